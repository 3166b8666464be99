"""What the compile tests share: a fresh Dynamo per test, activations with an unbacked batch size, a
loop that turns recompiles into errors, a graph-break count, a backward check against eager, and a
backend that captures the AOT forward graph for inspection."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from tests import oracle

BATCHES = (1, 2, 7, 64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Autouse where imported: no compiled code or recompile count leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TwoLinear(torch.nn.Module):
    """``x (B, K) -> w1 (+ b1) -> relu -> w2`` over two prepared weights; ``oracle`` is the float64
    result from their oracle weights ``(N, K)``, where the caller has them."""

    def __init__(self, w1, w2, b1: torch.Tensor, w1_64: Optional[torch.Tensor] = None, w2_64: Optional[torch.Tensor] = None):
        super().__init__()
        self.w1, self.w2 = w1, w2
        self.w1_64, self.w2_64 = w1_64, w2_64
        self.register_buffer("b1", b1)

    def forward(self, x):
        return self.w2.mm(torch.relu(self.w1.mm(x, self.b1)))

    def oracle(self, x):
        return oracle.matmul(torch.relu(oracle.matmul(x, self.w1_64, self.b1)), self.w2_64)


def unbacked_x(batch: int, k: int, requires_grad: bool = False) -> torch.Tensor:
    """``(batch, k)`` activations seeded by the batch size, the batch dimension marked unbacked, so
    the graph cannot specialize on any size, 0 and 1 included (``mark_dynamic`` would still
    specialize both). :data:`BATCHES` runs 1 but not 0: the ops' M = 0 is checked eagerly, and the
    model's compiled decode step runs batch 0 (``compile_tests/test_compile_model.py``)."""
    x = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x.requires_grad_(requires_grad)


def over_batches(compiled, k: int, batches=BATCHES, *, requires_grad: bool = False,
                 first: Optional[Callable] = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields ``(batch, x, compiled(x))`` per batch size. The first call compiles (through
    ``first(compiled, x)`` when given, e.g. to capture the generated code); a later call that
    would recompile raises."""
    for i, batch in enumerate(batches):
        x = unbacked_x(batch, k, requires_grad)
        if i == 0:
            y = compiled(x) if first is None else first(compiled, x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                y = compiled(x)
        yield batch, x, y


def assert_one_graph(model: torch.nn.Module, k: int, batch: int = 7) -> None:
    """Dynamo traces ``model`` into exactly one graph, without a break; resets Dynamo after."""
    explained = torch._dynamo.explain(model)(torch.randn(batch, k))
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()


def check_backward(model: torch.nn.Module, compiled, k: int, batches=(2, 7), same: Callable = torch.equal) -> None:
    """The gradient for x through ``compiled`` matches eager's for each batch, with no recompile."""
    for batch, x, y in over_batches(compiled, k, batches, requires_grad=True):
        x_ref = x.detach().clone().requires_grad_()
        grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(batch))
        y.backward(grad_out)
        model(x_ref).backward(grad_out)
        assert same(x.grad, x_ref.grad), f"batch {batch}"


def capturing_backend() -> tuple[Callable, list[torch.fx.GraphModule]]:
    """An AOT-autograd backend running the traced graphs as they are, and the list that collects
    its forward graphs."""
    graphs: list[torch.fx.GraphModule] = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)), graphs


def assert_opaque_linears(gm: torch.fx.GraphModule, mm, dequantize, dense: set, count: int = 2) -> None:
    """``gm`` calls ``mm`` ``count`` times and ``dequantize`` never, and holds no floating tensor of
    a dense weight's shape (one in ``dense``). Dense weights have static sizes; activations carry the
    unbacked batch size."""
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(mm) == count, targets
    assert dequantize not in targets, targets
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and all(type(s) is int for s in val.shape):
            assert tuple(val.shape) not in dense, f"dense weight in the forward graph: {node}"


def _short(v) -> str:
    if isinstance(v, torch.Tensor):
        dtype = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}[v.dtype]
        return f"{dtype}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, torch.fx.Node):
        return _short(v.meta["val"])
    return repr(v)


def graph_text(gm: torch.fx.GraphModule) -> str:
    """One line per op of ``gm`` with argument shapes, shape assertions on the batch left out."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten._assert_scalar.default:
            continue
        name = f"{node.target.namespace}.{node.target._opname}"
        args = ", ".join(_short(a) for a in node.args)
        lines.append(f"{name}({args}) -> {_short(node)}")
    return "\n".join(lines)
