"""The reference decoder sharded over four and eight processes (gloo, CPU, fp32), with Llama-3-70B's
head ratios: 8 KV heads and 8 query heads per KV head, so at world size 8 each rank holds one KV
head and its 8 query heads. For each scheme -- dense, GPTQ int4 g128 with and without act-order,
FP8 with per-channel scales and dynamic activations, FP8 with per-tensor scales and static
activation scales (fused q/k/v and gate/up each carry one scale per layer) -- the sharded model's
prefill and decode logits equal the single-process model's, eagerly at world size 8, and
compiled (``fullgraph=True``, one compilation for batch sizes 1, 3 and 4) for act-order GPTQ at
world size 4, whose row-parallel shards are rewritten with padding rows (``qops.layers.act_order``).

Sizes: head_dim 16 (hidden 64 * 16 = 1024) and intermediate 1024 give every row-parallel shard at
world size 8 K = 128, one whole GPTQ group, which plain (non-act-order) GPTQ shards need. The GPU
version of this file is ``tests/gpu/test_gpu_tp_wide.py``.
"""

import pytest
import torch
import torch.multiprocessing as mp

from qops.models import LlamaConfig
from qops.models.testing import TEST_SCHEMES, free_port, scheme_by_name, tp_model_worker

pytestmark = pytest.mark.multiprocess

CONFIG = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=16)
SCHEMES = ("none", "gptq", "gptq-act-order", "fp8", "fp8-tensor-static")
TOLERANCE = 1e-5  # fp32; the ranks' partial sums differ from the whole matmul only in summation order


def test_config_has_llama3_70b_head_ratios():
    assert CONFIG.num_key_value_heads == 8 and CONFIG.num_attention_heads == 8 * CONFIG.num_key_value_heads
    assert all(s == "none" or scheme_by_name(s) is not None for s in SCHEMES)
    assert set(TEST_SCHEMES) <= set(SCHEMES)


# World 8 only: one KV head a rank is the case this file is for; several heads a rank are
# tests/test_model_tp.py's (world 2) and this file's compiled world-4 test's (24 s of CI saved).
def test_tensor_parallel_model_equals_one_process_eagerly():
    mp.spawn(tp_model_worker, args=(8, free_port(), "gloo", torch.float32, SCHEMES, ("eager",), TOLERANCE, CONFIG),
             nprocs=8, join=True)


def test_tensor_parallel_act_order_model_compiles_fullgraph_at_world_size_4():
    mp.spawn(tp_model_worker, args=(4, free_port(), "gloo", torch.float32, ("gptq-act-order",), ("compiled",), TOLERANCE, CONFIG),
             nprocs=4, join=True)
