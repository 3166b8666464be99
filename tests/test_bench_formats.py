"""``benchmarks/bench_bnb_int8.py`` and ``benchmarks/bench_fp8.py`` with ``--dry-run`` (the CPU, tiny shapes,
the reference lowerings: their plumbing, correctness checks and JSON; the times mean nothing): every row
carries the fields PERF.md asks of a results row, is checked against float64, and the file says when it ran
and with which arguments."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERF_ROW_FIELDS = ("op", "format", "N", "K", "M", "dtype", "qops_us", "cublas_fp16_us", "roofline_us")


@pytest.mark.parametrize("script,ok", [
    ("bench_bnb_int8", lambda row: row["correct"]),
    ("bench_fp8", lambda row: all(row.get(e, 0) is not None and row.get(e, 0) < 2e-2 for e in ("rel_err", "rel_err_out"))),
])
def test_dry_run_rows(script, ok, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    bench = __import__(script)

    out = tmp_path / "given.json"
    assert bench.main(["--dry-run", "--trials", "1", "--shapes", "256x512", "--ms", "1,16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["args"]["shapes"] == ["256x512"] and res["args"]["ms"] == [1, 16] and res["date"].endswith("+00:00")
    assert res["rows"] and {r["M"] for r in res["rows"]} == {1, 16}
    for row in res["rows"]:
        assert all(row.get(f) is not None for f in PERF_ROW_FIELDS), row
        assert ok(row), row
    if script == "bench_fp8":  # the W8A16 rows check the out= form too (into a NaN-filled buffer)
        assert all("rel_err_out" in r for r in res["rows"] if r["op"] == "mm_fp8_weight")
    assert not (tmp_path / f"{script}.json").exists()  # the working directory is the fallback only
