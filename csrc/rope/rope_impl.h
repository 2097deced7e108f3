// Internal interface of the rotary family, plus the angle formula of the in-kernel 3-D table,
// written once for host and device.
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

// Angle of rotary channel r (< R) for token s of a video grid (see Rope3DGrid). Computed in
// double and reduced to [-pi, pi] so that the fp32 sin/cos that follow are exact to ~1e-7.
FUSEBOX_HD double rope_grid_angle(const Rope3DGrid& g, int64_t s, int64_t r, int64_t R,
                                  bool interleaved) {
  const int64_t pair = interleaved ? r / 2 : (r < R / 2 ? r : r - R / 2);
  int axis = 0;
  int64_t start = 0;
  while (axis < 2 && pair >= start + g.axes_dim[axis] / 2) {
    start += g.axes_dim[axis] / 2;
    ++axis;
  }
  const int64_t j = pair - start;
  int64_t pos;
  if (axis == 0)
    pos = s / (g.height * g.width);
  else if (axis == 1)
    pos = (s / g.width) % g.height;
  else
    pos = s % g.width;
  pos += g.offsets[axis];
  const double inv_freq = exp2(-(2.0 * double(j) / double(g.axes_dim[axis])) * log2(double(g.theta)));
  const double angle = double(pos) * inv_freq;
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
