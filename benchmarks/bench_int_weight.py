"""W4A16 g128 benchmark of ``torch.ops.qops.mm_int_weight`` against cuBLAS, torch int4 and gemlite.

One run on one GPU measures everything side by side with one method (PERF.md, "How to time"):

- the two ceilings: device-to-device copy bandwidth (2 GiB buffer) and bf16 dense matmul 8192^3;
- per shape (N x K) a GPTQ v2 checkpoint, 4 bits, group 128, asymmetric (``--symmetric``: symmetric, which
  runs without zero points as compressed-tensors W4A16 does), from one random fp16 weight,
  prepared for fp16 activations; every qops lowering that exists and can serve it is forced
  through ``dataclasses.replace(weight, kernel=...)``;
- correctness first, per (shape, M, lowering): functional op and ``mm_int_weight_out`` (its ``out``
  poisoned with NaN) against a float64 reference decoded from the checkpoint tensors by a second,
  independent 4-bit decoder here; torch int4 and gemlite once per shape;
- time: CUDA-graph replays of calls over rotated weight copies (> 256 MB in all, so the 50 MB L2
  cannot hold the weight), CUDA events, median of trials; every call starts after the previous one
  has finished (native launches without PDL: ``common.isolated_call``), and the native lowering is also
  timed with its PDL overlap between back-to-back calls (``qops_chained_us``);
- roofline per row: max(PERF.md's W4 bytes / copy bandwidth, 2*M*N*K / bf16 peak), the ceilings
  PERF.md's or this run's where higher (``common.ceilings``); ``pct_roofline_read`` is the same over
  the bytes the prepared weight really holds (4-bit zeros: ~2% fewer than PERF.md's formula);
- at M <= 16, ``read_floor_us``: a load-only launch over those bytes, timed with the candidates
  (read_floor.py), and ``pct_read_floor`` = read_floor_us / qops_us: what the kernel's own work costs
  beyond what any isolated launch reading that weight pays.

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
import gc
import hashlib
import json
import os
import sys
import time
import traceback

import torch

import common
from common import LARGE_SHAPES, ROOT, clone_tensors, n_copies, rel_err, short_err
from read_floor import LoadOnlyKernel, read_floor_callables

MS = [1, 4, 16, 64, 256, 2048]
QUICK_SHAPES = [(4096, 4096), (57344, 8192)]
QUICK_MS = [1, 16, 64, 2048]
DRY_SHAPES = [(256, 256), (384, 512)]
DRY_MS = [1, 4, 16]

BITS, GROUP = 4, 128
READ_FLOOR_MAX_M = 16  # the weight-bound rows, where a load-only launch over the weight's bytes is a floor
LOWERINGS = ("triton_int_weight", "native_w4a16")

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
    p.add_argument("--shapes", type=common.parse_shapes, help="comma-separated NxK (N = out_features, K = in_features); default: the five of PERF.md")
    p.add_argument("--ms", type=common.parse_ms, help="comma-separated batch sizes M; default: 1,4,16,64,256,2048")
    p.add_argument("--quick", action="store_true",
                   help=f"fewer trials, shorter trials, and (unless --shapes/--ms are given) shapes "
                        f"{','.join(common.shape_names(QUICK_SHAPES))} and M {','.join(map(str, QUICK_MS))}")
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
    p.add_argument("--symmetric", action="store_true",
                   help="symmetric weights: no zero points at run time (compressed-tensors W4A16), other kernel builds")
    p.add_argument("--no-gemlite", action="store_true", help="skip gemlite even when importable")
    p.add_argument("--no-torch-int4", action="store_true", help="skip torch's _weight_int4pack_mm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--triton-config", metavar="STEM",
                   help="run the Triton lowering on qops/ops/triton/configs/STEM.json instead of this GPU's own table "
                        "(e.g. 'h200' or 'default' on an H100: which table serves it better)")
    a = p.parse_args(argv)
    if a.triton_config is not None:
        from qops.ops.triton import int_weight as triton_int_weight

        known = triton_int_weight.config_stems()
        if a.triton_config not in known:
            p.error(f"--triton-config: no configs/{a.triton_config}.json (known: {', '.join(known)})")
    a.shape_list = a.shapes or (DRY_SHAPES if a.dry_run else QUICK_SHAPES if a.quick else common.PERF_SHAPES)
    for n, k in a.shape_list:
        if n % 8 or k % GROUP:  # the GPTQ packing: 8 nibbles per int32 along N, whole groups along K
            p.error(f"--shapes: {n}x{k}: N must be a multiple of 8 and K of {GROUP}")
    a.m_list = a.ms or (DRY_MS if a.dry_run else QUICK_MS if a.quick else MS)
    a.lowering_list = [s.strip() for s in a.lowerings.split(",") if s.strip()] if a.lowerings else (
        ["reference_int_weight"] if a.dry_run else list(LOWERINGS))
    a.trials = a.trials or (3 if a.quick or a.dry_run else 5)
    a.target_ms = a.target_ms or (5.0 if a.quick or a.dry_run else 15.0)
    return a


def decode_gptq4_f64(ckpt):
    """Float64 ``(K, N)`` weight of a 4-bit GPTQ checkpoint, decoded here without qops' unpacking.

    qweight ``(K/8, N)``: nibble i of word r is row 8r+i; qzeros ``(n_groups, N/8)``: nibble i of word
    c is column 8c+i, v2 stores the zero itself (v1: zero - 1); ``W[k, n] = s[g, n] * (q[k, n] - z[g, n])``.
    """
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


def is_fatal_cuda(e: BaseException) -> bool:
    s = str(e)
    return any(t in s for t in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                "CUDA error: an illegal", "misaligned address"))


def skip_reason(fatal: str | None, t_start: float, budget_s: float) -> str | None:
    """Why no new measurement may start: a fatal CUDA error poisons the context, and past the time
    budget the run must still leave time to write its JSON and table."""
    if fatal:
        return f"after fatal CUDA error: {fatal}"
    if time.time() - t_start > budget_s:
        return f"time budget {budget_s:.0f}s spent"
    return None


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


def workspace_for(name, iw, x):
    """The caller-owned workspace lowering ``name`` declares for ``x`` (``qops.workspace.SCRATCH_BYTES``), filled
    with garbage so that a lowering reading scratch it did not write shows up in the check; None where it needs none."""
    from qops.workspace import SCRATCH_BYTES

    size = SCRATCH_BYTES.get(name)
    nbytes = 0 if size is None else int(size(iw, x.shape[0], x.device))
    if nbytes == 0:
        return None, "None (the lowering declares no scratch for this call)"
    return torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=x.device), f"{nbytes} bytes (qops.workspace.SCRATCH_BYTES)"


def check_out_variant(iw, x, ref, workspace):
    return common.out_form_err(lambda out: torch.ops.qops.mm_int_weight_out(
        x, iw.qweight, iw.scales, iw.qzeros, iw.act_perm, None,
        iw.in_features, iw.bits, iw.group_size, iw.zero_offset, int(iw.kernel), out, workspace), iw.out_features, x, ref)


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


def r2(v, nd=2):
    return None if v is None else round(v, nd)


def time_candidates(cands: dict, args, dry: bool) -> tuple[dict, dict]:
    """Time every candidate (name -> callables over rotated copies): name -> (us, timing info), and
    name -> exception for those that failed. On the GPU all at once with interleaved trials; if that
    fails, each alone, so one broken candidate costs only its own row."""
    if not cands:
        return {}, {}
    if dry:
        return {n: tuple(common.wall_time(f, args.trials)) for n, f in cands.items()}, {}
    try:
        return {n: tuple(t) for n, t in common.graph_times(cands, args.trials, args.target_ms).items()}, {}
    except Exception:  # noqa: BLE001 - find the culprit below
        torch.cuda.synchronize()
    times, errors = {}, {}
    for n, f in cands.items():
        try:
            times[n] = tuple(common.graph_time(f, args.trials, args.target_ms))
        except Exception as e:  # noqa: BLE001
            errors[n] = e
    return times, errors


def run(args) -> int:
    import torch.nn.functional as F

    t_start = time.time()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("bench_int_weight: no CUDA device; use --dry-run to check the plumbing on CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if dry else torch.device("cuda")
    gpu = not dry

    def timer(fns, trials, target_ms):
        return common.wall_time(fns, trials) if dry else common.graph_time(fns, trials, target_ms)

    import qops  # noqa: F401  (registers torch.ops.qops.*)
    from qops.formats import FORMATS
    from qops.lowerings import Kernel, WeightSpec
    from qops.ops.int_weight import preferred_qweight_form, with_qweight_form

    torch.manual_seed(args.seed)
    res = {
        "gpu": common.device_name(gpu),
        "torch": torch.__version__,
        "triton": common.triton_version(),
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "qops_commit": common.git_commit(),
        "qops_dirty": common.git_dirty("qops"),
        "qops_source_sha256": qops_source_sha256(),
        "dry_run": dry,
        **common.run_stamp(args, shapes=common.shape_names(args.shape_list), ms=args.m_list, lowerings=args.lowering_list),
        "method": {
            "timing": "cpu wall clock (dry run; meaningless)" if dry else
            "CUDA-graph replays (one call per rotated weight copy), CUDA events, median of trials; at each (shape, M) "
            "every peer and lowering timed in one run with their trials interleaved (common.graph_times)",
            "rotation_bytes_min": common.ROT_BYTES, "max_copies": common.MAX_COPIES if gpu else common.DRY_MAX_COPIES,
            "roofline": f"max((N*K/2 + 4*N*K/{GROUP} + 2*M*(N+K)) B / copy_TBps, 2*M*N*K / bf16_TFLOPs); ceilings "
                        "PERF.md's (4.25 TB/s, 810 TFLOP/s) or this run's measurement where higher; roofline_read_us: "
                        "the prepared weight's own bytes + 2*M*(N+K)",
            "isolation": "qops_us: native launches without PDL, so no call overlaps the previous one (as every peer); "
                         "qops_chained_us: the native lowering as it launches by default, PDL overlapping back-to-back calls",
            "reference": "float64, decoded from the GPTQ checkpoint tensors independently of qops",
            "x": "torch.randn(M, K) fp16 (bf16 copy for cuBLAS bf16 and torch int4)",
            "tol": args.tol,
        },
    }
    out_paths = common.output_paths("bench_int_weight.json", args.out)
    table_path = args.table_out or (os.path.join(os.environ["OUT"], "bench_int_weight.txt") if os.environ.get("OUT") else None)
    print(json.dumps({k: res[k] for k in ("gpu", "torch", "triton", "cuda", "qops_commit", "qops_source_sha256", "date")}), flush=True)

    # Ceilings
    ceil = common.ceilings(args.trials, args.target_ms, gpu)
    copy_bw, bf16_tf = ceil.copy_TBps, ceil.bf16_TFLOPs
    if dry:
        res["ceilings_note"] = "dry run: PERF.md's H200 values, not measured"
    print(f"ceilings: copy {copy_bw:.3f} TB/s, bf16 {bf16_tf:.0f} TFLOP/s (this run measured {ceil.measured})", flush=True)
    res["copy_TBps"] = round(copy_bw, 4)
    res["bf16_TFLOPs"] = round(bf16_tf, 1)
    res["measured_ceilings"] = ceil.measured

    gemlite_mod, gemlite_status = (None, "disabled by --no-gemlite") if args.no_gemlite else load_gemlite(dev.type)
    res["gemlite"] = gemlite_status
    print(f"gemlite: {gemlite_status}", flush=True)

    # The load-only kernel over each shape's prepared weight bytes (read_floor.py), at M <= READ_FLOOR_MAX_M
    read_floor_kernel = None
    if gpu:
        try:
            read_floor_kernel = LoadOnlyKernel()
            res["read_floor"] = (f"load-only launch over the prepared weight's bytes (tiles, {2 * read_floor_kernel.sms} blocks), "
                                 f"timed with the candidates at M <= {READ_FLOOR_MAX_M}")
        except Exception as e:  # noqa: BLE001 - the floor is context, not a result: the run goes on without it
            res["read_floor"] = f"failed: {short_err(e)}"
    else:
        res["read_floor"] = "not measured: CUDA only"
    print(f"read floor: {res['read_floor']}", flush=True)

    rows, shape_info, skipped = [], [], []
    res["rows"], res["shapes"], res["skipped"] = rows, shape_info, skipped
    fatal = None
    fmt = FORMATS["gptq"]

    for si, (N, K) in enumerate(args.shape_list):
        why = skip_reason(fatal, t_start, args.budget_s)
        if why:
            skipped.append({"N": N, "K": K, "M": None, "why": why})
            print(f"skipping {N}x{K}: {why}", flush=True)
            continue
        t_shape = time.time()
        info = {"N": N, "K": K}
        shape_info.append(info)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        w = torch.randn(N, K, dtype=torch.float16, device=dev) * 0.02
        ckpt = fmt.quantize(w, bits=BITS, group_size=GROUP, sym=args.symmetric)
        iw = fmt.prepare(ckpt, dtype=torch.float16)
        info["default_lowering"] = iw.choice.lowering.name if iw.choice else None
        info["choice"] = iw.choice.explain() if iw.choice else None
        W64 = decode_gptq4_f64(ckpt)  # (K, N)
        iq = fmt.unpack(ckpt)
        q, zr, sc = iq.q, iq.zeros, iq.scales  # (N, K) uint8, (N, K/G) int32, (N, K/G) fp16
        spec = weight_spec(WeightSpec, N=N, K=K, act_order=iw.act_perm is not None,
                           symmetric=iw.qzeros is None, device=dev, act_dtype=torch.float16)

        # qops lowerings, forced
        variants, lowering_notes, chained = {}, {}, set()
        for name in args.lowering_list:
            low, why = lowering_status(name, spec, dev)
            if low is None:
                lowering_notes[name] = f"skipped: {why}"
                continue
            # each lowering on the qweight form its own preparation gives (column slabs for the native one)
            base = dataclasses.replace(with_qweight_form(iw, preferred_qweight_form(low.kernel, BITS, N)), kernel=low.kernel)
            variants[name] = [base] + [clone_tensors(base) for _ in range(n_copies(base.nbytes(), gpu) - 1)]
            lowering_notes[name] = f"forced kernel={int(low.kernel)}, {len(variants[name])} copies"
            if low.kernel == Kernel.NATIVE:
                chained.add(name)
        info["lowerings"] = lowering_notes
        broken = {}  # lowering -> error that stops it for this shape

        # peers
        peers = {}
        nb16 = N * K * 2
        w16s = [w] + [w.clone() for _ in range(n_copies(nb16, gpu) - 1)]
        wb = w.to(torch.bfloat16)
        wbs = [wb] + [wb.clone() for _ in range(n_copies(nb16, gpu) - 1)]
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
        floor_fns = None
        if read_floor_kernel is not None and not fatal and any(m <= READ_FLOOR_MAX_M for m in args.m_list):
            info["read_floor_bytes"] = iw.nbytes()
            floor_fns = read_floor_callables(read_floor_kernel, iw.nbytes())
        print(f"== {N}x{K}: default lowering {info['default_lowering']}; {lowering_notes}; {peer_notes}", flush=True)

        for M in args.m_list:
            why = skip_reason(fatal, t_start, args.budget_s)
            if why:
                skipped.append({"N": N, "K": K, "M": M, "why": why})
                print(f"skipping {N}x{K} M={M}: {why}", flush=True)
                continue
            x = torch.randn(M, K, dtype=torch.float16, device=dev)
            xb = x.to(torch.bfloat16)
            ref = x.double() @ W64
            wbytes = N * K / 2 + 4 * N * K / GROUP + 2 * M * (N + K)
            roof_us = common.roofline_us(wbytes, copy_bw, 2 * M * N * K, bf16_tf)
            io_bytes = 2 * M * (N + K)

            # Correctness first (a lowering that fails its call is not timed), then every candidate,
            # peers and lowerings, timed in one interleaved run (common.graph_times).
            row_base = {"op": "mm_int_weight", "format": "gptq", "bits": BITS, "group_size": GROUP,
                        "sym": iw.qzeros is None,
                        "N": N, "K": K, "M": M, "dtype": "float16"}
            names = list(variants) or [None]
            checked = {}
            for name in names:
                row = dict(row_base, lowering=name, qops_us=None, pct_roofline=None, speedup_vs_fp16=None, rel_err=None)
                checked[name] = row
                if name is None:
                    row["error"] = "no qops lowering usable: " + "; ".join(f"{k}: {v}" for k, v in lowering_notes.items())
                elif name in broken:
                    row["error"] = broken[name]
                elif fatal:
                    row["error"] = f"not run: {fatal}"
                else:
                    try:
                        row["rel_err"] = rel_err(variants[name][0].mm(x), ref)
                        ws, ws_note = workspace_for(name, variants[name][0], x)
                        row["rel_err_out"] = check_out_variant(variants[name][0], x, ref, ws)
                        row["workspace"] = ws_note
                        del ws
                        row["correct"] = all(v is not None and v <= args.tol for v in (row["rel_err"], row["rel_err_out"]))
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"correctness call failed: {short_err(e)}"
                        broken[name] = row["error"]
                        if is_fatal_cuda(e):
                            fatal = short_err(e)
                        traceback.print_exc()
            cands = {}
            if not fatal:
                for pname in ("cublas_fp16", "cublas_bf16", "torch_int4", "gemlite"):
                    if pname in peers:
                        cands[pname] = peers[pname](x, xb)
                for name, row in checked.items():
                    if name is not None and "error" not in row:
                        cands["qops:" + name] = [lambda c=c: common.isolated_call(c.mm, x) for c in variants[name]]
                        if name in chained:
                            cands["qops-chained:" + name] = [lambda c=c: c.mm(x) for c in variants[name]]
                if floor_fns is not None and M <= READ_FLOOR_MAX_M:
                    cands["read_floor"] = floor_fns
            times, errors = time_candidates(cands, args, dry)
            for name, err in errors.items():
                print(f"  {name} {N}x{K} M={M} failed: {err}", flush=True)
                if is_fatal_cuda(err):
                    fatal = short_err(err)
            peer_us = {p: (times[p][0] if p in times else None) for p in ("cublas_fp16", "cublas_bf16", "torch_int4", "gemlite")}
            timing = {p: (times[p][1] if p in times else {"error": short_err(errors[p])}) for p in peer_us if p in cands}
            peer_fields = {"cublas_fp16_us": r2(peer_us["cublas_fp16"]), "cublas_bf16_us": r2(peer_us["cublas_bf16"]),
                           "torch_int4_us": r2(peer_us["torch_int4"]), "gemlite_us": r2(peer_us["gemlite"]),
                           "roofline_us": r2(roof_us, 3)}
            if "read_floor" in times:
                peer_fields["read_floor_us"] = r2(times["read_floor"][0])
            elif "read_floor" in errors:
                peer_fields["read_floor_error"] = short_err(errors["read_floor"])
            for name, row in checked.items():
                row.update(peer_fields)
                timing.pop("qops", None)
                key = "qops:" + str(name)
                timing.pop("qops_chained", None)
                if key in times:
                    t, tinfo = times[key]
                    row["qops_us"] = r2(t)
                    timing["qops"] = tinfo
                    row["pct_roofline"] = r2(100 * roof_us / t, 1)
                    # the same % over the bytes this lowering's prepared weight really holds (packed zeros:
                    # fewer than PERF.md's formula counts, so this one is the lower)
                    read_us = common.roofline_us(variants[name][0].nbytes() + io_bytes, copy_bw, 2 * M * N * K, bf16_tf)
                    row["roofline_read_us"] = r2(read_us, 3)
                    row["pct_roofline_read"] = r2(100 * read_us / t, 1)
                    if "qops-chained:" + str(name) in times:
                        tc, tcinfo = times["qops-chained:" + str(name)]
                        row["qops_chained_us"] = r2(tc)
                        timing["qops_chained"] = tcinfo
                    if peer_us["cublas_fp16"]:
                        row["speedup_vs_fp16"] = r2(peer_us["cublas_fp16"] / t, 3)
                    if row.get("read_floor_us"):
                        row["pct_read_floor"] = r2(100 * row["read_floor_us"] / t, 1)
                elif key in errors and "error" not in row:
                    row["error"] = f"timing failed: {short_err(errors[key])}"
                row["timing"] = dict(timing)
                rows.append(row)
                print(json.dumps(common.clean({k: v for k, v in row.items() if k != "timing"})), flush=True)
            x = xb = ref = None
        info["seconds"] = round(time.time() - t_shape, 1)
        if dev.type == "cuda":
            info["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        # free everything of this shape before the next
        w = ckpt = iw = W64 = iq = q = zr = sc = variants = peers = w16s = wbs = wb = floor_fns = None  # noqa: F841
        tg = sz = tgs = gls = xt = None  # noqa: F841
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        res["elapsed_s"] = round(time.time() - t_start, 1)
        common.write_json(res, out_paths)

    res["elapsed_s"] = round(time.time() - t_start, 1)
    res["fatal"] = fatal
    targets = render_targets(rows, args, skipped)
    text = render_table(rows, args) + "\n" + targets
    res["targets"] = [t.strip() for t in targets.splitlines()[1:]]
    common.write_json(res, out_paths)
    print(f"\nJSON: {', '.join(out_paths)}  ({len(rows)} rows, {res['elapsed_s']}s)", flush=True)
    if table_path:
        with open(table_path, "w") as fh:
            fh.write(text + "\n")
    print(text, flush=True)
    return 3 if fatal else 0


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
    chained = {r["lowering"] for r in rows if r.get("qops_chained_us") is not None}
    head = f"{'N x K':>11} {'M':>5} |"
    for l in lows:
        head += f" {_short(l)[:7]:>7} {'%roof':>5} {'xfp16':>5}" + (f" {'chained':>7} |" if l in chained else " |")
    head += f" {'fp16':>7} {'bf16':>7} {'int4':>7} {'gemlite':>7} | {'roof':>6} {'floor':>6}"
    zeros = "sym" if args.symmetric else "asym"
    lines = ["", f"qops mm_int_weight, GPTQ W4 g128 {zeros}, fp16 activations: microseconds (lower is better);"
             " %roof = roofline / qops; xfp16 = cuBLAS fp16 / qops; chained = back-to-back calls overlapping through PDL"
             " (the others: each call after the last has finished); roof = the roofline, floor = a load-only launch over the"
             " prepared weight's bytes (M <= 16); '!' = failed correctness, 'E' = error", head,
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
            line += f" {us:>7} {pct:>5} {sp:>5}" + (f" {_f(r.get('qops_chained_us')):>7} |" if l in chained else " |")
        line += (f" {_f(any_r['cublas_fp16_us']):>7} {_f(any_r['cublas_bf16_us']):>7} {_f(any_r['torch_int4_us']):>7}"
                 f" {_f(any_r['gemlite_us']):>7} | {_f(any_r['roofline_us'], 2):>6} {_f(any_r.get('read_floor_us'), 2):>6}")
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
    if args.triton_config is None:
        return run(args)
    from qops.ops.triton import int_weight as triton_int_weight

    with triton_int_weight.config_override(triton_int_weight.load_config(args.triton_config)):
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
