// CPU reference of the mixture-of-experts family.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/cpu_common.h"
#include "moe/moe_impl.h"

namespace fusebox::cpu {

void moe_combine_cpu(const CombinePlan& p) {
  const TensorView &rows = *p.rows, &index = *p.index, &weights = *p.weights, &out = *p.out;
  for (int64_t n = 0; n < p.tokens; ++n) {
    for (int64_t d = 0; d < p.width; ++d) {
      float acc = 0.f;
      for (int64_t k = 0; k < p.top_k; ++k) {
        const int64_t at = n * index.strides[0] + k * index.strides[1];
        const int64_t r = index.dtype == DType::kInt64 ? static_cast<const int64_t*>(index.data)[at]
                                                       : static_cast<const int32_t*>(index.data)[at];
        FUSEBOX_CHECK(r >= 0 && r < p.num_rows, "index[", n, ", ", k, "] = ", r, " is outside rows' ",
                      p.num_rows, " rows");
        const float w = load(weights.data, weights.dtype, n * weights.strides[0] + k * weights.strides[1]);
        float product = w * load(rows.data, rows.dtype, r * rows.strides[0] + d);
        if (weights.dtype != DType::kFloat32) product = round_to(rows.dtype, product);
        acc += product;
      }
      store(out.data, out.dtype, n * out.strides[0] + d, acc);
    }
  }
}

namespace {

// The order top-k selects in: by probability, NaN above all (as torch.topk ranks it).
float topk_key(float prob) { return std::isnan(prob) ? 2.f : prob; }

}  // namespace

void moe_topk_softmax_cpu(const TopkPlan& p) {
  const TensorView &logits = *p.logits, &weights = *p.weights, &index = *p.index;
  std::vector<float> prob(size_t(p.num_experts));
  std::vector<bool> taken(size_t(p.num_experts));
  for (int64_t n = 0; n < p.tokens; ++n) {
    float max = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < p.num_experts; ++e) {
      prob[e] = load(logits.data, logits.dtype, n * logits.strides[0] + e);
      max = std::max(max, prob[e]);
    }
    for (int64_t e = 0; e < p.num_experts; ++e) sum += prob[e] = std::exp(prob[e] - max);
    for (int64_t e = 0; e < p.num_experts; ++e) prob[e] /= sum;
    std::fill(taken.begin(), taken.end(), false);
    std::vector<std::pair<float, int64_t>> top;  // descending; of equal ones the lower expert first
    float top_sum = 0.f;
    for (int64_t k = 0; k < p.top_k; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < p.num_experts; ++e)
        if (!taken[e] && (best < 0 || topk_key(prob[e]) > topk_key(prob[best]))) best = e;
      taken[best] = true;
      top.emplace_back(prob[best], best);
      top_sum += prob[best];
    }
    for (int64_t k = 0; k < p.top_k; ++k) {
      const float w = (p.renormalize ? top[k].first / top_sum : top[k].first) * p.scale;
      store(weights.data, weights.dtype, n * weights.strides[0] + k * weights.strides[1], w);
      const int64_t at = n * index.strides[0] + k * index.strides[1];
      if (index.dtype == DType::kInt64)
        static_cast<int64_t*>(index.data)[at] = top[k].second;
      else
        static_cast<int32_t*>(index.data)[at] = int32_t(top[k].second);
    }
  }
}

void moe_sort_cpu(const SortPlan& p) {
  const TensorView &index = *p.index, &row_token = *p.row_token, &offsets = *p.offsets, &pair_row = *p.pair_row;
  auto expert_of = [&](int64_t n, int64_t k) {
    const int64_t at = n * index.strides[0] + k * index.strides[1];
    const int64_t e = index.dtype == DType::kInt64 ? static_cast<const int64_t*>(index.data)[at]
                                                   : static_cast<const int32_t*>(index.data)[at];
    FUSEBOX_CHECK(e >= 0 && e < p.num_experts, "index[", n, ", ", k, "] = ", e, " is outside the ",
                  p.num_experts, " experts");
    return e;
  };
  // a counting sort: each expert's first row, then its pairs in pair order
  std::vector<int64_t> next_row(p.num_experts + 1, 0);
  for (int64_t n = 0; n < p.tokens; ++n)
    for (int64_t k = 0; k < p.top_k; ++k) ++next_row[expert_of(n, k) + 1];
  auto* offs = static_cast<int32_t*>(offsets.data);
  for (int64_t e = 0; e < p.num_experts; ++e) {
    next_row[e + 1] += next_row[e];
    offs[e * offsets.strides[0]] = int32_t(next_row[e + 1]);
  }
  auto* tokens_of = static_cast<int32_t*>(row_token.data);
  auto* rows_of = static_cast<int32_t*>(pair_row.data);
  for (int64_t n = 0; n < p.tokens; ++n)
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t row = next_row[expert_of(n, k)]++;
      tokens_of[row * row_token.strides[0]] = int32_t(n);
      rows_of[n * pair_row.strides[0] + k * pair_row.strides[1]] = int32_t(row);
    }
}

}  // namespace fusebox::cpu
