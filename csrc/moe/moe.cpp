// Entry points of the mixture-of-experts family.
#include "moe/moe_impl.h"

namespace fusebox {
namespace {

void check_index(const TensorView& index, const char* name) {
  FUSEBOX_CHECK(index.defined() && index.ndim == 2, name, " must be a 2-D tensor [tokens, top_k]; got shape ",
                index.shape_str());
  FUSEBOX_CHECK(index.dtype == DType::kInt32 || index.dtype == DType::kInt64, name,
                " must be int32 or int64; got ", dtype_name(index.dtype));
}

}  // namespace

void moe_combine(const TensorView& rows, const TensorView& index, const TensorView& weights,
                 const TensorView& out, cudaStream_t stream) {
  FUSEBOX_CHECK(rows.defined() && rows.ndim == 2, "rows must be a 2-D tensor [rows, hidden]; got shape ",
                rows.shape_str());
  detail::check_floating(rows, "rows");
  detail::check_unit_last_stride(rows, "rows");
  check_index(index, "index");
  FUSEBOX_CHECK(weights.defined(), "weights is required");
  detail::check_same_shape(weights, "weights", index, "index");
  detail::check_param_dtype(weights, "weights", rows.dtype);
  FUSEBOX_CHECK(out.defined() && out.ndim == 2 && out.shape[0] == index.shape[0] && out.shape[1] == rows.shape[1],
                "out must have the shape [index's rows, rows' width] = [", index.shape[0], ", ", rows.shape[1],
                "]; got ", out.shape_str());
  detail::check_dtype_is(out, "out", rows.dtype, "the dtype of rows");
  detail::check_unit_last_stride(out, "out");
  detail::check_same_device({{&rows, "rows"}, {&index, "index"}, {&weights, "weights"}, {&out, "out"}});
  const int64_t width = rows.shape[1];
  FUSEBOX_CHECK(width < (int64_t(1) << 31), "rows' width must be < 2^31; got ", width);
  CombinePlan p{&rows, &index, &weights, &out, index.shape[0], index.shape[1], rows.shape[0], width};
  if (p.tokens == 0 || width == 0) return;
  if (rows.device == Device::kCPU) {
    cpu::moe_combine_cpu(p);
    return;
  }
  // Row strides enter the vector width as the third row dimension of pick_vector_width.
  const TensorView* operands[] = {&rows, &out};
  detail::RowStrides strides[2];
  strides[0].s[2] = rows.strides[0];
  strides[1].s[2] = out.strides[0];
  const int vec = detail::pick_vector_width(rows.dtype, width, operands, 2, strides);
  cuda::moe_combine_cuda(p, vec, stream);
}

void moe_topk(const RouterArgs& a, cudaStream_t stream) {
  const TensorView &logits = a.logits, &weights = a.weights, &index = a.index;
  FUSEBOX_CHECK(logits.defined() && logits.ndim == 2, "logits must be a 2-D tensor [tokens, experts]; got shape ",
                logits.shape_str());
  detail::check_floating(logits, "logits");
  detail::check_unit_last_stride(logits, "logits");
  check_index(index, "index");
  FUSEBOX_CHECK(index.shape[0] == logits.shape[0], "index must have logits' ", logits.shape[0],
                " rows; got shape ", index.shape_str());
  FUSEBOX_CHECK(weights.defined(), "weights is required");
  detail::check_same_shape(weights, "weights", index, "index");
  detail::check_param_dtype(weights, "weights", logits.dtype);
  const int64_t num_experts = logits.shape[1], top_k = index.shape[1];
  FUSEBOX_CHECK(num_experts <= 1024, "logits may have at most 1024 experts (a warp holds a token's); got ",
                num_experts);
  FUSEBOX_CHECK(top_k <= num_experts && top_k <= 32, "top_k (index's columns) must be at most the ",
                num_experts, " experts and at most 32; got ", top_k);
  if (a.bias.defined()) {
    FUSEBOX_CHECK(a.bias.ndim == 1 && a.bias.shape[0] == num_experts, "bias must be a 1-D tensor of the ",
                  num_experts, " experts; got shape ", a.bias.shape_str());
    detail::check_floating(a.bias, "bias");
  }
  FUSEBOX_CHECK(a.num_groups >= 1 && a.num_groups <= 32 && num_experts % a.num_groups == 0,
                "num_groups must divide the ", num_experts, " experts and be 1-32; got ", a.num_groups);
  const int64_t group_size = num_experts / a.num_groups;
  FUSEBOX_CHECK(a.topk_groups >= 1 && a.topk_groups <= a.num_groups, "topk_groups must be 1-num_groups (",
                a.num_groups, "); got ", a.topk_groups);
  FUSEBOX_CHECK(a.num_groups == 1 || (group_size >= 2 && a.topk_groups * group_size >= top_k),
                "the ", a.topk_groups, " chosen groups of ", group_size,
                " experts must hold top_k and groups at least 2 experts; got top_k ", top_k);
  detail::check_same_device({{&logits, "logits"}, {&a.bias, "bias"}, {&weights, "weights"}, {&index, "index"}});
  const TopkPlan p{&a, logits.shape[0], num_experts, top_k, group_size};
  if (p.tokens == 0 || top_k == 0) return;
  if (logits.device == Device::kCPU) {
    cpu::moe_topk_cpu(p);
    return;
  }
  cuda::moe_topk_cuda(p, stream);
}

int64_t moe_sort_workspace_size(int64_t tokens, int64_t top_k, int64_t num_experts, bool for_current_device) {
  FUSEBOX_CHECK(tokens >= 0 && top_k >= 0, "tokens and top_k must be non-negative; got ", tokens, " and ", top_k);
  FUSEBOX_CHECK(num_experts >= 1, "num_experts must be at least 1; got ", num_experts);
  return cuda::moe_sort_workspace_size(tokens, top_k, num_experts, for_current_device);
}

void moe_sort(const TensorView& index, int64_t num_experts, const TensorView& row_token,
              const TensorView& offsets, const TensorView& pair_row, cudaStream_t stream,
              const TensorView& workspace) {
  check_index(index, "index");
  FUSEBOX_CHECK(num_experts >= 1, "num_experts must be at least 1; got ", num_experts);
  const int64_t tokens = index.shape[0], top_k = index.shape[1], pairs = tokens * top_k;
  FUSEBOX_CHECK(pairs < (int64_t(1) << 30), "index must have fewer than 2^30 elements; got ", index.shape_str());
  FUSEBOX_CHECK(row_token.defined() && row_token.ndim == 1 && row_token.shape[0] == pairs,
                "row_token must be a 1-D tensor of index's ", pairs, " elements; got shape ", row_token.shape_str());
  FUSEBOX_CHECK(offsets.defined() && offsets.ndim == 1 && offsets.shape[0] == num_experts,
                "offsets must be a 1-D tensor of num_experts (", num_experts, ") elements; got shape ",
                offsets.shape_str());
  FUSEBOX_CHECK(pair_row.defined(), "pair_row is required");
  detail::check_same_shape(pair_row, "pair_row", index, "index");
  detail::check_dtype_is(row_token, "row_token", DType::kInt32, "the index type moe_sort writes");
  detail::check_dtype_is(offsets, "offsets", DType::kInt32, "the index type moe_sort writes");
  detail::check_dtype_is(pair_row, "pair_row", DType::kInt32, "the index type moe_sort writes");
  detail::check_same_device(
      {{&index, "index"}, {&row_token, "row_token"}, {&offsets, "offsets"}, {&pair_row, "pair_row"}});
  if (workspace.defined()) {
    FUSEBOX_CHECK(workspace.ndim == 1 && workspace.strides[0] == 1,
                  "workspace must be a contiguous 1-D tensor; got shape ", workspace.shape_str());
    detail::check_dtype_is(workspace, "workspace", DType::kInt32, "the counts moe_sort keeps");
    FUSEBOX_CHECK(reinterpret_cast<uintptr_t>(workspace.data) % 16 == 0,
                  "workspace must start at a 16-byte aligned address");
    detail::check_same_device({{&index, "index"}, {&workspace, "workspace"}});
  }
  const SortPlan p{&index, &row_token, &offsets, &pair_row, &workspace, tokens, top_k, num_experts};
  if (index.device == Device::kCPU) {
    cpu::moe_sort_cpu(p);
    return;
  }
  cuda::moe_sort_cuda(p, stream);
}

}  // namespace fusebox
