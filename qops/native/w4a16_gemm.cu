// W4A16 matmul for small prefill and batched decode (33 <= M <= 64 rows of x: the rows the decode
// kernel, w4a16_gemv.cu, does not take in one launch), reading the same runtime int-weight layout
// (qops/ops/int_weight.py), 4-bit case:
//   qweight u32 (ceil(K/8), N): word (kw, n) holds rows 8*kw .. 8*kw+7 of column n, nibble i = row 8*kw+i;
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
// benchmarks/NOTES.md stop 24) neither the weight stream nor the tensor cores set the pace at M = 64:
// the latency of each warp's instruction stream does, at 8 warps an SM.
//
// Work split. A block is 8 warps, NWN along N (32 columns each) by NWK = 8 / NWN along K; grid
// (ceil(N / (32 NWN)), S), the S blocks of a column tile splitting the K chunks (128 rows each)
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
// Compile-time configuration (NVRTC -D): QOPS_DT (0 f16, 1 bf16), QOPS_MT (8-row tiles of x, 1..8:
// M <= 8 MT), QOPS_NWN (1, 2, 4, 8: warps along N), QOPS_HAS_Z (0/1), QOPS_STAGES (2..8: pipeline
// stages), QOPS_MINB (blocks an SM promised to ptxas).
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

namespace qops {
namespace gemm {

constexpr int kDT = QOPS_DT;
constexpr int kMT = QOPS_MT;
constexpr int kNWN = QOPS_NWN;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kNWK = kWarps / kNWN;
constexpr int kStages = QOPS_STAGES;
constexpr bool kHasZ = QOPS_HAS_Z != 0;
constexpr int kChunkK = 128;
constexpr int kRow = kNWK * 16;  // 16-byte x slots (8 values) of one row in one stage
constexpr int kRS = kRow + 4;    // padded: rows g, g + 1 of a quarter warp fall in disjoint banks
// One warp's weights in a stage (w4a16_gemv.cu's kSmemStage): 4 steps x 32 lanes x 16 bytes, lane-major
// within a step, then the lanes' scales (8 bytes each), then their zero words (4 bytes each).
constexpr int kWarpW = 4 * 32 * 16 + 32 * 8 + 32 * 4;
constexpr int kWScales = 4 * 32 * 16;
constexpr int kWZeros = kWScales + 32 * 8;
constexpr int kScaleBf16 = 8;  // `flags` bit, as in w4a16_gemv.cu
static_assert(kMT >= 1 && kMT <= 8, "QOPS_MT is 1..8 (M <= 64)");
static_assert(kNWN == 1 || kNWN == 2 || kNWN == 4 || kNWN == 8, "QOPS_NWN is 1, 2, 4 or 8");
static_assert(kStages >= 2 && kStages <= 8, "QOPS_STAGES is 2..8");
static_assert(kWarpW % 16 == 0, "stages must stay 16-byte aligned");

// A scale (f16 or bf16 bits, per `flags`) as a DT pair.
__device__ __forceinline__ u32 scale_pair(u32 bits16, int flags) {
  const u16 h = static_cast<u16>(bits16);
  const float f = (flags & kScaleBf16) ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
  const u32 d = f32_to_bits<kDT>(f);
  return d | (d << 16);
}

}  // namespace gemm
}  // namespace qops

extern "C" __global__ void __launch_bounds__(qops::gemm::kThreads, QOPS_MINB)
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
  const int n0 = blockIdx.x * (32 * kNWN) + wn * 32 + 4 * g;
  const bool n_ok = n0 < N;  // N % 4 == 0: a lane's four columns are all in or all out
  const int KW = (K + 7) >> 3;
  const int C = (K + kChunkK - 1) / kChunkK;
  const int S = gridDim.y, split = blockIdx.y;
  const int cb = static_cast<int>(static_cast<long long>(split) * C / S);
  const int ce = static_cast<int>(static_cast<long long>(split + 1) * C / S);
  const int n_it = (ce - cb + kNWK - 1) / kNWK;
  const int zw = (N + 7) >> 3;
  // A stage: x (M rows of kRS slots), then the 8 warps' weights.
  const int xslots = M * kRS;
  const int stage_bytes = xslots * 16 + kWarps * kWarpW;
  const u32 smem_a = smem_addr(smem);
  const char* smem_c = reinterpret_cast<const char*>(smem);

  // This lane's weight pieces, scales and zero word for iteration `it` into stage `st`; nothing is
  // copied past K, past N or past the block's chunks (the slots keep stale bytes: rows past K meet
  // zeros in x, columns past N are never stored, and a warp without a chunk skips the math).
  const u32* wbase = qweight + static_cast<size_t>((cb + wk) * 16 + c) * N + n0;
  const size_t wstride = static_cast<size_t>(kNWK * 16) * N;
  auto load_w = [&](int it, int st) {
    const int ch = cb + it * kNWK + wk;
    const bool ok = n_ok && ch < ce;
    const int rows_left = KW - (ch * 16 + c);
    const int grp = chunks_per_group == 1 ? ch : (chunks_per_group == 0 ? 0 : ch / chunks_per_group);
    const u32 dst = smem_a + st * stage_bytes + xslots * 16 + warp * kWarpW;
    const u32* src = wbase + static_cast<size_t>(it) * wstride;
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async_16_if(dst + j * 512 + lane * 16, src + static_cast<size_t>(4 * j) * N, ok && 4 * j < rows_left);
    cp_async_8_if(dst + kWScales + lane * 8, scales + static_cast<size_t>(grp) * N + n0, ok);
    if constexpr (kHasZ) cp_async_4_if(dst + kWZeros + lane * 4, qzeros + static_cast<size_t>(grp) * zw + (n0 >> 3), ok);
  };
  // x of iteration `it` into stage `st`: row m, 8 values from column k0 + 8 kk; threads take slots
  // tid, tid + 256, ... (zeros from column K on).
  const int nslots = M * kRow;
  auto load_x = [&](int it, int st) {
    const int k0 = (cb + it * kNWK) * kChunkK;
    const u32 base = smem_a + st * stage_bytes;
    for (int s = tid; s < nslots; s += kThreads) {
      const int m = s / kRow, kk = s - m * kRow;
      const int k = k0 + 8 * kk;
      const bool in = k < K;  // K % 8 == 0: a slot is all in or all out
      cp_async_16(base + (m * kRS + kk) * 16, in ? x + static_cast<size_t>(m) * ldx + k : x, in ? 16 : 0);
    }
  };

  float acc[kMT][2][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][t][i] = 0.f;

  // The first stages: weights (never written by the kernel ahead), then x once that kernel is done.
  // Group s is committed after stage s's x: group 0 also carries every first stage's weights (the
  // first wait covers them all), later groups one stage whole.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st)
    if (st < n_it) load_w(st, st);
  grid_dep_wait();
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_it) load_x(st, st);
    cp_async_commit();  // one group a stage, empty or not, so the wait below counts stages
  }

  const W4ZeroBase zbase = w4_zero_base<kDT>(static_cast<u32>(kHasZ ? zero_offset : 8));  // w4.cuh

  for (int it = 0; it < n_it; ++it) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage it have landed
    __syncthreads();               // everyone's have; and every warp is done with the stage refilled below
    const int ahead = it + kStages - 1;
    if (ahead < n_it) {
      load_w(ahead, ahead % kStages);
      load_x(ahead, ahead % kStages);
    }
    cp_async_commit();
    if (cb + it * kNWK + wk >= ce) continue;  // warp-uniform: no chunk for this warp in the last iteration

    const int st = it % kStages;
    const uint4* xs = reinterpret_cast<const uint4*>(smem_c + st * stage_bytes);
    const char* wsm = smem_c + st * stage_bytes + xslots * 16 + warp * kWarpW;
    const uint2 sc = *reinterpret_cast<const uint2*>(wsm + kWScales + lane * 8);
    const u32 zbits = kHasZ ? *reinterpret_cast<const u32*>(wsm + kWZeros + lane * 4) >> ((n0 & 7) * 4) : 0u;
    u32 za[4], zb[4], sp[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const u32 nib = (zbits >> (4 * jj)) & 15u;  // zero of column n0 + jj
      w4_zero_pairs(zbase, nib, za[jj], zb[jj]);
      const u32 sw = jj < 2 ? sc.x : sc.y;
      sp[jj] = scale_pair((jj & 1) ? sw >> 16 : sw, flags);
    }
    // The chunk's weight words first (4 loads in flight at once), then per 32-row step j: the x
    // pieces of every tile (8 loads in flight), the dequantization (its ALU work covers their
    // latency), and the MMAs ordered k step outer, tile inner, so the two MMAs into one accumulator
    // sit 2 MT issues apart instead of back to back (Nsight Compute, 344420d: 2 warps a scheduler
    // issued every 4.8 cycles each, stalled on fixed-latency dependencies and shared loads).
    uint4 wv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wv[j] = *reinterpret_cast<const uint4*>(wsm + j * 512 + lane * 16);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // x[m, 8 kw .. 8 kw + 7] of row m = 8 mt + g. Rows past M read whatever the stage holds there
      // (inside the allocation: the stage's weights or the next stage); they only reach the
      // accumulators of output rows past M, which are never stored.
      uint4 xv[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) xv[mt] = xs[(8 * mt + g) * kRS + wk * 16 + 4 * j + c];
      // A fragments: p[jj][r] = scale * (q[r] - z, q[r+4] - z) of column n0 + jj.
      u32 p[4][4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        w4_dequant_word<kDT>(p[jj], word(wv[j], jj), za[jj], zb[jj]);
#pragma unroll
        for (int r = 0; r < 4; ++r) p[jj][r] = mul2<kDT>(p[jj][r], sp[jj]);
      }
      // Two 16-row k steps (s = 0: nibbles 0,4,1,5 against x pairs (0,4) (1,5); s = 1: 2,6,3,7 against
      // (2,6) (3,7)) x two 16-column tiles: rows g and g + 8 of tile t are columns n0 + 2t and n0 + 2t + 1.
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const u32 lo = s2 ? xv[mt].y : xv[mt].x, hi = s2 ? xv[mt].w : xv[mt].z;
          const u32 b0 = prmt<0x5410>(lo, hi), b1 = prmt<0x7632>(lo, hi);
#pragma unroll
          for (int t = 0; t < 2; ++t)
            mma_16816<kDT>(acc[mt][t], p[2 * t][2 * s2], p[2 * t + 1][2 * s2], p[2 * t][2 * s2 + 1], p[2 * t + 1][2 * s2 + 1], b0, b1);
        }
    }
  }
  grid_dep_launch_dependents();

  // Sums of the NWK warps of a column group, in warp order, through shared memory (the stages).
  cp_async_wait<0>();
  __syncthreads();
  float4* part = reinterpret_cast<float4*>(smem);
  constexpr int kSlots = kMT * 2 * 32;  // float4 a lane per (mt, t)
  if (kNWK > 1 && wk > 0) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int t = 0; t < 2; ++t)
        part[((wk - 1) * kNWN + wn) * kSlots + (mt * 2 + t) * 32 + lane] =
            make_float4(acc[mt][t][0], acc[mt][t][1], acc[mt][t][2], acc[mt][t][3]);
  }
  if (kNWK > 1) __syncthreads();
  if (wk > 0 || !n_ok) return;
  const size_t mn = static_cast<size_t>(M) * N;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      float v[4] = {acc[mt][t][0], acc[mt][t][1], acc[mt][t][2], acc[mt][t][3]};
      for (int w = 1; w < kNWK; ++w) {
        const float4 o = part[((w - 1) * kNWN + wn) * kSlots + (mt * 2 + t) * 32 + lane];
        v[0] += o.x;
        v[1] += o.y;
        v[2] += o.z;
        v[3] += o.w;
      }
      // acc[mt][t][i]: x row 8 mt + 2 c + (i & 1), column n0 + 2 t + (i >> 1).
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * mt + 2 * c + (i & 1), n = n0 + 2 * t + (i >> 1);
        if (m >= M) continue;
        if (S == 1) store_out<kDT>(out, bias, flags, m, n, ldo, v[i]);
        else ws[split * mn + static_cast<size_t>(m) * N + n] = v[i];
      }
    }
}
