"""``scripts/guarantee_matrix.py``: cells come from test outcomes found by the columns' id templates --
pass, FAIL, skipped or partly skipped (never a pass), incomplete (a required test missing, e.g. an op
of the family no sample of the format opchecks), "no test", and "not run" for a suite not given --
each naming the run (commit, date) it comes from and flagging evidence older than the suite's newest
run; names in the tables that match no test id stop the generator; every format x lowering of the
registries has a row. Synthetic junit XML throughout, except one check of the tables against the
real opcheck ids."""
from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPCHECK = "tests.test_opcheck"
MODEL = "tests.test_model"
COMPILE = "compile_tests.test_compile_model"
GPU_MODEL = "tests.gpu.test_gpu_model"


@pytest.fixture()
def gm(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import guarantee_matrix

    return guarantee_matrix


def _junit(path, cases, timestamp="2026-12-01T10:00:00+00:00", hostname="ci"):
    body = []
    for cls, name, outcome in cases:
        inner = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='a real limit'/>",
                 "no-machine": "<skipped message='needs 2 CUDA devices, found 1'/>"}[outcome]
        body.append(f'<testcase classname="{cls}" name="{name}" time="0.1">{inner}</testcase>')
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" timestamp="{timestamp}" hostname="{hostname}">'
                    + "".join(body) + "</testsuite></testsuites>")
    return str(path)


def _opcheck_ids(family_ops, sample, variant="fp32"):
    return [(OPCHECK, f"test_opcheck[{op}-{sample}-{variant}]", "passed") for op in family_ops]


@pytest.fixture()
def cols(gm):
    return {c.title: c for c in gm.COLUMNS}


@pytest.fixture()
def low():
    from qops.lowerings import LOWERINGS_BY_NAME

    return LOWERINGS_BY_NAME


def test_cells_follow_the_outcomes(gm, tmp_path, cols, low):
    int_ops = gm.FAMILY_OPS["int_weight"]
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [
        *_opcheck_ids(int_ops, "gptq4sym"),
        (OPCHECK, "test_opcheck[mm_int_weight-gptq3v1act-fp16-3d-grad]", "passed"),
        *_opcheck_ids(int_ops, "awq"),
        (OPCHECK, "test_opcheck[mm_int_weight-awq4g128-bf16-m1]", "failed"),
        (COMPILE, "test_decode_compiles_once_for_every_batch_size_and_step[gptq-reference_int_weight-torch.float32]", "passed"),
        (COMPILE, "test_decode_compiles_once_for_every_batch_size_and_step[awq-reference_int_weight-torch.float32]", "skipped"),
        (MODEL, "test_half_precision[gptq-reference_int_weight-torch.float16]", "passed"),
        (MODEL, "test_half_precision[gptq-reference_int_weight-torch.bfloat16]", "passed"),
        (MODEL, "test_half_precision[awq-reference_int_weight-torch.float16]", "passed"),
        # A scheme whose name extends another's must not count for it.
        (MODEL, "test_half_precision[compressed-tensors-fp8-reference_fp8-torch.float16]", "passed"),
    ]))
    none = gm.read_junit("GPU", None)
    ref, tri = low["reference_int_weight"], low["triton_int_weight"]
    at = "@1111111 2026-12-01"
    assert gm.cell(cols["opcheck passes"], "gptq", ref, cpu, none) == f"CPU pass (6 tests) {at}; GPU not run"
    assert gm.cell(cols["opcheck passes"], "awq", ref, cpu, none) == f"CPU FAIL (1 of 6 tests) {at}; GPU not run"
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, none) == "GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "gptq", ref, cpu, none) == f"CPU pass (1 test) {at}; GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "awq", ref, cpu, none) == f"CPU skipped (1 test) {at}; GPU not run"
    assert gm.cell(cols["model compiles fullgraph"], "compressed-tensors", ref, cpu, none) == "GPU not run"
    half = cols["fp16 and bf16 match fp32 at every step"]
    assert gm.cell(half, "gptq", ref, cpu, none) == f"CPU pass (2 tests) {at}; GPU not run"
    assert gm.cell(half, "awq", ref, cpu, none) == f"CPU incomplete (1 of 2 required tests missing) {at}; GPU not run"
    assert gm.cell(half, "compressed-tensors", ref, cpu, none) == "GPU not run"
    assert gm.cell(cols["CUDA graphs captured"], "gptq", ref, cpu, none) == "GPU not run"
    gpu = gm.read_junit("GPU", _junit(tmp_path / "h200-2026-12-01-2222222-x-tests.xml", [
        (GPU_MODEL, "test_reduce_overhead_cuda_graphs[gptq-triton_int_weight-torch.bfloat16]", "passed"),
    ]))
    assert gm.cell(cols["CUDA graphs captured"], "gptq", tri, cpu, gpu) == \
        "GPU incomplete (1 of 2 required tests missing) @2222222 2026-12-01"
    assert gm.cell(cols["TP=2 compiles into graphs"], "gptq", tri, cpu, gpu) == "no test"
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, gpu) == "no test"
    gpu = gm.read_junit("GPU", _junit(tmp_path / "h200-2026-12-01-3333333-x-tests.xml", [
        ("tests.gpu.test_gpu_opcheck", "test_gpu_opcheck[gptq-triton_int_weight]", "passed"),
        ("tests.gpu.test_gpu_opcheck", "test_gpu_opcheck[gptq-native_w4a16]", "failed"),
    ]))
    assert gm.cell(cols["opcheck passes"], "gptq", tri, cpu, gpu) == "GPU pass (1 test) @3333333 2026-12-01"
    assert gm.cell(cols["opcheck passes"], "gptq", low["native_w4a16"], cpu, gpu) == "GPU FAIL (1 of 1 test) @3333333 2026-12-01"


def test_one_opcheck_sample_does_not_fill_a_cell(gm, tmp_path, cols, low):
    # The audit's repro: one passing dequantize sample gave gptq x reference_int_weight "CPU pass (1)"
    # although no matmul op was opchecked. Every op of the family needs one of the format's samples.
    ops = gm.FAMILY_OPS["int_weight"]
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [
        (OPCHECK, "test_opcheck[dequantize_int_weight-gptq4sym-float32]", "passed")]))
    got = gm.cell(cols["opcheck passes"], "gptq", low["reference_int_weight"], cpu, gm.read_junit("GPU", None))
    assert got == f"CPU incomplete ({len(ops) - 1} of {len(ops)} required tests missing) @1111111 2026-12-01; GPU not run"
    # Another format's sample on the missing ops does not count for gptq.
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [
        *_opcheck_ids(ops, "awq"), (OPCHECK, "test_opcheck[dequantize_int_weight-gptq4sym-float32]", "passed")]))
    assert gm.cell(cols["opcheck passes"], "gptq", low["reference_int_weight"], cpu, gm.read_junit("GPU", None)).startswith(
        "CPU incomplete")
    # A sample id with nothing after the sample name (bnb_cases' dequantize ids) counts; a longer
    # sample name that starts with the format's (nf4k256 vs nf4) would not.
    bw4 = gm.FAMILY_OPS["blockwise4"]
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [
        *[(OPCHECK, f"test_opcheck[{op}-nf4nested-fp32]", "passed") for op in bw4[:-1]],
        (OPCHECK, f"test_opcheck[{bw4[-1]}-nf4nested]", "passed")]))
    assert gm.cell(cols["opcheck passes"], "bitsandbytes-nf4", low["reference_blockwise4"], cpu, gm.read_junit("GPU", None)) == \
        f"CPU pass ({len(bw4)} tests) @1111111 2026-12-01; GPU not run"


def test_skips_are_never_a_pass(gm, tmp_path, cols, low):
    # The audit's repro: fp16 passed and bf16 skipped read "CPU pass (1, 1 skipped)" though bf16 never ran.
    half = cols["fp16 and bf16 match fp32 at every step"]
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [
        (MODEL, "test_half_precision[gptq-reference_int_weight-torch.float16]", "passed"),
        (MODEL, "test_half_precision[gptq-reference_int_weight-torch.bfloat16]", "skipped"),
        (MODEL, "test_half_precision[awq-reference_int_weight-torch.float16]", "skipped"),
        (MODEL, "test_half_precision[awq-reference_int_weight-torch.bfloat16]", "skipped"),
    ]))
    none = gm.read_junit("GPU", None)
    ref = low["reference_int_weight"]
    partly = gm.cell(half, "gptq", ref, cpu, none)
    assert partly == "CPU partly skipped (1 passed, 1 skipped) @1111111 2026-12-01; GPU not run"
    assert gm.cell(half, "awq", ref, cpu, none) == "CPU skipped (2 tests) @1111111 2026-12-01; GPU not run"
    # ... and the skipped test and its reason are listed under the table.
    (j, _) = gm.judgements(half, "gptq", ref, cpu, none)
    assert j.gaps == ["skipped: `test_half_precision[gptq-reference_int_weight-torch.bfloat16]` (@1111111 2026-12-01): a real limit"]


def test_a_cell_names_its_run_and_flags_an_older_one(gm, tmp_path, cols, low):
    # The audit's repro: TP=2 passed only in the two-GPU runs of 2026-11-30; every later one-GPU run
    # skips it for want of a second GPU. The cell keeps that pass but says where it comes from and
    # that it is older than the suite's newest run; a cell the newest run proves has no such flag.
    tp = "test_tensor_parallel_two_gpus_reduce_overhead[gptq-triton_int_weight]"
    graphs = ["test_reduce_overhead_cuda_graphs[gptq-triton_int_weight-torch.bfloat16]",
              "test_manual_cuda_graph_capture_replays_eager[gptq-triton_int_weight]"]
    two = _junit(tmp_path / "h200x2-2026-11-30-609a5a0-model-tp-tests.xml", [(GPU_MODEL, tp, "passed")],
                 timestamp="2026-11-30T23:35:47.476055+00:00")
    one = _junit(tmp_path / "h200-2026-12-04-6f6d195-gpu-suite-tests.xml",
                 [(GPU_MODEL, tp, "no-machine")] + [(GPU_MODEL, g, "passed") for g in graphs],
                 timestamp="2026-12-04T16:52:47.328093+00:00")
    none, tri = gm.read_junit("CPU", None), low["triton_int_weight"]
    gpu = gm.read_junit("GPU", f"{two},{one}")
    assert gm.cell(cols["TP=2 compiles into graphs"], "gptq", tri, none, gpu) == "GPU pass (1 test) @609a5a0 2026-11-30 **older run**"
    assert gm.cell(cols["CUDA graphs captured"], "gptq", tri, none, gpu) == "GPU pass (2 tests) @6f6d195 2026-12-04"
    # A cell drawing on both runs names both, and is flagged.
    mixed = _junit(tmp_path / "h200-2026-12-05-7777777-model-tests.xml", [(GPU_MODEL, graphs[0], "passed")],
                   timestamp="2026-12-05T01:00:00+00:00")
    gpu = gm.read_junit("GPU", f"{two},{one},{mixed}")
    assert gm.cell(cols["CUDA graphs captured"], "gptq", tri, none, gpu) == \
        "GPU pass (2 tests) @6f6d195 2026-12-04 + @7777777 2026-12-05 **older run**"


def test_runs_merge_in_the_order_they_started(gm, tmp_path):
    # Files given out of order (the two-GPU list once named c76284c's 12:29 runs after d0adff4's 21:30):
    # the later-started run's outcome wins, and the newest run is the last started, not the last named.
    t = "tests.gpu.test_gpu_tp"
    late = _junit(tmp_path / "h200-2026-11-30-d0adff4-tp-tests.xml", [(t, "a", "passed")], timestamp="2026-11-30T21:30:00+00:00")
    early = _junit(tmp_path / "h200-2026-11-30-c76284c-tp-tests.xml", [(t, "a", "failed")], timestamp="2026-11-30T12:29:00+00:00")
    suite = gm.read_junit("GPU", f"{late},{early}")
    assert suite.outcomes == {"tests/gpu/test_gpu_tp.py::a": "passed"}
    assert [r.commit for r in suite.runs] == ["c76284c", "d0adff4"] and suite.newest.commit == "d0adff4"


def test_later_runs_replace_outcomes_but_not_with_skips_for_want_of_hardware(gm, tmp_path):
    # A re-run replaces a failure (and a pass); a later skip for want of hardware replaces nothing (it
    # says nothing about the test); any other later skip (a limit the test now names) replaces it; a
    # test only ever skipped stays skipped.
    t = "tests.gpu.test_gpu_tp"
    first = _junit(tmp_path / "h200-2026-12-01-1111111-a-tests.xml",
                   [(t, "a", "failed"), (t, "b", "passed"), (t, "c", "passed"), (t, "d", "no-machine"), (t, "e", "failed"),
                    (t, "f", "skipped")])
    second = _junit(tmp_path / "h200-2026-12-02-2222222-a-tests.xml",
                    [(t, "a", "passed"), (t, "b", "no-machine"), (t, "c", "failed"), (t, "d", "no-machine"), (t, "e", "skipped"),
                     (t, "f", "no-machine")], timestamp="2026-12-02T10:00:00+00:00")
    suite = gm.read_junit("GPU", f"{first},{second}")
    want = {"a": ("passed", "2222222"), "b": ("passed", "1111111"), "c": ("failed", "2222222"), "d": ("skipped", "1111111"),
            "e": ("skipped", "2222222"), "f": ("skipped", "1111111")}
    got = {tid.split("::")[-1]: (o, suite.source[tid].commit) for tid, o in suite.outcomes.items()}
    assert got == want
    assert suite.skip_reason["tests/gpu/test_gpu_tp.py::f"] == "a real limit"  # the informative skip is kept


def test_within_one_file_a_failure_wins(gm, tmp_path):
    # A test that errors in teardown appears twice in one file.
    op = "tests.gpu.test_gpu_opcheck"
    path = _junit(tmp_path / "h200-2026-12-01-1111111-a-tests.xml", [(op, "test_gpu_opcheck[awq-triton_int_weight]", "passed"),
                                                                      (op, "test_gpu_opcheck[awq-triton_int_weight]", "failed")])
    assert gm.read_junit("GPU", path).outcomes == {"tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[awq-triton_int_weight]": "failed"}


def test_an_interrupted_runs_nameless_entry_is_no_test(gm, tmp_path):
    # pytest's junit XML of a run stopped by SIGINT (gpu_run.sh's group time limit) holds a testcase
    # with neither classname nor name: it must not become a test (nor a file named ".py").
    path = tmp_path / "h200-2026-12-04-7f0d1ae-cut-tests.xml"
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" timestamp="2026-12-04T00:50:00" hostname="h200">'
                    '<testcase classname="tests.gpu.test_gpu_opcheck" name="test_gpu_opcheck[gptq-native_w4a16]" time="1"/>'
                    '<testcase time="0.001"/></testsuite></testsuites>')
    assert gm.read_junit("GPU", str(path)).outcomes == {"tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[gptq-native_w4a16]": "passed"}


def test_a_run_without_a_commit_is_refused(gm, tmp_path):
    path = _junit(tmp_path / "gpu.xml", [(GPU_MODEL, "x", "passed")])
    with pytest.raises(gm.MatrixDataError, match="no commit"):
        gm.read_junit("GPU", path)
    assert gm.read_junit("CPU", path, commit="abcdef1").runs[0].label == "@abcdef1 2026-12-01"


def _complete_cpu(gm, tmp_path, extra=(), drop=()):
    """A CPU file with one test of every CPU column's function and every listed opcheck sample."""
    from qops.formats import FORMATS

    cases = [(COMPILE, "test_decode_compiles_once_for_every_batch_size_and_step[gptq-reference_int_weight-torch.float32]", "passed"),
             (MODEL, "test_half_precision[gptq-reference_int_weight-torch.float16]", "passed")]
    for fmt, samples in gm.OPCHECK_SAMPLES.items():
        cases += [c for s in samples for c in _opcheck_ids(gm.FAMILY_OPS[FORMATS[fmt].family][:1], s)]
    cases = [c for c in cases if not any(d in c[1] for d in drop)] + list(extra)
    return gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", cases))


def test_names_that_match_no_test_stop_the_generator(gm, tmp_path, monkeypatch, capsys):
    none, cpu = gm.read_junit("GPU", None), _complete_cpu(gm, tmp_path)
    gm.check_tables(cpu, none)
    # The audit's stale names: a sample listed under a format that no test id carries ...
    monkeypatch.setitem(gm.OPCHECK_SAMPLES, "gptq", gm.OPCHECK_SAMPLES["gptq"] + ("gptq4g128",))
    with pytest.raises(gm.MatrixDataError, match=r"OPCHECK_SAMPLES\['gptq'\]: sample 'gptq4g128' matches no CPU test id"):
        gm.check_tables(cpu, none)
    # ... and the generator's command line says so and writes nothing.
    path = _junit(tmp_path / "cpu-1111111-tests.xml", [])
    out = tmp_path / "G.md"
    assert gm.main(["--cpu", path, "--out", str(out), "--torch", "x", "--commit", "y"]) == 2
    assert "gptq4g128" in capsys.readouterr().err and not out.exists()
    monkeypatch.undo()
    # An opcheck sample in the results that no format lists (awq4g128 was once such a sample).
    with pytest.raises(gm.MatrixDataError, match="sample 'awq8' is opchecked on int_weight ops in the CPU results, but OPCHECK_SAMPLES gives it to no format"):
        gm.check_tables(_complete_cpu(gm, tmp_path, extra=[(OPCHECK, "test_opcheck[mm_int_weight-awq8-fp32]", "passed")]), none)
    # A column's test function renamed away: its cells would all read "no test".
    with pytest.raises(gm.MatrixDataError, match="no CPU test id is a test of tests/test_model.py::test_half_precision"):
        gm.check_tables(_complete_cpu(gm, tmp_path, drop=("test_half_precision",)), none)
    gpu = gm.read_junit("GPU", _junit(tmp_path / "h200-2026-12-01-2222222-x-tests.xml", [(GPU_MODEL, "test_other", "passed")]))
    with pytest.raises(gm.MatrixDataError, match="no GPU test id is a test of tests/gpu/test_gpu_model.py::test_reduce_overhead"):
        gm.check_tables(_complete_cpu(gm, tmp_path), gpu)


def test_the_sample_table_fits_the_real_opcheck_ids(gm, tmp_path):
    # What the generator checks on a run's results, here on the ids tests/test_opcheck.py generates
    # (cheaper than a run): a renamed or new sample fails CI, not only the next regeneration.
    from tests.test_opcheck import SAMPLES

    real = [(OPCHECK, f"test_opcheck[{op}-{sid}]", "passed") for op, make in SAMPLES.items() for sid in make()]
    gm.check_tables(_complete_cpu(gm, tmp_path, extra=real), gm.read_junit("GPU", None))


def test_every_registered_pair_has_a_row(gm):
    from qops.formats import FORMATS
    from qops.lowerings import LOWERINGS

    rows = list(gm.rows())
    assert {f for f, _ in rows} == set(FORMATS)
    assert {l.name for _, l in rows} == {l.name for l in LOWERINGS}
    assert set(gm.OPCHECK_SAMPLES) == set(FORMATS) and set(gm.FAMILY_OPS) == {f.family for f in FORMATS.values()}


def test_the_header_lists_every_run_and_the_newest(gm, tmp_path):
    # It once printed the oldest of ~30 merged files' timestamp as "the GPU run".
    cpu = gm.read_junit("CPU", _junit(tmp_path / "cpu-1111111-tests.xml", [(MODEL, "test_x", "passed")]))
    old = _junit(tmp_path / "h200x2-2026-11-30-609a5a0-tp-tests.xml", [(GPU_MODEL, "a", "passed"), (GPU_MODEL, "b", "failed")],
                 timestamp="2026-11-30T08:55:13+00:00", hostname="two")
    new = _junit(tmp_path / "h200-2026-12-04-6f6d195-suite-tests.xml", [(GPU_MODEL, "a", "skipped")],
                 timestamp="2026-12-04T16:52:47+00:00", hostname="one")
    text = gm.render(cpu, gm.read_junit("GPU", f"{new},{old}"), "2.13.0+cpu", "abc123")
    assert "at commit abc123; torch 2.13.0+cpu" in text
    assert "- GPU: 2 runs, newest **@6f6d195 2026-12-04**; merged: 2 tests (0 passed, 1 failed, 1 skipped)" in text
    runs = [line for line in text.splitlines() if line.startswith("  - @")]
    assert runs == ["  - @1111111 2026-12-01 (10:00 UTC, ci): 1 test (1 passed, 0 failed, 0 skipped): `cpu-1111111-tests.xml`",
                    "  - @609a5a0 2026-11-30 (08:55 UTC, two): 2 tests (1 passed, 1 failed, 0 skipped): "
                    "`h200x2-2026-11-30-609a5a0-tp-tests.xml`",
                    "  - @6f6d195 2026-12-04 (16:52 UTC, one): 1 test (0 passed, 0 failed, 1 skipped): "
                    "`h200-2026-12-04-6f6d195-suite-tests.xml`"]
    assert str(tmp_path) not in text  # no machine paths
    text = gm.render(cpu, gm.read_junit("GPU", None), "2.13.0+cpu", "abc123")
    assert "- GPU: **not run**" in text


def _regenerate_command(text: str) -> list[str]:
    """The generator's arguments from the fenced command the document ends with."""
    import shlex

    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("python scripts/guarantee_matrix.py ")]
    assert len(starts) == 1 and lines[starts[0] - 1] == "```" and lines[starts[0] + 1] == "```", \
        "the document must end with the one command that regenerates it"
    return shlex.split(lines[starts[0]])[2:]


def _without_generated_line(text: str) -> list[str]:
    # The "Generated <time> at commit <c>" line is the only one that differs between two generations.
    return [line for line in text.splitlines() if not line.startswith("- Generated ")]


def test_the_command_in_the_document_regenerates_it(gm, tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "check_tables", lambda cpu, gpu: None)  # synthetic runs name none of the tables' tests
    cpu = _junit(tmp_path / "cpu-1111111-tests.xml", [(MODEL, "test_x", "passed")])
    gpu = _junit(tmp_path / "h200-2026-12-04-6f6d195-suite-tests.xml", [(GPU_MODEL, "a", "passed")])
    first = tmp_path / "first.md"
    assert gm.main(["--cpu", cpu, "--gpu", gpu, "--torch", "2.13.0+cpu", "--note", "a note's 'quotes'", "--out", str(first),
                    "--commit", "abc"]) == 0
    argv = _regenerate_command(first.read_text())
    # Paths as the document shows them (names only here, outside the repository), so replay from their folder.
    assert argv[:2] == ["--cpu", "cpu-1111111-tests.xml"] and "--note" in argv and "a note's 'quotes'" in argv
    argv = [os.path.join(tmp_path, a) if a.endswith(".xml") else a for a in argv]
    second = tmp_path / "second.md"
    assert gm.main(argv + ["--out", str(second), "--commit", "def"]) == 0
    assert _without_generated_line(second.read_text()) == _without_generated_line(first.read_text())


def test_the_committed_document_is_what_its_runs_generate(gm, tmp_path):
    """docs/GUARANTEES.md against a fresh generation from the committed result files it names: fails
    when a cell was edited by hand, a named file is missing, or the registries or the script's tables
    changed since (a format or lowering added without regenerating: rerun the command it ends with)."""
    committed = open(os.path.join(ROOT, "docs", "GUARANTEES.md")).read()
    argv = _regenerate_command(committed)
    files = [p for i, a in enumerate(argv) if i and argv[i - 1] in ("--cpu", "--gpu") for p in a.split(",")]
    missing = [p for p in files if not os.path.isfile(os.path.join(ROOT, p))]
    assert files and not missing, f"docs/GUARANTEES.md names result files that are not in the repository: {missing}"
    argv = [",".join(os.path.join(ROOT, p) for p in a.split(",")) if i and argv[i - 1] in ("--cpu", "--gpu") else a
            for i, a in enumerate(argv)]
    fresh = tmp_path / "GUARANTEES.md"
    assert gm.main(argv + ["--out", str(fresh)]) == 0
    assert _without_generated_line(fresh.read_text()) == _without_generated_line(committed), \
        "docs/GUARANTEES.md differs from what its runs generate: regenerate it with the command it ends with"
