// Mixture-of-experts dispatch sort: the (token, k) pairs ordered by expert, a stable counting
// sort. Unfused, the same step is a radix sort of the flattened index, a histogram, a cumulative
// sum, a division for the tokens and an inverse permutation by index_put: eight or more launches
// a layer on a path the host already bounds (DeepSeek-V2-Lite's patched prefill waited on
// launches 17.5 ms of 48.1).
//
// The pairs split into tiles of consecutive pairs, one block a tile, and a tile into warp chunks.
// Each warp counts its pairs per bucket (expert, or one bucket past them for an index outside the
// experts) in shared memory. A bucket's first row for a warp is then: the pairs of every lower
// bucket, plus this bucket's pairs in earlier tiles, plus those of the tile's earlier warps. With
// one tile the block has every count itself. With several, a counting launch first writes each
// tile's counts to the workspace, and every block sums the earlier tiles' and all tiles' counts
// from it (a few KB, from L2). Where launches use programmatic dependent launch (sm_90+) the
// blocks write their own tile's counts and wait at a grid barrier instead (one cooperative launch,
// all blocks resident: on an H100 3-10% faster with L2 flushed, from 3% slower to 14% faster in
// a CUDA graph, on an H200 5-13% and 1-11%; without that launch attribute 3-16% slower in a graph
// on an H100, so two launches there). On sm_90+ an index of up to 16 tiles of 256 pairs takes one
// cluster instead, whose blocks read each other's totals from shared memory after a cluster
// barrier. Each warp then takes its pairs 32 at a time in pair order (kept in registers from the
// count where they were one round, else read again), and lanes of one bucket (found by ballots)
// take consecutive rows by lane order: tiles, chunks and rounds follow pair order, so the result
// is the stable sort's.
//
// One block was 31.7 us at DeepSeek-V2-Lite's 2048 x 6 pairs on an H100 and 124.5 at OLMoE's
// 8192 x 8 (slower than torch.compile): one SM issued the scattered row stores and the dependent
// rounds of every pair. Tiles of 512 pairs (up to kMaxTiles) took them to 11.7 and 16.1 us;
// tiles of 1024 to 13.5 and 16.2, of 2048 to 18.4 and 19.7. Decode calls take kernels of their
// own: up to 32 pairs without shared memory or barriers (moe_sort_small_kernel), up to 128 with
// two barriers (moe_sort_ranked_kernel).
#include "moe/moe_impl.h"
#include "moe/moe_operands.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <limits>

namespace fusebox::cuda {
namespace {

constexpr int kMaxWarps = 32;      // the most a block takes: the one block of a small index; wide tiles
constexpr int kTileWarps = 16;     // of each block of a tiled sort, unless kMaxWarps spares step 2 rounds
constexpr int kBucketWarps = 8;    // of the one block, where it has many buckets
constexpr int kTilePairs = 512;    // a tile's pairs at least (FUSEBOX_MOE_SORT_TILE for tuning)
constexpr int kMaxTiles = 64;      // larger indexes take larger tiles
constexpr int kRounds = 8;         // rounds of 32 pairs a warp loads before it uses them
constexpr int kColumnBatch = 8;   // tile counts a thread loads before it adds them (step 2 of a tiled sort)
constexpr int kMaxClusterBlocks = 16;  // of a sort in one cluster (sm_90+: 8 portable, 16 with an opt-in)
constexpr int kClusterTilePairs = 256;  // a cluster block's pairs at most (FUSEBOX_MOE_SORT_TILE for tuning)
constexpr int kSmallPairs = 128;   // the most pairs the decode kernels take (FUSEBOX_MOE_SORT_SMALL, <= 128)
// Shared memory: the warps' counts and two arrays a bucket, under the 48 KB a block takes without
// an opt-in on every GPU, with room for the static scan scratch.
constexpr int kSmemBytes = 47 * 1024;
constexpr int64_t kMaxCells = kSmemBytes / int64_t(sizeof(int));

struct SortKernelArgs {
  IndexPtr index;
  int* row_token;
  int* offsets;
  int* pair_row;
  int* tile_counts;  // [tiles][buckets] (several tiles) or null (one)
  Strides2D index_strides, pair_row_strides;
  int64_t row_token_s, offsets_s;
  int pairs, top_k, num_experts, tile_pairs, chunk;  // chunk: pairs of a warp, a multiple of 32
  int slices, slice_tiles;  // step 2 of a tiled sort: each bucket's tiles in `slices` runs of `slice_tiles`
  int match_bits;  // bits of bucket + 1, which step 4 matches a ballot a bit
};

// How the pairs split: `tiles` blocks of `warps` warps, each warp `chunk` pairs of its tile's
// `tile_pairs`. A tiled sort needs tiles * buckets counts of workspace, rounded up to a multiple
// of 4 (the size moe_sort_workspace_size has always reported; no read needs it since 8a82df6).
struct SortTiles {
  int tiles = 1, warps = 1, tile_pairs = 0, chunk = 32;
  bool cluster = false;  // the tiles are one cluster's blocks: one launch, no workspace
  int slices = 1, slice_tiles = 1;
  int64_t column_rounds = 0;  // step 2's rounds of loads on the busiest thread
  int64_t workspace = 0;
};

// Step 2 of a tiled sort reads the [tiles][buckets] counts as (bucket, run of tiles) items, one
// a thread at a time, kColumnBatch loads in flight: the split whose busiest thread waits on the
// fewest rounds of loads (DeepSeek-V3, 64 tiles of 257 buckets: on 512 threads 5 rounds at runs of
// 8 tiles where whole columns take 8; on 1024 threads 3).
void split_columns(SortTiles& s, int64_t buckets) {
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int runs = 1; runs <= s.tiles; ++runs) {
    const int run = (s.tiles + runs - 1) / runs, used = (s.tiles + run - 1) / run;
    const int64_t items_a_thread = (buckets * used + 32 * s.warps - 1) / (32 * s.warps);
    const int64_t rounds = items_a_thread * ((run + kColumnBatch - 1) / kColumnBatch);
    if (rounds < best) {
      best = rounds;
      s.slices = used;
      s.slice_tiles = run;
    }
  }
  s.column_rounds = best;
}

// The tiles of a sort over many blocks of `warps` warps (tiles == 1: the index takes one block).
SortTiles tiled_plan(int64_t pairs, int64_t buckets, int64_t min_tile, int64_t warps, int64_t workspace_available) {
  SortTiles s;
  const int64_t tile_warps = std::min<int64_t>(warps, kMaxCells / buckets - 2);
  if (pairs <= min_tile || tile_warps < 1) return s;
  const int64_t align = 32 * tile_warps;
  const int64_t tile = (std::max(min_tile, (pairs + kMaxTiles - 1) / kMaxTiles) + align - 1) / align * align;
  const int64_t tiles = (pairs + tile - 1) / tile;
  const int64_t workspace = (tiles * buckets + 3) / 4 * 4;
  if (tiles <= 1 || workspace > workspace_available) return s;
  s.tiles = int(tiles);
  s.warps = int(tile_warps);
  s.tile_pairs = int(tile);
  s.chunk = int(tile / tile_warps);
  s.workspace = workspace;
  split_columns(s, buckets);
  return s;
}

SortTiles sort_tiles(int64_t pairs, int64_t buckets, int64_t workspace_available) {
  const TuningKnobs& knobs = tuning_knobs();
  const int64_t min_tile = std::max<int64_t>(32, knobs.moe_sort_tile.value_or(kTilePairs));
  // kTileWarps a block; kMaxWarps where that keeps the tiles (a tile of at least 32 pairs a
  // warp) and spares step 2 two or more rounds of loads. H100, L2 flushed, 16 warps against 8:
  // 5-17% faster on every prefill row (DeepSeek-V3 2048 x 8 12.94-12.99 -> 11.39-11.52 us,
  // Mixtral 2048 x 2 9.63-9.68 -> 9.12-9.17); 32 against 16 at DeepSeek-V3 8192 x 8 (5 rounds
  // -> 3) 14.56-14.66 -> 13.34-13.41, level at OLMoE's 8192 x 8 (2 -> 1), slower where the
  // tiles grow (DeepSeek-V3 2048 x 8, 32 tiles of 512 pairs -> 16 of 1024: 11.70-11.81).
  SortTiles s;
  if (knobs.moe_sort_warps) {
    const int forced = std::clamp(*knobs.moe_sort_warps, 1, kMaxWarps);
    s = tiled_plan(pairs, buckets, min_tile, forced, workspace_available);
  } else {
    s = tiled_plan(pairs, buckets, min_tile, kTileWarps, workspace_available);
    const SortTiles wide = tiled_plan(pairs, buckets, min_tile, kMaxWarps, workspace_available);
    if (s.tiles > 1 && wide.tiles == s.tiles && wide.warps > s.warps && s.column_rounds - wide.column_rounds >= 2)
      s = wide;
  }
  if (s.tiles > 1) return s;
  // one block: a warp per 32 pairs, and at least one per 32 buckets up to kBucketWarps (the
  // per-bucket steps spread over them: H100, one token of DeepSeek-V3's 256 experts 8.2 -> 6.7 us
  // at 8 warps, of 64 experts 6.5 -> 6.2 at 2; Mixtral's 8 keep one), as many as the counts'
  // memory holds; at least one, which writes the offsets (all zero) where there are no pairs
  const int64_t bucket_warps = std::min<int64_t>(kBucketWarps, buckets / 32);
  s.warps = int(std::max<int64_t>(
      1, std::min<int64_t>({kMaxWarps, kMaxCells / buckets - 2, std::max(bucket_warps, (pairs + 31) / 32)})));
  s.tile_pairs = int(pairs);
  s.chunk = int(((pairs + s.warps - 1) / s.warps + 31) / 32 * 32);
  return s;
}

// A tiled sort as one cluster of at most `max_blocks` blocks of at most kClusterTilePairs pairs, a
// warp per 32 (a plan of one tile where it takes more). H100, L2 flushed / CUDA graph, against the
// two launches: Mixtral 2048 x 2 (16 blocks of 256) 9.76 -> 8.24 us / 5.28 -> 4.65; at 768 pairs a
// block (DeepSeek-V2-Lite 2048 x 6) 10.19 -> 9.90 but 5.84 -> 6.50 in a graph, at 4096 (DeepSeek-V3
// 8192 x 8) 14.56 -> 19.68: 16 SMs issue the scattered row stores that 64 share in two launches.
SortTiles cluster_plan(int64_t pairs, int64_t buckets, int max_blocks) {
  SortTiles s;
  const TuningKnobs& knobs = tuning_knobs();
  const int64_t most_warps = std::min<int64_t>(std::clamp(knobs.moe_sort_warps.value_or(kMaxWarps), 1, kMaxWarps),
                                               kMaxCells / buckets - 3);
  const int64_t max_tile = std::max<int64_t>(32, knobs.moe_sort_tile.value_or(kClusterTilePairs));
  if (max_blocks < 2 || most_warps < 1 || pairs > max_blocks * max_tile) return s;
  const int64_t blocks = std::min<int64_t>(max_blocks, (pairs + max_tile - 1) / max_tile);
  const int64_t block_pairs = (pairs + blocks - 1) / blocks;
  const int64_t warps = std::min<int64_t>(most_warps, (block_pairs + 31) / 32);
  const int64_t tile = (block_pairs + 32 * warps - 1) / (32 * warps) * (32 * warps);
  const int64_t tiles = (pairs + tile - 1) / tile;
  if (tiles < 2 || tile / warps > 32 * kRounds) return s;
  s.tiles = int(tiles);
  s.warps = int(warps);
  s.tile_pairs = int(tile);
  s.chunk = int(tile / warps);
  s.cluster = true;
  return s;
}

// The bucket of pair `pair`: its expert, or num_experts for an index outside the experts; -1 past
// `end`.
__device__ __forceinline__ int bucket_of(const SortKernelArgs& p, int pair, int end) {
  if (pair >= end) return -1;
  const int token = pair / p.top_k, k = pair - token * p.top_k;
  const int64_t e = p.index.load(p.index_strides.at(token, k));
  return e >= 0 && e < p.num_experts ? int(e) : p.num_experts;
}

// One round of a thread's pairs: bucket[r] of pair base + r * step + offset (-1 past `end`), all
// loads in flight before the first is used.
__device__ __forceinline__ void load_round(const SortKernelArgs& p, int (&bucket)[kRounds], int base, int end,
                                           int step, int offset) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r) bucket[r] = bucket_of(p, base + r * step + offset, end);
}

__device__ __forceinline__ void count_round(int* counts, const int (&bucket)[kRounds]) {
#pragma unroll
  for (int r = 0; r < kRounds; ++r)
    if (bucket[r] >= 0) atomicAdd(&counts[bucket[r]], 1);
}

// Adds the pairs [begin, end) to counts[bucket], `step` threads (this one at `offset`) taking
// consecutive pairs, kRounds of them loaded before the first add (loads in flight). The loop is
// uniform over the threads that share begin and end.
__device__ __forceinline__ void count_pairs(const SortKernelArgs& p, int* counts, int begin, int end, int step,
                                            int offset) {
  for (int base = begin; base < end; base += step * kRounds) {
    int bucket[kRounds];
    load_round(p, bucket, base, end, step, offset);
    count_round(counts, bucket);
  }
}

// Exclusive prefix sums of cells[0, n), in place; every thread of the block calls it. Thread t
// sums a run of consecutive cells, the block scans the run sums (shuffles, then warp 0 over the
// warp totals), and each thread writes its run's prefixes.
__device__ void block_exclusive_scan(int* cells, int n, int* warp_totals) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int first = min(n, int(threadIdx.x) * per_thread), last = min(n, first + per_thread);
  int run = 0;
  for (int i = first; i < last; ++i) run += cells[i];
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
    const int c = cells[i];
    cells[i] = prefix;
    prefix += c;
  }
  __syncthreads();
}

// A tiled sort's first launch: each tile's pairs per bucket, to tile_counts[tile][bucket].
__global__ void __launch_bounds__(kMaxWarps * 32) moe_sort_count_kernel(const SortKernelArgs p) {
  extern __shared__ int counts[];
  const int buckets = p.num_experts + 1;
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) counts[b] = 0;
  const int begin = blockIdx.x * p.tile_pairs, end = min(begin + p.tile_pairs, p.pairs);
  __syncthreads();
  pdl_wait();
  count_pairs(p, counts, begin, end, blockDim.x, threadIdx.x);
  pdl_release();
  __syncthreads();
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) p.tile_counts[int64_t(blockIdx.x) * buckets + b] = counts[b];
}

// The lanes whose `label` (below 2^bits) equals this lane's, a ballot a bit. In place of
// __match_any_sync: H100, L2 flushed, level in two launches (1% slower to 2% faster: DeepSeek-V3
// 8192 x 8 14.56 -> 14.24 us), 7-8% faster in a cluster's blocks of 4096 pairs (18.62 -> 17.20).
__device__ __forceinline__ unsigned match_by_ballots(int label, int bits) {
  unsigned peers = 0xffffffffu;
  for (int i = 0; i < bits; ++i) {
    const bool set = (label >> i) & 1;
    const unsigned voted = __ballot_sync(0xffffffffu, set);
    peers &= set ? voted : ~voted;
  }
  return peers;
}

// Distributed shared memory of a cluster (sm_90+): a barrier of all its blocks in two halves
// (arrive releases this block's shared writes, wait acquires the others'), and loads of another
// block's shared memory.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The int at `cell` of this block's shared memory, read from block `rank` of the cluster.
__device__ __forceinline__ int load_cluster_shared(const int* cell, int rank) {
  int v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned local = unsigned(__cvta_generic_to_shared(cell));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
#endif
  return v;
}

// How the blocks of a sort over several tiles learn the other tiles' counts: from a counting
// launch before (kLaunches), from each other's shared memory in one cluster (kCluster: sm_90+,
// block x is the cluster's rank x), or from the workspace after a grid barrier (kGrid: a
// cooperative launch, every block resident).
enum class SortMode { kLaunches, kCluster, kGrid };

// At most 64 registers, so that a block of kMaxWarps warps fits an SM. Given as __launch_bounds__
// (kMaxWarps * 32) instead, ptxas held the kernel to 32 and spilled the kept buckets of step 1.
template <SortMode kMode>
__global__ void __maxnreg__(64) moe_sort_kernel(const SortKernelArgs p) {
  constexpr bool kCluster = kMode == SortMode::kCluster, kGrid = kMode == SortMode::kGrid;
  // counts[warp * buckets + bucket]: a warp's pairs of each bucket, then the row of its first one.
  // Warp-major, so the lanes of a warp, which hold different buckets, hit different banks.
  // first[bucket]: the bucket's pairs (in all tiles), then the row of its first one.
  // earlier[bucket]: the bucket's pairs in earlier tiles.
  // totals[bucket] (kCluster): the tile's pairs of the bucket, which the cluster's blocks read.
  extern __shared__ int smem[];
  __shared__ int warp_totals[kMaxWarps];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int buckets = p.num_experts + 1;
  int* const counts = smem;
  int* const first = smem + warps * buckets;
  int* const earlier = first + buckets;
  int* const totals = earlier + buckets;
  int* const mine = counts + warp * buckets;
  for (int i = threadIdx.x; i < (warps + 2) * buckets; i += blockDim.x) smem[i] = 0;
  const int tile_end = min((blockIdx.x + 1) * p.tile_pairs, p.pairs);
  const int begin = min(blockIdx.x * p.tile_pairs + warp * p.chunk, tile_end), end = min(begin + p.chunk, tile_end);
  __syncthreads();
  pdl_wait();

  // 1. count (begin and end are the warp's). A warp of one round keeps its buckets in registers
  // for step 4 rather than loading them again (decode: one L2 round trip less on the chain).
  const bool one_round = end - begin <= 32 * kRounds;
  int bucket[kRounds];
  if (one_round) {
    load_round(p, bucket, begin, end, 32, lane);
    count_round(mine, bucket);
  } else {
    count_pairs(p, mine, begin, end, 32, lane);
  }

  // 2. every bucket's pairs, and those in earlier tiles
  if (kCluster || kGrid || p.tile_counts == nullptr) {
    __syncthreads();
    for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
      int sum = 0;
      for (int w = 0; w < warps; ++w) sum += counts[w * buckets + b];
      // kGrid: this tile's counts go to the workspace, read with the other tiles' after the barrier
      (kGrid ? p.tile_counts + int64_t(blockIdx.x) * buckets : kCluster ? totals : first)[b] = sum;
    }
  }
  if constexpr (kGrid) cooperative_groups::this_grid().sync();
  if constexpr (kCluster) {
    // Each tile's totals from its block's shared memory, all ranks' loads in flight. The other
    // blocks read this block's totals until the barrier's second half, at the kernel's end.
    cluster_arrive();
    cluster_wait();
    for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
      int c[kMaxClusterBlocks];
#pragma unroll
      for (int r = 0; r < kMaxClusterBlocks; ++r) c[r] = r < int(gridDim.x) ? load_cluster_shared(totals + b, r) : 0;
      int total = 0, before = 0;
#pragma unroll
      for (int r = 0; r < kMaxClusterBlocks; ++r) {
        total += c[r];
        before += r < int(blockIdx.x) ? c[r] : 0;
      }
      first[b] = total;
      earlier[b] = before;
    }
    cluster_arrive();
  } else if (p.tile_counts != nullptr) {
    // Column sums of the [tiles][buckets] counts: a thread takes one bucket's counts over a run
    // of tiles (split_columns; consecutive threads consecutive buckets: coalesced loads), sums
    // them in registers and adds the sums once. Before, each thread added every count it
    // loaded by shared atomics, with 4-way bank conflicts and a division a count. H100, CUDA
    // graph: DeepSeek-V3 8192 x 8 17.98-18.42 -> 14.23-14.42 us, 2048 x 8 11.60-11.97 ->
    // 9.26-9.43, OLMoE 8192 x 8 10.39-10.73 -> 8.96-9.02, Mixtral's 9 buckets 3-5% faster.
    const int tiles = gridDim.x;
    for (int item = threadIdx.x; item < buckets * p.slices; item += blockDim.x) {
      const int b = item % buckets, slice = item / buckets;
      const int t0 = slice * p.slice_tiles, t1 = min(tiles, t0 + p.slice_tiles);
      int total = 0, before = 0;
      for (int t = t0; t < t1; t += kColumnBatch) {
        int c[kColumnBatch];
#pragma unroll
        for (int r = 0; r < kColumnBatch; ++r)
          c[r] = t + r >= t1 ? 0
                 : kGrid ? __ldcg(p.tile_counts + int64_t(t + r) * buckets + b)  // written in this launch
                         : __ldg(p.tile_counts + int64_t(t + r) * buckets + b);
#pragma unroll
        for (int r = 0; r < kColumnBatch; ++r) {
          total += c[r];
          before += t + r < int(blockIdx.x) ? c[r] : 0;
        }
      }
      if (total != 0) atomicAdd(&first[b], total);
      if (before != 0) atomicAdd(&earlier[b], before);
    }
  }
  __syncthreads();

  // 3. each bucket's first row, then each warp's: the lower buckets' pairs, then the earlier
  // tiles' and warps' of this bucket
  block_exclusive_scan(first, buckets, warp_totals);
  pdl_release();
  // expert e's rows end where the next bucket's begin
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) p.offsets[e * p.offsets_s] = first[e + 1];
  for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
    int row = first[b] + earlier[b];
    for (int w = 0; w < warps; ++w) {
      const int c = counts[w * buckets + b];
      counts[w * buckets + b] = row;
      row += c;
    }
  }
  __syncthreads();

  // 4. place the pairs in pair order
  const unsigned lanes_before = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32 * kRounds) {
    if (!one_round) load_round(p, bucket, base, end, 32, lane);  // one round: held since step 1
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      if (base + r * 32 >= end) break;  // uniform over the warp
      const unsigned peers = match_by_ballots(bucket[r] + 1, p.match_bits);
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
  if constexpr (kCluster) cluster_wait();  // no block leaves while another may read its totals
}

// The sort of at most 32 pairs (decode), without shared memory or block barriers: each warp
// loads every pair's bucket (lane l holds pair l) as a key bucket * 128 + pair, which orders the
// pairs as the stable sort does. A pair's row is then the number of keys below its own, and
// expert e's end offset the number below (e + 1) * 128: every thread takes the keys one lane at a
// time by shuffles and counts. Warp 0 places the pairs; thread t writes expert t's offset. H100,
// CUDA-graph replay against an empty launch's 1.24 us: one token 2.4-3.2 us in the one-block
// kernel's chain (zeroing, counting atomics, a block scan, the barriers between them), 1.25-1.47
// here.
constexpr int kSmallKeyBits = 7;  // of the pair, in a key
constexpr int kNoKey = 0x7fffffff;  // past the pairs: above every key and limit

__device__ __forceinline__ int small_sort_key(const SortKernelArgs& p, int pair) {
  return pair < p.pairs ? (bucket_of(p, pair, p.pairs) << kSmallKeyBits) | pair : kNoKey;
}

// Writes the pair of key `key` (not kNoKey) at row `row`.
__device__ __forceinline__ void place_small(const SortKernelArgs& p, int key, int row) {
  const int pair = key & ((1 << kSmallKeyBits) - 1), bucket = key >> kSmallKeyBits;
  const int token = pair / p.top_k, k = pair - token * p.top_k;
  p.row_token[row * p.row_token_s] = token;
  p.pair_row[p.pair_row_strides.at(token, k)] = bucket < p.num_experts ? row : -1;
}

__global__ void __launch_bounds__(kMaxWarps * 32) moe_sort_small_kernel(const SortKernelArgs p) {
  const int lane = threadIdx.x & 31;
  pdl_wait();
  const int key = small_sort_key(p, lane);
  pdl_release();
  const int limit = int(threadIdx.x + 1) << kSmallKeyBits;  // keys of buckets up to expert threadIdx.x
  int row = 0, below = 0;
  for (int j = 0; j < p.pairs; ++j) {
    const int k = __shfl_sync(0xffffffffu, key, j);
    row += k < key;
    below += k < limit;
  }
  if (int(threadIdx.x) < p.num_experts) p.offsets[threadIdx.x * p.offsets_s] = below;
  if (threadIdx.x < 32 && key != kNoKey) place_small(p, key, row);
}

// The sort of 33 to 32 * kKeyWarps pairs (16 decode tokens of top-6 or top-8): the same keys, through
// shared memory. Warp w loads the keys of pairs [32w, 32w + 32); after one barrier each counts,
// by 16-byte broadcast reads, the keys below its own (its row), places its pair and files the key
// at that row; after a second, expert e's end offset is a binary search of the sorted keys.
// H100, CUDA graph: 16 tokens of top-6 and top-8 2.63-3.05 us in the one-block kernel, 1.95-2.00
// here (empty launch 1.20); counting every key for every expert by shuffles, as the one-round
// kernel does, was level with the one-block kernel at 128 pairs.
template <int kKeyWarps>
__global__ void __launch_bounds__(kMaxWarps * 32) moe_sort_ranked_kernel(const SortKernelArgs p) {
  static_assert(32 * kKeyWarps <= (1 << kSmallKeyBits), "a pair must fit its key bits");
  __shared__ __align__(16) int keys[32 * kKeyWarps];
  __shared__ int sorted[32 * kKeyWarps];
  const int warp = threadIdx.x >> 5;
  pdl_wait();
  int key = kNoKey;
  if (warp < kKeyWarps) {
    key = small_sort_key(p, int(threadIdx.x));
    keys[threadIdx.x] = key;
  }
  pdl_release();
  __syncthreads();
  if (key != kNoKey) {
    const int4* keys4 = reinterpret_cast<const int4*>(keys);
    int row = 0;
#pragma unroll
    for (int j = 0; j < 8 * kKeyWarps; ++j) {
      const int4 k = keys4[j];
      row += (k.x < key) + (k.y < key) + (k.z < key) + (k.w < key);
    }
    sorted[row] = key;
    place_small(p, key, row);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    const int limit = (e + 1) << kSmallKeyBits;
    int below = 0;  // the first sorted key at or above limit
    for (int n = p.pairs; n > 0;) {
      const int half = n >> 1;
      if (sorted[below + half] < limit) {
        below += half + 1;
        n -= half + 1;
      } else {
        n = half;
      }
    }
    p.offsets[e * p.offsets_s] = below;
  }
}

// The most blocks of a sort's cluster on this device: 16 where clusters of 16 one-SM blocks fit
// (H100, H200), else the portable 8; 0 before sm_90. FUSEBOX_MOE_SORT_CLUSTER caps it.
int max_cluster_blocks() {
  static PerDevice<int> most;
  if (device_limits().major < 9) return 0;
  const int blocks = most.get([](int) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kMaxClusterBlocks);
    cfg.blockDim = dim3(kMaxWarps * 32);
    cfg.dynamicSmemBytes = kSmemBytes;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim = {unsigned(kMaxClusterBlocks), 1, 1};
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    const auto kernel = moe_sort_kernel<SortMode::kCluster>;
    const bool allowed =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
    (void)cudaGetLastError();  // a refused size is not an error: the portable one stays
    return allowed ? kMaxClusterBlocks : 8;
  });
  const int knob = tuning_knobs().moe_sort_cluster.value_or(kMaxClusterBlocks);
  return std::min(blocks, std::clamp(knob, 0, kMaxClusterBlocks));
}

// The most blocks of a sort in one cooperative launch on this device: as many as are resident at
// once at the largest block and shared memory a tile takes (64 regs a thread: one block an SM at
// least); 0 without cooperative launches, and by default without programmatic dependent launch
// (FUSEBOX_MOE_SORT_GRID=0 / =1 override that).
int max_grid_blocks() {
  static PerDevice<int> most;
  if (tuning_knobs().moe_sort_grid.value_or(use_pdl() ? 1 : 0) != 1) return 0;
  return most.get([](int device) {
    int cooperative = 0, per_sm = 0;
    const bool ok =
        cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device) == cudaSuccess && cooperative &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_sort_kernel<SortMode::kGrid>, kMaxWarps * 32,
                                                      kSmemBytes) == cudaSuccess;
    (void)cudaGetLastError();
    return ok ? per_sm * device_limits().sm_count : 0;
  });
}

// Bits of the largest of 0..n.
int bit_width(int64_t n) {
  int bits = 0;
  while ((int64_t(1) << bits) <= n) ++bits;
  return bits;
}

void check_experts(int64_t num_experts) {
  // one warp's counts and the two bucket arrays must fit the shared memory
  const int64_t most = kMaxCells / 3 - 1;
  FUSEBOX_CHECK(num_experts <= most, "num_experts must be at most ", most, " (the sort counts pairs in ", kSmemBytes,
                " bytes of shared memory); got ", num_experts);
}

// Whether the decode kernels take the index: one block, no tiles.
bool takes_small_kernel(int64_t pairs, int64_t num_experts) {
  const int64_t small = std::min<int64_t>(128, tuning_knobs().moe_sort_small.value_or(kSmallPairs));
  return small > 0 && pairs <= small && num_experts <= kMaxWarps * 32;
}

// The tiles a sort launches on the current device with `workspace` counts at hand: one cluster
// where it can (no workspace), else tiles in two launches where the workspace holds their counts,
// else one block.
SortTiles launch_tiles(int64_t pairs, int64_t buckets, int64_t workspace) {
  const SortTiles tiles = sort_tiles(pairs, buckets, std::numeric_limits<int64_t>::max());
  if (tiles.tiles <= 1) return tiles;
  const SortTiles cluster = cluster_plan(pairs, buckets, max_cluster_blocks());
  if (cluster.cluster) return cluster;
  return tiles.workspace > workspace ? sort_tiles(pairs, buckets, workspace) : tiles;
}

}  // namespace

int64_t moe_sort_workspace_size(int64_t tokens, int64_t top_k, int64_t num_experts, bool for_current_device) {
  check_experts(num_experts);
  const int64_t pairs = tokens * top_k, buckets = num_experts + 1;
  if (!for_current_device) return sort_tiles(pairs, buckets, std::numeric_limits<int64_t>::max()).workspace;
  if (takes_small_kernel(pairs, num_experts)) return 0;
  const SortTiles tiles = launch_tiles(pairs, buckets, std::numeric_limits<int64_t>::max());
  return tiles.cluster ? 0 : tiles.workspace;
}

void moe_sort_cuda(const SortPlan& plan, cudaStream_t stream) {
  check_experts(plan.num_experts);
  const int64_t pairs = plan.tokens * plan.top_k, buckets = plan.num_experts + 1;
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
  if (takes_small_kernel(pairs, plan.num_experts)) {
    // 1, 2 or 4 warps of keys, which the block must hold besides a warp per 32 experts
    const int key_warps = pairs <= 32 ? 1 : pairs <= 64 ? 2 : 4;
    const dim3 block(32 * int(std::max<int64_t>(key_warps, (plan.num_experts + 31) / 32)));
    if (key_warps == 1)
      launch(moe_sort_small_kernel, dim3(1), block, 0, stream, p);
    else if (key_warps == 2)
      launch(moe_sort_ranked_kernel<2>, dim3(1), block, 0, stream, p);
    else
      launch(moe_sort_ranked_kernel<4>, dim3(1), block, 0, stream, p);
    return;
  }
  const TensorView* ws = plan.workspace;
  const SortTiles tiles = launch_tiles(pairs, buckets, ws != nullptr && ws->defined() ? ws->shape[0] : 0);
  p.tile_counts = tiles.tiles > 1 && !tiles.cluster ? static_cast<int*>(ws->data) : nullptr;
  p.tile_pairs = tiles.tile_pairs;
  p.chunk = tiles.chunk;
  p.slices = tiles.slices;
  p.slice_tiles = tiles.slice_tiles;
  p.match_bits = bit_width(buckets);
  // the warps' counts and two arrays a bucket, a third for a cluster's totals
  const size_t smem = size_t((tiles.warps + 2 + tiles.cluster) * buckets) * sizeof(int);
  const dim3 grid(tiles.tiles), block(tiles.warps * 32);
  if (tiles.cluster) {
    launch_with(LaunchOptions{use_pdl(), unsigned(tiles.tiles)}, moe_sort_kernel<SortMode::kCluster>, grid, block, smem,
                stream, p);
    return;
  }
  if (tiles.tiles > 1 && tiles.tiles <= max_grid_blocks()) {
    launch_with(LaunchOptions{use_pdl(), 1, true}, moe_sort_kernel<SortMode::kGrid>, grid, block, smem, stream, p);
    return;
  }
  if (tiles.tiles > 1)
    launch(moe_sort_count_kernel, grid, block, size_t(buckets) * sizeof(int), stream, p);
  launch(moe_sort_kernel<SortMode::kLaunches>, grid, block, smem, stream, p);
}

}  // namespace fusebox::cuda
