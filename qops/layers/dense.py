"""Unquantized linear layers (``quantize=None``): ``FastLinear`` and the dense checkpoint layout.

On disk: ``weight`` ``(N, K)`` in any floating dtype, converted to the model dtype when loaded;
``bias`` ``(N,)`` beside it. Column-parallel shards split dim 0, row-parallel shards dim 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import LinearMethod, QuantConfig
from .layout import FLOAT, Dim, LinearLayout, LinearScheme, TensorLayout, join

DENSE_LAYOUT = LinearLayout(tensors=(TensorLayout("weight", (Dim("n"), Dim("k")), FLOAT, convert=True),))
BIAS_LAYOUT = LinearLayout(tensors=(TensorLayout("bias", (Dim("n"),), FLOAT, convert=True),))


class FastLinear(nn.Module):
    """``y = x @ weight.T + bias`` with a frozen weight (TGI/LoRAX ``FastLinear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"FastLinear: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"FastLinear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def load(cls, config, prefix: str, weights, bias: bool) -> "FastLinear":
        w = weights.get_tensor(f"{prefix}.weight")
        b = weights.get_tensor(f"{prefix}.bias") if bias else None
        return cls(w, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class DenseScheme(LinearScheme):
    key = "weight"
    format = "dense"
    group_size = -1
    bits = 0

    @property
    def layout(self) -> LinearLayout:
        return DENSE_LAYOUT

    def stores(self, source, prefix):
        name = join(prefix, "weight")
        return source.has(name) and source.dtype_of(name).is_floating_point and source.dtype_of(name).itemsize >= 2

    def dims(self, source, prefix):
        shape = source.shape(join(prefix, "weight"))
        if len(shape) != 2:
            raise ValueError(f"tensor {join(prefix, 'weight')!r} must be 2-D (N, K), got shape {shape}")
        return shape[1], shape[0]

    def make(self, tensors, k, n, group_size):
        return tensors["weight"]


DENSE = DenseScheme()


class DenseConfig(QuantConfig):
    quantize = None

    def scheme(self, prefix):
        return None


class DenseMethod(LinearMethod):
    quantize = None
    accepts = "a dense (out_features, in_features) tensor (with fan_in_fan_out=True: (in_features, out_features))"

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise self.refuse(weight)
        if weight_scale is not None or input_scale is not None:
            raise ValueError("get_linear(quantize=None): weight_scale and input_scale belong to fp8 weights")
        if fan_in_fan_out:
            # Conv1D (GPT-2 style) stores (in_features, out_features).
            weight = weight.t().contiguous()
        if dtype is not None:
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return FastLinear(weight, bias)


METHOD = DenseMethod()
