"""Tensor-parallel layers across processes over gloo: world sizes 2 and 3, every layer kind of the
TinyBlock (column, fused qkv, fused q/k/v, gate_up, row, head with and without a dividing vocabulary,
embedding with out-of-range ids) for every checkpoint variant, equal to the single-process layers
eagerly, and at world size 2 also compiled with fullgraph=True (one compilation per process for all
variants, then a second call that must not recompile)."""

import pytest
import torch
import torch.multiprocessing as mp

from qops.layers.testing import VARIANTS, block_checkpoints, free_port, tp_worker

pytestmark = pytest.mark.multiprocess

# fp32 on CPU: the ranks' partial sums differ from the whole matmul only in summation order.
TOLERANCES = {"default": 1e-4}


@pytest.fixture(scope="module")
def checkpoints():
    return block_checkpoints()



# World 3 (shards that do not divide evenly) eagerly: its compiled run traced the same graph as world
# 2's with other sizes and took ~40 of its 76 s on CI's two cores, three processes compiling at once.
@pytest.mark.parametrize("world, modes", [(2, ("eager", "compiled")), (3, ("eager",))], ids=["2", "3"])
def test_tensor_parallel_layers_equal_the_single_process_layers(checkpoints, world, modes):
    mp.spawn(tp_worker, args=(world, checkpoints, free_port(), "gloo", torch.float32, modes, tuple(VARIANTS), TOLERANCES),
             nprocs=world, join=True)
