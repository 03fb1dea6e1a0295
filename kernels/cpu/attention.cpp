// Paged attention over the KV cache in place: no gather copy, no padding to the longest context.
//
// Each work item (attention_plan.cpp) holds R = query tokens x group rows: the query heads of
// one KV head, or for a decode item the query heads of every KV head (attention_decode.cpp).
// Here: prefill tiles. Keys are visited in chunks of kVec tokens; each chunk's K/V rows are
// found through the block table once (fp32 caches are read in place; bf16 / fp16 / fp8 rows
// are converted to fp32 once, into L1). Per chunk: scores, an online-softmax update (running
// max and sum per row, accumulators rescaled), then acc += p @ V. Scores come from one of two
// layouts:
// - few rows: S[row][key], keys in vector lanes: per row kVec dot-product vectors, summed by
//   one transpose tree (AVX-512; AVX2 sums each);
// - R a multiple of kVec: Q transposed once per item, S[key][row], rows in lanes, so each
//   score vector is D broadcast-FMAs with no horizontal sums.
// All math is fp32; the softmax uses Sleef's 1-ulp exp (torch's own). Where the CPU multiplies
// bf16 pairs (AMX or AVX512-BF16), bf16 prefill items run in bf16 products instead
// (attention_prefill_bf16.cpp).
// A sliding window (query at p sees keys p - window < j <= p): the plan starts each item's keys
// at the first one its first row sees (a plan made for that window; with another, the loop
// starts there anyway), later rows mask the keys before theirs. A soft-cap (Gemma 2) turns
// scores into cap * tanh(score / cap) before masking.
#include "attention_kernels.h"

#include <algorithm>
#include <atomic>

namespace mesh_cpu {

namespace {

using namespace attn;

// S[t][r] = q_r . k_t with rows in vector lanes (qt is Q transposed: [D][rows]); keys after
// pos[r] or at or before lo[r] masked, unless the whole chunk is visible to every row.
template <int NV>
void scores_cols(const float* qt, int rows, const float* const* krow, int c0, int min_pos,
                 int max_lo, const float* pos, const float* lo, float soft_cap, float* s) {
  constexpr int D = NV * kVec;
  for (int rv = 0; rv < rows; rv += kVec) {
    for (int t = 0; t < kVec; t += 4) {
      const float *k0 = krow[t], *k1 = krow[t + 1], *k2 = krow[t + 2], *k3 = krow[t + 3];
      fVec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int d = 0; d < D; ++d) {
        const fVec qv = fVec::loadu(qt + d * rows + rv);
        a0 = at::vec::fmadd(qv, fVec(k0[d]), a0);
        a1 = at::vec::fmadd(qv, fVec(k1[d]), a1);
        a2 = at::vec::fmadd(qv, fVec(k2[d]), a2);
        a3 = at::vec::fmadd(qv, fVec(k3[d]), a3);
      }
      a0.store(s + t * rows + rv);
      a1.store(s + (t + 1) * rows + rv);
      a2.store(s + (t + 2) * rows + rv);
      a3.store(s + (t + 3) * rows + rv);
    }
    if (soft_cap > 0.f) {
      const fVec inv(1.f / soft_cap), cap(soft_cap);
      for (int t = 0; t < kVec; ++t) {
        ((fVec::loadu(s + t * rows + rv) * inv).tanh() * cap).store(s + t * rows + rv);
      }
    }
    if (c0 + kVec - 1 <= min_pos && c0 > max_lo) continue;  // every row sees the whole chunk
    const fVec pv = fVec::loadu(pos + rv);
    const fVec lv = fVec::loadu(lo + rv);
    for (int t = 0; t < kVec; ++t) {
      const fVec sv = fVec::loadu(s + t * rows + rv);
      const fVec key(static_cast<float>(c0 + t));
      fVec::blendv(sv, fVec(kNegInf), (pv < key) | (lv >= key)).store(s + t * rows + rv);
    }
  }
}

void softmax_cols(float* s, int rows, Scratch& sc) {
  for (int rv = 0; rv < rows; rv += kVec) {
    fVec m_chunk(kNegInf);
    for (int t = 0; t < kVec; ++t) m_chunk = at::vec::maximum(m_chunk, fVec::loadu(s + t * rows + rv));
    const fVec m_old = fVec::loadu(sc.m.data() + rv);
    const fVec m_new = at::vec::maximum(m_old, m_chunk);
    fVec sum(0.f);
    // NOTE: a row may see no key of its first chunks (the window starts later for it): its
    // max stays -inf, and exp against 0 instead keeps its p, corr, l at 0 rather than NaN.
    const fVec m_safe = fVec::blendv(m_new, fVec(0.f), m_new == fVec(kNegInf));
    for (int t = 0; t < kVec; ++t) {
      const fVec p = (fVec::loadu(s + t * rows + rv) - m_safe).exp();
      p.store(s + t * rows + rv);
      sum = sum + p;
    }
    const fVec corr = (m_old - m_safe).exp();
    (fVec::loadu(sc.l.data() + rv) * corr + sum).store(sc.l.data() + rv);
    m_new.store(sc.m.data() + rv);
    corr.store(sc.corr.data() + rv);
  }
}

// A prefill item's accumulators (sc.acc, sc.m, sc.l) in fp32 FMAs.
template <int NV>
void accumulate_item(const Args& a, const int32_t* it, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int kv_head = it[kKvHead], q0 = it[kQBegin], G = a.group;
  const int kv0 = it[kKvBegin], kv1 = it[kKvEnd];
  const int rows = (it[kQEnd] - q0) * G;
  // Rows in lanes once they fill most of a vector (prefill tiles); padded rows are zero queries.
  // NOTE: the two ways sum in other orders, so --batch-invariant takes columns at any height.
  const bool by_cols = a.batch_invariant || rows > kVec / 2;
  const int rows_p = by_cols ? (rows + kVec - 1) / kVec * kVec : rows;
  // A row sees keys up to its own position, and none past this item's key range; none at or
  // before its position - window either (lo), so keys start at the first row's first one.
  const int min_pos = std::min(it[kPos0], kv1 - 1);
  const int max_lo = it[kPos0] + (rows - 1) / G - a.window;
  const int kv_first = std::max(kv0, it[kPos0] - a.window + 1);
  if (by_cols) std::fill(sc.q.begin(), sc.q.begin() + rows_p * D, 0.f);
  for (int r = 0; r < rows_p; ++r) {
    const int position = it[kPos0] + std::min(r, rows - 1) / G;
    sc.pos[r] = static_cast<float>(std::min(position, kv1 - 1));
    sc.lo[r] = static_cast<float>(position - a.window);
    if (r >= rows) continue;
    float* qr = sc.acc.data() + r * D;  // staging: acc is zeroed below
    load_row(a, q0 + r / G, kv_head * G + r % G, qr);
    if (by_cols) {
      for (int d = 0; d < D; ++d) sc.q[d * rows_p + r] = qr[d];
    } else {
      std::copy(qr, qr + D, sc.q.data() + r * D);
    }
  }
  start_rows(sc, rows, rows_p, D);
  const int32_t* bt = a.block_table + it[kReq] * a.bt_stride;
  const float* krow[kVec];
  const float* vrow[kVec];
  int64_t off[kVec];
  float* s = sc.s.data();
  for (int c0 = kv_first; c0 < kv1; c0 += kVec) {
    const int n = std::min(kVec, kv1 - c0);
    row_offsets(a, bt, c0, n, off);
    gather(a, off, kv_head, n, krow, vrow, sc);
    if (by_cols) {
      scores_cols<NV>(sc.q.data(), rows_p, krow, c0, min_pos, max_lo, sc.pos.data(),
                      sc.lo.data(), a.soft_cap, s);
      softmax_cols(s, rows_p, sc);
      accumulate_v<NV>(sc.acc.data(), rows, s, 1, rows_p, vrow, n, sc.corr.data());
    } else {
      scores_rows<NV>(sc.q.data(), rows, krow, n, c0, sc.pos.data(), sc.lo.data(), max_lo,
                      a.soft_cap, s, kVec);
      softmax_rows(s, kVec, kVec, 0, rows, sc);
      accumulate_v<NV>(sc.acc.data(), rows, s, kVec, 1, vrow, n, sc.corr.data());
    }
  }
}

template <int NV>
void run_item(const Args& a, const int32_t* it, Scratch& sc) {
  constexpr int D = NV * kVec;
  const int kv_head = it[kKvHead], q0 = it[kQBegin], G = a.group;
  const int rows = (it[kQEnd] - q0) * G;
  TORCH_CHECK(it[kReq] < a.bt_rows && it[kQEnd] <= a.num_tokens && rows > 0,
              "attention plan does not fit this step's tensors");
  if (prefill_in_bf16(a)) {
    run_prefill_item_bf16(a, it, sc);
  } else {
    accumulate_item<NV>(a, it, sc);
  }
  if (it[kPartial] < 0) {
    for (int r = 0; r < rows; ++r) {
      store_row(a, q0 + r / G, kv_head * G + r % G, sc.acc.data() + r * D,
                a.v_scale / sc.l[r]);
    }
    return;
  }
  float* part = a.partials + static_cast<int64_t>(it[kPartial]) * G * (D + 2);
  std::copy(sc.acc.begin(), sc.acc.begin() + G * D, part);
  std::copy(sc.m.begin(), sc.m.begin() + G, part + G * D);
  std::copy(sc.l.begin(), sc.l.begin() + G, part + G * D + G);
}

// Combines the splits of one decode row: out = sum_i acc_i e^(m_i - M) / sum_i l_i e^(m_i - M).
void merge(const Args& a, const int32_t* mg, Scratch& sc) {
  const int G = a.group, D = a.head_dim, num_splits = mg[3];
  const int64_t part_size = G * (D + 2);
  // Split i's partial of this KV head (mg[1]): see kAllKvHeads.
  auto partial = [&](int i) {
    return a.partials + (static_cast<int64_t>(mg[2] + i) * a.num_kv_heads + mg[1]) * part_size;
  };
  for (int g = 0; g < G; ++g) {
    float m_max = kNegInf, sum = 0.f;
    for (int i = 0; i < num_splits; ++i) m_max = std::max(m_max, partial(i)[G * D + g]);
    float* acc = sc.acc.data();
    std::fill(acc, acc + D, 0.f);
    for (int i = 0; i < num_splits; ++i) {
      const float* part = partial(i);
      const float w = std::exp(part[G * D + g] - m_max);
      sum += part[G * D + G + g] * w;
      for (int d = 0; d < D; d += kVec) {
        at::vec::fmadd(fVec::loadu(part + g * D + d), fVec(w), fVec::loadu(acc + d)).store(acc + d);
      }
    }
    store_row(a, mg[0], mg[1] * G + g, acc, a.v_scale / sum);
  }
}

// NOTE: items are taken by whichever thread is free, largest first (the plan's order), not
// cut into a fixed range per thread: a prompt tile on AMX and a memory-bound decode differ in
// speed per estimated cost, and a thread preempted by another process leaves its share to the
// other. A 128-token bf16 chunk beside 32 decodes: threads 460 / 320 us a layer with ranges,
// 404 / 402 taken this way (benchmarks.md 10k).
template <int NV>
void run_all(const Args& a, const at::Tensor& items, const at::Tensor& merges) {
  const int32_t* it = items.data_ptr<int32_t>();
  const int num_items = static_cast<int>(items.size(0));
  const int max_rows = std::max((a.group * kPrefillTile + kVec - 1) / kVec * kVec,
                                a.group * a.num_kv_heads);
  std::atomic<int> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(max_rows, a.head_dim);
    for (int i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const int32_t* item = it + i * kItemFields;
      if (item[kKvHead] == kAllKvHeads) {
        run_decode_item<NV>(a, item, sc);
      } else {
        run_item<NV>(a, item, sc);
      }
    }
  });
  const int32_t* mg = merges.data_ptr<int32_t>();
  at::parallel_for(0, merges.size(0), 16, [&](int64_t begin, int64_t end) {
    Scratch sc(1, a.head_dim);
    for (int64_t i = begin; i < end; ++i) merge(a, mg + i * 4, sc);
  });
}

}  // namespace

int64_t vec_size() { return kVec; }

bool supports_head_dim(int64_t head_dim) {
  if (head_dim % kVec != 0) return false;
  switch (head_dim / kVec) {
    case 1: case 2: case 4: case 5: case 6: case 8: case 16: return true;
    default: return false;
  }
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& items, const at::Tensor& merges,
                     at::Tensor& partials, double scale, double k_scale, double v_scale,
                     int64_t sliding_window, double soft_cap, bool batch_invariant) {
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0, "sliding_window and soft_cap: 0 = none");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, Hq, D] with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              key_cache.sizes() == value_cache.sizes(), "caches must be contiguous [N, bs, Hkv, D]");
  TORCH_CHECK(out.is_contiguous() && out.numel() == query.numel() &&
              out.scalar_type() == query.scalar_type(), "out must be contiguous like query");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1);
  TORCH_CHECK(items.is_contiguous() && merges.is_contiguous());
  const int head_dim = static_cast<int>(query.size(2));
  const int num_kv_heads = static_cast<int>(key_cache.size(2));
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % num_kv_heads == 0);
  TORCH_CHECK(supports_head_dim(head_dim), "no paged_attention kernel for head_dim ", head_dim);
  const bool same = key_cache.scalar_type() == query.scalar_type();
  TORCH_CHECK(same || key_cache.scalar_type() == at::kFloat8_e4m3fn, "cache dtype mismatch");
  const int group = static_cast<int>(query.size(1)) / num_kv_heads;
  TORCH_CHECK(partials.numel() == 0 || partials.size(1) == group, "partials planned for another group");
  Args a{static_cast<const char*>(query.data_ptr()), query.stride(0), query.scalar_type(),
         static_cast<char*>(out.data_ptr()), query.size(1) * head_dim,
         static_cast<const char*>(key_cache.data_ptr()),
         static_cast<const char*>(value_cache.data_ptr()), key_cache.scalar_type(),
         query.element_size(), key_cache.element_size(),
         block_table.data_ptr<int32_t>(), block_table.stride(0), block_table.size(0),
         block_table.size(1), query.size(0),
         num_kv_heads, group, head_dim, static_cast<int>(key_cache.size(1)), key_cache.size(0),
         static_cast<float>(scale * k_scale), static_cast<float>(v_scale),
         partials.numel() ? partials.data_ptr<float>() : nullptr,
         sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, kNoWindow))
                            : kNoWindow,
         static_cast<float>(soft_cap), batch_invariant};
  switch (head_dim / kVec) {
    case 1: return run_all<1>(a, items, merges);
    case 2: return run_all<2>(a, items, merges);
    case 4: return run_all<4>(a, items, merges);
    case 5: return run_all<5>(a, items, merges);
    case 6: return run_all<6>(a, items, merges);
    case 8: return run_all<8>(a, items, merges);
    default: return run_all<16>(a, items, merges);
  }
}

}  // namespace mesh_cpu
