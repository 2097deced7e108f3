// Device-side building blocks shared by every fusebox kernel: dtype conversion, vector
// loads/stores in 16-byte transactions, row reductions, and launch error checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/layout.h"
#include "fusebox/error.h"
#include "fusebox/tensor.h"

#define FUSEBOX_CUDA_CHECK(expr)                                                                \
  do {                                                                                          \
    cudaError_t err_ = (expr);                                                                  \
    if (err_ != cudaSuccess)                                                                    \
      throw ::fusebox::Error(::fusebox::ErrorKind::kCuda,                                       \
                             ::fusebox::detail::concat("fusebox: CUDA error ",                  \
                                                       cudaGetErrorString(err_), " at ",        \
                                                       __FILE__, ":", __LINE__));               \
  } while (0)

// After a launch: reports bad launch configurations (never a kernel's later fault).
#define FUSEBOX_CHECK_LAUNCH() FUSEBOX_CUDA_CHECK(cudaGetLastError())

namespace fusebox::cuda {

// ---------------------------------------------------------------- dtype conversion

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Rounds a float through T and back: the value a tensor of dtype T would hold.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// ---------------------------------------------------------------- vector access
// N elements of T move in chunks of at most 16 bytes; the pointer must be aligned to
// min(16, N * sizeof(T)) bytes (pick_vector_width guarantees it). Loads go through the
// read-only path (ld.global.nc): fusebox operands are never written by the kernel that reads
// them, and it lets the compiler issue every load of a row before the first store.

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int Bytes>
struct RawChunk;
template <>
struct RawChunk<16> {
  using type = uint4;
};
template <>
struct RawChunk<8> {
  using type = uint2;
};
template <>
struct RawChunk<4> {
  using type = unsigned int;
};
template <>
struct RawChunk<2> {
  using type = unsigned short;
};

template <typename T, int N>
struct VecIO {
  static constexpr int kBytes = int(sizeof(T)) * N;
  static constexpr int kChunk = kBytes < 16 ? N : 16 / int(sizeof(T));
  static constexpr int kChunks = N / kChunk;
  using Raw = typename RawChunk<kChunk * int(sizeof(T))>::type;

  __device__ __forceinline__ static void load(const T* p, float (&out)[N]) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const Raw raw = __ldg(reinterpret_cast<const Raw*>(p + c * kChunk));
      Pack<T, kChunk> pk;
      memcpy(&pk, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < kChunk; ++i) out[c * kChunk + i] = to_float(pk.v[i]);
    }
  }
  __device__ __forceinline__ static void store(T* p, const float (&in)[N]) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      Pack<T, kChunk> pk;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) pk.v[i] = from_float<T>(in[c * kChunk + i]);
      *reinterpret_cast<Pack<T, kChunk>*>(p + c * kChunk) = pk;
    }
  }
};

// An operand whose dtype is either the kernel's main type T or fp32, chosen at run time
// (weights, biases, modulation, gates, rotary tables). The branch is uniform per launch.
struct ParamPtr {
  const void* ptr = nullptr;
  bool is_f32 = false;
};

template <typename T, int N>
__device__ __forceinline__ void load_param(const ParamPtr& p, int64_t offset, float (&out)[N]) {
  if (p.is_f32)
    VecIO<float, N>::load(static_cast<const float*>(p.ptr) + offset, out);
  else
    VecIO<T, N>::load(static_cast<const T*>(p.ptr) + offset, out);
}

template <typename T>
__device__ __forceinline__ float load_param_scalar(const ParamPtr& p, int64_t offset) {
  if constexpr (sizeof(T) == 2) {
    if (!p.is_f32) {
      const unsigned short bits = __ldg(reinterpret_cast<const unsigned short*>(p.ptr) + offset);
      T v;
      memcpy(&v, &bits, sizeof(T));
      return to_float(v);
    }
  }
  return __ldg(static_cast<const float*>(p.ptr) + offset);
}

// ---------------------------------------------------------------- row indexing

// Maps a row number to an element offset for each operand of a merged RowLayout.
struct RowIndexer {
  int64_t size1, size2;  // sizes of the two inner row groups
  bool flat;             // one row group (the common case): no divisions
  __device__ __forceinline__ void split(int64_t row, int64_t& i0, int64_t& i1, int64_t& i2) const {
    if (flat) {
      i0 = i1 = 0;
      i2 = row;
      return;
    }
    i2 = row % size2;
    const int64_t t = row / size2;
    i1 = t % size1;
    i0 = t / size1;
  }
};

struct RowOffsets {
  int64_t s0, s1, s2;
  __device__ __forceinline__ int64_t at(int64_t i0, int64_t i1, int64_t i2) const {
    return i0 * s0 + i1 * s1 + i2 * s2;
  }
};

inline RowIndexer row_indexer(const detail::RowLayout& l) {
  return RowIndexer{l.sizes[1], l.sizes[2], l.sizes[0] == 1 && l.sizes[1] == 1};
}

inline RowOffsets row_offsets(const detail::RowStrides& s) { return RowOffsets{s.s[0], s.s[1], s.s[2]}; }

// ---------------------------------------------------------------- reductions

// Sum over the `width` consecutive lanes (a power of two <= 32) that share a row.
__device__ __forceinline__ float lane_group_sum(float v, int width) {
  for (int off = width >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the threads of one row: blockDim.x threads (a power of two) per row, rows stacked
// along threadIdx.y. `scratch` holds one float per warp of the block. Every thread of the block
// must call it (it synchronizes when rows span several warps).
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  const int tpr = blockDim.x;
  if (tpr <= 32) return lane_group_sum(v, tpr);
  v = lane_group_sum(v, 32);
  const int tid = threadIdx.y * tpr + threadIdx.x;
  const int warps_per_row = tpr >> 5;
  const int first_warp = threadIdx.y * warps_per_row;
  __syncthreads();  // scratch may still be read by a previous reduction
  if ((tid & 31) == 0) scratch[tid >> 5] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps_per_row; ++w) total += scratch[first_warp + w];
  return total;
}

// Sum over the whole block (1-D or 2-D); `scratch` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthreads = blockDim.x * blockDim.y;
  v = lane_group_sum(v, 32);
  __syncthreads();
  if ((tid & 31) == 0) scratch[tid >> 5] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (nthreads + 31) / 32; ++w) total += scratch[w];
  return total;
}

// ---------------------------------------------------------------- dispatch

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

// Calls f(std::integral_constant<int, V>) for the vector width V == vec (1, 2, 4 or 8),
// restricted to widths that fit 16 bytes of T.
template <typename T, typename F>
void dispatch_vec(int vec, F&& f) {
  switch (vec) {
    case 8:
      if constexpr (sizeof(T) <= 2) {
        f(std::integral_constant<int, 8>{});
        return;
      }
      break;
    case 4: f(std::integral_constant<int, 4>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    case 1: f(std::integral_constant<int, 1>{}); return;
  }
  throw Error(ErrorKind::kInvalidArgument, "fusebox: internal error: bad vector width");
}

// Limits of the current device that launch plans use (queried once per device).
struct DeviceLimits {
  int sm_count = 0;
  int smem_optin = 0;   // max dynamic shared memory per block after opt-in
  int smem_per_sm = 0;
};
const DeviceLimits& device_limits();

inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

}  // namespace fusebox::cuda
