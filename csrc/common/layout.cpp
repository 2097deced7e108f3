#include "common/layout.h"

#include <algorithm>

namespace fusebox::detail {

void check_floating(const TensorView& t, const char* name) {
  FUSEBOX_CHECK(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16, name,
                " must be float32, float16 or bfloat16; got ", dtype_name(t.dtype));
}

void check_unit_last_stride(const TensorView& t, const char* name) {
  if (t.ndim == 0) return;
  FUSEBOX_CHECK(t.shape[t.ndim - 1] <= 1 || t.strides[t.ndim - 1] == 1, name,
                " must have a contiguous last dimension (stride 1); got stride ",
                t.strides[t.ndim - 1], " for shape ", t.shape_str(),
                ". Call .contiguous() on it first");
}

void check_same_shape(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name) {
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == ref.shape[i];
  FUSEBOX_CHECK(same, name, " must have the shape of ", ref_name, " ", ref.shape_str(), "; got ",
                t.shape_str());
}

void check_dtype_is(const TensorView& t, const char* name, DType expected, const char* why) {
  FUSEBOX_CHECK(t.dtype == expected, name, " must be ", dtype_name(expected), " (", why, "); got ",
                dtype_name(t.dtype));
}

void check_param_dtype(const TensorView& t, const char* name, DType main) {
  FUSEBOX_CHECK(t.dtype == main || t.dtype == DType::kFloat32, name, " must be ", dtype_name(main),
                " or float32; got ", dtype_name(t.dtype));
}

void check_vector(const TensorView& t, const char* name, int64_t length, const char* length_desc,
                  DType main) {
  FUSEBOX_CHECK(t.ndim == 1 && t.shape[0] == length, name, " must be a 1-D tensor of ", length,
                " elements (", length_desc, "); got shape ", t.shape_str());
  FUSEBOX_CHECK(length <= 1 || t.strides[0] == 1, name, " must be contiguous; got stride ",
                t.strides[0]);
  check_param_dtype(t, name, main);
}

void check_same_device(std::initializer_list<std::pair<const TensorView*, const char*>> views) {
  const TensorView* first = nullptr;
  const char* first_name = nullptr;
  for (auto& [v, name] : views) {
    if (!v->defined()) continue;
    if (!first) {
      first = v;
      first_name = name;
      continue;
    }
    FUSEBOX_CHECK(v->device == first->device, name, " is on ",
                  v->device == Device::kCUDA ? "CUDA" : "CPU", " but ", first_name, " is on ",
                  first->device == Device::kCUDA ? "CUDA" : "CPU",
                  "; all tensors of one call must be on the same device");
  }
}

RowLayout merge_rows(const TensorView& x, const TensorView* const* operands, int count,
                     RowStrides* strides_out) {
  // Collect the leading dims of size > 1 (size-1 dims index nothing).
  const int lead = x.ndim - 1;
  int dims[kMaxDims];
  int n = 0;
  for (int d = 0; d < lead; ++d)
    if (x.shape[d] != 1) dims[n++] = d;

  RowLayout layout;
  layout.rows = 1;
  for (int d = 0; d < lead; ++d) layout.rows *= x.shape[d];

  // Greedily merge from the innermost dim outwards.
  int64_t group_size[kMaxDims];
  int64_t group_stride[kMaxDims][kMaxDims];  // [group][operand]
  int groups = 0;
  for (int i = n - 1; i >= 0; --i) {
    const int d = dims[i];
    bool mergeable = groups > 0;
    for (int o = 0; mergeable && o < count; ++o) {
      if (!operands[o]->defined()) continue;
      mergeable = operands[o]->strides[d] == group_stride[groups - 1][o] * group_size[groups - 1];
    }
    if (mergeable) {
      group_size[groups - 1] *= x.shape[d];
    } else {
      group_size[groups] = x.shape[d];
      for (int o = 0; o < count; ++o)
        group_stride[groups][o] = operands[o]->defined() ? operands[o]->strides[d] : 0;
      ++groups;
    }
  }
  FUSEBOX_CHECK(groups <= kRowDims, "x and its operands have ", groups,
                " leading dimensions that cannot be merged (at most ", kRowDims,
                " are supported); make some of them contiguous");
  // groups were collected innermost first; place them outermost first into 3 slots.
  for (int o = 0; o < count; ++o) strides_out[o] = RowStrides{};
  for (int g = 0; g < groups; ++g) {
    const int slot = kRowDims - 1 - g;
    layout.sizes[slot] = group_size[g];
    for (int o = 0; o < count; ++o) strides_out[o].s[slot] = group_stride[g][o];
  }
  return layout;
}

int pick_vector_width(DType main, int64_t width, const TensorView* const* operands, int count,
                      const RowStrides* strides) {
  int vec = int(16 / dtype_size(main));
  auto ok = [&](int v) {
    if (width % v) return false;
    for (int o = 0; o < count; ++o) {
      const TensorView& t = *operands[o];
      if (!t.defined() || t.data == nullptr) continue;
      const size_t bytes = std::min<size_t>(16, size_t(v) * dtype_size(t.dtype));
      if (reinterpret_cast<uintptr_t>(t.data) % bytes) return false;
      if (strides)
        for (int r = 0; r < kRowDims; ++r)
          if (strides[o].s[r] % v) return false;
    }
    return true;
  };
  while (vec > 1 && !ok(vec)) vec /= 2;
  return vec;
}

}  // namespace fusebox::detail
