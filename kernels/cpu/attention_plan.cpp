// A step's attention work list, built once per step and shared by every layer.
//
// Work items are (request, KV head, query rows, key range): all query heads of a KV head go
// together, so each K/V row is read once per item; a decode's item takes every KV head of its
// token at once, reading whole cache rows front to back. A prefill chunk is cut into tiles of
// kPrefillTile query tokens, each attending to keys 0 .. its last position (causal). A decode
// attends to its whole context, cut into splits of `split` keys when the step's decode work is
// large next to one thread's share (flash-decoding): split items leave fp32 partials (acc, max,
// sum) that a merge pass combines. Items are then ordered by estimated cost, largest first:
// the threads take them in that order as each frees up (attention.cpp), so one long context
// among short ones does not leave a thread idle at the end.
// With a sliding window (layers that have one get a plan of their own) key ranges start at the
// first key the item's first query still sees: a decode reads and splits only its window.
// With batch_invariant (--batch-invariant), a token's result must not depend on its batchmates
// or its chunk: decode splits (sized by the step's decode work) would change its sums' order,
// and a decode item runs another kernel than a prefill tile (a prompt chunk of one token would
// be a "decode"); so every query token goes into per-KV-head prefill tiles, never split.
#include "attention.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace mesh_cpu {

namespace {

constexpr int kMinSplit = 128;     // keys: never split a decode finer than this
constexpr int kItemsPerThread = 8; // aim for this many decode splits per thread

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_plan(
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_kv_heads,
    int64_t group, int64_t head_dim, int64_t sliding_window, bool batch_invariant) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window: 0 = none");
  // The first key a query at `pos` sees.
  auto first_key = [&](int pos) {
    return sliding_window > 0 ? static_cast<int>(std::max<int64_t>(0, pos - sliding_window + 1))
                              : 0;
  };
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous());
  const int num_reqs = static_cast<int>(seq_lens.numel());
  TORCH_CHECK(query_start_loc.numel() == num_reqs + 1, "query_start_loc needs num_reqs + 1");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int num_parts = std::max(1, at::get_num_threads());

  int64_t decode_keys = 0;
  for (int r = 0; r < num_reqs; ++r) {
    if (qsl[r + 1] - qsl[r] == 1) decode_keys += lens[r] - first_key(lens[r] - 1);
  }
  int64_t split = std::numeric_limits<int32_t>::max();
  if (num_parts > 1 && !batch_invariant) {
    split = std::max<int64_t>(
        kMinSplit, round_up(decode_keys / (kItemsPerThread * num_parts) + 1, kVec));
  }

  std::vector<int32_t> items, merges;
  std::vector<int64_t> costs;
  int32_t num_partials = 0;
  auto add = [&](int r, int h, int q0, int q1, int kv0, int kv1, int part, int pos0) {
    items.insert(items.end(), {r, h, q0, q1, kv0, kv1, part, pos0});
    const int64_t heads = h == kAllKvHeads ? num_kv_heads : 1;
    costs.push_back(static_cast<int64_t>(kv1 - kv0) * heads * (4 + (q1 - q0) * group));
  };
  for (int r = 0; r < num_reqs; ++r) {
    const int q_begin = qsl[r], q_len = qsl[r + 1] - qsl[r], seq_len = lens[r];
    TORCH_CHECK(q_len <= seq_len, "request ", r, " has more query tokens than its seq_len");
    if (q_len == 0) continue;
    const int first_pos = seq_len - q_len;  // position of the chunk's first query token
    if (q_len == 1 && !batch_invariant) {
      const int lo = first_key(first_pos);
      const int num_splits = static_cast<int>((seq_len - lo + split - 1) / split);
      if (num_splits <= 1) {
        add(r, kAllKvHeads, q_begin, q_begin + 1, lo, seq_len, -1, first_pos);
        continue;
      }
      for (int h = 0; h < num_kv_heads; ++h) {
        merges.insert(merges.end(), {q_begin, h, num_partials, num_splits});
      }
      for (int s = 0; s < num_splits; ++s) {
        const int kv0 = static_cast<int>(lo + s * split);
        const int kv1 = static_cast<int>(std::min<int64_t>(seq_len, kv0 + split));
        add(r, kAllKvHeads, q_begin, q_begin + 1, kv0, kv1, num_partials++, first_pos);
      }
      continue;
    }
    for (int h = 0; h < num_kv_heads; ++h) {
      for (int t0 = 0; t0 < q_len; t0 += kPrefillTile) {
        const int t1 = std::min(q_len, t0 + kPrefillTile);
        add(r, h, q_begin + t0, q_begin + t1, first_key(first_pos + t0), first_pos + t1, -1,
            first_pos + t0);
      }
    }
  }

  // Largest first (ties in plan order): an item left for the end is a short one.
  std::vector<int32_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return costs[x] > costs[y]; });
  std::vector<int32_t> sorted(items.size());
  for (size_t i = 0; i < order.size(); ++i) {
    std::copy_n(items.begin() + order[i] * kItemFields, kItemFields,
                sorted.begin() + i * kItemFields);
  }

  auto int_tensor = [](const std::vector<int32_t>& v, int64_t cols) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size()) / cols, cols},
                             at::TensorOptions().dtype(at::kInt));
    std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
    return t;
  };
  at::Tensor partials = at::empty({num_partials * num_kv_heads, group, head_dim + 2},
                                  at::TensorOptions().dtype(at::kFloat));
  return {int_tensor(sorted, kItemFields), int_tensor(merges, 4), partials};
}

}  // namespace mesh_cpu
