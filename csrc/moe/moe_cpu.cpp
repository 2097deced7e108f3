// CPU reference of the mixture-of-experts family.
#include "common/cpu_common.h"
#include "moe/moe_impl.h"

namespace fusebox::cpu {

void moe_combine_cpu(const CombinePlan& p) {
  const TensorView &rows = *p.rows, &index = *p.index, &weights = *p.weights, &out = *p.out;
  for (int64_t n = 0; n < p.tokens; ++n) {
    for (int64_t d = 0; d < p.width; ++d) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.top_k; ++k) {
        const int64_t at = n * index.strides[0] + k * index.strides[1];
        const int64_t r = index.dtype == DType::kInt64 ? static_cast<const int64_t*>(index.data)[at]
                                                       : static_cast<const int32_t*>(index.data)[at];
        FUSEBOX_CHECK(r >= 0 && r < p.num_rows, "index[", n, ", ", k, "] = ", r, " is outside rows' ",
                      p.num_rows, " rows");
        const float w = load(weights.data, weights.dtype, n * weights.strides[0] + k * weights.strides[1]);
        float product = w * load(rows.data, rows.dtype, r * rows.strides[0] + d);
        if (weights.dtype != DType::kFloat32) product = round_to(rows.dtype, product);
        acc += product;
      }
      store(out.data, out.dtype, n * out.strides[0] + d, acc);
    }
  }
}

}  // namespace fusebox::cpu
