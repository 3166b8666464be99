"""The reference decoder sharded over two processes (gloo, CPU): for every scheme whose tiny model
splits in two, the sharded model's prefill and decode logits equal the single-process model's,
eagerly (and with lm_head quantized for GPTQ and NF4); and compiled (``fullgraph=True``, one compilation for batch sizes 1, 3 and 4) for the
default scheme."""

import json

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
    # "+head": lm_head quantized as well, so the vocabulary-parallel head shards a quantized weight.
    schemes = ("none", *(s for s in QUANT_SCHEMES if s not in UNSPLITTABLE), "gptq+head", "bitsandbytes-nf4+head")
    mp.spawn(tp_model_worker, args=(2, free_port(), "gloo", torch.float32, schemes, ("eager",), TOLERANCE), nprocs=2, join=True)


def test_tensor_parallel_model_compiles_fullgraph():
    mp.spawn(tp_model_worker, args=(2, free_port(), "gloo", torch.float32, ("gptq",), ("compiled",), TOLERANCE), nprocs=2, join=True)


def test_pairs_in_one_spawn_report_each_item(tmp_path):
    """(scheme, lowering) items, as the two-GPU test runs every pair in one spawn: each rank reports
    each item; a lowering the chooser refuses for the sharded layers is reported as refused, not compared."""
    items = (("gptq", "reference_int_weight"), ("none", "dense"), ("gptq", "triton_int_weight"))
    tols = {"gptq-reference_int_weight": TOLERANCE, "none-dense": TOLERANCE, "gptq-triton_int_weight": TOLERANCE}
    report = tmp_path / "report"
    mp.spawn(tp_model_worker, args=(2, free_port(), "gloo", torch.float32, items, ("eager",), tols, None, str(report)),
             nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"report.{rank}").read_text())
        assert got["gptq-reference_int_weight"] == got["none-dense"] == {"failures": [], "refused": None}
        # triton serves fp16 / bf16 activations only; these ranks run fp32
        assert got["gptq-triton_int_weight"]["failures"] == [] and "not triton_int_weight" in got["gptq-triton_int_weight"]["refused"]
