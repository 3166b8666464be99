// W4A16 matmul for decode (M <= 32 rows of x), reading qops' runtime int-weight layout
// (qops/ops/int_weight.py), 4-bit case:
//   qweight u32 (ceil(K/8), N): word (kw, n) holds rows 8*kw .. 8*kw+7 of column n, nibble i = row 8*kw+i;
//           or the same words in 32-column slabs (N/32, ceil(K/8), 32) with flags & kQSlabs (w4.cuh);
//   scales  f16/bf16 (n_groups, N); group g covers rows [g*G, (g+1)*G), G a multiple of 128 or K
//           (passed as chunks_per_group = G / 128, or 0 for a single group);
//   qzeros  u32 (n_groups, ceil(N/8)) nibble stream along N, zero = nibble + zero_offset; or none (zero 8);
//           with QOPS_LUT the fp32 codebook (16 values) instead (below).
//   y[m, n] = sum_k x[m, k] * scale[k/G, n] * (q[k, n] - zero[k/G, n]) (+ bias[n]), fp32 accumulation.
// act_perm is applied by the caller (x gathered before the launch).
//
// Work split. A block is 8 warps, NWN along N (32 columns each) by NWK = 8/NWN along K; grid is
// (ceil(N / (32*NWN)), S), the S blocks of a column tile splitting the K chunks (128 rows each)
// evenly. Per 128-row chunk a lane loads 4 x 16 bytes: row kw = 16*chunk + 4*step + (lane % 4),
// columns n0 .. n0+3 with n0 = 4*(lane / 4) (+ the warp's column offset); a quarter warp reads 128
// contiguous bytes of one row. Chunks are kept in a register ring three deep (the one being used and
// two in flight; two deep for M > 8), or in a shared-memory ring (QOPS_SMEM_RING, below). x for the block's current K range is staged in shared memory with
// cp.async, as many stages as the ring, one barrier per iteration.
//
// Rows of x. MT = ceil(M / 8) B tiles of 8 rows (1..4), all multiplied by the same dequantized A
// fragments, so the weight is read and dequantized once for up to 32 rows. The registers grow with
// MT (accumulators 2 x MT x 8 fp32 a lane): MT <= 2 fits two blocks per SM (<= 128 registers), MT = 3
// and 4 take 150-240 registers (250 with a 3-deep ring; one block per SM; QOPS_MINB must be 1,
// two would spill).
//
// Math. The tensor cores compute W^T x^T with W as the 16x16 A operand (rows = 16 of the warp's 32
// columns, the K order inside a 16-row step permuted to match the int4 unpacking, the same permutation
// applied to x when it is read from shared memory), x^T as the 16x8 B operand (columns = rows of x; one
// B tile per 8 rows). Nibbles become f16/bf16 through the magic-number trick (OR into the
// mantissa of 1024.0 / 128.0, one lop3 per two values) and the zero point is subtracted in the same
// instruction that removes the bias, so A holds the exact small integers q - zero. Products and sums
// are fp32 in the MMA; each chunk's sum is multiplied by its group scale in fp32.
//
// Reduction, in a fixed order (no atomics: bit-identical from run to run):
//   - over the NWK warps of a block through shared memory;
//   - over the S blocks of a tile: S == 1 writes the output directly; with QOPS_CLUSTER == S (sm_90)
//     the S blocks form a thread-block cluster and sum through distributed shared memory; otherwise
//     each block writes fp32 partials to a workspace (S, M, N) and qops_w4a16_reduce finishes.
//
// Stream-K (a block's run of (tile, K chunk) units crossing a tile boundary, its tiles summed across
// the blocks sharing them in a cluster or through arrival counts in global memory) was built and measured
// 1.6-1.8x and 3-5 us slower than these whole-tile grids on the H200 (benchmarks/NOTES.md stop 38), and
// removed; so were tiles of unequal width (no gain, stop 40).
//
// x staging, two modes (QOPS_XFULL):
//   0: per iteration, as above: cp.async stages of the K range the block works on next, one barrier
//      per iteration (all warps of a block advance together).
//   1: once: the block's whole K range of x (M x K/S values, at most 48 KiB: at M = 32 no more than
//      640 rows of K a block) is read at the start,
//      already in the order the B fragments want (x0 x4 x1 x5 x2 x6 x3 x7 per 8 values), so the main
//      loop has no barrier, no x traffic and no permutes: each warp streams its chunks on its own.
//      The weight loads of the first iterations are issued before x is staged, hiding its latency.
//      x is read QOPS_XU 16-byte slots a thread before any is used, so a block waits one global
//      round trip per QOPS_XU x 256 slots (one per 256 slots cost M = 1 10-16%: benchmarks/NOTES.md, stop 19).
//
// Shared-memory weight ring (QOPS_SMEM_RING = SR > 0; with x staged once only). The register ring
// keeps D chunks in flight per warp, and every chunk in flight costs 19 registers a lane: at D = 2 the
// GPU has ~7 MB in flight against the ~8-9 MB that DRAM latency under load times bandwidth needs,
// and a deeper ring costs occupancy (above 128 registers, one block per SM). H200 measurements say
// the kernel is latency-bound there, not layout- or issue-bound (benchmarks/NOTES.md). With the ring
// in shared memory, each warp owns SR stages of kSmemStage bytes (2 KiB of qweight and the chunk's
// scales and zero words, 2432 bytes) after x; a lane cp.asyncs its own 4 x 16 bytes of qweight
// (.cg: not kept in L1), 8 bytes of scales and 4 of zeros into its own slots, one commit group per
// iteration, and reads back exactly those slots after cp.async.wait_group: no lane reads another
// lane's bytes, so there is no barrier and no warp sync, and warps stream independently as in XF.
// Scales and zeros ride along rather than in registers so one wait covers a whole chunk and nothing
// in flight holds a register (SR chunks would need 3 SR registers). Iteration `it` refills the stage
// it read in iteration it-1 with iteration it+SR-1 (its loads of that stage were issued before the
// copy, whose bytes land a global round trip later), then waits for its own: SR chunks in flight per
// warp (SR x 19 KiB a block) in 63-80 registers at M <= 8 (108-123 with the register ring; ptxas,
// sm_80/sm_90, no spills). Shared memory per block: x + SR x 8 x 2432 bytes, so
// above 48 KiB the host opts the kernel in (sm_90: up to 227 KiB a block, 228 KiB an SM: two blocks
// per SM up to 5 stages, one from 6, 11 at most). Off by default (0). With 16-byte copies that bypass
// L1 (.cg) it was 1.5-1.9x slower than the register ring at every depth: Nsight Compute showed each
// such cp.async asking the L2 for twice the sectors it needed (L2 hit rate 58%, DRAM 36% of peak).
// Through L1 (.ca) it matches the register ring: 4 stages 1-2% faster at M = 1 on 28672 x 4096 and
// 4096 x 14336, deeper rings slower as L1 and the blocks an SM shrink
// (`benchmarks/results/h200-2026-11-30-822a60e-sweep-smem-ca.json`, `...-9cc0d6c-sweep-smem-joint.json`).
//
// Gated output (QOPS_GLU = 1): the weight is a fused gate/up projection, N = 2H columns (gate
// columns 0..H-1, up columns H..2H-1), and the kernel writes y[m, j] = silu(g[m, j]) * u[m, j]
// (H columns) from the fp32 sums, so no separate SiLU-and-multiply kernel reads the 2H-wide result.
// A block takes NBLK / 2 gate columns j0 .. and the same up columns H + j0 ..: local column lc < NBLK/2
// is gate column j0 + lc, the others up column H + j0 + lc - NBLK/2; a lane's four columns stay in
// one half (H % 4 == 0). The pairs meet in shared memory after the K reduction (or in the cluster's
// distributed shared memory, or in qops_w4a16_reduce for the workspace path). No bias.
//
// Programmatic dependent launch (sm_90, launched with programmatic stream serialization): the kernel
// may start while the kernel ahead of it (which typically writes x) is still running. Weights, scales
// and zeros are never written by an earlier kernel, so the first ring stages are loaded before
// grid_dep_wait(); x, bias and the workspace are read, and out and the workspace written, only after
// it. After the main loop, grid_dep_launch_dependents() lets the next such launch start streaming its
// own weights while this one reduces and stores; with flags & kEarlyDependents (one-wave grids) it is
// issued as the kernel starts instead. Launched without the attribute, the wait is a no-op.
//
// Compile-time configuration (NVRTC -D): QOPS_DT (0 f16, 1 bf16), QOPS_MT (8-row tiles: 1: M <= 8,
// 2: M <= 16, 3: M <= 24, 4: M <= 32), QOPS_NWN (1, 2, 4, 8), QOPS_HAS_Z (0/1),
// QOPS_CLUSTER (1: no cluster; 2..8 needs sm_90),
// QOPS_XFULL (0/1), QOPS_RING (register ring depth; 0: 3 for MT = 1, 2 for MT >= 2),
// QOPS_MINB (minimum resident blocks per SM promised to the register allocator; default 2; 1 for MT >= 3),
// QOPS_FOLD (0/1: bias and zero point subtracted after the MMA; needs QOPS_XFULL and MT = 1),
// QOPS_PREFETCH (0: none; P > 0: each warp prefetches its weights into L2 P iterations ahead),
// QOPS_SMEM_RING (0: the register ring; 2..16: stages of the shared-memory weight ring, needs QOPS_XFULL;
// replaces QOPS_RING), QOPS_SMEM_BULK (0/1: that ring filled by whole-chunk bulk copies, sm_90 and qweight in
// slabs; measurements), QOPS_XU (x staged once: 16-byte slots a thread loads before it uses any, 1..8),
// QOPS_GLU (0/1: the gated output above; not with QOPS_SMEM_RING),
// QOPS_F16MMA (0/1: bf16 x through f16 MMAs, below; needs QOPS_XFULL),
// QOPS_WGMMA (0/1: warpgroup MMAs, below; sm_90a, x staged once, NWN 4 or 8),
// QOPS_LUT (0/1: 4-bit codebook weights, below) with QOPS_SMEM_BASE, QOPS_EXIT_FENCE (0/1, measurements: the
// cluster's last barrier with a release arrive, ptx.cuh cluster_exit_sync),
// QOPS_STAMPS (measurement builds, benchmarks/probe_layer_timeline.py: thread 0 of each block writes
// timer stamps to ws, so the launch must pass a buffer there and use no split-K workspace; below).
//
// bf16 x through f16 MMAs (QOPS_F16MMA, QOPS_DT = 1): the A operand (q - zero, or 1024 + q with fold)
// is exact in either type and the scales apply in fp32, so only x decides the MMA's type. bf16's
// 7-bit mantissa has no room for the 16 q trick, so its dequantization takes three more shifts a
// word (12.7% more instructions at M = 1, 3-9% slower: benchmarks/NOTES.md, stop 20). Here x is
// staged as f16 instead, each row scaled by a power of two 2^e that brings its largest magnitude in
// the block's K range into [2^14, 2^15): no value overflows, every value within 2^-28 of the row's
// largest converts exactly (f16 holds three more mantissa bits than bf16), and the sums are
// multiplied by 2^-e in fp32 after the main loop (exact). A first pass over the block's x finds the
// rows' largest magnitudes (kept in each row's padding slot of the staged x).
//
// 4-bit codebook weights (QOPS_LUT = 1; bitsandbytes NF4 / FP4 codes, qops.native.codebook_w4, measurements):
// qweight holds codes, byte r of a word the codes of rows r (high nibble) and r + 4 (low), so one lookup in
// a table of the codebook (codebook4.cuh, built at the start of dynamic shared memory under the prologue's
// loads) gives the A register the magic-number decode would; scales are absmax a column and 64 rows,
// (K/64, N), applied in fp32 after each half-chunk's MMAs; no zeros, no fold. Measured on the H200 it runs
// at the NF4 kernel's speed, not this kernel's (28672 x 4096 at M = 1: 25.4 us against 24.9 for the NF4
// kernel and 18.6 for GPTQ W4 here): the table's shared loads (mio and short-scoreboard stalls in Nsight
// Compute) are what 4-bit codebooks cost, whatever the structure around them (benchmarks/NOTES.md, stop 39).
//
// Warpgroup MMAs (QOPS_WGMMA = 1, sm_90a; x staged once, NWN 4 or 8 so the four warps of a warpgroup
// work on the same chunk of K, side by side along N). At M = 9..16 the main loop issues 32 mma.sync
// a warp-chunk, and Nsight Compute put the HMMA dependency waits and the tensor pipe's throttle among
// its largest stalls (benchmarks/NOTES.md, stops 33-35). Here a warpgroup issues one wgmma
// m64 n(8 MT) k16 per 16-row k step and 16-column tile: A is the four warps' dequantized fragments in
// registers (exactly the mma.sync A fragments; warp w of the group holds rows 16 w ..), B is x read by
// the tensor cores from shared memory, staged once in the K-major core-matrix image of
// w4a16_gemm.cu (per 32-row step, 16-row k step and K half, MT core matrices of 8 rows x 16 bytes, in
// the fragments' permuted K order), and D is laid out like the mma.sync C fragments, so the scaling,
// reduction and stores are shared. The MMAs run asynchronously: a warp dequantizes the next 32-row
// step while the previous step's run (fragments double-buffered, a wait_group 1 before a buffer is
// rewritten); each chunk's sums are waited for (wait_group 0) and scaled in fp32 as above, so A stays
// the exact q - z. No fold, no bf16-through-f16 staging, no shared-memory ring.
// Measured on the H200 (benchmarks/NOTES.md, stop 36; h200-2026-12-03-1cfb1a4-probe-wgmma2.json): the
// same bits as the mma.sync build, but 4-9% slower at M = 16 and 23-43% at M = 8 on the four large
// shapes, and as slow at M = 8 as at 16 (28672 x 4096: 30.2 / 29.7 us against 21.1 / 27.4). Read: the
// warpgroup moves in lockstep, every step waiting for the slowest of four warps' weight loads, where
// the mma.sync warps each stream on their own (not profiled). With the scales in A instead (no wait
// a chunk) it was 3-7% slower still. Only 4096 x 4096 at M = 16 gained (8.38 us against 8.53 with x
// staged once): a measurement knob (plan field wgmma), in no plan.
#include "w4.cuh"
#include "codebook4.cuh"

#ifndef QOPS_DT
#define QOPS_DT 0
#endif
#ifndef QOPS_MT
#define QOPS_MT 1
#endif
#ifndef QOPS_NWN
#define QOPS_NWN 1
#endif
#ifndef QOPS_HAS_Z
#define QOPS_HAS_Z 0
#endif
#ifndef QOPS_CLUSTER
#define QOPS_CLUSTER 1
#endif
#ifndef QOPS_XFULL
#define QOPS_XFULL 0
#endif
#ifndef QOPS_RING
#define QOPS_RING 0
#endif
#ifndef QOPS_MINB
#define QOPS_MINB 2
#endif
#ifndef QOPS_FOLD
#define QOPS_FOLD 0
#endif
#ifndef QOPS_PREFETCH
#define QOPS_PREFETCH 0
#endif
#ifndef QOPS_SMEM_RING
#define QOPS_SMEM_RING 0
#endif
#ifndef QOPS_SMEM_BULK
#define QOPS_SMEM_BULK 0  // measurements: the smem ring filled by whole-chunk bulk copies (sm_90, qweight in slabs)
#endif
#if QOPS_SMEM_BULK && (QOPS_SMEM_RING == 0 || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900))
#error "QOPS_SMEM_BULK needs QOPS_SMEM_RING > 0 and sm_90 (bulk copies)"
#endif
#ifndef QOPS_XU
#define QOPS_XU 8
#endif
#ifndef QOPS_GLU
#define QOPS_GLU 0
#endif
#ifndef QOPS_F16MMA
#define QOPS_F16MMA 0
#endif
#ifndef QOPS_STAMPS
#define QOPS_STAMPS 0
#endif
#ifndef QOPS_WGMMA
#define QOPS_WGMMA 0
#endif
#ifndef QOPS_EXIT_FENCE
#define QOPS_EXIT_FENCE 0  // measurements: the cluster's exit barrier with a release arrive (ptx.cuh cluster_exit_sync)
#endif
#ifndef QOPS_LUT
#define QOPS_LUT 0  // 1: 4-bit codebook weights (qzeros: the fp32 codebook), absmax a column and 64 rows (below)
#endif
#ifndef QOPS_SMEM_BASE
#define QOPS_SMEM_BASE 0  // QOPS_LUT: the shared-window address of dynamic shared memory (compiler.dynamic_shared_base)
#endif
#if QOPS_WGMMA
#include "wgmma.cuh"  // sm_90a only: the header says so otherwise
#endif

#if QOPS_CLUSTER > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "QOPS_CLUSTER > 1 needs thread-block clusters (sm_90 or newer)"
#endif
#define QOPS_CLUSTER_ATTR __cluster_dims__(1, QOPS_CLUSTER, 1)
#else
#define QOPS_CLUSTER_ATTR
#endif

namespace qops {

#if QOPS_STAMPS
// Measurement builds only: the global timer in nanoseconds (one clock for every SM, so stamps of
// different blocks compare) and the SM's own cycle counter (finer, for spans inside a block).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ long long sm_cycles() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}
#endif

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kChunkK = 128;  // K rows a warp takes per iteration: 4 steps of 32
// Chunks per warp held in registers (one in use, the rest in flight) and x stages in shared memory:
// three, or two for M > 8 where the further x tiles and their accumulators need the registers.
template <int MT>
__host__ __device__ constexpr int ring_depth() { return QOPS_RING > 0 ? QOPS_RING : (MT == 1 ? 3 : 2); }
// QOPS_SMEM_RING: one warp's stage of the shared-memory ring, in bytes: qweight 4 steps x 32 lanes x 16
// bytes (lane-major within a step: a step's reads and copies touch 512 contiguous bytes), then the
// lanes' scales (8 bytes each), then their zero words (4 bytes each; reserved without zeros, so the
// host's size does not depend on them). Multiple of 16: every stage starts 16-byte aligned.
constexpr int kSmemStage = 4 * 32 * 16 + 32 * 8 + 32 * 4;
constexpr int kSmemScales = 4 * 32 * 16;
constexpr int kSmemZeros = kSmemScales + 32 * 8;
static_assert(kSmemStage % 16 == 0, "stages must stay 16-byte aligned");

// Bits of the `flags` argument.
constexpr int kXVec = 1;       // x rows 16-byte aligned and K % 8 == 0: x staged with cp.async
// kBiasT = 2, kBiasF32 = 4: ptx.cuh (store_out)
constexpr int kScaleBf16 = 8;  // scales are bfloat16 (else float16)
// kEarlyDependents = 16: ptx.cuh

struct Chunk {
  uint4 w[4];  // step j: qweight row 16*chunk + 4*j + lane%4, columns n0 .. n0+3
  uint2 s;     // scales of columns n0 .. n0+3 (QOPS_LUT: of the chunk's first 64 rows)
  u32 z;       // qzeros word holding the zeros of columns n0 .. n0+3
#if QOPS_LUT
  uint2 s2;    // QOPS_LUT: the scales of the chunk's last 64 rows
#endif
};

__device__ __forceinline__ u32 word2(const uint2& v, int i) { return i == 0 ? v.x : v.y; }

// QOPS_LUT: the 4-bit codes are looked up in a table of the codebook (codebook4.cuh) at the start of
// dynamic shared memory, entries 256 bytes apart, its window address QOPS_SMEM_BASE the loads' immediate
// -- except in a cluster, whose launches place dynamic shared memory elsewhere (an H200 run trapped on
// the check below): there the lane's base is a register and each lookup adds it (one more instruction).
constexpr bool kLut = QOPS_LUT != 0;
constexpr int kLutStride = 256;
constexpr int kLutBase = QOPS_CLUSTER > 1 ? -1 : QOPS_SMEM_BASE;
constexpr int kLutBytes = kLut ? codebook_table_bytes<kLutStride>() : 0;

// The scales of a chunk's last 64 rows (QOPS_LUT; otherwise the chunk's, which cover all of it).
__device__ __forceinline__ const uint2& chunk_s2(const Chunk& ck) {
#if QOPS_LUT
  return ck.s2;
#else
  return ck.s;
#endif
}

// The four columns' scales of a chunk (or half-chunk) as fp32, from their f16 / bf16 bits.
__device__ __forceinline__ void column_scales(float (&sc)[4], const uint2& s, int flags) {
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const u16 h = static_cast<u16>((jj & 1) ? (word2(s, jj >> 1) >> 16) : (word2(s, jj >> 1) & 0xffffu));
    sc[jj] = (flags & kScaleBf16) ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
  }
}

// fp32 sum of the two halves of a f16x2 / bf16x2 word.
template <int DT>
__device__ __forceinline__ float sum2(u32 v) {
  return bits_to_f32<DT>(static_cast<u16>(v & 0xffffu)) + bits_to_f32<DT>(static_cast<u16>(v >> 16));
}

__device__ __forceinline__ u32 pack2(u16 h) { return static_cast<u32>(h) | (static_cast<u32>(h) << 16); }

// x[k .. k+7] of one row (src = &row[k]) read a value at a time, zeros from column K on: for rows
// that are not 16-byte aligned, and a row's last, partial slot.
__device__ __forceinline__ uint4 load_x8_scalar(const u16* src, int k, int K) {
  u32 h[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const u32 lo = (k + 2 * e < K) ? src[2 * e] : 0u;
    const u32 hi = (k + 2 * e + 1 < K) ? src[2 * e + 1] : 0u;
    h[e] = lo | (hi << 16);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

// The weight column of block-local column lc of column tile `tile` (NBLK = 32 * NWN columns a tile);
// QOPS_GLU: the first half of a tile's columns are gate columns, the second the same up columns, H =
// N / 2 on. (`tile` unsigned, as blockIdx.x: the same compares as when these read blockIdx.x.)
template <int NWN>
__device__ __forceinline__ int weight_column(unsigned tile, int lc, int N) {
  constexpr int NBLK = 32 * NWN;
  if constexpr (QOPS_GLU) {
    const int half = NBLK / 2, j = tile * half + (lc < half ? lc : lc - half);
    return lc < half ? j : (N >> 1) + j;
  } else {
    return tile * NBLK + lc;
  }
}

// Whether block-local column lc is a column of the weight (QOPS_GLU: its output column j < H).
template <int NWN>
__device__ __forceinline__ bool column_ok(unsigned tile, int lc, int N) {
  constexpr int NBLK = 32 * NWN;
  if constexpr (QOPS_GLU) {
    const int half = NBLK / 2;
    return tile * half + (lc < half ? lc : lc - half) < (N >> 1);
  } else {
    return tile * NBLK + lc < N;
  }
}

// Column tiles of the weight (QOPS_GLU: NBLK / 2 output columns a tile).
template <int NWN>
__device__ __forceinline__ int column_tiles(int N) {
  constexpr int NBLK = 32 * NWN;
  return QOPS_GLU ? ((N >> 1) + NBLK / 2 - 1) / (NBLK / 2) : (N + NBLK - 1) / NBLK;
}


// MT x 2 MMA C fragments (4 fp32 a lane each) set to zero.
template <int MT>
__device__ __forceinline__ void zero_frags(float (&a)[MT][2][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[mt][t][i] = 0.f;
}

// y = silu(gate) * up, from fp32 sums, stored as one output value.
template <int DT>
__device__ __forceinline__ void store_glu(u16* out, int m, int j, int ldo, float gate, float up) {
  const float y = gate / (1.f + __expf(-gate)) * up;
  out[static_cast<size_t>(m) * ldo + j] = f32_to_bits<DT>(y);
}

#if __CUDA_ARCH__ >= 900
// The cluster's last barrier (ptx.cuh): relaxed, or with QOPS_EXIT_FENCE the release arrive it had before.
__device__ __forceinline__ void exit_sync() {
  if constexpr (QOPS_EXIT_FENCE) cluster_sync();
  else cluster_exit_sync();
}

// v[e][u] = the sum over the cluster's CL blocks, in rank order, of the float at byte `offset(u, e)` of
// each block's `part` (offset < 0: none). Every block's values are requested before any is added: one
// distributed shared memory round trip, where a loop over the outputs waited for one each (28672 x 4096
// at M = 8..16 spent 2.3-3.6 us after its main loop: benchmarks/NOTES.md, stop 35). A template rather
// than a generic lambda: NVRTC 13.0 takes a generic lambda's call operator for a host function.
template <int CL, int E, int P, class Offset>
__device__ __forceinline__ void cluster_sum(float (&v)[E][P], u32 part_a, const Offset& offset) {
#pragma unroll
  for (int r = 0; r < CL; ++r) {
    const u32 base = dsmem_map(part_a, r);
#pragma unroll
    for (int u = 0; u < P; ++u)
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int o = offset(u, e);
        if (o >= 0) {
          const float w = ld_dsmem_f32(base + o);
          v[e][u] = r == 0 ? w : v[e][u] + w;
        }
      }
  }
}
#endif

template <int DT, int MT, int NWN, bool HAS_Z, int CL, bool XF, bool FOLD, int SR>
__device__ __forceinline__ void w4a16_gemv(const u32* __restrict__ qweight, const u16* __restrict__ scales,
                                           const u32* __restrict__ qzeros, const u16* __restrict__ x,
                                           const void* __restrict__ bias, u16* __restrict__ out,
                                           float* __restrict__ ws, int M, int N, int K, int ldx, int ldo,
                                           int chunks_per_group, int zero_offset, int flags) {
  constexpr int NWK = kWarps / NWN;
  constexpr int NBLK = 32 * NWN;
  constexpr int ROW = NWK * 16;  // 16-byte x slots (8 values) per row of one stage
  constexpr int RS = ROW + 4;    // padded stride: rows g, g+1 of a quarter warp fall in disjoint banks
  constexpr int kRing = ring_depth<MT>();
  constexpr int D = kRing - 1;  // prefetch distance in iterations
  static_assert(MT >= 1 && MT <= 4, "QOPS_MT is 1..4 (M <= 32)");
  static_assert(!FOLD || (XF && MT == 1), "QOPS_FOLD needs x staged once (QOPS_XFULL) and M <= 8");
  static_assert(SR == 0 || (SR >= 2 && SR <= 16 && XF), "QOPS_SMEM_RING is 0 or 2..16 and needs QOPS_XFULL");
  // The ring's copies address other lanes' columns as contiguous with this lane's.
  static_assert(!QOPS_GLU || SR == 0, "QOPS_GLU excludes QOPS_SMEM_RING");
  static_assert(!QOPS_F16MMA || XF, "QOPS_F16MMA converts x where it is staged once (QOPS_XFULL)");
  constexpr bool kF16 = QOPS_F16MMA && DT == 1;  // bf16 x staged as scaled f16
  constexpr int MDT = kF16 ? 0 : DT;             // the type of the MMAs' operands
  constexpr bool kWG = QOPS_WGMMA != 0;
  static_assert(!kWG || (XF && SR == 0 && !FOLD && !kF16 && (NWN == 4 || NWN == 8)),
                "QOPS_WGMMA needs x staged once, NWN 4 or 8 (a warpgroup's warps share their chunk), no fold, "
                "no bf16-through-f16 staging and no shared-memory ring");
  static_assert(!kLut || (XF && SR == 0 && !FOLD && !kWG && !HAS_Z),
                "QOPS_LUT needs x staged once, the register ring, no fold, no wgmma and no zeros");
  [[maybe_unused]] constexpr int kCore = 128;                  // QOPS_WGMMA: one core matrix of x, 8 rows x 16 bytes
  [[maybe_unused]] constexpr int kChunkImg = 16 * MT * kCore;  // QOPS_WGMMA: one 128-row chunk of the x image
  if (M <= 0 || N <= 0) {  // also the warm-up launch that only makes the module resident
    // Even with no work: a dependent launched after this grid waits only for this grid, so this grid
    // must not complete before the kernels ahead of it.
    grid_dep_wait();
    return;
  }
  if (flags & kEarlyDependents) grid_dep_launch_dependents();
#if QOPS_LUT
  // The codebook's table first (its address is the lookups' immediate), then what the other builds
  // keep at the start of dynamic shared memory.
  extern __shared__ uint4 smem_lut[];
  uint4* const smem = smem_lut + kLutBytes / 16;
  // A launch where dynamic shared memory starts elsewhere must fail, not read the wrong bytes.
  if (kLutBase >= 0 && smem_addr(smem_lut) != QOPS_SMEM_BASE) __trap();
  const u32 lut_lane = (kLutBase >= 0 ? 0u : smem_addr(smem_lut)) + 4u * (threadIdx.x & 31);
#else
  extern __shared__ uint4 smem[];
  [[maybe_unused]] constexpr u32 lut_lane = 0;
#endif
  // QOPS_STAMPS: block b's eight 64-bit slots at ws + 64 b bytes (after the S x M x N fp32 partials on the
  // workspace path: its sums stay intact): [0..4] the global timer (ns) at entry,
  // after griddepcontrol.wait, x staged, main loop done, end; [5..7] SM cycles of the three spans after
  // the wait (x staging, main loop, reduction and stores), slot 5 with the block's SM id in bits 48..63
  // (which SMs the slow blocks ran on). Compiled out otherwise.
#if QOPS_STAMPS
  long long cyc = 0;
  auto stamp = [&](int i) {
    if (threadIdx.x != 0) return;
    // After the fp32 partials where the S blocks of a tile sum through the workspace (S x M x N).
    float* base = ws + (CL == 1 && gridDim.y > 1 ? static_cast<size_t>(gridDim.y) * M * N : 0);
    unsigned long long* slot = reinterpret_cast<unsigned long long*>(base) + (static_cast<size_t>(blockIdx.y) * gridDim.x + blockIdx.x) * 8;
    slot[i] = global_timer_ns();
    const long long now = sm_cycles();
    if (i >= 2) slot[3 + i] = static_cast<unsigned long long>(now - cyc) | (i == 2 ? static_cast<unsigned long long>(sm_id()) << 48 : 0ull);
    cyc = now;
  };
#else
  auto stamp = [](int) {};
#endif
  stamp(0);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % NWN, wk = warp / NWN;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = weight_column<NWN>(blockIdx.x, wn * 32 + 4 * g, N);
  const bool n_ok = column_ok<NWN>(blockIdx.x, wn * 32 + 4 * g, N);
  const int KW = (K + 7) >> 3;
  const int C = (K + kChunkK - 1) / kChunkK;
  const int S = gridDim.y, split = blockIdx.y;
  const int cb = static_cast<int>(static_cast<long long>(split) * C / S);
  const int ce = static_cast<int>(static_cast<long long>(split + 1) * C / S);
  const int n_it = (ce - cb + NWK - 1) / NWK;
  const int zw = (N + 7) >> 3;
  const int xstage = M * RS;
  const int chunks_blk = (C + S - 1) / S;
  const int RSF = chunks_blk * 16 + 4;
  // This lane's qweight words for iteration `it`, step j: wbase + it * wstride + j * 4 * ldq (either
  // qweight form, kQSlabs in w4.cuh).
  const int ldq = qweight_row_stride(N, flags);
  const u32* wbase = qweight_column(qweight, n0, KW, flags) + static_cast<size_t>((cb + wk) * 16 + c) * ldq;
  const size_t wstride = static_cast<size_t>(NWK * 16) * ldq;
  const u32 wstep = 4u * ldq;

  // The register ring (unused with the shared-memory ring, which keeps the chunks in flight instead).
  Chunk ring[SR > 0 ? 1 : kRing];
#pragma unroll
  for (int r = 0; r < (SR > 0 ? 1 : kRing); ++r) {
#pragma unroll
    for (int j = 0; j < 4; ++j) ring[r].w[j] = make_uint4(0, 0, 0, 0);
    ring[r].s = make_uint2(0, 0);
    ring[r].z = 0u;
#if QOPS_LUT
    ring[r].s2 = make_uint2(0, 0);
#endif
  }
  float acc[MT][2][4];
  zero_frags(acc);

  // Loads that fall outside the weight are skipped, leaving stale registers: rows past K meet zeros
  // in x, columns past N are never stored, and a warp without a chunk skips the math.
  // Called for it = 0, 1, 2, ... in order, so the addresses advance by a constant stride instead of
  // being recomputed (integer work in the main loop costs issue slots the dequantization needs).
  const u32* wnext = wbase;
  int ch_next = cb + wk;
  // L2 prefetch QOPS_PREFETCH iterations ahead of the loads. The register ring keeps only D chunks
  // in flight per warp; the weight stream needs more bytes in flight than registers can hold (DRAM
  // latency under load x bandwidth), and a prefetch holds no register: the later load then waits
  // for L2 instead of DRAM.
  int it_next = 0;  // the iteration the next chunk load serves
  // (Iteration q's addresses from the next load's, not from wbase: one pointer fewer held across the loop.)
  auto prefetch_it = [&](int q) {
    if constexpr (QOPS_PREFETCH > 0) {
      const int ahead = q - it_next;
      const int ch = ch_next + ahead * NWK;
      const bool ok = n_ok && ch < ce;
      const int rows_left = KW - (ch * 16 + c);
      const u32* p = wnext + static_cast<ptrdiff_t>(ahead) * static_cast<ptrdiff_t>(wstride);
#pragma unroll
      for (int j = 0; j < 4; ++j) prefetch_l2_if(p + j * wstep, ok && 4 * j < rows_left);
    }
  };
  // The scale row (group) of chunk ch: ch / chunks_per_group (QOPS_LUT: two rows a chunk, 2 ch and
  // 2 ch + 1; a single group: 0), the division behind a uniform branch that groups of 128 rows
  // (chunks_per_group 1) never take. The ternary chain it replaces ran two branches and their
  // reconvergence every chunk. (Scale and zero offsets stepped across the loop took fewer
  // instructions still but 2-10 more registers, which pushed the M = 1 fold builds past 128: one
  // block an SM.) With the unconditional x loads and the one-instruction zero pairs below, the loop
  // lost ~15% of its instructions and ran 2-2.5% faster at M = 16 (benchmarks/NOTES.md, stop 41).
  const int g_per = kLut ? 0 : chunks_per_group;
  auto scale_row = [&](int ch) { return kLut ? 2 * ch : (g_per > 1 ? ch / g_per : ch * g_per); };
  // Where the next chunk of this lane comes from (both rings load the same pieces): prefetches
  // ahead, then advances the iteration, chunk and weight pointer.
  struct Src {
    const u32* w;  // step j at w + j * wstep
    const u16* s;
    const u32* z;
    bool ok;
    bool chunk_ok;  // the chunk is in this block's K range (ok also needs this lane's columns)
    int rows_left;
  };
  auto next_src = [&]() {
    prefetch_it(it_next + QOPS_PREFETCH);
    ++it_next;
    const int ch = ch_next;
    ch_next += NWK;
    const u32* p = wnext;
    wnext += wstride;
    const int grp = scale_row(ch);
    return Src{p, scales + static_cast<size_t>(grp) * N + n0, qzeros + static_cast<size_t>(grp) * zw + (n0 >> 3),
               n_ok && ch < ce, ch < ce, KW - (ch * 16 + c)};
  };
  auto load_chunk = [&](Chunk& ck) {
    const Src src = next_src();
#pragma unroll
    for (int j = 0; j < 4; ++j) ld_stream_v4_if(ck.w[j], src.w + j * wstep, src.ok && 4 * j < src.rows_left);
    ld_nc_v2_if(ck.s, src.s, src.ok);
    if constexpr (HAS_Z) ld_nc_u32_if(ck.z, src.z, src.ok);
#if QOPS_LUT
    ld_nc_v2_if(ck.s2, src.s + N, src.ok);
#endif
  };
  // The shared-memory ring (SR > 0): this warp's SR stages of kSmemStage bytes after x (and the FOLD
  // sums). Copy lane L fetches the qweight piece that lane 4 * (L % 8) + L / 8 reads (row L / 8 of
  // the step, columns 4 * (L % 8) ..): each eight consecutive lanes copy one 128-byte row segment.
  // (Tried against the doubled L2 sectors of the .cg copies, which it did not cure; the .ca form
  // did, and was measured with this mapping.) A lane then reads bytes other lanes copied, so the
  // warp syncs after its waits and before it overwrites a stage; scales and zeros stay per lane.
  char* sring = reinterpret_cast<char*>(smem + M * RSF + (FOLD ? chunks_blk * 4 : 0)) + warp * SR * kSmemStage;
  const u32 sring_a = smem_addr(sring);
  auto load_chunk_smem = [&](int stage) {
    const Src src = next_src();
    const u32 dst = sring_a + stage * kSmemStage;
    const int r = lane >> 3, gg = lane & 7;  // the row and column group this lane copies
    const int dn = 4 * (gg - g);
    const u32* w = src.w + (r - c) * ldq + dn;
    const bool ok = src.chunk_ok && n0 + dn < N;
    const int rows_left = src.rows_left + c - r;
    const u32 slot = dst + (4 * gg + r) * 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async_16_if(slot + j * 512, w + j * wstep, ok && 4 * j < rows_left);
    cp_async_8_if(dst + kSmemScales + lane * 8, src.s, src.ok);
    if constexpr (HAS_Z) cp_async_4_if(dst + kSmemZeros + lane * 4, src.z, src.ok);
  };
#if QOPS_SMEM_BULK
  // QOPS_SMEM_BULK (measurements; qweight in column slabs, which the host checks): a stage is the
  // warp's chunk as it lies in memory -- its 16 word rows of 32 columns, 2 KiB contiguous in the slab
  // form, so one bulk copy (lane 0) -- then its 32 scales (64 bytes, lane 16), its 4 zero words (16
  // bytes, lane 17) and the stage's mbarrier. Stop 18's version copied one 128-byte row a lane (the
  // flat form's rows lie 4N bytes apart) and ran at 0.64-0.74x the op: requests that small did not pay
  // (h200-2026-11-30-c9b8957-probe-w4-bulk.json). A lane reads row c + 4j at column group g (16
  // bytes; a 4-way bank conflict, lanes of one g reading four rows 128 bytes apart), scales at 8g,
  // zeros at word g / 2.
  constexpr int kBulkScales = 16 * 128, kBulkZeros = kBulkScales + 64, kBulkBar = kBulkZeros + 16;
  static_assert(kBulkBar + 8 <= kSmemStage && kBulkBar % 8 == 0, "the bulk stage fits the ring's stage");
  const int wn0 = n0 - 4 * g;  // the warp's first column (a multiple of 32)
  auto bulk_load = [&](int stage) {
    const Src src = next_src();
    const u32 dst = sring_a + stage * kSmemStage, bar = dst + kBulkBar;
    const int rows = src.chunk_ok ? max(0, min(16, src.rows_left + c)) : 0;  // word rows of this chunk inside K
    const bool cols = src.chunk_ok && wn0 < N;
    const u32 bytes = cols ? rows * 128u + 64u + (HAS_Z ? 16u : 0u) : 0u;
    if (lane == 0) mbar_arrive_expect_tx(bar, bytes);
    __syncwarp();
    if (cols) {
      if (lane == 0 && rows > 0) bulk_copy_g2s(dst, src.w - c * ldq - 4 * g, rows * 128u, bar);  // word row 16 chunk, column wn0
      if (lane == 16) bulk_copy_g2s(dst + kBulkScales, src.s - 4 * g, 64, bar);
      if (HAS_Z && lane == 17) bulk_copy_g2s(dst + kBulkZeros, src.z - (g >> 1), 16, bar);
    }
  };
  auto bulk_read = [&](int stage, int use) {
    const char* base = sring + stage * kSmemStage;
    mbar_wait_parity(sring_a + stage * kSmemStage + kBulkBar, static_cast<u32>(use & 1));
    Chunk ck;
#pragma unroll
    for (int j = 0; j < 4; ++j) ck.w[j] = *reinterpret_cast<const uint4*>(base + (c + 4 * j) * 128 + 16 * g);
    ck.s = *reinterpret_cast<const uint2*>(base + kBulkScales + 8 * g);
    ck.z = HAS_Z ? *reinterpret_cast<const u32*>(base + kBulkZeros + 4 * (g >> 1)) : 0u;
    return ck;
  };
#endif
  auto read_chunk_smem = [&](int stage) {
    const char* src = sring + stage * kSmemStage;
    Chunk ck;
#pragma unroll
    for (int j = 0; j < 4; ++j) ck.w[j] = *reinterpret_cast<const uint4*>(src + j * 512 + lane * 16);
    ck.s = *reinterpret_cast<const uint2*>(src + kSmemScales + lane * 8);
    ck.z = HAS_Z ? *reinterpret_cast<const u32*>(src + kSmemZeros + lane * 4) : 0u;
    return ck;
  };

  // x slots this thread stages each iteration: row m, 8 values from column k0 + 8*kk. Two cover
  // M * ROW <= 512 slots (the plans for MT <= 2 keep to that); MT >= 3 takes as many as 8*MT rows need.
  constexpr int kXSlots = MT <= 2 ? 2 : (8 * MT * ROW + kThreads - 1) / kThreads;
  const int nslots = M * ROW;
  int xsrc[kXSlots], xdst[kXSlots], xk[kXSlots];  // offsets into x (elements) and the stage (16-byte slots)
  bool xhas[kXSlots];
#pragma unroll
  for (int r = 0; r < kXSlots; ++r) {
    const int s = tid + r * kThreads;
    xhas[r] = s < nslots;
    const int m = xhas[r] ? s / ROW : 0, kk = s - m * ROW;
    xk[r] = cb * kChunkK + kk * 8;
    xsrc[r] = m * ldx + xk[r];
    xdst[r] = m * RS + kk;
  }
  const bool xvec = (flags & kXVec) != 0;

  auto load_x = [&](int it, int stage) {
    const int koff = it * NWK * kChunkK;
    uint4* base = smem + stage * xstage;
#pragma unroll
    for (int r = 0; r < kXSlots; ++r) {
      if (!xhas[r]) continue;
      const int k = xk[r] + koff;
      const u16* src = x + (xsrc[r] + koff);
      uint4* dst = base + xdst[r];
      if (xvec) {
        const bool in = k < K;
        cp_async_16(smem_addr(dst), in ? src : x, in ? 16 : 0);
      } else {
        *dst = load_x8_scalar(src, k, K);
      }
    }
  };

  // XF: the block's x, read once and stored in B-fragment order (x0 x4 x1 x5 x2 x6 x3 x7).
  // FOLD: per (block-local chunk, row m < 8) the sums the correction needs, after the staged x:
  // xsum[chunk * 8 + m] = (bias * sum of the staged values, sum of x); rows m >= M hold zeros.
  float2* xsum = reinterpret_cast<float2*>(smem + M * RSF);
  // The loads come first, QOPS_XU slots a thread, then their permutes and stores: one global round
  // trip for every QOPS_XU x 256 slots instead of one per 256 (Nsight Compute put 10-17% of the M = 1
  // kernel's stall samples on this prologue's loads, each waited for before the next was issued).
  // Slot s of the M x nkw staged slots is row s / nkw, 8-value word s % nkw; 16 | nkw, so the 16 lanes
  // of a chunk's FOLD sums share one row.
  static_assert(QOPS_XU >= 1 && QOPS_XU <= 8, "QOPS_XU is 1..8");
  const int nkw = (ce - cb) * 16;
  const int xtotal = M * nkw;
  // A thread's slots are tid, tid + kThreads, tid + 2 kThreads, ... (rounds of QOPS_XU), so their
  // rows and words are found by one division a thread and then stepped by (kThreads / nkw,
  // kThreads % nkw): a division by the runtime nkw is ~20 integer instructions, and with two a slot
  // (loads, then stores) they made the M = 16 prologue ~120 of a warp's ~480 instructions a chunk
  // (Nsight Compute, benchmarks/NOTES.md stop 33). M = 1 needs none (row 0, word s).
  struct SlotPos {
    int m, kwl;
  };
  const int step_m = (M > 1 && nkw > 0) ? kThreads / nkw : 0;
  const int step_w = M > 1 ? kThreads - step_m * nkw : kThreads;
  auto first_slot = [&]() -> SlotPos {
    if (M == 1 || nkw == 0) return SlotPos{0, tid};
    const int m = tid / nkw;
    return SlotPos{m, tid - m * nkw};
  };
  auto next_slot = [&](SlotPos& q) {
    q.m += step_m;
    q.kwl += step_w;
    if (M > 1 && q.kwl >= nkw) {
      q.kwl -= nkw;
      ++q.m;
    }
  };
  // The x slots base0 + u * kThreads + lane (u < QOPS_XU) of the block's M x nkw, all loaded before
  // any is used; slots past the end are zeros. `pos` is the first one's row and word on entry, the
  // next round's on return.
  auto load_x_slots = [&](int base0, uint4 (&v)[QOPS_XU], SlotPos& pos) {
#pragma unroll
    for (int u = 0; u < QOPS_XU; ++u) {
      // Warp-uniform: a short K range (a few slots a thread) does no more work than it needs.
      if (base0 + u * kThreads >= xtotal) break;
      const int s = base0 + u * kThreads + lane;
      const bool in = s < xtotal;
      const int m = in ? pos.m : 0, kwl = pos.kwl;
      next_slot(pos);
      const int k = (cb * 16 + kwl) * 8;
      const u16* src = x + (static_cast<size_t>(m) * ldx + k);
      const bool vec = xvec && k + 8 <= K;
      v[u] = make_uint4(0, 0, 0, 0);
      ld_nc_v4_if(v[u], src, in && vec);
      if (in && !vec) v[u] = load_x8_scalar(src, k, K);
    }
  };
  // kF16: row m's largest |x| in the block's K range, as fp32 bits, in the first word of the row's
  // padding slot (never written by the staging).
  auto row_max_bits = [&](int m) -> u32* { return reinterpret_cast<u32*>(smem + m * RSF + RSF - 4); };
  // kF16: 2^e (inverse: 2^-e) for row m, from its largest magnitude's exponent (e = 0 for a row of
  // zeros, infinities or NaNs; clamped to +-100 so both stay normal).
  auto row_scale = [&](int m, bool inverse) -> float {
    const int ex = static_cast<int>(*row_max_bits(m) >> 23);
    const int e = (ex == 0 && *row_max_bits(m) == 0) || ex == 255 ? 0 : max(-100, min(100, 14 - (ex - 127)));
    return __uint_as_float(static_cast<u32>(127 + (inverse ? -e : e)) << 23);
  };
  // kF16: the largest |x| of each row among the loaded slots, into the rows' maxima (shared atomics,
  // one a half warp: 16 | nkw, so the 16 lanes of a half warp hold one row's slots).
  auto max_slots = [&](int base0, const uint4 (&v)[QOPS_XU], SlotPos pos) {
#pragma unroll
    for (int u = 0; u < QOPS_XU; ++u) {
      if (base0 + u * kThreads >= xtotal) break;  // warp-uniform (the shuffles below)
      const int s = base0 + u * kThreads + lane;
      const int m = pos.m;
      next_slot(pos);
      // |x| of 8 bf16 values as bf16 bits (sign bits cleared; nonnegative floats order as integers).
      const u32 a = v[u].x & 0x7fff7fffu, b = v[u].y & 0x7fff7fffu, cc = v[u].z & 0x7fff7fffu, d = v[u].w & 0x7fff7fffu;
      u32 mx = max(max(max(a & 0xffffu, a >> 16), max(b & 0xffffu, b >> 16)), max(max(cc & 0xffffu, cc >> 16), max(d & 0xffffu, d >> 16)));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if ((lane & 15) == 0 && s < xtotal) atomicMax(row_max_bits(m), mx << 16);
    }
  };
  // kF16: the 8 bf16 values of a slot times 2^e, as f16 (round to nearest).
  auto to_scaled_f16 = [&](uint4 v, float sc) -> uint4 {
    auto cv = [&](u32 w) {
      return f32x2_to_f16x2(__uint_as_float(w << 16) * sc, __uint_as_float(w & 0xffff0000u) * sc);
    };
    return make_uint4(cv(v.x), cv(v.y), cv(v.z), cv(v.w));
  };
  // The loaded slots permuted into B-fragment order and stored (kF16: scaled and converted first;
  // FOLD: with their chunk sums).
  auto stage_slots = [&](int base0, uint4 (&v)[QOPS_XU], SlotPos pos) {
#pragma unroll
    for (int u = 0; u < QOPS_XU; ++u) {
      if (base0 + u * kThreads >= xtotal) break;  // warp-uniform (the FOLD sums shuffle across lanes)
      // The slots' rows and words stepped again from the round's first (`pos`), rather than
      // 2 x QOPS_XU registers held across the loads.
      const int s = base0 + u * kThreads + lane;
      const bool in = s < xtotal;
      const int m = in ? pos.m : 0, kwl = pos.kwl;
      next_slot(pos);
      if constexpr (kF16) v[u] = to_scaled_f16(v[u], row_scale(m, false));
      uint4 f = make_uint4(prmt<0x5410>(v[u].x, v[u].z), prmt<0x7632>(v[u].x, v[u].z), prmt<0x5410>(v[u].y, v[u].w),
                           prmt<0x7632>(v[u].y, v[u].w));
      if constexpr (FOLD) {
        // f16: the odd nibbles dequantize without their shift as 1024 + 16 q, so their x is staged
        // divided by 16 (exact: a power of two) and the product is x * (64 + q).
        float sum_x, sum_staged;
        if constexpr (MDT == 0) {
          f.y = fma_f16x2(f.y, 0x2c002c00u, 0x80008000u);  // * 1/16 (+ -0: exact)
          f.w = fma_f16x2(f.w, 0x2c002c00u, 0x80008000u);
          const float even = sum2<MDT>(f.x) + sum2<MDT>(f.z), odd = sum2<MDT>(f.y) + sum2<MDT>(f.w);
          sum_x = even + 16.f * odd;
          sum_staged = even + odd;
        } else {
          sum_x = sum2<MDT>(f.x) + sum2<MDT>(f.y) + sum2<MDT>(f.z) + sum2<MDT>(f.w);
          sum_staged = sum_x;
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) {  // over the 16 slots (lanes) of one chunk
          sum_x += __shfl_xor_sync(0xffffffffu, sum_x, o);
          sum_staged += __shfl_xor_sync(0xffffffffu, sum_staged, o);
        }
        if ((lane & 15) == 0 && in) xsum[(kwl >> 4) * 8 + m] = make_float2((MDT == 0 ? 1024.f : 128.f) * sum_staged, sum_x);
      }
      if (in) smem[m * RSF + kwl] = f;
    }
  };
  // QOPS_WGMMA: the block's x as wgmma's core-matrix image, chunk after chunk (w4a16_gemm.cu's layout;
  // rows M .. 8 MT - 1 and K on zero). Piece pc (16 bytes: 8 values of one row) belongs to 32-row step
  // q = pc / (32 MT) of the block's K range and 8-row group mg; a warp's 32 pieces are rows
  // 8 mg + g by value groups c, so each load reads whole sectors and each store fills 128 contiguous
  // bytes of a core matrix. Loads of QOPS_XU pieces a thread are issued before any is stored.
#if QOPS_WGMMA
  auto stage_x_image = [&]() {
    const int pieces = (ce - cb) * 4 * MT * 32;
    const u32 img = smem_addr(smem);
    for (int base0 = warp * 32; base0 < pieces; base0 += kThreads * QOPS_XU) {
      uint4 v[QOPS_XU];
#pragma unroll
      for (int u = 0; u < QOPS_XU; ++u) {
        if (base0 + u * kThreads >= pieces) break;  // warp-uniform (pieces is a multiple of 32)
        const int wu = (base0 + u * kThreads) >> 5, q = wu / MT, m = 8 * (wu - q * MT) + g;
        const int k = (cb * 16 + 4 * q + c) * 8;
        const u16* src = x + (static_cast<size_t>(m < M ? m : 0) * ldx + k);
        const bool vec = xvec && k + 8 <= K;
        v[u] = make_uint4(0, 0, 0, 0);
        ld_nc_v4_if(v[u], src, m < M && vec);
        if (m < M && !vec) v[u] = load_x8_scalar(src, k, K);
      }
#pragma unroll
      for (int u = 0; u < QOPS_XU; ++u) {
        if (base0 + u * kThreads >= pieces) break;
        const int wu = (base0 + u * kThreads) >> 5, q = wu / MT, mg = wu - q * MT;
        st_x_piece<MT>(img + q * 4 * MT * kCore + mg * kCore + g * 16 + 4 * c, v[u]);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // written in the generic proxy, read by wgmma
  };
#endif
  auto stage_x_full = [&]() {
    bool staged = false;
    if constexpr (kF16) {
      // The rows' maxima first: from the slots held in registers when one round covers the block's
      // x (at M = 1 a K range up to 256 x QOPS_XU x 8 values), else from a first pass of loads.
      if (tid < M) *row_max_bits(tid) = 0u;
      __syncthreads();
      if (xtotal <= kThreads * QOPS_XU) {  // block-uniform
        uint4 v[QOPS_XU];
        SlotPos pos = first_slot();
        const SlotPos start = pos;
        load_x_slots(warp * 32, v, pos);
        max_slots(warp * 32, v, start);
        __syncthreads();
        stage_slots(warp * 32, v, start);
        staged = true;
      } else {
        SlotPos pos = first_slot();
        for (int base0 = warp * 32; base0 < xtotal; base0 += kThreads * QOPS_XU) {
          uint4 v[QOPS_XU];
          const SlotPos start = pos;
          load_x_slots(base0, v, pos);
          max_slots(base0, v, start);
        }
        __syncthreads();
      }
    }
    if (!staged) {
      SlotPos pos = first_slot();
      for (int base0 = warp * 32; base0 < xtotal; base0 += kThreads * QOPS_XU) {
        uint4 v[QOPS_XU];
        const SlotPos start = pos;
        load_x_slots(base0, v, pos);
        stage_slots(base0, v, start);
      }
    }
    if constexpr (FOLD) {
      for (int i = tid; i < (ce - cb) * 8; i += kThreads)
        if ((i & 7) >= M) xsum[i] = make_float2(0.f, 0.f);
    }
  };

  // kF16: the sums of row m times 2^-e_m (exact), before the staged x (holding the rows' maxima) is reused.
  auto unscale_rows = [&]() {
    if constexpr (kF16) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int m = 8 * mt + 2 * c + i;
          const float inv = m < M ? row_scale(m, true) : 1.f;
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            acc[mt][t][i] *= inv;
            acc[mt][t][i + 2] *= inv;
          }
        }
    }
  };

  // This warp's sums into dst[wk][m][NBLK] (the block-local column; mn = M * NBLK), M rows, fp32.
  auto store_acc = [&](float* dst, int mn) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 8 * mt + 2 * c + (i & 1);
          const int col = wn * 32 + 4 * g + 2 * t + (i >> 1);
          if (m < M) dst[wk * mn + m * NBLK + col] = acc[mt][t][i];
        }
  };

  const W4ZeroBase zbase = w4_zero_base<MDT>(static_cast<u32>(HAS_Z ? zero_offset : 8));  // w4.cuh
  // x staged once: the staged row each B tile's lane reads (rows M .. 8 MT - 1: row M - 1, see compute).
  int xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) xrow[mt] = min(8 * mt + g, M - 1) * RSF;

  auto compute = [&](int it, const Chunk& ck, int stage) {
    const int ch = cb + it * NWK + wk;
    // Warp-uniform: this warp has no chunk in the block's last iteration. A wgmma build runs its MMAs
    // anyway (on x's first chunk, the sums dropped below): ptxas cannot tell that the branch is uniform
    // over the warpgroup and serializes every wgmma of a branch it takes for divergent (C7520).
    const bool have = ch < ce;
    if (!kWG && !have) return;

    u32 za[4], zb[4];
    float zf[4];  // FOLD: the zeros, subtracted after the MMA
    const u32 zbits = HAS_Z ? ck.z >> ((n0 & 7) * 4) : 0u;  // 4 nibbles: zeros of columns n0 .. n0+3
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const u32 nib = (zbits >> (4 * jj)) & 15u;
      if constexpr (FOLD) {
        zf[jj] = static_cast<float>(static_cast<int>(nib) + (HAS_Z ? zero_offset : 8));
      } else {
        w4_zero_pairs(zbase, nib, za[jj], zb[jj]);
      }
    }

    float gacc[MT][2][4];
    zero_frags(gacc);
    // acc += gacc x the columns' scales sc, in fp32 (the unfolded paths; QOPS_LUT: once a half-chunk).
    auto add_scaled = [&](const float (&sc)[4]) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][t][i] = fmaf(gacc[mt][t][i], sc[2 * t + (i >> 1)], acc[mt][t][i]);
    };

#if QOPS_WGMMA
    {
      // A step's fragments in one of two buffers: the wgmmas of step j - 1 may still read the other.
      // The zeros are tied to the asm stream: left to the compiler, they were materialized between the
      // first wgmmas, and ptxas then serialized them with an arrive and a wait of its own (C7519, C7517).
      float gw[2][4 * MT];
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4 * MT; ++i) {
          gw[t][i] = 0.f;
          fence_reg(gw[t][i]);
        }
      u32 pq[2][4][4];
      const u32 xchunk = smem_addr(smem) + (have ? ch - cb : 0) * kChunkImg;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u32 (&p)[4][4] = pq[j & 1];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) w4_dequant_word<MDT>(p[jj], word(ck.w[j], jj), za[jj], zb[jj]);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const unsigned long long desc = wgmma_desc(xchunk + (j * 2 + s) * 2 * (MT * kCore), MT * kCore, kCore);
#pragma unroll
          for (int t = 0; t < 2; ++t)
            Wgmma<MT, MDT>::run(gw[t], p[2 * t][2 * s], p[2 * t + 1][2 * s], p[2 * t][2 * s + 1], p[2 * t + 1][2 * s + 1], desc);
        }
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4 * MT; ++i) {
          fence_reg(gw[t][i]);
          gacc[i >> 2][t][i & 3] = gw[t][i];
        }
    }
#else
    const uint4* xs = XF ? smem : smem + stage * xstage;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // B fragments: x[m, 8*kw .. 8*kw+7] as pairs (0,4) (1,5) (2,6) (3,7), the pairs the unpacking yields.
      // x staged once: rows m >= M read row M - 1 (xrow), whose sums are never stored; an unconditional
      // load saves the zeroing and the predicate a conditional one costs (16 instructions a chunk at M = 16).
      u32 xb[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (XF) {
          const uint4 v = xs[xrow[mt] + (ch - cb) * 16 + 4 * j + c];
          xb[mt][0] = v.x;
          xb[mt][1] = v.y;
          xb[mt][2] = v.z;
          xb[mt][3] = v.w;
        } else {  // (the conditional load: one register a B tile fewer, which the gated M = 9..16 build needs)
          const int m = 8 * mt + g;
          uint4 v = make_uint4(0, 0, 0, 0);
          if (m < M) v = xs[m * RS + wk * 16 + 4 * j + c];
          xb[mt][0] = prmt<0x5410>(v.x, v.z);
          xb[mt][1] = prmt<0x7632>(v.x, v.z);
          xb[mt][2] = prmt<0x5410>(v.y, v.w);
          xb[mt][3] = prmt<0x7632>(v.y, v.w);
        }
      }
      // A fragments: p[jj][r] = (q[i] - z, q[i+4] - z) of column n0+jj, i = r, for r = 0..3.
      u32 p[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const u32 w = word(ck.w[j], jj);
        if constexpr (FOLD && MDT == 0) {
          // A = 1024 + q (even nibbles) and 1024 + 16 q (odd, against x / 16): bias and zero come off
          // after the MMA, from the staged x sums.
          const u32 w8 = w >> 8;
          p[jj][0] = and_or(w, 0x000f000fu, 0x64006400u);
          p[jj][1] = and_or(w, 0x00f000f0u, 0x64006400u);
          p[jj][2] = and_or(w8, 0x000f000fu, 0x64006400u);
          p[jj][3] = and_or(w8, 0x00f000f0u, 0x64006400u);
        } else if constexpr (FOLD) {
#pragma unroll
          for (int r = 0; r < 4; ++r) p[jj][r] = and_or(w >> (4 * r), 0x000f000fu, 0x43004300u);  // 128 + q
        } else if constexpr (kLut) {
          // Byte r of the word holds the codes of rows r (high nibble) and r + 4 (low): the table word is
          // (code of row r, code of row r + 4), the pair the MMA wants (the prepared layout's order).
          p[jj][0] = codebook_lookup<0, kLutStride, kLutBase>(lut_lane, w);
          p[jj][1] = codebook_lookup<1, kLutStride, kLutBase>(lut_lane, w);
          p[jj][2] = codebook_lookup<2, kLutStride, kLutBase>(lut_lane, w);
          p[jj][3] = codebook_lookup<3, kLutStride, kLutBase>(lut_lane, w);
        } else {
          w4_dequant_word<MDT>(p[jj], w, za[jj], zb[jj]);
        }
      }
      // Two 16-row k steps (nibbles 0,1,4,5 then 2,3,6,7) x two 16-column tiles: rows g and g+8 of
      // tile t are columns n0+2t and n0+2t+1.
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            mma_16816<MDT>(gacc[mt][t], p[2 * t][2 * s], p[2 * t + 1][2 * s], p[2 * t][2 * s + 1],
                          p[2 * t + 1][2 * s + 1], xb[mt][2 * s], xb[mt][2 * s + 1]);
      if constexpr (kLut) {
        if (j == 1) {  // steps 0, 1 are the chunk's first 64 rows (an absmax group): scaled here, in fp32
          float sa[4];
          column_scales(sa, ck.s, flags);
          add_scaled(sa);
          zero_frags(gacc);
        }
      }
    }
#endif

    float sc[4];
    column_scales(sc, chunk_s2(ck), flags);
    if constexpr (FOLD) {
      // (C1, S) of rows 2c and 2c + 1, the rows of this lane's accumulators; y = sum - C1 - z * S.
      const float4 cs = *reinterpret_cast<const float4*>(xsum + (ch - cb) * 8 + 2 * c);
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int jj = 2 * t + (i >> 1);
          const float c1 = (i & 1) ? cs.z : cs.x, sx = (i & 1) ? cs.w : cs.y;
          acc[0][t][i] = fmaf(fmaf(-zf[jj], sx, gacc[0][t][i] - c1), sc[jj], acc[0][t][i]);
        }
    } else if (have) {
      add_scaled(sc);
    }
  };

  if constexpr (SR > 0) {
    // As below, with the chunks in the shared-memory ring: iterations 0 .. SR-2 in flight before x is
    // staged. Iteration `it` first refills the stage of it-1 (read by this thread in the previous
    // iteration) with iteration it+SR-1, then waits for its own group: SR chunks in flight while it
    // computes. One group per iteration (maybe empty), so wait_group<SR-1> always means "the group
    // of `it` has landed".
    // With QOPS_SMEM_BULK each stage's mbarrier completes a phase per fill (one arrival announcing the
    // bytes, the copies' bytes landing), so chunk `it` waits for phase it / SR of stage it % SR; before
    // a stage is refilled, every lane's reads of it are done (warp sync) and ordered before the copy
    // engine's writes (proxy fence).
#if QOPS_SMEM_BULK
    if (lane == 0) {
      for (int st = 0; st < SR; ++st) mbar_init(sring_a + st * kSmemStage + kBulkBar, 1);
      mbar_init_fence();
    }
    __syncwarp();
    auto ring_fill = [&](int stage, bool any) {
      fence_proxy_async_smem();
      if (any) bulk_load(stage);
    };
    auto ring_take = [&](int stage, int it) { return bulk_read(stage, it / SR); };
#else
    auto ring_fill = [&](int stage, bool any) {
      if (any) load_chunk_smem(stage);
      cp_async_commit();
    };
    auto ring_take = [&](int stage, int) {
      cp_async_wait<SR - 1>();
      __syncwarp();  // the pieces other lanes copied for this lane have landed
      return read_chunk_smem(stage);
    };
#endif
#pragma unroll
    for (int d = 0; d < SR - 1; ++d) ring_fill(d, d < n_it);
    for (int q = SR - 1; q < QOPS_PREFETCH; ++q) prefetch_it(q);
    grid_dep_wait();  // x may still be being written by the kernel ahead
    stamp(1);
    stage_x_full();
    __syncthreads();
    stamp(2);
    for (int it0 = 0; it0 < n_it; it0 += SR) {
#pragma unroll
      for (int b = 0; b < SR; ++b) {
        const int it = it0 + b;
        if (it < n_it) {
          __syncwarp();  // every lane has read the stage of it - 1, refilled next
          ring_fill((b + SR - 1) % SR, it + SR - 1 < n_it);
          compute(it, ring_take(b, it), 0);
        }
      }
    }
#if QOPS_SMEM_BULK
    __syncwarp();  // every lane is past its last wait before the barriers go (their memory is reused below)
    if (lane == 0)
      for (int st = 0; st < SR; ++st) mbar_inval(sring_a + st * kSmemStage + kBulkBar);
#else
    cp_async_wait<0>();  // nothing is left in flight (only empty groups) before shared memory is reused
#endif
    unscale_rows();
    __syncthreads();
    stamp(3);
  } else if constexpr (XF) {
    // Weights of iterations 0 .. D-1 in flight first, then x (its latency overlaps theirs), then
    // every warp streams its chunks with no further barrier.
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (d < n_it) load_chunk(ring[d]);
    for (int q = D; q < QOPS_PREFETCH; ++q) prefetch_it(q);  // the iterations the prologue's loads did not cover
#if QOPS_LUT
    // The codebook is a weight (never written by the kernel ahead): its table is built under the
    // prologue's loads; the barrier after x's staging orders it before every lookup.
    codebook_table_build<MDT, kLutStride>(reinterpret_cast<unsigned char*>(smem_lut), reinterpret_cast<const float*>(qzeros),
                                          tid, kThreads);
#endif
    grid_dep_wait();  // x may still be being written by the kernel ahead
    stamp(1);
#if QOPS_WGMMA
    stage_x_image();
#else
    stage_x_full();
#endif
    __syncthreads();
    stamp(2);
    for (int it0 = 0; it0 < n_it; it0 += kRing) {
#pragma unroll
      for (int b = 0; b < kRing; ++b) {
        const int it = it0 + b;
        if (it < n_it) {
          if (it + D < n_it) load_chunk(ring[(b + D) % kRing]);
          compute(it, ring[b], b);
        }
      }
    }
    unscale_rows();
    __syncthreads();  // every warp is done with x before shared memory is reused below
    stamp(3);
  } else {
    // Prologue: iterations 0 .. D-1 in flight. On sm_90 all their weights go first, so that they
    // stream while the kernel ahead may still be writing x; before sm_90 each iteration's weights
    // and then its x, the order the kernel was tuned with there. Every iteration commits one
    // cp.async group (maybe empty) so that wait_group<D-1> always means "the group of the current
    // iteration has landed".
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (d < n_it) {
        load_chunk(ring[d]);
        if constexpr (!kGridDep) load_x(d, d);
      }
      if constexpr (!kGridDep) cp_async_commit();
    }
    for (int q = D; q < QOPS_PREFETCH; ++q) prefetch_it(q);  // the iterations the prologue's loads did not cover
    if constexpr (!kGridDep) stamp(1);  // no wait before sm_90: the span after it starts here
    if constexpr (kGridDep) {
      grid_dep_wait();
      stamp(1);
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if (d < n_it) load_x(d, d);
        cp_async_commit();
      }
    }
    stamp(2);  // x is staged per iteration here: this span only issues the first iterations' copies
    for (int it0 = 0; it0 < n_it; it0 += kRing) {
#pragma unroll
      for (int b = 0; b < kRing; ++b) {
        const int it = it0 + b;
        if (it < n_it) {
          cp_async_wait<D - 1>();
          __syncthreads();  // x of `it` visible to all; every warp is done with iteration it-1
          if (it + D < n_it) {
            load_chunk(ring[(b + D) % kRing]);
            load_x(it + D, (b + D) % kRing);
          }
          cp_async_commit();
          compute(it, ring[b], b);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    stamp(3);
  }
  // Only the reduction and the stores are left: the next dependent launch may start its weight loads.
  grid_dep_launch_dependents();

  // Reduction over the NWK warps sharing a column tile (shared memory reused), fixed order.
  float* red = reinterpret_cast<float*>(smem);  // [NWK][M][NBLK]
  const int total = M * NBLK;
  store_acc(red, total);
  __syncthreads();
  // [M][NBLK]: the block's sums, read by the other blocks of the cluster, or (QOPS_GLU, one block a
  // column tile) paired gate with up below.
  float* part = red + NWK * total;
  constexpr bool kPairHere = QOPS_GLU && CL == 1;  // with S == 1: the pairs meet in this block
  for (int idx = tid; idx < total; idx += kThreads) {
    float v = red[idx];
#pragma unroll
    for (int w = 1; w < NWK; ++w) v += red[w * total + idx];
    const int m = idx / NBLK, lc = idx - m * NBLK;
    if (CL > 1 || (kPairHere && S == 1)) {
      part[idx] = v;
    } else if (column_ok<NWN>(blockIdx.x, lc, N)) {
      const int n = weight_column<NWN>(blockIdx.x, lc, N);
      if (S == 1) store_out<DT>(out, bias, flags, m, n, ldo, v);
      else ws[(static_cast<size_t>(split) * M + m) * N + n] = v;
    }
  }
  constexpr int kHalf = NBLK / 2;
  if constexpr (kPairHere) {
    if (S == 1) {
      __syncthreads();
      for (int idx = tid; idx < M * kHalf; idx += kThreads) {
        const int m = idx / kHalf, lc = idx - m * kHalf;
        if (column_ok<NWN>(blockIdx.x, lc, N))
          store_glu<DT>(out, m, blockIdx.x * kHalf + lc, ldo, part[m * NBLK + lc], part[m * NBLK + kHalf + lc]);
      }
    }
  }
#if __CUDA_ARCH__ >= 900
  if constexpr (CL > 1) {
    cluster_sync();  // partials of every block of the cluster visible
    const int rank = static_cast<int>(cluster_rank());
    // A thread sums kPer outputs (idx = rank * kThreads + tid + u * CL * kThreads) with cluster_sum.
    // Scalar, so every thread has work and the stores stay coalesced (float4 groups left 3/4 of the
    // threads idle in a cluster of 8: +2-5%, stop 35).
    const u32 part_a = smem_addr(part);
    if constexpr (QOPS_GLU) {
      constexpr int kPer = (8 * MT * kHalf + CL * kThreads - 1) / (CL * kThreads);
      const int outs = M * kHalf;
      float v[2][kPer];  // gate, up
      cluster_sum<CL>(v, part_a, [&](int u, int e) {
        const int idx = (u * CL + rank) * kThreads + tid, m = idx / kHalf, lc = idx - m * kHalf;
        return idx < outs ? 4 * (m * NBLK + e * kHalf + lc) : -1;
      });
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int idx = (u * CL + rank) * kThreads + tid, m = idx / kHalf, lc = idx - m * kHalf;
        if (idx < outs && column_ok<NWN>(blockIdx.x, lc, N)) store_glu<DT>(out, m, blockIdx.x * kHalf + lc, ldo, v[0][u], v[1][u]);
      }
    } else {
      constexpr int kPer = (8 * MT * NBLK + CL * kThreads - 1) / (CL * kThreads);
      float v[1][kPer];
      cluster_sum<CL>(v, part_a, [&](int u, int) {
        const int idx = (u * CL + rank) * kThreads + tid;
        return idx < total ? 4 * idx : -1;
      });
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int idx = (u * CL + rank) * kThreads + tid, m = idx / NBLK, n = blockIdx.x * NBLK + idx - m * NBLK;
        if (idx < total && n < N) store_out<DT>(out, bias, flags, m, n, ldo, v[0][u]);
      }
    }
    exit_sync();  // no block leaves while another still reads its shared memory
  }
#endif
  stamp(4);
}

}  // namespace qops

extern "C" __global__ void __launch_bounds__(qops::kThreads, QOPS_MINB) QOPS_CLUSTER_ATTR
qops_w4a16_gemv(const unsigned* qweight, const unsigned short* scales, const unsigned* qzeros,
                const unsigned short* x, const void* bias, unsigned short* out, float* ws, int M, int N, int K,
                int ldx, int ldo, int chunks_per_group, int zero_offset, int flags) {
  qops::w4a16_gemv<QOPS_DT, QOPS_MT, QOPS_NWN, QOPS_HAS_Z != 0, QOPS_CLUSTER, QOPS_XFULL != 0, QOPS_FOLD != 0, QOPS_SMEM_RING>(
      qweight, scales, qzeros, x, bias, out, ws, M, N, K, ldx, ldo, chunks_per_group, zero_offset, flags);
}

// Split-K finish for the workspace path: out[m, n] = sum_s ws[s, m, n] (+ bias), s in order;
// QOPS_GLU: out[m, j] = silu(sum_s ws[s, m, j]) * sum_s ws[s, m, H + j], H = N / 2.
// A thread takes 4 adjacent output columns (N % 4 == 0, and N % 8 == 0 with QOPS_GLU: the host's;
// its ws is 16-byte aligned): 16-byte loads of every split's partials, all issued before the first
// add (one round trip, not S), the adds in split order (the same bits as one column a thread) and
// an 8-byte store where out allows. The host sizes the grid to match (int_weight_gemm.reduce_blocks).
// Measured against one column a thread (benchmarks/NOTES.md stop 44): 0.93-0.99x the op's time on the
// workspace plans (4096x14336 at M = 8 / 16, 8192x28672 at M = 4..16, the GEMM's split plans at M = 64).
extern "C" __global__ void __launch_bounds__(qops::kThreads)
qops_w4a16_reduce(const float* ws, const void* bias, unsigned short* out, int M, int N, int ldo, int S, int flags) {
  qops::grid_dep_wait();  // ws comes from the gemv just launched, which may still be storing it
  // Nothing here is worth overlapping with: a dependent launch may start its weight loads at once.
  qops::grid_dep_launch_dependents();
  const int idx = blockIdx.x * qops::kThreads + threadIdx.x;
  const int cols = QOPS_GLU ? N >> 1 : N;
  const size_t mn = static_cast<size_t>(M) * N;
  constexpr int kUnroll = 16;  // splits whose loads go out together (plans split at most 16 ways)
  const int quads = cols >> 2;
  if (idx >= M * quads) return;
  const int m = idx / quads, j = 4 * (idx - m * quads);
  const size_t at = static_cast<size_t>(m) * N + j;
  auto sum4 = [&](size_t first) {
    float4 p[kUnroll];
#pragma unroll
    for (int s = 0; s < kUnroll; ++s)
      if (s < S) p[s] = *reinterpret_cast<const float4*>(ws + s * mn + first);
    float4 v = p[0];
#pragma unroll
    for (int s = 1; s < kUnroll; ++s)
      if (s < S) v = make_float4(v.x + p[s].x, v.y + p[s].y, v.z + p[s].z, v.w + p[s].w);
    for (int s = kUnroll; s < S; ++s) {
      const float4 q = *reinterpret_cast<const float4*>(ws + s * mn + first);
      v = make_float4(v.x + q.x, v.y + q.y, v.z + q.z, v.w + q.w);
    }
    return v;
  };
  const float4 v = sum4(at);
  const float a[4] = {v.x, v.y, v.z, v.w};
  if constexpr (QOPS_GLU) {
    const float4 u = sum4(at + cols);
    const float b[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) qops::store_glu<QOPS_DT>(out, m, j + e, ldo, a[e], b[e]);
  } else {
    unsigned short* row = out + static_cast<size_t>(m) * ldo + j;
    if (((reinterpret_cast<unsigned long long>(row)) & 7) == 0) {
      float q[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) q[e] = qops::add_bias<QOPS_DT>(bias, flags, j + e, a[e]);
      *reinterpret_cast<uint2*>(row) = make_uint2(qops::pack2_bits<QOPS_DT>(q[0], q[1]), qops::pack2_bits<QOPS_DT>(q[2], q[3]));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) qops::store_out<QOPS_DT>(out, bias, flags, m, j + e, ldo, a[e]);
    }
  }
}
