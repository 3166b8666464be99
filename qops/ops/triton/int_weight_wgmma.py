"""The 4-bit integer weight-only GEMM (qops' runtime layout of GPTQ, AWQ and compressed-tensors weights) on Hopper
warpgroup MMAs, the weight as the MMA's register operand (Gluon).

Reached through ``int_weight.triton_mm`` where a 4-bit GEMM bucket of the Triton table names a ``wgmma`` tile (the
H100's and the H200's M = 64 and 128 buckets; the H100's M = 4 / 8 / 16 / 32 buckets with 8 / 8 / 16 / 32-row
tiles, 1.02-1.30x their Triton GEMMs there, stop 69), with the bucket's Triton GEMM wherever :func:`refusal` says
no or the call is too small for the tile (:func:`plan`). At M = 64 (W4 g128 asymmetric) it runs 1.94 / 2.10 / 2.00x
cuBLAS fp16 on an H100 and 1.37 / 1.39 / 1.47x on an H200 on 28672x4096 / 57344x8192 / 8192x28672 (the Triton
GEMM it replaced: 1.09-1.29x and 0.72-0.81x); at M = 128 1.00-1.14x and 0.73-0.76x (``benchmarks/NOTES.md``,
stops 65-68). Stream-K (a tile's ``stream_k``) is what the H100's M = 16 bucket takes (1.05-1.18x its split launch
or the GEMM, stop 69); at M = 64 it measured 6-7% faster on both cards only on 57344x8192 (1.70 waves of tiles) and
3-20% slower on the other three shapes (under one wave), so both cards' M = 64 entries take it only from one wave of
tiles up (``stream_k_min_waves``, stop 70).

Why a second kernel beside ``int_weight._tc_kernel``: Triton 3.6 stores that kernel's unpacked weight tile to
shared memory each K step and waits for the step's MMAs before the next (its pipeliner lets a dot run ahead
only on buffers it owns; sm_90 SASS and TTGIR at stop 64). Here the operands are swapped, ``y^T = W x^T``: the
weight tile ``(BLOCK_N, BLOCK_K)`` is the MMA's A operand, unpacked straight into the registers that operand
lives in, and x's tile ``(BLOCK_M, BLOCK_K)`` is the B operand in a ring of shared-memory stages filled by
``cp.async``, as are the packed words. The MMAs are asynchronous: each K step is two half-step MMAs, and the
unpack of one half overlaps the MMA of the other.

How the words reach the A operand's registers without a shuffle: a thread of the MMA's A fragment holds, per
row and per 32 K rows, the K pairs ``2t, 2t + 1, 2t + 8, 2t + 9`` of both 16-row chunks (``t`` = lane % 4),
eight values; a GPTQ word holds eight K-consecutive values. So thread ``t`` loads word ``4b + t`` of each
32-row block ``b`` and its values go to those eight positions. Which value goes where is free (x is
gathered to match), and it is chosen so that a register's two values sit 16 bits apart in the word, values
``i`` and ``i + 4`` (:data:`WORD_ORDER`): one LOP3 of the word in place then makes the pair, with no byte
permute (4 fewer instructions a word in fp16). The MMA's K position ``q = 32b + 16cc + 8h + 2t + e`` holds
weight row ``32b + 8t + 2cc + h + 4e``. x's columns are gathered in the same order once a call
(:func:`x_gather_index`), with the act-order permutation folded in; the product is the same sum over K.
The unpack is ``common.half_unpack_asm`` with the group's scale multiplied in (LOP3, packed FMA and
packed multiply a pair of values), so the weight is ``s * (q - z)`` rounded to the activation dtype, as a
dequantized weight is.

Which weight row feeds which MMA row is free too (the output columns follow): :func:`memory_row` gives each
thread consecutive weight rows, so its words of a K row, its scales and its zero points arrive in one vector
load each.

How K is shared among programs (:func:`plan`): K splits whose fp32 sums are added atomically into one sum or stored
as one partial a split (a tile's ``reduce``) and reduced by a second launch, or stream-K: one wave of programs, each
an equal run of the tiles' K steps laid end to end, a tile that several runs share summed by the last of them to
finish (from the others' fp32 parts, in program order), with no fp32 sum to zero or reduce. The x gather
(``x_gather.gather_x``; for act-order from 2^19 values of x through x transposed) zeroes the stream-K counts or the split
launch's fp32 sum, and the call's launches after it are programmatic dependents (PDL): the kernel copies its first
word stages before it waits for the gather, and the split sum's reduction is placed while the kernel's last programs
run. Before that chain a call was two to four launches, each waiting for the last (the gather, a zeroing of the sum,
the kernel, the reduction).

Gluon (``triton.experimental.gluon``) is experimental and its API moves between Triton releases; this file
is written against Triton 3.6 (the GPU machine's). Triton's interpreter does not run Gluon, so CI only
compiles it for sm_90 (``tests/test_int_weight_wgmma.py``); the GPU suite runs it against the float64 oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import pdl_launch
from .common import half_unpack_asm, scratch_aligned, sm_count, split_in_waves, stream_k_runs, workspace_view
from .x_gather import gather_scratch, gather_x

try:  # Gluon's API is per Triton release; a Triton without these names cannot build the kernel at all
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    # Triton 3.6 (the GPU machine's) names the cp.async load ``async_copy_global_to_shared``; later releases
    # ``async_load`` (CI's Triton compiles this file for sm_90 too)
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    # and its CTA barrier ``thread_barrier``, later ``barrier``
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means the same: no Gluon here
    GLUON_ERROR = f"{type(e).__name__}: {e}"


def available() -> str | None:
    """None where this Triton can build the kernel, else why not."""
    return GLUON_ERROR


# The unpack's outputs, in a word's values: outputs 2i, 2i + 1 (one register, K-adjacent in the MMA) are
# values i and i + 4, 16 bits apart in the word (no byte permute: ``common.half_pair_lanes``).
WORD_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# The unpack's bias operands ``-(magic * 2**-s + z)``, one per in-place offset ``s`` of ``common.half_offsets(4, half,
# WORD_ORDER)`` (fp16: 0 and 4, the magic 1024; bf16: 0, the magic 128), as (pattern at z = 0, step a unit of z): with
# 0 <= z <= 16 each is exact, and its bits are the magic's moved by z units in the last place.
BIAS_BITS = {"f16": ((0xE400, 1), (0xD400, 16)), "bf16": ((0xC300, 1),)}
_F16_B0, _F16_B0_STEP, _F16_B1, _F16_B1_STEP, _BF16_B0, _BF16_B0_STEP = (
    triton.language.constexpr(v) for v in (*BIAS_BITS["f16"][0], *BIAS_BITS["f16"][1], *BIAS_BITS["bf16"][0]))
_F16_ASM, _F16_CONSTRAINTS = (triton.language.constexpr(t) for t in half_unpack_asm(4, "f16", WORD_ORDER, scaled=True))
_BF16_ASM, _BF16_CONSTRAINTS = (triton.language.constexpr(t) for t in half_unpack_asm(4, "bf16", WORD_ORDER, scaled=True))


def _order_of(q: torch.Tensor) -> torch.Tensor:
    """The weight row whose value the MMA's K position ``q`` multiplies (see the module docstring): the
    fragment's output ``4cc + 2h + e`` of the lane's word is its value ``WORD_ORDER[4cc + 2h + e]``."""
    b, r = q // 32, q % 32
    cc, h, t, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
    return 32 * b + 8 * t + 2 * cc + h + 4 * e


def _gather_order(k: int) -> torch.Tensor:
    """``order[q]`` for the K positions of a ``k``-row weight (``k`` a multiple of 32), int64 on the CPU."""
    return _order_of(torch.arange(k))


def x_gather_index(k: int, act_perm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The column of x each K position of the kernel reads: the MMA order of :func:`_gather_order`, through
    the act-order permutation where there is one (the kernel's K row ``j`` multiplies ``x[:, act_perm[j]]``).
    The gather computes it itself (``x_gather.gather_x``); this is its reference."""
    order = _order_of(torch.arange(k, device=device))
    return order if act_perm is None else act_perm.index_select(0, order)


@triton.constexpr_function  # plain Python, also called by the kernel's layout function at compile time
def memory_row(row: int, block_n: int, warps: int) -> int:
    """The weight row (within a tile of ``block_n`` rows over ``warps`` warps) that MMA row ``row`` multiplies.

    The MMA fixes which rows a thread's A fragment holds: ``lane / 4 + 8 p`` (``p`` 0 or 1) within its warp's 16,
    in each of ``R = block_n / (16 warps)`` blocks of ``16 warps`` rows. Which weight row feeds an MMA row is free
    (the output columns follow it), so a thread's ``2R`` rows are made consecutive weight rows: MMA row
    ``((b warps + w) 2 + p) 8 + l`` (block, warp, +8, lane / 4) is weight row ``((w 8 + l) R + b) 2 + p``. A
    thread's words of one K row, its scales and its zero points' nibbles are then adjacent in memory: one
    vector load each instead of one a row."""
    blocks = block_n // (16 * warps)
    lane, plus8, w, b = row % 8, (row // 8) % 2, (row // 16) % warps, row // (16 * warps)
    return ((w * 8 + lane) * blocks + b) * 2 + plus8


if GLUON_ERROR is None:

    @gluon.constexpr_function
    def _word_layout(block_n, block_k, warps):
        """Registers of the ``(BLOCK_N, BLOCK_K / 8)`` word tile, rows the tile's weight rows: lane ``l`` of warp ``w``
        holds the words the A fragment's owner of MMA rows ``16 w + l / 4 (+ 8)`` of each ``16 * warps`` rows needs
        (one warpgroup's MMA covers 64 rows, its four warps' 16 each; a second warpgroup the next 64), of word
        columns ``l % 4 + 4b``; MMA row ``i`` is weight row ``memory_row(i)``."""
        rows = [[8, 0]] + [[0, 4 << i] for i in range((block_k // 32).bit_length() - 1)]
        rows += [[16 * warps << i, 0] for i in range((block_n // (16 * warps)).bit_length() - 1)]
        lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
        warp_rows = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
        def mem(bases):
            return [[memory_row(r, block_n, warps), c] for r, c in bases]
        return gl.DistributedLinearLayout(mem(rows), mem(lanes), mem(warp_rows), [], [block_n, block_k // 8])

    @gluon.jit
    def _in_memory_rows(acc, WARPS: gl.constexpr):
        """The accumulator ``(BLOCK_N, BLOCK_M)`` (MMA rows) relabelled by weight rows: a free reshape of registers."""
        BN: gl.constexpr = acc.shape[0]
        BM: gl.constexpr = acc.shape[1]
        R: gl.constexpr = BN // (16 * WARPS)
        t = gl.reshape(acc, [R, WARPS, 2, 8, BM])  # (b, w, p, l, m): MMA row ((b warps + w) 2 + p) 8 + l
        t = gl.permute(t, [1, 3, 0, 2, 4])  # (w, l, b, p, m): weight row ((w 8 + l) R + b) 2 + p
        return gl.reshape(t, [BN, BM])

    @gluon.constexpr_function
    def _copy_layout(rows, cols, vec, warps):
        """A ``(rows, cols)`` layout of ``vec``-element vectors for ``cp.async`` (every element once where the tile
        has a warp-row of rows: 16 x 64, 4 x 128 and up)."""
        tcols = min(32, cols // vec)
        trows = 32 // tcols
        wrows = max(1, min(warps, rows // trows))
        return gl.BlockedLayout([1, vec], [trows, tcols], [wrows, warps // wrows], [1, 0])

    @gluon.jit
    def _pair_bits(h):
        """The 16-bit pattern ``h`` (int32, < 2**16) in both halves of a word: the unpack's packed operands."""
        return h | (h << 16)

    @gluon.jit
    def _weight_operand(words, bias0, bias1, scale, a_layout: gl.constexpr, DTYPE: gl.constexpr, WARPS: gl.constexpr):
        """The MMA's A operand ``(BLOCK_N, 8 * C)`` (``s * (q - z)`` in DTYPE, K in the MMA order) of the word
        tile ``(BLOCK_N, C)``; ``bias0`` / ``bias1`` / ``scale`` ``(BLOCK_N, 1)`` packed pairs (:func:`_group_pairs`;
        bf16 has one bias)."""
        if DTYPE == gl.float16:
            v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
                _F16_ASM, _F16_CONSTRAINTS, [words, bias0, bias1, scale], dtype=(gl.float16,) * 8, is_pure=True,
                pack=1)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
                _BF16_ASM, _BF16_CONSTRAINTS, [words, bias0, scale], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # output 4cc + 2h + e of word column 4b + t goes to K position 32b + 16cc + 8h + 2t + e, and weight row
        # memory_row(i) to MMA row i
        t = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        BN: gl.constexpr = words.shape[0]
        C: gl.constexpr = words.shape[1]
        R: gl.constexpr = BN // (16 * WARPS)
        t = gl.reshape(t, [WARPS, 8, R, 2, C // 4, 4, 2, 2, 2])  # (w, l, rb, p; b, t, e, h, cc)
        t = gl.permute(t, [2, 0, 3, 1, 4, 8, 7, 5, 6])  # (rb, w, p, l; b, cc, h, t, e)
        t = gl.reshape(t, [BN, 8 * C])
        return gl.convert_layout(t, a_layout, assert_trivial=True)

    @gluon.jit
    def _group_raw(s_ptr, qz_ptr, g, offs_n, nmask, stride_s, stride_qz, HAS_ZEROS: gl.constexpr):
        """Group ``g``'s scales and zero-point words of rows ``offs_n`` as stored (the words' placeholder where
        there are no zero points), loaded a step before :func:`_group_pairs` uses them."""
        s = gl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0)
        if HAS_ZEROS:
            zw = gl.load(qz_ptr + g * stride_qz + offs_n // 8, mask=nmask, other=0)
        else:
            zw = offs_n
        return s, zw

    @gluon.jit
    def _group_pairs(s, zw, offs_n, zero_offset, HAS_ZEROS: gl.constexpr, DTYPE: gl.constexpr):
        """The packed scale and bias pairs ``(BLOCK_N, 1)`` of a group's :func:`_group_raw` values, built from bit
        patterns (:data:`BIAS_BITS`) with integer operations, not conversions: a bias pair is ``pair(base + step
        z)`` = ``pair(base + step zero_offset) + z * pair(step)`` (no carry between the halves: each stays below
        2**16), one multiply-add a row after the nibble's extraction."""
        scale = _pair_bits(s.to(DTYPE).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF)  # scales may be fp16 for bf16 x
        if HAS_ZEROS:
            z = (zw >> ((offs_n % 8) * 4)) & 15
            offset = zero_offset
        else:
            z = offs_n * 0
            offset = 8
        if DTYPE == gl.float16:
            bias0 = z * _pair_bits(_F16_B0_STEP) + _pair_bits(_F16_B0 + _F16_B0_STEP * offset)
            bias1 = z * _pair_bits(_F16_B1_STEP) + _pair_bits(_F16_B1 + _F16_B1_STEP * offset)
        else:
            bias0 = z * _pair_bits(_BF16_B0_STEP) + _pair_bits(_BF16_B0 + _BF16_B0_STEP * offset)
            bias1 = bias0
        return scale[:, None], bias0[:, None], bias1[:, None]

    @gluon.jit
    def _issue_x(x_ptr, x_stage, offs_xm, offs_xk, xmask, k0, stride_xm):
        """``cp.async`` of step ``k0``'s x tile into its stage (the caller commits)."""
        _async_load(x_stage, x_ptr + offs_xm[:, None] * stride_xm + (k0 + offs_xk)[None, :], mask=xmask)

    @gluon.jit
    def _issue_words(qw_ptr, w_stage, offs_wr, wcol, wmask, k0, stride_qw):
        """``cp.async`` of step ``k0``'s word tile into its stage (the caller commits)."""
        _async_load(w_stage, qw_ptr + (k0 // 8 + offs_wr)[:, None] * stride_qw + wcol[None, :], mask=wmask)

    @gluon.jit
    def _issue_step(x_ptr, qw_ptr, x_stage, w_stage, offs_xm, offs_xk, offs_wr, wcol, xmask, wmask, k0,
                    stride_xm, stride_qw):
        """``cp.async`` of step ``k0``'s x tile and word tile into one stage (the caller commits)."""
        _issue_x(x_ptr, x_stage, offs_xm, offs_xk, xmask, k0, stride_xm)
        _issue_words(qw_ptr, w_stage, offs_wr, wcol, wmask, k0, stride_qw)

    @gluon.jit
    def _grid_dependency_wait():
        """PTX ``griddepcontrol.wait``: until the grid this one is a programmatic dependent of has completed
        and its writes are visible (at once where it was launched as none)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _launch_dependents():
        """PTX ``griddepcontrol.launch_dependents``: a programmatic dependent launch after this grid may be
        placed once every program has run it (or exited)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.constexpr_function
    def _acc_layout(block_m, warps):
        """The accumulator ``(BLOCK_N, BLOCK_M)``: ``warps`` warps of 16 MMA rows each, the MMA's N the tile's M."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])

    @gluon.jit
    def _tile_sum(x_ptr, qw_ptr, s_ptr, qz_ptr, x_smem, w_smem, pid_n, pid_m, k_lo, steps,
                  M, N, K, stride_xm, stride_qw, stride_qslab, stride_s, stride_qz, zero_offset,
                  BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
                  STAGES: gl.constexpr, HAS_ZEROS: gl.constexpr, WARPS: gl.constexpr):
        """The fp32 sum ``(BLOCK_N, BLOCK_M)`` of output tile (``pid_n``, ``pid_m``) over ``steps`` > 0 K steps from
        row ``k_lo``: a ``cp.async`` ring of ``STAGES`` x / word stages (``x_smem``, ``w_smem``) feeding asynchronous
        MMAs, two a step, the unpack of one half overlapping the MMA of the other. x is written by the grid this one
        is a programmatic dependent of (the gather): the first x copies wait for it, the words' do not."""
        DTYPE: gl.constexpr = x_ptr.dtype.element_ty
        HALF_K: gl.constexpr = BLOCK_K // 2
        acc_l: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        word_l: gl.constexpr = _word_layout(BLOCK_N, HALF_K, WARPS)
        xcopy_l: gl.constexpr = _copy_layout(BLOCK_M, BLOCK_K, 8, WARPS)
        wcopy_l: gl.constexpr = _copy_layout(BLOCK_K // 8, BLOCK_N, 4, WARPS)
        # Without the zero-trip path, whose zeroed accumulator would meet the loop's at the final wait, ptxas
        # keeps the MMAs asynchronous (else it serializes them: its C7515 "non wgmma instructions defining
        # accumulator registers").
        gl.assume(steps > 0)

        offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(1, xcopy_l))
        offs_xk = gl.arange(0, BLOCK_K, gl.SliceLayout(0, xcopy_l))
        xmask = (offs_xm < M)[:, None] & (offs_xk < BLOCK_K)[None, :]
        offs_wr = gl.arange(0, BLOCK_K // 8, gl.SliceLayout(1, wcopy_l))
        offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, wcopy_l))
        wcol = (offs_wn // 32) * stride_qslab + offs_wn % 32
        wmask = (offs_wr < BLOCK_K // 8)[:, None] & (offs_wn < N)[None, :]

        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, word_l))
        nmask = offs_n < N

        # every warp is done reading the stages (a previous tile's last step) before they are refilled
        _cta_barrier()
        # x comes from the launch before (the gather), the words do not: the first stages' words are on their way
        # while this program waits for that grid (at once after a program's first tile, or without PDL); the first
        # group then holds them all
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _issue_words(qw_ptr, w_smem.index(i), offs_wr, wcol, wmask, k_lo + i * BLOCK_K, stride_qw)
        _grid_dependency_wait()
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _issue_x(x_ptr, x_smem.index(i), offs_xm, offs_xk, xmask, k_lo + i * BLOCK_K, stride_xm)
            cp.commit_group()

        # A group's scales and zero points are loaded a step ahead of their use: loaded in the step, their
        # latency (an L2 round trip) stalled the step's unpack (sm_90 SASS: the loads came after the
        # cp.async wait, the unpack right after the barrier).
        if GROUP == 0:
            s_raw, z_raw = _group_raw(s_ptr, qz_ptr, 0, offs_n, nmask, stride_s, stride_qz, HAS_ZEROS)
        else:
            s_raw, z_raw = _group_raw(s_ptr, qz_ptr, k_lo // GROUP, offs_n, nmask, stride_s, stride_qz, HAS_ZEROS)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        for i in range(steps):
            k0 = k_lo + i * BLOCK_K
            stage = i % STAGES
            scale, bias0, bias1 = _group_pairs(s_raw, z_raw, offs_n, zero_offset, HAS_ZEROS, DTYPE)
            if GROUP != 0:
                # the next step's group (the last step re-reads its own: K - BLOCK_K is in range)
                g_next = gl.minimum(k0 + BLOCK_K, K - BLOCK_K) // GROUP
                s_raw, z_raw = _group_raw(s_ptr, qz_ptr, g_next, offs_n, nmask, stride_s, stride_qz, HAS_ZEROS)
            cp.wait_group(STAGES - 2)
            # this thread's copies, seen by the MMAs' async proxy, then everyone's: fence, then barrier
            fence_async_shared()
            _cta_barrier()
            w_stage = w_smem.index(stage)
            x_stage = x_smem.index(stage)
            lo = w_stage.slice(0, HALF_K // 8, dim=0).permute((1, 0)).load(word_l)
            a_lo = _weight_operand(lo, bias0, bias1, scale, a_l, DTYPE, WARPS)
            acc = warpgroup_mma(a_lo, x_stage.slice(0, HALF_K, dim=1).permute((1, 0)), acc, is_async=True)
            # <= 1 in flight: the previous step's second MMA is done, so its stage may be refilled
            acc = warpgroup_mma_wait(1, deps=[acc])
            nxt = i + STAGES - 1
            if nxt < steps:
                _issue_step(x_ptr, qw_ptr, x_smem.index(nxt % STAGES), w_smem.index(nxt % STAGES), offs_xm, offs_xk,
                            offs_wr, wcol, xmask, wmask, k_lo + nxt * BLOCK_K, stride_xm, stride_qw)
            cp.commit_group()
            hi = w_stage.slice(HALF_K // 8, HALF_K // 8, dim=0).permute((1, 0)).load(word_l)
            a_hi = _weight_operand(hi, bias0, bias1, scale, a_l, DTYPE, WARPS)
            acc = warpgroup_mma(a_hi, x_stage.slice(HALF_K, HALF_K, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
        return warpgroup_mma_wait(0, deps=[acc])

    @gluon.jit
    def _store_tile(acc, y_ptr, bias_ptr, pid_n, pid_m, M, N, stride_ym, HAS_BIAS: gl.constexpr, ATOMIC: gl.constexpr,
                    WARPS: gl.constexpr):
        """Tile (``pid_n``, ``pid_m``) of y from its sum ``acc`` (MMA rows): written (+ bias), or added into the fp32
        sum (ATOMIC)."""
        acc = _in_memory_rows(acc, WARPS)
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        offs_on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc.type.layout))
        offs_om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(0, acc.type.layout))
        omask = (offs_on < N)[:, None] & (offs_om < M)[None, :]
        y_ptrs = y_ptr + offs_om[None, :] * stride_ym + offs_on[:, None]
        if ATOMIC:
            gl.atomic_add(y_ptrs, acc, mask=omask, sem="relaxed")
        else:
            if HAS_BIAS:
                acc += gl.load(bias_ptr + offs_on, mask=offs_on < N, other=0.0).to(gl.float32)[:, None]
            gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=omask)

    @gluon.jit
    def _part_ptrs(part_ptr, slot, acc_l: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """The fp32 ``(BLOCK_N, BLOCK_M)`` partial-sum slot ``slot``, addressed in the accumulator's layout (each
        thread reads back what it wrote)."""
        offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc_l))
        offs_m = gl.arange(0, BLOCK_M, gl.SliceLayout(0, acc_l))
        return part_ptr + slot * (BLOCK_N * BLOCK_M) + offs_n[:, None] * BLOCK_M + offs_m[None, :]

    @gluon.jit
    def _finish_shared_tile(acc, part_ptr, count_ptr, y_ptr, bias_ptr, tile, pid_n, pid_m, run, steps_tile,
                            M, N, stride_ym, HAS_BIAS: gl.constexpr, WARPS: gl.constexpr):
        """Stream-K: this program's sum ``acc`` of a tile whose K steps several programs share. Each parks its sum in
        its slot and counts itself in (the count is zeroed before the launch); the last to arrive adds the
        slots in program order (the same sum whoever arrives last: run-to-run deterministic) and writes the
        tile. Nobody waits for anybody, so the launch is safe whether or not its programs are co-resident.
        Slots: program c's run starting inside the tile (c's first) is slot c, the run starting the tile (its
        first program's last) slot ``num_programs + c``."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        BLOCK_M: gl.constexpr = acc.shape[1]
        acc_l: gl.constexpr = acc.type.layout
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        c0 = (tile * steps_tile) // run  # the program whose run starts the tile
        c1 = ((tile + 1) * steps_tile - 1) // run  # the one whose run ends it
        mine = pid + (pid == c0).to(gl.int32) * progs
        gl.store(_part_ptrs(part_ptr, mine, acc_l, BLOCK_N, BLOCK_M), acc)
        # every thread's partial is written before one thread counts the program in (release), and the count's
        # reader (acquire) tells every thread of the last program to go on
        _cta_barrier()
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == c1 - c0:
            # its own part too is read back (from L2): the accumulator's 64 registers a thread are free by then
            total = gl.load(_part_ptrs(part_ptr, progs + c0, acc_l, BLOCK_N, BLOCK_M), cache_modifier=".cg")
            for c in range(c0 + 1, c1 + 1):
                total += gl.load(_part_ptrs(part_ptr, c, acc_l, BLOCK_N, BLOCK_M), cache_modifier=".cg")
            _store_tile(total, y_ptr, bias_ptr, pid_n, pid_m, M, N, stride_ym, HAS_BIAS, False, WARPS)

    @gluon.jit
    def _wgmma_w4_kernel(
        x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, stride_xm, stride_qw, stride_qslab, stride_s, stride_qz, stride_ym, split_len, zero_offset,
        tiles_m, run,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, GROUP: gl.constexpr,
        STAGES: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, OUT_MODE: gl.constexpr,
        WARPS: gl.constexpr, STREAM_K: gl.constexpr,
    ):
        """``y[m, n] = sum_k x_g[m, k] w[n, k]``, x_g the gathered x (:func:`x_gather_index`).

        Split launch (grid N tiles x M tiles x K splits of ``split_len`` rows): a program sums its tile over its
        split and, by OUT_MODE (int_weight's), writes it (+ bias; 0), stores it as its split's fp32 partial in
        ``(S, M, N)`` partials (1), or adds it into the one fp32 sum ``(M, N)`` (2). Stream-K launch (STREAM_K, grid
        one wave of programs): the tiles' K steps laid end to end, M tiles adjacent (``tile = pid_n * tiles_m
        + pid_m``), program c takes steps ``[c * run, (c + 1) * run)``; a tile it covers whole is written,
        one it shares meets the others' parts in :func:`_finish_shared_tile` (``part_ptr`` 2 x programs slots,
        ``count_ptr`` one zeroed count a tile).

        GROUP: the group size (a multiple of BLOCK_K), 0 for one group over K. K is a multiple of BLOCK_K,
        BLOCK_K of 64. WARPS: 4 (one warpgroup) or 8 (two, each its own 64-row slabs of the N tile, sharing
        the x stages: half the x traffic a weight, but 10-25% slower on an H100 at M = 64, stop 66: the tables
        use 4); BLOCK_N a multiple of 16 * WARPS. The qweight is flat or in column slabs (word ``(j, n)`` at
        ``j * stride_qw + (n // 32) * stride_qslab + n % 32``; the flat form's ``stride_qslab`` is 32).

        Launched as the programmatic dependent of the x gather (on every GPU it runs on: Hopper has PDL), which
        also zeroes the fp32 sum and the stream-K counts; a program waits for it after its first word copies,
        before any x copy, atomic add or count (each program waits: none finishes before the gather, so a launch
        after this one waits for both). With K splits (OUT_MODE 1 / 2) the reduction after it, itself a
        programmatic dependent, may be placed once every program has started."""
        if OUT_MODE != 0:
            _launch_dependents()
        DTYPE: gl.constexpr = x_ptr.dtype.element_ty
        x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], DTYPE)
        # Row r of a word stage XORs its 32-byte chunks with r % 4: a warp's read (4 word rows x 8 columns)
        # then falls in 32 distinct banks.
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
        x_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, BLOCK_K], x_sl)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_K // 8, BLOCK_N], w_sl)

        if STREAM_K:
            steps_tile = K // BLOCK_K
            it = gl.program_id(0) * run
            end = gl.minimum(it + run, (N + BLOCK_N - 1) // BLOCK_N * tiles_m * steps_tile)
            while it < end:
                tile = it // steps_tile
                pid_n = tile // tiles_m
                pid_m = tile - pid_n * tiles_m
                first = it - tile * steps_tile
                last = gl.minimum(end - tile * steps_tile, steps_tile)
                acc = _tile_sum(x_ptr, qw_ptr, s_ptr, qz_ptr, x_smem, w_smem, pid_n, pid_m,
                                first * BLOCK_K, last - first, M, N, K, stride_xm, stride_qw, stride_qslab, stride_s,
                                stride_qz, zero_offset, BLOCK_N, BLOCK_M, BLOCK_K, GROUP, STAGES, HAS_ZEROS, WARPS)
                if last - first == steps_tile:
                    _store_tile(acc, y_ptr, bias_ptr, pid_n, pid_m, M, N, stride_ym, HAS_BIAS, False, WARPS)
                else:
                    _finish_shared_tile(acc, part_ptr, count_ptr, y_ptr, bias_ptr, tile, pid_n, pid_m, run, steps_tile,
                                        M, N, stride_ym, HAS_BIAS, WARPS)
                it = tile * steps_tile + last
        else:
            k_lo = gl.program_id(2) * split_len
            # the host launches no empty split
            steps = (gl.minimum(K, k_lo + split_len) - k_lo) // BLOCK_K
            acc = _tile_sum(x_ptr, qw_ptr, s_ptr, qz_ptr, x_smem, w_smem, gl.program_id(0), gl.program_id(1), k_lo,
                            steps, M, N, K, stride_xm, stride_qw, stride_qslab, stride_s, stride_qz, zero_offset,
                            BLOCK_N, BLOCK_M, BLOCK_K, GROUP, STAGES, HAS_ZEROS, WARPS)
            if OUT_MODE == 1:
                y_ptr += gl.program_id(2).to(gl.int64) * M * N  # this split's partial
            _store_tile(acc, y_ptr, bias_ptr, gl.program_id(0), gl.program_id(1), M, N, stride_ym, HAS_BIAS,
                        OUT_MODE == 2, WARPS)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

DEFAULT_TILE = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4}
# Every key a tile may hold (:func:`plan` reads them): a table's misspelt knob is refused, not silently ignored.
TILE_KEYS = frozenset({"BLOCK_N", "BLOCK_M", "BLOCK_K", "STAGES", "WARPS", "ctas_per_sm", "split", "stream_k",
                       "stream_k_min_waves", "min_tiles", "long_k_steps", "min_k_steps", "reduce", "few_tiles"})
# How a split launch leaves its fp32 sums (a tile's ``reduce``): added into one sum (atomic adds; the gather
# zeroes it) or stored as one partial a split (plain stores, no zeroing; the reduction reads them all, in
# split order: the same bits run to run). OUT_MODE as int_weight's.
SPLIT_OUT_MODES = {"atomic": 2, "partials": 1}


def split_out_mode(tile: dict) -> int:
    """The kernel's OUT_MODE for a split launch of ``tile`` (:data:`SPLIT_OUT_MODES`)."""
    reduce = tile.get("reduce", "atomic")
    if reduce not in SPLIT_OUT_MODES:
        raise ValueError(f"tile: reduce must be one of {sorted(SPLIT_OUT_MODES)}, got {reduce!r}")
    return SPLIT_OUT_MODES[reduce]


def shape_refusal(bits: int, group_size: int, k: int, n: int, block_k: int) -> str | None:
    """Why the kernel cannot take a weight of this shape with a K tile of ``block_k`` (None where it can), naming
    the argument: known when the launch is planned (:func:`plan`), once a shape."""
    if bits != 4:
        return f"bits: 4-bit weights only, got {bits}"
    if k % block_k:
        return f"in_features: K must be a multiple of BLOCK_K={block_k}, got {k}"
    if group_size != -1 and group_size % block_k:
        return f"group_size: -1 or a multiple of BLOCK_K={block_k}, got {group_size}"
    if n % 8:
        return f"out_features: N must be a multiple of 8 (the zero points' words), got {n}"
    return None


def call_refusal(x: torch.Tensor) -> str | None:
    """Why the kernel cannot take activations ``x`` (None where it can): their dtype and device, which a plan
    cached per shape does not know."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"x: fp16 / bf16 activations only, got {x.dtype}"
    if GLUON_ERROR is not None:
        return f"no Gluon in this Triton ({GLUON_ERROR})"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return f"x: needs a Hopper GPU (sm_90 warpgroup MMAs), got a tensor on {x.device}"
    return None


def refusal(x: torch.Tensor, bits: int, group_size: int, k: int, n: int, block_k: int = 64) -> str | None:
    """Why the kernel cannot take this call (None where it can), naming the argument."""
    return shape_refusal(bits, group_size, k, n, block_k) or call_refusal(x)


def sm90_build(tile: dict, dtype: torch.dtype, has_zeros: bool, split: bool, target=None):
    """The kernel compiled for sm_90 without a GPU (``triton.compile``; what CI can prove): the build a launch
    with ``tile`` would make (``split``: a split launch's, its fp32 sums as the tile's ``reduce`` says), integer
    sizes and strides declared multiples of 16 as a launch specializes them."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _wgmma_w4_kernel
    act = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    sig = {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "qz_ptr": "*i32", "bias_ptr": act,
           "y_ptr": "*fp32" if split else act, "part_ptr": "*fp32", "count_ptr": "*i32"}
    consts = {**{key: tile[key] for key in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "STAGES")}, "GROUP": 128,
              "HAS_ZEROS": has_zeros, "HAS_BIAS": not split, "OUT_MODE": split_out_mode(tile) if split else 0,
              "WARPS": tile.get("WARPS", 4), "STREAM_K": bool(tile.get("stream_k", 0)) and not split}
    sig.update({name: "constexpr" if name in consts else "i32" for name in fn.arg_names if name not in sig})
    aligned = {"N", "K", "stride_xm", "stride_qw", "stride_qslab", "stride_s", "stride_ym", "split_len"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in aligned}
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=target or GPUTarget("cuda", 90, 32),
                          options={"num_warps": consts["WARPS"], "launch_pdl": True})


def plan(m: int, n: int, k: int, bits: int, group_size: int, tile: dict, sms: int = 1) -> dict | None:
    """The launch of an (M, N, K) call with ``tile`` (None where :func:`shape_refusal` refuses the weight, or the
    call is too small for the tile, below): BLOCK_N / BLOCK_M / BLOCK_K / STAGES and how K is shared.

    - ``split`` given: that many K splits (their fp32 sums added atomically where more than one, or stored as
      partials where the tile's ``reduce`` is ``"partials"``; summed by a second launch either way).
    - else ``stream_k``: one wave of ``ctas_per_sm`` programs an SM of the ``sms``, the tiles' K steps cut into
      equal runs (``common.stream_k_runs``); a tile shared by several runs is summed by the last of them to
      finish (no fp32 sum to zero and reduce; 1.70 waves of tiles at 57344x8192, M = 64 leave 15% of an H100's
      slots idle in a split launch). ``stream_k_min_waves``: only where the call has at least that many waves
      of tiles (tiles over the wave's programs), the split launch below otherwise. At M = 64 on an H200 stream-K
      ran 7% faster than the split launch with 1.70 waves of tiles (57344x8192) and 6-20% slower with 0.85 or
      fewer (28672x4096, 8192x28672, 4096x14336; ``h200-2026-12-06-a54efbf-probe-wgmma.json``; on an H100 6% faster
      and 3-15% slower, ``h100-2026-12-07-fd4cc0e-probe-sk64.json``): under one wave a
      split launch has no idle slots to recover, and the shared tiles' fp32 parts are pure cost (at M = 128 it
      was within 1% of the split launch on all four).
    - else about ``ctas_per_sm`` programs an SM (the tiles, times the split; measured best at two on an H100 at
      M = 64 / 128, ``benchmarks/results/h100-2026-12-06-fbac7df-probe-wgmma-splits.json``), lowered where its
      programs would end in a partial wave (``common.split_in_waves``: 6144x4096 at M = 64 on an H100, 96 64-wide
      tiles, ran 3 splits, 288 programs over 264 slots, in 21.49 us through the op,
      ``h100-2026-12-07-faa855a-call80a-m64.json``; the probe timed 2 splits at 16.69 and 4 at 19.92,
      ``h100-2026-12-07-721d288-probe-m64.json``). No empty split, as the kernel assumes.

    ``min_tiles`` / ``long_k_steps`` / ``min_k_steps``: a call is left to the bucket's GEMM where it has fewer
    output tiles than ``min_tiles`` and its K fewer than ``long_k_steps`` K tiles, or where its K has fewer than
    ``min_k_steps`` K tiles. Few tiles run on K splits whose fp32 sums cost about as much as a short K saves: at
    M = 64 on an H100 (``h100-2026-12-07-ec7230b-probe-wgmma-m64-*.json``, 32 tiles a call, 8 splits) 0.73 / 0.95x
    the GEMM's speed at K = 4096 / 8192 (32 / 64 K tiles), 1.12 / 1.30x at K = 14336 / 28672 (112 / 224). A short
    K leaves each program few steps to fill and drain its ring over: at M = 32 on an H100 the 32-row tile ran
    1.30x the GEMM's speed at K = 8192 / 28672 and 0.96x at K = 4096
    (``h100-2026-12-07-9a13144-bench-m4-32-h100wa.json``).

    ``few_tiles`` (keys of a tile, say a narrower BLOCK_N): a call with fewer output tiles than ``min_tiles`` is
    planned again with these keys over the tile's before it is left to the GEMM (their own ``min_tiles`` /
    ``long_k_steps`` then decide). At M = 64 on an H100 the 64-wide tile at four K splits ran 1.15-1.68x the
    shipped launch's speed where the 128-wide one gave 32-48 tiles (4096x4096 13.32 us against 17.10, 6144x4096
    16.69 against 28.08 at two splits, 4096x8192 18.22 against 25.65, 4096x14336 26.92 against 31.05;
    ``h100-2026-12-07-721d288-probe-m64.json``); through the op with the H100 table's rule, 4096x4096 / 6144x4096 /
    4096x8192 / 4096x14336 13.35 / 21.49 / 18.26 / 26.86 us against 16.87 / 28.43 / 25.60 / 31.21 without it
    (``h100-2026-12-07-faa855a-call80a-m64*.json``; 6144x4096 at 3 splits, a partial wave: 16.55 us at 2 since
    a7e513d, ``h100-2026-12-07-a7e513d-call81a-waves.json``)."""
    cfg = {**DEFAULT_TILE, **tile}
    if unknown := sorted(set(cfg) - TILE_KEYS):
        raise ValueError(f"tile: unknown keys {unknown} (known: {sorted(TILE_KEYS)})")
    few = cfg.get("few_tiles")
    if few is not None and (not isinstance(few, dict) or "few_tiles" in few):
        raise ValueError(f"tile: few_tiles must be a mapping of tile keys other than few_tiles, got {few!r}")
    if cfg["BLOCK_N"] % (16 * cfg.get("WARPS", 4)):
        raise ValueError(f"tile: BLOCK_N must be a multiple of 16 * WARPS (each warp's 16 MMA rows), got {cfg}")
    split_out_mode(cfg)  # a misspelt reduce is refused with the plan, not at the first split call
    tiles_m = triton.cdiv(m, cfg["BLOCK_M"])
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * tiles_m
    if few is not None and tiles < cfg.get("min_tiles", 0):
        narrow = {key: value for key, value in cfg.items() if key != "few_tiles"}
        return plan(m, n, k, bits, group_size, {**narrow, **few}, sms)
    steps = max(1, k // cfg["BLOCK_K"])
    if shape_refusal(bits, group_size, k, n, cfg["BLOCK_K"]) is not None or _left_to_gemm(tiles, steps, cfg):
        return None
    slots = max(1, round(cfg.get("ctas_per_sm", 2) * sms))
    if "split" not in cfg and cfg.get("stream_k", 0) and tiles >= cfg.get("stream_k_min_waves", 0) * slots:
        programs, run = stream_k_runs(k, cfg["BLOCK_K"], tiles, slots)
        return dict(tile=cfg, split=1, stream_k=True, run=run // cfg["BLOCK_K"], programs=programs, tiles=tiles,
                    tiles_m=tiles_m, grid=(programs, 1, 1))
    if "split" in cfg:
        split = int(cfg["split"])
    else:  # about ctas_per_sm programs an SM, fewer where the last wave would be a partial one
        split = split_in_waves(k, cfg["BLOCK_K"], tiles, max(1, round(slots / tiles)), slots)[0]
    split = max(1, min(split, steps))
    split_len = triton.cdiv(steps, split) * cfg["BLOCK_K"]
    split = triton.cdiv(k, split_len)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), tiles_m, split)
    return dict(tile=cfg, split=split, split_len=split_len, stream_k=False, tiles_m=tiles_m, grid=grid)


def _left_to_gemm(tiles: int, steps: int, cfg: dict) -> bool:
    """Whether a call of ``tiles`` output tiles and ``steps`` K tiles is the bucket's GEMM's by the tile's
    ``min_tiles`` / ``long_k_steps`` / ``min_k_steps`` (see :func:`plan`)."""
    long_k = cfg.get("long_k_steps", 0)
    too_few_tiles = tiles < cfg.get("min_tiles", 0) and not (long_k and steps >= long_k)
    return too_few_tiles or steps < cfg.get("min_k_steps", 0)


def _scratch_parts(m: int, n: int, k: int, go: dict, act_order: bool = False) -> tuple[int, int, int, int]:
    """Bytes of the scratch's four parts: x gathered (fp16 / bf16); a split launch's fp32 sum or partials (one a
    split), or the stream-K slots (two a program, a tile each); the stream-K counts (int32, one a tile); x
    transposed for an act-order gather's transposed route (``x_gather.gather_scratch``)."""
    cfg = go["tile"]
    xg, xt = gather_scratch(m, k, 2, act_order)
    if go["stream_k"]:
        return (xg, scratch_aligned(4 * 2 * go["programs"] * cfg["BLOCK_N"] * cfg["BLOCK_M"]),
                scratch_aligned(4 * go["tiles"]), xt)
    if go["split"] == 1:
        return xg, 0, 0, xt
    sums = go["split"] if split_out_mode(cfg) == 1 else 1
    return xg, scratch_aligned(4 * sums * m * n), 0, xt


def workspace_bytes(m: int, n: int, k: int, launch: dict, act_order: bool = False) -> int:
    """Scratch bytes of :func:`launch` (:func:`_scratch_parts`)."""
    return sum(_scratch_parts(m, n, k, launch, act_order))


def launch(go: dict, x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
           act_perm: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, zero_offset: int,
           o2: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run the plan ``go`` (:func:`plan`) of ``x2 @ W^T``: writes ``o2`` (+ bias) and returns None with one split or
    stream-K; with several splits, returns the fp32 sum ``(M, N)`` or the partials ``(S, M, N)`` (the tile's
    ``reduce``) for the caller to finish (+ bias, cast).
    Scratch comes from ``workspace`` (:func:`workspace_bytes`) where it is large enough. :func:`call_refusal`
    must have said None."""
    from ..int_weight import qweight_strides

    m, k = x2.shape
    n = o2.shape[1]
    cfg = go["tile"]
    x_bytes, sum_bytes, count_bytes, xt_bytes = _scratch_parts(m, n, k, go, act_perm is not None)
    xg = workspace_view(workspace, (m, k), x2.dtype, x2.device)
    xt = None
    if xt_bytes:
        xt = workspace_view(workspace, (m * k,), x2.dtype, x2.device, offset=x_bytes + sum_bytes + count_bytes)
    out_mode = split_out_mode(cfg) if go["split"] > 1 else 0
    parts = counts = None
    if go["stream_k"]:
        parts = workspace_view(workspace, (sum_bytes // 4,), torch.float32, x2.device, offset=x_bytes)
        counts = workspace_view(workspace, (go["tiles"],), torch.int32, x2.device, offset=x_bytes + sum_bytes)
    if out_mode == 0:
        y = o2
    else:
        sums = (go["split"], m, n) if out_mode == 1 else (m, n)
        y = workspace_view(workspace, sums, torch.float32, x2.device, offset=x_bytes)
    # the gather (one launch, or two through xt) also zeroes what the kernel counts or adds into; the kernel is
    # its programmatic dependent, and it the dependent of the launch ahead (where the GPU has PDL: every GPU this
    # kernel runs on)
    pdl = pdl_launch(x2.device)
    gather_x(x2, act_perm, xg, y if out_mode == 2 else counts, pdl, xt=xt, dependent=True)
    stride_qw, stride_qslab = qweight_strides(qweight)
    _wgmma_w4_kernel[go["grid"]](
        xg, qweight, scales, qzeros if qzeros is not None else qweight, bias if bias is not None else scales, y,
        parts if parts is not None else y, counts if counts is not None else qweight,
        m, n, k, xg.stride(0), stride_qw, stride_qslab, scales.stride(0),
        qzeros.stride(0) if qzeros is not None else 0, y.stride(-2), go.get("split_len", k), zero_offset,
        go["tiles_m"], go.get("run", 0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_M=cfg["BLOCK_M"], BLOCK_K=cfg["BLOCK_K"],
        GROUP=0 if group_size == -1 else group_size, STAGES=cfg["STAGES"], HAS_ZEROS=qzeros is not None,
        HAS_BIAS=bias is not None and out_mode == 0, OUT_MODE=out_mode, WARPS=cfg.get("WARPS", 4),
        STREAM_K=go["stream_k"], num_warps=cfg.get("WARPS", 4), **({"launch_pdl": True} if pdl else {}))
    return None if out_mode == 0 else y


def wgmma_mm(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
             act_perm: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, zero_offset: int,
             tile: dict | None = None, split: int | None = 1) -> torch.Tensor:
    """``x2 @ W^T`` (+ bias) for a 4-bit weight as qops prepares it (flat or slab qweight), x2 ``(M, K)``, with
    this tile whatever the table says (tests, probes): ``split`` K splits, or with None the tile's own choice
    (stream-K where it says ``stream_k``) over this GPU's SMs, whatever its ``min_tiles``. The launch and the split
    sum's reduction are the op's own (``int_weight._run_wgmma``)."""
    from .int_weight import _run_wgmma  # that module imports this one

    m, k = x2.shape
    n = scales.shape[1]
    cfg = {**DEFAULT_TILE, **(tile or {}), **({} if split is None else {"split": split}), "min_tiles": 0}
    why = refusal(x2, 4, group_size, k, n, cfg["BLOCK_K"])
    if why is not None:
        raise ValueError(f"wgmma_mm: {why}")
    go = plan(m, n, k, 4, group_size, cfg, sm_count(x2.device, 1))
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    if m == 0:
        return y
    _run_wgmma({"launch": go}, x2, qweight, scales, qzeros, act_perm, bias, group_size, zero_offset, y, None)
    return y
