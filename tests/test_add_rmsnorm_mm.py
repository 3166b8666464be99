"""``qops::add_rmsnorm_mm_int_weight`` (and ``_out``) on CPU: against a float64 oracle over the int_weight
formats, its bad inputs (eager, fake, compiled), and the layers that call it.

The oracle adds, normalizes and multiplies in float64 from the inputs and reads the checkpoint's
dequantized weight; the op runs ``qops::add_rmsnorm`` and the reference matmul (the CPU lowering
composes them; the native CUDA lowering fuses them: tests/gpu/test_gpu_add_rmsnorm_mm.py).
"""
from __future__ import annotations

import pytest
import torch

import qops  # noqa: F401  (registers the ops)
from qops.layers.dense import FastLinear
from qops.layers.int_weight import IntWeightLinear
from qops.layers.tensor_parallel import TensorParallelColumnLinear
from qops.models.llama import RMSNorm
from tests.int_weight_cases import ACT_DTYPES, all_cases, build, one_thread, rel_err, seed_of  # noqa: F401  (one_thread: autouse fixture)
from tests.test_errors import MODES, expect_error, weight  # noqa: F401  (weight: fixture)

EPS = 1e-6
# The norm rounds x twice more than the plain matmul (the normalized value and its product with the
# norm weight, each to the activation dtype), which the bf16 bound allows for.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
CASES = [c for c in all_cases() if c.supported][::5]


def oracle(x, residual, norm_weight, w64, bias=None, glu=False):
    s = x.double() + residual.double()
    h = s / torch.sqrt((s * s).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    y = h @ w64.t()
    if bias is not None:
        y = y + bias.double()
    if glu:
        half = y.shape[-1] // 2
        y = torch.nn.functional.silu(y[..., :half]) * y[..., half:]
    return y


def _inputs(shape, k, dtype, gen):
    return (torch.randn(*shape, generator=gen).to(dtype), (2 * torch.randn(*shape, generator=gen)).to(dtype),
            (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype))


def _args(w, x, r, nw, bias, glu):
    return (x, r, nw, EPS, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features, w.bits, w.group_size, w.zero_offset,
            int(w.kernel), glu)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_the_float64_oracle(case):
    b = build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(seed_of(case) + 2)
    for glu in ((False, True) if case.n % 2 == 0 else (False,)):
        for dtype in ACT_DTYPES:
            for i, shape in enumerate(((0, case.k), (1, case.k), (3, case.k), (2, 9, case.k))):
                x, r, nw = _inputs(shape, case.k, dtype, gen)
                bias = None if glu else torch.randn(case.n, generator=gen).to(dtype)
                what = f"{case.id} glu={glu} {tuple(shape)} {dtype}"
                want = oracle(x, r, nw, b.w64, bias, glu)
                want_s = (x.double() + r.double()).to(dtype)
                y, s = torch.ops.qops.add_rmsnorm_mm_int_weight(*_args(w, x, r, nw, bias, glu))
                assert y.dtype == dtype and y.shape == want.shape and torch.equal(s, want_s), what
                out = torch.full(want.shape, float("nan"), dtype=dtype)
                summed = torch.full(x.shape, float("nan"), dtype=dtype)
                ws = torch.empty(4096, dtype=torch.uint8) if i % 2 else None
                assert torch.ops.qops.add_rmsnorm_mm_int_weight_out(*_args(w, x, r, nw, bias, glu), out, summed, ws) is None
                assert torch.equal(summed, want_s), f"{what} out"
                if x.numel():
                    assert rel_err(y, want) < TOL[dtype], f"{what}: {rel_err(y, want):.2e}"
                    assert rel_err(out, want) < TOL[dtype], f"{what} out: {rel_err(out, want):.2e}"
    x, r, nw = _inputs((4, 2 * case.k), 2 * case.k, torch.float32, gen)
    x, r, nw = x[:, ::2], r[:, 1::2], nw[: case.k]  # strided activations and residual
    y, _ = torch.ops.qops.add_rmsnorm_mm_int_weight(*_args(w, x, r, nw, None, False))
    assert rel_err(y, oracle(x, r, nw, b.w64)) < TOL[torch.float32], f"{case.id} strided"


def norm_args(w, **changes) -> dict:
    k = w.in_features
    args = dict(x=torch.randn(3, k), residual=torch.randn(3, k), norm_weight=torch.ones(k), eps=EPS, qweight=w.qweight, scales=w.scales,
                qzeros=w.qzeros, act_perm=w.act_perm, bias=None, in_features=k, bits=w.bits, group_size=w.group_size,
                zero_offset=w.zero_offset, kernel=int(w.kernel), glu=False)
    args.update(changes)
    return args


BAD = {
    "residual-shape": (dict(residual=torch.randn(2, 72)), r"add_rmsnorm_mm_int_weight: residual must have the shape of x \(3, 72\), got \(2, 72\)"),
    "residual-dtype": (dict(residual=torch.randn(3, 72).half()), r"residual must have the dtype of x \(torch.float32\), got torch.float16"),
    "norm_weight-shape": (dict(norm_weight=torch.ones(71)), r"add_rmsnorm_mm_int_weight: norm_weight must have shape \(72,\) \(K\), got \(71,\)"),
    "x-K": (dict(x=torch.randn(3, 64), residual=torch.randn(3, 64), norm_weight=torch.ones(64)), r"add_rmsnorm_mm_int_weight: x must have in_features=72 in its last dimension, got shape \(3, 64\)"),
    "glu-bias": (dict(glu=True, bias=torch.randn(24)), r"add_rmsnorm_mm_int_weight: bias must be None with glu=True"),
    "kernel-unknown": (dict(kernel=9), r"add_rmsnorm_mm_int_weight: kernel must be one of"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_input(weight, bad, mode):
    changes, pattern = BAD[bad]
    expect_error(torch.ops.qops.add_rmsnorm_mm_int_weight, norm_args(weight, **changes), mode, pattern)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field,value,pattern", [
    ("out", torch.empty(3, 12), r"out must have shape \(3, 24\), got \(3, 12\)"),
    ("summed", torch.empty(3, 71), r"summed must have the shape of x \(3, 72\), got \(3, 71\)"),
    ("summed", torch.empty(3, 72).bfloat16(), r"summed must have the dtype of x \(torch.float32\), got torch.bfloat16"),
], ids=["out-shape", "summed-shape", "summed-dtype"])
def test_out_variant_bad_buffers(weight, field, value, pattern, mode):
    args = norm_args(weight)
    args.update(out=torch.empty(3, 24), summed=torch.empty(3, 72), workspace=None)
    args[field] = value
    expect_error(torch.ops.qops.add_rmsnorm_mm_int_weight_out, args, mode, pattern)


def test_column_layer_fuses_or_composes_the_same_result():
    """TensorParallelColumnLinear.forward_add_rmsnorm: through the pre-norm op for a quantized layer,
    through the norm module then the layer otherwise (a dense layer, a norm weight of another dtype)."""
    case = next(c for c in CASES if c.fmt == "gptq" and c.n % 2 == 0)
    b = build(case)

    quant = TensorParallelColumnLinear(IntWeightLinear(b.weight))
    dense = TensorParallelColumnLinear(FastLinear(b.w64.float(), None))
    gen = torch.Generator().manual_seed(9)
    x, r, nw = _inputs((2, case.k), case.k, torch.float32, gen)
    norm = RMSNorm(nw, EPS)
    for layer in (quant, dense):
        for glu in (False, True):
            y, s = layer.forward_add_rmsnorm(x, r, norm, glu)
            assert torch.equal(s, x + r)
            assert rel_err(y, oracle(x, r, nw, b.w64, glu=glu)) < TOL[torch.float32], (type(layer.linear).__name__, glu)
    nw16 = nw.half()  # another dtype: the module's own forward_add, then the layer
    y, s = quant.forward_add_rmsnorm(x, r, RMSNorm(nw16, EPS))
    assert rel_err(y, oracle(x, r, nw16.float(), b.w64)) < TOL[torch.float32]
