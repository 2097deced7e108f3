// Device-side building blocks shared by every fusebox kernel: dtype conversion, vector
// loads/stores in 16-byte transactions, row reductions, and launch error checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "common/fast_divmod.h"
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

// N elements of T as stored in memory, in 32-bit words (two 16-bit values to a word), so a
// row kept in registers takes the registers its bytes need; elements are widened to fp32
// where the math uses them.
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Pack {
  static constexpr int kBytes = int(sizeof(T)) * N;
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  using Word = std::conditional_t<(kBytes >= 4), uint32_t, uint16_t>;
  Word w[kWords];
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

// Asks for the cache line holding p in L1 without waiting for it or holding a register: a
// later load_pack of p then hits L1 (or waits on the miss already in flight).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  constexpr int kChunk = Pack<T, N>::kBytes < 16 ? Pack<T, N>::kBytes : 16;
  using Raw = typename RawChunk<kChunk>::type;
  Pack<T, N> out;
#pragma unroll
  for (int c = 0; c < Pack<T, N>::kBytes / kChunk; ++c) {
    const Raw raw = __ldg(reinterpret_cast<const Raw*>(reinterpret_cast<const char*>(p) + c * kChunk));
    memcpy(reinterpret_cast<char*>(out.w) + c * kChunk, &raw, kChunk);
  }
  return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& in) {
  constexpr int kChunk = Pack<T, N>::kBytes < 16 ? Pack<T, N>::kBytes : 16;
  using Raw = typename RawChunk<kChunk>::type;
#pragma unroll
  for (int c = 0; c < Pack<T, N>::kBytes / kChunk; ++c) {
    Raw raw;
    memcpy(&raw, reinterpret_cast<const char*>(in.w) + c * kChunk, kChunk);
    *reinterpret_cast<Raw*>(reinterpret_cast<char*>(p) + c * kChunk) = raw;
  }
}

// Element-wise widening and rounding of packs.
template <typename T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N>& in, float (&out)[N]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __uint_as_float(in.w[i]);
  } else if constexpr (N == 1) {
    out[0] = std::is_same_v<T, __half> ? __half2float(__ushort_as_half(in.w[0]))
                                       : __uint_as_float(uint32_t(in.w[0]) << 16);
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const uint32_t word = in.w[j];
      if constexpr (std::is_same_v<T, __half>) {
        __half2 h2;
        memcpy(&h2, &word, 4);
        const float2 f = __half22float2(h2);
        out[2 * j] = f.x;
        out[2 * j + 1] = f.y;
      } else {  // bf16 is the top half of an fp32
        out[2 * j] = __uint_as_float(word << 16);
        out[2 * j + 1] = __uint_as_float(word & 0xffff0000u);
      }
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> pack(const float (&in)[N]) {
  Pack<T, N> out;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) out.w[i] = __float_as_uint(in[i]);
  } else if constexpr (N == 1) {
    const T v = from_float<T>(in[0]);
    memcpy(&out.w[0], &v, 2);
  } else {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      if constexpr (std::is_same_v<T, __half>) {
        const __half2 h2 = __floats2half2_rn(in[2 * j], in[2 * j + 1]);
        memcpy(&out.w[j], &h2, 4);
      } else {
        const __nv_bfloat162 b2 = __floats2bfloat162_rn(in[2 * j], in[2 * j + 1]);
        memcpy(&out.w[j], &b2, 4);
      }
    }
  }
  return out;
}

// Copies a pack from global to shared memory without holding it in registers: cp.async on
// sm_80+ (complete it with async_copy_wait() before reading), a plain load and store before
// that. Packs under 4 bytes are copied synchronously.
template <typename T, int N>
__device__ __forceinline__ void async_copy_pack(Pack<T, N>* smem, const T* gmem) {
  [[maybe_unused]] constexpr int kBytes = Pack<T, N>::kBytes;  // unused below sm_80
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBytes >= 4) {
    constexpr int kChunk = kBytes < 16 ? kBytes : 16;
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
#pragma unroll
    for (int c = 0; c < kBytes / kChunk; ++c)
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst + c * kChunk),
                   "l"(reinterpret_cast<const char*>(gmem) + c * kChunk), "n"(kChunk));
    return;
  }
#endif
  *smem = load_pack<T, N>(gmem);
}

__device__ __forceinline__ void async_copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// One element, widened to fp32.
template <typename T>
__device__ __forceinline__ float load_scalar(const T* p) {
  float v[1];
  unpack(load_pack<T, 1>(p), v);
  return v[0];
}

template <typename T, int N>
struct VecIO {
  __device__ __forceinline__ static void load(const T* p, float (&out)[N]) { unpack(load_pack<T, N>(p), out); }
  __device__ __forceinline__ static void store(T* p, const float (&in)[N]) { store_pack(p, pack<T, N>(in)); }
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
// Row numbers are below 2^31 (every launcher checks), so the divisions are 32-bit ones.
// (Plain divisions, not FastDivmod: the row kernels' register allocation, which their launch
// plans are tuned to, moved by 2-3 registers with it, and merged row groups are rare.)
struct RowIndexer {
  uint32_t size1, size2;  // sizes of the two inner row groups
  bool flat;              // one row group (the common case): no divisions
  __device__ __forceinline__ void split(int64_t row, int64_t& i0, int64_t& i1, int64_t& i2) const {
    if (flat) {
      i0 = i1 = 0;
      i2 = row;
      return;
    }
    const uint32_t r = uint32_t(row), t = r / size2;
    i2 = r - t * size2;
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
  return RowIndexer{uint32_t(l.sizes[1]), uint32_t(l.sizes[2]), l.sizes[0] == 1 && l.sizes[1] == 1};
}

inline RowOffsets row_offsets(const detail::RowStrides& s) { return RowOffsets{s.s[0], s.s[1], s.s[2]}; }

// ---------------------------------------------------------------- reductions

// Sum over the `width` consecutive lanes (a power of two <= 32) that share a row.
// N independent sums at once: their shuffles interleave instead of waiting on each other.
template <int N>
__device__ __forceinline__ void lane_group_sums(float (&v)[N], int width) {
  for (int off = width >> 1; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
  }
}

__device__ __forceinline__ float lane_group_sum(float v, int width) {
  float sums[1] = {v};
  lane_group_sums(sums, width);
  return sums[0];
}

// Sums over the `tpr` threads of one row, rows laid out along threadIdx.x (row r owns threads
// [r * tpr, (r + 1) * tpr)), of N values at once. tpr is a power of two <= 32 (shuffles within
// the warp) or a multiple of 32: shuffles, one barrier through `scratch` (N arrays of one float
// per warp of the block, `stride` floats apart), then each group of `width` lanes (the row's
// warp count rounded up to a power of two) reads the row's warp sums, one per lane, and combines
// them by shuffles, so every lane ends with the totals after log2(width) steps instead of a loop
// over the warps. Rows of several warps share a block only when tpr is a power of two. Every
// thread of the block must call it. A kernel that reduces more than once uses separate scratch
// arrays per reduction, so no barrier is needed before the writes.
template <int N>
__device__ __forceinline__ void row_sums(float (&v)[N], int tpr, float* scratch, int stride) {
  if (tpr <= 32) {
    lane_group_sums(v, tpr);
    return;
  }
  lane_group_sums(v, 32);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i * stride + warp] = v[i];
  }
  __syncthreads();
  const int warps = tpr >> 5, first = tpr == int(blockDim.x) ? 0 : warp & ~(warps - 1);
  const int width = 1 << (32 - __clz(warps - 1));  // power of two >= warps (warps >= 2)
  const int w = threadIdx.x & (width - 1);
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = w < warps ? scratch[i * stride + first + w] : 0.f;
  lane_group_sums(v, width);
}

__device__ __forceinline__ float row_sum(float v, int tpr, float* scratch) {
  float sums[1] = {v};
  row_sums(sums, tpr, scratch, 0);
  return sums[0];
}

// ---------------------------------------------------------------- programmatic dependent launch
// Kernels launched with `launch` may start while the previous kernel of the stream drains
// (sm_90+). Each kernel computes its addresses, calls pdl_wait() before its first access to
// global memory (which then sees everything the previous kernel wrote), and pdl_release()
// once its loads are issued, so the next kernel can be scheduled early. Both are no-ops on
// older architectures and when the kernel was launched without the attribute.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// ---------------------------------------------------------------- dispatch

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat16: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
    case DType::kInt32:
    case DType::kInt64:
      throw Error(ErrorKind::kInvalidArgument, "fusebox: internal error: an integer tensor reached a kernel's dtype dispatch");
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

// The current device's index; fails with a clear error past the devices a PerDevice holds.
int current_device();

// A value for each device, computed by `init(device)` on the current device's first `get`.
template <typename T>
class PerDevice {
 public:
  static constexpr int kMaxDevices = 64;
  template <typename Init>
  const T& get(Init&& init) {
    const int device = current_device();
    std::call_once(once_[device], [&] { values_[device] = init(device); });
    return values_[device];
  }

 private:
  T values_[kMaxDevices] = {};
  std::once_flag once_[kMaxDevices];
};

// Limits of the current device that launch plans use (queried once per device).
struct DeviceLimits {
  int major = 0;        // compute capability
  int sm_count = 0;
  int threads_per_sm = 0;  // resident threads per SM (2048 on sm_80/sm_90, 1024 on sm_75)
  int smem_optin = 0;   // max dynamic shared memory per block after opt-in
  int smem_per_sm = 0;
  double dram_bytes_per_s = 0;  // peak, from the memory clock and bus width (0: not reported)
  // Threads the whole GPU holds at once: one full wave of the launch plans' thresholds.
  int64_t resident_threads() const { return int64_t(sm_count) * threads_per_sm; }
};
const DeviceLimits& device_limits();

// Lets `kernel` take `bytes` of dynamic shared memory (above the default 48 KB); fails with a
// clear error where the device has less.
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  FUSEBOX_CHECK(bytes <= size_t(device_limits().smem_optin), "this launch needs ", bytes,
                " bytes of shared memory; the GPU allows ", device_limits().smem_optin);
  FUSEBOX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// Launch-plan overrides from the environment for tuning runs (scripts/tune.py), read once per
// process: a knob is unset unless its variable is set. Plain reads after the first call.
struct TuningKnobs {
  std::optional<int> norm_items;      // FUSEBOX_NORM_ITEMS: vectors per thread (1, 2, 4; 3 for 16-bit rows
                                      // with fp32 modulation; 8 without a residual)
  std::optional<int> norm_row_iters;  // FUSEBOX_NORM_ROW_ITERS: row groups per block (1-8)
  std::optional<int> norm_stage;      // FUSEBOX_NORM_STAGE: small operands through shared memory
  std::optional<int> rope_items;      // FUSEBOX_ROPE_ITEMS: heads per lane group (1, 2 or 4); units a
                                      // thread of rows across heads up to 512 units (1 or 4)
  std::optional<int> rope_early;      // FUSEBOX_ROPE_EARLY: 0: rotation factors loaded after the sum (wide
                                      // rows; the short kernel's half-split units with a norm); 1: with
                                      // the data
  std::optional<int> act_flat;        // FUSEBOX_ACT_FLAT: packed rows as one long row (0 or 1)
  std::optional<int> norm_flat;       // FUSEBOX_NORM_FLAT=0: norm rows never take their flat twin
  std::optional<int> norm_short;      // FUSEBOX_NORM_SHORT=0: short rows take the general 1-vector plan
  std::optional<int> rope_short;      // FUSEBOX_ROPE_SHORT=0: no short rotary kernel (the per-head or rows
                                      // kernel); 2: rows across heads take it at any size
  std::optional<int> add_flat;        // FUSEBOX_ADD_FLAT: the residual add alone as an elementwise pass of
                                      // 1 (default) or 2 vectors a thread; 0: the row kernel
  std::optional<int> moe_items;       // FUSEBOX_MOE_ITEMS: the combine's vectors a thread (1, 2 or 4)
  std::optional<int> moe_chunk;       // FUSEBOX_MOE_CHUNK: the combine's threads a column chunk (32, 64,
                                      // 128 or 256), spreading a token's row over more blocks; 0: the
                                      // widest chunks (the plan of grids of at least one block an SM)
  std::optional<int> moe_stage;       // FUSEBOX_MOE_STAGE=0: the combine holds rows in registers, never
                                      // staging them through shared memory
  std::optional<int> moe_sort_tile;   // FUSEBOX_MOE_SORT_TILE: the sort's pairs a block at least (larger
                                      // than the index: one block sorts it in one launch)
  std::optional<int> moe_sort_warps;  // FUSEBOX_MOE_SORT_WARPS: the warps of each block of a sort over many
                                      // blocks (1-32)
  std::optional<int> moe_sort_cluster;  // FUSEBOX_MOE_SORT_CLUSTER: the most blocks of the sort's cluster (2-16,
                                        // sm_90+); 0: tiles in two launches instead
  std::optional<int> moe_sort_grid;   // FUSEBOX_MOE_SORT_GRID: 1 / 0, a sort of several tiles outside a
                                      // cluster in one cooperative launch (a grid barrier) or two (default:
                                      // one where launches use programmatic dependent launch)
  std::optional<int> moe_sort_small;  // FUSEBOX_MOE_SORT_SMALL: the most pairs the decode sorts take
                                      // (default and most 128: up to 32 by shuffles, past that ranked
                                      // through shared memory); 0: none
};
const TuningKnobs& tuning_knobs();

// Whether launches use programmatic dependent launch: on sm_90+, unless FUSEBOX_PDL=0.
bool use_pdl();

// How a kernel launches: programmatic stream serialization (`pdl`), clusters of `cluster` blocks
// along x when above 1 (sm_90+), all blocks resident at once (`cooperative`: a grid barrier).
struct LaunchOptions {
  bool pdl = false;
  unsigned cluster = 1;
  bool cooperative = false;
};

// Launches `kernel<<<grid, block, smem, stream>>>(args...)` as `o` says, and checks the launch.
template <typename... KernelArgs, typename... Args>
void launch_with(LaunchOptions o, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                 cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  cfg.attrs = attr;
  if (o.pdl) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (o.cluster > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs++].val.clusterDim = {o.cluster, 1, 1};
  }
  if (o.cooperative) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeCooperative;
    attr[cfg.numAttrs++].val.cooperative = 1;
  }
  FUSEBOX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// The launch of every fusebox kernel: programmatic dependent launch where use_pdl() says so.
template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  launch_with(LaunchOptions{use_pdl()}, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// How a row's vectors spread over the threads of its blocks: `tpr` threads (a row's share of
// a block) each take `items` vectors of each of `chunks` column chunks.
struct ColumnSplit {
  int tpr;
  int64_t chunks;
  int64_t idle(int64_t vec_per_row, int items) const { return chunks * tpr * items - vec_per_row; }
};

// Rows of more than 32 threads' work are cut into the fewest chunks of at most `block_threads`
// threads, each a whole number of warps, sized alike, so the last chunk leaves few threads idle
// (Wan 1.3B's 1120-vector rows with 2 vectors a thread: 3 chunks of 192 threads, 32 slots idle,
// where power-of-two chunks of 256 left 416; gelu_tanh + bias 303.3 -> 291.1 us, Wan 14B 449.4
// -> 447.2, bench/results/2026-11-26_h200_ca4d16f/tune/act_column_chunks_vs_eccd7ef.txt).
// Narrower rows take a power of two of threads, stacked several to a block; one long (flat) row
// takes full blocks.
inline ColumnSplit column_split(int64_t vec_per_row, int items, bool flat, int block_threads) {
  const int64_t need = (vec_per_row + items - 1) / items;  // threads for the whole row
  if (flat || need <= 32) {
    const int tpr = int(std::min<int64_t>(next_pow2(need), block_threads));
    return {tpr, (need + tpr - 1) / tpr};
  }
  const int64_t chunks = (need + block_threads - 1) / block_threads;
  const int tpr = int(((need + chunks - 1) / chunks + 31) / 32 * 32);
  return {tpr, chunks};
}

}  // namespace fusebox::cuda
