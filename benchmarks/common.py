"""The measuring method shared by the GPU benchmarks (``../shared/PERF.md``, "How to time").

Every script here times the same way so that numbers from different scripts and runs compare:

- correctness first: relative Frobenius error against a float64 reference (``rel_err``);
- one zero-argument call per rotated weight copy, enough copies to exceed 256 MB (``n_copies``),
  because the H200's 50 MB L2 otherwise holds a 4-bit weight and the timing measures the cache;
- CUDA-graph replays of those calls, CUDA events, median of trials (``graph_time``);
- the two ceilings (``ceilings``: PERF.md's values, or this run's measurement where it is higher), and
  the roofline from them (``roofline_us``);
- the run's metadata (GPU, torch and triton versions, commit) and strict JSON (``write_json``).

``--dry-run`` on a CPU swaps in ``wall_time`` and PERF.md's ceilings: it checks the plumbing, its
numbers mean nothing.

The scripts import this module as ``common`` (Python puts a script's own folder on ``sys.path``).
"""
from __future__ import annotations

import argparse
import datetime
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PERF_SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]  # (N, K)
LARGE_SHAPES = PERF_SHAPES[1:]  # PERF.md's "four large shapes"
# PERF.md's measured H200 ceilings; a dry run has no GPU to measure them on.
PERF_COPY_TBPS, PERF_BF16_TFLOPS = 4.25, 810.0

ROT_BYTES = 288 * 2**20  # > 256 MB with margin: several times the H200's 50 MB L2
MAX_COPIES = 64  # bounds memory for small weights, whose 64 copies already defeat the L2
DRY_MAX_COPIES = 2  # no cache to defeat on a CPU; keeps the dry run short
COPY_BYTES = 2**30  # copy-bandwidth source buffer (plus as much destination)


class Timing(NamedTuple):
    us: float  # median microseconds per call
    info: dict  # how it was measured: copies, replays per trial, trials, spread


def _capture(fns) -> "torch.cuda.CUDAGraph":
    """One CUDA graph holding one call of each of ``fns``, after an eager warm-up on a side stream
    (compiles, autotunes: CUDA graphs cannot capture either)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return g


def _replay_ms(g, replays: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _timing(ts: list[float], copies: int, replays: int) -> Timing:
    med = statistics.median(ts)
    return Timing(med, {"copies": copies, "replays": replays, "trials": len(ts),
                        "spread_pct": round(100 * (max(ts) - min(ts)) / med, 1) if med > 0 else None})


def graph_time(fns, trials: int, target_ms: float, max_replays: int = 2000) -> Timing:
    """Median microseconds per call of ``fns`` (one zero-arg callable per rotated weight copy).

    One graph holds one call per copy (:func:`_capture`). A first timed replay sizes the trials so
    that each lasts about ``target_ms`` (at most ``max_replays`` replays), long enough for events to
    resolve.
    """
    return graph_times({"": fns}, trials, target_ms, max_replays)[""]


def graph_times(candidates: dict, trials: int, target_ms: float, max_replays: int = 2000) -> dict:
    """:func:`graph_time` of several candidates (name -> callables) with their trials interleaved
    (A B A B ...): a drift of clocks or power state during the measurement (a GEMV timed right after
    large GEMMs ran up to 15% slower on the H200, benchmarks/NOTES.md, stop 15) then moves all of
    them alike instead of biasing their ratios. Returns name -> :class:`Timing`."""
    graphs = {name: _capture(fns) for name, fns in candidates.items()}
    replays = {name: max(1, min(max_replays, round(target_ms / max(_replay_ms(g, 1), 1e-3)))) for name, g in graphs.items()}
    ts: dict = {name: [] for name in graphs}
    for _ in range(trials):
        for name, g in graphs.items():
            ts[name].append(_replay_ms(g, replays[name]) * 1e3 / replays[name] / len(candidates[name]))
    del graphs
    return {name: _timing(ts[name], len(candidates[name]), replays[name]) for name in ts}


def wall_time(fns, trials: int) -> Timing:
    """--dry-run stand-in for ``graph_time``: CPU wall-clock microseconds per call (meaningless)."""
    for f in fns:
        f()
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for f in fns:
            f()
        ts.append((time.perf_counter() - t0) * 1e6 / len(fns))
    return Timing(statistics.median(ts), {"copies": len(fns), "replays": 1, "trials": trials, "cpu_wall_clock": True})


def n_copies(nbytes: float, gpu: bool = True) -> int:
    """How many copies of a weight of ``nbytes`` to rotate so that together they exceed 256 MB."""
    return max(1, min(MAX_COPIES if gpu else DRY_MAX_COPIES, math.ceil(ROT_BYTES / max(nbytes, 1))))


def clone_tensors(obj):
    """A copy of the dataclass ``obj`` (a prepared weight) with every tensor field cloned."""
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).clone() for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


def copy_TBps(trials: int = 5) -> float:
    """Device-to-device copy bandwidth, bytes read + written, median of trials of 10 copies."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters, bws = 10, []
    for _ in range(trials):
        a.record()
        for _ in range(iters):
            dst.copy_(src)
        b.record()
        b.synchronize()
        bws.append(2 * COPY_BYTES * iters / (a.elapsed_time(b) / 1e3) / 1e12)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(bws)


def bf16_TFLOPs(trials: int, target_ms: float = 20.0) -> float:
    """Dense bf16 matmul peak at 8192^3, timed by ``graph_time``."""
    A = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    B = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_us = graph_time([lambda: A @ B], trials, target_ms).us
    A = B = None  # noqa: F841  (frees them; not `del`: the lambda holds the cells)
    torch.cuda.empty_cache()
    return 2 * 8192**3 / (t_us * 1e-6) / 1e12


class Ceilings(NamedTuple):
    copy_TBps: float  # the bandwidth rooflines use: the larger of PERF.md's and this run's
    bf16_TFLOPs: float  # likewise for the compute peak
    measured: dict  # this run's own measurements (None in a dry run)


def ceilings(trials: int, target_ms: float, gpu: bool) -> Ceilings:
    """The two ceilings a roofline divides by. On an H200 each is the larger of PERF.md's measured
    value and this run's measurement: a run's own figure only ever comes out lower than the device can
    do (a clock dip, another process), and dividing by it made a "ceiling" that cuBLAS fp16 beat (702
    against PERF.md's 810 TFLOP/s in one run), flattering every compute-bound %. Other GPUs get this
    run's measurement (PERF.md's values are the H200's). A dry run gets PERF.md's."""
    if not gpu:
        return Ceilings(PERF_COPY_TBPS, PERF_BF16_TFLOPS, {"copy_TBps": None, "bf16_TFLOPs": None})
    bw, tf = copy_TBps(trials), bf16_TFLOPs(trials, max(target_ms, 20.0))
    measured = {"copy_TBps": round(bw, 4), "bf16_TFLOPs": round(tf, 1)}
    if "H200" in torch.cuda.get_device_name():
        return Ceilings(max(bw, PERF_COPY_TBPS), max(tf, PERF_BF16_TFLOPS), measured)
    return Ceilings(bw, tf, measured)


def isolated_call(f, *args):
    """``f(*args)`` with qops' native kernels launched without programmatic dependent launch (PDL), so
    that in a graph of back-to-back calls each starts after the previous one has finished: as
    cuBLAS, torch int4, gemlite and qops' Triton kernels run here, and as a native matmul runs after
    the Inductor kernels between two matmuls of a model. With PDL, one native call streams its
    weights while the previous one drains (0.91-0.95x the time at M = 1, benchmarks/NOTES.md stop
    16): a pipelined throughput no peer gets, which the benchmarks report beside as
    ``qops_chained_us``. ``QOPS_NATIVE_PDL`` is read at every launch, so it holds for the launches
    a graph captures here."""
    from qops.native import int_weight as niw

    before = os.environ.get(niw.PDL_ENV)
    os.environ[niw.PDL_ENV] = "0"
    try:
        return f(*args)
    finally:
        if before is None:
            del os.environ[niw.PDL_ENV]
        else:
            os.environ[niw.PDL_ENV] = before


def roofline_us(nbytes: float, copy_TBps: float, flops: float = 0.0, bf16_TFLOPs: float = math.inf) -> float:
    """The slower of moving ``nbytes`` at the copy bandwidth and doing ``flops`` at the bf16 peak."""
    return max(nbytes / (copy_TBps * 1e12), flops / (bf16_TFLOPs * 1e12)) * 1e6


def rel_err(got, want) -> float | None:
    """Relative Frobenius error in float64; None when ``got`` holds NaN or Inf."""
    g = got.double()
    if not bool(torch.isfinite(g).all()):
        return None
    den = want.norm().item()
    num = (g - want).norm().item()
    return num / den if den else num


def out_form_err(write_out, n: int, x: torch.Tensor, want) -> float | None:
    """:func:`rel_err` of an op's ``_out`` form (what a CUDA-graph decode loop calls): ``write_out(out)``
    into an ``(M, n)`` buffer of x's dtype that starts as NaN, so an element left unwritten gives None."""
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    write_out(out)
    return rel_err(out, want)


def short_err(e: BaseException) -> str:
    """One line for a JSON field or a log: the exception type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """argparse type for ``--shapes``: comma-separated ``NxK`` (N = out_features, K = in_features)."""
    shapes = []
    for item in filter(None, (s.strip().lower() for s in text.split(","))):
        try:
            n, k = (int(v) for v in item.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NxK items like 4096x14336, got {item!r}") from None
        shapes.append((n, k))
    if not shapes:
        raise argparse.ArgumentTypeError("no shape given")
    return shapes


def parse_ms(text: str) -> list[int]:
    """argparse type for ``--ms``: comma-separated batch sizes, each >= 1."""
    try:
        ms = [int(m) for m in text.split(",") if m.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be >= 1")
    return ms


def probe_parser(prog: str, doc: str, shapes, ms: list[int], trials: int) -> argparse.ArgumentParser:
    """The arguments every probe takes (``--shapes``, ``--ms``, ``--trials``, ``--out``), with its defaults."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=shapes)
    p.add_argument("--ms", type=parse_ms, default=ms, help="rows of x")
    p.add_argument("--trials", type=int, default=trials)
    p.add_argument("--out")
    return p


def probe_result(name: str) -> dict | None:
    """A probe's JSON header (device, commit, measured copy bandwidth) with no rows yet; None, with a
    message, where there is no CUDA device to probe."""
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    return {"probe": name, "device": device_name(True), "commit": git_commit(), "copy_TBps": round(copy_TBps(5), 3), "rows": []}


def add_time(row: dict, name: str, us: float, roof_us: float) -> None:
    """``name``'s time and its share of the roofline, as a probe row's ``<name>_us`` / ``<name>_roof_pct``."""
    row[name + "_us"] = round(us, 2)
    row[name + "_roof_pct"] = round(100 * roof_us / us, 1)


def time_row(res: dict, row: dict, cands: dict, trials: int, roof_us: float, target_ms: float = 5.0,
             ratio: tuple[str, str, str] | None = None) -> dict:
    """A probe row's timing: ``cands`` (name -> callables) timed with interleaved trials
    (:func:`graph_times`) into ``row`` (:func:`add_time`), then ``ratio`` = (key, numerator, denominator)
    names adds ``row[key]`` = numerator time / denominator time; the row is appended to ``res["rows"]``
    and printed as one JSON line. Returns the row."""
    for name, t in graph_times(cands, trials, target_ms).items():
        add_time(row, name, t.us, roof_us)
    if ratio is not None:
        key, num, den = ratio
        row[key] = round(row[num + "_us"] / row[den + "_us"], 3)
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    return row


def device_name(gpu: bool) -> str:
    return torch.cuda.get_device_name() if gpu else "cpu (dry run)"


def triton_version() -> str:
    try:
        import triton
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: the torch-only peers still run
        return f"not importable ({short_err(e)})"
    return triton.__version__


def git_commit() -> str | None:
    """``$QOPS_COMMIT`` when set (a run from an exported snapshot of that commit: git there would name
    whatever repository encloses the snapshot), else ``git rev-parse HEAD`` of the repo, else None."""
    if os.environ.get("QOPS_COMMIT"):
        return os.environ["QOPS_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            return head.stdout.strip()
    except Exception:  # noqa: BLE001 - no git binary
        pass
    return os.environ.get("QOPS_COMMIT") or None


def git_dirty(path: str) -> bool | None:
    """Whether ``path`` (relative to the repo) has uncommitted changes; None without git (or for a
    snapshot run, ``$QOPS_COMMIT`` set)."""
    if os.environ.get("QOPS_COMMIT"):
        return None
    try:
        st = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001 - no git binary
        return None
    return bool(st.stdout.strip()) if st.returncode == 0 else None


def run_stamp(args, **resolved) -> dict:
    """A results file's ``date`` (UTC) and ``args``: the parsed arguments as given, with the lists a
    script resolved from them (parsed attributes named ``*_list``, e.g. the default shapes) replaced by
    ``resolved`` (e.g. ``shapes=``, ``ms=``), so the file says what ran."""
    given = {k: v for k, v in vars(args).items() if not k.endswith("_list")}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "args": given | resolved}


def shape_names(shapes) -> list[str]:
    return [f"{n}x{k}" for n, k in shapes]


def output_paths(filename: str, *extra: str | None) -> list[str]:
    """``$OUT/filename`` when ``$OUT`` is set (the device tool fetches that folder), then each given path;
    ``filename`` in the working directory when there is neither (a run always leaves its JSON)."""
    paths = [os.path.join(os.environ["OUT"], filename)] if os.environ.get("OUT") else []
    paths += [p for p in extra if p]
    return paths or [os.path.join(os.getcwd(), filename)]


def clean(o):
    """JSON-safe: non-finite floats become None (``json`` would write the invalid ``NaN``/``Infinity``)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    return o


def write_json(obj, paths) -> None:
    """Write ``obj`` to each path through a temporary file, so a run killed mid-write leaves the last
    complete file (the scripts rewrite their JSON as they go)."""
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(clean(obj), fh, indent=1)
        os.replace(tmp, path)


def add_repo_to_path() -> None:
    """Let ``import qops`` find the repo when a script runs without ``PYTHONPATH=.``."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
