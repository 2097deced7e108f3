#include <cstdlib>
#include <cstring>
#include <optional>

#include "common/cuda_common.cuh"

namespace fusebox::cuda {

int current_device() {
  int device = 0;
  FUSEBOX_CUDA_CHECK(cudaGetDevice(&device));
  FUSEBOX_CHECK(device < PerDevice<int>::kMaxDevices, "device index ", device, " is out of range");
  return device;
}

const DeviceLimits& device_limits() {
  static PerDevice<DeviceLimits> limits;
  return limits.get([](int device) {
    DeviceLimits l;
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.major, cudaDevAttrComputeCapabilityMajor, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.sm_count, cudaDevAttrMultiProcessorCount, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    int memory_khz = 0, bus_bits = 0;  // double data rate: two transfers a clock
    if (cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess)
      l.dram_bytes_per_s = 2.0 * memory_khz * 1e3 * bus_bits / 8;
    else
      (void)cudaGetLastError();  // not reported: the launch plans take their defaults
    return l;
  });
}

const TuningKnobs& tuning_knobs() {
  static const TuningKnobs knobs = [] {
    auto read = [](const char* name) -> std::optional<int> {
      const char* env = std::getenv(name);
      if (env == nullptr || *env == '\0') return std::nullopt;
      return std::atoi(env);
    };
    return TuningKnobs{read("FUSEBOX_NORM_ITEMS"), read("FUSEBOX_NORM_ROW_ITERS"), read("FUSEBOX_NORM_STAGE"),
                       read("FUSEBOX_ROPE_ITEMS"), read("FUSEBOX_ROPE_EARLY"),
                       read("FUSEBOX_ACT_FLAT"), read("FUSEBOX_NORM_FLAT"), read("FUSEBOX_NORM_SHORT"),
                       read("FUSEBOX_ROPE_SHORT"), read("FUSEBOX_ADD_FLAT"), read("FUSEBOX_MOE_ITEMS"),
                       read("FUSEBOX_MOE_CHUNK"), read("FUSEBOX_MOE_STAGE"), read("FUSEBOX_MOE_SORT_TILE"),
                       read("FUSEBOX_MOE_SORT_WARPS"), read("FUSEBOX_MOE_SORT_CLUSTER"),
                       read("FUSEBOX_MOE_SORT_GRID"), read("FUSEBOX_MOE_SORT_SMALL")};
  }();
  return knobs;
}

bool use_pdl() {
  static const bool enabled = [] {
    const char* env = std::getenv("FUSEBOX_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return enabled && device_limits().major >= 9;
}

}  // namespace fusebox::cuda
