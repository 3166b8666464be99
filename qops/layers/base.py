"""What every family of linear layers provides, so registries can treat them alike.

- :class:`QuantLinear`: an ``nn.Module`` holding a prepared (runtime-layout) weight as registered
  buffers -- static addresses for CUDA graphs, moved by ``.to()``, never a dense copy -- and calling
  its family's ``torch.ops.qops`` op in ``forward``: the allocating op standalone, the ``_out`` op
  with the model's scratch once given a workspace (:meth:`QuantLinear.use_workspace`,
  ``qops.workspace.attach_workspace``).
- :class:`LinearMethod`: one LoRAX/TGI ``quantize`` string: which weights ``get_linear`` accepts for
  it and how it turns them into a module.
- :class:`QuantConfig`: one parsed ``quantization_config`` of a checkpoint: which scheme
  (``qops.layers.layout.LinearScheme``) stores the layer under a given prefix.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..lowerings import silu_mul
from ..workspace import Workspace
from .layout import LinearScheme


@dataclass
class InputPadded:
    """A checkpoint for ``pad`` more input features than the activations have; the layer appends
    ``pad`` zero columns to ``x`` (act-order row-parallel shards, ``qops/layers/act_order.py``)."""

    checkpoint: Any
    pad: int


class QuantLinear(nn.Module):
    """Base of the quantized linear modules (``in_features``, ``out_features``, ``forward(x)``)."""

    in_features: int
    out_features: int
    # The model's scratch, a plain reference (set with use_workspace): the model owns and registers it.
    _workspace: Workspace | None = None

    @property
    def workspace(self) -> Workspace | None:
        return self._workspace

    def use_workspace(self, workspace: Workspace | None, *, check: bool = True) -> None:
        """Run ``forward`` through the op's ``_out`` variant with ``workspace``'s buffer as scratch
        (None: the allocating op again). Raises ``qops.workspace.WorkspaceTooSmall`` when the
        workspace holds less than this layer's lowering needs for ``M <= workspace.max_m``."""
        if workspace is not None and check:
            workspace.check_layer(self)
        # Not nn.Module.__setattr__: a submodule per layer would give the one buffer many owners.
        object.__setattr__(self, "_workspace", workspace)

    def _out_args(self, x: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(out, workspace)`` for the ``_out`` op, ``out`` ``width`` wide (default
        ``out_features``), or None for the allocating op: no workspace, or a call that needs
        gradients (the ``_out`` ops have no autograd)."""
        ws = self._workspace
        if ws is None:
            return None
        bias = getattr(self, "bias", None)
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return None
        out = torch.empty((*x.shape[:-1], width or self.out_features), dtype=x.dtype, device=x.device)
        return out, ws.scratch(math.prod(x.shape[:-1]))

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for a fused ``[gate; up]`` projection (gate rows first), ``(...,
        out_features / 2)``: here the product, then SiLU-and-multiply; a family whose op computes
        it in one kernel overrides this."""
        return silu_mul(self(x))

    def prepare_swiglu(self) -> None:
        """Compile and load now what :meth:`forward_swiglu` runs (before any CUDA-graph capture)."""

    @classmethod
    def from_checkpoint(cls, checkpoint, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None) -> "QuantLinear":
        """The module serving ``checkpoint`` (a format's checkpoint dataclass, e.g.
        ``qops.formats.gptq.GPTQCheckpoint``, or an :class:`InputPadded` one), prepared once for
        activations of ``dtype`` (default: its format's) on the checkpoint's device."""
        from .registry import CHECKPOINT_LINEARS

        inner = checkpoint.checkpoint if isinstance(checkpoint, InputPadded) else checkpoint
        try:
            build = CHECKPOINT_LINEARS[type(inner)]
        except KeyError:
            known = sorted(t.__name__ for t in CHECKPOINT_LINEARS)
            raise TypeError(f"QuantLinear.from_checkpoint: no quantized linear serves {type(inner).__name__}; known checkpoint types: {known}") from None
        module = build(checkpoint, bias, dtype=dtype)
        if not isinstance(module, cls):
            raise TypeError(f"{cls.__name__}.from_checkpoint: a {type(inner).__name__} is served by {type(module).__name__}")
        return module


class LinearMethod(abc.ABC):
    """One ``quantize`` string of ``get_linear``."""

    quantize: ClassVar[str | None]
    accepts: ClassVar[str]  # the weights it takes, for error messages

    @abc.abstractmethod
    def linear(self, weight, bias, *, fan_in_fan_out: bool, weight_scale, input_scale, dtype) -> nn.Module: ...

    def refuse(self, weight) -> TypeError:
        return TypeError(f"get_linear(quantize={self.quantize!r}) takes {self.accepts}; got {_describe(weight)}")

    def check_no_extras(self, fan_in_fan_out: bool, weight_scale, input_scale) -> None:
        if fan_in_fan_out:
            raise ValueError(f"get_linear(quantize={self.quantize!r}): fan_in_fan_out=True transposes a dense Conv1D weight; it does not apply to {self.accepts}")
        if weight_scale is not None or input_scale is not None:
            raise ValueError(f"get_linear(quantize={self.quantize!r}): weight_scale and input_scale belong to fp8 weights; this method carries its scales in the weight")


class QuantConfig(abc.ABC):
    """A checkpoint's parsed ``quantization_config``."""

    quantize: str | None  # the LoRAX/TGI string its layers go with

    @abc.abstractmethod
    def scheme(self, prefix: str) -> LinearScheme | None:
        """The quantized scheme the layer under ``prefix`` is stored in, or None when the config
        leaves it unquantized."""


def _describe(weight) -> str:
    if isinstance(weight, torch.Tensor):
        return f"a {weight.dtype} tensor of shape {tuple(weight.shape)}"
    if isinstance(weight, tuple):
        return f"a tuple of {len(weight)}"
    return f"a {type(weight).__name__}"
