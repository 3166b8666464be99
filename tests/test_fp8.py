"""FP8 formats (fp8, compressed-tensors-fp8, fp8-block) and the fp8 ops against a float64 oracle.

The oracle below imports nothing from qops: it decodes e4m3fn from the bit pattern (sign, 4-bit
exponent with bias 7, 3-bit mantissa, subnormals, 0x7F/0xFF NaN) in numpy, expands scales over their
blocks with ``np.repeat``, and reads each checkpoint only through its stored tensors (FORMATS.md).
Its round-to-nearest-even quantizer searches the code table, so it also checks qops' quantizers.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qops  # noqa: F401  (registers the ops)
from qops.formats import FORMATS, get_format
from qops.formats.fp8 import Fp8BlockCheckpoint, Fp8Checkpoint, quantize_rtn
from qops.lowerings import DISABLE_ENV, LOWERINGS_BY_NAME, Kernel, WeightSpec, choose
from qops.ops.fp8 import check_kernel, prepare_fp8_weight, quantize_fp8_activations
from tests.launch_recorder import KernelRecorder
from tests.oracle import check_elementwise, elementwise_bound, stride_two

FP8 = torch.float8_e4m3fn
FP8_FORMATS = ("fp8", "compressed-tensors-fp8", "fp8-block")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MS = (0, 1, 2, 3, 17, 128, 257)
# Relative Frobenius error allowed against the float64 oracle: fp32 accumulation plus the rounding of
# the output to its dtype.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


# ---- oracle -----------------------------------------------------------------------------------


def e4m3_decode(bits) -> np.ndarray:
    """float64 values of e4m3fn bit patterns (uint8)."""
    b = np.asarray(bits, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = (b & 0x7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return sign * mag


CODES = np.arange(127)  # the non-negative finite codes, in increasing value
GRID = e4m3_decode(CODES)


def e4m3_round(v) -> np.ndarray:
    """Round-to-nearest-even e4m3fn codes (uint8) of float64 values already within [-448, 448]."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(GRID, a), 1, len(GRID) - 1)
    lo = hi - 1
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def fp32_quotient(v: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``v / s`` divided in fp32, as quantizers (and checkpoint writers) do before rounding to fp8.

    The fp32 quotient can land exactly on a midpoint of the e4m3 grid where the exact one does not;
    the quantizer's contract is this two-step rounding, so the oracle models it.
    """
    return np.clip(v.astype(np.float32) / s.astype(np.float32), -448, 448).astype(np.float64)


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def _f64(t) -> np.ndarray:
    return t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)


def expand_blocks(scale: np.ndarray, n: int, k: int, bn: int, bk: int) -> np.ndarray:
    s = np.repeat(scale, bn, axis=0)[:n] if bn > 0 else scale
    s = np.repeat(s, bk, axis=1)[:, :k] if bk > 0 else s
    return np.broadcast_to(s, (n, k))


def oracle_weight(format_name: str, c) -> torch.Tensor:
    """The float64 ``(N, K)`` weight of a checkpoint, from its stored tensors only."""
    q = e4m3_decode(_u8(c.weight))
    n, k = q.shape
    if format_name == "fp8-block":
        bn, bk = c.block_size
        s = expand_blocks(_f64(c.weight_scale_inv), n, k, bn, bk)
    elif c.block_size is not None:
        bn, bk = c.block_size
        s = expand_blocks(_f64(c.weight_scale), n, k, bn, bk)
    else:
        s = _f64(c.weight_scale).reshape(-1, 1)  # (1, 1) per tensor or (N, 1) per channel
    return torch.from_numpy(q * s)


def oracle_mm(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    y = x.detach().double() @ w.t()
    return y if bias is None else y + bias.detach().double()


def oracle_x(x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """float64 activations: per-tensor ``(1,)`` and per-token ``(..., 1)`` scales broadcast; per-token-group
    scales ``(..., ceil(K/128))`` each cover 128 consecutive K values (the last group what is left)."""
    v, s = e4m3_decode(_u8(x_fp8)), _f64(x_scale)
    if s.ndim == v.ndim and s.shape[-1] > 1:
        s = np.repeat(s, 128, axis=-1)[..., : v.shape[-1]]
    return torch.from_numpy(v * s)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


# A quotient x / scale within this many fp32 ulps of an e4m3 midpoint may round either way, depending
# on how the device computed it: a scale computed another way (amax / 448 where qops multiplies by
# fp32(1/448) -- CUDA itself divided by a Python number so, and the CPU did not, before qops wrote the
# multiply) moves ~60% of the dynamic scales of fp16 / bf16 rows by an ulp and flips a code in ~3% of
# the rows; Inductor's Triton division x / scale need not be correctly rounded either. With fp16 / bf16
# x a quotient that is not a midpoint lies ~2^-15 (relative) or more from one, so this marks the ties only.
TIE_ULPS = 4
# An fp32 scale computed another way (amax / 448, not times the reciprocal) is within this of the oracle's.
SCALE_SLACK = 2.0**-22


def independent_fp8_x(x: torch.Tensor, static_scale: float | None, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 activations as W8A8 quantizes them, written from the format's definition on the host
    (not the op's ``quantize_fp8_activations``, whose GPU run the oracle must not share): the scale
    is the static one, or amax times fp32(1 / 448), rounded to fp32, per token (``group_size`` -1) or per token and 128 K
    values; each value x / scale (in fp32, saturated to +-448) rounded to the nearest e4m3 code
    (ties to even, this file's grid), decoded from its bits, times the scale.

    Returns ``(x64, tie64)`` on the CPU: ``tie64`` is, for each value whose quotient lies within
    ``TIE_ULPS`` of a midpoint of the grid, the e4m3 step there times the scale (0 elsewhere): how far
    a device that rounds that tie the other way may move it."""
    x64 = x.detach().cpu().double().numpy()
    k = x64.shape[-1]
    if static_scale is not None:
        s_k = np.full(x64.shape, np.float32(static_scale), dtype=np.float32)
    else:
        g = k if group_size == -1 else group_size
        groups = -(-k // g) if k else 0
        padded = np.zeros(x64.shape[:-1] + (groups * g,))
        padded[..., :k] = np.abs(x64)
        amax = padded.reshape(*x64.shape[:-1], groups, g).max(axis=-1) if groups else np.zeros(x64.shape[:-1] + (0,))
        s = np.where(amax == 0, np.float32(1), amax.astype(np.float32) * np.float32(1 / 448)).astype(np.float32)
        s_k = np.repeat(s, g, axis=-1)[..., :k]
    q = fp32_quotient(x64, s_k)
    a = np.abs(q)
    hi = np.clip(np.searchsorted(GRID, a), 1, len(GRID) - 1)
    step = GRID[hi] - GRID[hi - 1]
    near = np.abs(a - (GRID[hi] + GRID[hi - 1]) / 2) <= TIE_ULPS * np.spacing(a.astype(np.float32)).astype(np.float64)
    s64 = s_k.astype(np.float64)
    return torch.from_numpy(e4m3_decode(e4m3_round(q)) * s64), torch.from_numpy(np.where(near & (a < 448), step * s64, 0.0))


def row_magnitudes(m: int, shift: int, device=None) -> torch.Tensor:
    """``(m, 1)`` factors 10^-2 .. 10^2, cycling over the rows from 10^(shift % 5 - 2): rows of x
    whose dynamic fp8 scales differ by up to 10^4. Replayed with another input's scales, the large
    rows saturate at 448 and the small ones lose their precision."""
    return (10.0 ** ((torch.arange(m, device=device) + shift) % 5 - 2)).unsqueeze(1)


def check_fp8_mm(y: torch.Tensor, w, w64: torch.Tensor, x: torch.Tensor, bias, tol: float, what: str, c_dot: float = 8.0) -> None:
    """``y = w.mm(x, bias)`` of a prepared fp8 weight ``w`` (exact float64 ``w64``) against the float64
    oracle: x's dtype and shape, finite, relative error <= ``tol``, and every element within
    ``tests.oracle.elementwise_bound`` (one wrong element fails). W8A8 quantizes x with
    :func:`independent_fp8_x`; its bound adds, per output, the moves of the tied codes (``tie64 @
    |W|.T``) and of a scale an ulp or two off (``SCALE_SLACK * |x| @ |W|.T``): a device may round
    those differently and still keep the format's contract. ``c_dot``: the bound's weight on the
    dot product's spread (elementwise_bound's)."""
    dtype = x.dtype
    if w.activations == "none":
        x64, slack = x.detach().double(), 0.0
    else:
        static = float(w.input_scale.reshape(-1)[0]) if w.activations == "static" else None
        x64, tie = (t.to(y.device) for t in independent_fp8_x(x, static, w.x_group_size))
        slack = (tie + SCALE_SLACK * x64.abs()) @ w64.abs().t()
    want = oracle_mm(x64, w64, bias)
    assert y.dtype == dtype and tuple(y.shape) == tuple(want.shape), f"{what}: {y.dtype} {tuple(y.shape)}"
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output"
    err = rel_err(y, want)
    assert err <= tol, f"{what}: relative error {err:.2e}"
    bound = elementwise_bound(x64, w64, bias, dtype, c_dot=c_dot) + slack
    ratio = ((y.double() - want).abs() / bound).reshape(-1)
    if ratio.numel() and not bool((ratio <= 1).all()):
        worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
        raise AssertionError(f"{what}: {int((~(ratio <= 1)).sum())} of {ratio.numel()} elements past the elementwise bound; "
                             f"worst (flat index {worst}) at {float(ratio[worst]):.2f}x its bound")


# ---- cases ------------------------------------------------------------------------------------

# (format, granularity, N, K, block): N and K odd-sized; block scales over partial edge blocks.
WEIGHTS = {
    "fp8-tensor": ("fp8", "tensor", 72, 200, None),
    "fp8-channel": ("fp8", "channel", 72, 200, None),
    "ct-tensor": ("compressed-tensors-fp8", "tensor", 72, 200, None),
    "ct-channel": ("compressed-tensors-fp8", "channel", 40, 24, None),
    "ct-block": ("compressed-tensors-fp8", "block", 72, 200, (32, 64)),
    "block128": ("fp8-block", "block", 200, 328, (128, 128)),
}


def make_checkpoint(case: str, seed: int = 0, input_scale=None):
    fmt, gran, n, k, block = WEIGHTS[case]
    g = torch.Generator().manual_seed(seed)
    # Rows of different magnitudes so per-channel and block scales differ.
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n).unsqueeze(1)
    f = FORMATS[fmt]
    if fmt == "fp8-block":
        return f.quantize(w, block_size=block), w
    return f.quantize(w, granularity=gran, block_size=block or (128, 128), input_scale=input_scale), w


def weight_of(case: str, activations: str = "none", dtype=torch.float32, **kw):
    fmt = WEIGHTS[case][0]
    c, _ = make_checkpoint(case, **kw)
    return FORMATS[fmt].prepare(c, dtype=dtype, activations=activations), c


# ---- the oracle itself ------------------------------------------------------------------------


def test_oracle_decodes_every_code_as_torch_does():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = e4m3_decode(codes.numpy())
    theirs = codes.view(FP8).double().numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.isnan(ours).sum() == 2
    finite = ~np.isnan(ours)
    assert np.array_equal(ours[finite], theirs[finite])
    assert GRID[-1] == 448.0 and GRID[1] == 2.0**-9


def test_oracle_rounds_to_nearest_even_as_torch_does():
    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(5000, generator=g) * 30, torch.from_numpy(GRID[:-1] + np.diff(GRID) / 2).float()])
    assert np.array_equal(e4m3_round(v.double().numpy()), _u8(v.to(FP8)))


# ---- formats ----------------------------------------------------------------------------------


def test_registry_entries():
    for name in FP8_FORMATS:
        f = get_format(name)
        assert f.name == name and f.family == "fp8" and f.bits == (8,)


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_checkpoint_tensors_as_documented(case):
    fmt, gran, n, k, block = WEIGHTS[case]
    c, _ = make_checkpoint(case, input_scale=0.05 if fmt != "fp8-block" else None)
    assert c.weight.dtype == FP8 and tuple(c.weight.shape) == (n, k)
    if fmt == "fp8-block":
        bn, bk = block
        assert c.weight_scale_inv.dtype == torch.float32
        assert tuple(c.weight_scale_inv.shape) == (-(-n // bn), -(-k // bk))
        return
    want = {"tensor": (1,), "channel": (n, 1)}.get(gran) or (-(-n // block[0]), -(-k // block[1]))
    assert c.weight_scale.dtype == torch.float32 and tuple(c.weight_scale.shape) == want
    assert c.block_size == (block if gran == "block" else None)
    assert c.input_scale.dtype == torch.float32 and tuple(c.input_scale.shape) == (1,)


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_quantize_pack_unpack_is_exact(case):
    fmt, gran, n, k, block = WEIGHTS[case]
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g)
    fq = quantize_rtn(w, gran, block or (128, 128), 0.25 if fmt != "fp8-block" else None)
    back = FORMATS[fmt].unpack(FORMATS[fmt].pack(fq))
    assert torch.equal(back.q.view(torch.uint8), fq.q.view(torch.uint8))
    assert torch.equal(back.scale, fq.scale) and back.scale.shape == fq.scale.shape
    assert (back.block_n, back.block_k) == (fq.block_n, fq.block_k)
    assert (back.input_scale is None) == (fq.input_scale is None)
    if fq.input_scale is not None:
        assert torch.equal(back.input_scale, fq.input_scale)


@pytest.mark.parametrize("gran,block", [("tensor", None), ("channel", None), ("block", (128, 128)), ("block", (32, 64))])
def test_rtn_quantizer_matches_oracle(gran, block):
    n, k = 200, 328
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)
    w[3, :] = 0  # an all-zero row: its scale is 1 (per channel), its codes 0
    fq = quantize_rtn(w, gran, block or (128, 128))
    w64 = w.double().numpy()
    bn, bk = {"tensor": (n, k), "channel": (1, k)}.get(gran) or block
    sn, sk = -(-n // bn), -(-k // bk)
    padded = np.zeros((sn * bn, sk * bk))
    padded[:n, :k] = np.abs(w64)
    amax = padded.reshape(sn, bn, sk, bk).max(axis=(1, 3))
    want = np.where(amax > 0, amax / 448.0, 1.0)
    got = _f64(fq.scale)
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= want * 2.0**-23)  # the fp32 rounding of amax / 448
    s = expand_blocks(got, n, k, bn if gran != "tensor" else 0, bk if gran == "block" else 0)
    assert np.array_equal(e4m3_round(fp32_quotient(w64, s)), _u8(fq.q))


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_dequantize_matches_oracle(case):
    fmt = WEIGHTS[case][0]
    c, _ = make_checkpoint(case)
    want = oracle_weight(fmt, c)
    # fp32 rounds the exact product once, as the oracle rounded to fp32 does.
    assert torch.equal(FORMATS[fmt].dequantize(c), want.float())
    w, _ = weight_of(case)
    assert torch.equal(w.dequantize(torch.float32), want.float())
    assert torch.equal(w.dequantize(torch.bfloat16), want.float().bfloat16())


def test_checkpoints_as_written_in_the_wild():
    """Hand-built tensors: 0-d scalars (older fp8 writers), bf16 scales, DeepSeek 128x128 blocks."""
    g = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 126, (40, 24), generator=g, dtype=torch.uint8)
    bits[::3] |= 0x80
    weight = bits.view(FP8)
    c = Fp8Checkpoint(weight=weight, weight_scale=torch.tensor(0.5), input_scale=torch.tensor(2.0))
    fq = FORMATS["fp8"].unpack(c)
    assert (fq.block_n, fq.block_k) == (-1, -1) and tuple(fq.input_scale.shape) == (1,)
    assert torch.equal(FORMATS["fp8"].dequantize(c).double(), oracle_weight("fp8", c))
    c = Fp8Checkpoint(weight=weight, weight_scale=torch.rand(40, 1, generator=g).bfloat16())
    assert torch.equal(FORMATS["compressed-tensors-fp8"].dequantize(c).double(), oracle_weight("compressed-tensors-fp8", c))
    big = torch.randint(0, 126, (300, 260), generator=g, dtype=torch.uint8).view(FP8)
    c = Fp8BlockCheckpoint(weight=big, weight_scale_inv=torch.rand(3, 3, generator=g) * 1e-3)
    assert torch.equal(FORMATS["fp8-block"].dequantize(c).double(), oracle_weight("fp8-block", c).float().double())


@pytest.mark.parametrize("fmt,make,pattern", [
    ("fp8", lambda: Fp8Checkpoint(torch.zeros(4, 8, dtype=torch.float16), torch.ones(1)), r"weight must be torch\.float8_e4m3fn"),
    ("fp8", lambda: Fp8Checkpoint(torch.zeros(4, 8).to(FP8), torch.ones(4)), r"weight_scale must have shape \(4, 1\)"),
    ("fp8", lambda: Fp8Checkpoint(torch.zeros(4, 8).to(FP8), torch.ones(1, 1), block_size=(128, 128)), r"block_size is set"),
    ("fp8", lambda: Fp8Checkpoint(torch.zeros(4, 8).to(FP8), torch.ones(1), input_scale=torch.ones(2)), r"input_scale must be"),
    ("compressed-tensors-fp8", lambda: Fp8Checkpoint(torch.zeros(200, 8).to(FP8), torch.ones(1, 1), block_size=(128, 128)), r"weight_scale must have shape \(2, 1\)"),
    ("fp8-block", lambda: Fp8BlockCheckpoint(torch.zeros(200, 300).to(FP8), torch.ones(2, 2)), r"weight_scale_inv must have shape \(2, 3\)"),
    ("fp8-block", lambda: Fp8BlockCheckpoint(torch.zeros(4, 8).to(FP8), torch.ones(1, 1), block_size=(0, 128)), r"block_size\[0\]"),
])
def test_unpack_errors_name_the_tensor(fmt, make, pattern):
    with pytest.raises(ValueError, match=pattern):
        FORMATS[fmt].unpack(make())


@pytest.mark.parametrize("block_size,pattern", [
    ((128.0, 128), r"fp8-block: block_size\[0\] must be an integer, got float 128\.0"),
    ((128, True), r"fp8-block: block_size\[1\] must be an integer, got bool True"),
])
def test_block_sizes_must_be_integers(block_size, pattern):
    c = Fp8BlockCheckpoint(torch.zeros(200, 300).to(FP8), torch.ones(2, 3), block_size=block_size)
    with pytest.raises(TypeError, match=pattern):
        FORMATS["fp8-block"].unpack(c)


def test_pack_refuses_granularities_the_format_cannot_hold():
    fq = quantize_rtn(torch.randn(8, 16), "block", (4, 8))
    with pytest.raises(ValueError, match="block scales cannot be stored"):
        FORMATS["fp8"].pack(fq)
    with pytest.raises(ValueError, match="only block scales"):
        FORMATS["fp8-block"].pack(quantize_rtn(torch.randn(8, 16), "channel"))


# ---- ops against the oracle (reference kernel on this machine) --------------------------------


def _x(m: int, k: int, dtype, seed: int, *, transposed: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if transposed:  # non-contiguous: a transposed view
        return torch.randn(k, m, generator=g).to(dtype).t()
    return torch.randn(m, k, generator=g).to(dtype)


@pytest.mark.parametrize("case", sorted(WEIGHTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mm_fp8_weight_matches_oracle(case, dtype):
    w, c = weight_of(case, dtype=dtype)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    bias = torch.randn(n).to(dtype)
    for m in MS:
        for transposed in (False, True):
            x = _x(m, k, dtype, m, transposed=transposed)
            b = bias if m % 2 else None
            y = w.mm(x, b)
            assert y.is_contiguous()
            check_fp8_mm(y, w, want_w, x, b, TOL[dtype], f"M={m} transposed={transposed}")
    x3 = _x(6, k, dtype, 9).reshape(2, 3, k)
    assert rel_err(w.mm(x3), oracle_mm(x3, want_w)) <= TOL[dtype]
    assert tuple(w.mm(x3[0, 0]).shape) == (n,)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["fp8-tensor", "ct-block"])
def test_mm_fp8_weight_out_writes_what_mm_fp8_weight_returns(case, dtype):
    """The _out form writes into a NaN-poisoned out (contiguous, and every other column of a wider
    buffer) what the functional op returns, and both meet the float64 oracle (relative and per
    element): M = 0, 1, 17, 257, 3-D and transposed x, with and without a bias and a workspace."""
    w, c = weight_of(case, dtype=dtype)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = w.out_features, w.in_features
    bias = torch.randn(n).to(dtype)
    cases = (((1, k), bias, torch.empty(512, dtype=torch.uint8)), ((17, k), None, None), ((257, k), bias, None),
             ((2, 3, k), None, None), ((0, k), bias, None), ("transposed", bias, None))
    for shape, b, workspace in cases:
        x = _x(k, 17, dtype, 4).t() if shape == "transposed" else torch.randn(*shape).to(dtype)
        lead = tuple(x.shape[:-1])
        for layout in ("contiguous", "strided"):
            wide = torch.full((*lead, 2 * n), float("nan"), dtype=dtype)
            out = wide[..., ::2] if layout == "strided" else torch.full((*lead, n), float("nan"), dtype=dtype)
            ret = torch.ops.qops.mm_fp8_weight_out(x, w.weight, w.weight_scale, b, w.block_n, w.block_k, int(w.kernel), out, workspace)
            assert ret is None
            want = torch.ops.qops.mm_fp8_weight(x, w.weight, w.weight_scale, b, w.block_n, w.block_k, int(w.kernel))
            assert torch.equal(out, want), (shape, layout)
            if layout == "strided":
                assert bool(wide[..., 1::2].isnan().all()), "wrote outside out"
        check_fp8_mm(want.reshape(-1, n), w, want_w, x.reshape(-1, k), b, TOL[dtype], f"{case} {dtype} {shape}")


@pytest.mark.parametrize("case", ["fp8-tensor", "ct-channel", "ct-block", "block128"])
@pytest.mark.parametrize("x_scales", ["per-tensor", "per-token", "per-group"])
def test_scaled_mm_fp8_matches_oracle(case, x_scales):
    """Per-group scales: K = 200 and 328 end in a partial group, K = 24 is one group (a token)."""
    w, c = weight_of(case, activations="dynamic")
    assert w.activations == "dynamic" and w.kernel == Kernel.REFERENCE
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    g = torch.Generator().manual_seed(5)
    for m in MS:
        codes = torch.randint(0, 126, (m, k), generator=g, dtype=torch.uint8) | (torch.randint(0, 2, (m, k), generator=g, dtype=torch.uint8) << 7)
        x_fp8 = codes.view(FP8)
        x_scale = {"per-tensor": lambda: torch.tensor([0.03]), "per-token": lambda: torch.rand(m, 1, generator=g) + 0.01,
                   "per-group": lambda: torch.rand(m, -(-k // 128), generator=g) + 0.01}[x_scales]()
        for out_dtype in DTYPES:
            bias = torch.randn(n).to(out_dtype) if m % 2 else None
            y = torch.ops.qops.scaled_mm_fp8(x_fp8, x_scale, w.weight, w.weight_scale, bias, w.block_n, w.block_k, out_dtype, int(w.kernel))
            assert y.dtype == out_dtype and tuple(y.shape) == (m, n)
            assert rel_err(y, oracle_mm(oracle_x(x_fp8, x_scale), want_w, bias)) <= TOL[out_dtype], (m, out_dtype)
            check_elementwise(y, oracle_x(x_fp8, x_scale), want_w, bias, out_dtype, f"M={m} {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dynamic_activation_quantization_matches_oracle(dtype):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 9, 200, generator=g) * torch.logspace(-4, 3, 9).unsqueeze(1)).to(dtype)
    x[0, 2] = 0  # an all-zero token stays finite and zero
    x_fp8, x_scale = quantize_fp8_activations(x)
    assert x_fp8.dtype == FP8 and x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (2, 9, 1)
    x64 = _f64(x)
    amax = np.abs(x64).max(axis=-1, keepdims=True)
    s = _f64(x_scale)
    assert np.all(np.abs(s - amax / 448) <= amax / 448 * 2.0**-23 + (amax == 0))
    assert np.array_equal(e4m3_round(fp32_quotient(x64, s)), _u8(x_fp8))
    assert not torch.isnan(x_fp8.float()).any()


@pytest.mark.parametrize("k", [200, 256, 24])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_activation_quantization_matches_oracle(dtype, k):
    """One scale per token and 128 K values: amax of the group / 448, the last group partial; the
    codes round x / scale (in fp32) to nearest even; dequantized, within an fp8 step of x."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 5, k, generator=g) * torch.logspace(-3, 3, k)).to(dtype)  # groups of different magnitude
    x[0, 1] = 0  # an all-zero token
    x[1, 2, :min(k, 128)] = 0  # an all-zero group
    x_fp8, x_scale = quantize_fp8_activations(x, group_size=128)
    groups = -(-k // 128)
    assert x_fp8.dtype == FP8 and tuple(x_fp8.shape) == (2, 5, k)
    assert x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (2, 5, groups)
    x64 = _f64(x)
    padded = np.zeros((2, 5, groups * 128))
    padded[..., :k] = np.abs(x64)
    amax = padded.reshape(2, 5, groups, 128).max(axis=-1)
    s = _f64(x_scale)
    assert np.all(np.abs(s - amax / 448) <= amax / 448 * 2.0**-23 + (amax == 0) * 2.0**-100)
    assert np.all(s > 0) and np.all(np.isfinite(s))
    s_k = np.repeat(s, 128, axis=-1)[..., :k]
    assert np.array_equal(e4m3_round(fp32_quotient(x64, s_k)), _u8(x_fp8))
    back = oracle_x(x_fp8, x_scale).numpy()
    # e4m3 keeps 3 mantissa bits (half a step: 2^-4 relative); below 2^-6 * scale its subnormal step is 2^-9.
    assert np.all(np.abs(back - x64) <= np.abs(x64) * 2.0**-4 + s_k * 2.0**-10)
    assert not torch.isnan(x_fp8.float()).any() and torch.equal(x_fp8[0, 1].float(), torch.zeros(k))


def test_group_activation_quantization_refuses_other_groups():
    with pytest.raises(ValueError, match=r"qops.quantize_fp8_activations: group_size must be -1 \(per token\) or 128, got 64"):
        quantize_fp8_activations(torch.randn(2, 256), group_size=64)
    with pytest.raises(ValueError, match=r"qops.quantize_fp8_activations: group_size goes with dynamic scales"):
        quantize_fp8_activations(torch.randn(2, 256), torch.tensor([0.1]), group_size=128)


@pytest.mark.parametrize("case,want", [("block128", 128), ("ct-block", -1), ("fp8-channel", -1)])
def test_prepare_gives_block128_weights_group_activation_scales_where_the_lowering_reads_them(case, want):
    """The activation-scale layout is a static fact of the prepared weight: groups of 128 for 128 x 128
    blocks whose lowering declares it reads them (the reference does), one scale per token otherwise."""
    w, _ = weight_of(case, activations="dynamic")
    assert w.x_group_size == want and w.kernel == Kernel.REFERENCE
    assert weight_of(case, activations="none")[0].x_group_size == -1


def test_static_activation_quantization_saturates():
    x = torch.tensor([[1.0, -1.0, 0.5, 1000.0, -1000.0]])
    x_fp8, x_scale = quantize_fp8_activations(x, torch.tensor([1 / 64]))
    assert torch.equal(x_scale, torch.tensor([1 / 64]))
    assert torch.equal(x_fp8.float(), torch.tensor([[64.0, -64.0, 32.0, 448.0, -448.0]]))



def test_an_fp16_ulp_of_input_moves_static_w8a8_outputs_by_whole_fp8_steps():
    # Why two fp16 computations of the same layer input (tensor-parallel partial sums rounded before
    # the all-reduce, Inductor fusing the fp16 ops ahead of the quantization in fp32) disagree far
    # more downstream of static W8A8 layers than of W8A16 ones: quantize_fp8_activations is a step
    # function. An e4m3 step is 2^-3 of a value's binade, an fp16 ulp 2^-10, so moving every input
    # by one ulp moves about 1/128 of the fp8 codes by a whole step (6-12% of that activation).
    # Measured here: 0.69% of the codes, the output by 8.7e-3 of its max (W8A16: 6.5e-4, its fp16
    # output rounding). The GPU TP test's tolerance for fp8-tensor-static rests on this.
    gen = torch.Generator().manual_seed(0)
    fq = quantize_rtn(torch.randn(768, 384, generator=gen) * 0.05, "tensor", input_scale=0.02)  # TinyBlock's gate_up
    x = (torch.randn(12, 384, generator=gen) * 2).half()
    x_up = torch.nextafter(x, torch.full_like(x, float("inf")))
    codes, codes_up = (quantize_fp8_activations(v, fq.input_scale)[0].float() for v in (x, x_up))
    assert 0.005 < (codes != codes_up).float().mean() < 0.02

    def moved(activations):
        w = prepare_fp8_weight(fq, dtype=torch.float16, activations=activations)
        y, y_up = w.mm(x).float(), w.mm(x_up).float()
        return ((y_up - y).abs().max() / y.abs().max()).item()

    static, weight_only = moved("static"), moved("none")
    assert weight_only < 1.5e-3 and static > 5e-3 and static > 8 * weight_only, (static, weight_only)


# fp8-block checkpoints carry no static input_scale (FORMATS.md): dynamic only.
@pytest.mark.parametrize("case,activations", [("fp8-channel", "dynamic"), ("fp8-channel", "static"), ("ct-block", "dynamic"),
                                              ("ct-block", "static"), ("block128", "dynamic")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mm_fp8_end_to_end(case, activations, dtype):
    w, c = weight_of(case, activations=activations, dtype=dtype, input_scale=4.0 / 448)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    for m in MS:
        x = _x(m, k, dtype, m, transposed=m == 3)
        bias = torch.randn(n).to(dtype)
        y = w.mm(x, bias)
        x_fp8, x_scale = quantize_fp8_activations(x, w.input_scale if activations == "static" else None, w.x_group_size)
        # The composition exactly, and the math within the activations' fp8 rounding (<= 2**-4 each).
        assert torch.equal(y, torch.ops.qops.scaled_mm_fp8(x_fp8, x_scale, w.weight, w.weight_scale, bias, w.block_n, w.block_k, dtype, int(w.kernel)))
        assert rel_err(y, oracle_mm(oracle_x(x_fp8, x_scale), want_w, bias)) <= TOL[dtype]
        check_fp8_mm(y, w, want_w, x, bias, TOL[dtype], f"M={m}")
        assert rel_err(y, oracle_mm(x, want_w, bias)) <= 0.05


def _quantize_with(x, scales):
    """``x`` as e4m3 codes for the given per-token (``(M, 1)``) or per-group scales: x / scale in fp32,
    saturated, rounded by torch's cast."""
    s_k = scales if scales.shape[-1] == 1 else scales.repeat_interleave(128, -1)[:, : x.shape[-1]]
    return (x.float() / s_k).clamp(-448, 448).to(FP8)


def _w8a8_with_scales(w, x, bias, scales, dtype):
    """W8A8 of ``x`` quantized with the given scales, through the op's reference GEMM."""
    return torch.ops.qops.scaled_mm_fp8(_quantize_with(x, scales), scales, w.weight, w.weight_scale, bias, w.block_n, w.block_k,
                                        dtype, int(w.kernel))


def _amax(x, group_size):
    xf = x.float()
    if group_size == -1:
        return xf.abs().amax(-1, keepdim=True)
    groups = -(-x.shape[-1] // group_size)
    return torch.nn.functional.pad(xf, (0, groups * group_size - x.shape[-1])).unflatten(-1, (groups, group_size)).abs().amax(-1)


@pytest.mark.parametrize("case", ["fp8-channel", "block128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_w8a8_check_takes_scales_computed_another_way_and_catches_one_wrong_element(case, dtype):
    """Scales computed as ``amax / 448`` (as CUDA computed them differently from the CPU before qops
    multiplied by fp32(1/448) on both) are an ulp off the op's in most rows, and the ties of x / scale
    round the other way. Quantized so, W8A8 flips codes against the oracle's, past the plain
    elementwise bound; ``check_fp8_mm`` allows the tied codes and the scale's ulp (what a device's or a
    compiler's own division of x / scale may do), and still fails one output just past its bound."""
    w, c = weight_of(case, activations="dynamic", dtype=dtype)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    x = _x(257, k, dtype, 3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
    amax = _amax(x, w.x_group_size)
    other_scales = amax / 448
    assert not torch.equal(other_scales, amax * torch.tensor(1 / 448, dtype=torch.float32))
    y = _w8a8_with_scales(w, x, bias, other_scales, dtype)
    x64, tie = independent_fp8_x(x, None, w.x_group_size)
    assert torch.equal(oracle_x(*quantize_fp8_activations(x, None, w.x_group_size)), x64), "on the CPU the op quantizes as the oracle does"
    # Every code the other scales move (beyond the scale's own ulp) is a tie the oracle marked.
    moved = (oracle_x(_quantize_with(x, other_scales), other_scales) - x64).abs() > SCALE_SLACK * x64.abs()
    assert bool(moved.any()) and bool((tie[moved] > 0).all()), (int(moved.sum()), int((tie[moved] == 0).sum()))
    want = oracle_mm(x64, want_w, bias)
    plain = (y.double() - want).abs() / elementwise_bound(x64, want_w, bias, dtype)
    assert float(plain.max()) > 1, "the case shows nothing: no tie moved an output past the plain bound"
    check_fp8_mm(y, w, want_w, x, bias, TOL[dtype], "scales computed another way")
    # One output off by 1.5x its plain bound (under the relative-norm tolerance): caught.
    r, col = divmod(int(want.abs().reshape(-1).argmax()), n)
    bad = y.clone()
    bad[r, col] = want[r, col] + 1.5 * elementwise_bound(x64[r:r + 1], want_w[col:col + 1], bias[col:col + 1], dtype)[0, 0]
    assert rel_err(bad, want) <= TOL[dtype]
    with pytest.raises(AssertionError, match=f"1 of {257 * n} elements past the elementwise bound"):
        check_fp8_mm(bad, w, want_w, x, bias, TOL[dtype], "one wrong")


@pytest.mark.parametrize("case,dtype", [("fp8-channel", torch.float16), ("fp8-channel", torch.bfloat16), ("block128", torch.bfloat16)],
                         ids=str)
def test_stale_activation_scales_fail_the_replay_check(case, dtype):
    """What tests/gpu/test_gpu_fp8.py's graph replays check, on the reference kernel: x = relu(z) * 2
    captured at randn's magnitude, replayed on rows 10^-2 .. 10^2 as large. Quantized with the
    captured input's dynamic scales (a graph that kept them), the output fails check_fp8_mm for every
    M and row pattern the GPU test replays; quantized with its own, it passes."""
    w, c = weight_of(case, activations="dynamic", dtype=dtype)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    for m in (1, 7, 64):
        captured = torch.relu(_x(m, k, dtype, m)) * 2
        stale = quantize_fp8_activations(captured, None, w.x_group_size)[1]
        for shift in (4, 0):
            x = torch.relu((_x(m, k, torch.float32, 100 + m) * row_magnitudes(m, shift)).to(dtype)) * 2
            check_fp8_mm(w.mm(x, bias), w, want_w, x, bias, TOL[dtype], f"M={m} shift={shift}")
            with pytest.raises(AssertionError, match="relative error|elementwise bound"):
                check_fp8_mm(_w8a8_with_scales(w, x, bias, stale, dtype), w, want_w, x, bias, TOL[dtype], "stale")


@pytest.mark.parametrize("case", sorted(WEIGHTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_hot_activations_return_the_dequantized_weight(case, dtype):
    w, c = weight_of(case, dtype=dtype)
    want = oracle_weight(WEIGHTS[case][0], c).float().to(dtype)
    eye = torch.eye(w.in_features, dtype=dtype)
    assert torch.equal(w.mm(eye), want.t())
    if WEIGHTS[case][0] != "fp8-block":
        # W8A8 with a static scale of 1: one-hot rows quantize to exactly 1.
        w8, _ = weight_of(case, activations="static", dtype=dtype, input_scale=1.0)
        assert torch.equal(w8.mm(eye), want.t())


@pytest.mark.parametrize("activations", ["none", "dynamic", "static"])
def test_gradients_use_the_dequantized_weight(activations):
    w, c = weight_of("ct-block", activations=activations, input_scale=4.0 / 448)
    want_w = oracle_weight("compressed-tensors-fp8", c)
    n, k = want_w.shape
    for x in (torch.randn(5, k), torch.randn(k, 3).t(), torch.randn(0, k), torch.randn(2, 2, k)):
        x.requires_grad_()
        bias = torch.randn(n, requires_grad=True)
        y = w.mm(x, bias)
        grad = torch.randn_like(y)
        y.backward(grad)
        # Straight through the activation rounding: dy/dx is the dequantized weight, never fp8.
        assert x.grad.dtype == x.dtype
        assert rel_err(x.grad, grad.double() @ want_w) <= 1e-5
        assert torch.allclose(bias.grad, grad.reshape(-1, n).sum(0), atol=1e-5)


def test_half_precision_gradients_keep_their_dtype():
    w, c = weight_of("fp8-channel", dtype=torch.bfloat16)
    x = torch.randn(3, 200, dtype=torch.bfloat16, requires_grad=True)
    w.mm(x).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    want = oracle_weight("fp8", c).sum(0)
    assert rel_err(x.grad[0], want) <= TOL[torch.bfloat16]


# ---- the chooser ------------------------------------------------------------------------------


def _spec(**kw) -> WeightSpec:
    base = dict(family="fp8", format="fp8", bits=8, group_size=-1, n=4096, k=4096, act_order=False,
                symmetric=True, device=torch.device("cuda"), act_dtype=FP8)
    base.update(kw)
    return WeightSpec(**base)


def test_lowerings_state_why_they_refuse():
    smm, tri, ref = (LOWERINGS_BY_NAME[n] for n in ("scaled_mm_fp8", "triton_fp8", "reference_fp8"))
    assert smm.static_refusal(_spec()) is None
    assert "N=72 is not a multiple of 16" in smm.static_refusal(_spec(n=72))
    assert "K=200 is not a multiple of 16" in smm.static_refusal(_spec(k=200))
    assert "recipe takes 128 x 128 weight blocks, not -1 x 128" in smm.static_refusal(_spec(group_size=128))
    assert smm.static_refusal(_spec(group_size=128, block_n=128, out_dtype=torch.bfloat16)) is None
    assert "group_size=64 not in [-1, 128]" in smm.static_refusal(_spec(group_size=64, block_n=128))
    assert "activation dtype torch.float16" in smm.static_refusal(_spec(act_dtype=torch.float16))
    assert smm.min_capability == (8, 9) and tri.min_capability == (8, 0)
    assert tri.static_refusal(_spec(group_size=128, n=72, k=200)) is None
    assert tri.static_refusal(_spec(act_dtype=torch.bfloat16)) is None
    assert "group_size=48" in tri.static_refusal(_spec(group_size=48))
    assert ref.static_refusal(_spec(group_size=48, act_dtype=torch.float16)) is None
    assert "runs on ['cuda'], not cpu" in smm.device_refusal(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert smm.device_refusal(torch.device("cuda")) == "no CUDA device is available"


def _block_spec(**kw) -> WeightSpec:
    base = dict(group_size=128, block_n=128, n=4096, k=7168, out_dtype=torch.bfloat16)
    base.update(kw)
    return _spec(**base)


@pytest.mark.parametrize("cap", [(9, 0), (10, 0), (8, 9)])
def test_chooser_takes_the_cublas_block_recipe_on_sm90_only(monkeypatch, cap):
    """On a pretend GPU of each compute capability (no CUDA here): 128 x 128 blocks go to the
    scaled_mm lowering on 9.x only, and the refusal says why elsewhere."""
    from qops import lowerings

    monkeypatch.setattr(lowerings, "_cuda_capability", lambda device: cap)
    smm = LOWERINGS_BY_NAME["scaled_mm_fp8"]
    if cap[0] == 9:
        assert smm.refusal(_block_spec()) is None
        assert choose(_block_spec()).lowering.name == "scaled_mm_fp8"
    else:
        assert smm.refusal(_block_spec()) == f"F.scaled_mm's BlockWise1x128 x BlockWise128x128 recipe needs compute capability 9.x, device has {cap}"
        assert "refused scaled_mm_fp8: F.scaled_mm's" in choose(_block_spec()).explain()
    # Tensor- and channel-wise weights keep the torch._scaled_mm path on every FP8 GPU.
    assert smm.refusal(_spec()) is None


def test_chooser_explains_every_block_recipe_refusal(monkeypatch):
    from qops import lowerings

    monkeypatch.setattr(lowerings, "_cuda_capability", lambda device: (9, 0))
    smm = LOWERINGS_BY_NAME["scaled_mm_fp8"]
    recipe = "F.scaled_mm's BlockWise1x128 x BlockWise128x128 recipe"
    assert smm.refusal(_block_spec(out_dtype=torch.float32)) == (
        f"{recipe} writes ['torch.bfloat16', 'torch.float16'], not torch.float32 "
        "(fp32 output of cuBLASLt's block-scaled FP8 GEMM is not verified here)")
    assert smm.refusal(_block_spec(n=4000)) == f"{recipe} needs N a multiple of 128, got N=4000"
    assert smm.refusal(_block_spec(k=7200)) == f"{recipe} needs K a multiple of 128, got K=7200"
    assert smm.refusal(_block_spec(block_n=64)) == f"{recipe} takes 128 x 128 weight blocks, not 64 x 128"
    assert smm.refusal(_block_spec(n=72)) == "N=72 is not a multiple of 16"
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")
    assert "has no torch.nn.functional.scaled_mm" in smm.refusal(_block_spec())
    assert smm.refusal(_spec()) is None  # torch._scaled_mm needs none of it
    # The Triton lowering serves the same weights with per-token activation scales (declared).
    tri = LOWERINGS_BY_NAME["triton_fp8"]
    assert tri.static_refusal(_block_spec()) is None and tri.x_scales == frozenset({"tensor", "token"})
    assert LOWERINGS_BY_NAME["reference_fp8"].x_scales == frozenset({"tensor", "token", "group"})


def test_prepare_on_cpu_explains_the_choice():
    w, c = weight_of("fp8-channel", activations="auto")
    assert w.activations == "none" and w.kernel == Kernel.REFERENCE
    text = w.choice.explain()
    assert text.startswith("chose reference_fp8")
    assert "refused triton_fp8: runs on ['cuda'], not cpu" in text
    assert "refused W8A8 (fp8 activations): no native FP8 GEMM serves it (scaled_mm_fp8: " in text
    # The checkpoint's weight is used as is: no copy, nothing beyond the checkpoint's bytes.
    assert w.weight.data_ptr() == c.weight.data_ptr()
    assert w.nbytes() <= 1.02 * (c.weight.numel() + 4 * c.weight_scale.numel())


def test_prepare_activation_modes(monkeypatch):
    fq = quantize_rtn(torch.randn(64, 32), "tensor", input_scale=0.01)
    assert prepare_fp8_weight(fq, activations="static").activations == "static"
    w = prepare_fp8_weight(fq, activations="dynamic")
    assert w.activations == "dynamic" and w.input_scale is not None
    with pytest.raises(ValueError, match="activations must be one of"):
        prepare_fp8_weight(fq, activations="fp8")
    with pytest.raises(ValueError, match="needs a checkpoint input_scale"):
        prepare_fp8_weight(quantize_rtn(torch.randn(64, 32)), activations="static")
    monkeypatch.setenv(DISABLE_ENV, "reference_fp8")
    with pytest.raises(RuntimeError, match="reference_fp8: disabled by QOPS_DISABLE_LOWERINGS"):
        prepare_fp8_weight(fq, activations="none")


def test_prepare_stores_row_blocks_spanning_k_per_channel():
    fq = quantize_rtn(torch.randn(10, 8), "block", (4, 8))  # blocks 4 x 8 over K = 8: one column
    w = prepare_fp8_weight(dataclasses.replace(fq, block_k=-1))
    assert (w.block_n, w.block_k) == (1, -1) and tuple(w.weight_scale.shape) == (10, 1)
    assert torch.equal(w.dequantize(), fq.dequantize())


# ---- errors name the argument, eagerly and under fake tensors ----------------------------------


def _mm_args(w, **changes) -> dict:
    args = dict(x=torch.randn(3, w.in_features), weight=w.weight, weight_scale=w.weight_scale,
                bias=torch.randn(w.out_features), block_n=w.block_n, block_k=w.block_k, kernel=int(w.kernel))
    args.update(changes)
    return args


def _mm_out_args(w, **changes) -> dict:
    args = _mm_args(w)
    args.update(out=torch.empty(3, w.out_features), workspace=torch.empty(64, dtype=torch.uint8))
    args.update(changes)
    return args


def _smm_args(w, **changes) -> dict:
    x_fp8, x_scale = quantize_fp8_activations(torch.randn(3, w.in_features))
    args = dict(x_fp8=x_fp8, x_scale=x_scale, weight=w.weight, weight_scale=w.weight_scale,
                bias=torch.randn(w.out_features), block_n=w.block_n, block_k=w.block_k,
                out_dtype=torch.float16, kernel=int(w.kernel))
    args.update(changes)
    return args


def _bad_inputs():
    w, _ = weight_of("ct-block")  # N=72, K=200, blocks 32 x 64: weight_scale (3, 4)
    k = w.in_features
    mm, smm, dq = torch.ops.qops.mm_fp8_weight, torch.ops.qops.scaled_mm_fp8, torch.ops.qops.dequantize_fp8
    mmo = torch.ops.qops.mm_fp8_weight_out
    return {
        "x-dtype": (mm, _mm_args(w, x=torch.ones(3, k, dtype=torch.int32)), r"x must be float32, float16 or bfloat16"),
        "x-fp8": (mm, _mm_args(w, x=torch.ones(3, k).to(FP8)), r"x must be float32"),
        "weight-dtype": (mm, _mm_args(w, weight=w.weight.float()), r"weight must be torch\.float8_e4m3fn"),
        "weight-1d": (mm, _mm_args(w, weight=w.weight.reshape(-1)), r"weight must be 2-D"),
        "weight-k": (mm, _mm_args(w, x=torch.randn(3, k + 1)), r"weight must have K=201 columns"),
        "scale-dtype": (mm, _mm_args(w, weight_scale=w.weight_scale.half()), r"weight_scale must be torch\.float32"),
        "scale-shape": (mm, _mm_args(w, weight_scale=w.weight_scale[:, :3]), r"weight_scale must have shape \(3, 4\)"),
        "block-n": (mm, _mm_args(w, block_n=0), r"block_n must be -1 .* or positive, got 0"),
        "block-k": (mm, _mm_args(w, block_k=-2), r"block_k must be -1 .* or positive, got -2"),
        "block-mismatch": (mm, _mm_args(w, block_k=128), r"weight_scale must have shape \(3, 2\)"),
        "bias-shape": (mm, _mm_args(w, bias=torch.randn(71)), r"bias must have shape \(72,\)"),
        "bias-dtype": (mm, _mm_args(w, bias=torch.ones(72, dtype=torch.int64)), r"bias must be float32"),
        "bias-device": (mm, _mm_args(w, bias=torch.randn(72, device="meta")), r"bias must be on cpu"),
        "kernel-unknown": (mm, _mm_args(w, kernel=7), r"kernel must be one of \[0, 1, 3\] for fp8, got 7"),
        "kernel-device": (mm, _mm_args(w, kernel=1), r"kernel=1 \(triton_fp8\) runs on \['cuda'\]"),
        "out-weight-dtype": (mmo, _mm_out_args(w, weight=w.weight.float()), r"weight must be torch\.float8_e4m3fn"),
        "out-scale-shape": (mmo, _mm_out_args(w, weight_scale=w.weight_scale[:, :3]), r"weight_scale must have shape \(3, 4\)"),
        "out-kernel-device": (mmo, _mm_out_args(w, kernel=1), r"kernel=1 \(triton_fp8\) runs on \['cuda'\]"),
        "out-out-dtype": (mmo, _mm_out_args(w, out=torch.empty(3, 72, dtype=torch.float16)), r"out must have the dtype of x \(torch.float32\), got torch.float16"),
        "out-out-shape": (mmo, _mm_out_args(w, out=torch.empty(3, 71)), r"out must have shape \(3, 72\), got \(3, 71\)"),
        "out-out-device": (mmo, _mm_out_args(w, out=torch.empty(3, 72, device="meta")), r"out must be on cpu \(the device of x\), got meta"),
        "x_fp8-dtype": (smm, _smm_args(w, x_fp8=torch.randn(3, k)), r"x_fp8 must be torch\.float8_e4m3fn"),
        "x_scale-shape": (smm, _smm_args(w, x_scale=torch.ones(3, 3)),
                          r"x_scale must have shape \(1,\) \(per tensor\), \(3, 1\) \(per token\) or \(3, 2\) \(per token and group of 128 K values, K=200\), got \(3, 3\)"),
        "x_scale-lead": (smm, _smm_args(w, x_scale=torch.ones(2, 2)), r"x_scale must have shape .* got \(2, 2\)"),
        "x_scale-3d": (smm, _smm_args(w, x_scale=torch.ones(3, 2, 1)), r"x_scale must have shape .* got \(3, 2, 1\)"),
        "x_scale-tensor": (smm, _smm_args(w, x_scale=torch.ones(2)), r"x_scale must have shape"),
        "x_scale-dtype": (smm, _smm_args(w, x_scale=torch.ones(3, 1, dtype=torch.float16)), r"x_scale must be torch\.float32"),
        "out_dtype": (smm, _smm_args(w, out_dtype=torch.int32), r"out_dtype must be float32"),
        "smm-weight-k": (smm, _smm_args(w, weight=w.weight[:, :100].contiguous()), r"weight must have K=200"),
        "smm-kernel-device": (smm, _smm_args(w, kernel=3), r"kernel=3 \(scaled_mm_fp8\) runs on \['cuda'\]"),
        "dq-scale": (dq, dict(weight=w.weight, weight_scale=w.weight_scale.t(), block_n=32, block_k=64, dtype=torch.float32), r"weight_scale must have shape \(3, 4\)"),
        "dq-dtype": (dq, dict(weight=w.weight, weight_scale=w.weight_scale, block_n=32, block_k=64, dtype=torch.int8), r"dtype must be one of .*got torch.int8"),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("mode", ["eager", "fake"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_errors_name_the_argument(name, mode):
    op, args, pattern = BAD[name]
    values = list(args.values())
    with pytest.raises((TypeError, ValueError)) as info:
        if mode == "eager":
            op(*values)
        else:
            with FakeTensorMode() as m:
                op(*[m.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values])
    assert re.search(pattern, str(info.value)), str(info.value)
    assert str(info.value).startswith(f"qops.{op._qualified_op_name.split('::')[1]}:"), str(info.value)


def test_meta_tensors_infer_shapes():
    """Real "meta" tensors (a model built on the meta device) run the fake kernel, as the other
    families' ops do: shapes, no device refusal."""
    w, _ = weight_of("fp8-channel")
    meta = torch.device("meta")
    y = torch.ops.qops.mm_fp8_weight(torch.randn(3, w.in_features, device=meta), w.weight.to(meta), w.weight_scale.to(meta),
                                     None, w.block_n, w.block_k, 0)
    assert y.device == meta and tuple(y.shape) == (3, w.out_features)
    d = torch.ops.qops.dequantize_fp8(w.weight.to(meta), w.weight_scale.to(meta), w.block_n, w.block_k, torch.float16)
    assert d.device == meta and tuple(d.shape) == (w.out_features, w.in_features)


def test_kernel_ids_check_the_activation_dtype():
    # Kernel 3 (torch._scaled_mm) reads fp8 activations only: qops::mm_fp8_weight cannot take it.
    with pytest.raises(ValueError, match=r"kernel=3 \(scaled_mm_fp8\) reads \['torch.float8_e4m3fn'\] activations, not torch.float16"):
        check_kernel("mm_fp8_weight", 3, torch.device("cuda"), torch.float16)
    check_kernel("scaled_mm_fp8", 3, torch.device("cuda"), FP8)
    check_kernel("mm_fp8_weight", 1, torch.device("cuda"), torch.bfloat16)


# ---- Triton kernels under the interpreter -----------------------------------------------------


TRITON_WEIGHTS = {"tensor": "fp8-tensor", "channel": "fp8-channel", "block": "ct-block", "block128": "block128"}
# (path, M, config override): gemv, gemv with split-K forced, gemm.
TRITON_PATHS = {
    "gemv-m1": (1, None),
    "gemv-m3-splitk": (3, dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4)),
    "gemm-m17": (17, None),
    "gemm-m257": (257, None),  # past every M tile and bucket edge
}
# (activations, x dtype, native fp8 conversion)
TRITON_VARIANTS = {
    "w8a16-fp16-bits": ("none", torch.float16, False),
    "w8a16-fp32-native": ("none", torch.float32, True),
    "w8a8-fp16-native": ("dynamic", torch.float16, True),
    "w8a8-fp32-bits": ("dynamic", torch.float32, False),
    "w8a16-bf16-bits": ("none", torch.bfloat16, False),
    "w8a16-bf16-native": ("none", torch.bfloat16, True),
    "w8a8-bf16-native": ("dynamic", torch.bfloat16, True),
}


# The granularities and variants the Triton kernels serve: 128 x 128 weight blocks (block128) quantize x
# in 1 x 128 groups for W8A8, which the Triton kernel refuses (cuBLAS's block recipe serves it), so
# block128 runs weight-only.
# W8A16 in bf16 runs the GEMVs only here: their bf16 x is converted to fp32 on load, while the GEMM's
# tl.dot takes bf16 operands, which the interpreter multiplies wrongly (~1e9 off on a plain 16x32x16
# dot, Triton 3.9); the GPU suite checks that GEMM in bf16. W8A8's GEMM dots fp8 operands.
TRITON_GRAN_VARIANTS = [(g, v) for g in ("tensor", "channel", "block", "block128") for v in sorted(TRITON_VARIANTS)
                        if g != "block128" or TRITON_VARIANTS[v][0] == "none"]
TRITON_CASES = [(g, v, p) for g, v in TRITON_GRAN_VARIANTS for p in sorted(TRITON_PATHS)
                if not (TRITON_VARIANTS[v][:2] == ("none", torch.bfloat16) and p.startswith("gemm"))]


@pytest.mark.interpreter
@pytest.mark.parametrize("gran,variant,path", TRITON_CASES)
def test_triton_kernels_match_oracle(gran, path, variant):
    from qops.ops.triton.fp8 import triton_mm

    case = TRITON_WEIGHTS[gran]
    activations, dtype, native = TRITON_VARIANTS[variant]
    m, config = TRITON_PATHS[path]
    w, c = weight_of(case, activations=activations, dtype=dtype)
    want_w = oracle_weight(WEIGHTS[case][0], c)
    n, k = want_w.shape
    x = _x(m, k, dtype, 11, transposed=path.startswith("gemm"))
    bias = torch.randn(n).to(dtype) if path != "gemv-m1" else None
    if activations == "none":
        y = triton_mm(x, None, w.weight, w.weight_scale, bias, w.block_n, w.block_k, dtype, native_fp8=native, config=config)
        want = oracle_mm(x, want_w, bias)
    else:
        x_fp8, x_scale = quantize_fp8_activations(x)
        y = triton_mm(x_fp8, x_scale, w.weight, w.weight_scale, bias, w.block_n, w.block_k, dtype, native_fp8=native, config=config)
        want = oracle_mm(oracle_x(x_fp8, x_scale), want_w, bias)
    assert y.dtype == dtype and tuple(y.shape) == (m, n)
    assert rel_err(y, want) <= TOL[dtype]
    check_fp8_mm(y, w, want_w, x, bias, TOL[dtype], f"{gran} {path} {variant}")


@pytest.mark.interpreter
@pytest.mark.parametrize("path", sorted(TRITON_PATHS))
def test_triton_bias_with_any_strides(path):
    """The op accepts a bias with any strides; the kernels read it with unit stride, so the entry makes
    it contiguous (read as if contiguous it was off by ~600x)."""
    from qops.ops.triton.fp8 import triton_mm

    w, c = weight_of(TRITON_WEIGHTS["channel"], dtype=torch.float16)
    want_w = oracle_weight(WEIGHTS[TRITON_WEIGHTS["channel"]][0], c)
    n, k = want_w.shape
    m, config = TRITON_PATHS[path]
    x = _x(m, k, torch.float16, 12)
    bias = torch.randn(n).to(torch.float16)
    y = triton_mm(x, None, w.weight, w.weight_scale, stride_two(bias), w.block_n, w.block_k, torch.float16, config=config)
    assert rel_err(y, oracle_mm(x, want_w, bias)) <= TOL[torch.float16]


@pytest.mark.interpreter
@pytest.mark.parametrize("native", [False, True], ids=["bits", "native"])
@pytest.mark.parametrize("gran", ["channel", "block128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_one_hot_is_exact(gran, dtype, native):
    from qops.ops.triton.fp8 import triton_mm

    case = TRITON_WEIGHTS[gran]
    w, c = weight_of(case, dtype=dtype)
    want = oracle_weight(WEIGHTS[case][0], c).float().to(dtype)
    k = w.in_features
    for rows in (torch.eye(k, dtype=dtype)[:3], torch.eye(k, dtype=dtype)[:64]):  # gemv, gemm
        y = triton_mm(rows, None, w.weight, w.weight_scale, None, w.block_n, w.block_k, dtype, native_fp8=native)
        assert torch.equal(y, want.t()[: rows.shape[0]])


@pytest.mark.parametrize("gpu_pdl", [True, False])
def test_triton_split_k_is_chained_where_the_gpu_has_pdl(gpu_pdl, monkeypatch):
    """The split GEMV with its kernels replaced by recorders (the interpreter has no grid dependencies): on a GPU
    with PDL the fp32 sum is zeroed by ``zero_ahead``, the GEMV is its programmatic dependent and the one cast
    launch is the GEMV's; elsewhere ``zero_()`` and plain launches."""
    from qops.ops.triton import common as tc
    from qops.ops.triton import fp8 as tf8

    launches, zeroed = [], []

    monkeypatch.setattr(tf8, "_fp8_gemv_kernel", KernelRecorder("gemv", launches))
    monkeypatch.setattr(tc, "_reduce_kernel", KernelRecorder("reduce", launches))
    monkeypatch.setattr(tc, "zero_ahead", lambda buf: zeroed.append((tuple(buf.shape), buf.dtype)))
    monkeypatch.setattr(tc, "pdl_launch", lambda device: gpu_pdl)
    w, _ = weight_of("ct-block")  # N=72, K=200
    x = _x(3, 200, torch.float16, 13)
    config = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4)
    tf8.triton_mm(x, None, w.weight, w.weight_scale, torch.randn(72).half(), w.block_n, w.block_k, torch.float16,
                  config=config)
    assert [name for name, _ in launches] == ["gemv", "reduce"]
    gemv, reduce = launches[0][1], launches[1][1]
    assert gemv["ATOMIC"] and not reduce["HAS_BIAS"]  # split 0 adds the bias into the sum
    for kw in (gemv, reduce):
        assert (kw.get("PDL") is True and kw.get("launch_pdl") is True) == gpu_pdl, kw
    assert zeroed == ([((3, 72), torch.float32)] if gpu_pdl else [])


@pytest.mark.interpreter
@pytest.mark.parametrize("view", ["2d", "3d", "strided"])
def test_triton_takes_the_split_k_accumulator_from_the_workspace(view):
    from qops.ops.triton.fp8 import triton_mm, workspace_bytes

    w, c = weight_of("ct-block")  # N=72, K=200
    want_w = oracle_weight("compressed-tensors-fp8", c)
    n, k = want_w.shape
    m = 3
    config = dict(BLOCK_M=4, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4)
    x = _x(m, k, torch.float16, 12)
    bias = torch.randn(n).half()
    workspace = torch.full((4 * m * n + 5,), 255, dtype=torch.uint8)  # garbage: must not matter
    wide = torch.full((m, 2 * n), float("nan"), dtype=torch.float16)
    out = {"2d": torch.full((m, n), float("nan"), dtype=torch.float16), "3d": torch.full((1, m, n), float("nan"), dtype=torch.float16),
           "strided": wide[:, ::2]}[view]  # the view taken in fp16: a .half() of it would be a contiguous copy
    assert view != "strided" or out.stride() == (2 * n, 2)
    xv = x.reshape(1, m, k) if view == "3d" else x
    ret = triton_mm(xv, None, w.weight, w.weight_scale, bias, w.block_n, w.block_k, torch.float16, out, workspace, config=config)
    assert ret is out and rel_err(out.reshape(m, n), oracle_mm(x, want_w, bias)) <= TOL[torch.float16]
    assert view != "strided" or bool(wide[:, 1::2].isnan().all()), "wrote outside out"
    # The accumulator lived in the workspace: its first 4*M*N bytes hold the fp32 result.
    acc = workspace[: 4 * m * n].view(torch.float32).view(m, n)
    assert rel_err(acc, oracle_mm(x, want_w, bias)) <= TOL[torch.float16]
    # Too small: the lowering allocates its own and leaves the workspace alone.
    small = torch.full((4 * m * n - 1,), 7, dtype=torch.uint8)
    triton_mm(x, None, w.weight, w.weight_scale, None, w.block_n, w.block_k, torch.float16, None, small, config=config)
    assert bool((small == 7).all())
    # The size function: 4*M*N exactly when the GEMV splits K (N=8 one-row programs leave the
    # interpreter's pretend 4 SMs, 4 programs each, half idle).
    assert workspace_bytes(2, 8, 8192, -1, torch.device("cpu")) == 4 * 2 * 8
    assert workspace_bytes(1, 4096, 64, -1, torch.device("cpu")) == 0
    assert workspace_bytes(5, 16, 8192, -1, torch.device("cpu")) == 0  # the GEMM never splits K
    assert workspace_bytes(0, 16, 8192, -1, torch.device("cpu")) == 0


@pytest.mark.interpreter
def test_triton_edge_shapes():
    from qops.ops.triton.fp8 import triton_mm

    w, c = weight_of("ct-channel")  # N=40, K=24
    want_w = oracle_weight("compressed-tensors-fp8", c)
    assert tuple(triton_mm(torch.randn(0, 24), None, w.weight, w.weight_scale, None, w.block_n, w.block_k, torch.float16).shape) == (0, 40)
    x = torch.randn(2, 3, 24)
    y = triton_mm(x, None, w.weight, w.weight_scale, None, w.block_n, w.block_k, torch.float32)
    assert tuple(y.shape) == (2, 3, 40) and rel_err(y, oracle_mm(x, want_w)) <= TOL[torch.float32]
    with pytest.raises(ValueError, match="block_k must be -1 or a power of two >= 32"):
        triton_mm(x, None, w.weight, torch.ones(40, 2), None, 1, 16, torch.float32)


def test_triton_configs_fit_the_shapes():
    from qops.ops.triton.fp8 import GEMV_MAX_M, gemm_config, gemv_config

    # M=1 on the large shapes: enough programs without split-K; small N is split along K.
    for n, k in ((28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)):
        cfg = gemv_config(1, n, k, -1, 132)
        assert cfg["SPLIT_K"] == 1 and -(-n // cfg["BLOCK_N"]) >= 4 * 132
        # the measured best (h200 fp8 sweep 2): one row of 2048 weight bytes per step, 2 warps
        assert cfg["BLOCK_K"] == 2048 and cfg["BLOCK_N"] == 1 and cfg["num_warps"] == 2
    assert gemv_config(1, 72, 8192, -1, 132)["SPLIT_K"] > 1
    assert gemv_config(GEMV_MAX_M, 4096, 4096, 128, 132)["BLOCK_K"] <= 128
    assert gemm_config(2048, 4096, 4096, -1, 132)["BLOCK_M"] == 128
    assert gemm_config(16, 4096, 4096, 128, 132)["BLOCK_K"] == 128


def test_triton_gemv_does_not_split_k_when_determinism_is_requested(monkeypatch):
    """Split-K partial sums meet through atomic adds, whose order varies: a deterministic request
    (QOPS_DETERMINISTIC=1 or torch's switch) keeps the gemv to one split and its workspace to 0."""
    from qops.ops.triton.fp8 import gemv_config, workspace_bytes

    cpu = torch.device("cpu")
    monkeypatch.delenv("QOPS_DETERMINISTIC", raising=False)
    assert gemv_config(1, 256, 8192, -1, 132)["SPLIT_K"] > 1
    assert workspace_bytes(2, 8, 8192, -1, cpu) == 4 * 2 * 8
    monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
    assert gemv_config(1, 256, 8192, -1, 132)["SPLIT_K"] == 1
    assert workspace_bytes(2, 8, 8192, -1, cpu) == 0
    monkeypatch.delenv("QOPS_DETERMINISTIC")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert gemv_config(1, 256, 8192, -1, 132)["SPLIT_K"] == 1
        assert workspace_bytes(2, 8, 8192, -1, cpu) == 0
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.interpreter
def test_triton_gemv_without_split_k_when_determinism_is_requested(monkeypatch):
    """With 132 SMs the 72-row, 4-step gemv splits K in two through the workspace; under a
    deterministic request it runs one split, gives the oracle's result and leaves the workspace alone."""
    from qops.ops.triton import fp8 as F

    monkeypatch.setattr(F, "sm_count", lambda device, interpreter: 132)
    w, c = weight_of("ct-block")  # N=72, K=200, 64-wide K blocks: 4 steps
    want_w = oracle_weight("compressed-tensors-fp8", c)
    x = _x(2, want_w.shape[1], torch.float16, 13)
    for deterministic in (False, True):
        monkeypatch.setenv("QOPS_DETERMINISTIC", "1" if deterministic else "0")
        workspace = torch.full((4 * 2 * 72,), 7, dtype=torch.uint8)
        y = F.triton_mm(x, None, w.weight, w.weight_scale, None, w.block_n, w.block_k, torch.float16, None, workspace)
        assert rel_err(y, oracle_mm(x, want_w, None)) <= TOL[torch.float16]
        assert bool((workspace == 7).all()) == deterministic
        assert F.workspace_bytes(2, 72, 200, w.block_k, torch.device("cpu")) == (0 if deterministic else 4 * 2 * 72)


@pytest.mark.parametrize("n,k,block,x_scale,out_dtype,what", [
    (40, 64, (-1, -1), (1,), torch.float16, r"N=40 is not a multiple of 16"),
    (48, 72, (1, -1), (1,), torch.float16, r"K=72 is not a multiple of 16"),
    (48, 64, (16, 32), (1,), torch.float16, r"group_size=32 not in \[-1, 128\]"),
    (48, 256, (1, -1), (4, 2), torch.float16, r"group activation scales not in \['tensor', 'token'\]"),
    (208, 256, (128, 128), (4, 2), torch.float16, r"F.scaled_mm's BlockWise1x128 x BlockWise128x128 recipe needs N a multiple of 128, got N=208"),
    (256, 320, (128, 128), (4, 3), torch.bfloat16, r"recipe needs K a multiple of 128, got K=320"),
    (256, 256, (64, 128), (4, 2), torch.bfloat16, r"recipe takes 128 x 128 weight blocks, not 64 x 128"),
    (256, 256, (128, 128), (4, 2), torch.float32, r"recipe writes \['torch.bfloat16', 'torch.float16'\], not torch.float32"),
])
def test_scaled_mm_kernel_refuses_what_cublaslt_cannot_run_under_fake_cuda_tensors(n, k, block, x_scale, out_dtype, what):
    """Asked for directly, kernel 3 (cuBLASLt) names the declared limit it does not meet, at trace
    time, instead of failing inside cuBLASLt (the chooser never picks it for these weights)."""
    block_n, block_k = block
    s_n = 1 if block_n == -1 else (n if block_n == 1 else -(-n // block_n))
    s_k = 1 if block_k == -1 else -(-k // block_k)
    with FakeTensorMode():
        x = torch.empty(4, k, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="cuda")
        args = (x, torch.empty(*x_scale, device="cuda"), w, torch.empty(s_n, s_k, device="cuda"), None, block_n, block_k, out_dtype, 3)
        with pytest.raises(ValueError, match=f"qops.scaled_mm_fp8: kernel=3 \\(scaled_mm_fp8\\) does not serve this call: .*{what}"):
            torch.ops.qops.scaled_mm_fp8(*args)


def test_triton_kernel_refuses_group_activation_scales_under_fake_cuda_tensors():
    """The Triton W8A8 kernel reads per-tensor or per-token scales only (declared): asked for
    directly with per-token-group scales it says so."""
    with FakeTensorMode():
        x = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="cuda")
        args = (x, torch.empty(4, 2, device="cuda"), w, torch.empty(2, 2, device="cuda"), None, 128, 128, torch.bfloat16, 1)
        with pytest.raises(ValueError, match=r"kernel=1 \(triton_fp8\) does not serve this call: group activation scales not in \['tensor', 'token'\]"):
            torch.ops.qops.scaled_mm_fp8(*args)


@pytest.mark.parametrize("group_size", [-1, 128])
def test_scales_are_amax_times_the_fp32_reciprocal(group_size):
    """Dynamic activation scales and the reference quantizer's weight scales are amax times fp32(1/448),
    bit for bit: one multiply by one fp32 constant rounds alike on the CPU and on CUDA (which divides a
    tensor by a Python number as that multiply; a CPU division gave other bits in ~60% of rows, and the
    codes of ties with them). tests/gpu/test_gpu_fp8.py compares the two devices."""
    x = _x(257, 1000, torch.bfloat16, 9)
    _, s = quantize_fp8_activations(x, None, group_size)
    inv = torch.tensor(1 / 448, dtype=torch.float32)
    assert torch.equal(s, (_amax(x, group_size) * inv).clamp(min=torch.finfo(torch.float32).tiny))
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    q = quantize_rtn(w, granularity="channel")
    assert torch.equal(q.scale.reshape(-1), w.abs().amax(dim=1) * inv)
