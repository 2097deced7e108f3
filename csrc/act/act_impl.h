// Internal interface between the activation entry points and their backends.
#pragma once

#include <cmath>

#include "common/layout.h"
#include "common/host_device.h"
#include "fusebox/ops.h"

namespace fusebox {

FUSEBOX_HD float apply_activation(Activation act, float x) {
  switch (act) {
    case Activation::kSiLU: return x / (1.f + expf(-x));
    case Activation::kGeluTanh: {
      const float k = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    case Activation::kGelu: return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
  }
  return x;
}

// One pass over rows: out = act(a + bias) * b, where b (gated forms) and bias are optional.
struct ActPlan {
  const TensorView* a;
  const TensorView* b;  // may be undefined
  const TensorView* bias;
  const TensorView* out;
  Activation act;
  detail::RowLayout layout;
  detail::RowStrides sa, sb, sout;
};

namespace cuda {
void activation_cuda(const ActPlan& plan, int vec, cudaStream_t stream);
}
namespace cpu {
void activation_cpu(const ActPlan& plan);
}

}  // namespace fusebox
