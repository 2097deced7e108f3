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
  // The environment is read once per name; what is cached is whether the variable is set and
  // its value, never a caller's fallback (callers pass plan-dependent fallbacks).
  static std::mutex mu;
  static const char* names[16] = {};
  static bool is_set[16] = {};
  static int values[16] = {};
  std::lock_guard<std::mutex> lock(mu);
  int i = 0;
  for (; i < 16 && names[i] != nullptr; ++i)
    if (std::strcmp(names[i], name) == 0) return is_set[i] ? values[i] : fallback;
  const char* env = std::getenv(name);
  const bool set = env != nullptr && *env;
  const int v = set ? std::atoi(env) : 0;
  if (i < 16) {
    names[i] = name;
    is_set[i] = set;
    values[i] = v;
  }
  return set ? v : fallback;
}

bool use_pdl() {
  static const bool enabled = [] {
    const char* env = std::getenv("FUSEBOX_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return enabled && device_limits().major >= 9;
}

}  // namespace fusebox::cuda
