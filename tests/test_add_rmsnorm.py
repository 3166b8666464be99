"""``qops::add_rmsnorm`` (``qops.models.norm``) on CPU.

The oracle is float64 and written out here: the sum rounded to the dtype (the residual stream is
stored in it), then ``weight * round(s / sqrt(mean(s^2) + eps))``. Checked: the CPU kernel and the
Triton kernel under ``TRITON_INTERPRET=1`` (fp32 / fp16: the interpreter computes bf16 wrongly) for
rows 0, 1, 5, 3-D inputs, K off the power-of-two grid, strided x and a strided weight; ``opcheck``;
errors naming the argument, eagerly and under ``FakeTensorMode``; the Llama layer calling it (eager
and compiled equal to the plain sum and norm).
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qops.models import norm as N
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small products on one thread)
from tests.oracle import stride_two

OP = torch.ops.qops.add_rmsnorm.default
EPS = 1e-5
# Relative Frobenius error against the float64 oracle: the outputs' rounding, and a normalized value
# rounding the other way where the fp32 sum of squares differs from float64's in its last bits.
TOL = {torch.float32: 1e-6, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}


def oracle(x, residual, weight, eps):
    s = (x.double() + residual.double()).to(x.dtype).double()
    normed = (s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)).to(x.dtype).double()
    return weight.double() * normed, s


def rel(a, b) -> float:
    b = b.double()
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def inputs(shape, dtype, seed=0, strided=False, device="cpu"):
    """x, residual and weight of ``dtype`` on ``device`` (drawn on the CPU: the same values on every
    device); ``strided``: x a view with K stride 2. The view is taken after the conversion and the
    move, each of which returns a contiguous copy of a strided view, and its stride is checked."""
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(*shape[:-1], 2 * k if strided else k, generator=g).to(device=device, dtype=dtype)
    if strided:
        x = x[..., ::2]
        assert x.stride(-1) == 2, f"strided x {dtype} on {device}: strides {x.stride()}"
    r = (3 * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(device=device, dtype=dtype)
    return x, r, w


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_strided_inputs_stay_strided_on_the_device_asked_for(device):
    """tests/gpu builds its inputs with device="cuda"; "meta" stands in for a second device here (its
    ``.to`` of a strided view is a contiguous copy too, as ``.cuda()``'s is)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, r, w = inputs((2, 3, 96), dtype, strided=True, device=device)
        assert x.device.type == device and x.dtype == dtype and x.shape == (2, 3, 96), (x.device, x.dtype, x.shape)
        assert x.stride() == (3 * 192, 192, 2), f"{dtype} on {device}: strides {x.stride()}"
        assert r.device.type == w.device.type == device and r.dtype == w.dtype == dtype


def check(got, x, r, w, what):
    out, summed = got
    want_out, want_sum = oracle(x, r, w, EPS)
    assert out.dtype == x.dtype and summed.dtype == x.dtype and out.shape == x.shape and summed.shape == x.shape, what
    assert out.is_contiguous() and summed.is_contiguous(), what
    if x.numel():
        assert torch.equal(summed.double(), want_sum), f"{what}: the sum is the dtype's rounding of x + residual"
        assert rel(out, want_out) < TOL[x.dtype], f"{what}: {rel(out, want_out):.2e}"


SHAPES = [(0, 64), (1, 4096), (5, 1000), (2, 3, 96)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_kernel_matches_the_oracle(shape, dtype):
    x, r, w = inputs(shape, dtype, seed=len(shape))
    check(OP(x, r, w, EPS), x, r, w, f"{shape} {dtype}")
    xs, rs, ws = inputs(shape, dtype, seed=7, strided=True)
    check(OP(xs, rs, ws, EPS), xs, rs, ws, f"{shape} {dtype} strided x")
    check(OP(xs, rs, stride_two(ws), EPS), xs, rs, stride_two(ws), f"{shape} {dtype} strided x, weight of stride 2")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_kernel_matches_the_oracle(shape, dtype):
    if N._triton_kernel() is None:
        pytest.skip("triton is not importable")
    x, r, w = inputs(shape, dtype, seed=3, strided=True)
    check(N.triton_add_rmsnorm(x, r, w, EPS), x, r, w, f"{shape} {dtype}")
    # The op takes a weight of any strides (the CPU kernel: test above); the kernel reads it through its stride.
    ws = stride_two(w)
    assert ws.stride() == (2,)
    check(N.triton_add_rmsnorm(x, r, ws, EPS), x, r, ws, f"{shape} {dtype} weight of stride 2")


def add_rmsnorm_samples() -> dict[str, tuple]:
    out = {}
    for name, (shape, dtype, strided) in {"fp32-5x72": ((5, 72), torch.float32, False), "fp16-2x3x64-strided": ((2, 3, 64), torch.float16, True),
                                          "bf16-0x32": ((0, 32), torch.bfloat16, False)}.items():
        out[name] = (*inputs(shape, dtype, seed=1, strided=strided), EPS)
    return out


# For tests/test_opcheck.py (SAMPLES.update(OPCHECK_SAMPLES)): every qops op needs samples there.
OPCHECK_SAMPLES = {"add_rmsnorm": add_rmsnorm_samples}


@pytest.mark.parametrize("mode", ["eager", "fake"])
@pytest.mark.parametrize("bad,pattern", [
    ("x-int", r"x must be float32, float16 or bfloat16, got torch.int32"),
    ("residual-dtype", r"residual must have the dtype of x \(torch.float32\), got torch.float16"),
    ("weight-dtype", r"weight must have the dtype of x \(torch.float32\), got torch.bfloat16"),
    ("residual-shape", r"residual must have the shape of x \(3, 8\), got \(3, 9\)"),
    ("weight-shape", r"weight must have shape \(8,\) \(K\), got \(9,\)"),
    ("weight-device", r"weight must be on cpu \(the device of x\), got meta"),
])
def test_bad_input_is_named(bad, pattern, mode):
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    args = {"x-int": (x.int(), r, w), "residual-dtype": (x, r.half(), w), "weight-dtype": (x, r, w.bfloat16()),
            "residual-shape": (x, torch.randn(3, 9), w), "weight-shape": (x, r, torch.randn(9)),
            "weight-device": (x, r, w.to("meta"))}[bad]
    with pytest.raises((TypeError, ValueError), match=pattern):
        if mode == "eager":
            OP(*args, EPS)
        else:
            with FakeTensorMode() as m:
                OP(*[m.from_tensor(a) for a in args], EPS)

