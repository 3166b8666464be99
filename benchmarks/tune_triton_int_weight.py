"""Tune the Triton int-weight lowering on this GPU and write its config table.

    PYTHONPATH=. python benchmarks/tune_triton_int_weight.py            # writes $OUT/<gpu>.json
    PYTHONPATH=. python benchmarks/tune_triton_int_weight.py --dry-run  # CPU interpreter smoke test
    PYTHONPATH=. python benchmarks/tune_triton_int_weight.py --from-rows RUN-tune-rows.json  # select again, no GPU

Sweeps, for W4 g128 and W8 g128 (asymmetric, fp16 activations) over the PERF.md benchmark shapes:

- decode (GEMV) configs for M in {1, 2, 4}: BLOCK_N x num_warps (4 or 8 columns per thread),
  CHUNKS (32-value runs per step), programs per SM (the split-K count follows), then the atomic
  reduction for the best partials config, the words loaded a step ahead (``prefetch``), a register cap
  (``maxnreg``) and, at 4 bits, the packed fp16 dot (``half_dot``, alone and with ``prefetch``; ``half_dot`` 2 with
  it) for the best;
- tensor-core GEMM configs per M bucket {4 ... 2048}: tile shapes, warps, stages, programs per SM (at 4
  bits up to M = 128 each also as even / odd K halves, ``even_odd``),
  then the atomic reduction, the scales loaded a K tile ahead (``prefetch_scales``), stream-K (``stream_k``), the
  weight tile scaled before the MMA (``scale_weight``, where the tile's height would not) and, to M = 16, a
  register cap on the best one;
  and dequantize + cuBLAS from M = 256 on.

``decode_max_m`` is, per bit width, the largest M (from 1) where the best decode config beats the best GEMM one.
The widths it does not time (2 and 3 bits, the tables' "default") take the 4-bit picks among configs without
the 4-bit-only knob, and their crossover.
Each candidate is first checked against a float64-free fp32 reference on a 4096x4096 weight (a
failing candidate is dropped and reported). Timing follows PERF.md: CUDA-graph replay over rotated
weight copies totalling more than 256 MB, CUDA events, median of trials; cuBLAS fp16 is timed the
same way in the same process. Kernels are compiled first by worker processes in parallel (they
fill Triton's disk cache), so the whole run fits in a few minutes.

Writes ``$OUT/<gpu>.json`` (copy to ``qops/ops/triton/configs/``) and ``$OUT/tune_rows.json`` (the
measured rows: op, format, N, K, M, dtype, qops_us, cublas_fp16_us, roofline_us; and every timed
candidate with its per-shape times, ``candidates``), and prints a short table last.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Before torch (imported by common too) loads triton, which reads it once.
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import common  # noqa: E402
from common import n_copies  # noqa: E402

common.add_repo_to_path()
from qops.ops.int_weight import reference_dequantize  # noqa: E402
from qops.ops.triton import int_weight as T  # noqa: E402

SHAPES = common.LARGE_SHAPES  # (N, K)
CHECK_SHAPE = (4096, 4096)
BITS = (4, 8)
GROUP = 128
DECODE_MS = (1, 2, 4)
# Register caps tried on the best configs (``maxnreg``; 64K registers an SM). A 2-warp GEMV program at 124-128
# registers: 8 an SM; capped at 104, 9 (the 4-bit build compiled for sm_90 by Triton 3.6: no spill, 1944
# instructions a pass against 1924). The 4-warp 16-row GEMM tile at 154 registers: 3 an SM; at 128, 4 (a few
# spills: 472 instructions a pass against 437). The GEMV capped at 104 ran 4% slower on an H100 (stop 61,
# h100-2026-12-06-2f64354-probe-gemv-maxnreg.json); the GEMM cap is untimed.
DECODE_MAXNREG = 104
GEMM_MAXNREG = 128
GEMM_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # 1, 2: to decide decode_max_m
DENSE_FROM = 256
DEADLINE_S = 270


def decode_candidates(m: int) -> list[dict]:
    chunks = {1: (2, 4), 2: (1, 2), 4: (1, 2)}[m]
    out = []
    for block_n, warps in ((256, 2), (512, 4), (1024, 4), (1024, 8)):
        for ch in chunks:
            out.append({"BLOCK_N": block_n, "CHUNKS": ch, "num_warps": warps, "num_stages": 1, "max_split": 64,
                        "reduce": "partials"})
    return out


def gemm_candidates(m: int) -> list[dict]:
    if m <= 16:
        tiles = [(16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (16, 256, 128, 8, 3), (16, 128, 256, 4, 2)]
    elif m <= 32:
        tiles = [(32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (32, 256, 128, 8, 3)]
    elif m <= 64:
        # 32-row tiles too: they run on mma.sync, where the unpack can stay in registers (even_odd, and the
        # 8-bit tile), while 64-row tiles run warpgroup MMAs, which read the weight tile from shared memory.
        tiles = [(64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (32, 128, 128, 4, 3)]
    elif m <= 128:
        tiles = [(64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3)]
    else:
        tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 3)]
    out = [{"impl": "triton", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": s,
            "max_split": 32, "reduce": "partials"} for bm, bn, bk, w, s in tiles]
    if m >= DENSE_FROM:
        # Two 128 MB slab buffers of equal widths, slab i + 1 dequantized under slab i's GEMM: 1.03-1.29x
        # the single 64 MB buffer on the PERF.md shapes at M = 256..2048 (benchmarks/probe_dense.py,
        # h200-2026-12-01-e985209-probe-dense2.json).
        out.append({"impl": "dense", "DQ_BLOCK_K": 64, "DQ_BLOCK_N": 128, "slab_bytes": 128 << 20, "overlap": 1, "equal": 1})
    return out


def ctas_choices(path: str, m: int) -> tuple[int, ...]:
    if path == "decode":
        return (2, 4, 8)
    if path == "dense":
        return (1,)
    return (1, 2, 4) if m <= 64 else (1, 2)


def single_table(path: str, cfg: dict) -> dict:
    """A table serving every M of ``path`` with ``cfg`` (the path itself is forced per call; the other section,
    never read, is empty: a decode config's keys are not a GEMM entry's)."""
    section = "decode" if path == "decode" else "gemm"
    return {"gpu": "tuning", "tuned": False, "source": "tuner candidate", "decode_max_m": 4,
            "decode": {}, "gemm": {}, section: {"default": {"1": cfg}}}


def random_weight(n, k, bits, device, seed, group=GROUP):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = (k * bits + 31) // 32
    qweight = torch.randint(-(2**31), 2**31 - 1, (rows, n), generator=g, dtype=torch.int32).to(device)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=g) * 0.01 + 0.001).half().to(device)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (groups, (n * bits + 31) // 32), generator=g, dtype=torch.int32).to(device)
    return qweight, scales, qzeros


def weight_bytes(n, k, bits, group=GROUP):
    return n * k * bits // 8 + 2 * n * -(-k // group) + n * bits // 8 * -(-k // group)


def roofline_us(n, k, m, bits):
    # PERF.md's copy bandwidth, not one measured here: the tuner compares configs, the ratio is a guide
    return common.roofline_us(weight_bytes(n, k, bits) + 2 * m * (n + k), common.PERF_COPY_TBPS)


def time_us(fns, dry_run):
    """Median microseconds per call of ``fns`` (one per rotated copy): 3 trials of about 5 ms each, at
    most 50 replays, which keeps the several thousand candidates within the deadline."""
    if dry_run:
        return common.wall_time(fns, 1).us
    return common.graph_time(fns, 3, 5.0, max_replays=50).us


def run_mm(path, cfg, x, w, bits):
    qweight, scales, qzeros = w
    with T.config_override(single_table(path, cfg)):
        return T.triton_mm(x, qweight, scales, qzeros, None, None, bits, GROUP, 0, force_path=path)


def jobs(args) -> list[tuple]:
    """Every (bits, path, M, config) the sweep times."""
    out = []
    for bits in BITS:
        for m in DECODE_MS:
            for cfg in decode_candidates(m):
                for c in ctas_choices("decode", m):
                    out.append((bits, "decode", m, {**cfg, "ctas_per_sm": c}))
        for m in GEMM_MS:
            for cfg in gemm_candidates(m):
                path = "dense" if cfg.get("impl") == "dense" else "gemm"
                for c in ctas_choices(path, m):
                    out.append((bits, path, m, {**cfg, "ctas_per_sm": c}))
                    if bits == 4 and path == "gemm" and m <= 128:
                        # 4-bit tiles as even and odd K halves (two dots): their unpack reaches the MMA
                        # operand in registers where the eight-value interleave went through shared memory.
                        out.append((bits, path, m, {**cfg, "ctas_per_sm": c, "even_odd": 1}))
    if args.dry_run:
        picked, seen = [], set()
        for j in out:
            if j[2] in (1, 16, 256) and (j[0], j[1], j[2]) not in seen:
                seen.add((j[0], j[1], j[2]))
                picked.append(j)
        out = picked
    return out


def compile_key(job, shape, device):
    bits, path, m, cfg = job
    n, k = shape
    with T.config_override(single_table(path, cfg)):
        plan = T._plan(m, n, k, bits, GROUP, device, path)
    keep = {key: v for key, v in plan.items() if key not in ("grid", "split_len", "cfg")}
    keep["split"] = plan.get("split", 1) > 1
    return json.dumps([bits, path, min(m, 4) if path == "decode" else 0, keep,
                       cfg.get("num_warps"), cfg.get("num_stages")], sort_keys=True, default=str)


def precompile(job_list, args):
    """Compile every distinct kernel in parallel worker processes (they fill Triton's disk cache)."""
    device = torch.device("cuda")
    seen, todo = set(), []
    for job in job_list:
        for shape in SHAPES + [CHECK_SHAPE]:
            key = compile_key(job, shape, device)
            if key not in seen:
                seen.add(key)
                todo.append((job, shape))
    workers = max(1, min(args.jobs, len(todo)))
    print(f"precompiling {len(todo)} kernel variants with {workers} processes", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(todo, f)
        path = f.name
    t = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{i}/{workers}", "--todo", path]) for i in range(workers)]
    codes = [p.wait() for p in procs]
    print(f"precompiled in {time.time() - t:.0f}s (worker exit codes {sorted(set(codes))})", flush=True)


def worker(spec, todo_path):
    index, count = (int(v) for v in spec.split("/"))
    todo = json.load(open(todo_path))[index::count]
    weights = {}
    for (bits, path, m, cfg), (n, k) in todo:
        key = (bits, n, k)
        if key not in weights:
            weights[key] = random_weight(n, k, bits, "cuda", 0)
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        try:
            run_mm(path, cfg, x, weights[key], bits)
        except Exception as e:  # noqa: BLE001 - reported again, and dropped, by the main process
            print(f"worker {index}: {bits}-bit {path} M={m} {cfg} failed to build: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()


def check_candidate(job, device, cache) -> str | None:
    """None when the candidate matches an fp32 reference on the check shape, else why not."""
    bits, path, m, cfg = job
    n, k = CHECK_SHAPE
    if (bits, m) not in cache:
        w = random_weight(n, k, bits, device, 1)
        dense = reference_dequantize(w[0], w[1], w[2], k, bits, GROUP, 0)
        x = torch.randn(m, k, dtype=torch.float16, device=device)
        cache[(bits, m)] = (w, x, x.float() @ dense.t())
    w, x, ref = cache[(bits, m)]
    try:
        y = run_mm(path, cfg, x, w, bits)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"
    err = common.rel_err(y, ref)
    if err is None:
        return "non-finite output"
    return None if err < 5e-3 else f"relative error {err:.2e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter (checks the script only)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile worker processes")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--todo", help=argparse.SUPPRESS)
    ap.add_argument("--from-rows", metavar="TUNE_ROWS_JSON",
                    help="no timing: select the table again from a run's saved candidates (runs without a GPU)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.todo)
    if args.from_rows:
        return rebuild(args.from_rows, os.environ.get("OUT", "."))

    global SHAPES, CHECK_SHAPE
    out_dir = os.environ.get("OUT", ".")
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        SHAPES, CHECK_SHAPE = [(256, 256)], (128, 256)
    start = time.time()
    gpu = "dry-run" if dry else torch.cuda.get_device_name()
    stem = "dry-run" if dry else T.gpu_key(gpu)
    job_list = jobs(args)
    if not dry:
        precompile(job_list, args)

    cache, failed, ok_jobs = {}, [], []
    for job in job_list:
        why = check_candidate(job, device, cache)
        (failed.append((job, why)) if why else ok_jobs.append(job))
    for job, why in failed:
        print(f"DROPPED {job[0]}-bit {job[1]} M={job[2]} {job[3]}: {why}", flush=True)
    print(f"{len(ok_jobs)} candidates pass the check ({time.time() - start:.0f}s)", flush=True)

    # times[(bits, M, path, cfg json)][shape] = us
    times: dict = {}
    cublas: dict = {}
    timed_out = False
    for bits in BITS:
        for n, k in SHAPES:
            ws = [random_weight(n, k, bits, device, s) for s in range(n_copies(weight_bytes(n, k, bits), not dry))]
            for m in sorted({j[2] for j in ok_jobs}):
                x = torch.randn(m, k, dtype=torch.float16, device=device)
                if bits == BITS[0] and not dry:
                    dense = [torch.randn(n, k, dtype=torch.float16, device=device) * 0.02 for _ in range(n_copies(2 * n * k))]
                    cublas[(n, k, m)] = time_us([lambda d=d: torch.nn.functional.linear(x, d) for d in dense], dry)
                    del dense
                for job in ok_jobs:
                    if job[0] != bits or job[2] != m:
                        continue
                    if time.time() - start > DEADLINE_S:
                        timed_out = True
                        break
                    _, path, _, cfg = job
                    fns = [lambda w=w: run_mm(path, cfg, x, w, bits) for w in ws]
                    try:
                        t = time_us(fns, dry)
                    except Exception as e:  # noqa: BLE001
                        print(f"timing failed {bits}-bit {path} M={m} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    times.setdefault((bits, m, path, json.dumps(cfg, sort_keys=True)), {})[(n, k)] = t
            del ws
            if not dry:
                torch.cuda.empty_cache()
            print(f"timed {bits}-bit {n}x{k} ({time.time() - start:.0f}s)", flush=True)

    def time_variant(bits, m, paths, change, when=lambda cfg: True):
        """Time the bucket's best config of ``paths`` with ``change`` applied, on every shape (if it passes the check
        and ``when`` says the change means something for that config)."""
        top = best(times, bits, m, paths)
        if top is None or time.time() - start > DEADLINE_S + 20:
            return
        cfg, path, _ = top
        if not when(cfg):
            return
        alt = {**cfg, **change}
        if alt == cfg or check_candidate((bits, path, m, alt), device, cache):
            return
        for n, k in SHAPES:
            ws = [random_weight(n, k, bits, device, s) for s in range(n_copies(weight_bytes(n, k, bits), not dry))]
            x = torch.randn(m, k, dtype=torch.float16, device=device)
            times.setdefault((bits, m, path, json.dumps(alt, sort_keys=True)), {})[(n, k)] = time_us(
                [lambda w=w: run_mm(path, alt, x, w, bits) for w in ws], dry)
            del ws

    # The atomic reduction, tried on the best partials config of each decode / GEMM bucket; then the GEMV's
    # words loaded a step ahead (prefetch) on the best decode config, and the GEMM's scales loaded a K tile
    # ahead (prefetch_scales: Triton does not pipeline that load) on the best GEMM config.
    for bits in BITS:
        for m in sorted({j[2] for j in ok_jobs}):
            for paths in (("decode",), ("gemm",)):
                time_variant(bits, m, paths, {"reduce": "atomic"})
            time_variant(bits, m, ("decode",), {"prefetch": 1})  # a no-op past DECODE_MS (no decode timed there)
            time_variant(bits, m, ("gemm",), {"prefetch_scales": 1})
            # A register cap: one more program an SM (stop 60's profiles found both latency-bound at low occupancy).
            time_variant(bits, m, ("decode",), {"maxnreg": DECODE_MAXNREG})
            if bits == 4:  # the packed fp16 dot (stop 61; 4-bit words only), fast only with the prefetch on an H100
                time_variant(bits, m, ("decode",), {"half_dot": 1})
                time_variant(bits, m, ("decode",), {"half_dot": 1, "prefetch": 1})
                time_variant(bits, m, ("decode",), {"half_dot": 2, "prefetch": 1})  # two words a half-sum
            if m <= 16:
                time_variant(bits, m, ("gemm",), {"maxnreg": GEMM_MAXNREG})
            # Stream-K (stop 63): the launch takes it only where it saves rounds, so per shape it is the split
            # launch or faster (H100: 1.02-1.35x where taken, one 0.96x at 28672x4096 M = 32).
            time_variant(bits, m, ("gemm",), {"stream_k": 1})
            # The half weight tile scaled before the MMA where the tile's height would scale the product after it
            # (stop 64, H100: the 64 x 128 x 128 tile with it 1.03-1.20x faster at M = 64; slower at 16 and 32).
            time_variant(bits, m, ("gemm",), {"scale_weight": 1},
                         when=lambda cfg: 2 * cfg.get("BLOCK_M", 0) <= cfg.get("BLOCK_K", 0))

    source = (f"benchmarks/tune_triton_int_weight.py on {gpu}, torch {torch.__version__}, "
              f"triton {common.triton_version()}, commit {(common.git_commit() or 'unknown')[:12]}, "
              f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}"
              + (" (stopped at the time limit: some buckets keep untuned defaults)" if timed_out else ""))
    table = build_table(times, gpu, source, tuned=not dry)

    common.write_json(table, [os.path.join(out_dir, f"{stem}.json")])
    rows = _rows(table, times, cublas, dry)
    common.write_json({"gpu": gpu, "torch": torch.__version__, "triton": common.triton_version(), "commit": common.git_commit(),
                       "dropped": [[*j[:3], j[3], why] for j, why in failed], "rows": rows,
                       "candidates": _candidates(times)},
                      [os.path.join(out_dir, "tune_rows.json")])
    print(f"wrote {os.path.join(out_dir, stem + '.json')} and tune_rows.json in {time.time() - start:.0f}s; "
          f"decode_max_m={table['decode_max_m']}; {len(failed)} candidates dropped")
    _print_table(rows)


def four_bit_only(cfg: dict) -> bool:
    """Whether the config asks for what only 4-bit launches run (the lowering's own tests: ``even_odd``,
    ``half_dot``)."""
    return T.even_odd_applies(cfg, 4, T.Dequant.HALF_ASM) or bool(cfg.get("half_dot", 0))


def best(times, bits, m, paths, plain=False, n_shapes=None):
    """(config, path, per-shape us) minimising the geometric mean over the shapes, among the candidates
    timed on all ``n_shapes`` (default: every shape of SHAPES); ``plain``: among the configs that ask for
    nothing only 4-bit launches run."""
    scored = []
    for (b, mm, path, cfg_json), per in times.items():
        if b != bits or mm != m or path not in paths or len(per) != (n_shapes or len(SHAPES)):
            continue
        cfg = json.loads(cfg_json)
        if not (plain and four_bit_only(cfg)):
            scored.append((math.exp(statistics.fmean(math.log(v) for v in per.values())), cfg, path, per))
    if not scored:
        return None
    scored.sort(key=lambda s: s[0])
    return scored[0][1:]


def build_table(times, gpu: str, source: str, tuned: bool = True) -> dict:
    """The config table from the timed candidates ``times[(bits, M, path, cfg json)][(N, K)] = us``: per bit
    width and M bucket the fastest candidate in geometric mean over the shapes, and ``decode_max_m``, the
    largest M (from 1) up to which the best decode config beats the best GEMM one."""
    table = {"gpu": gpu, "tuned": tuned, "source": source, "decode_max_m": {}, "decode": {}, "gemm": {}}
    fallback = T.load_config("default")
    n_shapes = len({shape for per in times.values() for shape in per})  # the run's shapes (a dry run has one)
    # The widths the tuner does not time (2 and 3 bits: "default") take the 4-bit picks made without the
    # knobs only 4-bit weights take, and the crossover to the GEMM those give.
    for key, bits, plain in [(str(bits), bits, False) for bits in BITS] + [("default", BITS[0], True)]:
        dec, gem, decode_wins = {}, {}, []
        for m in DECODE_MS:
            top = best(times, bits, m, ("decode",), plain, n_shapes)
            dec[str(m)] = top[0] if top else T._bucket(fallback["decode"], bits, m)
            gtop = best(times, bits, m, ("gemm",), plain, n_shapes)
            if top and gtop:
                decode_wins.append((m, statistics.fmean(top[2].values()) < statistics.fmean(gtop[2].values())))
        for m in GEMM_MS:
            top = best(times, bits, m, ("gemm", "dense"), plain, n_shapes)
            gem[str(m)] = top[0] if top else T._bucket(fallback["gemm"], bits, m)
        table["decode"][key] = dec
        table["gemm"][key] = gem
        table["decode_max_m"][key] = 1
        for m, wins in sorted(decode_wins):
            if not wins:
                break
            table["decode_max_m"][key] = m
    return table


def amend(table: dict, amendments: list[dict]) -> dict:
    """``table`` with a shipped table's hand amendments (its ``amended`` list) applied, and that list kept in it:
    each sets the keys ``set`` in the entry at ``path`` (say ``["decode", "4", "1"]`` or ``["decode_max_m"]``).
    A table amended by hand records why and from which measurement; the selection from its rows plus the
    amendments must still give it (``test_tables_selected_from_saved_rows_are_what_the_rows_give``)."""
    out = copy.deepcopy(table)
    for change in amendments:
        entry = out
        for key in change["path"]:
            entry = entry[key]
        entry.update(change["set"])
    if amendments:
        out["amended"] = amendments
    return out


def times_from_rows(path: str) -> tuple[dict, dict]:
    """The timed candidates of a ``tune_rows.json`` (its ``candidates``) as ``build_table`` reads them, and
    the file's header (gpu, torch, triton, commit)."""
    with open(path) as f:
        saved = json.load(f)
    times = {}
    for c in saved["candidates"]:
        per = {common.parse_shapes(shape)[0]: us for shape, us in c["us"].items()}
        times[(c["bits"], c["M"], c["path"], json.dumps(c["config"], sort_keys=True))] = per
    return times, {key: saved.get(key) for key in ("gpu", "torch", "triton", "commit")}


def rebuild(rows_path: str, out_dir: str) -> int:
    """``--from-rows``: the table again from a run's saved candidates, with this script's selection (no GPU)."""
    times, head = times_from_rows(rows_path)
    gpu = head["gpu"]
    source = (f"benchmarks/tune_triton_int_weight.py --from-rows {os.path.basename(rows_path)}: timed on {gpu}, "
              f"torch {head['torch']}, triton {head['triton']}, commit {(head['commit'] or 'unknown')[:12]}; "
              f"selected at commit {(common.git_commit() or 'unknown')[:12]}")
    dry = gpu == "dry-run"  # a --dry-run's candidates: interpreter times, named as that run names its table
    table = build_table(times, gpu, source, tuned=not dry)
    out = os.path.join(out_dir, f"{'dry-run' if dry else T.gpu_key(gpu)}.json")
    common.write_json(table, [out])
    print(f"wrote {out}; decode_max_m={table['decode_max_m']}")
    return 0


def _candidates(times) -> list[dict]:
    """Every timed candidate with its per-shape microseconds, so a later reading can ask why a config lost
    (the rows keep only what the table picks)."""
    return [{"bits": bits, "M": m, "path": path, "config": json.loads(cfg),
             "us": {f"{n}x{k}": round(t, 2) for (n, k), t in sorted(per.items())}}
            for (bits, m, path, cfg), per in sorted(times.items())]


def _rows(table, times, cublas, dry):
    """Per bits, shape and M: the time of the configuration the table picks."""
    rows = []
    for bits in BITS:
        for n, k in SHAPES:
            for m in sorted(set(DECODE_MS) | set(GEMM_MS)):
                path = "decode" if m <= T.decode_max_m(table, bits) else "gemm"
                cfg = T._bucket(table[path], bits, m)
                if path == "gemm" and cfg.get("impl") == "dense":
                    path = "dense"
                per = times.get((bits, m, path, json.dumps(cfg, sort_keys=True)), {})
                if (n, k) not in per:
                    continue
                rows.append({"op": "mm_int_weight", "format": f"W{bits} g{GROUP} asym", "N": n, "K": k, "M": m,
                             "dtype": "float16", "path": path, "config": cfg, "qops_us": round(per[(n, k)], 2),
                             "cublas_fp16_us": None if (n, k, m) not in cublas else round(cublas[(n, k, m)], 2),
                             "roofline_us": round(roofline_us(n, k, m, bits), 2)})
    return rows


def _print_table(rows):
    print("bits N x K M path | qops_us cublas_us | x cuBLAS | % roofline")
    for r in rows:
        if r["M"] not in (1, 2, 4, 16, 64, 256, 2048):
            continue
        cb = r["cublas_fp16_us"]
        speed = f"{cb / r['qops_us']:.2f}x" if cb else "-"
        roof = f"{100 * r['roofline_us'] / r['qops_us']:.0f}%" if r["M"] <= 16 else "-"
        print(f"{r['format'][:2]} {r['N']}x{r['K']} {r['M']} {r['path']} | {r['qops_us']} {cb} | {speed} | {roof}")


if __name__ == "__main__":
    main()
