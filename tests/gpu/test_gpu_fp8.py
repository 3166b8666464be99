"""The fp8 family on a CUDA device: W8A16 through Triton, W8A8 through torch._scaled_mm, through
F.scaled_mm's DeepSeek block recipe (128 x 128 weight blocks, 1x128 activation groups, sm_90) and
through the Triton fallback (odd N/K, other block scales), every scale granularity, fp16 and bf16,
M = 0 .. 2048, contiguous, transposed and misaligned x, against the float64 oracle of
tests/test_fp8.py (a relative error and a bound on every element, ``check_fp8_mm``); eagerly, under
torch.compile(fullgraph=True) and in CUDA-graph replay.

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
from tests.test_fp8 import check_fp8_mm, oracle_mm, oracle_weight, oracle_x, rel_err, row_magnitudes
from tests.oracle import stride_two

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
MS = (0, 1, 2, 7, 16, 17, 64, 257, 2048)
# fp32 accumulation, output rounded to fp16 / bf16.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# cuBLASLt's block recipe: Hopper's FP8 tensor cores sum each 128-K block's products in fewer than
# fp32's bits before the block's scales are applied in fp32; benchmarks/probe_blockfp8.py measured
# 1.7e-3 in bf16, about bf16's own rounding. fp16 gets margin for that inner sum.
BLOCK_TOL = {torch.float16: 4e-3, torch.bfloat16: 1.2e-2}
BLOCK_MS = (0, 1, 16, 17, 64, 257)
# (format, granularity, N, K, block): aligned shapes go to torch._scaled_mm for W8A8; odd N/K and
# block scales to the Triton fallback.
CASES = {
    "tensor-aligned": ("fp8", "tensor", 256, 512, None),
    "channel-aligned": ("compressed-tensors-fp8", "channel", 256, 512, None),
    "channel-odd": ("fp8", "channel", 72, 200, None),
    "block128-odd": ("fp8-block", "block", 200, 328, (128, 128)),
    "channel-wide": ("fp8", "channel", 1024, 4096, None),
    # DeepSeek blocks for F.scaled_mm: ceil(K/128) = 5 (its scale grid padded to 8 along K), and 32.
    "block128-aligned": ("fp8-block", "block", 384, 640, (128, 128)),
    "block128-wide": ("fp8-block", "block", 1024, 4096, (128, 128)),
}


def _needs_sm90():
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        pytest.skip(f"F.scaled_mm's block recipe runs on compute capability 9.x only; this GPU is {cap}")

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


def check(w, w64, x, bias, what, tol=TOL):
    """``w.mm(x, bias)`` against the float64 oracle: relative error <= tol and every element within its
    elementwise bound (tests/test_fp8.py's check_fp8_mm, which allows the ties CUDA rounds the other way)."""
    y = w.mm(x, bias)
    torch.cuda.synchronize()
    check_fp8_mm(y, w, w64, x, bias, tol[x.dtype], what, c_dot=_c_dot(tol))
    return y


def _c_dot(tol) -> float:
    # The block recipe's 128-K inner sums in fewer than fp32's bits: twice the dot-product term of
    # elementwise_bound, as BLOCK_TOL doubles fp16's relative tolerance for them.
    return 16.0 if tol is BLOCK_TOL else 8.0


# Non-contiguous x: a transposed view (M stride 1), and rows at an odd element offset with a row
# stride of K + 3 (no 16-byte alignment), over the GEMV (M <= 4) and the GEMM buckets.
LAYOUTS = (("transposed", 3), ("transposed", 257), ("offset", 1), ("offset", 17))


def _x_layout(m: int, k: int, dtype, layout: str, seed: int = 5) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    if layout == "transposed":
        return torch.randn(k, m, device="cuda", generator=g).to(dtype).t()
    return torch.randn(m, k + 3, device="cuda", generator=g).to(dtype)[:, 1:k + 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["channel-odd", "block128-odd", "tensor-aligned", "channel-wide"])
def test_w8a16_triton(case, dtype):
    w, w64 = build(case, "none", dtype)
    assert w.kernel == Kernel.TRITON, w.choice.explain()
    ms = MS if case != "channel-wide" else (1, 16, 2048)
    for m in ms:
        bias = torch.randn(w.out_features, device="cuda").to(dtype)
        check(w, w64, _x(m, w.in_features, dtype), bias if m % 2 else None, f"{case} M={m}")
        if m in (1, 16):  # the op accepts a bias with any strides
            check(w, w64, _x(m, w.in_features, dtype), stride_two(bias), f"{case} M={m} strided bias")
    bias = torch.randn(w.out_features, device="cuda").to(dtype)
    for layout, m in LAYOUTS:
        check(w, w64, _x_layout(m, w.in_features, dtype, layout), bias, f"{case} M={m} {layout} x")


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
    bias = torch.randn(w.out_features, device="cuda").to(dtype)
    for layout, m in LAYOUTS:
        check(w, w64, _x_layout(m, w.in_features, dtype, layout), bias, f"{case} {activations} M={m} {layout} x")


def test_auto_takes_w8a8_where_scaled_mm_serves_it():
    w, _ = build("channel-aligned", "auto", torch.bfloat16)
    assert (w.activations, w.kernel) == ("static", Kernel.SCALED_MM), w.choice.explain()
    w, _ = build("block128-odd", "auto", torch.bfloat16)
    assert (w.activations, w.kernel) == ("none", Kernel.TRITON), w.choice.explain()
    assert "N=200 is not a multiple of 16" in w.choice.explain()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["block128-aligned", "block128-wide"])
def test_chooser_takes_the_cublas_block_recipe_on_sm90(case, dtype):
    """128 x 128 blocks with N, K multiples of 128: auto is W8A8 through the scaled_mm lowering with
    per-token-group activation scales; fp32 activations are refused with the reason (W8A16 instead)."""
    _needs_sm90()
    w, _ = build(case, "auto", dtype)
    assert (w.activations, w.kernel, w.x_group_size) == ("dynamic", Kernel.SCALED_MM, 128), w.choice.explain()
    assert w.choice.explain().startswith("chose scaled_mm_fp8")
    w32, _ = build(case, "auto", torch.float32)
    assert (w32.activations, w32.kernel) == ("none", Kernel.TRITON), w32.choice.explain()
    assert "not torch.float32" in w32.choice.explain()
    tw, _ = build(case, "dynamic", torch.float32)  # W8A8 kept: Triton reads per-token scales only
    assert (tw.kernel, tw.x_group_size) == (Kernel.TRITON, -1), tw.choice.explain()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["block128-aligned", "block128-wide"])
def test_block_w8a8_through_cublas(case, dtype):
    _needs_sm90()
    w, w64 = build(case, "dynamic", dtype)
    assert (w.kernel, w.x_group_size) == (Kernel.SCALED_MM, 128), w.choice.explain()
    bias = torch.randn(w.out_features, device="cuda").to(dtype)
    for m in BLOCK_MS:
        for b in (None, bias):
            check(w, w64, _x(m, w.in_features, dtype), b, f"{case} M={m} bias={b is not None}", BLOCK_TOL)
    x3 = _x(6, w.in_features, dtype, seed=3).reshape(2, 3, w.in_features)
    check(w, w64, x3, bias, f"{case} (2, 3, K)", BLOCK_TOL)


@pytest.mark.parametrize("x_scales", ["per-tensor", "per-token", "per-group"])
def test_block_lowering_reads_every_x_scale_layout(x_scales):
    """qops::scaled_mm_fp8 on kernel 3 with 128 x 128 blocks takes any x_scale layout (a tensor's or a
    token's scale is each of its groups'), odd M padded to 16, a strided x."""
    _needs_sm90()
    w, w64 = build("block128-aligned", "dynamic", torch.bfloat16)
    n, k = w.out_features, w.in_features
    g = torch.Generator(device="cuda").manual_seed(9)
    for m in (1, 17, 257):
        x = torch.randn(k, m, device="cuda", generator=g).t()  # transposed: not contiguous
        x_fp8, x_scale = quantize_fp8_activations(x, torch.tensor([0.02], device="cuda") if x_scales == "per-tensor" else None,
                                                  128 if x_scales == "per-group" else -1)
        for out_dtype in DTYPES:
            bias = torch.randn(n, device="cuda").to(out_dtype)
            y = torch.ops.qops.scaled_mm_fp8(x_fp8, x_scale, w.weight, w.weight_scale, bias, w.block_n, w.block_k, out_dtype, int(Kernel.SCALED_MM))
            assert y.dtype == out_dtype and tuple(y.shape) == (m, n)
            err = rel_err(y, oracle_mm(oracle_x(x_fp8, x_scale).cuda(), w64, bias))
            assert err <= BLOCK_TOL[out_dtype], (m, out_dtype, err)


def test_block_lowering_agrees_with_the_raw_f_scaled_mm_call():
    """The lowering is the recipe benchmarks/probe_blockfp8.py verified, nothing more: at M = 16
    (no padding) and K/128 = 32 (no scale padding) it returns the raw call's bits."""
    _needs_sm90()
    f = torch.nn.functional
    w, _ = build("block128-wide", "dynamic", torch.bfloat16)
    x_fp8, xs = quantize_fp8_activations(_x(16, w.in_features, torch.bfloat16), group_size=128)
    raw = f.scaled_mm(x_fp8, w.weight.t(), xs.t().contiguous().t(), f.ScalingType.BlockWise1x128, w.weight_scale.t(),
                      f.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    ours = torch.ops.qops.scaled_mm_fp8(x_fp8, xs, w.weight, w.weight_scale, None, 128, 128, torch.bfloat16, int(Kernel.SCALED_MM))
    assert torch.equal(ours, raw)


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


@pytest.mark.parametrize("case,activations,dtype", [("block128-odd", "none", torch.bfloat16), ("channel-aligned", "dynamic", torch.bfloat16),
                                                    ("channel-odd", "dynamic", torch.bfloat16),
                                                    ("block128-aligned", "dynamic", torch.bfloat16), ("block128-aligned", "dynamic", torch.float16)],
                         ids=str)
def test_compile_and_cuda_graph(case, activations, dtype, monkeypatch):
    """f(x) = w.mm(relu(x) * 2, bias), eagerly and compiled (one graph for every M), each captured in a
    CUDA graph. A replay of the captured input equals the captured function's own call bit for bit
    (the same kernels); replays on rows 10^-2 .. 10^2 as large as the captured ones (row_magnitudes)
    meet the float64 oracle, relative and elementwise, and equal the call: a graph that kept the
    captured input's dynamic activation scales saturates the large rows and blurs the small ones
    (tests/test_fp8.py::test_stale_activation_scales_fail_the_replay_check)."""
    # Bitwise comparisons: the Triton GEMV must not split K (atomic adds meet in a varying order).
    monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
    if case == "block128-aligned":
        _needs_sm90()
    w, w64 = build(case, activations, dtype)
    tol = TOL
    if case == "block128-aligned":
        assert (w.kernel, w.x_group_size) == (Kernel.SCALED_MM, 128), w.choice.explain()
        tol = BLOCK_TOL
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
        assert rel_err(got, eager.double()) <= tol[dtype], (m, "compiled")
        check_fp8_mm(got, w, w64, torch.relu(x) * 2, bias, tol[dtype], f"M={m} compiled", c_dot=_c_dot(tol))
        for name, fn in (("eager", f), ("compiled", compiled)):
            static_x = x.clone()
            g, out = _graph(fn, static_x)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fn(static_x)), f"M={m} {name}: replay of the captured input differs from the call"
            for shift in (4, 0):  # row 0 100x (shift 4) and 1/100x (shift 0) the captured magnitude
                static_x.copy_(_x(m, w.in_features, dtype, seed=2 + shift) * row_magnitudes(m, shift, "cuda").to(dtype))
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                what = f"M={m} {name} graph, rows 10^-2..10^2 (shift {shift})"
                check_fp8_mm(out, w, w64, torch.relu(static_x) * 2, bias, tol[dtype], what, c_dot=_c_dot(tol))
                assert torch.equal(out, fn(static_x)), f"{what}: replay differs from the call"
    torch._dynamo.reset()


@pytest.mark.parametrize("group_size", [-1, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_activation_quantization_is_bitwise_the_cpus(group_size, dtype):
    """quantize_fp8_activations on CUDA gives the CPU's scales and codes bit for bit eagerly (scales
    are amax times fp32(1/448): one multiply rounds alike everywhere; a division by 448 did not --
    CUDA divides by a Python number as that multiply, the CPU divides), and within an ulp compiled."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(257, 1000, generator=gen) * torch.logspace(-2, 2, 257).unsqueeze(1)).to(dtype)
    q_cpu, s_cpu = quantize_fp8_activations(x, None, group_size)
    compiled = torch.compile(lambda t: quantize_fp8_activations(t, None, group_size), fullgraph=True)
    q, s = quantize_fp8_activations(x.cuda(), None, group_size)
    assert torch.equal(s.cpu(), s_cpu), f"eager: {int((s.cpu() != s_cpu).sum())} scales differ"
    assert torch.equal(q.cpu().view(torch.uint8), q_cpu.view(torch.uint8)), "eager: codes differ"
    # Compiled, Inductor's kernel may round its own way (a constant folded otherwise, x / scale not
    # correctly rounded): within an ulp of the scales, a tie's code flipped at most in a few rows.
    q, s = compiled(x.cuda())
    assert bool(((s.cpu() - s_cpu).abs() <= s_cpu * 2.0**-23).all()), "compiled: a scale more than an ulp off"
    differ = int((q.cpu().view(torch.uint8) != q_cpu.view(torch.uint8)).sum())
    assert differ <= x.numel() // 100, f"compiled: {differ} codes differ"
