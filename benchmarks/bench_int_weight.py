"""W4A16 g128 benchmark of ``torch.ops.qops.mm_int_weight`` against cuBLAS, torch int4 and gemlite.

One run on one GPU measures everything side by side with one method (PERF.md, "How to time"):

- the two ceilings: device-to-device copy bandwidth (2 GiB buffer) and bf16 dense matmul 8192^3;
- per shape (N x K) a GPTQ v2 checkpoint, 4 bits, group 128, asymmetric, from one random fp16
  weight, prepared for fp16 activations; every qops lowering that exists and can serve it is forced
  through ``dataclasses.replace(weight, kernel=...)``;
- correctness first, per (shape, M, lowering): functional op and ``mm_int_weight_out`` (its ``out``
  poisoned with NaN) against a float64 reference decoded from the checkpoint tensors by a second,
  independent 4-bit decoder here; torch int4 and gemlite once per shape;
- time: CUDA-graph replays of calls over rotated weight copies (> 256 MB in all, so the 60 MB L2
  cannot hold the weight), CUDA events, median of trials;
- roofline per row: max(W4 bytes / copy bandwidth, 2*M*N*K / bf16 peak).

Writes ``$OUT/bench_int_weight.json`` (when ``$OUT`` is set) and ``--out``; prints the rows as
they come, then a compact table and a TARGETS block (PERF.md "Targets for qops on the H200").

    PYTHONPATH=. python benchmarks/bench_int_weight.py                 # full run (~3-5 min, H200)
    PYTHONPATH=. python benchmarks/bench_int_weight.py --quick
    PYTHONPATH=. python benchmarks/bench_int_weight.py --shapes 4096x4096 --ms 1,16
    PYTHONPATH=. python benchmarks/bench_int_weight.py --dry-run --out /tmp/b.json   # CPU, no GPU

See benchmarks/README.md for the fields.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]  # (N, K)
LARGE_SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]  # PERF.md's "four large shapes"
MS = [1, 4, 16, 64, 256, 2048]
QUICK_SHAPES = [(4096, 4096), (57344, 8192)]
QUICK_MS = [1, 16, 64, 2048]
DRY_SHAPES = [(256, 256), (384, 512)]
DRY_MS = [1, 4, 16]

BITS, GROUP = 4, 128
LOWERINGS = ("triton_int_weight", "native_w4a16")
ROT_BYTES = 288 * 2**20  # weight copies rotated per timed graph: > 256 MB in all
MAX_COPIES = 64
COPY_BYTES = 2**30  # copy-bandwidth buffer: 1 GiB source + 1 GiB destination
# PERF.md's measured ceilings, used only by --dry-run (no GPU to measure them on).
PERF_COPY_TBPS, PERF_BF16_TFLOPS = 4.25, 810.0

# PERF.md "Targets for qops on the H200", W4A16 rows.
M1_ROOF_PCT = {"native_w4a16": 85.0, "triton_int_weight": 70.0}
SMALL_M_MAX_VS_M1 = 1.2
SMALL_M_MIN_SPEEDUP = 2.5
M64_MIN_SPEEDUP = 2.0
M2048_MIN_SPEEDUP = 0.8


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench_int_weight.py",
        description="Time torch.ops.qops.mm_int_weight (GPTQ W4 g128 asym, fp16 activations) per lowering "
        "against cuBLAS fp16/bf16, torch int4 (_weight_int4pack_mm) and gemlite A16W4, with rooflines "
        "measured in the same run. Writes JSON to $OUT/bench_int_weight.json and --out.",
    )
    p.add_argument("--shapes", help="comma-separated NxK (N = out_features, K = in_features); default: the five of PERF.md")
    p.add_argument("--ms", help="comma-separated batch sizes M; default: 1,4,16,64,256,2048")
    p.add_argument("--quick", action="store_true",
                   help=f"fewer trials, shorter trials, and (unless --shapes/--ms are given) shapes "
                        f"{fmt_shapes(QUICK_SHAPES)} and M {','.join(map(str, QUICK_MS))}")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only: tiny shapes, the reference lowering, wall-clock timings that mean nothing, "
                        "PERF.md's ceilings instead of measured ones; checks the plumbing (JSON, table, targets)")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--table-out", help="also write the final table and TARGETS block here "
                                      "(default: $OUT/bench_int_weight.txt when $OUT is set)")
    p.add_argument("--lowerings", help=f"comma-separated qops lowerings to force (default: {','.join(LOWERINGS)}; "
                                      "--dry-run: reference_int_weight); missing or refused ones are skipped with the reason")
    p.add_argument("--trials", type=int, help="timed trials per measurement, median taken (default 5, --quick 3)")
    p.add_argument("--target-ms", type=float, help="GPU time per trial; sets graph replays per trial (default 15, --quick 5)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop starting new (shape, M) measurements after this many seconds and report what was done (default 300)")
    p.add_argument("--tol", type=float, default=1e-2, help="largest relative Frobenius error counted correct (default 1e-2)")
    p.add_argument("--no-gemlite", action="store_true", help="skip gemlite even when importable")
    p.add_argument("--no-torch-int4", action="store_true", help="skip torch's _weight_int4pack_mm")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.shapes:
        a.shape_list = parse_shapes(a.shapes, p)
    else:
        a.shape_list = DRY_SHAPES if a.dry_run else QUICK_SHAPES if a.quick else SHAPES
    if a.ms:
        try:
            a.m_list = [int(m) for m in a.ms.split(",") if m.strip()]
        except ValueError:
            p.error(f"--ms: expected comma-separated integers, got {a.ms!r}")
        if not a.m_list or min(a.m_list) < 1:
            p.error("--ms: batch sizes must be >= 1")
    else:
        a.m_list = DRY_MS if a.dry_run else QUICK_MS if a.quick else MS
    a.lowering_list = [s.strip() for s in a.lowerings.split(",") if s.strip()] if a.lowerings else (
        ["reference_int_weight"] if a.dry_run else list(LOWERINGS))
    a.trials = a.trials or (3 if a.quick or a.dry_run else 5)
    a.target_ms = a.target_ms or (5.0 if a.quick or a.dry_run else 15.0)
    return a


def parse_shapes(text, parser):
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            n, k = (int(v) for v in item.split("x"))
        except ValueError:
            parser.error(f"--shapes: expected NxK items like 4096x14336, got {item!r}")
        if n % 8 or k % GROUP:
            parser.error(f"--shapes: {item}: N must be a multiple of 8 and K of {GROUP}")
        shapes.append((n, k))
    if not shapes:
        parser.error("--shapes: no shape given")
    return shapes


def fmt_shapes(shapes):
    return ",".join(f"{n}x{k}" for n, k in shapes)


# ---------------------------------------------------------------------------------------------
# Timing


def n_copies(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` make the rotation exceed 256 MB."""
    return max(1, min(MAX_COPIES, math.ceil(ROT_BYTES / max(nbytes, 1))))


def cuda_graph_time(fns, trials: int, target_ms: float) -> tuple[float, dict]:
    """Median microseconds per call of ``fns`` (one zero-arg callable per weight copy).

    Eager warm-up on a side stream (compiles, autotunes), one CUDA graph holding one call per copy,
    replays per trial chosen from a first timed replay so a trial lasts about ``target_ms``.
    """
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
        fns[0]()
        fns[0]()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    est_ms = max(a.elapsed_time(b), 1e-3)
    iters = max(1, min(2000, round(target_ms / est_ms)))
    ts = []
    for _ in range(trials):
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / iters / len(fns))
    del g
    med = statistics.median(ts)
    return med, {"copies": len(fns), "replays": iters, "trials": trials,
                 "spread_pct": round(100 * (max(ts) - min(ts)) / med, 1) if med > 0 else None}


def cpu_wall_time(fns, trials: int, target_ms: float) -> tuple[float, dict]:
    """--dry-run stand-in: wall-clock microseconds on the CPU (meaningless as a benchmark)."""
    for f in fns[:2]:
        f()
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for f in fns:
            f()
        ts.append((time.perf_counter() - t0) * 1e6 / len(fns))
    return statistics.median(ts), {"copies": len(fns), "replays": 1, "trials": trials, "cpu_wall_clock": True}


def measure_copy_TBps(trials: int) -> float:
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    iters, bws = 10, []
    for _ in range(trials):
        a.record()
        for _ in range(iters):
            dst.copy_(src)
        b.record()
        b.synchronize()
        bws.append(2 * COPY_BYTES * iters / (a.elapsed_time(b) / 1e3) / 1e12)  # read + write
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(bws)


def measure_bf16_TFLOPs(trials: int, target_ms: float) -> float:
    import torch

    A = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    B = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_us, _ = cuda_graph_time([lambda: A @ B], trials, max(target_ms, 20.0))
    A = B = None  # noqa: F841  (frees them; not `del`: the lambda holds the cells)
    torch.cuda.empty_cache()
    return 2 * 8192**3 / (t_us * 1e-6) / 1e12


# ---------------------------------------------------------------------------------------------
# Weights, references and the competitors


def decode_gptq4_f64(ckpt):
    """Float64 ``(K, N)`` weight of a 4-bit GPTQ checkpoint, decoded here without qops' unpacking.

    qweight ``(K/8, N)``: nibble i of word r is row 8r+i; qzeros ``(n_groups, N/8)``: nibble i of word
    c is column 8c+i, v2 stores the zero itself (v1: zero - 1); ``W[k, n] = s[g, n] * (q[k, n] - z[g, n])``.
    """
    import torch

    assert ckpt.bits == 4 and ckpt.group_size > 0, "decoder handles 4-bit grouped checkpoints only"
    K, N, G = ckpt.in_features, ckpt.out_features, ckpt.group_size
    ng = K // G
    dev = ckpt.qweight.device
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=dev)
    q = ((ckpt.qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(K, N)
    z = ((ckpt.qzeros.unsqueeze(-1) >> shifts) & 15).reshape(ng, -1)[:, :N].double()
    if ckpt.version == "v1":
        z = z + 1
    w = q.view(ng, G, N).double()
    del q
    w.sub_(z.view(ng, 1, N)).mul_(ckpt.scales.double().view(ng, 1, N))
    return w.view(K, N)


def rel_err(got, ref) -> float | None:
    """Relative Frobenius error in float64; None when the output holds NaN or Inf."""
    import torch

    g = got.double()
    if not bool(torch.isfinite(g).all()):
        return None
    den = ref.norm().item()
    return (g - ref).norm().item() / den if den else (g - ref).norm().item()


def short_err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def is_fatal_cuda(e: BaseException) -> bool:
    s = str(e)
    return any(t in s for t in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                "CUDA error: an illegal", "misaligned address"))


def weight_spec(cls, *, N, K, act_order, symmetric, device, act_dtype):
    """The chooser's WeightSpec for this benchmark's weight, or None if its fields changed beyond these."""
    known = dict(family="int_weight", format="gptq", bits=BITS, group_size=GROUP, n=N, k=K,
                 act_order=act_order, symmetric=symmetric, device=device, act_dtype=act_dtype)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items() if n not in known
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        print(f"WeightSpec has new required fields {missing}: usability checked by device only", flush=True)
        return None
    return cls(**{k: v for k, v in known.items() if k in fields})


def lowering_status(name, spec, device):
    """(Lowering or None, reason why not usable or None)."""
    from qops import lowerings as L

    low = L.LOWERINGS_BY_NAME.get(name)
    if low is None:
        return None, f"not in qops.lowerings.LOWERINGS_BY_NAME (known: {sorted(L.LOWERINGS_BY_NAME)})"
    try:
        why = low.refusal(spec) if spec is not None else low.device_refusal(device)
    except Exception as e:  # noqa: BLE001 - e.g. QOPS_DISABLE_LOWERINGS naming unknown lowerings
        return None, short_err(e)
    return (low, None) if why is None else (None, why)


def workspace_for(iw, x):
    """A caller-owned workspace when qops declares a size for it, else None (the op allocates its own)."""
    import torch

    for mod_name in ("qops.ops.int_weight", "qops.workspace", "qops.scratch"):
        try:
            mod = __import__(mod_name, fromlist=["_"])
        except Exception:  # noqa: BLE001
            continue
        for fn_name in ("workspace_nbytes", "workspace_bytes", "int_weight_workspace_nbytes"):
            fn = getattr(mod, fn_name, None)
            if callable(fn):
                try:
                    nbytes = int(fn(iw, x.shape[0]) if fn_name != "int_weight_workspace_nbytes" else fn(iw, x))
                except Exception:  # noqa: BLE001 - unknown signature: let the op allocate
                    return None, "declared-size helper not understood; None passed"
                return torch.full((max(nbytes, 1),), 0xAB, dtype=torch.uint8, device=x.device), f"{mod_name}.{fn_name}"
    return None, "None (no declared workspace size found; the lowering allocates)"


def check_out_variant(iw, x, ref, workspace):
    import torch

    out = torch.full((x.shape[0], iw.out_features), float("nan"), dtype=x.dtype, device=x.device)
    torch.ops.qops.mm_int_weight_out(
        x, iw.qweight, iw.scales, iw.qzeros, iw.act_perm, None,
        iw.in_features, iw.bits, iw.group_size, iw.zero_offset, int(iw.kernel), out, workspace)
    return rel_err(out, ref)


def copy_int_weight(iw):
    return dataclasses.replace(
        iw,
        qweight=iw.qweight.clone(),
        scales=iw.scales.clone(),
        qzeros=None if iw.qzeros is None else iw.qzeros.clone(),
        act_perm=None if iw.act_perm is None else iw.act_perm.clone(),
    )


def load_gemlite(device_type: str):
    """(module, status). gemlite probes the GPU at import, so only try on CUDA."""
    if device_type != "cuda":
        return None, "skipped: gemlite needs a CUDA device to import"
    site = os.path.join(ROOT, ".whl", "site")
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)
    try:
        import gemlite
        from gemlite import GemLiteLinear
    except Exception as e:  # noqa: BLE001
        return None, f"not importable: {short_err(e)}"
    cfg = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    try:
        loaded = GemLiteLinear.load_config(cfg)
    except Exception as e:  # noqa: BLE001
        loaded = f"failed: {short_err(e)}"
    ver = getattr(gemlite, "__version__", "unknown")
    return gemlite, f"gemlite {ver} from {os.path.dirname(gemlite.__file__)}; h100.json config loaded: {loaded}"


# ---------------------------------------------------------------------------------------------
# Metadata


def qops_commit() -> tuple[str | None, bool | None]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            st = subprocess.run(["git", "status", "--porcelain", "--", "qops"], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return head.stdout.strip(), bool(st.stdout.strip()) if st.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git on the GPU machine
        pass
    return os.environ.get("QOPS_COMMIT") or None, None


def qops_source_sha256() -> str:
    """Hash of qops/**/*.py and tuned-config JSON: identifies the code even without git."""
    h = hashlib.sha256()
    base = os.path.join(ROOT, "qops")
    for d, dirs, files in sorted(os.walk(base)):
        dirs.sort()
        for f in sorted(files):
            if f.endswith((".py", ".json", ".cu", ".cuh")):
                p = os.path.join(d, f)
                h.update(os.path.relpath(p, base).encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


def clean(o):
    """JSON-safe: non-finite floats become None."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    return o


def write_json(res, paths):
    for path in paths:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(clean(res), fh, indent=1)
        os.replace(tmp, path)


def r2(v, nd=2):
    return None if v is None else round(v, nd)


# ---------------------------------------------------------------------------------------------
# The run


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    t_start = time.time()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("bench_int_weight: no CUDA device; use --dry-run to check the plumbing on CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if dry else torch.device("cuda")
    timer = cpu_wall_time if dry else cuda_graph_time
    global MAX_COPIES
    if dry:
        MAX_COPIES = 2  # no cache to defeat on the CPU; keeps the dry run short

    import qops  # noqa: F401  (registers torch.ops.qops.*)
    from qops.formats import FORMATS
    from qops.lowerings import WeightSpec

    torch.manual_seed(args.seed)
    try:
        import triton
        triton_ver = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_ver = f"not importable ({short_err(e)})"
    commit, dirty = qops_commit()
    res = {
        "gpu": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_ver,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "qops_commit": commit,
        "qops_dirty": dirty,
        "qops_source_sha256": qops_source_sha256(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": dry,
        "args": {k: v for k, v in vars(args).items() if k not in ("shape_list", "m_list", "lowering_list")}
        | {"shapes": fmt_shapes(args.shape_list), "ms": args.m_list, "lowerings": args.lowering_list},
        "method": {
            "timing": "cpu wall clock (dry run; meaningless)" if dry else
            "CUDA-graph replays (one call per rotated weight copy), CUDA events, median of trials",
            "rotation_bytes_min": ROT_BYTES, "max_copies": 2 if dry else MAX_COPIES,
            "roofline": f"max((N*K/2 + 4*N*K/{GROUP} + 2*M*(N+K)) B / copy_TBps, 2*M*N*K / bf16_TFLOPs)",
            "reference": "float64, decoded from the GPTQ checkpoint tensors independently of qops",
            "x": "torch.randn(M, K) fp16 (bf16 copy for cuBLAS bf16 and torch int4)",
            "tol": args.tol,
        },
    }
    out_paths = []
    if os.environ.get("OUT"):
        out_paths.append(os.path.join(os.environ["OUT"], "bench_int_weight.json"))
    if args.out:
        out_paths.append(args.out)
    if not out_paths:
        out_paths.append(os.path.join(os.getcwd(), "bench_int_weight.json"))
    table_path = args.table_out or (os.path.join(os.environ["OUT"], "bench_int_weight.txt") if os.environ.get("OUT") else None)
    print(json.dumps({k: res[k] for k in ("gpu", "torch", "triton", "cuda", "qops_commit", "qops_source_sha256", "date")}), flush=True)

    # Ceilings
    if dry:
        copy_bw, bf16_tf = PERF_COPY_TBPS, PERF_BF16_TFLOPS
        res["ceilings_note"] = "dry run: PERF.md's H200 values, not measured"
    else:
        copy_bw = measure_copy_TBps(args.trials)
        print(f"copy bandwidth (read+write, 2 GiB) {copy_bw:.3f} TB/s", flush=True)
        bf16_tf = measure_bf16_TFLOPs(args.trials, args.target_ms)
        print(f"bf16 8192^3 {bf16_tf:.0f} TFLOP/s", flush=True)
    res["copy_TBps"] = round(copy_bw, 4)
    res["bf16_TFLOPs"] = round(bf16_tf, 1)

    gemlite_mod, gemlite_status = (None, "disabled by --no-gemlite") if args.no_gemlite else load_gemlite(dev.type)
    res["gemlite"] = gemlite_status
    print(f"gemlite: {gemlite_status}", flush=True)

    rows, shape_info, skipped = [], [], []
    res["rows"], res["shapes"], res["skipped"] = rows, shape_info, skipped
    fatal = None
    fmt = FORMATS["gptq"]

    for si, (N, K) in enumerate(args.shape_list):
        if fatal:
            skipped.append({"N": N, "K": K, "M": None, "why": f"after fatal CUDA error: {fatal}"})
            continue
        if time.time() - t_start > args.budget_s:
            skipped.append({"N": N, "K": K, "M": None, "why": f"time budget {args.budget_s:.0f}s spent"})
            print(f"[budget] skipping {N}x{K}", flush=True)
            continue
        t_shape = time.time()
        info = {"N": N, "K": K}
        shape_info.append(info)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        w = torch.randn(N, K, dtype=torch.float16, device=dev) * 0.02
        ckpt = fmt.quantize(w, bits=BITS, group_size=GROUP, sym=False)
        iw = fmt.prepare(ckpt, dtype=torch.float16)
        info["default_lowering"] = iw.choice.lowering.name if iw.choice else None
        info["choice"] = iw.choice.explain() if iw.choice else None
        W64 = decode_gptq4_f64(ckpt)  # (K, N)
        iq = fmt.unpack(ckpt)
        q, zr, sc = iq.q, iq.zeros, iq.scales  # (N, K) uint8, (N, K/G) int32, (N, K/G) fp16
        spec = weight_spec(WeightSpec, N=N, K=K, act_order=iw.act_perm is not None,
                           symmetric=iw.qzeros is None, device=dev, act_dtype=torch.float16)

        # qops lowerings, forced
        variants, lowering_notes = {}, {}
        for name in args.lowering_list:
            low, why = lowering_status(name, spec, dev)
            if low is None:
                lowering_notes[name] = f"skipped: {why}"
                continue
            base = dataclasses.replace(iw, kernel=low.kernel)
            variants[name] = [base] + [copy_int_weight(base) for _ in range(n_copies(base.nbytes()) - 1)]
            lowering_notes[name] = f"forced kernel={int(low.kernel)}, {len(variants[name])} copies"
        info["lowerings"] = lowering_notes
        broken = {}  # lowering -> error that stops it for this shape

        # peers
        peers = {}
        nb16 = N * K * 2
        w16s = [w] + [w.clone() for _ in range(n_copies(nb16) - 1)]
        wb = w.to(torch.bfloat16)
        wbs = [wb] + [wb.clone() for _ in range(n_copies(nb16) - 1)]
        peers["cublas_fp16"] = lambda x, xb: [lambda wi=wi: F.linear(x, wi) for wi in w16s]
        peers["cublas_bf16"] = lambda x, xb: [lambda wi=wi: F.linear(xb, wi) for wi in wbs]
        peer_notes = {}
        if args.no_torch_int4:
            peer_notes["torch_int4"] = "disabled by --no-torch-int4"
        elif dev.type != "cuda":
            peer_notes["torch_int4"] = "skipped: CUDA packing only (dry run)"
        else:
            try:
                packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
                tg = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
                # tinygemm: w = (q - 8) * scale + zero_point; ours: w = (q - z) * s  =>  zero_point = (8 - z) * s
                scf = sc.float()
                sz = torch.stack([scf, (8 - zr.float()) * scf], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
                del packed_u8, scf
                xt = torch.randn(16, K, dtype=torch.bfloat16, device=dev)
                e = rel_err(torch.ops.aten._weight_int4pack_mm(xt, tg, GROUP, sz), xt.double() @ W64)
                info["torch_int4_rel_err"] = e
                print(f"  torch int4 rel err {e}", flush=True)
                nb4 = tg.numel() * tg.element_size() + sz.numel() * sz.element_size()
                tgs = [(tg, sz)] + [(tg.clone(), sz.clone()) for _ in range(n_copies(nb4) - 1)]
                peers["torch_int4"] = lambda x, xb: [lambda p=p: torch.ops.aten._weight_int4pack_mm(xb, p[0], GROUP, p[1]) for p in tgs]
                peer_notes["torch_int4"] = f"_weight_int4pack_mm, bf16 activations, innerKTiles 8, {len(tgs)} copies"
            except Exception as e:  # noqa: BLE001
                peer_notes["torch_int4"] = f"failed: {short_err(e)}"
                fatal = fatal or (short_err(e) if is_fatal_cuda(e) else None)
        if gemlite_mod is None:
            peer_notes["gemlite"] = gemlite_status
        elif not fatal:
            try:
                from gemlite import DType, GemLiteLinear

                def make_gl():
                    gl = GemLiteLinear(BITS, group_size=GROUP, in_features=K, out_features=N,
                                       input_dtype=DType.FP16, output_dtype=DType.FP16)
                    gl.pack(q, sc.half(), zr.half(), None)
                    return gl

                gls = [make_gl()]
                xt = torch.randn(16, K, dtype=torch.float16, device=dev)
                e = rel_err(gls[0](xt), xt.double() @ W64)
                info["gemlite_rel_err"] = e
                print(f"  gemlite rel err {e}", flush=True)
                try:
                    nbg = sum(t.numel() * t.element_size() for t in gls[0].get_tensor_args() if isinstance(t, torch.Tensor))
                except Exception:  # noqa: BLE001 - gemlite internals changed: count the packed nibbles
                    nbg = N * K // 2
                gls += [make_gl() for _ in range(n_copies(nbg) - 1)]
                peers["gemlite"] = lambda x, xb: [lambda gl=gl: gl(x) for gl in gls]
                peer_notes["gemlite"] = f"GemLiteLinear A16W4 g{GROUP}, fp16, {len(gls)} copies"
            except Exception as e:  # noqa: BLE001
                peer_notes["gemlite"] = f"failed: {short_err(e)}"
                fatal = fatal or (short_err(e) if is_fatal_cuda(e) else None)
        info["peers"] = peer_notes
        print(f"== {N}x{K}: default lowering {info['default_lowering']}; {lowering_notes}; {peer_notes}", flush=True)

        for M in args.m_list:
            if fatal:
                skipped.append({"N": N, "K": K, "M": M, "why": f"after fatal CUDA error: {fatal}"})
                continue
            if time.time() - t_start > args.budget_s:
                skipped.append({"N": N, "K": K, "M": M, "why": f"time budget {args.budget_s:.0f}s spent"})
                print(f"[budget] skipping {N}x{K} M={M}", flush=True)
                continue
            x = torch.randn(M, K, dtype=torch.float16, device=dev)
            xb = x.to(torch.bfloat16)
            ref = x.double() @ W64
            wbytes = N * K / 2 + 4 * N * K / GROUP + 2 * M * (N + K)
            roof_us = max(wbytes / (copy_bw * 1e12) * 1e6, 2 * M * N * K / (bf16_tf * 1e12) * 1e6)

            peer_us, timing = {}, {}
            for pname in ("cublas_fp16", "cublas_bf16", "torch_int4", "gemlite"):
                if pname not in peers or fatal:
                    peer_us[pname] = None
                    continue
                try:
                    peer_us[pname], timing[pname] = timer(peers[pname](x, xb), args.trials, args.target_ms)
                except Exception as e:  # noqa: BLE001
                    peer_us[pname] = None
                    timing[pname] = {"error": short_err(e)}
                    print(f"  {pname} {N}x{K} M={M} failed: {short_err(e)}", flush=True)
                    if is_fatal_cuda(e):
                        fatal = short_err(e)

            row_base = {"op": "mm_int_weight", "format": "gptq", "bits": BITS, "group_size": GROUP,
                        "N": N, "K": K, "M": M, "dtype": "float16"}
            peer_fields = {"cublas_fp16_us": r2(peer_us["cublas_fp16"]), "cublas_bf16_us": r2(peer_us["cublas_bf16"]),
                           "torch_int4_us": r2(peer_us["torch_int4"]), "gemlite_us": r2(peer_us["gemlite"]),
                           "roofline_us": r2(roof_us, 3)}
            names = list(variants) or [None]
            for name in names:
                timing.pop("qops", None)
                row = dict(row_base, lowering=name, qops_us=None, **peer_fields,
                           pct_roofline=None, speedup_vs_fp16=None, rel_err=None)
                if name is None:
                    row["error"] = "no qops lowering usable: " + "; ".join(f"{k}: {v}" for k, v in lowering_notes.items())
                elif name in broken:
                    row["error"] = broken[name]
                elif not fatal:
                    copies = variants[name]
                    try:
                        row["rel_err"] = rel_err(copies[0].mm(x), ref)
                        ws, ws_note = workspace_for(copies[0], x)
                        row["rel_err_out"] = check_out_variant(copies[0], x, ref, ws)
                        row["workspace"] = ws_note
                        del ws
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"correctness call failed: {short_err(e)}"
                        broken[name] = row["error"]
                        if is_fatal_cuda(e):
                            fatal = short_err(e)
                        traceback.print_exc()
                    if "error" not in row:
                        ok = all(v is not None and v <= args.tol for v in (row["rel_err"], row["rel_err_out"]))
                        row["correct"] = ok
                        try:
                            t, tinfo = timer([lambda c=c: c.mm(x) for c in copies], args.trials, args.target_ms)
                            row["qops_us"] = r2(t)
                            timing["qops"] = tinfo
                            row["pct_roofline"] = r2(100 * roof_us / t, 1)
                            if peer_us["cublas_fp16"]:
                                row["speedup_vs_fp16"] = r2(peer_us["cublas_fp16"] / t, 3)
                        except Exception as e:  # noqa: BLE001
                            row["error"] = f"timing failed: {short_err(e)}"
                            if is_fatal_cuda(e):
                                fatal = short_err(e)
                row["timing"] = dict(timing)
                rows.append(row)
                print(json.dumps(clean({k: v for k, v in row.items() if k != "timing"})), flush=True)
            x = xb = ref = None
        info["seconds"] = round(time.time() - t_shape, 1)
        if dev.type == "cuda":
            info["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        # free everything of this shape before the next
        w = ckpt = iw = W64 = iq = q = zr = sc = variants = peers = w16s = wbs = wb = None  # noqa: F841
        tg = sz = tgs = gls = xt = None  # noqa: F841
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        res["elapsed_s"] = round(time.time() - t_start, 1)
        write_json(res, out_paths)

    res["elapsed_s"] = round(time.time() - t_start, 1)
    res["fatal"] = fatal
    targets = render_targets(rows, args, skipped)
    text = render_table(rows, args) + "\n" + targets
    res["targets"] = [t.strip() for t in targets.splitlines()[1:]]
    write_json(res, out_paths)
    print(f"\nJSON: {', '.join(out_paths)}  ({len(rows)} rows, {res['elapsed_s']}s)", flush=True)
    if table_path:
        with open(table_path, "w") as fh:
            fh.write(text + "\n")
    print(text, flush=True)
    return 3 if fatal else 0


# ---------------------------------------------------------------------------------------------
# Reporting


def _short(name):
    return "none" if name is None else name.split("_")[0]


def _f(v, nd=1):
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if v < 1000 else f"{v:.0f}"


def render_table(rows, args) -> str:
    lows = []
    for r in rows:
        if r["lowering"] not in lows:
            lows.append(r["lowering"])
    by = {}
    for r in rows:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["lowering"]] = r
    head = f"{'N x K':>11} {'M':>5} |"
    for l in lows:
        head += f" {_short(l)[:7]:>7} {'%roof':>5} {'xfp16':>5} |"
    head += f" {'fp16':>7} {'bf16':>7} {'int4':>7} {'gemlite':>7} | {'roof':>6}"
    lines = ["", "qops mm_int_weight, GPTQ W4 g128 asym, fp16 activations: microseconds (lower is better);"
             " %roof = roofline / qops; xfp16 = cuBLAS fp16 / qops; '!' = failed correctness, 'E' = error", head,
             "-" * len(head)]
    for (N, K, M), d in by.items():
        any_r = next(iter(d.values()))
        line = f"{f'{N}x{K}':>11} {M:>5} |"
        for l in lows:
            r = d.get(l)
            if r is None:
                line += f" {'':>7} {'':>5} {'':>5} |"
                continue
            mark = "E" if r.get("error") else ("!" if r.get("correct") is False else "")
            us = _f(r["qops_us"]) + mark
            pct = "-" if r["pct_roofline"] is None else f"{r['pct_roofline']:.0f}%"
            sp = "-" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:.2f}"
            line += f" {us:>7} {pct:>5} {sp:>5} |"
        line += (f" {_f(any_r['cublas_fp16_us']):>7} {_f(any_r['cublas_bf16_us']):>7} {_f(any_r['torch_int4_us']):>7}"
                 f" {_f(any_r['gemlite_us']):>7} | {_f(any_r['roofline_us'], 2):>6}")
        lines.append(line)
    return "\n".join(lines)


def _verdict(results):
    """results: list of (ok, text). PASS when all ok, N/A when empty."""
    if not results:
        return "N/A "
    return "PASS" if all(ok for ok, _ in results) else "FAIL"


def render_targets(rows, args, skipped) -> str:
    out = ["TARGETS (PERF.md 'Targets for qops on the H200', W4A16 g128; ratios from this run)"]
    if getattr(args, "dry_run", False):
        out.append("  (dry run: CPU wall-clock numbers and tiny shapes -- verdicts are meaningless)")
    lows = [l for l in dict.fromkeys(r["lowering"] for r in rows) if l is not None]
    if not lows:
        out.append("  N/A  no qops lowering was measured")
    for low in lows:
        rs = [r for r in rows if r["lowering"] == low]
        by = {(r["N"], r["K"], r["M"]): r for r in rs}
        tag = f"[{low}]"

        def line(label, results, detail):
            out.append(f"  {_verdict(results)} {tag} {label}: {detail}")

        # correctness
        bad = [r for r in rs if r.get("error") or r.get("correct") is False]
        errs = [r["rel_err"] for r in rs if r.get("rel_err") is not None]
        line(f"correct (rel err <= {args.tol:g}, functional and out=)",
             [(not bad, "")] if rs else [],
             f"{len(rs) - len(bad)}/{len(rs)} rows ok, max rel err {max(errs):.2e}" if errs else f"{len(rs) - len(bad)}/{len(rs)} rows ok")

        # M = 1 roofline on the four large shapes
        thr = M1_ROOF_PCT.get(low, M1_ROOF_PCT["triton_int_weight"])
        res, parts = [], []
        for (N, K) in LARGE_SHAPES:
            r = by.get((N, K, 1))
            if r is None or r["pct_roofline"] is None:
                parts.append(f"{N}x{K} n/a")
                continue
            res.append((r["pct_roofline"] >= thr, ""))
            parts.append(f"{N}x{K} {r['pct_roofline']:.0f}%")
        line(f"M=1 >= {thr:.0f}% of roofline, four large shapes", res, ", ".join(parts))

        # M <= 16 within 1.2x of M = 1
        res, worst = [], None
        for (N, K, M), r in by.items():
            if M == 1 or M > 16 or r["qops_us"] is None:
                continue
            r1 = by.get((N, K, 1))
            if r1 is None or not r1["qops_us"]:
                continue
            ratio = r["qops_us"] / r1["qops_us"]
            res.append((ratio <= SMALL_M_MAX_VS_M1, ""))
            if worst is None or ratio > worst[0]:
                worst = (ratio, N, K, M)
        line(f"M<=16 time <= {SMALL_M_MAX_VS_M1}x the M=1 time", res,
             f"{sum(ok for ok, _ in res)}/{len(res)} ok, worst {worst[0]:.2f}x at {worst[1]}x{worst[2]} M={worst[3]}" if worst else "no M=1 and M in (1,16] pair")

        def speed_target(label, pred, minimum, how="min"):
            res, worst = [], None
            for (N, K, M), r in by.items():
                if not pred(M) or r["speedup_vs_fp16"] is None:
                    continue
                s = r["speedup_vs_fp16"]
                res.append((s >= minimum, ""))
                if worst is None or s < worst[0]:
                    worst = (s, N, K, M)
            line(label, res, f"{sum(ok for ok, _ in res)}/{len(res)} ok, worst {worst[0]:.2f}x at {worst[1]}x{worst[2]} M={worst[3]}" if worst else "not measured")

        speed_target(f"M<=16 >= {SMALL_M_MIN_SPEEDUP}x faster than cuBLAS fp16", lambda m: m <= 16, SMALL_M_MIN_SPEEDUP)
        speed_target(f"M=64 >= {M64_MIN_SPEEDUP}x faster than cuBLAS fp16", lambda m: m == 64, M64_MIN_SPEEDUP)
        speed_target(f"M=2048 >= {M2048_MIN_SPEEDUP}x cuBLAS fp16 throughput (stretch 1.0)", lambda m: m == 2048, M2048_MIN_SPEEDUP)

        for peer, key in (("torch int4", "torch_int4_us"), ("gemlite", "gemlite_us")):
            res, worst = [], None
            for (N, K, M), r in by.items():
                if r["qops_us"] is None or r[key] is None:
                    continue
                ratio = r[key] / r["qops_us"]  # > 1: qops faster
                res.append((ratio > 1.0, ""))
                if worst is None or ratio < worst[0]:
                    worst = (ratio, N, K, M)
            line(f"faster than {peer} at every M", res,
                 f"{sum(ok for ok, _ in res)}/{len(res)} ok, worst {worst[0]:.2f}x ({peer}/qops) at {worst[1]}x{worst[2]} M={worst[3]}" if worst else f"{peer} not measured")
    if skipped:
        out.append(f"  note: {len(skipped)} (shape, M) entries skipped: " + "; ".join(
            f"{s['N']}x{s['K']}{'' if s['M'] is None else ' M=' + str(s['M'])} ({s['why']})" for s in skipped[:6])
            + (" ..." if len(skipped) > 6 else ""))
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
