// 4-bit codebook weights (bitsandbytes NF4 / FP4, or any 16-value code) decoded through a table in
// shared memory, shared by the kernels that read them (blockwise4_gemv.cu, and w4a16_gemv.cu with
// QOPS_LUT). A byte of weights holds two codes; the table maps the byte v to the DT pair
// (code[v >> 4] in the low half, code[v & 15] in the high half), which is one register of an MMA
// operand, so decoding is one shared load a byte and no ALU chain.
//
// The table is held 32 times, entry v's copy for lane l at byte v * STRIDE + 4 l, so the 32 lanes of a
// warp hit 32 different banks whatever bytes they look up. STRIDE 128 packs the copies (32 KiB); with
// STRIDE 256 (64 KiB, half of each entry unused) one prmt builds v * 256 + 4 l outright and the load
// takes the table's shared-window address as its immediate (IMM: the table must then start where the
// caller says, which it checks on entry).
#pragma once

#include "ptx.cuh"

namespace qops {

template <int STRIDE>
__host__ __device__ constexpr int codebook_table_bytes() {
  static_assert(STRIDE == 128 || STRIDE == 256, "a table entry's 32 copies take 128 or 256 bytes");
  return 256 * STRIDE;
}

// Builds the table from the fp32 codebook `code` (16 values, rounded to DT). Thread `tid` of `threads`
// builds word v = tid, tid + threads, ... and stores its 32 copies starting at its own lane's bank, so a
// warp's stores of one round fall in 32 different banks. The caller syncs before any lookup.
template <int DT, int STRIDE>
__device__ __forceinline__ void codebook_table_build(unsigned char* table, const float* code, int tid, int threads) {
  for (int v = tid; v < 256; v += threads) {
    const u32 lo = f32_to_bits<DT>(code[v >> 4]);
    const u32 hi = f32_to_bits<DT>(code[v & 15]);
    const u32 word2 = lo | (hi << 16);
    u32* entry = reinterpret_cast<u32*>(table + v * STRIDE);
#pragma unroll 8
    for (int c = 0; c < 32; ++c) entry[(c + tid) & 31] = word2;
  }
}

// The table word of byte SEL of w for this lane. With BASE >= 0 (STRIDE 256) lane_table is 4 * lane and
// BASE the table's shared-window address (the load's immediate); otherwise lane_table is the shared
// address of the lane's copy of entry 0.
template <int SEL, int STRIDE, int BASE>
__device__ __forceinline__ u32 codebook_lookup(u32 lane_table, u32 w) {
  u32 v;
  if constexpr (BASE >= 0) {
    static_assert(STRIDE == 256, "the immediate form needs 256-byte entries");
    // one prmt: byte 0 from lane_table (4 * lane < 256), byte 1 = byte SEL of w, bytes 2, 3 zero
    asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(v) : "r"(prmt<0x5504 | (SEL << 4)>(w, lane_table)), "n"(BASE));
  } else {
    // prmt isolates byte v; one integer multiply-add makes the address
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(prmt<0x4440 | SEL>(w, 0u) * static_cast<u32>(STRIDE) + lane_table));
  }
  return v;
}

}  // namespace qops
