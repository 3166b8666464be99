// Every decoder layer of a Llama-style model for one token (batch 1) in one persistent kernel
// (qops.models.layer_kernel, op qops::decode_layers): RMSNorm -> [q; k; v] W4A16 projection ->
// rotary + KV-cache write + grouped-query attention -> o projection + residual add -> RMSNorm ->
// [gate; up] projection with silu(gate) * up -> down projection + residual add, layer after layer.
//
// Why one kernel. At batch 1 a layer's four matmuls stream ~109 MB of 4-bit weights (Llama-3-8B
// shapes), ~25 us at the H200's copy bandwidth, but as ~8 kernels a layer the step spends ~50 us: each
// matmul starts cold behind a small kernel (its first weights requested only once it is resident),
// and the small projections are mostly start-up (benchmarks/NOTES.md, stops 21, 29, 41). Weights do not
// depend on activations, so here each warp prefetches its coming weights into L2 QOPS_PF stages ahead of
// its loads, and the next projection's first QOPS_PF stages as a projection ends, so they are requested
// while the block finishes, the grid waits at a barrier or runs the attention (which reads no weights).
//
// Grid: QOPS_BPS blocks an SM of QOPS_WARPS warps: one of 8 (up to 255 registers a thread), or 16 warps an
// SM at <= 128 (two blocks of 8 or one of 16);
// the host launches QOPS_BPS x SMs blocks after the occupancy calculator says that many fit an SM, since
// every block must be resident at once for the grid barriers below. Threads synchronize within a block
// with named barrier 1.
//
// Weights: qops' runtime int-weight layout, 4-bit, qweight in 32-column slabs (qops/ops/int_weight.py,
// w4.cuh): word (kw, n) of slab s at (s * KW + kw) * 32 + n % 32 holds rows 8 kw .. 8 kw + 7 of column n;
// scales (n_groups, N) float16 or bfloat16; qzeros (n_groups, N / 8) nibbles (zero = nibble +
// zero_offset) or none (zero 8); groups a multiple of 128 rows, or one group. No act-order, no bias
// (the host refuses those).
//
// Work of a projection: units of (column group, 128-row chunk), a column group one 32-column slab (for
// [gate; up]: gate slab j with up slab j + I/32, so silu(gate) * up is computed where both sums meet).
// The U units, column group major, are split evenly over the G blocks: block b takes
// [floor(b U / G), floor((b + 1) U / G)), so every block streams the same bytes (+-1 unit) whatever the
// shape; a column group then spans one to three blocks. A block's units go to its W warps in stages of W
// (unit w of each stage to warp w; [gate; up]: pair w / 2's gate (w even) or up slab-chunk), each warp
// loading its next unit into registers while it computes the current one.
//
// A slab-chunk in registers: lane (r, c) = (lane / 4, lane % 4) holds word rows 4c + j (j = 0..3),
// columns 4r .. 4r + 3 (four 16-byte loads; a warp's load j reads four 128-byte rows), the four
// columns' scales and their zero word. The MMA (m16n8k16, fp32 accumulation): A is the weight, its 16
// rows the columns (tile e = 0, 1 of a lane: rows r and r + 8 are columns 4r + 2e and 4r + 2e + 1), its
// K order permuted so that lane c's k values come from its own words: in 16-row step 2j + s, lane c's
// logical k pair (2c, 2c + 1) is physical rows 32c + 8j + 2s + {0, 4}, pair (2c + 8, 2c + 9) rows
// 32c + 8j + 2s + {1, 5} (the nibble order of w4.cuh's magic-number decode: word pairs (q0, q4),
// (q1, q5), (q2, q6), (q3, q7)). B is x from shared memory with the same permutation, every B column
// holding x (so every lane's C holds the sums).
//
// A first version streamed the weights through a shared-memory ring filled by a producer warp's bulk
// copies (one per 2 KiB chunk and its scales and zeros, then one per 16 KiB stage): the stream alone
// reached 0.7-2.2 TB/s, a fixed cost of ~0.34 us a stage per SM (benchmarks/NOTES.md, stop 46).
//
// Reduction of a column group over its blocks (fixed order: bit-identical run to run): each block sums
// its warps' partials in warp order in shared memory; a block holding a whole column group finishes it
// (epilogue below) at once, otherwise it writes its fp32 partial to the workspace at (group, first
// chunk), and the last of the group's blocks to arrive (an arrival counter per group, acq_rel: no
// fences; reset by that block) sums the partials in chunk order and finishes. Epilogues: [q; k; v] rounded to the dtype;
// o and down: h = round(h + round(sum)) (the residual stream, in place); [gate; up]: round(silu(g) u)
// from the fp32 sums.
//
// Attention (after a grid barrier): block b < NKV * NSPLIT takes KV head b / NSPLIT and the b % NSPLIT-th
// share of the cache positions 0 .. pos - 1, of the min(NSPLIT, ceil(pos / 16)) shares the position
// needs (blocks past those wait at the next barrier); it rotates its GQ query heads and the new key (fp32 math,
// rounded to the dtype, as qops::decode_attention), share 0 writes the new key and value to the cache
// at pos, the last share also attends to the new token from registers (no block reads position pos
// back). Each warp keeps an online softmax per query head over its positions; warps, then shares
// (through the workspace and an arrival counter per KV head) merge in order. Scores, softmax and sums
// are fp32.
//
// Grid barrier: an arrival count in the workspace that only grows within a launch; each block adds one
// (release) and spins until the count reaches (barriers passed) x G (relaxed reads, then an acquire
// fence). Every call's host copy zeroes it. Activations written by one block and read by another go
// through L2 (ld.global.cg), never through a possibly stale L1.
//
// Compile-time configuration: QOPS_DT (0 f16, 1 bf16), QOPS_SDT (the scales' dtype, the same codes),
// QOPS_HAS_Z (0/1: qzeros present), QOPS_HD (head dim, a multiple of 32 up to 256), QOPS_GQ (query heads
// per KV head), QOPS_PF (stages of L2 prefetch ahead), QOPS_AHEAD (stages of register loads ahead),
// QOPS_BPS (blocks an SM), QOPS_WARPS (warps a block), QOPS_PROBE and QOPS_STAMPS (measurements,
// below). sm_80 and later.
#include "ptx.cuh"
#include "w4.cuh"

#ifndef QOPS_DT
#define QOPS_DT 1
#endif
#ifndef QOPS_HAS_Z
#define QOPS_HAS_Z 0
#endif
#ifndef QOPS_SDT
#define QOPS_SDT QOPS_DT
#endif
#ifndef QOPS_HD
#define QOPS_HD 128
#endif
#ifndef QOPS_GQ
#define QOPS_GQ 4
#endif
#ifndef QOPS_PF
// L2 prefetch distance, stages; 0 compiles the loop's prefetch out: at e38353f 0 measured 82.6 us a layer
// against 92.5 with 4 (the prefetch's per-stage address arithmetic costs the instruction-bound loop more
// than its L2 hits give; benchmarks/NOTES.md stop 47). Earlier, at two blocks an SM, 4 gave 106.2, 2 106.6,
// 8 110.4 (948a100), and 4 124, 12 140, 0 134 before the loop kept its state in registers (091c647).
#define QOPS_PF 0
#endif
#ifndef QOPS_STAMPS
#define QOPS_STAMPS 0
#endif
#ifndef QOPS_PROBE
#define QOPS_PROBE 0
#endif
#ifndef QOPS_BPS
#define QOPS_BPS 1
#endif
#ifndef QOPS_WARPS
#define QOPS_WARPS 8
#endif
#ifndef QOPS_AHEAD
// 8 warps an SM have the registers for two stages in flight (100.6 us a Llama-3-8B layer against 106.8
// with one); 16 (at <= 128 registers) spill with two (stop 47).
#define QOPS_AHEAD (QOPS_BPS * QOPS_WARPS == 8 ? 2 : 1)
#endif

namespace qops {
namespace layers {

constexpr int DT = QOPS_DT;
constexpr int SDT = QOPS_SDT;  // the scales' dtype
constexpr int HD = QOPS_HD;
constexpr int GQ = QOPS_GQ;
constexpr int kPrefetchStages = QOPS_PF;  // stages a warp's L2 prefetch runs ahead of its loads
constexpr int kAhead = QOPS_AHEAD;         // stages a warp's register loads run ahead of its math (1..3)
static_assert(kAhead >= 1 && kAhead <= 3, "QOPS_AHEAD is 1, 2 or 3");
// Blocks an SM (the host launches QOPS_BPS x SMs blocks) and warps a block (QOPS_WARPS): 16 warps an SM
// (two blocks of 8, or one of 16) run at <= 128 registers a thread, 8 up to 255. Two blocks of 8 run the
// weight loops faster than one, but their grid barriers (twice the arrivals) and finishers cost more
// (benchmarks/NOTES.md stop 47); one block of 16 has the loops' warps with one block's barrier.
constexpr int kBlocksPerSm = QOPS_BPS;
constexpr int kWarps = QOPS_WARPS;
static_assert(kBlocksPerSm == 1 || kBlocksPerSm == 2, "QOPS_BPS is 1 or 2");
static_assert(kWarps == 8 || kWarps == 16, "QOPS_WARPS is 8 or 16");
static_assert(kBlocksPerSm * kWarps <= 16, "at most 16 warps an SM (128 registers a thread)");
constexpr int kConsumers = 32 * kWarps;  // every thread of the block
constexpr int kThreads = kConsumers;
// Measurement knobs (benchmarks/probe_layer_kernel.py; results are wrong with them): QOPS_PROBE bit 1:
// the consumers skip the math (the stream and the barriers only), bit 2: no grid barriers.
constexpr int kProbe = QOPS_PROBE;
// QOPS_STAMPS (measurements): thread 0 of each block writes the global timer at kStamps points of layer
// kStampLayer (or the last, with fewer layers) to the workspace after the attention's partials
// (benchmarks/probe_layer_kernel.py --stamps reads them).
constexpr int kStamps = 24;
constexpr int kStampLayer = 2;
constexpr int kMaxSplits = 32;  // the host's MAX_SPLITS: the attention partials' size in the workspace
constexpr int kMergeBatch = 8;  // shares the last block of a KV head merges at a time (registers: 3 x 8 a thread)
// Positions a share attends to at least: a call at position pos uses ceil(pos / 16) shares (at most the
// launch's nsplit), so short caches are not spread over shares of one position and merged at length.
constexpr int kMinSharePositions = 16;
constexpr int kStageChunks = kWarps;  // slab-chunks a stage: one a warp
constexpr int kHdLane = HD / 32;            // head dims a lane holds in the attention
static_assert(HD % 32 == 0 && HD <= 256, "QOPS_HD: a multiple of 32 up to 256");
// Cache positions a warp loads before attending to them: 4 (2 at 16 warps an SM) where a lane's query
// heads fit (GQ x D / 32 <= 16 values; beyond, the attention's arrays alone fill the registers).
constexpr int kKvDepth = GQ * kHdLane > 16 ? 1 : kBlocksPerSm * kWarps == 8 ? 4 : 2;

// One layer's pointers as the host writes them (16 x 8 bytes; qops/models/layer_kernel.py).
struct LayerWeights {
  const u32* qweight[4];  // [q; k; v], o, [gate; up], down: column slabs (N/32, K/8, 32)
  const u16* scales[4];   // (n_groups, N)
  const u32* qzeros[4];   // (n_groups, N/8), or null without zeros
  const u16* norm1;       // input_layernorm weight (hidden)
  const u16* norm2;       // post_attention_layernorm weight (hidden)
  u16* k_cache;           // (max_batch, NKV, S, HD), row 0
  u16* v_cache;
};

struct Args {
  const LayerWeights* layers;
  int n_layers;
  u16* h;                     // (hidden,) residual stream, in place
  unsigned char* ws;          // workspace (layout: the host's offsets below)
  const long long* positions; // (1,)
  const float* cos;           // (R, HD)
  const float* sin;
  int hid, inter, nkv, max_seq, group_chunks;  // group_chunks: group_size / 128, 0 for one group
  int nsplit, kmax, ncg_max, zoff;
  float eps, scale;
  int off_qkv, off_attn, off_act, off_part, off_apart;  // bytes into ws; counters at 0
  int attn_ctr;        // index (u32) of the first KV head's counter
  int scratch_floats;  // floats of scratch (then 64 ints of flags)
};

// Counters at the workspace's start: [0] grid barrier arrivals (never reset within a launch: the n-th
// barrier waits for n x G), [1] unused, [2 ..) one per column group of the widest projection, then one per
// KV head (the attention's shares).
constexpr int kCtrGroups = 2;

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ u32 ld_relaxed_u32(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void red_release_add(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// An arrival that publishes the block's earlier writes (release; other threads' through the bar.sync
// before it) and sees the earlier arrivals' (acquire; other threads see them after the bar.sync after it).
__device__ __forceinline__ u32 atom_acq_rel_add(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_cg_f32(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u16 ld_cg_u16(const u16* p) {
  u16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void stamp(unsigned long long* st, int i) {
  if (QOPS_STAMPS && st != nullptr && threadIdx.x == 0) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    st[i] = t;
  }
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float to_f(u16 b) { return bits_to_f32<DT>(b); }
__device__ __forceinline__ u16 to_b(float f) { return f32_to_bits<DT>(f); }
__device__ __forceinline__ float round_dt(float f) { return to_f(to_b(f)); }

// All blocks of the grid: every thread's earlier global writes are visible to every thread's later reads
// (through L2) once it returns. `passed` counts the block's barriers so far: the count only grows (one
// release add a block, no reset, no generation word), so a barrier costs one arrival and the wait.
__device__ void grid_barrier(u32* ctr, u32& passed) {
  consumer_sync();
  ++passed;
  if constexpr (kProbe & 2) return;
  if (threadIdx.x == 0) {
    const u32 target = passed * gridDim.x;
    red_release_add(ctr, 1u);
    // Spin on relaxed loads and acquire once after: an acquire load invalidates the SM's L1 each time
    // (CCTL.IVALL), ~400k of them a launch when every spin read was one (stop 47's profile).
    while (ld_relaxed_u32(ctr) < target) {
    }
    fence_acq_rel_gpu();
  }
  consumer_sync();
}

// n / d for n d < 2^32 (unit and chunk indices): a high multiply, not a division's ~20 instructions in
// the weight loops. m = floor(2^32 / d) + 1 = 2^32 / d + e with 0 < e <= 1, so n m / 2^32 = n / d + n e / 2^32
// and the added n e / 2^32 < 1 / d cannot carry past the next integer. d = 1 (m would need 33 bits): m = 0.
struct FastDiv {
  u32 m;
  __device__ __forceinline__ void set(u32 d) { m = d == 1 ? 0u : static_cast<u32>(0xffffffffu / d + 1); }
  __device__ __forceinline__ int operator()(int n) const { return m ? static_cast<int>(__umulhi(static_cast<u32>(n), m)) : n; }
};

// Block b's first unit of a projection of U units split over G blocks, and the block holding unit u (the
// last of a run of blocks with equal starts, i.e. the one whose range is not empty). 32-bit: the host
// refuses U G >= 2^32 (a 64-bit division is ~4x the instructions, and the finisher does many).
__device__ __forceinline__ int unit_begin(int U, int b, int G) {
  return static_cast<int>(static_cast<u32>(U) * static_cast<u32>(b) / static_cast<u32>(G));
}
__device__ __forceinline__ int block_of_unit(int U, int u, int G) {
  return static_cast<int>((static_cast<u32>(u + 1) * static_cast<u32>(G) - 1u) / static_cast<u32>(U));
}

// The blocks between the first and the last unit of column group cg (of `chunks` units each): some may
// hold none of its units (empty ranges) when there are more blocks than units.
struct BlockSpan {
  int first, last;
};
__device__ __forceinline__ BlockSpan group_blocks(int U, int G, int chunks, int cg) {
  return BlockSpan{block_of_unit(U, cg * chunks, G), block_of_unit(U, (cg + 1) * chunks - 1, G)};
}

// One projection's facts, from the layer and the phase (0 [q; k; v], 1 o, 2 [gate; up], 3 down).
struct Proj {
  const u32* qw;
  const u16* sc;
  const u32* qz;
  int n;       // columns of the weight (2 I for [gate; up])
  int kw;      // word rows (K / 8)
  int groups;  // column groups (N / 32, or I / 32 gated)
  int chunks;  // K / 128
  int slabs;   // slab-chunks a unit (1, or 2 gated)
  int per_stage;  // units a stage (kStageChunks / slabs)
  int up_slab0;  // [gate; up]: the first up slab (I / 32); 0 otherwise
  int group_chunks;  // chunks a scale group, 0 for one group
  FastDiv by_chunks;  // / chunks
  FastDiv by_group;   // / group_chunks (1 with one group: then unused)
};

__device__ __forceinline__ Proj proj_of(const Args& a, const LayerWeights& lw, int p) {
  const int nh = a.nkv * GQ;
  Proj q;
  q.qw = lw.qweight[p];
  q.sc = lw.scales[p];
  q.qz = lw.qzeros[p];
  const int k = p == 1 ? nh * HD : p == 3 ? a.inter : a.hid;
  q.n = p == 0 ? (nh + 2 * a.nkv) * HD : p == 2 ? 2 * a.inter : a.hid;
  q.kw = k / 8;
  q.chunks = k / 128;
  q.slabs = p == 2 ? 2 : 1;
  q.per_stage = kStageChunks / q.slabs;
  q.groups = p == 2 ? a.inter / 32 : q.n / 32;
  q.up_slab0 = p == 2 ? a.inter / 32 : 0;
  q.group_chunks = a.group_chunks;
  q.by_chunks.set(q.chunks);
  q.by_group.set(a.group_chunks ? a.group_chunks : 1);
  return q;
}

struct Smem {
  u16* x;                 // the projection's input (K values)
  float* scratch;         // warp partials / the attention's partials
  int* flags;             // small per-block flags (64)
  u16* h_pre;             // o and down: the residual stream's values of the block's column groups (64 x 32)
};

// Stages: a block's units of a projection in groups of per_stage consecutive units (W warps: W, or W / 2
// [gate; up] pairs), one a warp: warp w takes unit w of each stage ([gate; up]: pair w / 2's gate (w even) or up
// slab-chunk). A warp's unit of stage k is i0 + k per_stage + w (or w / 2), when below i1.
__device__ __forceinline__ int stage_count(int i0, int i1, int per_stage) { return (i1 - i0 + per_stage - 1) / per_stage; }

// A warp's part of one projection's weight loop, by value: everything the loop reads stays in
// registers. (With the loop's state behind references into the caller's frame -- a prefetch cursor
// across projections and layers, the Args, x's pointer -- each stage waited on ~15 local-memory loads,
// and x was read with generic loads: benchmarks/NOTES.md stop 47, Nsight Compute.)
struct Loop {
  Proj q;
  int i0, i1, stages;  // the block's units [i0, i1) and their stages
  int unit, sl, lane;  // the warp's unit of each stage ([gate; up]: its slab), its lane
  int cg0, warp, ncg_max;
  u32 xs;              // x's shared-memory address
  float* red;          // the block's partials (shared memory)
};

__device__ __forceinline__ Loop loop_of(const Proj& q, int warp, int lane) {
  Loop L;
  L.q = q;
  const int U = q.groups * q.chunks;
  L.i0 = unit_begin(U, blockIdx.x, gridDim.x);
  L.i1 = unit_begin(U, blockIdx.x + 1, gridDim.x);
  L.stages = stage_count(L.i0, L.i1, q.per_stage);
  L.unit = q.slabs == 2 ? (warp >> 1) : warp;
  L.sl = q.slabs == 2 ? (warp & 1) : 0;
  L.lane = lane;
  L.warp = warp;
  L.cg0 = L.i1 > L.i0 ? L.i0 / q.chunks : 0;
  return L;
}

// Column groups the block holds units of: cg0 .. cg0 + groups_held - 1.
__device__ __forceinline__ int groups_held(const Loop& L) { return L.i1 > L.i0 ? (L.i1 - 1) / L.q.chunks - L.cg0 + 1 : 0; }

// Unit u's lines into L2 (none past the block's units): lanes 0-15 the slab-chunk's 16 weight lines,
// lane 16 its scales' line, lane 17 its zeros'.
__device__ __forceinline__ void prefetch_unit(const Loop& L, int u) {
  if (u >= L.i1) return;
  const int cg = L.q.by_chunks(u), c = u - cg * L.q.chunks;
  const int slab = cg + L.sl * L.q.up_slab0;
  const int grow = L.q.group_chunks ? L.q.by_group(c) : 0;
  const int lane = L.lane;
  const void* line = lane < 16 ? static_cast<const void*>(L.q.qw + (static_cast<size_t>(slab) * L.q.kw + 16 * c) * 32 + 32 * lane)
                   : lane == 16 ? static_cast<const void*>(L.q.sc + static_cast<size_t>(grow) * L.q.n + 32 * slab)
                                : static_cast<const void*>(L.q.qz + static_cast<size_t>(grow) * (L.q.n / 8) + 4 * slab);
  prefetch_l2_if(line, lane < 17 || (lane == 17 && QOPS_HAS_Z));
}

// The warp's units of the first kPrefetchStages stages of projection p of layer l into L2: issued as the
// projection before it ends, so they are requested while the block finishes, waits at the grid barrier
// and stages x. Inside a projection each stage prefetches the stage kPrefetchStages ahead.
__device__ __noinline__ void prefetch_head(const Args& a, int l, int p, int warp, int lane) {
  if (l >= a.n_layers) return;
  const Loop L = loop_of(proj_of(a, a.layers[l], p), warp, lane);
  for (int k = 0; k < kPrefetchStages && k < L.stages; ++k) prefetch_unit(L, L.i0 + k * L.q.per_stage + L.unit);
}

// --- a slab-chunk's sums (one warp) --------------------------------------------------------------

__device__ __forceinline__ uint4 lds_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// acc[i] += the chunk's sum for column 4 (lane / 4) + i of the slab, times its scale. `xk`: the shared
// address of x at the chunk's first row.
__device__ __forceinline__ void chunk_sums(float (&acc)[4], const uint4 (&w)[4], u32 xk, int lane, const W4ZeroBase& zbase,
                                           uint2 sv, u32 zword) {
  const int r = lane >> 2, c = lane & 3;
  u32 za[4], zb[4];
#if QOPS_HAS_Z
  const u32 zw = zword >> (16 * (r & 1));
#pragma unroll
  for (int i = 0; i < 4; ++i) w4_zero_pairs(zbase, (zw >> (4 * i)) & 15u, za[i], zb[i]);
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) w4_zero_pairs(zbase, 8u, za[i], zb[i]);
#endif
  float d[2][4];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[e][i] = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 wv = w[j];
    const uint4 xv = lds_v4(xk + 2 * (32 * c + 8 * j));
    const u32 b00 = prmt<0x5410>(xv.x, xv.z), b01 = prmt<0x7632>(xv.x, xv.z);
    const u32 b10 = prmt<0x5410>(xv.y, xv.w), b11 = prmt<0x7632>(xv.y, xv.w);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      u32 pa[4], pb[4];
      w4_dequant_word<DT>(pa, word(wv, 2 * e), za[2 * e], zb[2 * e]);
      w4_dequant_word<DT>(pb, word(wv, 2 * e + 1), za[2 * e + 1], zb[2 * e + 1]);
      mma_16816<DT>(d[e], pa[0], pb[0], pa[1], pb[1], b00, b01);
      mma_16816<DT>(d[e], pa[2], pb[2], pa[3], pb[3], b10, b11);
    }
  }
  acc[0] += d[0][0] * bits_to_f32<SDT>(static_cast<u16>(sv.x & 0xffffu));
  acc[1] += d[0][2] * bits_to_f32<SDT>(static_cast<u16>(sv.x >> 16));
  acc[2] += d[1][0] * bits_to_f32<SDT>(static_cast<u16>(sv.y & 0xffffu));
  acc[3] += d[1][2] * bits_to_f32<SDT>(static_cast<u16>(sv.y >> 16));
}

// --- staging x -----------------------------------------------------------------------------------

// x = round(w * round(h * rsqrt(mean(h^2) + eps))) (LlamaRMSNorm's roundings), h read through L2 once:
// each thread parks its values in x's buffer for the second pass (the same elements: no sync needed).
__device__ void stage_rmsnorm(const Args& a, const Smem& s, const u16* w) {
  const int t = threadIdx.x, K = a.hid;
  float ss = 0.f;
  for (int e = 8 * t; e < K; e += 8 * kConsumers) {
    const uint4 v = ld_cg_v4(a.h + e);
    *reinterpret_cast<uint4*>(s.x + e) = v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 wd = word(v, i);
      const float lo = to_f(static_cast<u16>(wd & 0xffffu)), hi = to_f(static_cast<u16>(wd >> 16));
      ss += lo * lo + hi * hi;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  float* red = s.scratch;
  consumer_sync();  // the previous user of scratch is done
  if ((t & 31) == 0) red[t >> 5] = ss;
  consumer_sync();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) total += red[i];
  const float rinv = rsqrtf(total / static_cast<float>(K) + a.eps);
  for (int e = 8 * t; e < K; e += 8 * kConsumers) {
    const uint4 v = *reinterpret_cast<const uint4*>(s.x + e);
    const uint4 wv = *reinterpret_cast<const uint4*>(w + e);
    uint4 o;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 hd = word(v, i), wd = word(wv, i);
      const float x0 = round_dt(to_f(static_cast<u16>(hd & 0xffffu)) * rinv), x1 = round_dt(to_f(static_cast<u16>(hd >> 16)) * rinv);
      const u32 packed = pack2_bits<DT>(to_f(static_cast<u16>(wd & 0xffffu)) * x0, to_f(static_cast<u16>(wd >> 16)) * x1);
      if (i == 0) o.x = packed;
      else if (i == 1) o.y = packed;
      else if (i == 2) o.z = packed;
      else o.w = packed;
    }
    *reinterpret_cast<uint4*>(s.x + e) = o;
  }
  consumer_sync();
}

__device__ void stage_copy(const Smem& s, const u16* src, int K) {
  for (int e = 8 * threadIdx.x; e < K; e += 8 * kConsumers) *reinterpret_cast<uint4*>(s.x + e) = ld_cg_v4(src + e);
  consumer_sync();
}

// --- a projection --------------------------------------------------------------------------------

// The column group's finished value(s) for column `col` of the group (t < 32): v (and vu, gated); o and
// down add it to h, whose value the block loaded as the projection began (`h_old`).
__device__ __forceinline__ void epilogue(const Args& a, int p, int cg, int t, float v, float vu, u16 h_old) {
  u16* act16 = reinterpret_cast<u16*>(a.ws);
  const int col = 32 * cg + t;
  if (p == 0) {
    act16[a.off_qkv / 2 + col] = to_b(v);
  } else if (p == 2) {
    const float g = v;
    act16[a.off_act / 2 + col] = to_b(g / (1.f + __expf(-g)) * vu);
  } else {
    a.h[col] = to_b(to_f(h_old) + round_dt(v));
  }
}

// A warp's unit of a stage in registers: lane (r, c) = (lane / 4, lane % 4) holds word rows 4c + j
// (j = 0..3), columns 4r .. 4r + 3 of the slab-chunk, the four columns' scales and their zero word.
struct Chunk {
  uint4 w[4];
  uint2 sv;
  u32 zw;
};

// Issue the loads of unit u (none when !mine): the weights on the streaming path (prefetched into L2),
// scales and zeros read-only.
__device__ __forceinline__ void load_chunk(const Loop& L, int u, bool mine, Chunk& ch) {
  const int cg = L.q.by_chunks(u), c = u - cg * L.q.chunks;
  const int slab = cg + L.sl * L.q.up_slab0;
  const int grow = L.q.group_chunks ? L.q.by_group(c) : 0;
  const int r = L.lane >> 2;
  const u32* wp = L.q.qw + (static_cast<size_t>(slab) * L.q.kw + 16 * c) * 32 + 128 * (L.lane & 3) + 4 * r;
#pragma unroll
  for (int j = 0; j < 4; ++j) ld_stream_v4_if(ch.w[j], wp + 32 * j, mine);
  ld_nc_v2_if(ch.sv, L.q.sc + static_cast<size_t>(grow) * L.q.n + 32 * slab + 4 * r, mine);
  if (QOPS_HAS_Z) ld_nc_u32_if(ch.zw, L.q.qz + static_cast<size_t>(grow) * (L.q.n / 8) + 4 * slab + (r >> 1), mine);
}

// A warp's sums of column group `cur` (none when cur < 0) into its row of the block's partials; zeroed after.
__device__ __forceinline__ void flush_sums(float* red, float (&acc)[4], int cur, int cg0, int warp, int ncg_max, int sl, int lane) {
  if (cur >= 0 && (lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) red[(warp * ncg_max + cur - cg0) * 64 + 32 * sl + 4 * (lane >> 2) + i] = acc[i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.f;
}

// Stage k: issue the loads of stage k + kAhead into `load`, this warp's unit of stage k (if any) into acc
// from `use`, the L2 prefetch of stage k + kPrefetchStages. False past the last stage.
__device__ __forceinline__ bool stage_step(const Loop& L, const W4ZeroBase& zbase, int k, const Chunk& use, Chunk& load,
                                           float (&acc)[4], int& cur) {
  if (k >= L.stages) return false;
  const int next = L.i0 + (k + kAhead) * L.q.per_stage + L.unit;
  if (k + kAhead < L.stages) load_chunk(L, next, next < L.i1, load);
  const int u = L.i0 + k * L.q.per_stage + L.unit;
  if (u < L.i1) {
    const int cg = L.q.by_chunks(u);
    if (cg != cur) {
      flush_sums(L.red, acc, cur, L.cg0, L.warp, L.ncg_max, L.sl, L.lane);
      cur = cg;
    }
    if constexpr (!(kProbe & 1)) chunk_sums(acc, use.w, L.xs + 2 * 128 * (u - cg * L.q.chunks), L.lane, zbase, use.sv, use.zw);
  }
  if constexpr (kPrefetchStages > 0) prefetch_unit(L, L.i0 + (k + kPrefetchStages) * L.q.per_stage + L.unit);
  return true;
}

// Run projection p of layer l over this block's units.
// Not inlined (nor attention): inlined four times into one body, the kernel needed 255 registers and
// spilled; as calls, none at one block an SM (ptxas, sm_90: ~200 registers).
__device__ __noinline__ void project(const Args& a, const Smem& s, int l, int p, const W4ZeroBase& zbase_in, unsigned long long* st) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const Proj q = proj_of(a, a.layers[l], p);
  float* red = s.scratch;  // [kWarps][ncg_max][64]
  for (int i = t; i < kWarps * a.ncg_max * 64; i += kConsumers) red[i] = 0.f;
  consumer_sync();

  // Warp w takes unit w of each stage ([gate; up]: unit w / 2's gate (w even) or up slab-chunk).
  Loop L = loop_of(q, warp, lane);
  if (p == 1 || p == 3) {
    // h of the block's column groups, for the epilogue: requested now, in flight under the loop (no block
    // writes a group's h before every block holding it has arrived, after its loop).
    const int ncg = groups_held(L);
    for (int g = warp; g < ncg; g += kWarps) s.h_pre[32 * g + lane] = ld_cg_u16(a.h + 32 * (L.cg0 + g) + lane);
  }
  L.ncg_max = a.ncg_max;
  L.xs = smem_addr(s.x);
  L.red = red;
  const W4ZeroBase zbase = zbase_in;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int cur = -1;
  // Each warp's units kAhead stages ahead, in kAhead + 1 register sets used in turn (the loop unrolled
  // so no set is ever copied: a copy would wait for its loads).
  Chunk c0, c1, c2, c3;
  Chunk* sets[4] = {&c0, &c1, &c2, &c3};
#pragma unroll
  for (int i = 0; i < kAhead; ++i)
    if (i < L.stages) load_chunk(L, L.i0 + i * L.q.per_stage + L.unit, L.i0 + i * L.q.per_stage + L.unit < L.i1, *sets[i]);
  if constexpr (kAhead == 1) {
    for (int k = 0;; k += 2) {
      if (!stage_step(L, zbase, k, c0, c1, acc, cur)) break;
      if (!stage_step(L, zbase, k + 1, c1, c0, acc, cur)) break;
    }
  } else if constexpr (kAhead == 2) {
    for (int k = 0;; k += 3) {
      if (!stage_step(L, zbase, k, c0, c2, acc, cur)) break;
      if (!stage_step(L, zbase, k + 1, c1, c0, acc, cur)) break;
      if (!stage_step(L, zbase, k + 2, c2, c1, acc, cur)) break;
    }
  } else {
    for (int k = 0;; k += 4) {
      if (!stage_step(L, zbase, k, c0, c3, acc, cur)) break;
      if (!stage_step(L, zbase, k + 1, c1, c0, acc, cur)) break;
      if (!stage_step(L, zbase, k + 2, c2, c1, acc, cur)) break;
      if (!stage_step(L, zbase, k + 3, c3, c2, acc, cur)) break;
    }
  }
  // The next projection's first stages into L2 while this one finishes and the grid waits.
  prefetch_head(a, p == 3 ? l + 1 : l, (p + 1) & 3, warp, lane);
  flush_sums(red, acc, cur, L.cg0, warp, a.ncg_max, L.sl, lane);
  consumer_sync();
  stamp(st, 0);

  // (Recomputed here rather than kept live across the loop: at 128 registers that spilled.)
  const int U = q.groups * q.chunks, G = gridDim.x;
  const int i0 = L.i0, i1 = L.i1, cg0 = L.cg0;
  const int ncg = groups_held(L);
  const int width = 32 * q.slabs;

  // The block's sums per column group: finished here, or a partial for the group's last block.
  float* part = reinterpret_cast<float*>(a.ws + a.off_part);
  u32* ctr = reinterpret_cast<u32*>(a.ws) + kCtrGroups;
  for (int g = 0; g < ncg; ++g) {
    const int cg = cg0 + g;
    const int lo = max(i0, cg * q.chunks), hi = min(i1, (cg + 1) * q.chunks);
    if (t < 32) {
      float v = 0.f, vu = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        v += red[(w * a.ncg_max + g) * 64 + t];
        vu += red[(w * a.ncg_max + g) * 64 + 32 + t];
      }
      if (hi - lo == q.chunks) {
        epilogue(a, p, cg, t, v, vu, s.h_pre[32 * g + t]);
      } else {
        float* dst = part + (static_cast<size_t>(cg) * q.chunks + (lo - cg * q.chunks)) * width;
        dst[t] = v;
        if (q.slabs == 2) dst[32 + t] = vu;
      }
    }
  }
  consumer_sync();
  int* last = s.flags;
  if (t < ncg) {
    const int cg = cg0 + t;
    const int lo = max(i0, cg * q.chunks), hi = min(i1, (cg + 1) * q.chunks);
    int is_last = 0;
    if (hi - lo != q.chunks) {
      // Blocks holding units of this group (the non-empty ones of its span).
      const BlockSpan span = group_blocks(U, G, q.chunks, cg);
      int parts = 0;
      for (int bb = span.first; bb <= span.last; ++bb) parts += unit_begin(U, bb + 1, G) > unit_begin(U, bb, G);
      is_last = atom_acq_rel_add(ctr + cg, 1u) + 1 == static_cast<u32>(parts);
    }
    last[t] = is_last;
  }
  consumer_sync();
  for (int g = 0; g < ncg; ++g) {
    if (!last[g]) continue;
    const int cg = cg0 + g;
    if (t < 32) {
      const BlockSpan span = group_blocks(U, G, q.chunks, cg);
      float v = 0.f, vu = 0.f;
      for (int bb = span.first; bb <= span.last; ++bb) {
        const int s0 = unit_begin(U, bb, G), s1 = unit_begin(U, bb + 1, G);
        if (s1 == s0) continue;
        const float* src = part + (static_cast<size_t>(cg) * q.chunks + (max(s0, cg * q.chunks) - cg * q.chunks)) * width;
        v += ld_cg_f32(src + t);
        if (q.slabs == 2) vu += ld_cg_f32(src + 32 + t);
      }
      epilogue(a, p, cg, t, v, vu, s.h_pre[32 * g + t]);
      if (t == 0) atomicExch(ctr + cg, 0u);
    }
  }
}

// --- attention -----------------------------------------------------------------------------------

// One cache position into a warp's online softmax of each query head: lane holds kHdLane dims of q, k, v, o.
__device__ __forceinline__ void attend(float (&m)[GQ], float (&l)[GQ], float (&o)[GQ][kHdLane], const float (&qr)[GQ][kHdLane],
                                       const float (&kv)[kHdLane], const float (&vv)[kHdLane], float scale) {
#pragma unroll
  for (int g = 0; g < GQ; ++g) {
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kHdLane; ++i) dot += qr[g][i] * kv[i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float sc = dot * scale;
    const float mn = fmaxf(m[g], sc);
    const float alpha = expf(m[g] - mn), pr = expf(sc - mn);
    l[g] = l[g] * alpha + pr;
#pragma unroll
    for (int i = 0; i < kHdLane; ++i) o[g][i] = o[g][i] * alpha + pr * vv[i];
    m[g] = mn;
  }
}

__device__ __noinline__ void attention(const Args& a, const Smem& s, const LayerWeights& lw) {
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int b = blockIdx.x;
  if (b >= a.nkv * a.nsplit) return;  // the caller's grid barrier follows
  const int hk = b / a.nsplit, sp = b - hk * a.nsplit;
  const int nh = a.nkv * GQ;
  const int pos = static_cast<int>(a.positions[0]);
  const int ns = min(a.nsplit, max(1, (pos + kMinSharePositions - 1) / kMinSharePositions));  // shares with work
  if (sp >= ns) return;
  const u16* qkv = reinterpret_cast<const u16*>(a.ws + a.off_qkv);
  // Scratch: q_s [GQ + 1][HD] (the rotated queries and key, rounded), v_s [HD], warp partials
  // [kWarps][GQ][HD + 2] (m, l, o).
  float* q_s = s.scratch;
  float* v_s = q_s + (GQ + 1) * HD;
  float* wp = v_s + HD;
  consumer_sync();  // scratch's previous users are done
  // Rounds of every thread's element unrolled so all their loads are in flight at once (one L2 round
  // trip, not one a round).
#pragma unroll
  for (int r = 0; r < ((GQ + 1) * HD + kConsumers - 1) / kConsumers; ++r) {
    const int i = t + r * kConsumers;
    if (i >= (GQ + 1) * HD) break;
    const int head = i / HD, d = i - head * HD;
    const int col = head < GQ ? (hk * GQ + head) * HD : (nh + hk) * HD;
    const float x = to_f(ld_cg_u16(qkv + col + d));
    const float partner = d < HD / 2 ? -to_f(ld_cg_u16(qkv + col + d + HD / 2)) : to_f(ld_cg_u16(qkv + col + d - HD / 2));
    q_s[i] = round_dt(x * a.cos[static_cast<size_t>(pos) * HD + d] + partner * a.sin[static_cast<size_t>(pos) * HD + d]);
  }
  for (int d = t; d < HD; d += kConsumers) v_s[d] = to_f(ld_cg_u16(qkv + (nh + a.nkv + hk) * HD + d));
  consumer_sync();
  const size_t head_base = static_cast<size_t>(hk) * a.max_seq * HD;
  if (sp == 0) {
    for (int d = t; d < HD; d += kConsumers) {
      lw.k_cache[head_base + static_cast<size_t>(pos) * HD + d] = to_b(q_s[GQ * HD + d]);
      lw.v_cache[head_base + static_cast<size_t>(pos) * HD + d] = to_b(v_s[d]);
    }
  }
  float m[GQ], l[GQ], o[GQ][kHdLane], qr[GQ][kHdLane];
#pragma unroll
  for (int g = 0; g < GQ; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kHdLane; ++i) {
      o[g][i] = 0.f;
      qr[g][i] = q_s[g * HD + lane * kHdLane + i];
    }
  }
  const int lo = static_cast<int>((static_cast<long long>(pos) * sp) / ns);
  const int hi = static_cast<int>((static_cast<long long>(pos) * (sp + 1)) / ns);
  // A warp's positions lo + warp, + kWarps, ..., kKvDepth of them loaded before it attends to any (the
  // cache rows come from DRAM: one round trip a group, not one a position), in the same order.
  for (int p0 = lo + warp; p0 < hi; p0 += kWarps * kKvDepth) {
    float kv[kKvDepth][kHdLane], vv[kKvDepth][kHdLane];
#pragma unroll
    for (int j = 0; j < kKvDepth; ++j) {
      const int p = p0 + kWarps * j;
      if (p < hi) {
        const u16* kr = lw.k_cache + head_base + static_cast<size_t>(p) * HD + lane * kHdLane;
        const u16* vr = lw.v_cache + head_base + static_cast<size_t>(p) * HD + lane * kHdLane;
#pragma unroll
        for (int i = 0; i < kHdLane; ++i) {
          kv[j][i] = to_f(kr[i]);
          vv[j][i] = to_f(vr[i]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kKvDepth; ++j)
      if (p0 + kWarps * j < hi) attend(m, l, o, qr, kv[j], vv[j], a.scale);
  }
  if (sp == ns - 1 && warp == 0) {  // the new token, from shared memory
    float kv[kHdLane], vv[kHdLane];
#pragma unroll
    for (int i = 0; i < kHdLane; ++i) {
      kv[i] = q_s[GQ * HD + lane * kHdLane + i];
      vv[i] = v_s[lane * kHdLane + i];
    }
    attend(m, l, o, qr, kv, vv, a.scale);
  }
#pragma unroll
  for (int g = 0; g < GQ; ++g) {
    float* dst = wp + (warp * GQ + g) * (HD + 2);
    if (lane == 0) {
      dst[0] = m[g];
      dst[1] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kHdLane; ++i) dst[2 + lane * kHdLane + i] = o[g][i];
  }
  consumer_sync();
  // Warps merged in order: this share's (m, l, o) per query head.
  float* apart = reinterpret_cast<float*>(a.ws + a.off_apart);
  u16* out = reinterpret_cast<u16*>(a.ws + a.off_attn);
  for (int i = t; i < GQ * HD; i += kConsumers) {
    const int g = i / HD, d = i - g * HD;
    float mm = neg_inf();
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, wp[(w * GQ + g) * (HD + 2)]);
    float ll = 0.f, oo = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float* src = wp + (w * GQ + g) * (HD + 2);
      const float f = src[0] == neg_inf() ? 0.f : expf(src[0] - mm);
      ll += src[1] * f;
      oo += src[2 + d] * f;
    }
    if (ns == 1) {
      out[(hk * GQ + g) * HD + d] = to_b(oo / ll);
    } else {
      float* dst = apart + ((static_cast<size_t>(hk) * a.nsplit + sp) * GQ + g) * (HD + 2);
      if (d == 0) {
        dst[0] = mm;
        dst[1] = ll;
      }
      dst[2 + d] = oo;
    }
  }
  if (ns == 1) return;
  consumer_sync();
  // Shares merged in order by the last of the KV head's blocks to arrive.
  u32* ctr = reinterpret_cast<u32*>(a.ws) + a.attn_ctr + hk;
  int* last = s.flags;
  if (t == 0) last[0] = atom_acq_rel_add(ctr, 1u) + 1 == static_cast<u32>(ns);
  consumer_sync();
  if (!last[0]) return;
  // Shares merged in order, kMergeBatch at a time: a batch's (m, l, o[d]) loaded before any is used (the
  // loads overlap: one L2 round trip a batch, not one a share), folded into the running (mm, ll, oo).
  for (int i = t; i < GQ * HD; i += kConsumers) {
    const int g = i / HD, d = i - g * HD;
    float mm = neg_inf(), ll = 0.f, oo = 0.f;
    for (int q0 = 0; q0 < ns; q0 += kMergeBatch) {
      float ms[kMergeBatch], ls[kMergeBatch], os[kMergeBatch];
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        ms[j] = neg_inf();
        ls[j] = os[j] = 0.f;
        if (q0 + j < ns) {
          const float* src = apart + ((static_cast<size_t>(hk) * a.nsplit + q0 + j) * GQ + g) * (HD + 2);
          ms[j] = ld_cg_f32(src);
          ls[j] = ld_cg_f32(src + 1);
          os[j] = ld_cg_f32(src + 2 + d);
        }
      }
      float mb = mm;
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) mb = fmaxf(mb, ms[j]);
      if (mb == neg_inf()) continue;  // nothing attended yet
      const float keep = mm == neg_inf() ? 0.f : expf(mm - mb);
      ll *= keep;
      oo *= keep;
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const float f = ms[j] == neg_inf() ? 0.f : expf(ms[j] - mb);
        ll += ls[j] * f;
        oo += os[j] * f;
      }
      mm = mb;
    }
    out[(hk * GQ + g) * HD + d] = to_b(oo / ll);
  }
  if (t == 0) atomicExch(ctr, 0u);
}

// --- the kernel ----------------------------------------------------------------------------------


__device__ void consume(const Args& a, const Smem& s) {
  u32* bar = reinterpret_cast<u32*>(a.ws);
  const W4ZeroBase zbase = w4_zero_base<DT>(static_cast<u32>(a.zoff));
  const int nh = a.nkv * GQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  prefetch_head(a, 0, 0, warp, lane);
  unsigned long long* stamps = nullptr;
  if (QOPS_STAMPS) {
    const size_t apart = static_cast<size_t>(a.nkv) * kMaxSplits * GQ * (HD + 2) * 4;
    stamps = reinterpret_cast<unsigned long long*>(a.ws + ((a.off_apart + apart + 255) / 256) * 256) + blockIdx.x * kStamps;
  }
  const int stamp_layer = min(kStampLayer, a.n_layers - 1);
  u32 passed = 0;  // grid barriers so far
  for (int l = 0; l < a.n_layers; ++l) {
    const LayerWeights lw = a.layers[l];
    unsigned long long* st = l == stamp_layer ? stamps : nullptr;
    stamp(st, 0);
    stage_rmsnorm(a, s, lw.norm1);
    stamp(st, 1);
    project(a, s, l, 0, zbase, st ? st + 2 : nullptr);  // 2: loop done; 3: finished
    stamp(st, 3);
    grid_barrier(bar, passed);
    stamp(st, 4);
    attention(a, s, lw);
    stamp(st, 5);
    grid_barrier(bar, passed);
    stamp(st, 6);
    stage_copy(s, reinterpret_cast<const u16*>(a.ws + a.off_attn), nh * HD);
    stamp(st, 7);
    project(a, s, l, 1, zbase, st ? st + 8 : nullptr);
    stamp(st, 9);
    grid_barrier(bar, passed);
    stamp(st, 10);
    stage_rmsnorm(a, s, lw.norm2);
    stamp(st, 11);
    project(a, s, l, 2, zbase, st ? st + 12 : nullptr);
    stamp(st, 13);
    grid_barrier(bar, passed);
    stamp(st, 14);
    stage_copy(s, reinterpret_cast<const u16*>(a.ws + a.off_act), a.inter);
    stamp(st, 15);
    project(a, s, l, 3, zbase, st ? st + 16 : nullptr);
    stamp(st, 17);
    grid_barrier(bar, passed);
    stamp(st, 18);
  }
}

}  // namespace layers
}  // namespace qops

extern "C" __global__ void __launch_bounds__(qops::layers::kThreads, qops::layers::kBlocksPerSm)
qops_decode_layers(const qops::layers::LayerWeights* layers, int n_layers, qops::u16* h, unsigned char* ws, const long long* positions,
                   const float* cos, const float* sin, int hid, int inter, int nkv, int max_seq, int group_chunks, int nsplit,
                   int kmax, int ncg_max, int zoff, float eps, float scale, int off_qkv, int off_attn, int off_act, int off_part,
                   int off_apart, int attn_ctr, int scratch_floats) {
  using namespace qops;
  using namespace qops::layers;
  const Args a{layers, n_layers, h, ws, positions, cos, sin, hid, inter, nkv, max_seq, group_chunks, nsplit, kmax, ncg_max, zoff,
               eps, scale, off_qkv, off_attn, off_act, off_part, off_apart, attn_ctr, scratch_floats};
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 raw = smem_addr(smem_raw);
  unsigned char* base = smem_raw + ((128u - (raw & 127u)) & 127u);
  Smem s;
  s.x = reinterpret_cast<u16*>(base);
  s.scratch = reinterpret_cast<float*>(base + 2 * ((a.kmax + 7) / 8 * 8));
  s.flags = reinterpret_cast<int*>(s.scratch) + a.scratch_floats;
  s.h_pre = reinterpret_cast<u16*>(s.flags + 64);
  consume(a, s);
}
