// Mixture-of-experts router top-k: each token's scores (softmax or sigmoid), the optional
// group-limited choice, its K experts and their weights in one launch, where transformers'
// routers take 2-6 launches (softmax, topk, renormalization, scale, cast) or, with sigmoid scores
// and groups (DeepSeek-V3), a dozen. One warp a token: lane l holds experts l, l + 32, ... (VPL
// of them) in registers. The softmax takes two warp reductions; the groups' ranks one top-2
// merge over the warp (all groups at once where a group is whole registers, as DeepSeek-V3's
// 32); each group and each of the K choices one arg-max, the winning lane striking its expert
// out. The arg-max takes two hardware reductions (sm_80+) of the key as an ordered integer, the
// largest key then the lowest id holding it, where it took five dependent steps of two shuffles.
// With the groups ranked at once too (the two changes were measured together), one token of
// DeepSeek-V3 went from 5.7 to 4.0 us and one of OLMoE from 2.55 to 1.84 (H100, CUDA graph).
#include <climits>

#include "moe/moe_impl.h"
#include "moe/moe_operands.cuh"

namespace fusebox::cuda {
namespace {

constexpr int kBlockThreads = 256;  // 8 tokens a block

struct TopkKernelArgs {
  const void* logits;
  const void* bias;  // nullptr, or [E] of bias_dtype
  void* weights;     // fp32 or T
  IndexPtr index;
  int64_t logits_stride, bias_stride;
  Strides2D weights_strides, index_strides;
  int64_t tokens;
  int num_experts, top_k, num_groups, topk_groups, group_size;
  DType bias_dtype;
  bool sigmoid, renormalize, weights_f32;
  float scale;
};

// The k-th choice of a token: its weight (renormalized over the top_sum of the K scores if asked,
// then scaled) and its expert (-1 where no expert filled the slot).
template <typename T>
__device__ __forceinline__ void store_choice(const TopkKernelArgs& p, int64_t token, int k, float score,
                                             float top_sum, int expert) {
  const float w = (p.renormalize ? score / (top_sum + 1e-20f) : score) * p.scale;
  const int64_t at = p.weights_strides.at(token, k);
  if (p.weights_f32)
    static_cast<float*>(p.weights)[at] = w;
  else
    static_cast<T*>(p.weights)[at] = from_float<T>(w);
  p.index.store(p.index_strides.at(token, k), expert);
}

__device__ __forceinline__ float load_bias(const TopkKernelArgs& p, int e) {
  const int64_t at = e * p.bias_stride;
  switch (p.bias_dtype) {
    case DType::kFloat16: return to_float(static_cast<const __half*>(p.bias)[at]);
    case DType::kBFloat16: return to_float(static_cast<const __nv_bfloat16*>(p.bias)[at]);
    default: return static_cast<const float*>(p.bias)[at];
  }
}

// A choice key as an unsigned integer of the same order: larger floats give larger keys, -0 and
// +0 the same one, and -inf (struck out, past the row, or a group not chosen) 0, below every
// key that can be chosen. Integer keys take the warp's hardware max and min reductions.
__device__ __forceinline__ unsigned order_key(float f) {
  if (f == -INFINITY) return 0u;
  const unsigned u = __float_as_uint(f + 0.f);  // + 0: -0 becomes +0
  return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// The warp's largest (kMax) or smallest 32-bit integer, on every lane: one hardware reduction
// on sm_80+, a shuffle tree before.
template <bool kMax, typename T>
__device__ __forceinline__ T warp_extreme(T v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return kMax ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const T other = __shfl_xor_sync(0xffffffffu, v, off);
    v = kMax ? max(v, other) : min(v, other);
  }
  return v;
#endif
}

// The warp's largest key and, of the lanes holding it, the lowest id, on every lane; INT_MAX
// where every key is 0. Two reductions, where a shuffle tree of (key, id) takes five dependent
// steps of two shuffles.
__device__ __forceinline__ int warp_arg_max(unsigned key, int id) {
  const unsigned best = warp_extreme<true>(key);
  return warp_extreme<false>(best != 0u && key == best ? id : INT_MAX);
}

// Top-2 of two multisets, each given as its two largest: (first, second) becomes the merge's.
__device__ __forceinline__ void merge_top2(float& first, float& second, float other_first, float other_second) {
  second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
  first = fmaxf(first, other_first);
}

template <typename T, int VPL>
__global__ void __launch_bounds__(kBlockThreads) moe_topk_kernel(const TopkKernelArgs p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * (kBlockThreads / 32) + (threadIdx.x >> 5);
  if (token >= p.tokens) return;  // the whole warp
  const T* row = static_cast<const T*>(p.logits) + token * p.logits_stride;

  pdl_wait();
  // The bias loads with the logits. Loaded where it is added, after the scores, it was a second
  // memory round trip on the chain (DeepSeek-V3, one token, H100, CUDA graph: 4.04-4.12 us ->
  // 3.66-3.71; routers without a bias level).
  float score[VPL], bias[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int e = lane + 32 * i;
    score[i] = e < p.num_experts ? to_float(row[e]) : -INFINITY;
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int e = lane + 32 * i;
    bias[i] = p.bias != nullptr && e < p.num_experts ? load_bias(p, e) : 0.f;
  }
  pdl_release();
  if (p.sigmoid) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) score[i] = 1.f / (1.f + expf(-score[i]));  // 0 past the row
  } else {
    float max = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPL; ++i) max = fmaxf(max, score[i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, off));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      score[i] = lane + 32 * i < p.num_experts ? expf(score[i] - max) : 0.f;
      sum += score[i];
    }
    sum = lane_group_sum(sum, 32);
#pragma unroll
    for (int i = 0; i < VPL; ++i) score[i] /= sum;
  }
  // the choice's keys: score + bias, NaN above all (as torch.topk ranks it), -inf past the row
  float key[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int e = lane + 32 * i;
    const float choice = p.bias != nullptr ? score[i] + bias[i] : score[i];
    key[i] = e < p.num_experts ? (isnan(choice) ? INFINITY : choice) : -INFINITY;
  }

  if (p.num_groups > 1) {
    // group g's rank: its two largest keys, summed; lane g keeps it
    float group_key = -INFINITY;
    if (p.group_size % 32 == 0) {
      // groups of whole registers (DeepSeek-V3: register i is group i): every register's top-2
      // over the warp at once, their shuffles interleaved, then lane g merges its group's
      const int group_registers = p.group_size / 32;
      float first[VPL], second[VPL];
#pragma unroll
      for (int i = 0; i < VPL; ++i) {
        first[i] = key[i];
        second[i] = -INFINITY;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const float other_first = __shfl_xor_sync(0xffffffffu, first[i], off);
          const float other_second = __shfl_xor_sync(0xffffffffu, second[i], off);
          merge_top2(first[i], second[i], other_first, other_second);
        }
      }
      float group_first = -INFINITY, group_second = -INFINITY;
#pragma unroll
      for (int i = 0; i < VPL; ++i)
        if (i / group_registers == lane) merge_top2(group_first, group_second, first[i], second[i]);
      if (lane < p.num_groups) group_key = group_first + group_second;
    } else {
      for (int g = 0; g < p.num_groups; ++g) {
        float first = -INFINITY, second = -INFINITY;
#pragma unroll
        for (int i = 0; i < VPL; ++i)
          if ((lane + 32 * i) / p.group_size == g && lane + 32 * i < p.num_experts)
            merge_top2(first, second, key[i], -INFINITY);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const float other_first = __shfl_xor_sync(0xffffffffu, first, off);
          const float other_second = __shfl_xor_sync(0xffffffffu, second, off);
          merge_top2(first, second, other_first, other_second);
        }
        if (lane == g) group_key = first + second;
      }
    }
    // the open groups' arg-max, of equal keys the lowest: a NaN group key (an infinite key beside
    // a -inf one) ranks above all, as torch.topk ranks NaN, and a -inf one just above the closed
    unsigned chosen = 0;  // bit g: group g is chosen from
    unsigned open_key = lane < p.num_groups ? max(order_key(group_key), 1u) : 0u;
    for (int j = 0; j < p.topk_groups; ++j) {
      const int best = warp_arg_max(open_key, lane);
      chosen |= 1u << best;  // an open group is left: topk_groups <= num_groups
      if (lane == best) open_key = 0u;
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (!((chosen >> ((lane + 32 * i) / p.group_size)) & 1u)) key[i] = -INFINITY;
  }

  // K rounds of a warp arg-max over (key descending, expert ascending); lane k keeps round k's
  unsigned order[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) order[i] = order_key(key[i]);
  float mine = 0.f, top_sum = 0.f;
  int mine_expert = 0;
  for (int k = 0; k < p.top_k; ++k) {
    unsigned lane_best = 0u;
#pragma unroll
    for (int i = 0; i < VPL; ++i) lane_best = max(lane_best, order[i]);
    int lane_expert = INT_MAX;
#pragma unroll
    for (int i = VPL - 1; i >= 0; --i)  // of equal keys the lowest expert
      if (order[i] == lane_best) lane_expert = lane + 32 * i;
    const int best = warp_arg_max(lane_best, lane_expert);
    float best_score = __int_as_float(0x7fc00000);  // none left (a bias of -inf): NaN, expert -1
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (lane + 32 * i == best) {
        order[i] = 0u;
        best_score = score[i];
      }
    best_score = __shfl_sync(0xffffffffu, best_score, best < INT_MAX ? best & 31 : lane);
    if (lane == k) {
      mine = best_score;
      mine_expert = best < INT_MAX ? best : -1;
    }
    top_sum += best_score;  // in k order, the same on every lane
  }
  if (lane < p.top_k) store_choice<T>(p, token, lane, mine, top_sum, mine_expert);
}

// The float an order_key stands for (0: -inf); +0 for both zeros.
__device__ __forceinline__ float key_value(unsigned key) {
  if (key == 0u) return -INFINITY;
  return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

// Decode-sized grouped routers (fewer tokens than SMs; groups one warp wide, DeepSeek-V3's 8 of
// 32) whose chosen groups hold at most kRankedCandidates experts: a block a token, expert e on
// thread e. The warp kernel's chain is a top-2 merge over the warp, topk_groups group rounds and
// K dependent arg-max rounds. Here each warp takes its group's top-2 by two reductions and a vote,
// each group's rank is a count of the group keys above its own, and every chosen expert's slot is
// the count of the chosen experts ranked above it, read from shared memory (8 16-byte reads and
// 32 compares a warp of experts): the rounds become independent compares. The same keys, orders
// and ties as moe_topk_kernel.
constexpr int kRankedThreads = 1024;    // a thread an expert
constexpr int kRankedCandidates = 128;  // experts a slot counts over: the chosen groups'

template <typename T>
__global__ void __launch_bounds__(kRankedThreads) moe_topk_ranked_kernel(const TopkKernelArgs p) {
  __shared__ __align__(16) unsigned expert_keys[kRankedThreads];
  __shared__ float warp_max[32], warp_sum[32];  // softmax: each warp's
  __shared__ unsigned group_keys[32];
  __shared__ float slot_score[32];
  __shared__ int slot_expert[32];
  // a thread an expert: the block is the token's num_groups * 32 experts
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, expert = threadIdx.x;
  const int64_t token = blockIdx.x;
  const T* row = static_cast<const T*>(p.logits) + token * p.logits_stride;

  pdl_wait();
  const float logit = to_float(row[expert]);
  const float bias = p.bias != nullptr ? load_bias(p, expert) : 0.f;  // beside the logit
  pdl_release();
  float score;
  if (p.sigmoid) {
    score = 1.f / (1.f + expf(-logit));
  } else {  // the block's max, then its sum, each from the warps' partials
    float max = logit;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, off));
    if (lane == 0) warp_max[warp] = max;
    __syncthreads();
    for (int w = 0; w < warps; ++w) max = fmaxf(max, warp_max[w]);
    const float e = expf(logit - max);
    score = e / row_sum(e, int(blockDim.x), warp_sum);
  }
  const float choice = p.bias != nullptr ? score + bias : score;
  const unsigned key = order_key(isnan(choice) ? INFINITY : choice);
  expert_keys[expert] = key;
  {  // the group's two largest keys, summed (a key held twice counts twice, as torch.topk takes it)
    const unsigned first = warp_extreme<true>(key);
    const unsigned below_first = warp_extreme<true>(key == first ? 0u : key);
    const unsigned holders = __ballot_sync(0xffffffffu, key == first);
    const unsigned second = holders & (holders - 1u) ? first : below_first;
    if (lane == 0) group_keys[warp] = max(order_key(key_value(first) + key_value(second)), 1u);
  }
  if (expert < p.top_k) {  // a slot no expert fills (too few choices) stays NaN, expert -1
    slot_score[expert] = __int_as_float(0x7fc00000);
    slot_expert[expert] = -1;
  }
  __syncthreads();

  // group g (warp g, lane g here) is chosen where fewer than topk_groups groups rank above it: a
  // larger key, or an equal one at a lower index
  const unsigned own_group_key = lane < p.num_groups ? group_keys[lane] : 0u;
  int groups_above = 0;
  for (int h = 0; h < p.num_groups; ++h) {
    const unsigned other = group_keys[h];
    groups_above += other > own_group_key || (other == own_group_key && h < lane);
  }
  const unsigned chosen = __ballot_sync(0xffffffffu, lane < p.num_groups && groups_above < p.topk_groups);
  if (((chosen >> warp) & 1u) && key != 0u) {
    // expert j ranks above this one where its key is larger, or equal at a lower index: above
    // key - 1 for j < expert, above key for j > expert (key >= 1 here). Four counts, so that the
    // adds are not one chain.
    int above[4] = {0, 0, 0, 0};
    for (unsigned rest = chosen; rest != 0u; rest &= rest - 1u) {
      const int h = __ffs(rest) - 1;
      const uint4* keys = reinterpret_cast<const uint4*>(expert_keys + 32 * h);
      if (h != warp) {  // 32 experts all at lower or all at higher indices
        const unsigned t = h < warp ? key - 1u : key;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const uint4 k = keys[q];
          above[0] += k.x > t;
          above[1] += k.y > t;
          above[2] += k.z > t;
          above[3] += k.w > t;
        }
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const uint4 k = keys[q];
          above[0] += k.x > (4 * q + 0 < lane ? key - 1u : key);
          above[1] += k.y > (4 * q + 1 < lane ? key - 1u : key);
          above[2] += k.z > (4 * q + 2 < lane ? key - 1u : key);
          above[3] += k.w > (4 * q + 3 < lane ? key - 1u : key);
        }
      }
    }
    const int slot = above[0] + above[1] + above[2] + above[3];
    if (slot < p.top_k) {
      slot_score[slot] = score;
      slot_expert[slot] = expert;
    }
  }
  __syncthreads();

  if (expert < p.top_k) {
    float top_sum = 0.f;  // in k order, as moe_topk_kernel sums
    for (int k = 0; k < p.top_k; ++k) top_sum += slot_score[k];
    store_choice<T>(p, token, expert, slot_score[expert], top_sum, slot_expert[expert]);
  }
}

}  // namespace

void moe_topk_cuda(const TopkPlan& plan, cudaStream_t stream) {
  const RouterArgs& a = *plan.args;
  TopkKernelArgs p{};
  p.logits = a.logits.data;
  p.bias = a.bias.defined() ? a.bias.data : nullptr;
  p.bias_stride = a.bias.defined() ? a.bias.strides[0] : 0;
  p.bias_dtype = a.bias.dtype;
  p.weights = a.weights.data;
  p.weights_f32 = a.weights.dtype == DType::kFloat32;
  p.index = index_ptr(a.index);
  p.logits_stride = a.logits.strides[0];
  p.weights_strides = strides_2d(a.weights);
  p.index_strides = strides_2d(a.index);
  p.tokens = plan.tokens;
  p.num_experts = int(plan.num_experts);
  p.top_k = int(plan.top_k);
  p.num_groups = int(a.num_groups);
  p.topk_groups = int(a.topk_groups);
  p.group_size = int(plan.group_size);
  p.sigmoid = a.score == RouterScore::kSigmoid;
  p.renormalize = a.renormalize;
  p.scale = a.scale;
  // Decode sizes (fewer tokens than SMs) of routers with groups of one warp whose chosen groups
  // hold at most kRankedCandidates experts: a block a token (moe_topk_ranked_kernel). H100,
  // CUDA-graph replay against the warp kernel: DeepSeek-V3 1 x 256 3.56-3.58 -> 2.34-2.35 us,
  // 16 x 256 4.19-4.21 -> 2.60; without groups it ran 0.2-0.4 us slower (Mixtral 1 x 8
  // 1.70-1.78 -> 2.01-2.02, Qwen3-30B-A3B 1 x 128 2.12 -> 2.41), so those keep the warp kernel.
  const bool warp_groups = p.num_groups > 1 && p.group_size == 32;
  if (plan.tokens <= device_limits().sm_count && warp_groups && int64_t(p.topk_groups) * 32 <= kRankedCandidates) {
    const unsigned threads = unsigned(plan.num_experts);  // num_groups * 32: a thread an expert
    dispatch_dtype(a.logits.dtype, [&](auto t) {
      launch(moe_topk_ranked_kernel<decltype(t)>, dim3(unsigned(plan.tokens)), dim3(threads), 0, stream, p);
    });
    return;
  }
  const int64_t blocks = (plan.tokens + kBlockThreads / 32 - 1) / (kBlockThreads / 32);
  FUSEBOX_CHECK(blocks < (int64_t(1) << 31), "too many tokens: ", plan.tokens);
  const int vpl = next_pow2((plan.num_experts + 31) / 32);  // 1..32 (at most 1024 experts)
  dispatch_dtype(a.logits.dtype, [&](auto t) {
    using T = decltype(t);
    const dim3 grid(static_cast<unsigned>(blocks)), block(kBlockThreads);
    switch (vpl) {
      case 1: launch(moe_topk_kernel<T, 1>, grid, block, 0, stream, p); break;
      case 2: launch(moe_topk_kernel<T, 2>, grid, block, 0, stream, p); break;
      case 4: launch(moe_topk_kernel<T, 4>, grid, block, 0, stream, p); break;
      case 8: launch(moe_topk_kernel<T, 8>, grid, block, 0, stream, p); break;
      case 16: launch(moe_topk_kernel<T, 16>, grid, block, 0, stream, p); break;
      default: launch(moe_topk_kernel<T, 32>, grid, block, 0, stream, p); break;
    }
  });
}

}  // namespace fusebox::cuda
