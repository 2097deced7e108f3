// Operands the mixture-of-experts kernels share: [tokens, top_k] views addressed by their two
// strides (index, weights, pair rows) and index tensors of either integer width.
#pragma once

#include "common/cuda_common.cuh"

namespace fusebox::cuda {

// Element (i, j) of a 2-D view at i * s0 + j * s1.
struct Strides2D {
  int64_t s0 = 0, s1 = 0;
  __device__ __forceinline__ int64_t at(int64_t i, int64_t j) const { return i * s0 + j * s1; }
};

inline Strides2D strides_2d(const TensorView& t) { return {t.strides[0], t.strides[1]}; }

// An int32 or int64 index tensor; the width is uniform per launch.
struct IndexPtr {
  void* ptr = nullptr;
  bool is64 = false;
  __device__ __forceinline__ int64_t load(int64_t at) const {
    return is64 ? int64_t(__ldg(static_cast<const long long*>(ptr) + at)) : __ldg(static_cast<const int*>(ptr) + at);
  }
  __device__ __forceinline__ void store(int64_t at, int64_t value) const {
    if (is64)
      static_cast<long long*>(ptr)[at] = value;
    else
      static_cast<int*>(ptr)[at] = int(value);
  }
};

inline IndexPtr index_ptr(const TensorView& t) { return {t.data, t.dtype == DType::kInt64}; }

}  // namespace fusebox::cuda
