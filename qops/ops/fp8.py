"""FP8 e4m3fn weight matmul (``fp8``, ``compressed-tensors-fp8``, ``fp8-block`` once prepared): ops,
runtime layout, argument checks shared with the fakes, activation quantization, and the pure-torch
reference kernel.

Runtime layout (what ``prepare_fp8_weight`` builds and every lowering reads; the checkpoint's own
tensors, not copied), K = in_features, N = out_features:

- ``weight`` float8_e4m3fn ``(N, K)``, row-major.
- ``weight_scale`` float32 ``(S_n, S_k)`` with ``S_n = 1 if block_n == -1 else ceil(N / block_n)``
  and ``S_k = 1 if block_k == -1 else ceil(K / block_k)``: per-tensor ``(-1, -1)``, per-channel
  ``(1, -1)``, blocks ``(bn, bk)``. ``W[n, k] = weight[n, k] * weight_scale[n // block_n, k // block_k]``
  (index 0 along a dimension whose block is -1).
- ``input_scale`` float32 ``(1,)`` or None: static per-tensor activation scale (W8A8 only).

Two mathematical contracts, two ops:

- ``qops::mm_fp8_weight`` (W8A16): ``y = x @ W.T + bias`` for float activations;
  ``qops::mm_fp8_weight_out`` writes the same into a caller-owned ``out`` and takes the caller's
  scratch (``workspace``) for the Triton GEMV's split-K accumulator.
- ``qops::scaled_mm_fp8`` (W8A8 GEMM): ``y = (x_fp8 * x_scale) @ W.T + bias`` for activations already
  quantized, ``x_scale`` per tensor ``(1,)``, per token ``(..., 1)`` or per token and group of 128
  consecutive K values ``(..., ceil(K / 128))`` (the last group partial when K % 128 != 0): DeepSeek-V3's
  1x128 activation quantization, which pairs with 128 x 128 weight blocks.

W8A8 with run-time activation quantization is :func:`mm_fp8`: :func:`quantize_fp8_activations` (plain
torch ops, so Inductor fuses them into whatever produces ``x``) followed by the opaque
``qops::scaled_mm_fp8``. Hiding the quantization inside the GEMM op would cost an extra read and write
of the activations that compilation could not remove. Whether the activations get one scale per token
or per token and group is fixed when the weight is prepared (``Fp8Weight.x_group_size``): groups for
128 x 128 blocks where the chosen lowering reads them (declared in ``qops.lowerings``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..formats.fp8 import FP8_DTYPE, FP8_MAX, FP8_MAX_INV, Fp8Quantized, dequantize_reference, expand_scale, scale_shape
from ..lowerings import (LOWERINGS_BY_KERNEL, LOWERINGS_BY_NAME, X_SCALE_GROUP, CallFacts, Choice, Kernel, WeightSpec, choose,
                         implementation)
from ._common import (ACT_DTYPES, bias_grad, check_bias, check_dequantize_dtype, check_devices, check_disjoint,
                      check_out, check_workspace, check_x, fail, frozen_weight_grads, refuse_gradients,
                      register_frozen_weight_autograd, save_frozen_weight)

FAMILY = "fp8"
ACTIVATIONS = ("auto", "none", "dynamic", "static")
# Smallest per-token scale: keeps an all-zero row finite (its values quantize to 0).
MIN_X_SCALE = torch.finfo(torch.float32).tiny


def check_fp8_weight(who: str, k, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int, block_k: int, device: torch.device):
    """Validate the runtime weight for ``k`` input features (None: the weight's own); returns N.

    Works on fake tensors.
    """
    for name, block in (("block_n", block_n), ("block_k", block_k)):
        if block != -1 and block <= 0:
            raise ValueError(fail(who, f"{name} must be -1 (one block spanning the dimension) or positive, got {block}"))
    check_devices(who, (("weight", weight), ("weight_scale", weight_scale)), device)
    torch._check_type(weight.dtype == FP8_DTYPE, lambda: fail(who, f"weight must be {FP8_DTYPE}, got {weight.dtype}"))
    torch._check_value(weight.dim() == 2, lambda: fail(who, f"weight must be 2-D (N, K), got {weight.dim()}-D"))
    n = weight.shape[0]
    if k is None:
        k = weight.shape[1]
    torch._check_value(weight.shape[1] == k, lambda: fail(who, f"weight must have K={k} columns (the last dimension of x), got shape {tuple(weight.shape)}"))
    sn, sk = scale_shape(n, k, block_n, block_k)
    torch._check_type(weight_scale.dtype == torch.float32, lambda: fail(who, f"weight_scale must be torch.float32, got {weight_scale.dtype}"))
    torch._check_value(
        weight_scale.dim() == 2 and weight_scale.shape[0] == sn and weight_scale.shape[1] == sk,
        lambda: fail(who, f"weight_scale must have shape ({sn}, {sk}) (N={n}, K={k}, block_n={block_n}, block_k={block_k}; -1 = one block over the dimension), got {tuple(weight_scale.shape)}"),
    )
    return n


def check_kernel(who: str, kernel: int, device: torch.device, act_dtype: torch.dtype, weight: torch.Tensor | None = None,
                 block_n: int = -1, block_k: int = -1, x_scale: str | None = None, out_dtype: torch.dtype | None = None) -> None:
    """``kernel`` names an fp8 lowering that runs on ``device`` and reads ``act_dtype`` activations
    (and, given the weight, whose declared capabilities -- N / K multiples, weight-scale blocks,
    activation-scale layout ``x_scale``, output dtype -- serve the call: the chooser never picks a
    lowering otherwise, a direct caller gets this error instead of one from inside the kernel)."""
    low = LOWERINGS_BY_KERNEL.get((FAMILY, kernel))
    if low is None:
        known = sorted(int(kid) for fam, kid in LOWERINGS_BY_KERNEL if fam == FAMILY)
        raise ValueError(fail(who, f"kernel must be one of {known} for {FAMILY}, got {kernel}"))
    if device.type != "meta" and device.type not in low.device_types:  # meta: shape inference, as lowering_for allows
        raise ValueError(fail(who, f"kernel={kernel} ({low.name}) runs on {sorted(low.device_types)}, but the inputs are on {device}"))
    if act_dtype not in low.act_dtypes:
        raise ValueError(fail(who, f"kernel={kernel} ({low.name}) reads {sorted(str(d) for d in low.act_dtypes)} activations, not {act_dtype}"))
    if weight is None:
        return
    n, k = weight.shape
    facts = CallFacts(bits=8, group_size=block_k, act_dtype=act_dtype, n=n, k=k, block_n=block_n, out_dtype=out_dtype, x_scale=x_scale)
    why = low.call_refusal(facts)
    if why is not None:
        raise ValueError(fail(who, f"kernel={kernel} ({low.name}) does not serve this call: {why}"))


def check_mm_fp8_weight(who, x, weight, weight_scale, bias, block_n, block_k, kernel) -> list:
    """Validate every argument of ``mm_fp8_weight``; returns the output shape."""
    check_x(who, x)
    n = check_fp8_weight(who, x.shape[-1], weight, weight_scale, block_n, block_k, x.device)
    check_bias(who, bias, n, x.device)
    check_kernel(who, kernel, x.device, x.dtype, weight, block_n, block_k, out_dtype=x.dtype)
    return [*x.shape[:-1], n]


def x_scale_groups(k) -> int:
    """Number of per-token-group activation scales for ``k`` input features: ``ceil(K / 128)``."""
    return -(-k // X_SCALE_GROUP)


def check_x_scale(who: str, x_scale: torch.Tensor, x: torch.Tensor) -> str:
    """``x_scale`` is float32 ``(1,)`` (per tensor), ``(*x.shape[:-1], 1)`` (per token) or
    ``(*x.shape[:-1], ceil(K / 128))`` (per token and group of 128 K values); returns which
    (``qops.lowerings.X_SCALE_LAYOUTS``). With K <= 128 a group is the whole token: "token"."""
    if x_scale.device != x.device:
        raise ValueError(fail(who, f"x_scale must be on {x.device} (the device of x_fp8), got {x_scale.device}"))
    torch._check_type(x_scale.dtype == torch.float32, lambda: fail(who, f"x_scale must be torch.float32, got {x_scale.dtype}"))
    lead = tuple(x.shape[:-1])
    groups = x_scale_groups(x.shape[-1])
    want = (f"(1,) (per tensor), {(*lead, 1)} (per token) or {(*lead, groups)} (per token and group of "
            f"{X_SCALE_GROUP} K values, K={x.shape[-1]})")
    if x_scale.dim() != x.dim():
        torch._check_value(x_scale.dim() == 1 and x_scale.shape[0] == 1, lambda: fail(who, f"x_scale must have shape {want}, got {tuple(x_scale.shape)}"))
        return "tensor"
    for i in range(x.dim() - 1):
        torch._check_value(x_scale.shape[i] == x.shape[i], lambda: fail(who, f"x_scale must have shape {want}, got {tuple(x_scale.shape)}"))
    last = x_scale.shape[-1]
    torch._check_value(last == 1 or last == groups, lambda: fail(who, f"x_scale must have shape {want}, got {tuple(x_scale.shape)}"))
    return "token" if last == 1 else "group"


def check_scaled_mm_fp8(who, x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, kernel) -> list:
    """Validate every argument of ``scaled_mm_fp8``; returns the output shape."""
    torch._check_type(x_fp8.dtype == FP8_DTYPE, lambda: fail(who, f"x_fp8 must be {FP8_DTYPE}, got {x_fp8.dtype}"))
    torch._check_value(x_fp8.dim() >= 1, lambda: fail(who, "x_fp8 must have at least one dimension (..., K)"))
    if out_dtype not in ACT_DTYPES:
        raise TypeError(fail(who, f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}"))
    layout = check_x_scale(who, x_scale, x_fp8)
    n = check_fp8_weight(who, x_fp8.shape[-1], weight, weight_scale, block_n, block_k, x_fp8.device)
    check_bias(who, bias, n, x_fp8.device)
    check_kernel(who, kernel, x_fp8.device, x_fp8.dtype, weight, block_n, block_k, layout, out_dtype)
    return [*x_fp8.shape[:-1], n]


# Block sizes and kernel ids are plain `int` (not SymInt): static facts of the weight that Dynamo
# must specialize on.
MM_WEIGHT_SCHEMA = "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int block_n, int block_k, int kernel) -> Tensor"
MM_WEIGHT_OUT_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int block_n, int block_k, int kernel, "
    "Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
SCALED_MM_SCHEMA = (
    "(Tensor x_fp8, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
    "int block_n, int block_k, ScalarType out_dtype, int kernel) -> Tensor"
)
DEQUANT_SCHEMA = "(Tensor weight, Tensor weight_scale, int block_n, int block_k, ScalarType dtype) -> Tensor"


@torch.library.custom_op("qops::mm_fp8_weight", mutates_args=(), schema=MM_WEIGHT_SCHEMA)
def mm_fp8_weight(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (S_n, S_k) float32
    bias: Optional[torch.Tensor],  # (N,) or None
    block_n: int,  # -1 (per tensor), 1 (per channel) or the block height
    block_k: int,  # -1 or the block width
    kernel: int,  # qops.lowerings.Kernel
) -> torch.Tensor:  # (..., N), dtype of x
    check_mm_fp8_weight("mm_fp8_weight", x, weight, weight_scale, bias, block_n, block_k, kernel)
    impl = implementation(FAMILY, kernel, x.device, "mm_fp8_weight")
    return impl(x, None, weight, weight_scale, bias, block_n, block_k, x.dtype)


@torch.library.custom_op("qops::mm_fp8_weight_out", mutates_args=("out", "workspace"), schema=MM_WEIGHT_OUT_SCHEMA)
def mm_fp8_weight_out(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (S_n, S_k) float32
    bias: Optional[torch.Tensor],  # (N,) or None
    block_n: int,
    block_k: int,
    kernel: int,
    out: torch.Tensor,  # (..., N), dtype of x, caller-owned; written
    workspace: Optional[torch.Tensor],  # caller-owned scratch (uint8); clobbered
) -> None:
    shape = check_mm_fp8_weight("mm_fp8_weight_out", x, weight, weight_scale, bias, block_n, block_k, kernel)
    check_out("mm_fp8_weight_out", out, shape, x)
    check_workspace("mm_fp8_weight_out", workspace, x)
    check_disjoint("mm_fp8_weight_out", (("out", out), ("workspace", workspace)),
                   (("x", x), ("weight", weight), ("weight_scale", weight_scale), ("bias", bias)))
    impl = implementation(FAMILY, kernel, x.device, "mm_fp8_weight_out")
    impl(x, None, weight, weight_scale, bias, block_n, block_k, x.dtype, out=out, workspace=workspace)


refuse_gradients("mm_fp8_weight_out", "mm_fp8_weight")


@torch.library.custom_op("qops::scaled_mm_fp8", mutates_args=(), schema=SCALED_MM_SCHEMA)
def scaled_mm_fp8(
    x_fp8: torch.Tensor,  # (..., K) float8_e4m3fn
    x_scale: torch.Tensor,  # (1,), (..., 1) or (..., ceil(K/128)) float32
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (S_n, S_k) float32
    bias: Optional[torch.Tensor],  # (N,) or None
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,  # float32 / float16 / bfloat16
    kernel: int,
) -> torch.Tensor:  # (..., N), out_dtype
    check_scaled_mm_fp8("scaled_mm_fp8", x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, kernel)
    impl = implementation(FAMILY, kernel, x_fp8.device, "scaled_mm_fp8")
    return impl(x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype)


@torch.library.custom_op("qops::dequantize_fp8", mutates_args=(), schema=DEQUANT_SCHEMA)
def dequantize_fp8(
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (S_n, S_k) float32
    block_n: int,
    block_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K)
    check_fp8_weight("dequantize_fp8", None, weight, weight_scale, block_n, block_k, weight.device)
    check_dequantize_dtype("dequantize_fp8", dtype)
    return dequantize_reference(weight, weight_scale, block_n, block_k).to(dtype).contiguous()  # row-major, as the fake says


def expand_x_scale_groups(x_scale: torch.Tensor, k: int) -> torch.Tensor:
    """Per-token-group scales ``(..., ceil(K / 128))`` -> the scale of every activation ``(..., K)``."""
    return x_scale.repeat_interleave(X_SCALE_GROUP, dim=-1)[..., :k]


def is_group_x_scale(x_scale: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether an ``x_scale`` already checked by :func:`check_x_scale` holds a scale per group of K
    (more than one per token)."""
    return x_scale.dim() == x.dim() and x_scale.shape[-1] > 1


def reference_mm(x, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, out=None, workspace=None) -> torch.Tensor:
    """The CPU kernel (and the GPU fallback): dequantize in fp32, matmul with fp32 accumulation.

    Lowering entry contract (every fp8 lowering's entry has it): arguments already validated; ``x``
    is float with ``x_scale`` None (W8A16) or float8_e4m3fn with its ``x_scale`` (W8A8: per tensor,
    per token or per token and group, as the lowering declares it reads); any strides; returns a
    fresh ``(..., N)`` tensor of ``out_dtype``. No host synchronisation. Entries of lowerings that
    serve W8A16 (``mm_fp8_weight_out``) also take ``out`` (``(..., N)`` of ``out_dtype``, written and
    returned) and ``workspace`` (caller-owned uint8 scratch, clobbered, used instead of allocating
    when large enough; None: allocate).
    """
    w = dequantize_reference(weight, weight_scale, block_n, block_k)
    xf = x.float()
    if x_scale is not None and is_group_x_scale(x_scale, x):
        # Scales that vary along K cannot be factored out of the sum: dequantize x first.
        xf, x_scale = xf * expand_x_scale_groups(x_scale, x.shape[-1]), None
    y = xf @ w.t()
    if x_scale is not None:
        y = y * x_scale
    if bias is not None:
        y = y + bias.float()
    if out is not None:
        return out.copy_(y)
    return y.to(out_dtype)


# M is padded up to a multiple of this before cuBLASLt: its FP8 heuristics have refused other M in
# some versions (and the block-scaled recipe refuses M = 1, 17, 257 on the H200 with torch 2.11); the
# padding costs a copy of the (small) quantized activations only.
SCALED_MM_M_MULTIPLE = 16
# cuBLASLt's 128 x 128 weight-scale grid has its K/128 axis padded to a multiple of this (torch checks
# the shape (round_up(ceil(K/128), 4), ceil(N/128)) with strides (1, round_up(ceil(K/128), 4))).
BLOCK_SCALE_K_MULTIPLE = 4


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (M, C) with ``rows`` zero rows appended (fp8 through its bytes: no fp8 pad kernel); ``t``
    itself when ``rows`` is 0."""
    if rows == 0:
        return t
    if t.dtype == FP8_DTYPE:
        return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, rows)).view(FP8_DTYPE)
    return torch.nn.functional.pad(t, (0, 0, 0, rows))


def _padded_rows_gemm(x, weight, bias, out_dtype, gemm, bias_in_gemm: bool = False) -> torch.Tensor:
    """The frame both cuBLASLt paths share: ``x (..., K)`` as M rows, zero rows up to a multiple of
    ``SCALED_MM_M_MULTIPLE``, ``gemm(a, m, pad)`` -> ``(M + pad, N)``, the padding sliced off, ``bias``
    added in fp32 unless the GEMM fused it (``bias_in_gemm``), and the lead dimensions restored."""
    n, k = weight.shape
    lead = x.shape[:-1]
    a = x.reshape(-1, k).contiguous()
    m = a.shape[0]
    if m == 0:
        return torch.empty((*lead, n), dtype=out_dtype, device=x.device)
    pad = -m % SCALED_MM_M_MULTIPLE
    y = gemm(_pad_rows(a, pad), m, pad)
    if pad:
        y = y[:m]
    if bias is not None and not bias_in_gemm:
        y = (y.float() + bias.float()).to(out_dtype)
    return y.reshape(*lead, n)


def scaled_mm_lowering(x, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype) -> torch.Tensor:
    """W8A8 through cuBLASLt: ``torch._scaled_mm`` for tensor-wise or row-wise (per token x per
    channel) scales, :func:`blockwise_scaled_mm` for 128 x 128 weight blocks. The chooser only picks
    it for what ``qops.lowerings`` declares (N, K multiples of 16; blocks 128 x 128 with N, K multiples
    of 128 on sm_90, fp16 / bf16 output).
    """
    if block_k != -1:
        return blockwise_scaled_mm(x, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype)
    if block_n not in (-1, 1) or is_group_x_scale(x_scale, x):
        raise ValueError(fail("scaled_mm_fp8", f"kernel={int(Kernel.SCALED_MM)} (torch._scaled_mm) needs per-tensor or per-channel weight "
                                               f"scales and per-tensor or per-token x_scale, got block_n={block_n}, block_k={block_k}, "
                                               f"x_scale {tuple(x_scale.shape)}"))
    n = weight.shape[0]
    rowwise = x_scale.numel() != 1 or block_n != -1
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32

    def gemm(a, m, pad):
        if rowwise:
            scale_a = _pad_rows(x_scale.reshape(-1, 1).expand(m, 1).contiguous(), pad)
            scale_b = weight_scale.expand(n, 1).reshape(1, n).contiguous()
        else:
            scale_a, scale_b = x_scale.reshape(1, 1), weight_scale.reshape(1, 1)
        return torch._scaled_mm(a, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias if fused_bias else None, out_dtype=out_dtype)

    return _padded_rows_gemm(x, weight, bias, out_dtype, gemm, bias_in_gemm=fused_bias)


def _x_scale_per_group(x_scale: torch.Tensor, m: int, groups: int) -> torch.Tensor:
    """Any accepted ``x_scale`` (per tensor, token or group) as per-group scales ``(M, groups)``: a
    tensor's or a token's one scale is its every group's."""
    if x_scale.numel() == 1:
        return x_scale.reshape(1, 1).expand(m, groups)
    return x_scale.reshape(m, -1).expand(m, groups)


def blockwise_scaled_mm(x, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype) -> torch.Tensor:
    """DeepSeek-style W8A8 through ``torch.nn.functional.scaled_mm``'s cuBLASLt recipe: activations
    with 1x128 scales (``BlockWise1x128``: per token and 128 K values), the weight with 128 x 128
    scales (``BlockWise128x128``). Recipe and layouts as ``benchmarks/probe_blockfp8.py`` verified on
    the H200 (torch 2.11: rel. error 1.7e-3 against float64). ``torch._scaled_mm`` does not infer this
    recipe from the scale shapes: it is not used here.

    The weight-scale grid is padded and transposed per call rather than stored so once: the op's
    ``weight_scale`` is the checkpoint's ``(ceil(N/128), ceil(K/128))`` grid, which every lowering and
    the fake check, and the transform is a view unless ceil(K/128) % 4 != 0 (then a copy of N*K/16384
    floats). Bias is added after the GEMM: whether cuBLASLt's block-scaled kernels fuse a bias
    epilogue is not verified.
    """
    if (block_n, block_k) != (X_SCALE_GROUP, X_SCALE_GROUP):
        raise ValueError(fail("scaled_mm_fp8", f"kernel={int(Kernel.SCALED_MM)} (F.scaled_mm block recipe) needs 128 x 128 weight blocks, "
                                               f"got block_n={block_n}, block_k={block_k}"))
    f = torch.nn.functional
    k = weight.shape[1]

    def gemm(a, m, pad):
        xs = _x_scale_per_group(x_scale, m, x_scale_groups(k))
        if pad:  # the scales of the zero rows, padded in their (K/128, M) image
            scale_a = f.pad(xs.t(), (0, pad)).t()
        elif xs.stride(0) == 1 and xs.stride(1) == m:
            scale_a = xs  # already outer-dim-major, as quantize_fp8_activations makes group scales
        else:
            scale_a = xs.t().contiguous().t()  # (M, K/128), outer-dim-major: strides (1, M)
        ws = weight_scale.contiguous()
        k_pad = -ws.shape[1] % BLOCK_SCALE_K_MULTIPLE
        if k_pad:
            ws = f.pad(ws, (0, k_pad))
        scale_b = ws.t()  # (round_up(K/128, 4), N/128), strides (1, round_up(K/128, 4))
        # Positional scale and recipe arguments: torch 2.11 and 2.13 agree on their order, not (all) on
        # their keyword names.
        return f.scaled_mm(a, weight.t(), scale_a, f.ScalingType.BlockWise1x128, scale_b, f.ScalingType.BlockWise128x128,
                           output_dtype=out_dtype)

    return _padded_rows_gemm(x, weight, bias, out_dtype, gemm)


# Inputs (x, weight, weight_scale, bias, block_n, block_k, kernel).
register_frozen_weight_autograd(mm_fp8_weight, torch.ops.qops.dequantize_fp8, tensors=(1, 2), statics=(4, 5), bias=3)


def _scaled_setup_context(ctx, inputs, output):
    bias = inputs[4]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _scaled_backward(ctx, grad):
    # Only the bias gets a gradient: a gradient for x_fp8 would itself be quantized to fp8. The
    # activation gradient comes from `mm_fp8`, which sees the unquantized x.
    grad_bias = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
        grad_bias = bias_grad(grad, ctx.bias_dtype)
    return None, None, None, None, grad_bias, None, None, None, None


scaled_mm_fp8.register_autograd(_scaled_backward, setup_context=_scaled_setup_context)


def quantize_fp8_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                             group_size: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., K)`` -> ``(x_fp8, x_scale)`` with ``x ~= x_fp8 * x_scale``, in plain torch ops.

    Dynamic (``input_scale`` None): ``group_size`` -1, one scale per token, ``amax(|x[..., :]|) * fp32(1 / 448)``
    (a multiply, so the scale's bits are the same on every device: ``FP8_MAX_INV``),
    shape ``(..., 1)``; ``group_size`` 128, one per token and group of 128 consecutive K values (the
    last group partial when K % 128 != 0), ``amax`` over the group, shape ``(..., ceil(K / 128))``.
    Scales are at least ``MIN_X_SCALE``, so an all-zero token or group stays zero.
    Static: ``x_scale = input_scale`` ``(1,)``; values beyond ``448 * input_scale`` saturate.
    Rounding is to nearest even, in fp32.
    """
    if group_size not in (-1, X_SCALE_GROUP):
        raise ValueError(fail("quantize_fp8_activations", f"group_size must be -1 (per token) or {X_SCALE_GROUP}, got {group_size}"))
    xf = x.float()
    if input_scale is not None:
        if group_size != -1:
            raise ValueError(fail("quantize_fp8_activations", "group_size goes with dynamic scales; a static input_scale is one per tensor"))
        scale = input_scale.float()
    elif group_size == -1:
        scale = (xf.abs().amax(dim=-1, keepdim=True) * FP8_MAX_INV).clamp(min=MIN_X_SCALE)
    else:
        return _quantize_fp8_groups(xf, group_size)
    x_fp8 = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale


def _quantize_fp8_groups(xf: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group dynamic quantization of fp32 ``xf`` (..., K): each group's values divided by
    that group's ``amax * fp32(1 / 448)``."""
    k, lead = xf.shape[-1], xf.shape[:-1]
    groups = -(-k // group_size)
    # Zeros pad K to whole groups: they change no group's amax and are sliced off after rounding.
    grouped = torch.nn.functional.pad(xf.reshape(-1, k), (0, groups * group_size - k)).unflatten(-1, (groups, group_size))
    # The scales are made group-major, (groups, tokens) contiguous, and handed out transposed: (tokens,
    # groups) with strides (1, tokens), the layout cuBLAS's 1x128 recipe reads (blockwise_scaled_mm then
    # passes them as they are instead of copying them; under torch.compile this is the reduction's own
    # store). Elementwise ops keep the layout.
    amax = grouped.transpose(0, 1).abs().amax(dim=-1).contiguous().t()
    scale = (amax * FP8_MAX_INV).clamp(min=MIN_X_SCALE)
    q = (grouped / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :k].reshape(*lead, k), scale.reshape(*lead, groups)


def _mm_fp8(x, weight, weight_scale, bias, block_n, block_k, input_scale, kernel, x_group_size):
    x_fp8, x_scale = quantize_fp8_activations(x, input_scale, x_group_size)
    return torch.ops.qops.scaled_mm_fp8(x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, x.dtype, kernel)


class _Fp8ActivationMM(torch.autograd.Function):
    """W8A8 forward; backward treats the activation rounding as the identity (straight-through) and
    multiplies by the dequantized weight."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, bias, block_n, block_k, input_scale, kernel, x_group_size):
        save_frozen_weight(ctx, x, bias, (weight, weight_scale), (block_n, block_k))
        return _mm_fp8(x, weight, weight_scale, bias, block_n, block_k, input_scale, kernel, x_group_size)

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_bias = frozen_weight_grads(ctx, grad, torch.ops.qops.dequantize_fp8, 3)
        return grad_x, None, None, grad_bias, None, None, None, None, None


def mm_fp8(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    weight: torch.Tensor,  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor,  # (S_n, S_k) float32
    bias: Optional[torch.Tensor],  # (N,) or None
    block_n: int,
    block_k: int,
    input_scale: Optional[torch.Tensor],  # (1,) float32 (static) or None (dynamic)
    kernel: int,
    x_group_size: int = -1,  # dynamic: -1 one scale per token, 128 per token and group of 128 K values
) -> torch.Tensor:  # (..., N), dtype of x
    """W8A8: quantize ``x`` to fp8 (per token, per token and group, or with the static
    ``input_scale``), then ``qops::scaled_mm_fp8``. Differentiable in ``x`` and ``bias``.
    ``x_group_size`` is a static fact of the prepared weight (``Fp8Weight.x_group_size``), never a
    per-call decision."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Fp8ActivationMM.apply(x, weight, weight_scale, bias, block_n, block_k, input_scale, kernel, x_group_size)
    return _mm_fp8(x, weight, weight_scale, bias, block_n, block_k, input_scale, kernel, x_group_size)


@dataclass
class Fp8Weight:
    """A prepared FP8 weight: runtime tensors plus the static facts the ops take."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    in_features: int
    out_features: int
    block_n: int
    block_k: int
    activations: str  # "none" (W8A16), "dynamic" or "static" (W8A8)
    kernel: Kernel
    choice: Choice | None = None
    x_group_size: int = -1  # dynamic W8A8: -1 one activation scale per token, 128 per token and group

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.activations == "none":
            return torch.ops.qops.mm_fp8_weight(x, self.weight, self.weight_scale, bias, self.block_n, self.block_k, int(self.kernel))
        input_scale = self.input_scale if self.activations == "static" else None
        return mm_fp8(x, self.weight, self.weight_scale, bias, self.block_n, self.block_k, input_scale, int(self.kernel),
                      self.x_group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.qops.dequantize_fp8(self.weight, self.weight_scale, self.block_n, self.block_k, dtype)

    def nbytes(self) -> int:
        ts = (self.weight, self.weight_scale, self.input_scale)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def prepare_fp8_weight(
    fq: Fp8Quantized,
    *,
    dtype: torch.dtype | None = None,
    format_name: str = "fp8",
    activations: str = "auto",
) -> Fp8Weight:
    """Build the runtime layout and choose the lowering for its device.

    ``dtype`` is the activation dtype the weight will see (default float32). ``activations``:
    ``"none"`` weight-only (W8A16); ``"dynamic"`` fp8 activations with scales computed per call;
    ``"static"`` fp8 activations with the checkpoint's ``input_scale``; ``"auto"`` W8A8 (static when
    the checkpoint has an input scale) where a native FP8 GEMM serves the weight, W8A16 otherwise --
    GPUs without FP8 units (compute capability < 8.9), CPU, N or K not multiples of 16, block scales
    other than 128 x 128 on sm_90 with N and K multiples of 128 and fp16 / bf16 activations.

    Dynamic activations of a 128 x 128-block weight get one scale per token and group of 128 K
    values (DeepSeek-V3's 1x128 recipe, which the block GEMM reads) where the chosen lowering
    declares it reads them; one per token otherwise.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"prepare_fp8_weight: activations must be one of {list(ACTIVATIONS)}, got {activations!r}")
    if activations == "static" and fq.input_scale is None:
        raise ValueError("prepare_fp8_weight: activations='static' needs a checkpoint input_scale; use 'dynamic'")
    n, k = fq.shape
    weight = fq.q.contiguous()
    scale = fq.scale.float().contiguous()
    block_n, block_k = fq.block_n, fq.block_k
    if block_k == -1 and block_n not in (-1, 1):
        # Row blocks spanning all of K mean one scale per row: store it per channel.
        scale, block_n = expand_scale(scale, n, 1, block_n, -1).contiguous(), 1
    act_dtype = dtype if dtype is not None else torch.float32

    def spec(a_dtype: torch.dtype) -> WeightSpec:
        return WeightSpec(
            family=FAMILY, format=format_name, bits=8, group_size=block_k, n=n, k=k,
            act_order=False, symmetric=True, device=weight.device, act_dtype=a_dtype,
            block_n=block_n, out_dtype=act_dtype if a_dtype == FP8_DTYPE else None,
        )

    if activations == "none":
        choice = choose(spec(act_dtype))
    elif activations in ("dynamic", "static"):
        choice = choose(spec(FP8_DTYPE))
    else:
        w8a8 = choose(spec(FP8_DTYPE))
        if w8a8.lowering.kernel == Kernel.SCALED_MM:
            choice, activations = w8a8, ("static" if fq.input_scale is not None else "dynamic")
        else:
            w8a16 = choose(spec(act_dtype))
            native = [f"{name}: {why}" for name, why in w8a8.refusals if LOWERINGS_BY_NAME[name].kernel == Kernel.SCALED_MM]
            why = f"no native FP8 GEMM serves it ({'; '.join(native)})"
            choice = Choice(w8a16.lowering, w8a16.refusals + (("W8A8 (fp8 activations)", why),))
            activations = "none"
    if choice.lowering.kernel == Kernel.SCALED_MM and activations == "dynamic" and block_n == -1:
        # Per-token activation scales need row-wise weight scales in _scaled_mm: expand once, here.
        scale, block_n = scale.expand(n, 1).contiguous(), 1
    input_scale = None if fq.input_scale is None else fq.input_scale.float().reshape(1).to(weight.device)
    x_group_size = -1
    if activations == "dynamic" and (block_n, block_k) == (X_SCALE_GROUP, X_SCALE_GROUP):
        facts = CallFacts(bits=8, group_size=block_k, act_dtype=FP8_DTYPE, n=n, k=k, block_n=block_n, out_dtype=act_dtype, x_scale="group")
        if choice.lowering.call_refusal(facts) is None:
            x_group_size = X_SCALE_GROUP
    return Fp8Weight(
        weight=weight,
        weight_scale=scale,
        input_scale=input_scale,
        in_features=k,
        out_features=n,
        block_n=block_n,
        block_k=block_k,
        activations=activations,
        kernel=choice.lowering.kernel,
        choice=choice,
        x_group_size=x_group_size,
    )
