"""``scripts/guarantee_matrix.py``: cells come from test outcomes found by id patterns -- pass,
FAIL, skipped, incomplete (a required test missing), "no test", and "not run" for a suite not
given -- and every format x lowering of the registries has a row."""
from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def gm(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import guarantee_matrix

    return guarantee_matrix


def _junit(path, cases):
    body = []
    for cls, name, outcome in cases:
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='y'/>",
                 "no-machine": "<skipped message='needs 2 CUDA devices, found 1'/>"}[outcome]
        body.append(f'<testcase classname="{cls}" name="{name}" time="0.1">{inner}</testcase>')
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" timestamp="2026-12-01T10:00:00" hostname="ci">'
                    + "".join(body) + "</testsuite></testsuites>")
    return str(path)


def test_cells_follow_the_outcomes(gm, tmp_path):
    from qops.lowerings import LOWERINGS_BY_NAME

    cm = "compile_tests.test_compile_model"
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu.xml", [
        ("tests.test_opcheck", "test_opcheck[mm_int_weight-gptq4sym-fp32-grad-bias-grad]", "passed"),
        ("tests.test_opcheck", "test_opcheck[mm_int_weight_out-gptq3v1act-fp16-3d-grad]", "passed"),
        ("tests.test_opcheck", "test_opcheck[mm_int_weight-awq-bf16-m1-bias]", "failed"),
        (cm, "test_decode_compiles_once_for_every_batch_size_and_step[gptq-reference_int_weight-torch.float32]", "passed"),
        (cm, "test_decode_compiles_once_for_every_batch_size_and_step[awq-reference_int_weight-torch.float32]", "skipped"),
        ("tests.test_model", "test_half_precision[gptq-reference_int_weight-torch.float16]", "passed"),
        ("tests.test_model", "test_half_precision[gptq-reference_int_weight-torch.bfloat16]", "passed"),
        ("tests.test_model", "test_half_precision[awq-reference_int_weight-torch.float16]", "passed"),
        # A scheme whose name extends another's must not count for it.
        ("tests.test_model", "test_half_precision[compressed-tensors-fp8-reference_fp8-torch.float16]", "passed"),
    ]))
    none = gm.read_junit("GPU", None)
    cols = {c.title: c for c in gm.COLUMNS}
    ref, tri = LOWERINGS_BY_NAME["reference_int_weight"], LOWERINGS_BY_NAME["triton_int_weight"]
    assert gm.cell(cols["opcheck passes"], "gptq", ref, cpu, none) == "CPU pass (2)"
    assert gm.cell(cols["opcheck passes"], "awq", ref, cpu, none) == "CPU FAIL (1 of 1)"
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, none) == "GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "gptq", ref, cpu, none) == "CPU pass (1); GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "awq", ref, cpu, none) == "CPU skipped (1); GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "compressed-tensors", ref, cpu, none) == "GPU not run"
    assert gm.cell(cols["fp16 and bf16 work"], "gptq", ref, cpu, none) == "CPU pass (2); GPU not run"
    assert gm.cell(cols["fp16 and bf16 work"], "awq", ref, cpu, none) == "CPU incomplete (1 of 2 required tests missing); GPU not run"
    assert gm.cell(cols["fp16 and bf16 work"], "compressed-tensors", ref, cpu, none) == "GPU not run"
    assert gm.cell(cols["CUDA graphs captured"], "gptq", ref, cpu, none) == "GPU not run"
    gpu = gm.read_junit("GPU", _junit(tmp_path / "gpu.xml", [
        ("tests.gpu.test_gpu_model", "test_reduce_overhead_cuda_graphs[gptq-triton_int_weight-torch.bfloat16]", "passed"),
    ]))
    assert gm.cell(cols["CUDA graphs captured"], "gptq", tri, cpu, gpu) == "GPU incomplete (1 of 2 required tests missing)"
    assert gm.cell(cols["TP=2 compiles into graphs"], "gptq", tri, cpu, gpu) == "no test"
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, gpu) == "no test"
    gpu = gm.read_junit("GPU", _junit(tmp_path / "gpu2.xml", [
        ("tests.gpu.test_gpu_opcheck", "test_gpu_opcheck[gptq-triton_int_weight]", "passed"),
        ("tests.gpu.test_gpu_opcheck", "test_gpu_opcheck[gptq-native_w4a16]", "failed"),
    ]))
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, gpu) == "GPU pass (1)"
    assert gm.cell(cols["opcheck passes"], "gptq", LOWERINGS_BY_NAME["native_w4a16"], cpu, gpu) == "GPU FAIL (1 of 1)"


def test_later_runs_replace_outcomes_but_not_with_skips(gm, tmp_path):
    # Oldest first: a re-run replaces a failure (and a pass); a later skip for want of hardware keeps
    # what an earlier run found; any other later skip (a limit the test now names) replaces it; a
    # test only ever skipped stays skipped.
    t = "tests.gpu.test_gpu_tp"
    first = _junit(tmp_path / "1.xml", [(t, "a", "failed"), (t, "b", "passed"), (t, "c", "passed"), (t, "d", "no-machine"),
                                        (t, "e", "failed")])
    second = _junit(tmp_path / "2.xml", [(t, "a", "passed"), (t, "b", "no-machine"), (t, "c", "failed"), (t, "d", "no-machine"),
                                         (t, "e", "skipped")])
    got = gm.read_junit("GPU", f"{first},{second}").outcomes
    want = {"a": "passed", "b": "passed", "c": "failed", "d": "skipped", "e": "skipped"}
    assert got == {f"tests/gpu/test_gpu_tp.py::{k}": v for k, v in want.items()}, got


def test_every_registered_pair_has_a_row(gm):
    from qops.formats import FORMATS
    from qops.lowerings import LOWERINGS

    rows = list(gm.rows())
    assert {f for f, _ in rows} == set(FORMATS)
    assert {l.name for _, l in rows} == {l.name for l in LOWERINGS}
    assert set(gm.OPCHECK_SAMPLES) == set(FORMATS) and set(gm.FAMILY_OPS) == {f.family for f in FORMATS.values()}


def test_renders_a_header_naming_the_run(gm, tmp_path):
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu.xml", [("tests.test_model", "test_x", "passed")]))
    text = gm.render(cpu, gm.read_junit("GPU", None), "2.13.0+cpu", "abc123")
    assert "torch 2.13.0+cpu, commit abc123" in text and "2026-12-01T10:00:00 on ci: 1 tests (1 passed" in text
    assert "GPU run: **not run**" in text


def test_a_later_run_of_a_test_replaces_the_earlier_outcome(gm, tmp_path):
    # Several GPU files, oldest first: a re-run after a fix takes the cell; a test the later file did
    # not run keeps its earlier outcome; within one file a failure (e.g. in teardown) still wins.
    op = "tests.gpu.test_gpu_opcheck"
    old = _junit(tmp_path / "old.xml", [(op, "test_gpu_opcheck[gptq-triton_int_weight]", "failed"),
                                        (op, "test_gpu_opcheck[gptq-native_w4a16]", "failed")])
    new = _junit(tmp_path / "new.xml", [(op, "test_gpu_opcheck[gptq-triton_int_weight]", "passed"),
                                        (op, "test_gpu_opcheck[awq-triton_int_weight]", "passed"),
                                        (op, "test_gpu_opcheck[awq-triton_int_weight]", "failed")])
    suite = gm.read_junit("GPU", f"{old},{new}")
    assert suite.outcomes == {
        "tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[gptq-triton_int_weight]": "passed",
        "tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[gptq-native_w4a16]": "failed",
        "tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[awq-triton_int_weight]": "failed",
    }


def test_an_interrupted_runs_nameless_entry_is_no_test(gm, tmp_path):
    # pytest's junit XML of a run stopped by SIGINT (gpu_run.sh's group time limit) holds a testcase
    # with neither classname nor name: it must not become a test (nor a file named ".py").
    path = tmp_path / "cut.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" timestamp="2026-12-04T00:50:00" hostname="h200">'
                    '<testcase classname="tests.gpu.test_gpu_opcheck" name="test_gpu_opcheck[gptq-native_w4a16]" time="1"/>'
                    '<testcase time="0.001"/></testsuite></testsuites>')
    assert gm.read_junit("GPU", str(path)).outcomes == {"tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[gptq-native_w4a16]": "passed"}
