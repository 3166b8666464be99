"""torch.compile of a two-layer module on prepared integer weights, for every int_weight format:
no graph breaks, one graph for every batch size, the same numbers as eager, and a forward graph
holding exactly one opaque qops call per linear and no dense weight."""
from __future__ import annotations

import expecttest
import pytest
import torch

import qops  # noqa: F401

from compile_tests import harness as H
from tests import oracle
from compile_tests.harness import fresh_dynamo  # noqa: F401  (autouse fixture)
from tests.int_weight_cases import Case, build, int_weight_formats, one_thread  # noqa: F401  (one_thread: autouse fixture)

K1, N1, N2 = 64, 40, 24  # x (B, 64) -> linear1 -> (B, 40) -> relu -> linear2 -> (B, 24)

# Per format, the two linears: (bits, group_size, sym, act_order, version). Group 32 on K=40 leaves
# a partial group; act-order where the format has it.
LAYERS = {
    "gptq": ((4, 32, False, True, "v1"), (3, 32, True, False, "v2")),
    "awq": ((4, 32, False, False, None), (4, -1, False, False, None)),
    "compressed-tensors": ((4, 32, True, True, None), (8, 32, False, False, None)),
}


def two_linear(fmt: str) -> H.TwoLinear:
    (b1, g1, s1, a1, v1), (b2, g2, s2, a2, v2) = LAYERS[fmt]
    first = build(Case(fmt, b1, g1, s1, a1, v1, N1, K1))
    second = build(Case(fmt, b2, g2, s2, a2, v2, N2, N1))
    b = torch.randn(N1, generator=torch.Generator().manual_seed(0))
    return H.TwoLinear(first.weight, second.weight, b, first.w64, second.w64)


def test_layers_cover_the_registry():
    assert set(LAYERS) == set(int_weight_formats()), "add each int_weight format to LAYERS"


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_no_graph_breaks(fmt):
    H.assert_one_graph(two_linear(fmt), K1)


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_one_graph_for_every_batch_size_and_eager_numbers(fmt):
    model = two_linear(fmt)
    compiled = torch.compile(model, fullgraph=True)  # Inductor
    for batch, x, y in H.over_batches(compiled, K1):
        eager = model(x)
        assert torch.equal(y, eager), f"batch {batch}: compiled differs from eager"
        err = torch.linalg.vector_norm(y.double() - model.oracle(x)) / torch.linalg.vector_norm(model.oracle(x))
        assert err < 1e-5, f"batch {batch}: relative error {err:.2e} against the oracle"


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_backward_compiles(fmt):
    model = two_linear(fmt)
    H.check_backward(model, torch.compile(model, fullgraph=True, backend="aot_eager"), K1)


class TestForwardGraph(expecttest.TestCase):
    """One opaque qops call per linear on the packed tensors; nothing weight-sized in floating point."""

    def setUp(self):
        torch._dynamo.reset()

    def tearDown(self):
        torch._dynamo.reset()

    def check(self, fmt: str) -> str:
        backend, graphs = H.capturing_backend()
        torch.compile(two_linear(fmt), fullgraph=True, backend=backend)(H.unbacked_x(7, K1))
        self.assertEqual(len(graphs), 1)
        H.assert_opaque_linears(graphs[0], torch.ops.qops.mm_int_weight.default, torch.ops.qops.dequantize_int_weight.default,
                                {(N1, K1), (K1, N1), (N2, N1), (N1, N2)})
        return H.graph_text(graphs[0])

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


@pytest.mark.parametrize("fmt", int_weight_formats())
def test_swiglu_compiles_once_for_every_batch_size(fmt):
    """``mm_int_weight_swiglu`` (fused gate / up: silu of the first N/2 columns times the last N/2)
    under torch.compile(fullgraph=True): one graph for every batch size, equal to eager, and within
    float64 rounding of silu(x W_gate^T) * (x W_up^T) from the oracle's weight."""
    bits, group, sym, act, version = LAYERS[fmt][0]
    built = build(Case(fmt, bits, group, sym, act, version, 2 * N1, K1))
    w = built.weight
    args = (w.qweight, w.scales, w.qzeros, w.act_perm, w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel))
    compiled = torch.compile(lambda x: torch.ops.qops.mm_int_weight_swiglu(x, *args), fullgraph=True)
    for batch, x, y in H.over_batches(compiled, K1):
        assert torch.equal(y, torch.ops.qops.mm_int_weight_swiglu(x, *args)), f"batch {batch}: compiled differs from eager"
        full = oracle.matmul(x, built.w64)
        want = torch.nn.functional.silu(full[:, :N1]) * full[:, N1:]
        err = torch.linalg.vector_norm(y.double() - want) / torch.linalg.vector_norm(want).clamp(min=1e-30)
        assert err < 1e-5, f"batch {batch}: relative error {err:.2e} against the oracle"
