// Rotary kernel (with the optional RMS norm of q and k) over "rows": a row is one head of one
// token (per-head norm or none), or every head of q (or of k) of one token (norm across
// heads, as LTX-Video and Wan normalize; paired, every head of both). `tpr` threads own a row;
// each holds ITEMS work units in registers, so q and k are read once and written once:
//   - a unit is one vector when rotary pairs lie inside vectors (interleaved pairs, VEC >= 2),
//     or two vectors a pair-offset apart (half-split pairs R/2 apart; interleaved with VEC 1);
//   - channels past the rotary dimension R are single pass-through units.
// The row's RMS statistics come from a row reduction over its units; the rotation reads the
// cos/sin table (or computes the 3-D grid angles) for the unit's own channels. Decode-sized
// calls of LLM layers (one head a lane group, a token's heads filling a block) take
// short_rope_kernel, whose path to its first load is short.
#include "common/cuda_common.cuh"
#include "rope/rope_impl.h"

#include <cstdint>
#include <type_traits>

namespace fusebox::cuda {
namespace {

constexpr int kMaxThreads = 512;

// Element strides in 32 bits (the launcher checks they fit, and splits a call whose batches
// lie 2^32 or more elements apart into one launch per batch), so that each term of an offset
// is one 32 x 32 -> 64-bit multiply-add: the 64 x 64-bit products took about a third of the
// one-head kernel's instructions.
struct RopeTensorArg {
  const void* ptr;
  uint32_t sb, ss, sh;
};

// Offset of element d of head h of token (b, s).
__device__ __forceinline__ uint64_t element_offset(uint32_t b, uint32_t s, uint32_t h, uint32_t d, uint32_t sb,
                                                   uint32_t ss, uint32_t sh) {
  return uint64_t(b) * sb + uint64_t(s) * ss + uint64_t(h) * sh + d;
}

// q's or k's argument, as the first one's fields plus the differences where `second`: both
// are read from the uniform argument bank. (A reference chosen per thread, or a select per
// field, compiles to constant-bank loads indexed by a register, each a miss of its own on the
// path to the data load.) The pointer is either an offset from the first one, so the compiler
// still knows it points to global memory (STG stores), or, with AS_INTEGER, an integer sum
// that hides this (generic ST stores). Which form a kernel takes follows the register
// allocation that results ([h200_377206b] tune/rope_pick_variants_377206b.txt): the
// across-heads rows of LTX-Video hold 64 registers with the integer form, 90 with the offset
// and 78 before either (qk_norm_rope 2x8064x2048 147 -> 131 us); the per-head kernel loses 5%
// with the integer form on Wan's rope_3d (100.5 -> 105 us).
template <bool AS_INTEGER>
__device__ __forceinline__ RopeTensorArg pick(bool second, const RopeTensorArg& first_arg,
                                              const RopeTensorArg& second_arg) {
  const void* ptr;
  if constexpr (AS_INTEGER) {
    const uintptr_t p0 = reinterpret_cast<uintptr_t>(first_arg.ptr);
    ptr = reinterpret_cast<const void*>(p0 + (second ? reinterpret_cast<uintptr_t>(second_arg.ptr) - p0 : 0));
  } else {
    const char* p0 = static_cast<const char*>(first_arg.ptr);
    ptr = p0 + (second ? static_cast<const char*>(second_arg.ptr) - p0 : 0);
  }
  return RopeTensorArg{ptr, first_arg.sb + (second ? second_arg.sb - first_arg.sb : 0u),
                       first_arg.ss + (second ? second_arg.ss - first_arg.ss : 0u),
                       first_arg.sh + (second ? second_arg.sh - first_arg.sh : 0u)};
}

// Fields in the order the kernels first read them: the argument bank is read through the
// constant cache, and each of its lines the path to the first load touches is a miss of its own.
struct RopeKernelArgs {
  uint32_t rows;  // below 2^31 (the launcher checks), so that row indices stay 32-bit
  int Hq, Hk, D, R;
  int q_rows;          // rows of a token that belong to q: Hq, or 1
  int units_per_head;  // rotary units + pass-through units of one head
  int tpr, rows_per_block;
  int tpr_log2;                   // per-head kernel: tpr is a power of two
  int head_groups;                // per-head kernel: lane groups of a token
  FastDivmod seq;                 // token -> (batch, position): S
  FastDivmod row_split;           // rows kernel: row -> (token, row of the token); per-head: thread -> token slot
  RopeTensorArg q, k;
  const void *cos, *sin;          // the table, of the kernel's TAB dtype
  uint32_t cos_sb, cos_ss, sin_sb, sin_ss;
  RopeTensorArg qo, ko;
  FastDivmod grid_hw, grid_w;     // 3-D grid: position -> (frame, in frame) -> (row, column)
  int step_heads, step_units;  // rows kernel: tpr as (heads, units) of a head, item to item
  int64_t grid_offsets[3];  // 3-D grid: (frame, row, column) of the first token
  ParamPtr qw, kw;
  bool across;  // one norm over every head of a tensor (weights [H * D])
  float eps, weight_offset;
  float inv_head_dim;  // per-head kernel: 1 / D, for the per-head norm's mean
};

// Where the unit's channels sit in its head: d0 and, for two-vector units, d1.
template <bool INTERLEAVED, int VEC>
struct UnitLayout {
  static constexpr bool kTwoVectors = !(INTERLEAVED && VEC >= 2);
  // (R >= 0: unsigned divisions, no sign fix-up)
  __device__ __forceinline__ static int rotary_units(int R) {
    return int(kTwoVectors ? unsigned(R) / (2 * VEC) : unsigned(R) / VEC);
  }
  // The rotary pair of channel d0, the unit's first (pairs numbered as the 3-D grid's table).
  __device__ __forceinline__ static int first_pair(int d0) { return INTERLEAVED ? d0 / 2 : d0; }
  __device__ __forceinline__ static void channels(int j, int R, int& d0, int& d1) {
    if (INTERLEAVED && VEC == 1) {
      d0 = 2 * j;
      d1 = d0 + 1;
    } else {
      d0 = j * VEC;
      d1 = d0 + int(unsigned(R) / 2);
    }
  }
};

// The 3-D grid's table, one entry per rotary pair: the pair's frequency in turns per position
// step (frequency / 2 pi, in double) and its grid axis. Computed on the host once per launch
// and passed as a kernel parameter (only to the grid variants); each block copies it to
// shared memory, where a thread reads the entries of its own pairs.
constexpr int kMaxGridPairs = kMaxGridRotaryDims / 2;
struct GridPairs {
  double turns[kMaxGridPairs];
  unsigned char axis[kMaxGridPairs];
};
template <bool GRID>
struct GridParam {};  // table mode: no parameter bytes
template <>
struct GridParam<true> {
  GridPairs pairs;
};

// The block's shared-memory copy of the grid table.
struct GridTable {
  const double* turns;
  const unsigned char* axis;
};

// cos/sin of channels [d, d + VEC) of token (b, s), read from the table (dtype TAB: a template
// parameter, since a run-time choice kept both loads and their addresses in every kernel).
template <typename TAB>
__device__ __forceinline__ const TAB* cos_at(const RopeKernelArgs& a, uint32_t b, uint32_t s, int d) {
  return static_cast<const TAB*>(a.cos) + element_offset(b, s, 0, d, a.cos_sb, a.cos_ss, 0);
}
template <typename TAB>
__device__ __forceinline__ const TAB* sin_at(const RopeKernelArgs& a, uint32_t b, uint32_t s, int d) {
  return static_cast<const TAB*>(a.sin) + element_offset(b, s, 0, d, a.sin_sb, a.sin_ss, 0);
}
template <typename TAB, int VEC>
__device__ __forceinline__ void load_rotation(const RopeKernelArgs& a, uint32_t b, uint32_t s, int d, float (&c)[VEC],
                                              float (&sn)[VEC]) {
  VecIO<TAB, VEC>::load(cos_at<TAB>(a, b, s, d), c);
  VecIO<TAB, VEC>::load(sin_at<TAB>(a, b, s, d), sn);
}

// cos/sin of the unit whose first channel is d0, from the grid: one angle per rotary pair (the
// two channels of a pair turn together), for the token at positions `pos` (frame, row,
// column). A two-vector unit's second vector holds the partners, so the same factors apply.
template <typename L, int VEC>
__device__ __forceinline__ void grid_rotation(const GridTable& g, const double (&pos)[3], int d0, float (&c)[VEC],
                                              float (&sn)[VEC]) {
  constexpr int kPairs = L::kTwoVectors ? VEC : VEC / 2;  // pairs whose first channel the unit holds
  constexpr int kStep = L::kTwoVectors ? 1 : 2;            // channels per pair in the vector
  const int first = L::first_pair(d0);
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int ax = g.axis[first + i];
    const double p = ax == 0 ? pos[0] : ax == 1 ? pos[1] : pos[2];  // no local-memory array
    // turns of the angle in double; the fraction of a turn is exact enough for fp32
    const double turns = p * g.turns[first + i];
    float si, ci;
    __sincosf(float(turns - rint(turns)) * 6.283185307179586f, &si, &ci);
#pragma unroll
    for (int e = 0; e < kStep; ++e) {
      c[i * kStep + e] = ci;
      sn[i * kStep + e] = si;
    }
  }
}

// The unit's rotation factors: from the table (both vectors of a two-vector unit) or the grid.
template <typename L, typename TAB, int VEC, bool GRID>
__device__ __forceinline__ void unit_rotation(const RopeKernelArgs& a, const GridTable& g, const double (&pos)[3],
                                              uint32_t b, uint32_t s, bool two, int d0, int d1, float (&c0)[VEC],
                                              float (&s0)[VEC], float (&c1)[VEC], float (&s1)[VEC]) {
  if constexpr (GRID) {
    grid_rotation<L, VEC>(g, pos, d0, c0, s0);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      c1[i] = c0[i];
      s1[i] = s0[i];
    }
  } else {
    load_rotation<TAB, VEC>(a, b, s, d0, c0, s0);
    if (two) load_rotation<TAB, VEC>(a, b, s, d1, c1, s1);
  }
}

// What one unit needs besides its data: rotation factors of its channels and norm weights.
template <int VEC>
struct UnitParams {
  float c0[VEC], s0[VEC], c1[VEC], s1[VEC], w0[VEC], w1[VEC];
};

// The factor a norm weight element w applies: offset + w (Gemma stores w - 1), or 1 when the
// norm has no weight (or the element was not loaded).
__device__ __forceinline__ float weight_factor(bool present, float offset, float w) {
  return present ? offset + w : 1.f;
}

// Where a unit's elements are normalized at their use: rstd * (offset + w) is taken as
// fmaf(rstd, w, scaled_offset(rstd, ...)), one multiply-add an element, with an absent weight
// loaded as zeros: a select and an add an element fewer than rstd * weight_factor(...), which
// OLMo-2's q/k rows spent 32 of their 336 warp instructions on. H200 side by side
// (bench/results/2026-11-29_h200_cd67aa2/tune/norm_fma_*): qk-norm + rope Wan 1.3B 116.4-116.9 ->
// 111.5-112.4 us bf16, 116.2 -> 114.0-114.2 fp16; OLMo-2 8192 tokens 80.3-80.9 -> 79.5-79.7,
// 2048 tokens 26.3-26.4 -> 25.9-26.1; LTX-Video 47.2-47.6 -> 47.0-47.3 bf16 and 46.9-47.2 ->
// 47.4-47.6 fp16 (its fp16 paired rows fell from 79 registers to 64 with 12 bytes of spills,
// which their launch bound since removed: see launch_rope).
__device__ __forceinline__ float scaled_offset(float rstd, bool weight_present, float offset) {
  return rstd * (weight_present ? offset : 1.f);
}

// Adds the squares of a unit's elements to acc (v1 only for a layout of two vectors), one FMA
// each (a pair's sum of squares first costs a multiply and an add more).
template <typename L, int VEC>
__device__ __forceinline__ void add_squares(float& acc, const float (&v0)[VEC], const float (&v1)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    acc = fmaf(v0[i], v0[i], acc);
    if constexpr (L::kTwoVectors) acc = fmaf(v1[i], v1[i], acc);
  }
}

// Writes one unit of a row: v0 as is outside the rotary part, else the rotated pair(s) (one
// vector holding interleaved pairs, or two vectors R/2 apart for half-split).
template <typename L, typename T, int VEC>
__device__ __forceinline__ void store_unit(T* o, int d0, int d1, bool rotary, const float (&v0)[VEC],
                                           const float (&v1)[VEC], const UnitParams<VEC>& r) {
  if (!rotary) {
    store_pack(o + d0, pack<T, VEC>(v0));
  } else if constexpr (!L::kTwoVectors) {
    float y[VEC];
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      y[i] = v0[i] * r.c0[i] - v0[i + 1] * r.s0[i];
      y[i + 1] = v0[i + 1] * r.c0[i + 1] + v0[i] * r.s0[i + 1];
    }
    store_pack(o + d0, pack<T, VEC>(y));
  } else {
    float y0[VEC], y1[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      y0[i] = v0[i] * r.c0[i] - v1[i] * r.s0[i];
      y1[i] = v1[i] * r.c1[i] + v0[i] * r.s1[i];
    }
    store_pack(o + d0, pack<T, VEC>(y0));
    store_pack(o + d1, pack<T, VEC>(y1));
  }
}

// The unit's norm weights and, where `rotation`, its rotation factors.
template <typename L, typename T, typename TAB, int VEC, bool NORM, bool GRID>
__device__ __forceinline__ void load_unit_params(const RopeKernelArgs& a, const GridTable& g, const double (&pos)[3],
                                                 uint32_t b, uint32_t s, const ParamPtr& w, int woff, bool rotation,
                                                 bool two, int d0, int d1, UnitParams<VEC>& p) {
  if constexpr (NORM) {  // an absent weight as zeros (see scaled_offset)
#pragma unroll
    for (int i = 0; i < VEC; ++i) p.w0[i] = p.w1[i] = 0.f;
    if (w.ptr) {
      load_param<T, VEC>(w, woff + d0, p.w0);
      if (two) load_param<T, VEC>(w, woff + d1, p.w1);
    }
  }
  if (rotation) unit_rotation<L, TAB, VEC, GRID>(a, g, pos, b, s, two, d0, d1, p.c0, p.s0, p.c1, p.s1);
}

// Grid mode: the (frame, row, column) of token s, offsets included, as doubles (the angle's
// factor).
__device__ __forceinline__ void grid_position(const RopeKernelArgs& a, uint32_t s, double (&pos)[3]) {
  uint32_t in_frame, col;
  const uint32_t frame = a.grid_hw.divmod(uint32_t(s), in_frame);
  const uint32_t row = a.grid_w.divmod(in_frame, col);
  pos[0] = double(int64_t(frame) + a.grid_offsets[0]);
  pos[1] = double(int64_t(row) + a.grid_offsets[1]);
  pos[2] = double(int64_t(col) + a.grid_offsets[2]);
}

// Grid mode: copies the launch's grid table into the block's shared memory ([R/2] turns, then
// [R/2] axes). Every thread must call it; the copy is visible after the next barrier.
template <bool GRID>
__device__ __forceinline__ GridTable stage_grid_table(const RopeKernelArgs& a, const GridParam<GRID>& gp,
                                                      unsigned char* smem) {
  double* turns = reinterpret_cast<double*>(smem);
  unsigned char* axis = smem + sizeof(double) * (a.R / 2);
  if constexpr (GRID) {
    for (int r = threadIdx.x; r < a.R / 2; r += blockDim.x) {
      turns[r] = gp.pairs.turns[r];
      axis[r] = gp.pairs.axis[r];
    }
  }
  return GridTable{turns, axis};
}

// Rows of one head (ITEMS == 1) load their unit's rotation factors and weights together with
// the data, so their latency overlaps it; wider rows load them after the reduction, where
// they would otherwise cost registers during it. EARLY_ROTATION: wide rows whose items are
// the same unit of several heads (step_units 0) load that unit's rotation factors with the
// data; it is a template parameter because holding them through the reduction costs the
// other rows registers even when not taken. Rows of one unit a lane (ITEMS == 1) with
// EARLY_ROTATION load the rotation factors with the data and the weights after the sum.
// PAIRED (norm across heads, as many k heads as q heads): a row is a token's q and its k, and
// each thread holds the same ITEMS units of both, so their rotation factors are read once for
// the two (the rows of q and of k each read them otherwise); the two row sums share a barrier.
// MAX_THREADS / MIN_BLOCKS: launch bounds (a MIN_BLOCKS of 0 states none), other than the
// defaults only for the rows of launch_rope that say why.
template <typename T, typename TAB, int VEC, int ITEMS, bool INTERLEAVED, bool NORM, bool GRID, bool EARLY_ROTATION,
          bool PAIRED = false, int MAX_THREADS = kMaxThreads, int MIN_BLOCKS = 0>
__global__ void __launch_bounds__(MAX_THREADS, MIN_BLOCKS)
    rope_rows_kernel(const RopeKernelArgs a, const GridParam<GRID> gp) {
  static_assert(!PAIRED || (NORM && ITEMS > 1), "paired rows are rows of a norm across heads");
  constexpr bool kEarlyParams = ITEMS == 1 && !EARLY_ROTATION;
  constexpr bool kEarlyRotation = EARLY_ROTATION;
  using L = UnitLayout<INTERLEAVED, VEC>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float scratch[PAIRED ? 2 : 1][kMaxThreads / 32];
  const GridTable gtab = stage_grid_table<GRID>(a, gp, smem_raw);
  if constexpr (GRID) __syncthreads();  // (rows that load their factors with the data need it first)

  const int tpr = a.tpr;
  const int rb = a.rows_per_block == 1 ? 0 : threadIdx.x / tpr;
  const int lane = threadIdx.x - rb * tpr;
  const uint32_t row = blockIdx.x * uint32_t(a.rows_per_block) + rb;
  const bool active = row < a.rows;
  // (rows < 2^31; the rows past the last split as well, unused, so that b and s stay 32-bit)
  uint32_t sub32, s;
  const uint32_t b = a.seq.divmod(a.row_split.divmod(row, sub32), s);
  const int sub = int(sub32);
  const bool is_k = sub >= a.q_rows;
  const int head0 = a.across ? 0 : (is_k ? sub - a.q_rows : sub);  // first head of the row
  const int heads = a.across ? (is_k ? a.Hk : a.Hq) : 1;
  const int units = heads * a.units_per_head;
  const RopeTensorArg src = pick<true>(is_k, a.q, a.k), dst = pick<true>(is_k, a.qo, a.ko);
  const T* in = static_cast<const T*>(src.ptr);
  T* out = static_cast<T*>(const_cast<void*>(dst.ptr));
  const int rot_units = L::rotary_units(a.R);
  double pos[3] = {0, 0, 0};
  if constexpr (GRID) grid_position(a, s, pos);

  const ParamPtr& w = is_k ? a.kw : a.qw;
  // Item `it` is unit u = lane + it * tpr of the row: head hi, unit j of the head. Walked
  // from item to item without divisions. When tpr is a whole number of heads (step_units 0)
  // every item is the same unit of another head, so its rotation factors are loaded once.
  const int hi_first = lane / a.units_per_head, j_first = lane - hi_first * a.units_per_head;
  auto walk = [&](int it, int& hi, int& j) {
    if (it == 0) {
      hi = hi_first;
      j = j_first;
      return;
    }
    hi += a.step_heads;
    j += a.step_units;
    if (j >= a.units_per_head) {
      j -= a.units_per_head;
      ++hi;
    }
  };
  const bool same_unit = a.step_units == 0;
  // channels of unit j of a head
  auto channels_of = [&](int j, int& d0, int& d1, bool& rotary) {
    rotary = j < rot_units;
    d1 = 0;
    if (rotary)
      L::channels(j, a.R, d0, d1);
    else
      d0 = a.R + (j - rot_units) * VEC;
  };

  UnitParams<VEC> late;  // kEarlyRotation: filled before the reduction

  // Threads without a row touch no global memory and need not wait; the wait under `active`
  // also keeps the compiler from hoisting it above the setup, which overlaps the previous
  // kernel's tail only while it comes first.
  if (active) pdl_wait();
  // Load every unit of the row: x0 (and x1 for two-vector rotary units); paired rows, k's in y0
  // and y1.
  constexpr int kPairedItems = PAIRED ? ITEMS : 1;
  Pack<T, VEC> x0[ITEMS], x1[ITEMS], y0[kPairedItems], y1[kPairedItems];
  UnitParams<VEC> early;
  int hi, j;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int u = lane + it * tpr;
    walk(it, hi, j);
    x0[it] = Pack<T, VEC>{};
    x1[it] = Pack<T, VEC>{};
    if constexpr (PAIRED) {
      y0[it] = Pack<T, VEC>{};
      y1[it] = Pack<T, VEC>{};
    }
    if (active && u < units) {
      int d0, d1;
      bool rotary;
      channels_of(j, d0, d1, rotary);
      const uint32_t h = head0 + hi;
      x0[it] = load_pack<T, VEC>(in + element_offset(b, s, h, d0, src.sb, src.ss, src.sh));
      if (rotary && L::kTwoVectors)
        x1[it] = load_pack<T, VEC>(in + element_offset(b, s, h, d1, src.sb, src.ss, src.sh));
      if constexpr (PAIRED) {
        const T* k_in = static_cast<const T*>(a.k.ptr);
        y0[it] = load_pack<T, VEC>(k_in + element_offset(b, s, h, d0, a.k.sb, a.k.ss, a.k.sh));
        if (rotary && L::kTwoVectors)
          y1[it] = load_pack<T, VEC>(k_in + element_offset(b, s, h, d1, a.k.sb, a.k.ss, a.k.sh));
      }
      if constexpr (kEarlyParams)
        load_unit_params<L, T, TAB, VEC, NORM, GRID>(a, gtab, pos, b, s, w, a.across ? hi * a.D : 0, rotary,
                                                     rotary && L::kTwoVectors, d0, d1, early);
      else if (kEarlyRotation && it == 0 && rotary)
        unit_rotation<L, TAB, VEC, GRID>(a, gtab, pos, b, s, L::kTwoVectors, d0, d1, late.c0, late.s0, late.c1,
                                         late.s1);
    }
  }
  pdl_release();

  float rstd = 1.f, rstd_k = 1.f;  // rstd_k: paired rows' k
  if constexpr (NORM) {
    float acc[PAIRED ? 2 : 1] = {};
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      float v0[VEC], v1[VEC];
      unpack(x0[it], v0);
      unpack(x1[it], v1);
      // (not add_squares: its FMA chain moved these rows' register allocations, LTX-Video's
      // paired rows from 80 to 82 registers, one block an SM fewer)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[0] += v0[i] * v0[i] + v1[i] * v1[i];
      if constexpr (PAIRED) {
        unpack(y0[it], v0);
        unpack(y1[it], v1);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[PAIRED] += v0[i] * v0[i] + v1[i] * v1[i];
      }
    }
    row_sums(acc, tpr, scratch[0], kMaxThreads / 32);
    rstd = rsqrtf(acc[0] / float(heads * a.D) + a.eps);
    if constexpr (PAIRED) rstd_k = rsqrtf(acc[PAIRED] / float(heads * a.D) + a.eps);
  }
  if (!active) return;

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int u = lane + it * tpr;
    walk(it, hi, j);
    if (u >= units) break;  // u grows with it
    int d0, d1;
    bool rotary;
    channels_of(j, d0, d1, rotary);
    T* o = out + element_offset(b, s, head0 + hi, 0, dst.sb, dst.ss, dst.sh);
    const bool two = rotary && L::kTwoVectors;
    if constexpr (!kEarlyParams)  // weights span every head when the norm does
      load_unit_params<L, T, TAB, VEC, NORM, GRID>(a, gtab, pos, b, s, w, a.across ? hi * a.D : 0,
                                                   rotary && !kEarlyRotation && (it == 0 || !same_unit), two, d0, d1,
                                                   late);
    const UnitParams<VEC>& p = kEarlyParams ? early : late;
    // Normalizes one unit (in0, in1 as loaded) by r and the norm weights wt (their vectors in
    // wv), rotates it by p and writes it to the row at dst.
    auto finish = [&](const Pack<T, VEC>& in0, const Pack<T, VEC>& in1, float r, const ParamPtr& wt,
                      const UnitParams<VEC>& wv, T* dst) {
      float v0[VEC], v1[VEC];
      unpack(in0, v0);
      unpack(in1, v1);
      if constexpr (NORM) {
        const float r_offset = scaled_offset(r, wt.ptr, a.weight_offset);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          v0[i] *= fmaf(r, wv.w0[i], r_offset);
          v1[i] *= fmaf(r, wv.w1[i], r_offset);
        }
      }
      store_unit<L, T, VEC>(dst, d0, d1, rotary, v0, v1, p);
    };
    finish(x0[it], x1[it], rstd, w, p, o);
    if constexpr (PAIRED) {  // k's unit: the same channels and rotation factors, k's weights
      UnitParams<VEC> kp;
      load_unit_params<L, T, TAB, VEC, NORM, GRID>(a, gtab, pos, b, s, a.kw, hi * a.D, false, two, d0, d1, kp);
      finish(y0[it], y1[it], rstd_k, a.kw, kp,
             static_cast<T*>(const_cast<void*>(a.ko.ptr)) +
                 element_offset(b, s, head0 + hi, 0, a.ko.sb, a.ko.ss, a.ko.sh));
    }
  }
}

// Per-head rows: of at most 32 units with a norm (head_dim <= 128 in 16-bit with whole
// vectors: the LLM and DiT case), of up to a block's threads without one (LTX-Video's flat
// 2048-channel rotary), one token per thread group: `tpr` lanes own the units of a head, and each of
// `head_groups` lane groups walks ITEMS heads of the token (h = group + it * head_groups).
// A lane's unit is the same in all its heads, so its rotation factors (and, for the norm, its
// weight vectors) are loaded or computed once per token and reused ITEMS times; the heads'
// data are all loaded before the first use. The per-head RMS is a shuffle over the lanes.
template <typename T, typename TAB, int VEC, int ITEMS, bool INTERLEAVED, bool NORM, bool GRID>
__device__ __forceinline__ void rope_heads(const RopeKernelArgs& a, const GridParam<GRID>& gp) {
  const int head_groups = a.head_groups;
  using L = UnitLayout<INTERLEAVED, VEC>;
  // With one-vector units the q and k norm weights of the lane's unit are read once, with the
  // data (two-vector units read theirs per head, from L1: holding both would cost registers).
  constexpr bool kEarlyWeights = NORM && !L::kTwoVectors;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const GridTable gtab = stage_grid_table<GRID>(a, gp, smem_raw);  // read after the data loads

  const int tpr = a.tpr;
  // token slot of the block, lane group, lane (tpr is a power of two; a block holds several
  // tokens only where one token's lanes fill less than 128 threads)
  int slot = 0, hg, lane = int(threadIdx.x) & (tpr - 1);
  {
    uint32_t in_token = threadIdx.x;
    if (a.rows_per_block > 1) slot = int(a.row_split.divmod(threadIdx.x, in_token));
    hg = int(in_token >> a.tpr_log2);
  }
  const uint32_t token = blockIdx.x * uint32_t(a.rows_per_block) + slot;
  const int heads = a.Hq + a.Hk;
  // (threads that only complete the block's last warp have hg >= head_groups or a slot past
  // the block's tokens)
  const bool active = slot < a.rows_per_block && hg < head_groups && token < a.rows && lane < a.units_per_head;
  // (token < 2^31, the launcher checks; inactive threads split theirs too, unused, so that b
  // and s stay 32-bit)
  uint32_t s;
  const uint32_t b = a.seq.divmod(token, s);
  const int rot_units = L::rotary_units(a.R);
  const bool rotary = lane < rot_units;
  const bool two = rotary && L::kTwoVectors;
  int d0, d1 = 0;
  if (rotary)
    L::channels(lane, a.R, d0, d1);
  else
    d0 = a.R + (lane - rot_units) * VEC;
  double pos[3] = {0, 0, 0};
  if constexpr (GRID) grid_position(a, s, pos);
  // Threads without a row touch no global memory and need not wait; the wait under `active`
  // also keeps the compiler from hoisting it above the setup, which overlaps the previous
  // kernel's tail only while it comes first.
  if (active) pdl_wait();
  float wq[VEC], wk[VEC];
  if constexpr (kEarlyWeights) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) wq[i] = wk[i] = 1.f;
    if (active && a.qw.ptr) load_param<T, VEC>(a.qw, d0, wq);
    if (active && a.kw.ptr) load_param<T, VEC>(a.kw, d0, wk);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      wq[i] = weight_factor(a.qw.ptr, a.weight_offset, wq[i]);
      wk[i] = weight_factor(a.kw.ptr, a.weight_offset, wk[i]);
    }
  }
  Pack<T, VEC> x0[ITEMS], x1[ITEMS];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int h = hg + it * head_groups;
    x0[it] = Pack<T, VEC>{};
    x1[it] = Pack<T, VEC>{};
    if (active && h < heads) {
      const bool is_k = h >= a.Hq;
      const RopeTensorArg src = pick<false>(is_k, a.q, a.k);
      const T* p =
          static_cast<const T*>(src.ptr) + element_offset(b, s, is_k ? h - a.Hq : h, 0, src.sb, src.ss, src.sh);
      x0[it] = load_pack<T, VEC>(p + d0);
      if (two) x1[it] = load_pack<T, VEC>(p + d1);
    }
  }
  // This lane's rotation factors, shared by its heads. A bf16 table's stay packed until each
  // head's use: half the registers, for an unpack an element per head (Qwen3's q/k with their
  // norm 91 -> 72 registers, the rotary alone 72 -> 64). fp16 tables kept their count or rose,
  // but for Qwen3's q/k with their norm, which packed fit a cap of 80 without spills (see
  // rope_heads_kernel_capped).
  constexpr bool kPackedRotation =
      !GRID && ITEMS > 1 &&
      (std::is_same_v<TAB, __nv_bfloat16> || (std::is_same_v<TAB, __half> && NORM && ITEMS == 2 && L::kTwoVectors));
  UnitParams<VEC> rot;
  Pack<TAB, VEC> rot_packs[4];  // (kPackedRotation) cos and sin of d0, of d1
  if constexpr (GRID) __syncthreads();  // the grid table's copy, made while the loads are in flight
  if (active && rotary) {
    if constexpr (kPackedRotation) {
      const TAB *cos = cos_at<TAB>(a, b, s, 0), *sin = sin_at<TAB>(a, b, s, 0);  // the token's rows
      rot_packs[0] = load_pack<TAB, VEC>(cos + d0);
      rot_packs[1] = load_pack<TAB, VEC>(sin + d0);
      if (two) {
        rot_packs[2] = load_pack<TAB, VEC>(cos + d1);
        rot_packs[3] = load_pack<TAB, VEC>(sin + d1);
      }
    } else {
      unit_rotation<L, TAB, VEC, GRID>(a, gtab, pos, b, s, two, d0, d1, rot.c0, rot.s0, rot.c1, rot.s1);
    }
  }
  pdl_release();

  // The per-head sums of all ITEMS heads shuffle together (FLUX 46.4 -> 42.2 us, [a4c6657] tune/3).
  float rstd[ITEMS];
  if constexpr (NORM) {
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      float v0[VEC], v1[VEC];
      unpack(x0[it], v0);
      unpack(x1[it], v1);
      rstd[it] = 0.f;
      add_squares<L>(rstd[it], v0, v1);
    }
    lane_group_sums(rstd, tpr);  // every lane takes part
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) rstd[it] = rsqrtf(rstd[it] * a.inv_head_dim + a.eps);
  }

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int h = hg + it * head_groups;
    const bool is_k = h >= a.Hq;
    float v0[VEC], v1[VEC];
    unpack(x0[it], v0);
    unpack(x1[it], v1);
    if constexpr (kEarlyWeights) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v0[i] *= rstd[it] * (is_k ? wk[i] : wq[i]);
    } else if constexpr (NORM) {
      const ParamPtr& w = is_k ? a.kw : a.qw;
      float w0[VEC], w1[VEC];
      // [D] per head: L1 hits after the first head. Ones only where nothing is loaded (set
      // before the loads, they cost an instruction an element).
      auto ones = [](float(&v)[VEC]) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = 1.f;
      };
      if (active && w.ptr) {
        load_param<T, VEC>(w, d0, w0);
        if (two)
          load_param<T, VEC>(w, d1, w1);
        else
          ones(w1);  // (v1 is not stored then)
      } else {
        ones(w0);
        ones(w1);
      }
      // r * (offset + w) as one FMA an element, r * w + r * offset (the offset only with
      // weights): the norm is most of this kernel's instructions (Qwen3's q/k: 2x the rotary's).
      const float r = rstd[it], r_offset = w.ptr ? r * a.weight_offset : 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        v0[i] *= fmaf(r, w0[i], r_offset);
        v1[i] *= fmaf(r, w1[i], r_offset);
      }
    }
    if (!(active && h < heads)) continue;
    const RopeTensorArg dst = pick<false>(is_k, a.qo, a.ko);
    T* o = static_cast<T*>(const_cast<void*>(dst.ptr)) +
           element_offset(b, s, is_k ? h - a.Hq : h, 0, dst.sb, dst.ss, dst.sh);
    if constexpr (kPackedRotation) {
      if (it > 0) {  // (opaque to the compiler, so that it unpacks again rather than hold the floats)
#pragma unroll
        for (auto& p : rot_packs)
#pragma unroll
          for (auto& word : p.w) {
            if constexpr (sizeof(word) == 4)
              asm volatile("" : "+r"(word));
            else
              asm volatile("" : "+h"(word));
          }
      }
      unpack(rot_packs[0], rot.c0);
      unpack(rot_packs[1], rot.s0);
      unpack(rot_packs[2], rot.c1);
      unpack(rot_packs[3], rot.s1);
    }
    store_unit<L, T, VEC>(o, d0, d1, rotary, v0, v1, rot);
  }
}

template <typename T, typename TAB, int VEC, int ITEMS, bool INTERLEAVED, bool NORM, bool GRID>
__global__ void __launch_bounds__(kMaxThreads) rope_heads_kernel(const RopeKernelArgs a, const GridParam<GRID> gp) {
  rope_heads<T, TAB, VEC, ITEMS, INTERLEAVED, NORM, GRID>(a, gp);
}

// The per-head kernel under a register cap, for the variants where the compiler's allocation
// falls just past an occupancy step; kernels of their own, since a cap moves other variants'
// allocations as well (a cap of 96 took FLUX's from 80 to 85 registers, 42.1 -> 45.9 us).
// - 96: two heads of half-split units with their norm per lane group (Qwen3's q/k): at 102
//   registers three blocks of 160 threads fit an SM, at 96 four (2048 tokens 22.4 -> 19.9 us,
//   8192 67.4 -> 60.2). Since 0a7993b (a bf16 table held packed) bf16 takes 72 uncapped, five
//   blocks. With an fp16 table, held packed as well: 80, five blocks, no spills (96 unpacked;
//   80 unpacked spilled 48-64 bytes). H200 fp16, side by side: 8192 tokens 54.64 -> 53.18-53.81
//   us, 2048 18.38-18.50 -> 18.18-18.34 ([h200_1915a37] tune/qwen3_fp16_caps.txt).
// - 72: two heads of half-split bf16 units without a norm (the LLM rope from 2048 tokens): 75
//   registers uncapped fit four 160-thread blocks an SM (five warps a block split unevenly over
//   the schedulers' register files, Nsight Compute's limit), 72 five, no spills: 2048 tokens
//   14.83-14.91 -> 14.56-14.72 us, 8192 45.60-45.76 -> 44.98-45.52 ([h200_3703b1b]
//   tune/rope_cap72_*). fp16 would spill 12-16 bytes there and ran 1% slower, so it keeps 78.
//   Since 0a7993b bf16 takes 64 under the cap, six blocks.
// - 80: four heads of interleaved one-vector units with their norm (FLUX's q/k). fp16 gets 82
//   registers uncapped against bf16's 80 (ptxas, sm_90), one register step past the 80 at which
//   FLUX's 192-thread blocks fit four to an SM; capped, 80 without spills (H100, fp16: 50.8 ->
//   47.4 us; bf16 unchanged).
template <int MAX_REGISTERS, typename T, typename TAB, int VEC, int ITEMS, bool INTERLEAVED, bool NORM, bool GRID>
__global__ void __maxnreg__(MAX_REGISTERS) rope_heads_kernel_capped(const RopeKernelArgs a, const GridParam<GRID> gp) {
  rope_heads<T, TAB, VEC, ITEMS, INTERLEAVED, NORM, GRID>(a, gp);
}

// ---------------------------------------------------------------- short rotary

// Arguments of short_rope_kernel, the fields its path reads first, first (a kernel's arguments
// start at byte 16 of a 64-byte line of the constant bank): the loads' addresses take the first
// two lines. A token's elements are token * (token stride) + head * (head stride) + channel in
// every operand, in 32 bits (the launcher checks that its batch and sequence strides fold into
// one and that the offsets fit): one multiply-add an address, where 64-bit offsets took three.
struct ShortRopeArgs {
  const void *q, *k;
  const void *cos, *sin;             // the table's rows, of the kernel's TAB dtype
  uint32_t q_ts, q_hs, k_ts, k_hs;  // token and head strides (elements)
  uint32_t cos_ts, sin_ts;
  int Hq, head_threads;  // threads of the block that own a head: (Hq + Hk) << tpr_log2
  int tpr_log2, R;
  int Hk;  // across heads: k's heads (q's and k's blocks own Hq and Hk lane groups)
  void *qo, *ko;
  uint32_t qo_ts, qo_hs, ko_ts, ko_hs;
  const void *qw, *kw;  // the norm's weights, of the data's dtype, or null
  float eps, weight_offset;
  float inv_q_width, inv_k_width;  // 1 / the channels a norm spans: D, or H * D across heads
};
static_assert(offsetof(ShortRopeArgs, cos_ts) == 48, "the first loads' pointers fill the first line");

// One token a block, each head on a lane group of 2^tpr_log2 lanes with one unit a lane (a head
// of whole vectors, wholly rotary, of 2^tpr_log2 units; the token's heads fill at most a
// block): the decode-sized rope and qk_norm_rope calls of LLM layers, whose time is the path
// from the launch through the loads to the stores, as for the norms' short_rows_kernel. The per-head
// kernel's one-head plan splits its thread index by run-time plan fields (tokens a block, heads
// a lane group), branches around pass-through channels and reads its arguments from three lines
// of the constant bank before its first load, at SASS instruction 84 of the bf16 rotary against
// this kernel's 36 (bench/results/2026-11-27_h200_4f8bf14/sass/rope_first_loads.txt).
//
// ACROSS: the norm spans every head of q (of k) of the token, as OLMo-2's does: a block is the
// heads of q (blockIdx.y 0) or of k (1) of a token, and its sum is block-wide. The rows kernel
// takes the same rows with a general row split before its first load.
// LATE_ROTATION (a norm's half-split units): the rotation factors are prefetched into L1 with
// the data and loaded after the sum, so that they hold no registers through it (OLMo-2's fp32
// table: 57 registers against 79, four 256-thread blocks an SM against three; without the
// prefetch 48, but their misses then start after the sum and the calls ran slower).
template <typename T, typename TAB, bool INTERLEAVED, bool NORM, bool ACROSS = false, bool LATE_ROTATION = false>
__global__ void __launch_bounds__(kMaxThreads) short_rope_kernel(const ShortRopeArgs a) {
  static_assert(!ACROSS || NORM, "a norm across heads");
  static_assert(!LATE_ROTATION || (NORM && !INTERLEAVED), "late rotation factors: a norm's half-split units");
  constexpr int VEC = 16 / int(sizeof(T));
  using L = UnitLayout<INTERLEAVED, VEC>;
  const bool k_block = ACROSS && blockIdx.y != 0;
  // Threads past the heads (the rest of the block's last warp; across heads, the threads past
  // the smaller tensor's heads) load the last lane's unit and store nothing: no branch around
  // the loads. Their lane groups are whole, so their per-head sums stay apart from the heads';
  // a sum across heads leaves them out.
  const int owned = ACROSS ? (k_block ? a.Hk : a.Hq) << a.tpr_log2 : a.head_threads;
  const int t = min(int(threadIdx.x), owned - 1);
  const int h = t >> a.tpr_log2, lane = t & ((1 << a.tpr_log2) - 1);
  const bool is_k = ACROSS ? k_block : h >= a.Hq;
  const uint32_t head = uint32_t(!ACROSS && is_k ? h - a.Hq : h), token = blockIdx.x;
  // q's or k's operand as q's plus the differences (see pick: a choice between the two
  // arguments compiles to a constant-bank load indexed by a register)
  auto choose = [is_k](uint32_t for_q, uint32_t for_k) { return for_q + (is_k ? for_k - for_q : 0u); };
  auto address = [is_k](const void* for_q, const void* for_k) {
    const char* p = static_cast<const char*>(for_q);
    return p + (is_k ? static_cast<const char*>(for_k) - p : 0);
  };
  int d0i, d1i;
  L::channels(lane, a.R, d0i, d1i);
  const uint32_t d0 = uint32_t(d0i), d1 = uint32_t(d1i);
  const T* in = reinterpret_cast<const T*>(address(a.q, a.k));
  const uint32_t in_at = token * choose(a.q_ts, a.k_ts) + head * choose(a.q_hs, a.k_hs);
  const TAB* cos = static_cast<const TAB*>(a.cos);
  const TAB* sin = static_cast<const TAB*>(a.sin);
  const uint32_t cos_at = token * a.cos_ts, sin_at = token * a.sin_ts;
  const TAB* const factors[4] = {cos + (cos_at + d0), sin + (sin_at + d0), cos + (cos_at + d1), sin + (sin_at + d1)};
  Pack<TAB, VEC> c0{}, s0{}, c1{}, s1{};
  auto load_rotation = [&] {
    c0 = load_pack<TAB, VEC>(factors[0]);
    s0 = load_pack<TAB, VEC>(factors[1]);
    if constexpr (L::kTwoVectors) {
      c1 = load_pack<TAB, VEC>(factors[2]);
      s1 = load_pack<TAB, VEC>(factors[3]);
    }
  };
  pdl_wait();
  const Pack<T, VEC> x0 = load_pack<T, VEC>(in + (in_at + d0));
  Pack<T, VEC> x1{};
  if constexpr (L::kTwoVectors) x1 = load_pack<T, VEC>(in + (in_at + d1));
  if constexpr (LATE_ROTATION) {
#pragma unroll
    for (const TAB* f : factors) prefetch_l1(f);
  } else {
    load_rotation();
  }
  const T* w = reinterpret_cast<const T*>(address(a.qw, a.kw));
  if (ACROSS && w) w += head * uint32_t(a.R);  // weights [H * D] (R == D)
  Pack<T, VEC> w0{}, w1{};
  if (NORM && w) {
    w0 = load_pack<T, VEC>(w + d0);
    if constexpr (L::kTwoVectors) w1 = load_pack<T, VEC>(w + d1);
  }
  pdl_release();
  float v0[VEC], v1[VEC];
  unpack(x0, v0);
  unpack(x1, v1);
  if constexpr (NORM) {
    float sum[1] = {0.f};
    add_squares<L>(sum[0], v0, v1);
    if constexpr (ACROSS) {
      __shared__ float scratch[kMaxThreads / 32];
      if (int(threadIdx.x) >= owned) sum[0] = 0.f;
      row_sums(sum, int(blockDim.x), scratch, 0);
    } else {
      lane_group_sums(sum, 1 << a.tpr_log2);  // every lane of the warp takes part
    }
    if constexpr (LATE_ROTATION) load_rotation();
    const float rstd = rsqrtf(sum[0] * (ACROSS && is_k ? a.inv_k_width : a.inv_q_width) + a.eps);
    const float rstd_offset = scaled_offset(rstd, w, a.weight_offset);  // w0, w1: zeros without weights
    float wv0[VEC], wv1[VEC];
    unpack(w0, wv0);
    unpack(w1, wv1);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v0[i] *= fmaf(rstd, wv0[i], rstd_offset);
      v1[i] *= fmaf(rstd, wv1[i], rstd_offset);
    }
  }
  if (int(threadIdx.x) >= owned) return;
  UnitParams<VEC> r;
  unpack(c0, r.c0);
  unpack(s0, r.s0);
  unpack(c1, r.c1);
  unpack(s1, r.s1);
  T* out = reinterpret_cast<T*>(const_cast<char*>(address(a.qo, a.ko))) +
           (token * choose(a.qo_ts, a.ko_ts) + head * choose(a.qo_hs, a.ko_hs));
  store_unit<L, T, VEC>(out, d0i, d1i, true, v0, v1, r);
}

// A stride as the kernels take it: in 32 bits, and 0 along a dimension of size 1 (never
// stepped, whatever its stride).
uint32_t stride32(const TensorView& t, int dim, const char* name) {
  if (t.shape[dim] == 1) return 0;
  FUSEBOX_CHECK(t.strides[dim] >= 0 && t.strides[dim] < (int64_t(1) << 32), name, "'s stride along dimension ", dim,
                " must be below 2^32 elements on CUDA; got ", t.strides[dim]);
  return uint32_t(t.strides[dim]);
}

RopeTensorArg tensor_arg(const TensorView& t, const char* name) {
  if (!t.defined()) return RopeTensorArg{nullptr, 0, 0, 0};
  return RopeTensorArg{t.data, stride32(t, 0, name), stride32(t, 1, name), stride32(t, 2, name)};
}

// Whether some operand's batches lie 2^32 or more elements apart (past what the kernels'
// 32-bit strides hold).
bool wide_batch_stride(const RopeArgs& args) {
  for (const TensorView* t : {&args.q, &args.k, &args.q_out, &args.k_out, &args.cos, &args.sin})
    if (t->defined() && t->shape[0] > 1 && t->strides[0] >= (int64_t(1) << 32)) return true;
  return false;
}

// The operands of batch b alone.
RopeArgs one_batch(const RopeArgs& args, int64_t b) {
  RopeArgs one = args;
  for (TensorView* t : {&one.q, &one.k, &one.q_out, &one.k_out, &one.cos, &one.sin}) {
    if (!t->defined()) continue;
    t->data = static_cast<char*>(t->data) + b * t->strides[0] * int64_t(dtype_size(t->dtype));
    t->shape[0] = 1;
  }
  return one;
}

ParamPtr param(const TensorView& t) {
  return ParamPtr{t.defined() ? t.data : nullptr, t.defined() && t.dtype == DType::kFloat32};
}

// Launches the per-head kernel (HEADS) or the rows kernel (early rotation factors compiled
// for the 4-unit rows of whole vectors and the paired rows only: the wide across-heads rows
// that use them; 2 items a thread only as paired rows, which only a norm takes). The table's
// dtype (TAB: T, or fp32 as FLUX and LTX-Video keep theirs) is a template parameter; the 3-D
// grid reads no table.
template <bool HEADS, typename T, int VEC, int ITEMS>
void launch_rope(const RopeKernelArgs& a, bool interleaved, bool norm, bool table_f32, const GridPairs* grid_pairs,
                 dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool early_rotation = false,
                 bool bounded_lanes = false) {
  auto go = [&](auto il, auto nm, auto gr, auto tab) {
    constexpr bool I = decltype(il)::value, N = decltype(nm)::value, G = decltype(gr)::value;
    using TAB = decltype(tab);
    GridParam<G> gp;
    if constexpr (G) gp.pairs = *grid_pairs;
    if constexpr (HEADS && ITEMS == 2 && N && UnitLayout<I, VEC>::kTwoVectors)
      launch(rope_heads_kernel_capped<std::is_same_v<TAB, __half> && !G ? 80 : 96, T, TAB, VEC, ITEMS, I, N, G>, grid,
             block, smem, stream, a, gp);
    else if constexpr (HEADS && ITEMS == 4 && N && !UnitLayout<I, VEC>::kTwoVectors)
      launch(rope_heads_kernel_capped<80, T, TAB, VEC, ITEMS, I, N, G>, grid, block, smem, stream, a, gp);
    else if constexpr (HEADS && ITEMS == 2 && !N && !G && VEC > 1 && std::is_same_v<T, __nv_bfloat16> &&
                       UnitLayout<I, VEC>::kTwoVectors)
      launch(rope_heads_kernel_capped<72, T, TAB, VEC, ITEMS, I, N, G>, grid, block, smem, stream, a, gp);
    else if constexpr (HEADS)
      launch(rope_heads_kernel<T, TAB, VEC, ITEMS, I, N, G>, grid, block, smem, stream, a, gp);
    else if constexpr (ITEMS == 4 && VEC > 1) {
      // The early-rotation rows of 16-bit one-vector units with their norm are bounded to more
      // blocks an SM than their register allocation gives unbounded (bf16 75 registers, fp16
      // 72), at the cost of 8 bytes of spills: 64 registers, eight 128-thread blocks (Wan
      // 1.3B's q/k, two 64-thread rows a block) or six 160-thread ones (Wan 14B's, one row).
      // Unbounded, bf16 fit only four 160-thread blocks against fp16's five (5-warp blocks
      // split unevenly over the four schedulers' register files: Nsight Compute's register
      // occupancy limit, [h200_3703b1b] ncu/). Measured side by side ([h200_3703b1b] tune/):
      // Wan 14B bf16 418.5 -> 362.2 us, fp16 381 -> 365.5; Wan 1.3B bf16 125.0 -> 122.8, fp16
      // 127.0 -> 123.4. Seven 160-thread blocks (56 registers, 64-80 bytes of spills) ran 433
      // us. Half-split units keep the default: at a 72-register bound they spilled up to 396
      // bytes.
      if constexpr (sizeof(T) == 2 && N && !G && !UnitLayout<I, VEC>::kTwoVectors) {
        if (early_rotation && block.x <= 128)
          return launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, true, false, 128, 8>, grid, block, smem,
                        stream, a, gp);
        if (early_rotation && block.x <= 160)
          return launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, true, false, 160, 6>, grid, block, smem,
                        stream, a, gp);
      }
      early_rotation ? launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, true>, grid, block, smem, stream, a, gp)
                     : launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, false>, grid, block, smem, stream, a, gp);
    } else if constexpr (ITEMS == 2) {
      // Paired rows: one-vector units from a table, of at most 128 threads (the launcher's
      // limits; two-vector units hold 128 registers paired). With early rotation factors
      // (Wan 1.3B's 12 heads, 96 threads a token) bounded to seven blocks an SM: 72 registers
      // where ptxas gives 76-78, no spills (qk-norm + rope bf16 118.8 -> 117.0 us, fp16 119.4
      // -> 116.3; [h200_4e2c81a] tune/tune_rope_paired_*). LTX-Video's rows (no early factors)
      // take the same bound since scaled_offset's form: unbounded, ptxas gave fp16 64 registers
      // and 12 bytes of spills, bounded 68 (72 bf16) and none; qk-norm + rope 2x2688x2048 bf16
      // 47.0-47.2 -> 46.5-46.8 us, fp16 47.5-47.8 -> 46.2-46.7, 2x8064x2048 126.7-126.9 ->
      // 125.4-125.6 bf16 ([h200_cd67aa2] tune/paired_bound_*; before that form it spilled here).
      if constexpr (N && !G && !UnitLayout<I, VEC>::kTwoVectors)
        early_rotation
            ? launch(rope_rows_kernel<T, TAB, VEC, 2, I, N, G, true, true, 128, 7>, grid, block, smem, stream, a, gp)
            : launch(rope_rows_kernel<T, TAB, VEC, 2, I, N, G, false, true, 128, 7>, grid, block, smem, stream, a, gp);
      else
        FUSEBOX_CHECK(false, "paired rotary rows take a norm, a table and one-vector units");
    } else {
      // bounded_lanes: lane-per-unit rows of 16-bit two-vector units with their norm (OLMo-2's
      // q/k across heads: 256 lanes a row) bounded to four 256-thread blocks an SM, 64 registers
      // where ptxas gives 79, so that 256 tokens' 512 rows run as one wave. Their weights load
      // after the sum (28 bytes of spills, 36 with every factor loaded with the data): OLMo-2
      // 256 tokens bf16 8.70-8.78 -> 7.89-8.02 us ([h200_d2becb9] tune/tune_bounded_param_loads.txt)
      if constexpr (ITEMS == 1 && sizeof(T) == 2 && VEC > 1 && N && !G && UnitLayout<I, VEC>::kTwoVectors)
        if (bounded_lanes && block.x <= 256)
          return launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, true, false, 256, 4>, grid, block, smem,
                        stream, a, gp);
      launch(rope_rows_kernel<T, TAB, VEC, ITEMS, I, N, G, false>, grid, block, smem, stream, a, gp);
    }
  };
  auto with_src = [&](auto il, auto nm) {
    if (grid_pairs)
      go(il, nm, std::true_type{}, T{});
    else if (table_f32 && !std::is_same_v<T, float>)
      go(il, nm, std::false_type{}, float{});
    else
      go(il, nm, std::false_type{}, T{});
  };
  auto with_norm = [&](auto il) { norm ? with_src(il, std::true_type{}) : with_src(il, std::false_type{}); };
  if constexpr (ITEMS == 8)  // only interleaved rows are that wide (rope_cuda)
    with_norm(std::true_type{});
  else
    interleaved ? with_norm(std::true_type{}) : with_norm(std::false_type{});
}

// The short rotary kernel's arguments, where every operand's batch and sequence strides fold
// into one token stride (one batch, one position per sequence, or packed sequences) and its
// offsets fit 32 bits; false otherwise.
bool short_rope_args(const RopeKernelArgs& a, const RopeShape& sh, ShortRopeArgs& k) {
  bool folds = true;
  auto token_stride = [&](uint32_t sb, uint32_t ss) {
    if (sh.B == 1) return ss;
    if (sh.S == 1) return sb;
    folds = folds && uint64_t(sb) == uint64_t(sh.S) * ss;
    return ss;
  };
  const uint64_t last_token = uint64_t(sh.B * sh.S - 1);
  auto fits = [&](uint32_t ts, uint32_t hs, int64_t heads) {
    return last_token * ts + uint64_t(heads - 1) * hs + uint64_t(a.D) <= UINT32_MAX;
  };
  k.q = a.q.ptr;
  k.k = a.k.ptr;
  k.cos = a.cos;
  k.sin = a.sin;
  k.q_ts = token_stride(a.q.sb, a.q.ss);
  k.q_hs = a.q.sh;
  k.k_ts = token_stride(a.k.sb, a.k.ss);
  k.k_hs = a.k.sh;
  k.cos_ts = token_stride(a.cos_sb, a.cos_ss);
  k.sin_ts = token_stride(a.sin_sb, a.sin_ss);
  k.Hq = a.Hq;
  k.head_threads = (a.Hq + a.Hk) << a.tpr_log2;
  k.tpr_log2 = a.tpr_log2;
  k.R = a.R;
  k.qo = const_cast<void*>(a.qo.ptr);
  k.ko = const_cast<void*>(a.ko.ptr);
  k.qo_ts = token_stride(a.qo.sb, a.qo.ss);
  k.qo_hs = a.qo.sh;
  k.ko_ts = token_stride(a.ko.sb, a.ko.ss);
  k.ko_hs = a.ko.sh;
  k.qw = a.qw.ptr;
  k.kw = a.kw.ptr;
  k.eps = a.eps;
  k.Hk = a.Hk;
  k.inv_q_width = a.across ? 1.f / float(sh.Hq * sh.D) : a.inv_head_dim;
  k.inv_k_width = a.across ? 1.f / float(std::max<int64_t>(sh.Hk, 1) * sh.D) : a.inv_head_dim;
  k.weight_offset = a.weight_offset;
  const int64_t hk = std::max<int64_t>(sh.Hk, 1);
  return folds && fits(k.q_ts, k.q_hs, sh.Hq) && fits(k.qo_ts, k.qo_hs, sh.Hq) && fits(k.k_ts, k.k_hs, hk) &&
         fits(k.ko_ts, k.ko_hs, hk) && fits(k.cos_ts, 0, 1) && fits(k.sin_ts, 0, 1);
}

// Launches short_rope_kernel (ACROSS where `across`; LATE_ROTATION where `late_rotation`, which
// only a norm's half-split units take).
void launch_short_rope(const ShortRopeArgs& k, DType dtype, bool interleaved, bool norm, bool across, bool table_f32,
                       bool late_rotation, dim3 grid, dim3 block, cudaStream_t stream) {
  FUSEBOX_CHECK(!late_rotation || (norm && !interleaved), "late rotation factors: a norm's half-split units");
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    auto go = [&](auto tab, auto il, auto nm, auto ac) {
      constexpr bool I = decltype(il)::value, N = decltype(nm)::value, A = decltype(ac)::value;
      if constexpr (N && !I)
        if (late_rotation)
          return launch(short_rope_kernel<T, decltype(tab), I, N, A, true>, grid, block, 0, stream, k);
      launch(short_rope_kernel<T, decltype(tab), I, N, A>, grid, block, 0, stream, k);
    };
    auto with_norm = [&](auto tab, auto il) {
      if (across)
        go(tab, il, std::true_type{}, std::true_type{});
      else if (norm)
        go(tab, il, std::true_type{}, std::false_type{});
      else
        go(tab, il, std::false_type{}, std::false_type{});
    };
    auto with_style = [&](auto tab) {
      interleaved ? with_norm(tab, std::true_type{}) : with_norm(tab, std::false_type{});
    };
    if (table_f32)
      with_style(float{});
    else
      with_style(T{});
  });
}

// Whether the short kernel loads a norm's rotation factors after the sum: where `possible`
// (half-split units with a norm), the plan's `preferred` choice unless FUSEBOX_ROPE_EARLY says.
bool late_rotation(bool possible, bool preferred) {
  const std::optional<int> early = tuning_knobs().rope_early;
  return possible && (early ? *early == 0 : preferred);
}

}  // namespace

void rope_cuda(const RopeArgs& args, const RopeShape& sh, int vec, cudaStream_t stream) {
  if (sh.B > 1 && wide_batch_stride(args)) {  // one launch per batch, whose batch stride is then unused
    RopeShape one_shape = sh;
    one_shape.B = 1;
    for (int64_t b = 0; b < sh.B; ++b) rope_cuda(one_batch(args, b), one_shape, vec, stream);
    return;
  }
  RopeKernelArgs a{};
  a.seq = FastDivmod(uint32_t(sh.S));  // (S <= the token count, below 2^31: checked per kernel below)
  a.Hq = int(sh.Hq);
  a.Hk = int(sh.Hk);
  a.D = int(sh.D);
  a.R = int(sh.R);
  a.q = tensor_arg(args.q, "q");
  a.k = tensor_arg(args.k, "k");
  a.qo = tensor_arg(args.q_out, "q_out");
  a.ko = tensor_arg(args.k_out, "k_out");
  if (args.use_grid) {
    for (int i = 0; i < 3; ++i) a.grid_offsets[i] = args.grid.offsets[i];
    a.grid_hw = FastDivmod(uint32_t(args.grid.height * args.grid.width));
    a.grid_w = FastDivmod(uint32_t(args.grid.width));
  } else {
    a.cos = args.cos.data;
    a.sin = args.sin.data;
    a.cos_sb = stride32(args.cos, 0, "cos");
    a.cos_ss = stride32(args.cos, 1, "cos");
    a.sin_sb = stride32(args.sin, 0, "sin");
    a.sin_ss = stride32(args.sin, 1, "sin");
  }
  const bool interleaved = args.style == RopeStyle::kInterleaved;
  const bool table_f32 = !args.use_grid && args.cos.dtype == DType::kFloat32;
  const bool norm = args.norm == NormType::kRMS;
  a.across = norm && args.norm_across_heads;
  a.qw = param(args.q_weight);
  a.kw = param(args.k_weight);
  a.eps = args.eps;
  a.weight_offset = args.weight_offset;
  a.inv_head_dim = 1.f / float(sh.D);

  // Units need whole vectors: interleaved pairs inside one, or half-split partners R/2 apart a
  // whole number of vectors; otherwise (and for widths the vector does not divide) one
  // element per vector. Only the full 16-byte width and 1 are compiled.
  const int full = int(16 / dtype_size(args.q.dtype));
  if (vec != full || a.R % (interleaved ? vec : 2 * vec) != 0 || (a.D - a.R) % vec != 0) vec = 1;
  const int rot_units = interleaved && vec >= 2 ? a.R / vec : a.R / (2 * vec);
  a.units_per_head = rot_units + (a.D - a.R) / vec;
  const bool has_k = args.k.defined();
  // The 3-D grid's per-pair frequencies and axes, the same for every token and block.
  GridPairs pairs_table{};
  const GridPairs* grid_pairs = nullptr;
  if (args.use_grid) {
    // (R <= kMaxGridRotaryDims: checked by the entry point)
    for (int p = 0; p < a.R / 2; ++p) {
      const int r = interleaved ? 2 * p : p;  // the pair's first channel
      int64_t j;
      pairs_table.axis[p] = static_cast<unsigned char>(rope_grid_axis(args.grid, r, a.R, interleaved, j));
      pairs_table.turns[p] = rope_grid_inv_freq(args.grid, r, a.R, interleaved) * 0.15915494309189535;  // 1 / (2 pi)
    }
    grid_pairs = &pairs_table;
  }
  const size_t smem = args.use_grid ? (sizeof(double) + 1) * size_t(a.R / 2) : 0;
  const int heads = a.Hq + a.Hk;

  // Per-head kernel (tokens are rows; up to 4 heads per lane group) when a head fits one lane
  // group and the token's lane groups fit a block.
  const int head_tpr = next_pow2(a.units_per_head);
  while ((1 << a.tpr_log2) < head_tpr) ++a.tpr_log2;
  const int64_t tokens = sh.B * sh.S;
  FUSEBOX_CHECK(tokens < (int64_t(1) << 31), "too many tokens: ", tokens);
  // Two-vector units (half-split pairs) hold twice the registers of one-vector ones.
  const bool two_vectors = !(interleaved && vec >= 2);
  // What the short rotary kernel (see short_rope_kernel) takes: a table, wholly rotary heads of
  // 2, 4, ... 32 whole vectors, norm weights (if any) of the data's dtype, operands whose batch
  // and sequence strides fold into one (short_rope_args); per head, a token's heads filling a
  // block of 128-512 threads.
  bool weights_of_data = true;
  for (const TensorView* w : {&args.q_weight, &args.k_weight})
    weights_of_data = weights_of_data && (!w->defined() || w->dtype == args.q.dtype);
  const bool short_heads = !args.use_grid && vec == full && a.R == a.D && a.units_per_head == head_tpr &&
                           head_tpr <= 32 && (!norm || weights_of_data) &&
                           tuning_knobs().rope_short.value_or(1) != 0;
  ShortRopeArgs short_args{};
  const bool short_per_head = short_heads && !a.across && head_tpr * heads >= 128 &&
                              head_tpr * heads <= kMaxThreads && short_rope_args(a, sh, short_args);
  // Heads per lane group (H200 figures):
  // - 1 when a lane per unit needs at most half the GPU's resident threads (decode-sized calls:
  //   the shortest path from loads to stores; Qwen3 qk-norm + rope, 1 token 7.04 -> 5.95 us,
  //   256 tokens 7.17 -> 6.43);
  // - 1 at any size for two-vector units the short kernel takes: Qwen3's q/k with their norm,
  //   bf16, 2048 tokens 17.5-17.6 -> 15.8-16.1 us, 8192 50.5-50.8 -> 49.6-49.8 (fp16 18.2-18.4
  //   -> 15.7-15.9, 53.2-53.5 -> 49.7); the LLM rotary 2048 tokens 14.6 -> 14.4-14.5. The
  //   per-head kernel with one head a lane group ran 21.1 (Qwen3) and 15.2 (rotary) there
  //   (bench/results/2026-11-28_h200_8e17b1d/tune/tune_heads_*.txt);
  // - otherwise, with a per-head norm, 2 for two-vector units (Qwen3 2048 tokens: 22.6 us, 23.6
  //   with 1, 24.7 with 4, before the short kernel) and 4 for one-vector units (FLUX 4608
  //   tokens: 42.0 us, 42.2 with 2 since the heads' sums shuffle together; 44.5 against 57.3
  //   before; [a4c6657] tune/3; 52.2 with 1 on c67e7d9);
  // - without a norm, 2 as well for two-vector units read from a table (LLM rotary, 32 + 8
  //   heads of 8 lanes: 2048 tokens 15.79 -> 15.20-15.25 us, 8192 47.0 -> 46.4-46.5; 20 lane
  //   groups fill 5 warps where 10 left 16 of 96 lanes idle; [h200_ac07c7e] tune/rope_items);
  //   one-vector units and the grid, whose angles four heads share, keep 4 (FLUX's table
  //   32.7 us, 34.4 with 2; Wan rope_3d 40 heads 321 against 632).
  const int64_t lanes_one_head_each = sh.B * sh.S * heads * int64_t(head_tpr);
  int head_items = heads >= 4 ? (two_vectors && (norm || !args.use_grid) ? 2 : 4) : heads >= 2 ? 2 : 1;
  if (lanes_one_head_each <= device_limits().resident_threads() / 2 || (two_vectors && short_per_head))
    head_items = 1;
  while (head_items < 4 && head_tpr * ((heads + head_items - 1) / head_items) > kMaxThreads) head_items *= 2;
  const int forced_items = tuning_knobs().rope_items.value_or(0);
  if (forced_items == 1 || forced_items == 2 || forced_items == 4) head_items = forced_items;
  const int head_groups = (heads + head_items - 1) / head_items;
  a.head_groups = head_groups;
  // Without a norm no lane group reduces, so a head of any width up to the block fits one:
  // each lane then rotates its unit of q and of k with one read of the rotation factors, where
  // the rows kernel gives q's and k's rows threads of their own that read the table twice
  // (LTX-Video's flat 2x2688x2048 bf16 46.3 -> 43.9 us; [h200_4e2c81a] tune/tune_rope_wide_heads_*).
  const bool head_fits = !norm || a.units_per_head <= 32;
  if (!a.across && head_fits && head_tpr * head_groups <= kMaxThreads) {
    a.tpr = head_tpr;
    const int items = head_items;
    if (items == 1 && short_per_head) {
      launch_short_rope(short_args, args.q.dtype, interleaved, norm, false, table_f32,
                        late_rotation(norm && !interleaved, false), dim3(unsigned(tokens)),
                        dim3(unsigned((head_tpr * heads + 31) / 32 * 32)), stream);
      return;
    }
    a.rows = uint32_t(tokens);
    a.rows_per_block = std::max(1, 128 / (a.tpr * head_groups));
    a.row_split = FastDivmod(uint32_t(a.tpr * head_groups));
    const int64_t blocks = (tokens + a.rows_per_block - 1) / a.rows_per_block;
    // whole warps: the per-head sums shuffle with every lane of a warp present
    const int threads = (a.tpr * head_groups * a.rows_per_block + 31) / 32 * 32;
    const dim3 grid(static_cast<unsigned>(blocks)), block(static_cast<unsigned>(threads));
    dispatch_dtype(args.q.dtype, [&](auto t) {
      using T = decltype(t);
      constexpr int kFull = 16 / int(sizeof(T));
      auto with_items = [&](auto v) {
        constexpr int V = decltype(v)::value;
        auto go = [&](auto n) {
          launch_rope<true, T, V, decltype(n)::value>(a, interleaved, norm, table_f32, grid_pairs, grid, block, smem,
                                                      stream);
        };
        switch (items) {
          case 1: go(std::integral_constant<int, 1>{}); break;
          case 2: go(std::integral_constant<int, 2>{}); break;
          default: go(std::integral_constant<int, 4>{}); break;
        }
      };
      if (vec == kFull)
        with_items(std::integral_constant<int, kFull>{});
      else
        with_items(std::integral_constant<int, 1>{});
    });
    return;
  }

  // Rows of a norm across heads whose q heads and k heads each fill at most a block, up to four
  // times the resident threads: the short rotary kernel, a block a tensor. H200, bf16, OLMo-2's
  // q/k against the rows kernel (bench/results/2026-11-28_h200_8e17b1d/tune/): 1 token
  // 5.57-5.68 -> 4.70-4.77 us (CUDA-graph replay 2.27-2.30 -> 1.83-1.85), 16 tokens 5.86-5.92 ->
  // 4.90-5.02 (2.37-2.41 -> 1.83-1.90), 256 tokens 8.03 -> 7.65-7.68. One block a token for both
  // tensors, with a sum of two segments, ran 5.30-5.52 us at 1 token and replayed slower than the
  // rows kernel (2.49-2.56 us).
  // Past a quarter of the resident threads its half-split units load their rotation factors
  // after the sum (LATE_ROTATION; bench/results/2026-11-28_h200_8f2520f/tune/, both columns of
  // each): 256 tokens 7.78-7.87 -> 7.38-7.49 us, 1024 tokens 18.14-18.26 (rows) -> 15.65-15.70,
  // 2048 28.19-28.24 (rows) -> 26.43-26.48. Smaller calls lose with them (128 tokens 5.84-5.92 ->
  // 6.10-6.18, 1 token 4.75-4.86 -> 5.15-5.17); from 4096 tokens the rows kernel is faster (46.2
  // against 53.2-53.4; 8192 81.1-81.3 against 97.4-97.5). Qwen3's per-head half-split units lose
  // with them at every size (2048 tokens 16.0-16.1 -> 16.6) and keep theirs early.
  const int across_threads = int(std::max(sh.Hq, sh.Hk)) * head_tpr;
  const unsigned tensors = has_k ? 2 : 1;
  const int64_t across_lanes = tokens * tensors * across_threads, resident = device_limits().resident_threads();
  if (a.across && short_heads && across_threads <= kMaxThreads &&
      (across_lanes <= 4 * resident || tuning_knobs().rope_short.value_or(1) == 2) &&
      short_rope_args(a, sh, short_args)) {
    launch_short_rope(short_args, args.q.dtype, interleaved, norm, true, table_f32,
                      late_rotation(!interleaved, across_lanes > resident / 4), dim3(unsigned(tokens), tensors),
                      dim3(unsigned((across_threads + 31) / 32 * 32)), stream);
    return;
  }
  const int64_t units = int64_t(a.across ? std::max(a.Hq, a.Hk) : 1) * a.units_per_head;
  // Wide rows of a norm across heads, with as many k heads as q heads, of at most 128 threads:
  // paired rows (a token's q and k, 2 units of each a thread; see rope_rows_kernel). H200, side
  // by side ([h200_4e2c81a] tune/tune_rope_paired_*): qk-norm + rope LTX-Video 2x2688x2048 bf16 50.2
  // -> 47.3 us, 2x8064x2048 131.1 -> 127.4, Wan 1.3B 123.3 -> 117.0. Wan 14B's 40 heads
  // (320 threads a token, 76 registers) ran 362 -> 453 and keep separate rows.
  // Measured for interleaved pairs read from a table (one-vector units) only, which both take.
  const bool paired =
      a.across && has_k && a.Hq == a.Hk && !two_vectors && !args.use_grid && units > 32 && units <= 2 * 128;
  // rows of a token: Hq + Hk (one head per row), 1 + has_k (all heads of a tensor) or 1 (paired)
  const int rows_per_token = paired ? 1 : a.across ? 1 + int(has_k) : a.Hq + a.Hk;
  a.row_split = FastDivmod(uint32_t(rows_per_token));
  a.q_rows = a.across ? 1 : a.Hq;
  const int64_t rows = sh.B * sh.S * rows_per_token;
  FUSEBOX_CHECK(rows < (int64_t(1) << 31), "too many rows: ", rows);
  a.rows = uint32_t(rows);

  // Two-vector units: at most 4 of them per thread. Calls whose rows fit one wave with a lane
  // per unit take that plan: the norm weights then load with the data rather than after the
  // sum, and a thread's path is a quarter as long. One wave: a quarter of the GPU's resident
  // threads (79 registers a lane); up to half for 16-bit two-vector units with a norm, in a
  // kernel bounded to 64 registers (launch_rope's bounded_lanes), which is slower where the
  // unbounded one fits. OLMo-2's q/k (32 heads of 128, half-split, fp32 table), bf16, H200
  // side by side ([h200_c87c93d] tune/): 1 token 8.83 -> 5.57 us, 16 tokens 8.66 -> 5.81;
  // bounded, 256 tokens 9.73-9.79 -> 8.77-8.83 (1 token 5.68 -> 6.14 had it been bounded
  // there; [h200_d2becb9] tune/). Since 8e17b1d those calls take the short kernel above where it
  // applies; these plans keep the rest (norm weights of another dtype, strides that do not fold).
  int items = paired ? 2 : units <= 32 ? 1 : units <= 4 * kMaxThreads ? 4 : 8;
  bool bounded_lanes = false;
  if (items == 4 && units <= kMaxThreads) {
    const int64_t lanes = rows * ((units + 31) / 32 * 32), resident = device_limits().resident_threads();
    const bool boundable =
        norm && two_vectors && !args.use_grid && args.q.dtype != DType::kFloat32 && units <= 256;
    bounded_lanes = boundable && lanes > resident / 4 && lanes <= resident / 2;
    const int forced = tuning_knobs().rope_items.value_or(0);
    items = forced == 1 || forced == 4 ? forced : lanes <= resident / 4 || bounded_lanes ? 1 : 4;
  }
  // (a two-vector unit covers 2 * vec channels: the limit in channels is for a wholly rotary row)
  FUSEBOX_CHECK(units <= int64_t(two_vectors ? 4 : 8) * kMaxThreads, "one row of the rotary kernel (",
                a.across ? "every head of a token" : "one head", ", ",
                int64_t(a.across ? std::max(a.Hq, a.Hk) : 1) * a.D, " channels) is too wide: at most ",
                8 * kMaxThreads * vec, " are supported with ", vec, "-element vectors (",
                full, " where the rotary pairs and widths align to 16 bytes)");
  const int64_t need = (units + items - 1) / items;
  a.tpr = need <= 32 ? next_pow2(need) : int((need + 31) / 32 * 32);
  a.rows_per_block = a.tpr < 128 && (a.tpr & (a.tpr - 1)) == 0 ? 128 / a.tpr : 1;
  a.step_heads = a.tpr / a.units_per_head;
  a.step_units = a.tpr % a.units_per_head;
  // Items that are one unit of several heads share its rotation factors: loaded with the data,
  // their latency overlaps it (Wan 14B qk-norm + rope 536 -> 453 us; [a4c6657] tune/1).
  const bool early_rotation = a.step_units == 0 && tuning_knobs().rope_early.value_or(1) != 0;
  const int64_t blocks = (rows + a.rows_per_block - 1) / a.rows_per_block;
  const dim3 grid(static_cast<unsigned>(blocks)), block(static_cast<unsigned>(a.tpr * a.rows_per_block));

  dispatch_dtype(args.q.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kFull = 16 / int(sizeof(T));
    auto with_items = [&](auto v) {
      constexpr int V = decltype(v)::value;
      auto go = [&](auto n) {
        launch_rope<false, T, V, decltype(n)::value>(a, interleaved, norm, table_f32, grid_pairs, grid, block, smem,
                                                     stream, early_rotation, bounded_lanes);
      };
      switch (items) {
        case 1: go(std::integral_constant<int, 1>{}); break;
        case 2: go(std::integral_constant<int, 2>{}); break;
        case 4: go(std::integral_constant<int, 4>{}); break;
        default:  // interleaved pairs in whole vectors (see above)
          if constexpr (V > 1) go(std::integral_constant<int, 8>{});
          break;
      }
    };
    if (vec == kFull)
      with_items(std::integral_constant<int, kFull>{});
    else
      with_items(std::integral_constant<int, 1>{});
  });
}

}  // namespace fusebox::cuda
