"""The NVRTC build record and the prefill script that replays it (no GPU needed): get_kernel's record
lines name exactly what the cache needs, and benchmarks/prefill_nvrtc_cache.py compiles them into the
entries a GPU run would look up, skipping builds the sources no longer accept."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from qops.native import compiler

pytestmark = pytest.mark.skipif(compiler.runtime_missing() is not None, reason=f"NVRTC unusable: {compiler.runtime_missing()}")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def prefill(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("prefill_nvrtc_cache", None)
    import prefill_nvrtc_cache
    return prefill_nvrtc_cache


def test_record_build_appends_one_line_per_build_only_when_asked(tmp_path, monkeypatch):
    path = tmp_path / "builds.jsonl"
    monkeypatch.delenv(compiler.RECORD_ENV, raising=False)
    compiler.record_build("w4a16_gemv.cu", "sm_90", {"QOPS_MT": 2})
    assert not path.exists()
    monkeypatch.setenv(compiler.RECORD_ENV, str(path))
    compiler.record_build("w4a16_gemv.cu", "sm_90", {"QOPS_MT": 2, "QOPS_DT": 1})
    compiler.record_build("smem_base.cu", "sm_80", {})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"source": "w4a16_gemv.cu", "arch": "sm_90", "defines": {"QOPS_DT": 1, "QOPS_MT": 2}},
                     {"source": "smem_base.cu", "arch": "sm_80", "defines": {}}]


def test_record_build_into_an_unwritable_place_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.setenv(compiler.RECORD_ENV, str(tmp_path / "missing-dir" / "builds.jsonl"))
    compiler.record_build("smem_base.cu", "sm_90", {})


def test_prefill_fills_the_keys_a_gpu_run_looks_up(tmp_path, monkeypatch, prefill):
    cache = tmp_path / "cache"
    monkeypatch.setenv(compiler.CACHE_ENV, str(cache))
    record = tmp_path / "builds.jsonl"
    monkeypatch.setenv(compiler.RECORD_ENV, str(record))
    compiler.record_build("smem_base.cu", "sm_90", {})
    compiler.record_build("smem_base.cu", "sm_90", {})  # recorded twice, built once
    compiler.record_build("smem_base.cu", "sm_80", {})
    # A build the current sources refuse (clusters need sm_90): reported and skipped.
    compiler.record_build("w4a16_gemv.cu", "sm_80", {"QOPS_CLUSTER": 2})
    stale = cache / "nvrtc" / ("0" * 64 + ".cubin")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"not needed")
    assert prefill.main([str(record), "--jobs", "1", "--keep-only"]) == 0
    want = {compiler.cache_key(compiler.native_source("smem_base.cu"), arch, compiler.native_options({})) for arch in ("sm_80", "sm_90")}
    assert {p.stem for p in (cache / "nvrtc").glob("*.cubin")} == want
    for key in want:
        assert (cache / "nvrtc" / f"{key}.cubin").read_bytes()[:4] == b"\x7fELF"


def test_prefill_refuses_a_file_that_is_not_a_record(tmp_path, prefill):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "smem_base.cu"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1 is not a build record"):
        prefill.main([str(bad)])


def test_prefill_builds_a_truncated_entry_again(tmp_path, monkeypatch, prefill, capsys):
    """A cache entry cut short (an interrupted copy) is not counted as cached: compiled and replaced."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(compiler.CACHE_ENV, str(cache))
    record = tmp_path / "builds.jsonl"
    record.write_text(json.dumps({"source": "smem_base.cu", "arch": "sm_90", "defines": {}}) + "\n")
    entry = compiler.cache_path(compiler.cache_key(compiler.native_source("smem_base.cu"), "sm_90", compiler.native_options({})))
    assert prefill.main([str(record), "--jobs", "1"]) == 0
    whole = entry.read_bytes()
    entry.write_bytes(whole[:100])
    capsys.readouterr()
    assert prefill.main([str(record), "--jobs", "1"]) == 0
    assert "(1 compiled, 0 already cached" in capsys.readouterr().out and entry.read_bytes() == whole
