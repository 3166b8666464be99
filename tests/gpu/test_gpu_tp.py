"""Tensor-parallel layers on two GPUs over NCCL: every layer kind of the TinyBlock for every
checkpoint variant, equal to the single-GPU layers, eagerly, compiled (fullgraph, Inductor), as a
CUDA graph captured from the eager and from the compiled model (replayed on new ids, then replayed
again after zeroing its outputs), and through mode="reduce-overhead" (cudagraph trees, a skipped
capture is an error). Plus, on one GPU: loading peaks below one dense layer above the final
footprint (exact, from the CUDA allocator), and an act-order row shard keeps the whole layer's
lowering.

NVLink multicast stays off in every spawned process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Run with ``pytest -m gpu tests/gpu/test_gpu_tp.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from qops.distributed import FakeGroup
from qops.layers import Weights
from qops.layers.testing import NVLS_OFF, VARIANTS, block_checkpoints, free_port, tp_worker, write_checkpoint

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 CUDA devices, found {torch.cuda.device_count()}")

# fp16 activations: the ranks' partial sums are rounded to fp16 before the all-reduce. W8A8 with
# dynamic per-token activation scales quantizes each rank's slice of a row-parallel input with the
# slice's own amax, so those differ by the fp8 rounding of the activations.
# fp8-tensor-static (W8A8, static input_scale): the shards compute what the whole layers do (fp32
# on the CPU with W8A8 forced: equal up to summation order, 1.5e-7; tests/test_layers.py), but the
# activation quantization is a step function of fp16 values: a one-ulp change of a layer's input
# moves ~1/128 of its fp8 codes by a whole e4m3 step and its output by ~1e-2 of its max
# (tests/test_fp8.py), and the block chains five such layers. The one-ulp changes come from the
# partial sums (eager) and from Inductor computing the fp16 ops ahead of each quantization in fp32
# without rounding them (compiled: the whole block compiled differs from it eager by as much, and
# by 0 with emulate_precision_casts). Measured: two H200s (36b2c80) up to 0.051 (head, compiled);
# gloo with fp16 and W8A8 forced, same ids, 0.049; the whole block compiled vs eager on the CPU over
# 30 ids up to 0.073; the fp16 whole block vs the fp32 one up to 0.067.
TOLERANCES = {"default": 1e-2, "fp8-channel": 1e-1, "fp8-tensor-static": 1e-1}
# Every mode in one pair of ranks per variant: tp_worker reports the mismatches of all modes
# together. All 17 variants in one pair ran > 224 s on the H200 (26b1d5b), and the 9 dense and
# int-weight variants in one pair > 135 s (51dc144: one compiled graph of them all, Triton kernels
# compiled cold), neither finishing inside its call; one test per variant is recorded as it ends,
# so a call cut short still reports the variants it reached. Select with -k <variant>.
MODES = ("eager", "compiled", "cuda_graph", "compiled_cuda_graph", "reduce_overhead")


@pytest.fixture(scope="module")
def checkpoints():
    return block_checkpoints()


@needs_two_gpus
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tensor_parallel_layers_on_two_gpus_equal_one_gpu(checkpoints, name):
    os.environ.update(NVLS_OFF)  # inherited by the spawned ranks (which set it again)
    mp.spawn(tp_worker, args=(2, checkpoints, free_port(), "nccl", torch.float16, MODES, (name,), TOLERANCES),
             nprocs=2, join=True)


@pytest.mark.parametrize("name", ["dense", "gptq-v2-4bit-actorder", "gptq-v1-3bit-actorder", "awq-gemm", "ct-8bit-asym-channel", "fp8-channel",
                                  "eetq-ampere", "bnb-nf4-nested"])
def test_loading_to_the_gpu_peaks_below_one_dense_layer_above_the_final_footprint(tmp_path, name):
    n, k = 4096, 4096
    write_checkpoint(str(tmp_path), VARIANTS[name], {"layer": torch.randn(n, k) * 0.05}, shards=1)
    for how, world in (("whole", 1), ("col", 2), ("row", 2)):
        w = Weights.from_pretrained(str(tmp_path), device="cuda", dtype=torch.float16, process_group=FakeGroup(0, world))
        get = {"whole": w.get_weights, "col": w.get_weights_col, "row": w.get_weights_row}[how]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        layer = w.linear(get("layer"))
        torch.cuda.synchronize()
        over = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        final = torch.cuda.memory_allocated() - base
        dense = n * k * 2 // world
        assert over <= dense, f"{how}: peak {over} bytes above the final footprint ({final}), one dense fp16 shard is {dense}"
        del layer


@pytest.mark.parametrize("name", ["gptq-v2-4bit-actorder", "ct-4bit-actorder"])
def test_act_order_row_shards_keep_the_fast_lowering(tmp_path, name):
    write_checkpoint(str(tmp_path), VARIANTS[name], {"layer": torch.randn(1024, 2048) * 0.05}, shards=1)
    whole = Weights.from_pretrained(str(tmp_path), device="cuda", dtype=torch.float16)
    ref = whole.linear(whole.get_weights("layer"))
    x = torch.randn(8, 2048, device="cuda", dtype=torch.float16)
    total = 0
    for rank in range(2):
        w = Weights.from_pretrained(str(tmp_path), device="cuda", dtype=torch.float16, process_group=FakeGroup(rank, 2))
        shard = w.linear(w.get_weights_row("layer"))
        assert shard.act_perm is not None and shard.input_pad > 0
        assert shard.choice.lowering.name == ref.choice.lowering.name != "reference_int_weight", shard.choice.explain()
        total = total + shard(x[:, rank * 1024:(rank + 1) * 1024]).float()
    want = ref(x).float()
    assert (total - want).abs().max() <= 1e-2 * want.abs().max()
