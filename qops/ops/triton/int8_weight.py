"""Triton lowering of ``qops::mm_int8_weight``: int8 weight-only, per-channel scales, on CUDA.

Reads the runtime layout of :mod:`qops.ops.int8_weight` (qweight ``(N, K)`` int8, scales ``(N,)``).
Two ways to compute ``y = x @ (q * s).T + bias``, chosen per call from the number of rows M and the
config table below (never from tensor values, never with a host sync):

- **gemv** (M <= ``gemv_max_m``): one program per (row of x, ``BLOCK_N`` weight rows, K split).
  Each thread streams 16 contiguous weight bytes per step (a warp reads 512 contiguous bytes of
  one row), turns int8 into fp32 without a conversion instruction (``q + 0x4B000080`` read as a
  float is ``2**23 + 128 + q``; one FADD removes the bias exactly) and accumulates ``q * x``
  element-wise in fp32; the per-channel scale multiplies the row sum once at the end.
- **gemm** (larger M): a tiled ``tl.dot`` GEMM. int8 tiles become fp16 with the same trick at
  half precision (``q + 0x6480`` read as fp16 is ``1152 + q``), exact; bf16 goes through fp32.
  fp32 activations use an IEEE (not TF32) dot. The scale multiplies the fp32 accumulator.

When the (M, N) tiles alone cannot fill the GPU, K is split: partial sums are added atomically into
a zeroed fp32 ``(M, N)`` buffer (the caller's ``workspace`` when it is large enough), then cast and
biased by one reduction launch; on a GPU with PDL the three launches are chained (``common.split_sum``).
Configs are data (``CONFIGS``), keyed by path and bucketed M; :func:`config_override` swaps them for tests
and tuning sweeps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import unit_stride
from .common import (ConfigTable, finish, grouped_tile, output_2d, pow2_at_most, reduce_sums, rows_2d, sm_count, split_k,
                     split_sum, store_row, store_tile)

CONFIGS: dict = {
    # One program per row of x reads the weights once per row: at M = 2 the GEMV took 1.7x its M = 1
    # time (60.7 / 30.6 / 212 / 106 us on the four large shapes) where the GEMM at M = 4 took 38.0 /
    # 28.5 / 150 / 75.9 us (benchmarks/results/h200-2026-11-30-418adfb-bnb-int8.json): M >= 2 tiles.
    "gemv_max_m": 1,
    # Programs wanted per SM before K is split (memory-bound: enough bytes in flight per SM).
    # From the H200 sweep of rows x bytes per step x warps x stages at M = 1 (9f03903,
    # benchmarks/results/h200-2026-11-30-9f03903-int8-sweep.json): 2 rows x 1024 bytes on 2 warps
    # (32 bytes a thread per step) was best on all four large shapes, 80/77/92/89% of the roofline,
    # where the untuned 4 rows x 1024 bytes on 4 warps measured 74/59/87/78% in the same run. One row
    # a program lost here (63-78% at its best), unlike the FP8 GEMV: this kernel keeps a (rows, BLOCK_K) fp32
    # accumulator and reduces it once at the end. Stages 2-4 were within 1%.
    "gemv": {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 2, "num_stages": 2, "programs_per_sm": 4, "max_split": 16},
    # (largest M of the bucket, tile config); the last bucket takes every larger M.
    # Register counts from ptxas (triton 3.6, sm_90): 168, 168, 116, 128, 219; no spills.
    "gemm": [
        (16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}),
        (32, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}),
        (64, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4}),
        (128, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}),
        (1 << 62, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
    ],
    "gemm_max_split": 8,
    "GROUP_M": 8,
}


TABLE = ConfigTable(CONFIGS)
config_override = TABLE.override
INTERPRETER_SMS = 8  # SM count assumed under Triton's CPU interpreter (tests)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _i8_to_f32(w):
    """int8 -> fp32 exactly, with an integer add and a float subtract (no I2F)."""
    return (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _i8_to(w, DT: tl.constexpr):
    """int8 -> ``DT`` exactly; fp16 with the half-precision magic number 1152."""
    if DT == tl.float16:
        return (w.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
    else:
        return _i8_to_f32(w).to(DT)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, split_len,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """PDL (ATOMIC, ``common.split_sum``): launched as the programmatic dependent of the sum's zeroing, the adds
    wait for it; the reduction after it may be placed once every program has started."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + m * stride_xm
    k_lo = pid_k * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :] * stride_wk, mask=nmask[:, None], other=0, eviction_policy="evict_first")
            xv = tl.load(x_row + kk * stride_xk)
        else:
            kmask = kk < k_hi
            w = tl.load(w_rows + kk[None, :] * stride_wk, mask=nmask[:, None] & kmask[None, :], other=0,
                        eviction_policy="evict_first")
            xv = tl.load(x_row + kk * stride_xk, mask=kmask, other=0.0)
        acc += _i8_to_f32(w) * xv.to(tl.float32)[None, :]
    r = tl.sum(acc, axis=1) * tl.load(s_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    store_row(y_ptr, bias_ptr, r, m, offs_n, nmask, stride_ym, stride_yn, HAS_BIAS, ATOMIC, PDL)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, split_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
):
    """PDL: as :func:`_gemv_kernel`'s."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    DT: tl.constexpr = x_ptr.dtype.element_ty
    k_lo = pid_k * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :] * stride_xk, mask=mmask[:, None], other=0.0)
            b = tl.load(w_rows + kk[None, :] * stride_wk, mask=nmask[:, None], other=0)
        else:
            kmask = kk < k_hi
            a = tl.load(x_rows + kk[None, :] * stride_xk, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :] * stride_wk, mask=nmask[:, None] & kmask[None, :], other=0)
        bt = tl.trans(_i8_to(b, DT))
        if IEEE:
            acc = tl.dot(a, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bt, acc)
    acc = acc * tl.load(s_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, mmask, nmask, stride_ym, stride_yn, HAS_BIAS, ATOMIC, PDL)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def plan(m: int, n: int, k: int, device: torch.device) -> dict:
    """Which path and launch parameters serve an (M, N, K) problem: static facts only."""
    sms = sm_count(device, INTERPRETER_SMS)
    if m <= TABLE["gemv_max_m"]:
        cfg = TABLE["gemv"]
        bk = pow2_at_most(k, cfg["BLOCK_K"])
        bn = cfg["BLOCK_N"]
        tiles = m * triton.cdiv(n, bn)
        split, per = split_k(k, bk, tiles, cfg["programs_per_sm"] * sms, cfg["max_split"])
        return dict(path="gemv", BLOCK_N=bn, BLOCK_K=bk, split=split, split_len=per, num_warps=cfg["num_warps"],
                    num_stages=cfg.get("num_stages", 3), grid=(m, triton.cdiv(n, bn), split), EVEN_K=k % bk == 0)
    cfg = TABLE.gemm(m)
    bm = pow2_at_most(m, cfg["BLOCK_M"])
    bn = pow2_at_most(n, cfg["BLOCK_N"])
    bk = pow2_at_most(k, cfg["BLOCK_K"])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split, per = split_k(k, bk, tiles, sms, TABLE["gemm_max_split"])
    return dict(path="gemm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split=split, split_len=per,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(tiles, split), EVEN_K=k % bk == 0)


def triton_mm(x, qweight, scales, bias, out=None, workspace=None):
    """Lowering entry (contract of ``qops.ops.int_weight.reference_mm``)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    x2 = rows_2d(x)
    m = x2.shape[0]
    y2 = output_2d(x2, n, out)
    if m == 0 or n == 0:
        return finish(y2, None, bias, x, n, out)
    if k == 0:
        y2.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(y2))
        return finish(y2, None, None, x, n, out)
    p = plan(m, n, k, x.device)
    atomic = p["split"] > 1
    acc, pdl = split_sum(workspace, m, n, x.device) if atomic else (None, False)
    dst = acc if atomic else y2
    chain = {"PDL": True, "launch_pdl": True} if pdl else {}
    scales, bias = unit_stride(scales), unit_stride(bias)
    b = bias if bias is not None else scales
    common = (x2, qweight, scales, b, dst, m, n, k, x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1),
              dst.stride(0), dst.stride(1), p["split_len"])
    if p["path"] == "gemv":
        _gemv_kernel[p["grid"]](*common, BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"], HAS_BIAS=bias is not None,
                                ATOMIC=atomic, EVEN_K=p["EVEN_K"], num_warps=p["num_warps"], num_stages=p["num_stages"],
                                **chain)
    else:
        _gemm_kernel[p["grid"]](*common, BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_K=p["BLOCK_K"],
                                GROUP_M=TABLE["GROUP_M"], HAS_BIAS=bias is not None, ATOMIC=atomic,
                                EVEN_K=p["EVEN_K"], IEEE=x.dtype == torch.float32,
                                num_warps=p["num_warps"], num_stages=p["num_stages"], **chain)
    if atomic:  # the fp32 sum, + bias, cast: one launch (the kernel's programmatic dependent where chained)
        reduce_sums(acc, bias, y2, 1, pdl)
    return finish(y2, None, None, x, n, out)
