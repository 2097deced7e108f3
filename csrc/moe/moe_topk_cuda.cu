// Mixture-of-experts router top-k: each token's softmax over its experts and its K largest
// probabilities, in one launch where transformers' routers run softmax, topk and the
// renormalization, scale and cast as 2-6 launches a layer. One warp a token: lane l holds experts
// l, l + 32, ... (VPL of them) in registers; the softmax takes two warp reductions, and each of
// the K selections one warp arg-max, the winning lane striking its expert out.
#include <climits>

#include "moe/moe_impl.h"
#include "moe/moe_operands.cuh"

namespace fusebox::cuda {
namespace {

constexpr int kBlockThreads = 256;  // 8 tokens a block

struct TopkKernelArgs {
  const void* logits;
  void* weights;  // fp32 or T
  IndexPtr index;
  int64_t logits_stride;
  Strides2D weights_strides, index_strides;
  int64_t tokens;
  int num_experts, top_k;
  bool renormalize, weights_f32;
  float scale;
};

// The order the selection takes: by probability, NaN above all (as torch.topk ranks it); -1
// marks an expert past the row or already taken.
__device__ __forceinline__ float topk_key(float prob) { return isnan(prob) ? 2.f : prob; }

template <typename T, int VPL>
__global__ void __launch_bounds__(kBlockThreads) moe_topk_softmax_kernel(const TopkKernelArgs p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * (kBlockThreads / 32) + (threadIdx.x >> 5);
  if (token >= p.tokens) return;  // the whole warp
  const T* row = static_cast<const T*>(p.logits) + token * p.logits_stride;

  pdl_wait();
  float prob[VPL];
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? to_float(row[e]) : -INFINITY;
    max = fmaxf(max, prob[i]);
  }
  pdl_release();
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, off));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    prob[i] = lane + 32 * i < p.num_experts ? expf(prob[i] - max) : 0.f;
    sum += prob[i];
  }
  sum = lane_group_sum(sum, 32);
  float key[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    prob[i] /= sum;
    key[i] = lane + 32 * i < p.num_experts ? topk_key(prob[i]) : -1.f;
  }

  // K rounds of a warp arg-max over (key descending, expert ascending); lane k keeps round k's
  float mine = 0.f, top_sum = 0.f;
  int mine_expert = 0;
  for (int k = 0; k < p.top_k; ++k) {
    float best_key = -1.f, best_prob = 0.f;
    int best = INT_MAX;
#pragma unroll
    for (int i = 0; i < VPL; ++i)  // a lane's experts ascend with i: strictly greater keeps the lower
      if (key[i] > best_key) {
        best_key = key[i];
        best_prob = prob[i];
        best = lane + 32 * i;
      }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float other_key = __shfl_xor_sync(0xffffffffu, best_key, off);
      const float other_prob = __shfl_xor_sync(0xffffffffu, best_prob, off);
      const int other = __shfl_xor_sync(0xffffffffu, best, off);
      if (other_key > best_key || (other_key == best_key && other < best)) {
        best_key = other_key;
        best_prob = other_prob;
        best = other;
      }
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (lane + 32 * i == best) key[i] = -1.f;
    if (lane == k) {
      mine = best_prob;
      mine_expert = best;
    }
    top_sum += best_prob;  // in k order, the same on every lane
  }
  if (lane < p.top_k) {
    const float w = (p.renormalize ? mine / top_sum : mine) * p.scale;
    const int64_t at = p.weights_strides.at(token, lane);
    if (p.weights_f32)
      static_cast<float*>(p.weights)[at] = w;
    else
      static_cast<T*>(p.weights)[at] = from_float<T>(w);
    p.index.store(p.index_strides.at(token, lane), mine_expert);
  }
}

}  // namespace

void moe_topk_softmax_cuda(const TopkPlan& plan, cudaStream_t stream) {
  TopkKernelArgs p{};
  p.logits = plan.logits->data;
  p.weights = plan.weights->data;
  p.weights_f32 = plan.weights->dtype == DType::kFloat32;
  p.index = index_ptr(*plan.index);
  p.logits_stride = plan.logits->strides[0];
  p.weights_strides = strides_2d(*plan.weights);
  p.index_strides = strides_2d(*plan.index);
  p.tokens = plan.tokens;
  p.num_experts = int(plan.num_experts);
  p.top_k = int(plan.top_k);
  p.renormalize = plan.renormalize;
  p.scale = plan.scale;
  const int64_t blocks = (plan.tokens + kBlockThreads / 32 - 1) / (kBlockThreads / 32);
  FUSEBOX_CHECK(blocks < (int64_t(1) << 31), "too many tokens: ", plan.tokens);
  const int vpl = next_pow2((plan.num_experts + 31) / 32);  // 1..32 (at most 1024 experts)
  dispatch_dtype(plan.logits->dtype, [&](auto t) {
    using T = decltype(t);
    const dim3 grid(static_cast<unsigned>(blocks)), block(kBlockThreads);
    switch (vpl) {
      case 1: launch(moe_topk_softmax_kernel<T, 1>, grid, block, 0, stream, p); break;
      case 2: launch(moe_topk_softmax_kernel<T, 2>, grid, block, 0, stream, p); break;
      case 4: launch(moe_topk_softmax_kernel<T, 4>, grid, block, 0, stream, p); break;
      case 8: launch(moe_topk_softmax_kernel<T, 8>, grid, block, 0, stream, p); break;
      case 16: launch(moe_topk_softmax_kernel<T, 16>, grid, block, 0, stream, p); break;
      default: launch(moe_topk_softmax_kernel<T, 32>, grid, block, 0, stream, p); break;
    }
  });
}

}  // namespace fusebox::cuda
