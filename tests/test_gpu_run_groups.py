"""scripts/gpu_run.sh's concurrent GPU-suite mode (QOPS_TEST_JOBS): the groups of
scripts/gpu_test_groups.txt select every GPU test exactly once, the groups' junit XMLs merge into one
file (a missing one is named, not dropped), and the script runs a groups file end to end on this box
(where every GPU test skips)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import merge_junit  # noqa: E402


def _groups(path: Path) -> list[list[str]]:
    return [shlex.split(line) for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _gpu_test_ids() -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert r.returncode == 0 and ids, r.stdout[-2000:] + r.stderr[-2000:]
    return ids


def _selects(args: list[str], test_id: str) -> bool:
    """Whether pytest run with ``args`` (files and at most one -k) selects ``test_id``. -k matches a
    case-insensitive substring of the item's names, which are all inside its node id here (the tests'
    -k words name test functions; none is part of a file or directory name, checked below)."""
    files, expr = [], None
    it = iter(args)
    for a in it:
        if a == "-k":
            expr = next(it)
        else:
            assert not a.startswith("-") and (ROOT / a).is_file(), f"groups hold test files and -k only: {a}"
            files.append(a)
    if test_id.split("::")[0] not in files:
        return False
    if expr is None:
        return True
    from _pytest.mark.expression import Expression  # pytest's own -k grammar (pytest >= 8, a test dependency)

    low = test_id.lower()
    return Expression.compile(expr).evaluate(lambda name, **kw: name.lower() in low)


def test_the_groups_select_every_gpu_test_exactly_once():
    groups = _groups(ROOT / "scripts" / "gpu_test_groups.txt")
    ids = _gpu_test_ids()
    words = {w for g in groups for i, a in enumerate(g) if i and g[i - 1] == "-k" for w in a.replace("(", " ").replace(")", " ").split()}
    words -= {"and", "or", "not"}
    for w in words:  # a -k word inside a path would select a whole file, not the tests it names
        assert not any(w.lower() in t.split("::")[0].lower() for t in ids), w
    owners = {t: [i for i, g in enumerate(groups) if _selects(g, t)] for t in ids}
    assert not [t for t, o in owners.items() if not o], "tests no group runs"
    assert not {t: o for t, o in owners.items() if len(o) > 1}, "tests two groups run"


def _junit(path: Path, suite: str, cases: dict[str, str]) -> Path:
    ts = ET.Element("testsuite", name=suite, tests=str(len(cases)), failures=str(sum(v == "failure" for v in cases.values())), errors="0")
    for name, outcome in cases.items():
        c = ET.SubElement(ts, "testcase", classname=suite, name=name)
        if outcome != "pass":
            ET.SubElement(c, outcome, message="x")
    root = ET.Element("testsuites")
    root.append(ts)
    ET.ElementTree(root).write(path)
    return path


def test_merge_keeps_every_suite_and_names_a_missing_input(tmp_path, capsys):
    a = _junit(tmp_path / "group-1.xml", "a", {"t1": "pass", "t2": "failure"})
    b = _junit(tmp_path / "group-2.xml", "b", {"t3": "skipped"})
    out = tmp_path / "merged.xml"
    assert merge_junit.main([str(out), str(a), str(tmp_path / "group-3.xml"), str(b)]) == 1
    root = ET.parse(out).getroot()
    assert [ts.get("source") for ts in root.iter("testsuite")] == ["group-1.xml", "group-2.xml"]
    assert [c.get("name") for c in root.iter("testcase")] == ["t1", "t2", "t3"]
    assert [p.get("value") for p in root.iter("property") if p.get("name") == "missing_input"] == ["group-3.xml"]
    assert "group-3.xml" in capsys.readouterr().err
    assert merge_junit.main([str(out), str(a), str(b)]) == 0


def test_gpu_run_runs_groups_concurrently_and_merges_their_xml(tmp_path):
    groups = tmp_path / "groups.txt"
    groups.write_text("# two groups\ntests/gpu/test_gpu_add_rmsnorm.py -k \"not nothing_matches_this\"\n\ntests/gpu/test_gpu_opcheck.py\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "QOPS_STEPS": "pytest_gpu", "QOPS_TEST_JOBS": "2",
           "QOPS_TEST_GROUPS": str(groups), "QOPS_TEST_TIMEOUT": "240"}
    env.pop("QOPS_TESTS", None)
    r = subprocess.run(["bash", "scripts/gpu_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "-- group 1 (rc 0)" in r.stdout and "-- group 2 (rc 0)" in r.stdout
    root = ET.parse(tmp_path / "out" / "pytest_gpu.xml").getroot()
    files = {c.get("classname", "").split(".")[-1] for c in root.iter("testcase")}
    assert files == {"test_gpu_add_rmsnorm", "test_gpu_opcheck"}, files


def test_gpu_retune_triton_stops_before_touching_the_tree_without_a_gpu(tmp_path):
    """scripts/gpu_retune_triton.sh overwrites the GPU's Triton table in the tree it runs in, so it must
    stop (rc 2) before anything when no CUDA device names the table; on this CPU box it does."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would tune")
    before = sorted(os.listdir(os.path.join(ROOT, "qops", "ops", "triton", "configs")))
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", "scripts/gpu_retune_triton.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(ROOT, "qops", "ops", "triton", "configs"))) == before
    assert not os.path.exists(tmp_path / "out" / "tune.log")
