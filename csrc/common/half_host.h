// Host-side fp16/bf16 storage types with round-to-nearest-even conversion. The CPU reference
// implementation uses these so the core needs no CUDA headers on the host path.
#pragma once

#include <cstdint>
#include <cstring>

namespace fusebox::host {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct bfloat16 {
  uint16_t bits;
};
struct float16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(bfloat16 v) { return bits_float(uint32_t(v.bits) << 16); }
inline float to_float(float16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1f;
  uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalize
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | uint32_t(127 - 15 - e) << 23 | (man << 13));
  }
  return bits_float(sign | (exp + 112) << 23 | (man << 13));
}

template <typename T>
T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline bfloat16 from_float<bfloat16>(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{uint16_t((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{uint16_t(u >> 16)};
}

template <>
inline float16 from_float<float16>(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return float16{uint16_t(sign | 0x7e00u)};  // NaN
  if (u >= 0x477ff000u) return float16{uint16_t(sign | 0x7c00u)};  // overflow (rounds to inf)
  if (u < 0x38800000u) {
    // subnormal or zero: value = m * 2^-24, round to nearest even
    if (u < 0x33000000u) return float16{sign};
    const uint32_t exp = u >> 23;
    const uint32_t man = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1
    uint32_t half = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return float16{uint16_t(sign | half)};
  }
  // normal: rebias exponent, round mantissa to 10 bits (nearest even)
  uint32_t h = ((u - 0x38000000u) >> 13);
  const uint32_t rem = u & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return float16{uint16_t(sign | h)};
}

}  // namespace fusebox::host
