// Entry point of the rotary family: checks q/k/tables/weights and dispatches.
#include <algorithm>

#include "common/layout.h"
#include "rope/rope_impl.h"

namespace fusebox {

using detail::check_same_shape;
using detail::check_unit_last_stride;

namespace {

void check_qk(const TensorView& t, const char* name, const TensorView& q) {
  FUSEBOX_CHECK(t.ndim == 4, name, " must be 4-D [batch, seq, heads, head_dim]; got shape ",
                t.shape_str());
  check_unit_last_stride(t, name);
  FUSEBOX_CHECK(t.shape[0] == q.shape[0] && t.shape[1] == q.shape[1] && t.shape[3] == q.shape[3],
                name, " must match q in batch, sequence and head_dim (q is ", q.shape_str(),
                "); got ", t.shape_str());
  detail::check_dtype_is(t, name, q.dtype, "the dtype of q");
}

}  // namespace

void rope(const RopeArgs& a, cudaStream_t stream) {
  FUSEBOX_CHECK(a.q.defined(), "q is required");
  detail::check_floating(a.q, "q");
  check_qk(a.q, "q", a.q);
  RopeShape sh;
  sh.B = a.q.shape[0];
  sh.S = a.q.shape[1];
  sh.Hq = a.q.shape[2];
  sh.D = a.q.shape[3];
  FUSEBOX_CHECK(a.q_out.defined(), "q_out is required");
  check_same_shape(a.q_out, "q_out", a.q, "q");
  check_qk(a.q_out, "q_out", a.q);
  if (a.k.defined()) {
    check_qk(a.k, "k", a.q);
    FUSEBOX_CHECK(a.k_out.defined(), "k_out is required when k is given");
    check_same_shape(a.k_out, "k_out", a.k, "k");
    check_qk(a.k_out, "k_out", a.q);
    sh.Hk = a.k.shape[2];
  } else {
    FUSEBOX_CHECK(!a.k_out.defined(), "k_out given without k");
  }

  if (a.use_grid) {
    FUSEBOX_CHECK(!a.cos.defined() && !a.sin.defined(), "cos/sin must be absent when the 3-D grid is used");
    const Rope3DGrid& g = a.grid;
    FUSEBOX_CHECK(g.frames > 0 && g.height > 0 && g.width > 0,
                  "num_frames, height and width must be positive; got ", g.frames, ", ", g.height,
                  ", ", g.width);
    FUSEBOX_CHECK(g.frames * g.height * g.width == sh.S, "num_frames * height * width (", g.frames,
                  " * ", g.height, " * ", g.width, " = ", g.frames * g.height * g.width,
                  ") must equal q's sequence length ", sh.S);
    for (int i = 0; i < 3; ++i)
      FUSEBOX_CHECK(g.axes_dim[i] >= 0 && g.axes_dim[i] % 2 == 0,
                    "axes_dim entries must be even and >= 0; got axes_dim[", i, "] = ", g.axes_dim[i]);
    FUSEBOX_CHECK(std::isfinite(g.theta) && g.theta > 0.f, "theta must be positive; got ", g.theta);
    sh.R = g.axes_dim[0] + g.axes_dim[1] + g.axes_dim[2];
    FUSEBOX_CHECK(sh.R > 0 && sh.R <= sh.D, "axes_dim must sum to a positive rotary dimension of at most head_dim (",
                  sh.D, "); got ", g.axes_dim[0], " + ", g.axes_dim[1], " + ", g.axes_dim[2], " = ", sh.R);
    FUSEBOX_CHECK(sh.R <= kMaxGridRotaryDims, "axes_dim must sum to at most ", kMaxGridRotaryDims,
                  " rotary dimensions for the 3-D grid; got ", sh.R);
  } else {
    FUSEBOX_CHECK(a.cos.defined() && a.sin.defined(), "cos and sin are required");
    FUSEBOX_CHECK(a.cos.ndim == 3 && a.cos.shape[0] == sh.B && a.cos.shape[1] == sh.S,
                  "cos must be [batch, seq, rotary_dim] = [", sh.B, ", ", sh.S,
                  ", R] (broadcast dims with stride 0); got ", a.cos.shape_str());
    check_same_shape(a.sin, "sin", a.cos, "cos");
    check_unit_last_stride(a.cos, "cos");
    check_unit_last_stride(a.sin, "sin");
    detail::check_param_dtype(a.cos, "cos", a.q.dtype);
    detail::check_param_dtype(a.sin, "sin", a.q.dtype);
    FUSEBOX_CHECK(a.sin.dtype == a.cos.dtype, "sin must have the dtype of cos (", dtype_name(a.cos.dtype), "); got ",
                  dtype_name(a.sin.dtype));
    sh.R = a.cos.shape[2];
  }
  FUSEBOX_CHECK(sh.R > 0 && sh.R % 2 == 0 && sh.R <= sh.D, "the rotary dimension (", sh.R,
                ") must be even, positive and at most head_dim (", sh.D, ")");

  if (a.norm != NormType::kNone) {
    FUSEBOX_CHECK(a.norm == NormType::kRMS, "only RMS normalization is fused with rotary embedding");
    FUSEBOX_CHECK(std::isfinite(a.eps) && a.eps >= 0.f, "eps must be finite and >= 0; got ", a.eps);
    const char* what = a.norm_across_heads ? "heads * head_dim" : "head_dim";
    if (a.q_weight.defined())
      detail::check_vector(a.q_weight, "q_weight", a.norm_across_heads ? sh.Hq * sh.D : sh.D, what, a.q.dtype);
    if (a.k_weight.defined()) {
      FUSEBOX_CHECK(a.k.defined(), "k_weight given without k");
      detail::check_vector(a.k_weight, "k_weight", a.norm_across_heads ? sh.Hk * sh.D : sh.D, what, a.q.dtype);
    }
  } else {
    FUSEBOX_CHECK(!a.q_weight.defined() && !a.k_weight.defined(),
                  "q_weight/k_weight are only used with normalization");
  }
  detail::check_same_device({{&a.q, "q"}, {&a.k, "k"}, {&a.q_out, "q_out"}, {&a.k_out, "k_out"},
                             {&a.cos, "cos"}, {&a.sin, "sin"}, {&a.q_weight, "q_weight"},
                             {&a.k_weight, "k_weight"}});

  if (sh.B * sh.S == 0 || sh.D == 0 || sh.Hq == 0) return;
  if (a.q.device == Device::kCPU) {
    cpu::rope_cpu(a, sh);
    return;
  }
  // Vector width: divides head_dim, every head/seq/batch stride of q/k and of the tables, and
  // aligns every pointer (tables and weights are read in vectors too).
  const TensorView* views[] = {&a.q, &a.k, &a.q_out, &a.k_out, &a.cos, &a.sin, &a.q_weight, &a.k_weight};
  int vec = int(16 / dtype_size(a.q.dtype));
  auto fits = [&](int v) {
    if (sh.D % v) return false;
    for (const TensorView* t : views) {
      if (!t->defined()) continue;
      const size_t bytes = std::min<size_t>(16, size_t(v) * dtype_size(t->dtype));
      if (reinterpret_cast<uintptr_t>(t->data) % bytes) return false;
      for (int d = 0; d + 1 < t->ndim; ++d)
        if (t->strides[d] % v) return false;
    }
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  cuda::rope_cuda(a, sh, vec, stream);
}

}  // namespace fusebox
