// Entry point of the norm family: checks every operand, merges row layouts, picks the
// vector width and hands off to the CPU reference or the CUDA kernel.
#include <cmath>
#include <string>
#include <utility>

#include "common/layout.h"
#include "norm/norm_impl.h"

namespace fusebox {

using detail::check_param_dtype;
using detail::check_same_shape;
using detail::check_unit_last_stride;

namespace {

void check_row_operand(const TensorView& t, const char* name, const TensorView& x, bool param) {
  if (!t.defined()) return;
  check_same_shape(t, name, x, "x");
  check_unit_last_stride(t, name);
  if (param)
    check_param_dtype(t, name, x.dtype);
  else
    detail::check_dtype_is(t, name, x.dtype, "the dtype of x");
}

// Split modulation (see NormArgs): a table for every present term or for none; the tables are
// [D] vectors, the terms then x's dtype.
void check_split_modulation(const NormArgs& a, int64_t width) {
  const std::pair<const TensorView*, const TensorView*> parts[] = {
      {&a.gate, &a.gate_table}, {&a.scale, &a.scale_table}, {&a.shift, &a.shift_table}};
  const char* names[] = {"gate", "scale", "shift"};
  bool any_table = false;
  for (const auto& [term, table] : parts) any_table |= table->defined();
  if (!any_table) return;
  for (int i = 0; i < 3; ++i) {
    const TensorView& term = *parts[i].first;
    const TensorView& table = *parts[i].second;
    const std::string table_name = std::string(names[i]) + "_table";
    FUSEBOX_CHECK(term.defined() || !table.defined(), table_name, " needs ", names[i], " (",
                  names[i], " = ", table_name, " + ", names[i], ")");
    if (!term.defined()) continue;
    FUSEBOX_CHECK(table.defined(), names[i], " needs ", table_name,
                  ": with split modulation every present term has its table");
    detail::check_vector(table, table_name.c_str(), width, "x's last dimension", a.x.dtype);
    detail::check_dtype_is(term, names[i], a.x.dtype, "x's dtype (with its table it is the per-row part)");
  }
}

}  // namespace

void norm(const NormArgs& a, cudaStream_t stream) {
  FUSEBOX_CHECK(a.x.defined() && a.x.ndim >= 1, "x must be a tensor of at least 1 dimension");
  detail::check_floating(a.x, "x");
  check_unit_last_stride(a.x, "x");
  const int64_t width = a.x.shape[a.x.ndim - 1];
  FUSEBOX_CHECK(width < (int64_t(1) << 31), "x's last dimension must be < 2^31; got ", width);
  FUSEBOX_CHECK(std::isfinite(a.eps) && a.eps >= 0.f, "eps must be finite and >= 0; got ", a.eps);

  const bool normalizes = a.norm != NormType::kNone;
  if (normalizes) {
    FUSEBOX_CHECK(a.out.defined(), "out is required");
    check_same_shape(a.out, "out", a.x, "x");
    check_unit_last_stride(a.out, "out");
    FUSEBOX_CHECK(a.out.dtype == a.x.dtype || a.out.dtype == DType::kFloat32,
                  "out must be ", dtype_name(a.x.dtype), " (x's dtype) or float32; got ",
                  dtype_name(a.out.dtype));
  } else {
    FUSEBOX_CHECK(a.branch.defined(), a.branch_name, " is required when norm is none");
    FUSEBOX_CHECK(!a.out.defined() && !a.weight.defined() && !a.bias.defined() &&
                      !a.scale.defined() && !a.shift.defined(),
                  "out, weight, bias, scale and shift must be absent when norm is none");
  }
  check_row_operand(a.branch, a.branch_name, a.x, false);
  if (a.branch.defined()) {
    FUSEBOX_CHECK(a.residual_out.defined(), "residual_out is required when ", a.branch_name, " is given");
  } else {
    FUSEBOX_CHECK(!a.gate.defined(), "gate needs ", a.branch_name, " (h = x + gate * ", a.branch_name, ")");
    FUSEBOX_CHECK(!a.residual_out.defined(), "residual_out is only written when branch is given");
  }
  check_row_operand(a.residual_out, "residual_out", a.x, false);
  check_row_operand(a.gate, "gate", a.x, true);
  check_row_operand(a.scale, "scale", a.x, true);
  check_row_operand(a.shift, a.shift_name, a.x, true);
  if (a.weight.defined()) detail::check_vector(a.weight, "weight", width, "x's last dimension", a.x.dtype);
  if (a.bias.defined()) detail::check_vector(a.bias, "bias", width, "x's last dimension", a.x.dtype);
  check_split_modulation(a, width);
  detail::check_same_device({{&a.x, "x"}, {&a.branch, a.branch_name}, {&a.gate, "gate"},
                             {&a.weight, "weight"}, {&a.bias, "bias"}, {&a.scale, "scale"},
                             {&a.shift, a.shift_name}, {&a.gate_table, "gate_table"},
                             {&a.scale_table, "scale_table"}, {&a.shift_table, "shift_table"},
                             {&a.out, "out"}, {&a.residual_out, "residual_out"}});

  const TensorView* rows[] = {&a.x, &a.branch, &a.gate, &a.scale, &a.shift, &a.out, &a.residual_out};
  detail::RowStrides rs[7];
  const detail::RowLayout layout = detail::merge_rows(a.x, rows, 7, rs);
  const NormStrides strides{rs[0], rs[1], rs[2], rs[3], rs[4], rs[5], rs[6]};

  if (a.x.device == Device::kCPU) {
    cpu::norm_cpu(a, layout, strides);
    return;
  }
  const TensorView* all[] = {&a.x, &a.branch, &a.gate, &a.scale, &a.shift, &a.out, &a.residual_out,
                             &a.weight, &a.bias, &a.gate_table, &a.scale_table, &a.shift_table};
  detail::RowStrides all_strides[12] = {rs[0], rs[1], rs[2], rs[3], rs[4], rs[5], rs[6]};
  const int vec = detail::pick_vector_width(a.x.dtype, width, all, 12, all_strides);
  cuda::norm_cuda(a, layout, strides, vec, stream);
}

namespace {

// The RMS norm of x into out, weighted: what the convenience forms below add operands to.
NormArgs rms_args(const TensorView& x, const TensorView& weight, const TensorView& out, float eps,
                  float weight_offset) {
  NormArgs a;
  a.x = x;
  a.weight = weight;
  a.out = out;
  a.norm = NormType::kRMS;
  a.eps = eps;
  a.weight_offset = weight_offset;
  return a;
}

}  // namespace

void rms_norm(const TensorView& x, const TensorView& weight, const TensorView& out, float eps,
              float weight_offset, cudaStream_t stream) {
  norm(rms_args(x, weight, out, eps, weight_offset), stream);
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        const TensorView& out, const TensorView& residual_out, float eps,
                        float weight_offset, cudaStream_t stream) {
  NormArgs a = rms_args(x, weight, out, eps, weight_offset);
  a.branch = residual;           // h = x + residual, normalized
  a.residual_out = residual_out;
  a.branch_name = "residual";
  norm(a, stream);
}

void rms_norm_add(const TensorView& x, const TensorView& residual, const TensorView& weight,
                  const TensorView& out, float eps, float weight_offset, cudaStream_t stream) {
  NormArgs a = rms_args(x, weight, out, eps, weight_offset);
  a.shift = residual;            // out = rms_norm(x) + residual
  a.shift_name = "residual";
  norm(a, stream);
}

void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias,
                const TensorView& out, float eps, cudaStream_t stream) {
  NormArgs a;
  a.x = x;
  a.weight = weight;
  a.bias = bias;
  a.out = out;
  a.norm = NormType::kLayer;
  a.eps = eps;
  norm(a, stream);
}

}  // namespace fusebox
