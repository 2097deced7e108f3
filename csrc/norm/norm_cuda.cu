// The row-normalization kernels behind every norm op: (gated) residual add, RMS or Layer
// normalization, affine weight/bias and AdaLN modulation in one pass over HBM.
//
// Register path (rows up to kMaxRegisterVectors vectors): `tpr` threads own a row, each holds
// ITEMS vectors of it in registers (as stored, 16-bit values packed), so the row is read once
// and written once. What the op computes (norm type, residual, modulation) and the dtype of
// the small operands are template parameters: every kernel carries only the code of its op,
// which keeps it small (instruction fetch is part of the latency of short launches).
//
// Streaming path (wider rows, or small operands of mixed dtypes): one block per row walks it
// once per pass; the re-reads come from L2.
#include "common/cuda_common.cuh"
#include "norm/norm_impl.h"

#include <algorithm>
#include <cstddef>

namespace fusebox::cuda {
namespace {

constexpr int kMaxThreads = 512;       // register path
constexpr int kStreamThreads = 1024;   // streaming path
constexpr int kMinBlockThreads = 128;  // short rows are stacked until a block has this many

struct RowOperandArg {
  const void* ptr;
  RowOffsets off;
};

// The fields in about the order the plain norm rows read them. Kernel arguments sit in a
// constant bank whose 64-byte lines a warp stalls on at its first use of each; the decode-sized
// rms_norm spent about 15 of its 660 warp samples on each of seven lines ([h200_5e77ff2] ncu).
// Rows without residual or modulation now touch four lines (a residual: five, was eight): on an
// H100 rms_norm ran 0.07-0.27 us faster from 1 to 8192 rows, fused_add_rms_norm unchanged.
struct NormKernelArgs {
  RowIndexer index;
  int64_t rows;
  int width;        // D
  int vec_per_row;  // D / VEC
  int tpr;          // threads per row: a power of two <= 32 or a multiple of 32
  int tpr_log2;     // log2(tpr) where rows_per_block > 1 (tpr is then a power of two)
  int rows_per_block;
  int row_iters;    // register path, ITEMS > 2: row groups per block (1 otherwise)
  RowOperandArg x, out;
  ParamPtr weight, bias;
  float eps, weight_offset;
  float inv_width;  // 1 / D: a multiply where the row sums become moments
  bool out_f32;
  NormType norm;
  bool gate_f32, scale_f32, shift_f32;
  RowOperandArg branch, residual_out;
  RowOperandArg gate, scale, shift;  // T or the params' dtype; T with split modulation
  ParamPtr gate_table, scale_table, shift_table;  // split modulation: [D], the params' dtype
};

template <typename T>
__device__ __forceinline__ T* at(const RowOperandArg& o, int64_t i0, int64_t i1, int64_t i2, size_t elem) {
  return reinterpret_cast<T*>(static_cast<char*>(const_cast<void*>(o.ptr)) + o.off.at(i0, i1, i2) * int64_t(elem));
}

// ---------------------------------------------------------------- register path

// How a block finds its rows' operands (a compile-time choice; see has_twin for the plans that
// have more than the general split):
enum class RowWalk {
  kSplit,    // any layout: a row index split into three (two divisions), three-term offsets
  kFlat,     // the rows form one row group (RowIndexer flat): an operand's offset is one product
  kSamples,  // two row groups (samples x rows, RowLayout sizes[0] == 1): the sample from
             // blockIdx.y, no division, two-term offsets
};

// Where a row's small operands (weight, bias, gate, scale, shift) wait between their load and
// their use after the reduction. A compile-time choice: a run-time one kept both paths' address
// arithmetic and predicates in every use (about 13 instructions per operand and vector).
enum class ParamPath {
  kHeld,    // loaded into registers right after the row (plans of 1-2 vectors per thread)
  kStaged,  // copied to shared-memory slots while the row loads (cp.async)
  kGlobal,  // read from global memory at their use (L1 hits for operands shared by every row)
};

// The small operands a kernel knows present at compile time. The norm rows are partly issue-bound:
// a presence read at run time costs its checks at every use and keeps each operand a step of its
// own.
enum class Known {
  kNone,        // each operand's presence read at run time
  kAffine,      // plain norm rows: the weight, and a LayerNorm's bias (an RMS norm has none)
  kModulation,  // modulated rows: scale and shift, no weight or bias; with a residual, the gate
};

// kStaged's slots: each thread copies the vectors it will need into its own shared-memory slots
// when it issues the row's loads (cp.async: no registers held while they are in flight) and
// reads them back after the reduction, so their latency overlaps the row's instead of following
// the reduction.
// Slot of operand p, item it, thread t: [p][it][t], consecutive threads 16 bytes apart.
template <typename P, int VEC, int ITEMS>
struct ParamSlots {
  Pack<P, VEC>* base;
  __device__ __forceinline__ Pack<P, VEC>* at(int p, int it) const {
    return base + (p * ITEMS + it) * int(blockDim.x) + int(threadIdx.x);
  }
};

// A block works on `row_iters` consecutive groups of `rows_per_block` rows; `tpr` threads own
// a row, each holding ITEMS vectors of it in registers (as stored, 16-bit values packed two to
// a register). A thread covers the same columns in every row, so a small operand whose row
// pointer does not change from one row to the next (weight, bias, per-sample modulation) is
// copied to its slots once per block, not once per row.
// With ITEMS <= 2 (rows of few vectors per thread's share, or few rows: the short critical path
// matters more than bytes in flight) the small operands are held in registers (PARAMS kHeld).
// NORM: what normalizes the row; RES: a branch (and optional gate) is added first and the sum
// written out; MOD: scale and/or shift modulate the normalized row. P: dtype of every small
// operand present. SPLIT: gate, scale and shift come as a [D] table (a small operand, P) plus a
// per-row part (T), added where the term is used. WALK: how the rows' operands are found
// (RowWalk); with kSamples, a.rows counts the rows of one sample and blockIdx.y is the sample.
// KNOWN: the small operands known present (see kKnownPlan for the plans that have such twins); the
// affine, or the modulation, then folds into the normalization's multiply. Static SASS (cuobjdump, sm_90): the
// bf16 LayerNorm flat kernel 468 -> 415 instructions, LTX's per-sample AdaLN kernel 1409 -> 882,
// gated_residual_norm's 2-vector kernel 673 -> 436. H200 side by side (bench/results/
// 2026-11-29_h200_81e431d/tune/, two columns each): kAffine (l8_la_*.txt) LayerNorm LTX
// 16.54-16.56 -> 15.62-15.73 us bf16, 17.50-17.54 -> 15.63-15.68 fp16; FLUX 20.3 -> 19.2-19.3 bf16,
// 21.3 -> 19.3 fp16; rms_norm 2048x2048 8.50-8.58 -> 8.19 bf16. kModulation (la_ld_bf16.txt):
// per-sample AdaLN LTX 17.30-17.44 -> 16.22-16.37, FLUX 22.05-22.29 -> 19.65-19.76, Wan 14B
// 180.4-180.5 -> 166.3-166.9; gated_residual_norm FLUX 33.6 -> 31.8, LTX 26.3 -> 25.3-25.4.
template <typename T, typename P, int VEC, int ITEMS, NormType NORM, bool RES, bool MOD, ParamPath PARAMS,
          bool SPLIT, RowWalk WALK, Known KNOWN>
__device__ __forceinline__ void norm_rows(const NormKernelArgs& a) {
  static_assert((ITEMS <= 2) == (PARAMS == ParamPath::kHeld),
                "registers hold the operands of the 1-2 vector plans only");
  static_assert(WALK == RowWalk::kSplit || ITEMS <= 4, "the 8-vector plans have no twin (has_twin)");
  constexpr bool kAffine = KNOWN == Known::kAffine, kModulation = KNOWN == Known::kModulation;
  static_assert(!kAffine || (PARAMS == ParamPath::kHeld && !RES && !MOD && NORM != NormType::kNone),
                "the affine twins are of the plain norm rows on the held plans");
  static_assert(!kModulation || (MOD && NORM != NormType::kNone), "the modulation twins: see kKnownPlan");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [iteration parity][reduction]: one float per warp for each of a row's (at most two) sums;
  // by parity since a fast thread may start the next row's reduction while a slow one still
  // reads this row's partial sums.
  __shared__ float scratch[2][2][kMaxThreads / 32];
  const int tpr = a.tpr;
  const int r = a.rows_per_block == 1 ? 0 : int(threadIdx.x) >> a.tpr_log2;
  const int lane = threadIdx.x - r * tpr;
  const ParamSlots<P, VEC, ITEMS> slots{reinterpret_cast<Pack<P, VEC>*>(smem_raw)};
  // row pointer of each operand's slot contents
  const P *gate_in = nullptr, *weight_in = nullptr, *bias_in = nullptr, *scale_in = nullptr, *shift_in = nullptr;
  // Row numbers stay below 2^31 (the launcher checks), so row arithmetic is 32-bit.
  // One group per block with few vectors per thread: a compile-time trip count keeps the loop
  // and its bookkeeping off the path of short (decode-sized) calls.
  const int row_iters = ITEMS <= 2 ? 1 : a.row_iters;
  const uint32_t first_group = blockIdx.x * uint32_t(row_iters);
  const uint32_t rows = uint32_t(a.rows);
  // Groups load in turn: loading the next one while this one is worked on would double the row
  // registers, and the occupancy that costs outweighs the overlap it buys (measured); the
  // other resident blocks keep loads in flight.
  Pack<T, VEC> h[ITEMS], b[RES ? ITEMS : 1];
  // LayerNorm moments in one row sum (see there; one barrier instead of two) for 16-bit rows
  // without a residual and with at most 4 vectors per thread: the per-sample adaln rows gain 5%
  // (Wan 14B 194.1 -> 183.9 us, FLUX 23.7 -> 22.5). fp32 outputs keep two row sums: they would
  // show the one-sum cancellation (up to 1e-4 of rstd). So do residual rows: ptxas gives the
  // staged ones 10 more registers with one sum (FLUX's gated_residual_norm 84 -> 94, 38.6 ->
  // 42.3 us), and the others gained 0-2%.
  constexpr bool kOnePassMoments = NORM == NormType::kLayer && sizeof(T) == 2 && !RES && ITEMS <= 4;
  float pivot = 0.f;  // kOnePassMoments: the row's first element
  pdl_wait();

  for (int k = 0; k < row_iters; ++k) {
    const uint32_t group_row = (first_group + k) * uint32_t(a.rows_per_block);
    if (group_row >= rows) break;  // uniform over the block
    const uint32_t row = group_row + r;
    const bool active = row < rows;
    int64_t i0 = 0, i1 = 0, i2 = 0;
    if constexpr (WALK == RowWalk::kFlat) {
      i2 = row;
    } else if constexpr (WALK == RowWalk::kSamples) {
      i1 = blockIdx.y;
      i2 = row;
    } else if (active) {
      a.index.split(row, i0, i1, i2);
    }
    // Output rows. With few vectors per thread they are addressed before the loads, so that
    // the arithmetic overlaps the loads' latency instead of following the reduction; with more,
    // at their use (registers are what bounds those plans).
    void* const early_out = ITEMS <= 2 && NORM != NormType::kNone
                                ? at<void>(a.out, i0, i1, i2, a.out_f32 ? sizeof(float) : sizeof(T))
                                : nullptr;
    T* const early_residual = ITEMS <= 2 && RES ? at<T>(a.residual_out, i0, i1, i2, sizeof(T)) : nullptr;
    {  // this thread's share of the row (zeros where there is none)
      const T* x = at<const T>(a.x, i0, i1, i2, sizeof(T));
      const T* branch = RES ? at<const T>(a.branch, i0, i1, i2, sizeof(T)) : nullptr;
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int vi = lane + it * tpr;
        h[it] = Pack<T, VEC>{};  // zero bits: 0.0 in every dtype (padding adds nothing)
        if (active && vi < a.vec_per_row) {
          h[it] = load_pack<T, VEC>(x + vi * VEC);
          if constexpr (RES) b[it] = load_pack<T, VEC>(branch + vi * VEC);
        }
      }
    }
    // The small operands present, numbered in slot order (-1: absent). With split modulation,
    // gate, scale and shift are their tables (the same for every row) and their per-row parts
    // follow.
    auto small = [&](const RowOperandArg& term, const ParamPtr& table) -> const P* {
      if (!term.ptr) return nullptr;
      return SPLIT ? static_cast<const P*>(table.ptr) : at<const P>(term, i0, i1, i2, sizeof(P));
    };
    const P* gate = RES ? small(a.gate, a.gate_table) : nullptr;
    const P* weight = NORM != NormType::kNone && !kModulation ? static_cast<const P*>(a.weight.ptr) : nullptr;
    const P* bias = NORM != NormType::kNone && !kModulation && !(kAffine && NORM == NormType::kRMS)
                        ? static_cast<const P*>(a.bias.ptr)
                        : nullptr;
    const P* scale = MOD ? small(a.scale, a.scale_table) : nullptr;
    const P* shift = MOD ? small(a.shift, a.shift_table) : nullptr;
    auto row_part = [&](bool present, const RowOperandArg& term) -> const T* {
      return SPLIT && present && term.ptr ? at<const T>(term, i0, i1, i2, sizeof(T)) : nullptr;
    };
    const T* const parts[3] = {row_part(RES, a.gate), row_part(MOD, a.scale), row_part(MOD, a.shift)};
    if constexpr (kOnePassMoments) {  // the row's first element, which every thread reads itself
      if (active) pivot = load_scalar(at<const T>(a.x, i0, i1, i2, sizeof(T)));
    }
    // (compile-time with KNOWN: kAffine has no gate, kModulation no weight or bias)
    const int gate_slot = kModulation ? (RES ? 0 : -1) : gate ? 0 : -1;
    const int weight_slot = kAffine ? 0 : kModulation ? -1 : weight ? int(gate != nullptr) : -1;
    const int bias_slot = kAffine        ? (NORM == NormType::kLayer ? 1 : -1)
                          : kModulation ? -1
                          : bias        ? int(gate != nullptr) + int(weight != nullptr)
                                        : -1;
    const int scale_slot = kModulation ? int(RES)
                           : scale     ? int(gate != nullptr) + int(weight != nullptr) + int(bias != nullptr)
                                       : -1;
    const int shift_slot =
        kModulation ? int(RES) + 1
        : shift     ? int(gate != nullptr) + int(weight != nullptr) + int(bias != nullptr) + int(scale != nullptr)
                    : -1;
    // Presence by slot where KNOWN makes it a constant; the general kernels keep their pointer
    // checks (the same test, but their SASS stays that of the measured kernels).
    const int slot_of[5] = {gate_slot, weight_slot, bias_slot, scale_slot, shift_slot};
    auto stage = [&](int slot, const P* src, const P*& in_slot) {  // unless already there
      if (PARAMS != ParamPath::kStaged || (KNOWN == Known::kNone ? src == nullptr : slot < 0) || !active ||
          in_slot == src)
        return;
      in_slot = src;
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int vi = lane + it * tpr;
        if (vi < a.vec_per_row) async_copy_pack(slots.at(slot, it), src + vi * VEC);
      }
    };
    // ITEMS <= 2: the operands' vectors, in the order gate, weight, bias, scale, shift.
    constexpr bool kHeldParams = PARAMS == ParamPath::kHeld;
    Pack<P, VEC> held[kHeldParams ? 5 : 1][kHeldParams ? ITEMS : 1];
    // Operands read at their use instead (L1 hits: the same rows for every row), so that no
    // registers wait for them: split tables, whose registers go to the per-row parts (Wan 1.3B's
    // per-token rows: 128 registers and 72 bytes of spills when held), and the weight and bias
    // of residual + modulated rows, whose presence is a run-time fact there (gated_residual_norm
    // mostly has neither, yet held they kept 16 registers: ptxas 13.0, 16-bit rows, 77-88 -> 60-64).
    // Modulated rows without a residual keep them held: read at their use (63-64 -> 47-59
    // registers, still eight 128-thread blocks an SM) LTX's per-token AdaLN ran 0.1-0.3 us slower
    // (bench/results/2026-11-29_h200_97c6628/tune/l0_l6_l7_*.txt; held again, l6_l8_bf16.txt:
    // 24.56-24.83 -> 24.35-24.43 us).
    auto at_use = [](int which) {
      return SPLIT ? which != 1 && which != 2 : RES && MOD && (which == 1 || which == 2);
    };
    // SPLIT with ITEMS <= 2: the per-row parts of gate, scale and shift, loaded with the row
    Pack<T, VEC> held_parts[kHeldParams && SPLIT ? 3 : 1][kHeldParams && SPLIT ? ITEMS : 1];
    if constexpr (kHeldParams) {
      const P* srcs[5] = {gate, weight, bias, scale, shift};
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int vi = lane + it * tpr;
        if (active && vi < a.vec_per_row) {
#pragma unroll
          for (int i = 0; i < 5; ++i) {
            const bool present = KNOWN == Known::kNone ? srcs[i] != nullptr : slot_of[i] >= 0;
            if (present && !at_use(i)) held[i][it] = load_pack<P, VEC>(srcs[i] + vi * VEC);
          }
          if constexpr (SPLIT) {
#pragma unroll
            for (int i = 0; i < 3; ++i)
              if (parts[i]) held_parts[i][it] = load_pack<T, VEC>(parts[i] + vi * VEC);
          }
        }
      }
    } else {
      stage(gate_slot, gate, gate_in);
      stage(weight_slot, weight, weight_in);
      stage(bias_slot, bias, bias_in);
      stage(scale_slot, scale, scale_in);
      stage(shift_slot, shift, shift_in);
    }
    if (k == 0) pdl_release();
    if constexpr (PARAMS == ParamPath::kStaged) async_copy_wait();  // only this thread's copies: its own slots
    // Item `it` of small operand `which` (0-4 as in `held`): from a register, its slot, or
    // straight from global memory (cached).
    auto param = [&](int which, int slot, const P* src, int it) {
      if (kHeldParams && !at_use(which)) return held[which][it];
      if constexpr (PARAMS == ParamPath::kStaged) return *slots.at(slot, it);
      return load_pack<P, VEC>(src + (lane + it * tpr) * VEC);
    };
    // SPLIT: adds item `it` of the per-row part of term `which` (0 gate, 1 scale, 2 shift) to its
    // table's values; registers hold it on the short plans, the others read it at its use.
    auto add_row_part = [&](int which, int it, float (&v)[VEC]) {
      if constexpr (SPLIT) {
        float q[VEC];
        if constexpr (kHeldParams)
          unpack(held_parts[which][it], q);
        else
          unpack(load_pack<T, VEC>(parts[which] + (lane + it * tpr) * VEC), q);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] += q[i];
      }
    };

    if constexpr (RES) {
      // h = x + gate * branch, rounded to T as the unfused model materializes it.
      T* res = ITEMS <= 2 ? early_residual : at<T>(a.residual_out, i0, i1, i2, sizeof(T));
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int vi = lane + it * tpr;
        if (active && vi < a.vec_per_row) {
          float xv[VEC], bv[VEC];
          unpack(h[it], xv);
          unpack(b[it], bv);
          if (gate_slot >= 0) {
            float gv[VEC];
            unpack(param(0, gate_slot, gate, it), gv);
            add_row_part(0, it, gv);
#pragma unroll
            for (int i = 0; i < VEC; ++i) bv[i] *= gv[i];
          }
#pragma unroll
          for (int i = 0; i < VEC; ++i) xv[i] += bv[i];
          h[it] = pack<T, VEC>(xv);
          store_pack(res + vi * VEC, h[it]);
        }
      }
    }
    if constexpr (NORM != NormType::kNone) {
      // A row sum over D as a moment: a multiply by 1 / D on the short plans; the longer plans
      // keep the division, whose code the compiler allocates fewer registers around there
      // (a multiply took LTX's 4-vector adaln from 64 to 84 registers, 18.2 -> 20.6 us).
      auto moment = [&](float row_total) {
        return ITEMS <= 2 ? row_total * a.inv_width : row_total / float(a.width);
      };
      float mean = 0.f, var;
      if constexpr (kOnePassMoments) {
        // One row sum of two values, the deviations from a pivot and their squares (one barrier
        // where the mean and then the squared deviations from it took two): mean = pivot + E[d],
        // var = E[d^2] - E[d]^2. The pivot, the row's first element, bounds the cancellation:
        // (mean - pivot)^2 <= (D - 1) var for any element of a row, so the variance keeps a
        // relative error under about D * 2^-23 (4096: 5e-4, with a 1000-sigma first element
        // about 1e-4 of rstd), under the 16-bit output's rounding; typical rows, a few 2^-23.
        // Padding holds zeros, not samples: skipped.
        float sums[2] = {0.f, 0.f};
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          if (lane + it * tpr < a.vec_per_row) {
            float v[VEC];
            unpack(h[it], v);
            float s = 0.f, q = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              const float d = v[i] - pivot;
              s += d;
              q = fmaf(d, d, q);
            }
            sums[0] += s;
            sums[1] += q;
          }
        }
        row_sums(sums, tpr, scratch[k & 1][0], kMaxThreads / 32);
        const float mean_d = moment(sums[0]);
        mean = pivot + mean_d;
        var = fmaxf(moment(sums[1]) - mean_d * mean_d, 0.f);
      } else if constexpr (NORM == NormType::kLayer) {
        // Two row sums: the mean, then the squared deviations from it.
        float sum = 0.f, m2 = 0.f;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          float v[VEC];
          unpack(h[it], v);  // padding holds zeros: adds nothing
#pragma unroll
          for (int i = 0; i < VEC; ++i) sum += v[i];
        }
        mean = moment(row_sum(sum, tpr, scratch[k & 1][0]));
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          if (lane + it * tpr < a.vec_per_row) {  // padding holds zeros, not samples
            float v[VEC];
            unpack(h[it], v);
#pragma unroll
            for (int i = 0; i < VEC; ++i) m2 += (v[i] - mean) * (v[i] - mean);
          }
        }
        var = moment(row_sum(m2, tpr, scratch[k & 1][1]));
      } else {
        float acc = 0.f;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          float v[VEC];
          unpack(h[it], v);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc += v[i] * v[i];
        }
        var = moment(row_sum(acc, tpr, scratch[k & 1][0]));
      }
      const float rstd = rsqrtf(var + a.eps);
      const float offset_rstd = a.weight_offset * rstd;  // kAffine: (offset + w) * rstd = fma(w, rstd, this)
      if (active) {
        void* out = ITEMS <= 2 ? early_out : at<void>(a.out, i0, i1, i2, a.out_f32 ? sizeof(float) : sizeof(T));
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          const int vi = lane + it * tpr;
          if (vi < a.vec_per_row) {
            const int col = vi * VEC;
            float v[VEC], p[VEC];
            unpack(h[it], v);
            if constexpr (kAffine) {
              // (v - mean) * rstd * (offset + w) + b as (v - mean) * fma(w, rstd, offset * rstd) + b:
              // three instructions an element where the general form takes five (RMS: two, three).
              float w[VEC];
              unpack(param(1, weight_slot, weight, it), w);
              if constexpr (NORM == NormType::kLayer) unpack(param(2, bias_slot, bias, it), p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) {
                const float factor = fmaf(w[i], rstd, offset_rstd);
                v[i] = NORM == NormType::kLayer ? fmaf(v[i] - mean, factor, p[i]) : v[i] * factor;
              }
            } else if constexpr (kModulation) {
              // (v - mean) * rstd * (1 + scale) + shift as (v - mean) * fma(scale, rstd, rstd) + shift:
              // three instructions an element where the general form takes four (RMS: two, three)
              float scale_v[VEC];
              unpack(param(3, scale_slot, scale, it), scale_v);
              add_row_part(1, it, scale_v);
              unpack(param(4, shift_slot, shift, it), p);
              add_row_part(2, it, p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] = fmaf(v[i] - mean, fmaf(scale_v[i], rstd, rstd), p[i]);
            } else {
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] = (v[i] - mean) * rstd;
            }
            if (KNOWN == Known::kNone && weight_slot >= 0) {
              unpack(param(1, weight_slot, weight, it), p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] *= a.weight_offset + p[i];
            }
            if (KNOWN == Known::kNone && bias_slot >= 0) {
              unpack(param(2, bias_slot, bias, it), p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] += p[i];
            }
            if (KNOWN == Known::kNone && scale_slot >= 0) {
              unpack(param(3, scale_slot, scale, it), p);
              add_row_part(1, it, p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] = fmaf(v[i], p[i], v[i]);  // y * (1 + scale) in one instruction
            }
            if (KNOWN == Known::kNone && shift_slot >= 0) {
              unpack(param(4, shift_slot, shift, it), p);
              add_row_part(2, it, p);
#pragma unroll
              for (int i = 0; i < VEC; ++i) v[i] += p[i];
            }
            if (a.out_f32)
              store_pack(static_cast<float*>(out) + col, pack<float, VEC>(v));
            else
              store_pack(static_cast<T*>(out) + col, pack<T, VEC>(v));
          }
        }
      }
    }
  }
}

// MIN_BLOCKS: blocks of kMaxThreads an SM that the registers must leave room for (0 states
// none; see register_bound for the plans that take one). The bound reaches the compiler's
// scheduling, not only the register allocator, where a bare register cap (__maxnreg__) spills.
template <int MIN_BLOCKS, typename T, typename P, int VEC, int ITEMS, NormType NORM, bool RES, bool MOD,
          ParamPath PARAMS, bool SPLIT, RowWalk WALK, Known KNOWN>
__global__ void __launch_bounds__(kMaxThreads, MIN_BLOCKS) norm_rows_kernel(const NormKernelArgs a) {
  norm_rows<T, P, VEC, ITEMS, NORM, RES, MOD, PARAMS, SPLIT, WALK, KNOWN>(a);
}

// The register bound of a plan (MIN_BLOCKS above), for those whose allocation falls past an
// occupancy step (ptxas 13.0, sm_90):
// - 2 (64 registers) for the 4-vector modulated rows without a residual: fp16 92-100 -> 64
//   registers, bf16 stays at 64 and loses its 8-20 bytes of spills, no spills anywhere (a bare
//   __maxnreg__(64) spills 60-84 bytes). H100, fp16: per-sample adaln LTX 23.6 -> 20.2 us, Wan 14B
//   267.6 -> 234.0; bf16 unchanged to 2.6% faster (bench/results/2026-11-25_h100_bafa32a/tune).
// - 3 (40 registers) for the fp16 variants that ptxas otherwise gives 7-10 registers more than
//   bf16's, one block an SM fewer: the 2-vector rows of a norm alone or of a residual add alone
//   (48-50 -> 40), and for bf16's 2-vector LayerNorm rows (43 -> 40); 16-bit operands, no
//   spills. Side by side on the H200 ([h100_18a1a3d] tune/norm_bound_h200_*): fp16 rms_norm
//   [4x4096x3072] without a weight 54.5-54.8 -> 51.4-51.7 us (bf16: 51.2), [2x4096x3072]
//   29.2-29.6 -> 27.6-27.8, 32768x2048 70.9-71.3 -> 67.6-67.7, LayerNorm ltx-long 42.4-42.6 ->
//   40.9-41.1 (bf16 42.1-42.5 -> 40.4); on the H100, whose bandwidth needs fewer loads in
//   flight, about 1% either way. Where bf16 already holds 40 the bound only moves its schedule
//   (its 1-vector residual + norm rows then ran 0.1-0.2 us slower on the H100), and fp16's
//   1-vector residual + norm rows (48 -> 40) ran 0.1-0.2 us slower on the H200 (faster on the
//   H100): those keep none.
// - on the twins (flat or sample walk) of 4-vector rows: 3 (40 registers) for a LayerNorm alone
//   (56-62 -> 40, no spills), 2 (64) for a residual + modulated norm with fp32 operands (78-85 ->
//   64, up to 12 bytes of spills; measured on the flat twins). Side by side on the H200
//   (bench/results/2026-11-26_h200_b738d93/tune/norm_bound_flat4.txt, two columns each): LayerNorm
//   Wan 1.3B 61.3-61.5 -> 57.6-57.7 us bf16 (fp16 60.6 -> 57.1-57.3), Wan 14B 179.2-179.7 -> 166.7
//   (fp16 177.2-177.4 -> 166.2-166.4); gated_residual_norm Wan 1.3B 109.9-110.0 -> 105.0-105.1
//   (fp16 104.4 -> 103.6-103.8). The RMS rows alone lost with 40 (16 bytes of spills; rms_norm
//   2048x4096 12.6-12.7 -> 13.3) and keep none.
// - the 3-vector rows (see pick_items) as the 4-vector ones, but their modulated LayerNorm twins
//   without a residual, whose fp32 operands are read at their use, take 40 registers (62 -> 40,
//   4-8 bytes of spills): side by side on the H200 (bench/results/2026-11-27_h200_c706e6a/tune/
//   items3_bound_*.txt) per-sample adaln Wan 1.3B 61.3 -> 57.2-57.3 us bf16, 60.1-60.6 -> 56.4-56.9
//   fp16, where 3 vectors under 64 registers gained 1.6% (items3_*.txt). The RMS ones (8-28 bytes
//   of spills at 40) ran 56.0-64.5 us from one process to the next against 58.2-60.4 with 4
//   vectors (2026-11-27_h200_b170d5f/tune/rms1536.txt) and keep 64.
// - 2 (64 registers) for every modulation twin of 3-4 vectors (kKnownPlan): the 3-vector ones
//   without a residual then take 48-64 (no spills; the general ones on the flat and sample walks
//   40 + 4 bytes of spills; Wan 1.3B's per-sample AdaLN within 0.3 us either way), the residual
//   ones 62-64 (no spills on the flat and sample walks, up to 16 bytes on the general split).
template <typename T, typename P, int ITEMS, NormType NORM, bool RES, bool MOD, ParamPath PARAMS, RowWalk WALK,
          Known KNOWN>
constexpr int register_bound() {
  constexpr bool kTwin = WALK != RowWalk::kSplit;
  constexpr bool kFour = ITEMS == 3 || ITEMS == 4;
  if constexpr (KNOWN == Known::kModulation && kFour) return 2;
  if constexpr (kTwin && ITEMS == 3 && MOD && !RES && NORM == NormType::kLayer && PARAMS == ParamPath::kGlobal)
    return 3;
  if constexpr (kTwin && kFour && !RES && !MOD && NORM == NormType::kLayer) return 3;
  if constexpr (kTwin && kFour && RES && MOD && std::is_same_v<P, float>) return 2;
  if constexpr (kFour && MOD && !RES) return 2;
  if constexpr (std::is_same_v<P, T> && !MOD) {
    constexpr bool kNormAlone2 = ITEMS == 2 && !RES, kAddAlone2 = ITEMS == 2 && RES && NORM == NormType::kNone;
    if constexpr (std::is_same_v<T, __half> && (kNormAlone2 || kAddAlone2)) return 3;
    if constexpr (std::is_same_v<T, __nv_bfloat16> && kNormAlone2 && NORM == NormType::kLayer) return 3;
  }
  return 0;
}

// Whether a plan has a twin for a walk other than the general split (WALK in norm_rows):
// - kFlat: the 1-4 vector plans without split modulation, except the 2-vector rows of an RMS
//   norm alone, whose flat twin, bounded to the row-group twin's 40 registers (ptxas gives it 55
//   unbounded, not timed), ran 9-11% slower at 67-268 MB on an H100 (not explained);
// - kSamples: those of them with modulation, and the gated residual add alone, whose per-sample
//   rows (a batch of several samples, as classifier-free guidance makes) are two row groups; a
//   flat walk over the same bytes ran 0.4-2.1 us faster than the general split (bench/results/
//   2026-11-26_h200_32e241e/tune/sample_split_cost.txt).
template <RowWalk WALK, int ITEMS, NormType NORM, bool RES, bool MOD, bool SPLIT>
constexpr bool has_twin() {
  constexpr bool kFlat = ITEMS == 1 || (ITEMS == 2 && !(NORM == NormType::kRMS && !RES && !MOD)) ||
                         ((ITEMS == 3 || ITEMS == 4) && !SPLIT);
  if constexpr (WALK == RowWalk::kFlat) return kFlat;
  if constexpr (WALK == RowWalk::kSamples) return kFlat && (MOD || (RES && NORM == NormType::kNone)) && !SPLIT;
  return true;
}

// ---------------------------------------------------------------- short rows

// Arguments of short_rows_kernel, the fields its path reads first, first (a kernel's arguments
// start at byte 16 of a 64-byte line of the constant bank): one line, two with a residual or a
// LayerNorm's bias.
struct ShortRowArgs {
  const void* x;
  void* out;
  const void* weight;             // [D] of the rows' dtype, or null
  uint32_t x_stride, out_stride;  // elements between rows (below 2^31)
  float eps, inv_width, weight_offset;
  int vec_per_row;
  // residual rows
  const void* branch;
  void* residual_out;
  uint32_t branch_stride, residual_stride;
  const void* bias;  // LayerNorm: [D] of the rows' dtype, or null
};
static_assert(offsetof(ShortRowArgs, branch) == 48, "the plain rows' arguments fill the first line");

// Rows of a plain RMS norm (fused_add_rms_norm's residual add first, with RES) or of a plain
// 16-bit LayerNorm, one vector per thread, one row per block of blockDim.x threads (a multiple
// of 32, 128 or more): the decode-sized rms_norm, fused_add_rms_norm and layer_norm calls, whose
// time is the path from the launch through the loads and the row sum to the stores. The general
// one-vector plan reads arguments from four or five lines of the constant bank, a stall at the
// first read of each (Nsight Compute put 10-16 warp samples on each: [h200_5e77ff2] ncu), and
// sets up its row in 40 instructions before the first load; this kernel loads at instruction 20.
// H200, side by side with the general plan (bench/results/2026-11-27_h200_54a975c/tune/
// decode_short_rows.txt, four alternating processes): 0.1-0.35 us faster warm, 0.05-0.3 flushed,
// level with Liger's kernels (rms_norm 16x4096 warm 4.10-4.13 -> 3.78-3.90 us, Liger 3.78-3.90).
// The LayerNorm takes its moments in one row sum, as the general rows do (see kOnePassMoments),
// and loads its weight and bias with the row: H200, side by side against reading them after the
// sum and against the general plan (bench/results/2026-11-29_h200_215452d/tune/), 1x2560 4.51 ->
// 4.19-4.42 us (general 4.46-4.64), 16x2560 4.67-4.70 -> 4.58-4.66 (4.78-4.80).
template <typename T, bool RES, NormType NORM>
__global__ void __launch_bounds__(kMaxThreads) short_rows_kernel(const ShortRowArgs a) {
  constexpr bool kLayer = NORM == NormType::kLayer;
  static_assert(NORM == NormType::kRMS || (kLayer && !RES && sizeof(T) == 2),
                "RMS rows, or 16-bit LayerNorm rows without a residual (one-sum moments)");
  constexpr int VEC = 16 / int(sizeof(T));
  __shared__ float scratch[kLayer ? 2 : 1][kMaxThreads / 32];
  const int vi = int(threadIdx.x);
  const bool active = vi < a.vec_per_row;
  const uint64_t row = blockIdx.x;
  const int col = vi * VEC;
  pdl_wait();
  Pack<T, VEC> h{}, b{}, w{}, bias{};
  float pivot = 0.f;  // kLayer: the row's first element, which every thread reads itself
  if (active) {
    h = load_pack<T, VEC>(static_cast<const T*>(a.x) + row * a.x_stride + col);
    if constexpr (RES) b = load_pack<T, VEC>(static_cast<const T*>(a.branch) + row * a.branch_stride + col);
    if constexpr (kLayer) {
      pivot = load_scalar(static_cast<const T*>(a.x) + row * a.x_stride);
      if (a.weight) w = load_pack<T, VEC>(static_cast<const T*>(a.weight) + col);
      if (a.bias) bias = load_pack<T, VEC>(static_cast<const T*>(a.bias) + col);
    }
  }
  pdl_release();
  float v[VEC];
  unpack(h, v);
  if constexpr (RES) {
    float bv[VEC];
    unpack(b, bv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] += bv[i];
    h = pack<T, VEC>(v);  // rounded to T, as the unfused model materializes the sum
    unpack(h, v);
    if (active) store_pack(static_cast<T*>(a.residual_out) + row * a.residual_stride + col, h);
  }
  float sums[kLayer ? 2 : 1] = {};
  if constexpr (kLayer) {
    if (active) {  // the deviations from the pivot and their squares; threads past the row add nothing
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = v[i] - pivot;
        sums[0] += d;
        sums[1] = fmaf(d, d, sums[1]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) sums[0] += v[i] * v[i];
  }
  // The RMS rows' weight (the same lines for every block) is read once the row's own lines have
  // come, its latency hidden by the row sum: 0.06 us faster (median of 33 pairs, 21 of them faster) than
  // with the data, 0.13 slower after the sum ([h200_4f8bf14] tune/short_rows_weight_late.txt).
  if (!kLayer && active && a.weight) w = load_pack<T, VEC>(static_cast<const T*>(a.weight) + col);
  row_sums(sums, int(blockDim.x), &scratch[0][0], kMaxThreads / 32);
  const float moment = sums[0] * a.inv_width;  // RMS: E[x^2]; LayerNorm: E[x - pivot]
  float mean = 0.f, var = moment;
  if constexpr (kLayer) {
    mean = pivot + moment;
    var = fmaxf(sums[1] * a.inv_width - moment * moment, 0.f);
  }
  const float rstd = rsqrtf(var + a.eps);
  if (!active) return;
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = kLayer ? (v[i] - mean) * rstd : v[i] * rstd;
  if (a.weight) {
    float wv[VEC];
    unpack(w, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] *= a.weight_offset + wv[i];
  }
  if (kLayer && a.bias) {
    float bv[VEC];
    unpack(bias, bv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] += bv[i];
  }
  store_pack(static_cast<T*>(a.out) + row * a.out_stride + col, pack<T, VEC>(v));
}

// ---------------------------------------------------------------- streaming path

// A modulation term's values at `col`: its row's, plus its table's under split modulation.
template <typename T, int VEC>
__device__ __forceinline__ void load_term(const ParamPtr& term, const ParamPtr& table, int col, float (&v)[VEC]) {
  load_param<T, VEC>(term, col, v);
  if (table.ptr == nullptr) return;
  float t[VEC];
  load_param<T, VEC>(table, col, t);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] += t[i];
}

template <typename T, int VEC>
__device__ __forceinline__ void load_input(const NormKernelArgs& a, const T* x, const T* branch,
                                           const ParamPtr& gate, int col, float (&h)[VEC]) {
  VecIO<T, VEC>::load(x + col, h);
  if (branch == nullptr) return;
  float b[VEC];
  VecIO<T, VEC>::load(branch + col, b);
  if (gate.ptr != nullptr) {
    float g[VEC];
    load_term<T, VEC>(gate, a.gate_table, col, g);
#pragma unroll
    for (int i = 0; i < VEC; ++i) b[i] *= g[i];
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) h[i] = round_to<T>(h[i] + b[i]);
}

// One block per row; every operand's dtype and presence is read at run time.
template <typename T, int VEC>
__global__ void __launch_bounds__(kStreamThreads) norm_stream_kernel(const NormKernelArgs a) {
  __shared__ float scratch[2][kStreamThreads / 32];
  const int64_t row = blockIdx.x;
  int64_t i0, i1, i2;
  a.index.split(row, i0, i1, i2);
  const T* x = at<const T>(a.x, i0, i1, i2, sizeof(T));
  const T* branch = a.branch.ptr ? at<const T>(a.branch, i0, i1, i2, sizeof(T)) : nullptr;
  T* res = a.branch.ptr ? at<T>(a.residual_out, i0, i1, i2, sizeof(T)) : nullptr;
  auto param = [&](const RowOperandArg& o, bool f32) {
    return ParamPtr{o.ptr ? at<const char>(o, i0, i1, i2, f32 ? 4 : sizeof(T)) : nullptr, f32};
  };
  const ParamPtr gate = param(a.gate, a.gate_f32), scale = param(a.scale, a.scale_f32),
                 shift = param(a.shift, a.shift_f32);
  pdl_wait();
  pdl_release();

  float acc = 0.f;
  for (int vi = threadIdx.x; vi < a.vec_per_row; vi += blockDim.x) {
    float h[VEC];
    load_input<T, VEC>(a, x, branch, gate, vi * VEC, h);
    if (res) VecIO<T, VEC>::store(res + vi * VEC, h);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc += a.norm == NormType::kLayer ? h[i] : h[i] * h[i];
  }
  if (a.norm == NormType::kNone) return;
  // (computed here rather than read from a.inv_width, which took the bf16 8-wide variant from
  // 38 to 55 registers under ptxas 13.0)
  const float inv_width = 1.f / float(a.width);
  float mean = 0.f;
  if (a.norm == NormType::kLayer) {
    mean = row_sum(acc, blockDim.x, scratch[0]) * inv_width;
    acc = 0.f;
    for (int vi = threadIdx.x; vi < a.vec_per_row; vi += blockDim.x) {
      float h[VEC];
      load_input<T, VEC>(a, x, branch, gate, vi * VEC, h);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc += (h[i] - mean) * (h[i] - mean);
    }
  }
  const float rstd = rsqrtf(row_sum(acc, blockDim.x, scratch[1]) * inv_width + a.eps);
  void* out = at<void>(a.out, i0, i1, i2, a.out_f32 ? sizeof(float) : sizeof(T));
  for (int vi = threadIdx.x; vi < a.vec_per_row; vi += blockDim.x) {
    const int col = vi * VEC;
    float v[VEC], p[VEC];
    load_input<T, VEC>(a, x, branch, gate, col, v);
    if (a.weight.ptr) {
      load_param<T, VEC>(a.weight, col, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = (v[i] - mean) * rstd * (a.weight_offset + p[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = (v[i] - mean) * rstd;
    }
    if (a.bias.ptr) {
      load_param<T, VEC>(a.bias, col, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] += p[i];
    }
    if (scale.ptr) {
      load_term<T, VEC>(scale, a.scale_table, col, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] *= 1.f + p[i];
    }
    if (shift.ptr) {
      load_term<T, VEC>(shift, a.shift_table, col, p);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] += p[i];
    }
    if (a.out_f32)
      VecIO<float, VEC>::store(static_cast<float*>(out) + col, v);
    else
      VecIO<T, VEC>::store(static_cast<T*>(out) + col, v);
  }
}

// ---------------------------------------------------------------- launch plan

// What the launch plan depends on, besides the row count and width.
struct RowOpTraits {
  bool normalizes;       // RMS or Layer (not a residual add alone)
  bool residual;         // a branch is added first
  bool plain_residual;   // ... without a gate or modulation (fused_add_rms_norm)
  bool modulated;        // scale and/or shift
  bool per_row_operand;  // a gate or modulation that changes from row to row (per token)
  bool small_operands;   // any of weight, bias, gate, scale, shift present
  bool f32_operands;     // ... in fp32
  bool layer_norm;       // the norm is LayerNorm
  bool sixteen_bit_rows;  // x is fp16 or bf16
  bool short_rows;        // short_rows_kernel can take them at one vector a thread
};

int threads_per_row(int64_t vec_per_row, int items) {
  const int64_t need = (vec_per_row + items - 1) / items;
  if (need <= 32) return next_pow2(need);
  return int((need + 31) / 32 * 32);
}

// Vectors per thread on the register path (0: streaming path). H200 figures; "2026-11-25"
// is bench/results/2026-11-25_h200_05f87b3/tune/norm_*.
// - a gated residual without a norm (unless launch_flat_add takes it; nothing to reduce, so
//   nothing for staging to hide): 1 vector
//   per thread up to 512 vectors a row, else 2, with the gate in registers (2026-11-25: LTX
//   19.78 -> 19.44 us, FLUX 23.92 -> 23.60, Wan 1.3B 74.72 -> 73.12 with 1; Wan 14B's
//   640-vector rows 236.5 -> 231.1 with 2).
// - 1 when one vector per thread needs at most half the GPU's resident threads (decode and
//   other small calls): the shortest path from the row's loads to its stores, which is what
//   bounds a call of one wave. Plain RMS and 16-bit LayerNorm rows of this plan take short_rows_kernel.
// - 2 for a norm without a residual, modulation or any small operand (RMSNorm with no weight)
//   of rows up to 512 vectors: nothing to stage, and the short plan is leaner than 4 vectors
//   (2026-11-25, every such case 2-8% faster: LTX 15.02 -> 14.51 us, [4x4096x3072] 52.22 ->
//   51.23, [1x1024x2048] 6.62 -> 6.11, where 1 vector took 6.30). With a weight, 4 stays ahead
//   from 2048 rows up (2048x4096 12.91 vs 13.50 with 2). On GPUs of less DRAM bandwidth an SM
//   (under kShortPathBytesPerSm: H100 SXM 25 GB/s, H200 37), 1 for such rows up to 256 vectors:
//   fewer bytes in flight meet the bandwidth there, and the one-vector path is shorter. H100,
//   forced 1 against the default 2 in one run (bench/results/2026-12-06_h100_ranked_topk/tune/
//   norm_no_weight.txt): [1x1024x2048] 6.85-6.94 -> 6.66 us, [4x1024x2048] 15.22-15.41 -> 14.90,
//   [1x4096x2048] 15.25-15.34 -> 14.85; 4 vectors slower (6.98-7.07, 15.49-15.57).
// - 1 for a norm without a residual or modulation up to a full wave: 2026-11-25, [1x512x4096]
//   7.17 -> 6.82 us (before the short plans of 00ba0d1 it lost there, 7.39 -> 8.51); with a
//   residual it still loses ([1x512x4096] 8.38 -> 9.28).
// - 2 for such a norm with 16-bit small operands (weight, bias) and rows up to 256 vectors, 384
//   for LayerNorm (bench/results/2026-11-26_h200_128d6e5/tune/norm_items_and_stage_172e9aa.txt:
//   LayerNorm LTX 18.54 -> 17.49 us, ltx-long 42.88 -> 41.79, rms_norm 8192x2048 20.90 -> 20.30,
//   32768x2048 68.91 -> 67.01). 384 vectors gained nothing there (FLUX 22.30 -> 22.19); on the
//   40-register LayerNorm variants of register_bound they do ([h100_18a1a3d] tune/: H200,
//   LayerNorm FLUX 22.3-22.4 -> 21.1 us bf16, 22.1-22.3 -> 21.5-21.6 fp16; H100 26.1 -> 24.5
//   and 26.0 -> 25.0). RMS rows of 384 vectors stay at 4: with 2, rms_norm 8192x3072 fp16 ran
//   28.0-28.1 -> 29.0 us and 32768x3072 98.5 -> 101.1 on the H200 (bf16: 2048x3072 gained 3%,
//   8192x3072 lost 1%). 512 vectors stay even (rms_norm 4096 wide on the H100, within 1-2%).
//   fp32 operands held in registers cost occupancy (Wan 1.3B's LayerNorm 61.2 -> 63.7).
// - 2 for a plain residual add + norm (fused_add_rms_norm: no gate, no modulation) of rows up to
//   512 vectors: x and the residual in flight with the small operands in registers. Measured
//   together with the shuffle row sum against the previous kernels (2026-11-24 tune/4):
//   2048x2048 13.79 -> 13.17 us, [1x512x4096] 9.50 -> 8.90. The per-sample modulated ops are
//   slower with 2 (adaln FLUX 23.68 -> 25.33 us, Wan 1.3B 72.0 -> 100.1 at 128d6e5).
//   Up to two waves, those the short rows take run faster with 1 (that kernel; H200, two or
//   three processes each, bench/results/2026-11-27_h200_f88b77c/tune/fadd_*): [1x512x4096]
//   8.40-8.53 -> 8.10-8.11 us, 2048x2048 12.48-12.54 -> 12.32-12.38, [1x1024x4096] even.
// - 2 as well for rows of up to 256 vectors whose modulation or gate changes from row to row
//   (per-token modulation): their operands load with the row into registers instead of being
//   staged (same run: adaln Wan 1.3B per token 162.8 -> 148.5 us, LTX per token 25.6 -> 25.0,
//   gated_residual_norm LTX per token 41.5 -> 40.9; at 640 vectors, Wan 14B, 524 -> 689).
//   Not for fp32 operands (Wan's per-token modulation), which are read at their use: 4 vectors
//   ran faster there once the 4-vector rows were bounded to 64 registers (adaln Wan 1.3B per
//   token 142.5-142.7 -> 140.0-140.2 us bf16, 142.7-142.8 -> 139.9-140.0 fp16; LTX's bf16
//   per-token rows lose 0.7-1.9 us with 4: 2026-11-26_h200_b738d93/tune/norm_token_items.txt).
// - 2 as well for a gated residual + modulated norm (gated_residual_norm) of 16-bit rows with
//   16-bit operands and up to 384 vectors (bench/results/2026-11-26_h200_ca4d16f/tune/
//   grn_items_by_dtype.txt, bf16: LTX 27.4-27.9 -> 26.6-26.7 us, LTX-long 70.0 either way). Its
//   kernels held 77-88 registers until the weight and bias of residual + modulated rows were read
//   at their use (see norm_rows); now 60-64 in both dtypes, and FLUX's 384-vector rows take 2 as
//   well.
//   H200, side by side with 97c6628's library, two columns each (bench/results/
//   2026-11-29_h200_97c6628/tune/l0_l6_l7_*.txt, l0 against l6): FLUX fp16 35.97-36.08 ->
//   33.49-33.65 us, bf16 34.03-34.46 -> 33.73-33.89; LTX-long bf16 68.51-68.66 -> 67.74-67.89,
//   fp16 68.82-68.90 -> 67.89-67.97; LTX and the per-token rows within 0.3 us. Before, fp16 needed
//   a bound of 80 registers in 128-thread blocks to join, and FLUX lost with 2 (38.3-38.5 ->
//   38.5-38.8 in act_items_and_grn_vs_ca4d16f.txt). Not for Wan's fp32-modulated rows.
// - otherwise 4, which keeps 64 bytes of each operand in flight per thread at the typical widths;
//   8 for wide rows of the ops without a residual (with one, 8 vectors of x, branch and gate
//   exceed the register budget).
// - 3 instead of 4 for 16-bit rows with fp32 modulation (or fp32 split tables) the same for every
//   row of a sample, whose threads would all hold an empty 4th vector (widths of 768, 1280 and 1536 elements:
//   Wan 1.3B's 192-vector rows take 64 threads either way), so that no registers or arithmetic
//   go to it. H200 side by side (2026-11-27, see register_bound): per-sample adaln Wan 1.3B
//   61.3 -> 57.2 us bf16, gated_residual_norm Wan 1.3B 104.5 -> 102.7-103.1 bf16 (fp16 within
//   0.4). LayerNorm alone and the per-token rows ran unchanged and keep 4; 16-bit modulation was
//   not measured.
// - 2 as well for 16-bit RMS rows of up to 256 vectors modulated the same for every row of a
//   sample by 16-bit operands (LTX's per-sample AdaLN), held in registers instead of staged.
//   H100 (bench/results/2026-12-06_h100_ee5fe0a/tune/): forced by FUSEBOX_NORM_ITEMS=2 (dit_*.txt)
//   LTX 19.41-19.54 -> 18.74-18.85 us, LTX-long 49.25-49.41 -> 47.89; the LayerNorm rows ran even
//   (FLUX) or slower (Wan 1.3B's fp32 modulation 72.5 -> 73.0) and keep 3-4. As the default,
//   alternating with ee5fe0a's library (adaln_rms_sample_items2_*.txt): LTX 19.47-19.57 ->
//   18.86-18.93, LTX-long 49.50-49.60 -> 47.58-47.87; per-token, FLUX and Wan rows unchanged.
// Odd widths (one element per vector) use 8.
constexpr double kShortPathBytesPerSm = 30e9;  // peak DRAM bytes/s an SM (see pick_items)

int pick_items(int64_t rows, int64_t vec_per_row, bool full_vectors, const RowOpTraits& op) {
  if (!full_vectors) return vec_per_row <= 8 * kMaxThreads ? 8 : 0;
  const int forced = tuning_knobs().norm_items.value_or(0);
  // the rows whose 3-vector plans are compiled (kThreeVectorRows in launch_rows)
  const bool three = op.modulated && op.sixteen_bit_rows && op.f32_operands;
  if ((forced == 1 || forced == 2 || (forced == 3 && three) || forced == 4 || (forced == 8 && !op.residual)) &&
      vec_per_row <= forced * kMaxThreads)
    return forced;
  if (!op.normalizes && vec_per_row <= 2 * kMaxThreads) return vec_per_row <= kMaxThreads ? 1 : 2;
  const DeviceLimits& gpu = device_limits();
  const int64_t wave = gpu.resident_threads();
  const bool plain_norm = !op.residual && !op.modulated;
  if (vec_per_row <= kMaxThreads && rows * vec_per_row <= wave / 2) return 1;
  if (plain_norm && !op.small_operands && vec_per_row <= kMaxThreads) {
    const bool lean_dram = gpu.dram_bytes_per_s > 0 && gpu.dram_bytes_per_s < kShortPathBytesPerSm * gpu.sm_count;
    return lean_dram && vec_per_row <= 256 ? 1 : 2;
  }
  if (plain_norm && vec_per_row <= kMaxThreads && rows * vec_per_row <= wave) return 1;
  if (plain_norm && !op.f32_operands && vec_per_row <= (op.layer_norm ? 384 : 256)) return 2;
  if (op.plain_residual && op.short_rows && vec_per_row <= kMaxThreads && rows * vec_per_row <= 2 * wave) return 1;
  if (op.plain_residual && vec_per_row <= kMaxThreads) return 2;
  if (op.per_row_operand && !op.f32_operands && vec_per_row <= 256) return 2;
  if (op.modulated && !op.residual && !op.layer_norm && op.sixteen_bit_rows && !op.f32_operands &&
      vec_per_row <= 256)
    return 2;
  if (op.residual && op.modulated && op.sixteen_bit_rows && !op.f32_operands && vec_per_row <= 384) return 2;
  if (vec_per_row <= 4 * kMaxThreads)
    return three && !op.per_row_operand && 3 * threads_per_row(vec_per_row, 4) >= vec_per_row ? 3 : 4;
  if (vec_per_row <= 8 * kMaxThreads && !op.residual) return 8;
  return 0;
}

// Split modulation: every present gate, scale and shift has a table (norm() checks).
bool split_modulation(const NormArgs& args) {
  return args.gate_table.defined() || args.scale_table.defined() || args.shift_table.defined();
}

// The dtype every present small operand shares (-2 when they differ). With split modulation the
// tables are the small operands; the per-row parts have x's dtype.
int shared_param_dtype(const NormArgs& args) {
  int dt = -1;
  const bool split = split_modulation(args);
  for (const TensorView* t : {&args.weight, &args.bias, split ? &args.gate_table : &args.gate,
                              split ? &args.scale_table : &args.scale, split ? &args.shift_table : &args.shift}) {
    if (!t->defined()) continue;
    if (dt == -1)
      dt = int(t->dtype);
    else if (dt != int(t->dtype))
      return -2;
  }
  return dt == -1 ? int(args.x.dtype) : dt;
}

// Split modulation on the register path: fp32 tables, full vectors, up to 4 vectors a thread.
template <typename P, int VEC, int ITEMS>
constexpr bool kSplitOnRegisterPath = std::is_same_v<P, float> && VEC > 1 && ITEMS <= 4;

// The plans with a twin for the operands of `known` (KNOWN in norm_rows):
// - kAffine: plain norm rows on the held plans, with small operands of the rows' dtype;
// - kModulation: modulated norm rows of 16-bit values, 2-4 full vectors a thread (the DiT sizes),
//   split modulation included, so that split and summed terms take the same arithmetic (the same
//   bits), except on the residual rows of 3-4 vectors. There the twins hold 64 registers
//   (register_bound) and only the summed fp32 terms take them: H200 side by side (bench/results/
//   2026-11-29_h200_874032e/tune/ld_le_*.txt, two columns each) gated_residual_norm Wan 14B
//   340.8-343.3 -> 331.0-331.3 us bf16, 332.1-332.3 -> 330.1-330.2 fp16; Wan 1.3B 103.6-103.7 ->
//   103.1. Split ones as twins (64 registers and 16-64 bytes of spills on the 4-vector plans,
//   against 82-120 registers for the general split kernels, unbounded) took a Wan-family block's modulation work 5% longer
//   (split_modulation_ld_le.txt: SkyReels-V2 0.857-0.870 -> 0.901-0.943 ms, Wan 2.2 TI2V
//   0.906-0.917 -> 0.954-0.993), so split and summed terms agree there to rounding, not bit for
//   bit. The staged 16-bit residual twins (90-99 registers against 77-84) are not compiled.
template <Known K, typename T, typename P, int VEC, int ITEMS, NormType NORM, bool RES, bool MOD, bool SPLIT>
constexpr bool kKnownPlan =
    K == Known::kAffine       ? ITEMS <= 2 && NORM != NormType::kNone && !RES && !MOD && !SPLIT && std::is_same_v<P, T>
    : K == Known::kModulation ? MOD && NORM != NormType::kNone && sizeof(T) == 2 && VEC > 1 && ITEMS >= 2 &&
                                    ITEMS <= 4 && !(RES && ITEMS > 2 && (SPLIT || !std::is_same_v<P, float>))
                              : true;

// stage: ITEMS > 2, the small operands go through shared-memory slots (else read at their use).
// split: split modulation (see norm_rows). walk: the plan's twin for that walk where it has one,
// else the general split. known: the operands present, where they are exactly those of a Known
// case (the plans of kKnownPlan then take that twin).
template <typename T, typename P, int VEC, int ITEMS>
void launch_rows(const NormKernelArgs& a, bool res, bool mod, bool split, RowWalk walk, int n_params, bool stage,
                 Known known, dim3 block, cudaStream_t stream) {
  stage = stage && ITEMS > 2 && n_params > 0;
  const size_t smem = stage ? size_t(n_params) * ITEMS * block.x * sizeof(Pack<P, VEC>) : 0;
  auto go = [&](auto norm, auto r, auto m, auto sp) {
    constexpr NormType kNorm = decltype(norm)::value;
    constexpr bool kRes = decltype(r)::value, kMod = decltype(m)::value, kSplit = decltype(sp)::value;
    // Plans that pick_items and the op never make are not compiled: a residual with 8 full
    // vectors per thread (too many registers), 3 vectors but for 16-bit rows with fp32
    // modulation, and a residual add alone with modulation or without its residual. Split
    // modulation is compiled for fp32 tables (those of the models that pass it) on full-vector
    // plans of up to 4 vectors; the streaming path takes the rest.
    constexpr bool kThreeVectorRows = kMod && sizeof(T) == 2 && VEC > 1 && std::is_same_v<P, float>;
    if constexpr ((kRes && VEC > 1 && ITEMS == 8) || (ITEMS == 3 && !kThreeVectorRows) ||
                  (kNorm == NormType::kNone && (!kRes || kMod)) ||
                  (kSplit && !(kSplitOnRegisterPath<P, VEC, ITEMS> && (kRes || kMod)))) {
      FUSEBOX_CHECK(false, "no norm kernel for this launch plan");
    } else {
      auto with_kernel = [&](auto path, auto walk_c, auto known_c) {
        constexpr ParamPath kPath = decltype(path)::value;
        constexpr RowWalk kWalk = decltype(walk_c)::value;
        constexpr int kMinBlocks = register_bound<T, P, ITEMS, kNorm, kRes, kMod, kPath, kWalk, decltype(known_c)::value>();
        const auto kernel = norm_rows_kernel<kMinBlocks, T, P, VEC, ITEMS, kNorm, kRes, kMod, kPath, kSplit, kWalk,
                                             decltype(known_c)::value>;
        // (the kernel's static shared memory counts against the same 48 KB default)
        if (smem > 32 * 1024) allow_dynamic_smem(kernel, smem);
        // The rows one grid row walks: all of them, or one sample's (kSamples: blockIdx.y).
        NormKernelArgs k = a;
        unsigned samples = 1;
        if constexpr (kWalk == RowWalk::kSamples) {
          k.rows = a.index.size2;
          samples = a.index.size1;
        }
        const int64_t groups = (k.rows + k.rows_per_block - 1) / k.rows_per_block;
        launch(kernel, dim3(unsigned((groups + k.row_iters - 1) / k.row_iters), samples), block, smem, stream, k);
      };
      auto with_path = [&](auto path, auto walk_c) {
        using AffineC = std::integral_constant<Known, Known::kAffine>;
        using ModulationC = std::integral_constant<Known, Known::kModulation>;
        if constexpr (kKnownPlan<Known::kAffine, T, P, VEC, ITEMS, kNorm, kRes, kMod, kSplit>)
          if (known == Known::kAffine) return with_kernel(path, walk_c, AffineC{});
        if constexpr (kKnownPlan<Known::kModulation, T, P, VEC, ITEMS, kNorm, kRes, kMod, kSplit>)
          if (known == Known::kModulation) return with_kernel(path, walk_c, ModulationC{});
        with_kernel(path, walk_c, std::integral_constant<Known, Known::kNone>{});
      };
      using Walk = RowWalk;
      auto with_layout = [&](auto path) {
        if constexpr (has_twin<Walk::kFlat, ITEMS, kNorm, kRes, kMod, kSplit>())
          if (walk == Walk::kFlat) return with_path(path, std::integral_constant<Walk, Walk::kFlat>{});
        if constexpr (has_twin<Walk::kSamples, ITEMS, kNorm, kRes, kMod, kSplit>())
          if (walk == Walk::kSamples) return with_path(path, std::integral_constant<Walk, Walk::kSamples>{});
        with_path(path, std::integral_constant<Walk, Walk::kSplit>{});
      };
      if constexpr (ITEMS <= 2)
        with_layout(std::integral_constant<ParamPath, ParamPath::kHeld>{});
      else if (stage)
        with_layout(std::integral_constant<ParamPath, ParamPath::kStaged>{});
      else
        with_layout(std::integral_constant<ParamPath, ParamPath::kGlobal>{});
    }
  };
  auto with_flags = [&](auto norm) {
    auto with_split = [&](auto r, auto m) {
      split ? go(norm, r, m, std::true_type{}) : go(norm, r, m, std::false_type{});
    };
    auto with_mod = [&](auto r) { mod ? with_split(r, std::true_type{}) : with_split(r, std::false_type{}); };
    res ? with_mod(std::true_type{}) : with_mod(std::false_type{});
  };
  switch (a.norm) {
    case NormType::kNone: with_flags(std::integral_constant<NormType, NormType::kNone>{}); break;
    case NormType::kRMS: with_flags(std::integral_constant<NormType, NormType::kRMS>{}); break;
    case NormType::kLayer: with_flags(std::integral_constant<NormType, NormType::kLayer>{}); break;
  }
}

// ---------------------------------------------------------------- residual add alone

// h = x + gate * branch (or x + branch) as an elementwise pass: vector v of a sample's rows is
// element v * VEC of x, branch and h, whose rows are contiguous within a sample; the gate's row
// and column come from v by one multiply-high division. blockIdx.y is the sample.
struct FlatAddArgs {
  const void* x;
  const void* branch;
  void* h;
  const void* gate;  // or null
  int64_t x_s1, branch_s1, h_s1, gate_s1, gate_s2;  // sample strides; the gate's row stride
  uint32_t vectors;                                  // vectors of one sample
  FastDivmod vec_per_row;
};

template <typename T, typename P, int VEC, int ITEMS>
__global__ void __launch_bounds__(256) flat_add_kernel(const FlatAddArgs a) {
  const int64_t sample = blockIdx.y;
  const T* x = static_cast<const T*>(a.x) + sample * a.x_s1;
  const T* branch = static_cast<const T*>(a.branch) + sample * a.branch_s1;
  Pack<T, VEC> xv[ITEMS], bv[ITEMS];
  Pack<P, VEC> gv[ITEMS];
  uint32_t v[ITEMS];
  pdl_wait();
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    v[it] = (blockIdx.x * ITEMS + it) * 256u + threadIdx.x;
    if (v[it] < a.vectors) {
      xv[it] = load_pack<T, VEC>(x + int64_t(v[it]) * VEC);
      bv[it] = load_pack<T, VEC>(branch + int64_t(v[it]) * VEC);
      if (a.gate) {
        uint32_t col;
        const uint32_t row = a.vec_per_row.divmod(v[it], col);
        gv[it] = load_pack<P, VEC>(static_cast<const P*>(a.gate) + sample * a.gate_s1 + row * a.gate_s2 +
                                   int64_t(col) * VEC);
      }
    }
  }
  pdl_release();
  T* h = static_cast<T*>(a.h) + sample * a.h_s1;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    if (v[it] >= a.vectors) break;
    float xf[VEC], bf[VEC];
    unpack(xv[it], xf);
    unpack(bv[it], bf);
    if (a.gate) {
      float gf[VEC];
      unpack(gv[it], gf);
#pragma unroll
      for (int i = 0; i < VEC; ++i) bf[i] *= gf[i];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) xf[i] += bf[i];
    store_pack(h + int64_t(v[it]) * VEC, pack<T, VEC>(xf));
  }
}

// The elementwise pass where the add's operands allow it (full vectors, rows contiguous within
// each of at most 65535 samples, the gate not split); false otherwise, and the row kernel takes
// them. The row kernel ran 64% more warp instructions for the same bytes as inductor's
// elementwise kernel (LTX-Video, bench/results/2026-11-29_h200_a1997f5/ncu/). H200, side by side
// against the row kernel, one vector a thread (bench/results/2026-11-29_h200_110e771/tune/):
// gated_residual LTX-Video 19.23-19.39 -> 19.15-19.20 us bf16 (19.41-19.55 -> 19.17-19.23 fp16),
// FLUX 23.55-23.68 -> 23.30-23.34, LTX-long 49.02-49.26 -> 48.70-48.80, Wan's rows level; two
// vectors a thread (FUSEBOX_ADD_FLAT=2) no better (a1997f5's tune/flat_add_*).
// FUSEBOX_ADD_FLAT=0 sends these rows to the row kernel.
bool launch_flat_add(const NormArgs& args, const detail::RowLayout& layout, const NormStrides& s, int vec,
                     bool full_vectors, cudaStream_t stream) {
  const int items = tuning_knobs().add_flat.value_or(1);
  const int64_t width = args.x.shape[args.x.ndim - 1];
  if ((items != 1 && items != 2) || !full_vectors || layout.sizes[0] != 1 || layout.sizes[1] > 65535 ||
      split_modulation(args))
    return false;
  for (const detail::RowStrides* st : {&s.x, &s.branch, &s.residual_out})
    if (layout.sizes[2] > 1 && st->s[2] != width) return false;
  const int64_t vectors = layout.sizes[2] * width / vec;
  if (vectors * items + 256 * items >= (int64_t(1) << 32)) return false;
  FlatAddArgs a{};
  a.x = args.x.data;
  a.branch = args.branch.data;
  a.h = args.residual_out.data;
  a.gate = args.gate.defined() ? args.gate.data : nullptr;
  a.x_s1 = s.x.s[1];
  a.branch_s1 = s.branch.s[1];
  a.h_s1 = s.residual_out.s[1];
  a.gate_s1 = s.gate.s[1];
  a.gate_s2 = s.gate.s[2];
  a.vectors = uint32_t(vectors);
  a.vec_per_row = FastDivmod(uint32_t(width / vec));
  const int64_t per_block = 256 * int64_t(items);
  const dim3 grid(unsigned((vectors + per_block - 1) / per_block), unsigned(layout.sizes[1])), block(256);
  dispatch_dtype(args.x.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / int(sizeof(T));
    auto go = [&](auto p) {
      using P = decltype(p);
      if (items == 1)
        launch(flat_add_kernel<T, P, V, 1>, grid, block, 0, stream, a);
      else
        launch(flat_add_kernel<T, P, V, 2>, grid, block, 0, stream, a);
    };
    if (args.gate.defined() && args.gate.dtype == DType::kFloat32 && !std::is_same_v<T, float>)
      go(float{});  // (norm() checks a gate is of x's dtype or fp32)
    else
      go(T{});
  });
  return true;
}

}  // namespace

void norm_cuda(const NormArgs& args, const detail::RowLayout& layout, const NormStrides& s, int vec,
               cudaStream_t stream) {
  if (layout.rows == 0 || args.x.shape[args.x.ndim - 1] == 0) return;
  NormKernelArgs a{};
  a.index = row_indexer(layout);
  a.rows = layout.rows;
  a.width = int(args.x.shape[args.x.ndim - 1]);
  a.inv_width = 1.f / float(a.width);
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
  auto table = [](const TensorView& t) {
    return ParamPtr{t.defined() ? t.data : nullptr, t.defined() && t.dtype == DType::kFloat32};
  };
  a.gate_table = table(args.gate_table);
  a.scale_table = table(args.scale_table);
  a.shift_table = table(args.shift_table);
  a.norm = args.norm;
  a.eps = args.eps;
  a.weight_offset = args.weight_offset;

  const bool full_vectors = vec * int(dtype_size(args.x.dtype)) == 16;
  const bool res = args.branch.defined();
  const bool mod = args.scale.defined() || args.shift.defined();
  const bool normalizes = args.norm != NormType::kNone;
  if (res && !normalizes && !mod && launch_flat_add(args, layout, s, vec, full_vectors, stream)) return;
  // An operand that changes from row to row (per-token modulation or gate).
  bool per_row_operand = false;
  for (const auto* st : {&s.gate, &s.scale, &s.shift}) per_row_operand |= layout.sizes[2] > 1 && st->s[2] != 0;
  const int n_params = int(args.gate.defined()) + int(normalizes && args.weight.defined()) +
                       int(normalizes && args.bias.defined()) + int(args.scale.defined()) +
                       int(args.shift.defined());
  const int param_dtype = shared_param_dtype(args);
  const bool params_f32 = param_dtype >= 0 && DType(param_dtype) == DType::kFloat32;
  const bool plain_residual = res && !args.gate.defined() && !mod && normalizes;
  const bool split = split_modulation(args);
  // Rows short_rows_kernel can take at one vector a thread: a plain RMS norm (after a plain
  // residual add or none) without bias, or a plain 16-bit LayerNorm without a residual; no
  // modulation, gate or fp32 operands, the output in x's dtype, one row group, rows of 128 or more
  // whole vectors, strides below 2^31.
  const bool short_layer_norm = args.norm == NormType::kLayer && !res && dtype_size(args.x.dtype) == 2 &&
                                (!args.bias.defined() || args.bias.dtype == args.x.dtype);
  bool short_rows = ((args.norm == NormType::kRMS && !args.bias.defined()) || short_layer_norm) && !mod &&
                    !args.gate.defined() && !split &&
                    (!args.weight.defined() || args.weight.dtype == args.x.dtype) && !a.out_f32 &&
                    (!res || plain_residual) && full_vectors && a.index.flat && a.vec_per_row >= kMinBlockThreads &&
                    tuning_knobs().norm_short.value_or(1) != 0;
  for (const RowOperandArg* o : {&a.x, &a.out, &a.branch, &a.residual_out})
    short_rows = short_rows && o->off.s2 >= 0 && o->off.s2 < (int64_t(1) << 31);
  const RowOpTraits traits{normalizes, res, plain_residual, mod, per_row_operand, n_params > 0,
                           n_params > 0 && params_f32, args.norm == NormType::kLayer,
                           dtype_size(args.x.dtype) == 2, short_rows};
  const int items = pick_items(a.rows, a.vec_per_row, full_vectors, traits);
  FUSEBOX_CHECK(a.rows < (int64_t(1) << 31), "too many rows: ", a.rows);
  // (the register path's split plans: see kSplitOnRegisterPath)
  const bool split_on_registers =
      full_vectors && items <= 4 && (params_f32 || args.x.dtype == DType::kFloat32);

  if (items == 0 || param_dtype < 0 || !(full_vectors || vec == 1) || (split && !split_on_registers)) {
    a.tpr = kStreamThreads;
    a.rows_per_block = 1;
    dispatch_dtype(args.x.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_vec<T>(vec, [&](auto v) {
        launch(norm_stream_kernel<T, decltype(v)::value>, dim3(unsigned(a.rows)), dim3(kStreamThreads), 0,
               stream, a);
      });
    });
    return;
  }

  // The short rows (see short_rows_kernel): one vector a thread, one row a block.
  if (short_rows && items == 1) {
    ShortRowArgs k{args.x.data, args.out.data, args.weight.defined() ? args.weight.data : nullptr,
                   uint32_t(a.x.off.s2), uint32_t(a.out.off.s2), a.eps, a.inv_width, a.weight_offset,
                   a.vec_per_row, res ? args.branch.data : nullptr, res ? args.residual_out.data : nullptr,
                   uint32_t(a.branch.off.s2), uint32_t(a.residual_out.off.s2),
                   args.bias.defined() ? args.bias.data : nullptr};
    const dim3 block(unsigned((a.vec_per_row + 31) / 32 * 32));
    dispatch_dtype(args.x.dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (sizeof(T) == 2) {
        if (args.norm == NormType::kLayer) {
          launch(short_rows_kernel<T, false, NormType::kLayer>, dim3(unsigned(a.rows)), block, 0, stream, k);
          return;
        }
      }
      if (res)
        launch(short_rows_kernel<T, true, NormType::kRMS>, dim3(unsigned(a.rows)), block, 0, stream, k);
      else
        launch(short_rows_kernel<T, false, NormType::kRMS>, dim3(unsigned(a.rows)), block, 0, stream, k);
    });
    return;
  }

  a.tpr = threads_per_row(a.vec_per_row, items);
  a.rows_per_block = (a.tpr <= 32 || (a.tpr & (a.tpr - 1)) == 0) && a.tpr < kMinBlockThreads
                         ? kMinBlockThreads / a.tpr
                         : 1;
  while ((1 << a.tpr_log2) < a.tpr) ++a.tpr_log2;
  const dim3 block(unsigned(a.tpr * a.rows_per_block));
  // A block may take several row groups in turn, its staged copies of constant operands then
  // serving every group. One group per block is the measured default (H200: the resident blocks
  // already keep enough loads in flight); FUSEBOX_NORM_ROW_ITERS (1-8) sets more for tuning runs.
  a.row_iters = items <= 2 ? 1 : std::max(1, std::min(8, tuning_knobs().norm_row_iters.value_or(1)));
  // 16-bit operands are staged; fp32 ones are read at their use: those that stay the same for
  // every row hit L1, and staging keeps fewer rows resident (Wan 14B adaln: 355 -> 291 us), and
  // those that change from row to row go faster too since the use is compile-time (Wan 14B
  // per-token adaln 497.6 -> 458.8 us, norm_items_and_stage_172e9aa.txt).
  // A modulated LayerNorm with its own weight and bias (CogVideoX) has four or five 16-bit
  // operands and no compile-time twin; staged, those rows ran well below the copy (the slots
  // take 256-320 bytes a thread on the 4-vector plan; occupancy not profiled). Read at use (H100,
  // alternating processes, bench/results/2026-12-05_h100_90deb5e/tune/
  // stage_wb.txt): adaln [2x17550x3072] 193.0-194.0 -> 152.3-152.6 us, [2x8192x4096] 126.1-126.8
  // -> 99.0-99.1, [1x8192x6144] 99.5-99.6 -> 77.4-77.5; gated_residual_norm [2x8192x4096]
  // 214.5-215.3 -> 200.2-200.6, [1x8192x6144] 154.7-155.2 -> 151.3-151.7. The RMS rows with a
  // weight gained at 4096 wide and lost at 3072 or 6144 (adaln 148.9-149.5 -> 151.6), so they
  // stay staged.
  const bool affine_modulated_layer_norm =
      args.norm == NormType::kLayer && args.weight.defined() && args.bias.defined() && mod;
  const bool stage_by_default = !params_f32 && !affine_modulated_layer_norm;
  const bool stage = tuning_knobs().norm_stage.value_or(int(stage_by_default)) != 0;
  // The flat twin where the rows form one group (FUSEBOX_NORM_FLAT=0: no twin, flat or sample,
  // for tuning runs). The 2-vector rows of a residual + RMS norm take it only while their threads
  // fit one wave: past that its rows streamed 0.2-0.5 us slower at 67-268 MB (H100, bf16, in two side-by-side
  // runs; fp16 within 0.2 either way), while on one wave it ran 0.1 us faster on the H100
  // (fused_add_rms_norm [1x512x4096]; on the H200 within the spread of repeated runs).
  // (rows * tpr threads, tpr = D / 2 vectors, against the half of the resident threads that blocks
  // of their 60-63 registers leave room for)
  // The sample walk where modulated rows, or gated rows with no norm after the add, form two row
  // groups (a batch of samples, each with its own modulation or gate row; the sample is
  // blockIdx.y, at most 65535 of them), for calls of more than two waves of threads. Side by side
  // on the H200 against the general split (bench/results/2026-11-26_h200_8572874/tune/
  // sample_walk.txt, two columns each): adaln LTX-long per sample
  // 40.2-40.3 -> 39.0-39.3 us bf16, 40.2-40.3 -> 37.8-38.0 fp16, gated_residual_norm LTX-long
  // 70.1-70.2 -> 69.4-69.5 bf16; at LTX's 1.3 waves mixed: adaln 17.4-17.6 -> 18.1 bf16,
  // 17.5-17.6 -> 17.0-17.1 fp16, gated_residual_norm within 0.2. With this rule: sample_walk_rule.txt.
  // The gated add alone (2026-11-27_h200_f88b77c/tune/gated_sample_walk_*, three processes each):
  // LTX 19.58-19.63 -> 19.31-19.38 us bf16, 19.55-19.66 -> 19.26-19.42 fp16; LTX-long within 0.3
  // either way.
  const int64_t wave = device_limits().resident_threads();
  const bool one_wave = a.rows * a.vec_per_row <= wave;
  const bool twins = tuning_knobs().norm_flat.value_or(1) != 0;
  RowWalk walk = RowWalk::kSplit;
  if (twins && a.index.flat && !(items == 2 && traits.plain_residual && args.norm == NormType::kRMS && !one_wave))
    walk = RowWalk::kFlat;
  else if (twins && (mod || (res && !normalizes)) && layout.sizes[0] == 1 && layout.sizes[1] <= 65535 &&
           a.rows * a.tpr > 2 * wave)
    walk = RowWalk::kSamples;

  // The operands present, where they are exactly those of a Known case (see kKnownPlan).
  Known known = Known::kNone;
  if (normalizes && !res && !mod && args.weight.defined() && args.bias.defined() == (args.norm == NormType::kLayer))
    known = Known::kAffine;
  else if (normalizes && args.scale.defined() && args.shift.defined() && !args.weight.defined() &&
           !args.bias.defined() && args.gate.defined() == res)
    known = Known::kModulation;
  dispatch_dtype(args.x.dtype, [&](auto t) {
    using T = decltype(t);
    auto with_params = [&](auto p) {
      using P = decltype(p);
      if (full_vectors) {
        constexpr int V = 16 / int(sizeof(T));
        if (items == 1)
          launch_rows<T, P, V, 1>(a, res, mod, split, walk, n_params, stage, known, block, stream);
        else if (items == 2)
          launch_rows<T, P, V, 2>(a, res, mod, split, walk, n_params, stage, known, block, stream);
        else if (items == 3)
          launch_rows<T, P, V, 3>(a, res, mod, split, walk, n_params, stage, known, block, stream);
        else if (items == 4)
          launch_rows<T, P, V, 4>(a, res, mod, split, walk, n_params, stage, known, block, stream);
        else
          launch_rows<T, P, V, 8>(a, res, mod, split, walk, n_params, stage, known, block, stream);
      } else {
        launch_rows<T, P, 1, 8>(a, res, mod, split, walk, n_params, stage, known, block, stream);
      }
    };
    if (params_f32 || std::is_same_v<T, float>)
      with_params(float{});
    else
      with_params(T{});
  });
}

}  // namespace fusebox::cuda
