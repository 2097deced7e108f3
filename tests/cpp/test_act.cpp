// CPU reference of the activation family.
#include <random>

#include "test_util.h"

using namespace fbtest;

namespace {
double silu(double x) { return x / (1 + std::exp(-x)); }
double gelu_tanh(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }
double gelu(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
}  // namespace

TEST(ActCpu, GatedActivationsMatchFormulas) {
  std::mt19937 rng(11);
  const int64_t rows = 3, n = 37;
  const std::pair<fusebox::Activation, double (*)(double)> acts[] = {
      {fusebox::Activation::kSiLU, silu}, {fusebox::Activation::kGeluTanh, gelu_tanh}, {fusebox::Activation::kGelu, gelu}};
  for (auto [act, f] : acts) {
    // gate and up are the two halves of a packed [rows, 2n] buffer.
    HostTensor packed(DType::kFloat32, {rows, 2 * n}), out(DType::kFloat32, {rows, n});
    packed.fill_random(rng, 0.f, 2.f);
    out.fill(NAN);
    TensorView gate = packed.view, up = packed.view;
    gate.shape[1] = up.shape[1] = n;
    up.data = static_cast<float*>(packed.view.data) + n;
    fusebox::gated_activation(gate, up, out.view, act);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < n; ++d)
        EXPECT_NEAR(out.at(r * n + d), f(packed.at(r * 2 * n + d)) * packed.at(r * 2 * n + n + d), 1e-5);
  }
}

TEST(ActCpu, GeluTanhWithBias) {
  std::mt19937 rng(12);
  HostTensor x(DType::kBFloat16, {4, 9}), bias(DType::kFloat32, {9}), out(DType::kBFloat16, {4, 9});
  x.fill_random(rng);
  bias.fill_random(rng);
  out.fill(NAN);
  fusebox::activation(x.view, bias.view, out.view, fusebox::Activation::kGeluTanh);
  for (int64_t i = 0; i < 36; ++i)
    EXPECT_NEAR(out.at(i), gelu_tanh(double(x.at(i)) + bias.at(i % 9)), 1e-2 * (1 + std::abs(out.at(i))));
}
