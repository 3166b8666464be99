"""GPTQ checkpoints (HF ``quant_method == "gptq"``), v1 and v2 zero conventions, act-order.

Tensors of one linear with K = in_features, N = out_features, G = group size, b = bits:

- ``qweight`` int32 ``(ceil(K*b/32), N)``: column n is a little-endian bit stream along K; row k of
  the weight sits at stream bits ``[k*b, (k+1)*b)``. For 4 bits, k = 8r + i is nibble i of word r.
  3 bits: 32 values in 3 words, values 10 and 21 straddle words.
- ``qzeros`` int32 ``(n_groups, ceil(N*b/32))``: the same bit stream, along N.
- ``scales`` fp16 ``(n_groups, N)``; ``g_idx`` int32 ``(K,)`` mapping each row to its group
  (``k // G`` without act-order, any assignment of G rows per group with it).
- n_groups = ceil(K / G) (1 when G == -1); a partial last group is allowed.

``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``, where ``z`` is the stored zero
plus 1 in v1 checkpoints (``checkpoint_format == "gptq"``; v1 writers store ``z - 1``) and the stored
zero in v2 (``"gptq_v2"``). A v1 zero of 0 cannot be stored; a stored v1 value of ``2**b - 1`` means
``z = 2**b``, which v2 cannot hold. Symmetric 4-bit v1 zeros are ``0x77777777``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._packing import pack_bits, packed_length, unpack_bits
from .base import CheckpointFormat
from .integer import IntQuantized, check_bits, check_g_idx, check_group_size, check_scales_dtype, check_tensor_arg, n_groups_for, quantize_rtn

VERSIONS = ("v1", "v2")


@dataclass
class GPTQCheckpoint:
    qweight: torch.Tensor  # (ceil(K*bits/32), N) int32
    qzeros: torch.Tensor  # (n_groups, ceil(N*bits/32)) int32
    scales: torch.Tensor  # (n_groups, N) fp16
    g_idx: torch.Tensor | None  # (K,) int32
    bits: int
    group_size: int
    in_features: int
    version: str = "v2"  # "v1" (zero - 1 stored) or "v2"

    @property
    def out_features(self) -> int:
        # Checked here, not only in the format check: preparation reads N first.
        check_tensor_arg(self.qweight, "qweight", 2, who="gptq")
        return self.qweight.shape[1]


def version_from_config(quantization_config: dict) -> str:
    """HF configs name the zero convention ``checkpoint_format`` (older) or ``format`` (newer)."""
    fmt = quantization_config.get("checkpoint_format", quantization_config.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq: checkpoint_format must be 'gptq' or 'gptq_v2', got {fmt!r}")
    return "v2" if fmt == "gptq_v2" else "v1"


def _check_checkpoint(c: GPTQCheckpoint) -> None:
    who = "gptq"
    check_bits(c.bits, who=who)
    check_group_size(c.group_size, who=who)
    if c.version not in VERSIONS:
        raise ValueError(f"{who}: version must be one of {VERSIONS}, got {c.version!r}")
    check_tensor_arg(c.qzeros, "qzeros", who=who)
    check_tensor_arg(c.scales, "scales", who=who)
    if c.g_idx is not None:
        check_tensor_arg(c.g_idx, "g_idx", who=who)
    k, n, b = c.in_features, c.out_features, c.bits
    g = n_groups_for(k, c.group_size)
    expect = {
        "qweight": ((packed_length(k, b), n), torch.int32, c.qweight),
        "qzeros": ((g, packed_length(n, b)), torch.int32, c.qzeros),
        "scales": ((g, n), None, c.scales),
    }
    if c.g_idx is not None:
        expect["g_idx"] = ((k,), None, c.g_idx)
    for name, (shape, dtype, t) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{who}: {name} must have shape {shape} (K={k}, N={n}, bits={b}, group_size={c.group_size}), got {tuple(t.shape)}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{who}: {name} must be {dtype}, got {t.dtype}")
    check_scales_dtype(c.scales, "scales", who=who)
    if c.g_idx is not None:
        check_g_idx(c.g_idx, g, "g_idx", who=who)


class GPTQFormat(CheckpointFormat):
    name = "gptq"
    family = "int_weight"
    bits = (2, 3, 4, 8)

    def quantize(self, w, *, bits, group_size, sym, g_idx=None, version="v2") -> GPTQCheckpoint:
        return self.pack(quantize_rtn(w, bits, group_size, sym, g_idx), version=version)

    def pack(self, iq: IntQuantized, *, version: str = "v2") -> GPTQCheckpoint:
        n, k = iq.shape
        zeros = iq.zeros
        if version == "v1":
            if bool((zeros == 0).any()):
                raise ValueError("gptq: a zero point of 0 cannot be stored in a v1 checkpoint; write v2")
            zeros = zeros - 1
        if bool((zeros >= 2**iq.bits).any()):
            raise ValueError(f"gptq: zero points must be < 2**bits = {2**iq.bits} in a {version} checkpoint")
        return GPTQCheckpoint(
            qweight=pack_bits(iq.q.t(), iq.bits, dim=0),
            qzeros=pack_bits(zeros.t(), iq.bits, dim=1),
            scales=iq.scales.t().contiguous(),
            g_idx=iq.g_idx.to(torch.int32),
            bits=iq.bits,
            group_size=iq.group_size,
            in_features=k,
            version=version,
        )

    def unpack(self, c: GPTQCheckpoint) -> IntQuantized:
        _check_checkpoint(c)
        k, n = c.in_features, c.out_features
        q = unpack_bits(c.qweight, c.bits, k, dim=0).t()
        z = unpack_bits(c.qzeros, c.bits, n, dim=1).to(torch.int32).t()
        if c.version == "v1":
            z = z + 1
        g_idx = c.g_idx
        if g_idx is None:
            g_idx = torch.arange(k, device=q.device) // (k if c.group_size == -1 else c.group_size)
        return IntQuantized(
            q=q.contiguous(),
            zeros=z.contiguous(),
            scales=c.scales.t().contiguous(),
            g_idx=g_idx.long(),
            bits=c.bits,
            group_size=c.group_size,
        )

    def prepare(self, c: GPTQCheckpoint, *, dtype: torch.dtype | None = None, choose_lowering: bool = True):
        # Without act-order the checkpoint's qweight is already the runtime packing: no copy.
        from ..ops.int_weight import prepare_int_weight

        return prepare_int_weight(self.unpack(c), dtype=dtype, format_name=self.name, checkpoint_qweight=c.qweight, choose_lowering=choose_lowering)


def convert_version(c: GPTQCheckpoint, version: str) -> GPTQCheckpoint:
    """Rewrite ``qzeros`` for the other zero convention (v1 <-> v2); other tensors are shared."""
    if version not in VERSIONS:
        raise ValueError(f"gptq: version must be one of {VERSIONS}, got {version!r}")
    if version == c.version:
        return c
    n = c.out_features
    z = unpack_bits(c.qzeros, c.bits, n, dim=1).to(torch.int32)
    limit = 2**c.bits
    if version == "v2":
        z = z + 1
        if bool((z >= limit).any()):
            raise ValueError(f"gptq: qzeros holds a v1 zero of {limit} (stored {limit - 1}), which a v2 checkpoint cannot hold")
    else:
        if bool((z == 0).any()):
            raise ValueError("gptq: qzeros holds a zero point of 0, which a v1 checkpoint cannot hold")
        z = z - 1
    return replace(c, qzeros=pack_bits(z, c.bits, dim=1), version=version)


FORMAT = GPTQFormat()
