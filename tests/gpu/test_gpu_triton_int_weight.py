"""The Triton lowering of mm_int_weight on a CUDA device, through ``torch.ops.qops.mm_int_weight``.

Weights are random checkpoints of every int_weight format, moved to the GPU and prepared there by
``FORMATS[name].prepare(checkpoint, dtype=...)`` with every higher-priority int_weight lowering
disabled, so the chooser itself must pick ``Kernel.TRITON``. The oracle is float64 ``x @ W.T + bias``
with W from ``tests.oracle`` (an independent reading of each checkpoint layout); every output is held
to a relative Frobenius error and to ``oracle.check_elementwise`` (one wrong element fails). Checked
eagerly, under ``torch.compile(fullgraph=True)`` and replayed from a captured CUDA graph (output
poisoned before the replay). The shipped config table decides the path per M: decode for the
smallest M, the tensor-core GEMM above it and, where the table says so, dequantize + cuBLAS for the
largest. On the H200 table (configs/h200.json): decode up to M = 4 (4 bits: M = 1; the kernel's row
count is min(M, 4)), then GEMM buckets of 8, 16, 32, 64 and 128 rows whose BLOCK_M is the bucket's size
(16 for the smallest), dense from 129.

Triton compiles one kernel per flag combination; the matrix below is sized so the file runs in a
few minutes on a cold cache.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import LOWERINGS, Kernel
from qops.ops.triton import int_weight as T
from tests import oracle
from tests.int_weight_cases import Case, pack, random_int_quantized, rel_err

pytestmark = pytest.mark.gpu

# fp32 accumulation; the output rounding (2^-11 fp16, 2^-8 bf16) dominates. The dense path's
# weight is rounded to the activation dtype once more before cuBLAS.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
ALL_M = (1, 2, 7, 16, 17, 64, 100, 257, 2048)
TRITON = "triton_int_weight"
# Checkpoints store scales in the model dtype, which need not be the activations': every int_weight
# format takes fp16, bf16 or fp32 scales (qops.formats.integer.SCALE_DTYPES) with either activation
# dtype the Triton lowering serves (fp16, bf16).
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def only_triton():
    """Disable every int_weight lowering ranked above Triton so the chooser picks it."""
    triton_low = next(l for l in LOWERINGS if l.name == TRITON)
    above = [l.name for l in LOWERINGS if l.family == "int_weight" and l.priority > triton_low.priority]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QOPS_DISABLE_LOWERINGS", ",".join(above))
        if not above:
            mp.delenv("QOPS_DISABLE_LOWERINGS", raising=False)
        yield


@dataclasses.dataclass
class Built:
    weight: object  # IntWeight on cuda, chosen kernel
    w64: torch.Tensor  # (N, K) float64 on cuda, checkpoint K order


_CACHE: dict = {}


def _to_cuda(ckpt):
    fields = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
    return dataclasses.replace(ckpt, **{k: v.cuda() for k, v in fields.items() if isinstance(v, torch.Tensor)})


def built(case: Case, dtype: torch.dtype, seed: int = 0, scale_dtype: torch.dtype = torch.float16) -> Built:
    key = (case, dtype, seed, scale_dtype)
    if key not in _CACHE:
        iq = random_int_quantized(case, torch.Generator().manual_seed(seed), scale_dtype)
        ckpt = pack(case, iq)
        w = FORMATS[case.fmt].prepare(_to_cuda(ckpt), dtype=dtype)
        assert w.kernel == Kernel.TRITON, w.choice.explain()
        _CACHE[key] = Built(w, oracle.dequantize(case.fmt, ckpt).cuda())
    return _CACHE[key]


def rand(*shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


def check(y, x, w64, bias, what):
    want = x.double() @ w64.t()
    if bias is not None:
        want = want + bias.double()
    assert y.dtype == x.dtype and y.shape == want.shape, what
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output"
    err = rel_err(y, want)
    assert err < TOL[x.dtype], f"{what}: relative error {err:.2e} >= {TOL[x.dtype]:.0e}"
    oracle.check_elementwise(y, x, w64, bias, x.dtype, what)


def matrix() -> list[tuple[Case, torch.dtype]]:
    """Every format x bits x group size, each once; dtype, sym, act-order and version rotate so
    that each appears across the matrix. N and K are odd or off multiples of the group."""
    support = {"gptq": (2, 3, 4, 8), "awq": (4,), "compressed-tensors": (4, 8)}
    shapes = [(264, 520), (200, 333), (136, 1000), (328, 200)]  # AWQ needs N % 8 == 0
    out, i = [], 0
    for fmt, bits_list in support.items():
        for bits in bits_list:
            for gs in (-1, 32, 64, 128):
                sym = i % 2 == 0 and fmt != "awq"
                act = fmt != "awq" and gs != -1 and i % 3 != 2
                ver = ("v1", "v2")[i % 2] if fmt == "gptq" else None
                n, k = shapes[i % len(shapes)]
                if fmt == "awq":
                    n = n - n % 8
                out.append((Case(fmt, bits, gs, sym, act, ver, n, k), (torch.float16, torch.bfloat16)[(i // 2) % 2]))
                i += 1
    return out


MATRIX = matrix()

# M beyond 1 and 16 for the matrix: on the H200 table the decode kernel's 3- and 4-row forms and the
# 32-, 64- and 128-row GEMM buckets, each tile partly filled. Each weight takes one (two for the
# first weights of a bits value with fewer than five), so every bits value sees all five.
EXTRA_M = (3, 4, 17, 33, 100)


def extra_m(index: int) -> tuple[int, ...]:
    bits = MATRIX[index][0].bits
    same = [i for i, (c, _) in enumerate(MATRIX) if c.bits == bits]
    j = same.index(index)
    return tuple(EXTRA_M[i] for i in (j % len(EXTRA_M), j + len(same)) if i < len(EXTRA_M))


def _id(c):
    case, dtype = c
    return f"{case.id}-{str(dtype)[6:]}"


def _matrix_id(c):
    return f"{_id(c)}-scales_{str(SCALE_DTYPES[MATRIX.index(c) % 3])[6:]}"


def test_matrix_covers_the_registry():
    formats = {c.fmt for c, _ in MATRIX}
    assert formats == {n for n, f in FORMATS.items() if f.family == "int_weight"}
    for bits in {c.bits for c, _ in MATRIX}:
        ms = {m for i, (c, _) in enumerate(MATRIX) if c.bits == bits for m in extra_m(i)}
        assert ms == set(EXTRA_M), (bits, ms)
    pairs = {(dtype, SCALE_DTYPES[i % 3]) for i, (_, dtype) in enumerate(MATRIX)}
    assert len(pairs) == 2 * len(SCALE_DTYPES), pairs


@pytest.mark.parametrize("item", MATRIX, ids=_matrix_id)
def test_every_format_bits_group(item):
    index = MATRIX.index(item)
    case, dtype = item
    # Scale dtypes rotate over the matrix (every pair with the activation dtype appears): a free
    # extra, since each weight compiles its own kernels anyway.
    b = built(case, dtype, scale_dtype=SCALE_DTYPES[index % 3])
    # One bias choice per weight (alternating over the matrix): each choice is another compiled kernel.
    use = rand(case.n, dtype=dtype, seed=1) if index % 2 == 0 else None
    for m in (1, 16, *extra_m(index)):
        x = rand(m, case.k, dtype=dtype, seed=10 + m)
        y = torch.ops.qops.mm_int_weight(x, b.weight.qweight, b.weight.scales, b.weight.qzeros, b.weight.act_perm, use,
                                         b.weight.in_features, b.weight.bits, b.weight.group_size, b.weight.zero_offset, int(b.weight.kernel))
        check(y, x, b.w64, use, f"{_matrix_id(item)} M={m} path={T._plan(m, case.n, case.k, case.bits, case.group_size, x.device)['path']}")


SWEEP = [
    (Case("gptq", 4, 128, False, True, "v1", 4104, 1000), torch.float16),
    (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16),
    (Case("compressed-tensors", 8, -1, True, False, None, 520, 777), torch.bfloat16),
    (Case("gptq", 3, 64, True, False, "v2", 300, 640), torch.float16),
]


@pytest.mark.parametrize("item", SWEEP, ids=_id)
def test_every_m_bucket(item):
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=2)
    for m in ALL_M:
        x = rand(m, case.k, dtype=dtype, seed=m)
        check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} M={m} path={T._plan(m, case.n, case.k, case.bits, case.group_size, x.device)['path']}")


@pytest.mark.parametrize("item", SWEEP[:2], ids=_id)
def test_torch_compile_fullgraph(item):
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=3)
    torch._dynamo.reset()
    f = torch.compile(lambda x: b.weight.mm(x, bias), fullgraph=True, dynamic=False)
    for m in (1, 16, 64):
        x = rand(m, case.k, dtype=dtype, seed=20 + m)
        check(f(x), x, b.w64, bias, f"compiled {_id(item)} M={m}")
    torch._dynamo.reset()


def replay_captured(call, x, fresh):
    """``call()`` captured into a CUDA graph (after two warm-up calls on a side stream, which compile
    and load every kernel), its output poisoned, ``fresh`` copied into the input buffer ``x``, then
    replayed: returns the replayed output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call()
    y.fill_(float("nan"))
    x.copy_(fresh)  # new inputs, same buffer
    graph.replay()
    torch.cuda.synchronize()
    return y


@pytest.mark.parametrize("item", SWEEP[:2], ids=_id)
def test_cuda_graph_replay(item):
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=4)
    for m in (1, 2, 16, 64, 2048):
        x = rand(m, case.k, dtype=dtype, seed=30 + m)
        y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=40 + m))
        check(y, x, b.w64, bias, f"graph {_id(item)} M={m}")


def test_out_variant_workspace_and_reductions():
    case, dtype = SWEEP[0]
    b = built(case, dtype)
    w = b.weight
    for reduce in ("partials", "atomic"):
        with T.config_override(table_with(reduce=reduce)):
            for m in (1, 7, 64):
                x = rand(m, case.k, dtype=dtype, seed=m)
                need = T.workspace_bytes(m, case.n, case.k, case.bits, case.group_size, x.device,
                                         act_order=w.act_perm is not None)
                ws = torch.full((max(need, 1),), 255, dtype=torch.uint8, device="cuda")
                big = torch.full((m, case.n + 9), float("nan"), dtype=dtype, device="cuda")
                out = big[:, 4:4 + case.n]
                torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits, w.group_size,
                                                 w.zero_offset, int(w.kernel), out, ws)
                check(out, x, b.w64, None, f"out {reduce} M={m}")
                assert bool(big[:, :4].isnan().all()) and bool(big[:, 4 + case.n:].isnan().all()), "wrote outside out"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_act_order_gemm_reads_x_gathered_into_the_workspace(dtype):
    """An act-order weight through the Triton GEMM: x gathered once (``x[:, act_perm]``) at the start of a
    garbage-filled workspace of exactly ``workspace_bytes(act_order=True)``, the split's fp32 sums after it; the
    result against the float64 oracle, for a strided x too, and the gathered x checked in the workspace."""
    case = SWEEP[0][0]
    assert case.act_order
    b = built(case, dtype)
    w = b.weight
    for m in (16, 33, 64):
        need = T.workspace_bytes(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"), act_order=True)
        base = rand(m, case.k + 24, dtype=dtype, seed=70 + m)
        for x in (base[:, :case.k].contiguous(), base[:, 8:8 + case.k]):
            ws = torch.full((need,), 255, dtype=torch.uint8, device="cuda")
            y = T.triton_mm(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, w.bits, w.group_size, w.zero_offset,
                            workspace=ws, force_path="gemm")
            check(y, x, b.w64, None, f"act-order gemm M={m} {dtype} strided={not x.is_contiguous()}")
            xg = ws[:m * case.k * dtype.itemsize].view(dtype).view(m, case.k)
            assert torch.equal(xg, x[:, w.act_perm.long()]), f"M={m}: x not gathered into the workspace"


@pytest.mark.parametrize("overlap", [0, 1])
def test_dense_slabs_overlapped_and_captured(overlap):
    """The dense path over several N-slabs (the last one partial), with and without the side-stream
    overlap of dequantization and GEMM, eagerly and replayed from a CUDA graph (output poisoned)."""
    case, dtype = SWEEP[0]  # act-order: the dequantization scatters rows
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=6)
    table = copy.deepcopy(T.load_config(T._device_facts(torch.device("cuda"))[0]))
    dense = {"impl": "dense", "DQ_BLOCK_K": 64, "DQ_BLOCK_N": 128, "slab_bytes": 1000 * 2 * 1024, "overlap": overlap}
    table["gemm"] = {str(bits): {"1000000": dense} for bits in (2, 3, 4, 8)}
    with T.config_override(table):
        m = 257
        plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
        assert plan["path"] == "dense" and case.n % plan["slab"] and case.n // plan["slab"] >= 4, plan
        x = rand(m, case.k, dtype=dtype, seed=60)
        check(b.weight.mm(x, bias), x, b.w64, bias, f"dense overlap={overlap} eager")
        y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=61))
        check(y, x, b.w64, bias, f"dense overlap={overlap} graph")


# The H200 table's 16-row GEMM config (BLOCK_M 16) for every M: on the shipped table each bucket's M
# equals its BLOCK_M, so only this override runs the GEMM over several M tiles (3 at M = 33, 17 at
# M = 257, the last holding one row), through the GROUP_M swizzle's partial last group. The wide
# weight fills the GPU without a K split (the output written directly); the narrow ones split K,
# their fp32 partials indexed by row: a buffer of (splits, M, N) or atomic adds into (M, N).
MULTI_TILE = [(SWEEP[0], "partials", False), (SWEEP[2], "atomic", True), (SWEEP[3], "partials", True)]
NARROW_GEMM = {"impl": "triton", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
               "num_stages": 3, "ctas_per_sm": 4, "max_split": 32}


def narrow_gemm_table(**cfg) -> dict:
    """This GPU's table with NARROW_GEMM (plus ``cfg``) as the GEMM of every M and bit width."""
    table = copy.deepcopy(T.load_config(T._device_facts(torch.device("cuda"))[0]))
    table["gemm"] = {key: {"1000000": {**NARROW_GEMM, **cfg}} for key in ("default", "2", "3", "4", "8")}
    return table


@pytest.mark.parametrize("item,reduce,splits", MULTI_TILE, ids=[f"{_id(i)}-{r}" for i, r, _ in MULTI_TILE])
def test_gemm_over_several_m_tiles(item, reduce, splits):
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=7)
    with T.config_override(narrow_gemm_table(reduce=reduce)):
        for m in (33, 257):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
            assert plan["path"] == "gemm" and plan["block_m"] == 16 and m % 16 != 0, plan
            if m == 257:
                assert (plan["split"] > 1) == splits, plan
            x = rand(m, case.k, dtype=dtype, seed=70 + m)
            check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} M={m} split={plan['split']} {reduce}")


def table_with(**keys) -> dict:
    """This GPU's table with ``keys`` set in every decode and GEMM config."""
    table = copy.deepcopy(T.load_config(T._device_facts(torch.device("cuda"))[0]))
    for section in ("decode", "gemm"):
        for by_m in table[section].values():
            for cfg in by_m.values():
                cfg.update(keys)
    return table


def table_with_pdl_reduce(reduce: str) -> dict:
    """This GPU's table with every decode and GEMM config set to ``reduce`` and ``pdl_reduce``."""
    return table_with(reduce=reduce, pdl_reduce=1)


@pytest.mark.parametrize("reduce", ["partials", "atomic"])
@pytest.mark.parametrize("item", [SWEEP[0], SWEEP[1], SWEEP[3]], ids=_id)
def test_pdl_reduction_matches_the_oracle(item, reduce, monkeypatch):
    """``pdl_reduce``: the split-K reduction launched as a programmatic dependent of the split-K kernel
    (it waits for that grid's completion), at M = 1, 3 (decode) and 17, 33 (GEMM), eagerly and replayed from
    a CUDA graph with fresh inputs, each launch asserted split (the split fitted to the GPU included)."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=11)
    dev = torch.device("cuda")
    launched = []
    shipped = T.split_in_waves
    monkeypatch.setattr(T, "split_in_waves", lambda *a: launched.append(shipped(*a)[0]) or shipped(*a))
    with T.config_override(table_with_pdl_reduce(reduce)):
        for m in (1, 3, 17, 33):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
            assert plan["path"] in ("decode", "gemm") and plan["split"] > 1 and T.reduce_pdl(plan["cfg"], dev, plan["reduce"] == "atomic"), plan
            x = rand(m, case.k, dtype=dtype, seed=110 + m)
            launched.clear()
            check(b.weight.mm(x, bias), x, b.w64, bias, f"pdl {reduce} {_id(item)} M={m}")
            assert launched and launched[-1] > 1, f"M={m}: the launch took one split ({launched}): no reduction to test"
            y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=120 + m))
            check(y, x, b.w64, bias, f"pdl graph {reduce} {_id(item)} M={m}")


@pytest.mark.parametrize("pdl_zero", [1, 0])
@pytest.mark.parametrize("item", [SWEEP[0], SWEEP[1]], ids=_id)
def test_atomic_sum_zeroed_ahead_matches_the_oracle(item, pdl_zero, monkeypatch):
    """The atomic split-K sum zeroed by a kernel whose programmatic dependent the split-K kernel is
    (``pdl_zero`` 1, ``common.zero_ahead``; 0: a ``zero_()`` before it), at M = 1, 3 (decode) and 17 (GEMM),
    each launch split: the fp32 sum lives in a caller's workspace whose bytes are 0xff (NaN) before every
    call, eagerly and in a captured graph that dirties the workspace itself before the call it replays.
    A sum not zeroed before the adds comes out NaN."""
    case, dtype = item
    b = built(case, dtype)
    w = b.weight
    bias = rand(case.n, dtype=dtype, seed=13)
    dev = torch.device("cuda")
    launched = []
    shipped = T.split_in_waves
    monkeypatch.setattr(T, "split_in_waves", lambda *a: launched.append(shipped(*a)[0]) or shipped(*a))
    with T.config_override(table_with(reduce="atomic", pdl_reduce=1, pdl_zero=pdl_zero)):
        for m in (1, 3, 17):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
            assert plan["split"] > 1 and T.zero_pdl(plan["cfg"], dev) == bool(pdl_zero), plan
            need = T.workspace_bytes(m, case.n, case.k, case.bits, case.group_size, dev)
            ws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
            x = rand(m, case.k, dtype=dtype, seed=130 + m)
            out = torch.empty(m, case.n, dtype=dtype, device="cuda")

            def call():
                ws.fill_(255)
                torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features,
                                                 w.bits, w.group_size, w.zero_offset, int(w.kernel), out, ws)
                return out

            launched.clear()
            check(call(), x, b.w64, bias, f"pdl_zero={pdl_zero} {_id(item)} M={m}")
            assert launched and launched[-1] > 1, f"M={m}: the launch took one split ({launched}): no atomic sum to test"
            y = replay_captured(call, x, rand(m, case.k, dtype=dtype, seed=140 + m))
            check(y, x, b.w64, bias, f"graph pdl_zero={pdl_zero} {_id(item)} M={m}")


PREFETCH_CASES = [(Case("gptq", 4, 128, False, True, "v2", 4104, 4096), torch.float16),
                  (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16),
                  (Case("gptq", 8, 64, False, False, "v2", 520, 2048), torch.float16),
                  (Case("gptq", 2, 256, True, False, "v2", 300, 2048), torch.bfloat16)]


@pytest.mark.parametrize("item", PREFETCH_CASES, ids=_id)
def test_prefetched_scales_give_the_same_bits(item):
    """The GEMM with its scales loaded a K tile ahead (``prefetch_scales``, a tuner knob) against the same
    config loading them where they are used: bit for bit, at M = 17 and 64, over splits of several groups."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=5)
    out = {}
    for prefetch in (0, 1):
        with T.config_override(narrow_gemm_table(reduce="partials", prefetch_scales=prefetch)):
            for m in (17, 64):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
                assert plan["path"] == "gemm" and plan["tile_group"], plan
                x = rand(m, case.k, dtype=dtype, seed=50 + m)
                out[prefetch, m] = b.weight.mm(x, bias)
                check(out[prefetch, m], x, b.w64, bias, f"{_id(item)} M={m} prefetch={prefetch} split={plan['split']}")
    assert all(torch.equal(out[0, m], out[1, m]) for m in (17, 64))


def gemv_table(**cfg) -> dict:
    """This GPU's table with the GEMV serving M <= 4 at every width, each decode config given ``cfg``."""
    table = copy.deepcopy(T.load_config(T._device_facts(torch.device("cuda"))[0]))
    table["decode_max_m"] = 4
    for by_m in table["decode"].values():
        for c in by_m.values():
            c.update(cfg)
    return table


GEMV_PREFETCH_CASES = [(Case("gptq", 4, 128, False, True, "v2", 4104, 4096), torch.float16),
                       (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16),
                       (Case("gptq", 8, 64, False, False, "v2", 520, 2048), torch.float16),
                       (Case("gptq", 2, 256, True, False, "v2", 300, 2048), torch.bfloat16),
                       (Case("gptq", 4, 32, False, True, "v1", 264, 1000), torch.float16)]  # K off the step


@pytest.mark.parametrize("item", GEMV_PREFETCH_CASES, ids=_id)
def test_gemv_prefetch_gives_the_same_bits(item):
    """The decode GEMV with each step's words, zero points and scales loaded during the step before
    (``prefetch``, a tuner knob) and the same config without it, at M = 1 and 3, against the oracle, and
    replayed from a CUDA graph with fresh inputs. Not bit for bit, as on the CPU: the prefetching build
    holds more registers, so the launch fits it another split count (and the atomic reduction's order
    varies), which an H100 run showed on the act-order case."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=7)
    dev = torch.device("cuda")
    for prefetch in (0, 1):
        with T.config_override(gemv_table(prefetch=prefetch, max_split=2)):  # programs long enough for the prefetch
            for m in (1, 3):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
                applies = T.gemv_prefetch_applies(plan["cfg"], case.bits, T.gemv_steps(plan))
                assert plan["path"] == "decode" and applies == bool(prefetch), plan
                x = rand(m, case.k, dtype=dtype, seed=70 + m)
                check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} M={m} prefetch={prefetch} split={plan['split']}")
                if prefetch:
                    y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=80 + m))
                    check(y, x, b.w64, bias, f"graph {_id(item)} M={m} prefetch")


@pytest.mark.parametrize("item", GEMV_PREFETCH_CASES, ids=_id)
def test_gemv_x_vec_matches_the_oracle(item):
    """The decode GEMV loading x as vectors (``x_vec``, the default; not taken with act-order) and with one
    scalar load a value, each alone and with ``prefetch``, at M = 1, 3 and 4, against the oracle, eagerly
    and replayed from a CUDA graph with fresh inputs; and x with K stride 2 (stop 60's first form read it
    as 1: a CPU test caught it)."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=9)
    dev = torch.device("cuda")
    for x_vec, prefetch in ((1, 0), (1, 1), (0, 0)):
        with T.config_override(gemv_table(x_vec=x_vec, prefetch=prefetch, max_split=2)):
            for m in (1, 3, 4):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
                want = bool(x_vec) and not case.act_order
                assert plan["path"] == "decode" and T.gemv_x_vec(plan["cfg"], case.bits, case.act_order) == want, plan
                x = rand(m, case.k, dtype=dtype, seed=80 + m)
                check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} M={m} x_vec={x_vec} prefetch={prefetch}")
                y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=85 + m))
                check(y, x, b.w64, bias, f"graph {_id(item)} M={m} x_vec={x_vec} prefetch={prefetch}")
            xs = rand(3, 2 * case.k, dtype=dtype, seed=89)[:, ::2]  # x's K stride 2: scalar loads
            check(b.weight.mm(xs, bias), xs, b.w64, bias, f"{_id(item)} strided x x_vec={x_vec} prefetch={prefetch}")


@pytest.mark.parametrize("item", GEMV_PREFETCH_CASES, ids=_id)
def test_gemv_short_split_matches_the_oracle(item):
    """The decode GEMV's narrower form where the entry's split leaves each program one group of K
    (``short_split``; the H200 table's M = 1 entry has one): taken where the plan says, at M = 1..4 against the
    oracle, eagerly and replayed from a CUDA graph with fresh inputs."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=11)
    dev = torch.device("cuda")
    table = gemv_table(max_split=64, short_split={"BLOCK_N": 128, "CHUNKS": 4, "num_warps": 2, "half_dot": 1})
    with T.config_override(table):
        for m in (1, 2, 4):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
            # these shapes' K is too short for the waves this GPU's entries ask for: every call takes the short form
            assert plan["path"] == "decode" and plan["cfg"]["BLOCK_N"] == 128 and "short_split" not in plan["cfg"], plan
            x = rand(m, case.k, dtype=dtype, seed=90 + m)
            what = f"{_id(item)} M={m} BLOCK_N={plan['cfg']['BLOCK_N']}"
            check(b.weight.mm(x, bias), x, b.w64, bias, what)
            y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=95 + m))
            check(y, x, b.w64, bias, "graph " + what)


HALF_DOT_CASES = [Case("gptq", 4, 128, False, False, "v2", 4104, 4096),  # several groups a split
                  Case("awq", 4, 128, False, False, None, 1024, 4096),
                  Case("gptq", 4, 32, False, False, "v1", 264, 1000),      # K off the step; zero points to 16
                  Case("compressed-tensors", 4, -1, True, False, None, 520, 2048)]  # per-channel, symmetric


@pytest.mark.parametrize("case", HALF_DOT_CASES, ids=lambda c: _id((c, torch.float16)))
def test_gemv_half_dot_matches_the_oracle(case):
    """The decode GEMV's packed fp16 dot (``half_dot``: ``common.half_dot_asm`` as inline PTX), alone and with
    each step's words loaded a step ahead (``prefetch``, as the H100 table ships it), and over two words a
    half-sum (``half_dot`` 2) with it, at M = 1..4, eagerly and replayed from a CUDA graph with fresh
    inputs, with x of K stride 2, and with x's sizes spread from 1e-3 to 2000 (the half-sums stay far
    from fp16's overflow)."""
    b = built(case, torch.float16)
    bias = rand(case.n, dtype=torch.float16, seed=11)
    dev = torch.device("cuda")
    for words, prefetch in ((1, 0), (1, 1), (2, 1)):
        _check_half_dot(case, b, bias, dev, words, prefetch)


def _check_half_dot(case, b, bias, dev, words, prefetch):
    with T.config_override(gemv_table(half_dot=words, prefetch=prefetch, max_split=2)):  # programs long enough for the prefetch
        for m in (1, 2, 3, 4):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
            build = T._split_k_build(plan, 2, torch.float16, case.bits, b.weight.qzeros, None, bias)[1]
            assert plan["path"] == "decode" and build.get("HALF_DOT") == T.HalfDot.ASM, (plan, build)
            assert build.get("PREFETCH", False) == bool(prefetch) and build.get("DOT_WORDS", 1) == words, build
            x = rand(m, case.k, dtype=torch.float16, seed=90 + m)
            what = f"{case} M={m} half_dot={words} prefetch={prefetch}"
            check(b.weight.mm(x, bias), x, b.w64, bias, what)
            y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=torch.float16, seed=95 + m))
            check(y, x, b.w64, bias, f"graph {what}")
        xs = rand(3, 2 * case.k, dtype=torch.float16, seed=99)[:, ::2]
        check(b.weight.mm(xs, bias), xs, b.w64, bias, f"{case} strided x half_dot={words} prefetch={prefetch}")
        g = torch.Generator(device="cuda").manual_seed(98)
        size = 10 ** (torch.rand(2, case.k, generator=g, device="cuda") * 6.3 - 3)
        xw = (torch.randn(2, case.k, generator=g, device="cuda") * size).half()
        check(b.weight.mm(xw, bias), xw, b.w64, bias, f"{case} x from 1e-3 to 2000 half_dot={words} prefetch={prefetch}")


KNOB_TILES = [  # the M = 16 tile the knobs are for, and a 128-row tile (the scale enters the half weight tile)
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1},
]
KNOB_CASES = [  # (case, dtype, the GEMM config knobs set)
    (Case("gptq", 4, 128, False, True, "v2", 4104, 4096), torch.float16, {"even_odd": 1}),
    (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16, {"even_odd": 1}),
    (Case("gptq", 4, -1, True, False, "v2", 520, 1000), torch.bfloat16, {"even_odd": 1}),  # per-channel, K off the tile
    (Case("compressed-tensors", 4, 128, True, False, None, 264, 2048), torch.float16, {"even_odd": 1}),
    (Case("compressed-tensors", 8, 128, True, False, None, 1032, 2048), torch.float16, {"sym_zero_load": 1}),
    (Case("compressed-tensors", 4, 128, True, False, None, 264, 2048), torch.bfloat16, {"sym_zero_load": 1, "even_odd": 1}),
    (Case("compressed-tensors", 4, -1, True, False, None, 520, 1000), torch.float16, {"sym_zero_load": 1}),
]


@pytest.mark.parametrize("item", KNOB_CASES, ids=lambda c: f"{_id(c[:2])}-{'-'.join(sorted(c[2]))}")
def test_gemm_knobs_match_the_oracle(item):
    """The tuner's GEMM knobs against the float64 oracle through the inline PTX of both half dtypes, at M = 1,
    17 and 100, on both scale placements: ``even_odd`` (4-bit tiles as their even and odd K rows, two dots)
    and ``sym_zero_load`` (the symmetric zero point derived from the scales' load; both keep the half unpack
    in the MMA operand's registers)."""
    case, dtype, knobs = item
    b = built(case, dtype)
    if knobs.get("sym_zero_load"):
        assert b.weight.qzeros is None
    bias = rand(case.n, dtype=dtype, seed=9)
    for tile in KNOB_TILES:
        table = narrow_gemm_table(reduce="partials", **knobs, **tile)
        table["decode_max_m"] = 0  # M = 1 on the GEMM too: the knobs' one-row tile is what decode would hide
        with T.config_override(table):
            for m in (1, 17, 100):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
                assert plan["path"] == "gemm" and plan["tile_group"], plan
                dequant = T.dequant_form(dtype, case.bits, True)
                assert T.even_odd_applies(plan["cfg"], case.bits, dequant) == bool(knobs.get("even_odd"))
                if knobs.get("even_odd"):
                    assert dequant == T.Dequant.HALF_ASM
                x = rand(m, case.k, dtype=dtype, seed=90 + m)
                check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item[:2])} M={m} {knobs} tile {tile['BLOCK_M']}x{tile['BLOCK_N']}")


SCALE_WEIGHT_TILES = [  # the 64-row warpgroup-MMA tile the knob is for, and the 16-row even / odd tile
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 3},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 3, "even_odd": 1},
]
SCALE_WEIGHT_CASES = [
    (Case("gptq", 4, 128, False, True, "v2", 4104, 4096), torch.float16),
    (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16),
    (Case("compressed-tensors", 8, 128, True, False, None, 1032, 2048), torch.float16),
    (Case("gptq", 4, -1, True, False, "v2", 520, 1000), torch.bfloat16),  # per-channel, K off the tile
]


@pytest.mark.parametrize("item", SCALE_WEIGHT_CASES, ids=_id)
def test_scaled_weight_tile_matches_the_oracle(item):
    """``scale_weight`` (the half weight tile scaled before the MMA where the tile's height would scale the
    product after it) against the float64 oracle through the inline PTX of both half dtypes, at M = 1, 17,
    64 and 257, on the 64-row tile (warpgroup MMAs chained into one accumulator) and the 16-row even / odd
    one; M = 17 also replayed from a CUDA graph."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=11)
    for tile in SCALE_WEIGHT_TILES:
        table = narrow_gemm_table(reduce="partials", scale_weight=1, **tile)
        table["decode_max_m"] = 0
        with T.config_override(table):
            for m in (1, 17, 64, 257):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
                assert plan["path"] == "gemm" and plan["tile_group"] and 2 * plan["block_m"] <= plan["block_k"], plan
                assert T.scale_weight_applies(plan["cfg"], T.dequant_form(dtype, case.bits, True))
                x = rand(m, case.k, dtype=dtype, seed=110 + m)
                what = f"scale_weight {_id(item)} M={m} tile {tile['BLOCK_M']}x{tile['BLOCK_N']}"
                check(b.weight.mm(x, bias), x, b.w64, bias, what)
                if m == 17:
                    y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=120 + m))
                    check(y, x, b.w64, bias, what + " graph")


STREAM_K_CASES = [  # (case, dtype, other GEMM knobs)
    (Case("gptq", 4, 128, False, True, "v2", 4104, 4096), torch.float16, {"even_odd": 1}),
    (Case("awq", 4, 128, False, False, None, 1024, 4096), torch.bfloat16, {"even_odd": 1}),
    (Case("gptq", 3, 128, False, True, "v1", 1000, 1000), torch.bfloat16, {}),  # the per-element gather, K off the tile
    (Case("compressed-tensors", 8, 128, True, False, None, 1032, 2048), torch.float16, {"sym_zero_load": 1}),
    (Case("gptq", 4, -1, True, False, "v2", 520, 1000), torch.bfloat16, {}),  # per-channel
]


@pytest.mark.parametrize("item", STREAM_K_CASES, ids=lambda c: f"{_id(c[:2])}-{'-'.join(sorted(c[2])) or 'plain'}")
def test_stream_k_matches_the_oracle(item, monkeypatch):
    """``stream_k``: one wave of programs, each a run of equal length over the tiles' K steps laid end to end,
    adding one partial sum per tile it touches, at M = 1, 17, 64 and 257 (the runs cross tiles and, at 8 bits,
    groups; at 257 the tiles alone would fill the GPU), eagerly and replayed from a CUDA graph (output
    poisoned, fresh inputs). Taken at every M here (``STREAM_K_GAIN`` 0), whatever the rounds rule would pick."""
    monkeypatch.setattr(T, "STREAM_K_GAIN", 0)
    case, dtype, knobs = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=15)
    table = narrow_gemm_table(stream_k=1, **knobs)
    table["decode_max_m"] = 0
    with T.config_override(table):
        for m in (1, 17, 64, 257):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
            assert plan["path"] == "gemm" and plan["stream_k"], plan
            x = rand(m, case.k, dtype=dtype, seed=150 + m)
            check(b.weight.mm(x, bias), x, b.w64, bias, f"stream_k {_id(item[:2])} M={m} {knobs}")
            if m == 17:
                y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=160 + m))
                check(y, x, b.w64, bias, f"stream_k graph {_id(item[:2])} M={m} {knobs}")


@pytest.mark.parametrize("item", GEMV_PREFETCH_CASES[:3], ids=_id)
def test_register_cap_matches_the_oracle(item):
    """``maxnreg`` (the tuner's register cap) on the decode GEMV (104) and the 16-row even / odd GEMM tile (128,
    where ptxas spills a little), against the oracle, eagerly and replayed from a CUDA graph; a build
    with the cap in its launch options was compiled."""
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=9)
    dev = torch.device("cuda")
    gemm = narrow_gemm_table(reduce="atomic", maxnreg=128, **({"even_odd": 1} if case.bits == 4 else {}), **KNOB_TILES[0])
    gemm["decode_max_m"] = 0
    for table, path, cap in ((gemv_table(maxnreg=104), "decode", 104), (gemm, "gemm", 128)):
        with T.config_override(table):
            for m in (1, 3):
                plan = T._plan(m, case.n, case.k, case.bits, case.group_size, dev)
                assert plan["path"] == path and plan["cfg"].get("maxnreg") == cap, plan
                x = rand(m, case.k, dtype=dtype, seed=70 + m)
                check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} M={m} {path} maxnreg {cap}")
                y = replay_captured(lambda: b.weight.mm(x, bias), x, rand(m, case.k, dtype=dtype, seed=75 + m))
                check(y, x, b.w64, bias, f"graph {_id(item)} M={m} {path} maxnreg {cap}")
    capped = [key for key in T._BUILD_FACTS if dict(key[2]).get("maxnreg")]
    assert capped, "no capped build was compiled"


SCALE_CASE = Case("gptq", 4, 128, False, True, "v2", 264, 1000)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=["scales_fp16", "scales_bf16", "scales_fp32"])
def test_scale_dtypes_on_every_path(scale_dtype, dtype):
    """fp16, bf16 and fp32 scales with fp16 and bf16 activations on each kernel of the H200 table:
    decode (M = 1), the GEMM scaling its fp32 product (M = 17), the GEMM scaling its half weight tile
    (M = 100: tiles taller than half their depth round the scale to the activation dtype first) and
    dense (M = 257: the dequantized weight in the activation dtype). The H200 table is applied on
    whatever GPU runs this (another GPU's table may put these rows on other paths: default.json makes M = 257
    a GEMM)."""
    case = SCALE_CASE
    b = built(case, dtype, scale_dtype=scale_dtype)
    assert b.weight.scales.dtype == scale_dtype
    bias = rand(case.n, dtype=dtype, seed=8)
    with T.config_override(T.load_config("h200")):
        for m, want in ((1, "decode"), (17, "gemm"), (100, "gemm"), (257, "dense")):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
            assert plan["path"] == want, (m, plan)
            if want == "gemm":  # one-group K tiles; only the 128-row tile scales the half weight tile
                assert plan["tile_group"] and (2 * plan["block_m"] > plan["block_k"]) == (m == 100), (m, plan)
            x = rand(m, case.k, dtype=dtype, seed=80 + m)
            check(b.weight.mm(x, bias), x, b.w64, bias, f"scales {scale_dtype} x {dtype} M={m} {want}")


@pytest.mark.parametrize("item", SWEEP[:2], ids=_id)
def test_activation_layouts(item):
    """Non-contiguous, batched, 1-D and empty activations (fp16 and bf16), with a bias, through the
    op and its ``_out`` form (a NaN-filled output, every element checked): the row counts reach
    decode (1, 4), two GEMM buckets (6, 17) and dense (257); M = 0 returns an empty output of x's
    dtype and launches nothing."""
    case, dtype = item
    b = built(case, dtype)
    w = b.weight
    k = case.k
    bias = rand(case.n, dtype=dtype, seed=9)
    layouts = {
        "3d": rand(2, 3, k, dtype=dtype),
        "transposed": rand(k, 17, dtype=dtype).t(),
        "strided": rand(4, 2 * k, dtype=dtype)[:, ::2],
        "strided_dense": rand(257, 2 * k, dtype=dtype)[:, ::2],
        "1d": rand(k, dtype=dtype),
        "empty": torch.empty(0, k, dtype=dtype, device="cuda"),
        "empty_3d": torch.empty(2, 0, k, dtype=dtype, device="cuda"),
    }
    for name, x in layouts.items():
        check(w.mm(x, bias), x, b.w64, bias, name)
        out = torch.full((*x.shape[:-1], case.n), float("nan"), dtype=dtype, device="cuda")
        torch.ops.qops.mm_int_weight_out(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.in_features, w.bits,
                                         w.group_size, w.zero_offset, int(w.kernel), out, None)
        check(out, x, b.w64, bias, f"{name} out")


def test_small_tensors_with_any_strides():
    """scales, qzeros, act_perm and bias as views of stride 2 along their last dimension (the op
    accepts any strides): the oracle's result at every path's M."""
    case, dtype = next(item for item in MATRIX if item[0].act_order and not item[0].sym)
    b = built(case, dtype)
    w = b.weight
    strided = dataclasses.replace(w, scales=oracle.stride_two(w.scales), qzeros=oracle.stride_two(w.qzeros),
                                  act_perm=oracle.stride_two(w.act_perm))
    bias = rand(case.n, dtype=dtype, seed=3)
    for m in (1, 7, 64, 2048):
        x = rand(m, case.k, dtype=dtype, seed=m)
        check(strided.mm(x, oracle.stride_two(bias)), x, b.w64, bias, f"M={m}")


# Whole-word, one-group weight tiles (the shipped table's K tile divides the group), so the GEMM
# builds its tile in fp16/bf16; every form it can take is checked against the oracle.
HALF = [
    (Case("gptq", 4, 128, False, True, "v1", 264, 1000), torch.float16),
    (Case("awq", 4, 128, False, False, None, 1024, 520), torch.bfloat16),
    (Case("compressed-tensors", 8, 128, True, False, None, 200, 1000), torch.float16),
    (Case("gptq", 2, -1, False, False, "v2", 136, 333), torch.bfloat16),
    (Case("gptq", 2, -1, True, False, "v1", 328, 520), torch.float16),
]


@pytest.mark.parametrize("form", ["asm", "triton", "fp32"])
@pytest.mark.parametrize("item", HALF, ids=_id)
def test_weight_tile_forms(item, form):
    case, dtype = item
    b = built(case, dtype)
    bias = rand(case.n, dtype=dtype, seed=5)
    assert T.dequant_form(dtype, case.bits, True) == T.Dequant.HALF_ASM, "a GPU runs the inline-PTX tile by default"
    with T.dequant_override(form):
        for m in (16, 64):
            plan = T._plan(m, case.n, case.k, case.bits, case.group_size, torch.device("cuda"))
            if plan["path"] != "gemm" or not plan["tile_group"]:
                pytest.fail(f"M={m}: the shipped table no longer gives a one-group GEMM tile here: {plan}")
            assert T.dequant_form(dtype, case.bits, True) == T.Dequant.NAMES[form]
            x = rand(m, case.k, dtype=dtype, seed=50 + m)
            check(b.weight.mm(x, bias), x, b.w64, bias, f"{_id(item)} form={form} M={m}")


def test_shipped_config_for_this_gpu_loads():
    stem, sms = T._device_facts(torch.device("cuda"))
    table = T.load_config(stem)
    assert sms > 0 and all(T.decode_max_m(table, bits) >= 1 for bits in (2, 3, 4, 8))
    print(f"GPU config {stem}: tuned={table['tuned']} source={table['source']!r} ({os.cpu_count()} CPUs)")
