// The row-normalization kernel behind every norm op: (gated) residual add, RMS or Layer
// normalization, affine weight/bias and AdaLN modulation in one pass over HBM.
//
// Each row is read once into registers (ITEMS vectors of VEC elements per thread), reduced,
// and written once. Rows wider than the register budget take the ITEMS == 0 path, which
// streams the row through each pass (the re-reads come from L2).
#include "common/cuda_common.cuh"
#include "norm/norm_impl.h"

namespace fusebox::cuda {
namespace {

struct RowOperandArg {
  const void* ptr;
  RowOffsets off;
};

struct NormKernelArgs {
  RowIndexer index;
  int64_t rows;
  int width;        // D
  int vec_per_row;  // D / VEC
  int rows_per_block;
  RowOperandArg x, branch, residual_out, out;
  RowOperandArg gate, scale, shift;  // ParamPtr-typed
  bool gate_f32, scale_f32, shift_f32, out_f32;
  ParamPtr weight, bias;
  NormType norm;
  float eps, weight_offset;
};

template <typename T>
struct RowPtrs {
  const T* x;
  const T* branch;
  T* residual_out;
  void* out;
  ParamPtr gate, scale, shift;
};

// h = x + gate * branch, rounded to T when it is a materialized residual.
template <typename T, int VEC>
__device__ __forceinline__ void load_input(const NormKernelArgs& a, const RowPtrs<T>& r,
                                           int col, float (&h)[VEC]) {
  VecIO<T, VEC>::load(r.x + col, h);
  if (r.branch == nullptr) return;
  float b[VEC];
  VecIO<T, VEC>::load(r.branch + col, b);
  if (r.gate.ptr != nullptr) {
    float g[VEC];
    load_param<T, VEC>(r.gate, col, g);
#pragma unroll
    for (int i = 0; i < VEC; ++i) b[i] *= g[i];
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) h[i] = round_to<T>(h[i] + b[i]);
}

// Loads (weight_offset + weight) for one vector; 1 where there is no weight.
template <typename T, int VEC>
__device__ __forceinline__ void load_weight(const NormKernelArgs& a, int col, float (&w)[VEC]) {
  if (a.weight.ptr != nullptr) {
    load_param<T, VEC>(a.weight, col, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) w[i] += a.weight_offset;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) w[i] = 1.f;
  }
}

// `w` holds the vector's (offset + weight), loaded ahead of the row reduction.
template <typename T, int VEC>
__device__ __forceinline__ void store_output(const NormKernelArgs& a, const RowPtrs<T>& r,
                                             int col, float (&v)[VEC], const float (&w)[VEC],
                                             float mean, float rstd) {
  if (a.norm != NormType::kNone) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = (v[i] - mean) * rstd * w[i];
    if (a.bias.ptr != nullptr) {
      float b[VEC];
      load_param<T, VEC>(a.bias, col, b);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] += b[i];
    }
    if (r.scale.ptr != nullptr) {
      float s[VEC];
      load_param<T, VEC>(r.scale, col, s);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] *= 1.f + s[i];
    }
    if (r.shift.ptr != nullptr) {
      float s[VEC];
      load_param<T, VEC>(r.shift, col, s);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] += s[i];
    }
    if (a.out_f32)
      VecIO<float, VEC>::store(static_cast<float*>(r.out) + col, v);
    else
      VecIO<T, VEC>::store(static_cast<T*>(r.out) + col, v);
  }
}

// Block size cap per register budget: ITEMS * VEC floats of row per thread must stay in
// registers without spilling (checked with -Xptxas -warn-spills).
__host__ __device__ constexpr int max_threads_for_items(int items) {
  return items > 0 ? 256 : 1024;
}

// ITEMS > 0: the row lives in registers. ITEMS == 0: the row is streamed once per pass.
template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(max_threads_for_items(ITEMS)) norm_rows_kernel(const NormKernelArgs a) {
  __shared__ float scratch[32];
  const int64_t row = int64_t(blockIdx.x) * a.rows_per_block + threadIdx.y;
  const bool active = row < a.rows;

  RowPtrs<T> r{};
  if (active) {
    int64_t i0, i1, i2;
    a.index.split(row, i0, i1, i2);
    r.x = static_cast<const T*>(a.x.ptr) + a.x.off.at(i0, i1, i2);
    if (a.branch.ptr) {
      r.branch = static_cast<const T*>(a.branch.ptr) + a.branch.off.at(i0, i1, i2);
      r.residual_out = static_cast<T*>(const_cast<void*>(a.residual_out.ptr)) + a.residual_out.off.at(i0, i1, i2);
    }
    if (a.gate.ptr)
      r.gate = {static_cast<const char*>(a.gate.ptr) + a.gate.off.at(i0, i1, i2) * (a.gate_f32 ? 4 : sizeof(T)), a.gate_f32};
    if (a.scale.ptr)
      r.scale = {static_cast<const char*>(a.scale.ptr) + a.scale.off.at(i0, i1, i2) * (a.scale_f32 ? 4 : sizeof(T)), a.scale_f32};
    if (a.shift.ptr)
      r.shift = {static_cast<const char*>(a.shift.ptr) + a.shift.off.at(i0, i1, i2) * (a.shift_f32 ? 4 : sizeof(T)), a.shift_f32};
    if (a.out.ptr)
      r.out = static_cast<char*>(const_cast<void*>(a.out.ptr)) + a.out.off.at(i0, i1, i2) * (a.out_f32 ? 4 : sizeof(T));
  }
  const int tpr = blockDim.x;
  const float inv_width = 1.f / float(a.width);

  if constexpr (ITEMS > 0) {
    // Every load of the row, and of the weight, is issued before the first store and before
    // the reduction's barriers.
    float v[ITEMS][VEC], w[ITEMS][VEC];
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int vi = threadIdx.x + it * tpr;
      if (active && vi < a.vec_per_row) {
        load_input<T, VEC>(a, r, vi * VEC, v[it]);
        load_weight<T, VEC>(a, vi * VEC, w[it]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[it][i] = 0.f;
      }
    }
    if (r.residual_out) {
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int vi = threadIdx.x + it * tpr;
        if (vi < a.vec_per_row) VecIO<T, VEC>::store(r.residual_out + vi * VEC, v[it]);
      }
    }
    float mean = 0.f, rstd = 1.f;
    if (a.norm != NormType::kNone) {
      float acc = 0.f;
      if (a.norm == NormType::kLayer) {
#pragma unroll
        for (int it = 0; it < ITEMS; ++it)
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc += v[it][i];
        mean = row_sum(acc, scratch) * inv_width;
        acc = 0.f;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          const bool valid = threadIdx.x + it * tpr < a.vec_per_row;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float d = v[it][i] - mean;
            acc += valid ? d * d : 0.f;
          }
        }
      } else {
#pragma unroll
        for (int it = 0; it < ITEMS; ++it)
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc += v[it][i] * v[it][i];
      }
      rstd = rsqrtf(row_sum(acc, scratch) * inv_width + a.eps);
    }
    if (!active) return;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int vi = threadIdx.x + it * tpr;
      if (vi < a.vec_per_row) store_output<T, VEC>(a, r, vi * VEC, v[it], w[it], mean, rstd);
    }
  } else {
    // Streaming path for very wide rows: pass 1 sums (and writes the residual), pass 2 (Layer
    // only) sums squared deviations, pass 3 normalizes.
    float acc = 0.f;
    for (int vi = threadIdx.x; active && vi < a.vec_per_row; vi += tpr) {
      float h[VEC];
      load_input<T, VEC>(a, r, vi * VEC, h);
      if (r.residual_out) VecIO<T, VEC>::store(r.residual_out + vi * VEC, h);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc += a.norm == NormType::kLayer ? h[i] : h[i] * h[i];
    }
    float mean = 0.f, rstd = 1.f;
    if (a.norm == NormType::kLayer) {
      mean = row_sum(acc, scratch) * inv_width;
      acc = 0.f;
      for (int vi = threadIdx.x; active && vi < a.vec_per_row; vi += tpr) {
        float h[VEC];
        load_input<T, VEC>(a, r, vi * VEC, h);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc += (h[i] - mean) * (h[i] - mean);
      }
    }
    if (a.norm != NormType::kNone) rstd = rsqrtf(row_sum(acc, scratch) * inv_width + a.eps);
    if (!active || a.norm == NormType::kNone) return;
    for (int vi = threadIdx.x; vi < a.vec_per_row; vi += tpr) {
      float h[VEC], w[VEC];
      load_input<T, VEC>(a, r, vi * VEC, h);
      load_weight<T, VEC>(a, vi * VEC, w);
      store_output<T, VEC>(a, r, vi * VEC, h, w, mean, rstd);
    }
  }
}

// Threads per row and register items per thread for a row of `vec_per_row` vectors.
struct NormLaunch {
  int items;  // 0: streaming path
  int threads_per_row;
  int rows_per_block;
};

NormLaunch plan_norm_launch(int64_t vec_per_row, int64_t rows) {
  NormLaunch l;
  constexpr int kTargetThreads = 256;  // per row, before items grow
  int items = next_pow2((vec_per_row + kTargetThreads - 1) / kTargetThreads);
  if (items > 8) items = 8;
  int tpr = next_pow2((vec_per_row + items - 1) / items);
  if (tpr > max_threads_for_items(items)) {
    l.items = 0;
    l.threads_per_row = 1024;
    l.rows_per_block = 1;
    return l;
  }
  l.items = items;
  l.threads_per_row = tpr;
  int rpb = tpr >= 256 ? 1 : 256 / tpr;
  while (rpb > 1 && rpb / 2 >= rows) rpb /= 2;
  l.rows_per_block = rpb;
  return l;
}

}  // namespace

void norm_cuda(const NormArgs& args, const detail::RowLayout& layout, const NormStrides& s, int vec,
               cudaStream_t stream) {
  if (layout.rows == 0 || args.x.shape[args.x.ndim - 1] == 0) return;
  NormKernelArgs a{};
  a.index = row_indexer(layout);
  a.rows = layout.rows;
  a.width = int(args.x.shape[args.x.ndim - 1]);
  a.vec_per_row = a.width / vec;
  auto operand = [](const TensorView& t, const detail::RowStrides& st) {
    return RowOperandArg{t.defined() ? t.data : nullptr, row_offsets(st)};
  };
  a.x = operand(args.x, s.x);
  a.branch = operand(args.branch, s.branch);
  a.residual_out = operand(args.residual_out, s.residual_out);
  a.out = operand(args.out, s.out);
  a.gate = operand(args.gate, s.gate);
  a.scale = operand(args.scale, s.scale);
  a.shift = operand(args.shift, s.shift);
  a.gate_f32 = args.gate.defined() && args.gate.dtype == DType::kFloat32;
  a.scale_f32 = args.scale.defined() && args.scale.dtype == DType::kFloat32;
  a.shift_f32 = args.shift.defined() && args.shift.dtype == DType::kFloat32;
  a.out_f32 = args.out.defined() && args.out.dtype == DType::kFloat32;
  a.weight = ParamPtr{args.weight.defined() ? args.weight.data : nullptr,
                      args.weight.defined() && args.weight.dtype == DType::kFloat32};
  a.bias = ParamPtr{args.bias.defined() ? args.bias.data : nullptr,
                    args.bias.defined() && args.bias.dtype == DType::kFloat32};
  a.norm = args.norm;
  a.eps = args.eps;
  a.weight_offset = args.weight_offset;

  const NormLaunch l = plan_norm_launch(a.vec_per_row, a.rows);
  a.rows_per_block = l.rows_per_block;
  const dim3 block(l.threads_per_row, l.rows_per_block);
  const dim3 grid(unsigned((a.rows + l.rows_per_block - 1) / l.rows_per_block));

  dispatch_dtype(args.x.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      switch (l.items) {
        case 0: norm_rows_kernel<T, V, 0><<<grid, block, 0, stream>>>(a); break;
        case 1: norm_rows_kernel<T, V, 1><<<grid, block, 0, stream>>>(a); break;
        case 2: norm_rows_kernel<T, V, 2><<<grid, block, 0, stream>>>(a); break;
        case 4: norm_rows_kernel<T, V, 4><<<grid, block, 0, stream>>>(a); break;
        default: norm_rows_kernel<T, V, 8><<<grid, block, 0, stream>>>(a); break;
      }
    });
  });
  FUSEBOX_CHECK_LAUNCH();
}

}  // namespace fusebox::cuda
