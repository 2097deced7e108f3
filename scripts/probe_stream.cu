// How close a plain SM kernel gets to the driver's device copy (cudaMemcpyAsync, what
// `fusebox bench` calls copy bandwidth) at the sizes where the fused ops stream: copy kernels of
// 16-byte vectors, V a thread, one-shot grids (a block per tile, all loads before the stores) or
// persistent grid-stride loops, and a minimal RMS-norm row kernel (a row a block, loads, one block
// sum, stores) at widths 1536-4096, as written and with the next row's loads in flight during a
// row's sum and stores (a resident grid, rows staged by cp.async). Times as the bench does (L2
// flushed, CUDA events, median); the two row kernels' outputs are compared bit for bit first.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc/include -Icsrc scripts/probe_stream.cu -o build/probe_stream
// Run:   build/probe_stream   (one table: us and the ratio to cudaMemcpyAsync of the same bytes)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common/cuda_common.cuh"
#include "probe_timer.cuh"

namespace {

constexpr int kThreads = 256;

// Every load of a thread's V vectors of a tile, then every store: the bytes in flight a thread
// are 16 V.
template <int V>
__device__ __forceinline__ void copy_tile(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t tile,
                                          size_t n) {
  const size_t base = tile * kThreads * V + threadIdx.x;
  uint4 r[V];
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (base + i * kThreads < n) r[i] = src[base + i * kThreads];
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (base + i * kThreads < n) dst[base + i * kThreads] = r[i];
}

// A block a tile.
template <int V>
__global__ void __launch_bounds__(kThreads) copy_oneshot(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                         size_t n) {
  copy_tile<V>(src, dst, blockIdx.x, n);
}

// A resident grid striding over the tiles.
template <int V>
__global__ void __launch_bounds__(kThreads) copy_strided(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                         size_t n) {
  for (size_t tile = blockIdx.x; tile * kThreads * V < n; tile += gridDim.x) copy_tile<V>(src, dst, tile, n);
}

// A bf16 row of blockDim.x * V vectors normalized in place (RMS, no weight): square-sum, warp
// sums into `partial` (a float a warp), one barrier, the block's sum, scale. The library's pack
// conversions and lane sums; the vectors stay uint4 so the loads and stores are plain copies'.
template <int V>
__device__ __forceinline__ void rms_normalize(uint4 (&r)[V], float* partial, float eps) {
  using Bf16x8 = fusebox::cuda::Pack<__nv_bfloat16, 8>;
  static_assert(sizeof(Bf16x8) == sizeof(uint4), "a vector is 8 bf16");
  float x[V][8];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    Bf16x8 v;
    memcpy(&v, &r[i], sizeof(v));
    fusebox::cuda::unpack(v, x[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += x[i][j] * x[i][j];
  }
  ss = fusebox::cuda::lane_group_sum(ss, 32);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += partial[w];
  const float scale = rsqrtf(total / float(blockDim.x * V * 8) + eps);
#pragma unroll
  for (int i = 0; i < V; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[i][j] *= scale;
    const Bf16x8 v = fusebox::cuda::pack<__nv_bfloat16, 8>(x[i]);
    memcpy(&r[i], &v, sizeof(v));
  }
}

// The least a row kernel does: a row a block, its loads, the normalization, its stores.
template <int V>
__global__ void __launch_bounds__(512) rms_rows(const uint4* __restrict__ src, uint4* __restrict__ dst, float eps) {
  __shared__ float partial[16];
  const size_t base = size_t(blockIdx.x) * blockDim.x * V + threadIdx.x;
  uint4 r[V];
#pragma unroll
  for (int i = 0; i < V; ++i) r[i] = src[base + i * blockDim.x];
  rms_normalize<V>(r, partial, eps);
#pragma unroll
  for (int i = 0; i < V; ++i) dst[base + i * blockDim.x] = r[i];
}

// The same row norm with the next row's loads in flight while this row is summed and written:
// a resident grid, each block's rows a grid apart, every row copied by cp.async into one of two
// shared-memory stages (a thread's own slots, so only the block sum needs a barrier). Its own
// cp.async wrappers: two stages need commit groups and a wait for all but the newest, where the
// library's async_copy_pack / async_copy_wait wait for everything; .cg keeps the rows out of L1.
__device__ __forceinline__ void cp_async16(uint4* smem, const uint4* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

template <int V>
__global__ void __launch_bounds__(512) rms_rows_pipelined(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                          int rows, float eps) {
  extern __shared__ uint4 stage[];  // [2][V][blockDim.x]
  __shared__ float partial[2][16];
  const int threads = blockDim.x, per_row = threads * V, tid = threadIdx.x;
  auto issue = [&](int row, int buf) {
#pragma unroll
    for (int i = 0; i < V; ++i)
      cp_async16(&stage[(buf * V + i) * threads + tid], src + size_t(row) * per_row + i * threads + tid);
  };
  int row = blockIdx.x, buf = 0;
  if (row < rows) issue(row, 0);
  cp_async_commit();
  for (int n = 0; row < rows; row += gridDim.x, buf ^= 1, ++n) {
    if (row + int(gridDim.x) < rows) issue(row + gridDim.x, buf ^ 1);
    cp_async_commit();  // (an empty group after the last row keeps the count)
    cp_async_wait_one();
    uint4 r[V];
#pragma unroll
    for (int i = 0; i < V; ++i) r[i] = stage[(buf * V + i) * threads + tid];
    // (the barrier inside orders this row's partials before their reuse two rows on)
    rms_normalize<V>(r, partial[n & 1], eps);
#pragma unroll
    for (int i = 0; i < V; ++i) dst[size_t(row) * per_row + i * threads + tid] = r[i];
  }
}

// Finite bf16 values in [-2, 2) from a hash of the element index.
__global__ void fill_random(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ unsigned(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(float(h >> 8) * (4.f / 16777216.f) - 2.f);
  }
}

}  // namespace

int main() {
  cudaStream_t s;
  FUSEBOX_CUDA_CHECK(cudaStreamCreate(&s));
  probe::Timer t(s);
  int sms = 0;
  FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  FUSEBOX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, sms);
  const size_t max_half = size_t(264) << 20;
  uint4 *src, *dst;
  FUSEBOX_CUDA_CHECK(cudaMalloc(&src, max_half));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&dst, max_half));
  fill_random<<<sms * 8, 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(src), max_half / 2);
  {  // the pipelined rows against the plain ones, 4096 wide, bit for bit
    const int width = 4096, rows = int(max_half / 2 / width), threads = width / 8;
    uint4* ref;
    FUSEBOX_CUDA_CHECK(cudaMalloc(&ref, max_half));
    rms_rows<1><<<rows, threads, 0, s>>>(src, ref, 1e-6f);
    rms_rows_pipelined<1><<<sms * 2, threads, size_t(2) * width * 2, s>>>(src, dst, rows, 1e-6f);
    std::vector<unsigned char> a(max_half), b(max_half);
    FUSEBOX_CUDA_CHECK(cudaMemcpyAsync(a.data(), ref, max_half, cudaMemcpyDeviceToHost, s));
    FUSEBOX_CUDA_CHECK(cudaMemcpyAsync(b.data(), dst, max_half, cudaMemcpyDeviceToHost, s));
    FUSEBOX_CUDA_CHECK(cudaStreamSynchronize(s));
    FUSEBOX_CUDA_CHECK(cudaFree(ref));
    const bool same = a == b;
    std::printf("pipelined rows %s the plain rows (%d rows of %d)\n", same ? "match" : "DIFFER from", rows, width);
    if (!same) return 1;
  }

  std::printf("%-28s", "kernel \\ MB moved");
  const std::vector<size_t> halves_mb = {33, 67, 113, 264};  // half the bytes a case moves
  for (size_t h : halves_mb) std::printf(" %16zu", 2 * h);
  std::printf("\n");
  std::vector<double> memcpy_us;
  auto row = [&](const std::string& name, const std::function<void(size_t)>& launch) {
    std::printf("%-28s", name.c_str());
    for (size_t k = 0; k < halves_mb.size(); ++k) {
      const size_t bytes = halves_mb[k] << 20;
      const double us = t.median_us([&] { launch(bytes); }, true, 120);
      if (memcpy_us.size() < halves_mb.size()) memcpy_us.push_back(us);
      std::printf("  %7.2f (%.3fx)", us, us / memcpy_us[k]);
    }
    std::printf("\n");
    FUSEBOX_CUDA_CHECK(cudaGetLastError());
  };
  row("cudaMemcpyAsync", [&](size_t b) { cudaMemcpyAsync(dst, src, b, cudaMemcpyDeviceToDevice, s); });
  auto oneshot = [&](auto kernel, int v) {
    return [=](size_t b) {
      const size_t n = b / 16;
      kernel<<<unsigned((n + size_t(kThreads) * v - 1) / (size_t(kThreads) * v)), kThreads, 0, s>>>(src, dst, n);
    };
  };
  row("one-shot, 1 vector", oneshot(copy_oneshot<1>, 1));
  row("one-shot, 2 vectors", oneshot(copy_oneshot<2>, 2));
  row("one-shot, 4 vectors", oneshot(copy_oneshot<4>, 4));
  row("one-shot, 8 vectors", oneshot(copy_oneshot<8>, 8));
  for (int per_sm : {4, 8}) {
    auto strided = [&, per_sm](auto kernel) {
      return [=](size_t b) { kernel<<<sms * per_sm, kThreads, 0, s>>>(src, dst, b / 16); };
    };
    row("strided, 4 vec, " + std::to_string(per_sm) + " blocks/SM", strided(copy_strided<4>));
    row("strided, 8 vec, " + std::to_string(per_sm) + " blocks/SM", strided(copy_strided<8>));
  }
  for (int width : {1536, 2048, 4096}) {
    for (int v : {1, 2, 4}) {
      const int threads = width / 8 / v;
      if (threads < 32 || threads > 512 || threads % 32) continue;
      auto launch = [&, width, v, threads](size_t b) {
        const unsigned rows = unsigned(b / 2 / width);
        if (v == 1) rms_rows<1><<<rows, threads, 0, s>>>(src, dst, 1e-6f);
        if (v == 2) rms_rows<2><<<rows, threads, 0, s>>>(src, dst, 1e-6f);
        if (v == 4) rms_rows<4><<<rows, threads, 0, s>>>(src, dst, 1e-6f);
      };
      row("rms rows " + std::to_string(width) + ", " + std::to_string(v) + " vec x " + std::to_string(threads), launch);
    }
    for (int v : {1, 2}) {
      const int threads = width / 8 / v;
      if (threads < 32 || threads > 512 || threads % 32) continue;
      const size_t smem = size_t(2) * width * 2;  // two rows of bf16
      auto kernel = v == 1 ? rms_rows_pipelined<1> : rms_rows_pipelined<2>;
      int per_sm = 0;
      FUSEBOX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      auto launch = [&, width, threads, smem, kernel, per_sm](size_t b) {
        const int rows = int(b / 2 / width);
        kernel<<<std::min(rows, sms * per_sm), threads, smem, s>>>(src, dst, rows, 1e-6f);
      };
      const std::string name = "pipelined " + std::to_string(width) + ", " + std::to_string(v) + " vec x ";
      row(name + std::to_string(threads) + ", " + std::to_string(per_sm) + "/SM", launch);
    }
  }
  return 0;
}
