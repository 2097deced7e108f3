// Internal interface between the mixture-of-experts entry points and their backends.
#pragma once

#include "common/layout.h"
#include "fusebox/ops.h"

namespace fusebox {

// out[n] = sum_k weights[n, k] * rows[index[n, k]]; validated views, strides in elements.
struct CombinePlan {
  const TensorView* rows;
  const TensorView* index;
  const TensorView* weights;
  const TensorView* out;
  int64_t tokens, top_k, num_rows, width;
};

// A router's top-k (see moe_topk); validated views.
struct TopkPlan {
  const RouterArgs* args;
  int64_t tokens, num_experts, top_k, group_size;
};

// The (token, k) pairs of index sorted by expert (see moe_sort); validated views.
struct SortPlan {
  const TensorView* index;
  const TensorView* row_token;
  const TensorView* offsets;
  const TensorView* pair_row;
  const TensorView* workspace;  // int32, or undefined (one block sorts)
  int64_t tokens, top_k, num_experts;
};

namespace cuda {
void moe_combine_cuda(const CombinePlan& plan, int vec, cudaStream_t stream);
void moe_sort_cuda(const SortPlan& plan, cudaStream_t stream);
int64_t moe_sort_workspace_size(int64_t tokens, int64_t top_k, int64_t num_experts, bool for_current_device);
void moe_topk_cuda(const TopkPlan& plan, cudaStream_t stream);
}
namespace cpu {
void moe_combine_cpu(const CombinePlan& plan);
void moe_sort_cpu(const SortPlan& plan);
void moe_topk_cpu(const TopkPlan& plan);
}

}  // namespace fusebox
