"""torch.compile of a two-layer module on prepared integer weights, for every int_weight format:
no graph breaks, one graph for every batch size, the same numbers as eager, and a forward graph
holding exactly one opaque qops call per linear and no dense weight."""
from __future__ import annotations

import expecttest
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import qops  # noqa: F401

from tests import oracle
from tests.int_weight_cases import Case, build, int_weight_formats, one_thread  # noqa: F401  (one_thread: autouse fixture)

BATCHES = (1, 2, 7, 64)
K1, N1, N2 = 64, 40, 24  # x (B, 64) -> linear1 -> (B, 40) -> relu -> linear2 -> (B, 24)

# Per format, the two linears: (bits, group_size, sym, act_order, version). Group 32 on K=40 leaves
# a partial group; act-order where the format has it.
LAYERS = {
    "gptq": ((4, 32, False, True, "v1"), (3, 32, True, False, "v2")),
    "awq": ((4, 32, False, False, None), (4, -1, False, False, None)),
    "compressed-tensors": ((4, 32, True, True, None), (8, 32, False, False, None)),
}


class TwoLinear(torch.nn.Module):
    def __init__(self, fmt: str):
        super().__init__()
        (b1, g1, s1, a1, v1), (b2, g2, s2, a2, v2) = LAYERS[fmt]
        first = build(Case(fmt, b1, g1, s1, a1, v1, N1, K1))
        second = build(Case(fmt, b2, g2, s2, a2, v2, N2, N1))
        self.w1, self.w2 = first.weight, second.weight
        self.w1_64, self.w2_64 = first.w64, second.w64
        self.register_buffer("b1", torch.randn(N1, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return self.w2.mm(torch.relu(self.w1.mm(x, self.b1)))

    def oracle(self, x):
        return oracle.matmul(torch.relu(oracle.matmul(x, self.w1_64, self.b1)), self.w2_64)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _x(batch: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn(batch, K1, generator=torch.Generator().manual_seed(seed + batch))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x.requires_grad_(requires_grad)


def test_layers_cover_the_registry():
    assert set(LAYERS) == set(int_weight_formats()), "add each int_weight format to LAYERS"


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_no_graph_breaks(fmt):
    explained = torch._dynamo.explain(TwoLinear(fmt))(torch.randn(7, K1))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_one_graph_for_every_batch_size_and_eager_numbers(fmt):
    model = TwoLinear(fmt)
    compiled = torch.compile(model, fullgraph=True)  # Inductor
    for i, batch in enumerate(BATCHES):
        x = _x(batch)
        if i == 0:
            y = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                y = compiled(x)
        eager = model(x)
        assert torch.equal(y, eager), f"batch {batch}: compiled differs from eager"
        err = torch.linalg.vector_norm(y.double() - model.oracle(x)) / torch.linalg.vector_norm(model.oracle(x))
        assert err < 1e-5, f"batch {batch}: relative error {err:.2e} against the oracle"


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_backward_compiles(fmt):
    model = TwoLinear(fmt)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for i, batch in enumerate((2, 7)):
        x = _x(batch, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        if i == 0:
            y = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                y = compiled(x)
        grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(batch))
        y.backward(grad_out)
        model(x_ref).backward(grad_out)
        assert torch.equal(x.grad, x_ref.grad), f"batch {batch}"


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        dtype = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}[v.dtype]
        return f"{dtype}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, torch.fx.Node):
        return _short(v.meta["val"])
    return repr(v)


def forward_graph(model: torch.nn.Module, batch: int = 7) -> tuple[str, list[torch.fx.GraphModule]]:
    """The AOT forward graph of ``model``, one line per op (shape assertions on the batch left out)."""
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=fw_compiler))
    compiled(_x(batch))
    assert len(graphs) == 1
    lines = []
    for node in graphs[0].graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten._assert_scalar.default:
            continue
        name = f"{node.target.namespace}.{node.target._opname}"
        args = ", ".join(_short(a) for a in node.args)
        lines.append(f"{name}({args}) -> {_short(node)}")
    return "\n".join(lines), graphs


class TestForwardGraph(expecttest.TestCase):
    """One opaque qops call per linear on the packed tensors; nothing weight-sized in floating point."""

    def setUp(self):
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()

    def check(self, fmt: str) -> str:
        text, graphs = forward_graph(TwoLinear(fmt))
        targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        self.assertEqual(targets.count(torch.ops.qops.mm_int_weight.default), 2)
        self.assertNotIn(torch.ops.qops.dequantize_int_weight.default, targets)
        for node in graphs[0].graph.nodes:
            val = node.meta.get("val")
            # A dense weight has static sizes; activations carry the unbacked batch size.
            if isinstance(val, torch.Tensor) and val.is_floating_point() and all(type(s) is int for s in val.shape):
                self.assertNotIn(tuple(val.shape), {(N1, K1), (K1, N1), (N2, N1), (N1, N2)}, f"dense weight {node}")
        return text

    def test_all_formats_have_a_snapshot(self):
        snapshots = {m[len("test_graph_"):].replace("_", "-") for m in dir(self) if m.startswith("test_graph_")}
        self.assertEqual(snapshots, set(int_weight_formats()))

    def test_graph_gptq(self):
        self.assertExpectedInline(self.check("gptq"), """\
qops.mm_int_weight(f32[u0, 64], i32[8, 40], f16[2, 40], i32[2, 5], i32[64], f32[40], 64, 4, 32, 1, 0) -> f32[u0, 40]
aten.relu(f32[u0, 40]) -> f32[u0, 40]
qops.mm_int_weight(f32[u0, 40], i32[4, 24], f16[2, 24], None, None, None, 40, 3, 32, 0, 0) -> f32[u0, 24]""")

    def test_graph_awq(self):
        self.assertExpectedInline(self.check("awq"), """\
qops.mm_int_weight(f32[u0, 64], i32[8, 40], f16[2, 40], i32[2, 5], None, f32[40], 64, 4, 32, 0, 0) -> f32[u0, 40]
aten.relu(f32[u0, 40]) -> f32[u0, 40]
qops.mm_int_weight(f32[u0, 40], i32[5, 24], f16[1, 24], i32[1, 3], None, None, 40, 4, -1, 0, 0) -> f32[u0, 24]""")

    def test_graph_compressed_tensors(self):
        self.assertExpectedInline(self.check("compressed-tensors"), """\
qops.mm_int_weight(f32[u0, 64], i32[8, 40], f16[2, 40], None, i32[64], f32[40], 64, 4, 32, 0, 0) -> f32[u0, 40]
aten.relu(f32[u0, 40]) -> f32[u0, 40]
qops.mm_int_weight(f32[u0, 40], i32[10, 24], f16[2, 24], i32[2, 6], None, None, 40, 8, 32, 0, 0) -> f32[u0, 24]""")
