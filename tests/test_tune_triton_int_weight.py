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
    for r in rows["rows"]:
        bits = int(r["format"][1])
        assert (bits, r["M"], r["path"], json.dumps(r["config"], sort_keys=True)) in timed, r
    assert "bits N x K M path" in done.stdout
