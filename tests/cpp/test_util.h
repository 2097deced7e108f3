// Test helpers: host tensors with random contents, device mirrors, and error matchers.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/cpu_common.h"
#include "fusebox/fusebox.h"

namespace fbtest {

using fusebox::DType;
using fusebox::TensorView;

// A host tensor of `dtype` with a given shape and (optionally) strides into a larger buffer.
struct HostTensor {
  std::vector<unsigned char> storage;
  TensorView view;

  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
    view.dtype = dtype;
    view.device = fusebox::Device::kCPU;
    view.ndim = int(shape.size());
    int64_t span = 1;
    int64_t stride = 1;
    for (int d = view.ndim - 1; d >= 0; --d) {
      view.shape[d] = shape[size_t(d)];
      view.strides[d] = strides.empty() ? stride : strides[size_t(d)];
      stride *= shape[size_t(d)];
      if (shape[size_t(d)] > 0) span += (shape[size_t(d)] - 1) * view.strides[d];
    }
    storage.assign(size_t(span) * fusebox::dtype_size(dtype) + 16, 0);
    view.data = storage.data();
  }
  float at(int64_t offset) const { return fusebox::cpu::load(view.data, view.dtype, offset); }
  void set(int64_t offset, float v) { fusebox::cpu::store(view.data, view.dtype, offset, v); }
  int64_t span() const { return int64_t(storage.size() - 16) / int64_t(fusebox::dtype_size(view.dtype)); }

  // Fills every element of the underlying buffer (including gaps between strided rows).
  void fill_random(std::mt19937& rng, float mean = 0.f, float stddev = 1.f) {
    std::normal_distribution<float> dist(mean, stddev);
    for (int64_t i = 0; i < span(); ++i) set(i, dist(rng));
  }
  void fill(float v) {
    for (int64_t i = 0; i < span(); ++i) set(i, v);
  }
};

// Offset of a multi-index.
inline int64_t offset_of(const TensorView& v, std::initializer_list<int64_t> idx) {
  int64_t o = 0;
  int d = 0;
  for (int64_t i : idx) o += i * v.strides[d++];
  return o;
}

// Expects `f` to throw fusebox::Error whose message contains every one of `needles`.
inline void expect_error(const std::function<void()>& f, std::vector<std::string> needles) {
  try {
    f();
  } catch (const fusebox::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message: " << msg << "\nmissing: " << n;
    return;
  }
  ADD_FAILURE() << "expected a fusebox::Error";
}

inline bool has_cuda() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device copy of a host tensor (same strides); copy_back() refreshes the host buffer.
struct DeviceMirror {
  HostTensor* host;
  void* ptr = nullptr;
  TensorView view;
  explicit DeviceMirror(HostTensor& h) : host(&h) {
    EXPECT_EQ(cudaMalloc(&ptr, h.storage.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, h.storage.data(), h.storage.size(), cudaMemcpyHostToDevice), cudaSuccess);
    view = h.view;
    view.data = ptr;
    view.device = fusebox::Device::kCUDA;
  }
  void copy_back() {
    EXPECT_EQ(cudaMemcpy(host->storage.data(), ptr, host->storage.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  ~DeviceMirror() { cudaFree(ptr); }
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
};

// ||a - b|| / ||b|| over the elements of a view layout, failing on NaN.
inline double rel_error(const HostTensor& a, const HostTensor& b) {
  double num = 0, den = 0;
  const TensorView& v = b.view;
  const int64_t n = v.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off_a = 0, off_b = 0;
    for (int d = v.ndim - 1; d >= 0; --d) {
      const int64_t idx = rem % v.shape[d];
      rem /= v.shape[d];
      off_a += idx * a.view.strides[d];
      off_b += idx * v.strides[d];
    }
    const double x = a.at(off_a), y = b.at(off_b);
    if (std::isnan(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace fbtest
