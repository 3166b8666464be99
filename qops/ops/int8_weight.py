"""int8 weight-only matmul with one scale per output channel (EETQ, bitsandbytes LLM.int8 storage):
ops, runtime layout, argument checks shared with the fakes, and the pure-torch reference kernel.

Runtime layout (what ``prepare_int8_weight`` builds and every lowering reads), K = in_features,
N = out_features:

- ``qweight`` int8 ``(N, K)``, signed values, any strides (row-major is what the lowerings are
  fast on; bitsandbytes' ``weight`` is used as is).
- ``scales`` float32 / float16 / bfloat16 ``(N,)``: ``W[n, k] = qweight[n, k] * scales[n]``
  (bitsandbytes: ``SCB / 127``; EETQ: ``weight_scales``).

``y = x @ W.T + bias``. The same math as the integer family at bits=8, group_size=-1, zero 128, but
over a signed row-major byte matrix instead of a K-packed word stream: a bitsandbytes checkpoint
maps onto it without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..lowerings import Choice, Kernel, WeightSpec, choose, implementation, warm_up
from .int_weight import ACT_DTYPES, _fail, check_out

FAMILY = "int8_weight"


def check_int8_weight(who: str, k, qweight: torch.Tensor, scales: torch.Tensor, device: torch.device):
    """Validate the runtime weight for ``k`` input features; returns N. Works on fake tensors."""
    for name, t in (("qweight", qweight), ("scales", scales)):
        if t.device != device:
            raise ValueError(_fail(who, f"{name} must be on {device} (the device of x), got {t.device}"))
    torch._check_type(qweight.dtype == torch.int8, lambda: _fail(who, f"qweight must be torch.int8, got {qweight.dtype}"))
    torch._check_value(qweight.dim() == 2, lambda: _fail(who, f"qweight must be 2-D (N, K), got {qweight.dim()}-D"))
    n = qweight.shape[0]
    torch._check_value(qweight.shape[1] == k, lambda: _fail(who, f"qweight must have K={k} columns (the last dimension of x), got {qweight.shape[1]}"))
    torch._check_type(scales.dtype in ACT_DTYPES, lambda: _fail(who, f"scales must be float32, float16 or bfloat16, got {scales.dtype}"))
    torch._check_value(
        scales.dim() == 1 and scales.shape[0] == n,
        lambda: _fail(who, f"scales must have shape ({n},) (N from qweight), got {tuple(scales.shape)}"),
    )
    return n


def check_mm_int8_weight(who, x, qweight, scales, bias) -> list:
    """Validate every argument of ``mm_int8_weight``; returns the output shape."""
    torch._check_type(x.dtype in ACT_DTYPES, lambda: _fail(who, f"x must be float32, float16 or bfloat16, got {x.dtype}"))
    torch._check_value(x.dim() >= 1, lambda: _fail(who, "x must have at least one dimension (..., K)"))
    n = check_int8_weight(who, x.shape[-1], qweight, scales, x.device)
    check_bias(who, bias, n, x)
    return [*x.shape[:-1], n]


def check_bias(who, bias, n, x) -> None:
    if bias is None:
        return
    if bias.device != x.device:
        raise ValueError(_fail(who, f"bias must be on {x.device} (the device of x), got {bias.device}"))
    torch._check_type(bias.dtype in ACT_DTYPES, lambda: _fail(who, f"bias must be float32, float16 or bfloat16, got {bias.dtype}"))
    torch._check_value(bias.dim() == 1 and bias.shape[0] == n, lambda: _fail(who, f"bias must have shape ({n},) (N), got {tuple(bias.shape)}"))


MM_SCHEMA = "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int kernel) -> Tensor"
MM_OUT_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int kernel, Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
DEQUANT_SCHEMA = "(Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor"


@torch.library.custom_op("qops::mm_int8_weight", mutates_args=(), schema=MM_SCHEMA)
def mm_int8_weight(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N,) float
    bias: Optional[torch.Tensor],  # (N,) or None
    kernel: int,  # qops.lowerings.Kernel
) -> torch.Tensor:  # (..., N), dtype of x
    check_mm_int8_weight("mm_int8_weight", x, qweight, scales, bias)
    impl = implementation(FAMILY, kernel, x.device, "mm_int8_weight")
    return impl(x, qweight, scales, bias)


@torch.library.custom_op("qops::mm_int8_weight_out", mutates_args=("out", "workspace"), schema=MM_OUT_SCHEMA)
def mm_int8_weight_out(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N,) float
    bias: Optional[torch.Tensor],  # (N,) or None
    kernel: int,
    out: torch.Tensor,  # (..., N), dtype of x, caller-owned; written
    workspace: Optional[torch.Tensor],  # caller-owned scratch (uint8); clobbered
) -> None:
    shape = check_mm_int8_weight("mm_int8_weight_out", x, qweight, scales, bias)
    check_out("mm_int8_weight_out", out, shape, x)
    impl = implementation(FAMILY, kernel, x.device, "mm_int8_weight_out")
    impl(x, qweight, scales, bias, out=out, workspace=workspace)


@torch.library.custom_op("qops::dequantize_int8_weight", mutates_args=(), schema=DEQUANT_SCHEMA)
def dequantize_int8_weight(
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N,) float
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K)
    check_int8_weight("dequantize_int8_weight", qweight.shape[-1], qweight, scales, qweight.device)
    return reference_dequantize(qweight, scales).to(dtype)


def reference_dequantize(qweight, scales) -> torch.Tensor:
    """fp32 ``(N, K)`` weight, straight from the layout's definition."""
    return qweight.float() * scales.float().unsqueeze(1)


def reference_mm(x, qweight, scales, bias, out=None, workspace=None) -> torch.Tensor:
    """The CPU kernel (and the GPU fallback); the lowering entry contract of ``ops/int_weight.py``."""
    y = x.float() @ reference_dequantize(qweight, scales).t()
    if bias is not None:
        y = y + bias.float()
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def _setup_context(ctx, inputs, output):
    x, qweight, scales, bias, kernel = inputs
    ctx.save_for_backward(qweight, scales)
    ctx.meta = (x.dtype, bias is not None)


def _backward(ctx, grad):
    # Weights are frozen: the gradient flows to the activations (and the bias) only.
    qweight, scales = ctx.saved_tensors
    x_dtype, has_bias = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.qops.dequantize_int8_weight(qweight, scales, torch.float32)
        grad_x = (grad.float() @ w).to(x_dtype)
    if has_bias and ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
    return grad_x, None, None, grad_bias, None


mm_int8_weight.register_autograd(_backward, setup_context=_setup_context)


@dataclass
class Int8Weight:
    """A prepared int8 per-channel weight: runtime tensors plus the lowering chosen for them."""

    qweight: torch.Tensor
    scales: torch.Tensor
    in_features: int
    out_features: int
    kernel: Kernel
    choice: Choice | None = None

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.qops.mm_int8_weight(x, self.qweight, self.scales, bias, int(self.kernel))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.qops.dequantize_int8_weight(self.qweight, self.scales, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def prepare_int8_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    format_name: str = "bitsandbytes-int8",
) -> Int8Weight:
    """Wrap the runtime tensors and choose the lowering for their device (no copy of ``qweight``).

    ``dtype`` is the activation dtype the weight will see (default: the scales' dtype).
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"prepare_int8_weight: qweight must be a 2-D int8 tensor (N, K), got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    if tuple(scales.shape) != (n,) or scales.dtype not in ACT_DTYPES:
        raise ValueError(f"prepare_int8_weight: scales must be float of shape ({n},), got {scales.dtype} {tuple(scales.shape)}")
    scales = scales.to(qweight.device)
    act_dtype = dtype if dtype is not None else scales.dtype
    spec = WeightSpec(
        family=FAMILY, format=format_name, bits=8, group_size=-1, n=n, k=k,
        act_order=False, symmetric=True, device=qweight.device, act_dtype=act_dtype,
    )
    choice = choose(spec)
    weight = Int8Weight(qweight=qweight, scales=scales, in_features=k, out_features=n, kernel=choice.lowering.kernel, choice=choice)
    warm_up(choice.lowering, weight)
    return weight
