"""compressed-tensors ``pack-quantized`` integer checkpoints (``quant_method == "compressed-tensors"``).

Tensors of one linear with K = in_features, N = out_features, G = group size, b = bits (4 or 8):

- ``weight_packed`` int32 ``(N, ceil(K*b/32))``: row n is a little-endian bit stream along K,
  element k at bits ``[k*b, (k+1)*b)``. Values are the signed integers plus ``2**(b-1)``
  (int4 -8..7 stored as 0..15).
- ``weight_scale`` ``(N, n_groups)`` in the model dtype; ``(N, 1)`` for channel-wise quantization.
- ``weight_zero_point`` only when asymmetric: packed along **dim 0** (N), ``(ceil(N*b/32), n_groups)``,
  with the same +2**(b-1) offset. Symmetric checkpoints have a zero point of 0 (stored midpoint).
- ``weight_shape`` int ``(2,)`` = ``[N, K]``; optional ``weight_g_idx`` ``(K,)`` (act-order).
- n_groups = ceil(K / G); a partial last group is allowed.

With unsigned stored values u and zero point uz: ``W[n, k] = scale[n, g] * (u[n, k] - uz[n, g])``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._packing import pack_bits, packed_length, unpack_bits
from .base import CheckpointFormat
from .integer import IntQuantized, check_bits, check_g_idx, check_group_size, check_scales_dtype, check_tensor_arg, default_g_idx, n_groups_for, quantize_rtn


@dataclass
class CompressedTensorsCheckpoint:
    weight_packed: torch.Tensor  # (N, ceil(K*bits/32)) int32
    weight_scale: torch.Tensor  # (N, n_groups)
    weight_shape: torch.Tensor  # (2,) int: [N, K]
    weight_zero_point: torch.Tensor | None  # (ceil(N*bits/32), n_groups) int32, asymmetric only
    weight_g_idx: torch.Tensor | None  # (K,) int32
    bits: int
    group_size: int  # -1 for channel-wise

    @property
    def out_features(self) -> int:
        return int(self.weight_shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight_shape[1])


def _check_checkpoint(c: CompressedTensorsCheckpoint) -> None:
    who = "compressed-tensors"
    check_bits(c.bits, (4, 8), who=who)
    for name in ("weight_packed", "weight_scale", "weight_shape"):
        check_tensor_arg(getattr(c, name), name, who=who)
    for name in ("weight_zero_point", "weight_g_idx"):
        if getattr(c, name) is not None:
            check_tensor_arg(getattr(c, name), name, who=who)
    if tuple(c.weight_shape.shape) != (2,):
        raise ValueError(f"{who}: weight_shape must have shape (2,), got {tuple(c.weight_shape.shape)}")
    n, k = c.out_features, c.in_features
    check_group_size(c.group_size, who=who)
    g = n_groups_for(k, c.group_size)
    checks = [
        ("weight_packed", c.weight_packed, (n, packed_length(k, c.bits)), torch.int32),
        ("weight_scale", c.weight_scale, (n, g), None),
    ]
    if c.weight_zero_point is not None:
        checks.append(("weight_zero_point", c.weight_zero_point, (packed_length(n, c.bits), g), torch.int32))
    if c.weight_g_idx is not None:
        checks.append(("weight_g_idx", c.weight_g_idx, (k,), None))
    for name, t, shape, dtype in checks:
        if tuple(t.shape) != shape:
            raise ValueError(f"{who}: {name} must have shape {shape} (N={n}, K={k}, bits={c.bits}, group_size={c.group_size}), got {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{who}: {name} must be {dtype}, got {t.dtype}")
    check_scales_dtype(c.weight_scale, "weight_scale", who=who)
    if c.weight_g_idx is not None:
        check_g_idx(c.weight_g_idx, g, "weight_g_idx", who=who)


class CompressedTensorsFormat(CheckpointFormat):
    name = "compressed-tensors"
    family = "int_weight"
    bits = (4, 8)

    def quantize(self, w, *, bits, group_size, sym, g_idx=None) -> CompressedTensorsCheckpoint:
        return self.pack(quantize_rtn(w, bits, group_size, sym, g_idx), sym=sym)

    def pack(self, iq: IntQuantized, *, sym: bool | None = None) -> CompressedTensorsCheckpoint:
        n, k = iq.shape
        check_bits(iq.bits, (4, 8), who="compressed-tensors")
        mid = 2 ** (iq.bits - 1)
        if sym is None:
            sym = bool((iq.zeros == mid).all())
        elif sym and not bool((iq.zeros == mid).all()):
            raise ValueError(f"compressed-tensors: sym=True needs every zero point at {mid}")
        trivial = torch.equal(iq.g_idx.cpu(), default_g_idx(k, iq.group_size))
        return CompressedTensorsCheckpoint(
            weight_packed=pack_bits(iq.q, iq.bits, dim=1),
            weight_scale=iq.scales.contiguous(),
            weight_shape=torch.tensor([n, k], dtype=torch.int64),
            weight_zero_point=None if sym else pack_bits(iq.zeros, iq.bits, dim=0),
            weight_g_idx=None if trivial else iq.g_idx.to(torch.int32),
            bits=iq.bits,
            group_size=iq.group_size,
        )

    def unpack(self, c: CompressedTensorsCheckpoint) -> IntQuantized:
        _check_checkpoint(c)
        n, k = c.out_features, c.in_features
        g = n_groups_for(k, c.group_size)
        dev = c.weight_packed.device
        if c.weight_zero_point is None:
            zeros = torch.full((n, g), 2 ** (c.bits - 1), dtype=torch.int32, device=dev)
        else:
            zeros = unpack_bits(c.weight_zero_point, c.bits, n, dim=0).to(torch.int32)
        g_idx = default_g_idx(k, c.group_size, dev) if c.weight_g_idx is None else c.weight_g_idx.long()
        return IntQuantized(
            q=unpack_bits(c.weight_packed, c.bits, k, dim=1),
            zeros=zeros.contiguous(),
            scales=c.weight_scale.contiguous(),
            g_idx=g_idx,
            bits=c.bits,
            group_size=c.group_size,
        )


FORMAT = CompressedTensorsFormat()
