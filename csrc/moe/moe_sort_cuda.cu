// Mixture-of-experts dispatch sort: the (token, k) pairs ordered by expert in one launch of one
// block, a stable counting sort. Unfused, the same step is a radix sort of the flattened index,
// a histogram, a cumulative sum, a division for the tokens and an inverse permutation by index_put:
// eight or more launches a layer on a path the host already bounds (DeepSeek-V2-Lite's patched
// prefill waited on launches 17.5 ms of 48.1).
//
// Warp w owns the pairs [w * chunk, (w + 1) * chunk). Pass 1 counts each warp's pairs per bucket
// (expert, or one bucket past them for an index outside the experts) in shared memory; an
// exclusive scan in (bucket, warp) order turns the counts into each warp's first row per bucket;
// pass 2 re-reads the pairs 32 at a time in pair order, where lanes of one bucket (found by
// __match_any_sync) take consecutive rows by their lane order. Warp chunks and rounds follow pair
// order, so the result is the stable sort's. One block sorts DeepSeek-V2-Lite's 2048 x 6 pairs in
// 24 rounds a warp (12 a pass); the grouped GEMMs that follow take milliseconds.
#include "moe/moe_impl.h"
#include "moe/moe_operands.cuh"

namespace fusebox::cuda {
namespace {

constexpr int kMaxWarps = 32;
constexpr int kRounds = 8;  // rounds of 32 pairs a warp loads before it uses them (loads in flight)
// The counts' shared memory: under the 48 KB a block takes without an opt-in on every GPU, with
// room for the static scan scratch.
constexpr int kCountsBytes = 47 * 1024;

struct SortKernelArgs {
  IndexPtr index;
  int* row_token;
  int* offsets;
  int* pair_row;
  Strides2D index_strides, pair_row_strides;
  int64_t row_token_s, offsets_s;
  int pairs, top_k, num_experts, chunk;  // chunk: pairs of a warp, a multiple of 32
};

// The bucket of pair `pair`: its expert, or num_experts for an index outside the experts; -1 past
// the warp's last pair.
__device__ __forceinline__ int bucket_of(const SortKernelArgs& p, int pair, int end) {
  if (pair >= end) return -1;
  const int token = pair / p.top_k, k = pair - token * p.top_k;
  const int64_t e = p.index.load(p.index_strides.at(token, k));
  return e >= 0 && e < p.num_experts ? int(e) : p.num_experts;
}

// Exclusive prefix sums, in place, of the n cells visited in the order cell(0), cell(1), ...;
// every thread of the block calls it. Thread t sums a run of consecutive positions, the block
// scans the run sums (shuffles, then warp 0 over the warp totals), and each thread writes its
// run's prefixes.
template <typename Cell>
__device__ void block_exclusive_scan(int* cells, int n, Cell cell, int* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int first = min(n, int(threadIdx.x) * per_thread), last = min(n, first + per_thread);
  int run = 0;
  for (int i = first; i < last; ++i) run += cells[cell(i)];
  int inclusive = run;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int total = lane < warps ? warp_totals[lane] : 0;
    int before = total;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, before, off);
      if (lane >= off) before += v;
    }
    __syncwarp();
    if (lane < warps) warp_totals[lane] = before - total;
  }
  __syncthreads();
  int prefix = warp_totals[warp] + inclusive - run;
  for (int i = first; i < last; ++i) {
    const int c = cells[cell(i)];
    cells[cell(i)] = prefix;
    prefix += c;
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kMaxWarps * 32) moe_sort_kernel(const SortKernelArgs p) {
  // counts[warp * buckets + bucket]: a warp's pairs of each bucket, then the row of its first one.
  // Warp-major, so the lanes of a warp, which hold different buckets, hit different banks.
  extern __shared__ int counts[];
  __shared__ int warp_totals[kMaxWarps];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int buckets = p.num_experts + 1;
  int* const mine = counts + warp * buckets;
  for (int i = threadIdx.x; i < buckets * warps; i += blockDim.x) counts[i] = 0;
  const int begin = min(warp * p.chunk, p.pairs), end = min(begin + p.chunk, p.pairs);
  __syncthreads();
  pdl_wait();

  // 1. count (the loop is uniform over a warp: begin and end are the warp's)
  for (int base = begin; base < end; base += 32 * kRounds) {
    int bucket[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) bucket[r] = bucket_of(p, base + r * 32 + lane, end);
#pragma unroll
    for (int r = 0; r < kRounds; ++r)
      if (bucket[r] >= 0) atomicAdd(&mine[bucket[r]], 1);
  }
  __syncthreads();

  // 2. each warp's first row per bucket: prefix sums in (bucket, warp) order
  block_exclusive_scan(
      counts, buckets * warps, [=](int i) { return (i % warps) * buckets + i / warps; }, warp_totals);
  pdl_release();
  // expert e's rows end where the next bucket's begin (warp 0's first row of bucket e + 1)
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) p.offsets[e * p.offsets_s] = counts[e + 1];
  __syncthreads();  // before warp 0 moves its first rows on

  // 3. place the pairs in pair order
  const unsigned lanes_before = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32 * kRounds) {
    int bucket[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) bucket[r] = bucket_of(p, base + r * 32 + lane, end);
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      const unsigned peers = __match_any_sync(0xffffffffu, bucket[r]);
      const int rank = __popc(peers & lanes_before);
      const int row = bucket[r] >= 0 ? mine[bucket[r]] + rank : 0;
      __syncwarp();
      if (bucket[r] >= 0 && rank == 0) mine[bucket[r]] += __popc(peers);
      __syncwarp();
      if (bucket[r] >= 0) {
        const int pair = base + r * 32 + lane, token = pair / p.top_k, k = pair - token * p.top_k;
        p.row_token[row * p.row_token_s] = token;
        p.pair_row[p.pair_row_strides.at(token, k)] = bucket[r] < p.num_experts ? row : -1;
      }
    }
  }
}

}  // namespace

void moe_sort_cuda(const SortPlan& plan, cudaStream_t stream) {
  const int64_t max_cells = kCountsBytes / int64_t(sizeof(int)), buckets = plan.num_experts + 1;
  FUSEBOX_CHECK(buckets <= max_cells, "num_experts must be at most ", max_cells - 1, " (the sort counts pairs in ",
                kCountsBytes, " bytes of shared memory); got ", plan.num_experts);
  const int64_t pairs = plan.tokens * plan.top_k;
  SortKernelArgs p{};
  p.index = index_ptr(*plan.index);
  p.row_token = static_cast<int*>(plan.row_token->data);
  p.offsets = static_cast<int*>(plan.offsets->data);
  p.pair_row = static_cast<int*>(plan.pair_row->data);
  p.index_strides = strides_2d(*plan.index);
  p.pair_row_strides = strides_2d(*plan.pair_row);
  p.row_token_s = plan.row_token->strides[0];
  p.offsets_s = plan.offsets->strides[0];
  p.pairs = int(pairs);
  p.top_k = int(std::max<int64_t>(plan.top_k, 1));
  p.num_experts = int(plan.num_experts);
  // as many warps as the counts' memory holds, up to one per 32 pairs; at least one, which writes
  // the offsets (all zero) where there are no pairs
  const int warps = int(std::max<int64_t>(1, std::min<int64_t>({kMaxWarps, max_cells / buckets, (pairs + 31) / 32})));
  p.chunk = int(((pairs + warps - 1) / warps + 31) / 32 * 32);
  launch(moe_sort_kernel, dim3(1), dim3(warps * 32), size_t(buckets * warps) * sizeof(int), stream, p);
}

}  // namespace fusebox::cuda
