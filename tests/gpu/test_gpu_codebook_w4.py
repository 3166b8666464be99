"""NF4 / FP4 codes through the W4A16 decode kernel's table path (qops.native.codebook_w4, w4a16_gemv.cu
with QOPS_LUT) on a CUDA device, against a float64 oracle written here from the codes, the codebook and
the absmax (not with the module's unpacking): every plan shape the perf shapes take (one block a tile,
a cluster of two, the workspace's split partials, the f16-MMA staging of bf16 x), M = 1, 7 and 16 and
the three- and four-tile heights (M = 17, 32), fp16 and bf16, N and K off the plans' tile grids (N = 160:
five 32-column slabs, K = 1152: nine 128-row chunks; the kernel needs N % 32 == 0 and K % 128 == 0),
strided x, M = 0, CUDA-graph replay and run-to-run identity."""
from __future__ import annotations

import pytest
import torch

from qops.formats.bitsandbytes import codebook
from qops.native import codebook_w4 as cw
from qops.native import int_weight as niw
from tests import oracle
from tests.int_weight_cases import rel_err

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
# The codes are rounded to the MMA's type in the table (2^-11 / 2^-8 relative), the sums are fp32.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
_BUILT: dict = {}


def _weight(n, k, quant_type="nf4", seed=0):
    """(qweight on the GPU, codes (N, K) int64 on the GPU, absmax fp32 (K/64, N), codebook on the GPU)."""
    key = (n, k, quant_type, seed)
    if key not in _BUILT:
        gen = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        absmax = (torch.rand(k // 64, n, generator=gen) + 0.5) * 0.02
        _BUILT[key] = (cw.pack_codes(codes).cuda(), codes.long().cuda(), absmax, codebook(quant_type).cuda())
    return _BUILT[key]


def oracle_weight(codes, scales, code):
    """W[n, k] = code[c(n, k)] * scale[k // 64, n], (N, K) in float64 from the codes themselves."""
    return code.double()[codes] * scales.double().t().repeat_interleave(64, dim=1)


def check_output(got, x, w, what):
    """``got`` against float64 ``x @ W.T``: the relative error within TOL, and every element within
    ``oracle.elementwise_bound``. The bound holds for the table path's arithmetic: x is exact in the
    MMA's type (bf16 staged as f16 is scaled by a power of two a row first), each codebook value is
    rounded once to that type in the table (an independent relative error of at most u a weight, which
    the random-walk term 8 u sqrt(sum (x w)^2) covers), sums are fp32, each 64-row half chunk's sum is
    scaled by its absmax in fp32 and the output is rounded once (2 u |y|)."""
    dtype = x.dtype
    assert got.shape == (*x.shape[:-1], w.shape[0]) and got.dtype == dtype, what
    err = rel_err(got, x.double() @ w.t())
    assert err < TOL[dtype], f"{what}: relative error {err:.2e} >= {TOL[dtype]:.0e}"
    oracle.check_elementwise(got, x, w, None, dtype, what)


def _check(n, k, m, dtype, quant_type="nf4", x=None):
    q, codes, absmax, code = _weight(n, k, quant_type)
    scales = absmax.to(dtype).cuda()  # the kernel's scales: absmax in x's dtype
    if x is None:
        x = torch.randn(m, k, dtype=dtype, device="cuda")
    got = cw.codebook_mm(x, q, scales, code)
    check_output(got, x, oracle_weight(codes, scales, code), f"{quant_type} {n}x{k} M={m} {dtype}")
    return got


# (N, K): one block a tile (4096x4096), a cluster of two (4096x14336 at M = 1), nwn 4 with bf16 through
# f16 MMAs (28672x4096 at M = 1), the workspace's partials (4096x14336 at M = 16), the rule's plans off
# the table (N = 160: five slabs; K = 1152: nine chunks).
SHAPES = [(4096, 4096), (4096, 14336), (28672, 4096), (160, 1152), (96, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_the_oracle(n, k, m, dtype):
    _check(n, k, m, dtype)


# Three and four 8-row tiles (M = 17, 32): a cluster of two (4096x4096 at 17), the workspace's partials
# (4096x4096 at 32, 160x1152 at 17), one block a tile (28672x4096 at 17, 96x256 at 32); on an H200's
# facts tests/test_native_int_weight_checks.py checks these plans. (There the table's 64 KiB leaves no
# room for the x of these rows on 4096x14336, M >= 17, or 28672x4096, M >= 24: lut_plan raises.)
TALL_CASES = [(4096, 4096, 17), (4096, 4096, 32), (160, 1152, 17), (28672, 4096, 17), (96, 256, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,m", TALL_CASES)
def test_tall_tiles_match_the_oracle(n, k, m, dtype):
    p = niw.lut_plan(niw.plan(m, n, k, 0), n, k, niw.smem_optin_bytes(0))
    assert p.mt == -(-m // 8) and p.lut, p
    _check(n, k, m, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_codes(dtype):
    _check(4096, 4096, 1, dtype, "fp4")


def test_plans_cover_the_reductions():
    """The shapes above reach each way the kernel sums a tile's split K (so the oracle tests cover them)."""
    seen = set()
    for n, k in SHAPES:
        for m in (1, 7, 16):
            p = niw.plan(m, n, k, 0)
            seen.add("cluster" if p.cluster else ("workspace" if p.splits > 1 else "single"))
    assert seen == {"cluster", "workspace", "single"}, seen


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_batched_x(dtype):
    k = 4096
    base = torch.randn(7, 2 * k, dtype=dtype, device="cuda")
    _check(4096, k, 7, dtype, x=base[:, :k])  # rows 2K apart
    _check(4096, k, 7, dtype, x=base[:, ::2])  # column stride 2 (copied)
    _check(4096, k, 6, dtype, x=torch.randn(2, 3, k, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(dtype):
    q, _, absmax, code = _weight(4096, 4096)
    for lead in ((0,), (2, 0)):
        out = cw.codebook_mm(torch.empty(*lead, 4096, dtype=dtype, device="cuda"), q, absmax.to(dtype).cuda(), code)
        assert out.shape == (*lead, 4096) and out.dtype == dtype


@pytest.mark.parametrize("n,k,m", [(4096, 14336, 1), (4096, 14336, 16), (28672, 4096, 1)])
def test_cuda_graph_replay_and_identical_runs(n, k, m):
    q, _, absmax, code = _weight(n, k)
    scales = absmax.to(torch.bfloat16).cuda()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    first = cw.codebook_mm(x, q, scales, code)  # loads the module before capture
    assert torch.equal(first, cw.codebook_mm(x, q, scales, code))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cw.codebook_mm(x, q, scales, code)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cw.codebook_mm(x, q, scales, code))


def test_rows_whose_table_plan_does_not_fit_are_refused_by_name():
    """4096 x 14336 at 17 rows: x staged once beside the codebook table needs more shared memory than
    a block may have; refused naming x's rows before any launch (was the int weights' plan error)."""
    q, _, absmax, code = _weight(4096, 14336)
    x = torch.randn(17, 14336, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="codebook_mm: x has 17 rows, whose plan for N = 4096, K = 14336 with the codebook table"):
        cw.codebook_mm(x, q, absmax.half().cuda(), code)
