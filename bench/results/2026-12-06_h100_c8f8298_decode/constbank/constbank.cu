// Microbenchmark: does a kernel's parameter layout (how many 64-byte constant lines its setup
// touches, and whether they are read one after another) cost time at decode size?
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

struct Small { const float4* in; float4* out; int n; };
// n (the exit test) 96 bytes past the pointers: another line
struct Far { const float4* in; float4* out; int64_t pad[10]; int n; };
// n beside the pointers, the same padding after
struct Near { int n; const float4* in; float4* out; int64_t pad[10]; };
// three dependent reads on three lines: n, then a stride, then the pointers
struct Chain { int64_t pad0[6]; int n; int64_t pad1[7]; int64_t stride; const float4* in; float4* out; };

__global__ void k_small(const Small p) { int t = threadIdx.x; if (t >= p.n) return; p.out[t] = p.in[t]; }
__global__ void k_far(const Far p) { int t = threadIdx.x; if (t >= p.n) return; p.out[t] = p.in[t]; }
__global__ void k_near(const Near p) { int t = threadIdx.x; if (t >= p.n) return; p.out[t] = p.in[t]; }
__global__ void k_chain(const Chain p) {
  int t = threadIdx.x; if (t >= p.n) return;
  if (t * p.stride >= (int64_t(1) << 40)) return;
  p.out[t] = p.in[t];
}

template <typename F>
float time_one(F launch, float4* flush, size_t flush_n, cudaStream_t s, bool do_flush) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> v;
  for (int i = 0; i < 200; ++i) {
    if (do_flush) cudaMemsetAsync(flush, i & 0xff, flush_n * sizeof(float4), s);
    cudaEventRecord(a, s); launch(); cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); v.push_back(ms * 1000);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  float4 *in, *out, *flush; size_t flush_n = (size_t(200) << 20) / sizeof(float4);
  CK(cudaMalloc(&in, 1 << 20)); CK(cudaMalloc(&out, 1 << 20)); CK(cudaMalloc(&flush, flush_n * sizeof(float4)));
  cudaStream_t s; CK(cudaStreamCreate(&s));
  Small ps{in, out, 256}; Far pf{}; pf.in = in; pf.out = out; pf.n = 256;
  Near pn{}; pn.in = in; pn.out = out; pn.n = 256; Chain pc{}; pc.in = in; pc.out = out; pc.n = 256; pc.stride = 1;
  auto ls = [&] { k_small<<<8, 256, 0, s>>>(ps); };
  auto lf = [&] { k_far<<<8, 256, 0, s>>>(pf); };
  auto ln = [&] { k_near<<<8, 256, 0, s>>>(pn); };
  auto lc = [&] { k_chain<<<8, 256, 0, s>>>(pc); };
  if (argc > 1) {  // for ncu: each kernel a few times, flushed before each
    for (int i = 0; i < 5; ++i) {
      cudaMemsetAsync(flush, i, flush_n * sizeof(float4), s); ls();
      cudaMemsetAsync(flush, i, flush_n * sizeof(float4), s); lf();
      cudaMemsetAsync(flush, i, flush_n * sizeof(float4), s); ln();
      cudaMemsetAsync(flush, i, flush_n * sizeof(float4), s); lc();
    }
    CK(cudaDeviceSynchronize());
    return 0;
  }
  for (int rep = 0; rep < 2; ++rep)
    for (int fl = 0; fl < 2; ++fl) {
      printf("%s small %.3f far %.3f near %.3f chain %.3f us\n", fl ? "flushed" : "warm   ",
             time_one(ls, flush, flush_n, s, fl), time_one(lf, flush, flush_n, s, fl),
             time_one(ln, flush, flush_n, s, fl), time_one(lc, flush, flush_n, s, fl));
    }
  CK(cudaDeviceSynchronize());
  printf("sizes: small %zu far %zu near %zu chain %zu\n", sizeof(Small), sizeof(Far), sizeof(Near), sizeof(Chain));
  return 0;
}
