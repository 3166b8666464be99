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

from ..lowerings import CallFacts, Choice, Kernel, WeightSpec, choose, implementation, warm_up
from ._common import (ACT_DTYPES, check_act_dtype, check_bias, check_dequantize_dtype, check_devices, check_disjoint,
                      check_out, check_workspace, check_x, fail, reference_matmul, refuse_gradients,
                      register_frozen_weight_autograd)

FAMILY = "int8_weight"


def check_int8_weight(who: str, k, qweight: torch.Tensor, scales: torch.Tensor, device: torch.device):
    """Validate the runtime weight for ``k`` input features (None: any K); returns N. Works on fake tensors."""
    check_devices(who, (("qweight", qweight), ("scales", scales)), device)
    torch._check_type(qweight.dtype == torch.int8, lambda: fail(who, f"qweight must be torch.int8, got {qweight.dtype}"))
    torch._check_value(qweight.dim() == 2, lambda: fail(who, f"qweight must be 2-D (N, K), got {qweight.dim()}-D"))
    n = qweight.shape[0]
    if k is not None:
        torch._check_value(qweight.shape[1] == k, lambda: fail(who, f"qweight must have K={k} columns (the last dimension of x), got {qweight.shape[1]}"))
    check_act_dtype(who, "scales", scales)
    torch._check_value(
        scales.dim() == 1 and scales.shape[0] == n,
        lambda: fail(who, f"scales must have shape ({n},) (N from qweight), got {tuple(scales.shape)}"),
    )
    return n


def check_mm_int8_weight(who, x, qweight, scales, bias) -> list:
    """Validate every argument of ``mm_int8_weight``; returns the output shape."""
    check_x(who, x)
    n = check_int8_weight(who, x.shape[-1], qweight, scales, x.device)
    check_bias(who, bias, n, x.device)
    return [*x.shape[:-1], n]


MM_SCHEMA = "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int kernel) -> Tensor"
MM_OUT_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int kernel, Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
DEQUANT_SCHEMA = "(Tensor qweight, Tensor scales, ScalarType dtype) -> Tensor"


def call_facts(x, shape) -> CallFacts:
    """What a lowering must serve for this call (checked when the op names its kernel)."""
    return CallFacts(8, -1, x.dtype, shape[-1], x.shape[-1])


@torch.library.custom_op("qops::mm_int8_weight", mutates_args=(), schema=MM_SCHEMA)
def mm_int8_weight(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N,) float
    bias: Optional[torch.Tensor],  # (N,) or None
    kernel: int,  # qops.lowerings.Kernel
) -> torch.Tensor:  # (..., N), dtype of x
    shape = check_mm_int8_weight("mm_int8_weight", x, qweight, scales, bias)
    impl = implementation(FAMILY, kernel, x.device, "mm_int8_weight", call_facts(x, shape))
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
    check_workspace("mm_int8_weight_out", workspace, x)
    check_disjoint("mm_int8_weight_out", (("out", out), ("workspace", workspace)), (("x", x), ("qweight", qweight), ("scales", scales), ("bias", bias)))
    impl = implementation(FAMILY, kernel, x.device, "mm_int8_weight_out", call_facts(x, shape))
    impl(x, qweight, scales, bias, out=out, workspace=workspace)


refuse_gradients("mm_int8_weight_out", "mm_int8_weight")


@torch.library.custom_op("qops::dequantize_int8_weight", mutates_args=(), schema=DEQUANT_SCHEMA)
def dequantize_int8_weight(
    qweight: torch.Tensor,  # (N, K) int8
    scales: torch.Tensor,  # (N,) float
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K)
    check_int8_weight("dequantize_int8_weight", None, qweight, scales, qweight.device)
    check_dequantize_dtype("dequantize_int8_weight", dtype)
    return reference_dequantize(qweight, scales).to(dtype).contiguous()  # row-major whatever qweight's strides, as the fake says


def reference_dequantize(qweight, scales) -> torch.Tensor:
    """fp32 ``(N, K)`` weight, straight from the layout's definition."""
    return qweight.float() * scales.float().unsqueeze(1)


def reference_mm(x, qweight, scales, bias, out=None, workspace=None) -> torch.Tensor:
    """The CPU kernel (and the GPU fallback); the lowering entry contract of ``ops/int_weight.py``."""
    return reference_matmul(x, reference_dequantize(qweight, scales), bias, out)


# Inputs (x, qweight, scales, bias, kernel).
register_frozen_weight_autograd(mm_int8_weight, torch.ops.qops.dequantize_int8_weight, tensors=(1, 2), statics=(), bias=3)


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
