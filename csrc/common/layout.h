// Shared host-side plumbing of the entry points: argument checks with messages that name the
// argument, and the row layout that lets one kernel walk strided, broadcast operands.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "fusebox/error.h"
#include "fusebox/tensor.h"

namespace fusebox::detail {

// Checks shared by all ops.
// The main operand of every computing op: float32, float16 or bfloat16.
void check_floating(const TensorView& t, const char* name);
void check_unit_last_stride(const TensorView& t, const char* name);
void check_same_shape(const TensorView& t, const char* name, const TensorView& ref, const char* ref_name);
void check_dtype_is(const TensorView& t, const char* name, DType expected, const char* why);
// Small operands may be fp32 or the main dtype.
void check_param_dtype(const TensorView& t, const char* name, DType main);
void check_vector(const TensorView& t, const char* name, int64_t length, const char* length_desc,
                  DType main);
void check_same_device(std::initializer_list<std::pair<const TensorView*, const char*>> views);

// Leading ("row") dimensions of several same-shaped operands, merged where every operand is
// contiguous across them, so that a kernel indexes rows with at most kRowDims divisions.
constexpr int kRowDims = 3;
struct RowLayout {
  int64_t rows = 0;
  int64_t sizes[kRowDims] = {1, 1, 1};  // outermost first
};
struct RowStrides {
  int64_t s[kRowDims] = {0, 0, 0};
};

// Builds the merged layout of x's leading dims; `operands` (may hold undefined views, which are
// skipped) must have x's shape. Writes one RowStrides per operand into `strides_out`.
RowLayout merge_rows(const TensorView& x, const TensorView* const* operands, int count,
                     RowStrides* strides_out);

// Largest vector width (elements, power of two, <= 16 bytes of the main dtype) that divides
// the row width and every row stride, and whose byte width every pointer is aligned to.
int pick_vector_width(DType main, int64_t width, const TensorView* const* operands, int count,
                      const RowStrides* strides);

}  // namespace fusebox::detail
