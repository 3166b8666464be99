// W4A16 matmul for small prefill and batched decode (33 <= M <= 64 rows of x: the rows the decode
// kernel, w4a16_gemv.cu, does not take in one launch), reading the same runtime int-weight layout
// (qops/ops/int_weight.py), 4-bit case:
//   qweight u32 (ceil(K/8), N): word (kw, n) holds rows 8*kw .. 8*kw+7 of column n, nibble i = row 8*kw+i;
//           or the same words in 32-column slabs (N/32, ceil(K/8), 32) with flags & kQSlabs (w4.cuh);
//   scales  f16/bf16 (n_groups, N); group g covers rows [g*G, (g+1)*G), G a multiple of 128 or K
//           (passed as chunks_per_group = G / 128, or 0 for a single group);
//   qzeros  u32 (n_groups, ceil(N/8)) nibble stream along N, zero = nibble + zero_offset; or none (zero 8).
//   y[m, n] = sum_k x[m, k] * scale[k/G, n] * (q[k, n] - zero[k/G, n]) (+ bias[n]), fp32 accumulation.
// act_perm is applied by the caller (x gathered before the launch). The host guarantees K % 8 == 0
// and x rows 16-byte aligned.
//
// Why a second kernel. At M = 64 the decode kernel's design (x staged once, per-chunk fp32 group
// sums, up to 32 rows) runs out of registers, and two 32-row launches read the weight twice: they
// lost to the Triton lowering, whose dense path (dequantized slabs, then cuBLAS) itself runs at
// 0.56-0.81x cuBLAS fp16 (h200-2026-12-01-f28b309-int-weight.txt). Here one launch reads the weight
// once for all rows: at M = 64 a 16x16 weight fragment feeds 16 MMAs. Measured (Nsight Compute,
// benchmarks/NOTES.md stop 24) neither the weight stream nor the tensor cores set the pace of the
// mma.sync build at M = 64: the latency of each warp's instruction stream does, at 8 warps an SM.
// On Hopper the wgmma build below replaces it (1.02-1.41x faster, stop 25).
//
// Work split. A block is 8 warps, NWN along N (16 TW columns each: TW = 2 unless QOPS_TW says 1) by
// NWK = 8 / NWN along K; grid (ceil(N / (16 TW NWN)), S), the S blocks of a column tile splitting the K chunks (128 rows each)
// evenly. Iteration `it` of a block covers chunks cb + NWK it .. + NWK - 1, warp wk taking chunk
// cb + NWK it + wk. A lane's weights per chunk are those of the decode kernel: word rows
// 16 chunk + 4 j + lane % 4 (j = 0..3) of columns n0 .. n0 + 3, n0 = 4 (lane / 4) + the warp's
// offset (a quarter warp reads 128 contiguous bytes of a row), with the chunk's 4 scales and zero word.
//
// Pipeline. Everything an iteration reads goes through shared memory with cp.async, QOPS_STAGES
// stages deep (loads for iteration it + STAGES - 1 are issued at iteration it): the block's x for
// the iteration (M rows x NWK chunks, shared by its warps) and each warp's weights, scales and zeros
// (each lane copies its own pieces and reads back exactly those: no bank conflicts, nothing shared).
// A first version kept the weights in a register ring: at 226 registers a thread (one block, 8 warps
// an SM) that left one chunk in flight a warp and a barrier a chunk waiting on it, and M = 64 ran at
// 17-18% of the roofline (h200-2026-12-01-6ade7e6-probe-gemm.json). In shared memory the chunks in
// flight cost no registers. One barrier an iteration: after it, the stage refilled is the one every
// warp finished reading in the previous iteration.
//
// Math. As in the decode kernel, W is the 16x16 A operand (rows: columns n0 + 2t, n0 + 2t + 1 of the
// lane quads, K order inside a 32-row step permuted to match the nibble unpacking: pairs (q_i,
// q_i+4)), x^T the 16x8 B operand (one B tile per 8 rows of x, the same permutation applied when a
// lane reads its 16 bytes of x: 4 prmt). Unlike the decode kernel, the dequantized weight is
// multiplied by its group's scale in the activation dtype before the MMAs (one f16x2 / bf16x2
// multiply a register; the exact q - zero times the scale, rounded once, which is what a dequantized
// dense weight holds), so the MMAs accumulate straight into the output sums: no per-chunk fp32
// group sums, whose registers (MT x 8 a lane) the decode kernel pays at every M.
//
// Reduction, in a fixed order (no atomics: bit-identical from run to run): over the NWK warps of a
// block through shared memory (after the last iteration), then S == 1 writes the output, S > 1 writes
// fp32 partials to a workspace (S, M, N) that w4a16_gemv.cu's qops_w4a16_reduce adds in order.
//
// Programmatic dependent launch (sm_90): the first stages' weights, scales and zeros are copied
// before grid_dep_wait() (never written by the kernel ahead); x is copied, and anything written,
// only after it. The next launch is released after the main loop.
//
// Warpgroup MMAs (QOPS_WGMMA = 1, sm_90a only; NWN 4 or 8, so a warpgroup's four warps share their K
// chunk). mma.sync peaks near half of Hopper's dense fp16 rate, and at M = 64 the MMAs alone at
// that rate would take ~30 us on 28672 x 4096, the time #3's "2x cuBLAS" asks for the whole call;
// the profile above also counts each warp's shared loads and permutes of x (8 of each a 32-row step)
// among its stalls. Here the four warps of a warpgroup issue one wgmma m64 n(8 MT) k16 per 16-row
// step and 16-column tile: A is the warps' dequantized weight fragments in registers, exactly the
// mma.sync A fragments above (warp w of the group holds rows 16 w ..), and the tensor cores read x^T
// from shared memory themselves; D is laid out like MT mma.sync C fragments, so the reduction and
// the stores below are shared. The MMAs run asynchronously: a warp dequantizes the next 32-row step
// while the previous step's wgmmas run (a wait_group 1 before its fragments are overwritten).
// x cannot come through cp.async here, because the tensor cores read it in the weight fragments'
// permuted K order (pairs (q_i, q_i+4) of a word): each thread loads 16-byte pieces of x into
// registers two iterations ahead, permutes them (4 prmt a piece) and stores them as 4-byte words into
// one of three x buffers in the K-major core-matrix layout wgmma reads (three: the buffer written in
// iteration it was last read by wgmmas of it - 2, which every warpgroup has waited for before the
// barrier of it). Weights, scales and zeros keep the cp.async stages.
// Measured on the H200 (benchmarks/NOTES.md stop 25): x decides this build's speed. Without its x
// (QOPS_PROBE 3) the loop ran 2.3-3.3x faster at M = 64, without its MMAs or its dequantization
// only ~1.25x; each column tile reads all of x from L2, as many bytes as its weights at 256
// columns and M = 64. Loads that asked the L2 for twice the sectors they used were the first
// build's cost (a lane a row: 1.04-1.10x the mma.sync build; whole sectors: 1.02-1.41x). Loading
// two iterations ahead instead of one measured the same (before the loads read whole sectors).
// One 16-column tile a warp (TW = 1: two blocks an SM in 125 registers) was 1.1-1.9x slower: the
// block's x is read for half the columns.
// QOPS_XNAT = 1: the weight fragments in natural K order instead, so x
// needs no permutation and goes through cp.async in each pipeline stage like the weights (whole
// sectors, no registers, no prmt). A lane then needs rows 2c, 2c + 1 of every word row of a step: it
// reads the four 16-byte slots of its quad (4x the shared loads) and takes byte c of each word (one
// prmt with a per-lane selector, an and-or, one fma that removes bias and zero: f16 keeps the odd
// row's nibble in bits 4..7 and divides by 16 in the same fma; bf16 takes it from the word shifted
// by 4). Each iteration waits for its own MMAs (the next barrier lets the stage be refilled).
// Measured 1.07-1.35x *slower* than the register-staged x on the five PERF.md shapes at M = 33..64
// (h200-2026-12-01-f4e4b54-probe-xnat.json): so the register staging was not what x costs; off in
// the rule. Nor is the L2 asked for the same lines of x by every block at once: QOPS_KROT (each
// column tile starting at its own K chunk) timed within 2% of the rule (...-57ab254-probe-krot.json).
// Nsight Compute of the rule's build at 28672x4096, M = 64 (...-57ab254-ncu-gemm64-gemv16-*): 112
// blocks on 132 SMs, 8 warps an SM (227 registers), issue slots 32% busy, no dominant stall (fixed
// latency 24%, long scoreboard 12%: the permutes waiting on x's loads; short scoreboard 7%).
// QOPS_XPRE = 1: x permuted once per call instead of once per column tile. A small kernel in this
// file (qops_w4a16_x_image, launched just before the GEMM, PDL) writes x into the workspace as the
// exact shared-memory image the wgmma builds read: chunk by chunk (128 rows of K), each chunk 16 MT
// core matrices of 128 bytes in the permuted K order above, rows past M and K zero. Iteration it's
// x is then kXbBytes contiguous bytes of that image, copied into its pipeline stage by cp.async
// beside the weights (16-byte pieces, whole sectors, no registers, no permutes in the GEMM), while
// the weight path (fragments, dequantization, wgmma) is the register-staged build's. Without x
// (QOPS_PROBE 3) that build's loop ran 2.3-3.3x faster (stop 25), and xnat, which moved x to cp.async
// but the permutation onto the weight (4x its shared loads, a drain an iteration), measured slower.
// The stage of iteration it - 2 is the one refilled at iteration it (loads run kStages - 2 ahead), so
// no iteration waits for its own MMAs: by the barrier of it every warpgroup has issued a step of
// it - 1 and waited (wait_group 1) for everything of it - 2.
// Measured (benchmarks/NOTES.md stop 31): 1.13-1.32x faster than the register-staged x at M = 64 on
// the five PERF.md shapes, 1.04-1.27x at 17..48 rows; the rule takes it with wgmma. Without its MMAs
// the loop runs 1.4x faster and x now costs ~1 us over the weight stream alone (28672x4096): the
// MMAs and the dequantization, issued by the same two warpgroups, are what remains (Nsight Compute:
// issue slots ~21% busy, fixed-latency and HGMMA-dispatch stalls). Opening each stage under the
// previous iteration's last MMAs instead measured 1-5% slower.
// QOPS_WS = 1, 2 or 4 (with QOPS_XPRE): warp-specialized. Nsight Compute of the xpre build at M = 64
// (benchmarks/NOTES.md stop 42) against cuBLAS, whose blocks run a producer warpgroup beside two
// consumer warpgroups: ours issued ~520 instructions a warp an iteration, a fifth of them the
// cp.async address arithmetic, and every iteration ended on a block-wide barrier. Here QOPS_WS
// producer warps do all the copying: each lane issues, for each of its 8 / QOPS_WS compute warps,
// the cp.async pieces that lane of that warp reads (the stage layout is the xpre build's), then one
// cp.async.mbarrier.arrive.noinc, and lane 0 of the first producer one bulk copy of the iteration's
// image chunks (expect_tx). A stage's full mbarrier completes when both have landed; the compute
// warps wait on it instead of the barrier, and release the stage on its empty mbarrier (every
// compute thread arrives: a lane-0-only arrive is a branch inside the wgmma pipeline, which made
// ptxas serialize every MMA) once step QOPS_WGDEPTH - 1 of the next iteration has waited for all of
// its wgmmas. The MMAs and their order are the xpre build's: the output is bit-identical to it.
// 9 to 12 warps all leave 168 registers a thread (the register file is split between the four
// sub-partitions and one holds three warps); the compute warps take 146-168. The epilogue's
// barriers become a named barrier of the compute warps (the producers leave once their copies landed).
// Measured (benchmarks/NOTES.md stop 43): four producers 1.03-1.11x faster than xpre at M = 33 / 64
// where a block runs 14-64 iterations, 0.95-0.97x at 4 (4096 x 4096); one producer 1.1-1.2x slower
// (one sub-partition's load queue); 3-6 stages and QOPS_WGDEPTH 2 / 3 the same within 4%. Without the
// weight copies and the dequantization (QOPS_PROBE 6) the loop runs at 28.6 us on 28672 x 4096 at
// M = 64 (526 TFLOP/s of register-A m64n64k16 wgmma), and each of the two adds its own time to that
// (probes 5, 4; a build that dequantized into a sink feeding nothing was slower still, and one that
// started the second warpgroup late no faster: 009520f, removed): the compute warps' ALU work does
// not hide under these MMAs.
//
// Compile-time configuration (NVRTC -D): QOPS_DT (0 f16, 1 bf16), QOPS_MT (8-row tiles of x, 1..8:
// M <= 8 MT), QOPS_NWN (1, 2, 4, 8: warps along N), QOPS_HAS_Z (0/1), QOPS_STAGES (2..8: pipeline
// stages), QOPS_MINB (blocks an SM promised to ptxas), QOPS_WGMMA (0/1, above), QOPS_TW (1, 2: 16-column
// tiles a warp), QOPS_XNAT (0/1, above), QOPS_XPRE (0/1, above), QOPS_WS (0, 1, 2, 4, above),
// QOPS_WGDEPTH (1..3, above), QOPS_KROT (0/1: rotated K order), QOPS_PROBE (measurement builds).
#include "w4.cuh"

#ifndef QOPS_DT
#define QOPS_DT 0
#endif
#ifndef QOPS_MT
#define QOPS_MT 8
#endif
#ifndef QOPS_NWN
#define QOPS_NWN 8
#endif
#ifndef QOPS_HAS_Z
#define QOPS_HAS_Z 0
#endif
#ifndef QOPS_STAGES
#define QOPS_STAGES 4
#endif
#ifndef QOPS_MINB
#define QOPS_MINB 1
#endif
#ifndef QOPS_WGMMA
#define QOPS_WGMMA 0
#endif
#ifndef QOPS_TW
#define QOPS_TW 2
#endif
#ifndef QOPS_XNAT
#define QOPS_XNAT 0  // wgmma builds: weight fragments in natural K order, x through cp.async (header)
#endif
#ifndef QOPS_XPRE
#define QOPS_XPRE 0  // wgmma builds: x from the image qops_w4a16_x_image wrote, through cp.async (header)
#endif
#ifndef QOPS_KROT
#define QOPS_KROT 0  // 1: each column tile starts its K loop at a different chunk group (kit below)
#endif
#ifndef QOPS_WS
#define QOPS_WS 0  // xpre builds: 1, 2 or 4 producer warps copy every stage, the eight others only compute (header)
#endif
#ifndef QOPS_WGDEPTH
#define QOPS_WGDEPTH 1  // ws builds: wgmma groups (32-row steps) left in flight after each step's issue (1..3)
#endif
#ifndef QOPS_PROBE
#define QOPS_PROBE 0  // measurements only, wgmma builds (wrong sums): 1 no MMAs, 2 no dequantization either, 3 nor x;
                      // ws builds: 4 no weight copies, 5 no dequantization, 6 neither
#endif
#if QOPS_WGMMA
#include "wgmma.cuh"  // sm_90a only: the header says so otherwise
#endif

namespace qops {
namespace gemm {

constexpr int kDT = QOPS_DT;
constexpr int kMT = QOPS_MT;
constexpr int kNWN = QOPS_NWN;
constexpr int kTW = QOPS_TW;        // 16-column MMA tiles a warp
constexpr int kCols = 2 * kTW;      // columns a lane (rows g and g + 8 of each tile)
constexpr int kWarpCols = 16 * kTW;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;  // the warps that compute
constexpr bool kWs = QOPS_WS != 0;
constexpr int kProd = kWs ? QOPS_WS : 1;  // QOPS_WS: producer warps kWarps .. kWarps + kProd - 1
constexpr int kWPer = kWarps / kProd;     // compute warps whose pieces one producer warp copies
constexpr int kBlockThreads = kThreads + (kWs ? 32 * QOPS_WS : 0);
constexpr int kNWK = kWarps / kNWN;
constexpr int kStages = QOPS_STAGES;
constexpr bool kHasZ = QOPS_HAS_Z != 0;
constexpr int kChunkK = 128;
constexpr int kRow = kNWK * 16;  // 16-byte x slots (8 values) of one row in one stage
constexpr int kRS = kRow + 4;    // padded: rows g, g + 1 of a quarter warp fall in disjoint banks
// One warp's weights in a stage (w4a16_gemv.cu's kSmemStage at TW = 2): 4 steps x 32 lanes x 4 TW bytes
// (a lane's words of one row), lane-major within a step, then the lanes' scales (2 TW bytes each),
// then their zero words (4 bytes each).
constexpr int kWPiece = 4 * kCols;
constexpr int kWarpW = 4 * 32 * kWPiece + 32 * 2 * kCols + 32 * 4;
constexpr int kWScales = 4 * 32 * kWPiece;
constexpr int kWZeros = kWScales + 32 * 2 * kCols;
constexpr int kScaleBf16 = 8;  // `flags` bit, as in w4a16_gemv.cu
static_assert(kMT >= 1 && kMT <= 8, "QOPS_MT is 1..8 (M <= 64)");
static_assert(kNWN == 1 || kNWN == 2 || kNWN == 4 || kNWN == 8, "QOPS_NWN is 1, 2, 4 or 8");
static_assert(kTW == 1 || kTW == 2, "QOPS_TW is 1 or 2");
static_assert(kStages >= 2 && kStages <= 8, "QOPS_STAGES is 2..8");
static_assert(kWarpW % 16 == 0, "stages must stay 16-byte aligned");
constexpr bool kWgmma = QOPS_WGMMA != 0;
static_assert(!kWgmma || kNWN == 4 || kNWN == 8, "QOPS_WGMMA: a warpgroup's warps must share their chunk (NWN 4 or 8)");
constexpr bool kXNat = QOPS_XNAT != 0;
static_assert(!kXNat || (kWgmma && kTW == 2 && QOPS_PROBE == 0), "QOPS_XNAT is a wgmma build with two tiles a warp");
constexpr bool kXPre = QOPS_XPRE != 0;
static_assert(!kXPre || (kWgmma && !kXNat && QOPS_KROT == 0 && kStages >= 3),
              "QOPS_XPRE is a wgmma build with the weight's own K order, natural chunk order and at least 3 stages");
// wgmma's x buffer: per chunk of the iteration (NWK), 32-row step (4), 16-row k step (2) and K half
// (2), MT core matrices of 8 rows x 16 bytes (x rows 8 i .. 8 i + 7 at 128 i bytes).
constexpr int kCore = 128;
constexpr int kChunkImg = 4 * 2 * 2 * kMT * kCore;  // one chunk's part of it (QOPS_XPRE: the image's unit)
constexpr int kXbBytes = kNWK * kChunkImg;
static_assert(!kWs || (kXPre && kTW == 2 && (QOPS_PROBE == 0 || (QOPS_PROBE >= 4 && QOPS_PROBE <= 6)) && QOPS_MINB == 1),
              "QOPS_WS is an xpre build with two tiles a warp, one block an SM, no probe but its own (4..6)");
static_assert(QOPS_WS == 0 || QOPS_WS == 1 || QOPS_WS == 2 || QOPS_WS == 4, "QOPS_WS is 0, 1, 2 or 4 producer warps");
static_assert(QOPS_PROBE < 4 || kWs, "QOPS_PROBE 4..6 are ws builds");
constexpr int kDepth = QOPS_WGDEPTH;
static_assert(kDepth >= 1 && kDepth <= 3 && (kDepth == 1 || kWs), "QOPS_WGDEPTH is 1..3, above 1 in ws builds only");
// Fragment buffers: a step's registers are rewritten only after its group retired, and indexed by
// the step (0..3) so that the index stays a compile-time one across iterations.
constexpr int kFragBufs = kDepth == 1 ? 2 : 4;
#if QOPS_WGMMA
#if !QOPS_XNAT
constexpr int kXbufs = 3;  // the register-staged x's buffers
#endif
constexpr int kXPieces = (8 * kMT) * kNWK * 4 * 4;  // 16-byte pieces of x an iteration
constexpr int kXPiecesPerThread = (kXPieces + kThreads - 1) / kThreads;
#endif

// A scale (f16 or bf16 bits, per `flags`) as a DT pair.
__device__ __forceinline__ u32 scale_pair(u32 bits16, int flags) {
  const u16 h = static_cast<u16>(bits16);
  const float f = (flags & kScaleBf16) ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
  const u32 d = f32_to_bits<kDT>(f);
  return d | (d << 16);
}

// The first stages when x goes through cp.async too: weights (never written by the kernel ahead),
// then x (load_x) once that kernel is done. Group s is committed after stage s's x: group 0 also
// carries every first stage's weights (the first wait covers them all), later groups one stage
// whole. A template, not a generic lambda: NVRTC 13.0 (the H200 machine's) takes a generic lambda's
// call operator for a host function.
template <int Stages, class LoadW, class LoadX>
__device__ __forceinline__ void load_first_stages(int n_it, const LoadW& load_w, const LoadX& load_x) {
#pragma unroll
  for (int st = 0; st < Stages - 1; ++st)
    if (st < n_it) load_w(st, st);
  grid_dep_wait();
#pragma unroll
  for (int st = 0; st < Stages - 1; ++st) {
    if (st < n_it) load_x(st, st);
    cp_async_commit();  // one group a stage, empty or not, so the wait below counts stages
  }
}

}  // namespace gemm
}  // namespace qops

extern "C" __global__ void __launch_bounds__(qops::gemm::kBlockThreads, QOPS_MINB)
qops_w4a16_gemm(const unsigned* __restrict__ qweight, const unsigned short* __restrict__ scales,
                const unsigned* __restrict__ qzeros, const unsigned short* __restrict__ x,
                const void* __restrict__ bias, unsigned short* __restrict__ out, float* __restrict__ ws, int M,
                int N, int K, int ldx, int ldo, int chunks_per_group, int zero_offset, int flags) {
  using namespace qops;
  using namespace qops::gemm;
  if (M <= 0 || N <= 0) {  // also the warm-up launch that only makes the module resident
    grid_dep_wait();
    return;
  }
  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wn = warp % kNWN, wk = warp / kNWN;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * (kWarpCols * kNWN) + wn * kWarpCols + kCols * g;
  const bool n_ok = n0 < N;  // N % 4 == 0: a lane's 2 TW columns are all in or all out
  const int KW = (K + 7) >> 3;
  const int C = (K + kChunkK - 1) / kChunkK;
  const int S = gridDim.y, split = blockIdx.y;
  const int cb = static_cast<int>(static_cast<long long>(split) * C / S);
  const int ce = static_cast<int>(static_cast<long long>(split + 1) * C / S);
  const int n_it = (ce - cb + kNWK - 1) / kNWK;
  // Iteration it reads the block's chunk group kit(it): with QOPS_KROT the blocks of a grid start at
  // different groups (rotated by the column tile), so they do not all ask the L2 for the same lines of
  // x at once. The order of a block's sums is fixed either way (bit-identical run to run).
  const int rot = (QOPS_KROT && n_it > 0) ? static_cast<int>(blockIdx.x % n_it) : 0;
  auto kit = [&](int it) {
    if constexpr (!QOPS_KROT) return it;  // the builds without it: the code of before, select-free
    return it + rot < n_it ? it + rot : it + rot - n_it;
  };
  const int zw = (N + 7) >> 3;
  // A stage: x (M rows of kRS slots; none with wgmma, whose x buffers follow the stages), then the
  // 8 warps' weights.
  // With QOPS_XNAT the stage's x is the wgmma core-matrix image of the iteration's chunks.
  const int xstage = kWgmma ? ((kXNat || kXPre) ? kXbBytes : 0) : M * kRS * 16;
  const int stage_bytes = xstage + kWarps * kWarpW;
  const u32 smem_a = smem_addr(smem);
  const char* smem_c = reinterpret_cast<const char*>(smem);

  // This lane's weight pieces, scales and zero word for iteration `it` into stage `st`; nothing is
  // copied past K, past N or past the block's chunks (the slots keep stale bytes: rows past K meet
  // zeros in x, columns past N are never stored, and a warp without a chunk skips the math).
  // Either qweight form (kQSlabs in w4.cuh): a lane's columns n0 .. n0 + 2 TW - 1 lie in one slab.
  const int ldq = qweight_row_stride(N, flags);
  const u32* wbase = qweight_column(qweight, n0, KW, flags) + static_cast<size_t>((cb + wk) * 16 + c) * ldq;
  const size_t wstride = static_cast<size_t>(kNWK * 16) * ldq;
  auto load_w = [&](int it, int st) {
    const int ch = cb + kit(it) * kNWK + wk;
    const bool ok = n_ok && ch < ce;
    const int rows_left = KW - (ch * 16 + c);
    const int grp = chunks_per_group == 1 ? ch : (chunks_per_group == 0 ? 0 : ch / chunks_per_group);
    const u32 dst = smem_a + st * stage_bytes + xstage + warp * kWarpW;
    const u32* src = wbase + static_cast<size_t>(kit(it)) * wstride;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 d = dst + j * (32 * kWPiece) + lane * kWPiece;
      const u32* sj = src + static_cast<size_t>(4 * j) * ldq;
      if constexpr (kTW == 2) cp_async_16_if(d, sj, ok && 4 * j < rows_left);
      else cp_async_8_if(d, sj, ok && 4 * j < rows_left);
    }
    if constexpr (kTW == 2) cp_async_8_if(dst + kWScales + lane * 8, scales + static_cast<size_t>(grp) * N + n0, ok);
    else cp_async_4_if(dst + kWScales + lane * 4, scales + static_cast<size_t>(grp) * N + n0, ok);
    if constexpr (kHasZ) cp_async_4_if(dst + kWZeros + lane * 4, qzeros + static_cast<size_t>(grp) * zw + (n0 >> 3), ok);
  };


  float acc[kMT][kTW][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int t = 0; t < kTW; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][t][i] = 0.f;

  const W4ZeroBase zbase = w4_zero_base<kDT>(static_cast<u32>(kHasZ ? zero_offset : 8));  // w4.cuh

  // This warp's chunk of stage st, dequantized: the 2 TW weight words a lane holds for each 32-row
  // step (wv), then per step j the A fragments p[jj][r] = scale * (q[r] - z, q[r+4] - z) of column n0 + jj.
  struct Chunk {
    u32 wv[4][kCols];
    u32 za[kCols], zb[kCols], sp[kCols];
  };
  auto read_chunk = [&](int st) {
    Chunk ck;
    const char* wsm = smem_c + st * stage_bytes + xstage + warp * kWarpW;
    // Every shared load first (six in flight at once), then the scale and zero pairs: converting the
    // scales right after their load stalled on it (5% of the samples, Nsight Compute at a09a7cc).
    u32 sc[kTW];
    if constexpr (kTW == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(wsm + kWScales + lane * 8);
      sc[0] = v.x;
      sc[kTW - 1] = v.y;
    } else {
      sc[0] = *reinterpret_cast<const u32*>(wsm + kWScales + lane * 4);
    }
    const u32 zbits = kHasZ ? *reinterpret_cast<const u32*>(wsm + kWZeros + lane * 4) >> ((n0 & 7) * 4) : 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const char* pj = wsm + j * (32 * kWPiece) + lane * kWPiece;
      if constexpr (kTW == 2) {
        const uint4 v = *reinterpret_cast<const uint4*>(pj);
        ck.wv[j][0] = v.x;
        ck.wv[j][1] = v.y;
        ck.wv[j][kCols - 2] = v.z;
        ck.wv[j][kCols - 1] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(pj);
        ck.wv[j][0] = v.x;
        ck.wv[j][1] = v.y;
      }
    }
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) {
      const u32 nib = (zbits >> (4 * jj)) & 15u;  // zero of column n0 + jj
      w4_zero_pairs(zbase, nib, ck.za[jj], ck.zb[jj]);
      const u32 sw = sc[jj >> 1];
      ck.sp[jj] = scale_pair((jj & 1) ? sw >> 16 : sw, flags);
    }
    return ck;
  };
  [[maybe_unused]] auto dequant_step = [&](const Chunk& ck, int j, u32 (&p)[kCols][4]) {
#pragma unroll
    for (int jj = 0; jj < kCols; ++jj) {
      w4_dequant_word<kDT>(p[jj], ck.wv[j][jj], ck.za[jj], ck.zb[jj]);
#pragma unroll
      for (int r = 0; r < 4; ++r) p[jj][r] = mul2<kDT>(p[jj][r], ck.sp[jj]);
    }
  };

#if QOPS_WGMMA
  float accw[kTW][4 * kMT];
#pragma unroll
  for (int t = 0; t < kTW; ++t)
#pragma unroll
    for (int i = 0; i < 4 * kMT; ++i) accw[t][i] = 0.f;
  // The wgmmas of 32-row step j of the warpgroup's chunk (x's core matrices at xbase), its fragments q:
  // two 16-row k steps x the warp's tiles, one commit group; then wait until the previous step's
  // group is done, so its fragments may be overwritten.
  auto issue_step = [&](u32 xbase, int j, const u32 (&q)[kCols][4]) {
    wgmma_fence();
#pragma unroll
    for (int s2 = 0; s2 < 2; ++s2) {
      const unsigned long long desc = wgmma_desc(xbase + ((wk * 4 + j) * 2 + s2) * 2 * (kMT * kCore), kMT * kCore, kCore);
#pragma unroll
      for (int t = 0; t < kTW; ++t)
        Wgmma<kMT, kDT>::run(accw[t], q[2 * t][2 * s2], q[2 * t + 1][2 * s2], q[2 * t][2 * s2 + 1], q[2 * t + 1][2 * s2 + 1], desc);
    }
    wgmma_commit();
    wgmma_wait<kDepth>();
  };
#if QOPS_PROBE
  // What the main loop costs without its MMAs (1), or its dequantization too (2, 3): the words
  // still reach a register sum, so nothing is optimized away.
  auto probe_chunk = [&](const Chunk& ck) {
    u32 sink = 0;
    u32 p[kCols][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int jj = 0; jj < kCols; ++jj) {
        if (QOPS_PROBE == 1) {
          dequant_step(ck, j, p);
          sink ^= p[jj][0] ^ p[jj][1] ^ p[jj][2] ^ p[jj][3];
        } else {
          sink ^= ck.wv[j][jj];
        }
      }
    }
    accw[0][0] += __uint_as_float(sink & 0x3FFFFFu);
  };
#endif

#if QOPS_XNAT
  // x through cp.async, in natural K order (header). Piece u of an iteration: 16 bytes (8 values, group
  // c of a 32-row step) of one x row into its core matrix; a warp's 32 pieces are rows 8 mg .. 8 mg + 7
  // by the 4 groups of step q (= wkc * 4 + j), lane = 4 (row % 8) + c: whole sectors read, 128
  // contiguous bytes written a group. Rows past M and columns past K are zero-filled.
  auto load_x_nat = [&](int it, int st) {
    const int k0 = (cb + kit(it) * kNWK) * kChunkK;
    const u32 base = smem_a + st * stage_bytes;
#pragma unroll
    for (int i = 0; i < kXPiecesPerThread; ++i) {
      const int u = tid + i * kThreads;  // u % 32 == lane
      if (u >= kXPieces) break;
      const int wu = u >> 5, q = wu / kMT, mg = wu - q * kMT;
      const int m = 8 * mg + (lane >> 2), k = k0 + 32 * q + 8 * c;
      const bool in = m < M && k < K;  // K % 8 == 0: 8 values all in or all out
      cp_async_16(base + ((4 * q + c) * kMT + mg) * kCore + (lane >> 2) * 16, in ? x + static_cast<size_t>(m) * ldx + k : x,
                  in ? 16 : 0);
    }
  };
  // A lane's pair of rows 2c, 2c + 1 of a word (its k columns of the A fragment in natural order):
  // byte c of the word twice, the low nibble kept in the low half and the high one in the high half
  // (f16: in its bits 4..7, removed with the 16 q trick; bf16, whose mantissa has no room for that:
  // the word shifted by 4 supplies the high half's nibble), then one fma removes bias and zero.
  const u32 nat_sel = kDT == 0 ? (c | (c << 8)) : (c | ((4 + c) << 8));
  auto nat_pair = [&](u32 w, u32 zn) {
    if constexpr (kDT == 0) {
      return fma_f16x2(and_or(prmt_r(w, w, nat_sel), 0x00F0000Fu, 0x64006400u), 0x2C003C00u, zn);  // (1, 1/16)
    } else {
      return fma_bf16x2(and_or(prmt_r(w, w >> 4, nat_sel), 0x000F000Fu, 0x43004300u), 0x3F803F80u, zn);
    }
  };

  load_first_stages<kStages>(n_it, load_w, load_x_nat);

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage it have landed
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // x, copied in the generic proxy, is read by wgmma
    __syncthreads();  // everyone's copies have landed; every warpgroup's MMAs of the stage refilled below are done
    const int ahead = it + kStages - 1;
    if (ahead < n_it) {
      load_w(ahead, ahead % kStages);
      load_x_nat(ahead, ahead % kStages);
    }
    cp_async_commit();
    if (cb + kit(it) * kNWK + wk < ce) {  // warpgroup-uniform: the group's warps share wk
      const int st = it % kStages;
      const Chunk ck = read_chunk(st);  // scales and zeros (its own words go unused here)
      const char* wsm = smem_c + st * stage_bytes + xstage + warp * kWarpW;
      const u32 xst = smem_a + st * stage_bytes;
      u32 zn[kCols];  // the fma's addends: -(1024 + z), -(64 + z) (f16); -(128 + z) twice (bf16)
#pragma unroll
      for (int jj = 0; jj < kCols; ++jj) zn[jj] = kDT == 0 ? prmt<0x7610>(ck.za[jj] ^ 0x80008000u, ck.zb[jj]) : ck.za[jj];
      u32 p[2][kCols][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // Step j's four word rows 4 j + r of the lane's columns, from the slots of lanes 4 g + r (the quad
        // copied them; the barrier above made them visible): p[jj][r] = rows 8 r + 2 c, + 1 of column n0 + jj.
        uint4 wr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) wr[r] = *reinterpret_cast<const uint4*>(wsm + j * (32 * kWPiece) + (4 * g + r) * kWPiece);
#pragma unroll
        for (int jj = 0; jj < kCols; ++jj)
#pragma unroll
          for (int r = 0; r < 4; ++r) p[j & 1][jj][r] = mul2<kDT>(nat_pair(word(wr[r], jj), zn[jj]), ck.sp[jj]);
        issue_step(xst, j, p[j & 1]);
      }
    }
    wgmma_wait<0>();  // this stage's x is refilled after the next barrier
  }
#elif QOPS_XPRE
  // x from the image (header): partials of a split-K plan first in the workspace, the image after them.
  // (int_weight_gemm.make_plan: the partials' bytes rounded up to 256.)
  const char* ximg = reinterpret_cast<const char*>(ws) + (S > 1 ? (static_cast<size_t>(S) * M * N * 4 + 255) / 256 * 256 : 0);
#if QOPS_WS
  // Warp-specialized (header): warp kWarps copies, warps 0..7 compute. Stage st's full barrier completes
  // once the producer's 32 lanes' cp.async (weights, scales, zeros of every compute warp, each lane the
  // pieces the same lane of that warp reads) and the bulk copy of the x image have landed; its empty
  // barrier once each compute warp is done with it (its wgmmas reading x retired).
  const u32 bars = smem_a + kStages * stage_bytes;
  auto full_bar = [&](int st) { return bars + 8 * st; };
  auto empty_bar = [&](int st) { return bars + 8 * (kStages + st); };
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full_bar(st), 32 * kProd + 1);  // the producer lanes' cp.async arrivals (noinc), lane 0's expect_tx
      mbar_init(empty_bar(st), kThreads);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp >= kWarps) {
    // A producer warp: compute warps pw kWPer .. + kWPer - 1, lane (g, c) copying the pieces that lane of
    // each reads (load_w above with that warp). Their sources at iteration 0, advanced by wstride an
    // iteration; a K chunk's group once per chunk, not per warp. (load_w's own arithmetic per warp and
    // stage, repeated for 8 / QOPS_WS warps, was 545 instructions a stage against these 223.)
    const int pw = warp - kWarps;
    const u32* wsrc[kWPer];
    const unsigned short* ssrc[kWPer];
    const u32* zsrc[kWPer];
    bool col_ok[kWPer];
#pragma unroll
    for (int i = 0; i < kWPer; ++i) {
      const int w = pw * kWPer + i;
      const int n0_w = blockIdx.x * (kWarpCols * kNWN) + (w % kNWN) * kWarpCols + kCols * g;
      col_ok[i] = n0_w < N;
      wsrc[i] = qweight_column(qweight, col_ok[i] ? n0_w : 0, KW, flags) + static_cast<size_t>((cb + w / kNWN) * 16 + c) * ldq;
      ssrc[i] = scales + (col_ok[i] ? n0_w : 0);
      zsrc[i] = qzeros + (col_ok[i] ? n0_w >> 3 : 0);
    }
    auto group_of = [&](int ch) { return chunks_per_group == 1 ? ch : (chunks_per_group == 0 ? 0 : ch / chunks_per_group); };
    auto fill_w = [&](int it, int st) {
      if constexpr (QOPS_PROBE != 4 && QOPS_PROBE != 6) {
        int grp[kNWK];
#pragma unroll
        for (int q = 0; q < kNWK; ++q) grp[q] = group_of(cb + it * kNWK + q);
#pragma unroll
        for (int i = 0; i < kWPer; ++i) {
          const int w = pw * kWPer + i, wk_w = w / kNWN;
          const int ch = cb + it * kNWK + wk_w;
          const bool ok = col_ok[i] && ch < ce;
          const int rows_left = KW - (ch * 16 + c);
          const u32 dst = smem_a + st * stage_bytes + xstage + w * kWarpW;
          const u32* src = wsrc[i] + static_cast<size_t>(it) * wstride;
#pragma unroll
          for (int j = 0; j < 4; ++j)
            cp_async_16_if(dst + j * (32 * kWPiece) + lane * kWPiece, src + static_cast<size_t>(4 * j) * ldq, ok && 4 * j < rows_left);
          const size_t gq = static_cast<size_t>(kNWK == 1 ? grp[0] : grp[wk_w]);
          cp_async_8_if(dst + kWScales + lane * 8, ssrc[i] + gq * N, ok);
          if constexpr (kHasZ) cp_async_4_if(dst + kWZeros + lane * 4, zsrc[i] + gq * zw, ok);
        }
      }
      cp_async_mbar_arrive_noinc(full_bar(st));
    };
    // The iteration's chunks of the image that some warp reads (those before ce): one bulk copy, by
    // the first producer warp's lane 0.
    auto fill_x = [&](int it, int st) {
      if (pw != 0 || lane != 0) return;
      const int ch0 = cb + it * kNWK;
      const u32 bytes = static_cast<u32>(min(kNWK, ce - ch0) * kChunkImg);
      mbar_arrive_expect_tx(full_bar(st), bytes);
      bulk_copy_g2s(smem_a + st * stage_bytes, ximg + static_cast<size_t>(ch0) * kChunkImg, bytes, full_bar(st));
    };
    const int first = min(kStages, n_it);
    for (int it = 0; it < first; ++it) fill_w(it, it);  // never written by the kernel ahead
    grid_dep_wait();  // the image is
    for (int it = 0; it < first; ++it) fill_x(it, it);
    for (int it = first; it < n_it; ++it) {
      const int st = it % kStages;
      mbar_wait_parity(empty_bar(st), ((it / kStages) - 1) & 1);  // the compute warps' release of it - kStages
      fill_w(it, st);
      fill_x(it, st);
    }
    grid_dep_launch_dependents();
    // Leave only once every copy has landed (the last fill of each stage).
    for (int it = max(n_it - kStages, 0); it < n_it; ++it) mbar_wait_parity(full_bar(it % kStages), (it / kStages) & 1);
    return;
  }
  grid_dep_wait();  // the compute warps write the output (the kernel ahead may still read it)
  // Stage it - 1 is released once step kDepth - 1 of it has waited (wait_group kDepth) for every
  // earlier wgmma group.
  auto release = [&](int it) {
    if (it < 0) return;
    mbar_arrive(empty_bar(it % kStages));
  };
  for (int it = 0; it < n_it; ++it) {
    const int st = it % kStages;
    mbar_wait_parity(full_bar(st), (it / kStages) & 1);
    if (cb + it * kNWK + wk < ce) {  // warpgroup-uniform: the group's warps share wk
      const Chunk ck = read_chunk(st);
      const u32 xst = smem_a + st * stage_bytes;
      u32 p[kFragBufs][kCols][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (QOPS_PROBE == 5 || QOPS_PROBE == 6) {  // measurements: the words as fragments, no dequantization
#pragma unroll
          for (int jj = 0; jj < kCols; ++jj)
#pragma unroll
            for (int r = 0; r < 4; ++r) p[j % kFragBufs][jj][r] = ck.wv[j][jj] + r;
        } else {
          dequant_step(ck, j, p[j % kFragBufs]);
        }
        issue_step(xst, j, p[j % kFragBufs]);
        if (j == kDepth - 1) release(it - 1);
      }
    } else {
      wgmma_wait<0>();
      release(it - 1);
    }
  }
#else
  // Iteration it's NWK chunks are kXbBytes contiguous bytes of the image, copied as they lie; chunks
  // past K (the last iteration of a split may name some) are zero-filled, never read.
  auto load_x_pre = [&](int it, int st) {
    if constexpr (QOPS_PROBE == 3) return;  // the measurement without x
    constexpr int kPieces = kXbBytes / 16;
    const int ch0 = cb + it * kNWK;
    const u32 base = smem_a + st * stage_bytes;
    const char* src = ximg + static_cast<size_t>(ch0) * kChunkImg;
#pragma unroll
    for (int i = 0; i < (kPieces + kThreads - 1) / kThreads; ++i) {
      const int u = tid + i * kThreads;
      if (kPieces % kThreads != 0 && u >= kPieces) break;
      const bool in = ch0 + u / (kChunkImg / 16) < C;
      cp_async_16(base + u * 16, in ? src + static_cast<size_t>(u) * 16 : ximg, in ? 16 : 0);
    }
  };

  load_first_stages<kStages - 1>(n_it, load_w, load_x_pre);  // stages 0 .. kStages - 3

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 3>();  // this thread's copies of stage it have landed
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // x, copied in the generic proxy, is read by wgmma
    __syncthreads();  // everyone's copies have landed; the MMAs of it - 2, whose stage is refilled below, are done
    const int ahead = it + kStages - 2;
    if (ahead < n_it) {
      load_w(ahead, ahead % kStages);
      load_x_pre(ahead, ahead % kStages);
    }
    cp_async_commit();
    if (cb + it * kNWK + wk < ce) {  // warpgroup-uniform: the group's warps share wk
      const int st = it % kStages;
      const Chunk ck = read_chunk(st);
      const u32 xst = smem_a + st * stage_bytes;
#if QOPS_PROBE
      probe_chunk(ck);
      if (false)
#endif
      {
        u32 p[2][kCols][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          dequant_step(ck, j, p[j & 1]);
          issue_step(xst, j, p[j & 1]);
        }
      }
    } else {
      wgmma_wait<0>();  // no step issued here: the stage of this iteration's earlier MMAs may be refilled next
    }
  }
#endif  // QOPS_WS
#else
  // x through registers into the wgmma buffers (header). Piece u of an iteration: 16 bytes (8 values,
  // group c of a 32-row step) of one x row; a warp's 32 pieces are rows 8 mg .. 8 mg + 7 by the 4 groups
  // of step q (= wkc * 4 + j): lane = 4 (row % 8) + c. Every load instruction then reads whole 32-byte
  // sectors (the first build, a lane a row, asked the L2 for twice the sectors it needed), and every
  // 4-byte store fills 128 contiguous bytes of a core matrix (no bank conflicts).
  const u32 xb_a = smem_a + kStages * stage_bytes;
  using XRegs = uint4[kXPiecesPerThread];
  auto load_x_regs = [&](int it, XRegs& xr) {
    const int k0 = (cb + kit(it) * kNWK) * kChunkK;
#pragma unroll
    for (int i = 0; i < kXPiecesPerThread; ++i) {
      const int u = tid + i * kThreads;
      const int wu = u >> 5, q = wu / kMT, mg = wu - q * kMT;
      const int m = 8 * mg + (lane >> 2), k = k0 + 32 * q + 8 * c;
      const bool in = u < kXPieces && m < M && k < K;  // K % 8 == 0: 8 values all in or all out
      xr[i] = make_uint4(0u, 0u, 0u, 0u);
      if (in) xr[i] = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * ldx + k);
    }
  };
  // Core matrix (wkc, j, s2, kc), row m: word c holds x values 8 c + i, 8 c + i + 4 with i = 2 s2 + kc,
  // the K order of the A fragments (MMA k 8 kc + 2 c + e is row 8 c + 2 s2 + kc + 4 e of the step).
  auto store_x_regs = [&](const XRegs& xr, int buf) {
    const u32 base = xb_a + buf * kXbBytes;
#pragma unroll
    for (int i = 0; i < kXPiecesPerThread; ++i) {
      const int u = tid + i * kThreads;
      if (u >= kXPieces) continue;
      const int wu = u >> 5, q = wu / kMT, mg = wu - q * kMT;
      st_x_piece<kMT>(base + q * 4 * kMT * kCore + mg * kCore + (lane >> 2) * 16 + 4 * c, xr[i]);
    }
    // The tensor cores read these through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  };

  // The first stages' weights (never written by the kernel ahead), then x once that kernel is done.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_it) load_w(st, st);
    cp_async_commit();  // one group a stage, empty or not, so the wait below counts stages
  }
  grid_dep_wait();
  // x of iteration it + 1 waits in xa for the end of iteration it; the loads of it + 2 are issued at
  // the top of it (xn), so each piece has a whole iteration to arrive. (Loaded one iteration ahead,
  // the permutes waited on them: 28% of the stall samples, Nsight Compute at a09a7cc; but two ahead
  // timed the same, f1baac6: the stall moved, the cost was the loads' doubled sectors.)
  XRegs xa, xn;
  if (n_it > 0) {
    load_x_regs(0, xa);
    store_x_regs(xa, 0);
  }
  if (n_it > 1) load_x_regs(1, xa);

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 2>();  // this thread's weight copies of stage it have landed
    __syncthreads();               // x buffer it % 3 is complete; every warp is done with the stage refilled below
    const int ahead = it + kStages - 1;
    if (ahead < n_it) load_w(ahead, ahead % kStages);
    cp_async_commit();
    if (it + 2 < n_it && QOPS_PROBE != 3) load_x_regs(it + 2, xn);
    if (cb + kit(it) * kNWK + wk < ce) {          // warpgroup-uniform: the group's warps share wk
      const Chunk ck = read_chunk(it % kStages);
      const u32 xbuf = xb_a + (it % kXbufs) * kXbBytes;
      u32 p[2][kCols][4];
#if QOPS_PROBE
      probe_chunk(ck);
      if (false)
#endif
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        dequant_step(ck, j, p[j & 1]);
        issue_step(xbuf, j, p[j & 1]);
      }
    }
    if (it + 1 < n_it && QOPS_PROBE != 3) store_x_regs(xa, (it + 1) % kXbufs);  // after this iteration's MMAs are issued
#pragma unroll
    for (int i = 0; i < kXPiecesPerThread; ++i) xa[i] = xn[i];
  }
#endif
  wgmma_wait<0>();
#pragma unroll
  for (int t = 0; t < kTW; ++t)
#pragma unroll
    for (int i = 0; i < 4 * kMT; ++i) {
      fence_reg(accw[t][i]);
      acc[i >> 2][t][i & 3] = accw[t][i];
    }
#else
  // x of iteration `it` into stage `st`: row m, 8 values from column k0 + 8 kk; threads take slots
  // tid, tid + 256, ... (zeros from column K on).
  const int nslots = M * kRow;
  auto load_x = [&](int it, int st) {
    const int k0 = (cb + kit(it) * kNWK) * kChunkK;
    const u32 base = smem_a + st * stage_bytes;
    for (int s = tid; s < nslots; s += kThreads) {
      const int m = s / kRow, kk = s - m * kRow;
      const int k = k0 + 8 * kk;
      const bool in = k < K;  // K % 8 == 0: a slot is all in or all out
      cp_async_16(base + (m * kRS + kk) * 16, in ? x + static_cast<size_t>(m) * ldx + k : x, in ? 16 : 0);
    }
  };
  load_first_stages<kStages>(n_it, load_w, load_x);

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage it have landed
    __syncthreads();               // everyone's have; and every warp is done with the stage refilled below
    const int ahead = it + kStages - 1;
    if (ahead < n_it) {
      load_w(ahead, ahead % kStages);
      load_x(ahead, ahead % kStages);
    }
    cp_async_commit();
    if (cb + kit(it) * kNWK + wk >= ce) continue;  // warp-uniform: no chunk for this warp in the last iteration

    const int st = it % kStages;
    const uint4* xs = reinterpret_cast<const uint4*>(smem_c + st * stage_bytes);
    // The chunk's weight words first, then per 32-row step j: the x pieces of every tile (8 loads in
    // flight), the dequantization (its ALU work covers their latency), and the MMAs ordered k step
    // outer, tile inner, so the two MMAs into one accumulator sit 2 MT issues apart instead of back to
    // back (Nsight Compute, 344420d: 2 warps a scheduler issued every 4.8 cycles each, stalled on
    // fixed-latency dependencies and shared loads).
    const Chunk ck = read_chunk(st);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // x[m, 8 kw .. 8 kw + 7] of row m = 8 mt + g. Rows past M read whatever the stage holds there
      // (inside the allocation: the stage's weights or the next stage); they only reach the
      // accumulators of output rows past M, which are never stored.
      uint4 xv[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) xv[mt] = xs[(8 * mt + g) * kRS + wk * 16 + 4 * j + c];
      u32 p[kCols][4];
      dequant_step(ck, j, p);
      // Two 16-row k steps (s = 0: nibbles 0,4,1,5 against x pairs (0,4) (1,5); s = 1: 2,6,3,7 against
      // (2,6) (3,7)) x two 16-column tiles: rows g and g + 8 of tile t are columns n0 + 2t and n0 + 2t + 1.
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const u32 lo = s2 ? xv[mt].y : xv[mt].x, hi = s2 ? xv[mt].w : xv[mt].z;
          const u32 b0 = prmt<0x5410>(lo, hi), b1 = prmt<0x7632>(lo, hi);
#pragma unroll
          for (int t = 0; t < kTW; ++t)
            mma_16816<kDT>(acc[mt][t], p[2 * t][2 * s2], p[2 * t + 1][2 * s2], p[2 * t][2 * s2 + 1], p[2 * t + 1][2 * s2 + 1], b0, b1);
        }
    }
  }
#endif
  grid_dep_launch_dependents();

  // Sums of the NWK warps of a column group, in warp order, through shared memory (the stages).
  // QOPS_WS: the compute warps alone (named barrier 1; the producer has left), every copy landed.
  auto sync_compute = [] {
    if constexpr (kWs) asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory");
    else __syncthreads();
  };
  cp_async_wait<0>();
  sync_compute();
  float4* part = reinterpret_cast<float4*>(smem);
  constexpr int kSlots = kMT * kTW * 32;  // float4 a lane per (mt, t)
  if (kNWK > 1 && wk > 0) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int t = 0; t < kTW; ++t)
        part[((wk - 1) * kNWN + wn) * kSlots + (mt * kTW + t) * 32 + lane] =
            make_float4(acc[mt][t][0], acc[mt][t][1], acc[mt][t][2], acc[mt][t][3]);
  }
  if (kNWK > 1) sync_compute();
  if (wk > 0 || !n_ok) return;
  // A lane holds, for each of its rows m = 8 mt + 2 c + r (r = 0, 1), the kCols adjacent columns
  // n0 .. n0 + kCols - 1 (v[t][r]: column n0 + 2 t, v[t][r + 2]: n0 + 2 t + 1), so each row is one
  // vector store (8 bytes of output, 16 of fp32 partials; a warp's store covers 4 rows x 32 columns)
  // where the pointers allow it, instead of kCols scalar stores (the same values). For out that
  // depends on the caller's pointer and row stride; the partials' workspace is 16-byte aligned by the
  // host (int_weight._workspace) with N % 4 == 0, so their scalar form is a guard only (dropping it
  // reallocates the registers of the measured build: left for a run that can time it). The bias of
  // those columns is read once. Measured against the scalar stores (benchmarks/NOTES.md stop 44):
  // 0.90-0.97x the time at M = 64 on the PERF.md shapes, 0.96-0.99x at M = 17 / 33.
  float* part_out = ws + static_cast<size_t>(split) * M * N;  // S > 1: this split's fp32 partials
  const bool vec = S == 1 ? ((reinterpret_cast<unsigned long long>(out) | (2ull * static_cast<unsigned>(ldo))) & (2 * kCols - 1)) == 0
                          : (reinterpret_cast<unsigned long long>(ws) & (4 * kCols - 1)) == 0;
  // (add_bias's loads, but the fp32 one through __ldg: as ld.global.nc.f32 it cannot pass for a
  // weight load, ld.global.nc.u32, in the PTX-order test of the PDL trigger.)
  float bias_v[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    bias_v[j] = 0.f;
    if (S == 1 && (flags & kBiasT)) bias_v[j] = bits_to_f32<kDT>(static_cast<const u16*>(bias)[n0 + j]);
    else if (S == 1 && (flags & kBiasF32)) bias_v[j] = __ldg(static_cast<const float*>(bias) + n0 + j);
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    float v[kTW][4];
#pragma unroll
    for (int t = 0; t < kTW; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[t][i] = acc[mt][t][i];
      for (int w = 1; w < kNWK; ++w) {
        const float4 o = part[((w - 1) * kNWN + wn) * kSlots + (mt * kTW + t) * 32 + lane];
        v[t][0] += o.x;
        v[t][1] += o.y;
        v[t][2] += o.z;
        v[t][3] += o.w;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int m = 8 * mt + 2 * c + r;
      if (m >= M) continue;
      float q[kCols];
#pragma unroll
      for (int t = 0; t < kTW; ++t) {
        q[2 * t] = v[t][r] + bias_v[2 * t];
        q[2 * t + 1] = v[t][r + 2] + bias_v[2 * t + 1];
      }
      if (S == 1) {
        u16* row = out + static_cast<size_t>(m) * ldo + n0;
        if (vec) {
          u32 h[kTW];
#pragma unroll
          for (int t = 0; t < kTW; ++t) h[t] = pack2_bits<kDT>(q[2 * t], q[2 * t + 1]);
          if constexpr (kTW == 2) *reinterpret_cast<uint2*>(row) = make_uint2(h[0], h[1]);
          else *reinterpret_cast<u32*>(row) = h[0];
        } else {
#pragma unroll
          for (int j = 0; j < kCols; ++j) row[j] = f32_to_bits<kDT>(q[j]);
        }
      } else {
        float* row = part_out + static_cast<size_t>(m) * N + n0;
        if (vec) {
          if constexpr (kTW == 2) *reinterpret_cast<float4*>(row) = make_float4(q[0], q[1], q[2], q[3]);
          else *reinterpret_cast<float2*>(row) = make_float2(q[0], q[1]);
        } else {
#pragma unroll
          for (int j = 0; j < kCols; ++j) row[j] = q[j];
        }
      }
    }
  }
}

#if QOPS_XPRE
// x as the image the QOPS_XPRE GEMM copies (header), written to `img` (chunks of kChunkImg bytes,
// ceil(K / 128) of them). Thread u: 16 bytes of x (8 values, group c of 32-row step Q) of row
// 8 mg + r, with lane = 4 r + c and u / 32 = Q MT + mg, stored as the four 4-byte words
// store_x_regs writes: a warp's stores fill 128 contiguous bytes each. Rows past M and columns past K
// are written as zeros (the GEMM's MMAs read them).
extern "C" __global__ void __launch_bounds__(qops::gemm::kThreads)
qops_w4a16_x_image(const unsigned short* __restrict__ x, unsigned* __restrict__ img, int M, int K, int ldx) {
  using namespace qops;
  using namespace qops::gemm;
  // The GEMM behind may start (and copy its first weights); it reads the image only after its own
  // grid_dep_wait, which waits for this grid to finish.
  grid_dep_launch_dependents();
  grid_dep_wait();  // x is written by the kernel ahead; and the launch before may still read the workspace
  if (M <= 0) return;  // also the warm-up launch
  const int C = (K + kChunkK - 1) / kChunkK;
  const int u = blockIdx.x * kThreads + threadIdx.x;
  if (u >= C * 4 * kMT * 32) return;
  const int lane = u & 31, wu = u >> 5;
  const int mg = wu % kMT, Q = wu / kMT;
  const int r = lane >> 2, c = lane & 3;
  const int m = 8 * mg + r, k = 32 * Q + 8 * c;
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (m < M && k < K) v = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * ldx + k);  // K % 8 == 0
  char* row = reinterpret_cast<char*>(img) + static_cast<size_t>(Q >> 2) * kChunkImg + mg * kCore + r * 16 + 4 * c;
  const int q = Q & 3;
#pragma unroll
  for (int s2 = 0; s2 < 2; ++s2) {
    const u32 lo = s2 ? v.y : v.x, hi = s2 ? v.w : v.z;
    const size_t blk = static_cast<size_t>((q * 2 + s2) * 2) * (kMT * kCore);
    *reinterpret_cast<u32*>(row + blk) = prmt<0x5410>(lo, hi);
    *reinterpret_cast<u32*>(row + blk + kMT * kCore) = prmt<0x7632>(lo, hi);
  }
}
#endif
