// What the fixed cost of mid-size norm rows is made of: LayerNorm (weight + bias), bf16,
// D = 2048, two 8-element vectors a thread, 128 threads a row, from 512 to 16384 rows, timed with
// the L2 flushed by a read-only pass before each call and events around it (the last rows' writes
// then stay in L2, so times run under the bench's floor: compare the columns with each other):
//   A: one row a block, weight and bias read at their use, mean then variance (two barriers);
//      "held", "1-pass", "pdl": A with weight and bias loaded with the row, with one row sum of
//      the deviations from the row's first element and their squares, with programmatic
//      dependent launch; "all 3": the three together, the shape of fusebox's 2-vector plan
//   C: a persistent grid (resident blocks), rows strided by the grid, the next row's loads issued
//      before this row's reductions
//   fusebox: fusebox::layer_norm through the C++ API
// Build (after scripts/build.sh): nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc/include -Icsrc
//   scripts/probe_persistent_rows.cu build/gpu/libfusebox_core.a -o build/gpu/probe_persistent_rows
// Result (H100, bench/results/2026-11-26_h100_db0e32e/tune/probe_persistent_rows*.txt): C loses
// to A at every size but one (its loop costs 8 registers, 10 blocks an SM against 12); "all 3"
// is the fastest; fusebox at 5458512, the same algorithm, ran 0.6-2.1 us behind it from 1536 to
// 8192 rows. Its first load came 109 instructions in, against 12: hence the flat twins (db0e32e).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "common/cuda_common.cuh"
#include "fusebox/fusebox.h"
#include "probe_timer.cuh"


constexpr int D = 2048, VEC = 8, ITEMS = 2, TPR = D / VEC / ITEMS;  // 128

struct Row { uint4 v[ITEMS]; };

__device__ __forceinline__ void unpack(uint4 p, float (&f)[8]) {
  const uint32_t w[4] = {p.x, p.y, p.z, p.w};
  for (int i = 0; i < 4; ++i) { f[2 * i] = __uint_as_float(w[i] << 16); f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
}
__device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  uint32_t w[4];
  for (int i = 0; i < 4; ++i) { __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]); memcpy(&w[i], &h, 4); }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ Row load_row(const __nv_bfloat16* x, int64_t row) {
  Row r;
  const uint4* p = reinterpret_cast<const uint4*>(x + row * D);
  for (int it = 0; it < ITEMS; ++it) r.v[it] = __ldg(p + threadIdx.x + it * TPR);
  return r;
}
__device__ __forceinline__ float block_sum(float v, float* sm) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = (threadIdx.x & 31) < TPR / 32 ? sm[threadIdx.x & 31] : 0.f;
  for (int o = 2; o; o >>= 1) t += __shfl_xor_sync(~0u, t, o);
  return t;
}
struct Params { uint4 w[ITEMS], b[ITEMS]; };

__device__ __forceinline__ Params load_params(const __nv_bfloat16* w, const __nv_bfloat16* b) {
  Params p;
  for (int it = 0; it < ITEMS; ++it) {
    p.w[it] = __ldg(reinterpret_cast<const uint4*>(w) + threadIdx.x + it * TPR);
    p.b[it] = __ldg(reinterpret_cast<const uint4*>(b) + threadIdx.x + it * TPR);
  }
  return p;
}

// ONEPASS: mean and variance from one row sum of the deviations from the row's first element
// and their squares (one barrier); else the mean, then the squared deviations (two).
// held: weight and bias loaded with the row (else read at their use).
template <bool ONEPASS>
__device__ __forceinline__ void finish_row(const Row& r, int64_t row, const __nv_bfloat16* w, const __nv_bfloat16* b,
                                           __nv_bfloat16* y, float* sm, const Params* held = nullptr,
                                           float pivot = 0.f) {
  float v[ITEMS][8], mean, var;
  for (int it = 0; it < ITEMS; ++it) unpack(r.v[it], v[it]);
  if (ONEPASS) {
    float s = 0.f, q = 0.f;
    for (int it = 0; it < ITEMS; ++it)
      for (int i = 0; i < 8; ++i) { const float d = v[it][i] - pivot; s += d; q = fmaf(d, d, q); }
    for (int o = 16; o; o >>= 1) { s += __shfl_xor_sync(~0u, s, o); q += __shfl_xor_sync(~0u, q, o); }
    if ((threadIdx.x & 31) == 0) { sm[threadIdx.x >> 5] = s; sm[4 + (threadIdx.x >> 5)] = q; }
    __syncthreads();
    const bool in = (threadIdx.x & 31) < TPR / 32;
    s = in ? sm[threadIdx.x & 31] : 0.f;
    q = in ? sm[4 + (threadIdx.x & 31)] : 0.f;
    for (int o = 2; o; o >>= 1) { s += __shfl_xor_sync(~0u, s, o); q += __shfl_xor_sync(~0u, q, o); }
    const float md = s * (1.f / D);
    mean = pivot + md;
    var = fmaxf(q * (1.f / D) - md * md, 0.f);
  } else {
    float s = 0.f, q = 0.f;
    for (int it = 0; it < ITEMS; ++it) for (int i = 0; i < 8; ++i) s += v[it][i];
    mean = block_sum(s, sm) * (1.f / D);
    for (int it = 0; it < ITEMS; ++it) for (int i = 0; i < 8; ++i) q += (v[it][i] - mean) * (v[it][i] - mean);
    var = block_sum(q, sm + 4) * (1.f / D);
  }
  const float rstd = rsqrtf(var + 1e-6f);
  for (int it = 0; it < ITEMS; ++it) {
    const int vi = threadIdx.x + it * TPR;
    float wf[8], bf[8], o[8];
    unpack(held ? held->w[it] : __ldg(reinterpret_cast<const uint4*>(w) + vi), wf);
    unpack(held ? held->b[it] : __ldg(reinterpret_cast<const uint4*>(b) + vi), bf);
    for (int i = 0; i < 8; ++i) o[i] = (v[it][i] - mean) * rstd * wf[i] + bf[i];
    reinterpret_cast<uint4*>(y + row * D)[vi] = pack(o);
  }
}

// A and its variants: HELD (weight and bias loaded with the row), ONEPASS (one row sum), PDL
// (griddepcontrol.wait before the loads and launch_dependents after them, launched with
// programmatic stream serialization, as fusebox's kernels are).
template <bool HELD, bool ONEPASS, bool PDL>
__global__ void __launch_bounds__(TPR) ln_rows_a(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* b,
                                                 __nv_bfloat16* y, int rows) {
  __shared__ float sm[2][8];
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  const Row r = load_row(x, blockIdx.x);
  Params p;
  if (HELD) p = load_params(w, b);
  const float pivot = ONEPASS ? __bfloat162float(x[int64_t(blockIdx.x) * D]) : 0.f;
  if (PDL) asm volatile("griddepcontrol.launch_dependents;" :::);
  finish_row<ONEPASS>(r, blockIdx.x, w, b, y, &sm[0][0], HELD ? &p : nullptr, pivot);
}

template <bool PREFETCH>
__global__ void __launch_bounds__(TPR) ln_rows_p(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* b,
                                                 __nv_bfloat16* y, int rows) {
  __shared__ float sm[2][2][8];
  int row = blockIdx.x, k = 0;
  if (row >= rows) return;
  Row cur = load_row(x, row);
  for (; row < rows; row += gridDim.x, ++k) {
    Row nxt{};
    const int next = row + gridDim.x;
    if (PREFETCH && next < rows) nxt = load_row(x, next);
    finish_row<false>(cur, row, w, b, y, &sm[k & 1][0][0]);
    if (!PREFETCH && next < rows) nxt = load_row(x, next);
    cur = nxt;
  }
}

__global__ void empty_kernel() {}

template <typename K>
void launch(K kernel, int grid, bool pdl, cudaStream_t s, const __nv_bfloat16* x, const __nv_bfloat16* w,
            const __nv_bfloat16* b, __nv_bfloat16* y, int rows) {
  fusebox::cuda::launch_pdl(pdl, kernel, dim3(grid), dim3(TPR), 0, s, x, w, b, y, rows);
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int sms = 0;
  FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  FUSEBOX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  auto regs = [](auto k) { cudaFuncAttributes a; FUSEBOX_CUDA_CHECK(cudaFuncGetAttributes(&a, k)); return a.numRegs; };
  int occ_c = 0;
  FUSEBOX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_c, ln_rows_p<true>, TPR, 0));
  printf("%s, %d SMs; registers: A %d, A held %d, A one-pass %d, A pdl %d, A all three %d, C %d (%d blocks/SM)\n",
         prop.name, sms, regs(ln_rows_a<false, false, false>), regs(ln_rows_a<true, false, false>),
         regs(ln_rows_a<false, true, false>), regs(ln_rows_a<false, false, true>), regs(ln_rows_a<true, true, true>),
         regs(ln_rows_p<true>), occ_c);
  const int max_rows = 16384;
  __nv_bfloat16 *x, *y, *w, *b;
  FUSEBOX_CUDA_CHECK(cudaMalloc(&x, size_t(max_rows) * D * 2));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&y, size_t(max_rows) * D * 2));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&w, D * 2));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&b, D * 2));
  {  // inputs: bf16 of small varied values
    std::vector<uint16_t> h(size_t(max_rows) * D);
    for (size_t i = 0; i < h.size(); ++i) h[i] = 0x3f80 + uint16_t((i * 2654435761u) >> 25);
    FUSEBOX_CUDA_CHECK(cudaMemcpy(x, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    FUSEBOX_CUDA_CHECK(cudaMemcpy(w, h.data(), D * 2, cudaMemcpyHostToDevice));
    FUSEBOX_CUDA_CHECK(cudaMemcpy(b, h.data() + D, D * 2, cudaMemcpyHostToDevice));
  }
  cudaStream_t s;
  FUSEBOX_CUDA_CHECK(cudaStreamCreate(&s));
  probe::Timer timer(s);
  auto time_us = [&](auto fn_launch, bool flush) { return timer.median_us(fn_launch, flush, 80); };
  // copy bandwidth (1 GB moved) and the empty launch, as the bench's floor
  void *cs, *cd;
  const size_t cb = size_t(1) << 29;
  FUSEBOX_CUDA_CHECK(cudaMalloc(&cs, cb));
  FUSEBOX_CUDA_CHECK(cudaMalloc(&cd, cb));
  const float copy_us = time_us([&] { FUSEBOX_CUDA_CHECK(cudaMemcpyAsync(cd, cs, cb, cudaMemcpyDeviceToDevice, s)); }, false);
  const double bw = 2.0 * cb / copy_us / 1e6;  // TB/s
  const float launch_us = time_us([&] { empty_kernel<<<1, 32, 0, s>>>(); }, false);
  printf("copy %.2f TB/s, empty launch %.2f us; time over the floor (launch + bytes / copy) in us\n", bw, launch_us);
  printf("%6s %6s %7s | %7s %7s %7s %7s %7s | %7s | %7s\n", "rows", "MB", "floor", "A", "held", "1-pass", "pdl",
         "all 3", "C", "fusebox");
  auto view = [](void* p, std::initializer_list<int64_t> shape) {
    return fusebox::make_view(p, fusebox::DType::kBFloat16, fusebox::Device::kCUDA, shape);
  };
  for (int rows : {512, 1024, 1536, 1792, 2048, 2560, 3072, 4096, 5376, 6144, 8192, 12288, 16384}) {
    const double mb = 2.0 * rows * D * 2 / 1e6;
    const double floor = launch_us + mb / bw;
    auto t = [&](auto kernel, bool pdl) {
      return time_us([&] { launch(kernel, rows, pdl, s, x, w, b, y, rows); }, true) - floor;
    };
    const double a = t(ln_rows_a<false, false, false>, false), ah = t(ln_rows_a<true, false, false>, false),
                 a1 = t(ln_rows_a<false, true, false>, false), ap = t(ln_rows_a<false, false, true>, true),
                 a3 = t(ln_rows_a<true, true, true>, true);
    const int gc = std::min(rows, occ_c * sms);
    const double c = time_us([&] { launch(ln_rows_p<true>, gc, false, s, x, w, b, y, rows); }, true) - floor;
    const double f = time_us([&] {
      fusebox::layer_norm(view(x, {rows, D}), view(w, {D}), view(b, {D}), view(y, {rows, D}), 1e-6f, s);
    }, true) - floor;
    printf("%6d %6.1f %7.2f | %7.2f %7.2f %7.2f %7.2f %7.2f | %7.2f | %7.2f\n", rows, mb, floor, a, ah, a1, ap, a3, c, f);
  }
  // the variants compute the same rows
  std::vector<uint16_t> ya(size_t(4096) * D), yc(size_t(4096) * D);
  launch(ln_rows_a<false, false, false>, 4096, false, s, x, w, b, y, 4096);
  FUSEBOX_CUDA_CHECK(cudaMemcpy(ya.data(), y, ya.size() * 2, cudaMemcpyDeviceToHost));
  FUSEBOX_CUDA_CHECK(cudaMemset(y, 0xff, ya.size() * 2));
  launch(ln_rows_p<true>, std::min(4096, occ_c * sms), false, s, x, w, b, y, 4096);
  FUSEBOX_CUDA_CHECK(cudaMemcpy(yc.data(), y, yc.size() * 2, cudaMemcpyDeviceToHost));
  printf("A and C outputs %s\n", ya == yc ? "identical" : "DIFFER");
  return 0;
}
