// Mixture-of-experts combine kernel: each token's output row is the weighted sum of the K
// expert-output rows its index names. Threads of a token own ITEMS vectors of its row each
// (column chunks for rows wider than a block) and issue the loads of a chunk of K_CHUNK rows
// before the first product; the row is written once. The unfused form (the gather, the fp32
// products and their sum) writes and reads (2 + 4 + 4) * K bytes an element between them.
//
// Every row load waits on its index load, so a thread's bytes in flight come in bursts of one
// index latency plus one row latency: with one vector a thread and K = 2 the kernel ran at 58-66%
// of copy bandwidth (H200, Mixtral's 2x4096 rows), with K = 8 at 74-94%. ITEMS vectors a thread
// move ITEMS times the bytes a burst; staged in shared memory (STAGED below), the bytes of a
// burst no longer need registers, and four blocks an SM keep about twice as many in flight.
#include "moe/moe_impl.h"
#include "moe/moe_operands.cuh"

namespace fusebox::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kMaxLoads = 16;  // row vectors a thread has in flight in registers: K_CHUNK * ITEMS
constexpr int kMaxChunk = 8;   // rows a chunk: every top-k of the models served (2-8) in one
// Staged row vectors a thread at most: 12 of 16 bytes, 48 KB a block of 256 threads (the
// default without an opt-in; four blocks an SM).
constexpr int kMaxStagedSlots = 12;

// Rows of a staged chunk (K_CHUNK) at `items` vectors a thread: a chunk fills the slots.
__host__ __device__ constexpr int staged_chunk_rows(int items) {
  return kMaxStagedSlots / items < kMaxChunk ? kMaxStagedSlots / items : kMaxChunk;
}

// acc += w * row, element by element as the unfused form computes it: the product rounded to
// the rows' dtype where the weights are 16-bit (the product tensor is then 16-bit), no fma.
template <typename T, int VEC>
__device__ __forceinline__ void add_weighted_row(float (&acc)[VEC], const Pack<T, VEC>& row, float w,
                                                 bool weights_f32) {
  float x[VEC];
  unpack(row, x);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    float product = __fmul_rn(w, x[i]);
    if (!weights_f32) product = round_to<T>(product);
    acc[i] = __fadd_rn(acc[i], product);
  }
}

// A token with an index outside the rows: its whole output row is NaN (no host sync to raise).
template <int VEC>
__device__ __forceinline__ void poison_row(float (&acc)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = __int_as_float(0x7fc00000);
}

struct CombineKernelArgs {
  const void* rows;
  IndexPtr index;
  ParamPtr weights;
  void* out;
  int64_t rows_stride, out_stride;
  Strides2D index_strides, weights_strides;
  int64_t tokens, num_rows;
  int top_k, vec_per_row, tokens_per_block;
};

// STAGED: row vectors go to this thread's shared-memory slots by cp.async rather than into
// registers, so the bytes in flight are bound by shared memory (up to 228 KB an SM) instead of
// the registers that hold them (128 a thread at 16 loads: 2 blocks, 96 KB an SM). Slot (j, it)
// of thread `tid` is stage[(j * ITEMS + it) * threads + tid]: a warp's reads are consecutive.
template <typename T, int VEC, int ITEMS, bool STAGED>
__global__ void __launch_bounds__(kBlockThreads, !STAGED ? 2 : ITEMS == 4 ? 3 : 4)
    moe_combine_kernel(const CombineKernelArgs p) {
  using PackT = Pack<T, VEC>;
  extern __shared__ __align__(16) unsigned char combine_smem[];
  PackT* stage = reinterpret_cast<PackT*>(combine_smem);
  const int threads = blockDim.x * blockDim.y, tid = threadIdx.y * blockDim.x + threadIdx.x;
  // Indices first where the rows are staged or a thread's rows take few registers (one vector
  // of at most 4 bytes: the decode plan's, or rows too narrow for wider vectors).
  constexpr bool INDEX_FIRST = STAGED || (ITEMS == 1 && VEC * sizeof(T) <= 4);
  constexpr int K_CHUNK = STAGED ? staged_chunk_rows(ITEMS) : INDEX_FIRST ? kMaxChunk : kMaxLoads / ITEMS;
  const int64_t token = int64_t(blockIdx.x) * p.tokens_per_block + threadIdx.y;
  const int first = blockIdx.y * ITEMS * blockDim.x + threadIdx.x;  // vectors first + it * blockDim.x
  if (token >= p.tokens || first >= p.vec_per_row) return;
  const T* rows = static_cast<const T*>(p.rows) + first * VEC;

  pdl_wait();
  float acc[ITEMS][VEC] = {};
  bool out_of_range = false;
  for (int k0 = 0; k0 < p.top_k; k0 += K_CHUNK) {
    int64_t r[INDEX_FIRST ? K_CHUNK : 1];
    float w[K_CHUNK];
    PackT v[STAGED ? 1 : K_CHUNK][ITEMS];
    auto load_row = [&](int j, int64_t row) {
      if (row < 0 || row >= p.num_rows) {  // never read out of bounds; the row becomes NaN
        out_of_range = true;
        row = 0;
      }
#pragma unroll
      for (int it = 0; it < ITEMS; ++it)
        if (first + it * int(blockDim.x) < p.vec_per_row) {
          const T* src = rows + row * p.rows_stride + it * blockDim.x * VEC;
          if constexpr (STAGED)
            async_copy_pack(&stage[(j * ITEMS + it) * threads + tid], src);
          else
            v[j][it] = load_pack<T, VEC>(src);
        }
    };
    // INDEX_FIRST: every index of the chunk is requested before the first row (one index
    // latency for all rows), and the weights after the rows, under their latency (staged, H100,
    // 2048 tokens: 0.7-1.9% faster than with the indices). Otherwise the loads alternate (index,
    // row, index, row...): the indices held alongside 2-4 vectors of rows cost an occupancy
    // step (120 -> 141 registers at 2 vectors a thread, 2x the time on an H200).
    auto load_weight = [&](int j) {
      w[j] = load_param_scalar<T>(p.weights, p.weights_strides.at(token, k0 + j));
    };
#pragma unroll
    for (int j = 0; j < K_CHUNK; ++j) {
      if (k0 + j < p.top_k) {
        const int64_t row = p.index.load(p.index_strides.at(token, k0 + j));
        if constexpr (INDEX_FIRST) {
          r[j] = row;
        } else {
          load_weight(j);
          load_row(j, row);
        }
      }
    }
    if constexpr (INDEX_FIRST) {
#pragma unroll
      for (int j = 0; j < K_CHUNK; ++j)
        if (k0 + j < p.top_k) load_row(j, r[j]);
#pragma unroll
      for (int j = 0; j < K_CHUNK; ++j)
        if (k0 + j < p.top_k) load_weight(j);
    }
    if constexpr (STAGED) async_copy_wait();  // this thread's own slots only
#pragma unroll
    for (int j = 0; j < K_CHUNK; ++j) {
      if (k0 + j < p.top_k) {
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          if constexpr (STAGED)
            add_weighted_row<T, VEC>(acc[it], stage[(j * ITEMS + it) * threads + tid], w[j],
                                     p.weights.is_f32);
          else
            add_weighted_row<T, VEC>(acc[it], v[j][it], w[j], p.weights.is_f32);
        }
      }
    }
  }
  pdl_release();
  T* out = static_cast<T*>(p.out) + token * p.out_stride + first * VEC;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    if (first + it * int(blockDim.x) >= p.vec_per_row) break;
    if (out_of_range) poison_row(acc[it]);
    store_pack(out + it * blockDim.x * VEC, pack<T, VEC>(acc[it]));
  }
}

// Decode-sized calls (a grid of fewer blocks than SMs): the time is one chain, index load ->
// row loads -> store, plus the instructions between them. This kernel keeps that path short:
// one vector a thread, one token a grid row, index and weights contiguous along k (element j
// at an immediate offset), 32-bit row numbers and stride, K_MAX rows' loads unrolled and
// predicated on the uniform top-k. Against the general kernel's decode plan (H100, 1-16
// tokens): 2-8% faster with L2 flushed, CUDA-graph replay 1.8-3.1 -> 1.3-2.2 us.
struct DecodeCombineArgs {
  const void* rows;
  const void* index;
  const void* weights;
  void* out;
  int index_stride, weights_stride;  // a token's k-vector: element j at token * stride + j
  int64_t out_stride;
  int rows_stride, num_rows, top_k, vec_per_row;
  bool index64, weights_f32;
};

template <typename T, int VEC, int K_MAX>
__global__ void __launch_bounds__(128) moe_combine_decode_kernel(const DecodeCombineArgs p) {
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= p.vec_per_row) return;
  const int token = blockIdx.y, K = p.top_k;
  pdl_wait();
  int64_t r[K_MAX];
  if (p.index64) {
    const long long* index = static_cast<const long long*>(p.index) + token * p.index_stride;
#pragma unroll
    for (int j = 0; j < K_MAX; ++j) r[j] = j < K ? __ldg(index + j) : 0;
  } else {
    const int* index = static_cast<const int*>(p.index) + token * p.index_stride;
#pragma unroll
    for (int j = 0; j < K_MAX; ++j) r[j] = j < K ? __ldg(index + j) : 0;
  }
  float w[K_MAX];
#pragma unroll
  for (int j = 0; j < K_MAX; ++j)
    if (j < K) w[j] = load_param_scalar<T>(ParamPtr{p.weights, p.weights_f32}, token * p.weights_stride + j);
  bool bad = false;  // the whole output row becomes NaN, as in moe_combine_kernel; nothing is read
#pragma unroll
  for (int j = 0; j < K_MAX; ++j) bad |= j < K && uint64_t(r[j]) >= uint64_t(p.num_rows);
  const T* rows = static_cast<const T*>(p.rows) + v * VEC;
  Pack<T, VEC> x[K_MAX];
  if (!bad) {
#pragma unroll
    for (int j = 0; j < K_MAX; ++j)
      if (j < K) x[j] = load_pack<T, VEC>(rows + static_cast<int64_t>(int(r[j])) * p.rows_stride);
  }
  pdl_release();
  float acc[VEC] = {};
#pragma unroll
  for (int j = 0; j < K_MAX; ++j)
    if (j < K) add_weighted_row<T, VEC>(acc, x[j], w[j], p.weights_f32);
  if (bad) poison_row(acc);
  store_pack(static_cast<T*>(p.out) + token * p.out_stride + v * VEC, pack<T, VEC>(acc));
}

// Elements in a 4-byte vector of `elem_bytes`-byte elements (1 for fp32): the decode plans' width
// from top-k 5. constexpr: the decode launcher's template argument too.
constexpr int four_byte_vec(int64_t elem_bytes) { return elem_bytes >= 4 ? 1 : int(4 / elem_bytes); }

int staged_slots(int64_t top_k, int items) {
  return int(std::min<int64_t>(top_k, staged_chunk_rows(items))) * items;
}

// Vectors a thread. Staged: the most (4, 2, 1) whose slots hold the whole top-k in one chunk
// (H200, bf16, 2048 tokens: K = 2 at 4, K = 6 at 2, K = 8 at 1 were each the fastest of the
// three). In registers: 4 where K <= 4 (one burst of K_CHUNK = 4 rows holds the whole top-k),
// else 2 (bursts of 8 rows). Fewer where a token's row would get less than a warp of threads.
int vectors_per_thread(int64_t top_k, int64_t vec_per_row, bool staged) {
  int items = 4;
  if (staged)
    while (items > 1 && top_k * items > kMaxStagedSlots) items /= 2;
  else if (top_k > 4)
    items = 2;
  while (items > 1 && vec_per_row < 32 * items) items /= 2;
  return items;
}

// Chunks of `split.tpr` threads a token's row, `tokens_per_block` tokens a block.
struct CombineGrid {
  int64_t tokens;
  ColumnSplit split;
  int tokens_per_block;
  int64_t blocks() const { return split.chunks * ((tokens + tokens_per_block - 1) / tokens_per_block); }
};

// chunk_threads: 0 for the widest chunks (up to a block), else at most that many threads
CombineGrid combine_grid(int64_t tokens, int vec_per_row, int items, int chunk_threads,
                         int block_threads = kBlockThreads) {
  CombineGrid g{tokens, column_split(vec_per_row, items, false, block_threads), 1};
  if (chunk_threads > 0) {  // a token's row over more, smaller chunks
    const int64_t need = (vec_per_row + items - 1) / items;
    g.split.tpr = int(std::min<int64_t>(chunk_threads, next_pow2(need)));
    g.split.chunks = (need + g.split.tpr - 1) / g.split.tpr;
  }
  g.tokens_per_block = std::max(1, block_threads / g.split.tpr);
  return g;
}

// The decode kernel where it applies: top-k <= 8, 16-byte vectors up to top-k 4 (4-byte ones
// above, as the general decode plan), k-contiguous index and weights, 32-bit row numbers and strides.
bool try_decode_combine(const CombinePlan& plan, int vec, cudaStream_t stream) {
  const int64_t elem = dtype_size(plan.rows->dtype), K = plan.top_k;
  const int wide = int(16 / elem), narrow = four_byte_vec(elem);
  const int v = K <= 4 ? wide : narrow;
  const TensorView &index = *plan.index, &weights = *plan.weights;
  const auto fits32 = [](int64_t x) { return x >= 0 && x < (int64_t(1) << 31); };
  const bool k_contiguous = K <= 1 || (index.strides[1] == 1 && weights.strides[1] == 1);
  if (K > 8 || vec < v || plan.tokens > 65535 || !k_contiguous || !fits32(plan.tokens * index.strides[0]) ||
      !fits32(plan.tokens * weights.strides[0]) || !fits32(plan.rows->strides[0]) || !fits32(plan.num_rows))
    return false;
  DecodeCombineArgs p{};
  p.rows = plan.rows->data;
  p.index = index.data;
  p.weights = weights.data;
  p.out = plan.out->data;
  p.index_stride = int(index.strides[0]);
  p.weights_stride = int(weights.strides[0]);
  p.out_stride = plan.out->strides[0];
  p.rows_stride = int(plan.rows->strides[0]);
  p.num_rows = int(plan.num_rows);
  p.top_k = int(K);
  p.vec_per_row = int(plan.width / v);
  p.index64 = index.dtype == DType::kInt64;
  p.weights_f32 = weights.dtype == DType::kFloat32;
  // Blocks of 128 threads, fewer where the grid would be under 16 blocks (H200, experiment: one
  // token 0.1-0.2 us faster at 64 than at 128 threads; at 16 tokens 64 replayed up to 0.3 us
  // slower in CUDA graphs, DeepSeek-V3 16 x 8 3.00 against 2.72).
  int threads = 128;
  while (threads > 32 && plan.tokens * ((p.vec_per_row + threads - 1) / threads) < 16) threads /= 2;
  const dim3 block(threads), grid(unsigned((p.vec_per_row + threads - 1) / threads), unsigned(plan.tokens));
  dispatch_dtype(plan.rows->dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kWide = 16 / sizeof(T), kNarrow = four_byte_vec(sizeof(T));
    if (K <= 2)
      launch(moe_combine_decode_kernel<T, kWide, 2>, grid, block, 0, stream, p);
    else if (K <= 4)
      launch(moe_combine_decode_kernel<T, kWide, 4>, grid, block, 0, stream, p);
    else
      launch(moe_combine_decode_kernel<T, kNarrow, 8>, grid, block, 0, stream, p);
  });
  return true;
}

}  // namespace

void moe_combine_cuda(const CombinePlan& plan, int vec, cudaStream_t stream) {
  CombineKernelArgs p{};
  p.rows = plan.rows->data;
  p.index = index_ptr(*plan.index);
  p.weights = ParamPtr{plan.weights->data, plan.weights->dtype == DType::kFloat32};
  p.out = plan.out->data;
  p.rows_stride = plan.rows->strides[0];
  p.out_stride = plan.out->strides[0];
  p.index_strides = strides_2d(*plan.index);
  p.weights_strides = strides_2d(*plan.weights);
  p.tokens = plan.tokens;
  p.num_rows = plan.num_rows;
  FUSEBOX_CHECK(plan.top_k < (int64_t(1) << 31), "index's top_k must be < 2^31; got ", plan.top_k);
  p.top_k = int(plan.top_k);
  p.vec_per_row = int(plan.width / vec);
  const auto& knobs = tuning_knobs();
  // Rows staged through shared memory (see moe_combine_kernel): sm_80+ (cp.async), 16-byte
  // vectors, unless FUSEBOX_MOE_STAGE=0; else held in registers.
  const bool can_stage = device_limits().major >= 8 && vec * dtype_size(plan.rows->dtype) == 16 &&
                         knobs.moe_stage.value_or(1) != 0;
  int items = vectors_per_thread(plan.top_k, p.vec_per_row, can_stage), chunk_threads = 0;
  // A grid of fewer blocks than SMs (decode): the decode kernel where it applies. Otherwise
  // (top-k over 8, strided index or weights, narrow vectors, a forced plan) this plan: one
  // vector a thread in chunks of a warp, so the token's row loads spread over more SMs
  // (b8747da: 1-7% faster at 1-16 tokens on an H100; 14% slower at 2048 tokens). From top-k 5,
  // 4-byte vectors held in registers: there one warp's chain of dependent instructions bounded
  // the 16-byte plan (ncu, 1 token x 6: one warp a block, about 750 instructions over 5100
  // cycles). H100, 1-16 tokens: 2-11% faster at top-k 6 and 8 (graph replay 3-24%); 3-6% slower
  // at top-k 2, which keeps 16 bytes.
  bool staged = can_stage;
  if (combine_grid(p.tokens, p.vec_per_row, items, 0).blocks() < device_limits().sm_count) {
    // A forced plan (FUSEBOX_MOE_ITEMS or _CHUNK) keeps the general kernel for tuning and tests.
    if (!knobs.moe_items && !knobs.moe_chunk && try_decode_combine(plan, vec, stream)) return;
    items = 1;
    chunk_threads = 32;
    const int narrow = four_byte_vec(dtype_size(plan.rows->dtype));
    if (plan.top_k > 4 && vec > narrow && plan.width / narrow <= int64_t(chunk_threads) * 65535) {
      vec = narrow;
      p.vec_per_row = int(plan.width / vec);
      staged = false;
    }
  }
  const int knob_items = knobs.moe_items.value_or(0);
  if (knob_items == 1 || knob_items == 2 || knob_items == 4) items = knob_items;
  const int knob_chunk = knobs.moe_chunk.value_or(-1);
  if (knob_chunk == 0 || knob_chunk == 32 || knob_chunk == 64 || knob_chunk == 128 || knob_chunk == 256)
    chunk_threads = knob_chunk;  // 0: the widest chunks
  // Staged rows at 1 or 4 vectors a thread in blocks of 128 threads: H200, 2048-8192 tokens,
  // top-k 8 2-5% faster (DeepSeek-V3 72.1 -> 68.9 us), top-k 2 0-2.5%; H100 within +-1%. At 2
  // vectors (top-k 5-6) 4-7% slower on the H200, 2% on the H100: those keep 256.
  const int block_threads = staged && items != 2 ? 128 : kBlockThreads;
  const CombineGrid grid_plan = combine_grid(p.tokens, p.vec_per_row, items, chunk_threads, block_threads);
  const ColumnSplit split = grid_plan.split;
  p.tokens_per_block = grid_plan.tokens_per_block;
  FUSEBOX_CHECK(split.chunks <= 65535, "rows' width ", plan.width, " is too wide for the combine kernel");
  const int64_t blocks = (p.tokens + p.tokens_per_block - 1) / p.tokens_per_block;
  FUSEBOX_CHECK(blocks < (int64_t(1) << 31), "too many tokens: ", p.tokens);
  const dim3 block(split.tpr, p.tokens_per_block);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(split.chunks));
  const size_t stage_bytes = size_t(block.x) * block.y * staged_slots(plan.top_k, items) * 16;
  dispatch_dtype(plan.rows->dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_vec<T>(vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      auto go = [&](auto items_c) {
        constexpr int I = decltype(items_c)::value;
        if constexpr (V * sizeof(T) == 16) {
          if (staged) return launch(moe_combine_kernel<T, V, I, true>, grid, block, stage_bytes, stream, p);
        }
        launch(moe_combine_kernel<T, V, I, false>, grid, block, 0, stream, p);
      };
      switch (items) {
        case 4: go(std::integral_constant<int, 4>{}); break;
        case 2: go(std::integral_constant<int, 2>{}); break;
        default: go(std::integral_constant<int, 1>{}); break;
      }
    });
  });
}

}  // namespace fusebox::cuda
