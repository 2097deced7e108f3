// CPU reference of the rotary family against formulas written out here.
#include <random>

#include "test_util.h"

using namespace fbtest;

namespace {

// Expected output of rotating channel d of one head (already normalized values in `x`).
double rotate(const std::vector<double>& x, int64_t d, int64_t R, bool interleaved, double c, double s) {
  if (d >= R) return x[size_t(d)];
  if (interleaved) return d % 2 == 0 ? x[size_t(d)] * c - x[size_t(d + 1)] * s : x[size_t(d)] * c + x[size_t(d - 1)] * s;
  return d < R / 2 ? x[size_t(d)] * c - x[size_t(d + R / 2)] * s : x[size_t(d)] * c + x[size_t(d - R / 2)] * s;
}

struct RopeCase {
  bool interleaved;
  int64_t R;  // rotary dims (< D: partial)
};

class RopeCpu : public ::testing::TestWithParam<RopeCase> {};

}  // namespace

TEST_P(RopeCpu, TableRotationMatchesFormula) {
  const auto [interleaved, R] = GetParam();
  const int64_t B = 2, S = 3, Hq = 4, Hk = 2, D = 8;
  std::mt19937 rng(7);
  HostTensor q(DType::kFloat32, {B, S, Hq, D}), k(DType::kFloat32, {B, S, Hk, D});
  HostTensor qo(DType::kFloat32, {B, S, Hq, D}), ko(DType::kFloat32, {B, S, Hk, D});
  HostTensor cs(DType::kFloat32, {1, S, R}), sn(DType::kFloat32, {1, S, R});
  for (auto* t : {&q, &k, &cs, &sn}) t->fill_random(rng);
  qo.fill(NAN);
  ko.fill(NAN);
  fusebox::RopeArgs a;
  a.q = q.view;
  a.k = k.view;
  a.q_out = qo.view;
  a.k_out = ko.view;
  a.cos = cs.view;
  a.sin = sn.view;
  a.cos.shape[0] = a.sin.shape[0] = B;  // broadcast batch
  a.cos.strides[0] = a.sin.strides[0] = 0;
  a.style = interleaved ? fusebox::RopeStyle::kInterleaved : fusebox::RopeStyle::kHalfSplit;
  fusebox::rope(a);
  for (auto [in, out, H] : {std::tuple{&q, &qo, Hq}, std::tuple{&k, &ko, Hk}})
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          std::vector<double> x(D);
          for (int64_t d = 0; d < D; ++d) x[size_t(d)] = in->at(offset_of(in->view, {b, s, h, d}));
          for (int64_t d = 0; d < D; ++d) {
            const double c = d < R ? cs.at(s * R + d) : 1, sv = d < R ? sn.at(s * R + d) : 0;
            EXPECT_NEAR(out->at(offset_of(out->view, {b, s, h, d})), rotate(x, d, R, interleaved, c, sv), 1e-5);
          }
        }
}

INSTANTIATE_TEST_SUITE_P(Styles, RopeCpu,
                         ::testing::Values(RopeCase{false, 8}, RopeCase{true, 8}, RopeCase{false, 4}, RopeCase{true, 6}));

TEST(RopeCpu, PerHeadAndAcrossHeadNormBeforeRotation) {
  const int64_t S = 2, H = 3, D = 4;
  std::mt19937 rng(8);
  for (bool across : {false, true}) {
    HostTensor q(DType::kFloat32, {1, S, H, D}), qo(DType::kFloat32, {1, S, H, D});
    HostTensor w(DType::kFloat32, {across ? H * D : D});
    HostTensor cs(DType::kFloat32, {1, S, D}), sn(DType::kFloat32, {1, S, D});
    for (auto* t : {&q, &w, &cs, &sn}) t->fill_random(rng);
    qo.fill(NAN);
    fusebox::RopeArgs a;
    a.q = q.view;
    a.q_out = qo.view;
    a.cos = cs.view;
    a.sin = sn.view;
    a.norm = fusebox::NormType::kRMS;
    a.norm_across_heads = across;
    a.q_weight = w.view;
    a.eps = 1e-6f;
    fusebox::rope(a);
    for (int64_t s = 0; s < S; ++s) {
      double total = 0;
      std::vector<double> ss(H, 0);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const double v = q.at((s * H + h) * D + d);
          ss[size_t(h)] += v * v;
          total += v * v;
        }
      for (int64_t h = 0; h < H; ++h) {
        const double rstd = across ? 1 / std::sqrt(total / (H * D) + 1e-6) : 1 / std::sqrt(ss[size_t(h)] / D + 1e-6);
        std::vector<double> x(D);
        for (int64_t d = 0; d < D; ++d) x[size_t(d)] = q.at((s * H + h) * D + d) * rstd * w.at(across ? h * D + d : d);
        for (int64_t d = 0; d < D; ++d)
          EXPECT_NEAR(qo.at((s * H + h) * D + d), rotate(x, d, D, false, cs.at(s * D + d), sn.at(s * D + d)), 1e-5)
              << "across=" << across;
      }
    }
  }
}

TEST(RopeCpu, GridAnglesFollowWanSections) {
  // One head of 12 channels split 4/4/4 over (frame, row, col) of a 2x3x4 grid, interleaved.
  const int64_t F = 2, Hh = 3, W = 4, S = F * Hh * W, D = 12;
  std::mt19937 rng(9);
  HostTensor q(DType::kFloat32, {1, S, 1, D}), qo(DType::kFloat32, {1, S, 1, D});
  q.fill_random(rng);
  qo.fill(NAN);
  fusebox::RopeArgs a;
  a.q = q.view;
  a.q_out = qo.view;
  a.use_grid = true;
  a.grid.frames = F;
  a.grid.height = Hh;
  a.grid.width = W;
  a.grid.axes_dim[0] = a.grid.axes_dim[1] = a.grid.axes_dim[2] = 4;
  a.grid.theta = 10000.f;
  a.style = fusebox::RopeStyle::kInterleaved;
  fusebox::rope(a);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t pos[3] = {s / (Hh * W), (s / W) % Hh, s % W};
    std::vector<double> x(D);
    for (int64_t d = 0; d < D; ++d) x[size_t(d)] = q.at(s * D + d);
    for (int64_t d = 0; d < D; ++d) {
      const int64_t pair = d / 2, axis = pair / 2, j = pair % 2;
      const double angle = pos[axis] * std::pow(10000.0, -2.0 * j / 4);
      EXPECT_NEAR(qo.at(s * D + d), rotate(x, d, D, true, std::cos(angle), std::sin(angle)), 1e-5);
    }
  }
}
