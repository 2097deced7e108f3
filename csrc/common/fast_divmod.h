// Division by a run-time divisor that is the same for a whole launch, for host and device.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace fusebox {

// n / d and n % d for 0 <= n < 2^31 and 0 < d < 2^31 as a multiply-high, an add and a shift,
// with the multiplier computed on the host once per launch (a 32-bit division by a run-time
// divisor is a sequence of about 20 instructions; the row and token splits at the start of
// the kernels take several). q = (umulhi(n, mul) + n) >> shift, shift = ceil(log2 d),
// mul = 2^32 (2^shift - d) / d + 1 (the round-up method; exact for n, d < 2^31).
struct FastDivmod {
  uint32_t divisor = 1, mul = 0, shift = 0;
  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d == 0 ? 1 : d) {  // (0: an empty launch's size)
    while ((uint64_t(1) << shift) < divisor) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor)) / divisor + 1);
  }
  FUSEBOX_HD uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    return (__umulhi(n, mul) + n) >> shift;
#else
    return (uint32_t((uint64_t(n) * mul) >> 32) + n) >> shift;
#endif
  }
  FUSEBOX_HD uint32_t divmod(uint32_t n, uint32_t& r) const {
    const uint32_t q = div(n);
    r = n - q * divisor;
    return q;
  }
};

}  // namespace fusebox
