// 4-bit codebook matmul for decode (bitsandbytes NF4 / FP4, M <= 16 rows of x), reading qops'
// blockwise4 runtime layout (qops/ops/blockwise4.py) in either byte order of qweight:
//   qweight u8 (N*K/2,): flat element e = n*K + k has its code in the high nibble of its byte when e
//           is even, in the low nibble when odd; flat (QOPS_TILE16 0): row n is the K/2 bytes from
//           n*K/2; tile16 (QOPS_TILE16 1, N % 16 == 0): byte kb of row n sits at
//           (n/16)*8K + (kb/64)*1024 + (n%16)*64 + kb%64, so a warp's 128-wide step of a 16-row
//           tile (64 bytes of each row) is 1 KiB, contiguous, and the next step follows it;
//   code    f32 (16,) codebook; absmax f32 (n_blocks,), or u8 (n_blocks,) when nested:
//           absmax[b] = nested_code[u8[b]] * nested_absmax[b / NESTED_BS] + nested_offset[0];
//   block b = e / BLOCKSIZE (flat: a block may straddle rows);
//   y[m, n] = sum_k x[m, k] * code[q(n, k)] * absmax[(n*K + k) / BLOCKSIZE] (+ bias[n]), fp32 sums.
// The host guarantees K % 128 == 0, BLOCKSIZE % 64 == 0, N*K < 2^31 and 16-byte aligned x rows, so a
// 128-wide step of a row (64 bytes) spans one block or two whole ones and every load below is aligned.
//
// Decode. The 16 codes are rounded to the activation dtype, as bitsandbytes' own kernels do. A byte
// holds two codes (even K high, odd K low); a 256-entry table in shared memory maps it to the f16x2 /
// bf16x2 word (even code in the low half), which is exactly one register of an MMA operand. The table
// is held 32 times, entry v's copy for lane l at byte v*S + 4*l (S = 128: 32 KiB; or 256: 64 KiB,
// QOPS_LUT_IMM), so the 32 lanes of a warp always hit 32 different banks whatever bytes they look up.
// With S = 256 a weight costs half a prmt (the address: the byte in bits 8..15, 4*l below it) and half
// a shared load whose immediate is the window's base; with S = 128 also half an integer multiply-add.
// No ALU decode chain (the Triton CUDA-core GEMV spends ~3 integer instructions a weight on it).
//
// Math. The tensor cores compute W x^T with W as the 16x16 A operand (16 rows of N) and x^T as the
// 16x8 B operand (8 rows of x per tile, QOPS_MT tiles). Per 128-wide step of K, lane (g = lane/4,
// t = lane%4) loads 16 bytes of rows g and g+8 of a tile, bytes 16t..16t+15 of the row's 64 (one
// 16-byte load a row: a warp's load covers 64 contiguous bytes of 8 rows in the flat order, 512
// contiguous bytes in tile16; with 8 bytes a lane, the first version's 32, the loads alone reached
// only 60-70% of the roofline). Tile16 is the same kernel with 1 KiB-contiguous requests: 7-12%
// faster than the flat order at M = 1 on the four large shapes, 5-8% at M = 16
// (benchmarks/results/h200-2026-11-30-4635f3f-probe-nf4-layout.json). Slice j (0..7) of the
// step is one k16 MMA built from the lane's bytes 2j, 2j+1, so the MMA's k order is a permutation of
// K (logical k 2t, 2t+1, 2t+8, 2t+9 <-> 32t+4j .. 32t+4j+3), and x is read in the same order: lane
// (g, t) takes x[g][32t+4j .. 32t+4j+3] as its B registers, 32 contiguous values a step.
// Scaling. With BLOCKSIZE >= 128 a step lies in one block: one MMA chain a step, its fp32 sum scaled by
// the block's absmax. With BLOCKSIZE 64 lanes t = 0, 1 hold block A (K 0..63 of the step) and t = 2,
// 3 block B, and every k16 MMA mixes the four lanes; so each slice runs twice, into chain A with the
// x of lanes 2, 3 zero and into chain B with the x of lanes 0, 1 zero (x loaded, predicated, into two
// zero-initialized register sets), and the chains are scaled by their blocks' absmax in fp32. MMAs
// are cheap at M <= 8; the lookups are the same either way. With QOPS_PRESCALE (the plans' choice at
// M > 8, where two chains double the MMAs of both x tiles) each lane instead multiplies its decoded
// words by its own block's absmax rounded to the activation dtype (what bitsandbytes' dequantization
// computes) and one chain over unmasked x serves both blocks. With QOPS_BLOCK_COLS (M <= 8; no plan
// picks it yet: no faster at M = 1, +3-6% at M = 4, benchmarks/NOTES.md stop 17) the two blocks take
// separate columns of the MMA instead: x row m is the B operand's columns 2m (the x of block A's
// lanes, t = 0, 1; zero at t = 2, 3) and 2m + 1 (block B's), so one MMA yields both blocks' sums side
// by side in fp32, each scaled by its absmax after the step: no multiply a lookup and no doubled MMA,
// at the price of 4 rows of x an 8-column tile.
//
// Work split. A block is QOPS_WARPS warps on 16*QOPS_R*QOPS_WN rows of N (grid: ceil(N / (16 R WN))):
// QOPS_WN groups of warps side by side along N, each group on its own 16 R rows, and the
// WK = WARPS / WN warps of a group splitting the rows' steps evenly; a group sums its warps' partials
// through shared memory at the end, in warp order (deterministic, no atomics, no workspace). WN = 1
// is one group a block. More groups build the table once for more rows and give each warp more
// steps: 16 steps a warp measured best (whole rows a warp, 32 steps at K = 4096, were 11% slower
// than WN = 1: the plan rule in blockwise4.py). Each warp streams its steps through a
// register ring of QOPS_RING slots: a step requests the step QOPS_RING - 1 ahead (weights and
// absmax, predicated off past the warp's range) and then uses its own, so QOPS_RING - 1 steps are in
// flight at every step (the first version loaded a few steps and used them; ptxas interleaved the
// loads with the uses and kept ~one in flight). x is read when a step is used (L1: every warp of the
// SM reads the same few KiB). Rows of N past the end read row N-1 and rows of x past M read row 0
// (valid memory, results discarded). Persistent (QOPS_PERSISTENT): the grid holds as many blocks as
// the SMs run at once, and each takes tiles blockIdx.x, + gridDim.x, ...: the table is built once a
// block, and the next tile's first steps are requested before the current tile's partials are
// summed, so a short K (4 steps a warp at K = 4096) does not wait out a load's latency per tile.
// The partials then sit after the table (kNestedMapBytes on), not in it.
//
// Programmatic dependent launch (sm_90): the ring's first steps are requested and the tables built
// from weight tensors only (never written by the kernel ahead) before grid_dep_wait(); x and bias are
// read and out written only after it. The next launch is released after the main loop, or as the
// kernel starts with flags & kEarlyDependents (one-wave grids: ptx.cuh).
//
// Compile-time configuration (NVRTC -D): QOPS_DT (0 f16, 1 bf16), QOPS_MT (x tiles, 1 or 2: 8 rows of
// x each, 4 with QOPS_BLOCK_COLS), QOPS_R (16-row tiles a block: 1 or 2), QOPS_WARPS (4, 8 or 16),
// QOPS_RING (2..8 slots), QOPS_WN (1, 2, 4, 8; divides QOPS_WARPS), QOPS_MINB (blocks an SM
// promised to ptxas), QOPS_NESTED (0/1), QOPS_BLOCKSIZE, QOPS_NESTED_BS (nested only), QOPS_PRESCALE (0/1), QOPS_BLOCK_COLS (0/1),
// QOPS_LUT_IMM (0/1) with QOPS_SMEM_BASE, QOPS_TILE16 (0/1), QOPS_PERSISTENT (0/1), QOPS_PROBE and
// QOPS_ALU (measurement builds only).
#include "codebook4.cuh"

#ifndef QOPS_DT
#define QOPS_DT 0
#endif
#ifndef QOPS_MT
#define QOPS_MT 1
#endif
#ifndef QOPS_R
#define QOPS_R 2
#endif
#ifndef QOPS_WARPS
#define QOPS_WARPS 8
#endif
#ifndef QOPS_RING
#define QOPS_RING 4
#endif
#ifndef QOPS_WN
#define QOPS_WN 1  // warp groups side by side along N (each on 16 QOPS_R rows); QOPS_WARPS / QOPS_WN warps a group split K
#endif
#ifndef QOPS_NESTED
#define QOPS_NESTED 0
#endif
#ifndef QOPS_MINB
#define QOPS_MINB 2
#endif
#ifndef QOPS_PRESCALE
#define QOPS_PRESCALE 0  // 1: scale the decoded weights by absmax in DT before one MMA chain (two-block steps)
#endif
#ifndef QOPS_BLOCK_COLS
#define QOPS_BLOCK_COLS 0  // 1: blocks A and B of a two-block step in separate MMA columns (4 rows of x a tile)
#endif
#ifndef QOPS_PROBE
#define QOPS_PROBE 0  // measurements (benchmarks/probe_nf4_native.py): 1 loads alone, 2 math alone
#endif
#ifndef QOPS_PERSISTENT
#define QOPS_PERSISTENT 0  // 1: a block goes on to tile blockIdx.x + gridDim.x, ... (the grid fills the SMs once)
#endif
#ifndef QOPS_TILE16
#define QOPS_TILE16 0  // qweight's byte order: 0 flat, 1 tile16 (above)
#endif
#ifndef QOPS_BLOCKSIZE
#define QOPS_BLOCKSIZE 64
#endif
#ifndef QOPS_NESTED_BS
#define QOPS_NESTED_BS 256
#endif
#ifndef QOPS_LUT_IMM
#define QOPS_LUT_IMM 0  // 1: table entries 256 bytes apart, the window base QOPS_SMEM_BASE an immediate of the lookup
#endif
#ifndef QOPS_ALU
#define QOPS_ALU 0  // measurements: of a lane's 8 words a step, how many are decoded on the ALU (codebook_decode_alu)
#endif
#ifndef QOPS_SMEM_BASE
#define QOPS_SMEM_BASE 0  // shared-window address of dynamic shared memory (measured: compiler.dynamic_shared_base)
#endif

namespace qops {
namespace bw4 {

constexpr int kDT = QOPS_DT;
constexpr int kMT = QOPS_MT;
constexpr int kR = QOPS_R;
constexpr int kWarps = QOPS_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kWN = QOPS_WN;
constexpr int kWK = kWarps / kWN;  // warps of a group, splitting K
constexpr int kBlockRows = 16 * kR * kWN;
constexpr int kRing = QOPS_RING;
constexpr bool kNested = QOPS_NESTED != 0;
constexpr int kBlock = QOPS_BLOCKSIZE;
constexpr int kProbe = QOPS_PROBE;
constexpr int kNestedBS = QOPS_NESTED_BS;
constexpr int kStepK = 128;                    // K values of a row a lane quad covers per step (64 bytes)
constexpr bool kTile16 = QOPS_TILE16 != 0;
constexpr int kStepStride = kTile16 ? 1024 : kStepK / 2;  // bytes from a lane's piece of a row in one step to the next
constexpr bool kTwoBlocks = kBlock == 64;      // a step spans two absmax blocks (else one)
// Two-block steps, pre-scaled: each lane multiplies its decoded words by its own block's absmax
// (rounded to DT, as bitsandbytes' dequantization does), so one MMA chain over unmasked x serves
// both blocks: half the MMAs and x loads of the two chains, one more f16x2/bf16x2 multiply a lookup.
constexpr bool kPrescale = QOPS_PRESCALE != 0 && kTwoBlocks;
// Two-block steps, block columns: x row m fills B columns 2m (block A's lanes) and 2m + 1 (block B's).
constexpr bool kBlockCols = QOPS_BLOCK_COLS != 0 && kTwoBlocks;
constexpr int kRowsPerTile = kBlockCols ? 4 : 8;  // rows of x an 8-column MMA tile holds
static_assert(!(kPrescale && kBlockCols), "QOPS_PRESCALE and QOPS_BLOCK_COLS are two answers to the same problem");
constexpr bool kLutImm = QOPS_LUT_IMM != 0;
// Entry v's copy for lane l at v * kTableStride + 4 l. 128: the 32 copies packed, the address one prmt
// and one integer multiply-add away. 256 (kLutImm): half of each entry's bytes unused, but one prmt
// builds v * 256 + 4 l outright and the load adds the window's base as its immediate (measured at
// M = 1: 1-4% faster, ~12% fewer instructions a step).
constexpr int kTableStride = kLutImm ? 256 : 128;
constexpr int kTableBytes = codebook_table_bytes<kTableStride>();  // 256 byte values x 32 lane copies
constexpr int kNestedMapBytes = 256 * 4;        // the nested code after the table (NESTED_MAP_BYTES on the host)
constexpr bool kPersistent = QOPS_PERSISTENT != 0;
// QOPS_ALU = A (0..8): the words of quarters i < A of row g + 8, then of quarters i < A - 4 of row g,
// decoded on the ALU (codebook_decode_alu), the rest through the table: fewer shared loads a step
// for more integer instructions (benchmarks/probe_nf4_native.py --plans '[{"alu": 2}]').
constexpr int kAlu = QOPS_ALU;
static_assert(kAlu >= 0 && kAlu <= 8, "QOPS_ALU is 0..8 words of a lane's eight a step");
__device__ __forceinline__ constexpr bool alu_word(int i, int h) { return h == 1 ? i < kAlu : i < kAlu - 4; }
static_assert(kMT == 1 || kMT == 2, "QOPS_MT is 1 or 2 (M <= 16)");
static_assert(kR == 1 || kR == 2, "QOPS_R is 1 or 2");
static_assert(kWarps == 4 || kWarps == 8 || kWarps == 16, "QOPS_WARPS is 4, 8 or 16");
static_assert(kWN >= 1 && kWarps % kWN == 0, "QOPS_WN divides QOPS_WARPS");
static_assert(kRing >= 2 && kRing <= 8, "QOPS_RING is 2..8");
static_assert(kBlock % 64 == 0, "QOPS_BLOCKSIZE must be a multiple of 64");
static_assert(!kNested || !kTwoBlocks || kNestedBS % 2 == 0, "two-block steps need an even QOPS_NESTED_BS");
static_assert(kWarps * kR * kMT * 32 * 16 <= kTableBytes, "the partials reuse the table's shared memory");

// What a lane keeps in flight for one step: 16 weight bytes of rows g and g+8 of each tile and the
// two rows' absmax as loaded: float32 bits of blocks A and B (B: two blocks only), or the nested u8
// codes (A in bits 0..7, B in bits 8..15).
struct Slot {
  uint4 w[kR][2];
  uint2 a[kR][2];
};

// wrow: step 0 of rows g and g + 8 of each tile (the lane's 16 bytes 16 t further).
__device__ __forceinline__ void load_slot(Slot& sl, const unsigned char* const (&wrow)[kR][2], const u32 (&flat)[kR][2],
                                          const void* absmax, int q, int t, bool pred) {
  if constexpr (kProbe == 2) return;  // math alone: the slots keep what they were given
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ld_stream_v4_if(sl.w[r][h], wrow[r][h] + q * kStepStride + 16 * t, pred);
      const u32 b = (flat[r][h] + static_cast<u32>(q) * kStepK) / kBlock;
      if constexpr (kNested) {
        if constexpr (kTwoBlocks) ld_nc_u16_if(sl.a[r][h].x, static_cast<const unsigned char*>(absmax) + b, pred);
        else ld_nc_u8_if(sl.a[r][h].x, static_cast<const unsigned char*>(absmax) + b, pred);
      } else {
        if constexpr (kTwoBlocks) ld_nc_v2_if(sl.a[r][h], static_cast<const float*>(absmax) + b, pred);
        else ld_nc_u32_if(sl.a[r][h].x, static_cast<const float*>(absmax) + b, pred);
      }
    }
}

// The absmax of block b (SECOND: block B of a two-block step) from the slot's word(s).
// ``nested_scale``: nested_absmax of the block's nested group (unused when plain).
template <bool SECOND>
__device__ __forceinline__ float block_absmax(const uint2& a, const float* nested_code_s, float nested_scale,
                                              float nested_offset) {
  if constexpr (kNested) return fmaf(nested_code_s[SECOND ? (a.x >> 8) & 255u : a.x & 255u], nested_scale, nested_offset);
  else return __uint_as_float(SECOND ? a.y : a.x);
}

// nested_absmax of block b's group (1 when plain). Blocks A and B of a two-block step share it: A is
// even (K % 128 == 0) and a nested group holds an even number of blocks.
__device__ __forceinline__ float nested_scale_of(const float* nested_absmax, u32 b) {
  if constexpr (kNested) return nested_absmax[b / kNestedBS];
  else return 1.f;
}

// The table word of byte SEL of w for this lane (codebook4.cuh). lane_table: the lane's copy of entry 0
// (a shared address), or with kLutImm 4 * lane (the window's base is then the load's immediate).
template <int SEL>
__device__ __forceinline__ u32 lookup(u32 lane_table, u32 w) {
  return codebook_lookup<SEL, kTableStride, kLutImm ? QOPS_SMEM_BASE : -1>(lane_table, w);
}

// Decoding on the ALU instead (no shared memory): the 16 codes as DT bits, their low bytes packed four
// to a register in tab[0..3] and their high bytes in tab[4..7] (codebook_alu_table). For the two bytes
// HALF of w (0: bytes 0, 1; 1: bytes 2, 3) it gives the words codebook_lookup<2 HALF> and <2 HALF + 1>
// would: each nibble's low three bits select a byte from the codes 0..7 and from 8..15 (two prmt a
// byte half), the nibble's top bit chooses between them (a byte mask from one prmt in sign-replicate
// mode: nibble 2j's top bit is bit 7 of w << 4's byte j, nibble 2j + 1's bit 7 of w's), and two prmt
// interleave low and high bytes into the byte's pair. ~11 instructions a byte pair where the table
// takes one prmt and one shared load a byte (codebook4.cuh): QOPS_ALU, a measurement knob for when the
// lookups queue on the memory-instruction pipe (stop 39: mio and short-scoreboard stalls). Measured at
// M = 1 (benchmarks/NOTES.md stop 45): a quarter of the words on the ALU +2-3% on 4096x14336 and
// 8192x28672, -4% on 28672x4096; half or more slower everywhere. No plan takes it.
template <int DT>
__device__ __forceinline__ void codebook_alu_table(u32 (&tab)[8], const float* code) {
#pragma unroll
  for (int i = 0; i < 8; ++i) tab[i] = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const u32 b = f32_to_bits<DT>(code[j]);
    tab[j / 4] |= (b & 0xffu) << (8 * (j % 4));
    tab[4 + j / 4] |= (b >> 8) << (8 * (j % 4));
  }
}

template <int HALF>
__device__ __forceinline__ void codebook_decode_alu(const u32 (&tab)[8], u32 w, u32& first, u32& second) {
  const u32 sel = (w >> (16 * HALF)) & 0x7777u;                     // four 3-bit selectors
  const u32 top = prmt<HALF ? 0xFBEA : 0xD9C8>(w << 4, w);           // 0xff where a nibble's top bit is set
  const u32 lo = (prmt_r(tab[0], tab[1], sel) & ~top) | (prmt_r(tab[2], tab[3], sel) & top);
  const u32 hi = (prmt_r(tab[4], tab[5], sel) & ~top) | (prmt_r(tab[6], tab[7], sel) & top);
  first = prmt<0x4051>(lo, hi);   // byte 2 HALF: code[v >> 4] low half, code[v & 15] high half
  second = prmt<0x6273>(lo, hi);  // byte 2 HALF + 1
}

// The table words of bytes 2 HALF and 2 HALF + 1 of w: on the ALU where ``alu`` (alu_word, a
// compile-time constant after unrolling), else through the table.
template <int HALF>
__device__ __forceinline__ void decode_pair(bool alu, u32 lane_table, const u32 (&alu_tab)[8], u32 w, u32& first, u32& second) {
  if (alu) {
    codebook_decode_alu<HALF>(alu_tab, w, first, second);
  } else {
    first = lookup<2 * HALF>(lane_table, w);
    second = lookup<2 * HALF + 1>(lane_table, w);
  }
}

// x for a quarter of a step (8 values of the lane's 32) and one x tile: with two blocks a step, in the
// register set of the lane's block (lo: t < 2, hi: t >= 2; predicated loads), the other set staying
// zero from the start of the kernel; with block columns, in lo where the lane's block is its column's
// (t < 2 for even g, t >= 2 for odd g), lo staying zero otherwise; with one block, in lo.
struct XQuarter {
  uint4 lo;
  uint4 hi;
};

__device__ __forceinline__ void load_x(XQuarter& xq, const u16* xrow, int q, int t, int i) {
  const uint4* xp = reinterpret_cast<const uint4*>(xrow + q * kStepK + 32 * t) + i;
  if constexpr (kBlockCols) {
    ld_nc_v4_if(xq.lo, xp, (t >= 2) == ((threadIdx.x >> 2) & 1));  // g & 1: the column's block
  } else if constexpr (kTwoBlocks && !kPrescale) {
    ld_nc_v4_if(xq.lo, xp, t < 2);
    ld_nc_v4_if(xq.hi, xp, t >= 2);
  } else {
    xq.lo = *xp;
  }
}

// acc += d scaled by the absmax of the lane's rows: s0 for row g (d[.][0..1]), s1 for row g + 8.
__device__ __forceinline__ void add_scaled(float (&acc)[kMT][4], const float (&d)[kMT][4], float s0, float s1) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    acc[mt][0] = fmaf(d[mt][0], s0, acc[mt][0]);
    acc[mt][1] = fmaf(d[mt][1], s0, acc[mt][1]);
    acc[mt][2] = fmaf(d[mt][2], s1, acc[mt][2]);
    acc[mt][3] = fmaf(d[mt][3], s1, acc[mt][3]);
  }
}

__device__ __forceinline__ void use_slot(const Slot& sl, float (&acc)[kR][kMT][4], u32 lane_table, const u32 (&alu_tab)[8], XQuarter (&xq)[kMT],
                                         const u16* const (&xrow)[kMT], const u32 (&flat)[kR][2], const float* nested_code_s,
                                         const float* nested_absmax, float nested_offset, int q, int t) {
  if constexpr (kProbe == 1) {  // loads alone: every loaded word reaches the output, nothing is decoded
#pragma unroll
    for (int r = 0; r < kR; ++r)
      acc[r][0][0] += __uint_as_float((sl.w[r][0].x ^ sl.w[r][0].y ^ sl.w[r][0].z ^ sl.w[r][0].w ^ sl.w[r][1].x ^ sl.w[r][1].y ^
                                       sl.w[r][1].z ^ sl.w[r][1].w ^ sl.a[r][0].x ^ sl.a[r][1].x) & 0x3fffffffu);
    return;
  }
  u32 pre[kR][2];  // kPrescale: the lane's block's absmax for rows g, g+8 of each tile, as a DT pair
  if constexpr (kPrescale) {
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const u32 b = (flat[r][h] + static_cast<u32>(q) * kStepK) / kBlock;
        const float ns = nested_scale_of(nested_absmax, b);
        const float sv = t < 2 ? block_absmax<false>(sl.a[r][h], nested_code_s, ns, nested_offset)
                               : block_absmax<true>(sl.a[r][h], nested_code_s, ns, nested_offset);
        const u32 bits = f32_to_bits<kDT>(sv);
        pre[r][h] = bits | (bits << 16);
      }
  }
  float da[kR][kMT][4], db[kR][kMT][4];  // chain A (one-block steps, pre-scaled: the only chain) and chain B
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) da[r][mt][e] = db[r][mt][e] = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // quarter i: slices 2i, 2i + 1, x[32t + 8i .. 32t + 8i + 7]
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) load_x(xq[mt], xrow[mt], q, t, i);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const u32 w0 = word(sl.w[r][0], i);  // row g: bytes 4i .. 4i + 3 (slice 2i + jj: 2 of them)
        const u32 w1 = word(sl.w[r][1], i);  // row g + 8
        u32 a0, a1, a2, a3;  // row g's words for bytes 2 jj, 2 jj + 1 of w0 (a0, a2), row g + 8's of w1 (a1, a3)
        if (jj == 0) {
          decode_pair<0>(alu_word(i, 0), lane_table, alu_tab, w0, a0, a2);
          decode_pair<0>(alu_word(i, 1), lane_table, alu_tab, w1, a1, a3);
        } else {
          decode_pair<1>(alu_word(i, 0), lane_table, alu_tab, w0, a0, a2);
          decode_pair<1>(alu_word(i, 1), lane_table, alu_tab, w1, a1, a3);
        }
        if constexpr (kPrescale) {
          a0 = mul2<kDT>(a0, pre[r][0]);
          a2 = mul2<kDT>(a2, pre[r][0]);
          a1 = mul2<kDT>(a1, pre[r][1]);
          a3 = mul2<kDT>(a3, pre[r][1]);
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          // x[32t + 8i + 4jj .. + 3] as the B registers
          const uint4& lo = xq[mt].lo;
          mma_16816<kDT>(da[r][mt], a0, a1, a2, a3, jj ? lo.z : lo.x, jj ? lo.w : lo.y);
          if constexpr (kTwoBlocks && !kPrescale && !kBlockCols) {
            const uint4& hi = xq[mt].hi;
            mma_16816<kDT>(db[r][mt], a0, a1, a2, a3, jj ? hi.z : hi.x, jj ? hi.w : hi.y);
          }
        }
      }
    }
  }
  if constexpr (kPrescale) {
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][mt][e] += da[r][mt][e];
    return;
  }
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    if constexpr (kBlockCols) {  // columns 2t (block A) and 2t + 1 (block B) of x row t of each tile
      const u32 b0 = (flat[r][0] + static_cast<u32>(q) * kStepK) / kBlock;
      const u32 b1 = (flat[r][1] + static_cast<u32>(q) * kStepK) / kBlock;
      const float ns0 = nested_scale_of(nested_absmax, b0), ns1 = nested_scale_of(nested_absmax, b1);
      const float a0 = block_absmax<false>(sl.a[r][0], nested_code_s, ns0, nested_offset);
      const float b0s = block_absmax<true>(sl.a[r][0], nested_code_s, ns0, nested_offset);
      const float a1 = block_absmax<false>(sl.a[r][1], nested_code_s, ns1, nested_offset);
      const float b1s = block_absmax<true>(sl.a[r][1], nested_code_s, ns1, nested_offset);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        acc[r][mt][0] = fmaf(da[r][mt][1], b0s, fmaf(da[r][mt][0], a0, acc[r][mt][0]));  // row g
        acc[r][mt][2] = fmaf(da[r][mt][3], b1s, fmaf(da[r][mt][2], a1, acc[r][mt][2]));  // row g + 8
      }
      continue;
    }
    const u32 b0 = (flat[r][0] + static_cast<u32>(q) * kStepK) / kBlock;  // row g's block A
    const u32 b1 = (flat[r][1] + static_cast<u32>(q) * kStepK) / kBlock;  // row g + 8's
    const float ns0 = nested_scale_of(nested_absmax, b0), ns1 = nested_scale_of(nested_absmax, b1);
    add_scaled(acc[r], da[r], block_absmax<false>(sl.a[r][0], nested_code_s, ns0, nested_offset),
               block_absmax<false>(sl.a[r][1], nested_code_s, ns1, nested_offset));
    if constexpr (kTwoBlocks)
      add_scaled(acc[r], db[r], block_absmax<true>(sl.a[r][0], nested_code_s, ns0, nested_offset),
                 block_absmax<true>(sl.a[r][1], nested_code_s, ns1, nested_offset));
  }
}

// Row pointers (step 0 of rows g and g + 8 of each 16-row tile) and flat indices of group tile
// ``tile`` (16 kR rows; rows past N read row N - 1: valid memory, results discarded).
__device__ __forceinline__ void tile_rows(const unsigned char* (&wrow)[kR][2], u32 (&flat)[kR][2], const unsigned char* qweight,
                                          int tile, int N, int K, int g) {
  const int n_tile = tile * (16 * kR);
#pragma unroll
  for (int r = 0; r < kR; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = min(n_tile + 16 * r + 8 * h + g, N - 1);
      if constexpr (kTile16)
        wrow[r][h] = qweight + static_cast<size_t>(n / 16) * (8 * K) + 64 * (n % 16);
      else
        wrow[r][h] = qweight + static_cast<size_t>(n) * (K / 2);
      flat[r][h] = static_cast<u32>(n) * static_cast<u32>(K);
    }
}

}  // namespace bw4
}  // namespace qops

extern "C" __global__ void __launch_bounds__(qops::bw4::kThreads, QOPS_MINB)
qops_blockwise4_gemv(const unsigned char* __restrict__ qweight, const float* __restrict__ code,
                     const void* __restrict__ absmax, const float* __restrict__ nested_code,
                     const float* __restrict__ nested_absmax, const float* __restrict__ nested_offset,
                     const unsigned short* __restrict__ x, const void* __restrict__ bias, unsigned short* __restrict__ out,
                     int M, int N, int K, int ldx, int ldo, int flags) {
  using namespace qops;
  using namespace qops::bw4;
  extern __shared__ __align__(16) unsigned char table[];
  const int tid = threadIdx.x;
  if (M <= 0 || N <= 0) {  // also the warm-up launch that only makes the module resident
    grid_dep_wait();
    return;
  }
  if (flags & kEarlyDependents) grid_dep_launch_dependents();
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wn = warp % kWN, wk = warp / kWN;  // the warp's group (rows) and its place in the group's K split
  const int n_tiles = (N + kBlockRows - 1) / kBlockRows;  // the grid covers them (one a block), or fills the SMs (persistent)
  const unsigned char* wrow[kR][2];
  u32 flat[kR][2];  // flat index n*K of the row's first element (N*K < 2^31)
  const int steps = K / kStepK;
  const int p0 = static_cast<int>(static_cast<long long>(steps) * wk / kWK);
  const int p1 = static_cast<int>(static_cast<long long>(steps) * (wk + 1) / kWK);

  if constexpr (kLutImm) {
    // The lookups address the table with the window's base as an immediate: a launch where dynamic
    // shared memory starts elsewhere must fail, not read the wrong bytes.
    if (smem_addr(table) != QOPS_SMEM_BASE) __trap();
  }

  // The ring's first kRing - 1 steps are requested before anything else: weights and absmax are
  // never written by the kernel ahead, and their latency then covers the table's build.
  Slot ring[kRing];
  if constexpr (kProbe == 2) {  // math alone: weight bytes that vary by lane, absmax codes in range
#pragma unroll
    for (int s = 0; s < kRing; ++s)
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          ring[s].w[r][h] = make_uint4(0x9e3779b9u * (tid + 7 * s + 3 * r + h), 0x85ebca6bu * (tid + s + r + 5 * h),
                                       0xc2b2ae35u * (tid + 3 * s + h), 0x27d4eb2fu * (tid + s + 7 * r));
          ring[s].a[r][h] = kNested ? make_uint2((tid * 0x0101u + s) & 0xffffu, 0) : make_uint2(0x3c000000u, 0x3c800000u);
        }
  }
  int tile = blockIdx.x;  // block tile: group wn's rows start at (tile * kWN + wn) * 16 kR
  tile_rows(wrow, flat, qweight, tile * kWN + wn, N, K, g);
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) load_slot(ring[s], wrow, flat, absmax, p0 + s, t, p0 + s < p1);

  codebook_table_build<kDT, kTableStride>(table, code, tid, kThreads);  // codebook4.cuh
  u32 alu_tab[8];  // QOPS_ALU: the codes' bytes in registers (unused, and removed, without it)
  if constexpr (kAlu > 0) codebook_alu_table<kDT>(alu_tab, code);
  else
#pragma unroll
    for (int i = 0; i < 8; ++i) alu_tab[i] = 0;
  float* nested_code_s = reinterpret_cast<float*>(table + kTableBytes);
  if constexpr (kNested)
    for (int v = tid; v < 256; v += kThreads) nested_code_s[v] = nested_code[v];
  __syncthreads();
  grid_dep_wait();  // x, bias and out: after the kernel ahead

  const u16* xrow[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int m = kRowsPerTile * mt + (kBlockCols ? g >> 1 : g);
    xrow[mt] = x + static_cast<size_t>(m < M ? m : 0) * ldx;
  }
  const float noff = kNested ? nested_offset[0] : 0.f;
  const u32 lane_table = (kLutImm ? 0u : smem_addr(table)) + 4u * lane;
  XQuarter xq[kMT];  // the set of the other block's lanes stays zero (its loads are predicated off)
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) xq[mt].lo = xq[mt].hi = make_uint4(0, 0, 0, 0);
  // Partials of the warps: in the table's shared memory when the block takes one tile, after the
  // table and the nested map when it goes on to others.
  float4* part = reinterpret_cast<float4*>(kPersistent ? table + kTableBytes + kNestedMapBytes : table);
  constexpr int kSlots = kR * kMT * 32;

  while (true) {  // once, or (persistent) for tiles blockIdx.x, + gridDim.x, ...
    const int n_tile = tile * kBlockRows;
    float acc[kR][kMT][4];
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) acc[r][mt][0] = acc[r][mt][1] = acc[r][mt][2] = acc[r][mt][3] = 0.f;

    // Step q sits in slot (q - p0) % kRing; each step requests the one kRing - 1 ahead, then uses its own.
    for (int base = p0; base < p1; base += kRing) {
#pragma unroll
      for (int s = 0; s < kRing; ++s) {
        const int ahead = base + s + kRing - 1;
        load_slot(ring[(s + kRing - 1) % kRing], wrow, flat, absmax, ahead, t, ahead < p1);
        if (base + s < p1)
          use_slot(ring[s], acc, lane_table, alu_tab, xq, xrow, flat, nested_code_s, nested_absmax, noff, base + s, t);
      }
    }
    grid_dep_launch_dependents();
    const int next = tile + gridDim.x;
    if (kPersistent && next < n_tiles) {
      // The next tile's first steps are requested now: their latency runs under the sums below.
      // (The ring is free: its last slots were consumed by the loop, whose loads past p1 were predicated off.)
      tile_rows(wrow, flat, qweight, next * kWN + wn, N, K, g);
#pragma unroll
      for (int s = 0; s < kRing - 1; ++s) load_slot(ring[s], wrow, flat, absmax, p0 + s, t, p0 + s < p1);
    }

    // Partials of each group's warps, summed in warp order through shared memory.
    __syncthreads();  // every warp is done with the table (one tile), or with the last tile's partials
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        part[warp * kSlots + (r * kMT + mt) * 32 + lane] = make_float4(acc[r][mt][0], acc[r][mt][1], acc[r][mt][2], acc[r][mt][3]);
    __syncthreads();
    for (int i = tid; i < kWN * kSlots; i += kThreads) {
      // group gi's slot j: warps gi, gi + kWN, ... (gi spelled 0 for one group: i < kSlots is not
      // visible to ptxas, and the extra division made the 128-register persistent build spill)
      const int gi = kWN == 1 ? 0 : i / kSlots, j = i - gi * kSlots;
      float4 v = part[gi * kSlots + j];
      for (int w = 1; w < kWK; ++w) {
        const float4 o = part[(w * kWN + gi) * kSlots + j];
        v.x += o.x;
        v.y += o.y;
        v.z += o.z;
        v.w += o.w;
      }
      const int r = j / (kMT * 32), mt = (j / 32) % kMT, l = j & 31;
      const int n0 = n_tile + 16 * kR * gi + 16 * r + (l >> 2);
      const float vals[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        // block columns: x row 4 mt + t, rows g and g + 8 of N in values 0 and 2 (1 and 3 unused)
        if (kBlockCols && (q & 1)) continue;
        const int n = n0 + 8 * (q >> 1);
        const int m = kBlockCols ? kRowsPerTile * mt + (l & 3) : 8 * mt + 2 * (l & 3) + (q & 1);
        if (n < N && m < M) store_out<kDT>(out, bias, flags, m, n, ldo, vals[q]);
      }
    }
    if (!kPersistent || next >= n_tiles) break;
    tile = next;
  }
}
