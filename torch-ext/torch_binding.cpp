// PyTorch operators over the fusebox core: schemas, and one implementation per op that turns
// at::Tensor arguments into core views (no copies), allocates outputs and calls the core on
// the current CUDA stream (or the CPU reference). Registered for both CPU and CUDA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fusebox/fusebox.h"

namespace {

using at::Tensor;
using fusebox::TensorView;
using OptTensor = std::optional<Tensor>;

// ---------------------------------------------------------------- tensor -> view

fusebox::DType to_dtype(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return fusebox::DType::kFloat32;
    case at::kHalf: return fusebox::DType::kFloat16;
    case at::kBFloat16: return fusebox::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "fusebox: ", name, " must be float32, float16 or bfloat16; got ",
                       t.scalar_type());
  }
}

// The view of `t` with the core dtype `dtype` (checked by the caller).
TensorView view_as(const Tensor& t, const char* name, fusebox::DType dtype) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "fusebox: ", name, " must be a dense (strided) tensor");
  TORCH_CHECK_VALUE(t.is_cpu() || t.is_cuda(), "fusebox: ", name,
                    " must be on a CPU or CUDA device; got ", t.device());
  TORCH_CHECK_VALUE(t.dim() <= fusebox::kMaxDims, "fusebox: ", name, " has ", t.dim(),
                    " dimensions; at most ", fusebox::kMaxDims, " are supported");
  TensorView v;
  v.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  v.dtype = dtype;
  v.device = t.is_cuda() ? fusebox::Device::kCUDA : fusebox::Device::kCPU;
  v.ndim = int(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  if (v.ndim == 0) {  // a 0-d tensor is one element; give it a dimension so it counts as given
    v.ndim = 1;
    v.shape[0] = 1;
    v.strides[0] = 1;
  }
  return v;
}

TensorView view(const Tensor& t, const char* name) { return view_as(t, name, to_dtype(t, name)); }

// An integer operand (indices).
TensorView index_view(const Tensor& t, const char* name) {
  const auto type = t.scalar_type();
  TORCH_CHECK_TYPE(type == at::kInt || type == at::kLong, "fusebox: ", name, " must be int32 or int64; got ", type);
  return view_as(t, name, type == at::kLong ? fusebox::DType::kInt64 : fusebox::DType::kInt32);
}

TensorView view(const OptTensor& t, const char* name) {
  return t.has_value() ? view(*t, name) : TensorView{};
}

// Broadcasts a modulation-like operand to x's shape through stride-0 dimensions.
Tensor broadcast_to(const Tensor& t, const Tensor& x, const char* name) {
  bool ok = t.dim() <= x.dim();
  for (int64_t i = 1; ok && i <= t.dim(); ++i) {
    const int64_t ts = t.size(-i), xs = x.size(-i);
    ok = ts == xs || ts == 1;
  }
  TORCH_CHECK_VALUE(ok, "fusebox: ", name, " of shape ", t.sizes(),
                    " cannot broadcast to x's shape ", x.sizes());
  TORCH_CHECK_VALUE(t.dim() == 0 || t.size(-1) == x.size(-1) || x.size(-1) == 1, "fusebox: ", name,
                    " must have x's last dimension (", x.size(-1), "); got shape ", t.sizes());
  return t.expand(x.sizes());
}

OptTensor broadcast_to(const OptTensor& t, const Tensor& x, const char* name) {
  if (!t.has_value()) return std::nullopt;
  return broadcast_to(*t, x, name);
}

// Runs a core call with the device of `ref` current and its stream, translating core errors.
template <typename F>
void run(const Tensor& ref, F&& call) {
  try {
    if (ref.is_cuda()) {
      const c10::cuda::CUDAGuard guard(ref.device());
      call(c10::cuda::getCurrentCUDAStream(ref.device().index()).stream());
    } else {
      call(nullptr);
    }
  } catch (const fusebox::Error& e) {
    switch (e.kind()) {
      case fusebox::ErrorKind::kInvalidArgument: TORCH_CHECK_VALUE(false, e.what());
      case fusebox::ErrorKind::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
      default: TORCH_CHECK(false, e.what());
    }
  }
}

Tensor empty_like_shape(const Tensor& x, std::optional<at::ScalarType> dtype = std::nullopt) {
  return at::empty(x.sizes(), x.options().dtype(dtype.value_or(x.scalar_type())));
}

fusebox::NormType parse_norm(const std::string& s, bool allow_none) {
  if (s == "rms") return fusebox::NormType::kRMS;
  if (s == "layer") return fusebox::NormType::kLayer;
  if (allow_none && s == "none") return fusebox::NormType::kNone;
  TORCH_CHECK_VALUE(false, "fusebox: norm_type must be 'rms' or 'layer'", allow_none ? " or 'none'" : "",
                    "; got '", s, "'");
}

fusebox::Activation parse_activation(const std::string& s) {
  if (s == "silu") return fusebox::Activation::kSiLU;
  if (s == "gelu_tanh") return fusebox::Activation::kGeluTanh;
  if (s == "gelu") return fusebox::Activation::kGelu;
  TORCH_CHECK_VALUE(false, "fusebox: activation must be 'silu', 'gelu_tanh' or 'gelu'; got '", s, "'");
}

void check_out_dtype(std::optional<at::ScalarType> out_dtype, const Tensor& x) {
  TORCH_CHECK_VALUE(!out_dtype.has_value() || *out_dtype == x.scalar_type() || *out_dtype == at::kFloat,
                    "fusebox: out_dtype must be x's dtype (", x.scalar_type(), ") or float32; got ",
                    *out_dtype);
}

// ---------------------------------------------------------------- norms

// What error messages call the branch and shift operands of norm_impl (the functions that pass
// a residual as one of them name it "residual").
struct OperandNames {
  const char* branch = "branch";
  const char* shift = "shift";
};

// Returns the norm's output and, where a branch is given, the updated residual h = x + gate * branch.
std::pair<Tensor, OptTensor> norm_impl(const Tensor& x, const OptTensor& branch, const OptTensor& gate,
                                       const OptTensor& scale, const OptTensor& shift,
                                       const OptTensor& weight, const OptTensor& bias,
                                       const std::string& norm_type, double eps, double weight_offset,
                                       std::optional<at::ScalarType> out_dtype,
                                       const OperandNames& names = {},
                                       const OptTensor& gate_table = std::nullopt,
                                       const OptTensor& scale_table = std::nullopt,
                                       const OptTensor& shift_table = std::nullopt) {
  check_out_dtype(out_dtype, x);
  TORCH_CHECK_VALUE(branch.has_value() || !gate.has_value(),
                    "fusebox: gate needs branch (h = x + gate * branch)");
  const OptTensor gate_b = broadcast_to(gate, x, "gate");
  const OptTensor scale_b = broadcast_to(scale, x, "scale");
  const OptTensor shift_b = broadcast_to(shift, x, names.shift);
  Tensor out = empty_like_shape(x, out_dtype);
  OptTensor h;
  if (branch.has_value()) h = empty_like_shape(x);
  fusebox::NormArgs a;
  a.x = view(x, "x");
  a.branch = view(branch, names.branch);
  a.branch_name = names.branch;
  a.gate = view(gate_b, "gate");
  a.scale = view(scale_b, "scale");
  a.shift = view(shift_b, names.shift);
  a.shift_name = names.shift;
  a.weight = view(weight, "weight");
  a.bias = view(bias, "bias");
  a.gate_table = view(gate_table, "gate_table");
  a.scale_table = view(scale_table, "scale_table");
  a.shift_table = view(shift_table, "shift_table");
  a.out = view(out, "out");
  a.residual_out = view(h, "residual_out");
  a.norm = parse_norm(norm_type, false);
  a.eps = float(eps);
  a.weight_offset = float(weight_offset);
  run(x, [&](cudaStream_t s) { fusebox::norm(a, s); });
  return {out, h};
}

std::tuple<Tensor, Tensor> fused_norm(const Tensor& x, const OptTensor& branch, const OptTensor& gate,
                                      const OptTensor& scale, const OptTensor& shift,
                                      const OptTensor& weight, const OptTensor& bias,
                                      const std::string& norm_type, double eps, double weight_offset,
                                      std::optional<at::ScalarType> out_dtype, const OptTensor& gate_table,
                                      const OptTensor& scale_table, const OptTensor& shift_table) {
  auto [out, h] = norm_impl(x, branch, gate, scale, shift, weight, bias, norm_type, eps, weight_offset,
                            out_dtype, {}, gate_table, scale_table, shift_table);
  // the schema returns two tensors; without a branch the second is empty
  return {out, h.has_value() ? *h : at::empty({0}, x.options())};
}

Tensor rms_norm(const Tensor& x, const OptTensor& weight, double eps, double weight_offset,
                std::optional<at::ScalarType> out_dtype) {
  return norm_impl(x, std::nullopt, std::nullopt, std::nullopt, std::nullopt, weight, std::nullopt, "rms",
                   eps, weight_offset, out_dtype).first;
}

Tensor layer_norm(const Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
                  std::optional<at::ScalarType> out_dtype) {
  return norm_impl(x, std::nullopt, std::nullopt, std::nullopt, std::nullopt, weight, bias, "layer", eps,
                   0.0, out_dtype).first;
}

std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& x, const Tensor& residual,
                                              const OptTensor& weight, double eps, double weight_offset) {
  auto [out, h] = norm_impl(x, residual, std::nullopt, std::nullopt, std::nullopt, weight, std::nullopt,
                            "rms", eps, weight_offset, std::nullopt, {"residual", "shift"});
  return {out, *h};
}

// residual + rms_norm(x): the residual is the norm's per-token shift
Tensor rms_norm_add(const Tensor& x, const Tensor& residual, const OptTensor& weight, double eps,
                    double weight_offset) {
  return norm_impl(x, std::nullopt, std::nullopt, std::nullopt, residual, weight, std::nullopt, "rms", eps,
                   weight_offset, std::nullopt, {"branch", "residual"}).first;
}

Tensor gated_residual(const Tensor& x, const Tensor& branch, const OptTensor& gate,
                      const OptTensor& gate_table) {
  const OptTensor gate_b = broadcast_to(gate, x, "gate");
  Tensor h = empty_like_shape(x);
  fusebox::NormArgs a;
  a.x = view(x, "x");
  a.branch = view(branch, "branch");
  a.gate = view(gate_b, "gate");
  a.gate_table = view(gate_table, "gate_table");
  a.residual_out = view(h, "out");
  a.norm = fusebox::NormType::kNone;
  run(x, [&](cudaStream_t s) { fusebox::norm(a, s); });
  return h;
}

// ---------------------------------------------------------------- rotary

// q/k as the core's [B, S, H, D]: a flat [B, S, W] is one head of width W; heads_first
// [B, H, S, D] is the same memory with two strides swapped.
TensorView rotary_view(const Tensor& t, const char* name, bool heads_first) {
  TORCH_CHECK_VALUE(t.dim() == 3 || t.dim() == 4, "fusebox: ", name,
                    " must be [batch, seq, heads, head_dim], [batch, heads, seq, head_dim] "
                    "(heads_first) or [batch, seq, width]; got shape ", t.sizes());
  TensorView v = view(t, name);
  if (t.dim() == 3) {
    v.ndim = 4;
    v.shape[3] = v.shape[2];
    v.strides[3] = v.strides[2];
    v.shape[2] = 1;
    v.strides[2] = v.shape[3];
  } else if (heads_first) {
    std::swap(v.shape[1], v.shape[2]);
    std::swap(v.strides[1], v.strides[2]);
  }
  return v;
}

// cos/sin as the core's [B, S, R] (stride 0 over a broadcast batch).
TensorView table_view(const Tensor& t, const char* name, const TensorView& q, bool heads_first) {
  TensorView v = view(t, name);
  const int64_t B = q.shape[0], S = q.shape[1];
  auto fail = [&] {
    TORCH_CHECK_VALUE(false, "fusebox: ", name, " must be [seq, R], [batch, seq, R] or, 4-D, ",
                      heads_first ? "[batch, 1, seq, R]" : "[batch, seq, 1, R]", " with seq = ", S,
                      " and batch = ", B, " or 1; got shape ", t.sizes());
  };
  TensorView c;
  c.data = v.data;
  c.dtype = v.dtype;
  c.device = v.device;
  c.ndim = 3;
  if (t.dim() == 2) {
    c.shape[0] = B; c.strides[0] = 0;
    c.shape[1] = v.shape[0]; c.strides[1] = v.strides[0];
    c.shape[2] = v.shape[1]; c.strides[2] = v.strides[1];
  } else if (t.dim() == 3) {
    c.shape[0] = v.shape[0]; c.strides[0] = v.strides[0];
    c.shape[1] = v.shape[1]; c.strides[1] = v.strides[1];
    c.shape[2] = v.shape[2]; c.strides[2] = v.strides[2];
  } else if (t.dim() == 4) {
    const int head_dim = heads_first ? 1 : 2, seq_dim = heads_first ? 2 : 1;
    if (v.shape[head_dim] != 1) fail();
    c.shape[0] = v.shape[0]; c.strides[0] = v.strides[0];
    c.shape[1] = v.shape[seq_dim]; c.strides[1] = v.strides[seq_dim];
    c.shape[2] = v.shape[3]; c.strides[2] = v.strides[3];
  } else {
    fail();
  }
  if (c.shape[1] != S || (c.shape[0] != B && c.shape[0] != 1)) fail();
  if (c.shape[0] == 1) {
    c.shape[0] = B;
    c.strides[0] = 0;
  }
  return c;
}

std::tuple<Tensor, Tensor> rotary(const Tensor& q, const OptTensor& k, const OptTensor& cos,
                                  const OptTensor& sin, at::OptionalIntArrayRef grid,
                                  at::OptionalIntArrayRef axes_dim, double theta,
                                  at::OptionalIntArrayRef offsets, const std::string& norm,
                                  bool across_heads, const OptTensor& q_weight,
                                  const OptTensor& k_weight, double eps, double weight_offset,
                                  bool interleaved, bool heads_first) {
  if (k.has_value())
    TORCH_CHECK_VALUE(k->dim() == q.dim(), "fusebox: k must have q's rank (", q.dim(), "); got shape ",
                      k->sizes());
  Tensor q_out = empty_like_shape(q);
  Tensor k_out = k.has_value() ? empty_like_shape(*k) : at::empty({0}, q.options());
  fusebox::RopeArgs a;
  a.q = rotary_view(q, "q", heads_first);
  a.q_out = rotary_view(q_out, "q_out", heads_first);
  if (k.has_value()) {
    a.k = rotary_view(*k, "k", heads_first);
    a.k_out = rotary_view(k_out, "k_out", heads_first);
  }
  if (grid.has_value()) {
    TORCH_CHECK_VALUE(grid->size() == 3, "fusebox: grid must be [num_frames, height, width]");
    TORCH_CHECK_VALUE(axes_dim.has_value() && axes_dim->size() == 3,
                      "fusebox: axes_dim must have 3 entries (time, height, width)");
    TORCH_CHECK_VALUE(!offsets.has_value() || offsets->size() == 3, "fusebox: offsets must have 3 entries");
    TORCH_CHECK_VALUE(!cos.has_value() && !sin.has_value(), "fusebox: pass either cos/sin or grid, not both");
    a.use_grid = true;
    a.grid.frames = (*grid)[0];
    a.grid.height = (*grid)[1];
    a.grid.width = (*grid)[2];
    for (int i = 0; i < 3; ++i) {
      a.grid.axes_dim[i] = (*axes_dim)[i];
      a.grid.offsets[i] = offsets.has_value() ? (*offsets)[i] : 0;
    }
    a.grid.theta = float(theta);
  } else {
    TORCH_CHECK_VALUE(cos.has_value() && sin.has_value(), "fusebox: cos and sin are required (or a grid)");
    a.cos = table_view(*cos, "cos", a.q, heads_first);
    a.sin = table_view(*sin, "sin", a.q, heads_first);
  }
  a.style = interleaved ? fusebox::RopeStyle::kInterleaved : fusebox::RopeStyle::kHalfSplit;
  a.norm = parse_norm(norm, true);
  a.norm_across_heads = across_heads;
  a.q_weight = view(q_weight, "q_weight");
  a.k_weight = view(k_weight, "k_weight");
  a.eps = float(eps);
  a.weight_offset = float(weight_offset);
  run(q, [&](cudaStream_t s) { fusebox::rope(a, s); });
  return {q_out, k_out};
}

// ---------------------------------------------------------------- activations

Tensor gated_act(const Tensor& gate, const Tensor& up, const std::string& act) {
  const fusebox::Activation a = parse_activation(act);
  Tensor out = empty_like_shape(gate);
  const TensorView g = view(gate, "gate"), u = view(up, "up"), o = view(out, "out");
  run(gate, [&](cudaStream_t s) { fusebox::gated_activation(g, u, o, a, s); });
  return out;
}

Tensor gated_act_packed(const Tensor& x, const std::string& act, bool gate_first) {
  const fusebox::Activation a = parse_activation(act);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "fusebox: x's last dimension must be even "
                    "(gate and up packed together); got shape ", x.sizes());
  const int64_t n = x.size(-1) / 2;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  Tensor out = at::empty(out_shape, x.options());
  // Gate and up are two views of x; the core reads them through x's strides.
  TensorView first = view(x, "x"), second = view(x, "x");
  first.shape[first.ndim - 1] = n;
  second.shape[second.ndim - 1] = n;
  if (n > 0) second.data = static_cast<char*>(second.data) + n * x.element_size() * x.stride(-1);
  const TensorView o = view(out, "out");
  run(x, [&](cudaStream_t s) {
    fusebox::gated_activation(gate_first ? first : second, gate_first ? second : first, o, a, s);
  });
  return out;
}

Tensor act(const Tensor& x, const OptTensor& bias, const std::string& act) {
  const fusebox::Activation a = parse_activation(act);
  Tensor out = empty_like_shape(x);
  const TensorView xv = view(x, "x"), b = view(bias, "bias"), o = view(out, "out");
  run(x, [&](cudaStream_t s) { fusebox::activation(xv, b, o, a, s); });
  return out;
}

// ---------------------------------------------------------------- mixture of experts

Tensor moe_combine(const Tensor& rows, const Tensor& index, const Tensor& weights) {
  TORCH_CHECK_VALUE(rows.dim() == 2, "fusebox: rows must be a 2-D tensor [rows, hidden]; got shape ", rows.sizes());
  TORCH_CHECK_VALUE(index.dim() == 2, "fusebox: index must be a 2-D tensor [tokens, top_k]; got shape ",
                    index.sizes());
  Tensor out = at::empty({index.size(0), rows.size(1)}, rows.options());
  const TensorView r = view(rows, "rows"), i = index_view(index, "index"), w = view(weights, "weights"),
                   o = view(out, "out");
  run(rows, [&](cudaStream_t s) { fusebox::moe_combine(r, i, w, o, s); });
  return out;
}

std::tuple<Tensor, Tensor> moe_topk(const Tensor& logits, int64_t top_k, c10::string_view score, const OptTensor& bias,
                                    int64_t num_groups, int64_t topk_groups, bool renormalize, double scale,
                                    std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "fusebox: logits must be a 2-D tensor [tokens, experts]; got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(top_k >= 0, "fusebox: top_k must be non-negative; got ", top_k);
  TORCH_CHECK_VALUE(score == "softmax" || score == "sigmoid", "fusebox: score must be 'softmax' or 'sigmoid'; got '",
                    std::string(score), "'");
  Tensor weights = at::empty({logits.size(0), top_k}, logits.options().dtype(out_dtype.value_or(at::kFloat)));
  Tensor index = at::empty({logits.size(0), top_k}, logits.options().dtype(at::kLong));
  fusebox::RouterArgs a;
  a.logits = view(logits, "logits");
  a.bias = view(bias, "bias");
  a.weights = view(weights, "weights");
  a.index = index_view(index, "index");
  a.score = score == "sigmoid" ? fusebox::RouterScore::kSigmoid : fusebox::RouterScore::kSoftmax;
  a.num_groups = num_groups;
  a.topk_groups = topk_groups;
  a.renormalize = renormalize;
  a.scale = float(scale);
  run(logits, [&](cudaStream_t s) { fusebox::moe_topk(a, s); });
  return {weights, index};
}

std::tuple<Tensor, Tensor, Tensor> moe_sort(const Tensor& index, int64_t num_experts) {
  TORCH_CHECK_VALUE(index.dim() == 2, "fusebox: index must be a 2-D tensor [tokens, top_k]; got shape ",
                    index.sizes());
  TORCH_CHECK_VALUE(num_experts >= 1, "fusebox: num_experts must be at least 1; got ", num_experts);
  const auto opts = index.options().dtype(at::kInt);
  Tensor row_token = at::empty({index.numel()}, opts), offsets = at::empty({num_experts}, opts),
         pair_row = at::empty(index.sizes(), opts);
  const TensorView i = index_view(index, "index"), rt = view_as(row_token, "row_token", fusebox::DType::kInt32),
                   of = view_as(offsets, "offsets", fusebox::DType::kInt32),
                   pr = view_as(pair_row, "pair_row", fusebox::DType::kInt32);
  run(index, [&](cudaStream_t s) {
    // the counts of a sort over many blocks, from the caching allocator (no sync, no memset);
    // none where one block or one cluster sorts the index on this device
    Tensor workspace;
    TensorView ws;
    const int64_t elements =
        index.is_cuda() ? fusebox::moe_sort_workspace_size(index.size(0), index.size(1), num_experts, true) : 0;
    if (elements > 0) {
      workspace = at::empty({elements}, opts);
      ws = view_as(workspace, "workspace", fusebox::DType::kInt32);
    }
    fusebox::moe_sort(i, num_experts, rt, of, pr, s, ws);
  });
  return {row_token, offsets, pair_row};
}

}  // namespace

TORCH_LIBRARY(fusebox, m) {
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset, ScalarType? out_dtype) -> Tensor", tags);
  m.def("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) -> Tensor", tags);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, float weight_offset) -> (Tensor, Tensor)", tags);
  m.def("rms_norm_add(Tensor x, Tensor residual, Tensor? weight, float eps, float weight_offset) -> Tensor", tags);
  m.def("fused_norm(Tensor x, Tensor? branch, Tensor? gate, Tensor? scale, Tensor? shift, Tensor? weight, "
        "Tensor? bias, str norm_type, float eps, float weight_offset, ScalarType? out_dtype, "
        "Tensor? gate_table=None, Tensor? scale_table=None, Tensor? shift_table=None) -> (Tensor, Tensor)", tags);
  m.def("gated_residual(Tensor x, Tensor branch, Tensor? gate, Tensor? gate_table=None) -> Tensor", tags);
  m.def("rotary(Tensor q, Tensor? k, Tensor? cos, Tensor? sin, int[]? grid, int[]? axes_dim, float theta, "
        "int[]? offsets, str norm, bool across_heads, Tensor? q_weight, Tensor? k_weight, float eps, "
        "float weight_offset, bool interleaved, bool heads_first) -> (Tensor, Tensor)", tags);
  m.def("gated_act(Tensor gate, Tensor up, str act) -> Tensor", tags);
  m.def("gated_act_packed(Tensor x, str act, bool gate_first) -> Tensor", tags);
  m.def("act(Tensor x, Tensor? bias, str act) -> Tensor", tags);
  m.def("moe_combine(Tensor rows, Tensor index, Tensor weights) -> Tensor", tags);
  m.def("moe_sort(Tensor index, int num_experts) -> (Tensor, Tensor, Tensor)", tags);
  m.def("moe_topk(Tensor logits, int top_k, str score, Tensor? bias, int num_groups, int topk_groups, "
        "bool renormalize, float scale, ScalarType? out_dtype) -> (Tensor, Tensor)", tags);
}

#define FUSEBOX_IMPL_ALL(m)                              \
  m.impl("rms_norm", &rms_norm);                         \
  m.impl("layer_norm", &layer_norm);                     \
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);     \
  m.impl("rms_norm_add", &rms_norm_add);                 \
  m.impl("fused_norm", &fused_norm);                     \
  m.impl("gated_residual", &gated_residual);             \
  m.impl("rotary", &rotary);                             \
  m.impl("gated_act", &gated_act);                       \
  m.impl("gated_act_packed", &gated_act_packed);         \
  m.impl("act", &act);                                   \
  m.impl("moe_combine", &moe_combine);                   \
  m.impl("moe_sort", &moe_sort);                         \
  m.impl("moe_topk", &moe_topk)

TORCH_LIBRARY_IMPL(fusebox, CPU, m) { FUSEBOX_IMPL_ALL(m); }
TORCH_LIBRARY_IMPL(fusebox, CUDA, m) { FUSEBOX_IMPL_ALL(m); }
