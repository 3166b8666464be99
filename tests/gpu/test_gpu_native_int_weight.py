"""The native W4A16 lowering (qops/native) against the exact dequantized weight, on a CUDA device.

Weights come from every 4-bit int_weight format (GPTQ v1/v2, AWQ, compressed-tensors), prepared on
the CPU and moved to the GPU with ``kernel=Kernel.NATIVE``. The reference is float64
``x @ W.T (+ bias)`` with W from ``IntQuantized.dequantize`` (exact: fp16 scales times small
integers). Checked eagerly, under ``torch.compile(fullgraph=True)``, in CUDA-graph replay, through
both split-K reductions (cluster and workspace, which must agree bit for bit), for run-to-run
determinism, and with programmatic dependent launch on and off right behind the kernels writing x.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import Kernel
from qops.native import compiler
from qops.native import int_weight as native
from qops.native import int_weight_gemm as gemm
from qops.ops.int_weight import flat_qweight, to_column_slabs
from qops.ops.triton import x_gather
from tests import oracle
from tests.int_weight_cases import CLUSTER_COMPARE_M, RULE_CLUSTER_M, Case, native_cluster_pairs, pack, random_int_quantized, rel_err

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
# fp32 accumulation of exact products: the error is the output rounding (2^-11, 2^-8) and little else.
TOL = {torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
M_VALUES = (1, 2, 7, 16)
# One launch of three or four 8-row tiles (17..32), and the first M of the GEMM (33).
TALL_M_VALUES = (17, 24, 25, 32, 33)
# The GEMM (w4a16_gemm.cu): 5..8 tiles of 8 rows, the last partly filled or full.
GEMM_M_VALUES = (40, 57, 64)


@dataclasses.dataclass
class Native:
    weight: object  # qops IntWeight on cuda, kernel NATIVE
    w64: torch.Tensor  # (N, K) float64 on cuda, checkpoint K order


_BUILT: dict = {}


def native_weight(fmt, n, k, group_size, sym, act_order=False, version=None, seed=0, slabs=False,
                  scale_dtype=torch.float16) -> Native:
    """The weight with its qweight flat (as prepared on the CPU) or, ``slabs``, in column slabs (as
    prepared for the native lowering on a GPU), its scales in ``scale_dtype`` (kept as stored, whatever
    the activation dtype: the kernels read either with the ``_SCALE_BF16`` flag)."""
    key = (fmt, n, k, group_size, sym, act_order, version, seed, slabs, scale_dtype)
    if slabs and key not in _BUILT:
        nw = native_weight(fmt, n, k, group_size, sym, act_order, version, seed, scale_dtype=scale_dtype)
        _BUILT[key] = Native(dataclasses.replace(nw.weight, qweight=to_column_slabs(nw.weight.qweight)), nw.w64)
    if key not in _BUILT:
        case = Case(fmt, 4, group_size, sym, act_order, version, n, k)
        gen = torch.Generator().manual_seed(seed)
        iq = random_int_quantized(case, gen, scale_dtype)
        w = FORMATS[fmt].prepare(pack(case, iq))
        moved = {f: (getattr(w, f).cuda() if getattr(w, f) is not None else None) for f in ("qweight", "scales", "qzeros", "act_perm")}
        w = dataclasses.replace(w, **moved, kernel=Kernel.NATIVE, choice=None)
        _BUILT[key] = Native(w, iq.dequantize().double().cuda())
    return _BUILT[key]


def reference(x, w64, bias=None):
    y = x.double() @ w64.t()
    return y if bias is None else y + bias.double()


def check(y, x, w64, bias, what):
    """``y`` against float64 ``x @ W.T + bias``: the relative Frobenius error within TOL, and every
    element within ``oracle.elementwise_bound``, u (2 |x w| + 2 |bias| + 8 sqrt(sum (x w)^2)), so that
    one wrong element, which the norm lets pass, fails.

    Why the bound holds on every path here (tests/test_native_int_weight_checks.py replays each on the
    CPU, truncating the fp32 sums: worst error 0.2-0.4 of the bound):
    - the decode kernel (every plan, mma.sync or wgmma): A is the exact integers q - z, x is exact in
      its dtype (bf16 x staged as f16 for f16 MMAs is first scaled by a power of two a row), sums
      are fp32 and each 128-row chunk's is scaled in fp32, split-K partials are fp32 (cluster or
      workspace), the output is rounded once: 2 u |y| covers that, the fp32 sums are far below u;
    - fold: A = 1024 + q (f16) or 128 + q (bf16), and the magic times the chunk's x sum is taken off
      in fp32: a cancellation of ~2^-23 x 1024 x sum |x| a chunk, largest on x of one sign (the fold
      test's x + 3), still inside the 8 u sqrt term;
    - the GEMM, and Triton past rows_served: s (q - z) rounded to x's dtype before the MMA (the GEMM
      first converts the scale to it: two roundings for fp16 scales with bf16 x), an independent error
      of at most 2 u a weight that the random-walk term covers at ~10 standard deviations on these
      centred x; fp32 sums and partials (cuBLAS's split-K under Triton's dense path may keep them in
      x's dtype, which that term covers too)."""
    want = reference(x, w64, bias)
    assert y.dtype == x.dtype and y.shape == want.shape, what
    assert bool(torch.isfinite(y).all()), what
    err = rel_err(y, want)
    assert err < TOL[x.dtype], f"{what}: relative error {err:.2e} >= {TOL[x.dtype]:.1e}"
    oracle.check_elementwise(y, x, w64, bias, x.dtype, what)


def rand(*shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


# (format, N, K, group, sym, act-order, version). N % 4 == 0 (the lowering's n_multiple); K odd or
# not a multiple of 128 where the format allows, so partial groups and the scalar x path are covered.
CASES = [
    ("gptq", 256, 512, 128, True, False, "v1"),
    ("gptq", 1000, 777, 128, False, False, "v1"),
    ("gptq", 4096, 4096, 128, False, False, "v2"),
    ("gptq", 1024, 2048, 128, False, True, "v1"),
    ("gptq", 512, 1000, 128, True, True, "v2"),
    ("gptq", 768, 1536, -1, False, False, "v2"),
    ("gptq", 1024, 8192, -1, True, False, "v1"),
    ("awq", 1024, 1024, 128, False, False, None),
    ("awq", 2048, 640, -1, False, False, None),
    ("compressed-tensors", 1536, 1280, 128, True, True, None),
    ("compressed-tensors", 640, 384, 128, False, False, None),
]


def _id(c):
    fmt, n, k, g, sym, act, ver = c
    return f"{fmt}{'-' + ver if ver else ''}-{n}x{k}-g{g}-{'sym' if sym else 'asym'}{'-act' if act else ''}"


def _x(m, k, dtype, layout, seed):
    """x of m rows in one of three layouts: contiguous, every other column (made contiguous before
    the launch), or rows 3 elements into a wider buffer (row stride not a multiple of 8: the scalar
    x staging, not cp.async)."""
    if layout == "strided":
        return rand(m, 2 * k, dtype=dtype, seed=seed)[:, ::2]
    if layout == "offset":
        return rand(m, k + 3, dtype=dtype, seed=seed)[:, 3:]
    return rand(m, k, dtype=dtype, seed=seed)


# M <= 16: MT = 1, 2 (every x contiguous, as before the tall rows existed); M = 17..33: one launch
# with MT = 3 or 4 up to 32 rows, the GEMM at 33 (on Hopper from 24 rows on these weights:
# decode_rows); M = 40..64: the GEMM; x in every layout.
M_GROUPS = {"small_m": (M_VALUES, ("contiguous",), 1, 10), "tall_m": (TALL_M_VALUES, ("contiguous", "strided", "offset"), 2, 20),
            "gemm_m": (GEMM_M_VALUES, ("offset", "contiguous", "strided"), 3, 30)}


# Each case with its qweight flat, and in column slabs where N allows (what a GPU's prepare gives).
FORM_CASES = [(c, f) for c in CASES for f in ("flat", "slabs") if f == "flat" or c[1] % 32 == 0]


@pytest.mark.parametrize("group", sorted(M_GROUPS))
@pytest.mark.parametrize("case, form", FORM_CASES, ids=[f"{_id(c)}-{f}" for c, f in FORM_CASES])
def test_eager_matches_reference(case, form, group):
    ms, layouts, bias_seed, x_seed = M_GROUPS[group]
    fmt, n, k, g, sym, act, ver = case
    nw = native_weight(fmt, n, k, g, sym, act, ver, slabs=form == "slabs")
    w = nw.weight
    for dtype in DTYPES:
        bias = rand(n, dtype=dtype, seed=bias_seed)
        for i, m in enumerate(ms):
            layout = layouts[i % len(layouts)]
            x = _x(m, k, dtype, layout, seed=x_seed + m)
            b = bias if i % 2 else None
            check(w.mm(x, b), x, nw.w64, b, f"{_id(case)} {dtype} M={m} {layout} bias={b is not None} plan={native.plan(min(m, native.MAX_M), n, k, 0)}")


# fp16 and bf16 scales (compressed-tensors checkpoints often store bf16): a weight with zeros and one
# without, both act-order, both of fewer than 2^24 values (so 17 rows stay on the decode kernel on
# Hopper, and 65 rows go to Triton). The decode and GEMM builds are the ones test_eager_matches_reference
# and test_column_slabs_give_the_flat_forms_bits_on_every_kernel load (the scale dtype is a launch
# flag, not a build). The Triton kernels specialize on the scales' dtype (M = 65's GEMM and M = 257's
# dequantization, by scale and x dtype: up to eight builds of a few seconds), so only the first weight
# goes there.
SCALE_DTYPE_CASES = [("gptq", 1024, 2048, 128, False, True, "v1"), ("compressed-tensors", 1536, 1280, 128, True, True, None)]


@pytest.mark.parametrize("scale_dtype", DTYPES, ids=["fp16-scales", "bf16-scales"])
@pytest.mark.parametrize("case", SCALE_DTYPE_CASES, ids=_id)
def test_either_scale_dtype_with_either_activation_dtype(case, scale_dtype, monkeypatch):
    """Scales keep the checkpoint's dtype whatever x's (prepare does not convert them): the decode
    kernel reads either through the _SCALE_BF16 flag and scales its fp32 sums, the GEMM converts them
    to x's dtype before scaling the weight, Triton loads them by pointer type. Both scale dtypes with
    both x dtypes through each family: the decode kernel (the rule's plans at M = 1, 7, 16, 17 and a
    folded plan at 1), the GEMM (the rule's build and the mma.sync one at M = 33, 64) and, past
    rows_served, the Triton lowering (M = 65, 257), each launch recorded."""
    fmt, n, k, g, sym, act, ver = case
    nw = native_weight(fmt, n, k, g, sym, act, ver, scale_dtype=scale_dtype)
    w = nw.weight
    assert w.scales.dtype == scale_dtype and all(native.serves(n, k, 4, g, dt, scale_dtype) for dt in DTYPES)
    monkeypatch.delenv(native.SLICED_ROWS_ENV, raising=False)
    assert native.decode_rows(n, k, 0) >= 17 and native.rows_served(n, k, 0) < 65
    fold = native.make_plan(1, n, k, nwn=1, splits=1, cluster=False, xfull=True, fold=True)
    families = [(m, "rule", contextlib.nullcontext, "gemv") for m in (1, 7, 16, 17)]
    families.append((1, "fold", lambda: native.plan_override(lambda *a: fold), "gemv"))
    for m in (33, 64):
        mma = gemm.make_plan(m, n, k, nwn=8, splits=1, stages=4)
        families += [(m, "rule", contextlib.nullcontext, "gemm"), (m, "mma.sync", lambda q=mma: gemm.plan_override(lambda *_: q), "gemm")]
    if case == SCALE_DTYPE_CASES[0]:
        families += [(m, "triton", contextlib.nullcontext, None) for m in (65, 257)]
    launches = _record_launches(monkeypatch)
    for dtype in DTYPES:
        bias = rand(n, dtype=dtype, seed=4)
        for m, what, override, kind in families:
            x = rand(m, k, dtype=dtype, seed=m + 40)
            b = bias if m % 2 else None
            launches.clear()
            with override():
                y = w.mm(x, b)
            assert launches == ([(kind, m)] if kind else []), f"{what} M={m}: launches {launches}"
            check(y, x, nw.w64, b, f"{_id(case)} {scale_dtype} scales, {dtype} x, M={m} {what}")


def test_choose_picks_native_on_this_gpu():
    case = Case("gptq", 4, 128, False, False, "v2", 256, 512)
    iq = random_int_quantized(case, torch.Generator().manual_seed(0))
    c = pack(case, iq)
    c = dataclasses.replace(c, **{f.name: getattr(c, f.name).cuda() for f in dataclasses.fields(c) if isinstance(getattr(c, f.name), torch.Tensor)})
    w = FORMATS["gptq"].prepare(c, dtype=torch.float16)
    assert w.choice.lowering.name == "native_w4a16", w.choice.explain()
    # prepared for the native lowering: qweight in column slabs (the checkpoint's words reordered)
    assert w.qweight.shape == (8, 64, 32) and torch.equal(flat_qweight(w.qweight), c.qweight)
    assert native.warmup(w) >= 1
    x = rand(3, 512, dtype=torch.float16)
    check(w.mm(x), x, iq.dequantize().double().cuda(), None, "chosen")


def _decode_plans(m, n, k):
    """The rule's decode plan at m rows and, at m <= 16, its shared-memory ring and a split through the workspace."""
    plans = [native.plan(m, n, k, 0)]
    if m <= 16:
        for fields in (dict(nwn=4, splits=1, cluster=False, xfull=True, smem_ring=4), dict(nwn=2, splits=3, cluster=False, xfull=False)):
            try:
                plans.append(native.make_plan(m, n, k, minb=1 if m > 8 else 2, smem_limit=native.smem_optin_bytes(0), **fields))
            except ValueError:
                pass
    return plans


# GEMM builds at 33..64 rows: mma.sync, wgmma with x per tile and with x permuted once (one and two
# 16-column tiles a warp), x in natural K order, the rotated K order, a split through the workspace.
SLAB_GEMM_PLANS = [dict(nwn=8, splits=1, stages=4), dict(nwn=8, splits=1, stages=4, wgmma=True),
                   dict(nwn=8, splits=1, stages=4, wgmma=True, xpre=True), dict(nwn=8, splits=1, stages=4, minb=2, tw=1, wgmma=True, xpre=True),
                   dict(nwn=8, splits=1, stages=4, wgmma=True, xnat=True), dict(nwn=4, splits=3, stages=4, wgmma=True, krot=True)]


@pytest.mark.parametrize("case", [("gptq", 4096, 4096, 128, False, False, "v2"), ("gptq", 1024, 1000, 128, True, True, "v1"),
                                  ("awq", 2048, 640, -1, False, False, None)], ids=_id)
def test_column_slabs_give_the_flat_forms_bits_on_every_kernel(case):
    """The same words in the other order: every kernel (decode plans, the gated epilogue, each GEMM
    build, the Triton lowering above 64 rows) must give the flat form's output bit for bit, and the
    float64 oracle's within tolerance."""
    fmt, n, k, g, sym, act, ver = case
    flat = native_weight(fmt, n, k, g, sym, act, ver)
    slabs = native_weight(fmt, n, k, g, sym, act, ver, slabs=True)
    wgmma_ok = gemm.wgmma_missing(0) is None
    ran = 0

    def same(what, f, m, dtype, bias=None):
        nonlocal ran
        x = rand(m, k, dtype=dtype, seed=m + 17)
        y = f(slabs.weight, x, bias)
        assert torch.equal(y, f(flat.weight, x, bias)), f"{_id(case)} {dtype} M={m} {what}: slabs differ from flat"
        ran += 1
        return x, y

    for dtype in DTYPES:
        bias = rand(n, dtype=dtype, seed=5)
        for m in (1, 7, 16, 17, 32):
            for p in _decode_plans(m, n, k):
                with native.plan_override(lambda *a, p=p: p):
                    x, y = same(p, lambda w, x, b: w.mm(x, b), m, dtype, bias)
                check(y, x, flat.w64, bias, f"{_id(case)} slabs {dtype} M={m} {p}")
        for m in (1, 16):
            same("glu", lambda w, x, b: native.native_mm(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, 4, g, w.zero_offset, glu=True),
                 m, dtype)
        if k % 8 == 0:
            for fields in SLAB_GEMM_PLANS:
                if fields.get("wgmma") and not wgmma_ok:
                    continue
                for m in (33, 64):
                    try:
                        q = gemm.make_plan(m, n, k, **fields)
                    except ValueError:
                        continue
                    with gemm.plan_override(lambda *_, q=q: q):
                        x, y = same(q, lambda w, x, b: w.mm(x, b), m, dtype, bias if m == 33 else None)
                    check(y, x, flat.w64, bias if m == 33 else None, f"{_id(case)} slabs {dtype} M={m} {q}")
        for m in (65, 257):  # the Triton lowering (the native one delegates)
            x, y = same("triton", lambda w, x, b: w.mm(x, b), m, dtype, bias)
            check(y, x, flat.w64, bias, f"{_id(case)} slabs {dtype} M={m} triton")
    assert ran >= 20


@pytest.mark.parametrize("case", [("gptq", 4096, 4096, 128, False, False, "v2"), ("gptq", 1024, 1000, 128, True, True, "v1"),
                                  ("awq", 2048, 640, -1, False, False, None)], ids=_id)
def test_smem_bulk_ring_matches_the_cp_async_ring_bitwise(case):
    """QOPS_SMEM_BULK (measurements): the shared-memory ring filled by one bulk copy a warp and chunk
    on slab weights (K = 1000: the last chunk's copy is short) gives the cp.async ring's bits, and the
    oracle's values, eagerly and replayed from a CUDA graph; a flat weight is refused naming the form."""
    if not native._device_facts(0)[1]:
        pytest.skip("bulk copies need sm_90")
    fmt, n, k, g, sym, act, ver = case
    flat = native_weight(fmt, n, k, g, sym, act, ver)
    slabs = native_weight(fmt, n, k, g, sym, act, ver, slabs=True)
    for dtype in DTYPES:
        for m in (1, 7, 16):
            for stages in (2, 4):
                ring = native.make_plan(m, n, k, nwn=4 if m <= 8 else 2, splits=1, cluster=False, xfull=True, smem_ring=stages,
                                        minb=2 if m <= 8 else 1, smem_limit=native.smem_optin_bytes(0))
                bulk = dataclasses.replace(ring, smem_bulk=True)
                x = rand(m, k, dtype=dtype, seed=m + stages)
                with native.plan_override(lambda *a: ring):
                    want = slabs.weight.mm(x)
                with native.plan_override(lambda *a: bulk):
                    y = slabs.weight.mm(x)
                    assert torch.equal(y, want), f"{_id(case)} {dtype} M={m} stages={stages}: bulk ring differs from the cp.async ring"
                    check(y, x, flat.w64, None, f"{_id(case)} {dtype} M={m} bulk")
                    if m == 7 and dtype == torch.float16:
                        _check_graph_replays(slabs, m, k, dtype, (2, 3), f"{_id(case)} bulk ring graph")
                        with pytest.raises(ValueError, match="smem_bulk needs qweight in column slabs"):
                            flat.weight.mm(x)


@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 8192), (6144, 4096)], ids=str)
def test_cluster_and_workspace_reductions_agree_bitwise(shape):
    """The rule's plan for each M of CLUSTER_COMPARE_M (1..32: MT = 1..4), its split count taken to a
    cluster size the H200 plans use (2, 4 or 8), forced once summing in a cluster and once through the
    workspace (a decode plan override keeps M = 17..32 on the decode kernel, not the GEMM): bit for
    bit equal, and both equal to the reference."""
    n, k = shape
    sms, cluster_ok = native._device_facts(0)
    if not cluster_ok:
        pytest.skip("thread-block clusters need sm_90")
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    bias = rand(n, dtype=torch.float16, seed=3)
    pairs = native_cluster_pairs(n, k, sms, native.smem_optin_bytes(0))
    if sms == 132:  # an H200's: the rule's own cluster plans are among those compared
        assert [m for m, rule, cl, _ in pairs if rule == cl] == list(RULE_CLUSTER_M[shape]), [(m, rule) for m, rule, _, _ in pairs]
    compared = []
    for m, _, cl, ws in pairs:
        assert cl.cluster and not ws.cluster and cl.splits == ws.splits > 1 and ws.workspace > 0, (m, cl, ws)
        x = rand(m, k, dtype=torch.float16, seed=m)
        with native.plan_override(lambda *a, p=cl: p):
            assert native.plan(m, n, k, 0) == cl
            y_cl = nw.weight.mm(x, bias)
        with native.plan_override(lambda *a, p=ws: p):
            y_ws = nw.weight.mm(x, bias)
        what = f"{shape} M={m} splits={cl.splits}"
        check(y_cl, x, nw.w64, bias, f"{what} cluster")
        check(y_ws, x, nw.w64, bias, f"{what} workspace")
        assert torch.equal(y_cl, y_ws), f"{what}: cluster and workspace sums differ"
        compared.append(m)
    assert compared == list(CLUSTER_COMPARE_M)


def runtime_weight(n, k, seed):
    """Random runtime-layout tensors made on the GPU (a 57344 x 8192 weight packs in seconds), and
    their float64 (N, K) weight decoded as the layout is documented at the top of w4a16_gemv.cu:
    W[n, k] = scale[k/128, n] * (nibble k%8 of qweight[k/8, n] - nibble n%8 of qzeros[k/128, n/8])."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, device="cuda", dtype=torch.uint8)
    z = torch.randint(0, 16, (k // 128, n), generator=g, device="cuda", dtype=torch.uint8)
    # 2^-7 x (1 + j / 8): exact in fp16 and bf16 alike, so one oracle serves both activation dtypes
    scales = torch.randint(8, 16, (k // 128, n), generator=g, device="cuda").float().mul_(2.0 ** -10)

    def words(nib):  # eight nibbles along dim 1 -> one u32 word (kept as int32), nibble i at bits 4i
        shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int64)
        w = (nib.to(torch.int64) << shifts.view(1, 8, 1)).sum(1)
        return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()

    qweight = words(q.view(k // 8, 8, n))
    qzeros = words(z.view(k // 128, n // 8, 8).transpose(1, 2))
    w64 = (q.double().view(k // 128, 128, n) - z.double().view(k // 128, 1, n)) * scales.double().view(k // 128, 1, n)
    return qweight, scales, qzeros, w64.view(k, n).t()


def _table_entries():
    if not torch.cuda.is_available():
        return []
    table = native.plan_tables().get(torch.cuda.get_device_name(0))
    return table["plans"] if table and table["sms"] == native._device_facts(0)[0] else []


def test_plan_table_entries_match_reference_on_their_own_shapes(monkeypatch):
    """Every entry of this GPU's plan table (qops/native/plans/) is the plan the op takes, and gives
    the right answer at the smallest and largest M it covers, in fp16 and bf16, at its real shape."""
    entries = _table_entries()
    if not entries:
        pytest.skip(f"no plan table for {torch.cuda.get_device_name(0)} with {native._device_facts(0)[0]} SMs")
    monkeypatch.delenv(native.PLANS_ENV, raising=False)
    for (n, k) in sorted({(e["n"], e["k"]) for e in entries}):
        qweight, scales, qzeros, w64 = runtime_weight(n, k, seed=n + k)
        for e in (e for e in entries if (e["n"], e["k"]) == (n, k)):
            for m in sorted({e["m_min"], e["m_max"]}):
                p = native.plan(m, n, k, 0)
                assert p == native.make_plan(m, n, k, **e["plan"]), (e, p)
                for dtype in DTYPES:
                    x = rand(m, k, dtype=dtype, seed=m)
                    y = native.native_mm(x, qweight, scales.to(dtype), qzeros, None, None, 4, 128, 0)  # scales exact in dtype
                    check(y, x, w64, None, f"table {n}x{k} M={m} {dtype} {p}")
        del qweight, scales, qzeros, w64
        torch.cuda.empty_cache()


PLAN_VARIANTS = [  # (nwn, splits, cluster, xfull, ring, minb, fold, prefetch): every kernel knob the plans or the sweep use
    (1, 1, False, True, 0, 2, False, 0), (1, 1, False, False, 0, 2, False, 0), (2, 2, True, True, 0, 2, False, 0),
    (2, 2, False, True, 3, 2, False, 0), (4, 3, False, True, 2, 2, False, 0), (1, 3, True, False, 4, 1, False, 0),
    (2, 4, False, False, 0, 1, False, 0), (1, 2, True, True, 4, 1, False, 0),
    (1, 1, False, True, 0, 2, True, 0), (2, 2, True, True, 0, 1, True, 4), (4, 3, False, True, 2, 2, True, 8), (4, 1, False, True, 0, 1, True, 2),
    (2, 4, False, False, 0, 1, False, 4), (1, 2, True, False, 0, 2, False, 16),
    # M = 17..32 (MT 3, 4; one block per SM): the widest tile, nwn 2, the 3-deep ring, x staged once
    (8, 1, False, False, 0, 1, False, 2), (8, 3, False, False, 3, 1, False, 0), (8, 2, True, False, 0, 1, False, 4),
    (4, 2, True, False, 3, 1, False, 2), (2, 1, False, False, 0, 1, False, 0), (2, 4, False, True, 0, 1, False, 0),
    # the shared-memory weight ring (9th field: stages; x staged once): the M = 1 plans of 28672 x 4096
    # (fold) and 4096 x 14336 (cluster), a workspace, more stages than iterations, MT = 2, 11 stages (the most that fit)
    (4, 1, False, True, 0, 1, True, 0, 8), (1, 2, True, True, 0, 1, False, 0, 4), (1, 3, False, True, 0, 2, False, 2, 2),
    (2, 1, False, True, 0, 1, True, 0, 10), (8, 1, False, True, 0, 1, False, 0, 6), (4, 2, False, True, 0, 2, False, 4, 5),
    (1, 1, False, True, 0, 1, False, 0, 11),
]


def _variant_id(v):
    return "nwn{}-s{}-{}-{}-ring{}-minb{}{}-pf{}".format(
        v[0], v[1], "cl" if v[2] else "ws", "xfull" if v[3] else "xstaged", v[4], v[5], "-fold" if v[6] else "", v[7]) + (
        f"-smem{v[8]}" if len(v) > 8 and v[8] else "")


@pytest.mark.parametrize("variant", PLAN_VARIANTS, ids=_variant_id)
def test_every_plan_variant_matches_reference(variant):
    nwn, splits, cluster, xfull, ring, minb, fold, prefetch = variant[:8]
    smem_ring = variant[8] if len(variant) > 8 else 0
    if cluster and not native._device_facts(0)[1]:
        pytest.skip("thread-block clusters need sm_90")
    ran = 0
    for fmt, n, k, g, sym, ver in [("gptq", 1000, 777, 128, False, "v1"), ("gptq", 512, 2048, 128, True, "v2"), ("awq", 640, 1280, -1, False, None)]:
        nw = native_weight(fmt, n, k, g, sym, False, ver)
        for m in (1, 7, 16, 17, 24, 32):
            try:
                p = native.make_plan(m, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull, ring=ring, minb=minb, fold=fold,
                                     prefetch=prefetch, smem_ring=smem_ring, smem_limit=native.smem_optin_bytes(0))
            except ValueError:  # outside the kernel's limits for this M (make_plan says which)
                continue
            ran += 1
            for dtype in DTYPES:
                x = rand(m, k, dtype=dtype, seed=m)
                bias = rand(n, dtype=dtype, seed=5) if m in (7, 24) else None
                with native.plan_override(lambda *a, p=p: p):
                    y = nw.weight.mm(x, bias)
                check(y, x, nw.w64, bias, f"{fmt} {n}x{k} M={m} {dtype} {p}")
    assert ran >= 3, f"the variant fits only {ran} (shape, M) cases: make_plan refused the rest (3 to 18 on an H200)"


# The decode kernel's warpgroup-MMA builds (QOPS_WGMMA): (nwn, splits, cluster). The widest tile (the
# M <= 16 plans'), two warpgroups along K (nwn 4: on K = 777, 7 chunks, the second warpgroup has no
# chunk in the last iteration and runs its MMAs on the first chunk's x, its sums dropped), a cluster,
# the workspace.
WGMMA_PLANS = [(8, 1, False), (4, 1, False), (8, 2, True), (4, 3, False), (8, 2, False)]


def _wgmma_plan(m, n, k, nwn, splits, cluster):
    return native.make_plan(m, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=True, minb=1 if m > 16 else 2, wgmma=True,
                            smem_limit=native.smem_optin_bytes(0))


@pytest.mark.parametrize("variant", WGMMA_PLANS, ids=lambda v: "nwn{}-s{}-{}".format(v[0], v[1], "cl" if v[2] else "ws"))
def test_wgmma_plans_match_reference(variant):
    """Every tile height (M = 1 .. 32), both dtypes, zeros or not, act-order, a bias, K off the chunk grid,
    and x rows that are not 16-byte aligned (the scalar x path of the image staging)."""
    if (why := gemm.wgmma_missing(0)) is not None:
        pytest.skip(why)
    nwn, splits, cluster = variant
    ran = 0
    for fmt, n, k, g, sym, act, ver in [("gptq", 1000, 777, 128, False, False, "v1"), ("gptq", 512, 2048, 128, True, False, "v2"),
                                        ("awq", 640, 1280, -1, False, False, None), ("gptq", 1024, 2048, 128, False, True, "v1")]:
        nw = native_weight(fmt, n, k, g, sym, act, ver)
        for m in (1, 7, 9, 16, 17, 24, 32):
            try:
                p = _wgmma_plan(m, n, k, nwn, splits, cluster)
            except ValueError:  # outside the kernel's limits for this M (make_plan says which)
                continue
            ran += 1
            for dtype in DTYPES:
                for layout in (("contiguous", "offset") if m in (9, 16) else ("contiguous",)):
                    x = _x(m, k, dtype, layout, seed=m)
                    bias = rand(n, dtype=dtype, seed=5) if m in (7, 16) else None
                    with native.plan_override(lambda *a, p=p: p):
                        y = nw.weight.mm(x, bias)
                    check(y, x, nw.w64, bias, f"{fmt} {n}x{k} M={m} {dtype} {layout} {p}")
    assert ran >= 20, f"the wgmma plan fits only {ran} (shape, M) cases: make_plan refused the rest (24 to 28 on an H200)"


def test_wgmma_cluster_and_workspace_agree_bitwise_and_repeat():
    """The two split-K sums of the wgmma build agree bit for bit, and a second run gives the same bits."""
    if (why := gemm.wgmma_missing(0)) is not None:
        pytest.skip(why)
    n, k = 4096, 4096
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    for m in (9, 16):
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        ys = []
        for cluster in (True, False, True):
            p = _wgmma_plan(m, n, k, 8, 2, cluster)
            with native.plan_override(lambda *a, p=p: p):
                ys.append(nw.weight.mm(x))
        check(ys[0], x, nw.w64, None, f"wgmma M={m}")
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), f"M={m}: wgmma sums differ between reductions or runs"


def test_wgmma_gated_output_and_cuda_graph():
    """The gated output (silu(gate) * up, no zeros) and a CUDA-graph replay of a wgmma build after warm-up."""
    if (why := gemm.wgmma_missing(0)) is not None:
        pytest.skip(why)
    n, k = 2048, 1024
    nw = native_weight("gptq", n, k, 128, True, version="v1")
    p = _wgmma_plan(16, n, k, 8, 2, True)
    x = rand(16, k, dtype=torch.float16, seed=2)
    with native.plan_override(lambda *a, p=p: p):
        w = nw.weight
        y = native.native_mm(x, w.qweight, w.scales, w.qzeros, None, None, 4, 128, w.zero_offset, glu=True)
        want = glu_reference(x, nw.w64)
        assert rel_err(y, want) < TOL[torch.float16], rel_err(y, want)
        native.warmup(nw.weight, torch.float16, max_m=16)
        _check_graph_replays(nw, 16, k, torch.float16, (3, 4), f"wgmma graph {p}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_keeps_the_precision_of_the_exact_path_on_offset_activations(dtype):
    """Folding subtracts the dequantization bias (1024 or 128 times the x sums) after the MMA: the
    worst case for its cancellation is activations of one sign. Within 2x of the exact path's error
    (which is the output rounding) and within the tolerance."""
    n, k = 1024, 4096
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    errs = {}
    for fold in (False, True):
        p = native.make_plan(4, n, k, nwn=1, splits=1, cluster=False, xfull=True, fold=fold)
        x = (rand(4, k, dtype=torch.float32, seed=7) + 3.0).to(dtype)
        with native.plan_override(lambda *a, p=p: p):
            y = nw.weight.mm(x)
        check(y, x, nw.w64, None, f"fold={fold}")
        errs[fold] = rel_err(y, reference(x, nw.w64))
    assert errs[True] <= 2 * errs[False] + 1e-4, errs


def test_out_variant_with_workspace_and_strided_out():
    nw = native_weight("gptq", 1024, 2048, 128, False, version="v2")
    w = nw.weight
    for m in (1, 5, 16, 32, 40):
        x = rand(m, 2048, dtype=torch.bfloat16, seed=m)
        big = torch.full((m, 1100), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = big[:, 7:1031]
        need = native.workspace_bytes(m, 1024, 2048, 4, 128)
        ws = torch.full((max(need, 1),), 255, dtype=torch.uint8, device="cuda")  # garbage scratch
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size,
                                         w.zero_offset, int(w.kernel), out, ws)
        check(out, x, nw.w64, None, f"out M={m}")
        assert bool(big[:, :7].isnan().all()) and bool(big[:, 1031:].isnan().all()), "wrote outside out"
        out2 = torch.full((m, 1024), float("nan"), dtype=torch.bfloat16, device="cuda").t().contiguous().t()
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size,
                                         w.zero_offset, int(w.kernel), out2, None)
        check(out2, x, nw.w64, None, f"column-major out M={m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_act_order_x_is_gathered_into_the_workspace(dtype, monkeypatch):
    """With an act_perm, x gathered through it lands at the start of the caller's workspace (both gather routes:
    the switch set to 32 rows' worth here, so direct below 32 rows, transposed from 32), the split partials after it; the call allocates nothing, a CUDA
    graph of it replays on new x, and a workspace sized without act_order is refused by name."""
    n, k = 1024, 2048
    nw = native_weight("gptq", n, k, 128, False, act_order=True, version="v2")
    w = nw.weight
    assert w.act_perm is not None
    monkeypatch.setattr(x_gather, "TRANSPOSED_FROM_MK", 32 * k)
    for m in (1, 5, 16, 23, 32, 40, 64):  # decode kernel, then (from decode_rows) the GEMM
        x = rand(m, 2 * k, dtype=dtype, seed=m)[:, ::2]  # K-strided: the gather reads it in place
        need = native.workspace_bytes(m, n, k, 4, 128, 0, act_order=True)
        assert need >= m * k * x.element_size(), m
        ws = torch.full((need,), 255, dtype=torch.uint8, device="cuda")
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        args = (w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel))
        torch.ops.qops.mm_int_weight_out(x, *args, out, ws)
        check(out, x, nw.w64, None, f"{dtype} M={m}")
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.ops.qops.mm_int_weight_out(x, *args, out, ws)  # (an index_select of x would allocate here)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocated, f"M={m}: the call allocated"
        gathered = ws[: m * k * x.element_size()].view(dtype).view(m, k)
        assert torch.equal(gathered, x[:, w.act_perm.long()]), f"M={m}: the workspace does not start with x[:, act_perm]"
        small = native.workspace_bytes(m, n, k, 4, 128, 0)
        with pytest.raises(ValueError, match="workspace holds"):
            torch.ops.qops.mm_int_weight_out(x, *args, out, torch.empty(small, dtype=torch.uint8, device="cuda"))
        xs = torch.empty_like(x)
        xs.copy_(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qops.mm_int_weight_out(xs, *args, out, ws)
        for seed in (100 + m, 200 + m):
            xs.copy_(rand(m, k, dtype=dtype, seed=seed))
            out.fill_(float("nan"))
            g.replay()
            check(out, xs, nw.w64, None, f"replay {dtype} M={m} seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
def test_activation_layouts_and_bias_dtypes(act_order, dtype):
    """x in every layout the op takes, with a bias of x's dtype (stored as is), of fp32 and of the
    other half type (both added in fp32: the kernel's _BIAS_F32 path), and a strided one."""
    nw = native_weight("gptq", 512, 1000, 128, True, act_order=act_order, version="v2")
    w = nw.weight
    k = 1000
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    layouts = {
        "3d": rand(2, 3, k, dtype=dtype),
        "transposed": rand(k, 5, dtype=dtype).t(),
        "strided": rand(4, 2 * k, dtype=dtype)[:, ::2],
        "offset": rand(3, k + 3, dtype=dtype)[:, 3:],
        "broadcast": rand(1, k, dtype=dtype).expand(6, k),
        "1d": rand(k, dtype=dtype),
    }
    biases = (None, rand(512, dtype=dtype), rand(512, dtype=torch.float32), rand(512, dtype=other), rand(1024, dtype=dtype)[::2])
    for name, x in layouts.items():
        for bias in biases:
            check(w.mm(x, bias), x, nw.w64, bias, f"{name} {dtype} bias={None if bias is None else bias.dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_inputs(dtype, monkeypatch):
    """No rows (x of (0, K) and (2, 0, K)) through every entry: mm with and without a bias (of x's
    dtype and fp32), mm_int_weight_out with and without a workspace, mm_int_weight_swiglu and its
    _out. Each output has the op's shape and x's dtype, and nothing is launched."""
    n, k = 256, 512
    nw = native_weight("gptq", n, k, 128, True, version="v1")
    w = nw.weight
    args = (w.qweight, w.scales, w.qzeros, w.act_perm)
    tail = (w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel))
    launches = _record_launches(monkeypatch)
    for lead in ((0,), (2, 0)):
        x = torch.empty(*lead, k, dtype=dtype, device="cuda")
        for bias in (None, rand(n, dtype=dtype, seed=1), rand(n, dtype=torch.float32, seed=2)):
            y = w.mm(x, bias)
            assert y.shape == (*lead, n) and y.dtype == dtype, (lead, bias)
            out = torch.empty(*lead, n, dtype=dtype, device="cuda")
            for ws in (None, torch.full((64,), 255, dtype=torch.uint8, device="cuda")):
                torch.ops.qops.mm_int_weight_out(x, *args, bias, *tail, out, ws)
        g = torch.ops.qops.mm_int_weight_swiglu(x, *args, *tail)
        assert g.shape == (*lead, n // 2) and g.dtype == dtype, lead
        out = torch.empty(*lead, n // 2, dtype=dtype, device="cuda")
        for ws in (None, torch.full((64,), 255, dtype=torch.uint8, device="cuda")):
            torch.ops.qops.mm_int_weight_swiglu_out(x, *args, *tail, out, ws)
    assert launches == [], launches


def test_deterministic_run_to_run():
    for shape, m in (((4096, 4096), 16), ((1024, 8192), 1), ((1000, 777), 7), ((4096, 4096), 32), ((1024, 8192), 25)):
        nw = native_weight("gptq", *shape, 128, False, version="v2")
        x = rand(m, shape[1], dtype=torch.bfloat16, seed=5)
        first = nw.weight.mm(x)
        for _ in range(20):
            assert torch.equal(nw.weight.mm(x), first), f"{shape} M={m} changed between runs"


def test_deterministic_mode_serves_large_m(monkeypatch):
    nw = native_weight("gptq", 1024, 2048, 128, False, version="v2")
    monkeypatch.setenv(native.DETERMINISTIC_ENV, "1")
    assert native.warmup(nw.weight, torch.float16) >= 1
    try:
        for m in (150, 72):
            x = rand(m, 2048, dtype=torch.float16, seed=6)
            y = nw.weight.mm(x)
            check(y, x, nw.w64, None, f"deterministic M={m}")
            assert torch.equal(nw.weight.mm(x), y)
            assert torch.equal(y[64:128], nw.weight.mm(x[64:128])), "64-row slices are independent GEMM launches"
            assert torch.equal(y[128:], nw.weight.mm(x[128:])), "the short last slice is a launch of its own"
        odd = native_weight("gptq", 1000, 777, 128, False, version="v1")  # K % 8 != 0: no GEMM, 32-row decode slices
        x = rand(72, 777, dtype=torch.bfloat16, seed=7)
        y = odd.weight.mm(x)
        check(y, x, odd.w64, None, "deterministic M=72, K=777")
        assert torch.equal(odd.weight.mm(x), y) and torch.equal(y[32:64], odd.weight.mm(x[32:64]))
    finally:
        monkeypatch.delenv(native.DETERMINISTIC_ENV)
        native.read_deterministic()


def _native_launches(m: int, last: int) -> list[tuple[str, int]]:
    """The launches the lowering makes for m rows it serves: one up to 64 rows, else 64-row slices and the rest."""
    step = gemm.MAX_M if m > native.MAX_M else native.MAX_M
    return [("gemv" if r <= last else "gemm", r) for r in (min(step, m - r0) for r0 in range(0, m, step))]


def _record_launches(monkeypatch) -> list:
    launches = []
    real, real_gemm = native._launch, gemm.launch
    monkeypatch.setattr(native, "_launch", lambda x2, *a: (launches.append(("gemv", x2.shape[0])), real(x2, *a))[1])
    monkeypatch.setattr(gemm, "launch", lambda p, x2, *a: (launches.append(("gemm", x2.shape[0])), real_gemm(p, x2, *a))[1])
    return launches


def test_large_m_runs_in_slices_then_goes_to_triton(monkeypatch):
    """One decode launch up to decode_rows (32; on Hopper 23 for this weight, 16 for one of 2^25
    elements), one GEMM launch from there to 64 rows (the weight read once either way), then 64-row
    slices and a launch for the rest up to rows_served (this GPU's SLICED_ROWS on Hopper), above that triton."""
    monkeypatch.delenv(native.SLICED_ROWS_ENV, raising=False)
    launches = _record_launches(monkeypatch)
    hopper = gemm.wgmma_missing(0) is None
    for n, k, last in ((1024, 2048, 23 if hopper else 32), (8192, 4096, 16 if hopper else 32)):
        assert native.decode_rows(n, k, 0) == last
        served = native.rows_served(n, k, 0)
        table = native.sliced_rows_table(torch.cuda.get_device_name(0))
        assert served == (max(next(r for size, r in table if n * k >= size), gemm.MAX_M) if hopper else gemm.MAX_M)
        nw = native_weight("gptq", n, k, 128, False, version="v2")
        bias = rand(n, dtype=torch.float16, seed=8)
        for m in sorted({16, 17, 23, 24, 32, 33, 64, 65, 96, served, served + 1}):
            want = _native_launches(m, last) if m <= served else []
            launches.clear()
            x = rand(m, k, dtype=torch.float16, seed=7)
            y = nw.weight.mm(x, bias)
            check(y, x, nw.w64, bias, f"{n}x{k} M={m}")
            assert launches == want, f"{n}x{k} M={m}: native launches {launches}, expected {want}"


def test_slices_past_64_rows(monkeypatch):
    """Slices forced to 200 rows: 64-row GEMM launches and a decode launch (or GEMM) for the rest, each
    slice the same bits as a call of its rows alone, the scratch workspace_bytes sizes enough, bf16 too."""
    if (why := gemm.wgmma_missing(0)) is not None:
        pytest.skip(f"the slices past 64 rows are the wgmma GEMM's: {why}")
    launches = _record_launches(monkeypatch)
    monkeypatch.setenv(native.SLICED_ROWS_ENV, "200")
    nw = native_weight("gptq", 1024, 2048, 128, False, version="v2")
    last = native.decode_rows(1024, 2048, 0)
    for m, dtype in ((150, torch.float16), (200, torch.bfloat16), (129, torch.float16)):
        x = rand(m, 2048, dtype=dtype, seed=9)
        ws = torch.full((max(native.workspace_bytes(m, 1024, 2048, 4, 128, 0), 1),), 255, dtype=torch.uint8, device="cuda")
        w = nw.weight
        y = torch.empty(m, 1024, dtype=dtype, device="cuda")
        launches.clear()
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size,
                                         w.zero_offset, int(w.kernel), y, ws)
        assert launches == _native_launches(m, last), f"M={m}: {launches}"
        check(y, x, nw.w64, None, f"sliced M={m} {dtype}")
        assert torch.equal(y[64:128], nw.weight.mm(x[64:128])), "64-row slices are independent GEMM launches"
        assert torch.equal(y[128:], nw.weight.mm(x[128:])), "the last slice is a launch of its own"
    launches.clear()
    x = rand(201, 2048, dtype=torch.float16, seed=9)
    check(nw.weight.mm(x), x, nw.w64, None, "M=201, past the forced limit")
    assert launches == [], "past rows_served the call goes to triton"


GEMM_PLANS = [  # (nwn, splits, stages, minb, wgmma, tw): the rule's tile, every other width, the workspace path, pipeline
    # depths, two blocks an SM; warpgroup MMAs at both widths they take, split and not, shallow and deep; one
    # 16-column tile a warp (two blocks an SM at any M), with and without warpgroup MMAs
    (8, 1, 4, 1, 0, 2), (1, 1, 2, 1, 0, 2), (2, 2, 3, 1, 0, 2), (4, 1, 4, 1, 0, 2), (8, 3, 4, 1, 0, 2), (8, 1, 2, 1, 0, 2),
    (4, 5, 6, 1, 0, 2), (8, 1, 3, 2, 0, 2),
    (8, 1, 4, 1, 1, 2), (4, 1, 4, 1, 1, 2), (4, 5, 2, 1, 1, 2), (8, 3, 6, 1, 1, 2),
    (8, 1, 3, 2, 0, 1), (4, 2, 2, 2, 0, 1), (2, 1, 2, 1, 0, 1), (8, 1, 4, 2, 1, 1), (8, 3, 2, 2, 1, 1), (4, 1, 4, 1, 1, 1),
    # wgmma = 2: x through cp.async with the weight in natural K order (xnat), split and not, both widths
    (8, 1, 4, 1, 2, 2), (4, 5, 4, 1, 2, 2), (8, 3, 6, 1, 2, 2), (4, 1, 2, 1, 2, 2),
]


@pytest.mark.parametrize("variant", GEMM_PLANS, ids=lambda v: "nwn{}-s{}-st{}-minb{}-wgmma{}-tw{}".format(*v))
def test_every_gemm_plan_matches_reference(variant):
    nwn, splits, stages, minb, wgmma, tw = variant
    _check_gemm_plan(variant, nwn=nwn, splits=splits, stages=stages, minb=minb, wgmma=bool(wgmma), tw=tw, xnat=wgmma == 2)


# K loops rotated by column tile: mma.sync and wgmma, split (the rotation inside each split's range,
# whose last group is partial at K = 1000) and not.
KROT_PLANS = [dict(nwn=8, splits=1, stages=4, wgmma=True), dict(nwn=4, splits=5, stages=4, wgmma=True),
              dict(nwn=8, splits=3, stages=3, wgmma=False), dict(nwn=8, splits=1, stages=4, wgmma=True, xnat=True)]


@pytest.mark.parametrize("fields", KROT_PLANS, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_rotated_k_gemm_plans_match_reference(fields):
    _check_gemm_plan(fields, krot=True, **fields)


# The GEMM below 33 rows (every row routed to it, as Hopper's routing does from 17 or 24), with two
# blocks an SM where the build fits 128 registers (make_plan), split and not, both widths, xnat.
SMALL_M_GEMM_PLANS = [dict(nwn=8, splits=1, stages=4, wgmma=True), dict(nwn=8, splits=2, stages=4, minb=2, wgmma=True),
                      dict(nwn=4, splits=1, stages=4, minb=2, wgmma=True), dict(nwn=8, splits=3, stages=3, minb=2, wgmma=True, xnat=True),
                      dict(nwn=8, splits=2, stages=3, wgmma=False)]


@pytest.mark.parametrize("fields", SMALL_M_GEMM_PLANS, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_gemm_below_33_rows_matches_reference(fields, monkeypatch):
    monkeypatch.setattr(native, "decode_rows", lambda *a: 0)  # every row to the GEMM
    _check_gemm_plan(fields, ms=(1, 8, 16, 17, 32), **fields)


# x permuted once per call into the workspace (xpre): one tile width's and the other's, split (the
# image after the partials) and not, the fewest stages (one ahead) and the most that fit at M = 64,
# and one 16-column tile a warp.
XPRE_PLANS = [dict(nwn=8, splits=1, stages=4), dict(nwn=8, splits=1, stages=6), dict(nwn=4, splits=5, stages=4),
              dict(nwn=8, splits=3, stages=3), dict(nwn=4, splits=1, stages=3),
              # one 16-column tile a warp, two blocks an SM (not run on a GPU yet: stop 31's last change)
              dict(nwn=8, splits=1, stages=4, minb=2, tw=1), dict(nwn=4, splits=3, stages=3, minb=2, tw=1)]


@pytest.mark.parametrize("fields", XPRE_PLANS, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_gemm_x_image_plans_match_reference(fields):
    _check_gemm_plan(fields, wgmma=True, xpre=True, **fields)


@pytest.mark.parametrize("fields", XPRE_PLANS[:3] + XPRE_PLANS[5:], ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_gemm_x_image_below_33_rows_matches_reference(fields, monkeypatch):
    monkeypatch.setattr(native, "decode_rows", lambda *a: 0)  # every row to the GEMM
    _check_gemm_plan(fields, ms=(1, 8, 17, 32), wgmma=True, xpre=True, **fields)


# Warp-specialized (ws: a producer warp, stages handed over through mbarriers): both widths, split
# (the image after the partials) and not, the fewest and most stages, stages reused many times
# (K = 4096 at 3 stages: 32 iterations) and fewer iterations than stages (K = 640 at 6).
# One, two and four producer warps; two wgmma groups in flight (four fragment buffers).
WS_PLANS = [dict(nwn=8, splits=1, stages=6, ws=1), dict(nwn=4, splits=5, stages=4, ws=2), dict(nwn=8, splits=3, stages=3, ws=4),
            dict(nwn=4, splits=1, stages=3, ws=4), dict(nwn=8, splits=1, stages=5, ws=2), dict(nwn=8, splits=2, stages=4, ws=4, wgdepth=2),
            dict(nwn=4, splits=1, stages=4, ws=4, wgdepth=2)]


@pytest.mark.parametrize("fields", WS_PLANS, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_gemm_warp_specialized_plans_match_reference(fields):
    _check_gemm_plan(fields, wgmma=True, xpre=True, **fields)


# Below 33 rows: one and two producers, and four (measured 1.05-1.11x faster than xpre there on three large
# shapes at 26af5f6, not yet in the rule), split and not.
WS_PLANS_BELOW_33 = WS_PLANS[:2] + [dict(nwn=8, splits=1, stages=4, ws=4), dict(nwn=4, splits=4, stages=4, ws=4)]


@pytest.mark.parametrize("fields", WS_PLANS_BELOW_33, ids=lambda f: "-".join(f"{k}{int(v)}" for k, v in f.items()))
def test_gemm_warp_specialized_below_33_rows_matches_reference(fields, monkeypatch):
    monkeypatch.setattr(native, "decode_rows", lambda *a: 0)  # every row to the GEMM
    _check_gemm_plan(fields, ms=(1, 8, 17, 32), wgmma=True, xpre=True, **fields)


def test_gemm_warp_specialized_gives_the_xpre_builds_bits():
    """Same fragments, same MMAs in the same order: only who copies the stages differs, so the output
    is the xpre build's bit for bit (split and not, both dtypes, zeros and none, a partial last chunk)."""
    if why := gemm.wgmma_missing(torch.cuda.current_device()):
        pytest.skip(why)
    ran = 0
    for fmt, n, k, g, sym in (("gptq", 1000, 1000, 128, False), ("gptq", 4096, 4096, 128, True), ("awq", 2048, 640, -1, False)):
        nw = native_weight(fmt, n, k, g, sym, False, "v2" if fmt == "gptq" else None)
        for dtype in DTYPES:
            for m, nwn, splits in ((64, 8, 1), (48, 4, 2), (33, 8, 3)):
                x = rand(m, k, dtype=dtype, seed=m + splits)
                ys = []
                for ws, depth in ((0, 1), (1, 1), (4, 1), (4, 2)):
                    q = gemm.make_plan(m, n, k, nwn=nwn, splits=min(splits, -(-k // 128)), stages=4, wgmma=True, xpre=True, ws=ws,
                                       wgdepth=depth)
                    with gemm.plan_override(lambda *_, q=q: q):
                        ys.append(nw.weight.mm(x))
                for what, y in zip(("ws=1", "ws=4", "ws=4 wgdepth=2"), ys[1:]):
                    assert torch.equal(ys[0], y), f"{fmt} {n}x{k} {dtype} M={m} nwn={nwn} splits={splits}: {what} differs from xpre"
                check(ys[2], x, nw.w64, None, f"ws {fmt} {n}x{k} {dtype} M={m}")
                ran += 1
    assert ran == 18


@pytest.mark.parametrize("ws", [0, 4], ids=["xpre", "ws4"])
def test_gemm_x_image_chain_in_a_cuda_graph_on_one_workspace(ws):
    """Two xpre GEMMs back to back in a CUDA graph on one caller's workspace, the second's x computed
    from the first's output: the second image may be written only after the first GEMM has read its
    own (the image kernel waits for the launch before it), and must see the x the op before it wrote."""
    if why := gemm.wgmma_missing(torch.cuda.current_device()):
        pytest.skip(why)
    n = k = 2048
    a, b = native_weight("gptq", n, k, 128, False, version="v2"), native_weight("awq", n, k, 128, False)
    m = 64
    q = gemm.make_plan(m, n, k, nwn=8, splits=2, stages=4, wgmma=True, xpre=True, ws=ws)
    x = rand(m, k, dtype=torch.float16, seed=5)
    with gemm.plan_override(lambda *_: q):
        need = native.workspace_bytes(m, n, k, 4, 128, 0)
        assert need == q.workspace and need >= q.x_image > 0
        ws = torch.full((need,), 255, dtype=torch.uint8, device="cuda")
        y1, y2 = (torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in range(2))

        def step():
            torch.ops.qops.mm_int_weight_out(x, a.weight.qweight, a.weight.scales, a.weight.qzeros, a.weight.act_perm, None,
                                             k, 4, 128, a.weight.zero_offset, int(a.weight.kernel), y1, ws)
            torch.ops.qops.mm_int_weight_out(y1 * 0.25, b.weight.qweight, b.weight.scales, b.weight.qzeros, b.weight.act_perm, None,
                                             k, 4, 128, b.weight.zero_offset, int(b.weight.kernel), y2, ws)

        step()
        torch.cuda.synchronize()
        check(y1, x, a.w64, None, "first xpre GEMM")
        want2 = y2.clone()
        check(y2, y1 * 0.25, b.w64, None, "second xpre GEMM, x from the first")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for seed in (6, 7):
            x.copy_(rand(m, k, dtype=torch.float16, seed=seed))
            g.replay()
            torch.cuda.synchronize()
            check(y1, x, a.w64, None, f"replayed first xpre GEMM, seed {seed}")
            check(y2, y1 * 0.25, b.w64, None, f"replayed second xpre GEMM, seed {seed}")
            assert not torch.equal(y2, want2)


def _check_gemm_plan(name, wgmma=False, splits=1, ms=(33, 48, 64), **fields):
    if wgmma and (why := gemm.wgmma_missing(torch.cuda.current_device())):
        pytest.skip(why)
    ran = 0
    for fmt, n, k, g, sym, act, ver in (("gptq", 1000, 1000, 128, False, True, "v2"), ("awq", 2048, 640, -1, False, False, None),
                                        ("gptq", 4096, 4096, 128, True, False, "v1")):
        nw = native_weight(fmt, n, k, g, sym, act, ver)
        for dtype in DTYPES:
            for m in ms:
                try:
                    q = gemm.make_plan(m, n, k, splits=min(splits, -(-k // 128)), wgmma=wgmma, **fields)
                except ValueError:
                    continue  # a combination the kernel cannot run (two blocks an SM at M > 40, shared memory)
                x = rand(m, k, dtype=dtype, seed=m + q.nwn)
                bias = rand(n, dtype=torch.float32, seed=3) if m == 33 else None
                with gemm.plan_override(lambda *_: q):
                    y = nw.weight.mm(x, bias)
                    assert torch.equal(nw.weight.mm(x, bias), y), f"{q}: not bit-identical run to run"
                check(y, x, nw.w64, bias, f"{fmt} {n}x{k} g{g} {dtype} M={m} {q}")
                ran += 1
    assert ran >= 6, f"only {ran} cases could run plan {name}"


def test_gemm_out_with_workspace_and_strided_out():
    nw = native_weight("gptq", 4096, 4096, 128, False, version="v2")
    w = nw.weight
    m = 48
    x = rand(m, 4096, dtype=torch.bfloat16, seed=11)
    q = gemm.make_plan(m, 4096, 4096, nwn=4, splits=3, stages=4)
    with gemm.plan_override(lambda *_: q):
        assert native.workspace_bytes(m, 4096, 4096, 4, 128, 0) == q.workspace > 0
        ws = torch.full((q.workspace + 16,), 255, dtype=torch.uint8, device="cuda")[16:]  # exactly the need, 16-byte aligned
        big = torch.full((m, 2 * 4096 + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = big[:, 8:8 + 2 * 4096:2]  # column stride 2: written through a contiguous temporary
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size,
                                         w.zero_offset, int(w.kernel), out, ws)
        check(out, x, nw.w64, None, "GEMM into a strided out with a caller's workspace")
        assert bool(big[:, :8].isnan().all()) and bool(big[:, 9::2].isnan().all()), "wrote outside out"
        with pytest.raises(ValueError, match="workspace"):
            torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits,
                                             w.group_size, w.zero_offset, int(w.kernel), out, ws[: q.workspace - 16])



@pytest.mark.parametrize("splits, wgmma_ws", [(1, None), (3, None), (1, 4), (3, 0)], ids=["mma", "mma-split", "ws4", "xpre-split"])
def test_gemm_into_rows_its_vector_stores_cannot_take(splits, wgmma_ws):
    """The GEMM stores a lane's four columns of a row as one 8-byte store (16 for split partials) where the
    pointers allow; this out starts 4 bytes past an 8-byte boundary and its rows lie N + 6 apart, so every
    row goes through the scalar stores: the same bits as into a contiguous out, bias included."""
    nw = native_weight("gptq", 4096, 4096, 128, False, version="v2")
    w = nw.weight
    m = 48
    x = rand(m, 4096, dtype=torch.bfloat16, seed=12)
    bias = rand(4096, dtype=torch.bfloat16, seed=13)
    if wgmma_ws is None:
        q = gemm.make_plan(m, 4096, 4096, nwn=4, splits=splits, stages=4)
    else:
        if gemm.wgmma_missing(0):
            pytest.skip(gemm.wgmma_missing(0))
        q = gemm.make_plan(m, 4096, 4096, nwn=4, splits=splits, stages=4, wgmma=True, xpre=True, ws=wgmma_ws)
    with gemm.plan_override(lambda *_: q):
        want = w.mm(x, bias)  # contiguous: the vector stores
        big = torch.full((m, 4096 + 6), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = big[:, 2:2 + 4096]
        assert out.data_ptr() % 8 == 4 and out.stride(0) % 4 == 2
        ws = torch.full((max(q.workspace, 16),), 255, dtype=torch.uint8, device="cuda")
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features, w.bits, w.group_size,
                                         w.zero_offset, int(w.kernel), out, ws)
    assert torch.equal(out, want), "scalar and vector stores differ"
    check(out, x, nw.w64, bias, f"GEMM into misaligned rows, {splits} splits")
    assert bool(big[:, :2].isnan().all()) and bool(big[:, 2 + 4096:].isnan().all()), "wrote outside out"

def test_torch_compile_fullgraph():
    nw = native_weight("awq", 1024, 1024, 128, False)
    w = nw.weight
    bias = rand(1024, dtype=torch.float16)

    def f(x):
        y = w.mm(x, bias)
        return y, torch.nn.functional.silu(y)

    cf = torch.compile(f, fullgraph=True, dynamic=False)
    for m in (1, 16, 32, 64):  # the decode kernel, then the GEMM
        x = rand(m, 1024, dtype=torch.float16, seed=m)
        (y, s), (y_ref, s_ref) = cf(x), f(x)
        assert torch.equal(y, y_ref), f"M={m}: the compiled graph must call the same kernel"
        torch.testing.assert_close(s, s_ref)  # Inductor's fused silu may round differently
        check(y, x, nw.w64, bias, f"compiled M={m}")


def _check_graph_replays(nw, m, k, dtype, seeds, what):
    """Capture ``nw.weight.mm`` on a static x of M rows, then for each seed: new x, output poisoned
    with NaN, replay; equal to eager and to the float64 oracle."""
    w = nw.weight
    static_x = rand(m, k, dtype=dtype, seed=1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = w.mm(static_x)
    for seed in seeds:
        x = rand(m, k, dtype=dtype, seed=seed)
        static_x.copy_(x)
        static_y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, w.mm(x)), f"{what}: replay differs from eager"
        check(static_y, x, nw.w64, None, what)


def test_cuda_graph_replay():
    nw = native_weight("gptq", 4096, 4096, 128, False, version="v2")
    native.warmup(nw.weight, torch.float16)  # M = 1..64; M = 96 is triton's, captured as it comes
    for m in (1, 16, 24, 32, 40, 64, 96):
        _check_graph_replays(nw, m, 4096, torch.float16, (2, 3), f"graph M={m}")


@pytest.mark.parametrize("stages", [4, 8])
def test_smem_ring_env_warmup_then_cuda_graph(stages, monkeypatch):
    """QOPS_NATIVE_SMEM_RING gives the x-staged-once plans a shared-memory ring (above 48 KiB: the
    warm-up opts the kernels in, so nothing is set during capture); the graph replays match eager
    and the oracle, at M = 1, 7 (the ring) and 16 (no ring), fp16 and bf16."""
    monkeypatch.setenv(native.SMEM_RING_ENV, str(stages))
    for fmt, n, k, sym, ver in (("gptq", 8192, 4096, False, "v2"), ("gptq", 4096, 14336, True, "v1")):
        nw = native_weight(fmt, n, k, 128, sym, version=ver)
        w = nw.weight
        assert native.plan(1, n, k, 0).smem_ring == stages
        for dtype in DTYPES:
            native.warmup(w, dtype, max_m=16)
            for m in (1, 7, 16):
                _check_graph_replays(nw, m, k, dtype, (2,), f"{n}x{k} {dtype} M={m} smem_ring={native.plan(m, n, k, 0).smem_ring}")


def test_compiled_cuda_graphs_reduce_overhead():
    import torch._inductor.config as iconf

    nw = native_weight("gptq", 1024, 2048, 128, True, version="v1")
    w = nw.weight

    def f(x):
        return w.mm(x) * 2

    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with iconf.patch({"triton.cudagraph_or_error": True}):
        for step in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            x = rand(4, 2048, dtype=torch.float16, seed=step)
            y = cf(x).clone()
            assert torch.equal(y, f(x)), f"step {step}"


def test_capture_of_a_kernel_not_loaded_raises():
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(compiler.NativeNotReadyError, match="Warm up"):
        with torch.cuda.graph(g):
            compiler.get_kernel(0, native.SOURCE, {"QOPS_NEVER_BUILT": 1}, native.GEMV)


def test_pdl_is_on_for_this_gpu(monkeypatch):
    """Says whether the PDL tests below exercise programmatic dependent launch here or only ordinary launches."""
    if not native._sm90(0):
        pytest.skip("programmatic dependent launch needs sm_90")
    monkeypatch.delenv(native.PDL_ENV, raising=False)
    assert native.use_pdl(0)
    if compiler.pdl_missing() is not None:
        pytest.skip(f"launches fall back to ordinary ones: {compiler.pdl_missing()}")


def _producer_then_two_matmuls(w1, w2, a, bias):
    """x = 2 a, y = x @ W1^T + bias, z = y @ W2^T: each native launch sits right behind the kernel
    writing its x; the second one behind a native kernel, which lets it start before its own end."""
    x = a * 2
    y = w1.mm(x, bias)
    return x, y, w2.mm(y)


PDL_PLANS = [  # (nwn, splits, cluster, xfull[, shared-memory ring stages]): direct store, cluster sum, workspace + reduce kernel, both x modes
    (4, 1, False, True), (1, 1, False, False), (2, 2, True, True), (2, 3, False, False), (1, 4, False, True),
    (4, 1, False, True, 8), (2, 2, True, True, 4),
]


@pytest.mark.parametrize("variant", PDL_PLANS, ids=lambda v: "nwn{}-s{}-{}-{}".format(
    v[0], v[1], "cl" if v[2] else "ws", "xfull" if v[3] else "xstaged") + (f"-smem{v[4]}" if len(v) > 4 else ""))
def test_pdl_in_a_cuda_graph_right_after_the_kernel_writing_x(variant, monkeypatch):
    nwn, splits, cluster, xfull = variant[:4]
    smem_ring = variant[4] if len(variant) > 4 else 0
    if cluster and not native._device_facts(0)[1]:
        pytest.skip("thread-block clusters need sm_90")
    w1 = native_weight("gptq", 1024, 2048, 128, False, version="v2")
    w2 = native_weight("awq", 512, 1024, 128, False)
    bias = rand(1024, dtype=torch.float16, seed=9)

    served = set()

    def chosen(m, n, k, sms, cluster_ok):
        try:
            p = native.make_plan(m, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull, smem_ring=smem_ring,
                                 smem_limit=native.smem_optin_bytes(0))
        except ValueError:  # outside the kernel's limits for this shape: the usual plan
            return None
        served.add((m, n))
        return p

    outs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv(native.PDL_ENV, pdl)
        for m in (1, 7, 16, 32):
            static_a = rand(m, 2048, dtype=torch.float16, seed=m)
            with native.plan_override(chosen):
                _producer_then_two_matmuls(w1.weight, w2.weight, static_a, bias)  # compiles and loads every kernel
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    x, y, z = _producer_then_two_matmuls(w1.weight, w2.weight, static_a, bias)
            for rep in range(4):
                static_a.copy_(rand(m, 2048, dtype=torch.float16, seed=100 * rep + m))
                y.fill_(float("nan"))  # a matmul that read x before its producer finished shows here
                z.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                what = f"QOPS_NATIVE_PDL={pdl} M={m} replay {rep}"
                check(y, x, w1.w64, bias, f"first matmul, {what}")
                check(z, y, w2.w64, None, f"second matmul, {what}")
                outs[pdl, m, rep] = (y.clone(), z.clone())
    for (pdl, m, rep), (y, z) in outs.items():
        if pdl == "1":
            y0, z0 = outs["0", m, rep]
            assert torch.equal(y, y0) and torch.equal(z, z0), f"M={m} replay {rep}: PDL changed the result"
    # Every variant fits both matmuls at M = 1 on an H200 (most at 1, 7 and 16): not only the rule's plans ran.
    assert {(1, 1024), (1, 512)} <= served, sorted(served)


def check_glu_plan(nw, p, x):
    """The gated output (silu(gate) * up, no bias) of ``nw`` under plan ``p``, against the float64 oracle."""
    w = nw.weight
    with native.plan_override(lambda *a, p=p: p):
        y = native.native_mm(x, w.qweight, w.scales, w.qzeros, None, None, 4, 128, w.zero_offset, glu=True)
    err = rel_err(y, glu_reference(x, nw.w64))
    assert err < TOL[x.dtype], f"{p} {x.dtype}: relative error {err:.2e}"


def glu_reference(x, w64):
    """silu(gate) * up in float64 from the unfused product (gate columns first, then up)."""
    y = reference(x, w64)
    h = y.shape[-1] // 2
    return torch.nn.functional.silu(y[..., :h]) * y[..., h:]


# (N, K) of fused gate/up weights: N % 8 == 0 (the kernel), N % 8 == 4 (the unfused fallback), K off
# the tile grid; every reduction path is forced below.
GLU_SHAPES = [(1024, 512), (2000, 777), (4096, 4096), (1028, 1280)]
GLU_PLANS = [  # (nwn, splits, cluster, xfull): one block, a cluster of 2, the workspace of 3, the widest tile
    (1, 1, False, True), (2, 2, True, True), (4, 3, False, False), (8, 1, False, True), (8, 4, False, True),
]


@pytest.mark.parametrize("shape", GLU_SHAPES, ids=str)
def test_glu_matches_silu_times_up_of_the_reference(shape):
    n, k = shape
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    w = nw.weight
    for dtype in DTYPES:
        for m in (1, 7, 16, 17, 32, 33):
            x = rand(m, k, dtype=dtype, seed=m)
            y = native.native_mm(x, w.qweight, w.scales, w.qzeros, None, None, 4, 128, w.zero_offset, glu=True)
            want = glu_reference(x, nw.w64)
            assert y.shape == want.shape and y.dtype == dtype
            err = rel_err(y, want)
            assert err < TOL[dtype], f"{shape} M={m} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", GLU_PLANS, ids=lambda v: "nwn{}-s{}-{}-{}".format(v[0], v[1], "cl" if v[2] else "ws", "xfull" if v[3] else "xstaged"))
def test_glu_every_reduction_path(variant):
    nwn, splits, cluster, xfull = variant
    if cluster and not native._device_facts(0)[1]:
        pytest.skip("thread-block clusters need sm_90")
    n, k = 2048, 1536
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    ran = []
    for m in (1, 8, 16, 24):
        try:
            p = native.make_plan(m, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull, minb=1 if m > 16 else 2,
                                 smem_limit=native.smem_optin_bytes(0))
        except ValueError:
            continue
        ran.append(m)
        for dtype in DTYPES:
            x = rand(m, k, dtype=dtype, seed=m + 1)
            check_glu_plan(nw, p, x)
    assert ran == [1, 8, 16, 24], f"make_plan refused the variant at M not in {ran} (it serves all four on an H200)"


def test_glu_in_a_cuda_graph_with_out_and_workspace():
    n, k, m = 4096, 4096, 8
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    w = nw.weight
    assert native.warmup_shape(0, torch.float16, n, k, True, glu=True) >= 1
    x = rand(m, k, dtype=torch.float16, seed=4)
    out = torch.empty(m, n // 2, dtype=torch.float16, device="cuda")
    ws = torch.full((max(native.workspace_bytes(m, n, k, 4, 128, 0), 16),), 255, dtype=torch.uint8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        native.native_mm(x, w.qweight, w.scales, w.qzeros, None, None, 4, 128, w.zero_offset, out=out, workspace=ws, glu=True)
    for seed in (5, 6):
        x.copy_(rand(m, k, dtype=torch.float16, seed=seed))
        out.zero_()
        g.replay()
        err = rel_err(out, glu_reference(x, nw.w64))
        assert err < TOL[torch.float16], f"replay seed {seed}: relative error {err:.2e}"


def test_glu_refuses_a_bias():
    nw = native_weight("gptq", 1024, 512, 128, False, version="v2")
    w = nw.weight
    x = rand(1, 512, dtype=torch.float16)
    with pytest.raises(ValueError, match="no bias"):
        native.native_mm(x, w.qweight, w.scales, w.qzeros, None, rand(1024, dtype=torch.float16), 4, 128, w.zero_offset, glu=True)


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
def test_swiglu_op_eager_compiled_replayed_and_out(act_order):
    """``qops::mm_int_weight_swiglu`` (and ``_out``) through the native lowering's gated kernel:
    eagerly on 3-D and strided x, under torch.compile(fullgraph=True) (and the same calls again with
    new values, with no recompile), replayed from a CUDA graph, and into a strided caller-owned out,
    against the float64 oracle."""
    n, k = 2 * 1400, 1000  # N/2 off the 128-column block grid, K off the 128-row group grid
    nw = native_weight("gptq", n, k, 128, False, act_order=act_order, version="v1")
    w = nw.weight
    args = (w.qweight, w.scales, w.qzeros, w.act_perm, w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel))
    # The lambda's code object is shared by both parametrizations, and Dynamo's recompile limit (8 a code
    # object; past it fullgraph=True raises) counts every compile of it: reset, so only this test's count.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.ops.qops.mm_int_weight_swiglu(x, *args), fullgraph=True)

    def layouts(dtype, seed):  # 3-D, every other column of a wider buffer, one row
        return (rand(2, 3, k, dtype=dtype, seed=seed), rand(5, 2 * k, dtype=dtype, seed=seed + 1)[:, ::2],
                rand(1, k, dtype=dtype, seed=seed + 2))

    for dtype in DTYPES:
        assert native.warmup_swiglu(w, dtype) >= 1  # every gated kernel loaded before the capture below
        for x in layouts(dtype, 1):
            want = glu_reference(x, nw.w64)
            for name, y in (("eager", torch.ops.qops.mm_int_weight_swiglu(x, *args)), ("compiled", compiled(x))):
                assert y.shape == want.shape and y.dtype == dtype, name
                assert rel_err(y, want) < TOL[dtype], f"{name} {dtype} {tuple(x.shape)}: {rel_err(y, want):.2e}"
        x = rand(8, k, dtype=dtype, seed=4)
        big = torch.full((8, n // 2 + 9), float("nan"), dtype=dtype, device="cuda")
        out = big[:, 5:5 + n // 2]
        ws = torch.full((max(native.workspace_bytes(8, n, k, 4, 128, act_order=act_order), 16),), 255, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qops.mm_int_weight_swiglu_out(x, *args, out, ws)
        for seed in (5, 6):
            x.copy_(rand(8, k, dtype=dtype, seed=seed))
            g.replay()
            err = rel_err(out, glu_reference(x, nw.w64))
            assert err < TOL[dtype], f"replay {dtype} seed {seed}: {err:.2e}"
        assert bool(big[:, :5].isnan().all()) and bool(big[:, 5 + n // 2:].isnan().all()), "wrote outside out"
    # Every (layout, dtype) above has its graph now: the same calls on new values reuse them.
    with torch.compiler.set_stance("fail_on_recompile"):
        for dtype in DTYPES:
            for x in layouts(dtype, 11):
                y = compiled(x)
                assert rel_err(y, glu_reference(x, nw.w64)) < TOL[dtype], f"compiled again {dtype} {tuple(x.shape)}"


# (N, K, M) with x staged once: the decode shapes' M = 1 plans (folded), M = 8 and 16, a K off the
# 128-row grid, and 32 rows (four x tiles, one block an SM).
F16MMA_CASES = [(6144, 4096, 1), (4096, 14336, 1), (28672, 4096, 8), (1000, 777, 5), (4096, 4096, 16), (2048, 1536, 32)]


def _x_rows_of_every_magnitude(m, k, seed, scales=(1.0, 1e30, 1e-30, 0.0, 3e4, 1e-6, 70000.0)):
    """bf16 rows scaled by each of ``scales`` in turn (a row of zeros among them), and row 7 with one
    value 1e6 times the rest."""
    x = rand(m, k, dtype=torch.float32, seed=seed)
    for r in range(m):
        x[r] *= scales[r % len(scales)]
    if m > 7:
        x[7, 3] *= 1e6  # one value far above its row's others
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape", F16MMA_CASES, ids=lambda s: "{}x{}-m{}".format(*s))
def test_bf16_through_f16_mma_matches_the_reference_at_every_magnitude(shape):
    """QOPS_F16MMA: bf16 x staged as f16 with a power-of-two scale a row; rows from 1e-30 to 1e30 (far
    outside f16's range), a row of zeros, and a row dominated by one value, against float64, each row
    to its own scale; and the same results as the bf16 MMAs within the tolerance."""
    n, k, m = shape
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    w = nw.weight
    base = native.plan(m, n, k, 0)
    p = dataclasses.replace(native.make_plan(m, n, k, nwn=base.nwn, splits=base.splits, cluster=base.cluster, xfull=True,
                                             ring=base.ring, minb=base.minb, fold=base.fold and m <= 8,
                                             smem_limit=native.smem_optin_bytes(0)), f16mma=True)
    assert p.defines(torch.bfloat16, True)["QOPS_F16MMA"] == 1
    x = _x_rows_of_every_magnitude(m, k, seed=m)
    with native.plan_override(lambda *a: p):
        y = w.mm(x)
    with native.plan_override(lambda *a: dataclasses.replace(p, f16mma=False)):
        y_bf16 = w.mm(x)
    want = reference(x, nw.w64)
    for r in range(m):
        if not bool(want[r].abs().max() > 0):
            assert bool((y[r] == 0).all()), f"row {r}: a row of zeros gives zeros"
            continue
        err = rel_err(y[r], want[r])
        assert err < TOL[torch.bfloat16], f"{p} row {r} (|x| ~ {x[r].float().abs().max().item():.1e}): relative error {err:.2e}"
        assert rel_err(y[r], y_bf16[r].double()) < TOL[torch.bfloat16], f"row {r}: f16 and bf16 MMAs disagree"


def test_f16mma_with_the_gated_output_and_the_rule():
    """The gated epilogue on sums from f16 MMAs (the decode model's gate/up at M = 1 takes both), and
    the rule's choice: f16mma at M = 1 on weights of >= F16MMA_MIN_NK values, nowhere else."""
    n, k = 2048, 1536
    nw = native_weight("gptq", n, k, 128, False, version="v2")
    w = nw.weight
    for m in (1, 8):
        base = native.plan(m, n, k, 0)
        p = dataclasses.replace(native.make_plan(m, n, k, nwn=base.nwn, splits=base.splits, cluster=base.cluster, xfull=True,
                                                 minb=base.minb, smem_limit=native.smem_optin_bytes(0)), f16mma=True)
        # gate * up squares a row's magnitude: 1e15 and 1e-15 keep the products inside bf16's range;
        # 3e4 and 7e4 are still above f16's largest value (the scaling is what makes them fit).
        x = _x_rows_of_every_magnitude(m, k, seed=10 + m, scales=(1.0, 1e15, 1e-15, 0.0, 3e4, 1e-3, 70000.0))
        with native.plan_override(lambda *a: p):
            y = native.native_mm(x, w.qweight, w.scales, w.qzeros, None, None, 4, 128, w.zero_offset, glu=True)
        want = glu_reference(x, nw.w64)
        for r in range(m):
            if not bool(want[r].abs().max() > 0):
                assert bool((y[r] == 0).all()), f"M={m} row {r}: a row of zeros gives zeros"
                continue
            assert rel_err(y[r], want[r]) < TOL[torch.bfloat16], f"M={m} row {r}: {rel_err(y[r], want[r]):.2e}"
    big = native.plan(1, 28672, 4096, 0)
    assert big.f16mma == big.xfull and 28672 * 4096 >= native.F16MMA_MIN_NK
    assert not native.plan(1, 4096, 4096, 0).f16mma and not native.plan(4, 28672, 4096, 0).f16mma
