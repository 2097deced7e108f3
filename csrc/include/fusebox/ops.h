// The fusebox operators. Every function validates its views, then runs on the device the
// views live on: CUDA views launch on `stream` (nothing is allocated, nothing synchronizes),
// CPU views run the reference implementation (the stream is ignored).
//
// Numerics (all ops): inputs are widened to fp32, all arithmetic and reductions run in fp32,
// each output is rounded once to its dtype. Intermediate tensors that the unfused model
// would materialize (the residual sum) are rounded to their dtype before they are used, so
// the fused op sees the same values the unfused chain would.
//
// Layout rules: every operand needs a unit stride in its last dimension; all other strides
// are free (views into fused QKV projections, chunks of a modulation table, stride-0
// broadcasts). Small operands (weight, bias, scale, shift, gate, cos, sin) may be fp32 or the
// dtype of the main input; everything else shares the main input's dtype.
#pragma once

#include "fusebox/tensor.h"

typedef struct CUstream_st* cudaStream_t;

namespace fusebox {

enum class NormType : int8_t {
  kNone = 0,   // no normalization: only the (gated) residual sum is produced
  kRMS = 1,    // x * rsqrt(mean(x^2) + eps)
  kLayer = 2,  // (x - mean(x)) * rsqrt(var(x) + eps)
};

// One pass over rows of width D:
//   h   = x + gate * branch            (when branch is given; gate defaults to 1)
//   n   = norm(h) * (weight_offset + weight) + bias     (weight/bias optional, [D])
//   out = n * (1 + scale) + shift       (scale/shift optional)
// `residual_out` receives h (rounded to x's dtype) and is required when branch is given.
// gate, scale and shift have x's shape, broadcast through stride-0 dimensions.
// out may be x's dtype or fp32.
// Split modulation: each present term of gate, scale and shift may come as two parts,
// term = term_table + term, with term_table a [D] vector (a row of a DiT block's modulation
// table, fp32 or x's dtype) and the term itself in x's dtype (the per-token timestep
// projection). The parts are added in fp32 where the term is used, as `table.float() + temb`
// computes it, so the fp32 sum is never written. Either every present term has its table or
// none does.
struct NormArgs {
  TensorView x;
  TensorView branch;
  TensorView gate;
  TensorView weight;
  TensorView bias;
  TensorView scale;
  TensorView shift;
  TensorView gate_table, scale_table, shift_table;
  TensorView out;
  TensorView residual_out;
  NormType norm = NormType::kRMS;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
  const char* branch_name = "branch";  // how error messages call `branch` ("residual", ...)
  const char* shift_name = "shift";    // and `shift` ("residual" in rms_norm_add)
};
void norm(const NormArgs& args, cudaStream_t stream = nullptr);

// Convenience forms of `norm` for C++ callers.
void rms_norm(const TensorView& x, const TensorView& weight, const TensorView& out, float eps,
              float weight_offset = 0.0f, cudaStream_t stream = nullptr);
void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        const TensorView& out, const TensorView& residual_out, float eps,
                        float weight_offset = 0.0f, cudaStream_t stream = nullptr);
// out = residual + rms_norm(x) * weight, rounded once (a post-norm layer's residual add);
// residual broadcasts to x as shift does.
void rms_norm_add(const TensorView& x, const TensorView& residual, const TensorView& weight,
                  const TensorView& out, float eps, float weight_offset = 0.0f,
                  cudaStream_t stream = nullptr);
void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias,
                const TensorView& out, float eps, cudaStream_t stream = nullptr);

enum class RopeStyle : int8_t {
  kHalfSplit = 0,    // pairs (i, i + R/2): Llama, Qwen, Mistral, Gemma ("rotate_half")
  kInterleaved = 1,  // pairs (2i, 2i + 1): Flux, LTX-Video, Wan, HunyuanVideo
};

// Frequencies of a video grid computed in the kernel instead of read from a table.
// Token s of a sequence maps to (f, h, w) = (s / (H*W), (s / W) % H, s % W) + offsets.
// The rotary channels of a head are split in three sections of axes_dim[0..2] channels
// (sum = rotary dims); in section a, pair j rotates by angle pos_a * theta^(-2j / axes_dim[a]).
struct Rope3DGrid {
  int64_t frames = 0, height = 0, width = 0;
  int64_t axes_dim[3] = {0, 0, 0};
  int64_t offsets[3] = {0, 0, 0};
  float theta = 10000.0f;
};

// Rotary embedding of q and k in one launch, with an optional RMS normalization first.
//   q: [B, S, Hq, D], k: [B, S, Hk, D] (any strides, unit last stride; k may be absent)
//   cos, sin: [B, S, R] (stride-0 broadcast allowed), R = rotary dims (even, <= D);
//             channels >= R pass through unrotated. Absent when `grid` is used.
//   For LTX-style tables that differ per head, view q as one head of width Hq*D.
// Norm (when norm != kNone, RMS only): per head over D channels, or across all heads of a
// token (norm_across_heads); q_weight/k_weight are [D] or [H*D] respectively, optional.
// The rotation uses each channel's own table entry: out[i] = x[i]*cos[i] - x[p]*sin[i] for the
// first element of a pair and out[p] = x[p]*cos[p] + x[i]*sin[p] for the second, as the
// reference implementations in transformers and diffusers compute it.
struct RopeArgs {
  TensorView q, k;
  TensorView q_out, k_out;
  TensorView cos, sin;
  RopeStyle style = RopeStyle::kHalfSplit;
  bool use_grid = false;
  Rope3DGrid grid;
  NormType norm = NormType::kNone;
  bool norm_across_heads = false;
  TensorView q_weight, k_weight;
  float eps = 1e-6f;
  float weight_offset = 0.0f;
};
void rope(const RopeArgs& args, cudaStream_t stream = nullptr);

enum class Activation : int8_t { kSiLU = 0, kGeluTanh = 1, kGelu = 2 };

// out = act(gate) * up. gate/up/out: [..., N].
void gated_activation(const TensorView& gate, const TensorView& up, const TensorView& out,
                      Activation act, cudaStream_t stream = nullptr);

// out = act(x + bias). x/out: [..., N]; bias optional [N].
void activation(const TensorView& x, const TensorView& bias, const TensorView& out, Activation act,
                cudaStream_t stream = nullptr);

// The combine step of a mixture-of-experts layer: each token's K expert outputs, weighted and
// summed.
//   out[n, :] = sum over k of weights[n, k] * rows[index[n, k], :]
//   rows: [M, H] (the experts' output rows, any row stride); index: [N, K], int32 or int64;
//   weights: [N, K], fp32 or rows' dtype (any strides); out: [N, H] in rows' dtype.
// Each product is rounded to the product's dtype (fp32 for fp32 weights, else rows' dtype) and
// added in fp32 in k order, the sum rounded once to out's dtype: the values of
// `(rows[index] * weights[..., None]).sum(1)` (whose 16-bit sums accumulate in fp32), with
// nothing materialized.
// An index outside [0, M): the CPU reference raises; a CUDA launch cannot without a host sync,
// so it writes NaN over that token's row and reads nothing out of bounds.
void moe_combine(const TensorView& rows, const TensorView& index, const TensorView& weights,
                 const TensorView& out, cudaStream_t stream = nullptr);

// The router of a mixture-of-experts layer after its logits, in one launch.
enum class RouterScore : int8_t {
  kSoftmax = 0,  // softmax over the token's experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2)
  kSigmoid = 1,  // each logit's sigmoid (DeepSeek-V3, Kimi K2, GLM-4.5)
};

struct RouterArgs {
  TensorView logits;   // [N, E] fp32/fp16/bf16, unit last stride, E <= 1024
  TensorView bias;     // optional [E], any float dtype: added to the scores for the choice only
  TensorView weights;  // out [N, K]: fp32 or logits' dtype (any strides)
  TensorView index;    // out [N, K]: int32 or int64, the experts (any strides); K <= min(E, 32)
  RouterScore score = RouterScore::kSoftmax;
  // Group-limited choice: the E experts in num_groups consecutive groups; only the topk_groups
  // groups whose two largest choice scores sum highest are chosen from (1, 1: no groups).
  int64_t num_groups = 1, topk_groups = 1;
  bool renormalize = false;  // the weights divided by (their sum + 1e-20)
  float scale = 1.f;         // the weights times scale
};

// Each token's scores (fp32), its K experts of the largest choice scores (score + bias), in
// descending order, of equal ones the lower expert first, and their weights: the scores (without
// the bias), renormalized and scaled as asked. The values transformers' routers compute, up to
// the order of the fp32 sums (the 1e-20 changes no fp32 sum of softmax scores). A token left
// with fewer than K choice scores above -inf (a bias of -inf): the CPU reference raises; CUDA writes
// expert -1 with a NaN weight for each missing choice.
void moe_topk(const RouterArgs& args, cudaStream_t stream = nullptr);

// The dispatch step of a mixture-of-experts layer: its (token, k) pairs sorted by expert, as
// grouped GEMMs over each expert's rows read them, in one launch, or two over many blocks for
// an index of more than 512 pairs given a workspace. Sorted row r holds one pair;
// expert e's pairs take rows [offsets[e - 1], offsets[e]) in pair order (n * K + k), as a stable
// sort of the flattened index puts them.
//   index: [N, K], int32 or int64, the expert of each pair (any strides); num_experts: E >= 1.
//   row_token: [N * K] int32, the token each sorted row reads (pair / K).
//   offsets: [E] int32, the rows of experts 0..e (inclusive cumulative counts).
//   pair_row: [N, K] int32, the sorted row of each pair (the inverse permutation; moe_combine's
//   index). Outputs take any strides.
// An expert outside [0, E): the CPU reference raises; a CUDA launch cannot without a host sync,
// so it sorts the pair after every expert's rows (outside all offsets) and sets its pair_row to
// -1, on which moe_combine writes NaN over that token's row.
//   workspace: optional, contiguous int32 on index's device, 16-byte aligned, of at least
//   moe_sort_workspace_size elements. Without one large enough, an index of up to 4096 pairs
//   still takes one cluster on sm_90+ (which needs none), a larger one a single block: the same
//   result, slower for large indexes. Not read after.
// num_experts at most 4009 on CUDA (the counts live in shared memory).
void moe_sort(const TensorView& index, int64_t num_experts, const TensorView& row_token,
              const TensorView& offsets, const TensorView& pair_row, cudaStream_t stream = nullptr,
              const TensorView& workspace = TensorView{});

// The int32 elements of the workspace that lets moe_sort spread over many blocks. By default
// enough on any device, without a CUDA call (0 where one block sorts an index of this size);
// for_current_device: what moe_sort reads on the current CUDA device, also 0 where one cluster
// sorts the index (sm_90+: up to 2048 pairs, 4096 where clusters of 16 fit, as on H100 and
// H200), never more than the default.
int64_t moe_sort_workspace_size(int64_t tokens, int64_t top_k, int64_t num_experts, bool for_current_device = false);

}  // namespace fusebox
