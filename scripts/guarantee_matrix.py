#!/usr/bin/env python3
"""Generate docs/GUARANTEES.md -- what is guaranteed for every checkpoint format x lowering --
from test results (pytest junit XML). No cell is written by hand: each cell is the outcome of the
tests whose ids match the column's patterns for that (format, lowering); a cell no test matches
says "no test"; a GPU column without GPU results says "not run".

    python -m pytest --junitxml=/tmp/cpu.xml tests/test_opcheck.py tests/test_model.py \\
        tests/test_model_tp.py compile_tests/test_compile_model.py
    python scripts/guarantee_matrix.py --cpu /tmp/cpu.xml [--gpu gpu_out/pytest_gpu.xml] [--out docs/GUARANTEES.md]

Rows: every ``qops.formats.FORMATS`` entry x every lowering of ``qops.lowerings.LOWERINGS`` that
lists it. Test ids name the (scheme, lowering) pair (``qops.models.testing``): the model tests
parametrize over the schemes of ``qops.models.QUANT_SCHEMES``, one per format, named after it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The op family's ops, and each format's opcheck sample names (tests/test_opcheck.py,
# tests/bnb_cases.py): opcheck runs every op on the CPU with the reference kernel.
FAMILY_OPS = {
    "int_weight": ("mm_int_weight", "mm_int_weight_out", "dequantize_int_weight"),
    "fp8": ("mm_fp8_weight", "scaled_mm_fp8", "dequantize_fp8"),
    "int8_weight": ("mm_int8_weight", "mm_int8_weight_out", "dequantize_int8_weight"),
    "blockwise4": ("mm_blockwise4", "mm_blockwise4_out", "dequantize_blockwise4"),
}
OPCHECK_SAMPLES = {
    "gptq": ("gptq4sym", "gptq3v1act", "gptq4g128"), "awq": ("awq",), "compressed-tensors": ("ct8act", "ct4g128"),
    "fp8": ("tensor", "channel"), "compressed-tensors-fp8": ("tensor", "channel", "block", "block128"), "fp8-block": ("block", "block128"),
    "eetq": ("eetq",), "bitsandbytes-int8": ("bnb8",), "bitsandbytes-nf4": ("nf4nested", "nf4k256"), "bitsandbytes-fp4": ("fp4plain", "fp4k256"),
}


def _pair(fmt: str, low: str) -> str:
    return re.escape(f"{fmt}-{low}")


@dataclass(frozen=True)
class Column:
    title: str
    # (format, lowering) -> patterns every one of which must match at least one test id
    cpu: object = None
    gpu: object = None
    gpu_only: bool = False
    how: str = ""


def _opcheck(fmt, low):
    ops = "|".join(FAMILY_OPS[low.family])
    tags = "|".join(re.escape(t) for t in OPCHECK_SAMPLES.get(fmt, ()))
    if not tags or not low.name.startswith("reference"):
        return []
    return [rf"^tests/test_opcheck\.py::test_opcheck\[({ops})-({tags})-"]


def _gpu_opcheck(fmt, low):
    return [] if low.name.startswith("reference") else [rf"^tests/gpu/test_gpu_opcheck\.py::test_gpu_opcheck\[{_pair(fmt, low.name)}\]"]


COLUMNS = (
    Column("opcheck passes", cpu=_opcheck, gpu=_gpu_opcheck,
           how="CPU: `tests/test_opcheck.py::test_opcheck[<op of the family>-<the format's samples>-...]` (schema, fake, "
               "autograd registration, AOT dispatch; run with the reference kernel, so it fills the reference rows); GPU: "
               "`tests/gpu/test_gpu_opcheck.py::test_gpu_opcheck[<format>-<lowering>]` (the same samples on CUDA through each "
               "CUDA lowering)"),
    Column("model compiles fullgraph",
           cpu=lambda f, l: [rf"^compile_tests/test_compile_model\.py::test_decode_compiles_once_for_every_batch_size_and_step\[{_pair(f, l.name)}-"],
           gpu=lambda f, l: [rf"^tests/gpu/test_gpu_model\.py::test_reduce_overhead_cuda_graphs\[{_pair(f, l.name)}-"],
           how="CPU: `compile_tests/test_compile_model.py::test_decode_compiles_once_for_every_batch_size_and_step[<format>-<lowering>-...]`; "
               "GPU: `tests/gpu/test_gpu_model.py::test_reduce_overhead_cuda_graphs[<format>-<lowering>-...]` (both `fullgraph=True`)"),
    Column("zero recompiles across batch sizes",
           cpu=lambda f, l: [rf"^compile_tests/test_compile_model\.py::test_decode_compiles_once_for_every_batch_size_and_step\[{_pair(f, l.name)}-"],
           gpu=lambda f, l: [rf"^tests/gpu/test_gpu_model\.py::test_reduce_overhead_cuda_graphs\[{_pair(f, l.name)}-"],
           how="the same tests: one compilation for batch sizes 1, 2/3, 7 and the maximum and every decode step, "
               "under `set_stance(\"fail_on_recompile\")`"),
    Column("CUDA graphs captured", gpu_only=True,
           gpu=lambda f, l: [rf"^tests/gpu/test_gpu_model\.py::test_reduce_overhead_cuda_graphs\[{_pair(f, l.name)}-",
                             rf"^tests/gpu/test_gpu_model\.py::test_manual_cuda_graph_capture_replays_eager\[{_pair(f, l.name)}\]"],
           how="GPU: reduce-overhead with `cudagraph_or_error` and no `cudagraph_skips`, and a manual `torch.cuda.graph` capture "
               "replayed equal to eager"),
    Column("fp16 and bf16 work",
           cpu=lambda f, l: [rf"^tests/test_model\.py::test_half_precision\[{_pair(f, l.name)}-torch\.float16\]",
                             rf"^tests/test_model\.py::test_half_precision\[{_pair(f, l.name)}-torch\.bfloat16\]"],
           gpu=lambda f, l: [rf"^tests/gpu/test_gpu_model\.py::test_half_precision_decode\[{_pair(f, l.name)}-torch\.float16\]",
                             rf"^tests/gpu/test_gpu_model\.py::test_half_precision_decode\[{_pair(f, l.name)}-torch\.bfloat16\]"],
           how="`tests/test_model.py::test_half_precision[<format>-<lowering>-torch.float16|torch.bfloat16]` (CPU), "
               "`tests/gpu/test_gpu_model.py::test_half_precision_decode[...]` (GPU): both dtypes must have a test"),
    Column("TP=2 compiles into graphs", gpu_only=True,
           gpu=lambda f, l: [rf"^tests/gpu/test_gpu_model\.py::test_tensor_parallel_two_gpus_reduce_overhead\[{_pair(f, l.name)}\]"],
           how="GPU, two devices: `tests/gpu/test_gpu_model.py::test_tensor_parallel_two_gpus_reduce_overhead[<format>-<lowering>]` "
               "(NCCL, reduce-overhead CUDA graphs)"),
)


@dataclass
class Suite:
    name: str  # "CPU" or "GPU"
    path: str | None
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    timestamp: str | None = None
    hostname: str | None = None

    @property
    def given(self) -> bool:
        return self.path is not None


def test_id(case: ET.Element) -> str:
    cls, name = case.get("classname", ""), case.get("name", "")
    parts = cls.split(".")
    # Modules are lowercase path segments; a trailing capitalized segment is a test class.
    mod = [p for p in parts if not p[:1].isupper()]
    klass = [p for p in parts if p[:1].isupper()]
    return "/".join(mod) + ".py::" + "::".join(klass + [name])


# Skip messages that say the machine lacked what the test needs (tests/gpu, conftest.py).
MACHINE_SKIP = re.compile(r"needs \d+ CUDA devices|needs a CUDA device|no GPU on this machine")


def read_junit(name: str, path: str | None) -> Suite:
    """The outcomes in one junit XML file, or in several (comma-separated paths, one suite, oldest
    run first: a test a later file ran again takes that file's outcome, so a re-run after a fix
    replaces the failure it fixed. A later skip for want of hardware (``MACHINE_SKIP``: a one-GPU run
    of 2-GPU tests) does not replace a pass or a failure, since it says nothing about the test; any
    other skip (the test now names a real limit of the pair) does)."""
    suite = Suite(name, path)
    if path is None:
        return suite
    for one in path.split(","):
        root = ET.parse(one).getroot()
        for ts in root.iter("testsuite"):
            suite.timestamp = suite.timestamp or ts.get("timestamp")
            suite.hostname = suite.hostname or ts.get("hostname")
        outcomes: dict[str, str] = {}
        no_machine: set[str] = set()
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
            if skip is not None and MACHINE_SKIP.search(skip.get("message", "")):
                no_machine.add(tid)
        for tid, outcome in outcomes.items():
            if not (outcome == "skipped" and tid in no_machine and suite.outcomes.get(tid, "skipped") != "skipped"):
                suite.outcomes[tid] = outcome
    return suite


def verdict(suite: Suite, patterns: list[str]) -> str:
    if not suite.given:
        return f"{suite.name} not run"
    matched: dict[str, str] = {}
    missing = []
    for p in patterns:
        hits = {t: o for t, o in suite.outcomes.items() if re.search(p, t)}
        if not hits:
            missing.append(p)
        matched.update(hits)
    if not matched:
        return "no test"
    counts = {o: sum(1 for v in matched.values() if v == o) for o in ("passed", "failed", "skipped")}
    if counts["failed"]:
        return f"{suite.name} FAIL ({counts['failed']} of {len(matched)})"
    if missing:
        return f"{suite.name} incomplete ({len(missing)} of {len(patterns)} required tests missing)"
    if not counts["passed"]:
        return f"{suite.name} skipped ({counts['skipped']})"
    skipped = f", {counts['skipped']} skipped" if counts["skipped"] else ""
    return f"{suite.name} pass ({counts['passed']}{skipped})"


def cell(col: Column, fmt: str, low, cpu: Suite, gpu: Suite) -> str:
    parts = []
    if col.cpu is not None and not col.gpu_only and "cpu" in low.device_types:
        pats = col.cpu(fmt, low)
        if pats:
            parts.append(verdict(cpu, pats))
    if col.gpu is not None and "cuda" in low.device_types:
        pats = col.gpu(fmt, low)
        if pats:
            parts.append(verdict(gpu, pats))
    parts = [p for p in parts if p != "no test"] or ["no test"]
    return "; ".join(parts)


def rows():
    from qops.formats import FORMATS
    from qops.lowerings import LOWERINGS

    for name, fmt in FORMATS.items():
        for low in sorted((l for l in LOWERINGS if l.family == fmt.family and name in l.formats), key=lambda l: -l.priority):
            yield name, low


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"
    except Exception:  # noqa: BLE001 - no git
        return os.environ.get("QOPS_COMMIT", "unknown")


def summary(s: Suite) -> str:
    n = len(s.outcomes)
    c = {o: sum(1 for v in s.outcomes.values() if v == o) for o in ("passed", "failed", "skipped")}
    files = sorted({t.split("::")[0] for t in s.outcomes})
    return (f"{s.timestamp or 'unknown date'} on {s.hostname or 'unknown host'}: {n} tests ({c['passed']} passed, {c['failed']} failed, "
            f"{c['skipped']} skipped) from {', '.join(f'`{f}`' for f in files)}")


def render(cpu: Suite, gpu: Suite, torch_version: str, commit: str, notes: tuple[str, ...] = ()) -> str:
    out = ["# Guarantees: checkpoint formats x lowerings", "",
           "Generated by `scripts/guarantee_matrix.py` from pytest junit XML; no cell is written by hand. Each cell is the",
           "outcome of the tests whose ids match that column's patterns for the row's (format, lowering) -- listed under",
           "the table. \"no test\": no test covers the cell. \"not run\": the suite that covers it was not given.", "",
           f"- Generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, torch {torch_version}, "
           f"commit {commit}.",
           f"- CPU run: {summary(cpu)}." if cpu.given else "- CPU run: none given.",
           (f"- GPU run: {summary(gpu)}." if gpu.given else
            "- GPU run: **not run** -- no GPU results were given, so every GPU cell says \"GPU not run\" (the GPU tests exist: "
            "`tests/gpu/test_gpu_model.py`, run with `pytest -m gpu`)."),
           "- On the CPU every format runs on its reference lowering; the Triton and native lowerings run on CUDA only."]
    out += [f"- {n}" for n in notes] + [""]
    head = ["format", "lowering"] + [c.title for c in COLUMNS]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for fmt, low in rows():
        out.append("| " + " | ".join([f"`{fmt}`", f"`{low.name}`"] + [cell(c, fmt, low, cpu, gpu) for c in COLUMNS]) + " |")
    out += ["", "## Where each column comes from", ""]
    for c in COLUMNS:
        out.append(f"- **{c.title}**{' (GPU only)' if c.gpu_only else ''}: {c.how}.")
    out += ["", "Regenerate: run the CPU tests with `--junitxml`, then `python scripts/guarantee_matrix.py --cpu <xml> "
            "[--gpu <xml of pytest -m gpu tests/gpu>]` (see the script's docstring).", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", required=True, help="junit XML of the CPU test run")
    p.add_argument("--gpu", default=None, help="junit XML of the GPU test run (pytest -m gpu tests/gpu), or several, comma-separated; omitted: GPU cells say 'not run'")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "GUARANTEES.md"), help="where to write (default docs/GUARANTEES.md)")
    p.add_argument("--torch", default=None, help="torch version of the run (default: this interpreter's)")
    p.add_argument("--commit", default=None, help="commit of the run (default: git HEAD here)")
    p.add_argument("--note", action="append", default=[], help="a line about the runs, added under the header (repeatable)")
    args = p.parse_args(argv)
    if args.torch is None:
        import torch

        args.torch = torch.__version__
    text = render(read_junit("CPU", args.cpu), read_junit("GPU", args.gpu), args.torch, args.commit or git_commit(), tuple(args.note))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
