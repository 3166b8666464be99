"""The collectives of the tensor-parallel layers, and the process-group stand-in for one process.

Only functional collectives (``torch.distributed._functional_collectives``) are used: Dynamo traces
them into the graph and Inductor schedules them, so layers compile with ``fullgraph=True`` and run
under CUDA graphs (NCCL) as well as on gloo (CPU). Eagerly they return ``AsyncCollectiveTensor``s;
each result is waited on here, so callers always hold plain tensors.

torch 2.13 renamed ``all_gather_tensor`` to ``all_gather_single`` (the old name warns); the name is
resolved once, at import.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class FakeGroup:
    """A process group that only knows its rank and size: sharded loading without communication.

    Layers built with it compute their own shard; a collective through it is an error (use
    ``reduce=False`` on row-parallel layers and embeddings, and ``layer.linear`` of a head).
    """

    rank_: int = 0
    size_: int = 1

    def __post_init__(self):
        if not (0 <= self.rank_ < self.size_):
            raise ValueError(f"FakeGroup: rank must lie in [0, {self.size_}), got {self.rank_}")

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


def group_rank(group) -> int:
    return 0 if group is None else group.rank()


def group_size(group) -> int:
    return 1 if group is None else group.size()


def _check_real(group, who: str) -> None:
    if isinstance(group, FakeGroup):
        raise RuntimeError(f"qops.distributed.{who}: a FakeGroup of size {group.size()} cannot communicate; use a torch.distributed process group")


def _waited(t: torch.Tensor) -> torch.Tensor:
    # Eager results are AsyncCollectiveTensors; traced ones are plain tensors (the wait is in the graph).
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the group (a new tensor; ``x`` is unchanged)."""
    _check_real(group, "all_reduce_sum")
    return _waited(funcol.all_reduce(x, "sum", group))


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last dimension, in rank order."""
    _check_real(group, "all_gather_last_dim")
    # Gathered along dim 0 with the last dimension moved in front: rank r's block then lands where
    # the concatenation along the last dimension puts it. Gathering along another dimension directly
    # goes through torch._utils._maybe_view_chunk_cat in torch 2.11, which Dynamo refuses to trace
    # (a graph break under fullgraph=True, seen on the two-GPU H200 machine).
    xt = x.movedim(-1, 0).contiguous()
    return _waited(_all_gather(xt, 0, group)).movedim(0, -1).contiguous()
