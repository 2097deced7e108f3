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
  HostTensor ws64(DType::kInt64, {8}), ws2d(DType::kInt32, {2, 4}), ws(DType::kInt32, {9});
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, pair_row.view, nullptr, ws64.view); },
               {"workspace must be int32", "int64"});
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, pair_row.view, nullptr, ws2d.view); },
               {"workspace must be a contiguous 1-D tensor", "[2, 4]"});
  TensorView misaligned = ws.view;
  misaligned.data = static_cast<int32_t*>(ws.view.data) + 1;
  misaligned.shape[0] = 8;
  expect_error(
      [&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, pair_row.view, nullptr, misaligned); },
      {"workspace must start at a 16-byte aligned address"});
  expect_error([&] { fusebox::moe_sort_workspace_size(-1, 2, 4); }, {"tokens and top_k must be non-negative"});
  index.set(3, 4);  // index[1, 1] = 4 of 4 experts
  expect_error([&] { fusebox::moe_sort(index.view, 4, row_token.view, offsets.view, pair_row.view); },
               {"index[1, 1] = 4 is outside the 4 experts"});
}

// The workspace a sort needs: none up to a tile of pairs, whole int4 of one count a bucket a tile
// above, the tiles growing past kMaxTiles; too many experts for the counts' shared memory raise.
TEST(MoeCpu, SortWorkspaceSize) {
  EXPECT_EQ(fusebox::moe_sort_workspace_size(64, 8, 64), 0);  // 512 pairs: one block
  EXPECT_EQ(fusebox::moe_sort_workspace_size(0, 8, 64), 0);
  EXPECT_EQ(fusebox::moe_sort_workspace_size(2048, 6, 64), 24 * 65);   // 24 tiles of 512 pairs
  EXPECT_EQ(fusebox::moe_sort_workspace_size(8192, 8, 128), 64 * 129);
  EXPECT_EQ(fusebox::moe_sort_workspace_size(3000, 1, 8), 56);  // 6 tiles of 9 buckets, whole int4
  EXPECT_EQ(fusebox::moe_sort_workspace_size(32768, 8, 256), 64 * 257);  // 64 tiles of 4096 pairs
  expect_error([&] { fusebox::moe_sort_workspace_size(4, 2, 4010); }, {"num_experts must be at most 4009"});
}

namespace {

fusebox::RouterArgs router(const HostTensor& logits, const HostTensor& weights, const HostTensor& index) {
  fusebox::RouterArgs a;
  a.logits = logits.view;
  a.weights = weights.view;
  a.index = index.view;
  return a;
}

}  // namespace

TEST(MoeCpu, TopkSoftmaxMatchesFormula) {
  // 3 tokens of 5 experts; token 2 has two equal logits (experts 1 and 4): the lower comes first
  const float logit[3][5] = {{0.5f, -1.f, 2.f, 0.25f, 1.f}, {-3.f, 4.f, 0.f, 1.5f, -0.5f}, {0.f, 1.f, -2.f, 0.5f, 1.f}};
  for (bool renormalize : {false, true}) {
    HostTensor logits(DType::kFloat32, {3, 5}, {8, 1}), weights(DType::kFloat32, {3, 3}),
        index(DType::kInt64, {3, 3}, {1, 3});  // index column-major
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t e = 0; e < 5; ++e) logits.set(n * 8 + e, logit[n][e]);
    fusebox::RouterArgs a = router(logits, weights, index);
    a.renormalize = renormalize;
    a.scale = 2.f;
    fusebox::moe_topk(a);
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

// DeepSeek-V3's form: sigmoid scores, the choice by score + bias within the best groups (by the
// sum of their two largest choice scores), the weights the scores without the bias.
TEST(MoeCpu, TopkSigmoidGroupLimited) {
  // 8 experts in 4 groups of 2; the bias lifts expert 1 (group 0) and lowers expert 6 (group 3)
  const float logit[8] = {0.f, -1.f, 1.f, 0.5f, -2.f, -2.f, 3.f, 2.5f};
  const float bias_of[8] = {0.f, 0.9f, 0.f, 0.f, 0.f, 0.f, -0.9f, 0.f};
  HostTensor logits(DType::kFloat32, {1, 8}), bias(DType::kFloat32, {8}), weights(DType::kFloat32, {1, 3}),
      index(DType::kInt32, {1, 3});
  double sig[8], choice[8];
  for (int e = 0; e < 8; ++e) {
    logits.set(e, logit[e]);
    bias.set(e, bias_of[e]);
    sig[e] = 1 / (1 + std::exp(-double(logit[e])));
    choice[e] = sig[e] + bias_of[e];
  }
  // groups by choice: g0 0.5 + 1.169, g1 0.731 + 0.622, g2 0.119 + 0.119, g3 0.053 + 0.924: g0 and
  // g1 are chosen from; expert 6 has the highest score, but its bias and group leave it out
  ASSERT_GT(choice[0] + choice[1], choice[2] + choice[3]);
  ASSERT_GT(choice[2] + choice[3], choice[6] + choice[7]);
  fusebox::RouterArgs a = router(logits, weights, index);
  a.bias = bias.view;
  a.score = fusebox::RouterScore::kSigmoid;
  a.num_groups = 4;
  a.topk_groups = 2;
  a.renormalize = true;
  a.scale = 2.5f;
  fusebox::moe_topk(a);
  const int want[3] = {1, 2, 3};  // choices 1.169, 0.731, 0.622 (expert 0's 0.5 is fourth)
  double top_sum = 0;
  for (int k = 0; k < 3; ++k) top_sum += sig[want[k]];
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(index.at(k), want[k]) << k;
    EXPECT_NEAR(weights.at(k), 2.5 * sig[want[k]] / top_sum, 1e-6) << k;
  }
}

TEST(MoeCpu, TopkValidatesArguments) {
  HostTensor logits(DType::kBFloat16, {4, 16}), weights(DType::kFloat32, {4, 2}), index(DType::kInt64, {4, 2});
  HostTensor wide(DType::kFloat32, {2, 1025}), wide_w(DType::kFloat32, {2, 2}), wide_i(DType::kInt64, {2, 2}),
      k17_w(DType::kFloat32, {4, 17}), k17_i(DType::kInt64, {4, 17}), f16_w(DType::kFloat16, {4, 2}),
      rows_i(DType::kInt64, {3, 2}), float_i(DType::kFloat32, {4, 2}), bias15(DType::kFloat32, {15});
  auto expect = [&](const HostTensor& l, const HostTensor& w, const HostTensor& i, auto&& tweak,
                    std::vector<std::string> needles) {
    fusebox::RouterArgs a = router(l, w, i);
    tweak(a);
    expect_error([&] { fusebox::moe_topk(a); }, needles);
  };
  auto none = [](fusebox::RouterArgs&) {};
  expect(wide, wide_w, wide_i, none, {"at most 1024 experts", "1025"});
  expect(logits, k17_w, k17_i, none, {"must be at most the 16 experts", "got 17"});
  expect(logits, f16_w, index, none, {"weights must be bfloat16 or float32"});
  expect(logits, weights, rows_i, none, {"index must have logits' 4 rows"});
  expect(logits, weights, float_i, none, {"index must be int32 or int64"});
  expect(logits, weights, index, [&](fusebox::RouterArgs& a) { a.bias = bias15.view; },
         {"bias must be a 1-D tensor of the 16 experts", "[15]"});
  expect(logits, weights, index, [](fusebox::RouterArgs& a) { a.num_groups = 3; },
         {"num_groups must divide the 16 experts", "got 3"});
  expect(logits, weights, index, [](fusebox::RouterArgs& a) { a.num_groups = 4, a.topk_groups = 5; },
         {"topk_groups must be 1-num_groups (4); got 5"});
  expect(logits, weights, index, [](fusebox::RouterArgs& a) { a.num_groups = 16; },
         {"groups at least 2 experts"});
}
