// What attention_plan.cpp and the attention kernels (attention.cpp, attention_decode.cpp) share:
// the layout of a work item.
#pragma once

#include "cpu_common.h"
#include "ops.h"

namespace mesh_cpu {

// One work item, int32 x kItemFields: request, KV head, query tokens [q_begin, q_end), keys
// [kv_begin, kv_end), partial slot (-1: write the output directly), position of q_begin.
// Query token q_begin + i sits at position pos0 + i and sees keys 0 .. pos0 + i.
// A decode item has KV head kAllKvHeads: it covers every head of its one token, so it reads
// each K/V cache row whole (heads are adjacent in a row) rather than a head's slice of many.
// Its partial slot p keeps head h's partial result at index p * num_kv_heads + h.
constexpr int kPrefillTile = 16;  // query tokens per prefill item
constexpr int kAllKvHeads = -1;

enum ItemField { kReq, kKvHead, kQBegin, kQEnd, kKvBegin, kKvEnd, kPartial, kPos0, kItemFields };

}  // namespace mesh_cpu
