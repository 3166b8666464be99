"""The reference decoder sharded over four and eight GPUs (NCCL, fp16, NVLink multicast off) equal to
the same model on one GPU, eagerly and through reduce-overhead CUDA graphs (one compilation for
batch sizes 1, 3 and 4, no skipped capture; three decode steps per batch size, so each is warmed up,
recorded and replayed on new tokens, and batch size 3 replayed again after the others: every visit
must replay a graph, ``qops.models.testing.TP_STEPS``), for each scheme of ``tests/test_tp_wide.py``.

Llama-3-70B's attention shapes: 64 query heads, 8 KV heads, head_dim 128, hidden 8192, so at world
size 8 each rank holds one KV head, and its fused qkv shard (N = 1280) and o_proj shard (K = 1024)
are 70B's. One decoder layer, intermediate 4096 and vocabulary 1024 keep the random checkpoint small
(every rank quantizes it on the host). One test per (world size, scheme), so a call cut short still
records what finished. A forced lowering is checked to serve every layer; act-order GPTQ and
per-tensor FP8 run where the chooser puts them (act-order row shards get local groups of 32 or 64
rows, ``qops.layers.act_order``, which native_w4a16 does not serve, so their layers mix lowerings).

Run on a machine with at least 4 (or 8) GPUs:
``pytest -m gpu tests/gpu/test_gpu_tp_wide.py -k world4`` and ``-k world8``.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from qops.models import LlamaConfig
from qops.models.testing import NVLS_OFF, free_port, tp_model_worker

pytestmark = pytest.mark.gpu

CONFIG = LlamaConfig(vocab_size=1024, hidden_size=8192, intermediate_size=4096, num_hidden_layers=1,
                     num_attention_heads=64, num_key_value_heads=8, head_dim=128)
# (scheme, lowering forced for every layer, or None: the chooser's pick)
CASES = [("none", None), ("gptq", "native_w4a16"), ("gptq-act-order", None), ("fp8", "scaled_mm_fp8"), ("fp8-tensor-static", None)]
# fp16 against fp16 on one GPU: row-parallel partial sums are rounded to fp16 before the all-reduce.
# W8A8 FP8 with per-token activation scales: each rank scales its own K slice of the activations.
# Static scales: fp16 ulp differences flip whole fp8 activation codes (tests/gpu/test_gpu_tp.py
# TOLERANCES and tests/test_fp8.py measure it: 8.7e-3 of a layer's max output per ulp of input).
# Both are estimates for this Frobenius error on the logits, not measurements: this file has not yet run
# on four or eight GPUs (tests/test_tp_wide.py shards these schemes over gloo on the CPU, in fp32, at a
# smaller hidden size, eagerly and compiled). Each test compares eager logits and, since TP_STEPS, logits from replayed CUDA graphs; its
# first run should report the errors it sees, and a failure there may be an estimate too tight.
TOLERANCE = {"fp8": 3e-2, "fp8-tensor-static": 3e-2}
DEFAULT_TOLERANCE = 1e-2


@pytest.mark.parametrize("world", [4, 8], ids=["world4", "world8"])
@pytest.mark.parametrize("scheme,lowering", CASES, ids=[s for s, _ in CASES])
def test_tensor_parallel_70b_ratios_reduce_overhead(world, scheme, lowering):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, found {torch.cuda.device_count()}")
    os.environ.update(NVLS_OFF)  # inherited by the spawned ranks (which set it again)
    item = scheme if lowering is None else (scheme, lowering)
    tol = TOLERANCE.get(scheme, DEFAULT_TOLERANCE)
    mp.spawn(tp_model_worker, args=(world, free_port(), "nccl", torch.float16, (item,), ("eager", "reduce_overhead"), tol, CONFIG),
             nprocs=world, join=True)
