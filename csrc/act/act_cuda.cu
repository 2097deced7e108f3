// Elementwise activation kernel over rows: out = act(a + bias) [* b]. Each thread moves
// ITEMS vectors of a row; column chunks spread wide rows over several blocks so that even one
// row (decode) fills more than one SM. Operands whose rows are packed end to end (no bias)
// may instead run as one long row (FLAT): every block full, consecutive blocks on
// consecutive memory. The activation, the presence of `b` / bias, ITEMS and FLAT are template
// parameters, so the per-element loop is straight-line code and a flat kernel carries no row
// arithmetic at all; ITEMS stays small to keep the kernel short (instruction fetch is part
// of the latency of short launches).
#include "act/act_impl.h"
#include "common/cuda_common.cuh"

namespace fusebox::cuda {
namespace {

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
};

// FLAT: one row of rows * width elements at offset 0 (the chunk is blockIdx.x).
template <typename T, int VEC, Activation ACT, bool GATED, bool BIAS, int ITEMS, bool FLAT>
__global__ void __launch_bounds__(kBlockThreads) activation_kernel(const ActKernelArgs p) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = GATED ? static_cast<const T*>(p.b) : nullptr;
  T* out = static_cast<T*>(p.out);
  if constexpr (!FLAT) {
    const int64_t row = int64_t(blockIdx.x) * p.rows_per_block + threadIdx.y;
    if (row >= p.rows) return;
    int64_t i0, i1, i2;
    p.index.split(row, i0, i1, i2);
    a += p.sa.at(i0, i1, i2);
    if constexpr (GATED) b += p.sb.at(i0, i1, i2);
    out += p.sout.at(i0, i1, i2);
  }
  const int first = (FLAT ? blockIdx.x : blockIdx.y) * ITEMS * blockDim.x + threadIdx.x;

  pdl_wait();
  Pack<T, VEC> va[ITEMS], vb[ITEMS];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {  // issue every load before the first use
    const int vi = first + it * blockDim.x;
    if (vi < p.vec_per_row) {
      va[it] = load_pack<T, VEC>(a + vi * VEC);
      if constexpr (GATED) vb[it] = load_pack<T, VEC>(b + vi * VEC);
    }
  }
  pdl_release();
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int vi = first + it * blockDim.x;
    if (vi < p.vec_per_row) {
      float x[VEC], bias[VEC] = {};
      unpack(va[it], x);
      if constexpr (BIAS) load_param<T, VEC>(p.bias, vi * VEC, bias);
      if constexpr (GATED) {
        float up[VEC];
        unpack(vb[it], up);
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = apply_activation(ACT, x[i]) * up[i];
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = apply_activation(ACT, x[i] + bias[i]);
      }
      store_pack(out + vi * VEC, pack<T, VEC>(x));
    }
  }
}

constexpr int kMaxItems = 4;

// Vectors per thread (H200, bench/results/2026-11-26_h200_ca4d16f/tune/act_items_and_streaming_stores.txt,
// 1, 2 and 4 side by side):
// - gated forms (silu(gate) * up, gelu_tanh(gate) * up): 1, at every size. Decode swiglu
//   1x11008 4.29 -> 3.97-4.16 us, 256x11008 8.45 -> 7.97, 2048x11008 35.1 -> 34.7, 8192x11008
//   127.4 -> 126.6, geglu 8192x21504 245.6 -> 243.9; 4 was slower everywhere.
// - ungated with a bias (the DiT FFN's gelu_tanh(x + bias)): 4, unless its column chunks leave
//   more threads idle than 2 would: LTX 48.6 -> 47.8 us, LTX-long 135.2 -> 131.7, Wan 14B
//   461.2 -> 449.0; Wan 1.3B's 1120-vector rows (then a chunk of 1024 and one of 96 with 4)
//   303.0 -> 307.9. 1 was slower everywhere (LTX-long 140.2).
// - ungated without a bias: 2, as before (not re-measured).
int vectors_per_thread(int64_t vec_per_row, bool gated, bool bias) {
  if (gated) return 1;
  if (!bias) return 2;
  auto idle = [&](int items) {  // (rows with a bias take the row plan, never flat)
    return column_split(vec_per_row, items, false, kBlockThreads).idle(vec_per_row, items);
  };
  return idle(kMaxItems) <= idle(2) ? kMaxItems : 2;
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

  // Flat: one row group, every operand's rows width apart (or a single row: a decode step's
  // gate and up halves of one packed projection), no bias (its column would need a division per
  // vector), element offsets within 32 bits. FUSEBOX_ACT_FLAT=0 keeps the row plan, for tuning
  // runs.
  const int64_t total_vecs = p.rows * p.vec_per_row;
  const bool packed = plan.sa.s[2] == width && plan.sout.s[2] == width && (!p.b || plan.sb.s[2] == width);
  const bool flat = tuning_knobs().act_flat.value_or(1) != 0 && p.index.flat && (packed || p.rows == 1) &&
                    !p.bias.ptr && (total_vecs + kBlockThreads * kMaxItems) * vec < (int64_t(1) << 31);
  if (flat) {
    p.rows = 1;
    p.vec_per_row = int(total_vecs);
  }
  const int items = vectors_per_thread(p.vec_per_row, p.b != nullptr, p.bias.ptr != nullptr);
  const ColumnSplit split = column_split(p.vec_per_row, items, flat, kBlockThreads);
  const int tpr = split.tpr;
  const int64_t chunks = split.chunks;
  p.rows_per_block = std::max(1, kBlockThreads / tpr);
  FUSEBOX_CHECK(flat || chunks <= 65535, "row width ", width, " is too wide for the activation kernel");
  const int64_t blocks = (p.rows + p.rows_per_block - 1) / p.rows_per_block;
  FUSEBOX_CHECK(blocks < (int64_t(1) << 31), "too many rows: ", p.rows);
  const dim3 block(tpr, p.rows_per_block);
  const dim3 grid = flat ? dim3(static_cast<unsigned>(chunks))
                           : dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(chunks));
  dispatch_dtype(plan.a->dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      auto go = [&](auto act, auto gated, auto bias) {
        constexpr Activation kAct = decltype(act)::value;
        constexpr bool kGated = decltype(gated)::value, kBias = decltype(bias)::value;
        // the plans vectors_per_thread makes: 1 for the gated forms, 2, or 4 with a bias
        auto with_items = [&](auto n) {
          constexpr int kItems = decltype(n)::value;
          if constexpr (!kBias) {  // (a bias never runs flat)
            if (flat) return launch(activation_kernel<T, V, kAct, kGated, kBias, kItems, true>, grid, block, 0, stream, p);
          }
          launch(activation_kernel<T, V, kAct, kGated, kBias, kItems, false>, grid, block, 0, stream, p);
        };
        if constexpr (kGated) {
          with_items(std::integral_constant<int, 1>{});
        } else if constexpr (kBias) {
          if (items == kMaxItems)
            with_items(std::integral_constant<int, kMaxItems>{});
          else
            with_items(std::integral_constant<int, 2>{});
        } else {
          with_items(std::integral_constant<int, 2>{});
        }
      };
      using Act = Activation;
      auto with_act = [&](auto gated, auto bias) {
        switch (plan.act) {
          case Act::kSiLU: go(std::integral_constant<Act, Act::kSiLU>{}, gated, bias); break;
          case Act::kGeluTanh: go(std::integral_constant<Act, Act::kGeluTanh>{}, gated, bias); break;
          case Act::kGelu: go(std::integral_constant<Act, Act::kGelu>{}, gated, bias); break;
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
}

}  // namespace fusebox::cuda
