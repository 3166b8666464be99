"""Triton lowering of the fp8 op family on CUDA: ``qops::mm_fp8_weight`` (W8A16) and
``qops::scaled_mm_fp8`` (W8A8 where cuBLASLt cannot serve: odd N or K, block scales other than 128 x 128
with N, K multiples of 128 on sm_90, GPUs without FP8 GEMM support), with per-tensor or per-token
activation scales only (per-token-group scales are declared not served: ``qops.lowerings``).

Reads the runtime layout of :mod:`qops.ops.fp8`: ``weight`` float8_e4m3fn ``(N, K)`` row-major (read
as bytes), ``weight_scale`` fp32 ``(S_n, S_k)`` with blocks ``block_n x block_k`` (-1: whole dim).
Two kernels, chosen per call from the number of rows M (a shape, never a tensor value):

- **gemv** (M <= ``GEMV_MAX_M``): each program multiplies ``BLOCK_N`` weight rows by the (at most 4)
  activation rows on CUDA cores -- at this M tensor cores would idle -- with 16-byte loads along K.
  ``BLOCK_N`` shrinks until the rows alone give every SM several programs; when N is too small for
  that, K is split and partial sums are added atomically into a zeroed fp32 ``(M, N)`` buffer: the
  caller's ``workspace`` when it holds :func:`workspace_bytes`, else one from torch's allocator.
  Not when deterministic results are requested (``qops.ops._common.deterministic_requested``, read
  at each call): atomic adds meet in a varying order, so K is then never split.
- **gemm**: ``tl.dot`` tiles with fp32 accumulation, grouped tile order for L2 reuse; fp8 activations
  on FP8-capable GPUs go to the tensor cores as fp8.

fp8 -> fp16/bf16/fp32 happens in registers. On compute capability >= 8.9 Triton's ``float8e4nv``
cast (hardware ``cvt``). Below that an exact bit move: e4m3's sign, exponent and mantissa bits placed
into an fp16 (``sign << 15 | (bits & 0x7F) << 7``) give the value / 256 -- fp16's exponent bias is 15
against e4m3's 7, and fp16 subnormals cover e4m3's -- and the 256 is folded into the scale. Scales
constant along K multiply the fp32 accumulator once; block scales multiply each K tile's fp32
partial product (the K tile lies inside one block: ``BLOCK_K`` divides ``block_k``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._common import deterministic_requested, unit_stride
from .common import grouped_tile, pick_bucket, reduce_sums, sm_count, split_sum

FP8 = torch.float8_e4m3fn
GEMV_MAX_M = 4
# gemv launch, from two H200 sweeps at M = 1. The first (85c0cb8,
# benchmarks/results/h200-2026-11-30-85c0cb8-fp8-sweep.json: 2-32 rows, 4-16 KiB tiles, 4/8 warps,
# split 1/2/4) found 2048 weight bytes per row per K step and no split-K best, with 8 rows from
# N = 8192 and 2 below, 4 warps (83/70/87/92% of the roofline on the four large shapes, timed in the
# second sweep's run). The second
# (9f03903, ...-9f03903-fp8-sweep-2.json: 1-8 rows, 1-4 KiB steps, 2/4/8 warps, 2-4 stages) found one
# row of 2048 bytes a step on 2 warps (32 bytes a thread) better on all four: 87/80/97/93%. One row a
# program gives the most programs (a likely reason: the last wave's tail is shortest; not profiled);
# 4096-byte steps were 1-2% faster on three shapes and 6% slower on 4096x14336. The pipeline
# depth did not matter (2-4 stages within 1%). No split-K once the rows give every SM
# GEMV_PROGRAMS_PER_SM programs.
GEMV_ROW_BYTES = 2048
GEMV_BLOCK_N = 1
GEMV_WARPS = 2
GEMV_PROGRAMS_PER_SM = 4
# gemm: (largest M of the bucket, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages);
# the last bucket takes every larger M. BLOCK_N of the small-M buckets shrinks (not below 16) until
# the tiles fill the GPU.
GEMM_CONFIGS = (
    (16, 16, 64, 256, 1, 4, 4),
    (32, 32, 64, 128, 1, 4, 4),
    (64, 64, 64, 128, 8, 4, 4),
    (256, 64, 128, 128, 8, 4, 4),
    (None, 128, 128, 64, 8, 8, 4),
)


@triton.jit
def _e4m3_to(bits, DTYPE: tl.constexpr, NATIVE: tl.constexpr):
    """uint8 e4m3fn bit patterns -> DTYPE, exactly: the value (NATIVE) or the value / 256."""
    if NATIVE:
        return bits.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    else:
        b = bits.to(tl.uint16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.float16, bitcast=True).to(DTYPE)


@triton.jit
def _epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_k, xs_ptr, ws_ptr, b_ptr, out_ptr,
              stride_xsm, stride_sn, stride_om, scale_bn,
              POST: tl.constexpr, K_BLOCKED: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
              ATOMIC: tl.constexpr, ZERO_WAIT: tl.constexpr = False):
    acc = acc * POST
    if not K_BLOCKED:
        s = tl.load(ws_ptr + (offs_n // scale_bn) * stride_sn, mask=n_mask, other=0.0)
        acc = acc * s[None, :]
    if HAS_X_SCALE:
        xs = tl.load(xs_ptr + offs_m * stride_xsm, mask=m_mask, other=0.0)
        acc = acc * xs[:, None]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + tl.where(pid_k == 0, bias, 0.0)[None, :]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        if ZERO_WAIT:  # launched as the programmatic dependent of the sum's zeroing (common.split_sum)
            tl.extra.cuda.gdc_wait()
        tl.atomic_add(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
    scale_bn, scale_bk,
    X_FP8: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, K_BLOCKED: tl.constexpr,
    NATIVE: tl.constexpr, POST: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    # PDL (ATOMIC, common.split_sum): its adds wait for the sum's zeroing; the reduction after it may be placed
    # once every program has started
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    s_rows = offs_n // scale_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Masks compare with K itself (specialized as a multiple of 16 when it is one), so the loads stay
    # 16 bytes wide; the last split's tiles past K are fully masked.
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0)
        wf = _e4m3_to(w, tl.float32, NATIVE)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0)
        if X_FP8:
            xf = _e4m3_to(x, tl.float32, NATIVE)
        else:
            xf = x.to(tl.float32)
        if BLOCK_M == 1:
            part = tl.sum(wf * xf, axis=1)[None, :]
        else:
            part = tl.sum(xf[:, None, :] * wf[None, :, :], axis=2)
        if K_BLOCKED:
            # Tiles past K contribute 0; their scale index is clamped to stay in bounds.
            s = tl.load(ws_ptr + s_rows * stride_sn + (tl.minimum(k0, K - 1) // scale_bk) * stride_sk, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    _epilogue(acc, offs_m, offs_n, m_mask, n_mask, pid_k, xs_ptr, ws_ptr, b_ptr, out_ptr,
              stride_xsm, stride_sn, stride_om, scale_bn, POST, K_BLOCKED, HAS_X_SCALE, HAS_BIAS, ATOMIC, PDL)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_xsm, stride_wn, stride_wk, stride_sn, stride_sk, stride_om,
    scale_bn, scale_bk,
    X_FP8: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, K_BLOCKED: tl.constexpr,
    NATIVE: tl.constexpr, POST: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    s_rows = offs_n // scale_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0)
        if X_FP8 and NATIVE:
            a = x.to(tl.float8e4nv, bitcast=True)
            b = w.to(tl.float8e4nv, bitcast=True)
        else:
            if X_FP8:
                a = _e4m3_to(x, COMPUTE, NATIVE)
            else:
                a = x.to(COMPUTE)
            b = _e4m3_to(w, COMPUTE, NATIVE)
        # max_num_imprecise_acc=0: fp8 dots on sm_90 otherwise accumulate in reduced precision.
        if K_BLOCKED:
            part = tl.dot(a, tl.trans(b), input_precision=PRECISION, max_num_imprecise_acc=0)
            s = tl.load(ws_ptr + s_rows * stride_sn + (k0 // scale_bk) * stride_sk, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION, max_num_imprecise_acc=0)
    _epilogue(acc, offs_m, offs_n, m_mask, n_mask, 0, xs_ptr, ws_ptr, b_ptr, out_ptr,
              stride_xsm, stride_sn, stride_om, scale_bn, POST, K_BLOCKED, HAS_X_SCALE, HAS_BIAS, False)


@functools.cache
def _native_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gemv_config(m: int, n: int, k: int, block_k_scale: int, sms: int) -> dict:
    """Launch configuration of the gemv kernel (M <= GEMV_MAX_M); one K split when deterministic
    results are requested (the splits meet through atomic adds, whose order varies)."""
    block_m = triton.next_power_of_2(m)
    block_n = GEMV_BLOCK_N
    block_k = max(64, GEMV_ROW_BYTES // block_m)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if block_k_scale > 0:
        block_k = min(block_k, block_k_scale)
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(GEMV_PROGRAMS_PER_SM * sms // programs, steps // 2))  # 1 for the large shapes
    if deterministic_requested():
        split_k = 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=GEMV_WARPS)


def _gemv_launch(m: int, n: int, k: int, block_k_scale: int, sms: int, config: dict | None) -> tuple[dict, int, int]:
    """(kernel config, split count, K per split) of a gemv call: what :func:`triton_mm` launches
    and :func:`workspace_bytes` sizes, from one computation."""
    cfg = dict(config or gemv_config(m, n, k, block_k_scale, sms))
    split_k = cfg.pop("SPLIT_K")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    return cfg, (triton.cdiv(k, k_per_split) if k else 1), k_per_split


def workspace_bytes(m: int, n: int, k: int, block_k: int, device: torch.device) -> int:
    """Scratch bytes :func:`triton_mm` uses for an (m, K) x (K, N) product on ``device``: the fp32
    split-K accumulator ``4*M*N`` of the gemv kernel when it splits K, else 0."""
    if m <= 0 or n <= 0 or m > GEMV_MAX_M:
        return 0
    split_k = _gemv_launch(m, n, k, block_k, sm_count(device, 4), None)[1]
    return 4 * m * n if split_k > 1 else 0


def gemm_config(m: int, n: int, k: int, block_k_scale: int, sms: int) -> dict:
    """Launch configuration of the gemm kernel."""
    max_m, bm, bn, bk, group_m, warps, stages = pick_bucket(GEMM_CONFIGS, m)
    if max_m is not None and max_m <= 64:
        while bn > 16 and triton.cdiv(n, bn) * triton.cdiv(m, bm) < GEMV_PROGRAMS_PER_SM * sms:
            bn //= 2
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    if block_k_scale > 0:
        bk = min(bk, block_k_scale)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def triton_mm(x, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, out=None, workspace=None, *, native_fp8=None,
              config=None):
    """Lowering entry (contract in :func:`qops.ops.fp8.reference_mm`, ``out`` and ``workspace`` included).

    ``native_fp8`` (default: compute capability >= 8.9) and ``config`` (a gemv or gemm config dict)
    override the choices made from the device and M, for tests and tuning (a given gemv config's
    ``SPLIT_K`` is used as given, deterministic request or not).
    """
    n, k = weight.shape
    lead = x.shape[:-1]
    a = x.reshape(-1, k)
    m = a.shape[0]
    y = _rows_of(out, m, n)
    in_place = y is not None
    if not in_place:
        y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return _result(y, out, in_place, lead, n)
    native = _native_fp8(x.device) if native_fp8 is None else native_fp8
    x_fp8 = x.dtype == FP8
    if x_fp8:
        a = a.view(torch.uint8)
    w = weight.view(torch.uint8)
    k_blocked = block_k != -1
    if k_blocked and (block_k & (block_k - 1) or block_k < 32):
        raise ValueError(f"qops.triton_fp8: block_k must be -1 or a power of two >= 32, got {block_k}")
    if x_scale is not None and x_scale.numel() not in (1, m):
        # Per-token-group scales vary along K; the kernels multiply the accumulator by one scale a row
        # (qops.lowerings declares it: the chooser and the op never send them here).
        raise ValueError(f"qops.triton_fp8: x_scale must be per tensor or per token ({m} rows), got shape {tuple(x_scale.shape)}")
    xs = x_scale.reshape(-1) if x_scale is not None else weight_scale
    stride_xsm = xs.stride(0) if xs.numel() > 1 else 0
    post = (1.0 if native else 256.0) * (1.0 if native or not x_fp8 else 256.0)
    sms = sm_count(x.device, 4)  # 4 under Triton's CPU interpreter: a few programs per launch keep tests fast
    args = dict(
        stride_xm=a.stride(0), stride_xk=a.stride(1), stride_xsm=stride_xsm,
        stride_wn=w.stride(0), stride_wk=w.stride(1),
        stride_sn=weight_scale.stride(0), stride_sk=weight_scale.stride(1),
        scale_bn=n if block_n == -1 else block_n, scale_bk=block_k if k_blocked else max(k, 1),
        X_FP8=x_fp8, HAS_X_SCALE=x_scale is not None, HAS_BIAS=bias is not None, K_BLOCKED=k_blocked,
        NATIVE=native, POST=post,
    )
    b = unit_stride(bias) if bias is not None else weight_scale
    use_gemv = m <= GEMV_MAX_M if config is None else "SPLIT_K" in config
    if use_gemv:
        cfg, split_k, k_per_split = _gemv_launch(m, n, k, block_k, sms, config)
        target, pdl = (y, False) if split_k == 1 else split_sum(workspace, m, n, x.device)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split_k, triton.cdiv(m, cfg["BLOCK_M"]))
        _fp8_gemv_kernel[grid](a, xs, w, weight_scale, b, target, m, n, k, k_per_split,
                               stride_om=target.stride(0), ATOMIC=split_k > 1, **args, **cfg,
                               **({"PDL": True, "launch_pdl": True} if pdl else {}))
        if split_k > 1:  # the fp32 sum (its bias added by split 0), cast: the kernel's programmatic dependent
            reduce_sums(target, None, y, 1, pdl)
    else:
        cfg = dict(config or gemm_config(m, n, k, block_k, sms))
        compute = tl.float16 if x_fp8 else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[x.dtype]
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
        _fp8_gemm_kernel[grid](a, xs, w, weight_scale, b, y, m, n, k, stride_om=y.stride(0),
                               COMPUTE=compute, PRECISION="ieee" if compute == tl.float32 else "tf32", **args, **cfg)
    return _result(y, out, in_place, lead, n)


def _rows_of(out: torch.Tensor | None, m: int, n: int) -> torch.Tensor | None:
    """The caller's ``out`` as the ``(M, N)`` rows the kernels write (unit column stride), if it can be."""
    if out is None:
        return None
    try:
        y = out.view(m, n)
    except RuntimeError:
        return None
    return y if n <= 1 or y.stride(1) == 1 else None


def _result(y: torch.Tensor, out: torch.Tensor | None, in_place: bool, lead, n: int) -> torch.Tensor:
    if out is None:
        return y.reshape(*lead, n)
    if not in_place:
        out.copy_(y.view(out.shape))
    return out
