"""Triton lowering of ``qops::mm_blockwise4``: 4-bit codebook weights (bitsandbytes NF4 / FP4) on CUDA.

Reads the runtime layout of :mod:`qops.ops.blockwise4` as is: the flat nibble stream (element 2i in
the high nibble of byte i), the 16-entry codebook, and the block absmax, nested or not. With
``K % blocksize == 0`` every row starts on a byte and a block never spans two rows: byte j of row n
holds K indices 2j and 2j+1 and belongs to block ``n * K/B + 2j // B``, which the gemv and gemm
kernels assume. Other K (blocks straddling rows) take the dense path at every M: it reads the flat
stream by absolute index and needs neither.

- **gemv** (M <= ``gemv_max_m``, 16 by default; M = 1 in 16 bits takes **gemv_fma** below): ``tl.dot``
  with the weight as the wide operand:
  a program owns ``BLOCK_N`` rows and walks its K split in steps of ``STEP`` bytes per row (by default
  at most one block, so one absmax per (row, step); multi-block steps below); the rows of x are the dot's N, padded to 16, so M = 1
  and M = 16 cost the same weight traffic and decode. Each step is two dots, even K against the
  high nibbles and odd K against the low ones (no interleaving), accumulated by the tensor cores in
  fp32; the block absmax (nested: de-nested once per (row, step) as
  ``nested_code[u8] * nested_absmax[b // 256] + offset``) scales the step's fp32 product once per
  output element. Codes are decoded in registers by inline PTX: the 16 codes rounded to x's dtype
  are split into eight 32-bit words (low bytes of codes 0-3, 4-7, 8-11, 12-15, then the high
  bytes), and per four weight bytes ``prmt`` picks every nibble's byte from the two half tables,
  keeps the half its bit 3 names and interleaves low and high bytes into half2 words: 22
  instructions per 4 bytes and no memory access, where the previous kernel gathered each nibble's
  code from a 64-byte table in L1 (two loads per byte) and de-nested the absmax per element. SASS
  of the loop (triton 3.9, sm_90, fp16, NF4, blocksize 64, nested, the default config): 0.315
  warp-instructions per weight byte, against 0.63 for the previous GEMV (1.30 when the launcher
  cannot prove 8-byte rows); the H200 issues ~4 per cycle per SM and needs ~16 bytes per cycle per
  SM at the copy roofline. Triton's interpreter runs no inline PTX, and fp32 activations have no
  16-bit codes: both look the codes up in memory (``PRMT=False``; fp32 x then takes an exact FMA
  dot only as wide as M, 0.51 warp-instructions per byte at M = 1); the PTX sequence itself is
  executed instruction by instruction in ``tests/test_bitsandbytes.py``.

  Multi-block steps (config ``gemv.blocks_per_step`` > 1, off by default: measured on the H200
  at 0.63-1.09x the one-block step, so the absmax chain below is not what bounds it; see CONFIGS): a step of
  ``STEP`` bytes per row spans ``G = 2 * STEP / blocksize`` whole blocks (a power of two that divides
  the row, so splits, a whole number of steps, stay mask-free). They were built on the hypothesis
  that the dependent chain of two global loads inside the loop (absmax byte, then its nested code
  and nested absmax) bounds the one-block step; the H200 said otherwise (see CONFIGS). Two ways to scale G blocks per step were compiled and counted
  (SASS, loop only, sm_90, fp16, NF4 nested, b64):
  (b) ``scale "product"``: G dot pairs per step (unrolled, one per block, the default layout and
  registers of the one-block kernel), each fp32 product scaled by its block's absmax as before, with
  all G absmax loaded and de-nested at the top of the step (independent loads: one latency per step).
  BLOCK_N 128, 4 warps: 0.285 warp-instructions per byte at STEP 128, 0.278 at 256 (0.315 at one
  block), 111-114 registers, no spills; numerics unchanged (one rounding of each code to x's dtype).
  (a) ``scale "weight"``: the decoded tile times its blocks' absmax in x's dtype (an HMUL2 per two
  codes), then one wide dot pair into the accumulator: no fp32 scaling, but at ``BLOCK_M = 16`` a
  block row of 64 codes costs 32 packed multiplies against 16 FMAs on the product, the whole
  ``BLOCK_N x STEP`` tile is live at once (255 registers at BLOCK_N 128, STEP 128, 4 warps; 0.318
  per byte on 8 warps), and the scaled weight rounds twice more (absmax and product in 16 bits:
  ~1.7x the fp16 error, subnormal below ~6e-5 absmax in fp16). So (b) is the path; (a) is kept
  selectable for the GPU sweep only.
- **gemv_fma** (M <= ``gemv_fma_max_m``, 2 by default, x in fp16 or bf16): CUDA cores, no tensor
  core. A program takes up to four (weight row, row of x) products: at M = 1 two weight rows, at
  M = 2 two by two. It walks the K split in steps of ``STEP`` contiguous bytes a weight row, seen as
  a (G, SUB) tile of runs that each lie inside one block. Codes are decoded by the same ``prmt``
  sequence, once per weight row for every row of x; x is read as int32 pairs (element 2j low,
  2j + 1 high: byte j's two nibbles) when its rows start on 4 bytes with unit stride; products and
  sums are fp32, and each run's sum is scaled once by its block's absmax. Every tensor of a step is
  2-D in the weight bytes' layout, so Triton loads x straight into the registers that use it; the
  tensor-core GEMV pays a shared-memory layout conversion (and barriers) for its operands each step.
  The loop is ~14.5 thread-instructions per weight byte at two weight rows (SASS, triton 3.6,
  sm_90), which caps it by instruction issue near 55% of the copy roofline; measured 32-43% at
  M = 1 against 20-24% for the tensor-core GEMV, and 1.27-1.37x that GEMV at M = 2 (CONFIGS).
- **dense** (M > ``dense_above_m``, 32 by default): the weight is dequantized by a Triton kernel
  into a transient ``(slab, K)`` buffer of x's dtype (at most ``slab_bytes``, 128 MB), rows
  ``[n0, n0 + slab)`` of W at a time, and cuBLAS writes ``x @ slab.T (+ bias)`` into the output's
  columns ``[n0, n0 + slab)``; the dense weight never outlives the call. A slab of W is a contiguous
  range of the flat element stream, so the kernel is one-dimensional: a program decodes
  ``DQ_BLOCK_BYTES`` consecutive bytes (both nibbles of a byte lie in one block, B being even), looks
  both codes up, scales them by their block's absmax in fp32 (de-nested as in the other kernels) and
  rounds once to x's dtype. Block and nested-block indices come from the absolute flat index, so slab
  edges need not fall on block boundaries; slabs are a multiple of 8 rows, which keeps every slab's
  first element on a byte (``n0 * K`` even) and its output column offset 16-byte aligned.
- **gemm** (only when the config raises ``dense_above_m`` past ``gemv_slices_max_m``; measured
  0.02-0.04x cuBLAS fp16): ``tl.dot`` on tensor cores. A K step of ``BLOCK_K`` values (at most one
  block) is two dots, even and odd K against the high and low nibbles, so no interleaving is
  needed; the block absmax scales the step's fp32 product once per output element (small
  ``BLOCK_M``), or the weight tile before the dots (large ``BLOCK_M``, where a second fp32
  accumulator would spill).

Split-K (atomic adds into a zeroed fp32 buffer), workspace and configs as in
:mod:`qops.ops.triton.int8_weight`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._common import unit_stride
from ..blockwise4 import LAYOUT_FLAT
from .common import (ConfigTable, finish, fp32_scratch, grouped_tile, output_2d, pow2_at_most, rows_2d, sm_count, split_k,
                     store_row, store_tile, workspace_view)

CONFIGS: dict = {
    # GEMV: BLOCK_N 64 rows x 32 bytes per step on 4 warps, K split until ~4 programs per SM: the best
    # of two H200 sweeps (bench_bnb_int8.py --sweep-nf4; ...-99e1780-nf4-steps.json and
    # ...-b72e09a-nf4-steps-2.json): 1.17x the earlier BLOCK_N 128, one program per SM (geometric
    # mean of four shapes at M 1 and 16), e.g. 8192x28672 M=1 148 -> 122 us, still ~20-24% of the
    # roofline. More, smaller programs helped; multi-block steps, 8 warps and BLOCK_N 256 did not.
    # Triton 3.6 (the device's), with the launch's divisibility specialization, puts the weight bytes
    # through a cp.async pipeline of num_stages (70 registers; 96 at BLOCK_N 128). A hand pipeline
    # instead (1-3 steps of weight bytes and absmax carried in registers, 3cd88ff) measured
    # 0.63-0.85x (...-6f38b91-nf4-steps-3.json) and was taken out; what bounds the loop is not
    # established.
    # STEP_BYTES is capped at blocks_per_step * blocksize / 2 (1: one absmax per step). M <= 16 rows
    # of x ride in one 16-wide dot.
    "gemv_max_m": 16,
    # Above this M, calls dequantize W into slabs and multiply with cuBLAS. The dense path moves ~4.5
    # bytes per weight (0.5 read, 2 written, 2 read back by cuBLAS) at near copy bandwidth; the
    # slices move 0.5 bytes per weight per 16-row slice at ~20% of it (measured at 26b1d5b: 0.20-0.22x
    # cuBLAS fp16 at M = 64, 0.07-0.08x at M = 256), i.e. ~2.5 copy-bandwidth bytes per slice: the
    # slices cost more from 3 slices up (M > 32). Not yet measured on a GPU; by the same count the
    # dense path would run near 2 / 4.5 of cuBLAS fp16's speed while cuBLAS is bound by its weight reads.
    "dense_above_m": 32,
    # Transient dense weight per slab, bytes (x's dtype); one slab for N * K * 2 <= 128 MB in fp16.
    "slab_bytes": 128 << 20,
    "dense": {"DQ_BLOCK_BYTES": 1024, "num_warps": 4},
    # Up to this M (and not dense), calls run the small-M kernel over gemv_max_m-row slices (see
    # triton_mm); above, the GEMM.
    "gemv_slices_max_m": 256,
    # blocks_per_step > 1 lets STEP_BYTES span that many whole blocks per row (the multi-block step,
    # measured 0.63-1.09x: kept for sweeps); scale "weight" scales the weight tile before one wide
    # dot instead of each block's product (see the module docstring).
    "gemv": {"BLOCK_N": 64, "STEP_BYTES": 32, "num_warps": 4, "num_stages": 4, "programs_per_sm": 4,
             "max_split": 16, "blocks_per_step": 1, "scale": "product"},
    # Up to this M (16-bit x only), the CUDA-core GEMV (``_gemv_fma_kernel``): ROWS weight rows x
    # STEP_BYTES contiguous bytes a row per step, for each of up to 4 // ROWS rows of x.
    # Sweep 1 at M = 1 (71d027d, benchmarks/results/h200-2026-11-30-71d027d-nf4-fma.json: 1/2 rows,
    # 512-2048 bytes, 1/2/4 warps, 1/2 stages): two rows of 1024 bytes on one warp best on all four
    # large shapes, 37.5 / 31.8 / 42.5 / 37.9% of the roofline against 23.0 / 19.6 / 23.8 / 23.9% for
    # the tensor-core GEMV in the same run (1.59-1.79x); two rows beat one (x converted once for
    # both), one warp beat two and four, stages did not matter. Sweep 2 (ff4b071, ...-nf4-fma-2.json):
    # four rows lost to two. Sweep 3 (a05a4ec, ...-nf4-fma-3.json): rows of x unrolled with the
    # weight rows; at M = 2, two by two measured 49.3 / 27.0 / 176 / 94.5 us against 62.8 / 36.7 / 241 /
    # 122 for the tensor-core GEMV; at M = 4 (one weight row by four rows of x) 1.4-2.2x slower than
    # it: the products, not the bytes, bound it there. The unrolled kernel as measured there cost M = 1
    # ~5% (40.4 / 22.4 / 143 / 77.5 us against 38.0 / 22.5 / 135 / 75.5): ptxas took 125 registers
    # where the two-row kernel took 80 (capping them with maxnreg 80-128 was slower still, 6c34b9c,
    # ...-6c34b9c-nf4-fma-4.json). The cause was the epilogue's form; with the current one the M = 1
    # kernel's SASS is the two-row kernel's again (1112 instructions, 80 registers, the same
    # sequence up to register names): not re-measured. maxnreg: ptxas's register cap (None: its own).
    "gemv_fma_max_m": 2,
    "gemv_fma": {"ROWS": 2, "STEP_BYTES": 1024, "num_warps": 1, "num_stages": 2, "maxnreg": None, "programs_per_sm": 4,
                 "max_split": 16},
    # Register counts from ptxas (triton 3.6, sm_90, nested, blocksize 64): 168, 114, 164, 164,
    # 210; no spills (BLOCK_N 128 with BLOCK_M >= 32 reaches 255).
    "gemm": [
        (16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}),
        (32, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
        (64, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
        (128, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
        (1 << 62, {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
    ],
    "gemm_max_split": 8,
    "GROUP_M": 8,
    # Up to this BLOCK_M the block absmax scales the fp32 product of each K step (a second
    # accumulator); above it, the weight tile before the dot (registers: 255 and spills otherwise).
    "scale_after_max_block_m": 32,
}
TABLE = ConfigTable(CONFIGS)
config_override = TABLE.override
INTERPRETER_SMS = 8  # SM count assumed under Triton's CPU interpreter (tests)


def interpreted() -> bool:
    """Triton's CPU interpreter runs no inline PTX: there the GEMV looks codes up in memory instead."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blk, mask, NESTED: tl.constexpr, NESTED_BS: tl.constexpr):
    """fp32 absmax of blocks ``blk``: plain, or de-nested from uint8 through the 256-entry code."""
    if NESTED:
        q = tl.load(am_ptr + blk, mask=mask, other=0).to(tl.int32)
        return tl.load(ncode_ptr + q) * tl.load(nam_ptr + blk // NESTED_BS, mask=mask, other=0.0) + noff
    else:
        return tl.load(am_ptr + blk, mask=mask, other=0.0)


# $4: four weight bytes; $5 + 4i: plane word i of _code_planes; $0, $1: even codes, $2, $3: odd codes.
_DECODE_ASM = tl.constexpr("""
{
.reg .b32 a, m, a2, m2, x, y, lo, hi;
and.b32 a, $4, 0x77777777;
shr.u32 m, $4, 1;
and.b32 m, m, 0x44444444;
or.b32 m, m, 0x32103210;
shr.u32 a2, a, 16;
shr.u32 m2, m, 16;
prmt.b32 x, $5, $9, a;
prmt.b32 y, $13, $17, a;
prmt.b32 lo, x, y, m;
prmt.b32 x, $21, $25, a;
prmt.b32 y, $29, $33, a;
prmt.b32 hi, x, y, m;
prmt.b32 $0, lo, hi, 0x7351;
prmt.b32 $2, lo, hi, 0x6240;
prmt.b32 x, $5, $9, a2;
prmt.b32 y, $13, $17, a2;
prmt.b32 lo, x, y, m2;
prmt.b32 x, $21, $25, a2;
prmt.b32 y, $29, $33, a2;
prmt.b32 hi, x, y, m2;
prmt.b32 $1, lo, hi, 0x7351;
prmt.b32 $3, lo, hi, 0x6240;
}
""")
# Four outputs (two int16 pairs each), then the byte word and 8 table words, each packed four times.
_DECODE_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 33))


@triton.jit
def _plane_word(code_ptr, FIRST: tl.constexpr, HIGH: tl.constexpr, DT: tl.constexpr):
    """Bytes ``HIGH`` (0 low, 1 high) of the 16-bit codes FIRST..FIRST+3 (rounded to DT), packed in an int32."""
    word = 0
    for i in tl.static_range(4):
        bits = tl.load(code_ptr + FIRST + i).to(DT).to(tl.int16, bitcast=True).to(tl.int32)
        word = word | (((bits >> (8 * HIGH)) & 0xFF) << (8 * i))
    return word


@triton.jit
def _code_planes(code_ptr, DT: tl.constexpr):
    """The register codebook: the 16 codes rounded to DT, as eight int32 words of four bytes each
    (low bytes of codes 0-3, 4-7, 8-11, 12-15, then their high bytes)."""
    return (_plane_word(code_ptr, 0, 0, DT), _plane_word(code_ptr, 4, 0, DT), _plane_word(code_ptr, 8, 0, DT),
            _plane_word(code_ptr, 12, 0, DT), _plane_word(code_ptr, 0, 1, DT), _plane_word(code_ptr, 4, 1, DT),
            _plane_word(code_ptr, 8, 1, DT), _plane_word(code_ptr, 12, 1, DT))


@triton.jit
def _gemv_tables(noff_ptr, code_ptr, NESTED: tl.constexpr, PRMT: tl.constexpr, DT: tl.constexpr):
    """What the GEMVs read once per program: the nested absmax's offset (0 when plain) and the
    register codebook for ``_decode`` (unused zeros when codes are looked up in memory)."""
    if NESTED:
        noff = tl.load(noff_ptr)
    else:
        noff = 0.0
    if PRMT:
        planes = _code_planes(code_ptr, DT)
    else:
        planes = (0, 0, 0, 0, 0, 0, 0, 0)
    return noff, planes


@triton.jit
def _decode_prmt(b, planes, DT: tl.constexpr):
    """(even, odd) 16-bit codes of the bytes ``b`` (high nibble: even K, low nibble: odd K), in DT.

    Four bytes (eight nibbles) per call: ``prmt`` looks each nibble's low three bits up in both
    8-entry halves of a byte plane, a third ``prmt`` keeps the half the nibble's bit 3 names, and two
    more interleave low and high bytes into half2 words: 22 instructions, no memory access.
    """
    l0, l1, l2, l3, h0, h1, h2, h3 = planes
    even, odd = tl.inline_asm_elementwise(
        asm=_DECODE_ASM, constraints=_DECODE_CONSTRAINTS,
        args=[b, l0, l1, l2, l3, h0, h1, h2, h3], dtype=(tl.int16, tl.int16), is_pure=True, pack=4)
    return even.to(DT, bitcast=True), odd.to(DT, bitcast=True)


@triton.jit
def _decode(b, planes, code_ptr, PRMT: tl.constexpr, DT: tl.constexpr):
    """(even, odd) codes of the bytes ``b`` in DT: in registers (``PRMT``) or looked up in memory."""
    if PRMT:
        w_even, w_odd = _decode_prmt(b, planes, DT)
    else:
        bi = b.to(tl.int32)
        w_even = tl.load(code_ptr + (bi >> 4)).to(DT)
        w_odd = tl.load(code_ptr + (bi & 15)).to(DT)
    return w_even, w_odd


@triton.jit
def _dot_pair(w_even, w_odd, xx, acc, BLOCK_M: tl.constexpr, STEP: tl.constexpr, DT: tl.constexpr):
    """``acc + w_even @ x_even.T + w_odd @ x_odd.T`` for ``xx`` = (BLOCK_M, 2 * STEP) consecutive K of x."""
    x_even, x_odd = tl.split(tl.reshape(xx, (BLOCK_M, STEP, 2)))
    if DT == tl.float32:
        t = tl.dot(w_even, tl.trans(x_even), acc, input_precision="ieee")
        t = tl.dot(w_odd, tl.trans(x_odd), t, input_precision="ieee")
    else:
        t = tl.dot(w_even, tl.trans(x_even), acc)
        t = tl.dot(w_odd, tl.trans(x_odd), t)
    return t


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff_ptr, bias_ptr, y_ptr,
    M, N, row_bytes, stride_xm, stride_xk, stride_ym, stride_yn, split_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STEP: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    PRMT: tl.constexpr, SCALE_W: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # A step is STEP bytes per row: SUB bytes inside one block (STEP <= half a block), or G = STEP /
    # SUB whole blocks (STEP a multiple of half a block).
    SUB: tl.constexpr = STEP if STEP < BLOCKSIZE // 2 else BLOCKSIZE // 2
    G: tl.constexpr = STEP // SUB
    blocks_per_row = (2 * row_bytes) // BLOCKSIZE
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    nmask = offs_n < N
    mmask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    row_blk = offs_n.to(tl.int64) * blocks_per_row
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    DT: tl.constexpr = x_ptr.dtype.element_ty
    noff, planes = _gemv_tables(noff_ptr, code_ptr, NESTED, PRMT, DT)
    kb_lo = pid_k * split_bytes
    kb_hi = tl.minimum(row_bytes, kb_lo + split_bytes)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # K % BLOCKSIZE == 0, splits are whole steps and STEP divides the row (plan): every step is whole.
    for kb0 in range(kb_lo, kb_hi, STEP):
        if SCALE_W:
            # One wide dot per step: each decoded weight times its block's absmax, rounded to DT.
            offs_w = tl.arange(0, STEP)
            bw = tl.load(w_rows + (kb0 + offs_w)[None, :], mask=nmask[:, None], other=0,
                        eviction_policy="evict_first")
            we, wo = _decode(bw, planes, code_ptr, PRMT, DT)
            blks = row_blk[:, None] + ((2 * kb0) // BLOCKSIZE + tl.arange(0, G))[None, :]
            sw = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blks, nmask[:, None], NESTED, NESTED_BS).to(DT)
            we = tl.reshape(tl.reshape(we, (BLOCK_N, G, SUB)) * sw[:, :, None], (BLOCK_N, STEP))
            wo = tl.reshape(tl.reshape(wo, (BLOCK_N, G, SUB)) * sw[:, :, None], (BLOCK_N, STEP))
            xw = tl.load(x_rows + (2 * kb0 + tl.arange(0, 2 * STEP))[None, :] * stride_xk, mask=mmask[:, None],
                         other=0.0)
            acc = _dot_pair(we, wo, xw, acc, BLOCK_M, STEP, DT)
        else:
            # One dot pair per block (G of them, unrolled), each fp32 product scaled by its absmax.
            offs_b = tl.arange(0, SUB)
            offs_x = tl.arange(0, 2 * SUB)
            if G > 1:
                # Every block's absmax of the step first (G independent loads and de-nestings): one
                # load latency per step, not a dependent chain per block between the dots.
                ss = ()
                for g in tl.static_range(G):
                    ss = ss + (_block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, row_blk + (2 * kb0) // BLOCKSIZE + g,
                                             nmask, NESTED, NESTED_BS),)
            for g in tl.static_range(G):
                kb = kb0 + g * SUB
                b = tl.load(w_rows + (kb + offs_b)[None, :], mask=nmask[:, None], other=0,
                            eviction_policy="evict_first")
                w_even, w_odd = _decode(b, planes, code_ptr, PRMT, DT)
                xx = tl.load(x_rows + (2 * kb + offs_x)[None, :] * stride_xk, mask=mmask[:, None], other=0.0)
                t = _dot_pair(w_even, w_odd, xx, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), BLOCK_M, SUB, DT)
                if G > 1:
                    s = ss[g]
                else:
                    s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, row_blk + (2 * kb) // BLOCKSIZE, nmask,
                                      NESTED, NESTED_BS)
                acc += t * s[:, None]
    store_tile(y_ptr, bias_ptr, tl.trans(acc), offs_m, offs_n, mmask, nmask, stride_ym, stride_yn, HAS_BIAS, ATOMIC)


@triton.jit
def _fma_weights(w_row, kb0, pos, blks, row_len, planes, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff,
                 MASKED: tl.constexpr, PRMT: tl.constexpr, NESTED: tl.constexpr, NESTED_BS: tl.constexpr,
                 DT: tl.constexpr):
    """One weight row's step: its (G, SUB) even and odd codes in fp32 and the (G,) absmax of its runs.
    ``MASKED``: the row may not exist (``row_len`` 0 instead of its byte count): it reads as zeros."""
    if MASKED:
        b = tl.load(w_row + kb0 + pos, mask=kb0 + pos < row_len, other=0, eviction_policy="evict_first")
        s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blks, kb0 + tl.arange(0, blks.shape[0]) < row_len,
                          NESTED, NESTED_BS)
    else:
        b = tl.load(w_row + kb0 + pos, eviction_policy="evict_first")
        s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blks, blks >= 0, NESTED, NESTED_BS)
    w_even, w_odd = _decode(b, planes, code_ptr, PRMT, DT)
    return w_even.to(tl.float32), w_odd.to(tl.float32), s


@triton.jit
def _fma_x(x_ptr, row_start, kb0, pos, stride_xk, row_len, MASKED: tl.constexpr, PAIRS: tl.constexpr,
           DT: tl.constexpr):
    """One row of x for a step: its (G, SUB) even and odd elements in fp32 (byte j of the step: K
    indices 2j, 2j + 1). ``MASKED``: the row may not exist (``row_len`` 0): it reads as zeros."""
    mask = kb0 + pos < row_len
    if PAIRS:
        # The launcher checked that x's rows start on 4 bytes and run with unit stride.
        ptr = x_ptr.to(tl.pointer_type(tl.int32)) + row_start // 2 + kb0 + pos
        if MASKED:
            xp = tl.load(ptr, mask=mask, other=0)
        else:
            xp = tl.load(ptr)
        x_even = (xp & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        x_odd = (xp >> 16).to(tl.int16).to(DT, bitcast=True)
    else:
        ptr = x_ptr + row_start + (2 * (kb0 + pos)) * stride_xk
        if MASKED:
            x_even = tl.load(ptr, mask=mask, other=0.0)
            x_odd = tl.load(ptr + stride_xk, mask=mask, other=0.0)
        else:
            x_even = tl.load(ptr)
            x_odd = tl.load(ptr + stride_xk)
    return x_even.to(tl.float32), x_odd.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(
    x_ptr, w_ptr, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff_ptr, bias_ptr, y_ptr,
    M, N, row_bytes, stride_xm, stride_xk, stride_ym, stride_yn, split_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, ROWS: tl.constexpr, XROWS: tl.constexpr, STEP: tl.constexpr,
    NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, PRMT: tl.constexpr, PAIRS: tl.constexpr,
):
    """``XROWS`` rows of x against ``ROWS`` weight rows on CUDA cores (ROWS x XROWS <= 4 products a
    program), ``STEP`` bytes a weight row per step.

    A row's step is a (G, SUB) tile: G runs of SUB contiguous bytes, each inside one block, so the
    block absmax is constant along a run and scales the run's fp32 sum of products once. Every
    tensor of the step is 2-D in the weight bytes' layout: Triton then loads x straight into the
    registers that use it (a 3-D (rows, G, SUB) tile made it move x through shared memory, with two
    barriers per conversion), so the rows of W and of x are unrolled rather than tensor dimensions.
    Each weight row is decoded once for all XROWS rows of x, and each row of x converted once for all
    ROWS weight rows. x is read as int32 pairs (``PAIRS``: element 2j in the low half, 2j + 1 in the
    high half, byte j's high and low nibble), as wide as the weight's loads.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    SUB: tl.constexpr = STEP if STEP < BLOCKSIZE // 2 else BLOCKSIZE // 2
    G: tl.constexpr = STEP // SUB
    DT: tl.constexpr = x_ptr.dtype.element_ty
    m0 = pid_m * XROWS
    n0 = pid_n * ROWS
    offs_g = tl.arange(0, G)
    pos = offs_g[:, None] * SUB + tl.arange(0, SUB)[None, :]  # (G, SUB): byte offsets inside a step
    blocks_per_row = (2 * row_bytes) // BLOCKSIZE
    w_row = w_ptr + n0.to(tl.int64) * row_bytes
    noff, planes = _gemv_tables(noff_ptr, code_ptr, NESTED, PRMT, DT)
    kb_lo = pid_k * split_bytes
    kb_hi = tl.minimum(row_bytes, kb_lo + split_bytes)
    # Products (weight row r, row j of x) are lanes r * XROWS + j: four accumulators at most.
    acc0 = tl.zeros([G], tl.float32)
    acc1 = tl.zeros([G], tl.float32)
    acc2 = tl.zeros([G], tl.float32)
    acc3 = tl.zeros([G], tl.float32)
    # Row 0 of W and of x always exists; a later one past N or M reads as zeros (0 bytes long).
    row_lens = ()
    for r in tl.static_range(ROWS):
        row_lens = row_lens + (tl.where(n0 + r < N, row_bytes, 0),)
    x_lens = ()
    for j in tl.static_range(XROWS):
        x_lens = x_lens + (tl.where(m0 + j < M, row_bytes, 0),)
    for kb0 in range(kb_lo, kb_hi, STEP):
        xs = ()
        for j in tl.static_range(XROWS):
            xs = xs + (_fma_x(x_ptr, (m0 + j) * stride_xm, kb0, pos, stride_xk, x_lens[j], j > 0, PAIRS, DT),)
        blks = n0.to(tl.int64) * blocks_per_row + (2 * (kb0 + offs_g * SUB)) // BLOCKSIZE
        for r in tl.static_range(ROWS):
            w_even, w_odd, s = _fma_weights(w_row + r * row_bytes, kb0, pos, blks + r * blocks_per_row,
                                            row_lens[r], planes, code_ptr, am_ptr, ncode_ptr,
                                            nam_ptr, noff, r > 0, PRMT, NESTED, NESTED_BS, DT)
            for j in tl.static_range(XROWS):
                x_even, x_odd = xs[j]
                part = tl.sum(w_even * x_even + w_odd * x_odd, axis=1) * s
                if r * XROWS + j == 0:
                    acc0 += part
                elif r * XROWS + j == 1:
                    acc1 += part
                elif r * XROWS + j == 2:
                    acc2 += part
                else:
                    acc3 += part
    # Row j of x: weight row r's sum (lane r * XROWS + j) goes to column n0 + r. A four-wide vector
    # whatever ROWS is: ptxas kept 125 registers in the loop for a ROWS-wide one built in a loop,
    # against 80 for this form (two weight rows, one row of x; triton 3.6, sm_90).
    accs = (acc0, acc1, acc2, acc3)
    i = tl.arange(0, 4)
    for j in tl.static_range(XROWS):
        r = tl.where(i == 0, tl.sum(accs[j], axis=0), 0.0)
        if ROWS >= 2:
            r = tl.where(i == 1, tl.sum(accs[XROWS + j], axis=0), r)
        if ROWS >= 4:
            r = tl.where(i == 2, tl.sum(accs[2 * XROWS + j], axis=0), r)
            r = tl.where(i == 3, tl.sum(accs[3 * XROWS + j], axis=0), r)
        # Columns past N or this program's rows, and a row of x past M, are not written.
        cols = tl.where(m0 + j < M, tl.minimum(N, n0 + ROWS), 0)
        store_row(y_ptr, bias_ptr, r, m0 + j, n0 + i, n0 + i < cols, stride_ym, stride_yn, HAS_BIAS, ATOMIC)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr, w_ptr, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_ym, stride_yn, split_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr, IEEE: tl.constexpr, SCALE_AFTER: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    HALF: tl.constexpr = BLOCK_K // 2
    row_bytes = K // 2
    blocks_per_row = K // BLOCKSIZE
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, HALF)
    pair = tl.arange(0, 2)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    row_blk = offs_n.to(tl.int64) * blocks_per_row
    DT: tl.constexpr = x_ptr.dtype.element_ty
    if NESTED:
        noff = tl.load(noff_ptr)
    else:
        noff = 0.0
    kb_lo = pid_k * split_bytes
    kb_hi = tl.minimum(row_bytes, kb_lo + split_bytes)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # K % BLOCKSIZE == 0 and BLOCK_K divides BLOCKSIZE: every step is whole and inside one block.
    for kb0 in range(kb_lo, kb_hi, HALF):
        bo = kb0 + offs_b
        b = tl.load(w_rows + bo[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        blk = row_blk + (2 * kb0) // BLOCKSIZE
        s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blk, nmask, NESTED, NESTED_BS)
        c_hi = tl.load(code_ptr + (b >> 4))
        c_lo = tl.load(code_ptr + (b & 15))
        xk = (2 * bo)[None, :, None] + pair[None, None, :]
        xx = tl.load(x_rows + xk * stride_xk, mask=mmask[:, None, None], other=0.0)
        x_even, x_odd = tl.split(xx)
        if SCALE_AFTER:
            # Few rows of x: scaling the (BLOCK_M, BLOCK_N) product is cheaper than the weight tile.
            w_hi = tl.trans(c_hi.to(DT))
            w_lo = tl.trans(c_lo.to(DT))
            if IEEE:
                t = tl.dot(x_even, w_hi, input_precision="ieee")
                t = tl.dot(x_odd, w_lo, t, input_precision="ieee")
            else:
                t = tl.dot(x_even, w_hi)
                t = tl.dot(x_odd, w_lo, t)
            acc += t * s[None, :]
        else:
            # Many rows: a second (BLOCK_M, BLOCK_N) accumulator would spill; scale the weights.
            w_hi = tl.trans((c_hi * s[:, None]).to(DT))
            w_lo = tl.trans((c_lo * s[:, None]).to(DT))
            if IEEE:
                acc = tl.dot(x_even, w_hi, acc, input_precision="ieee")
                acc = tl.dot(x_odd, w_lo, acc, input_precision="ieee")
            else:
                acc = tl.dot(x_even, w_hi, acc)
                acc = tl.dot(x_odd, w_lo, acc)
    store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, mmask, nmask, stride_ym, stride_yn, HAS_BIAS, ATOMIC)


@triton.jit
def _dequant_kernel(
    w_ptr, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff_ptr, out_ptr, byte0, count, row_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, BLOCK_BYTES: tl.constexpr, NESTED: tl.constexpr,
    TILE16: tl.constexpr,
):
    """``out[i] = code[nibble(e)] * absmax[e // BLOCKSIZE]`` with ``e = 2 * byte0 + i``, for ``i < count``.

    ``out`` is contiguous in x's dtype; a program decodes ``BLOCK_BYTES`` bytes of the nibble stream
    from ``byte0 + pid * BLOCK_BYTES`` (high nibble: element 2j, low: 2j + 1, one block for both).
    With ``TILE16`` the stream's byte (row n, byte kb of its ``row_bytes``) is read where the tile16
    layout keeps it (:mod:`qops.ops.blockwise4`).
    """
    local = tl.program_id(0) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bmask = 2 * local < count
    byte = byte0.to(tl.int64) + local
    addr = byte
    if TILE16:
        n = byte // row_bytes
        kb = byte % row_bytes
        addr = (n // 16) * (16 * row_bytes) + (kb // 64) * 1024 + (n % 16) * 64 + kb % 64
    b = tl.load(w_ptr + addr, mask=bmask, other=0, eviction_policy="evict_first").to(tl.int32)
    if NESTED:
        noff = tl.load(noff_ptr)
    else:
        noff = 0.0
    s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, (2 * byte) // BLOCKSIZE, bmask, NESTED, NESTED_BS)
    hi = tl.load(code_ptr + (b >> 4)) * s
    lo = tl.load(code_ptr + (b & 15)) * s
    v = tl.reshape(tl.join(hi, lo), (2 * BLOCK_BYTES,))
    offs = 2 * tl.program_id(0) * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=offs < count)


def gemv_step(step_bytes: int, blocks_per_step: int, half_block: int, row_bytes: int) -> int:
    """Bytes per row of one GEMV loop step: ``step_bytes`` (a power of two) capped at
    ``blocks_per_step`` blocks; past one block, a power-of-two count of whole blocks that divides the
    row, so that every step (and every split, a whole number of steps) ends on the row's last byte."""
    step = min(step_bytes, half_block * max(1, blocks_per_step))
    if step <= half_block:
        return step
    g = triton.next_power_of_2(step // half_block + 1) // 2  # the power of two at most step / half_block
    while g > 1 and row_bytes % (g * half_block):
        g //= 2
    return g * half_block


def plan(m: int, n: int, k: int, blocksize: int, device: torch.device, dtype: torch.dtype | None = None,
         dense: bool = False) -> dict:
    """Which path and launch parameters serve an (M, N, K, blocksize) problem with activations of
    ``dtype`` (default float16): static facts only. ``dense``: the dense path at every M."""
    sms = sm_count(device, INTERPRETER_SMS)
    row_bytes = k // 2
    half_block = blocksize // 2
    if not dense and m <= TABLE["gemv_fma_max_m"] and k % blocksize == 0 and dtype in (None, torch.float16, torch.bfloat16):
        cfg = TABLE["gemv_fma"]
        step = gemv_step(cfg["STEP_BYTES"], max(1, cfg["STEP_BYTES"] // half_block), half_block, row_bytes)
        # Up to four products a program: all of M's rows of x (M <= 4) with as many weight rows as fit.
        xrows = min(triton.next_power_of_2(m), 4)
        rows = max(1, min(cfg["ROWS"], 4 // xrows))
        if rows not in (1, 2, 4):
            raise ValueError(f"qops.triton_blockwise4: gemv_fma ROWS must be 1, 2 or 4, got {cfg['ROWS']}")
        tiles = triton.cdiv(m, xrows) * triton.cdiv(n, rows)
        split, per = split_k(row_bytes, step, tiles, cfg["programs_per_sm"] * sms, cfg["max_split"])
        return dict(path="gemv_fma", ROWS=rows, XROWS=xrows, STEP=step, split=split, split_bytes=per,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                    maxnreg={"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {},
                    grid=(triton.cdiv(m, xrows), triton.cdiv(n, rows), split))
    if not dense and m <= TABLE["gemv_max_m"] and k % blocksize == 0:
        cfg = TABLE["gemv"]
        step = gemv_step(cfg["STEP_BYTES"], cfg.get("blocks_per_step", 1), half_block, row_bytes)
        bn = pow2_at_most(n, cfg["BLOCK_N"])
        tiles = triton.cdiv(n, bn)
        split, per = split_k(row_bytes, step, tiles, cfg["programs_per_sm"] * sms, cfg["max_split"])
        # x's rows are the dot's N: 16 at least for the 16-bit tensor-core dot; fp32 x takes the FMA
        # dot (input_precision "ieee"), whose cost grows with the padded width, so no padding there.
        bm = triton.next_power_of_2(m) if dtype == torch.float32 else max(16, triton.next_power_of_2(m))
        return dict(path="gemv", BLOCK_M=bm, BLOCK_N=bn, STEP=step, SCALE_W=cfg.get("scale") == "weight", split=split,
                    split_bytes=per, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                    grid=(tiles, split))
    # K % blocksize != 0: blocks straddle rows, which only the dense path (flat stream) reads.
    if dense or m > TABLE["dense_above_m"] or k % blocksize:
        elt = (dtype or torch.float16).itemsize
        # Whole multiples of 8 rows: every slab starts on a byte of the nibble stream (n0 * K even)
        # and at a 16-byte aligned output column; at least 8 rows, at most N.
        rows = max(8, TABLE["slab_bytes"] // max(1, k * elt) // 8 * 8)
        cfg = TABLE["dense"]
        return dict(path="dense", slab=min(n, rows), DQ_BLOCK_BYTES=cfg["DQ_BLOCK_BYTES"],
                    num_warps=cfg["num_warps"], split=1)
    if m <= TABLE["gemv_slices_max_m"]:
        # gemv_max_m-row slices through the small-M kernel: measured on the H200 (85c0cb8), four
        # slices at M = 64 take 1/5-1/7 of the tl.dot GEMM's time and sixteen at M = 256 1/4-1/2 of
        # it (benchmarks/results/h200-2026-11-30-85c0cb8-bnb-int8.json); until the GEMM is rebuilt.
        return {**plan(TABLE["gemv_max_m"], n, k, blocksize, device, dtype), "path": "gemv_slices"}
    cfg = TABLE.gemm(m)
    bm = pow2_at_most(m, cfg["BLOCK_M"])
    bn = pow2_at_most(n, cfg["BLOCK_N"])
    bk = min(cfg["BLOCK_K"], blocksize)  # 32 <= bk, divides the block: one absmax per step
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, per = split_k(row_bytes, bk // 2, tiles, sms, TABLE["gemm_max_split"])
    return dict(path="gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split=split, split_bytes=per,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(tiles, split))


def triton_mm(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
              nested_blocksize, layout, out=None, workspace=None):
    """Lowering entry (contract of ``qops.ops.blockwise4.reference_mm``); any K (see :func:`plan`).

    The tile16 layout (built for the native kernel, which delegates the calls it does not serve
    here) takes the dense path at every M: only its dequantization kernel reads that byte order."""
    k = x.shape[-1]
    n = out_features
    x2 = rows_2d(x)
    m = x2.shape[0]
    y2 = output_2d(x2, n, out)
    if m == 0 or n == 0:
        return finish(y2, None, bias, x, n, out)
    if k == 0:
        y2.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(y2))
        return finish(y2, None, None, x, n, out)
    bias = unit_stride(bias)
    p = plan(m, n, k, blocksize, x.device, x.dtype, dense=layout != LAYOUT_FLAT)
    if p["path"] == "dense":
        _run_dense(p, x2, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, blocksize,
                   nested_blocksize, layout, y2, workspace)
        return finish(y2, None, None, x, n, out)
    if p["path"] == "gemv_slices":
        rows = TABLE["gemv_max_m"]
        for r0 in range(0, m, rows):
            triton_mm(x2[r0:r0 + rows], qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features,
                      blocksize, nested_blocksize, layout, out=y2[r0:r0 + rows], workspace=workspace)
        return finish(y2, None, None, x, n, out)
    nested = absmax.dtype == torch.uint8
    atomic = p["split"] > 1
    acc = fp32_scratch(workspace, (m, n), True, x.device) if atomic else None
    dst = acc if atomic else y2
    qweight = qweight.contiguous()
    absmax = absmax.contiguous()
    if nested:
        tables = (nested_code.contiguous(), nested_absmax.contiguous(), nested_offset)
    else:
        tables = (code, code, code)  # unused pointers
    common = (x2, qweight, code.contiguous(), absmax, *tables, bias if bias is not None else code, dst,
              m, n, k, x2.stride(0), x2.stride(1), dst.stride(0), dst.stride(1), p["split_bytes"])
    flags = dict(BLOCKSIZE=blocksize, NESTED_BS=nested_blocksize if nested else 1, NESTED=nested,
                 HAS_BIAS=bias is not None, ATOMIC=atomic, num_warps=p["num_warps"])
    if p["path"] == "gemv_fma":
        # x read as int32 pairs where every row it reads starts on 4 bytes and has unit K stride.
        pairs = x2.stride(1) == 1 and x2.data_ptr() % 4 == 0 and (m == 1 or x2.stride(0) % 2 == 0)
        _gemv_fma_kernel[p["grid"]](x2, qweight, code.contiguous(), absmax, *tables, bias if bias is not None else code,
                                    dst, m, n, k // 2, x2.stride(0), x2.stride(1), dst.stride(0),
                                    dst.stride(1), p["split_bytes"], ROWS=p["ROWS"], XROWS=p["XROWS"], STEP=p["STEP"],
                                    PRMT=not interpreted(), PAIRS=pairs, num_stages=p["num_stages"], **p["maxnreg"], **flags)
    elif p["path"] == "gemv":
        prmt = x.dtype != torch.float32 and not interpreted()
        _gemv_kernel[p["grid"]](x2, qweight, code.contiguous(), absmax, *tables, bias if bias is not None else code,
                                dst, m, n, k // 2, x2.stride(0), x2.stride(1), dst.stride(0), dst.stride(1),
                                p["split_bytes"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], STEP=p["STEP"],
                                SCALE_W=p["SCALE_W"], PRMT=prmt, num_stages=p["num_stages"], **flags)
    else:
        _gemm_kernel[p["grid"]](*common, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
                                GROUP_M=TABLE["GROUP_M"], IEEE=x.dtype == torch.float32,
                                SCALE_AFTER=p["BLOCK_M"] <= TABLE["scale_after_max_block_m"],
                                num_stages=p["num_stages"], **flags)
    return finish(y2, acc, bias, x, n, out)


def slab_buffer(workspace: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """The transient dense slab: a view of the caller's workspace (``common.workspace_view``) when it holds it,
    else a fresh tensor. The declared workspace need
    (``qops.workspace.SCRATCH_BYTES``) leaves the slab out: dense calls are prefill-sized, and a model
    workspace big enough for them would be held for every decode step."""
    return workspace_view(workspace, shape, dtype, device)


def _run_dense(p, x2, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, blocksize,
               nested_blocksize, layout, y2, workspace):
    """Dequantize N-slabs of W (rows = output features) into a transient buffer and multiply with cuBLAS."""
    m, k = x2.shape
    n = y2.shape[1]
    slab = p["slab"]
    nested = absmax.dtype == torch.uint8
    qweight, code, absmax = qweight.contiguous(), code.contiguous(), absmax.contiguous()
    if nested:
        tables = (nested_code.contiguous(), nested_absmax.contiguous(), nested_offset)
    else:
        tables = (code, code, code)  # unused pointers
    w = slab_buffer(workspace, (slab, k), x2.dtype, x2.device)
    b = bias.to(x2.dtype) if bias is not None and bias.dtype != x2.dtype else bias
    block = p["DQ_BLOCK_BYTES"]
    for n0 in range(0, n, slab):
        rows = min(slab, n - n0)
        count = rows * k
        # n0 is a multiple of 8: n0 * K is even, so the slab starts on byte n0 * K / 2.
        _dequant_kernel[(triton.cdiv(count, 2 * block),)](
            qweight, code, absmax, *tables, w, n0 * k // 2, count, k // 2,
            BLOCKSIZE=blocksize, NESTED_BS=nested_blocksize if nested else 1, BLOCK_BYTES=block, NESTED=nested,
            TILE16=layout != LAYOUT_FLAT, num_warps=p["num_warps"])
        wt = w[:rows].t()
        dst = y2[:, n0:n0 + rows]
        if b is not None:
            torch.addmm(b[n0:n0 + rows], x2, wt, out=dst)
        else:
            torch.mm(x2, wt, out=dst)
