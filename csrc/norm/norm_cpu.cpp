// CPU reference of the norm family: the same semantics as the CUDA kernel (fp32 math,
// residual rounded to x's dtype before it is normalized), with double-precision reductions.
#include <cmath>
#include <vector>

#include "common/cpu_common.h"
#include "norm/norm_impl.h"

namespace fusebox::cpu {
namespace {

// A modulation term at column d of a row: its per-row value plus, split, its table's (fp32 sum).
float term_at(const TensorView& term, const TensorView& table, int64_t row_off, int64_t d) {
  const float v = load(term.data, term.dtype, row_off + d);
  return table.defined() ? load(table.data, table.dtype, d) + v : v;
}

}  // namespace

void norm_cpu(const NormArgs& a, const detail::RowLayout& layout, const NormStrides& s) {
  const int64_t width = a.x.shape[a.x.ndim - 1];
  std::vector<float> h(size_t(width > 0 ? width : 0));
  for (int64_t row = 0; row < layout.rows; ++row) {
    const int64_t ox = row_offset(layout, s.x, row);
    for (int64_t d = 0; d < width; ++d) {
      float v = load(a.x.data, a.x.dtype, ox + d);
      if (a.branch.defined()) {
        float b = load(a.branch.data, a.branch.dtype, row_offset(layout, s.branch, row) + d);
        if (a.gate.defined()) b *= term_at(a.gate, a.gate_table, row_offset(layout, s.gate, row), d);
        v = round_to(a.x.dtype, v + b);
        store(a.residual_out.data, a.residual_out.dtype, row_offset(layout, s.residual_out, row) + d, v);
      }
      h[size_t(d)] = v;
    }
    if (a.norm == NormType::kNone) continue;

    double mean = 0.0, sq = 0.0;
    if (a.norm == NormType::kLayer) {
      for (int64_t d = 0; d < width; ++d) mean += h[size_t(d)];
      mean /= double(width);
      for (int64_t d = 0; d < width; ++d) sq += (h[size_t(d)] - mean) * (h[size_t(d)] - mean);
    } else {
      for (int64_t d = 0; d < width; ++d) sq += double(h[size_t(d)]) * h[size_t(d)];
    }
    const float rstd = float(1.0 / std::sqrt(sq / double(width) + double(a.eps)));
    const float fmean = float(mean);

    const int64_t oo = row_offset(layout, s.out, row);
    for (int64_t d = 0; d < width; ++d) {
      float y = (h[size_t(d)] - fmean) * rstd;
      if (a.weight.defined()) y *= a.weight_offset + load(a.weight.data, a.weight.dtype, d);
      if (a.bias.defined()) y += load(a.bias.data, a.bias.dtype, d);
      if (a.scale.defined()) y *= 1.f + term_at(a.scale, a.scale_table, row_offset(layout, s.scale, row), d);
      if (a.shift.defined()) y += term_at(a.shift, a.shift_table, row_offset(layout, s.shift, row), d);
      store(a.out.data, a.out.dtype, oo + d, y);
    }
  }
}

}  // namespace fusebox::cpu
