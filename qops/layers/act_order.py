"""Row-parallel shards of act-order weights, resolved on each rank with the same fast op.

With act-order (GPTQ ``desc_act``, compressed-tensors ``actorder="group"``) a group's rows are
scattered over K; ``g_idx[k]`` names the group of row k. The runtime layout
(``qops/ops/int_weight.py``) wants groups as contiguous runs of exactly ``group_size`` rows once
``act_perm`` has gathered the activations. A row-parallel rank owns the checkpoint rows
``[k0, k1)`` -- the activation columns the previous column-parallel layer left on it -- and holds
``c_g`` of group g's rows, anywhere from 0 to G. Such a shard is not a valid act-order layer.

So each rank rewrites its shard into an act-order layer of its own, without touching a weight bit:

- its group size becomes G', a divisor of G (a multiple of 32, for the Triton decode path) chosen
  to minimise the runtime bytes;
- group g's ``c_g`` rows become ``ceil(c_g / G')`` new groups of G' rows, each with g's scales and
  zeros (gathered from the full tables, which act-order row shards read whole -- small);
- the last new group of g is completed with padding rows, appended after the real rows
  (K' = K_loc + pad, packed words extended with zero words). Padding rows meet activations the layer
  pads with zeros, so they contribute exactly nothing;
- ``g_idx`` of the new layer gives every row its new group. The format's own ``prepare`` resolves
  the act-order permutation as for any act-order checkpoint, and the same op and lowering run it.

The price is the padding rows: none when every group splits evenly across ranks into multiples of
32 rows, about G'/2 rows per group otherwise -- for G = 128 and a random act-order, about 25% more
rows at world size 2 and up to twice the rows at world size 8, where a group's ~16 local rows fill
half of a 32-row group. A kernel reading one group index per row (or per run) would remove it. The rewritten shard keeps the checkpoint format, so everything downstream (prepare,
chunked preparation, the lowering choice) is the ordinary path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import LinearLayout, WeightsError


def _runtime_bytes_per_column(counts: torch.Tensor, g: int, bits: int) -> tuple[int, int]:
    m = (counts + g - 1) // g
    groups = int(m.sum())
    rows = groups * g
    # packed rows + one fp16 scale and one packed zero per group (per output column)
    return rows * bits + groups * (16 + bits), rows


# Smallest local group size: the Triton lowering's decode (small batch) path needs group_size % 32
# == 0; a smaller G' would send decode of the shard down the GEMM path.
MIN_GROUP = 32


def choose_group_size(counts: torch.Tensor, group_size: int, bits: int) -> int:
    """The divisor G' of ``group_size`` (a multiple of MIN_GROUP when ``group_size`` is) minimising
    the local runtime bytes."""
    floor = MIN_GROUP if group_size % MIN_GROUP == 0 else 1
    best = None
    for d in range(group_size, 0, -1):
        if group_size % d or d % floor:
            continue
        cost, _ = _runtime_bytes_per_column(counts, d, bits)
        if best is None or cost < best[0]:
            best = (cost, d)
    return best[1]


def localize(
    tensors: dict[str, torch.Tensor | None],
    layout: LinearLayout,
    *,
    k_local: int,
    n_groups: int,
    group_size: int,
    bits: int,
) -> tuple[dict[str, torch.Tensor | None], int, int, int]:
    """Rewrite a row shard (k-dimensions local, blocked k-dimensions holding all ``n_groups``
    groups, local ``g_idx``) as a self-contained act-order layer.

    Returns ``(tensors, k_runtime, new_group_size, pad)`` with ``k_runtime = k_local + pad``.
    """
    _check_group_rows(tensors, layout, n_groups)
    g_idx = tensors[layout.g_idx]
    dev = g_idx.device
    g = g_idx.long()
    if g.numel() != k_local:
        raise WeightsError(f"act-order shard: g_idx has {g.numel()} entries for {k_local} rows")
    if k_local and bool(((g < 0) | (g >= n_groups)).any()):
        raise WeightsError(f"act-order shard: g_idx values must lie in [0, {n_groups}), got {int(g.min())}..{int(g.max())}")
    counts = torch.bincount(g, minlength=n_groups)
    if bool((counts > group_size).any()):
        raise WeightsError(f"act-order shard: a group holds {int(counts.max())} rows, more than group_size={group_size}")
    g_new = choose_group_size(counts, group_size, bits)
    m = (counts + g_new - 1) // g_new  # new groups per original group
    starts = torch.cumsum(m, 0) - m
    src = torch.repeat_interleave(torch.arange(n_groups, device=dev), m)  # new group -> original group
    order = torch.argsort(g, stable=True)
    sorted_g = g[order]
    first = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(k_local, device=dev) - first[sorted_g]
    new_idx = torch.empty_like(g)
    new_idx[order] = starts[sorted_g] + rank_in_group // g_new
    pads = m * g_new - counts
    pad_idx = torch.repeat_interleave(starts + m - 1, pads)
    pad = int(pads.sum())
    k_rt = k_local + pad

    out: dict[str, torch.Tensor | None] = {}
    for t in layout.tensors:
        v = tensors.get(t.name)
        if v is None or t.name == layout.g_idx:
            continue
        for d_i, d in enumerate(t.dims):
            if d.axis != "k":
                continue
            if d.block:
                v = v.index_select(d_i, src.to(v.device)) if d.block != -1 else v
            elif d.bits:
                v = _extend_packed(v, d_i, k_local, k_rt, d.bits)
            else:
                shape = [0] * (2 * v.dim())
                shape[2 * (v.dim() - 1 - d_i) + 1] = pad
                v = F.pad(v, shape)
        out[t.name] = v
    out[layout.g_idx] = torch.cat([new_idx, pad_idx]).to(g_idx.dtype)
    return out, k_rt, g_new, pad


def _check_group_rows(tensors: dict[str, torch.Tensor | None], layout: LinearLayout, n_groups: int) -> None:
    """Every grouped tensor (scales, zeros) holds one row per group of the whole layer: a shard
    reads all of them, and its new groups index them by the original group."""
    for t in layout.tensors:
        v = tensors.get(t.name)
        for d_i, d in enumerate(t.dims):
            if v is not None and d.axis == "k" and d.block not in (0, -1) and v.shape[d_i] != n_groups:
                raise WeightsError(f"act-order shard: {t.name} has {v.shape[d_i]} group rows along K (dim {d_i}), expected {n_groups}: "
                                   f"a row shard holds every group of the layer, and the other grouped tensors have {n_groups}")


def _extend_packed(v: torch.Tensor, dim: int, k_local: int, k_rt: int, bits: int) -> torch.Tensor:
    """Append ``k_rt - k_local`` zero values to a bit stream packed along ``dim``."""
    words, words_rt = -(-k_local * bits // 32), -(-k_rt * bits // 32)
    v = v.movedim(dim, 0)
    if v.shape[0] != words:
        raise WeightsError(f"act-order shard: a packed tensor has {v.shape[0]} words along K, expected {words} for {k_local} values")
    used = k_local * bits % 32
    if used:
        # Bits past the last value of a partial word must read as zero padding values.
        v = v.clone()
        v[-1] &= (1 << used) - 1
    v = torch.cat([v, v.new_zeros((words_rt - words, *v.shape[1:]))])
    return v.movedim(0, dim).contiguous()
