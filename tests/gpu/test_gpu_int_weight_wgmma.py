"""The Gluon W4A16 GEMM (``qops/ops/triton/int_weight_wgmma.py``) on a Hopper GPU against the float64 oracle of
``tests/oracle.py``: GPTQ (v1 / v2, act-order, symmetric), AWQ and compressed-tensors 4-bit weights as qops prepares
them (flat and column-slab qweight), fp16 and bf16, M = 1 / 17 / 64 / 257, N off the tile grid, a strided x, K
splits (an atomic sum or partials) and stream-K (tiles shared by up to a program a K step), a bias, and CUDA-graph
replays with fresh inputs."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import LOWERINGS, Kernel
from qops.ops import int_weight as IW
from qops.ops.triton import int_weight as T
from qops.ops.triton import int_weight_wgmma as G
from tests import oracle
from tests.gpu.test_gpu_triton_int_weight import replay_captured  # its poisoned output, fresh inputs
from tests.int_weight_cases import Case, pack, random_int_quantized, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
TILES = ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4},
         {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 64, "STAGES": 3},
         {"BLOCK_N": 256, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4, "WARPS": 8},
         {"BLOCK_N": 128, "BLOCK_M": 8, "BLOCK_K": 128, "STAGES": 4},  # the H100 table's M = 4 / 8 buckets'
         {"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 128, "STAGES": 4, "reduce": "partials"})  # splits as partials
SK_TILES = ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4, "stream_k": 1},
            {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "stream_k": 1, "ctas_per_sm": 2},
            {"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 128, "STAGES": 4, "stream_k": 1, "ctas_per_sm": 3})
CASES = [  # (case, dtype, qweight form)
    (Case("gptq", 4, 128, False, False, "v2", 4104, 1024), torch.float16, "flat"),
    (Case("gptq", 4, 128, True, True, "v1", 4096, 2048), torch.bfloat16, "slabs"),
    (Case("awq", 4, 64, False, False, None, 1056, 1024), torch.float16, "slabs"),
    (Case("compressed-tensors", 4, -1, True, False, None, 520, 1024), torch.bfloat16, "flat"),
    (Case("gptq", 4, 128, False, True, "v2", 264, 512), torch.float16, "flat"),
]


@pytest.fixture(autouse=True)
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the kernel is for Hopper (sm_90)")


def rand(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


def prepared(case: Case, dtype: torch.dtype, form: str):
    """(the prepared weight with its qweight in ``form``, the float64 oracle weight ``(N, K)``)."""
    iq = random_int_quantized(case, torch.Generator().manual_seed(3), torch.float16)
    ckpt = pack(case, iq)
    fields = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
    ckpt = dataclasses.replace(ckpt, **{k: v.cuda() for k, v in fields.items() if isinstance(v, torch.Tensor)})
    w = FORMATS[case.fmt].prepare(ckpt, dtype=dtype)
    flat = IW.flat_qweight(w.qweight)
    w = dataclasses.replace(w, qweight=flat if form == "flat" else IW.to_column_slabs(flat))
    return w, oracle.dequantize(case.fmt, ckpt).cuda()


def run(w, x, bias, tile, split):
    return G.wgmma_mm(x, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.group_size, w.zero_offset, tile, split)


def check(y, x, w64, bias, what):
    want = x.double() @ w64.t() + bias.double()
    assert y.dtype == x.dtype and y.shape == want.shape, what
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output"
    err = rel_err(y, want)
    assert err < TOL[x.dtype], f"{what}: relative error {err:.2e} >= {TOL[x.dtype]:.0e}"
    oracle.check_elementwise(y, x, w64, bias, x.dtype, what)


@pytest.mark.parametrize("item", CASES, ids=lambda c: f"{c[0].id}-{str(c[1])[6:]}-{c[2]}")
def test_wgmma_gemm_matches_the_oracle(item):
    case, dtype, form = item
    w, w64 = prepared(case, dtype, form)
    bias = rand(case.n, dtype=dtype, seed=5)
    for tile in TILES:
        if G.shape_refusal(4, case.group_size, case.k, case.n, tile["BLOCK_K"]):  # a g64 weight and a 128-deep K step
            continue
        for m in (1, 17, 64, 257):
            for split in (1, 3):
                base = rand(m, case.k + 16, dtype=dtype, seed=m)
                x = base[:, 8:8 + case.k] if split == 3 else base[:, :case.k].contiguous()  # strided x with splits
                what = f"{case.id} {dtype} {form} tile {tile} M={m} split={split}"
                y = run(w, x, bias, tile, split)
                check(y, x, w64, bias, what)
                if tile.get("reduce") == "partials":  # summed in split order: the same bits twice
                    assert torch.equal(y, run(w, x, bias, tile, split)), f"{what}: not the same bits twice"


@pytest.mark.parametrize("item", CASES, ids=lambda c: f"{c[0].id}-{str(c[1])[6:]}-{c[2]}")
def test_stream_k_matches_the_oracle_and_repeats_itself(item):
    """Stream-K over this GPU's SMs: these small shapes share every tile among several programs (N = 264, K = 512
    at M = 1: 3 tiles of 8 steps, a program a step), whose last to finish adds the parts; the same bits twice."""
    case, dtype, form = item
    w, w64 = prepared(case, dtype, form)
    bias = rand(case.n, dtype=dtype, seed=5)
    for tile in SK_TILES:
        if G.shape_refusal(4, case.group_size, case.k, case.n, tile["BLOCK_K"]):
            continue
        for m in (1, 17, 64, 257):
            base = rand(m, case.k + 16, dtype=dtype, seed=m)
            x = base[:, 8:8 + case.k] if m % 2 else base[:, :case.k].contiguous()
            what = f"{case.id} {dtype} {form} tile {tile} M={m} stream-K"
            y = run(w, x, bias, tile, None)
            check(y, x, w64, bias, what)
            assert torch.equal(y, run(w, x, bias, tile, None)), f"{what}: not the same bits twice"


def test_stream_k_replays_from_a_cuda_graph():
    """The shared tiles' counts are zeroed by the gather inside the graph: each of three replays with fresh
    inputs counts from zero (a count left from the last would finish no tile, or the wrong one)."""
    case, dtype, form = CASES[0]
    w, w64 = prepared(case, dtype, form)
    bias = rand(case.n, dtype=dtype, seed=6)
    x = rand(17, case.k, dtype=dtype, seed=7)
    y = replay_captured(lambda: run(w, x, bias, SK_TILES[1], None), x, rand(17, case.k, dtype=dtype, seed=8))
    check(y, x, w64, bias, "stream-K graph replay")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run(w, x, bias, SK_TILES[1], None)
    for seed in (9, 10, 11):
        y.fill_(float("nan"))
        x.copy_(rand(17, case.k, dtype=dtype, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        check(y, x, w64, bias, f"stream-K graph replay, inputs {seed}")


def test_wgmma_gemm_replays_from_a_cuda_graph():
    case, dtype, form = CASES[1]
    w, w64 = prepared(case, dtype, form)
    bias = rand(case.n, dtype=dtype, seed=6)
    x = rand(17, case.k, dtype=dtype, seed=7)
    y = replay_captured(lambda: run(w, x, bias, TILES[0], 2), x, rand(17, case.k, dtype=dtype, seed=8))
    check(y, x, w64, bias, "graph replay")


def test_chained_calls_on_one_workspace_replay_from_a_cuda_graph():
    """Three calls in one graph, each one's x the last one's output and all on one workspace: a call's gather
    (x, and the zeroed sum or counts) may not start before the call before it has finished reading its
    gathered x and writing its output, though each call's kernel and reduction are programmatic dependents.
    Split (atomic sum, reduced), stream-K, split (partials, reduced); each output checked against the oracle of
    the input it was given, over three replays with fresh inputs."""
    from qops.ops.triton.int_weight import _run_wgmma

    case = Case("gptq", 4, 128, False, True, "v2", 1024, 1024)  # N = K: an output is the next call's x
    dtype = torch.float16
    w, w64 = prepared(case, dtype, "flat")
    bias = rand(case.n, dtype=dtype, seed=60)
    m, sms = 17, G.sm_count(torch.device("cuda"), 1)
    tiles = ({**TILES[3], "split": 3}, SK_TILES[2], {**TILES[0], "split": 2, "reduce": "partials"})
    plans = [G.plan(m, case.n, case.k, 4, case.group_size, {**tile, "min_tiles": 0}, sms) for tile in tiles]
    assert [p["split"] > 1 or p["stream_k"] for p in plans] == [True, True, True] and plans[1]["stream_k"]
    workspace = torch.empty(max(G.workspace_bytes(m, case.n, case.k, p) for p in plans), dtype=torch.uint8,
                            device="cuda")
    x = rand(m, case.k, dtype=dtype, seed=61)
    ys = [torch.empty(m, case.n, dtype=dtype, device="cuda") for _ in plans]

    def chain():
        for go, src, y in zip(plans, [x] + ys[:-1], ys):
            _run_wgmma({"launch": go}, src, w.qweight, w.scales, w.qzeros, w.act_perm, bias, w.group_size,
                       w.zero_offset, y, workspace)

    chain()  # compiles every build outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for seed in (62, 63, 64):
        for y in ys:
            y.fill_(float("nan"))
        x.copy_(rand(m, case.k, dtype=dtype, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for i, (src, y) in enumerate(zip([x] + ys[:-1], ys)):
            check(y, src, w64, bias, f"chained call {i}, inputs {seed}")


def test_refusal_names_the_argument_on_the_gpu():
    x = torch.zeros(2, 4096, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="group_size"):
        G.wgmma_mm(x, torch.zeros(512, 4096, device="cuda", dtype=torch.int32), torch.zeros(128, 4096, device="cuda",
                   dtype=torch.float16), None, None, None, 32, 0)


def wgmma_table(tile: dict) -> dict:
    """This GPU's table with its 4-bit M = 64 GEMM bucket, ``tile`` as its ``wgmma`` entry, serving every M
    (decode off; the larger buckets may be the dense path, which takes no wgmma tile)."""
    table = copy.deepcopy(T.load_config(T._device_facts(torch.device("cuda"))[0]))
    table["decode_max_m"] = 0
    section = table["gemm"]["4"] if "4" in table["gemm"] else table["gemm"]["default"]
    m64 = section[str(min(int(b) for b in section if int(b) >= 64))]
    table["gemm"]["4"] = {"1000000": {**m64, "wgmma": dict(tile)}}
    return table


@pytest.mark.parametrize("tile", [{**TILES[0], "split": 2}, SK_TILES[0], {**TILES[3], "split": 2},
                                  {**SK_TILES[0], "stream_k_min_waves": 0.5},
                                  {**TILES[3], "split": 3, "reduce": "partials"}],
                         ids=["split2", "stream_k", "rows8-split2", "stream_k-from-half-a-wave",
                              "rows8-split3-partials"])
@pytest.mark.parametrize("item", [CASES[0], CASES[1], CASES[3]], ids=lambda c: f"{c[0].id}-{str(c[1])[6:]}")
def test_the_op_takes_the_wgmma_bucket(item, tile, monkeypatch):
    """Through ``torch.ops.qops.mm_int_weight`` (the Triton lowering) with a table whose 4-bit GEMM buckets name
    a ``wgmma`` tile: eagerly, under ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph, at M = 1,
    17, 64 and 257, K split 2 or 3 (an atomic sum or partials, whose reduction adds the bias) or stream-K, and the
    plan says ``wgmma``. With ``stream_k_min_waves`` 0.5 the same bucket launches both ways: stream-K at M = 257 on N = 4104 (165 tiles, over
    half the 264 slots of 132 SMs), the split launch at M <= 64 (33 tiles)."""
    triton_low = next(l for l in LOWERINGS if l.name == "triton_int_weight")
    above = [l.name for l in LOWERINGS if l.family == "int_weight" and l.priority > triton_low.priority]
    monkeypatch.setenv("QOPS_DISABLE_LOWERINGS", ",".join(above))
    case, dtype, form = item
    w, w64 = prepared(case, dtype, form)
    w = dataclasses.replace(w, kernel=Kernel.TRITON)
    bias = rand(case.n, dtype=dtype, seed=9)
    compiled = torch.compile(lambda x: w.mm(x, bias), fullgraph=True)
    with T.config_override(wgmma_table(tile)):
        for m in (1, 17, 64, 257):
            assert T._plan(m, case.n, case.k, 4, case.group_size, torch.device("cuda"))["path"] == "wgmma"
            x = rand(m, case.k, dtype=dtype, seed=20 + m)
            check(w.mm(x, bias), x, w64, bias, f"op M={m}")
            check(compiled(x), x, w64, bias, f"compiled M={m}")
        x = rand(17, case.k, dtype=dtype, seed=40)
        y = replay_captured(lambda: w.mm(x, bias), x, rand(17, case.k, dtype=dtype, seed=41))
        check(y, x, w64, bias, "op graph replay")


def test_a_deterministic_request_keeps_the_splits_as_partials(monkeypatch):
    """Under ``QOPS_DETERMINISTIC=1`` the op's split launch through a ``wgmma`` bucket stores its splits as partials
    (no atomic adds) and keeps their count: the oracle's answer, the same bits on every call and every replay."""
    case, dtype, form = CASES[1]
    w, w64 = prepared(case, dtype, form)
    w = dataclasses.replace(w, kernel=Kernel.TRITON)
    bias = rand(case.n, dtype=dtype, seed=70)
    x = rand(17, case.k, dtype=dtype, seed=71)
    monkeypatch.setenv("QOPS_DISABLE_LOWERINGS", ",".join(
        l.name for l in LOWERINGS if l.family == "int_weight" and l.name != "triton_int_weight"))
    monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
    with T.config_override(wgmma_table({**TILES[3], "split": 3})):
        go = T._plan(17, case.n, case.k, 4, case.group_size, torch.device("cuda"))["launch"]
        assert go["split"] == 3 and G.split_out_mode(go["tile"]) == 1
        y = w.mm(x, bias)
        check(y, x, w64, bias, "deterministic split")
        assert all(torch.equal(y, w.mm(x, bias)) for _ in range(3)), "not the same bits on every call"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            z = w.mm(x, bias)
        for _ in range(3):
            z.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(z, y), "a replay gave other bits"


def test_a_refused_call_takes_the_bucket_gemm(monkeypatch):
    """A 4-bit g32 weight (its group splits the kernel's 64-row K step) through a ``wgmma`` bucket: the refusal
    sends it to the bucket's Triton GEMM, which must still match the oracle."""
    case = Case("gptq", 4, 32, False, False, "v2", 1032, 512)
    w, w64 = prepared(case, torch.float16, "flat")
    w = dataclasses.replace(w, kernel=Kernel.TRITON)
    x = rand(17, case.k, dtype=torch.float16, seed=50)
    bias = rand(case.n, dtype=torch.float16, seed=51)
    assert "group_size" in G.refusal(x, 4, 32, case.k, case.n)
    with T.config_override(wgmma_table(TILES[0])):
        check(w.mm(x, bias), x, w64, bias, "fallback")
