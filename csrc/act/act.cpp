// Entry points of the activation family.
#include "act/act_impl.h"

namespace fusebox {

namespace {

void run(ActPlan& p, cudaStream_t stream) {
  const TensorView& a = *p.a;
  FUSEBOX_CHECK(a.ndim >= 1, "input must have at least 1 dimension");
  const TensorView* rows[] = {p.a, p.b, p.out};
  detail::RowStrides rs[3];
  p.layout = detail::merge_rows(a, rows, 3, rs);
  p.sa = rs[0];
  p.sb = rs[1];
  p.sout = rs[2];
  if (a.device == Device::kCPU) {
    cpu::activation_cpu(p);
    return;
  }
  const TensorView* all[] = {p.a, p.b, p.out, p.bias};
  detail::RowStrides all_strides[4] = {rs[0], rs[1], rs[2], {}};
  const int vec = detail::pick_vector_width(a.dtype, a.shape[a.ndim - 1], all, 4, all_strides);
  cuda::activation_cuda(p, vec, stream);
}

}  // namespace

void gated_activation(const TensorView& gate, const TensorView& up, const TensorView& out,
                      Activation act, cudaStream_t stream) {
  FUSEBOX_CHECK(gate.defined() && gate.ndim >= 1, "gate must be a tensor of at least 1 dimension");
  detail::check_floating(gate, "gate");
  FUSEBOX_CHECK(up.defined(), "up is required");
  FUSEBOX_CHECK(out.defined(), "out is required");
  detail::check_same_shape(up, "up", gate, "gate");
  detail::check_same_shape(out, "out", gate, "gate");
  detail::check_dtype_is(up, "up", gate.dtype, "the dtype of gate");
  detail::check_dtype_is(out, "out", gate.dtype, "the dtype of gate");
  detail::check_unit_last_stride(gate, "gate");
  detail::check_unit_last_stride(up, "up");
  detail::check_unit_last_stride(out, "out");
  detail::check_same_device({{&gate, "gate"}, {&up, "up"}, {&out, "out"}});
  const TensorView none;
  ActPlan p{&gate, &up, &none, &out, act, {}, {}, {}, {}};
  run(p, stream);
}

void activation(const TensorView& x, const TensorView& bias, const TensorView& out, Activation act,
                cudaStream_t stream) {
  FUSEBOX_CHECK(x.defined() && x.ndim >= 1, "x must be a tensor of at least 1 dimension");
  detail::check_floating(x, "x");
  FUSEBOX_CHECK(out.defined(), "out is required");
  detail::check_same_shape(out, "out", x, "x");
  detail::check_dtype_is(out, "out", x.dtype, "the dtype of x");
  detail::check_unit_last_stride(x, "x");
  detail::check_unit_last_stride(out, "out");
  if (bias.defined()) detail::check_vector(bias, "bias", x.shape[x.ndim - 1], "x's last dimension", x.dtype);
  detail::check_same_device({{&x, "x"}, {&bias, "bias"}, {&out, "out"}});
  const TensorView none;
  ActPlan p{&x, &none, &bias, &out, act, {}, {}, {}, {}};
  run(p, stream);
}

}  // namespace fusebox
