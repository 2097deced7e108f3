// Elementwise activation kernel over rows: out = act(a + bias) [* b]. Each thread moves up to
// kItems 16-byte vectors of a row; column chunks spread wide rows over several blocks so that
// even one row (decode) fills more than one SM.
#include "act/act_impl.h"
#include "common/cuda_common.cuh"

namespace fusebox::cuda {
namespace {

constexpr int kItems = 4;
constexpr int kBlockThreads = 256;

struct ActKernelArgs {
  RowIndexer index;
  int64_t rows;
  int vec_per_row;
  int rows_per_block;
  const void* a;
  const void* b;
  void* out;
  RowOffsets sa, sb, sout;
  ParamPtr bias;
  Activation act;
};

// The activation and the presence of `b` / bias are compile-time, so the per-element loop is
// straight-line code.
template <typename T, int VEC, Activation ACT, bool GATED, bool BIAS>
__global__ void __launch_bounds__(kBlockThreads) activation_kernel(const ActKernelArgs p) {
  const int64_t row = int64_t(blockIdx.x) * p.rows_per_block + threadIdx.y;
  if (row >= p.rows) return;
  int64_t i0, i1, i2;
  p.index.split(row, i0, i1, i2);
  const T* a = static_cast<const T*>(p.a) + p.sa.at(i0, i1, i2);
  const T* b = GATED ? static_cast<const T*>(p.b) + p.sb.at(i0, i1, i2) : nullptr;
  T* out = static_cast<T*>(p.out) + p.sout.at(i0, i1, i2);

  const int first = blockIdx.y * kItems * blockDim.x + threadIdx.x;
  float va[kItems][VEC], vb[kItems][VEC];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {  // issue every load before the first use
    const int vi = first + it * blockDim.x;
    if (vi < p.vec_per_row) {
      VecIO<T, VEC>::load(a + vi * VEC, va[it]);
      if constexpr (GATED) VecIO<T, VEC>::load(b + vi * VEC, vb[it]);
    }
  }
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int vi = first + it * blockDim.x;
    if (vi >= p.vec_per_row) break;
    float bias[VEC] = {};
    if constexpr (BIAS) load_param<T, VEC>(p.bias, vi * VEC, bias);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float v = apply_activation(ACT, va[it][i] + bias[i]);
      va[it][i] = GATED ? v * vb[it][i] : v;
    }
    VecIO<T, VEC>::store(out + vi * VEC, va[it]);
  }
}

}  // namespace

void activation_cuda(const ActPlan& plan, int vec, cudaStream_t stream) {
  const int64_t width = plan.a->shape[plan.a->ndim - 1];
  if (plan.layout.rows == 0 || width == 0) return;
  ActKernelArgs p{};
  p.index = row_indexer(plan.layout);
  p.rows = plan.layout.rows;
  p.vec_per_row = int(width / vec);
  p.a = plan.a->data;
  p.b = plan.b->defined() ? plan.b->data : nullptr;
  p.out = plan.out->data;
  p.sa = row_offsets(plan.sa);
  p.sb = row_offsets(plan.sb);
  p.sout = row_offsets(plan.sout);
  p.bias = ParamPtr{plan.bias->defined() ? plan.bias->data : nullptr,
                    plan.bias->defined() && plan.bias->dtype == DType::kFloat32};
  p.act = plan.act;

  int tpr = next_pow2((p.vec_per_row + kItems - 1) / kItems);
  if (tpr > kBlockThreads) tpr = kBlockThreads;
  p.rows_per_block = kBlockThreads / tpr;
  const int64_t chunks = (p.vec_per_row + int64_t(tpr) * kItems - 1) / (int64_t(tpr) * kItems);
  FUSEBOX_CHECK(chunks <= 65535, "row width ", width, " is too wide for the activation kernel");
  const dim3 block(tpr, p.rows_per_block);
  const dim3 grid(unsigned((p.rows + p.rows_per_block - 1) / p.rows_per_block), unsigned(chunks));
  dispatch_dtype(plan.a->dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      auto launch = [&](auto act, auto gated, auto bias) {
        activation_kernel<T, V, decltype(act)::value, decltype(gated)::value, decltype(bias)::value>
            <<<grid, block, 0, stream>>>(p);
      };
      using Act = Activation;
      auto with_act = [&](auto gated, auto bias) {
        switch (p.act) {
          case Act::kSiLU: launch(std::integral_constant<Act, Act::kSiLU>{}, gated, bias); break;
          case Act::kGeluTanh: launch(std::integral_constant<Act, Act::kGeluTanh>{}, gated, bias); break;
          case Act::kGelu: launch(std::integral_constant<Act, Act::kGelu>{}, gated, bias); break;
        }
      };
      // Gated forms never take a bias; the ungated form may.
      if (p.b)
        with_act(std::true_type{}, std::false_type{});
      else if (p.bias.ptr)
        with_act(std::false_type{}, std::true_type{});
      else
        with_act(std::false_type{}, std::false_type{});
    });
  });
  FUSEBOX_CHECK_LAUNCH();
}

}  // namespace fusebox::cuda
