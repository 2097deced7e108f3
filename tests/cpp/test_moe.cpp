// CPU reference of the mixture-of-experts family.
#include <random>

#include "test_util.h"

using namespace fbtest;

namespace {

// A routing of `tokens` tokens to `top_k` of `num_rows` rows each, with weights in (0, 1).
void fill_routing(std::mt19937& rng, HostTensor& index, HostTensor& weights, int64_t num_rows) {
  std::uniform_int_distribution<int64_t> pick(0, num_rows - 1);
  std::uniform_real_distribution<float> w(0.05f, 1.f);
  for (int64_t n = 0; n < index.view.shape[0]; ++n)
    for (int64_t k = 0; k < index.view.shape[1]; ++k) {
      index.set(offset_of(index.view, {n, k}), float(pick(rng)));
      weights.set(offset_of(weights.view, {n, k}), w(rng));
    }
}

}  // namespace

TEST(MoeCpu, CombineMatchesFormula) {
  std::mt19937 rng(21);
  const int64_t tokens = 5, top_k = 3, num_rows = 11, width = 13;
  for (DType idx : {DType::kInt32, DType::kInt64}) {
    // rows with a row stride past their width; index and weights column-major
    HostTensor rows(DType::kBFloat16, {num_rows, width}, {width + 4, 1});
    HostTensor index(idx, {tokens, top_k}, {1, tokens}), weights(DType::kFloat32, {tokens, top_k}, {1, tokens});
    HostTensor out(DType::kBFloat16, {tokens, width});
    rows.fill_random(rng);
    fill_routing(rng, index, weights, num_rows);
    out.fill(NAN);
    fusebox::moe_combine(rows.view, index.view, weights.view, out.view);
    for (int64_t n = 0; n < tokens; ++n)
      for (int64_t d = 0; d < width; ++d) {
        double want = 0;
        for (int64_t k = 0; k < top_k; ++k) {
          const int64_t r = int64_t(index.at(offset_of(index.view, {n, k})));
          want += double(weights.at(offset_of(weights.view, {n, k}))) * rows.at(offset_of(rows.view, {r, d}));
        }
        EXPECT_NEAR(out.at(n * width + d), want, 1e-2 * (1 + std::abs(want))) << n << ", " << d;
      }
  }
}

TEST(MoeCpu, CombineRejectsIndexOutsideRows) {
  HostTensor rows(DType::kFloat32, {4, 8}), index(DType::kInt64, {2, 2}), weights(DType::kFloat32, {2, 2}),
      out(DType::kFloat32, {2, 8});
  index.set(3, 4);  // index[1, 1] = 4 of 4 rows
  expect_error([&] { fusebox::moe_combine(rows.view, index.view, weights.view, out.view); },
               {"index[1, 1] = 4", "outside rows' 4 rows"});
}

TEST(MoeCpu, CombineValidatesArguments) {
  HostTensor rows(DType::kBFloat16, {4, 8}), index(DType::kInt32, {2, 3}), weights(DType::kFloat32, {2, 3}),
      out(DType::kBFloat16, {2, 8});
  HostTensor findex(DType::kFloat32, {2, 3}), wshape(DType::kFloat32, {3, 2}), wout(DType::kBFloat16, {2, 7}),
      fout(DType::kFloat32, {2, 8}), irows(DType::kInt32, {4, 8});
  expect_error([&] { fusebox::moe_combine(rows.view, findex.view, weights.view, out.view); },
               {"index must be int32 or int64", "float32"});
  expect_error([&] { fusebox::moe_combine(rows.view, index.view, wshape.view, out.view); },
               {"weights must have the shape of index [2, 3]"});
  expect_error([&] { fusebox::moe_combine(rows.view, index.view, weights.view, wout.view); },
               {"out must have the shape", "[2, 8]"});
  expect_error([&] { fusebox::moe_combine(rows.view, index.view, weights.view, fout.view); },
               {"out must be bfloat16"});
  expect_error([&] { fusebox::moe_combine(irows.view, index.view, weights.view, out.view); },
               {"rows must be float32, float16 or bfloat16", "int32"});
  expect_error([&] { fusebox::rms_norm(irows.view, TensorView{}, irows.view, 1e-6f); },
               {"x must be float32, float16 or bfloat16"});
}
