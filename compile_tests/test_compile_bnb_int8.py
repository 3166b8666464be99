"""torch.compile of a two-layer module on prepared int8 (EETQ, bitsandbytes LLM.int8) and 4-bit
blockwise (bitsandbytes NF4 / FP4) weights: no graph breaks, one graph for every batch size (the
batch marked unbacked, recompiles turned into errors), the same numbers as eager, a backward, and a
forward graph holding exactly one opaque qops call per linear and no dense weight."""
from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import qops  # noqa: F401
from qops.formats import FORMATS

from tests import bnb_cases as C
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small CPU matmuls on one thread)

BATCHES = (1, 2, 7, 64)
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


class TwoLinear(torch.nn.Module):
    def __init__(self, fmt: str):
        super().__init__()
        first, second = (C.build(case, torch.float32) for case in LAYERS[fmt])
        self.k = first.case.k
        self.w1, self.w2 = first.weight, second.weight
        self.w1_64, self.w2_64 = first.w64, second.w64
        self.register_buffer("b1", torch.randn(first.case.n, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return self.w2.mm(torch.relu(self.w1.mm(x, self.b1)))

    def oracle(self, x):
        return C.matmul(torch.relu(C.matmul(x, self.w1_64, self.b1)), self.w2_64)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x(k: int, batch: int, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x.requires_grad_(requires_grad)


def test_layers_cover_the_families():
    want = {name for name, f in FORMATS.items() if f.family in OPS}
    assert set(LAYERS) == want, "add each int8_weight / blockwise4 format to LAYERS"


@pytest.mark.parametrize("fmt", sorted(LAYERS))
def test_one_graph_for_every_batch_size_and_eager_numbers(fmt):
    model = TwoLinear(fmt)
    explained = torch._dynamo.explain(model)(torch.randn(7, model.k))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # Inductor
    for i, batch in enumerate(BATCHES):
        x = _x(model.k, batch)
        if i == 0:
            y = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                y = compiled(x)
        assert torch.equal(y, model(x)), f"batch {batch}: compiled differs from eager"
        assert C.rel_err(y, model.oracle(x)) < 1e-5, f"batch {batch}"


@pytest.mark.parametrize("fmt", sorted(LAYERS))
def test_backward_and_forward_graph(fmt):
    model = TwoLinear(fmt)
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for i, batch in enumerate((2, 7)):
        x = _x(model.k, batch, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        if i == 0:
            y = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                y = compiled(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(batch))
        y.backward(g)
        model(x_ref).backward(g)
        assert torch.equal(x.grad, x_ref.grad), f"batch {batch}"
    assert len(graphs) == 1
    mm, dequant = OPS[FORMATS[fmt].family]
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(mm) == 2 and dequant not in targets
    dense = {(c.n, c.k) for c in LAYERS[fmt]} | {(c.k, c.n) for c in LAYERS[fmt]}
    for node in graphs[0].graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and all(type(s) is int for s in val.shape):
            assert tuple(val.shape) not in dense, f"dense weight in the forward graph: {node}"
