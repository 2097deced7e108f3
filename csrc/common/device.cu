#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/cuda_common.cuh"

namespace fusebox::cuda {

const DeviceLimits& device_limits() {
  constexpr int kMaxDevices = 64;
  static DeviceLimits limits[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  int device = 0;
  FUSEBOX_CUDA_CHECK(cudaGetDevice(&device));
  FUSEBOX_CHECK(device < kMaxDevices, "device index ", device, " is out of range");
  std::call_once(once[device], [device] {
    DeviceLimits& l = limits[device];
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.major, cudaDevAttrComputeCapabilityMajor, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.sm_count, cudaDevAttrMultiProcessorCount, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  });
  return limits[device];
}

int tuning_knob(const char* name, int fallback) {
  static std::mutex mu;
  static const char* names[16] = {};
  static int values[16] = {};
  std::lock_guard<std::mutex> lock(mu);
  int i = 0;
  for (; i < 16 && names[i] != nullptr; ++i)
    if (std::strcmp(names[i], name) == 0) return values[i];
  const char* env = std::getenv(name);
  const int v = env != nullptr && *env ? std::atoi(env) : fallback;
  if (i < 16) {
    names[i] = name;
    values[i] = v;
  }
  return v;
}

bool use_pdl() {
  static const bool enabled = [] {
    const char* env = std::getenv("FUSEBOX_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return enabled && device_limits().major >= 9;
}

}  // namespace fusebox::cuda
