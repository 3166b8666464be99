"""torch.compile of the layer modules: one module holding a layer of every registered checkpoint
type (an act-order row shard with padded input among them), FastLinear, and the tensor-parallel
layers at world size 1. One compilation (fullgraph=True, Inductor) serves every batch size; the
numbers are the eager ones; each quantized linear is exactly one opaque qops call reading the
module's buffers -- with a workspace attached, the ``_out`` op, every one given the workspace's
buffer as the same graph input, never copied; world size 1 emits no collective."""
from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

import qops  # noqa: F401
from qops.formats import FORMATS
from qops.formats.integer import act_order_g_idx
from qops.layers import CHECKPOINT_LINEARS, Blockwise4Linear, FastLinear, Int8Linear, IntWeightLinear, QuantLinear, Weights, get_linear
from qops.layers import act_order
from qops.layers import int_weight as lw
from qops.layers.base import InputPadded
from qops.layers.fp8 import Fp8Linear
from qops.layers.testing import VARIANTS, TinyBlock, sample_ids, write_block
from qops.workspace import Workspace, attach_workspace

from compile_tests import harness as H
from compile_tests.harness import fresh_dynamo  # noqa: F401  (autouse fixture)
from compile_tests.test_compile_model import check_workspace_in_place

K, N = 128, 128  # EETQ's ampere byte order needs multiples of 64
BATCHES = (1, 3, 16)


def _w(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def _layers() -> dict[str, torch.nn.Module]:
    """Every K -> N layer kind; each checkpoint type registered for the layer API is here."""
    g_idx = act_order_g_idx(K, 16, torch.Generator().manual_seed(0))
    checkpoints = {
        "gptq": FORMATS["gptq"].quantize(_w(N, K, 1), bits=4, group_size=16, sym=False, g_idx=g_idx, version="v1"),
        "awq": FORMATS["awq"].quantize(_w(N, K, 2), bits=4, group_size=16),
        "ct": FORMATS["compressed-tensors"].quantize(_w(N, K, 3), bits=8, group_size=-1, sym=True),
        "fp8": FORMATS["fp8"].quantize(_w(N, K, 4), granularity="tensor", input_scale=0.01),
        "fp8_block": FORMATS["fp8-block"].quantize(_w(N, K, 5), block_size=(32, 32)),
        "eetq": FORMATS["eetq"].quantize(_w(N, K, 8)),
        "bnb_int8": FORMATS["bitsandbytes-int8"].quantize(_w(N, K, 9)),
        "bnb_nf4": FORMATS["bitsandbytes-nf4"].quantize(_w(N, K, 10), group_size=64, nested=True),
    }
    assert {type(c) for c in checkpoints.values()} == set(CHECKPOINT_LINEARS)
    layers = {k: QuantLinear.from_checkpoint(c, torch.randn(N), dtype=torch.float32) for k, c in checkpoints.items()}
    # An act-order row shard: rows 64..191 of a K=256 layer, padded locally.
    big = FORMATS["gptq"].quantize(_w(N, 2 * K, 6), bits=4, group_size=32, sym=True, g_idx=act_order_g_idx(2 * K, 32, torch.Generator().manual_seed(1)))
    rows = {"qweight": big.qweight[8:24], "qzeros": big.qzeros, "scales": big.scales, "g_idx": big.g_idx[64:192]}
    scheme = lw.GPTQScheme(4, 32, "v2")
    t, k_rt, g_new, pad = act_order.localize(rows, scheme.layout, k_local=K, n_groups=8, group_size=32, bits=4)
    assert pad > 0
    layers["act_order_shard"] = QuantLinear.from_checkpoint(InputPadded(scheme.make(t, k_rt, N, g_new), pad), dtype=torch.float32)
    layers["dense"] = get_linear(_w(N, K, 7), torch.randn(N), None)
    return layers


class AllLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict(_layers())

    def forward(self, x):
        return {k: layer(x) for k, layer in self.layers.items()}


def test_every_layer_kind_compiles_once_for_every_batch_size():
    model = AllLayers()
    counts = {cls: sum(isinstance(m, cls) for m in model.layers.values()) for cls in (IntWeightLinear, Fp8Linear, Int8Linear, Blockwise4Linear)}
    assert list(counts.values()) == [4, 2, 2, 1] and isinstance(model.layers["dense"], FastLinear)
    # On CPU every fp8 layer is W8A16.
    ops = {"mm_int_weight": counts[IntWeightLinear], "mm_fp8_weight": counts[Fp8Linear], "mm_int8_weight": counts[Int8Linear],
           "mm_blockwise4": counts[Blockwise4Linear]}
    compiled = torch.compile(model, fullgraph=True)

    def first(fn, x):
        got, (code, *_) = run_and_get_code(fn, x)
        # One opaque call per quantized linear, and no dequantized weight.
        for op, count in ops.items():
            assert len(re.findall(rf"torch\.ops\.qops\.{op}\.default\(", code)) == count, (op, code)
        assert "dequantize" not in code
        return got

    with torch.no_grad():
        for batch, x, got in H.over_batches(compiled, K, BATCHES, first=first):
            want = model(x)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_every_layer_kind_with_a_workspace_takes_it_in_place_and_compiles_once():
    model = AllLayers()
    want = {}
    with torch.no_grad():
        for batch in BATCHES:
            x = H.unbacked_x(batch, K)
            want[batch] = model(x)  # the allocating ops
    model.workspace = Workspace(4096, max_m=max(BATCHES))
    attach_workspace(model, model.workspace)
    counts = {cls: sum(isinstance(m, cls) for m in model.layers.values()) for cls in (IntWeightLinear, Fp8Linear, Int8Linear, Blockwise4Linear)}
    ops = {"mm_int_weight_out": counts[IntWeightLinear], "mm_fp8_weight_out": counts[Fp8Linear],
           "mm_int8_weight_out": counts[Int8Linear], "mm_blockwise4_out": counts[Blockwise4Linear]}
    compiled = torch.compile(model, fullgraph=True)

    def first(fn, x):
        got, (code, *_) = run_and_get_code(fn, x)
        check_workspace_in_place(code, ops)
        return got

    ptr = model.workspace.buffer.data_ptr()
    with torch.no_grad():
        for batch, x, got in H.over_batches(compiled, K, BATCHES, first=first):
            for k in got:
                torch.testing.assert_close(got[k], want[batch][k], rtol=1e-5, atol=1e-5, msg=k)
    assert model.workspace.buffer.data_ptr() == ptr


def test_tensor_parallel_layers_at_world_size_one_compile_without_collectives(tmp_path):
    name = "gptq-v2-4bit-actorder"
    write_block(str(tmp_path), VARIANTS[name])
    block = TinyBlock(Weights.from_pretrained(str(tmp_path), dtype=torch.float32))
    ids = sample_ids(0, "cpu")
    with torch.no_grad():
        want = block(ids)
        got, (code, *_) = run_and_get_code(torch.compile(block, fullgraph=True), ids)
    assert "all_reduce" not in code and "all_gather" not in code
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
