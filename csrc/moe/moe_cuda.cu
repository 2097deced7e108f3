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
          float x[VEC];
          if constexpr (STAGED)
            unpack(stage[(j * ITEMS + it) * threads + tid], x);
          else
            unpack(v[j][it], x);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {  // no fma: the product is rounded before the add, as unfused
            float product = __fmul_rn(w[j], x[i]);
            if (!p.weights.is_f32) product = round_to<T>(product);  // a 16-bit product tensor
            acc[it][i] = __fadd_rn(acc[it][i], product);
          }
        }
      }
    }
  }
  pdl_release();
  T* out = static_cast<T*>(p.out) + token * p.out_stride + first * VEC;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    if (first + it * int(blockDim.x) >= p.vec_per_row) break;
    if (out_of_range) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[it][i] = __int_as_float(0x7fc00000);
    }
    store_pack(out + it * blockDim.x * VEC, pack<T, VEC>(acc[it]));
  }
}

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
CombineGrid combine_grid(int64_t tokens, int vec_per_row, int items, int chunk_threads) {
  CombineGrid g{tokens, column_split(vec_per_row, items, false, kBlockThreads), 1};
  if (chunk_threads > 0) {  // a token's row over more, smaller chunks
    const int64_t need = (vec_per_row + items - 1) / items;
    g.split.tpr = int(std::min<int64_t>(chunk_threads, next_pow2(need)));
    g.split.chunks = (need + g.split.tpr - 1) / g.split.tpr;
  }
  g.tokens_per_block = std::max(1, kBlockThreads / g.split.tpr);
  return g;
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
  // A grid of fewer blocks than SMs (decode): one vector a thread in chunks of a warp, so the
  // token's row loads spread over more SMs (b8747da: 1-7% faster at 1-16 tokens on an H100;
  // 14% slower at 2048 tokens). From top-k 5, 4-byte vectors held in registers: there one
  // warp's chain of dependent instructions bounded the 16-byte plan (ncu, 1 token x 6: one warp
  // a block, about 750 instructions over 5100 cycles). H100, 1-16 tokens: 2-11% faster at
  // top-k 6 and 8 (graph replay 3-24%); 3-6% slower at top-k 2, which keeps 16 bytes.
  bool staged = can_stage;
  if (combine_grid(p.tokens, p.vec_per_row, items, 0).blocks() < device_limits().sm_count) {
    items = 1;
    chunk_threads = 32;
    const int narrow = std::max(1, 4 / int(dtype_size(plan.rows->dtype)));
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
  const CombineGrid grid_plan = combine_grid(p.tokens, p.vec_per_row, items, chunk_threads);
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
