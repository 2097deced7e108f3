// FastDivmod (the kernels' row and token splits) against plain division, on the host: the same
// formula the device evaluates with __umulhi.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/fast_divmod.h"

namespace {

using fusebox::FastDivmod;

void expect_exact(uint32_t d, uint32_t n) {
  const FastDivmod f(d);
  uint32_t r = 0;
  const uint32_t q = f.divmod(n, r);
  ASSERT_EQ(q, n / d) << n << " / " << d;
  ASSERT_EQ(r, n % d) << n << " % " << d;
}

TEST(FastDivmod, SmallDivisorsEveryDividendUpTo4096) {
  for (uint32_t d = 1; d <= 300; ++d)
    for (uint32_t n = 0; n <= 4096; ++n) expect_exact(d, n);
}

TEST(FastDivmod, EdgesAndRandomPairsBelow2To31) {
  const uint32_t top = (uint32_t(1) << 31) - 1;
  std::vector<uint32_t> divisors = {1, 2, 3, 7, 24, 96, 1560, 32760, 65535, 65536, 65537, 1u << 30, top};
  std::mt19937 gen(7);
  std::uniform_int_distribution<uint32_t> any(1, top);
  for (int i = 0; i < 200; ++i) divisors.push_back(any(gen));
  for (uint32_t d : divisors) {
    for (uint32_t n : {0u, 1u, d - 1, d, d + 1, 2 * (d / 2) + 1, top - 1, top}) expect_exact(d, n);
    for (int i = 0; i < 2000; ++i) expect_exact(d, any(gen));
    // the dividends next to every multiple of d in a stretch (where a round-off would show)
    for (uint64_t m = uint64_t(d) * (top / d / 2); m <= top && m < uint64_t(d) * (top / d / 2 + 64); m += d) {
      expect_exact(d, uint32_t(m));
      if (m > 0) expect_exact(d, uint32_t(m - 1));
    }
  }
}

TEST(FastDivmod, ZeroDivisorIsOne) {  // the size of an empty launch, never divided by
  uint32_t r = 5;
  EXPECT_EQ(FastDivmod(0).divmod(9, r), 9u);
  EXPECT_EQ(r, 0u);
}

}  // namespace
