// Where the fixed cost of a short fusebox launch goes: times, the way `fusebox bench` does
// (CUDA events around each call, L2 flushed before it, the GPU held busy while the calls are
// enqueued so host time never shows), an empty kernel and a minimal one-vector RMS-norm row
// kernel launched with and without programmatic dependent launch and with small or large
// argument structs, beside fusebox's own rms_norm through the C++ API.
//
// Build (after scripts/build.sh): nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc/include -Icsrc
//   scripts/probe_launch.cu build/gpu/libfusebox_core.a -o build/gpu/probe_launch
// Run: build/gpu/probe_launch   (FUSEBOX_PDL=0 turns PDL off for the fusebox rows);
//      build/gpu/probe_launch placement   (operands in one 2 MB page or apart)
// -DPROBE_BLOAT_KERNELS=N compiles N large unused kernels (about 30 KB of code each) into the
// probe's module, beside the mini kernels: whether a kernel's module size moves its launch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_common.cuh"
#include "fusebox/fusebox.h"
#include "probe_timer.cuh"

namespace {

template <int PAD>
struct EmptyArgs {
  float* p;
  char pad[PAD];
};

template <int PAD, bool PDL>
__global__ void empty_kernel(const EmptyArgs<PAD> a) {
  if constexpr (PDL) fusebox::cuda::pdl_wait();
  if (threadIdx.x == 1000) *a.p = 1.f;
}

template <int PAD>
struct RmsArgs {
  const __nv_bfloat16* x;
  const __nv_bfloat16* w;
  __nv_bfloat16* out;
  int width;
  float eps;
  char pad[PAD];
};

// The same five arguments 64 bytes apart: each on its own line of the constant bank that holds
// kernel arguments, as in a large argument struct whose fields a kernel reads from all over it.
struct RmsSpreadArgs {
  const __nv_bfloat16* x;
  char pad0[56];
  const __nv_bfloat16* w;
  char pad1[56];
  __nv_bfloat16* out;
  char pad2[56];
  int width;
  char pad3[60];
  float eps;
  char pad4[60];
};

// One bf16 row per block, one 16-byte vector per thread: the least a one-vector RMS row kernel
// does. `bias` (0 in practice) lets a caller make the result depend on extra work. PDL 1 waits
// on the previous grid; 2 also lets the next grid launch once the loads are issued.
template <int PDL, typename Args, int SMEM_FLOATS = 16>
__device__ __forceinline__ void rms_row(const Args& a, float bias = 0.f) {
  __shared__ float warp_sums[SMEM_FLOATS];
  if constexpr (PDL > 0) fusebox::cuda::pdl_wait();
  const size_t base = size_t(blockIdx.x) * a.width + threadIdx.x * 8;
  const uint4 xv = *reinterpret_cast<const uint4*>(a.x + base);
  const uint4 wv = *reinterpret_cast<const uint4*>(a.w + threadIdx.x * 8);
  if constexpr (PDL > 1) fusebox::cuda::pdl_release();
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv.x, wv.y, wv.z, wv.w};
  float v[8], acc = bias;
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(xs[i] << 16);
    v[2 * i + 1] = __uint_as_float(xs[i] & 0xffff0000u);
  }
  for (int i = 0; i < 8; ++i) acc += v[i] * v[i];
  for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(~0u, acc, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  float total = (threadIdx.x & 31) < warps ? warp_sums[threadIdx.x & 31] : 0.f;
  for (int off = 16; off; off >>= 1) total += __shfl_xor_sync(~0u, total, off);
  const float rstd = rsqrtf(total / a.width + a.eps);
  uint32_t o[4];
  for (int i = 0; i < 4; ++i) {
    const float w0 = __uint_as_float(ws[i] << 16), w1 = __uint_as_float(ws[i] & 0xffff0000u);
    const __nv_bfloat162 r = __floats2bfloat162_rn(v[2 * i] * rstd * w0, v[2 * i + 1] * rstd * w1);
    memcpy(&o[i], &r, 4);
  }
  *reinterpret_cast<uint4*>(a.out + base) = make_uint4(o[0], o[1], o[2], o[3]);
}

template <int PAD, int PDL>
__global__ void __launch_bounds__(512) mini_rms_kernel(const RmsArgs<PAD> a) {
  rms_row<PDL>(a);
}

// The minimal kernel with what fusebox's one-vector rows decide at run time, one at a time
// (GEN bits): 1 the weight's and bias's presence (null checks around their loads), 2 the
// cross-warp sum over a run-time thread count (fusebox::cuda::row_sum), 4 the output dtype (a
// branch between a bf16 and an fp32 store); and what its loads and launch do: 8 the loads
// through the read-only path (ld.global.nc, as fusebox's load_pack), 16 programmatic dependent
// launch (wait first, release after the loads, launched with the attribute).
struct GenArgs {
  const __nv_bfloat16* x;
  const __nv_bfloat16* w;
  const __nv_bfloat16* b;
  void* out;
  int width;
  float eps;
  int tpr;
  bool out_f32;
};

template <int GEN>
__global__ void __launch_bounds__(512) mini_rms_general_kernel(const GenArgs a) {
  __shared__ float warp_sums[64];
  if constexpr ((GEN & 16) != 0) fusebox::cuda::pdl_wait();
  const size_t base = size_t(blockIdx.x) * a.width + threadIdx.x * 8;
  auto load = [](const __nv_bfloat16* p) {
    if constexpr ((GEN & 8) != 0) return __ldg(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<const uint4*>(p);
  };
  const uint4 xv = load(a.x + base);
  uint4 wv = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u), bv = make_uint4(0, 0, 0, 0);
  if (!(GEN & 1) || a.w) wv = load(a.w + threadIdx.x * 8);
  if ((GEN & 1) && a.b) bv = load(a.b + threadIdx.x * 8);
  if constexpr ((GEN & 16) != 0) fusebox::cuda::pdl_release();
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv.x, wv.y, wv.z, wv.w},
                 bs[4] = {bv.x, bv.y, bv.z, bv.w};
  float v[8], acc = 0.f;
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(xs[i] << 16);
    v[2 * i + 1] = __uint_as_float(xs[i] & 0xffff0000u);
  }
  for (int i = 0; i < 8; ++i) acc += v[i] * v[i];
  float total;
  if constexpr ((GEN & 2) != 0) {
    total = fusebox::cuda::row_sum(acc, a.tpr, warp_sums);
  } else {
    for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(~0u, acc, off);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    total = (threadIdx.x & 31) < warps ? warp_sums[threadIdx.x & 31] : 0.f;
    for (int off = 16; off; off >>= 1) total += __shfl_xor_sync(~0u, total, off);
  }
  const float rstd = rsqrtf(total / a.width + a.eps);
  float r[8];
  for (int i = 0; i < 4; ++i) {
    r[2 * i] = v[2 * i] * rstd * __uint_as_float(ws[i] << 16) + __uint_as_float(bs[i] << 16);
    r[2 * i + 1] = v[2 * i + 1] * rstd * __uint_as_float(ws[i] & 0xffff0000u) + __uint_as_float(bs[i] & 0xffff0000u);
  }
  if ((GEN & 4) && a.out_f32) {
    float4* o = reinterpret_cast<float4*>(static_cast<float*>(a.out) + base);
    o[0] = make_float4(r[0], r[1], r[2], r[3]);
    o[1] = make_float4(r[4], r[5], r[6], r[7]);
    return;
  }
  uint32_t o[4];
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(r[2 * i], r[2 * i + 1]);
    memcpy(&o[i], &h, 4);
  }
  *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + base) = make_uint4(o[0], o[1], o[2], o[3]);
}

// fusebox's row kernels hold a 256-byte static shared array (two 32-float reduction slots).
__global__ void __launch_bounds__(512) mini_rms_smem256_kernel(const RmsArgs<8> a) { rms_row<0, RmsArgs<8>, 64>(a); }

__global__ void __launch_bounds__(512) mini_rms_spread_kernel(const RmsSpreadArgs a) { rms_row<0>(a); }

// The minimal kernel with the output row's line prefetched to L2 before the loads: the store's
// address translation then happens while the loads are in flight, not after the reduction.
__global__ void __launch_bounds__(512) mini_rms_prefetch_out_kernel(const RmsArgs<8> a) {
  const __nv_bfloat16* o = a.out + size_t(blockIdx.x) * a.width + threadIdx.x * 8;
  asm volatile("prefetch.global.L2 [%0];" ::"l"(o));
  rms_row<0>(a);
}

// 256 extra integer instructions before the loads (four chains): as straight-line code
// (UNROLL, 4 KB more code to fetch) or as a loop of 64 iterations (a few instructions of code).
template <bool UNROLL>
__global__ void __launch_bounds__(512) mini_rms_extra_kernel(const RmsArgs<8> a) {
  uint32_t c0 = threadIdx.x, c1 = blockIdx.x, c2 = a.width, c3 = threadIdx.x ^ 5;
  if constexpr (UNROLL) {
#pragma unroll
    for (int i = 0; i < 64; ++i) c0 = c0 * 3u + c1, c1 = c1 * 5u + c2, c2 = c2 * 7u + c3, c3 = c3 * 9u + c0;
  } else {
#pragma unroll 1
    for (int i = 0; i < 64; ++i) c0 = c0 * 3u + c1, c1 = c1 * 5u + c2, c2 = c2 * 7u + c3, c3 = c3 * 9u + c0;
  }
  rms_row<0>(a, float((c0 ^ c1 ^ c2 ^ c3) == 0x12345u));  // 0 in practice, not provably
}

#ifndef PROBE_BLOAT_KERNELS
#define PROBE_BLOAT_KERNELS 0
#endif
// Never launched: only their code in this module counts.
template <int K>
__global__ void bloat_kernel(float* p) {
  float acc = p[threadIdx.x];
#pragma unroll
  for (int i = 0; i < 1000; ++i) acc = acc * (1.0001f + K * 1e-7f) + p[(threadIdx.x + i * (K + 1)) & 1023];
  p[threadIdx.x] = acc;
}

template <int... K>
int bloat_count(std::integer_sequence<int, K...>) {
  static const void* table[] = {nullptr, reinterpret_cast<const void*>(bloat_kernel<K>)...};
  int n = 0;
  for (const void* f : table) n += f != nullptr;
  return n;
}

fusebox::TensorView view(void* p, std::initializer_list<int64_t> shape) {
  return fusebox::make_view(p, fusebox::DType::kBFloat16, fusebox::Device::kCUDA, shape);
}

}  // namespace

// `probe_launch placement`: the minimal kernel and fusebox's rms_norm with x, the weight and
// the output in one 2 MB page or in pages 64 MB apart (whether a page's address translation,
// missed after the flush's 256 MB pass, sits on the call's path).
int placement(cudaStream_t s, probe::Timer& t) {
  char* base;
  FUSEBOX_CUDA_CHECK(cudaMalloc(&base, size_t(256) << 20));
  FUSEBOX_CUDA_CHECK(cudaMemset(base, 0x3f, size_t(256) << 20));
  const size_t MB = size_t(1) << 20;
  struct Place {
    const char* name;
    size_t x, w, out;
  };
  const Place places[] = {{"x, w, out in one page", 0, 1792 * 1024, MB},
                          {"w 64 MB apart", 0, 64 * MB, MB},
                          {"out 64 MB apart", 0, 1792 * 1024, 128 * MB},
                          {"x, w, out 64 MB apart", 0, 64 * MB, 128 * MB}};
  std::printf("| case | placement | kernel | flushed us | warm us |\n|---|---|---|---:|---:|\n");
  for (int nrows : {16, 128}) {
    const int width = 2048;
    const dim3 grid(nrows), block(width / 8);
    for (const Place& p : places) {
      auto* x = reinterpret_cast<__nv_bfloat16*>(base + p.x);
      auto* w = reinterpret_cast<__nv_bfloat16*>(base + p.w);
      auto* out = reinterpret_cast<__nv_bfloat16*>(base + p.out);
      const RmsArgs<8> args{x, w, out, width, 1e-6f, {}};
      const std::pair<const char*, std::function<void()>> kernels[] = {
          {"mini", [&] { fusebox::cuda::launch_pdl(false, mini_rms_kernel<8, 0>, grid, block, 0, s, args); }},
          {"mini, out prefetched", [&] { fusebox::cuda::launch_pdl(false, mini_rms_prefetch_out_kernel, grid, block, 0, s, args); }},
          {"fusebox rms_norm", [&] {
             fusebox::rms_norm(view(x, {nrows, width}), view(w, {width}), view(out, {nrows, width}), 1e-6f, 0.f, s);
           }}};
      for (const auto& k : kernels) {
        k.second();
        std::printf("| %dx%d | %s | %s | %.2f | %.2f |\n", nrows, width, p.name, k.first, t.median_us(k.second, true),
                    t.median_us(k.second, false));
      }
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  cudaStream_t s;
  FUSEBOX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  probe::Timer t(s);
  if (argc > 1 && std::string(argv[1]) == "placement") return placement(s, t);
  const int max_rows = 256, max_width = 4096;
  __nv_bfloat16 *x, *w, *out;
  FUSEBOX_CUDA_CHECK(cudaMalloc(&x, size_t(max_rows) * max_width * 2));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&out, size_t(max_rows) * max_width * 2));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&w, max_width * 2));
  FUSEBOX_CUDA_CHECK(cudaMemset(x, 0x3f, size_t(max_rows) * max_width * 2));
  FUSEBOX_CUDA_CHECK(cudaMemset(w, 0x3f, max_width * 2));

  struct Row {
    std::string name;
    std::function<void()> fn;
  };
  std::vector<Row> rows;
  auto add = [&](std::string n, std::function<void()> f) { rows.push_back({std::move(n), std::move(f)}); };
  add("empty, 8 B args", [&] { fusebox::cuda::launch_pdl(false, empty_kernel<8, false>, 1, 32, 0, s, EmptyArgs<8>{t.sink, {}}); });
  add("empty, 8 B args, PDL", [&] { fusebox::cuda::launch_pdl(true, empty_kernel<8, true>, 1, 32, 0, s, EmptyArgs<8>{t.sink, {}}); });
  add("empty, 384 B args", [&] { fusebox::cuda::launch_pdl(false, empty_kernel<384, false>, 1, 32, 0, s, EmptyArgs<384>{t.sink, {}}); });
  add("empty, 384 B args, PDL", [&] { fusebox::cuda::launch_pdl(true, empty_kernel<384, true>, 1, 32, 0, s, EmptyArgs<384>{t.sink, {}}); });
  for (int shape : {0, 1, 2}) {
    const int nrows = shape == 0 ? 1 : shape == 1 ? 16 : 256;
    const int width = shape == 1 ? 4096 : 2048;
    const std::string tag = std::to_string(nrows) + "x" + std::to_string(width);
    const dim3 grid(nrows), block(width / 8);
    add("mini rms " + tag, [=, &t] {
      fusebox::cuda::launch_pdl(false, mini_rms_kernel<8, 0>, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    add("mini rms " + tag + ", PDL", [=, &t] {
      fusebox::cuda::launch_pdl(true, mini_rms_kernel<8, 1>, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    add("mini rms " + tag + ", PDL + early trigger", [=, &t] {
      fusebox::cuda::launch_pdl(true, mini_rms_kernel<8, 2>, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    auto general = [=](auto kernel, bool pdl = false) {
      return [=] {
        fusebox::cuda::launch_pdl(pdl, kernel, grid, block, 0, s, GenArgs{x, w, nullptr, out, width, 1e-6f, int(block.x), false});
      };
    };
    add("mini rms " + tag + ", general: none", general(mini_rms_general_kernel<0>));
    add("mini rms " + tag + ", general: weight/bias presence", general(mini_rms_general_kernel<1>));
    add("mini rms " + tag + ", general: row_sum", general(mini_rms_general_kernel<2>));
    add("mini rms " + tag + ", general: output dtype", general(mini_rms_general_kernel<4>));
    add("mini rms " + tag + ", general: all three", general(mini_rms_general_kernel<7>));
    add("mini rms " + tag + ", general: read-only loads", general(mini_rms_general_kernel<8>));
    add("mini rms " + tag + ", general: PDL", general(mini_rms_general_kernel<16>, true));
    add("mini rms " + tag + ", general: read-only loads + PDL", general(mini_rms_general_kernel<24>, true));
    add("mini rms " + tag + ", general: all five", general(mini_rms_general_kernel<31>, true));
    add("mini rms " + tag + ", 256 B static shared", [=, &t] {
      fusebox::cuda::launch_pdl(false, mini_rms_smem256_kernel, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    add("mini rms " + tag + ", 384 B args", [=, &t] {
      fusebox::cuda::launch_pdl(false, mini_rms_kernel<384, 0>, grid, block, 0, s, RmsArgs<384>{x, w, out, width, 1e-6f, {}});
    });
    add("mini rms " + tag + ", args on 5 lines", [=, &t] {
      RmsSpreadArgs a{};
      a.x = x, a.w = w, a.out = out, a.width = width, a.eps = 1e-6f;
      fusebox::cuda::launch_pdl(false, mini_rms_spread_kernel, grid, block, 0, s, a);
    });
    add("mini rms " + tag + ", +256 instructions unrolled", [=, &t] {
      fusebox::cuda::launch_pdl(false, mini_rms_extra_kernel<true>, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    add("mini rms " + tag + ", +256 instructions in a loop", [=, &t] {
      fusebox::cuda::launch_pdl(false, mini_rms_extra_kernel<false>, grid, block, 0, s, RmsArgs<8>{x, w, out, width, 1e-6f, {}});
    });
    add("fusebox rms_norm " + tag, [=] {
      fusebox::rms_norm(view(x, {nrows, width}), view(w, {width}), view(out, {nrows, width}), 1e-6f, 0.f, s);
    });
  }
  for (auto& r : rows) r.fn();  // load modules, warm up
  FUSEBOX_CUDA_CHECK(cudaStreamSynchronize(s));
  const char* pdl = std::getenv("FUSEBOX_PDL");
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::printf("bloat kernels in the probe's module: %d, CUDA_MODULE_LOADING=%s\n",
              bloat_count(std::make_integer_sequence<int, PROBE_BLOAT_KERNELS>{}), loading ? loading : "(unset)");
  std::printf("FUSEBOX_PDL=%s\n| case | flushed us | warm us |\n|---|---:|---:|\n", pdl ? pdl : "(unset)");
  for (auto& r : rows)
    std::printf("| %s | %.2f | %.2f |\n", r.name.c_str(), t.median_us(r.fn, true), t.median_us(r.fn, false));
  return 0;
}
