"""The GPU suites' checks of native W4A16 outputs, run on the CPU against emulations of the kernels' arithmetic.

tests/gpu/test_gpu_native_int_weight.py ``check`` and tests/gpu/test_gpu_codebook_w4.py ``check_output``
hold every element to ``oracle.elementwise_bound`` (u (2 |x w| + 2 |bias| + 8 sqrt(sum (x w)^2))).
The kernels have no CPU path, so here each rounding they make is replayed in float64 / float32 / the
activation dtype, the way the sources describe it (w4a16_gemv.cu, w4a16_gemm.cu, "Math"):

- decode kernel: A holds the exact integers q - z, x is exact in its dtype, each 16-row k step of
  the MMA adds into fp32 sums (truncated here, the worst of the tensor cores' fp32 accumulation), a
  128-row chunk's sum is scaled by its group's scale in fp32 (fmaf), split-K partials are fp32, the
  output is rounded once;
- fold (M <= 8): A = 1024 + q (f16) or 128 + q (bf16), and 1024 x (the chunk's sum of x) plus
  z x (that sum) are taken off in fp32 after the MMA: the cancellation is the one rounding here that
  grows with |x| rather than with |y|, so it runs on offset activations (all of one sign);
- GEMM (and the Triton tiles that scale in the activation dtype): the scale converted to x's dtype
  and s (q - z) rounded to it before the MMA, fp32 sums;
- codebook (QOPS_LUT): the codebook's values rounded to the MMA's type in the table, each 64-row
  half chunk's sum scaled in fp32.

Each emulated output passes the GPU file's own check (the worst ratio of error to bound is printed
with ``-s``: 0.12-0.38, the output's own rounding, which takes up to half the bound; the fp32 sums,
even truncated, and the fold's cancellation leave it where rounding the exact product once puts it),
and the same output with one element moved by a few bounds fails it while the relative norm alone
lets it pass. On the H200's facts, the codebook file's tall cases have plans.
"""
from __future__ import annotations

import pytest
import torch

from tests import oracle
from tests.gpu import test_gpu_codebook_w4 as cb_suite
from tests.gpu import test_gpu_native_int_weight as suite
from tests.int_weight_cases import Case, one_thread, random_int_quantized, rel_err  # noqa: F401  (one_thread: autouse)
from tests.test_gpu_suite_facts import H200_SMEM_OPTIN, H200_SMS

DTYPES = (torch.float16, torch.bfloat16)


def _f32(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to fp32 (to nearest), back in float64."""
    return v.float().double()


def _f32_truncated(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to fp32 toward zero: a pessimistic model of a tensor-core fp32 accumulation."""
    r = v.float()
    over = r.double().abs() > v.abs()
    r = torch.where(over, torch.nextafter(r, torch.zeros_like(r)), r)
    return r.double()


def _in(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values rounded to ``dtype`` (to nearest), back in float64."""
    return v.to(dtype).double()


def _mma_sums(x64: torch.Tensor, a64: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """(M, N) fp32 sums of x[:, k0:k1] a[:, k0:k1]^T as the MMAs make them: each 16-row k step's
    products summed exactly, then added to the fp32 accumulator (truncated)."""
    acc = torch.zeros(x64.shape[0], a64.shape[0], dtype=torch.float64)
    for s in range(k0, k1, 16):
        acc = _f32_truncated(acc + x64[:, s:s + 16] @ a64[:, s:s + 16].t())
    return acc


def _weight(n, k, group_size, sym, scale_dtype, seed=0):
    case = Case("gptq", 4, group_size, sym, False, "v2", n, k)
    iq = random_int_quantized(case, torch.Generator().manual_seed(seed), scale_dtype)
    g = iq.g_idx.long()
    qz = (iq.q.double() - iq.zeros.double().index_select(1, g))  # (N, K) exact q - z
    return iq, qz, iq.scales.double(), iq.zeros.double(), iq.dequantize().double()


def _x(m, k, dtype, offset, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + offset
    return x.to(dtype)


def _bias(n, dtype):
    return torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)


def _finish(acc32: torch.Tensor, bias, dtype):
    if bias is not None:
        acc32 = _f32(acc32 + bias.double())
    return acc32.to(dtype)


def _split_ranges(k: int, splits: int) -> list[tuple[int, int]]:
    """The K rows of each of S blocks splitting ceil(K / 128) chunks evenly (the kernels' cb, ce)."""
    chunks = -(-k // 128)
    return [(128 * (s * chunks // splits), 128 * ((s + 1) * chunks // splits)) for s in range(splits)]


def _padded(t: torch.Tensor, k: int) -> torch.Tensor:
    """K padded with zeros to whole 128-row chunks (x and the weight past K meet zeros in the kernels)."""
    return torch.nn.functional.pad(t, (0, -(-k // 128) * 128 - k))


def _in_order(partials: list[torch.Tensor]) -> torch.Tensor:
    total = partials[0]
    for p in partials[1:]:
        total = _f32(total + p)
    return total


def emulate_decode(x, qz, scales, g_idx, bias, splits=1):
    """The decode kernel (mma.sync or wgmma builds): exact A, fp32 chunk sums scaled in fp32 (fmaf),
    S fp32 partials added in order (the workspace's reduction, or the cluster's)."""
    k = x.shape[1]
    x64, a64 = _padded(x.double(), k), _padded(qz, k)
    partials = []
    for k0, k1 in _split_ranges(k, splits):
        acc = torch.zeros(x.shape[0], qz.shape[0], dtype=torch.float64)
        for c0 in range(k0, k1, 128):
            gacc = _mma_sums(x64, a64, c0, c0 + 128)
            acc = _f32(gacc * scales[:, int(g_idx[c0])] + acc)
        partials.append(acc)
    return _finish(_in_order(partials), bias, x.dtype)


def emulate_fold(x, q, zeros, scales, g_idx, bias):
    """The folded decode kernel: A = magic + q (1024 for f16, 128 for bf16), then per chunk
    y += ((gacc - magic * sum x) - z * sum x) * s in fp32, the x sums themselves fp32."""
    magic = 1024.0 if x.dtype == torch.float16 else 128.0
    k = x.shape[1]
    x64, a64 = _padded(x.double(), k), _padded(q.double() + magic, k)
    acc = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for c0 in range(0, x64.shape[1], 128):
        gacc = _mma_sums(x64, a64, c0, c0 + 128)
        sx = torch.zeros(x.shape[0], 1, dtype=torch.float64)  # a lane's slots, then the shuffle tree: fp32 throughout
        for s in range(c0, c0 + 128, 8):
            sx = _f32(sx + _f32(x64[:, s:s + 8].sum(1, keepdim=True)))
        c1 = _f32(magic * sx)
        g = int(g_idx[min(c0, k - 1)])
        inner = _f32(-zeros[:, g] * sx + _f32(gacc - c1))  # fmaf(-z, sx, gacc - c1)
        acc = _f32(inner * scales[:, g] + acc)
    return _finish(acc, bias, x.dtype)


def emulate_gemm(x, qz, scales, g_idx, bias, splits=1):
    """The GEMM: the scale converted to x's dtype, s (q - z) rounded to it, fp32 MMA sums, S fp32
    partials added in order."""
    dt = x.dtype
    k = x.shape[1]
    w = _in(_in(scales, dt).index_select(1, g_idx.long()) * qz, dt)
    x64, w = _padded(x.double(), k), _padded(w, k)
    partials = [_mma_sums(x64, w, k0, k1) for k0, k1 in _split_ranges(k, splits)]
    return _finish(_in_order(partials), bias, dt)


def _ratio(got, x, w64, bias, dtype) -> float:
    want = oracle.matmul(x, w64, bias)
    return float(((got.double() - want).abs() / oracle.elementwise_bound(x, w64, bias, dtype)).max())


def _record(name, ratio):
    print(f"{name}: worst error / bound {ratio:.3f}")  # (-s shows how far inside the bound each path stays)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale_dtype", DTYPES, ids=["fp16-scales", "bf16-scales"])
def test_decode_arithmetic_passes_the_suites_check(dtype, scale_dtype):
    n, k = 256, 4096
    iq, qz, scales, _, w64 = _weight(n, k, 128, False, scale_dtype)
    bias = _bias(n, dtype)
    for m, splits in ((1, 1), (16, 4), (32, 2)):
        x = _x(m, k, dtype, 0.0, seed=m)
        y = emulate_decode(x, qz, scales, iq.g_idx, bias, splits)
        suite.check(y, x, w64, bias, f"decode M={m} splits={splits}")
        _record(f"decode {dtype} {scale_dtype}", _ratio(y, x, w64, bias, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0.0, 3.0], ids=["centred", "offset"])
def test_fold_arithmetic_passes_the_suites_check(dtype, offset):
    """test_fold_keeps_the_precision_of_the_exact_path_on_offset_activations' inputs (x + 3, K = 4096,
    asymmetric zeros): the fold's cancellation stays inside the bound."""
    n, k = 256, 4096
    iq, _, scales, zeros, w64 = _weight(n, k, 128, False, torch.float16, seed=1)
    x = _x(4, k, dtype, offset, seed=7)
    y = emulate_fold(x, iq.q, zeros, scales, iq.g_idx, None)
    suite.check(y, x, w64, None, f"fold {dtype} offset {offset}")
    _record(f"fold {dtype} offset={offset}", _ratio(y, x, w64, None, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale_dtype", DTYPES, ids=["fp16-scales", "bf16-scales"])
def test_gemm_arithmetic_passes_the_suites_check(dtype, scale_dtype):
    """Weights rounded to x's dtype (twice for fp16 scales with bf16 x), on the GEMM's shapes (K off
    the 128-row grid), split and not."""
    for (n, k), seed in (((256, 4096), 0), ((200, 1000), 1)):
        iq, qz, scales, _, w64 = _weight(n, k, 128, False, scale_dtype, seed=seed)
        bias = _bias(n, dtype)
        for m, splits in ((33, 1), (64, 3)):
            x = _x(m, k, dtype, 0.0, seed=m)
            y = emulate_gemm(x, qz, scales, iq.g_idx, bias if m == 33 else None, splits)
            suite.check(y, x, w64, bias if m == 33 else None, f"gemm {n}x{k} M={m}")
            _record(f"gemm {dtype} {scale_dtype}", _ratio(y, x, w64, bias if m == 33 else None, dtype))


def emulate_codebook(x, codes, code, scales):
    """The table path (QOPS_LUT): each codebook value rounded to the MMA's type (x's), fp32 sums of
    each 64-row half chunk scaled by its absmax in fp32."""
    a64 = _in(code.double()[codes], x.dtype)
    x64 = x.double()
    acc = torch.zeros(x.shape[0], codes.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], 64):
        acc = _f32(_mma_sums(x64, a64, k0, k0 + 64) * scales[k0 // 64].double() + acc)
    return acc.to(x.dtype)


def _codebook_case(n, k, dtype, seed=0):
    from qops.formats.bitsandbytes import codebook

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = ((torch.rand(k // 64, n, generator=gen) + 0.5) * 0.02).to(dtype)  # as the GPU file's absmax
    return codes, codebook("nf4"), scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_codebook_arithmetic_passes_the_suites_check(dtype):
    n, k = 160, 1152
    codes, code, scales = _codebook_case(n, k, dtype)
    w = cb_suite.oracle_weight(codes, scales, code)
    for m in (1, 17):
        x = _x(m, k, dtype, 0.0, seed=m)
        y = emulate_codebook(x, codes, code, scales)
        cb_suite.check_output(y, x, w, f"codebook M={m}")
        _record(f"codebook {dtype}", _ratio(y, x, w, None, dtype))


def _one_element_off(y: torch.Tensor, x, w64, bias) -> torch.Tensor:
    """``y`` with its largest element moved by four times its bound (a few percent of it)."""
    bound = oracle.elementwise_bound(x, w64, bias, y.dtype)
    i = int(y.double().abs().argmax())
    bad = y.clone()
    bad.view(-1)[i] += 4 * float(bound.reshape(-1)[i]) * (1 if float(y.view(-1)[i]) >= 0 else -1)
    return bad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_wrong_element_fails_the_check_the_norm_lets_pass(dtype):
    n, k, m = 256, 1024, 16
    iq, qz, scales, _, w64 = _weight(n, k, 128, False, torch.float16)
    x = _x(m, k, dtype, 0.0, seed=2)
    bad = _one_element_off(emulate_decode(x, qz, scales, iq.g_idx, None), x, w64, None)
    assert rel_err(bad, oracle.matmul(x, w64)) < suite.TOL[dtype]  # the relative norm alone passes it
    with pytest.raises(AssertionError, match="1 of 4096 elements past the elementwise bound"):
        suite.check(bad, x, w64, None, "one element off")
    codes, code, cscales = _codebook_case(n, k, dtype)
    w = cb_suite.oracle_weight(codes, cscales, code)
    bad = _one_element_off(emulate_codebook(x, codes, code, cscales), x, w, None)
    assert rel_err(bad, oracle.matmul(x, w)) < cb_suite.TOL[dtype]
    with pytest.raises(AssertionError, match="1 of 4096 elements past the elementwise bound"):
        cb_suite.check_output(bad, x, w, "one element off")


def _h200_lut_plan(n, k, m):
    """codebook_mm's plan on an H200: the table's entry or the rule's, made a table (lut) plan."""
    from qops.native import int_weight as native

    base = native.measured_plan(m, n, k, "NVIDIA H200", H200_SMS, True, H200_SMEM_OPTIN) or native._plan(m, n, k, H200_SMS, True)
    return native.lut_plan(base, n, k, H200_SMEM_OPTIN)


@pytest.mark.parametrize("n,k,m", cb_suite.TALL_CASES)
def test_codebook_tall_cases_take_three_and_four_tiles_on_an_h200(n, k, m):
    """tests/gpu/test_gpu_codebook_w4.py::test_tall_tiles_match_the_oracle: each (N, K, M) has a table
    plan on an H200 (none raises), MT = 3 or 4, and together they reach a cluster, the workspace and
    one block a tile."""
    p = _h200_lut_plan(n, k, m)
    assert p.lut and p.xfull and p.mt == -(-m // 8) >= 3


def test_codebook_tall_cases_cover_every_reduction_on_an_h200():
    seen = set()
    for n, k, m in cb_suite.TALL_CASES:
        p = _h200_lut_plan(n, k, m)
        seen.add((p.mt, "cluster" if p.cluster else ("workspace" if p.splits > 1 else "single")))
    assert seen == {(3, "cluster"), (3, "workspace"), (3, "single"), (4, "workspace"), (4, "single")}, sorted(seen)


def test_bf16_scales_read_as_fp16_fail_the_check():
    """What test_either_scale_dtype_with_either_activation_dtype guards against: a launch that drops
    the _SCALE_BF16 flag reads bf16 scales' bits as fp16."""
    iq, qz, _, _, w64 = _weight(256, 1024, 128, False, torch.bfloat16)
    x = _x(7, 1024, torch.float16, 0.0, seed=3)
    y = emulate_decode(x, qz, iq.scales.view(torch.float16).double(), iq.g_idx, None)
    with pytest.raises(AssertionError, match="bf16 scales read as fp16"):
        suite.check(y, x, w64, None, "bf16 scales read as fp16")
