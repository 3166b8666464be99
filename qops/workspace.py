"""Preallocated scratch for the quantized matmuls: one buffer per device, owned by the model.

Some lowerings need scratch memory per call -- fp32 split-K partial sums -- and take it from the
caller's ``workspace`` argument (``qops::mm_int_weight_out``, ``qops::mm_int8_weight_out``,
``qops::mm_blockwise4_out``, ``qops::mm_fp8_weight_out``) when it is large enough. Each such
lowering states its need as a function of the call's shape; :data:`SCRATCH_BYTES` maps lowering
names to those functions:

=====================  ==========================================================================
lowering               size function
=====================  ==========================================================================
triton_int_weight      ``qops.ops.triton.int_weight.workspace_bytes(m, n, k, bits, group_size, device, act_order)``
native_w4a16           ``qops.native.int_weight.workspace_bytes(m, n, k, bits, group_size, device, act_order)`` (its own
                       plans' partials, after x gathered through act_perm where the layer has one; Triton's need
                       for the calls it delegates)
triton_int8_weight     ``4*M*N`` when ``qops.ops.triton.int8_weight.plan`` splits K, else 0
triton_blockwise4      ``4*M*N`` when ``qops.ops.triton.blockwise4.plan`` splits K for some x dtype, else 0
triton_fp8             ``qops.ops.triton.fp8.workspace_bytes(m, n, k, block_k, device)`` for W8A16 layers
                       (``4*M*N`` when its GEMV splits K); W8A8 layers call ``qops::scaled_mm_fp8``,
                       which takes no workspace
=====================  ==========================================================================

Lowerings not listed need none (the reference kernels, ``scaled_mm_fp8``).

A :class:`Workspace` is sized once, when the model is built, as the largest need of any of its
layers for any row count ``M <= max_m`` (layers run one after another, so they share it), and
never grows: :meth:`Workspace.take` raises when asked for more. Its memory is the registered
buffer ``buffer`` (uint8, not saved in state dicts), so it moves with ``.to()``, and
``torch.compile``'s cudagraph trees treat it as a static input that steps may mutate.

:func:`attach_workspace` hands it to every quantized linear of the model (after checking that each
fits): a layer keeps a plain reference to the model's :class:`Workspace` -- not a submodule, so
the buffer has one owner and one name in ``named_buffers`` -- and then calls its op's ``_out``
variant with an output from ``torch.empty`` and the whole buffer as ``workspace`` for calls of
``M <= max_m`` rows (:meth:`Workspace.scratch`); longer calls (prefill) pass None, and the lowering
allocates as a standalone layer's does. Under ``torch.compile`` the buffer is one graph input that
every op mutates in place: no copy of it, no allocation.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_true

ALIGN = 256  # bytes; buffers start 512-byte aligned (caching allocator), sizes are rounded up to this


def _k(layer) -> int:
    return layer.in_features + getattr(layer, "input_pad", 0)


def _triton_int_weight(layer, m: int, device: torch.device) -> int:
    from .ops.triton.int_weight import workspace_bytes

    return workspace_bytes(m, layer.out_features, _k(layer), layer.bits, layer.group_size, device,
                           act_order=layer.act_perm is not None)


def _native_w4a16(layer, m: int, device: torch.device) -> int:
    from .native import int_weight as native

    return native.workspace_bytes(m, layer.out_features, _k(layer), layer.bits, layer.group_size, device,
                                  act_order=layer.act_perm is not None)


def _split_k_accumulator(plan: Callable[..., dict]):
    def need(layer, m: int, device: torch.device, *extra) -> int:
        return 4 * m * layer.out_features if plan(m, layer.out_features, layer.in_features, *extra, device)["split"] > 1 else 0

    return need


def _triton_int8_weight(layer, m, device):
    from .ops.triton import int8_weight

    return _split_k_accumulator(int8_weight.plan)(layer, m, device)


def _triton_blockwise4(layer, m, device):
    from .ops._common import ACT_DTYPES
    from .ops.blockwise4 import LAYOUT_FLAT
    from .ops.triton import blockwise4

    # Its plan depends on x's dtype (fp32 x splits K where 16-bit x does not), which a layer learns
    # only when called: the need of the dearest.
    def need(dtype):
        p = blockwise4.plan(m, layer.out_features, layer.in_features, layer.blocksize, device, dtype,
                            dense=layer.layout != LAYOUT_FLAT)
        return 4 * m * layer.out_features if p["split"] > 1 else 0

    return max(need(dtype) for dtype in ACT_DTYPES)


def _triton_fp8(layer, m, device):
    if getattr(layer, "activations", "none") != "none":
        return 0  # W8A8: qops::scaled_mm_fp8 has no workspace argument
    from .ops.triton.fp8 import workspace_bytes

    return workspace_bytes(m, layer.out_features, layer.in_features, layer.block_k, device)


# Lowering name -> bytes of scratch one call of (m rows) x (a layer's weight) needs on a device.
SCRATCH_BYTES: dict[str, Callable[[nn.Module, int, torch.device], int]] = {
    "triton_int_weight": _triton_int_weight,
    "native_w4a16": _native_w4a16,
    "triton_int8_weight": _triton_int8_weight,
    "triton_blockwise4": _triton_blockwise4,
    "triton_fp8": _triton_fp8,
}


def lowering_name(layer: nn.Module) -> str | None:
    choice = getattr(layer, "choice", None)
    return None if choice is None else choice.lowering.name


def layer_scratch_bytes(layer: nn.Module, max_m: int, device: torch.device) -> int:
    """The most scratch ``layer`` (a prepared ``QuantLinear``) needs for any M in ``[1, max_m]``."""
    name = lowering_name(layer)
    fn = SCRATCH_BYTES.get(name)
    if fn is None:
        return 0
    # Layers of one shape share their need: computed once per (lowering, shape, device, max_m).
    key = (name, layer.out_features, _k(layer), getattr(layer, "bits", 0), getattr(layer, "group_size", 0),
           getattr(layer, "blocksize", 0), getattr(layer, "block_k", 0), getattr(layer, "activations", None), str(device), max_m)
    if key not in _NEEDS:
        _NEEDS[key] = max((int(fn(layer, m, device)) for m in range(1, max_m + 1)), default=0)
    return _NEEDS[key]


_NEEDS: dict[tuple, int] = {}


class WorkspaceTooSmall(RuntimeError):
    pass


class Workspace(nn.Module):
    """A fixed scratch buffer (see the module docstring). ``needs`` records each layer's need."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu", *, max_m: int = 1, needs: dict[str, int] | None = None) -> None:
        super().__init__()
        if nbytes < 0:
            raise ValueError(f"Workspace: nbytes must be >= 0, got {nbytes}")
        self.max_m = max_m
        self.needs = dict(needs or {})
        size = -(-nbytes // ALIGN) * ALIGN
        self.register_buffer("buffer", torch.empty(size, dtype=torch.uint8, device=device), persistent=False)

    @classmethod
    def for_model(cls, model: nn.Module, *, max_m: int, device: torch.device | str | None = None) -> "Workspace":
        """Sized for every prepared quantized linear of ``model`` and every M in ``[1, max_m]``."""
        from .layers import QuantLinear

        needs = {}
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                dev = torch.device(device) if device is not None else _device_of(m)
                needs[name] = layer_scratch_bytes(m, max_m, dev)
        if device is None:
            device = next((_device_of(m) for m in model.modules() if isinstance(m, QuantLinear)), torch.device("cpu"))
        return cls(max(needs.values(), default=0), device, max_m=max_m, needs=needs)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer (uint8); the workspace never grows, so asking for more
        than it holds is an error, not an allocation."""
        if nbytes > self.nbytes:
            raise WorkspaceTooSmall(f"Workspace: {nbytes} bytes asked, {self.nbytes} held (sized for M <= {self.max_m}); "
                                    "build the model with a larger max_batch")
        return self.buffer[:nbytes]

    def scratch(self, rows) -> torch.Tensor | None:
        """What a layer passes as ``workspace`` for a call of ``rows`` rows (an int or SymInt): the
        whole buffer when ``rows <= max_m`` (what it was sized for), else None (the lowering
        allocates, as without a workspace). Under torch.compile an unbacked ``rows`` takes the
        buffer without a guard (a decode step's batch never exceeds the model's ``max_m``)."""
        if guard_or_true(rows <= self.max_m):
            return self.buffer
        return None

    def check(self, model: nn.Module) -> None:
        """Raise unless every quantized linear of ``model`` fits (e.g. after its layers changed)."""
        from .layers import QuantLinear

        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                self.check_layer(m, name)

    def check_layer(self, layer: nn.Module, name: str | None = None) -> None:
        """Raise :class:`WorkspaceTooSmall` unless ``layer`` fits for every M <= ``max_m``."""
        need = layer_scratch_bytes(layer, self.max_m, self.buffer.device)
        if need > self.nbytes:
            who = name if name is not None else f"{type(layer).__name__}(N={layer.out_features}, K={_k(layer)})"
            raise WorkspaceTooSmall(f"Workspace: layer {who} ({lowering_name(layer)}) needs {need} bytes for M <= {self.max_m}, {self.nbytes} held")

    def extra_repr(self) -> str:
        users = sum(1 for v in self.needs.values() if v)
        return f"nbytes={self.nbytes}, max_m={self.max_m}, layers_needing_scratch={users}/{len(self.needs)}"


def attach_workspace(model: nn.Module, workspace: Workspace | None) -> None:
    """Give every quantized linear of ``model`` ``workspace`` (None: take it away), after checking
    that each fits (:class:`WorkspaceTooSmall` names the first that does not). The model owns the
    workspace (register it as a submodule, as ``LlamaForCausalLM.workspace`` is); the layers only
    refer to it."""
    from .layers import QuantLinear

    if workspace is not None:
        workspace.check(model)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_workspace(workspace, check=False)


def _device_of(module: nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    for t in module.parameters():
        return t.device
    return torch.device("cpu")
