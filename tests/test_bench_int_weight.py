"""``benchmarks/bench_int_weight.py --dry-run`` (its building, correctness, timing, JSON, table and TARGETS
code on tiny shapes on the CPU; its numbers mean nothing) and the load-only kernel of
``benchmarks/read_floor.py`` that the GPU run times beside the matmuls."""
from __future__ import annotations

import json
import os

import pytest

from qops.native import compiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_rows_and_no_read_floor_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import bench_int_weight

    out = tmp_path / "b.json"
    assert bench_int_weight.main(["--dry-run", "--ms", "1,16", "--trials", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["read_floor"] == "not measured: CUDA only"
    assert [(r["N"], r["K"], r["M"]) for r in res["rows"]] == [(256, 256, 1), (256, 256, 16), (384, 512, 1), (384, 512, 16)]
    assert all(r["correct"] and "read_floor_us" not in r and "pct_read_floor" not in r for r in res["rows"])
    printed = capsys.readouterr().out
    assert " floor" in printed and "TARGETS" in printed


def test_symmetric_weights_run_without_zero_points(tmp_path, capsys, monkeypatch):
    """``--symmetric``: GPTQ symmetric checkpoints, which prepare without zero points (the kernels' other
    builds, as compressed-tensors W4A16 runs), checked against the same float64 decoder."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import bench_int_weight

    out = tmp_path / "b.json"
    assert bench_int_weight.main(["--dry-run", "--symmetric", "--ms", "17", "--trials", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["sym"] and r["correct"] for r in rows)
    assert "GPTQ W4 g128 sym," in capsys.readouterr().out


@pytest.mark.skipif(compiler.runtime_missing() is not None, reason=f"NVRTC unusable: {compiler.runtime_missing()}")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_load_only_kernel_compiles(arch, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import read_floor

    assert compiler.cubin_problem(compiler.compile(read_floor.SOURCE, arch)) is None


def test_triton_config_option_runs_the_bench_on_the_named_table(monkeypatch, capsys):
    """``--triton-config h200`` makes the named table the Triton lowering's for the whole run (how an
    H100 run compares its own table with the H200's); an unknown name is refused, naming the known ones."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import torch

    import bench_int_weight
    from qops.ops.triton import int_weight as T

    seen = []
    monkeypatch.setattr(bench_int_weight, "run", lambda args: seen.append((args.triton_config, T.config_for(torch.device("cpu")))) or 0)
    assert bench_int_weight.main(["--dry-run", "--triton-config", "h200"]) == 0
    assert bench_int_weight.main(["--dry-run"]) == 0
    assert seen[0] == ("h200", T.load_config("h200")) and seen[1] == (None, T.load_config("default"))
    assert T.config_for(torch.device("cpu")) is T.load_config("default")  # the override ends with the run
    with pytest.raises(SystemExit):
        bench_int_weight.main(["--dry-run", "--triton-config", "a100"])
    assert "--triton-config: no configs/a100.json (known: default, h100, h200)" in capsys.readouterr().err


def test_compare_bench_pairs_rows_and_takes_the_geomean(tmp_path):
    """benchmarks/compare_bench.py: rows pair on their full key (lowering, format, shape, M, ...); a row
    that failed or timed nothing is unpaired, not a ratio; the geomean is over the pairs."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "compare_bench.py")
    spec = importlib.util.spec_from_file_location("compare_bench", path)
    cb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cb)
    base = dict(format="gptq", bits=4, group_size=128, sym=False, N=4096, K=4096, dtype="float16")
    a = {"rows": [dict(base, lowering="triton_int_weight", M=1, qops_us=10.0), dict(base, lowering="triton_int_weight", M=16, qops_us=20.0),
                  dict(base, lowering="native_w4a16", M=1, qops_us=8.0), dict(base, lowering="triton_int_weight", M=64, qops_us=None, error="E")]}
    b = {"rows": [dict(base, lowering="triton_int_weight", M=1, qops_us=5.0), dict(base, lowering="triton_int_weight", M=16, qops_us=40.0),
                  dict(base, lowering="native_w4a16", M=1, qops_us=8.0), dict(base, lowering="triton_int_weight", M=64, qops_us=30.0)]}
    pairs, geo, lone = cb.compare(a, b, "triton_int_weight")
    assert [(p[0][7], p[3]) for p in pairs] == [(1, 2.0), (16, 0.5)] and geo == pytest.approx(1.0)
    assert [dict(zip(cb.KEY, k))["M"] for k in lone] == [64]
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert cb.main([str(fa), str(fb)]) == 0  # all lowerings: the native pair too
    assert cb.main([str(fa), str(fb), "--lowering", "gemlite"]) == 1
