// CPU reference of the mixture-of-experts family.
#include <algorithm>
#include <cmath>
#include <functional>
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

// The key the choice ranks experts by: NaN above all (as torch.topk ranks it).
float choice_key(float choice) { return std::isnan(choice) ? INFINITY : choice; }

// The index of the largest key not yet taken (of equal ones the lowest), or -1.
int64_t arg_max(const std::vector<float>& key, const std::vector<bool>& taken) {
  int64_t best = -1;
  for (size_t e = 0; e < key.size(); ++e)
    if (!taken[e] && key[e] > (best < 0 ? -INFINITY : key[best])) best = int64_t(e);
  return best;
}

}  // namespace

void moe_topk_cpu(const TopkPlan& p) {
  const RouterArgs& a = *p.args;
  const TensorView &logits = a.logits, &weights = a.weights, &index = a.index;
  const int64_t experts = p.num_experts;
  std::vector<float> score(static_cast<size_t>(experts)), key(score.size());
  std::vector<float> group_key(static_cast<size_t>(a.num_groups));
  std::vector<bool> taken(score.size()), group_taken(group_key.size());
  for (int64_t n = 0; n < p.tokens; ++n) {
    for (int64_t e = 0; e < experts; ++e) score[e] = load(logits.data, logits.dtype, n * logits.strides[0] + e);
    if (a.score == RouterScore::kSoftmax) {
      float max = -INFINITY, sum = 0.f;
      for (float x : score) max = std::max(max, x);
      for (float& x : score) sum += x = std::exp(x - max);
      for (float& x : score) x /= sum;
    } else {
      for (float& x : score) x = 1.f / (1.f + std::exp(-x));
    }
    for (int64_t e = 0; e < experts; ++e)
      key[e] = choice_key(a.bias.defined() ? score[e] + load(a.bias.data, a.bias.dtype, e * a.bias.strides[0])
                                           : score[e]);
    if (a.num_groups > 1) {  // a group ranks by its two largest choice scores, summed
      for (int64_t g = 0; g < a.num_groups; ++g) {
        const auto first = key.begin() + g * p.group_size;
        std::vector<float> members(first, first + p.group_size);
        std::partial_sort(members.begin(), members.begin() + 2, members.end(), std::greater<float>());
        group_key[g] = members[0] + members[1];
      }
      std::fill(group_taken.begin(), group_taken.end(), false);
      for (int64_t j = 0; j < a.topk_groups; ++j) {  // of equal keys the lowest group, -inf ones too
        int64_t best = -1;
        for (int64_t g = 0; g < a.num_groups; ++g)
          if (!group_taken[g] && (best < 0 || group_key[g] > group_key[best])) best = g;
        group_taken[best] = true;
      }
      for (int64_t e = 0; e < experts; ++e)
        if (!group_taken[e / p.group_size]) key[e] = -INFINITY;  // outside the chosen groups
    }
    std::fill(taken.begin(), taken.end(), false);
    std::vector<int64_t> top;
    float top_sum = 0.f;
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int64_t best = arg_max(key, taken);
      FUSEBOX_CHECK(best >= 0, "token ", n, " has fewer than top_k (", p.top_k, ") experts to choose from");
      taken[best] = true;
      top.push_back(best);
      top_sum += score[best];
    }
    for (int64_t k = 0; k < p.top_k; ++k) {
      const float w = (a.renormalize ? score[top[k]] / (top_sum + 1e-20f) : score[top[k]]) * a.scale;
      store(weights.data, weights.dtype, n * weights.strides[0] + k * weights.strides[1], w);
      const int64_t at = n * index.strides[0] + k * index.strides[1];
      if (index.dtype == DType::kInt64)
        static_cast<int64_t*>(index.data)[at] = top[k];
      else
        static_cast<int32_t*>(index.data)[at] = int32_t(top[k]);
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
