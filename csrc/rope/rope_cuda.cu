// Rotary kernel: one block per token handles every q and k head of that token. The token's
// rows are read once (vectorized) into shared memory, so per-head or across-head RMS
// statistics and the pair partners of either rotary style come from on-chip memory; the
// cos/sin row is read (or computed, for the 3-D grid) once per token and shared by all heads.
#include "common/cuda_common.cuh"
#include "rope/rope_impl.h"

namespace fusebox::cuda {
namespace {

constexpr int kThreads = 128;

struct RopeTensorArg {
  const void* ptr;
  int64_t sb, ss, sh;
};

struct RopeKernelArgs {
  int64_t S;
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

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeKernelArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int heads = a.Hq + a.Hk;
  T* rows = reinterpret_cast<T*>(smem_raw);                        // [heads * D], 16B aligned
  float* cs = reinterpret_cast<float*>(rows + size_t(heads) * a.D);  // [R]
  float* sn = cs + a.R;                                               // [R]
  float* sumsq = sn + a.R;                                            // [heads]
  __shared__ float scratch[32];

  const int64_t token = blockIdx.x;
  const int64_t b = token / a.S, s = token % a.S;
  const int tid = threadIdx.x;

  for (int r = tid; r < a.R; r += blockDim.x) {
    if (a.use_grid) {
      const float angle = float(rope_grid_angle(a.grid, s, r, a.R, a.interleaved));
      sincosf(angle, &sn[r], &cs[r]);
    } else {
      cs[r] = load_param_scalar<T>(a.cos, b * a.cos_sb + s * a.cos_ss + r);
      sn[r] = load_param_scalar<T>(a.sin, b * a.sin_sb + s * a.sin_ss + r);
    }
  }
  for (int h = tid; h < heads; h += blockDim.x) sumsq[h] = 0.f;
  __syncthreads();

  // Stage the token's rows; accumulate squares per head (or per tensor when across heads).
  const int vpd = a.D / VEC;
  const int nq = a.Hq * vpd, n = heads * vpd;
  float local_q = 0.f, local_k = 0.f;
  for (int v = tid; v < n; v += blockDim.x) {
    const bool is_k = v >= nq;
    const int vv = is_k ? v - nq : v;
    const int h = vv / vpd, d0 = (vv % vpd) * VEC;
    const RopeTensorArg& src = is_k ? a.k : a.q;
    float x[VEC];
    VecIO<T, VEC>::load(static_cast<const T*>(src.ptr) + b * src.sb + s * src.ss + h * src.sh + d0, x);
    VecIO<T, VEC>::store(rows + (is_k ? a.Hq * a.D : 0) + h * a.D + d0, x);
    if (a.norm) {
      float sq = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) sq += x[i] * x[i];
      if (a.across)
        (is_k ? local_k : local_q) += sq;
      else
        atomicAdd(&sumsq[(is_k ? a.Hq : 0) + h], sq);
    }
  }
  float rstd_q = 1.f, rstd_k = 1.f;
  if (a.norm && a.across) {
    rstd_q = rsqrtf(block_sum(local_q, scratch) / float(a.Hq * a.D) + a.eps);
    rstd_k = rsqrtf(block_sum(local_k, scratch) / float(max(a.Hk, 1) * a.D) + a.eps);
  }
  __syncthreads();

  for (int v = tid; v < n; v += blockDim.x) {
    const bool is_k = v >= nq;
    const int vv = is_k ? v - nq : v;
    const int h = vv / vpd, d0 = (vv % vpd) * VEC;
    const T* row = rows + (is_k ? a.Hq * a.D : 0) + h * a.D;
    float rstd = 1.f;
    if (a.norm) rstd = a.across ? (is_k ? rstd_k : rstd_q) : rsqrtf(sumsq[(is_k ? a.Hq : 0) + h] / float(a.D) + a.eps);
    const ParamPtr& w = is_k ? a.kw : a.qw;
    const int w_base = a.across ? h * a.D : 0;
    auto normed = [&](int d) {
      float val = to_float(row[d]);
      if (a.norm) {
        val *= rstd;
        if (w.ptr) val *= a.weight_offset + load_param_scalar<T>(w, w_base + d);
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

  const int64_t heads = sh.Hq + sh.Hk;
  const size_t row_bytes = (size_t(heads * sh.D) * dtype_size(args.q.dtype) + 15) / 16 * 16;
  const size_t smem = row_bytes + sizeof(float) * size_t(2 * sh.R + heads);
  int device = 0, smem_optin = 0;
  FUSEBOX_CUDA_CHECK(cudaGetDevice(&device));
  FUSEBOX_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  FUSEBOX_CHECK(smem + 32 * sizeof(float) <= size_t(smem_optin), "one token of q and k (", heads,
                " heads x ", sh.D, " channels) needs ", smem,
                " bytes of shared memory; this GPU allows ", smem_optin);
  const int64_t tokens = sh.B * sh.S;
  FUSEBOX_CHECK(tokens < (int64_t(1) << 31), "batch * seq must be < 2^31; got ", tokens);

  dispatch_dtype(args.q.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      auto kernel = rope_kernel<T, decltype(v)::value>;
      if (smem > 48 * 1024)
        FUSEBOX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      kernel<<<unsigned(tokens), kThreads, smem, stream>>>(a);
    });
  });
  FUSEBOX_CHECK_LAUNCH();
}

}  // namespace fusebox::cuda
