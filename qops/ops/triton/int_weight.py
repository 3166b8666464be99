"""Triton lowering of ``qops::mm_int_weight``: integer weight-only matmul on CUDA.

Reads the runtime layout of :mod:`qops.ops.int_weight` (qweight ``(ceil(K*b/32), N)`` int32, a bit
stream along K with consecutive N contiguous, or the same words in 32-column slabs; scales
``(n_groups, N)``; qzeros ``(n_groups, ceil(N*b/32))`` a bit stream along N, or None for the
symmetric zero ``2**(b-1)``; act_perm ``(K,)``). Three ways to compute ``y = x[:, act_perm] @ W.T + bias``, chosen per call from the
number of rows M and the shipped config table (never from tensor values, never with a host sync):

- **decode** (M <= the table's ``decode_max_m``, per bit width where it says so): a split-K GEMV on CUDA cores. Each thread owns ``VEC``
  adjacent columns (16-byte loads along N, coalesced across the warp) and all K rows of its step, so
  the per-step reduction over K stays in registers. Values are turned into floats without an int ->
  float conversion instruction: a value masked *in place* and OR-ed into the mantissa of 2**23 is the
  float ``2**23 + q * 2**sh``; one FMA ``f * 2**-sh - (2**(23-sh) + z)`` then gives ``q - z``
  exactly, so a 4-bit value costs one LOP3, one FFMA to dequantize and one FFMA to accumulate (values
  reaching bit 23 are read from the word shifted right by 12: one shift per word). Scales multiply the
  per-step partial sums once per column, never per element. A config may ask (``prefetch``; 2, 4 and 8
  bits) for each step's words, zero points and scales to be loaded during the step before, taken where a
  program runs at least ``PREFETCH_MIN_STEPS`` steps (its extra first load is not hidden). x's values come
  as one vector load a run and word, split out in registers (``x_vec``, on unless a config says 0; 2, 4
  and 8 bits without act_perm): 4-5% at M = 1 on an H100 over one load a value. For 4-bit words and fp16
  x a config may ask (``half_dot``) for the packed fp16 dot (``common.half_dot_asm``: ``(q - z) / 16``
  in f16x2 pairs, four products a half summed in fp16, the halves in fp32; 2.6 instructions a value
  against 3.8); it pays only with the prefetch (alone ptxas issues each word's load just before its use),
  and a config pairing the two gets neither where the prefetch does not apply. The H100 table pairs them
  at M = 1 and 2: at M = 1 27.2 / 16.5 / 87.2 / 48.0 us against 29.0 / 16.5 / 100.6 / 49.5 on 28672x4096 /
  4096x14336 / 57344x8192 / 8192x28672 (``benchmarks/probe_triton_gemv.py``, stop 61). A decode entry may
  name a narrower form for short K (``short_split``: keys that replace its own where its split gives each
  program one split unit, a quantization group, because K is too short for the programs it asks for): on the
  H200 the M = 1 entry's 512 columns x 2 runs x 4 warps leave 4096x4096 256 programs of two steps; its
  ``short_split`` (256 x 4 x 2: 512 programs of one step) runs it in 7.32 us against 9.14 (6144x4096 8.36 /
  9.82, 4096x8192 9.76 / 10.72, 14336x4096 15.43 / 17.64), where on the longer-K shapes the wide form is as
  fast or faster (4096x14336 13.90 against 15.52).
- **gemm** (larger M): a tiled split-K GEMM on tensor cores. The packed ``(BLOCK_K/vpw, BLOCK_N)``
  word tile is dequantized in registers to ``q - z`` (exact in fp16 and bf16) and fed to ``tl.dot``
  with fp32 accumulation. For fp16/bf16 activations, whole words and a K tile inside one group (2
  and 4 bits; 8 bits in fp16) the values go straight into f16x2/bf16x2 pairs, K-adjacent as the
  operand wants them (``common.half_unpack_asm``: PRMT, LOP3 with the 1024.0 / 128.0 magic, packed
  FMA; 1.5 instructions per value at 4 bits, 1 at 8), as inline PTX on a GPU and as the same lanes
  in plain Triton under the interpreter (:func:`dequant_form`). A config may ask (``even_odd``) for a
  4-bit tile as its even and its odd K rows, multiplied as two dots with x's tile split alike: each
  half has the 8-bit tile's shape, whose unpack Triton 3.6 carries into the MMA operand's registers
  on sm_90 (the eight-value interleave goes through shared memory). Symmetric weights derive their
  constant zero point from the scales' load (``sym_zero_load``) where that keeps the unpack there too
  (:func:`sym_zero_load_applies`).
  Otherwise each value goes through
  the fp32 mantissa trick and is interleaved back into K order with ``tl.join``. When a K tile
  lies inside one quantization group the scale multiplies the tile's fp32 product (once per output
  element per tile) or, for tiles taller than half their depth or where a config asks (``scale_weight``),
  the half weight tile (once per weight pair); otherwise scales are applied per element before the dot.
  With an act_perm, x is gathered once a call (``x[:, act_perm]``, into the workspace ahead of the fp32 sums;
  :func:`gathers_x`): read through act_perm, a K tile's columns are scattered and load a value at a time.
- **wgmma** (a 4-bit GEMM bucket whose config holds a ``wgmma`` tile, on Hopper): the Gluon kernel of
  :mod:`.int_weight_wgmma` (the weight as the warpgroup MMA's register operand, asynchronous MMAs over a
  ``cp.async`` ring; x gathered once a call into the MMA's K order, in the caller's workspace), with the
  bucket's GEMM wherever that kernel refuses the weight (``int_weight_wgmma.shape_refusal``, when planned: bits,
  K or group off its K tile), the call is too small for it (too few output tiles for its K, or too short a K:
  the tile's ``min_tiles``, ``long_k_steps`` and ``min_k_steps``, measured per card) or the kernel refuses the
  call (``call_refusal``: dtype, another GPU, a Triton without Gluon); a tile's ``few_tiles`` (say a narrower
  BLOCK_N) is tried before a call of too few tiles goes to the GEMM. A tile's ``stream_k`` launches one wave of
  programs over the tiles' K steps laid end to end; with ``stream_k_min_waves`` it does so only where the call
  has that many waves of tiles.
- **dense** (the largest M, when the config says so): the weight is dequantized by a Triton kernel
  into a transient dense ``(K, N)`` buffer in N-slabs of bounded size and multiplied by cuBLAS; the
  dense weight never outlives the call. act_perm is applied by scattering rows, so x is not gathered.
  The config may ask for slabs of equal widths (``equal``) and for two slab buffers with slab i + 1
  dequantized on a side stream while cuBLAS multiplies slab i (``overlap``); the H200 table takes
  both with 128 MB buffers above M = 128 (``benchmarks/probe_dense.py``).

Split-K partial sums either go to an fp32 ``(S, M, N)`` buffer summed by a small reduce kernel
(no zeroing pass), or are added atomically into a zeroed fp32 ``(M, N)`` buffer; which one is a
config choice decided by the tuner. On sm_90+ the atomic one's reduction is launched as a programmatic
dependent of the split-K kernel (placed under that kernel's last programs, waiting for its completion
there; ``pdl_reduce`` in a config overrides: :func:`reduce_pdl`), and the split-K kernel is itself the
programmatic dependent of the kernel that zeroes its fp32 buffer, its adds waiting for the zeroing
(``pdl_zero`` 0 in a config: a ``zero_()`` before it; :func:`zero_pdl`). Configs come from
``configs/<gpu>.json`` (``default.json`` for an unknown GPU), loaded once (an entry's key outside
:data:`DECODE_KEYS` / :data:`GEMM_KEYS` is refused there, and by :func:`config_override`) and keyed by bits and
bucketed M; the split count follows from the device's SM count and the shape (the config's programs
per SM), lowered where the grid would end in a partial wave of the programs the build's registers
and shared memory let the GPU hold at once (``common.split_in_waves``; a config's ``maxnreg`` caps a
build's registers, so the GPU holds more of its programs, a tuner variant), and is one when
deterministic results are requested
(``qops.ops._common.deterministic_requested``, read at each call; the wgmma kernel's split launch keeps its
splits then, stored as partials that its reduction sums in split order). A GEMM config may ask for stream-K
instead (``stream_k``): one wave of programs, each a run of equal length over the tiles' K steps laid end
to end, adding into the atomic sum once per tile it touches (``common.stream_k_runs``), so no wave is
partial whatever the tile count; not under a deterministic request.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from .common import (EVEN_ODD_4, HALF_FORMATS, X_PAIRS_ASM, X_PAIRS_CONSTRAINTS, fp32_scratch, grouped_tile, half_dot_asm,
                     half_unpack_asm, interpreting, pick_bucket, reduce_sums, resident_programs, sm_count,
                     split_in_waves, split_k, stream_k_runs, zero_ahead)
from .._common import deterministic_requested, pdl_launch, unit_stride
from ..int_weight import qweight_columns, qweight_strides, qweight_word_rows
from . import int_weight_wgmma as wgmma
from .x_gather import gather_act_order, gather_scratch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = "default"
# fp32 bit pattern of 2**23: an integer q < 2**23 OR-ed into its mantissa reads as 2**23 + q.
MAGIC_ARG = 0x4B000000
TWO23 = tl.constexpr(8388608.0)


class Dequant:
    """How the tensor-core GEMM turns packed words into its weight tile (the ``DEQUANT`` constexpr).

    FP32: each value through the fp32 2**23 mantissa trick, then rounded to the activation dtype
    (any bits, any dtype). HALF_TRITON / HALF_ASM: pairs of values straight into f16x2 / bf16x2
    (``common.half_unpack_asm``), as plain Triton operations (the interpreter's form, also valid on
    a GPU) or as one inline-PTX block per word (1 to 1.5 instructions per value).
    """
    FP32 = 0
    HALF_TRITON = 1
    HALF_ASM = 2
    NAMES = {"fp32": FP32, "triton": HALF_TRITON, "asm": HALF_ASM}


def _asm(bits: int, half: str, order=None) -> tuple[tl.constexpr, tl.constexpr]:
    try:
        code, constraints = half_unpack_asm(bits, half, order)
    except ValueError:
        code, constraints = "", ""
    return tl.constexpr(code), tl.constexpr(constraints)


_F16_2, _F16_2C = _asm(2, "f16")
_F16_4, _F16_4C = _asm(4, "f16")
_F16_8, _F16_8C = _asm(8, "f16")
_BF16_2, _BF16_2C = _asm(2, "bf16")
_BF16_4, _BF16_4C = _asm(4, "bf16")
_F16_4EO, _F16_4EOC = _asm(4, "f16", EVEN_ODD_4)
_BF16_4EO, _BF16_4EOC = _asm(4, "bf16", EVEN_ODD_4)
_DOT, _DOTC = (tl.constexpr(t) for t in half_dot_asm())  # one word, finished in fp32
_DOT_FIRST, _DOT_FIRSTC = (tl.constexpr(t) for t in half_dot_asm(finish=False))  # the first of two: f16x2 sums
_DOT_LAST, _DOT_LASTC = (tl.constexpr(t) for t in half_dot_asm(carry_in=True))  # the second, onto them
_XPAIRS, _XPAIRSC = tl.constexpr(X_PAIRS_ASM), tl.constexpr(X_PAIRS_CONSTRAINTS)


class HalfDot:
    """How the decode GEMV forms a 4-bit word's products with fp16 x (the ``HALF_DOT`` constexpr).

    OFF: each value in fp32 (:func:`_value`, one LOP3 and two FFMAs a value). TRITON / ASM: the
    packed fp16 dot of ``common.half_dot_asm`` (values ``(q - z) / 16`` in f16x2, four products a half
    summed in fp16, eight with ``DOT_WORDS`` 2, the halves in fp32; 2.6 SASS instructions a value in the
    4-bit M = 1 loop against 3.8, 2.4 with ``DOT_WORDS`` 2 and the prefetch), as plain Triton under the
    interpreter (no inline PTX there; same values and pairs, its own rounding order) and as inline PTX
    on a GPU.
    """
    OFF = 0
    TRITON = 1
    ASM = 2


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Zero points of the columns ``offs_n`` in group ``g`` as fp32 (qzeros is a bit stream along N)."""
    if HAS_ZEROS:
        bit = offs_n * BITS
        word = bit // 32
        off = bit % 32
        row = qz_ptr + g * stride_qz
        lo = tl.load(row + word, mask=nmask, other=0).to(tl.uint32, bitcast=True)
        z = (lo >> off.to(tl.uint32)) & ((1 << BITS) - 1)
        if (32 % BITS) != 0:
            # 3-bit zeros may straddle two words; the second word is read only for those columns.
            spill = off > 32 - BITS
            hi = tl.load(row + word + 1, mask=nmask & spill, other=0).to(tl.uint32, bitcast=True)
            z = z | ((hi << ((32 - off) % 32).to(tl.uint32)) & ((1 << BITS) - 1))
        return z.to(tl.int32).to(tl.float32) + zero_offset
    else:
        return tl.full(offs_n.shape, 1 << (BITS - 1), tl.float32)


@triton.jit
def _high_word(w):
    """``w >> 12``, where :func:`_value` reads values whose bits reach bit 23 (the exponent): 2, 4 and
    8-bit ones then sit between bits 4 and 20, never at bit 0. (A shift then a mask from bit 0
    compiles to bfe, which sm_90 runs as two instructions, not fused with the magic's OR: the 4-bit
    GEMV's loop had 4.2 SASS instructions a value with ``w >> 16``, 4.0 with this.)"""
    return w >> 12


@triton.jit
def _value(w, w_hi, w_prev, zf, magic, I: tl.constexpr, BITS: tl.constexpr):
    """Value I (0..31) of a 32-value chunk as ``q - z`` in fp32, given the chunk's word J.

    ``w`` is the word holding the value's last bit, ``w_hi`` is :func:`_high_word` (for values whose bits
    reach the exponent, bit 23), ``w_prev`` the word before (for a 3-bit value straddling two words).
    ``magic`` is ``MAGIC_ARG`` passed at run time: held in a register, the mask and the OR fuse into one
    LOP3 (with two immediates ptxas emits two). Exact: every intermediate is an integer < 2**24.
    """
    OFF: tl.constexpr = (I * BITS) % 32
    MASK: tl.constexpr = (1 << BITS) - 1
    if OFF + BITS > 32:
        # Straddling 3-bit value: low bits at the top of the previous word, the rest at the bottom of w.
        LOW: tl.constexpr = 32 - OFF
        lo = (w_prev >> OFF) & ((1 << LOW) - 1)
        hi = (w << LOW) & MASK
        f = (lo | hi | magic).to(tl.float32, bitcast=True)
        return f - (TWO23 + zf)
    elif 32 % BITS != 0:
        # Shift, then mask (bfe: two instructions on sm_90). In place as below the 3-bit GEMV took 4.3
        # instructions a value against 5.6, but 168 registers against 128 (a constant per bit offset and
        # column): not measured on a GPU, not taken.
        f = (((w >> OFF) & MASK) | magic).to(tl.float32, bitcast=True)
        return f - (TWO23 + zf)
    elif OFF + BITS <= 23:
        # Masked in place: the float is 2**23 + q * 2**OFF; scaling by 2**-OFF is exact.
        f = ((w & (MASK << OFF)) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << OFF)) - (TWO23 / (1 << OFF) + zf)
    else:
        SH: tl.constexpr = OFF - 12  # _high_word's shift
        f = ((w_hi & (MASK << SH)) | magic).to(tl.float32, bitcast=True)
        return f * (1.0 / (1 << SH)) - (TWO23 / (1 << SH) + zf)


@triton.jit
def _store_rows(y_ptr, bias_ptr, acc, row, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn,
                HAS_BIAS: tl.constexpr, OUT_MODE: tl.constexpr):
    """Write one output row: OUT_MODE 0 final dtype (+bias), 1 fp32 partial of split pid_k, 2 atomic fp32."""
    # The row test is made a tensor: Triton's interpreter rejects a scalar comparison folded into a mask.
    rmask = nmask & (tl.full(offs_n.shape, row, tl.int32) < M)
    if OUT_MODE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=rmask)
    elif OUT_MODE == 1:
        tl.store(y_ptr + pid_k * stride_ys + row * stride_ym + offs_n * stride_yn, acc, mask=rmask)
    else:
        tl.atomic_add(y_ptr + row * stride_ym + offs_n * stride_yn, acc, mask=rmask, sem="relaxed")


@triton.jit
def _x_value(xrow_ptr, pk_ptr, I: tl.constexpr, stride_xk, kmask, HAS_PERM: tl.constexpr, MASKED: tl.constexpr):
    """fp32 x[row, k] for k = chunk start + I. ``pk_ptr`` points at the chunk starts (in x when
    there is no act_perm, in act_perm otherwise): the constant I folds into the load's offset."""
    if HAS_PERM:
        if MASKED:
            # Past K the padded weight rows hold -z, so x must read as 0 there, not as x[perm=0].
            kidx = tl.load(pk_ptr + I, mask=kmask, other=0)
            return tl.load(xrow_ptr + kidx * stride_xk, mask=kmask, other=0.0).to(tl.float32)
        else:
            kidx = tl.load(pk_ptr + I)
        return tl.load(xrow_ptr + kidx * stride_xk).to(tl.float32)
    elif MASKED:
        return tl.load(pk_ptr + I * stride_xk, mask=kmask, other=0.0).to(tl.float32)
    else:
        return tl.load(pk_ptr + I * stride_xk).to(tl.float32)


@triton.jit
def _word_columns(offs_n, stride_qslab, BLOCK_N: tl.constexpr):
    """Where columns ``offs_n`` (a run of BLOCK_N from a multiple of it) start in a qweight word row:
    ``(n // 32) * stride_qslab + n % 32`` serves both forms (flat: stride_qslab = 32, so n itself;
    column slabs: the slab's offset), contiguous in runs of 32 columns."""
    RUN: tl.constexpr = 32 if BLOCK_N > 32 else BLOCK_N
    qcol = (offs_n // 32) * stride_qslab + offs_n % 32
    return tl.max_contiguous(tl.multiple_of(qcol, RUN), RUN)


@triton.jit
def _step_words(qw_ptr, k0, qcol, nmask, n_wrows, stride_qw, BITS: tl.constexpr, CHUNKS: tl.constexpr,
                EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """The words of a GEMV step from K row ``k0``: ``(CHUNKS, BLOCK_N, BITS)`` int32, word j of run c at
    ``[c, :, j]`` (BITS a power of two). Past the last word row (K not a multiple of the step) the last
    row is read again rather than masked (a masked load zeroes its registers first, an instruction a
    word): any word dequantizes to a finite value, and the x it meets past K is 0."""
    wrow = (k0 // 32 + tl.arange(0, CHUNKS))[:, None, None] * BITS + tl.arange(0, BITS)[None, None, :]
    if not EVEN_K:
        wrow = tl.minimum(wrow, n_wrows - 1)
    ptrs = qw_ptr + wrow * stride_qw + qcol[None, :, None]
    if EVEN_N:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=nmask[None, :, None], other=0)


@triton.jit
def _last_of(t, I: tl.constexpr):
    """Element I of the last dimension of ``t`` ``(C, N, L)`` (L = 1, 2, 4 or 8, in each thread's
    registers), as ``(C, N)``: halving splits, no data moves."""
    C: tl.constexpr = t.shape[0]
    N: tl.constexpr = t.shape[1]
    L: tl.constexpr = t.shape[2]
    if L >= 2:
        lo, hi = tl.split(tl.reshape(t, (C, N, L // 2, 2)))
        t = hi if I % 2 == 1 else lo
    if L >= 4:
        lo, hi = tl.split(tl.reshape(t, (C, N, L // 4, 2)))
        t = hi if (I // 2) % 2 == 1 else lo
    if L >= 8:
        lo, hi = tl.split(tl.reshape(t, (C, N, L // 8, 2)))
        t = hi if (I // 4) % 2 == 1 else lo
    return tl.reshape(t, (C, N))


@triton.jit
def _x_word_run(pk_ptr, kbase, k_hi, stride_xk, I0: tl.constexpr, XV: tl.constexpr, EVEN_K: tl.constexpr):
    """x's values I0 .. I0 + XV - 1 of each run ``(CHUNKS, 1, XV)``: one vector load a run where x's K
    stride is 1 (a launch makes it the constant 1), XV scalar loads otherwise."""
    offs = I0 + tl.arange(0, XV)
    ptrs = pk_ptr[:, None, None] + offs[None, None, :] * stride_xk
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(kbase[:, None, None] + offs[None, None, :]) < k_hi, other=0.0)


@triton.jit
def _x_word(pk_ptr, kbase, k_hi, stride_xk, J: tl.constexpr, BITS: tl.constexpr, EVEN_K: tl.constexpr,
            XVEC: tl.constexpr):
    """With XVEC, the x values word J of each run multiplies (``32 // BITS`` of them) as one or two vector
    loads a run of at most 16 bytes, ``(CHUNKS, 1, XV)`` each (Triton moved a 32-byte run through shared
    memory, with two barriers a word). Without, nothing is loaded (``kbase`` twice, which :func:`_x_at`
    does not read)."""
    if XVEC:
        VPW: tl.constexpr = 32 // BITS
        XV: tl.constexpr = 8 if VPW > 8 else VPW
        xa = _x_word_run(pk_ptr, kbase, k_hi, stride_xk, J * VPW, XV, EVEN_K)
        if VPW > XV:
            xb = _x_word_run(pk_ptr, kbase, k_hi, stride_xk, J * VPW + XV, XV, EVEN_K)
        else:
            xb = xa
    else:
        xa = kbase
        xb = kbase
    return xa, xb


@triton.jit
def _x_at(x_ptr, pk_ptr, xa, xb, I: tl.constexpr, BITS: tl.constexpr, stride_xk, kmask, HAS_PERM: tl.constexpr,
          MASKED: tl.constexpr, XVEC: tl.constexpr):
    """fp32 x value I of each run of the step, ``(CHUNKS,)``: split out of the word's vectors ``xa`` / ``xb``
    (XVEC, :func:`_x_word`), else loaded by itself (:func:`_x_value`)."""
    if XVEC:
        XV: tl.constexpr = xa.shape[2]
        L: tl.constexpr = I % (32 // BITS)  # the value's place among its word's
        if L < XV:
            v = _last_of(xa, L)
        else:
            v = _last_of(xb, L - XV)
        return tl.reshape(v, (xa.shape[0],)).to(tl.float32)
    else:
        return _x_value(x_ptr, pk_ptr, I, stride_xk, kmask, HAS_PERM, MASKED)


@triton.jit
def _half_dot_value(w, zf, I: tl.constexpr):
    """Value I of each 4-bit word as ``(q - z) / 16`` in fp16 (exact), plain Triton."""
    q = ((w >> (4 * I)) & 15).to(tl.float32)
    return ((q - zf) * 0.0625).to(tl.float16)


@triton.jit
def _half_of(c, H: tl.constexpr):
    """Half H (0 low, 1 high) of the f16x2 values ``c`` held as int32, as fp16."""
    return ((c >> (16 * H)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _half_dot_row(w, zf, xa, carry, STAGE: tl.constexpr):
    """One row's packed dot in plain Triton, paired as ``common.half_dot_asm`` pairs it: the low half's
    four products (values 0..3) and the high half's (4..7) each summed in fp16 (onto the halves of
    ``carry`` at STAGE 2); then the two sums added in fp32 (STAGE 0, 2) or kept as f16x2 in an int32
    (STAGE 1, the carry of the next word). Each row computes the values again: the interpreter's form."""
    lo = (_last_of(xa, 0) * _half_dot_value(w, zf, 0) + _last_of(xa, 1) * _half_dot_value(w, zf, 1)
          + _last_of(xa, 2) * _half_dot_value(w, zf, 2) + _last_of(xa, 3) * _half_dot_value(w, zf, 3))
    hi = (_last_of(xa, 4) * _half_dot_value(w, zf, 4) + _last_of(xa, 5) * _half_dot_value(w, zf, 5)
          + _last_of(xa, 6) * _half_dot_value(w, zf, 6) + _last_of(xa, 7) * _half_dot_value(w, zf, 7))
    if STAGE == 2:
        lo = _half_of(carry, 0) + lo
        hi = _half_of(carry, 1) + hi
    if STAGE == 1:
        lo_bits = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi_bits = hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo_bits | (hi_bits << 16)
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _x_pairs(xa):
    """The f16x2 pairs ``(x0, x4), (x1, x5), (x2, x6), (x3, x7)`` of a word's eight fp16 x values ``xa``
    ``(C, 1, 8)``, each as the two halves ``(C, 1)`` of one register (a PRMT a pair, shared by the
    thread's columns)."""
    xp = tl.inline_asm_elementwise(_XPAIRS, _XPAIRSC, [xa], dtype=tl.float16, is_pure=True, pack=8)
    return (_last_of(xp, 0), _last_of(xp, 1), _last_of(xp, 2), _last_of(xp, 3), _last_of(xp, 4), _last_of(xp, 5),
            _last_of(xp, 6), _last_of(xp, 7))


@triton.jit
def _dot_row(w, zf, blo, bhi, xa, carry, FORM: tl.constexpr, STAGE: tl.constexpr):
    """One row's packed dot of each 4-bit word of ``w`` ``(C, N)`` with its eight x values ``xa``
    (``_x_word``): STAGE 0 one word (``sum_i x_i (q_i - z) / 16`` in fp32), 1 the first of two (f16x2
    sums out, as int32), 2 the second, onto ``carry`` (fp32 out). FORM (:class:`HalfDot`) 2:
    ``common.half_dot_asm`` as inline PTX (``blo`` / ``bhi`` its bias pairs; ptxas computes a word's pairs
    once for all rows), 1: the same in plain Triton from ``zf``."""
    if FORM == 1:
        return _half_dot_row(w, zf, xa, carry, STAGE)
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_pairs(xa)
    args = [w, blo, bhi, carry, a0, a1, a2, a3, a4, a5, a6, a7]
    if STAGE == 0:
        return tl.inline_asm_elementwise(_DOT, _DOTC, args, dtype=tl.float32, is_pure=True, pack=1)
    elif STAGE == 1:
        return tl.inline_asm_elementwise(_DOT_FIRST, _DOT_FIRSTC, args, dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_DOT_LAST, _DOT_LASTC, args, dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _half_dot(w, zf, blo, bhi, xa0, xa1, xa2, xa3, c0, c1, c2, c3, BLOCK_M: tl.constexpr, FORM: tl.constexpr,
              STAGE: tl.constexpr):
    """Rows m0 .. m0 + BLOCK_M - 1's :func:`_dot_row` (four results; those past BLOCK_M repeat the first):
    ``xaR`` row R's x values, ``cR`` its carry."""
    d0 = _dot_row(w, zf, blo, bhi, xa0, c0, FORM, STAGE)
    d1 = d0
    d2 = d0
    d3 = d0
    if BLOCK_M > 1:
        d1 = _dot_row(w, zf, blo, bhi, xa1, c1, FORM, STAGE)
    if BLOCK_M > 2:
        d2 = _dot_row(w, zf, blo, bhi, xa2, c2, FORM, STAGE)
    if BLOCK_M > 3:
        d3 = _dot_row(w, zf, blo, bhi, xa3, c3, FORM, STAGE)
    return d0, d1, d2, d3


@triton.jit
def _gemv_step(x0_ptr, x1_ptr, x2_ptr, x3_ptr, pk0, pk1, pk2, pk3, ws, w_ptrs, wrow, kbase, k_hi, zf, nmask, n_wrows,
               stride_qw, stride_xk, magic, BITS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               WORDS: tl.constexpr, XVEC: tl.constexpr, HALF_DOT: tl.constexpr, DOT_WORDS: tl.constexpr):
    """One step's per-run partial sums ``(CHUNKS, BLOCK_N)`` of rows m0 .. m0 + 3 (unscaled). WORDS: the
    words come loaded in ``ws`` (``_step_words``); otherwise each word row is loaded here from ``w_ptrs``
    (3-bit steps do not split evenly; and loading all of a step through ``_step_words`` without the
    prefetch cost 168 registers against 128 at 2 bits and 2050 instructions against 2036 at 4).
    XVEC (:func:`gemv_x_vec`): x's values a word multiplies are loaded as vectors, once a word, not one
    scalar load a value (4-bit M = 1: 149 loads a pass -> 37, 2036 instructions -> 1924).
    HALF_DOT (:class:`HalfDot`; 4 bits, fp16 x, XVEC): each word's products through the packed fp16 dot,
    sums of ``(q - z) / 16`` (the caller scales by 16); DOT_WORDS 2: two words' products a half summed
    in fp16 before the fp32 add (a run's 4 words pair up)."""
    blo = zf
    bhi = zf
    if HALF_DOT == 2:
        blo = _half_bias(zf * 0.0625, 64.0, 64.0, tl.float16)
        bhi = _half_bias(zf * 0.0625, 4.0, 4.0, tl.float16)
    p0 = tl.zeros([CHUNKS, BLOCK_N], tl.float32)
    p1 = tl.zeros([CHUNKS, BLOCK_N], tl.float32)
    p2 = tl.zeros([CHUNKS, BLOCK_N], tl.float32)
    p3 = tl.zeros([CHUNKS, BLOCK_N], tl.float32)
    w_prev = tl.zeros([CHUNKS, BLOCK_N], tl.int32)
    c0 = w_prev  # the packed dot's f16x2 carries from a word to the next (DOT_WORDS 2)
    c1 = w_prev
    c2 = w_prev
    c3 = w_prev
    for j in tl.static_range(BITS):
        if WORDS:
            w = _last_of(ws, j)  # word j of each run
        elif EVEN_K and EVEN_N:
            w = tl.load(w_ptrs + j * stride_qw)
        elif EVEN_K:
            w = tl.load(w_ptrs + j * stride_qw, mask=nmask[None, :], other=0)
        else:
            w = tl.load(w_ptrs + j * stride_qw, mask=((wrow + j) < n_wrows)[:, None] & nmask[None, :], other=0)
        w_hi = _high_word(w)
        xa0, xb0 = _x_word(pk0, kbase, k_hi, stride_xk, j, BITS, EVEN_K, XVEC)
        xa1 = xa0
        xa2 = xa0
        xa3 = xa0
        if BLOCK_M > 1:
            xa1, xb1 = _x_word(pk1, kbase, k_hi, stride_xk, j, BITS, EVEN_K, XVEC)
        if BLOCK_M > 2:
            xa2, xb2 = _x_word(pk2, kbase, k_hi, stride_xk, j, BITS, EVEN_K, XVEC)
        if BLOCK_M > 3:
            xa3, xb3 = _x_word(pk3, kbase, k_hi, stride_xk, j, BITS, EVEN_K, XVEC)
        if HALF_DOT != 0:
            # stage 0: one word; with DOT_WORDS 2, 1 on even words (f16x2 carries out), 2 on odd ones (onto them)
            d0, d1, d2, d3 = _half_dot(w, zf, blo, bhi, xa0, xa1, xa2, xa3, c0, c1, c2, c3, BLOCK_M, HALF_DOT,
                                       0 if DOT_WORDS == 1 else 1 + j % 2)
            if DOT_WORDS == 2 and j % 2 == 0:
                c0 = d0
                c1 = d1
                c2 = d2
                c3 = d3
            else:
                p0 += d0
                if BLOCK_M > 1:
                    p1 += d1
                if BLOCK_M > 2:
                    p2 += d2
                if BLOCK_M > 3:
                    p3 += d3
        else:
            for i in tl.static_range(32):
                # Value i starts in word (i*BITS)//32; one that straddles is finished with word j.
                first_word = (i * BITS) // 32
                straddles = (i * BITS) % 32 + BITS > 32
                if (first_word == j and not straddles) or (first_word + 1 == j and straddles):
                    v = _value(w, w_hi, w_prev, zf, magic, i, BITS)
                    kmask = (kbase + i) < k_hi
                    x0v = _x_at(x0_ptr, pk0, xa0, xb0, i, BITS, stride_xk, kmask, HAS_PERM, not EVEN_K, XVEC)
                    p0 += x0v[:, None] * v
                    if BLOCK_M > 1:
                        x1v = _x_at(x1_ptr, pk1, xa1, xb1, i, BITS, stride_xk, kmask, HAS_PERM, not EVEN_K, XVEC)
                        p1 += x1v[:, None] * v
                    if BLOCK_M > 2:
                        x2v = _x_at(x2_ptr, pk2, xa2, xb2, i, BITS, stride_xk, kmask, HAS_PERM, not EVEN_K, XVEC)
                        p2 += x2v[:, None] * v
                    if BLOCK_M > 3:
                        x3v = _x_at(x3_ptr, pk3, xa3, xb3, i, BITS, stride_xk, kmask, HAS_PERM, not EVEN_K, XVEC)
                        p3 += x3v[:, None] * v
        w_prev = w
    return p0, p1, p2, p3


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, K, n_wrows,
    stride_xm, stride_xk, stride_qw, stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn,
    split_len, group_size, zero_offset, magic,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, XVEC: tl.constexpr = False, HALF_DOT: tl.constexpr = 0, DOT_WORDS: tl.constexpr = 1,
    ZERO_WAIT: tl.constexpr = False,
):
    """Split-K GEMV for up to 4 rows. Program (n tile, K split, m tile); a step covers CHUNKS runs
    of 32 K values (BITS words each), all inside one quantization group. PDL: the reduction launched
    after it (a programmatic dependent) may be scheduled as soon as every program has started.
    PREFETCH (BITS a power of two): a step's words, zero points and scales are loaded during the step
    before, so a program's loads overlap its own arithmetic rather than only other programs'.
    XVEC (BITS a power of two, no act_perm): x loaded as vectors, once a word (``_gemv_step``).
    HALF_DOT (:class:`HalfDot`): 4-bit words times fp16 x as packed fp16 dots (``_gemv_step``; DOT_WORDS
    words a half-sum), whose sums are of ``(q - z) / 16``: the scales are taken times 16 (exact).
    ZERO_WAIT (OUT_MODE 2, launched as a programmatic dependent of ``common.zero_ahead``): the atomic
    adds wait for the fp32 sum's zeroing, which the program's loads and arithmetic overlap."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    nmask = offs_n < N
    qcol = _word_columns(offs_n, stride_qslab, BLOCK_N)
    chunk = tl.arange(0, CHUNKS)
    STEP: tl.constexpr = 32 * CHUNKS
    k_lo = pid_k * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    # Rows past M read row M-1 rather than being masked: their results are never stored.
    x0_ptr = x_ptr + tl.minimum(m0, M - 1) * stride_xm
    x1_ptr = x_ptr + tl.minimum(m0 + 1, M - 1) * stride_xm
    x2_ptr = x_ptr + tl.minimum(m0 + 2, M - 1) * stride_xm
    x3_ptr = x_ptr + tl.minimum(m0 + 3, M - 1) * stride_xm
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    if PREFETCH:
        # The step after the split's last reads the last again (in bounds, unused): splits are never
        # empty (K = 0 never launches), so k_last >= k_lo.
        k_last = k_lo + (k_hi - 1 - k_lo) // STEP * STEP
        g = k_lo // group_size
        ws_next = _step_words(qw_ptr, k_lo, qcol, nmask, n_wrows, stride_qw, BITS, CHUNKS, EVEN_K, EVEN_N)
        zf_next = _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)
        s_next = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0).to(tl.float32)
    for k0 in range(k_lo, k_hi, STEP):
        if PREFETCH:
            ws = ws_next
            zf = zf_next[None, :]
            s = s_next
            k_next = tl.minimum(k0 + STEP, k_last)
            g_next = k_next // group_size
            ws_next = _step_words(qw_ptr, k_next, qcol, nmask, n_wrows, stride_qw, BITS, CHUNKS, EVEN_K, EVEN_N)
            zf_next = _zero_points(qz_ptr, g_next, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)
            s_next = tl.load(s_ptr + g_next * stride_s + offs_n, mask=nmask, other=0.0).to(tl.float32)
        else:
            g = k0 // group_size
            zf = _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)[None, :]
            ws = zf  # unused: _gemv_step loads the words itself
        kbase = k0 + chunk * 32
        if HAS_PERM:
            pk0 = perm_ptr + kbase
            pk1 = pk0
            pk2 = pk0
            pk3 = pk0
        else:
            pk0 = x0_ptr + kbase * stride_xk
            pk1 = x1_ptr + kbase * stride_xk
            pk2 = x2_ptr + kbase * stride_xk
            pk3 = x3_ptr + kbase * stride_xk
        wrow = (k0 // 32 + chunk) * BITS
        w_ptrs = qw_ptr + wrow[:, None] * stride_qw + qcol[None, :]
        p0, p1, p2, p3 = _gemv_step(x0_ptr, x1_ptr, x2_ptr, x3_ptr, pk0, pk1, pk2, pk3, ws, w_ptrs, wrow, kbase, k_hi, zf,
                                    nmask, n_wrows, stride_qw, stride_xk, magic, BITS, BLOCK_M, CHUNKS, BLOCK_N,
                                    HAS_PERM, EVEN_K, EVEN_N, PREFETCH, XVEC, HALF_DOT, DOT_WORDS)
        if not PREFETCH:
            s = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0).to(tl.float32)
        if HALF_DOT != 0:
            s = s * 16.0
        acc0 += s * tl.sum(p0, axis=0)
        if BLOCK_M > 1:
            acc1 += s * tl.sum(p1, axis=0)
        if BLOCK_M > 2:
            acc2 += s * tl.sum(p2, axis=0)
        if BLOCK_M > 3:
            acc3 += s * tl.sum(p3, axis=0)
    if ZERO_WAIT:
        tl.extra.cuda.gdc_wait()
    _store_rows(y_ptr, bias_ptr, acc0, m0, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn, HAS_BIAS, OUT_MODE)
    if BLOCK_M > 1:
        _store_rows(y_ptr, bias_ptr, acc1, m0 + 1, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn, HAS_BIAS, OUT_MODE)
    if BLOCK_M > 2:
        _store_rows(y_ptr, bias_ptr, acc2, m0 + 2, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn, HAS_BIAS, OUT_MODE)
    if BLOCK_M > 3:
        _store_rows(y_ptr, bias_ptr, acc3, m0 + 3, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn, HAS_BIAS, OUT_MODE)


@triton.jit
def _interleave(v0, v1, v2, v3, v4, v5, v6, v7, VPW: tl.constexpr):
    """Stack per-value tiles ``(R, BN)`` (value t of each word) into K order ``(R * VPW, BN)``."""
    # Each join adds a trailing axis; the innermost join picks the lowest bit of t.
    if VPW == 2:
        t = tl.permute(tl.join(v0, v1), (0, 2, 1))
    elif VPW == 4:
        t = tl.permute(tl.join(tl.join(v0, v1), tl.join(v2, v3)), (0, 3, 2, 1))
    else:
        t = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
        t = tl.permute(t, (0, 4, 3, 2, 1))  # (R, BN, c, b, a) with t = c + 2b + 4a -> (R, a, b, c, BN)
    return tl.reshape(t, (v0.shape[0] * VPW, v0.shape[1]))


@triton.jit
def _half_bias(zf, LO: tl.constexpr, HI: tl.constexpr, DTYPE: tl.constexpr):
    """The packed pair ``(-(LO + z), -(HI + z))`` (low half first) per column, as int32, for the
    PTX unpack; every value is an exact small integer in DTYPE."""
    if DTYPE == tl.float16:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,r,r", [-(zf + HI), -(zf + LO)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,r,r", [-(zf + HI), -(zf + LO)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half_value(w, zf, POS: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """The value at bit POS of each word as ``q - z`` in DTYPE, computed as one half of the PTX pair
    of ``common.half_unpack_asm`` (same byte, in-place offset, magic and FMA)."""
    if DTYPE == tl.float16:
        MANT: tl.constexpr = 10
        MAGIC: tl.constexpr = 0x6400
        MAGIC_F: tl.constexpr = 1024.0
    else:
        MANT: tl.constexpr = 7
        MAGIC: tl.constexpr = 0x4300
        MAGIC_F: tl.constexpr = 128.0
    SHIFT: tl.constexpr = BITS * ((POS % 8 + BITS) > MANT)
    S: tl.constexpr = POS % 8 - SHIFT
    BYTE: tl.constexpr = (POS - SHIFT) // 8
    byte = ((w >> SHIFT) >> (8 * BYTE)) & 0xFF
    h = ((byte & (((1 << BITS) - 1) << S)) | MAGIC).to(tl.int16).to(DTYPE, bitcast=True)
    return h * (1.0 / (1 << S)) + (-(zf + MAGIC_F / (1 << S))).to(DTYPE)


@triton.jit
def _half_pair(w, zf, I: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """Values ``2I`` and ``2I + 1`` of each word (plain Triton: the interpreter's form)."""
    return _half_value(w, zf, 2 * I * BITS, BITS, DTYPE), _half_value(w, zf, (2 * I + 1) * BITS, BITS, DTYPE)


@triton.jit
def _half_tile(w, zf, BITS: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The ``(BLOCK_K, BN)`` tile ``q - z`` in DTYPE (fp16 or bf16) of the word tile ``w`` ``(R, BN)``
    (BITS 2, 4 or 8; not 8 with bf16). ``zf`` ``(1, BN)`` fp32 zero points."""
    if BITS == 4:
        if ASM:
            if DTYPE == tl.float16:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _F16_4, _F16_4C, [w, _half_bias(zf, 1024.0, 64.0, DTYPE)], dtype=(tl.float16,) * 8,
                    is_pure=True, pack=1)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _BF16_4, _BF16_4C, [w, _half_bias(zf, 128.0, 128.0, DTYPE)], dtype=(tl.bfloat16,) * 8,
                    is_pure=True, pack=1)
        else:
            v0, v1 = _half_pair(w, zf, 0, BITS, DTYPE)
            v2, v3 = _half_pair(w, zf, 1, BITS, DTYPE)
            v4, v5 = _half_pair(w, zf, 2, BITS, DTYPE)
            v6, v7 = _half_pair(w, zf, 3, BITS, DTYPE)
        return _interleave(v0, v1, v2, v3, v4, v5, v6, v7, 8)
    elif BITS == 8:
        if ASM:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(
                _F16_8, _F16_8C, [w, _half_bias(zf, 1024.0, 1024.0, DTYPE)], dtype=(tl.float16,) * 4,
                is_pure=True, pack=1)
        else:
            v0, v1 = _half_pair(w, zf, 0, BITS, DTYPE)
            v2, v3 = _half_pair(w, zf, 1, BITS, DTYPE)
        return _interleave(v0, v1, v2, v3, v0, v0, v0, v0, 4)
    else:
        if ASM:
            if DTYPE == tl.float16:
                v0, v1, v2, v3, v4, v5, v6, v7, u0, u1, u2, u3, u4, u5, u6, u7 = tl.inline_asm_elementwise(
                    _F16_2, _F16_2C, [w, _half_bias(zf, 1024.0, 256.0, DTYPE), _half_bias(zf, 64.0, 16.0, DTYPE)],
                    dtype=(tl.float16,) * 16, is_pure=True, pack=1)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7, u0, u1, u2, u3, u4, u5, u6, u7 = tl.inline_asm_elementwise(
                    _BF16_2, _BF16_2C, [w, _half_bias(zf, 128.0, 32.0, DTYPE), _half_bias(zf, 8.0, 8.0, DTYPE)],
                    dtype=(tl.bfloat16,) * 16, is_pure=True, pack=1)
        else:
            v0, v1 = _half_pair(w, zf, 0, BITS, DTYPE)
            v2, v3 = _half_pair(w, zf, 1, BITS, DTYPE)
            v4, v5 = _half_pair(w, zf, 2, BITS, DTYPE)
            v6, v7 = _half_pair(w, zf, 3, BITS, DTYPE)
            u0, u1 = _half_pair(w, zf, 4, BITS, DTYPE)
            u2, u3 = _half_pair(w, zf, 5, BITS, DTYPE)
            u4, u5 = _half_pair(w, zf, 6, BITS, DTYPE)
            u6, u7 = _half_pair(w, zf, 7, BITS, DTYPE)
        R: tl.constexpr = BLOCK_K // 16
        lo = tl.reshape(_interleave(v0, v1, v2, v3, v4, v5, v6, v7, 8), (R, 8, w.shape[1]))
        hi = tl.reshape(_interleave(u0, u1, u2, u3, u4, u5, u6, u7, 8), (R, 8, w.shape[1]))
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 3, 1, 2)), (BLOCK_K, w.shape[1]))


@triton.jit
def _word_tile(qw_ptr, k0, qcol, nmask, n_wrows, stride_qw, BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The ``(BLOCK_K * BITS / 32, BN)`` words holding K rows ``k0 ..`` of columns ``qcol`` (BITS divides 32)."""
    R: tl.constexpr = BLOCK_K * BITS // 32
    wrow = (k0 * BITS) // 32 + tl.arange(0, R)
    ptrs = qw_ptr + wrow[:, None] * stride_qw + qcol[None, :]
    if EVEN_K:
        return tl.load(ptrs, mask=nmask[None, :], other=0)
    else:
        return tl.load(ptrs, mask=(wrow < n_wrows)[:, None] & nmask[None, :], other=0)


@triton.jit
def _half_tiles_even_odd(w, zf, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The 4-bit word tile ``w`` ``(R, BN)`` as two ``(4R, BN)`` tiles ``q - z`` in DTYPE: its even and
    its odd K rows (row ``4r + t`` of each holds value ``2t``, resp. ``2t + 1``, of word ``r``: K row
    ``8r + 2t`` or ``8r + 2t + 1``). Each is the shape of the 8-bit tile (four values a word, two joins
    deep), whose chain Triton carries into the MMA operand's registers; the 4-bit tile's eight-value
    interleave went through shared memory instead. ``zf`` ``(1, BN)`` fp32 zero points."""
    if ASM:
        if DTYPE == tl.float16:
            e0, e1, e2, e3, o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _F16_4EO, _F16_4EOC, [w, _half_bias(zf, 1024.0, 1024.0, DTYPE), _half_bias(zf, 64.0, 64.0, DTYPE)],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            e0, e1, e2, e3, o0, o1, o2, o3 = tl.inline_asm_elementwise(
                _BF16_4EO, _BF16_4EOC, [w, _half_bias(zf, 128.0, 128.0, DTYPE)], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
    else:
        e0 = _half_value(w, zf, 0, 4, DTYPE)
        e1 = _half_value(w, zf, 8, 4, DTYPE)
        e2 = _half_value(w, zf, 16, 4, DTYPE)
        e3 = _half_value(w, zf, 24, 4, DTYPE)
        o0 = _half_value(w, zf, 4, 4, DTYPE)
        o1 = _half_value(w, zf, 12, 4, DTYPE)
        o2 = _half_value(w, zf, 20, 4, DTYPE)
        o3 = _half_value(w, zf, 28, 4, DTYPE)
    return _interleave(e0, e1, e2, e3, e0, e0, e0, e0, 4), _interleave(o0, o1, o2, o3, o0, o0, o0, o0, 4)


@triton.jit
def _tc_weight_tile(
    qw_ptr, s_ptr, qz_ptr, k0, k_hi, offs_n, qcol, nmask, n_wrows, stride_qw, stride_s, stride_qz,
    group_size, zero_offset, zf_tile, magic,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
    TILE_GROUP: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr, DEQUANT: tl.constexpr = 0,
):
    """The ``(BLOCK_K, BN)`` weight tile in K order: ``q - z`` when TILE_GROUP (the caller scales the
    product), else ``s * (q - z)`` with each row's own group. ``DEQUANT`` (a :class:`Dequant`) only
    matters for whole words in one group (the host picks FP32 where the half forms do not apply)."""
    if 32 % BITS == 0 and TILE_GROUP:
        VPW: tl.constexpr = 32 // BITS
        R: tl.constexpr = BLOCK_K // VPW
        w = _word_tile(qw_ptr, k0, qcol, nmask, n_wrows, stride_qw, BITS, BLOCK_K, EVEN_K)
        if DEQUANT != 0:
            return _half_tile(w, zf_tile, BITS, BLOCK_K, DTYPE, DEQUANT == 2)
        else:
            w_hi = _high_word(w)
            v0 = _value(w, w_hi, w, zf_tile, magic, 0, BITS).to(DTYPE)
            v1 = _value(w, w_hi, w, zf_tile, magic, 1, BITS).to(DTYPE)
            if VPW > 2:
                v2 = _value(w, w_hi, w, zf_tile, magic, 2, BITS).to(DTYPE)
                v3 = _value(w, w_hi, w, zf_tile, magic, 3, BITS).to(DTYPE)
            else:
                v2 = v0
                v3 = v0
            if VPW > 4:
                v4 = _value(w, w_hi, w, zf_tile, magic, 4, BITS).to(DTYPE)
                v5 = _value(w, w_hi, w, zf_tile, magic, 5, BITS).to(DTYPE)
                v6 = _value(w, w_hi, w, zf_tile, magic, 6, BITS).to(DTYPE)
                v7 = _value(w, w_hi, w, zf_tile, magic, 7, BITS).to(DTYPE)
            else:
                v4 = v0
                v5 = v0
                v6 = v0
                v7 = v0
            if VPW <= 8:
                return _interleave(v0, v1, v2, v3, v4, v5, v6, v7, VPW)
            else:
                # 2-bit: 16 values per word, interleaved as two halves of 8 (values t and t + 8).
                u0 = _value(w, w_hi, w, zf_tile, magic, 8, BITS).to(DTYPE)
                u1 = _value(w, w_hi, w, zf_tile, magic, 9, BITS).to(DTYPE)
                u2 = _value(w, w_hi, w, zf_tile, magic, 10, BITS).to(DTYPE)
                u3 = _value(w, w_hi, w, zf_tile, magic, 11, BITS).to(DTYPE)
                u4 = _value(w, w_hi, w, zf_tile, magic, 12, BITS).to(DTYPE)
                u5 = _value(w, w_hi, w, zf_tile, magic, 13, BITS).to(DTYPE)
                u6 = _value(w, w_hi, w, zf_tile, magic, 14, BITS).to(DTYPE)
                u7 = _value(w, w_hi, w, zf_tile, magic, 15, BITS).to(DTYPE)
                lo = tl.reshape(_interleave(v0, v1, v2, v3, v4, v5, v6, v7, 8), (R, 8, v0.shape[1]))
                hi = tl.reshape(_interleave(u0, u1, u2, u3, u4, u5, u6, u7, 8), (R, 8, v0.shape[1]))
                t = tl.permute(tl.join(lo, hi), (0, 3, 1, 2))  # (R, 2, 8, BN): value t = 8 * half + e
                return tl.reshape(t, (BLOCK_K, v0.shape[1]))
    else:
        # Generic gather unpack (3-bit streams, groups that split a word): each row reads the one
        # or two words holding its value. Slower, and correct for any bits and group size.
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_hi
        bit = offs_k * BITS
        word = bit // 32
        off = (bit % 32).to(tl.uint32)
        lo = tl.load(qw_ptr + word[:, None] * stride_qw + qcol[None, :], mask=kmask[:, None] & nmask[None, :], other=0)
        q = (lo.to(tl.uint32, bitcast=True) >> off[:, None]) & ((1 << BITS) - 1)
        if 32 % BITS != 0:
            spill = (kmask & (off > 32 - BITS)) & ((word + 1) < n_wrows)
            hi = tl.load(qw_ptr + (word + 1)[:, None] * stride_qw + qcol[None, :], mask=spill[:, None] & nmask[None, :], other=0)
            q = q | ((hi.to(tl.uint32, bitcast=True) << ((32 - off) % 32)[:, None]) & ((1 << BITS) - 1))
        f = (q.to(tl.int32, bitcast=True) | magic).to(tl.float32, bitcast=True) - TWO23
        if TILE_GROUP:
            return (f - zf_tile).to(DTYPE)
        else:
            g = offs_k // group_size
            rmask = kmask[:, None] & nmask[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :], mask=rmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zbit = offs_n * BITS
                zword = zbit // 32
                zoff = (zbit % 32).to(tl.uint32)
                zlo = tl.load(qz_ptr + g[:, None] * stride_qz + zword[None, :], mask=rmask, other=0).to(tl.uint32, bitcast=True)
                z = (zlo >> zoff[None, :]) & ((1 << BITS) - 1)
                if 32 % BITS != 0:
                    zspill = rmask & (zoff > 32 - BITS)[None, :]
                    zhi = tl.load(qz_ptr + g[:, None] * stride_qz + zword[None, :] + 1, mask=zspill, other=0).to(tl.uint32, bitcast=True)
                    z = z | ((zhi << ((32 - zoff) % 32)[None, :]) & ((1 << BITS) - 1))
                zf = z.to(tl.int32).to(tl.float32) + zero_offset
            else:
                zf = (1 << (BITS - 1)) * 1.0
            return (s * (f - zf)).to(DTYPE)


@triton.jit
def _tc_tile(
    x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, n_wrows, stride_xm, stride_xk, stride_qw, stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn,
    group_size, zero_offset, magic, tile, pid_k, k_lo, k_hi,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    TILE_GROUP: tl.constexpr, OUT_MODE: tl.constexpr, EVEN_K: tl.constexpr, DEQUANT: tl.constexpr,
    PREFETCH_S: tl.constexpr, EVEN_ODD: tl.constexpr, SYM_ZERO_LOAD: tl.constexpr, ZERO_WAIT: tl.constexpr,
    SCALE_W: tl.constexpr,
):
    """Output tile ``tile`` (in :func:`grouped_tile`'s order) over K rows ``k_lo .. k_hi`` (``k_lo`` a multiple
    of BLOCK_K): written (OUT_MODE 0), stored as partial ``pid_k`` (1) or added into the fp32 sum (2)."""
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    nmask = offs_n < N
    qcol = _word_columns(offs_n, stride_qslab, BLOCK_N)
    mmask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # The group of the K tile, carried through the loop (a K tile never spans two groups): a
    # division by the run-time group size per tile cost ~40 instructions, 0.3 per weight at BLOCK_M 16.
    g = k_lo // group_size
    left = group_size - (k_lo - g * group_size)
    if TILE_GROUP and PREFETCH_S:
        s_ahead = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_hi
        if HAS_PERM:
            kidx = tl.load(perm_ptr + kk, mask=kmask, other=0)
        else:
            kidx = kk
        a_ptrs = x_ptr + offs_m[:, None] * stride_xm + kidx[None, :] * stride_xk
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if TILE_GROUP:
            left -= BLOCK_K
            g_next = tl.where(left == 0, g + 1, g)
            if PREFETCH_S:
                s = s_ahead
                # The last step loads its own group again (never read): g_next may lie past the scales there.
                g_ahead = tl.where(k0 + BLOCK_K < k_hi, g_next, g)
                s_ahead = tl.load(s_ptr + g_ahead * stride_s + offs_n, mask=nmask, other=0.0)
            if SYM_ZERO_LOAD:
                if not PREFETCH_S:
                    s = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0)
                zf = (s.to(tl.float32) * 0.0 + (1 << (BITS - 1)))[None, :]
            else:
                zf = _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)[None, :]
            if EVEN_ODD:
                w = _word_tile(qw_ptr, k0, qcol, nmask, n_wrows, stride_qw, BITS, BLOCK_K, EVEN_K)
                b_even, b_odd = _half_tiles_even_odd(w, zf, DTYPE, DEQUANT == 2)
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            else:
                b = _tc_weight_tile(qw_ptr, s_ptr, qz_ptr, k0, k_hi, offs_n, qcol, nmask, n_wrows, stride_qw, stride_s, stride_qz,
                                    group_size, zero_offset, zf, magic, BITS, BLOCK_K, HAS_ZEROS, TILE_GROUP, EVEN_K, DTYPE,
                                    DEQUANT)
            if not (PREFETCH_S or SYM_ZERO_LOAD):  # those loaded it above
                s = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0)
            if DEQUANT != 0 and (SCALE_W or 2 * BLOCK_M > BLOCK_K):
                # Scaling the product costs BLOCK_M / BLOCK_K instructions per weight, the half tile
                # 1/2 (a packed multiply per pair): cheaper for tall tiles. SCALE_W asks for it at any
                # height: the dots then chain into one accumulator (no second fp32 tile of registers,
                # no multiply-add after each K tile's MMAs have finished). s * (q - z) is then
                # rounded to the activation dtype, as a dequantized weight would be: once where the
                # scales are stored in it, twice where they are not (the scale itself first).
                if EVEN_ODD:
                    acc = tl.dot(a_odd, b_odd * s.to(DTYPE)[None, :], tl.dot(a_even, b_even * s.to(DTYPE)[None, :], acc))
                else:
                    acc = tl.dot(a, b * s.to(DTYPE)[None, :], acc)
            else:
                # "ieee": fp32 activations (interpreter tests) are not rounded to tf32; fp16/bf16 are unaffected.
                if EVEN_ODD:
                    acc += tl.dot(a_odd, b_odd, tl.dot(a_even, b_even)) * s.to(tl.float32)[None, :]
                else:
                    acc += tl.dot(a, b, input_precision="ieee") * s.to(tl.float32)[None, :]
            g = g_next
            left = tl.where(left == 0, group_size, left)
        else:
            b = _tc_weight_tile(qw_ptr, s_ptr, qz_ptr, k0, k_hi, offs_n, qcol, nmask, n_wrows, stride_qw, stride_s, stride_qz,
                                group_size, zero_offset, 0.0, magic, BITS, BLOCK_K, HAS_ZEROS, TILE_GROUP, EVEN_K, DTYPE)
            acc = tl.dot(a, b, acc, input_precision="ieee")
    rmask = mmask[:, None] & nmask[None, :]
    if OUT_MODE == 0:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask)
    elif OUT_MODE == 1:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc, mask=rmask)
    else:
        if ZERO_WAIT:
            tl.extra.cuda.gdc_wait()
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.atomic_add(y_ptrs, acc, mask=rmask, sem="relaxed")


@triton.jit
def _tc_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, K, n_wrows,
    stride_xm, stride_xk, stride_qw, stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn,
    split_len, group_size, zero_offset, magic,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    TILE_GROUP: tl.constexpr, OUT_MODE: tl.constexpr, EVEN_K: tl.constexpr, DEQUANT: tl.constexpr = 0,
    PREFETCH_S: tl.constexpr = False, EVEN_ODD: tl.constexpr = False, SYM_ZERO_LOAD: tl.constexpr = False,
    PDL: tl.constexpr = False, ZERO_WAIT: tl.constexpr = False, STREAM_K: tl.constexpr = False,
    SCALE_W: tl.constexpr = False,
):
    """Split-K tiled GEMM on tensor cores: program (m/n tile, K split). PREFETCH_S loads the next K tile's
    scales one iteration ahead: Triton's pipeliner does not take that load (a few bytes a thread, under
    cp.async's 4), so each step otherwise waits for it where the scales are used. EVEN_ODD (4 bits, a
    half form, the K tile in one group) multiplies the even and the odd K rows as two dots
    (:func:`_half_tiles_even_odd`; x's tile split the same way), the sum unchanged. SYM_ZERO_LOAD (no
    zero points) derives the constant zero point from the group's scales (loaded first) as ``s * 0 + 2**(b-1)``: built
    from a load, it is placed like loaded zero points, and Triton 3.6 then carries the half unpack into
    the MMA operand's registers, which it does not do from a constant (sm_90 SASS: the tile goes through
    shared memory; the 8-bit 16 x 128 x 128 GEMM ran 183 us symmetric, 59 us asymmetric on an H100; with
    it, 60 us). A non-finite scale gives a non-finite zero point, where its column's output is non-finite anyway.
    PDL, ZERO_WAIT: as the GEMV's (the reduction after it may be scheduled once every program has started;
    the atomic adds wait for the zeroing launched before it). STREAM_K (OUT_MODE 2): the grid is one program
    per run of ``split_len / BLOCK_K`` K steps of the tiles' steps laid end to end (tile by tile, K inner):
    a program adds one partial sum per tile its run touches, so every program does the same work whatever
    the tile count, where a split count leaves a partial last wave. SCALE_W (a half form, the K tile in one
    group) scales the weight tile, not the product, at any tile height (:func:`scale_weight_applies`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if STREAM_K:
        k_steps = tl.cdiv(K, BLOCK_K)
        run = split_len // BLOCK_K
        it = tl.program_id(0) * run
        end = tl.minimum(tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) * k_steps, it + run)
        while it < end:
            tile = it // k_steps
            first = it - tile * k_steps
            last = tl.minimum(k_steps, first + (end - it))
            _tc_tile(x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr, M, N, n_wrows, stride_xm, stride_xk,
                     stride_qw, stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn, group_size,
                     zero_offset, magic, tile, 0, first * BLOCK_K, tl.minimum(K, last * BLOCK_K),
                     BITS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, HAS_ZEROS, HAS_PERM, HAS_BIAS, TILE_GROUP, OUT_MODE,
                     EVEN_K, DEQUANT, PREFETCH_S, EVEN_ODD, SYM_ZERO_LOAD, ZERO_WAIT, SCALE_W)
            it += last - first
    else:
        pid_k = tl.program_id(1)
        k_lo = pid_k * split_len
        _tc_tile(x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr, M, N, n_wrows, stride_xm, stride_xk, stride_qw,
                 stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn, group_size, zero_offset, magic,
                 tl.program_id(0), pid_k, k_lo, tl.minimum(K, k_lo + split_len),
                 BITS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, HAS_ZEROS, HAS_PERM, HAS_BIAS, TILE_GROUP, OUT_MODE, EVEN_K,
                 DEQUANT, PREFETCH_S, EVEN_ODD, SYM_ZERO_LOAD, ZERO_WAIT, SCALE_W)


@triton.jit
def _dequant_kernel(
    qw_ptr, s_ptr, qz_ptr, perm_ptr, w_ptr,
    K, N, n0, slab, n_wrows, stride_qw, stride_qslab, stride_s, stride_qz,
    group_size, zero_offset, magic,
    BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, TILE_GROUP: tl.constexpr,
):
    """Dense slab of ``W.T``: ``w[perm[k], n - n0] = s * (q - z)`` for columns ``[n0, n0 + slab)``.

    ``w`` is ``(K, slab)`` contiguous. Rows go to their checkpoint position (act_perm is scattered
    here, so x needs no gather).
    """
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = n0 + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    nmask = offs_n < tl.minimum(N, n0 + slab)
    qcol = _word_columns(offs_n, stride_qslab, BLOCK_N)
    if TILE_GROUP:
        g = k0 // group_size
        zf = _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)[None, :]
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0).to(tl.float32)
        w_tile = _tc_weight_tile(qw_ptr, s_ptr, qz_ptr, k0, K, offs_n, qcol, nmask, n_wrows, stride_qw, stride_s, stride_qz,
                                 group_size, zero_offset, zf, magic, BITS, BLOCK_K, HAS_ZEROS, True, False,
                                 tl.float32) * s[None, :]
    else:
        w_tile = _tc_weight_tile(qw_ptr, s_ptr, qz_ptr, k0, K, offs_n, qcol, nmask, n_wrows, stride_qw, stride_s, stride_qz,
                                 group_size, zero_offset, 0.0, magic, BITS, BLOCK_K, HAS_ZEROS, False, False,
                                 tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    if HAS_PERM:
        rows = tl.load(perm_ptr + offs_k, mask=kmask, other=0)
    else:
        rows = offs_k
    tl.store(w_ptr + rows[:, None] * slab + (offs_n - n0)[None, :], w_tile.to(w_ptr.dtype.element_ty),
             mask=kmask[:, None] & nmask[None, :])


# --------------------------------------------------------------------------------------------
# Configs: shipped JSON tables keyed by GPU, bits and bucketed M
# --------------------------------------------------------------------------------------------

_OVERRIDE: dict | None = None


def gpu_key(name: str) -> str:
    """Config file stem for a device name: 'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100'."""
    words = name.lower().replace("nvidia", " ").split()
    return words[0].split("-")[0] if words else DEFAULT_CONFIG


def config_stems() -> list[str]:
    """The stems of the shipped config tables (``configs/<stem>.json``), ``default`` among them."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.json"))


# The keys each kind of table entry is read for (by the planner and the launchers): decode entries, GEMM entries and
# the ``dense`` defaults merged into a dense GEMM entry. A table's misspelt knob, or one of the other kind of entry
# (its wgmma tile's too), is refused when the table is loaded, not silently ignored at each call.
_LAUNCH_KEYS = frozenset({"BLOCK_N", "num_warps", "num_stages", "maxnreg", "ctas_per_sm", "max_split", "reduce",
                          "pdl_reduce", "pdl_zero"})
DECODE_KEYS = _LAUNCH_KEYS | {"CHUNKS", "prefetch", "half_dot", "x_vec", "short_split"}
DENSE_KEYS = frozenset({"impl", "ctas_per_sm", "DQ_BLOCK_K", "DQ_BLOCK_N", "DQ_WARPS", "slab_bytes", "equal", "overlap"})
GEMM_KEYS = _LAUNCH_KEYS | DENSE_KEYS | {"BLOCK_M", "BLOCK_K", "GROUP_M", "stream_k", "prefetch_scales", "even_odd",
                                        "scale_weight", "sym_zero_load", "wgmma"}


def entry_key_refusal(table: dict) -> str | None:
    """Where ``table`` has an entry with a key it is not read for -- a decode entry (or its ``short_split``)
    outside :data:`DECODE_KEYS`, a GEMM entry outside :data:`GEMM_KEYS` (its ``wgmma`` tile, and that tile's
    ``few_tiles``, outside ``int_weight_wgmma.TILE_KEYS``), the ``dense`` defaults outside :data:`DENSE_KEYS` -- or
    an entry that is not a mapping, which key and where; None where it has none."""
    known = {"decode": DECODE_KEYS, "gemm": GEMM_KEYS}
    checks = [(f"{sect}[{bits!r}][{bucket!r}]", entry, known[sect]) for sect in ("decode", "gemm")
              for bits, section in table.get(sect, {}).items() for bucket, entry in section.items()]
    checks.append(("dense", table.get("dense", {}), DENSE_KEYS))
    nested = [(f"{where}[{key!r}]", entry[key], keys) for where, entry, _ in checks if isinstance(entry, dict)
              for key, keys in (("short_split", DECODE_KEYS - {"short_split"}), ("wgmma", wgmma.TILE_KEYS)) if key in entry]
    nested += [(f"{where}['few_tiles']", entry["few_tiles"], wgmma.TILE_KEYS - {"few_tiles"}) for where, entry, _ in nested
               if isinstance(entry, dict) and "few_tiles" in entry]
    for where, entry, keys in checks + nested:
        if not isinstance(entry, dict):
            return f"{where}: expected a mapping of keys, got {type(entry).__name__}"
        if unknown := sorted(set(entry) - keys):
            return f"{where}: unknown keys {unknown} (known: {sorted(keys)})"
    return None


@functools.cache
def load_config(stem: str) -> dict:
    """The table in ``configs/<stem>.json``, or ``default.json`` when there is none for this GPU."""
    path = CONFIG_DIR / f"{stem}.json"
    if not path.exists():
        path = CONFIG_DIR / f"{DEFAULT_CONFIG}.json"
    with open(path) as f:
        table = json.load(f)
    for key in ("decode_max_m", "decode", "gemm"):
        if key not in table:
            raise ValueError(f"qops triton config {path}: missing key {key!r}")
    if isinstance(table["decode_max_m"], dict) and "default" not in table["decode_max_m"]:
        raise ValueError(f"qops triton config {path}: decode_max_m by bits needs a 'default' entry")
    if refusal := entry_key_refusal(table):
        raise ValueError(f"qops triton config {path}: {refusal}")
    return table


def decode_max_m(table: dict, bits: int) -> int:
    """The most rows ``table`` runs on the decode GEMV for ``bits``-bit weights: one number for every
    width, or one per width (``{"4": 4, "8": 2, "default": 4}``: where the GEMM overtakes the GEMV
    depends on the bytes a value, so the tuner decides it per width)."""
    rows = table["decode_max_m"]
    if isinstance(rows, dict):
        rows = rows.get(str(bits), rows["default"])
    return int(rows)


@functools.cache
def _device_facts(device: torch.device) -> tuple[str, int]:
    """(config stem, SM count) of a device; looked up once per device. Under Triton's interpreter (CPU
    tensors in tests): the generic table and a small pretend SM count."""
    stem = gpu_key(torch.cuda.get_device_properties(device).name) if device.type == "cuda" else DEFAULT_CONFIG
    return stem, sm_count(device, 4)


def config_for(device: torch.device) -> dict:
    if _OVERRIDE is not None:
        return _OVERRIDE
    return load_config(_device_facts(device)[0])


@contextlib.contextmanager
def config_override(table: dict):
    """Use ``table`` (same schema as the JSON files) instead of the shipped configs, e.g. to force a
    path in tests or to time candidate configs in the tuner."""
    if refusal := entry_key_refusal(table):
        raise ValueError(f"config_override: {refusal}")
    global _OVERRIDE
    previous = _OVERRIDE
    _OVERRIDE = table
    _shape_plan.cache_clear()
    try:
        yield
    finally:
        _OVERRIDE = previous
        _shape_plan.cache_clear()


# A forced weight-tile form for every GEMM call ("fp32", "triton" or "asm"), for A/B timing and
# tests; QOPS_TRITON_DEQUANT sets it for a whole process.
_DEQUANT_FORCE: str | None = os.environ.get("QOPS_TRITON_DEQUANT") or None


@contextlib.contextmanager
def dequant_override(name: str | None):
    """Use the weight-tile form ``name`` (a key of ``Dequant.NAMES``, or None for the automatic
    choice) wherever it applies in this block; where it does not, FP32 is used as always."""
    global _DEQUANT_FORCE
    if name is not None and name not in Dequant.NAMES:
        raise ValueError(f"unknown dequant form {name!r}; known: {sorted(Dequant.NAMES)}")
    previous, _DEQUANT_FORCE = _DEQUANT_FORCE, name
    try:
        yield
    finally:
        _DEQUANT_FORCE = previous


def dequant_form(dtype: torch.dtype, bits: int, tile_group: bool) -> int:
    """The ``Dequant`` form of the GEMM's weight tile: pairs straight into fp16/bf16 wherever the
    format holds the values in place (2, 4, 8 bits in fp16; 2, 4 bits in bf16) and the K tile lies
    in one group, as inline PTX on a GPU and as plain Triton under the interpreter (no inline asm
    there); FP32 otherwise (fp32 activations, 3 bits, 8 bits in bf16, per-element scales)."""
    half = {torch.float16: "f16", torch.bfloat16: "bf16"}.get(dtype)
    if half is None or not tile_group or 16 % bits or bits > HALF_FORMATS[half][0]:
        return Dequant.FP32
    if _DEQUANT_FORCE is not None:
        forced = Dequant.NAMES[_DEQUANT_FORCE]
        if forced != Dequant.HALF_ASM or not interpreting():
            return forced
    return Dequant.HALF_TRITON if interpreting() else Dequant.HALF_ASM


def even_odd_applies(cfg: dict, bits: int, dequant: int) -> bool:
    """Whether a GEMM call runs the even / odd K split (``_tc_kernel``'s EVEN_ODD): asked by its config
    (``even_odd``) and possible: 4 bits through a half form (fp16 / bf16, the K tile in one group)."""
    return bool(cfg.get("even_odd", 0)) and bits == 4 and dequant != Dequant.FP32


# Steps a GEMV program must run for the prefetch to pay: it loads one step more than it uses, at its start,
# with nothing to hide that latency behind. On an H100 (stop 61, 4-bit M = 1, the prefetch with the packed
# fp16 dot against neither): 2 steps a program (4096x14336) 4-10% slower, 4 / 7 / 16 steps (28672x4096 /
# 8192x28672 / 57344x8192) 0-6% / 0-4% / 7-14% faster.
PREFETCH_MIN_STEPS = 4


def gemv_steps(plan: dict) -> int:
    """Steps (``CHUNKS`` runs of 32 K rows) a decode plan's programs run, before the launch fits the split to
    whole waves (which only lowers the split count, so programs only get longer)."""
    return -(-plan["split_len"] // (32 * plan["chunks"]))


def gemv_prefetch_applies(cfg: dict, bits: int, steps: int) -> bool:
    """Whether a decode config's GEMV loads each step's words a step ahead (``prefetch`` in the config):
    for bit widths whose words split evenly per run (2, 4, 8; 3-bit values straddle words), where a
    program runs at least ``PREFETCH_MIN_STEPS`` steps."""
    return bool(cfg.get("prefetch", 0)) and bits in (2, 4, 8) and steps >= PREFETCH_MIN_STEPS


def gemv_x_vec(cfg: dict, bits: int, has_perm: bool) -> bool:
    """Whether the GEMV loads x as vectors, once a word (``XVEC``): by default wherever it can -- BITS a
    power of two (3-bit values straddle words) and no act_perm (x is gathered through it); a config's
    ``x_vec`` 0 turns it off. x's K stride need not be 1 (then the loads are scalar). Measured on an H100
    (stop 60, 4-bit M = 1, the shipped config): 4.0-5.5% faster on the four large shapes."""
    return bool(cfg.get("x_vec", 1)) and bits in (2, 4, 8) and not has_perm


def gemv_half_dot(cfg: dict, bits: int, dtype: torch.dtype, x_vec: bool, prefetch: bool) -> int:
    """The decode GEMV's :class:`HalfDot` form: the packed fp16 dot where a config asks for it
    (``half_dot`` 1, or 2 for two words a half-sum: ``DOT_WORDS``) and it applies -- 4-bit words, fp16 x, x loaded as vectors (``x_vec``) -- as
    inline PTX on a GPU and as plain Triton under the interpreter; OFF otherwise (bf16's 8-bit
    significand would round each product to 2**-9, and fp32 x gains nothing). A config pairing it with
    the prefetch gets neither where the prefetch does not apply (``prefetch``: whether it does): alone,
    ptxas issues each word's load ~60 instructions before its use (the fp32 form's: ~280), and on an
    H100 it ran 21-24% slower than the fp32 form at M = 1 (with the prefetch: 4% slower to 14% faster)."""
    if int(cfg.get("half_dot", 0)) not in (0, 1, 2):
        raise ValueError(f"qops triton config: half_dot must be 0, 1 or 2 (words a half-sum), got {cfg['half_dot']!r}")
    if not (cfg.get("half_dot", 0) and bits == 4 and dtype == torch.float16 and x_vec):
        return HalfDot.OFF
    if cfg.get("prefetch", 0) and not prefetch:
        return HalfDot.OFF
    return HalfDot.TRITON if interpreting() else HalfDot.ASM


def scale_weight_applies(cfg: dict, dequant: int) -> bool:
    """Whether a GEMM call scales the half weight tile by its group's scales before the MMA (``_tc_kernel``'s
    SCALE_W) where the tile's height alone would scale the fp32 product after it (``2 * BLOCK_M <= BLOCK_K``):
    asked by its config (``scale_weight``) and possible (a half form, so the K tile lies in one group).
    Compiled for sm_90 by Triton 3.6, the 4-bit 64 x 64 x 128 tile (warpgroup MMAs) then needs 128
    registers, not 167, and its K loop 344 instructions, not 370 (64 x 128 x 128: 167, not 255): the MMAs
    accumulate into the one fp32 tile instead of a fresh one that FFMAs add to it once they have finished.
    On an H100 the 64 x 128 x 128 tile with it (and stream-K) ran M = 64 1.19-1.31x faster than the table's
    64 x 64 x 128 entry on the four large shapes, 1.03-1.20x faster than the same tile scaling the product
    (stop 64, ``benchmarks/results/h100-2026-12-06-8d9a75a-probe-m64.json``); at M = 16 and 32 it was
    slower (more instructions a value where the product costs 1/8 or 1/4 of an FFMA a weight)."""
    return bool(cfg.get("scale_weight", 0)) and dequant != Dequant.FP32


def sym_zero_load_applies(cfg: dict, bits: int, dequant: int, symmetric: bool) -> bool:
    """Whether a GEMM call on symmetric weights derives the zero point from the scales' load
    (``_tc_kernel``'s SYM_ZERO_LOAD): as its config says (``sym_zero_load``), else where it keeps the half
    unpack in the MMA operand's registers, which Triton 3.6 does not do from a constant: 8-bit and
    ``even_odd`` 4-bit tiles under 64 rows (sm_90, 28672x4096 on an H100: 8 bits 2.6-3.1x faster, 4-bit even /
    odd 38-62 us against 159-261). Elsewhere the tile goes through shared memory either way (the 4-bit
    eight-value interleave; wgmma, which reads its weight operand there, from 64 rows) and the constant
    is as fast or faster (4-bit 64 x 128 x 128: 84-87 us against 95-96)."""
    if not symmetric:
        return False
    if "sym_zero_load" in cfg:
        return bool(cfg["sym_zero_load"])
    half = dequant != Dequant.FP32  # the fp32 unpack (fp32 or 8-bit bf16 activations) was not measured with it
    return half and int(cfg["BLOCK_M"]) < 64 and (bits == 8 or even_odd_applies(cfg, bits, dequant))


def _bucket(section: dict, bits: int, m: int) -> dict:
    """The entry for ``bits`` (or "default") whose M bucket is the smallest >= m (else the largest)."""
    by_m = section.get(str(bits), section.get("default"))
    if by_m is None:
        raise KeyError(f"qops triton config: no entry for bits={bits} and no 'default' in {sorted(section)}")
    return pick_bucket([(b, by_m[str(b)]) for b in sorted(int(b) for b in by_m)], m)[1]


# --------------------------------------------------------------------------------------------
# Launch plans: everything decided from shapes and the config, cached per shape
# --------------------------------------------------------------------------------------------


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _split(k: int, unit: int, tiles: int, cfg: dict, sms: int) -> tuple[int, int]:
    """(split count, K length per split): enough programs to fill ``ctas_per_sm`` waves of SMs,
    each split a whole number of ``unit`` K rows (a step, a tile or a quantization group)."""
    return split_k(k, unit, tiles, int(cfg.get("ctas_per_sm", 2)) * sms, int(cfg.get("max_split", 64)))


def _plan(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device, force: str | None = None) -> dict:
    """The launch plan of an (M, N, K) call: cached per shape and per state of the deterministic
    request (read here, at each call), so a request made after a shape's first call still gets
    one K split."""
    return _shape_plan(m, n, k, bits, group_size, device, force, deterministic_requested())


@functools.lru_cache(maxsize=4096)
def _shape_plan(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device, force: str | None,
                deterministic: bool) -> dict:
    # ``deterministic`` is part of the cache key (split_k reads the same request itself) and keeps stream-K off.
    table = config_for(device)
    sms = table.get("num_sms") or _device_facts(device)[1]
    grouped = group_size != -1
    path = force
    if path is None:
        decode_ok = not grouped or group_size % 32 == 0
        path = "decode" if (m <= decode_max_m(table, bits) and decode_ok) else "gemm"
    if path == "decode":
        if grouped and group_size % 32:
            raise ValueError(f"decode path needs group_size % 32 == 0, got {group_size}")
        cfg = _bucket(table["decode"], bits, m)
        plan = _decode_plan(cfg, m, n, k, group_size, sms)
        if "short_split" in cfg and plan["split_len"] <= plan["split_unit"]:
            short = {key: v for key, v in cfg.items() if key != "short_split"}
            plan = _decode_plan({**short, **cfg["short_split"]}, m, n, k, group_size, sms)
        return plan
    cfg = _bucket(table["gemm"], bits, m)
    if path == "dense" or (path in ("gemm", "wgmma") and cfg.get("impl", "triton") == "dense"):
        cfg = cfg if "DQ_BLOCK_K" in cfg else {**table.get("dense", {}), **cfg}
        bk = int(cfg.get("DQ_BLOCK_K", 64))
        tile_group = not grouped or group_size % bk == 0
        elt = 2
        # Slabs of whole 64-column blocks bound the transient dense weight to about slab_bytes.
        slab = max(64, min(n, int(cfg.get("slab_bytes", 128 << 20)) // max(1, k * elt)))
        if cfg.get("equal", 0):
            # As many slabs, all of one width: no narrow last slab whose GEMM fills few SMs.
            slab = -(-n // -(-n // slab))
        slab = min(n, -(-slab // 64) * 64)
        return dict(path="dense", cfg=cfg, dq_block_k=bk, dq_block_n=int(cfg.get("DQ_BLOCK_N", 128)),
                    dq_warps=int(cfg.get("DQ_WARPS", 4)), tile_group=tile_group, slab=slab)
    bm, bn, bk = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"])
    # The word unpack takes K tiles of 16 word rows or more where the group allows (the tuned
    # tiles); a smaller group shrinks the tile to it, down to what the dot (16 rows) and whole words
    # need: 4 word rows at 4 bits g32, 8 at 2 bits g128. Below that, each element is scaled before
    # the dot (the per-element gather: a 16-word-row minimum sent 2-bit g128 there, 1066 us for
    # 28672x4096 at M = 16 on an H100, 27x the 4-bit g128 tile; 4-bit g32 / g64 took it too).
    vpw = 32 // bits if 32 % bits == 0 else 1
    min_bk = max(16, vpw)
    bk = max(bk, 16 * vpw if 32 % bits == 0 else 16)
    tile_group = True
    if grouped and group_size % bk:
        # Shrink the K tile to a power of two dividing the group; otherwise scale each element
        # before the dot.
        fit = _pow2_divisor(group_size, bk)
        if fit >= min_bk:
            bk = fit
        else:
            # Per-element scaling: the K tile only needs the dot's minimum of 16 rows. Keeping the
            # wide tile of the word unpack here asked for 598 KB of shared memory at 2 bits, g32
            # (seen on the H200).
            tile_group = False
            bk = max(16, fit)
    tiles = -(-m // bm) * -(-n // bn)
    split, split_len = _split(k, bk, tiles, cfg, sms)
    # Stream-K wherever a tile has several K steps, also with one split (the M = 64 tiles: 448 on 264 slots),
    # not under a deterministic request (its runs meet through atomic adds).
    stream = bool(cfg.get("stream_k", 0)) and not deterministic and k > bk
    gemm = dict(
        path="gemm", cfg=cfg, split=split, split_len=split_len, split_unit=bk, tiles=tiles, sms=sms,
        block_m=bm, block_n=bn, block_k=bk,
        tile_group=tile_group, even_k=(k % bk == 0), grid=(tiles, split),
        reduce=cfg.get("reduce", "partials"), stream_k=stream,
    )
    if force in (None, "wgmma") and "wgmma" in cfg:  # force "gemm": the Triton GEMM itself
        # K splits meet through atomic adds (their order varies): under a deterministic request a split launch
        # (a stream-K tile's too, under its stream_k_min_waves) stores its splits as partials instead, which
        # its reduction sums in split order, keeping its splits (one split: 32 programs at 4096x14336 M = 4);
        # stream-K's shared tiles are summed in a fixed order: it stays
        tile = cfg["wgmma"]
        launch = wgmma.plan(m, n, k, bits, group_size, tile, sms)
        if deterministic and launch is not None and not launch["stream_k"] and launch["split"] > 1:
            launch = wgmma.plan(m, n, k, bits, group_size, {**tile, "reduce": "partials"}, sms)
        if launch is not None:
            return dict(path="wgmma", cfg=cfg, launch=launch, fallback=gemm)
    return gemm


def _decode_plan(cfg: dict, m: int, n: int, k: int, group_size: int, sms: int) -> dict:
    """The decode GEMV's launch plan under one config: its column tiles, its K steps (``CHUNKS`` runs of 32
    rows, fewer where a group is shorter) and the K split that fills the config's waves."""
    block_n = int(cfg["BLOCK_N"])
    chunks = int(cfg["CHUNKS"])
    grouped = group_size != -1
    if grouped:
        chunks = _pow2_divisor(group_size // 32, chunks)
    step = 32 * chunks
    block_m = min(m, 4)
    tiles = -(-n // block_n) * -(-m // block_m)
    unit = group_size if grouped else step
    split, split_len = _split(k, unit, tiles, cfg, sms)
    return dict(
        path="decode", cfg=cfg, split=split, split_len=split_len, split_unit=unit, tiles=tiles, sms=sms,
        block_m=block_m, block_n=block_n,
        chunks=chunks, even_k=(k % step == 0), even_n=(n % block_n == 0),
        grid=(-(-n // block_n), split, -(-m // block_m)), reduce=cfg.get("reduce", "partials"), stream_k=False,
    )


def workspace_bytes(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device,
                    act_order: bool = False) -> int:
    """Scratch bytes ``triton_mm`` uses for these sizes (fp32 split-K partials; with ``act_order``, x gathered
    for the GEMM, :func:`gathers_x`, sized for fp32 x); 0 when none."""
    plan = _plan(m, n, k, bits, group_size, device)
    if plan["path"] == "wgmma":
        fallback = _gemm_workspace_bytes(plan["fallback"], m, n, k, act_order)
        return max(wgmma.workspace_bytes(m, n, k, plan["launch"], act_order), fallback)
    return _gemm_workspace_bytes(plan, m, n, k, act_order)


def _gemm_workspace_bytes(plan: dict, m: int, n: int, k: int, act_order: bool) -> int:
    if plan["path"] == "dense":
        return 0
    # the split launch's partials ((S, M, N) or one (M, N) sum); stream-K, where asked, may take one sum instead
    rows = 0 if plan["split"] == 1 else plan["split"] if plan["reduce"] == "partials" else 1
    gathered = sum(gather_scratch(m, k, 4, True)) if act_order and gathers_x(plan) else 0  # sized for fp32 x
    return gathered + 4 * max(rows, int(plan["stream_k"])) * m * n


def gathers_x(plan: dict) -> bool:
    """Whether a call of this plan with an act_perm gathers x once (``x[:, act_perm]`` into the workspace, ahead
    of the fp32 sums) rather than reading it through act_perm in the kernel. The GEMM does: its K tile's x
    columns are scattered, so it loads them one element at a time, BLOCK_M x BLOCK_K loads a step; at M = 16 on an
    H100 (4096x14336, W4 g128) that took 59.1 us against 20.5 without act-order (stop 73, ``probe_wgmma_w4
    --act-order``), gathered first 23.4 us against 20.3 (``h100-2026-12-07-565aae4-actorder.json``; the gather's
    routes: ``x_gather``). The decode GEMV reads at most a few rows of x and keeps the in-kernel gather."""
    return plan["path"] == "gemm"



# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def triton_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=None, workspace=None, *, force_path=None):
    """``y = x[..., act_perm] @ W.T + bias`` for the runtime integer layout (the lowering entry).

    Arguments are already validated (``qops.ops.int_weight.check_mm_int_weight``). Returns a fresh
    ``(..., N)`` tensor of x's dtype, or writes ``out`` and returns it. No host synchronisation;
    no autotuning: the launch plan comes from the shipped config table. ``force_path`` ("decode",
    "gemm", "dense", "wgmma" where the bucket names that kernel) overrides the table's choice (tests, tuner);
    "gemm" is the Triton GEMM even where the bucket names the wgmma kernel.
    """
    k = x.shape[-1]
    n = qweight_columns(qweight)
    lead = x.shape[:-1]
    m = math.prod(lead)
    if out is None:
        out = torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    qweight, scales, qzeros, act_perm, bias = (unit_stride(t) for t in (qweight, scales, qzeros, act_perm, bias))
    x2 = x.reshape(m, k)
    direct = out.is_contiguous()
    o2 = out.view(m, n) if direct else torch.empty((m, n), dtype=x.dtype, device=x.device)
    plan = _plan(m, n, k, bits, group_size, x.device, force_path)
    if plan["path"] == "wgmma" and wgmma.call_refusal(x2) is not None:  # the shape was checked by the plan
        plan = plan["fallback"]
    if plan["path"] == "wgmma":
        _run_wgmma(plan, x2, qweight, scales, qzeros, act_perm, bias, group_size, zero_offset, o2, workspace)
    elif plan["path"] == "dense":
        _run_dense(plan, x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2)
    else:
        _run_split_k(plan, x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2, workspace)
    if not direct:
        out.copy_(o2.view(out.shape))
    return out


@dataclasses.dataclass
class _SplitLaunch:
    """One launch of the split-K kernel: its build, grid and output mode, the K length its ``split_len``
    argument carries, the partial sums its reduction adds (0: none, the output written directly) and the
    rounds of K steps the busiest program slot runs (None without a build figure: the interpreter)."""
    kernel: object
    constexprs: dict
    launch: dict
    grid: tuple
    mode: int
    split_len: int
    parts: int
    pdl: bool
    zero_wait: bool
    per_sm: int | None
    rounds: int | None


# Stream-K replaces the split count's launch only where it takes this many times fewer rounds (H100, stop 63,
# W4 g128: at 1.16-1.32x fewer 1.03-1.12x faster; at 1.0-1.03x 4-9% slower, its programs' extra tile starts).
STREAM_K_GAIN = 1.1


def _split_launch(plan, tensors: tuple, split: int, split_len: int, mode: int, stream_k: bool = False) -> _SplitLaunch:
    """The launch of ``split`` K splits of ``split_len`` rows writing OUT_MODE ``mode``, with its PDL options
    (``stream_k``: the STREAM_K build, its grid and run length still to be set)."""
    x2, _, _, qzeros, act_perm, bias, bits = tensors[:7]
    pdl = mode != 0 and reduce_pdl(plan["cfg"], x2.device, atomic=mode == 2)
    zero_wait = mode == 2 and zero_pdl(plan["cfg"], x2.device)
    kernel, constexprs, launch = _split_k_build(plan, mode, x2.dtype, bits, qzeros, act_perm, bias, pdl, zero_wait, stream_k)
    stages, per_sm = _build_facts(kernel, constexprs, launch, plan, tensors, mode)
    grid = plan["grid"][:1] + (split,) + plan["grid"][2:]
    rounds = None
    if per_sm:
        rounds = -(-plan["tiles"] * split // (per_sm * plan["sms"])) * -(-split_len // plan["split_unit"])
    return _SplitLaunch(kernel, constexprs, dict(launch, num_stages=stages), grid, mode, split_len,
                        split if mode == 1 else int(mode == 2), pdl, zero_wait, per_sm, rounds)


def _fitted_split_launch(plan, tensors: tuple) -> _SplitLaunch:
    """The plan's split count as launched: lowered where its grid would end in a partial wave of the programs
    the build lets the GPU hold (one split: the build writing the output itself)."""
    split, split_len = plan["split"], plan["split_len"]
    go = _split_launch(plan, tensors, split, split_len, 0 if split == 1 else 2 if plan["reduce"] == "atomic" else 1)
    if split > 1 and go.per_sm:
        # The plan's split count asks for a number of programs; the build's registers and shared
        # memory say how many the GPU holds at once, and a grid a little past that runs a second wave.
        k = tensors[0].shape[1]
        fitted, fitted_len = split_in_waves(k, plan["split_unit"], plan["tiles"], split, go.per_sm * plan["sms"])
        if (fitted, fitted_len) != (split, split_len):
            go = _split_launch(plan, tensors, fitted, fitted_len, go.mode if fitted > 1 else 0)
    return go


def _stream_k_launch(plan, tensors: tuple) -> _SplitLaunch:
    """The stream-K launch: one wave of the programs the STREAM_K build lets the GPU hold (the config's
    programs an SM where no build figure exists: the interpreter), each one run of K steps."""
    go = _split_launch(plan, tensors, 1, plan["split_len"], 2, stream_k=True)
    slots = (go.per_sm or int(plan["cfg"].get("ctas_per_sm", 2))) * plan["sms"]
    programs, run = stream_k_runs(tensors[0].shape[1], plan["split_unit"], plan["tiles"], slots)
    return dataclasses.replace(go, grid=(programs,), split_len=run, rounds=run // plan["split_unit"] if go.per_sm else None)


def _chosen_launch(plan, tensors: tuple) -> _SplitLaunch:
    """The fitted split launch, or stream-K where the plan allows it and it saves ``STREAM_K_GAIN`` of the
    rounds. Chosen once per plan and kind of call (dtype, device, which optional tensors, the forced tile
    form, the gain) and kept in the plan: the builds, their figures and the choice depend on nothing else,
    and making them again took 22-26 us of Python a call (a 16-row GEMM on the CI box: 33 -> 11 us with
    the split launch, 37 -> 21 with stream-K). A config override drops the plans, and with them the choices."""
    x2, _, _, qzeros, act_perm, bias = tensors[:6]
    key = (x2.dtype, x2.device, qzeros is None, act_perm is None, bias is None, _DEQUANT_FORCE, STREAM_K_GAIN)
    chosen = plan.setdefault("launches", {})
    go = chosen.get(key)
    if go is None:
        go = _fitted_split_launch(plan, tensors)
        if plan["stream_k"]:
            streamed = _stream_k_launch(plan, tensors)
            if go.rounds is None or streamed.rounds is None or go.rounds >= STREAM_K_GAIN * streamed.rounds:
                go = streamed
        chosen[key] = go
    return go


def _run_wgmma(plan, x2, qweight, scales, qzeros, act_perm, bias, group_size, zero_offset, o2, workspace):
    total = wgmma.launch(plan["launch"], x2, qweight, scales, qzeros, act_perm, bias, group_size, zero_offset, o2,
                         workspace)
    if total is not None:  # K splits: their fp32 sum or partials, + bias, cast; the kernel's programmatic dependent
        reduce_sums(total, bias, o2, total.shape[0] if total.dim() == 3 else 1, pdl_launch(o2.device))


def _run_split_k(plan, x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2, workspace):
    m, n = x2.shape[0], o2.shape[1]
    sums_at = 0
    if act_perm is not None and gathers_x(plan):
        x2, sums_at = gather_act_order(x2, act_perm, workspace)
        act_perm = None
    tensors = (x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2)
    go = _chosen_launch(plan, tensors)
    if go.mode == 0:
        y = o2
    elif go.mode == 2:
        y = fp32_scratch(workspace, (m, n), not go.zero_wait, x2.device, offset=sums_at)
    else:
        y = fp32_scratch(workspace, (go.parts, m, n), False, x2.device, offset=sums_at)
    if go.zero_wait:
        zero_ahead(y)
    go.kernel[go.grid](*_split_k_args(*tensors, y, go.mode, go.split_len), **go.constexprs, **go.launch,
                       **({"launch_pdl": True} if go.zero_wait else {}))
    if go.mode != 0:
        reduce_sums(y, bias, o2, go.parts if go.mode == 1 else 1, go.pdl)


def reduce_pdl(cfg: dict, device: torch.device, atomic: bool) -> bool:
    """Whether a split-K launch of config ``cfg`` starts its reduction as a programmatic dependent (on a
    GPU that has PDL): the reduction's launch latency then overlaps the split-K kernel's last programs.

    ``pdl_reduce`` in the config decides; without it, the launch's own reduction does: ``atomic`` (the fp32
    sum; a stream-K config's split launch may take partials) takes PDL and partials do not. Measured on an
    H100 (h100-2026-12-06-16c396d-probe-pdl, W4 g128, five shapes x M = 1 / 4 / 16): atomic 0.26-0.97 us faster in all 15 rows; partials 0.2-0.8 us faster in 8 and
    0.1-3.5 us slower in 7 (its reduction has many more programs, placed early while the split-K
    kernel still runs)."""
    knob = cfg.get("pdl_reduce")
    return bool(atomic if knob is None else knob) and pdl_launch(device)


def zero_pdl(cfg: dict, device: torch.device) -> bool:
    """Whether an atomic split-K launch of config ``cfg`` zeroes its fp32 sum with ``common.zero_ahead`` and
    starts as that kernel's programmatic dependent, its atomic adds waiting for the zeroing (``ZERO_WAIT``),
    rather than after a ``zero_()``: the zeroing's launch then overlaps the split-K kernel's loads instead
    of preceding them. On a GPU with PDL unless the config's ``pdl_zero`` is 0."""
    return bool(cfg.get("pdl_zero", 1)) and pdl_launch(device)


def _out_strides(mode: int, o2: torch.Tensor) -> tuple[int, int, int]:
    """(split, row, column) strides of the kernel's output for OUT_MODE ``mode``: the final output ``o2``
    (0), contiguous fp32 partials ``(S, M, N)`` (1), or one contiguous fp32 ``(M, N)`` sum (2)."""
    if mode == 0:
        return 0, o2.stride(0), o2.stride(1)
    m, n = o2.shape
    return (m * n if mode == 1 else 0), n, 1


def _split_k_build(plan, mode: int, dtype, bits: int, qzeros, act_perm, bias, pdl: bool = False,
                   zero_wait: bool = False, stream_k: bool = False) -> tuple:
    """(kernel, constexprs, launch options) of a decode or GEMM plan writing OUT_MODE ``mode``; ``pdl``
    compiles in the trigger of a PDL reduction, ``zero_wait`` the wait for a PDL zeroing (:func:`zero_pdl`),
    ``stream_k`` the GEMM's stream-K loop (each absent otherwise: the builds stay those of before)."""
    cfg = plan["cfg"]
    flags = dict(
        BITS=bits, HAS_ZEROS=qzeros is not None, HAS_PERM=act_perm is not None, HAS_BIAS=bias is not None,
        OUT_MODE=mode, EVEN_K=plan["even_k"], **({"PDL": True} if pdl else {}),
        **({"ZERO_WAIT": True} if zero_wait else {}),
    )
    launch = dict(num_warps=int(cfg.get("num_warps", 4)), num_stages=int(cfg.get("num_stages", 2)),
                  **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}))
    if plan["path"] == "decode":
        x_vec = gemv_x_vec(cfg, bits, act_perm is not None)
        prefetch = gemv_prefetch_applies(cfg, bits, gemv_steps(plan))
        half_dot = gemv_half_dot(cfg, bits, dtype, x_vec, prefetch)
        knobs = {"PREFETCH": prefetch, "XVEC": x_vec, "HALF_DOT": half_dot,
                 "DOT_WORDS": 2 if half_dot and int(cfg["half_dot"]) == 2 else 0}
        return _gemv_kernel, dict(BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], CHUNKS=plan["chunks"],
                                  EVEN_N=plan["even_n"], **flags, **{k: on for k, on in knobs.items() if on}), launch
    dequant = dequant_form(dtype, bits, plan["tile_group"])
    return _tc_kernel, dict(
        **({"STREAM_K": True} if stream_k else {}),
        **({"SCALE_W": True} if scale_weight_applies(cfg, dequant) else {}),
        BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"], BLOCK_K=plan["block_k"],
        GROUP_M=int(cfg.get("GROUP_M", 8)), TILE_GROUP=plan["tile_group"],
        DEQUANT=dequant, PREFETCH_S=bool(cfg.get("prefetch_scales", 0)),
        EVEN_ODD=even_odd_applies(cfg, bits, dequant), SYM_ZERO_LOAD=sym_zero_load_applies(cfg, bits, dequant, qzeros is None),
        **flags), launch


def _split_k_args(x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2, y, mode, split_len) -> tuple:
    """The run-time arguments of ``_gemv_kernel`` / ``_tc_kernel`` writing ``y`` as OUT_MODE ``mode`` (an
    absent tensor is passed as another pointer, never read)."""
    m, k = x2.shape
    return (
        x2, qweight, scales, qzeros if qzeros is not None else qweight, act_perm if act_perm is not None else qweight,
        bias if bias is not None else scales, y,
        m, qweight_columns(qweight), k, qweight_word_rows(qweight),
        x2.stride(0), x2.stride(1), *qweight_strides(qweight), scales.stride(0),
        qzeros.stride(0) if qzeros is not None else 0, *_out_strides(mode, o2),
        # group_size -1 is passed as K: k // K == 0 for every row, so one division serves both.
        split_len, group_size if group_size != -1 else k, zero_offset, MAGIC_ARG,
    )


# (kernel, constexprs as items, launch options as sorted items, dtype, device) -> (num_stages that fit the
# device's shared memory, programs of that build an SM holds at once or None)
_BUILD_FACTS: dict[tuple, tuple[int, int | None]] = {}


def _build_facts(kernel, constexprs: dict, launch: dict, plan, tensors: tuple, mode: int) -> tuple[int, int | None]:
    """(num_stages, programs an SM holds at once) of a build (``_split_k_build``'s kernel, constexprs and
    launch options), found once per build by compiling it without a launch for ``tensors`` (the first
    call of a shape compiles it anyway; later shapes with the same constexprs reuse the figures, though
    Triton may specialize their build on the integer arguments' divisibility by 16). Under Triton's
    interpreter: the configured stages and no figure for the programs."""
    x2 = tensors[0]
    # Names with the values: the optional knobs are present only when on, so values alone could not tell
    # PREFETCH from XVEC (both True at the same place).
    key = (id(kernel), tuple(constexprs.items()), tuple(sorted(launch.items())), x2.dtype, x2.device)
    facts = _BUILD_FACTS.get(key)
    if facts is None:
        if not _compiles_for(x2.device):
            facts = (launch["num_stages"], None)
        else:
            # The fp32 output of modes 1 and 2 enters the build through its dtype and alignment only.
            y = tensors[-1] if mode == 0 else torch.empty(16, dtype=torch.float32, device=x2.device)
            args = _split_k_args(*tensors, y, mode, plan["split_len"])
            facts = _compiled_facts(kernel, plan["grid"], args, constexprs, launch, x2.device)
        _BUILD_FACTS[key] = facts
    return facts


def _compiles_for(device: torch.device) -> bool:
    """Whether Triton compiles kernels for ``device`` (a CUDA device, not the CPU interpreter)."""
    return device.type == "cuda" and not interpreting()


def _compiled_facts(kernel, grid, args, constexprs: dict, launch: dict, device) -> tuple[int, int | None]:
    """Compile ``kernel`` for ``args`` without launching it: (num_stages, programs an SM holds at once).

    If Triton reports that the pipeline needs more shared memory than the device has (OutOfResources,
    raised when the binary is loaded), fewer stages are tried: a table tuned for one tile shape can meet
    a (bits, group) combination whose unpacked tile is larger (2/3-bit tiles at M = 16 asked for 299 KB
    on the H200 with 3 stages); one stage fewer fits and runs the same arithmetic."""
    stages = launch["num_stages"]
    while True:
        try:
            compiled = kernel.warmup(*args, grid=grid, **constexprs, **dict(launch, num_stages=stages))
            compiled._init_handles()
            break
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
    per_sm = resident_programs(int(compiled.n_regs), int(compiled.metadata.shared), int(compiled.metadata.num_warps),
                               torch.cuda.get_device_properties(device))
    return stages, per_sm


def _run_dense(plan, x2, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, o2):
    """Dequantize N-slabs of W.T into a transient buffer and multiply with cuBLAS (largest M).

    With the config's ``overlap`` set (CUDA only), slab i + 1 is dequantized on a side stream into a
    second buffer while cuBLAS multiplies slab i: the memory-bound dequantization under the
    compute-bound GEMM. The side stream forks from and joins the caller's stream with events inside
    the call, so it captures into a CUDA graph as one fork-join.
    """
    m, k = x2.shape
    n = o2.shape[1]
    slab = plan["slab"]
    starts = range(0, n, slab)
    overlap = bool(plan["cfg"].get("overlap", 0)) and x2.is_cuda and len(starts) > 1
    bufs = [torch.empty((k, slab), dtype=x2.dtype, device=x2.device) for _ in range(2 if overlap else 1)]
    b = bias.to(x2.dtype) if bias is not None and bias.dtype != x2.dtype else bias

    def dequant(n0, w):
        _dequant_slab(plan, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset, k, n, n0, w)

    def multiply(n0, w):
        width = min(slab, n - n0)
        wv, dst = w[:, :width], o2[:, n0:n0 + width]
        if b is not None:
            torch.addmm(b[n0:n0 + width], x2, wv, out=dst)
        else:
            torch.mm(x2, wv, out=dst)

    if not overlap:
        for n0 in starts:
            dequant(n0, bufs[0])
            multiply(n0, bufs[0])
        return
    main = torch.cuda.current_stream(x2.device)
    side = _side_stream(x2.device)
    side.wait_stream(main)  # x, the weight and both buffers are ready on the caller's stream
    freed: list = [None, None]  # per buffer: the event after the GEMM that last read it
    for i, n0 in enumerate(starts):
        w = bufs[i % 2]
        with torch.cuda.stream(side):
            if freed[i % 2] is not None:
                side.wait_event(freed[i % 2])
            dequant(n0, w)
            ready = torch.cuda.Event()
            ready.record(side)
        main.wait_event(ready)  # also joins the side stream: its last work is the last slab's dequant
        multiply(n0, w)
        freed[i % 2] = torch.cuda.Event()
        freed[i % 2].record(main)


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the dense path's overlapped dequantization (from torch's pool)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def _dequant_slab(plan, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset, k, n, n0, w):
    """Columns ``[n0, n0 + slab)`` of W.T, dequantized into ``w`` ``(K, slab)``."""
    slab = plan["slab"]
    bk, bn = plan["dq_block_k"], plan["dq_block_n"]
    width = min(slab, n - n0)
    _dequant_kernel[(-(-k // bk), -(-width // bn))](
        qweight, scales, qzeros if qzeros is not None else qweight, act_perm if act_perm is not None else qweight, w,
        k, n, n0, slab, qweight_word_rows(qweight), *qweight_strides(qweight), scales.stride(0),
        qzeros.stride(0) if qzeros is not None else 0, group_size if group_size != -1 else k, zero_offset,
        MAGIC_ARG, BITS=bits, BLOCK_K=bk, BLOCK_N=bn, HAS_ZEROS=qzeros is not None, HAS_PERM=act_perm is not None,
        TILE_GROUP=plan["tile_group"], num_warps=plan["dq_warps"],
    )
