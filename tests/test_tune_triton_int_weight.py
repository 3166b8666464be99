"""``benchmarks/tune_triton_int_weight.py --dry-run``: the tuner's candidate check, timing, table and rows on a
tiny shape under Triton's interpreter (its numbers mean nothing). The table it writes must load as a shipped
one would, its picks must be among the timed candidates, and every timed candidate must be kept with its
per-shape times (what a later reading needs to ask why a config lost)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from qops.ops.triton import int_weight as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_a_loadable_table_and_every_candidate(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_triton_int_weight.py"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = json.loads((tmp_path / "dry-run.json").read_text())
    rows = json.loads((tmp_path / "tune_rows.json").read_text())
    assert not table["tuned"] and not rows["dropped"]
    assert set(table["decode_max_m"]) == {"4", "8", "default"}  # where the GEMM overtakes the GEMV, per width
    with T.config_override(table):
        for bits in (4, 8):
            for m in (1, 16, 256):
                assert T._bucket(table["gemm"], bits, m) and T._bucket(table["decode"], bits, min(m, 4))
    timed = {(c["bits"], c["M"], c["path"], json.dumps(c["config"], sort_keys=True)) for c in rows["candidates"]}
    assert all(c["us"] and all(v > 0 for v in c["us"].values()) for c in rows["candidates"])
    assert {path for _, _, path, _ in timed} == {"decode", "gemm", "dense"}
    # the variants tried on each bucket's best: the atomic reduction, the GEMM's scales a K tile ahead
    assert any(c["config"].get("reduce") == "atomic" for c in rows["candidates"])
    assert any(c["config"].get("prefetch_scales") == 1 and c["path"] == "gemm" for c in rows["candidates"])
    assert any(c["config"].get("stream_k") == 1 and c["path"] == "gemm" for c in rows["candidates"])
    assert any(c["config"].get("scale_weight") == 1 and c["path"] == "gemm" for c in rows["candidates"])
    for path in ("decode", "gemm"):  # and a register cap
        assert any(c["config"].get("maxnreg") and c["path"] == path for c in rows["candidates"]), path
    for r in rows["rows"]:
        bits = int(r["format"][1])
        assert (bits, r["M"], r["path"], json.dumps(r["config"], sort_keys=True)) in timed, r
    assert "bits N x K M path" in done.stdout
    # the same selection from the saved candidates alone (--from-rows), with no timing
    again = tmp_path / "again"
    again.mkdir()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_triton_int_weight.py"), "--from-rows",
                           str(tmp_path / "tune_rows.json")], env={**env, "OUT": str(again)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rebuilt = json.loads((again / "dry-run.json").read_text())
    assert {k: v for k, v in rebuilt.items() if k != "source"} == {k: v for k, v in table.items() if k != "source"}


def _tuner():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import tune_triton_int_weight
    finally:
        sys.path.pop(0)
    return tune_triton_int_weight


def test_widths_not_timed_take_the_picks_without_four_bit_knobs():
    """2- and 3-bit weights ("default") never run ``even_odd``: their GEMM picks and their GEMV / GEMM crossover
    come from the 4-bit candidates without it, while the 4-bit entries keep the knob where it wins."""
    tuner = _tuner()
    shapes = tuner.SHAPES
    plain = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
    halves = {**plain, "BLOCK_N": 128, "even_odd": 1}
    decode = {"BLOCK_N": 256, "CHUNKS": 4}
    times = {}
    def put(bits, m, path, cfg, us):
        times[(bits, m, path, json.dumps(cfg, sort_keys=True))] = {shape: us for shape in shapes}
    for bits in tuner.BITS:
        for m in tuner.DECODE_MS:
            put(bits, m, "decode", decode, 30.0 + m)          # the GEMV: 31, 32, 34 us
        for m in tuner.GEMM_MS:
            put(bits, m, "gemm", plain, 40.0 + m)             # slower than the GEMV at M <= 4
            if bits == 4:
                put(bits, m, "gemm", halves, 20.0 + m)        # faster than both from M = 1
    table = tuner.build_table(times, "test", "test")
    assert table["decode_max_m"] == {"4": 1, "8": 4, "default": 4}  # 1: the least it takes
    assert all(table["gemm"]["4"][str(m)] == halves for m in tuner.GEMM_MS)
    assert all(table["gemm"][key][str(m)] == plain for key in ("8", "default") for m in tuner.GEMM_MS)
    assert table["decode"]["default"] == table["decode"]["4"]


def test_tables_selected_from_saved_rows_are_what_the_rows_give():
    """A shipped table made with ``--from-rows`` is what the committed rows file it names gives now, with the
    hand amendments it lists (``amended``: what, why, from which measurement): the selection it ships can be
    checked and redone without a GPU."""
    tuner = _tuner()
    checked = 0
    for path in sorted(T.CONFIG_DIR.glob("*.json")):
        table = json.loads(path.read_text())
        if not table["source"].startswith("benchmarks/tune_triton_int_weight.py --from-rows "):
            continue
        rows = table["source"].split("--from-rows ")[1].split(":")[0]
        times, head = tuner.times_from_rows(os.path.join(ROOT, "benchmarks", "results", rows))
        selected = tuner.build_table(times, head["gpu"], table["source"])
        assert tuner.amend(selected, table.get("amended", [])) == table, path.name
        checked += 1
    assert checked >= 1  # the H100's table


def test_shipped_tables_hold_what_their_amendments_set():
    """Every shipped table with an ``amended`` list (hand changes, each naming why and its results file)
    holds what each amendment sets: applying them again changes nothing, so the list and the table agree,
    whether the table was selected from saved rows or not (the H200's was not)."""
    tuner = _tuner()
    amended = 0
    for path in sorted(T.CONFIG_DIR.glob("*.json")):
        table = json.loads(path.read_text())
        changes = table.get("amended", [])
        for change in changes:
            assert {"path", "set", "why", "evidence"} <= set(change), (path.name, change)
            for name in change["evidence"].replace(",", " ").split():
                if name.endswith(".json"):  # each named results file is committed (the first with its folder)
                    assert os.path.exists(os.path.join(ROOT, "benchmarks", "results", os.path.basename(name))), name
        assert tuner.amend(table, changes) == table, path.name
        amended += bool(changes)
    assert amended >= 2  # the H100's and the H200's
