#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/half_host.h"

using namespace fusebox::host;

TEST(HalfHost, Float16ExactValuesRoundTrip) {
  for (float v : {0.f, -0.f, 1.f, -2.5f, 65504.f, 6.103515625e-05f /*min normal*/, 5.960464477539063e-08f /*min subnormal*/, 0.333251953125f})
    EXPECT_EQ(to_float(from_float<float16>(v)), v) << v;
}

TEST(HalfHost, Float16RoundsToNearestEven) {
  EXPECT_EQ(to_float(from_float<float16>(1.f + 1.f / 2048)), 1.f);                 // tie -> even (down)
  EXPECT_EQ(to_float(from_float<float16>(1.f + 3.f / 2048)), 1.f + 2.f / 1024);    // tie -> even (up)
  EXPECT_EQ(to_float(from_float<float16>(1.f + 1.5f / 2048)), 1.f + 1.f / 1024);   // above tie
  EXPECT_TRUE(std::isinf(to_float(from_float<float16>(65520.f))));                 // overflow rounds to inf
  EXPECT_EQ(to_float(from_float<float16>(65519.f)), 65504.f);
  EXPECT_TRUE(std::isnan(to_float(from_float<float16>(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(to_float(from_float<float16>(1e-9f)), 0.f);
  EXPECT_EQ(to_float(from_float<float16>(3 * 5.960464477539063e-08f)), 3 * 5.960464477539063e-08f);
}

TEST(HalfHost, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(to_float(from_float<bfloat16>(1.f)), 1.f);
  EXPECT_EQ(to_float(from_float<bfloat16>(1.f + 1.f / 256)), 1.f);              // tie -> even
  EXPECT_EQ(to_float(from_float<bfloat16>(1.f + 3.f / 256)), 1.f + 4.f / 256);  // tie -> even (up)
  EXPECT_EQ(to_float(from_float<bfloat16>(-3.140625f)), -3.140625f);
  EXPECT_TRUE(std::isnan(to_float(from_float<bfloat16>(std::numeric_limits<float>::quiet_NaN()))));
}
