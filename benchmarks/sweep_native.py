"""Launch-plan sweep of the native W4A16 decode kernel (``qops/native/w4a16_gemv.cu``) on one GPU.

The kernel has knobs that only a measurement can set: warps along N (``nwn``), blocks splitting K
(``splits``) and how they meet (thread-block cluster or workspace), x staged once or per iteration
(``xfull``), the register ring depth (``ring``), the stages of the shared-memory weight ring
(``smem_ring``, x staged once only; 0 is the register ring) and the blocks per SM promised to the
register allocator (``minb``). For each (shape, M) this script times the plan
``qops.native.int_weight.plan`` picks today, then walks the knobs one at a time from it (coordinate
descent: keep a value when it is faster, twice over all knobs), every variant checked against a
float64 reference first. ``--joint`` first times every combination of a few knobs (for knobs that
only pay together, such as a deep ring, which leaves one block per SM, with a wider tile).
``cluster`` is a joint knob too (a split count of 2..8 summed in a thread-block cluster or through
the workspace); outside ``--joint`` a new split count is tried both ways. ``--confirm N`` times the
default and the N fastest plans of a case once more, their trials interleaved, and takes the best of
that round: the minimum over dozens of single timings is biased towards a lucky one (the plan table
``qops/native/plans/`` is built from confirmed cases, ``benchmarks/native_plan_table.py``).

Method as ``common.py`` (CUDA-graph replays over rotated weight copies > 256 MB, median of
trials). GPTQ v2, 4 bits, group 128, asymmetric, fp16 activations (``--dtype bfloat16``: bf16), as
bench_int_weight.py.

Writes ``$OUT/sweep_native.json`` (and ``--out``) after every case; prints per case the default
plan, the best plan found and their times, then a table last. qweight in 32-column slabs where N % 32 == 0
(what `prepare` gives this kernel; `--qweight-form flat`: the checkpoint-like form).

    PYTHONPATH=. python benchmarks/sweep_native.py                    # ~2-3 min on an H200
    PYTHONPATH=. python benchmarks/sweep_native.py --shapes 28672x4096 --ms 1
    PYTHONPATH=. python benchmarks/sweep_native.py --ms 24,32         # the MT = 3, 4 plans (one block per SM)

The shared-memory ring holds no chunk in registers, so it can run with three or four blocks per SM
promised (``minb`` 3, 4: <= 80 / 64 registers a thread). ``--values`` narrows a knob's values;
``--jobs`` compiles the ``--joint`` plans' kernels in parallel first:

    PYTHONPATH=. python benchmarks/sweep_native.py --ms 1 --joint smem_ring,minb,nwn \
        --values smem_ring=2,3,4 --values minb=2,3,4 --knobs splits --passes 1

At M = 17..32 (MT = 3, 4) the kernel needs one block per SM (minb = 1; minb = 2 would spill and
is refused), and the widest tile (nwn = 8) and a 3-deep ring are worth trying there.

    PYTHONPATH=. python benchmarks/sweep_native.py --shapes 28672x4096,4096x14336 --ms 1,8 \
        --joint smem_ring,nwn --knobs splits,smem_ring,minb,prefetch,fold   # the shared-memory ring
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import multiprocessing
import sys
import time

import torch

import common
from bench_int_weight import decode_gptq4_f64
from common import PERF_SHAPES, clone_tensors, n_copies, rel_err

KNOBS = ("prefetch", "fold", "xfull", "nwn", "splits", "ring", "minb", "smem_ring", "smem_bulk", "xu", "f16mma")
# smem_ring: 2 KiB + 384 bytes of scales and zeros a warp a stage; up to 5 stages two blocks fit on
# an H200 SM (<= 113 KiB a block with x), 6 and more take one block per SM, 11 is the most that fits.
# minb 3, 4 (<= 80, 64 registers a thread) only with the shared-memory ring (the register ring spills).
VALUES = {"nwn": (1, 2, 4, 8), "splits": (1, 2, 3, 4, 6, 8, 12, 16), "ring": (2, 3, 4, 5, 6, 8), "minb": (1, 2, 3, 4), "xfull": (True, False),
          "fold": (True, False), "prefetch": (0, 2, 4, 8), "smem_ring": (0, 2, 3, 4, 5, 6, 8, 10),
          "xu": (1, 2, 4, 8), "cluster": (True, False), "smem_bulk": (False, True), "f16mma": (False, True)}
# f16mma: bf16 x staged as f16 (a power of two a row) and f16 MMAs (x staged once; no effect on f16 x,
# where the sweep records both values as the same build).
# smem_bulk: the shared-memory ring filled by one bulk copy a warp's chunk (sm_90, qweight in slabs;
# the host refuses it otherwise, and the sweep records the refusal).
PLAN_KEYS = ("nwn", "splits", "cluster", "xfull", "ring", "minb", "fold", "prefetch", "smem_ring", "smem_bulk", "xu", "f16mma")
TOL = 2e-3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in PERF_SHAPES), help="N x K list")
    ap.add_argument("--ms", default="1,4,16", help="M values (<= 32: one launch each)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=4.0, help="length of one timed trial")
    ap.add_argument("--passes", type=int, default=2, help="rounds of coordinate descent over the knobs")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--knobs", default=",".join(KNOBS), help="the knobs to walk, comma-separated (default: all)")
    ap.add_argument("--joint", default="", help="knobs whose every combination is timed first, from the default plan; "
                    "the best starts the walk (e.g. smem_ring,nwn)")
    ap.add_argument("--values", action="append", default=[], metavar="KNOB=V1,V2",
                    help="the values tried for a knob instead of VALUES' (repeatable; booleans as 0/1)")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the --joint plans' kernels before timing (0: none)")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="activation dtype (default float16)")
    ap.add_argument("--confirm", type=int, default=0, metavar="N",
                    help="re-time the default and the N fastest plans of each case, their trials interleaved, and pick the best "
                         "of those (a sweep's minimum over many single timings favours a lucky one)")
    ap.add_argument("--confirm-trials", type=int, default=11, help="trials of each plan in the --confirm round")
    ap.add_argument("--qweight-form", choices=("slabs", "flat"), default="slabs",
                    help="qweight as the op gives it to this kernel (slabs: 32-column slabs where N %% 32 == 0, the default) or flat")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    return ap.parse_args(argv)


def candidate(native, base, m: int, n: int, k: int, cluster_ok: bool, smem_limit: int | None = None, **change):
    """``base`` with ``change`` applied, or None when the kernel cannot run it (``smem_limit``: the
    device's opt-in maximum of shared memory a block)."""
    f = {"nwn": base.nwn, "splits": base.splits, "xfull": base.xfull, "ring": base.ring, "minb": base.minb, "fold": base.fold,
         "prefetch": base.prefetch, "smem_ring": base.smem_ring, "xu": base.xu, "smem_bulk": base.smem_bulk, "f16mma": base.f16mma} | change
    if not f["xfull"]:
        f["fold"] = False  # folding needs x staged once
        f["smem_ring"] = 0  # and so does the shared-memory ring
        f["f16mma"] = False  # and the f16 staging of bf16 x
    bulk = f.pop("smem_bulk")
    if bulk and not f["smem_ring"]:  # a build-only field of the shared-memory ring
        return None
    if f["ring"] >= 4 and m > 8 and f["minb"] > 1:  # two blocks an SM: no registers for a 4-deep ring beside M > 8's accumulators
        return None
    if "cluster" in f:  # a joint knob: as asked, where the device and the split count allow it
        cluster = f.pop("cluster")
        if cluster and not (cluster_ok and 2 <= f["splits"] <= 8):
            return None
    else:
        cluster = cluster_ok and base.cluster and 2 <= f["splits"] <= 8  # a new split count is tried both ways by the caller
    try:
        return dataclasses.replace(native.make_plan(m, n, k, cluster=cluster, smem_limit=smem_limit, **f), smem_bulk=bulk)
    except ValueError:
        return None


def override_values(specs) -> None:
    """--values KNOB=V1,V2: replace VALUES[KNOB] (booleans given as 0/1)."""
    for spec in specs:
        knob, _, vals = spec.partition("=")
        if knob not in VALUES:
            raise SystemExit(f"sweep_native: unknown knob {knob!r} in --values (one of {', '.join(VALUES)})")
        cast = (lambda v: bool(int(v))) if isinstance(VALUES[knob][0], bool) else int
        VALUES[knob] = tuple(cast(v) for v in vals.split(",") if v)


def _compile_one(args) -> str | None:
    from qops.native import compiler
    source, arch, defines = args
    try:
        compiler.compile_cached(source, arch, compiler.native_options(defines))
    except Exception as e:  # noqa: BLE001 - the timing loop reports a plan that cannot build
        return f"{defines}: {common.short_err(e)}"
    return None


def precompile(native, plans, dtype, jobs: int) -> float:
    """Compile the kernels of ``plans`` into the disk cache in ``jobs`` processes (the timing loop then
    only loads them); returns the seconds it took."""
    from concurrent.futures import ProcessPoolExecutor

    from qops.native import compiler
    t0 = time.time()
    source, arch = compiler.native_source(native.SOURCE), compiler.device_arch(0)
    todo = {tuple(sorted(p.defines(dtype, True).items())) for p in plans}
    # spawn, not fork: the parent holds a CUDA context, which a forked child must not touch
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for err in ex.map(_compile_one, [(source, arch, dict(d)) for d in todo]):
            if err:
                print(f"  compile failed: {err}", flush=True)
    print(f"precompiled {len(todo)} kernels in {time.time() - t0:.1f} s with {jobs} processes", flush=True)
    return time.time() - t0


def key(p) -> tuple:
    return tuple(getattr(p, f) for f in PLAN_KEYS)


def run(args) -> int:
    if not torch.cuda.is_available():
        print("sweep_native: needs a CUDA device", file=sys.stderr)
        return 2
    import qops  # noqa: F401
    from qops.formats import FORMATS
    from qops.native import int_weight as native
    from qops.ops.int_weight import SLAB_COLUMNS, with_qweight_form

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    sms, cluster_ok = native._device_facts(0)
    smem_limit = native.smem_optin_bytes(0)
    copy_bw = common.copy_TBps(args.trials)
    res = {"gpu": common.device_name(True), "torch": torch.__version__, "qops_commit": common.git_commit(),
           "qops_dirty": common.git_dirty("qops"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "copy_TBps": round(copy_bw, 4), "sms": sms, "smem_optin": smem_limit, "joint": args.joint, "default_plans": native._env_plans(), "dtype": args.dtype, "qweight_form": args.qweight_form, "method": "CUDA-graph replays over rotated weight copies, median of trials",
           "cases": []}
    paths = common.output_paths("sweep_native.json", args.out)
    t0 = time.time()
    shapes = common.parse_shapes(args.shapes)
    ms = common.parse_ms(args.ms)
    override_values(args.values)
    joint = [kb for kb in args.joint.split(",") if kb]
    if joint and args.jobs > 0:
        plans = [native.plan(m, n, k, 0) for n, k in shapes for m in ms]
        plans += [c for n, k in shapes for m in ms for combo in itertools.product(*(VALUES[kb] for kb in joint))
                  if (c := candidate(native, native.plan(m, n, k, 0), m, n, k, cluster_ok, smem_limit, **dict(zip(joint, combo)))) is not None]
        res["precompile_s"] = round(precompile(native, plans, dtype, args.jobs), 1)
    if max(ms) > native.MAX_M:
        print(f"sweep_native: M <= {native.MAX_M} (one launch; larger M runs as slices of those plans)", file=sys.stderr)
        return 2
    fmt = FORMATS["gptq"]
    for n, k in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent; skipping {n}x{k}", flush=True)
            continue
        w = torch.randn(n, k, dtype=dtype, device=dev) * 0.02
        ckpt = fmt.quantize(w, bits=4, group_size=128, sym=False)
        del w
        iw = fmt.prepare(ckpt, dtype=dtype, choose_lowering=False)
        if args.qweight_form == "slabs" and n % SLAB_COLUMNS == 0:  # what prepare gives the native lowering
            iw = with_qweight_form(iw, "slabs")
        w64 = decode_gptq4_f64(ckpt)
        nbytes = n * k / 2 + 4 * n * k / 128
        copies = [iw] + [clone_tensors(iw) for _ in range(n_copies(nbytes) - 1)]
        for m in ms:
            if time.time() - t0 > args.budget_s:
                break
            x = torch.randn(m, k, dtype=dtype, device=dev)
            ref = x.double() @ w64
            out = torch.empty(m, n, dtype=dtype, device=dev)
            ws = torch.empty(16 * m * n * 4, dtype=torch.uint8, device=dev)
            roof_us = (nbytes + 2 * m * (n + k)) / (copy_bw * 1e12) * 1e6
            seen: dict[tuple, float | None] = {}
            plans: dict[tuple, object] = {}

            def call(c, p):
                with native.plan_override(lambda *a: p):
                    return native.native_mm(x, c.qweight, c.scales, c.qzeros, None, None, 4, 128, c.zero_offset, out=out, workspace=ws)

            def measure(p):
                kp = key(p)
                if kp in seen:
                    return seen[kp]
                plans[kp] = p
                try:
                    err = rel_err(call(iw, p), ref)
                    if err is None or err > TOL:
                        print(f"  WRONG {kp}: rel err {err}", flush=True)
                        seen[kp] = None
                        return None
                    t = common.graph_time([lambda c=c: call(c, p) for c in copies], args.trials, args.target_ms).us
                except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                    print(f"  FAILED {kp}: {common.short_err(e)}", flush=True)
                    seen[kp] = None
                    return None
                seen[kp] = t
                return t

            default = native.plan(m, n, k, 0)
            t_def = measure(default)
            best, t_best = default, t_def if t_def is not None else float("inf")
            for combo in itertools.product(*(VALUES[kb] for kb in joint)) if joint else ():
                c = candidate(native, default, m, n, k, cluster_ok, smem_limit, **dict(zip(joint, combo)))
                t = measure(c) if c is not None else None
                if t is not None and t < t_best:
                    best, t_best = c, t
            for _ in range(args.passes):
                for knob in [kb for kb in args.knobs.split(",") if kb]:
                    for v in VALUES[knob]:
                        c = candidate(native, best, m, n, k, cluster_ok, smem_limit, **{knob: v})
                        if c is None:
                            continue
                        if knob == "splits" and cluster_ok and 2 <= v <= 8:
                            for cl in (True, False):  # both reductions for a split count
                                cc = candidate(native, best, m, n, k, cluster_ok, smem_limit, splits=v, cluster=cl)
                                if cc is None:
                                    continue
                                t = measure(cc)
                                if t is not None and t < t_best:
                                    best, t_best = cc, t
                            continue
                        t = measure(c)
                        if t is not None and t < t_best:
                            best, t_best = c, t
            confirmed = None
            if args.confirm > 0 and t_def is not None:
                # The default and the fastest plans again, trials interleaved (common.graph_times).
                ranked = [kp for kp, t in sorted(((kp, t) for kp, t in seen.items() if t is not None), key=lambda e: e[1])]
                picks = [key(default)] + [kp for kp in ranked if kp != key(default)][:args.confirm]
                times = common.graph_times({kp: [lambda c=c, p=plans[kp]: call(c, p) for c in copies] for kp in picks},
                                           args.confirm_trials, args.target_ms)
                confirmed = [{"plan": dict(zip(PLAN_KEYS, kp)), "us": times[kp].us} for kp in picks]
                t_def = times[key(default)].us
                best_kp = min(picks, key=lambda kp: times[kp].us)
                best, t_best = plans[best_kp], times[best_kp].us
            case = {"N": n, "K": k, "M": m, "roofline_us": round(roof_us, 2),
                    "default": {"plan": dataclasses.asdict(default), "us": t_def,
                                "roof_pct": round(100 * roof_us / t_def, 1) if t_def else None},
                    "best": {"plan": dataclasses.asdict(best), "us": t_best,
                             "roof_pct": round(100 * roof_us / t_best, 1) if t_best < float("inf") else None},
                    "measured": [{"plan": dict(zip(PLAN_KEYS, kp)), "us": t} for kp, t in seen.items()]}
            if confirmed is not None:
                case["confirmed"] = confirmed
            res["cases"].append(case)
            common.write_json(res, paths)
            print(f"{n}x{k} M={m}: default {t_def} us ({case['default']['roof_pct']}%), best {t_best:.2f} us "
                  f"({case['best']['roof_pct']}%) {key(best)} of {len(seen)} plans", flush=True)
        del copies, iw, w64
        torch.cuda.empty_cache()

    print("\nN x K        M  roof_us  default_us (%)    best_us (%)  best plan " + str(PLAN_KEYS))
    for c in res["cases"]:
        print(f"{c['N']:>5}x{c['K']:<6} {c['M']:>2} {c['roofline_us']:>8.2f}  {c['default']['us'] or float('nan'):>8.2f} ({c['default']['roof_pct']})"
              f"  {c['best']['us']:>8.2f} ({c['best']['roof_pct']})  {key(native.Plan(**c['best']['plan']))}")
    return 0


def main(argv=None) -> int:
    common.add_repo_to_path()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
