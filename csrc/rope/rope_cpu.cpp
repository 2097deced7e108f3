// CPU reference of the rotary family: stage one token's q and k rows, normalize, rotate.
#include <cmath>
#include <vector>

#include "common/cpu_common.h"
#include "rope/rope_impl.h"

namespace fusebox::cpu {

namespace {

// Rotates (and optionally normalizes) one tensor's heads at token (b, s).
void rotate_token(const RopeArgs& a, const RopeShape& sh, const TensorView& in, const TensorView& out,
                  const TensorView& weight, int64_t heads, int64_t b, int64_t s,
                  const std::vector<float>& cs, const std::vector<float>& sn) {
  const int64_t D = sh.D, R = sh.R;
  const bool interleaved = a.style == RopeStyle::kInterleaved;
  std::vector<float> x(size_t(heads * D));
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d)
      x[size_t(h * D + d)] = load(in.data, in.dtype, b * in.strides[0] + s * in.strides[1] + h * in.strides[2] + d);

  std::vector<float> rstd(size_t(heads), 1.f);
  if (a.norm == NormType::kRMS) {
    const int64_t group = a.norm_across_heads ? heads * D : D;
    for (int64_t g0 = 0; g0 < heads * D; g0 += group) {
      double sq = 0.0;
      for (int64_t i = g0; i < g0 + group; ++i) sq += double(x[size_t(i)]) * x[size_t(i)];
      const float r = float(1.0 / std::sqrt(sq / double(group) + double(a.eps)));
      for (int64_t h = g0 / D; h < (g0 + group) / D; ++h) rstd[size_t(h)] = r;
    }
  }
  auto normed = [&](int64_t h, int64_t d) {
    float v = x[size_t(h * D + d)];
    if (a.norm == NormType::kNone) return v;
    v *= rstd[size_t(h)];
    if (weight.defined()) v *= a.weight_offset + load(weight.data, weight.dtype, a.norm_across_heads ? h * D + d : d);
    return v;
  };
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d) {
      float v = normed(h, d);
      if (d < R) {
        bool first;
        const int64_t p = rope_partner(d, R, interleaved, first);
        const float pv = normed(h, p);
        v = first ? v * cs[size_t(d)] - pv * sn[size_t(d)] : v * cs[size_t(d)] + pv * sn[size_t(d)];
      }
      store(out.data, out.dtype, b * out.strides[0] + s * out.strides[1] + h * out.strides[2] + d, v);
    }
}

}  // namespace

void rope_cpu(const RopeArgs& a, const RopeShape& sh) {
  std::vector<float> cs(size_t(sh.R)), sn(size_t(sh.R));
  const bool interleaved = a.style == RopeStyle::kInterleaved;
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t s = 0; s < sh.S; ++s) {
      for (int64_t r = 0; r < sh.R; ++r) {
        if (a.use_grid) {
          const double angle = rope_grid_reduce(double(rope_grid_position(a.grid, s, r, sh.R, interleaved)) *
                                                rope_grid_inv_freq(a.grid, r, sh.R, interleaved));
          cs[size_t(r)] = float(std::cos(angle));
          sn[size_t(r)] = float(std::sin(angle));
        } else {
          cs[size_t(r)] = load(a.cos.data, a.cos.dtype, b * a.cos.strides[0] + s * a.cos.strides[1] + r);
          sn[size_t(r)] = load(a.sin.data, a.sin.dtype, b * a.sin.strides[0] + s * a.sin.strides[1] + r);
        }
      }
      rotate_token(a, sh, a.q, a.q_out, a.q_weight, sh.Hq, b, s, cs, sn);
      if (a.k.defined()) rotate_token(a, sh, a.k, a.k_out, a.k_weight, sh.Hk, b, s, cs, sn);
    }
}

}  // namespace fusebox::cpu
