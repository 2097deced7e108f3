// CPU reference of the mixture-of-experts family: the router's top-k, the dispatch sort and the
// combine.
#include <cmath>
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

TEST(MoeCpu, SortIsTheStableSortByExpert) {
  // 4 tokens, top-2, 3 experts; index column-major: pair (n, k) at n + 4 * k
  const int64_t expert[4][2] = {{2, 0}, {0, 2}, {1, 0}, {2, 1}};
  for (DType idx : {DType::kInt32, DType::kInt64}) {
    HostTensor index(idx, {4, 2}, {1, 4}), row_token(DType::kInt32, {8}), offsets(DType::kInt32, {3}),
        pair_row(DType::kInt32, {4, 2}, {1, 5});  // pair_row strided past its shape
    for (int64_t n = 0; n < 4; ++n)
      for (int64_t k = 0; k < 2; ++k) index.set(n + 4 * k, float(expert[n][k]));
    row_token.fill(-9);
    pair_row.fill(-9);
    fusebox::moe_sort(index.view, 3, row_token.view, offsets.view, pair_row.view);
    // pairs in order 0..7 have experts 2 0 0 2 1 0 2 1: expert 0 takes pairs 1 2 5, expert 1
    // pairs 4 7, expert 2 pairs 0 3 6
    const int want_row_token[8] = {0, 1, 2, 2, 3, 0, 1, 3};
    const int want_offsets[3] = {3, 5, 8};
    const int want_pair_row[4][2] = {{5, 0}, {1, 6}, {3, 2}, {7, 4}};
    for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(row_token.at(r), want_row_token[r]) << r;
    for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(offsets.at(e), want_offsets[e]) << e;
    for (int64_t n = 0; n < 4; ++n)
      for (int64_t k = 0; k < 2; ++k) EXPECT_EQ(pair_row.at(n + 5 * k), want_pair_row[n][k]) << n << ", " << k;
  }
}

TEST(MoeCpu, SortValidatesArguments) {
  HostTensor index(DType::kInt64, {3, 2}), row_token(DType::kInt32, {6}), offsets(DType::kInt32, {4}),
      pair_row(DType::kInt32, {3, 2});
  HostTensor findex(DType::kFloat32, {3, 2}), short_rows(DType::kInt32, {5}), long_rows(DType::kInt64, {6}),
      wrong_offsets(DType::kInt32, {3}), wrong_pairs(DType::kInt32, {2, 3});
  expect_error([&] { fusebox::moe_sort(findex.view, 4, row_token.view, offsets.view, pair_row.view); },
               {"index must be int32 or int64", "float32"});
  expect_error([&] { fusebox::moe_sort(index.view, 0, row_token.view, offsets.view, pair_row.view); },
               {"num_experts must be at least 1; got 0"});
  expect_error([&] { fusebox::moe_sort(index.view, 4, short_rows.view, offsets.view, pair_row.view); },
               {"row_token must be a 1-D tensor of index's 6 elements", "[5]"});
  expect_error([&] { fusebox::moe_sort(index.view, 4, long_rows.view, offsets.view, pair_row.view); },
               {"row_token must be int32", "int64"});
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, wrong_offsets.view, pair_row.view); },
               {"offsets must be a 1-D tensor of num_experts (4) elements", "[3]"});
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, wrong_pairs.view); },
               {"pair_row must have the shape of index [3, 2]"});
  index.set(3, 4);  // index[1, 1] = 4 of 4 experts
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, pair_row.view); },
               {"index[1, 1] = 4 is outside the 4 experts"});
}

TEST(MoeCpu, TopkSoftmaxMatchesFormula) {
  // 3 tokens of 5 experts; token 2 has two equal logits (experts 1 and 4): the lower comes first
  const float logit[3][5] = {{0.5f, -1.f, 2.f, 0.25f, 1.f}, {-3.f, 4.f, 0.f, 1.5f, -0.5f}, {0.f, 1.f, -2.f, 0.5f, 1.f}};
  for (bool renormalize : {false, true}) {
    HostTensor logits(DType::kFloat32, {3, 5}, {8, 1}), weights(DType::kFloat32, {3, 3}),
        index(DType::kInt64, {3, 3}, {1, 3});  // index column-major
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t e = 0; e < 5; ++e) logits.set(n * 8 + e, logit[n][e]);
    fusebox::moe_topk_softmax(logits.view, renormalize, 2.f, weights.view, index.view);
    const int64_t want_index[3][3] = {{2, 4, 0}, {1, 3, 2}, {1, 4, 3}};
    for (int64_t n = 0; n < 3; ++n) {
      double sum = 0, top_sum = 0;
      for (int64_t e = 0; e < 5; ++e) sum += std::exp(double(logit[n][e]));
      for (int64_t k = 0; k < 3; ++k) top_sum += std::exp(double(logit[n][want_index[n][k]])) / sum;
      for (int64_t k = 0; k < 3; ++k) {
        EXPECT_EQ(index.at(n + 3 * k), want_index[n][k]) << n << ", " << k;
        const double p = std::exp(double(logit[n][want_index[n][k]])) / sum;
        EXPECT_NEAR(weights.at(n * 3 + k), 2 * (renormalize ? p / top_sum : p), 1e-6) << n << ", " << k;
      }
    }
  }
}

TEST(MoeCpu, TopkSoftmaxValidatesArguments) {
  HostTensor logits(DType::kBFloat16, {4, 16}), weights(DType::kFloat32, {4, 2}), index(DType::kInt64, {4, 2});
  HostTensor wide(DType::kFloat32, {2, 1025}), wide_w(DType::kFloat32, {2, 2}), wide_i(DType::kInt64, {2, 2}),
      k17_w(DType::kFloat32, {4, 17}), k17_i(DType::kInt64, {4, 17}), f16_w(DType::kFloat16, {4, 2}),
      rows_i(DType::kInt64, {3, 2}), float_i(DType::kFloat32, {4, 2});
  expect_error([&] { fusebox::moe_topk_softmax(wide.view, false, 1.f, wide_w.view, wide_i.view); },
               {"at most 1024 experts", "1025"});
  expect_error([&] { fusebox::moe_topk_softmax(logits.view, false, 1.f, k17_w.view, k17_i.view); },
               {"must be at most the 16 experts", "got 17"});
  expect_error([&] { fusebox::moe_topk_softmax(logits.view, false, 1.f, f16_w.view, index.view); },
               {"weights must be bfloat16 or float32"});
  expect_error([&] { fusebox::moe_topk_softmax(logits.view, false, 1.f, weights.view, rows_i.view); },
               {"index must have logits' 4 rows"});
  expect_error([&] { fusebox::moe_topk_softmax(logits.view, false, 1.f, weights.view, float_i.view); },
               {"index must be int32 or int64"});
}
