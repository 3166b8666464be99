#!/usr/bin/env python3
"""Generate docs/GUARANTEES.md -- what is guaranteed for every checkpoint format x lowering --
from test results (pytest junit XML). No cell is written by hand: each cell is the outcome of the
tests whose ids the column's templates (``COLUMNS``, data) name for that (format, lowering), with the
run (commit, date) each outcome comes from. The generator fails, naming them, when a test function or
an opcheck sample its tables name matches no test id in the results it reads (a renamed test would
otherwise turn cells into "no test" silently), or when an opcheck sample in the results belongs to no
format.

    # on a clean checkout: the file's name carries the commit the tests ran at
    python -m pytest --junitxml=/tmp/cpu-$(git rev-parse --short=7 HEAD)-tests.xml tests/test_opcheck.py::test_opcheck \\
        tests/test_model.py::test_half_precision \\
        compile_tests/test_compile_model.py::test_decode_compiles_once_for_every_batch_size_and_step
    python scripts/guarantee_matrix.py --cpu /tmp/cpu-<commit>-tests.xml \\
        [--gpu benchmarks/results/<machine>-<date>-<commit>-<what>-tests.xml,...] [--out docs/GUARANTEES.md]

Runs: each junit file is one run. Its commit is read from its file name (benchmarks/results' naming,
``<machine>-<date>-<commit>-<what>.xml``; the CPU file's may be given with ``--cpu-commit`` instead)
and its date from the XML's timestamp. Several GPU files are merged in the order they started (see
``read_junit``); the last is the suite's newest run, and a cell any of whose tests last ran in an
older one says so.

Rows: every ``qops.formats.FORMATS`` entry x every lowering of ``qops.lowerings.LOWERINGS`` that
lists it. Test ids name the (scheme, lowering) pair (``qops.models.testing``): the model tests
parametrize over the schemes of ``qops.models.QUANT_SCHEMES``, one per format, named after it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# --- which tests prove which cell: data, checked against the results read ---------------------------

# The ops (torch.ops.qops) that take each family's weights: a format's "opcheck passes" cell on the
# CPU needs every one of them opchecked with at least one of the format's samples.
FAMILY_OPS = {
    "int_weight": ("mm_int_weight", "mm_int_weight_out", "mm_int_weight_swiglu", "mm_int_weight_swiglu_out", "dequantize_int_weight"),
    "fp8": ("mm_fp8_weight", "mm_fp8_weight_out", "scaled_mm_fp8", "dequantize_fp8"),
    "int8_weight": ("mm_int8_weight", "mm_int8_weight_out", "dequantize_int8_weight"),
    "blockwise4": ("mm_blockwise4", "mm_blockwise4_out", "dequantize_blockwise4"),
}
# Each format's opcheck samples, by the names tests/test_opcheck.py and tests/bnb_cases.py give them.
# The int_weight, int8 and 4-bit blockwise samples are built through the format (packed in its layout,
# then FORMATS[fmt].prepare); the fp8 samples are not (quantize_rtn + prepare_fp8_weight): each counts
# for every fp8 format that stores its scale granularity.
OPCHECK_SAMPLES = {
    "gptq": ("gptq4sym", "gptq3v1act", "gptq4g128act"),
    "awq": ("awq", "awq4g128"),
    "compressed-tensors": ("ct8act", "ct4g128act"),
    "fp8": ("tensor", "channel", "tensor16", "channel16"),
    "compressed-tensors-fp8": ("tensor", "channel", "block", "block128", "tensor16", "channel16"),
    "fp8-block": ("block", "block128"),
    "eetq": ("eetq",),
    "bitsandbytes-int8": ("bnb8",),
    "bitsandbytes-nf4": ("nf4nested", "nf4k256", "nf4tile16"),
    "bitsandbytes-fp4": ("fp4plain", "fp4k256"),
}
OPCHECK_TEST = "tests/test_opcheck.py::test_opcheck"

# A template is a test id, or its start cut at a parameter boundary (it then matches the ids that go on
# with "-" or "]"), with "{fmt}-{low}" naming the row. "{op}" makes one requirement per op of the row's
# family (FAMILY_OPS); "{sample}" accepts any of the format's samples (OPCHECK_SAMPLES). A suite's part
# of a cell needs every requirement met by at least one test id, and every test it matches to pass.
COMPILE_CPU = "compile_tests/test_compile_model.py::test_decode_compiles_once_for_every_batch_size_and_step[{fmt}-{low}"
REDUCE_OVERHEAD_GPU = "tests/gpu/test_gpu_model.py::test_reduce_overhead_cuda_graphs[{fmt}-{low}"


@dataclass(frozen=True)
class Column:
    title: str
    cpu: tuple[str, ...] = ()  # templates of the tests required on the CPU (reference lowerings)
    gpu: tuple[str, ...] = ()  # ... and on CUDA
    how: str = ""

    @property
    def gpu_only(self) -> bool:
        return not self.cpu


COLUMNS = (
    Column("opcheck passes", cpu=(OPCHECK_TEST + "[{op}-{sample}",), gpu=("tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[{fmt}-{low}]",),
           how="CPU: `tests/test_opcheck.py::test_opcheck[<op>-<sample>-...]` for every op of the format's family, each with at least "
               "one of the format's samples (schema, fake, autograd registration, AOT dispatch; the reference kernel, so it fills "
               "the reference rows). Which samples count for which format is a table in the script (`OPCHECK_SAMPLES`): the "
               "integer and 4-bit samples are built through the format's own layout; the fp8 samples are built by granularity "
               "(per-tensor, per-channel, blocks), not through a format, and count for every fp8 format storing that granularity. "
               "GPU: `tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[<format>-<lowering>]`: the format's samples (that test's "
               "own table) on CUDA through that lowering, for the family's matmul ops the format has samples of, at least one "
               "sample the lowering serves for each (on `scaled_mm_fp8`, for `scaled_mm_fp8` only); samples it refuses are left "
               "out"),
    Column("model compiles fullgraph", cpu=(COMPILE_CPU,), gpu=(REDUCE_OVERHEAD_GPU,),
           how="CPU: `compile_tests/test_compile_model.py::test_decode_compiles_once_for_every_batch_size_and_step[<format>-<lowering>-...]` "
               "(fp32); GPU: `tests/gpu/test_gpu_model.py::test_reduce_overhead_cuda_graphs[<format>-<lowering>-...]` (both "
               "`fullgraph=True`)"),
    Column("zero recompiles across batch sizes", cpu=(COMPILE_CPU,), gpu=(REDUCE_OVERHEAD_GPU,),
           how="the same tests: one compilation serves every batch size they step through (CPU: 2, 1, 7 and the maximum, 8) and "
               "every decode step, under `set_stance(\"fail_on_recompile\")`"),
    Column("CUDA graphs captured",
           gpu=(REDUCE_OVERHEAD_GPU, "tests/gpu/test_gpu_model.py::test_manual_cuda_graph_capture_replays_eager[{fmt}-{low}]"),
           how="GPU: reduce-overhead with `cudagraph_or_error` and no `cudagraph_skips`, and a manual `torch.cuda.graph` capture "
               "whose replays agree with each other exactly and with eager decode within 1e-3 (relative)"),
    Column("fp16 and bf16 match fp32 at every step",
           cpu=("tests/test_model.py::test_half_precision[{fmt}-{low}-torch.float16]",
                "tests/test_model.py::test_half_precision[{fmt}-{low}-torch.bfloat16]"),
           gpu=("tests/gpu/test_gpu_model.py::test_half_precision_decode[{fmt}-{low}-torch.float16]",
                "tests/gpu/test_gpu_model.py::test_half_precision_decode[{fmt}-{low}-torch.bfloat16]"),
           how="both dtypes required. CPU: `tests/test_model.py::test_half_precision[<format>-<lowering>-torch.float16|torch.bfloat16]`: "
               "a greedy generation in that dtype, every step's logits (the prefill's and each decode step's, through the KV "
               "cache) within 6 unit roundoffs (relative) of the fp32 model run over the same tokens at once. GPU: "
               "`tests/gpu/test_gpu_model.py::test_half_precision_decode[...]`: the forward over the prompt and every step of a "
               "greedy generation near the fp32 model on the reference lowering (2e-2 fp16, 6e-2 bf16, relative; GPU results "
               "before stop 50's run checked the prompt's forward only)"),
    Column("TP=2 compiles into graphs",
           gpu=("tests/gpu/test_gpu_model.py::test_tensor_parallel_two_gpus_reduce_overhead[{fmt}-{low}]",),
           how="GPU, two devices: `tests/gpu/test_gpu_model.py::test_tensor_parallel_two_gpus_reduce_overhead[<format>-<lowering>]` "
               "(NCCL, reduce-overhead CUDA graphs)"),
)


class MatrixDataError(Exception):
    """The tables above or the result files do not fit each other (a stale name, a run without a
    commit or a date): the matrix would say something its results cannot back."""


# --- reading the results ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Run:
    """One junit XML file."""
    path: str
    commit: str
    started: datetime.datetime
    hostname: str
    counts: dict[str, int]

    @property
    def date(self) -> str:
        return self.started.date().isoformat()

    @property
    def label(self) -> str:
        return f"@{self.commit} {self.date}"


@dataclass
class Suite:
    name: str  # "CPU" or "GPU"
    runs: list[Run] = field(default_factory=list)  # oldest first
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    source: dict[str, Run] = field(default_factory=dict)  # test id -> the run its outcome comes from
    skip_reason: dict[str, str] = field(default_factory=dict)

    @property
    def given(self) -> bool:
        return bool(self.runs)

    @property
    def newest(self) -> Run:
        return self.runs[-1]


def test_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # Modules are lowercase path segments; a trailing capitalized segment is a test class.
    mod = [p for p in parts if not p[:1].isupper()]
    klass = [p for p in parts if p[:1].isupper()]
    return "/".join(mod) + ".py::" + "::".join(klass + [name])


# Skip messages that say the machine lacked what the test needs (tests/gpu, conftest.py).
MACHINE_SKIP = re.compile(r"needs \d+ CUDA devices|needs a CUDA device|no GPU on this machine")
# benchmarks/results' file names: <machine>-<YYYY-MM-DD>-<commit>-<what>.xml
COMMIT_IN_NAME = re.compile(r"(?:^|-)([0-9a-f]{7,40})(?=-)")


def commit_from_name(path: str) -> str | None:
    m = COMMIT_IN_NAME.search(os.path.basename(path))
    return m.group(1) if m else None


def _started(path: str, root: ET.Element) -> datetime.datetime:
    stamps = [ts.get("timestamp") for ts in root.iter("testsuite") if ts.get("timestamp")]
    if not stamps:
        raise MatrixDataError(f"{path}: no <testsuite timestamp=...>: the run cannot be dated or ordered")
    times = [datetime.datetime.fromisoformat(s) for s in stamps]
    # pytest writes UTC; a stamp without a zone (an older writer) is read as UTC.
    return min(t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc) for t in times).astimezone(datetime.timezone.utc)


def _read_one(path: str, commit: str | None):
    root = ET.parse(path).getroot()
    commit = commit or commit_from_name(path)
    if not commit:
        raise MatrixDataError(f"{path}: no commit in the file name (<machine>-<date>-<commit>-<what>.xml) and none given: "
                              "every cell must name the commit its outcome comes from")
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for case in root.iter("testcase"):
        if not case.get("name"):
            continue  # an interrupted run (a group past its time limit) leaves such an entry: it names no test
        skip = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif skip is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        tid = test_id(case)
        # A test that errors in teardown appears twice in one file: the failure wins.
        if outcomes.get(tid) != "failed":
            outcomes[tid] = outcome
            if skip is not None:
                reasons[tid] = skip.get("message", "")
    counts = {o: sum(1 for v in outcomes.values() if v == o) for o in ("passed", "failed", "skipped")}
    hosts = sorted({ts.get("hostname") for ts in root.iter("testsuite") if ts.get("hostname")})
    return Run(path, commit, _started(path, root), ", ".join(hosts) or "unknown host", counts), outcomes, reasons


def read_junit(name: str, path: str | None, commit: str | None = None) -> Suite:
    """The outcomes in one junit XML file, or in several (comma-separated paths, one suite). Each file
    is a run; ``commit`` names the commit of every file given, else each file's name does. The runs
    are merged in the order they started (their timestamps): a test a later run ran again takes that
    run's outcome, so a re-run after a fix replaces the failure it fixed. A skip for want of hardware
    (``MACHINE_SKIP``: a one-GPU run of 2-GPU tests) replaces nothing, since it says nothing about the
    test; any other skip (the test now names a real limit of the pair) does. The run each outcome
    comes from is kept (``Suite.source``), so a cell can say when its evidence is older than the
    suite's newest run."""
    suite = Suite(name)
    if path is None:
        return suite
    read = sorted((_read_one(one, commit) for one in path.split(",")), key=lambda r: r[0].started)  # stable: ties keep their order
    for run, outcomes, reasons in read:
        suite.runs.append(run)
        for tid, outcome in outcomes.items():
            if outcome == "skipped" and MACHINE_SKIP.search(reasons.get(tid, "")) and tid in suite.outcomes:
                continue
            suite.outcomes[tid] = outcome
            suite.source[tid] = run
            if outcome == "skipped":
                suite.skip_reason[tid] = reasons.get(tid, "")
    return suite


# --- matching the tables to the results ------------------------------------------------------------------


def matches(template: str, tid: str) -> bool:
    """Whether test id ``tid`` is the expanded ``template`` or goes on from it with a parameter boundary."""
    return tid == template or (tid.startswith(template) and tid[len(template)] in "-]")


@dataclass(frozen=True)
class Requirement:
    label: str  # for the list of gaps
    alternatives: tuple[str, ...]  # expanded templates; any one matching test id meets it

    def met_by(self, tid: str) -> bool:
        return any(matches(a, tid) for a in self.alternatives)


def requirements(templates: tuple[str, ...], fmt: str, low) -> list[Requirement]:
    out = []
    for t in templates:
        t = t.replace("{fmt}", fmt).replace("{low}", low.name)
        for op in (FAMILY_OPS[low.family] if "{op}" in t else (None,)):
            one = t if op is None else t.replace("{op}", op)
            if "{sample}" in one:
                samples = OPCHECK_SAMPLES.get(fmt, ())
                out.append(Requirement(one.replace("{sample}", "(" + "|".join(samples) + ")").split("::")[-1],
                                       tuple(one.replace("{sample}", s) for s in samples)))
            else:
                out.append(Requirement(one.split("::")[-1], (one,)))
    return out


def check_tables(cpu: Suite, gpu: Suite) -> None:
    """Fail, naming them, where a name the tables look for matches no test id of the suite it is
    looked for in (a renamed test or sample), or an opcheck sample in the results is no format's."""
    problems = []
    for suite, side in ((cpu, "cpu"), (gpu, "gpu")):
        if not suite.given:
            continue
        for col in COLUMNS:
            for t in getattr(col, side):
                fn = t.split("[")[0]
                if not any(tid == fn or tid.startswith(fn + "[") for tid in suite.outcomes):
                    problems.append(f"column {col.title!r}: no {suite.name} test id is a test of {fn}")
    if cpu.given:
        opchecked: dict[str, set[str]] = {}  # family -> samples found in the results
        for family, ops in FAMILY_OPS.items():
            for op in ops:
                head = f"{OPCHECK_TEST}[{op}-"
                for tid in cpu.outcomes:
                    if tid.startswith(head):
                        opchecked.setdefault(family, set()).add(re.split(r"[-\]]", tid[len(head):])[0])
        from qops.formats import FORMATS

        listed: dict[str, set[str]] = {}
        for fmt, samples in OPCHECK_SAMPLES.items():
            family = FORMATS[fmt].family
            listed.setdefault(family, set()).update(samples)
            for s in samples:
                if s not in opchecked.get(family, set()):
                    problems.append(f"OPCHECK_SAMPLES[{fmt!r}]: sample {s!r} matches no CPU test id "
                                    f"{OPCHECK_TEST}[<op of {family}>-{s}...]")
        for family, found in sorted(opchecked.items()):
            for s in sorted(found - listed.get(family, set())):
                problems.append(f"sample {s!r} is opchecked on {family} ops in the CPU results, but OPCHECK_SAMPLES gives it to no format")
    if problems:
        raise MatrixDataError("the matrix's tables do not fit the results:\n  " + "\n  ".join(problems))


# --- cells ---------------------------------------------------------------------------------------------------


@dataclass
class Judgement:
    text: str
    gaps: list[str] = field(default_factory=list)  # what keeps it from a plain pass, for the list under the table


def judge(suite: Suite, reqs: list[Requirement]) -> Judgement:
    if not suite.given:
        return Judgement(f"{suite.name} not run")
    matched: dict[str, str] = {}
    missing = []
    for r in reqs:
        hits = {t: o for t, o in suite.outcomes.items() if r.met_by(t)}
        if not hits:
            missing.append(r)
        matched.update(hits)
    if not matched:
        return Judgement("no test")
    n = len(matched)
    counts = {o: sum(1 for v in matched.values() if v == o) for o in ("passed", "failed", "skipped")}
    tests = f"{n} test{'s' if n != 1 else ''}"
    if counts["failed"]:
        text = f"{suite.name} FAIL ({counts['failed']} of {tests})"
    elif missing:
        text = f"{suite.name} incomplete ({len(missing)} of {len(reqs)} required tests missing)"
    elif not counts["passed"]:
        text = f"{suite.name} skipped ({tests})"
    elif counts["skipped"]:
        text = f"{suite.name} partly skipped ({counts['passed']} passed, {counts['skipped']} skipped)"
    else:
        text = f"{suite.name} pass ({tests})"
    runs = sorted({suite.source[t] for t in matched}, key=lambda r: r.started)
    text += " " + " + ".join(r.label for r in runs)
    if runs[0] is not suite.newest:
        text += " **older run**"
    gaps = [f"missing: no {suite.name} test `{r.label}`" for r in missing]
    gaps += [f"failed: `{t.split('::')[-1]}` ({suite.source[t].label})" for t, o in sorted(matched.items()) if o == "failed"]
    gaps += [f"skipped: `{t.split('::')[-1]}` ({suite.source[t].label}): {_one_line(suite.skip_reason.get(t, ''))}"
             for t, o in sorted(matched.items()) if o == "skipped"]
    return Judgement(text, gaps)


def _one_line(reason: str, limit: int = 300) -> str:
    """A skip message as one line of the list under the table (messages may hold a lowering's whole
    refusal chain, one line per lowering)."""
    text = " ".join(reason.split()) or "no reason given"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def verdict(suite: Suite, reqs: list[Requirement]) -> str:
    return judge(suite, reqs).text


def judgements(col: Column, fmt: str, low, cpu: Suite, gpu: Suite) -> list[Judgement]:
    parts = []
    if col.cpu and "cpu" in low.device_types:
        parts.append(judge(cpu, requirements(col.cpu, fmt, low)))
    if col.gpu and "cuda" in low.device_types:
        parts.append(judge(gpu, requirements(col.gpu, fmt, low)))
    return [p for p in parts if p.text != "no test"] or [Judgement("no test")]


def cell(col: Column, fmt: str, low, cpu: Suite, gpu: Suite) -> str:
    return "; ".join(j.text for j in judgements(col, fmt, low, cpu, gpu))


def rows():
    from qops.formats import FORMATS
    from qops.lowerings import LOWERINGS

    for name, fmt in FORMATS.items():
        for low in sorted((l for l in LOWERINGS if l.family == fmt.family and name in l.formats), key=lambda l: -l.priority):
            yield name, low


# --- the document --------------------------------------------------------------------------------------------


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"
    except Exception:  # noqa: BLE001 - no git
        return os.environ.get("QOPS_COMMIT", "unknown")


def _shown_path(path: str) -> str:
    """A result file as the document names it: relative to the repository, or only its name (no
    machine paths in the repository)."""
    full = os.path.abspath(path)
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else os.path.basename(full)


def _counts(c: dict[str, int]) -> str:
    n = sum(c.values())
    return f"{n} test{'s' if n != 1 else ''} ({c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped)"


def runs_section(s: Suite) -> list[str]:
    if not s.given:
        return []
    merged = {o: sum(1 for v in s.outcomes.values() if v == o) for o in ("passed", "failed", "skipped")}
    files = sorted({t.split("::")[0] for t in s.outcomes})
    out = [f"- {s.name}: {len(s.runs)} run{'s' if len(s.runs) != 1 else ''}, newest **{s.newest.label}**; merged: "
           f"{_counts(merged)} from {', '.join(f'`{f}`' for f in files)}."]
    out += [f"  - {r.label} ({r.started.strftime('%H:%M')} UTC, {r.hostname}): {_counts(r.counts)}: `{_shown_path(r.path)}`"
            for r in s.runs]
    return out


LEGEND = (
    "Each cell part says which suite (CPU, GPU) and:",
    "",
    "- **pass (n tests)**: every required test ran and passed, n tests matched in all.",
    "- **partly skipped (p passed, s skipped)** / **skipped (n tests)**: some / all of the cell's tests were skipped, so the cell "
    "is not shown to hold; the reasons are listed under the table.",
    "- **incomplete**: a test the column requires has no result (listed under the table); **FAIL**: a test failed.",
    "- **no test**: no test covers the cell; **not run**: the suite that covers it was not given.",
    "- **@commit date**: the run each of the cell's outcomes comes from (the last run of each test, except that a skip for want "
    "of hardware never replaces an earlier outcome). **older run**: some of the cell's outcomes come from a run before the "
    "suite's newest one (e.g. two-GPU tests that the later one-GPU runs skipped), so the cell may not hold at the newer "
    "commits.",
)


def regenerate_argv(cpu_path: str, cpu_commit: str | None, gpu_paths: str | None, torch_version: str, notes: tuple[str, ...]) -> list[str]:
    """The generator's arguments that rebuild this document from the same runs (the document shows them
    as a command; tests/test_model_guarantees.py replays it against the committed copy)."""
    argv = ["--cpu", _shown_path(cpu_path)] + (["--cpu-commit", cpu_commit] if cpu_commit else [])
    if gpu_paths:
        argv += ["--gpu", ",".join(_shown_path(g) for g in gpu_paths.split(",") if g)]
    argv += ["--torch", torch_version]
    for n in notes:
        argv += ["--note", n]
    return argv


def render(cpu: Suite, gpu: Suite, torch_version: str, commit: str, notes: tuple[str, ...] = (), argv: list[str] | None = None) -> str:
    out = ["# Guarantees: checkpoint formats x lowerings", "",
           "Generated by `scripts/guarantee_matrix.py` from pytest junit XML. No cell is written by hand: each cell is the",
           "outcome of the tests that the column's templates name for the row's (format, lowering) -- listed under the table;",
           "the templates, and which opcheck samples count for which format, are tables in the script, checked against the",
           "results (a name there that matches no test id stops the generator).", ""]
    out += list(LEGEND) + [""]
    out.append(f"- Generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} at commit {commit}; "
               f"torch {torch_version} (the CPU run's).")
    out += runs_section(cpu) if cpu.given else ["- CPU: **not run** -- no CPU results were given."]
    out += runs_section(gpu) if gpu.given else [
        "- GPU: **not run** -- no GPU results were given, so every GPU cell says \"GPU not run\" (the GPU tests exist: "
        "`tests/gpu/test_gpu_model.py`, run with `pytest -m gpu`)."]
    out.append("- The CPU cells cover the reference lowerings only (the CPU tests read here run every format on its reference "
               "lowering); the Triton and native lowerings' cells come from the GPU runs.")
    out += [f"- {n}" for n in notes] + [""]
    head = ["format", "lowering"] + [c.title for c in COLUMNS]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    gaps = []
    for fmt, low in rows():
        texts = []
        for c in COLUMNS:
            js = judgements(c, fmt, low, cpu, gpu)
            texts.append("; ".join(j.text for j in js))
            gaps += [f"- `{fmt}` x `{low.name}`, {c.title}: {g}" for j in js for g in j.gaps]
        out.append("| " + " | ".join([f"`{fmt}`", f"`{low.name}`"] + texts) + " |")
    out += ["", "## What keeps cells from a plain pass", ""] + (gaps or ["Nothing: no cell lacks a test, skipped one or failed."])
    out += ["", "## Where each column comes from", ""]
    for c in COLUMNS:
        out.append(f"- **{c.title}**{' (GPU only)' if c.gpu_only else ''}: {c.how}.")
    out += ["", "Regenerate from new runs: run the CPU tests the docstring of `scripts/guarantee_matrix.py` names with "
            "`--junitxml`, then `python scripts/guarantee_matrix.py --cpu <that XML> --gpu <the GPU files, comma-separated>`. "
            "This document, from the runs it was generated from (the test suite replays this command and compares):", ""]
    if argv is not None:
        out += ["```", "python scripts/guarantee_matrix.py " + shlex.join(argv), "```", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", required=True, help="junit XML of the CPU test run")
    p.add_argument("--cpu-commit", default=None, help="the commit the CPU run tested (default: the one in the file's name)")
    p.add_argument("--gpu", default=None, help="junit XML of the GPU test run (pytest -m gpu tests/gpu), or several, comma-separated, "
                                               "each named <machine>-<date>-<commit>-<what>.xml; omitted: GPU cells say 'not run'")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "GUARANTEES.md"), help="where to write (default docs/GUARANTEES.md)")
    p.add_argument("--torch", default=None, help="torch version of the CPU run (default: this interpreter's)")
    p.add_argument("--commit", default=None, help="commit the document is generated at (default: git HEAD here)")
    p.add_argument("--note", action="append", default=[], help="a line about the runs, added under the header (repeatable)")
    args = p.parse_args(argv)
    if args.torch is None:
        import torch

        args.torch = torch.__version__
    try:
        cpu, gpu = read_junit("CPU", args.cpu, args.cpu_commit), read_junit("GPU", args.gpu)
        check_tables(cpu, gpu)
    except MatrixDataError as e:
        print(f"guarantee_matrix: {e}", file=sys.stderr)
        return 2
    argv = regenerate_argv(args.cpu, args.cpu_commit, args.gpu, args.torch, tuple(args.note))
    text = render(cpu, gpu, args.torch, args.commit or git_commit(), tuple(args.note), argv)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
