// Host-side helpers of the CPU reference implementation: typed element access for views and
// the row walk that mirrors the CUDA kernels' RowIndexer.
#pragma once

#include <cstdint>

#include "common/half_host.h"
#include "common/layout.h"
#include "fusebox/tensor.h"

namespace fusebox::cpu {

// Reads element `offset` of a view of any supported dtype as float.
inline float load(const void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[offset];
    case DType::kFloat16: return host::to_float(static_cast<const host::float16*>(base)[offset]);
    case DType::kBFloat16: return host::to_float(static_cast<const host::bfloat16*>(base)[offset]);
    case DType::kInt32: return float(static_cast<const int32_t*>(base)[offset]);
    case DType::kInt64: return float(static_cast<const int64_t*>(base)[offset]);
  }
  return 0.f;
}

// Rounds v to dtype and stores it.
inline void store(void* base, DType dtype, int64_t offset, float v) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[offset] = v; break;
    case DType::kFloat16: static_cast<host::float16*>(base)[offset] = host::from_float<host::float16>(v); break;
    case DType::kBFloat16: static_cast<host::bfloat16*>(base)[offset] = host::from_float<host::bfloat16>(v); break;
    case DType::kInt32: static_cast<int32_t*>(base)[offset] = int32_t(v); break;  // (indices: tests)
    case DType::kInt64: static_cast<int64_t*>(base)[offset] = int64_t(v); break;
  }
}

// The value a tensor of `dtype` would hold for v.
inline float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kFloat32: return v;
    case DType::kFloat16: return host::to_float(host::from_float<host::float16>(v));
    case DType::kBFloat16: return host::to_float(host::from_float<host::bfloat16>(v));
    case DType::kInt32:
    case DType::kInt64: break;
  }
  return v;
}

// Element offset of row `row` for an operand with merged row strides.
inline int64_t row_offset(const detail::RowLayout& l, const detail::RowStrides& s, int64_t row) {
  const int64_t i2 = row % l.sizes[2];
  const int64_t t = row / l.sizes[2];
  return (t / l.sizes[1]) * s.s[0] + (t % l.sizes[1]) * s.s[1] + i2 * s.s[2];
}

}  // namespace fusebox::cpu
