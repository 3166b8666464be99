"""``qops::add_rmsnorm_mm_int_weight`` (and ``_out``) on the native lowering, on a CUDA device.

Where the decode plan stages x once in one block per column tile (batch 1-2 decode), the residual add
and the RMSNorm run inside the W4A16 decode kernel while it stages x (``w4a16_gemv.cu``, QOPS_NORM);
elsewhere the op runs ``qops::add_rmsnorm`` and then the matmul. Both against a float64 oracle written
here (sum, norm and product in float64 from the inputs), the new residual stream bit for bit against
the dtype's rounding of the exact sum, and the fused launch against the composed one.
"""
from __future__ import annotations

import pytest
import torch

from qops.native import int_weight as native
from tests.gpu.test_gpu_native_int_weight import DTYPES, native_weight, rand
from tests.int_weight_cases import rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-5
# x is rounded twice more than in the plain matmul (the normalized value, then its product with the
# norm weight, each to the activation dtype, as qops::add_rmsnorm rounds them).
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
# The fused launch against add_rmsnorm + the matmul: the same roundings but for 1 / rms, whose last
# bit may differ (a different summation order), moving a few normalized values by one unit.
TOL_COMPOSED = {torch.float16: 1e-3, torch.bfloat16: 4e-3}


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


def exact_sum(x, residual):
    """x + residual rounded once to the dtype (both kernels add in fp32, exact for these inputs)."""
    return (x.float() + residual.float()).to(x.dtype)


def call(nw, x, residual, norm_weight, bias=None, glu=False):
    w = nw.weight
    return torch.ops.qops.add_rmsnorm_mm_int_weight(x, residual, norm_weight, EPS, w.qweight, w.scales, w.qzeros, w.act_perm, bias,
                                                    w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel), glu)


def composed(nw, x, residual, norm_weight, bias=None, glu=False):
    w = nw.weight
    h, s = torch.ops.qops.add_rmsnorm(x, residual, norm_weight, EPS)
    if glu:
        return torch.ops.qops.mm_int_weight_swiglu(h, w.qweight, w.scales, w.qzeros, w.act_perm, w.in_features, w.bits, w.group_size,
                                                   w.zero_offset, int(w.kernel)), s
    return w.mm(h, bias), s


def inputs(m, k, dtype, seed):
    # The norm weight around 1 with a spread, the residual larger than x (as in a decoder).
    return (rand(m, k, dtype=dtype, seed=seed), (3 * rand(m, k, dtype=dtype, seed=seed + 100)).to(dtype),
            (1 + 0.3 * rand(k, dtype=dtype, seed=seed + 200)).to(dtype))


# (N, K, glu, group, sym): the decode shapes of the Llama-3-8B-shaped model's qkv and gate/up (both
# fused at M = 1), a K off the 128-row chunk grid, N off the 128-column tile grid, group -1.
SHAPES = [(6144, 4096, False, 128, False), (28672, 4096, True, 128, False), (2000, 1000, True, 128, True),
          (1000, 1032, False, -1, False), (520, 2048, False, 128, True)]
# Rows: 1 and 2 (fused where the plan allows), 3 and 17 (composed), 0.
M_VALUES = (1, 2, 3, 17, 0)


def _id(s):
    n, k, glu, g, sym = s
    return f"{n}x{k}-{'glu' if glu else 'mm'}-g{g}-{'sym' if sym else 'asym'}"


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_the_oracle_and_the_composed_ops(shape):
    n, k, glu, group, sym = shape
    nw = native_weight("gptq", n, k, group, sym, version="v2")
    w = nw.weight
    fused_seen = 0
    for dtype in DTYPES:
        for m in M_VALUES:
            x, r, nweight = inputs(m, k, dtype, seed=m + 7)
            why = native._norm_refusal(x, r, nweight, w.qweight, w.scales, w.qzeros, w.act_perm, 4, group, None, None, glu)
            fused_seen += why is None
            what = f"{_id(shape)} M={m} {dtype} ({'fused' if why is None else 'composed: ' + why})"
            y, s = call(nw, x, r, nweight, glu=glu)
            assert y.dtype == dtype and y.shape == (m, n // 2 if glu else n), what
            assert torch.equal(s, exact_sum(x, r)), f"{what}: the new residual stream"
            if m == 0:
                continue
            assert bool(torch.isfinite(y).all()), what
            err = rel_err(y, oracle(x, r, nweight, nw.w64, glu=glu))
            assert err < TOL[dtype], f"{what}: relative error {err:.2e} >= {TOL[dtype]:.1e}"
            y2, _ = composed(nw, x, r, nweight, glu=glu)
            assert rel_err(y, y2.double()) < TOL_COMPOSED[dtype], f"{what}: against add_rmsnorm + the matmul"
    if (n, k) in ((6144, 4096), (28672, 4096)):
        assert fused_seen >= 2, f"{_id(shape)}: M = 1 of the decode shape must take the fused kernel"


def test_bias_strided_inputs_and_the_out_variant():
    n, k = 1000, 1032
    nw = native_weight("gptq", n, k, 128, False, version="v1")
    w = nw.weight
    for dtype in DTYPES:
        bias = rand(n, dtype=dtype, seed=3)
        x, r, nweight = inputs(1, k, dtype, seed=4)
        y, s = call(nw, x, r, nweight, bias)
        assert rel_err(y, oracle(x, r, nweight, nw.w64, bias)) < TOL[dtype], f"bias {dtype}"
        # Strided x (not 16-byte rows: composed) and a 3-D call.
        xs = rand(2, 2 * k, dtype=dtype, seed=5)[:, ::2]
        rs = rand(2, k, dtype=dtype, seed=6)
        y, s = call(nw, xs, rs, nweight)
        assert rel_err(y, oracle(xs, rs, nweight, nw.w64)) < TOL[dtype] and torch.equal(s, exact_sum(xs, rs)), f"strided {dtype}"
        x3, r3 = rand(1, 1, k, dtype=dtype, seed=7), rand(1, 1, k, dtype=dtype, seed=8)
        y, s = call(nw, x3, r3, nweight)
        assert y.shape == (1, 1, n) and s.shape == (1, 1, k)
        assert rel_err(y, oracle(x3, r3, nweight, nw.w64)) < TOL[dtype], f"3-D {dtype}"
        # _out: caller-owned out (strided) and summed; then summed in place of the residual (composed).
        big = torch.full((1, n + 9), float("nan"), dtype=dtype, device="cuda")
        out, summed = big[:, 5:5 + n], torch.full((1, k), float("nan"), dtype=dtype, device="cuda")
        ws = torch.empty(max(native.workspace_bytes(1, n, k, 4, 128), 16), dtype=torch.uint8, device="cuda")
        args = (x, r, nweight, EPS, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size, w.zero_offset,
                int(w.kernel), False)
        torch.ops.qops.add_rmsnorm_mm_int_weight_out(*args, out, summed, ws)
        assert rel_err(out, oracle(x, r, nweight, nw.w64)) < TOL[dtype] and torch.equal(summed, exact_sum(x, r)), f"out {dtype}"
        assert bool(big[:, :5].isnan().all()) and bool(big[:, 5 + n:].isnan().all()), "wrote outside out"
        want_s, want_y = exact_sum(x, r), oracle(x, r, nweight, nw.w64)
        r_inplace = r.clone()
        torch.ops.qops.add_rmsnorm_mm_int_weight_out(x, r_inplace, *args[2:], out, r_inplace, ws)
        assert torch.equal(r_inplace, want_s) and rel_err(out, want_y) < TOL[dtype], f"summed over the residual {dtype}"


def test_fused_launch_is_deterministic_and_replays_from_a_cuda_graph():
    n, k, m = 28672, 4096, 1
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    dtype = torch.bfloat16
    assert native.warmup_norm(nw.weight, glu=True, act_dtype=dtype) >= 1
    x, r, nweight = inputs(m, k, dtype, seed=11)
    assert native._norm_refusal(x, r, nweight, nw.weight.qweight, nw.weight.scales, nw.weight.qzeros, None, 4, 128, None, None, True) is None
    y0, s0 = call(nw, x, r, nweight, glu=True)
    for _ in range(3):
        y1, s1 = call(nw, x, r, nweight, glu=True)
        assert torch.equal(y0, y1) and torch.equal(s0, s1), "run to run"
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gy, gs = call(nw, x, r, nweight, glu=True)
    for seed in (12, 13):
        xn, rn, _ = inputs(m, k, dtype, seed=seed)
        x.copy_(xn)
        r.copy_(rn)
        gy.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ey, es = call(nw, x, r, nweight, glu=True)
        assert torch.equal(gy, ey) and torch.equal(gs, es), f"replay {seed} differs from eager"
        assert rel_err(gy, oracle(x, r, nweight, nw.w64, glu=True)) < TOL[dtype], f"replay {seed}"


def test_torch_compile_fullgraph():
    n, k = 6144, 4096
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    w = nw.weight
    native.warmup_norm(w, act_dtype=torch.float16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, r, nweight: call(nw, x, r, nweight), fullgraph=True)
    for m in (1, 2, 5):
        x, r, nweight = inputs(m, k, torch.float16, seed=m)
        y, s = compiled(x, r, nweight)
        ey, es = call(nw, x, r, nweight)
        assert torch.equal(y, ey) and torch.equal(s, es), f"M={m}: the compiled graph must call the same kernels"
        assert rel_err(y, oracle(x, r, nweight, nw.w64)) < TOL[torch.float16], f"compiled M={m}"


# Plans forced on shapes whose own M = 1 plan splits K or stages x per iteration (the fused kernel is
# then never taken by the rule): one column of warps, fold, the widest tile, bf16 x through f16 MMAs.
FORCED = [dict(nwn=1), dict(nwn=2, fold=True), dict(nwn=4, fold=True, f16mma=True), dict(nwn=8, f16mma=True)]


@pytest.mark.parametrize("fields", FORCED, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
@pytest.mark.parametrize("shape", SHAPES[2:], ids=_id)
def test_fused_kernel_on_forced_plans(shape, fields):
    n, k, glu, group, sym = shape
    nw = native_weight("gptq", n, k, group, sym, version="v2")
    w = nw.weight
    for m in (1, 2):
        p = native.make_plan(m, n, k, splits=1, cluster=False, xfull=True, **fields)
        with native.plan_override(lambda *a, p=p: p):
            for dtype in DTYPES:
                x, r, nweight = inputs(m, k, dtype, seed=m + 31)
                assert native._norm_refusal(x, r, nweight, w.qweight, w.scales, w.qzeros, None, 4, group, None, None, glu) is None, p
                y, s = call(nw, x, r, nweight, glu=glu)
                what = f"{_id(shape)} {p} {dtype}"
                assert torch.equal(s, exact_sum(x, r)), what
                assert rel_err(y, oracle(x, r, nweight, nw.w64, glu=glu)) < TOL[dtype], what
                y2, _ = composed(nw, x, r, nweight, glu=glu)
                assert rel_err(y, y2.double()) < TOL_COMPOSED[dtype], f"{what}: against add_rmsnorm + the matmul"
