// Internal interface of the rotary family, plus the angle formula of the 3-D grid, written once
// for the CPU reference and the CUDA launcher (which hands the kernels each pair's frequency).
#pragma once

#include <cmath>

#include "common/host_device.h"
#include "fusebox/ops.h"

namespace fusebox {

// Geometry of one rotary launch, derived and checked by the entry point.
struct RopeShape {
  int64_t B = 0, S = 0;
  int64_t Hq = 0, Hk = 0, D = 0, R = 0;
};

// Index of the partner of channel d (< R) and whether d is the first element of its pair.
FUSEBOX_HD int64_t rope_partner(int64_t d, int64_t R, bool interleaved, bool& first) {
  if (interleaved) {
    first = (d & 1) == 0;
    return d ^ 1;
  }
  first = d < R / 2;
  return first ? d + R / 2 : d - R / 2;
}

// The widest rotary part the 3-D grid takes (its per-pair table is a kernel parameter).
constexpr int64_t kMaxGridRotaryDims = 512;

// The 3-D grid's angles (see Rope3DGrid). Channel r (< R) belongs to pair
// `pair`, which falls in one section (axis) of the grid; its angle is
// position_on_that_axis * theta^(-2j / axes_dim[axis]), j the pair's index in its section.
FUSEBOX_HD int rope_grid_axis(const Rope3DGrid& g, int64_t r, int64_t R, bool interleaved, int64_t& j) {
  const int64_t pair = interleaved ? r / 2 : (r < R / 2 ? r : r - R / 2);
  int axis = 0;
  int64_t start = 0;
  while (axis < 2 && pair >= start + g.axes_dim[axis] / 2) {
    start += g.axes_dim[axis] / 2;
    ++axis;
  }
  j = pair - start;
  return axis;
}

// Frequency of channel r, in double (it does not depend on the token).
FUSEBOX_HD double rope_grid_inv_freq(const Rope3DGrid& g, int64_t r, int64_t R, bool interleaved) {
  int64_t j;
  const int axis = rope_grid_axis(g, r, R, interleaved, j);
  return exp2(-(2.0 * double(j) / double(g.axes_dim[axis])) * log2(double(g.theta)));
}

// Position of token s along the axis that channel r rotates with.
FUSEBOX_HD int64_t rope_grid_position(const Rope3DGrid& g, int64_t s, int64_t r, int64_t R, bool interleaved) {
  int64_t j;
  const int axis = rope_grid_axis(g, r, R, interleaved, j);
  const int64_t pos = axis == 0 ? s / (g.height * g.width) : axis == 1 ? (s / g.width) % g.height : s % g.width;
  return pos + g.offsets[axis];
}

// Reduces an angle to [-pi, pi] in double, so the fp32 sin/cos that follow are exact to ~1e-7.
FUSEBOX_HD double rope_grid_reduce(double angle) {
  const double two_pi = 6.283185307179586;
  return angle - two_pi * rint(angle / two_pi);
}

namespace cuda {
void rope_cuda(const RopeArgs& args, const RopeShape& shape, int vec, cudaStream_t stream);
}
namespace cpu {
void rope_cpu(const RopeArgs& args, const RopeShape& shape);
}

}  // namespace fusebox
