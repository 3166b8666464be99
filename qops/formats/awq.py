"""AWQ GEMM checkpoints (HF ``quant_method == "awq"``, ``version``/``format`` "gemm"), 4-bit.

Tensors of one linear with K = in_features, N = out_features (a multiple of 8), G = group size:

- ``qweight`` int32 ``(K, N/8)`` and ``qzeros`` int32 ``(n_groups, N/8)``, both packed along **N**.
  Word c holds the eight columns 8c..8c+7 in an interleaved nibble order: nibble i (bits 4i..4i+3)
  holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``.
- ``scales`` fp16 ``(n_groups, N)``; n_groups = ceil(K / G).

``W[n, k] = scales[k // G, n] * (q[k, n] - z[k // G, n])``: no +1 on the zero (unlike GPTQ v1).
AWQ has no act-order. The GEMV layout (``(N, K/8)``) is a different format and not read here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._packing import pack_bits, unpack_bits
from .base import CheckpointFormat
from .integer import IntQuantized, check_group_size, check_integer, check_scales_dtype, check_tensor_arg, default_g_idx, n_groups_for, quantize_rtn

# Nibble i of a packed word holds column AWQ_ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of a group of eight sits in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass
class AWQCheckpoint:
    qweight: torch.Tensor  # (K, N/8) int32
    qzeros: torch.Tensor  # (n_groups, N/8) int32
    scales: torch.Tensor  # (n_groups, N) fp16
    group_size: int
    bits: int = 4

    # Checked here, not only in the format check: preparation reads K and N first.
    @property
    def in_features(self) -> int:
        check_tensor_arg(self.qweight, "qweight", 2, who="awq")
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        check_tensor_arg(self.scales, "scales", 2, who="awq")
        return self.scales.shape[1]


def _pack_n_interleaved(v: torch.Tensor) -> torch.Tensor:
    """(R, N) values < 16 -> (R, N/8) int32 in AWQ's nibble order."""
    r, n = v.shape
    nibbles = v.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, n)
    return pack_bits(nibbles, 4, dim=1)


def _unpack_n_interleaved(w: torch.Tensor, n: int) -> torch.Tensor:
    r = w.shape[0]
    nibbles = unpack_bits(w, 4, n, dim=1)
    return nibbles.reshape(r, n // 8, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, n)


def _check_checkpoint(c: AWQCheckpoint) -> None:
    who = "awq"
    check_integer(c.bits, "bits", who=who)
    if c.bits != 4:
        raise ValueError(f"{who}: bits must be 4 (AWQ GEMM packs nibbles), got {c.bits}")
    check_group_size(c.group_size, who=who)
    k, n = c.in_features, c.out_features
    check_tensor_arg(c.qzeros, "qzeros", who=who)
    if n % 8:
        raise ValueError(f"{who}: out_features N must be a multiple of 8 for the N-packed layout, got {n}")
    g = n_groups_for(k, c.group_size)
    for name, t, shape, dtype in (
        ("qweight", c.qweight, (k, n // 8), torch.int32),
        ("qzeros", c.qzeros, (g, n // 8), torch.int32),
        ("scales", c.scales, (g, n), None),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{who}: {name} must have shape {shape} (K={k}, N={n}, group_size={c.group_size}), got {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{who}: {name} must be {dtype}, got {t.dtype}")
    check_scales_dtype(c.scales, "scales", who=who)


class AWQFormat(CheckpointFormat):
    name = "awq"
    family = "int_weight"
    bits = (4,)

    def quantize(self, w, *, bits=4, group_size, sym=False) -> AWQCheckpoint:
        return self.pack(quantize_rtn(w, bits, group_size, sym))

    def pack(self, iq: IntQuantized) -> AWQCheckpoint:
        n, k = iq.shape
        if iq.bits != 4:
            raise ValueError(f"awq: bits must be 4, got {iq.bits}")
        if not torch.equal(iq.g_idx.cpu(), default_g_idx(k, iq.group_size)):
            raise ValueError("awq: AWQ has no act-order; g_idx must be k // group_size")
        if n % 8:
            raise ValueError(f"awq: out_features N must be a multiple of 8, got {n}")
        return AWQCheckpoint(
            qweight=_pack_n_interleaved(iq.q.t()),
            qzeros=_pack_n_interleaved(iq.zeros.t()),
            scales=iq.scales.t().contiguous(),
            group_size=iq.group_size,
        )

    def unpack(self, c: AWQCheckpoint) -> IntQuantized:
        _check_checkpoint(c)
        k, n = c.in_features, c.out_features
        return IntQuantized(
            q=_unpack_n_interleaved(c.qweight, n).t().contiguous(),
            zeros=_unpack_n_interleaved(c.qzeros, n).to(torch.int32).t().contiguous(),
            scales=c.scales.t().contiguous(),
            g_idx=default_g_idx(k, c.group_size, c.qweight.device),
            bits=4,
            group_size=c.group_size,
        )


FORMAT = AWQFormat()
