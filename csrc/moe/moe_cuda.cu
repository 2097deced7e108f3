// Mixture-of-experts combine kernel: each token's output row is the weighted sum of the K
// expert-output rows its index names. Threads of a token own one vector of its row each
// (column chunks for rows wider than a block), issue the loads of up to kLoadsInFlight rows
// before the first product, and write the row once: the gather, the fp32 products and the sum
// of the unfused form, which write and read (2 + 4 + 4) * K bytes an element between them,
// become one read of the K rows.
#include "common/cuda_common.cuh"
#include "moe/moe_impl.h"

namespace fusebox::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kLoadsInFlight = 8;  // top-k of the common MoE models: 2, 4, 6 or 8

struct CombineKernelArgs {
  const void* rows;
  const void* index;
  ParamPtr weights;
  void* out;
  int64_t rows_stride, out_stride, index_s0, index_s1, weights_s0, weights_s1;
  int64_t tokens, num_rows;
  int top_k, vec_per_row, tokens_per_block;
  bool index64;
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads) moe_combine_kernel(const CombineKernelArgs p) {
  const int64_t token = int64_t(blockIdx.x) * p.tokens_per_block + threadIdx.y;
  const int vi = blockIdx.y * blockDim.x + threadIdx.x;
  if (token >= p.tokens || vi >= p.vec_per_row) return;
  const T* rows = static_cast<const T*>(p.rows) + vi * VEC;
  const int64_t index_row = token * p.index_s0, weights_row = token * p.weights_s0;

  pdl_wait();
  float acc[VEC] = {};
  bool out_of_range = false;
  for (int k0 = 0; k0 < p.top_k; k0 += kLoadsInFlight) {
    Pack<T, VEC> v[kLoadsInFlight];
    float w[kLoadsInFlight];
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j) {
      if (k0 + j < p.top_k) {
        const int64_t at = index_row + (k0 + j) * p.index_s1;
        int64_t r = p.index64 ? __ldg(static_cast<const long long*>(p.index) + at)
                              : __ldg(static_cast<const int*>(p.index) + at);
        if (r < 0 || r >= p.num_rows) {  // never read out of bounds; the row becomes NaN
          out_of_range = true;
          r = 0;
        }
        v[j] = load_pack<T, VEC>(rows + r * p.rows_stride);
        w[j] = load_param_scalar<T>(p.weights, weights_row + (k0 + j) * p.weights_s1);
      }
    }
#pragma unroll
    for (int j = 0; j < kLoadsInFlight; ++j) {
      if (k0 + j < p.top_k) {
        float x[VEC];
        unpack(v[j], x);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[j], x[i]));  // no fma: as unfused
      }
    }
  }
  pdl_release();
  if (out_of_range) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = __int_as_float(0x7fc00000);
  }
  store_pack(static_cast<T*>(p.out) + token * p.out_stride + vi * VEC, pack<T, VEC>(acc));
}

}  // namespace

void moe_combine_cuda(const CombinePlan& plan, int vec, cudaStream_t stream) {
  CombineKernelArgs p{};
  p.rows = plan.rows->data;
  p.index = plan.index->data;
  p.weights = ParamPtr{plan.weights->data, plan.weights->dtype == DType::kFloat32};
  p.out = plan.out->data;
  p.rows_stride = plan.rows->strides[0];
  p.out_stride = plan.out->strides[0];
  p.index_s0 = plan.index->strides[0];
  p.index_s1 = plan.index->strides[1];
  p.weights_s0 = plan.weights->strides[0];
  p.weights_s1 = plan.weights->strides[1];
  p.tokens = plan.tokens;
  p.num_rows = plan.num_rows;
  FUSEBOX_CHECK(plan.top_k < (int64_t(1) << 31), "index's top_k must be < 2^31; got ", plan.top_k);
  p.top_k = int(plan.top_k);
  p.index64 = plan.index->dtype == DType::kInt64;
  p.vec_per_row = int(plan.width / vec);
  const ColumnSplit split = column_split(p.vec_per_row, 1, false, kBlockThreads);
  p.tokens_per_block = std::max(1, kBlockThreads / split.tpr);
  FUSEBOX_CHECK(split.chunks <= 65535, "rows' width ", plan.width, " is too wide for the combine kernel");
  const int64_t blocks = (p.tokens + p.tokens_per_block - 1) / p.tokens_per_block;
  FUSEBOX_CHECK(blocks < (int64_t(1) << 31), "too many tokens: ", p.tokens);
  const dim3 block(split.tpr, p.tokens_per_block);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(split.chunks));
  dispatch_dtype(plan.rows->dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      launch(moe_combine_kernel<T, V>, grid, block, 0, stream, p);
    });
  });
}

}  // namespace fusebox::cuda
