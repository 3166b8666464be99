"""Every int_weight op against the float64 oracle, over every registered format and what it can hold.

The oracle reads the checkpoint tensors; the ops read the runtime layout ``prepare`` built from
them; agreement therefore covers the format's unpack, ``prepare`` (act-order permutation, zero
offset, symmetric zeros dropped) and the kernel.
"""
from __future__ import annotations

import pytest
import torch

from tests import oracle
from tests.int_weight_cases import ACT_DTYPES, TOL, all_cases, build, one_thread, rel_err, seed_of  # noqa: F401  (one_thread: autouse fixture)

SUPPORTED = [c for c in all_cases() if c.supported]
M_VALUES = (0, 1, 2, 3, 17, 128, 257)


def _one_per_format(pred) -> list:
    """The first supported case of each format satisfying ``pred``."""
    picked = {}
    for c in SUPPORTED:
        if pred(c) and c.fmt not in picked:
            picked[c.fmt] = c
    return list(picked.values())


# For the slower checks: per format, one plain weight and one with every feature it supports.
FEATURED = _one_per_format(lambda c: c.group_size == 32 and not c.act_order and c.sym) + _one_per_format(
    lambda c: c.group_size == 64 and not c.sym and (c.act_order or c.fmt == "awq") and c.bits in (3, 4) and c.version != "v2"
)


def _check(y, x, w64, bias, what):
    want = oracle.matmul(x, w64, bias)
    assert y.dtype == x.dtype, what
    assert y.shape == want.shape, what
    if y.numel():
        assert bool(torch.isfinite(y).all()), what
        err = rel_err(y, want)
        assert err < TOL[x.dtype], f"{what}: relative error {err:.2e} >= {TOL[x.dtype]:.0e}"


def _out_call(w, x, bias, workspace):
    out = torch.full((*x.shape[:-1], w.out_features), float("nan"), dtype=x.dtype)
    r = torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features, w.bits,
                                         w.group_size, w.zero_offset, int(w.kernel), out, workspace)
    assert r is None
    return out


@pytest.mark.parametrize("case", SUPPORTED, ids=lambda c: c.id)
def test_ops_match_oracle(case):
    b = build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(seed_of(case))
    workspace = torch.empty(4096, dtype=torch.uint8)
    for dtype in ACT_DTYPES:
        deq = torch.ops.qops.dequantize_int_weight(w.qweight, w.scales, w.qzeros, w.act_perm, w.in_features,
                                                   w.bits, w.group_size, w.zero_offset, dtype)
        assert deq.dtype == dtype and deq.shape == (case.n, case.k) and deq.is_contiguous()
        if dtype == torch.float32:
            assert torch.equal(deq.double(), b.w64)
        else:
            assert rel_err(deq, b.w64) < TOL[dtype], dtype
        bias = torch.randn(case.n, generator=gen).to(dtype)
        for i, m in enumerate(M_VALUES):
            x = torch.randn(m, case.k, generator=gen).to(dtype)
            x0 = x.clone()
            for bb in (None, bias):
                what = f"{case.id} M={m} {dtype} bias={bb is not None}"
                _check(w.mm(x, bb), x, b.w64, bb, "mm_int_weight " + what)
                _check(_out_call(w, x, bb, workspace if i % 2 else None), x, b.w64, bb, "mm_int_weight_out " + what)
            assert torch.equal(x, x0), "the op must not write its input"


def _activation_layouts(k: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Per layout: activations of ``dtype`` with last dimension K in that layout, and the strides it must have.

    Each view is taken after the conversion to ``dtype``: ``Tensor.to(dtype)`` of a view that is not
    dense (a step, an offset, an expand) returns a contiguous copy, so converting the view would
    hand the op a contiguous fp16/bf16 tensor under a non-contiguous name."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return {
        "transposed": (rand(k, 17).t(), (1, 17)),
        "strided": (rand(9, 2 * k)[:, ::2], (2 * k, 2)),
        "offset": (rand(5, k + 3)[:, 3:], (k + 3, 1)),
        "3d-permuted": (rand(7, 3, k).transpose(0, 1), (k, 3 * k, 1)),
        "3d-k-strided": (rand(2, 5, k, 2)[..., 1], (10 * k, 2 * k, 2)),
        "broadcast": (rand(1, k).expand(6, k), (0, 1)),
        "1d": (rand(2 * k)[::2], (2,)),
    }


@pytest.mark.parametrize("case", FEATURED, ids=lambda c: c.id)
def test_non_contiguous_activations(case):
    b = build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(1)
    for dtype in ACT_DTYPES:
        bias = torch.randn(2 * case.n, generator=gen).to(dtype)[::2]  # a strided bias too
        assert bias.stride() == (2,), f"{dtype} bias: {bias.stride()}"
        for name, (x, strides) in _activation_layouts(case.k, dtype, gen).items():
            assert x.stride() == strides, f"{name} {dtype}: strides {x.stride()}, want {strides}"
            _check(w.mm(x, bias), x, b.w64, bias, f"{case.id} {name} {dtype}")
            _check(_out_call(w, x, None, None), x, b.w64, None, f"{case.id} {name} {dtype} out")


@pytest.mark.parametrize("case", FEATURED, ids=lambda c: c.id)
def test_out_is_written_through_its_strides(case):
    # A caller's buffer may be a view (a slice of a larger activation buffer): only it is written.
    b = build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, case.k, generator=gen)
    bias = torch.randn(case.n, generator=gen)
    for name, make in {
        "transposed": lambda: torch.full((case.n, 6), 7.0).t(),
        "column-slice": lambda: torch.full((6, case.n + 5), 7.0)[:, 2:2 + case.n],
        "row-strided": lambda: torch.full((12, case.n), 7.0)[::2],
    }.items():
        out = make()
        base = out._base
        before = base.clone()
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features, w.bits,
                                         w.group_size, w.zero_offset, int(w.kernel), out, None)
        _check(out, x, b.w64, bias, f"{case.id} out {name}")
        untouched = torch.ones_like(base, dtype=torch.bool)
        untouched.as_strided(out.shape, out.stride(), out.storage_offset()).fill_(False)
        assert torch.equal(base[untouched], before[untouched]), f"{name}: wrote outside out"


@pytest.mark.parametrize("case", FEATURED, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
def test_gradient(case, dtype):
    b = build(case)
    gen = torch.Generator().manual_seed(2)
    for shape in ((0, case.k), (3, case.k), (2, 17, case.k)):
        x = torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
        bias = torch.randn(case.n, generator=gen).to(dtype).requires_grad_()
        y = b.weight.mm(x, bias)
        grad_out = torch.randn(y.shape, generator=gen).to(dtype)
        y.backward(grad_out)
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        assert bias.grad.dtype == dtype and bias.grad.shape == bias.shape
        want_x = grad_out.double() @ b.w64
        want_b = grad_out.double().reshape(-1, case.n).sum(0)
        if x.numel():
            assert rel_err(x.grad, want_x) < TOL[dtype], shape
            assert rel_err(bias.grad, want_b) < TOL[dtype], shape
        else:
            assert bool((bias.grad == 0).all())


@pytest.mark.parametrize("case", FEATURED[:3], ids=lambda c: c.id)
def test_gradient_without_bias_and_with_frozen_x(case):
    b = build(case)
    x = torch.randn(4, case.k, requires_grad=True)
    b.weight.mm(x).sum().backward()
    assert torch.allclose(x.grad.double(), b.w64.sum(0).expand(4, -1), rtol=1e-5, atol=1e-6)
    bias = torch.randn(case.n, requires_grad=True)
    y = b.weight.mm(torch.randn(4, case.k), bias)
    y.sum().backward()
    assert torch.equal(bias.grad, torch.full((case.n,), 4.0))


def swiglu_oracle(x, w64):
    """silu(gate) * up in float64 from the oracle's product: gate columns first, then up."""
    return _silu_mul64(oracle.matmul(x, w64, None))


def _silu_mul64(y):
    h = y.shape[-1] // 2
    gate, up = y[..., :h], y[..., h:]
    return gate / (1 + torch.exp(-gate)) * up


def _check_swiglu(y, x, w64, what):
    want = swiglu_oracle(x, w64)
    assert y.dtype == x.dtype and y.shape == want.shape, what
    if y.numel():
        err = rel_err(y, want)
        assert err < TOL[x.dtype], f"{what}: relative error {err:.2e} >= {TOL[x.dtype]:.0e}"


@pytest.mark.parametrize("case", SUPPORTED[::3] + FEATURED, ids=lambda c: c.id)
def test_swiglu_ops_match_oracle(case):
    b = build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(seed_of(case) + 1)
    for dtype in ACT_DTYPES:
        for i, m in enumerate(M_VALUES):
            x = torch.randn(m, case.k, generator=gen).to(dtype)
            _check_swiglu(w.mm_swiglu(x), x, b.w64, f"{case.id} M={m} {dtype}")
            out = torch.full((m, case.n // 2), float("nan"), dtype=dtype)
            torch.ops.qops.mm_int_weight_swiglu_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, w.in_features, w.bits, w.group_size,
                                                    w.zero_offset, int(w.kernel), out, torch.empty(4096, dtype=torch.uint8) if i % 2 else None)
            _check_swiglu(out, x, b.w64, f"{case.id} M={m} {dtype} out")
    x = torch.randn(9, 2 * case.k, generator=gen)[:, ::2]  # strided activations
    _check_swiglu(w.mm_swiglu(x), x, b.w64, f"{case.id} strided x")


@pytest.mark.parametrize("case", FEATURED[:3], ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", ACT_DTYPES, ids=str)
def test_swiglu_gradient(case, dtype):
    b = build(case)
    gen = torch.Generator().manual_seed(4)
    for shape in ((0, case.k), (2, 5, case.k)):
        x = torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
        y = b.weight.mm_swiglu(x)
        grad_out = torch.randn(y.shape, generator=gen).to(dtype)
        y.backward(grad_out)
        x64 = x.detach().double().requires_grad_()
        _silu_mul64(x64 @ b.w64.t()).backward(grad_out.double())  # autograd through float64 x @ W.T
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        if x.numel():
            assert rel_err(x.grad, x64.grad) < TOL[dtype], shape
