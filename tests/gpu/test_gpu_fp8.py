"""The fp8 family on a CUDA device: W8A16 through Triton, W8A8 through torch._scaled_mm and through the
Triton fallback (odd N/K, block scales), every scale granularity, fp16 and bf16, against the float64
oracle of tests/test_fp8.py; eagerly, under torch.compile(fullgraph=True) and in CUDA-graph replay.

Weights are quantized on the GPU and prepared there, so the chooser picks the lowering; the tests
assert which one it picked.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import Kernel
from qops.ops.fp8 import quantize_fp8_activations
from tests.test_fp8 import oracle_mm, oracle_weight, oracle_x, rel_err

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
MS = (1, 2, 7, 16, 64, 257, 2048)
# fp32 accumulation, output rounded to fp16 / bf16.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# (format, granularity, N, K, block): aligned shapes go to torch._scaled_mm for W8A8; odd N/K and
# block scales to the Triton fallback.
CASES = {
    "tensor-aligned": ("fp8", "tensor", 256, 512, None),
    "channel-aligned": ("compressed-tensors-fp8", "channel", 256, 512, None),
    "channel-odd": ("fp8", "channel", 72, 200, None),
    "block128-odd": ("fp8-block", "block", 200, 328, (128, 128)),
    "channel-wide": ("fp8", "channel", 1024, 4096, None),
}

_BUILT: dict = {}


def build(case: str, activations: str, dtype: torch.dtype):
    key = (case, activations, dtype)
    if key not in _BUILT:
        fmt, gran, n, k, block = CASES[case]
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n, k, device="cuda", generator=g) * torch.logspace(-2, 0, n, device="cuda").unsqueeze(1)
        f = FORMATS[fmt]
        if fmt == "fp8-block":
            c = f.quantize(w, block_size=block)
        else:
            c = f.quantize(w, granularity=gran, input_scale=4.0 / 448)
        _BUILT[key] = (f.prepare(c, dtype=dtype, activations=activations), oracle_weight(fmt, c).cuda())
    return _BUILT[key]


def _x(m: int, k: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    return torch.randn(m, k, device="cuda", generator=g).to(dtype)


def _want(w, w64, x, bias):
    if w.activations == "none":
        return oracle_mm(x, w64, bias)
    x_fp8, x_scale = quantize_fp8_activations(x, w.input_scale if w.activations == "static" else None)
    return oracle_mm(oracle_x(x_fp8, x_scale).cuda(), w64, bias)


def check(w, w64, x, bias, what):
    y = w.mm(x, bias)
    torch.cuda.synchronize()
    assert y.dtype == x.dtype and tuple(y.shape) == (x.shape[0], w.out_features), what
    assert torch.isfinite(y).all(), what
    err = rel_err(y, _want(w, w64, x, bias))
    assert err <= TOL[x.dtype], f"{what}: relative error {err:.2e}"
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["channel-odd", "block128-odd", "tensor-aligned", "channel-wide"])
def test_w8a16_triton(case, dtype):
    w, w64 = build(case, "none", dtype)
    assert w.kernel == Kernel.TRITON, w.choice.explain()
    ms = MS if case != "channel-wide" else (1, 16, 2048)
    for m in ms:
        bias = torch.randn(w.out_features, device="cuda").to(dtype)
        check(w, w64, _x(m, w.in_features, dtype), bias if m % 2 else None, f"{case} M={m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,activations,kernel", [
    ("tensor-aligned", "dynamic", Kernel.SCALED_MM),  # row-wise after prepare (per-token x)
    ("tensor-aligned", "static", Kernel.SCALED_MM),  # tensor-wise
    ("channel-aligned", "dynamic", Kernel.SCALED_MM),
    ("channel-aligned", "static", Kernel.SCALED_MM),  # per-tensor x expanded to rows
    ("channel-odd", "dynamic", Kernel.TRITON),
    ("block128-odd", "dynamic", Kernel.TRITON),
])
def test_w8a8(case, activations, kernel, dtype):
    w, w64 = build(case, activations, dtype)
    assert w.kernel == kernel and w.activations == activations, w.choice.explain()
    ms = MS if activations == "dynamic" or kernel == Kernel.SCALED_MM else (1, 64)
    for m in ms:
        bias = torch.randn(w.out_features, device="cuda").to(dtype)
        check(w, w64, _x(m, w.in_features, dtype), bias if m % 2 else None, f"{case} {activations} M={m}")


def test_auto_takes_w8a8_where_scaled_mm_serves_it():
    w, _ = build("channel-aligned", "auto", torch.bfloat16)
    assert (w.activations, w.kernel) == ("static", Kernel.SCALED_MM), w.choice.explain()
    w, _ = build("block128-odd", "auto", torch.bfloat16)
    assert (w.activations, w.kernel) == ("none", Kernel.TRITON), w.choice.explain()
    assert "group_size=128 not in [-1]" in w.choice.explain()


def test_without_fp8_units_weight_only_still_works(monkeypatch):
    """Below compute capability 8.9: the chooser refuses torch._scaled_mm, auto falls back to W8A16,
    and the Triton kernels' bit-move conversion (no float8 cast) gives the oracle's answer."""
    from qops import lowerings
    from qops.ops.triton.fp8 import triton_mm

    monkeypatch.setattr(lowerings, "_cuda_capability", lambda device: (8, 0))
    fmt = FORMATS["fp8"]
    c = fmt.quantize(torch.randn(256, 512, device="cuda"), granularity="channel")
    w = fmt.prepare(c, dtype=torch.float16)
    assert (w.activations, w.kernel) == ("none", Kernel.TRITON), w.choice.explain()
    assert "needs compute capability >= (8, 9), device has (8, 0)" in w.choice.explain()
    w64 = oracle_weight("fp8", c).cuda()
    for m in (1, 3, 64):
        for dtype in DTYPES:
            x = _x(m, 512, dtype)
            y = triton_mm(x, None, w.weight, w.weight_scale, None, w.block_n, w.block_k, dtype, native_fp8=False)
            assert rel_err(y, oracle_mm(x, w64)) <= TOL[dtype], (m, dtype)
            x_fp8, x_scale = quantize_fp8_activations(x)
            y = triton_mm(x_fp8, x_scale, w.weight, w.weight_scale, None, w.block_n, w.block_k, dtype, native_fp8=False)
            assert rel_err(y, oracle_mm(oracle_x(x_fp8, x_scale).cuda(), w64)) <= TOL[dtype], (m, dtype, "w8a8")


def test_triton_w8a8_agrees_with_scaled_mm():
    w, w64 = build("channel-aligned", "dynamic", torch.bfloat16)
    tw = dataclasses.replace(w, kernel=Kernel.TRITON)
    for m in (1, 16, 257):
        x = _x(m, w.in_features, torch.bfloat16)
        a, b = w.mm(x), tw.mm(x)
        assert rel_err(b, a.double()) <= 1e-2, m


def _graph(fn, x):
    """Capture ``fn(x)`` in a CUDA graph after warm-up (Triton compiles, cuBLASLt heuristics)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(x)
    return g, out


@pytest.mark.parametrize("case,activations", [("block128-odd", "none"), ("channel-aligned", "dynamic"),
                                              ("channel-odd", "dynamic")])
def test_compile_and_cuda_graph(case, activations):
    dtype = torch.bfloat16
    w, w64 = build(case, activations, dtype)
    bias = torch.randn(w.out_features, device="cuda").to(dtype)

    def f(x):
        return w.mm(torch.relu(x) * 2, bias)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for i, m in enumerate((1, 7, 64)):
        x = _x(m, w.in_features, dtype, seed=1)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        eager = f(x)
        if i == 0:
            got = compiled(x)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                got = compiled(x)
        assert rel_err(got, eager.double()) <= TOL[dtype], (m, "compiled")
        for fn in (f, compiled):
            static_x = x.clone()
            g, out = _graph(fn, static_x)
            static_x.copy_(_x(m, w.in_features, dtype, seed=2))
            out.zero_()
            g.replay()
            torch.cuda.synchronize()
            want = f(static_x)
            assert rel_err(out, want.double()) <= TOL[dtype], (m, "graph replay")
    torch._dynamo.reset()
