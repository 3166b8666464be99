"""torch.compile of a two-layer module on prepared FP8 weights, W8A16 and W8A8 (dynamic and static
activation scales): no graph breaks, one graph for every batch size (unbacked batch), the eager
numbers, exactly one opaque qops call per linear, and -- for W8A8 -- the activation quantization
visible to Inductor and fused into the kernel that produces the activations. ``mm_fp8_weight_out``
takes a module's workspace buffer in place (one graph input, no copy)."""
from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import qops  # noqa: F401
from qops.formats import FORMATS

from compile_tests import harness as H
from compile_tests.harness import fresh_dynamo  # noqa: F401  (autouse fixture)

K1, N1, N2 = 64, 40, 24  # x (B, 64) -> linear1 -> (B, 40) -> relu -> linear2 -> (B, 24)
ACTIVATIONS = ("none", "dynamic", "static")
OP = {"none": torch.ops.qops.mm_fp8_weight.default, "dynamic": torch.ops.qops.scaled_mm_fp8.default,
      "static": torch.ops.qops.scaled_mm_fp8.default}


def two_linear(activations: str) -> H.TwoLinear:
    """Per-channel scales on the first linear, 16 x 32 blocks (partial along K) on the second."""
    g = torch.Generator().manual_seed(0)
    fmt = FORMATS["compressed-tensors-fp8"]
    first = fmt.quantize(torch.randn(N1, K1, generator=g), granularity="channel", input_scale=4.0 / 448)
    second = fmt.quantize(torch.randn(N2, N1, generator=g), granularity="block", block_size=(16, 32), input_scale=8.0 / 448)
    w1 = fmt.prepare(first, activations=activations)
    w2 = fmt.prepare(second, activations=activations)
    return H.TwoLinear(w1, w2, torch.randn(N1, generator=g))


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_one_graph_for_every_batch_size_and_eager_numbers(activations):
    model = two_linear(activations)
    H.assert_one_graph(model, K1)
    compiled = torch.compile(model, fullgraph=True)  # Inductor

    def first(fn, x):
        y, code = run_and_get_code(fn, x)
        check_code("\n".join(code), activations)
        return y

    for batch, x, y in H.over_batches(compiled, K1, first=first):
        eager = model(x)
        assert y.shape == eager.shape
        # Inductor's fused quantization may round x / scale differently from eager in a rare element.
        assert torch.allclose(y, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item()), f"batch {batch}"


def check_code(code: str, activations: str) -> None:
    """Two opaque qops calls, no dense weight; W8A8: relu and the quantization in one kernel."""
    op = OP[activations]
    calls = re.findall(r"torch\.ops\.qops\.(\w+)\.default\(", code)
    assert calls == [op._opname, op._opname], calls
    kernels = re.findall(r"^(\w*fused\w*) = ", code, flags=re.M)
    if activations == "none":
        return
    # The first layer's input is quantized from x directly; the second's from relu(first layer),
    # in the same kernel as the relu (dynamic: with the per-token amax).
    quantizing = [k for k in kernels if "_to_copy" in k]
    assert len(quantizing) == 2, kernels
    second = [k for k in quantizing if "relu" in k]
    assert len(second) == 1, kernels
    if activations == "dynamic":
        assert "amax" in second[0], kernels


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_backward_compiles(activations):
    model = two_linear(activations)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    H.check_backward(model, compiled, K1, same=lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))


class _OutTwoLinear(torch.nn.Module):
    """The W8A16 pair through ``qops::mm_fp8_weight_out``, both on one module-owned workspace."""

    def __init__(self, model: H.TwoLinear, nbytes: int):
        super().__init__()
        self.inner = model
        self.register_buffer("workspace", torch.empty(nbytes, dtype=torch.uint8), persistent=False)

    def _mm(self, w, x, bias=None):
        out = torch.empty(*x.shape[:-1], w.out_features, dtype=x.dtype, device=x.device)
        torch.ops.qops.mm_fp8_weight_out(x, w.weight, w.weight_scale, bias, w.block_n, w.block_k, int(w.kernel), out, self.workspace)
        return out

    def forward(self, x):
        return self._mm(self.inner.w2, torch.relu(self._mm(self.inner.w1, x, self.inner.b1)))


def test_out_op_takes_the_workspace_in_place():
    model = _OutTwoLinear(two_linear("none"), 1024)
    compiled = torch.compile(model, fullgraph=True)

    def first(fn, x):
        y, (code, *_) = run_and_get_code(fn, x)
        calls = re.findall(r"torch\.ops\.qops\.mm_fp8_weight_out\.default\((.*)\)", code)
        assert len(calls) == 2, code
        # Both calls get the buffer as the graph input it is; it is never cloned or copied back.
        (ws,) = {c.rsplit(",", 1)[1].strip() for c in calls}
        assert re.fullmatch(r"arg\d+_1", ws), ws
        assert "clone" not in code and "copy_" not in code
        return y

    with torch.no_grad():
        for batch, x, y in H.over_batches(compiled, K1, first=first):
            torch.testing.assert_close(y, model.inner(x), rtol=1e-5, atol=1e-5, msg=f"batch {batch}")


# DeepSeek-style blocks: x (B, 256) -> 128 x 128-block linear -> (B, 256) -> relu -> (B, 128), with
# per-token-group (1x128) activation scales, on the reference here (the scaled_mm lowering on sm_90).
BK1, BN1, BN2 = 256, 256, 128


def block_two_linear() -> H.TwoLinear:
    g = torch.Generator().manual_seed(1)
    fmt = FORMATS["fp8-block"]
    w1 = fmt.prepare(fmt.quantize(torch.randn(BN1, BK1, generator=g)), activations="dynamic")
    w2 = fmt.prepare(fmt.quantize(torch.randn(BN2, BN1, generator=g)), activations="dynamic")
    assert w1.x_group_size == w2.x_group_size == 128, w1.choice.explain()
    return H.TwoLinear(w1, w2, torch.randn(BN1, generator=g))


def test_group_scaled_w8a8_compiles_into_one_graph_with_the_quantization_fused():
    model = block_two_linear()
    H.assert_one_graph(model, BK1)
    compiled = torch.compile(model, fullgraph=True)

    def first(fn, x):
        y, code = run_and_get_code(fn, x)
        code = "\n".join(code)
        calls = re.findall(r"torch\.ops\.qops\.(\w+)\.default\(", code)
        assert calls == ["scaled_mm_fp8", "scaled_mm_fp8"], calls
        # The second layer's groups: amax and rounding in the kernel that computes the relu.
        kernels = re.findall(r"^(\w*fused\w*) = ", code, flags=re.M)
        assert any("relu" in k and "amax" in k and "_to_copy" in k for k in kernels), kernels
        return y

    for batch, x, y in H.over_batches(compiled, BK1, first=first):
        eager = model(x)
        assert y.shape == (batch, BN2)
        assert torch.allclose(y, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item()), f"batch {batch}"


def test_group_scaled_w8a8_backward_compiles():
    model = block_two_linear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    H.check_backward(model, compiled, BK1, same=lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
