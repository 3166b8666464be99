// 4-bit integer weights (GPTQ's nibble order: word bits 4i..4i+3 hold row 8 kw + i) to MMA operand
// registers, shared by the W4A16 kernels (w4a16_gemv.cu, w4a16_gemm.cu). No ALU conversion: a
// nibble ORed into the mantissa of 1024.0 (f16) or 128.0 (bf16) is that number plus q, and one
// f16x2 / bf16x2 instruction removes the bias and the zero point together, so the registers hold
// the exact small integers q - z.
#pragma once

#include "ptx.cuh"

namespace qops {

// `flags` bit of the W4A16 kernels: qweight is in 32-column slabs (qops/ops/int_weight.py), word
// (kw, n) at (n / 32) * 32 KW + 32 kw + n % 32, instead of kw N + n. A lane's columns n0 .. n0 + 3
// (n0 % 4 == 0) lie in one slab either way, so only its base and the word-row stride change; a warp's
// 4 word rows x 32 columns are then 512 contiguous bytes.
constexpr int kQSlabs = 32;

// Words from one qweight word row to the next.
__device__ __forceinline__ int qweight_row_stride(int N, int flags) { return (flags & kQSlabs) ? 32 : N; }

// Word (0, n0) of qweight (KW word rows).
__device__ __forceinline__ const u32* qweight_column(const u32* qweight, int n0, int KW, int flags) {
  return (flags & kQSlabs) ? qweight + static_cast<size_t>(n0 >> 5) * KW * 32 + (n0 & 31) : qweight + n0;
}

// The DT pairs that remove the magic bias and the zero point z (<= 16, in the mantissa):
//   f16:  (1024 + q) - (1024 + z) and (1024 + 16 q) / 16 - (64 + z); 1024 + z = 0x6400 + z,
//         -(64 + z) = 0xD400 + 16 z;
//   bf16: (128 + q) - (128 + z); -(128 + z) = 0xC300 + z.
// A column's z is z0 + its zero nibble: the pairs for z0 come once a kernel (w4_zero_base), a column's
// pairs once a column and group (w4_zero_pairs), one integer multiply-add each: every half stays below
// 0x10000, so (h + nib) * 0x10001 = h * 0x10001 + nib * 0x10001 exactly.
struct W4ZeroBase {
  u32 a, b;  // the z0 pairs: (0x6400 + z0 or 0xC300 + z0) and 0xD400 + 16 z0, in both halves
};

template <int DT>
__device__ __forceinline__ W4ZeroBase w4_zero_base(u32 z0) {
  return W4ZeroBase{((DT == 0 ? 0x6400u : 0xC300u) + z0) * 0x10001u, (0xD400u + 16u * z0) * 0x10001u};
}

__device__ __forceinline__ void w4_zero_pairs(const W4ZeroBase& base, u32 nib, u32& za, u32& zb) {
  za = nib * 0x10001u + base.a;
  zb = nib * 0x100010u + base.b;
}

// p[r] = (q[r] - z, q[r + 4] - z) of word w as a DT pair, r = 0..3 (za, zb: w4_zero_pairs of z).
template <int DT>
__device__ __forceinline__ void w4_dequant_word(u32 (&p)[4], u32 w, u32 za, u32 zb) {
  if constexpr (DT == 0) {
    const u32 w8 = w >> 8;
    p[0] = sub_f16x2(and_or(w, 0x000f000fu, 0x64006400u), za);
    p[1] = fma_f16x2(and_or(w, 0x00f000f0u, 0x64006400u), 0x2c002c00u, zb);
    p[2] = sub_f16x2(and_or(w8, 0x000f000fu, 0x64006400u), za);
    p[3] = fma_f16x2(and_or(w8, 0x00f000f0u, 0x64006400u), 0x2c002c00u, zb);
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) p[r] = fma_bf16x2(and_or(w >> (4 * r), 0x000f000fu, 0x43004300u), 0x3f803f80u, za);
  }
}

}  // namespace qops
