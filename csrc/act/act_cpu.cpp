// CPU reference of the activation family.
#include "act/act_impl.h"
#include "common/cpu_common.h"

namespace fusebox::cpu {

void activation_cpu(const ActPlan& p) {
  const int64_t width = p.a->shape[p.a->ndim - 1];
  for (int64_t row = 0; row < p.layout.rows; ++row) {
    const int64_t oa = row_offset(p.layout, p.sa, row);
    const int64_t ob = row_offset(p.layout, p.sb, row);
    const int64_t oo = row_offset(p.layout, p.sout, row);
    for (int64_t d = 0; d < width; ++d) {
      float v = load(p.a->data, p.a->dtype, oa + d);
      if (p.bias->defined()) v += load(p.bias->data, p.bias->dtype, d);
      v = apply_activation(p.act, v);
      if (p.b->defined()) v *= load(p.b->data, p.b->dtype, ob + d);
      store(p.out->data, p.out->dtype, oo + d, v);
    }
  }
}

}  // namespace fusebox::cpu
