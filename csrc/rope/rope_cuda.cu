// Rotary kernel: a block walks tokens (grid-stride) and handles every q and k head of a token
// at once. The token's rows are read once (vectorized, all loads in flight) into shared
// memory, so per-head or across-head RMS statistics and the pair partners of either rotary
// style come from on-chip memory; the cos/sin row is read (or computed, for the 3-D grid) once
// per token and shared by all heads. Norm weights and grid frequencies are staged once per
// block.
#include "common/cuda_common.cuh"
#include "rope/rope_impl.h"

#include <algorithm>

namespace fusebox::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadBatch = 4;  // vectors per thread in flight while staging a token

struct RopeTensorArg {
  const void* ptr;
  int64_t sb, ss, sh;
};

struct RopeKernelArgs {
  int64_t S, tokens;
  int Hq, Hk, D, R;
  RopeTensorArg q, k, qo, ko;
  ParamPtr cos, sin;
  int64_t cos_sb, cos_ss, sin_sb, sin_ss;
  bool use_grid;
  Rope3DGrid grid;
  bool interleaved;
  bool norm, across;
  ParamPtr qw, kw;
  float eps, weight_offset;
};

// Shared-memory layout of one block; sizes in bytes, every part 16-byte aligned.
struct RopeSmem {
  size_t rows, table, weights, freqs, sums, total;
  __host__ __device__ RopeSmem(int heads, int D, int R, size_t elem, int qw_len, int kw_len, bool grid) {
    auto al = [](size_t b) { return (b + 15) / 16 * 16; };
    rows = al(size_t(heads) * D * elem);
    table = al(sizeof(float) * 2 * R);
    weights = al(sizeof(float) * size_t(qw_len + kw_len));
    freqs = grid ? al(sizeof(double) * R) : 0;
    sums = al(sizeof(float) * heads);
    total = rows + table + weights + freqs + sums;
  }
};

// Reads VEC elements of a staged row from shared memory as floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_staged(const T* p, float (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pk.v[i]);
}

// Output of one staged token when every pair lies within one vector (interleaved) or between
// two vectors R/2 apart (half-split): each work unit reads its vector(s) from shared memory
// once and writes whole vectors. Units: per head, the rotary units, then pass-through vectors.
template <typename T, int VEC>
__device__ __forceinline__ void rotate_pair_vectors(const RopeKernelArgs& a, const T* rows, const float* cs,
                                                    const float* sn, const float* qw, const float* kw,
                                                    const float* sumsq, float rstd_q, float rstd_k,
                                                    int64_t b, int64_t s) {
  const int rot_units = a.interleaved ? a.R / VEC : a.R / (2 * VEC);
  const int units = rot_units + (a.D - a.R) / VEC;
  const int half = a.R / 2;
  const int total = (a.Hq + a.Hk) * units;
  for (int u = threadIdx.x; u < total; u += blockDim.x) {
    const int head = u / units, j = u % units;
    const bool is_k = head >= a.Hq;
    const int h = is_k ? head - a.Hq : head;
    const T* row = rows + head * a.D;
    float scale = 1.f;
    if (a.norm) scale = a.across ? (is_k ? rstd_k : rstd_q) : rsqrtf(sumsq[head] / float(a.D) + a.eps);
    const float* w = is_k ? kw : qw;
    if (w && a.across) w += h * a.D;
    const RopeTensorArg& dst = is_k ? a.ko : a.qo;
    T* out = static_cast<T*>(const_cast<void*>(dst.ptr)) + b * dst.sb + s * dst.ss + h * dst.sh;
    auto normalize = [&](float (&x)[VEC], int d0) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] *= scale * (w ? w[d0 + i] : 1.f);
    };
    if (j >= rot_units) {  // pass-through channels
      const int d0 = a.R + (j - rot_units) * VEC;
      float x[VEC];
      load_staged<T, VEC>(row + d0, x);
      normalize(x, d0);
      VecIO<T, VEC>::store(out + d0, x);
    } else if (a.interleaved) {
      const int d0 = j * VEC;
      float x[VEC], y[VEC];
      load_staged<T, VEC>(row + d0, x);
      normalize(x, d0);
#pragma unroll
      for (int i = 0; i < VEC; i += 2) {
        y[i] = x[i] * cs[d0 + i] - x[i + 1] * sn[d0 + i];
        y[i + 1] = x[i + 1] * cs[d0 + i + 1] + x[i] * sn[d0 + i + 1];
      }
      VecIO<T, VEC>::store(out + d0, y);
    } else {
      const int d0 = j * VEC, d1 = d0 + half;
      float lo[VEC], hi[VEC], ylo[VEC], yhi[VEC];
      load_staged<T, VEC>(row + d0, lo);
      load_staged<T, VEC>(row + d1, hi);
      normalize(lo, d0);
      normalize(hi, d1);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        ylo[i] = lo[i] * cs[d0 + i] - hi[i] * sn[d0 + i];
        yhi[i] = hi[i] * cs[d1 + i] + lo[i] * sn[d1 + i];
      }
      VecIO<T, VEC>::store(out + d0, ylo);
      VecIO<T, VEC>::store(out + d1, yhi);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeKernelArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int heads = a.Hq + a.Hk;
  const int qw_len = a.qw.ptr ? (a.across ? a.Hq * a.D : a.D) : 0;
  const int kw_len = a.kw.ptr ? (a.across ? a.Hk * a.D : a.D) : 0;
  const RopeSmem layout(heads, a.D, a.R, sizeof(T), qw_len, kw_len, a.use_grid);
  T* rows = reinterpret_cast<T*>(smem_raw);
  float* cs = reinterpret_cast<float*>(smem_raw + layout.rows);
  float* sn = cs + a.R;
  float* qw = reinterpret_cast<float*>(smem_raw + layout.rows + layout.table);
  float* kw = qw + qw_len;
  double* freq = reinterpret_cast<double*>(smem_raw + layout.rows + layout.table + layout.weights);
  float* sumsq = reinterpret_cast<float*>(smem_raw + layout.total - layout.sums);
  __shared__ float scratch[32];
  const int tid = threadIdx.x;

  // Per-block setup: norm weights (with the offset folded in) and grid frequencies.
  for (int i = tid; i < qw_len; i += blockDim.x) qw[i] = a.weight_offset + load_param_scalar<T>(a.qw, i);
  for (int i = tid; i < kw_len; i += blockDim.x) kw[i] = a.weight_offset + load_param_scalar<T>(a.kw, i);
  if (a.use_grid)
    for (int r = tid; r < a.R; r += blockDim.x) freq[r] = rope_grid_inv_freq(a.grid, r, a.R, a.interleaved);

  const int vpd = a.D / VEC;
  const int nq = a.Hq * vpd, n = heads * vpd;
  // Whole-vector pairs: interleaved pairs never straddle a vector; half-split partners sit
  // R/2 apart, a whole number of vectors.
  const bool pair_vectors = VEC >= 2 && a.R % VEC == 0 && (a.interleaved || (a.R / 2) % VEC == 0);
  for (int64_t token = blockIdx.x; token < a.tokens; token += gridDim.x) {
    const int64_t b = token / a.S, s = token % a.S;
    __syncthreads();  // the previous token's rows, table and sums are consumed
    for (int r = tid; r < a.R; r += blockDim.x) {
      if (a.use_grid) {
        const float angle = float(rope_grid_reduce(double(rope_grid_position(a.grid, s, r, a.R, a.interleaved)) * freq[r]));
        sincosf(angle, &sn[r], &cs[r]);
      } else {
        cs[r] = load_param_scalar<T>(a.cos, b * a.cos_sb + s * a.cos_ss + r);
        sn[r] = load_param_scalar<T>(a.sin, b * a.sin_sb + s * a.sin_ss + r);
      }
    }
    for (int h = tid; h < heads; h += blockDim.x) sumsq[h] = 0.f;
    __syncthreads();

    // Stage the token's rows, kLoadBatch vectors per thread in flight; accumulate squares per
    // head (or per tensor when the norm spans all heads).
    float local_q = 0.f, local_k = 0.f;
    for (int base = tid; base < n; base += kLoadBatch * blockDim.x) {
      float x[kLoadBatch][VEC];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int v = base + j * blockDim.x;
        if (v >= n) break;
        const bool is_k = v >= nq;
        const int vv = is_k ? v - nq : v;
        const RopeTensorArg& src = is_k ? a.k : a.q;
        VecIO<T, VEC>::load(static_cast<const T*>(src.ptr) + b * src.sb + s * src.ss + (vv / vpd) * src.sh + (vv % vpd) * VEC, x[j]);
      }
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int v = base + j * blockDim.x;
        if (v >= n) break;
        const bool is_k = v >= nq;
        const int vv = is_k ? v - nq : v;
        VecIO<T, VEC>::store(rows + v * VEC, x[j]);  // rows of q then k, each [heads, D]
        if (a.norm) {
          float sq = 0.f;
#pragma unroll
          for (int i = 0; i < VEC; ++i) sq += x[j][i] * x[j][i];
          if (a.across)
            (is_k ? local_k : local_q) += sq;
          else
            atomicAdd(&sumsq[(is_k ? a.Hq : 0) + vv / vpd], sq);
        }
      }
    }
    float rstd_q = 1.f, rstd_k = 1.f;
    if (a.norm && a.across) {
      rstd_q = rsqrtf(block_sum(local_q, scratch) / float(a.Hq * a.D) + a.eps);
      rstd_k = rsqrtf(block_sum(local_k, scratch) / float(max(a.Hk, 1) * a.D) + a.eps);
    }
    __syncthreads();

    if (pair_vectors) {
      rotate_pair_vectors<T, VEC>(a, rows, cs, sn, qw_len ? qw : nullptr, kw_len ? kw : nullptr, sumsq,
                                  rstd_q, rstd_k, b, s);
      continue;
    }
    for (int v = tid; v < n; v += blockDim.x) {
      const bool is_k = v >= nq;
      const int vv = is_k ? v - nq : v;
      const int h = vv / vpd, d0 = (vv % vpd) * VEC;
      const T* row = rows + (is_k ? a.Hq * a.D : 0) + h * a.D;
      float rstd = 1.f;
      if (a.norm) rstd = a.across ? (is_k ? rstd_k : rstd_q) : rsqrtf(sumsq[(is_k ? a.Hq : 0) + h] / float(a.D) + a.eps);
      const float* w = (is_k ? kw_len : qw_len) ? (is_k ? kw : qw) + (a.across ? h * a.D : 0) : nullptr;
      auto normed = [&](int d) {
        float val = to_float(row[d]);
        if (a.norm) {
          val *= rstd;
          if (w) val *= w[d];
        }
        return val;
      };
      float out[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int d = d0 + i;
        float val = normed(d);
        if (d < a.R) {
          bool first;
          const int p = int(rope_partner(d, a.R, a.interleaved, first));
          const float pv = normed(p);
          val = first ? val * cs[d] - pv * sn[d] : val * cs[d] + pv * sn[d];
        }
        out[i] = val;
      }
      const RopeTensorArg& dst = is_k ? a.ko : a.qo;
      VecIO<T, VEC>::store(static_cast<T*>(const_cast<void*>(dst.ptr)) + b * dst.sb + s * dst.ss + h * dst.sh + d0, out);
    }
  }
}

// Per-head kernel for heads of at most 32 work units (head_dim <= 128 in 16-bit, the
// LLM/DiT case): a group of lanes owns one head row of one token and reads its vectors straight
// from global memory (both halves of a half-split pair in one thread), reduces the per-head
// RMS statistics with shuffles and writes whole vectors. No shared-memory staging and no
// block barriers on the data path, so every resident warp keeps loads in flight.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rope_head_kernel(const RopeKernelArgs a, const int lanes) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  double* freq = reinterpret_cast<double*>(smem_raw);  // [R], grid mode only
  if (a.use_grid) {
    for (int r = threadIdx.x; r < a.R; r += blockDim.x) freq[r] = rope_grid_inv_freq(a.grid, r, a.R, a.interleaved);
    __syncthreads();
  }
  const int heads = a.Hq + a.Hk;
  const int rot_units = a.interleaved ? a.R / VEC : a.R / (2 * VEC);
  const int units = rot_units + (a.D - a.R) / VEC;
  const int half = a.R / 2;
  const int lane = threadIdx.x % lanes;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / lanes) + threadIdx.x / lanes;
  const bool active = row < a.tokens * heads && lane < units;
  // Rows past the end still take part in the shuffles below, with zeros.
  const int64_t token = active ? row / heads : 0;
  const int head = active ? int(row % heads) : 0;
  const int64_t b = token / a.S, s = token % a.S;
  const bool is_k = head >= a.Hq;
  const int h = is_k ? head - a.Hq : head;
  const RopeTensorArg& src = is_k ? a.k : a.q;
  const RopeTensorArg& dst = is_k ? a.ko : a.qo;

  // Channels this thread owns: one vector at d0, plus its partner vector at d1 (half-split).
  const bool rotary = lane < rot_units;
  const bool two = rotary && !a.interleaved;
  const int d0 = rotary ? lane * VEC : a.R + (lane - rot_units) * VEC;
  const int d1 = d0 + half;
  float x0[VEC] = {}, x1[VEC] = {};
  if (active) {
    const T* in = static_cast<const T*>(src.ptr) + b * src.sb + s * src.ss + h * src.sh;
    VecIO<T, VEC>::load(in + d0, x0);
    if (two) VecIO<T, VEC>::load(in + d1, x1);
  }
  float c0[VEC], s0[VEC], c1[VEC], s1[VEC];
  if (active && rotary) {
    if (a.use_grid) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float ang0 = float(rope_grid_reduce(double(rope_grid_position(a.grid, s, d0 + i, a.R, a.interleaved)) * freq[d0 + i]));
        __sincosf(ang0, &s0[i], &c0[i]);
        if (two) {
          const float ang1 = float(rope_grid_reduce(double(rope_grid_position(a.grid, s, d1 + i, a.R, a.interleaved)) * freq[d1 + i]));
          __sincosf(ang1, &s1[i], &c1[i]);
        }
      }
    } else {
      load_param<T, VEC>(a.cos, b * a.cos_sb + s * a.cos_ss + d0, c0);
      load_param<T, VEC>(a.sin, b * a.sin_sb + s * a.sin_ss + d0, s0);
      if (two) {
        load_param<T, VEC>(a.cos, b * a.cos_sb + s * a.cos_ss + d1, c1);
        load_param<T, VEC>(a.sin, b * a.sin_sb + s * a.sin_ss + d1, s1);
      }
    }
  }
  if (a.norm) {
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) sq += x0[i] * x0[i] + x1[i] * x1[i];
    const float rstd = rsqrtf(lane_group_sum(sq, lanes) / float(a.D) + a.eps);
    const ParamPtr& w = is_k ? a.kw : a.qw;
    float w0[VEC], w1[VEC];
    if (active && w.ptr) {
      load_param<T, VEC>(w, d0, w0);
      if (two) load_param<T, VEC>(w, d1, w1);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      x0[i] *= rstd * (w.ptr ? a.weight_offset + w0[i] : 1.f);
      x1[i] *= rstd * (w.ptr ? a.weight_offset + w1[i] : 1.f);
    }
  }
  if (!active) return;
  T* out = static_cast<T*>(const_cast<void*>(dst.ptr)) + b * dst.sb + s * dst.ss + h * dst.sh;
  if (!rotary) {
    VecIO<T, VEC>::store(out + d0, x0);
  } else if (a.interleaved) {
    float y[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      y[i] = x0[i] * c0[i] - x0[i + 1] * s0[i];
      y[i + 1] = x0[i + 1] * c0[i + 1] + x0[i] * s0[i + 1];
    }
    VecIO<T, VEC>::store(out + d0, y);
  } else {
    float y0[VEC], y1[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      y0[i] = x0[i] * c0[i] - x1[i] * s0[i];
      y1[i] = x1[i] * c1[i] + x0[i] * s1[i];
    }
    VecIO<T, VEC>::store(out + d0, y0);
    VecIO<T, VEC>::store(out + d1, y1);
  }
}

RopeTensorArg tensor_arg(const TensorView& t) {
  if (!t.defined()) return RopeTensorArg{nullptr, 0, 0, 0};
  return RopeTensorArg{t.data, t.strides[0], t.strides[1], t.strides[2]};
}

ParamPtr param(const TensorView& t) {
  return ParamPtr{t.defined() ? t.data : nullptr, t.defined() && t.dtype == DType::kFloat32};
}

}  // namespace

void rope_cuda(const RopeArgs& args, const RopeShape& sh, int vec, cudaStream_t stream) {
  RopeKernelArgs a{};
  a.S = sh.S;
  a.Hq = int(sh.Hq);
  a.Hk = int(sh.Hk);
  a.D = int(sh.D);
  a.R = int(sh.R);
  a.q = tensor_arg(args.q);
  a.k = tensor_arg(args.k);
  a.qo = tensor_arg(args.q_out);
  a.ko = tensor_arg(args.k_out);
  a.use_grid = args.use_grid;
  if (args.use_grid) {
    a.grid = args.grid;
  } else {
    a.cos = param(args.cos);
    a.sin = param(args.sin);
    a.cos_sb = args.cos.strides[0];
    a.cos_ss = args.cos.strides[1];
    a.sin_sb = args.sin.strides[0];
    a.sin_ss = args.sin.strides[1];
  }
  a.interleaved = args.style == RopeStyle::kInterleaved;
  a.norm = args.norm == NormType::kRMS;
  a.across = args.norm_across_heads;
  a.qw = param(args.q_weight);
  a.kw = param(args.k_weight);
  a.eps = args.eps;
  a.weight_offset = args.weight_offset;

  a.tokens = sh.B * sh.S;
  const int64_t heads = sh.Hq + sh.Hk;

  // Per-head path: pairs in whole vectors, at most 32 units per head, and no norm spanning
  // several heads.
  const bool pair_vectors = vec >= 2 && a.R % vec == 0 && (a.interleaved || (a.R / 2) % vec == 0);
  const int units = (a.interleaved ? a.R / vec : a.R / (2 * vec)) + (a.D - a.R) / vec;
  const bool cross_head_norm = a.norm && a.across && (sh.Hq > 1 || sh.Hk > 1);
  if (pair_vectors && units <= 32 && !cross_head_norm) {
    const int lanes = next_pow2(units);
    const int64_t rows = a.tokens * heads;
    const int rows_per_block = kThreads / lanes;
    const size_t smem = a.use_grid ? sizeof(double) * size_t(a.R) : 0;
    FUSEBOX_CHECK((rows + rows_per_block - 1) / rows_per_block < (int64_t(1) << 31), "too many rows: ", rows);
    dispatch_dtype(args.q.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_vec<T>(vec, [&](auto v) {
        rope_head_kernel<T, decltype(v)::value>
            <<<unsigned((rows + rows_per_block - 1) / rows_per_block), kThreads, smem, stream>>>(a, lanes);
      });
    });
    FUSEBOX_CHECK_LAUNCH();
    return;
  }

  const int qw_len = args.q_weight.defined() ? int(args.q_weight.shape[0]) : 0;
  const int kw_len = args.k_weight.defined() ? int(args.k_weight.shape[0]) : 0;
  const size_t smem = RopeSmem(int(heads), a.D, a.R, dtype_size(args.q.dtype), qw_len, kw_len, a.use_grid).total;
  const DeviceLimits& dev = device_limits();
  FUSEBOX_CHECK(smem <= size_t(dev.smem_optin), "one token of q and k (", heads, " heads x ", sh.D,
                " channels) needs ", smem, " bytes of shared memory; this GPU allows ", dev.smem_optin);

  dispatch_dtype(args.q.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      auto kernel = rope_kernel<T, decltype(v)::value>;
      if (smem > 48 * 1024)
        FUSEBOX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      // As many blocks as fit on the GPU at once; each walks its share of the tokens.
      int blocks_per_sm = 0;
      FUSEBOX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kThreads, smem));
      const int64_t grid = std::min<int64_t>(a.tokens, int64_t(std::max(blocks_per_sm, 1)) * dev.sm_count);
      kernel<<<unsigned(grid), kThreads, smem, stream>>>(a);
    });
  });
  FUSEBOX_CHECK_LAUNCH();
}

}  // namespace fusebox::cuda
