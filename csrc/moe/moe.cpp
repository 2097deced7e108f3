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

void moe_topk_softmax(const TensorView& logits, bool renormalize, float scale, const TensorView& weights,
                      const TensorView& index, cudaStream_t stream) {
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
  detail::check_same_device({{&logits, "logits"}, {&weights, "weights"}, {&index, "index"}});
  const int64_t num_experts = logits.shape[1], top_k = index.shape[1];
  FUSEBOX_CHECK(num_experts <= 1024, "logits may have at most 1024 experts (a warp holds a token's); got ",
                num_experts);
  FUSEBOX_CHECK(top_k <= num_experts && top_k <= 32, "top_k (index's columns) must be at most the ",
                num_experts, " experts and at most 32; got ", top_k);
  const TopkPlan p{&logits, &weights, &index, logits.shape[0], num_experts, top_k, renormalize, scale};
  if (p.tokens == 0 || top_k == 0) return;
  if (logits.device == Device::kCPU) {
    cpu::moe_topk_softmax_cpu(p);
    return;
  }
  cuda::moe_topk_softmax_cuda(p, stream);
}

void moe_sort(const TensorView& index, int64_t num_experts, const TensorView& row_token,
              const TensorView& offsets, const TensorView& pair_row, cudaStream_t stream) {
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
  const SortPlan p{&index, &row_token, &offsets, &pair_row, tokens, top_k, num_experts};
  if (index.device == Device::kCPU) {
    cpu::moe_sort_cpu(p);
    return;
  }
  cuda::moe_sort_cuda(p, stream);
}

}  // namespace fusebox
