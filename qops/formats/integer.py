"""The meaning shared by every integer weight-only checkpoint layout (GPTQ, AWQ, compressed-tensors).

A weight ``W`` of shape ``(N, K)`` (out_features, in_features, as ``torch.nn.Linear`` holds it) is

    W[n, k] = scales[n, g_idx[k]] * (q[n, k] - zeros[n, g_idx[k]])

with ``q`` unsigned in ``[0, 2**bits)``, ``zeros`` integer and ``scales`` floating point, one column
of ``scales``/``zeros`` per group. Without act-order ``g_idx[k] = k // group_size``; the last group may
be partial (``K % group_size != 0``). ``group_size == -1`` means one group spanning all of K.

Each checkpoint layout converts to and from :class:`IntQuantized`; the runtime layout the kernels
read is built from it (``qops.ops.int_weight.prepare_int_weight``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8)
# Checkpoints store scales in the model dtype; the int_weight ops read exactly these.
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class IntQuantized:
    q: torch.Tensor  # (N, K) uint8, values < 2**bits
    zeros: torch.Tensor  # (N, n_groups) int32; may reach 2**bits for GPTQ v1 checkpoints
    scales: torch.Tensor  # (N, n_groups) floating point
    g_idx: torch.Tensor  # (K,) int64, values in [0, n_groups)
    bits: int
    group_size: int  # -1 or the number of K rows per group

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``(N, K)``."""
        g = self.g_idx.long()
        s = self.scales.float().index_select(1, g)
        z = self.zeros.float().index_select(1, g)
        return s * (self.q.float() - z)


def check_integer(value, name: str, *, who: str) -> None:
    # 4.0 == 4 and True == 1 would pass a range check, then fail inside a shift or silently truncate.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who}: {name} must be an integer, got {type(value).__name__} {value!r}")


def check_tensor_arg(t, name: str, ndim: int | None = None, *, who: str) -> None:
    """``t`` is a tensor (of ``ndim`` dimensions when given): checked before its shape is read."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{who}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_scales_dtype(scales: torch.Tensor, name: str, *, who: str) -> None:
    # float64 or float8 scales would pass as "floating point", then set the activation dtype no
    # lowering serves, in an error that never names the tensor.
    if scales.dtype not in SCALE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
        raise ValueError(f"{who}: {name} must be floating point ({names}), got {scales.dtype}")


def check_g_idx(g_idx: torch.Tensor, n_groups: int, name: str, *, who: str) -> None:
    """Integer group indices in ``[0, n_groups)``. Reads the values (a host sync): for checkpoint
    tensors on the reference path, never inside an op."""
    if g_idx.is_floating_point() or g_idx.dtype == torch.bool:
        raise ValueError(f"{who}: {name} must be an integer tensor, got {g_idx.dtype}")
    if g_idx.numel() and bool(((g_idx < 0) | (g_idx >= n_groups)).any()):
        raise ValueError(f"{who}: {name}: values must lie in [0, {n_groups}) (one group index per row), got {int(g_idx.min())}..{int(g_idx.max())}")


def check_bits(bits: int, allowed=SUPPORTED_BITS, *, who: str) -> None:
    check_integer(bits, "bits", who=who)
    if bits not in allowed:
        raise ValueError(f"{who}: bits must be one of {list(allowed)}, got {bits}")


def n_groups_for(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else (k + group_size - 1) // group_size


def check_group_size(group_size: int, *, who: str) -> None:
    check_integer(group_size, "group_size", who=who)
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"{who}: group_size must be -1 or a positive integer, got {group_size}")


def default_g_idx(k: int, group_size: int, device=None) -> torch.Tensor:
    if group_size == -1:
        return torch.zeros(k, dtype=torch.int64, device=device)
    return torch.arange(k, device=device) // group_size


def act_order_g_idx(k: int, group_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A g_idx as GPTQ act-order writes it: rows quantized in a permuted order, G per group."""
    order = torch.randperm(k, generator=generator)
    g = torch.empty(k, dtype=torch.int64)
    g[order] = default_g_idx(k, group_size)
    return g


def quantize_rtn(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    g_idx: torch.Tensor | None = None,
) -> IntQuantized:
    """Round-to-nearest quantization of ``w`` (N, K), per (row, group), GPTQ's min/max rule.

    Symmetric: ``scale = 2*max|w| / (2**bits - 1)``, zero at the midpoint ``2**(bits-1)``.
    Asymmetric: ``scale = (max - min) / (2**bits - 1)``, ``zero = round(-min / scale)``.
    """
    check_bits(bits, who="quantize_rtn")
    n, k = w.shape
    check_group_size(group_size, who="quantize_rtn")
    g = default_g_idx(k, group_size, w.device) if g_idx is None else g_idx.to(w.device).long()
    n_groups = int(g.max().item()) + 1 if k else n_groups_for(k, group_size)
    maxq = 2**bits - 1
    wf = w.float()
    inf = torch.tensor(float("inf"), device=w.device)
    # Per (row, group) min and max via scatter over the group index of each column.
    gmin = torch.full((n, n_groups), float("inf"), device=w.device)
    gmax = torch.full((n, n_groups), float("-inf"), device=w.device)
    idx = g.unsqueeze(0).expand(n, k)
    gmin = gmin.scatter_reduce(1, idx, wf, "amin")
    gmax = gmax.scatter_reduce(1, idx, wf, "amax")
    gmin = torch.where(gmin == inf, torch.zeros_like(gmin), gmin).clamp(max=0)
    gmax = torch.where(gmax == -inf, torch.zeros_like(gmax), gmax).clamp(min=0)
    if sym:
        amax = torch.maximum(gmax, -gmin)
        gmin, gmax = -amax, amax
    scale = (gmax - gmin) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        zero = torch.round(-gmin / scale).clamp(0, maxq)
    scale_h = scale.to(torch.float16)  # checkpoints store fp16 scales; quantize against them
    s_k = scale_h.float().index_select(1, g)
    z_k = zero.index_select(1, g)
    q = torch.clamp(torch.round(wf / s_k + z_k), 0, maxq).to(torch.uint8)
    return IntQuantized(q=q, zeros=zero.to(torch.int32), scales=scale_h, g_idx=g, bits=bits, group_size=group_size)
