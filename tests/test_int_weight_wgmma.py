"""The Gluon W4A16 GEMM (``qops/ops/triton/int_weight_wgmma.py``) on the CPU: its K order against the MMA
fragment's, its refusals, and its builds compiled for sm_90 (Triton's interpreter does not run Gluon; the GPU
suite's ``tests/gpu/test_gpu_int_weight_wgmma.py`` runs them against the float64 oracle)."""
from __future__ import annotations

import copy
import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from qops.ops.triton import common as C
from qops.ops.triton import int_weight_wgmma as G


def fragment_positions(t: int) -> list[int]:
    """The K positions (within one 32-row block) that lane ``l`` with ``l % 4 == t`` holds in a warpgroup
    MMA's A fragment of fp16 / bf16 (PTX ISA, wgmma register fragments: per 16-row chunk, pairs at
    ``2t`` and ``2t + 8``), in the order chunk, then pair, then element."""
    return [16 * chunk + 8 * pair + 2 * t + e for chunk in (0, 1) for pair in (0, 1) for e in (0, 1)]


def test_gather_order_is_the_fragments_order():
    # Lane t holds word 4b + t of block b, whose value j is weight row 32b + 8t + j. The unpack's output o
    # is value WORD_ORDER[o] (its PTX run in tests/test_triton_int_weight.py), and output o fills the o-th
    # position the fragment gives that lane: that position must multiply x's column of weight row
    # 32b + 8t + WORD_ORDER[o].
    k = 256
    order = G._gather_order(k)
    assert sorted(order.tolist()) == list(range(k))
    assert sorted(G.WORD_ORDER) == list(range(8))
    for b in range(k // 32):
        for t in range(4):
            for o, q in enumerate(fragment_positions(t)):
                assert order[32 * b + q] == 32 * b + 8 * t + G.WORD_ORDER[o]


@pytest.mark.parametrize("block_n,warps", [(128, 4), (64, 4), (256, 4), (256, 8), (128, 8)])
def test_memory_rows_give_a_thread_consecutive_weight_rows(block_n, warps):
    # A thread of the A fragment holds MMA rows 16 w + l / 4 + 8 p + 16 warps b (p 0 / 1, b over the row blocks);
    # memory_row must be a permutation of the tile's rows taking each thread's 2R rows to 2R consecutive ones
    # (aligned: one vector load of words, scales and zero points).
    rows = [G.memory_row(i, block_n, warps) for i in range(block_n)]
    assert sorted(rows) == list(range(block_n))
    blocks = block_n // (16 * warps)
    for w in range(warps):
        for lane in range(0, 32, 4):
            mine = sorted(rows[16 * w + lane // 4 + 8 * p + 16 * warps * b] for p in (0, 1) for b in range(blocks))
            assert mine == list(range(mine[0], mine[0] + 2 * blocks)) and mine[0] % (2 * blocks) == 0


@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_bias_bits_are_the_unpacks_biases(half):
    # The kernel builds its bias operands from BIAS_BITS with integer operations; each must be the pattern of
    # -(magic * 2**-s + z), for the unpack's in-place offsets in order and every zero point the formats store
    # (4-bit, plus GPTQ v1's offset of 1).
    dtype = torch.float16 if half == "f16" else torch.bfloat16
    magic = C.HALF_FORMATS[half][2]
    offsets = C.half_offsets(4, half, G.WORD_ORDER)
    assert len(offsets) == len(G.BIAS_BITS[half]) and all(lo == hi for lo, hi in offsets)
    for (s, _), (base, step) in zip(offsets, G.BIAS_BITS[half]):
        for z in range(17):
            want = int(torch.tensor(-(magic / 2**s + z)).to(dtype).view(torch.int16)) & 0xFFFF
            assert base + step * z == want, (half, s, z)


def test_unpack_pairs_need_no_byte_permute():
    # the point of WORD_ORDER: each register's two values 16 bits apart, one LOP3 of the word in place
    for half in ("f16", "bf16"):
        code, _ = C.half_unpack_asm(4, half, G.WORD_ORDER, scaled=True)
        assert "prmt" not in code and code.count("lop3") == 4


def test_x_gather_index_folds_act_order():
    k = 128
    perm = torch.randperm(k)
    idx = G.x_gather_index(k, perm, torch.device("cpu"))
    assert torch.equal(idx, perm[G._gather_order(k)])
    assert torch.equal(G.x_gather_index(k, None, torch.device("cpu")), G._gather_order(k))


@pytest.mark.parametrize("kwargs,names", [
    (dict(bits=8), "bits"),
    (dict(dtype=torch.float32), "x"),
    (dict(k=4160 + 32), "in_features"),
    (dict(group_size=32), "group_size"),
    (dict(n=4100), "out_features"),
    (dict(), "x: needs a Hopper GPU"),
])
def test_refusals_name_the_argument(kwargs, names):
    x = torch.zeros(2, 8, dtype=kwargs.get("dtype", torch.float16))
    why = G.refusal(x, kwargs.get("bits", 4), kwargs.get("group_size", 128), kwargs.get("k", 4096), kwargs.get("n", 4096))
    if G.available() is not None and names == "x: needs a Hopper GPU":
        assert why.startswith("no Gluon"), why
    else:
        assert why is not None and why.startswith(names), why


def ptxas_for_sm90() -> str:
    """The ptxas Triton itself runs for sm_90 (Triton 3.9 ships two; the older one cannot read its PTX)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except (ImportError, TypeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_report(ptx: str) -> str:
    exe = ptxas_for_sm90()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        return subprocess.run([exe, "-arch=sm_90a", "-v", path, "-o", path + ".o"], capture_output=True, text=True,
                              check=True).stderr


@pytest.mark.skipif(G.available() is not None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("tile,dtype,zeros,split", [
    ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4}, torch.float16, True, False),
    ({"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 64, "STAGES": 4}, torch.bfloat16, False, True),
    ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3}, torch.float16, True, True),  # the H100 table's
    ({"BLOCK_N": 256, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4, "WARPS": 8}, torch.bfloat16, True, False),
    ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "stream_k": 1}, torch.float16, True, False),
    ({"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "stream_k": 1}, torch.bfloat16, False, False),
    # the H100 table's M = 4 / 8, 16 and 32 buckets'
    ({"BLOCK_N": 128, "BLOCK_M": 8, "BLOCK_K": 128, "STAGES": 4}, torch.float16, True, True),
    ({"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 128, "STAGES": 4, "stream_k": 1}, torch.bfloat16, True, False),
    ({"BLOCK_N": 128, "BLOCK_M": 32, "BLOCK_K": 128, "STAGES": 4}, torch.float16, False, False),
    # a split launch storing partials
    ({"BLOCK_N": 128, "BLOCK_M": 8, "BLOCK_K": 128, "STAGES": 4, "reduce": "partials"}, torch.bfloat16, True, True),
])
def test_builds_keep_the_mmas_asynchronous(tile, dtype, zeros, split):
    """Each build compiles for sm_90 with no spill, and ptxas keeps its warpgroup MMAs asynchronous: its C7515
    ("wgmma.mma_async instructions are serialized") came from the loop's zero-trip path, which ``gl.assume``
    removed; a change that brings it back waits for every MMA and loses the kernel's point."""
    k = G.sm90_build(tile, dtype, zeros, split)
    report = ptxas_report(k.asm["ptx"])
    assert "C7515" not in report and "serialized" not in report, report
    assert "0 bytes spill stores" in report, report
    assert "wgmma.mma_async" in k.asm["ptx"] and "wgmma.wait_group.sync.aligned 1" in k.asm["ptx"]
    # atomics: a split launch's adds into the one fp32 sum (not its partials'), stream-K's arrival counts
    adds = re.search(r"^\s*(@!?%p\d+\s+)?(red|atom)\.", k.asm["ptx"], re.MULTILINE) is not None
    assert adds == (tile.get("reduce", "atomic") == "atomic" if split else bool(tile.get("stream_k"))), tile


@pytest.mark.skipif(G.available() is not None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("tile,split", [
    ({"BLOCK_N": 128, "BLOCK_M": 8, "BLOCK_K": 128, "STAGES": 4}, True),
    ({"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 128, "STAGES": 4, "stream_k": 1}, False),
])
def test_the_dependent_build_copies_words_before_it_waits_for_the_gather(tile, split):
    """As the gather's programmatic dependent, a program's first word copies are issued before its grid
    dependency wait and no copy group is committed before it (x's copies come after); a split build lets the
    reduction after it launch early (a launch without PDL finds the wait already met)."""
    ptx = G.sm90_build(tile, torch.float16, True, split).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "cp.async" in ptx[:wait] and "cp.async.commit_group" not in ptx[:wait]
    assert ("griddepcontrol.launch_dependents" in ptx) == split


@pytest.mark.parametrize("k,split", [(4096, 3), (384, 5), (256, 1), (8192, 64), (192, 7)])
def test_plan_has_no_empty_split(k, split):
    # the kernel assumes each program has a K step at least (gl.assume: its MMAs stay asynchronous)
    go = G.plan(64, 4104, k, 4, -1, {"split": split})
    steps = k // go["tile"]["BLOCK_K"]
    assert go["split"] <= min(split, steps) and go["split_len"] % go["tile"]["BLOCK_K"] == 0
    assert (go["split"] - 1) * go["split_len"] < k <= go["split"] * go["split_len"]
    assert go["grid"] == (-(-4104 // go["tile"]["BLOCK_N"]), 1, go["split"])


def test_workspace_holds_x_and_the_sum():
    go = G.plan(17, 4104, 4096, 4, 128, {"split": 3})
    assert G.workspace_bytes(17, 4104, 4096, go) >= 2 * 17 * 4096 + 4 * 17 * 4104
    partials = G.plan(17, 4104, 4096, 4, 128, {"split": 3, "reduce": "partials"})
    assert G.workspace_bytes(17, 4104, 4096, partials) == C.scratch_aligned(2 * 17 * 4096) + C.scratch_aligned(3 * 4 * 17 * 4104)
    with pytest.raises(ValueError, match="reduce must be one of"):
        G.plan(17, 4104, 4096, 4, 128, {"split": 3, "reduce": "partial"})
    assert G.workspace_bytes(17, 4104, 4096, G.plan(17, 4104, 4096, 4, 128, {})) == -(-2 * 17 * 4096 // 256) * 256
    ws = torch.zeros(G.workspace_bytes(17, 4104, 4096, go), dtype=torch.uint8)
    x = C.workspace_view(ws, (17, 4096), torch.float16, ws.device)
    s = C.workspace_view(ws, (17, 4104), torch.float32, ws.device, offset=G._scratch_parts(17, 4104, 4096, go)[0])
    assert x.data_ptr() == ws.data_ptr() and s.data_ptr() + s.numel() * 4 <= ws.data_ptr() + ws.numel()
    assert C.workspace_view(ws[:10], (17, 4096), torch.float16, ws.device).data_ptr() != ws.data_ptr()  # too small: fresh


SK_TILE = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "ctas_per_sm": 2, "stream_k": 1}


@pytest.mark.parametrize("m,n,k", [(64, 28672, 4096), (64, 57344, 8192), (128, 8192, 28672), (17, 4104, 1024),
                                   (257, 4104, 128), (1, 128, 8192)])
def test_stream_k_runs_cover_every_step_once_in_one_wave(m, n, k):
    go = G.plan(m, n, k, 4, -1, SK_TILE, 132)
    assert go["stream_k"] and go["grid"] == (go["programs"], 1, 1) and go["programs"] <= 2 * 132
    steps = k // 128
    assert go["tiles"] == -(-n // 128) * -(-m // 64) and go["tiles_m"] == -(-m // 64)
    # the programs' runs (as the kernel walks them) cover each (tile, step) once
    seen = torch.zeros(go["tiles"] * steps, dtype=torch.int32)
    shared = {}
    for c in range(go["programs"]):
        it, end = c * go["run"], min((c + 1) * go["run"], go["tiles"] * steps)
        assert it < end  # no empty program
        while it < end:
            tile = it // steps
            last = min(end - tile * steps, steps)
            seen[it:tile * steps + last] += 1
            if last - (it - tile * steps) < steps:
                shared.setdefault(tile, []).append(c)
            it = tile * steps + last
    assert bool((seen == 1).all())
    # a shared tile's programs are the ones the kernel's last arrival reads: c0 .. c1, c0's run starting it
    for tile, progs in shared.items():
        c0, c1 = tile * steps // go["run"], ((tile + 1) * steps - 1) // go["run"]
        assert progs == list(range(c0, c1 + 1)) and c0 * go["run"] <= tile * steps
    parts = G._scratch_parts(m, n, k, go)
    assert parts[1] == -(-4 * 2 * go["programs"] * 128 * 64 // 256) * 256 and parts[2] >= 4 * go["tiles"]


def wgmma_table(tile: dict) -> dict:
    from qops.ops.triton import int_weight as T

    table = copy.deepcopy(T.load_config("h100"))
    table["decode_max_m"] = 0
    section = table["gemm"]["4"]
    table["gemm"]["4"] = {key: {**cfg, "wgmma": dict(tile)} for key, cfg in section.items()}
    return table


def test_a_wgmma_bucket_plans_the_kernel_with_its_gemm_as_fallback(monkeypatch):
    from qops.ops.triton import int_weight as T

    cpu = torch.device("cpu")
    with T.config_override(wgmma_table({"BLOCK_N": 128, "BLOCK_M": 64, "split": 2})):
        p = T._plan(64, 4096, 4096, 4, 128, cpu)
        assert p["path"] == "wgmma" and p["launch"]["split"] == 2 and p["fallback"]["path"] == "gemm"
        assert p["fallback"]["cfg"] is p["cfg"]  # the bucket's own GEMM, as shipped
        assert T._plan(64, 4096, 4096, 8, 128, cpu)["path"] == "gemm"  # 8-bit buckets hold no wgmma tile
        assert T._plan(64, 4096, 4096, 4, 32, cpu)["path"] == "gemm"  # g32 splits the kernel's K tile
        need = T.workspace_bytes(64, 4096, 4096, 4, 128, cpu)
        assert need >= G.workspace_bytes(64, 4096, 4096, p["launch"])
        assert need >= T._gemm_workspace_bytes(p["fallback"], 64, 4096, 4096, False)
        # an act-order weight: the fallback GEMM's gathered x too
        gathered = T.workspace_bytes(64, 4096, 4096, 4, 128, cpu, act_order=True)
        assert gathered >= T._gemm_workspace_bytes(p["fallback"], 64, 4096, 4096, True) >= 4 * 64 * 4096
        monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
        go = T._plan(64, 4096, 4096, 4, 128, cpu)["launch"]  # no atomic adds: the same splits, as partials
        assert go["split"] == 2 and G.split_out_mode(go["tile"]) == 1
        assert T.workspace_bytes(64, 4096, 4096, 4, 128, cpu) >= G.workspace_bytes(64, 4096, 4096, go)
    with T.config_override(wgmma_table({"BLOCK_N": 128, "BLOCK_M": 64, "stream_k": 1})):
        # stream-K sums a shared tile in program order: it stays under the deterministic request
        go = T._plan(64, 4096, 4096, 4, 128, cpu)["launch"]
        assert go["stream_k"] and go["split"] == 1
        assert T.workspace_bytes(64, 4096, 4096, 4, 128, cpu) >= G.workspace_bytes(64, 4096, 4096, go)
    table = {**wgmma_table({"BLOCK_N": 128, "BLOCK_M": 64, "stream_k": 1, "stream_k_min_waves": 1}), "num_sms": 132}
    with T.config_override(table):
        # a stream-K tile's split launch (32 tiles: under a wave of 264) adds its splits atomically: partials instead
        go = T._plan(64, 4096, 4096, 4, 128, cpu)["launch"]
        assert not go["stream_k"] and go["split"] == 8 and G.split_out_mode(go["tile"]) == 1
        monkeypatch.delenv("QOPS_DETERMINISTIC")
        go = T._plan(64, 4096, 4096, 4, 128, cpu)["launch"]
        assert go["split"] == 8 and G.split_out_mode(go["tile"]) == 2


def test_plan_splits_to_its_programs_per_sm_and_leaves_few_tiles_to_the_gemm():
    tile = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "ctas_per_sm": 2, "min_tiles": 64}
    # the H100's best splits at M = 64 (probe-wgmma-splits): 224 and 448 tiles one, 64 tiles four
    assert G.plan(64, 28672, 4096, 4, 128, tile, 132)["split"] == 1
    assert G.plan(64, 57344, 8192, 4, 128, tile, 132)["split"] == 1
    assert G.plan(64, 8192, 28672, 4, 128, tile, 132)["split"] == 4
    assert G.plan(128, 8192, 28672, 4, 128, tile, 132)["split"] == 2
    assert G.plan(64, 4096, 14336, 4, 128, tile, 132) is None  # 32 tiles
    assert G.plan(128, 4096, 14336, 4, 128, tile, 132)["split"] == 4
    # few tiles with a long K take the kernel where the tile says so (the K rule of stop 68's H100 probe)
    long_k = {**tile, "long_k_steps": 112}
    assert G.plan(64, 4096, 14336, 4, 128, long_k, 132)["split"] == 8  # 32 tiles, 112 K tiles
    assert G.plan(64, 4096, 28672, 4, 128, long_k, 132)["split"] == 8
    assert G.plan(64, 4096, 14208, 4, 128, long_k, 132) is None  # 111 K tiles
    assert G.plan(64, 4096, 4096, 4, 128, long_k, 132) is None
    assert G.plan(64, 28672, 4096, 4, 128, long_k, 132)["split"] == 1  # 224 tiles: min_tiles alone decides
    # a short K is the GEMM's whatever the tiles where the tile says so (the H100's 32-row tile at M = 32)
    short_k = {**tile, "BLOCK_M": 32, "min_k_steps": 64}
    assert G.plan(32, 28672, 4096, 4, 128, short_k, 132) is None  # 224 tiles, 32 K tiles
    assert G.plan(32, 57344, 8192, 4, 128, short_k, 132)["split"] == 1  # 64 K tiles
    assert G.plan(32, 8192, 28672, 4, 128, short_k, 132)["split"] == 4
    assert G.plan(32, 4096, 14336, 4, 128, {**short_k, "long_k_steps": 112}, 132)["split"] == 8
    # stream-K only over a wave of tiles where the tile says so (the H200's M = 64 probe): 264 slots on 132 SMs
    sk = {**tile, "stream_k": 1, "stream_k_min_waves": 1}
    assert G.plan(64, 57344, 8192, 4, 128, sk, 132)["stream_k"]  # 448 tiles
    assert G.plan(64, 33792, 8192, 4, 128, sk, 132)["stream_k"]  # 264 tiles, one wave
    assert G.plan(64, 33664, 8192, 4, 128, sk, 132)["split"] == 1  # 263 tiles: the split launch
    assert not G.plan(64, 28672, 4096, 4, 128, sk, 132)["stream_k"]  # 224 tiles
    assert G.plan(64, 8192, 28672, 4, 128, sk, 132)["split"] == 4  # 64 tiles
    assert G.plan(64, 28672, 4096, 4, 128, {**sk, "stream_k_min_waves": 0}, 132)["stream_k"]
    # a weight the kernel refuses plans no launch (the bucket's GEMM takes it, the shape checked once)
    assert G.plan(64, 28672, 4096, 8, 128, tile, 132) is None
    assert G.plan(64, 28672, 4096, 4, 32, tile, 132) is None


def test_few_tiles_replans_a_call_of_too_few_tiles_before_the_gemm():
    """``few_tiles``: a call with fewer output tiles than ``min_tiles`` is planned again with those keys (the
    H100's M = 64 tile: 64-wide, 4 stages) before it is left to the GEMM; their own min_tiles / long_k_steps then
    decide, and a call with enough tiles keeps the tile."""
    tile = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "ctas_per_sm": 2, "min_tiles": 64,
            "long_k_steps": 112, "stream_k": 1, "stream_k_min_waves": 1, "few_tiles": {"BLOCK_N": 64, "STAGES": 4}}
    go = G.plan(64, 4096, 4096, 4, 128, tile, 132)  # 32 wide tiles, 64 narrow: four splits of 264 slots
    assert go["tile"]["BLOCK_N"] == 64 and go["tile"]["STAGES"] == 4 and go["split"] == 4 and "few_tiles" not in go["tile"]
    assert go["grid"] == (64, 1, 4)
    # 96 narrow tiles: 264 / 96 rounds to 3 splits, 288 programs, a partial second wave; 2 fill one wave
    assert G.plan(64, 6144, 4096, 4, 128, tile, 132)["split"] == 2
    assert G.plan(64, 6144, 4096, 4, 128, tile, 144)["split"] == 3  # 288 slots: 3 splits fill one wave
    assert G.plan(64, 4096, 14336, 4, 128, tile, 132)["tile"]["BLOCK_N"] == 64  # before the long-K rule
    assert G.plan(64, 2048, 4096, 4, 128, tile, 132) is None  # 32 narrow tiles, 32 K tiles: the GEMM's
    assert G.plan(64, 2048, 14336, 4, 128, tile, 132)["tile"]["BLOCK_N"] == 64  # 112 K tiles
    wide = G.plan(64, 8192, 28672, 4, 128, tile, 132)  # 64 tiles: the tile itself
    assert wide["tile"]["BLOCK_N"] == 128 and wide["split"] == 4
    assert G.plan(64, 57344, 8192, 4, 128, tile, 132)["stream_k"]
    # the narrow tile's own keys decide where it has them
    assert G.plan(64, 4096, 4096, 4, 128, {**tile, "few_tiles": {"BLOCK_N": 64, "min_tiles": 128}}, 132) is None
    for bad in ({"BLOCK_N": 64, "few_tiles": {}}, [64]):
        with pytest.raises(ValueError, match="few_tiles must be a mapping"):
            G.plan(64, 4096, 4096, 4, 128, {**tile, "few_tiles": bad}, 132)
    with pytest.raises(ValueError, match=r"unknown keys \['BLOCK_NN'\]"):
        G.plan(64, 4096, 4096, 4, 128, {**tile, "few_tiles": {"BLOCK_NN": 64}}, 132)
    from qops.ops.triton import int_weight as T

    table = T.load_config("h100")
    table["gemm"]["4"]["64"]["wgmma"]["few_tiles"]["BLOCK_NN"] = 64
    assert "['few_tiles']: unknown keys ['BLOCK_NN']" in T.entry_key_refusal(table)


def test_a_tile_with_an_unknown_key_is_refused_and_shipped_tiles_have_none():
    tile = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3, "stream_k_min_wave": 1}  # misspelt
    with pytest.raises(ValueError, match=r"unknown keys \['stream_k_min_wave'\]"):
        G.plan(64, 57344, 8192, 4, 128, tile, 132)
    from qops.ops.triton import int_weight as T

    for gpu in ("default", "h100", "h200"):
        for bits, section in T.load_config(gpu)["gemm"].items():
            for bucket, cfg in section.items():
                if "wgmma" in cfg:
                    assert set(cfg["wgmma"]) <= G.TILE_KEYS, (gpu, bits, bucket)
                    G.plan(int(bucket), 57344, 8192, 4, 128, cfg["wgmma"], 132)


def test_forcing_the_gemm_path_plans_the_triton_gemm():
    # the tuner and the tests force "gemm" to time the Triton GEMM of a bucket that names the wgmma kernel
    from qops.ops.triton import int_weight as T

    cpu = torch.device("cpu")
    with T.config_override(wgmma_table({"BLOCK_N": 128, "BLOCK_M": 64})):
        assert T._plan(64, 4096, 4096, 4, 128, cpu, "gemm")["path"] == "gemm"
        assert T._plan(64, 4096, 4096, 4, 128, cpu, "wgmma")["path"] == "wgmma"
