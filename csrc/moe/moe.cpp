// Entry points of the mixture-of-experts family.
#include "moe/moe_impl.h"

namespace fusebox {

void moe_combine(const TensorView& rows, const TensorView& index, const TensorView& weights,
                 const TensorView& out, cudaStream_t stream) {
  FUSEBOX_CHECK(rows.defined() && rows.ndim == 2, "rows must be a 2-D tensor [rows, hidden]; got shape ",
                rows.shape_str());
  detail::check_floating(rows, "rows");
  detail::check_unit_last_stride(rows, "rows");
  FUSEBOX_CHECK(index.defined() && index.ndim == 2, "index must be a 2-D tensor [tokens, top_k]; got shape ",
                index.shape_str());
  FUSEBOX_CHECK(index.dtype == DType::kInt32 || index.dtype == DType::kInt64,
                "index must be int32 or int64; got ", dtype_name(index.dtype));
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

}  // namespace fusebox
