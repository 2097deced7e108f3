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
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.sm_count, cudaDevAttrMultiProcessorCount, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  });
  return limits[device];
}

}  // namespace fusebox::cuda
