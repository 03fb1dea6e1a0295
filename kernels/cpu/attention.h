// What attention_plan.cpp and attention.cpp share: the layout of a work item.
#pragma once

#include "cpu_common.h"
#include "ops.h"

namespace mesh_cpu {

// One work item, int32 x kItemFields: request, KV head, query tokens [q_begin, q_end), keys
// [kv_begin, kv_end), partial slot (-1: write the output directly), position of q_begin.
// Query token q_begin + i sits at position pos0 + i and sees keys 0 .. pos0 + i.
constexpr int kPrefillTile = 16;  // query tokens per prefill item

enum ItemField { kReq, kKvHead, kQBegin, kQEnd, kKvBegin, kKvEnd, kPartial, kPos0, kItemFields };

}  // namespace mesh_cpu
