// The timing of the scripts/probe_*.cu programs, as `fusebox bench` times kernels: CUDA events
// around each call, the GPU held busy while a chunk of calls is enqueued (so host time never
// shows), and optionally the L2 flushed by a read-only pass over 256 MB before each call.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "common/cuda_common.cuh"

namespace probe {

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Reads a buffer larger than L2 (what the bench's flush does).
__global__ void flush_kernel(const float4* p, size_t n, float* sink) {
  float acc = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    acc += p[i].x;
  if (acc == 12345.f) *sink = acc;
}

struct Timer {
  cudaStream_t s;
  float4* flush_buf = nullptr;
  size_t flush_n = (size_t(256) << 20) / 16;
  float* sink = nullptr;
  long long cycles_per_us = 0;

  explicit Timer(cudaStream_t stream) : s(stream) {
    int clock_khz = 0;
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    cycles_per_us = clock_khz / 1000;
    FUSEBOX_CUDA_CHECK(cudaMalloc(&flush_buf, flush_n * 16));
    FUSEBOX_CUDA_CHECK(cudaMemset(flush_buf, 0, flush_n * 16));
    FUSEBOX_CUDA_CHECK(cudaMalloc(&sink, 4));
  }

  // Median of `iters` calls of `fn` (each enqueueing one call on `s`), in microseconds.
  double median_us(const std::function<void()>& fn, bool flush, int iters = 200) {
    std::vector<float> ts;
    for (int c = 0; c < iters; c += 8) {
      cudaEvent_t ev[16];
      for (auto& e : ev) FUSEBOX_CUDA_CHECK(cudaEventCreate(&e));
      FUSEBOX_CUDA_CHECK(cudaStreamSynchronize(s));
      spin_kernel<<<1, 1, 0, s>>>(cycles_per_us * 300);
      for (int i = 0; i < 8; ++i) {
        if (flush) flush_kernel<<<264, 1024, 0, s>>>(flush_buf, flush_n, sink);
        FUSEBOX_CUDA_CHECK(cudaEventRecord(ev[2 * i], s));
        fn();
        FUSEBOX_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], s));
      }
      FUSEBOX_CUDA_CHECK(cudaStreamSynchronize(s));
      for (int i = 0; i < 8; ++i) {
        float ms;
        FUSEBOX_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        ts.push_back(ms * 1e3f);
      }
      for (auto& e : ev) FUSEBOX_CUDA_CHECK(cudaEventDestroy(e));
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  }
};

}  // namespace probe
