// Internal interface between the activation entry points and their backends.
#pragma once

#include <cmath>

#include "common/layout.h"
#include "common/host_device.h"
#include "fusebox/ops.h"

namespace fusebox {

// exp and division with the hardware approximations on the GPU (relative error ~2^-21, far
// under one fp32 rounding step of the results below) and the libm versions on the host.
FUSEBOX_HD float exp_fast(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}
FUSEBOX_HD float div_fast(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);  // 0 when |b| > 2^126: the limit of x * sigmoid(..) there
#else
  return a / b;
#endif
}

// The activation functions, written once for the CPU reference and the kernels.
// gelu_tanh uses the identity 0.5 * (1 + tanh(u)) = sigmoid(2u): one exp, no cancellation.
FUSEBOX_HD float apply_activation(Activation act, float x) {
  switch (act) {
    case Activation::kSiLU: return div_fast(x, 1.f + exp_fast(-x));
    case Activation::kGeluTanh: {
      const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2/pi) * (...)
      return div_fast(x, 1.f + exp_fast(-2.f * u));
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
