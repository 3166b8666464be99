"""Tensor-parallel layers (LoRAX/TGI names and loaders), compiled and captured as they are.

With world size w and rank r of ``weights.process_group``:

- ``TensorParallelColumnLinear``: rank r holds N/w output features (of each fused block) and returns
  its slice of the output; no communication.
- ``TensorParallelRowLinear``: rank r holds K/w input features and reads its slice of the input;
  the partial outputs are summed with an all-reduce when the group has more than one member. The
  bias is given to rank 0's matmul only, so it is added once (also with ``reduce=False``, where the
  caller reduces).
- ``TensorParallelHead``: the vocabulary is split like a column layer and the logits all-gathered;
  when the vocabulary (or its quantized layout) does not split, every rank holds the full head.
- ``TensorParallelEmbedding``: rank r holds rows ``[r*B, min(V, (r+1)*B))`` with B = ceil(V/w) plus
  one zero row; ids outside the block -- including ids outside the vocabulary -- read the zero row,
  and the all-reduce adds the ranks' rows.

Collectives are functional (``qops.distributed``), so ``torch.compile(fullgraph=True)`` traces them;
the layers hold their weights as parameters or buffers, so CUDA graphs see static addresses.
``config`` arguments are accepted for LoRAX/TGI signature compatibility and not read: the
checkpoint's own config (through ``weights``) decides the quantization.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_gather_last_dim, all_reduce_sum, group_rank, group_size
from ..lowerings import silu_mul
from .base import QuantLinear
from .layout import ShardingError, join
from .loader import Weights, qkv_sizes


class SuperLayer(nn.Module):
    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class TensorParallelColumnLinear(SuperLayer):
    @classmethod
    def load(cls, config, prefix: str, weights: Weights, bias: bool) -> "TensorParallelColumnLinear":
        w = weights.get_weights_col(prefix)
        b = weights.get_bias_col_packed(prefix, 1) if bias else None
        return cls(weights.linear(w, b))

    @classmethod
    def load_multi(cls, config, prefixes: list[str], weights: Weights, bias: bool, dim: int = 0) -> "TensorParallelColumnLinear":
        w = weights.get_multi_weights_col(prefixes, dim=dim)
        b = weights.get_bias_multi_col(prefixes) if bias else None
        return cls(weights.linear(w, b))

    @classmethod
    def load_qkv(cls, config, prefix: str, weights: Weights, bias: bool, num_heads: int, num_key_value_heads: int) -> "TensorParallelColumnLinear":
        """A fused ``[q; k; v]`` projection: each of q, k, v is split by heads on its own."""
        w = weights.get_weights_col_packed_qkv(prefix, num_heads, num_key_value_heads)
        b = None
        if bias:
            n = weights.shape(join(prefix, "bias"))[0]
            b = weights.get_bias_col_packed(prefix, qkv_sizes(prefix, n, num_heads, num_key_value_heads, weights.world_size))
        return cls(weights.linear(w, b))

    @classmethod
    def load_gate_up(cls, config, prefix: str, weights: Weights, bias: bool) -> "TensorParallelColumnLinear":
        """A fused ``[gate; up]`` projection: each half is split on its own."""
        w = weights.get_weights_col_packed_gate_up(prefix)
        b = weights.get_bias_col_packed(prefix, 2) if bias else None
        return cls(weights.linear(w, b))

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a fused ``[gate; up]`` layer (:meth:`load_multi` of gate and up,
        :meth:`load_gate_up`): the rank's gate and up slices are the two halves of its output. A
        quantized layer may compute it in one kernel (:meth:`QuantLinear.forward_swiglu`)."""
        if isinstance(self.linear, QuantLinear):
            return self.linear.forward_swiglu(x)
        return silu_mul(self.linear(x))

    def prepare_swiglu(self) -> None:
        """Load :meth:`forward_swiglu`'s kernels now, before any CUDA-graph capture."""
        if isinstance(self.linear, QuantLinear):
            self.linear.prepare_swiglu()


class TensorParallelRowLinear(SuperLayer):
    def __init__(self, linear: nn.Module, process_group) -> None:
        super().__init__(linear)
        self.process_group = process_group
        self.world_size = group_size(process_group)

    @classmethod
    def load(cls, config, prefix: str, weights: Weights, bias: bool) -> "TensorParallelRowLinear":
        w = weights.get_weights_row(prefix)
        # Only rank 0 adds the bias, so the sum over ranks holds it once.
        b = weights.get_bias(prefix) if bias and weights.rank == 0 else None
        return cls(weights.linear(w, b), weights.process_group)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        y = self.linear(x)
        if reduce and self.world_size > 1:
            y = all_reduce_sum(y, self.process_group)
        return y


class TensorParallelHead(SuperLayer):
    def __init__(self, linear: nn.Module, process_group, should_gather: bool) -> None:
        super().__init__(linear)
        self.process_group = process_group
        self.should_gather = should_gather

    @classmethod
    def load(cls, config, prefix: str, weights: Weights) -> "TensorParallelHead":
        should_gather = weights.world_size > 1
        if should_gather:
            try:
                w = weights.get_weights_col(prefix)
            except ShardingError:
                # The vocabulary (or its packing) does not split: every rank holds the whole head.
                w, should_gather = weights.get_weights(prefix), False
        else:
            w = weights.get_weights(prefix)
        return cls(weights.linear(w), weights.process_group, should_gather)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.should_gather:
            y = all_gather_last_dim(y, self.process_group)
        return y


class TensorParallelEmbedding(nn.Module):
    def __init__(self, prefix: str, weights: Weights, reduce: bool = True) -> None:
        super().__init__()
        name = join(prefix, "weight")
        shard = weights.get_partial_sharded(name, dim=0)
        num_embeddings = weights.shape(name)[0]
        rank, world = group_rank(weights.process_group), group_size(weights.process_group)
        block = -(-num_embeddings // world)
        self.min_id = min(num_embeddings, rank * block)
        self.max_id = min(num_embeddings, (rank + 1) * block)
        self.null_idx = shard.shape[0]  # the appended zero row
        self.process_group = weights.process_group
        self.world_size = world
        self.reduce = reduce
        self.weight = nn.Parameter(F.pad(shard, (0, 0, 0, 1)), requires_grad=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = torch.where((input < self.min_id) | (input >= self.max_id), self.null_idx, input - self.min_id)
        out = F.embedding(ids, self.weight)
        if self.reduce and self.world_size > 1:
            out = all_reduce_sum(out, self.process_group)
        return out
