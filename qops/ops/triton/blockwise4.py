"""Triton lowering of ``qops::mm_blockwise4``: 4-bit codebook weights (bitsandbytes NF4 / FP4) on CUDA.

Reads the runtime layout of :mod:`qops.ops.blockwise4` as is: the flat nibble stream (element 2i in
the high nibble of byte i), the 16-entry codebook, and the block absmax, nested or not. The capability
table only sends weights with ``K % blocksize == 0`` here, so every row starts on a byte and a block
never spans two rows: byte j of row n holds K indices 2j and 2j+1 and belongs to block
``n * K/B + 2j // B``.

- **gemv** (M <= ``gemv_max_m``): a program owns ``BLOCK_N`` rows and walks its K split in steps
  of ``SUB_BLOCKS`` x ``SUB_BYTES`` bytes per row (a 3-D tile; a sub-block never straddles a
  quantization block, so one absmax serves it). Threads load 16 contiguous bytes; each byte's two
  codes are looked up in the codebook (an L1-resident 64-byte table) and multiplied by the matching
  even/odd activations (loaded contiguously and split in registers). Nested absmax is de-nested in
  the kernel, once per (row, sub-block): ``nested_code[u8] * nested_absmax[b // 256] + offset``.
- **gemm** (larger M): ``tl.dot`` on tensor cores. A K step of ``BLOCK_K`` values (at most one
  block) is two dots, even and odd K against the high and low nibbles, so no interleaving is
  needed; the block absmax scales the step's fp32 product once per output element (small
  ``BLOCK_M``), or the weight tile before the dots (large ``BLOCK_M``, where a second fp32
  accumulator would spill).

Split-K, workspace and configs as in :mod:`qops.ops.triton.int8_weight`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ConfigTable, finish, fp32_scratch, grouped_tile, output_2d, pow2_at_most, rows_2d, sm_count, split_k, store_row, store_tile

CONFIGS: dict = {
    "gemv_max_m": 2,
    # Bytes per row per step = SUB_BLOCKS * SUB_BYTES (SUB_BYTES is capped at blocksize/2).
    # Untuned defaults: 4 rows x 512 bytes per step (one row per warp, 16 B per thread).
    "gemv": {"BLOCK_N": 4, "STEP_BYTES": 512, "SUB_BYTES": 32, "num_warps": 4, "programs_per_sm": 4, "max_split": 16},
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


@triton.jit
def _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blk, mask, NESTED: tl.constexpr, NESTED_BS: tl.constexpr):
    """fp32 absmax of blocks ``blk``: plain, or de-nested from uint8 through the 256-entry code."""
    if NESTED:
        q = tl.load(am_ptr + blk, mask=mask, other=0).to(tl.int32)
        return tl.load(ncode_ptr + q) * tl.load(nam_ptr + blk // NESTED_BS, mask=mask, other=0.0) + noff
    else:
        return tl.load(am_ptr + blk, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, code_ptr, am_ptr, ncode_ptr, nam_ptr, noff_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_ym, stride_yn, split_bytes,
    BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, BLOCK_N: tl.constexpr, SUB_BLOCKS: tl.constexpr,
    SUB_BYTES: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    row_bytes = K // 2
    blocks_per_row = K // BLOCKSIZE
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * row_bytes
    row_blk = offs_n.to(tl.int64) * blocks_per_row
    sub = tl.arange(0, SUB_BLOCKS)
    sub_bytes = sub[:, None] * SUB_BYTES + tl.arange(0, SUB_BYTES)[None, :]  # [SUB_BLOCKS, SUB_BYTES]
    pair = tl.arange(0, 2)
    x_row = x_ptr + m * stride_xm
    if NESTED:
        noff = tl.load(noff_ptr)
    else:
        noff = 0.0
    kb_lo = pid_k * split_bytes
    kb_hi = tl.minimum(row_bytes, kb_lo + split_bytes)
    STEP: tl.constexpr = SUB_BLOCKS * SUB_BYTES
    acc = tl.zeros([BLOCK_N, SUB_BLOCKS, SUB_BYTES], tl.float32)
    for kb0 in range(kb_lo, kb_hi, STEP):
        bo = kb0 + sub_bytes
        sub_start = kb0 + sub * SUB_BYTES
        xk = (2 * bo)[:, :, None] + pair[None, None, :]
        if EVEN_K:
            smask = nmask[:, None]
            b = tl.load(w_rows[:, None, None] + bo[None, :, :], mask=nmask[:, None, None], other=0,
                        eviction_policy="evict_first")
            xx = tl.load(x_row + xk * stride_xk)
        else:
            live = sub_start < kb_hi
            smask = nmask[:, None] & live[None, :]
            b = tl.load(w_rows[:, None, None] + bo[None, :, :], mask=smask[:, :, None], other=0,
                        eviction_policy="evict_first")
            xx = tl.load(x_row + xk * stride_xk, mask=live[:, None, None], other=0.0)
        x_even, x_odd = tl.split(xx.to(tl.float32))
        bi = b.to(tl.int32)
        c_hi = tl.load(code_ptr + (bi >> 4), eviction_policy="evict_last")
        c_lo = tl.load(code_ptr + (bi & 15), eviction_policy="evict_last")
        blk = row_blk[:, None] + (2 * sub_start // BLOCKSIZE)[None, :]
        s = _block_absmax(am_ptr, ncode_ptr, nam_ptr, noff, blk, smask, NESTED, NESTED_BS)
        acc += (c_hi * x_even[None, :, :] + c_lo * x_odd[None, :, :]) * s[:, :, None]
    r = tl.sum(tl.sum(acc, axis=2), axis=1)
    store_row(y_ptr, bias_ptr, r, m, offs_n, nmask, stride_ym, stride_yn, HAS_BIAS, ATOMIC)


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


def plan(m: int, n: int, k: int, blocksize: int, device: torch.device) -> dict:
    """Which path and launch parameters serve an (M, N, K, blocksize) problem: static facts only."""
    sms = sm_count(device, INTERPRETER_SMS)
    row_bytes = k // 2
    half_block = blocksize // 2
    if m <= TABLE["gemv_max_m"]:
        cfg = TABLE["gemv"]
        sub_bytes = min(cfg["SUB_BYTES"], half_block)
        step = max(sub_bytes, min(cfg["STEP_BYTES"], triton.next_power_of_2(row_bytes)))
        bn = cfg["BLOCK_N"]
        tiles = m * triton.cdiv(n, bn)
        split, per = split_k(row_bytes, step, tiles, cfg["programs_per_sm"] * sms, cfg["max_split"])
        return dict(path="gemv", BLOCK_N=bn, SUB_BLOCKS=step // sub_bytes, SUB_BYTES=sub_bytes, split=split,
                    split_bytes=per, num_warps=cfg["num_warps"], grid=(m, triton.cdiv(n, bn), split),
                    EVEN_K=row_bytes % step == 0)
    cfg = TABLE.gemm(m)
    bm = pow2_at_most(m, cfg["BLOCK_M"])
    bn = pow2_at_most(n, cfg["BLOCK_N"])
    bk = min(cfg["BLOCK_K"], blocksize)  # 32 <= bk, divides the block: one absmax per step
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, per = split_k(row_bytes, bk // 2, tiles, sms, TABLE["gemm_max_split"])
    return dict(path="gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split=split, split_bytes=per,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(tiles, split))


def triton_mm(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
              nested_blocksize, out=None, workspace=None):
    """Lowering entry (contract of ``qops.ops.int_weight.reference_mm``); needs K % blocksize == 0."""
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
    nested = absmax.dtype == torch.uint8
    p = plan(m, n, k, blocksize, x.device)
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
    if p["path"] == "gemv":
        _gemv_kernel[p["grid"]](*common, BLOCK_N=p["BLOCK_N"], SUB_BLOCKS=p["SUB_BLOCKS"], SUB_BYTES=p["SUB_BYTES"],
                                EVEN_K=p["EVEN_K"], **flags)
    else:
        _gemm_kernel[p["grid"]](*common, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
                                GROUP_M=TABLE["GROUP_M"], IEEE=x.dtype == torch.float32,
                                SCALE_AFTER=p["BLOCK_M"] <= TABLE["scale_after_max_block_m"],
                                num_stages=p["num_stages"], **flags)
    return finish(y2, acc, bias, x, n, out)
