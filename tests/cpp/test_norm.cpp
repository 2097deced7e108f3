// CPU reference of the norm family against double-precision formulas written out here.
#include <random>

#include "test_util.h"

using namespace fbtest;

namespace {

struct NormCase {
  int64_t rows, width;
  DType dtype;
};

class NormCpu : public ::testing::TestWithParam<NormCase> {};

double tol(DType d) { return d == DType::kFloat32 ? 1e-6 : (d == DType::kBFloat16 ? 8e-3 : 1e-3); }

}  // namespace

TEST_P(NormCpu, RmsNormWithWeightAndOffsetMatchesFormula) {
  const auto [rows, width, dtype] = GetParam();
  std::mt19937 rng(1);
  HostTensor x(dtype, {rows, width}), w(DType::kFloat32, {width}), out(dtype, {rows, width}), ref(DType::kFloat32, {rows, width});
  x.fill_random(rng);
  w.fill_random(rng, 0.f, 0.5f);
  out.fill(NAN);
  fusebox::rms_norm(x.view, w.view, out.view, 1e-6f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < width; ++d) ss += double(x.at(r * width + d)) * x.at(r * width + d);
    const double rstd = 1.0 / std::sqrt(ss / width + 1e-6);
    for (int64_t d = 0; d < width; ++d) ref.set(r * width + d, float(x.at(r * width + d) * rstd * (1.0 + w.at(d))));
  }
  EXPECT_LT(rel_error(out, ref), tol(dtype));
}

TEST_P(NormCpu, LayerNormWithAffineMatchesFormula) {
  const auto [rows, width, dtype] = GetParam();
  std::mt19937 rng(2);
  HostTensor x(dtype, {rows, width}), w(dtype, {width}), b(dtype, {width}), out(dtype, {rows, width}), ref(DType::kFloat32, {rows, width});
  x.fill_random(rng, 0.5f, 2.f);
  w.fill_random(rng, 1.f, 0.1f);
  b.fill_random(rng);
  out.fill(NAN);
  fusebox::layer_norm(x.view, w.view, b.view, out.view, 1e-5f);
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < width; ++d) mean += x.at(r * width + d);
    mean /= width;
    for (int64_t d = 0; d < width; ++d) var += (x.at(r * width + d) - mean) * (x.at(r * width + d) - mean);
    const double rstd = 1.0 / std::sqrt(var / width + 1e-5);
    for (int64_t d = 0; d < width; ++d)
      ref.set(r * width + d, float((x.at(r * width + d) - mean) * rstd * w.at(d) + b.at(d)));
  }
  EXPECT_LT(rel_error(out, ref), tol(dtype));
}

INSTANTIATE_TEST_SUITE_P(Shapes, NormCpu,
                         ::testing::Values(NormCase{3, 1, DType::kFloat32}, NormCase{5, 7, DType::kBFloat16},
                                           NormCase{2, 769, DType::kFloat16}, NormCase{4, 2048, DType::kBFloat16},
                                           NormCase{1, 5125, DType::kFloat32}));

TEST(NormCpu, FusedAddRoundsResidualBeforeNormalizing) {
  std::mt19937 rng(3);
  const int64_t rows = 4, width = 33;
  HostTensor x(DType::kBFloat16, {rows, width}), res(DType::kBFloat16, {rows, width}),
      out(DType::kBFloat16, {rows, width}), h(DType::kBFloat16, {rows, width}), ref(DType::kFloat32, {rows, width});
  x.fill_random(rng);
  res.fill_random(rng);
  h.fill(NAN);
  out.fill(NAN);
  fusebox::fused_add_rms_norm(x.view, res.view, TensorView{}, out.view, h.view, 1e-6f);
  for (int64_t i = 0; i < rows * width; ++i)
    EXPECT_EQ(h.at(i), fusebox::cpu::round_to(DType::kBFloat16, x.at(i) + res.at(i))) << i;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < width; ++d) ss += double(h.at(r * width + d)) * h.at(r * width + d);
    for (int64_t d = 0; d < width; ++d) ref.set(r * width + d, float(h.at(r * width + d) / std::sqrt(ss / width + 1e-6)));
  }
  EXPECT_LT(rel_error(out, ref), 8e-3);
}

TEST(NormCpu, RmsNormAddRoundsOnce) {
  // out = residual + rms_norm(x) * weight, the sum taken in fp32 and rounded once
  std::mt19937 rng(5);
  const int64_t rows = 3, width = 45;
  HostTensor x(DType::kBFloat16, {rows, width}), res(DType::kBFloat16, {rows, width}),
      w(DType::kBFloat16, {width}), out(DType::kBFloat16, {rows, width}), ref(DType::kFloat32, {rows, width});
  x.fill_random(rng);
  res.fill_random(rng);
  w.fill_random(rng);
  out.fill(NAN);
  fusebox::rms_norm_add(x.view, res.view, w.view, out.view, 1e-6f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < width; ++d) ss += double(x.at(r * width + d)) * x.at(r * width + d);
    const double rstd = 1.0 / std::sqrt(ss / width + 1e-6);
    for (int64_t d = 0; d < width; ++d)
      ref.set(r * width + d, float(res.at(r * width + d) + x.at(r * width + d) * rstd * (1.0 + w.at(d))));
  }
  EXPECT_LT(rel_error(out, ref), 8e-3);
}

TEST(NormCpu, GatedResidualAdaLnWithBroadcastModulation) {
  // x [B, S, D]; gate/scale/shift are per-sample [B, 1, D] chunks of a [B, 6, D] table,
  // seen through stride-0 broadcast over S.
  std::mt19937 rng(4);
  const int64_t B = 2, S = 5, D = 24;
  HostTensor x(DType::kFloat32, {B, S, D}), y(DType::kFloat32, {B, S, D}), table(DType::kFloat32, {B, 6, D});
  HostTensor out(DType::kFloat32, {B, S, D}), h(DType::kFloat32, {B, S, D});
  x.fill_random(rng);
  y.fill_random(rng);
  table.fill_random(rng, 0.f, 0.5f);
  out.fill(NAN);
  h.fill(NAN);
  auto chunk = [&](int i) {
    TensorView v = x.view;
    v.data = static_cast<float*>(table.view.data) + i * D;
    v.strides[0] = 6 * D;
    v.strides[1] = 0;
    return v;
  };
  fusebox::NormArgs a;
  a.x = x.view;
  a.branch = y.view;
  a.gate = chunk(2);
  a.shift = chunk(3);
  a.scale = chunk(4);
  a.out = out.view;
  a.residual_out = h.view;
  a.norm = fusebox::NormType::kLayer;
  a.eps = 1e-6f;
  fusebox::norm(a);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      std::vector<double> hv(D);
      double mean = 0, var = 0;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t o = (b * S + s) * D + d;
        hv[d] = double(x.at(o)) + double(table.at((b * 6 + 2) * D + d)) * y.at(o);
        EXPECT_NEAR(h.at(o), hv[d], 1e-5);
        mean += hv[d];
      }
      mean /= D;
      for (double v : hv) var += (v - mean) * (v - mean);
      const double rstd = 1.0 / std::sqrt(var / D + 1e-6);
      for (int64_t d = 0; d < D; ++d) {
        const double expect = (hv[d] - mean) * rstd * (1 + table.at((b * 6 + 4) * D + d)) + table.at((b * 6 + 3) * D + d);
        EXPECT_NEAR(out.at((b * S + s) * D + d), expect, 1e-4);
      }
    }
}

TEST(NormCpu, StridedRowsAreReadInPlace) {
  // x is the first half of each row of a [rows, 2 * D] buffer.
  std::mt19937 rng(5);
  const int64_t rows = 6, D = 10;
  HostTensor x(DType::kFloat32, {rows, D}, {2 * D, 1}), out(DType::kFloat32, {rows, D}), ref(DType::kFloat32, {rows, D});
  x.fill_random(rng);
  out.fill(NAN);
  fusebox::rms_norm(x.view, TensorView{}, out.view, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(x.at(r * 2 * D + d)) * x.at(r * 2 * D + d);
    for (int64_t d = 0; d < D; ++d) ref.set(r * D + d, float(x.at(r * 2 * D + d) / std::sqrt(ss / D)));
  }
  EXPECT_LT(rel_error(out, ref), 1e-6);
}

TEST(NormCpu, EmptyRowsAreANoOp) {
  HostTensor x(DType::kFloat32, {0, 16}), out(DType::kFloat32, {0, 16});
  fusebox::rms_norm(x.view, TensorView{}, out.view, 1e-6f);
}

TEST(RowLayout, MergesContiguousLeadingDims) {
  HostTensor x(DType::kFloat32, {2, 3, 4, 8});
  const TensorView* ops[] = {&x.view};
  fusebox::detail::RowStrides s[1];
  const auto l = fusebox::detail::merge_rows(x.view, ops, 1, s);
  EXPECT_EQ(l.rows, 24);
  EXPECT_EQ(l.sizes[2], 24);
  EXPECT_EQ(s[0].s[2], 8);
}

TEST(RowLayout, KeepsBroadcastDimsApart) {
  HostTensor x(DType::kFloat32, {2, 3, 8});
  TensorView scale = x.view;
  scale.strides[1] = 0;  // [2, 1, 8] expanded
  const TensorView* ops[] = {&x.view, &scale};
  fusebox::detail::RowStrides s[2];
  const auto l = fusebox::detail::merge_rows(x.view, ops, 2, s);
  EXPECT_EQ(l.sizes[1], 2);
  EXPECT_EQ(l.sizes[2], 3);
  EXPECT_EQ(s[1].s[2], 0);
  EXPECT_EQ(s[1].s[1], 24);
}
