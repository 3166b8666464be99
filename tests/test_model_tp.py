"""The reference decoder sharded over two processes (gloo, CPU): for every scheme whose tiny model
splits in two, the sharded model's prefill and decode logits equal the single-process model's,
eagerly; and compiled (``fullgraph=True``, one compilation for batch sizes 1, 3 and 4) for the
default scheme."""

import pytest
import torch
import torch.multiprocessing as mp

from qops.models import QUANT_SCHEMES
from qops.models.testing import free_port, tp_model_worker

pytestmark = pytest.mark.multiprocess

# 128x128 fp8 blocks: the tiny model's k/v projections (N = 128) do not split in two.
UNSPLITTABLE = {"fp8-block"}
TOLERANCE = 1e-5  # fp32; the ranks' partial sums differ from the whole matmul only in summation order



def test_every_scheme_but_the_unsplittable_ones_is_checked():
    assert UNSPLITTABLE <= set(QUANT_SCHEMES)


def test_tensor_parallel_model_equals_one_process_eagerly():
    schemes = ("none", *(s for s in QUANT_SCHEMES if s not in UNSPLITTABLE))
    mp.spawn(tp_model_worker, args=(2, free_port(), "gloo", torch.float32, schemes, ("eager",), TOLERANCE), nprocs=2, join=True)


def test_tensor_parallel_model_compiles_fullgraph():
    mp.spawn(tp_model_worker, args=(2, free_port(), "gloo", torch.float32, ("gptq",), ("compiled",), TOLERANCE), nprocs=2, join=True)
