"""torch.compile of a two-layer module on prepared int8 (EETQ, bitsandbytes LLM.int8) and 4-bit
blockwise (bitsandbytes NF4 / FP4) weights: no graph breaks, one graph for every batch size (the
batch marked unbacked, recompiles turned into errors), the same numbers as eager, a backward, and a
forward graph holding exactly one opaque qops call per linear and no dense weight."""
from __future__ import annotations

import pytest
import torch

import qops  # noqa: F401
from qops.formats import FORMATS

from compile_tests import harness as H
from compile_tests.harness import fresh_dynamo  # noqa: F401  (autouse fixture)
from tests import bnb_cases as C
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small CPU matmuls on one thread)

# Per format, the two linears (N, K): x (B, K1) -> linear1 -> (B, N1) -> relu -> linear2 -> (B, N2).
LAYERS = {
    "bitsandbytes-int8": (C.Case("bitsandbytes-int8", 40, 72), C.Case("bitsandbytes-int8", 24, 40)),
    "eetq": (C.Case("eetq", 64, 128, layout="ampere"), C.Case("eetq", 24, 64, layout="row_major")),
    "bitsandbytes-nf4": (C.Case("bitsandbytes-nf4", 40, 72, blocksize=64, nested=True),
                         C.Case("bitsandbytes-nf4", 24, 40, blocksize=32, nested=False)),
    "bitsandbytes-fp4": (C.Case("bitsandbytes-fp4", 40, 72, blocksize=32, nested=False),
                         C.Case("bitsandbytes-fp4", 24, 40, blocksize=64, nested=True)),
}
OPS = {"int8_weight": (torch.ops.qops.mm_int8_weight.default, torch.ops.qops.dequantize_int8_weight.default),
       "blockwise4": (torch.ops.qops.mm_blockwise4.default, torch.ops.qops.dequantize_blockwise4.default)}


def two_linear(fmt: str) -> H.TwoLinear:
    first, second = (C.build(case, torch.float32) for case in LAYERS[fmt])
    b = torch.randn(first.case.n, generator=torch.Generator().manual_seed(0))
    return H.TwoLinear(first.weight, second.weight, b, first.w64, second.w64)


def test_layers_cover_the_families():
    want = {name for name, f in FORMATS.items() if f.family in OPS}
    assert set(LAYERS) == want, "add each int8_weight / blockwise4 format to LAYERS"


@pytest.mark.parametrize("fmt", sorted(LAYERS))
def test_one_graph_for_every_batch_size_and_eager_numbers(fmt):
    model, k = two_linear(fmt), LAYERS[fmt][0].k
    H.assert_one_graph(model, k)
    compiled = torch.compile(model, fullgraph=True)  # Inductor
    for batch, x, y in H.over_batches(compiled, k):
        assert torch.equal(y, model(x)), f"batch {batch}: compiled differs from eager"
        assert C.rel_err(y, model.oracle(x)) < 1e-5, f"batch {batch}"


@pytest.mark.parametrize("fmt", sorted(LAYERS))
def test_backward_and_forward_graph(fmt):
    model, k = two_linear(fmt), LAYERS[fmt][0].k
    backend, graphs = H.capturing_backend()
    H.check_backward(model, torch.compile(model, fullgraph=True, backend=backend), k)
    assert len(graphs) == 1
    dense = {(c.n, c.k) for c in LAYERS[fmt]} | {(c.k, c.n) for c in LAYERS[fmt]}
    H.assert_opaque_linears(graphs[0], *OPS[FORMATS[fmt].family], dense)


def test_tile16_weights_compile_to_one_graph_and_eager_numbers():
    # The layout argument is a static int of the op: one graph over batch sizes, as for the flat order.
    cases = (C.Case("bitsandbytes-nf4", 128, 256, blocksize=64, nested=True), C.Case("bitsandbytes-fp4", 16, 128, blocksize=128))
    first, second = (C.build(case, torch.float32) for case in cases)
    w1, w2 = C.as_tile16(first.weight), C.as_tile16(second.weight)
    b = torch.randn(128, generator=torch.Generator().manual_seed(1))
    model = H.TwoLinear(w1, w2, b, first.w64, second.w64)
    H.assert_one_graph(model, 256)
    compiled = torch.compile(model, fullgraph=True)
    for batch, x, y in H.over_batches(compiled, 256):
        assert torch.equal(y, model(x)), f"batch {batch}: compiled differs from eager"
        assert C.rel_err(y, model.oracle(x)) < 1e-5, f"batch {batch}"
