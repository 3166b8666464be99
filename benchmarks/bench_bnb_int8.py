"""int8 W8A16 (``qops::mm_int8_weight``: EETQ / bitsandbytes LLM.int8) and NF4 (``qops::mm_blockwise4``:
bitsandbytes, blocksize 64, nested absmax) against cuBLAS fp16 / bf16, timed as PERF.md says.

One run measures everything side by side with one method (``../shared/anchors/bench_anchors.py``):

- the ceilings: device-to-device copy bandwidth (1 GiB + 1 GiB) and bf16 dense matmul 8192^3;
- per shape (N x K) one random int8 weight with per-channel scales and one random NF4 weight
  (every byte value, nested absmax with bitsandbytes' dynamic map), prepared on the GPU (the chooser
  picks the Triton lowerings), fp16 activations;
- correctness first, per (shape, M): rows ``[0, 512)`` of the output against float64 ``x @ W.T``
  with W decoded here from the runtime tensors (bytes read with // and %, not qops' code), and the
  ``_out`` op with its ``out`` poisoned with NaN;
- time: CUDA-graph replays over rotated weight copies (> 256 MB in all), CUDA events, median; each op's
  trials interleaved with cuBLAS fp16's on the same x (``common.graph_times``), which its ``vs_fp16`` uses;
  each call after the previous one has finished (``common.isolated_call``), and a native lowering also
  as it launches by default, PDL overlapping back-to-back calls (``qops_chained_us``);
- roofline per row: max(bytes moved / copy bandwidth, 2*M*N*K / bf16 peak), bytes = weight +
  scales/absmax + x read + y written; ceilings PERF.md's or this run's where higher (``common.ceilings``).

Writes ``$OUT/bench_bnb_int8.json`` (and ``--out``): one flat row per (shape, M, variant) with PERF.md's
fields (``variant``: ``int8``, ``nf4`` as chosen, ``nf4_triton`` / ``nf4_fma_gemv`` the Triton GEMVs
forced); prints rows as they come, then a table and the
targets (PERF.md: int8 W8A16 M=1 >= 70% of the roofline on the four large shapes, NF4 M=1 >= 60%;
issue #5: NF4 faster than cuBLAS fp16 up to M=16) last.

    PYTHONPATH=. python benchmarks/bench_bnb_int8.py                    # ~1-2 min on an H200 (estimate)
    PYTHONPATH=. python benchmarks/bench_bnb_int8.py --shapes 57344x8192 --ms 1 --sweep
    PYTHONPATH=. python benchmarks/bench_bnb_int8.py --dry-run --out /tmp/b.json   # CPU: plumbing only
    PYTHONPATH=. python benchmarks/bench_bnb_int8.py --shapes 28672x4096,4096x14336,57344x8192,8192x28672 \
        --ms 1,16 --sweep-nf4        # the NF4 GEMV's K step (multi-block) against the default, ~60 s
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

import qops  # noqa: E402,F401
from qops.lowerings import LOWERINGS_BY_KERNEL, Kernel  # noqa: E402
from qops.formats.bitsandbytes import codebook  # noqa: E402
from qops.formats.blockwise4 import dynamic_map  # noqa: E402
from qops.ops.blockwise4 import LAYOUT_FLAT, LAYOUT_TILE16, prepare_blockwise4  # noqa: E402
from qops.ops.int8_weight import prepare_int8_weight  # noqa: E402

MS = [1, 16, 64, 256]
DRY_SHAPES, DRY_MS = [(256, 512), (320, 1024)], [1, 16]
BLOCKSIZE = 64
CHECK_ROWS = 512
TARGETS = {"int8_m1_roof_pct": 70.0, "nf4_m1_roof_pct": 60.0, "nf4_vs_fp16_max_m": 16}
# --sweep: GEMV configs tried at M = 1 (the lowering's defaults are in qops/ops/triton/*.py CONFIGS).
SWEEP = {
    # Rows x bytes per step x warps x pipeline stages, keeping 16-64 weight bytes a thread per step
    # (16: one 16-byte load; 64: as many fp32 accumulators as registers allow). The first grid
    # (2/4/8 rows, 256-1024 bytes, 4/8 warps) never reached the 2048-byte steps that won for FP8.
    "int8": [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
             for bn, bk, w, st in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (2, 4, 8), (2, 3, 4))
             if 16 <= bn * bk // (32 * w) <= 64],
    "nf4": [dict(BLOCK_N=bn, num_warps=w, programs_per_sm=p) for bn, w, p in itertools.product((64, 128, 256), (4, 8), (1, 2, 4))],
    # The CUDA-core GEMV (blockwise4 "gemv_fma"): weight rows x bytes a row per step x warps x stages.
    # Earlier grids, each recorded in its results file: run 1 (71d027d, ...-71d027d-nf4-fma.json) rows
    # 1/2, 512-2048 bytes, 1/2/4 warps, 1/2 stages: two rows of 1024 bytes on one warp best everywhere;
    # run 2 (ff4b071, ...-ff4b071-nf4-fma-2.json) four rows: lost to two; run 3 (a05a4ec,
    # ...-a05a4ec-nf4-fma-3.json) the kernel with rows of x unrolled too, at M = 1 and, as nf4_fma_m2 /
    # nf4_fma_m4 (gemv_fma_max_m raised to 4), at M = 2 and 4, where the plan caps ROWS at 4 // XROWS.
    # Run 4 (below, 6c34b9c): ptxas's register cap (run 3's kernel took 125 registers at M = 1 where
    # the two-row kernel of runs 1-2 took 80, and ran ~5% slower): every cap was slower.
    "nf4_fma": [dict(ROWS=2, STEP_BYTES=1024, num_warps=1, num_stages=2, maxnreg=r) for r in (None, 80, 96, 128)],
    "nf4_fma_m2": [dict(ROWS=2, STEP_BYTES=1024, num_warps=1, num_stages=2, maxnreg=r) for r in (None, 80, 96, 128)],
    "nf4_fma_m4": [dict(ROWS=1, STEP_BYTES=sb, num_warps=w, num_stages=2) for sb, w in itertools.product((512, 1024), (1, 2))],
    # The tensor-core GEMV at M = 16 (where it still serves) with fewer warps and smaller tiles than
    # the earlier NF4 sweeps tried (they stopped at 4 warps, BLOCK_N 64).
    "nf4_m16": [dict(BLOCK_N=bn, num_warps=w, programs_per_sm=p) for bn, w, p in itertools.product((32, 64), (1, 2, 4), (4, 8))],
    # The native kernel (qops/native/blockwise4_gemv.cu), plan fields: 16-row tiles of N a block x
    # warps a block (splitting K) x register ring slots; at M = 1 and (nf4_native_m16) M = 16.
    # Each with a register budget (minb: blocks an SM promised to ptxas; 80 registers = 3 blocks of 8
    # warps, 128 = 2) it compiles in without spills (ptxas -v, sm_90).
    "nf4_native": [dict(tiles=1, warps=8, ring=2, minb=3)] + [dict(tiles=1, warps=8, ring=r, minb=2) for r in (3, 4)]
                  + [dict(tiles=1, warps=4, ring=3, minb=4), dict(tiles=1, warps=16, ring=3, minb=1)]
                  + [dict(tiles=2, warps=8, ring=2, minb=2)] + [dict(tiles=2, warps=8, ring=r, minb=1) for r in (3, 4)]
                  + [dict(tiles=2, warps=4, ring=2, minb=4)]
                  + [dict(tiles=2, warps=8, ring=2, minb=2, scale="prescale"), dict(tiles=1, warps=8, ring=3, minb=2, scale="prescale")],
    "nf4_native_m16": [dict(tiles=1, warps=8, ring=3, minb=2, scale=p) for p in ("chains", "prescale")]
                      + [dict(tiles=2, warps=8, ring=r, minb=1, scale="chains") for r in (2, 3)]
                      + [dict(tiles=2, warps=8, ring=2, minb=2, scale="prescale"), dict(tiles=2, warps=8, ring=3, minb=1, scale="prescale"),
                         dict(tiles=2, warps=4, ring=2, minb=4, scale="prescale")],
}

# --sweep-nf4: NF4 GEMV K steps, timed at every M of --ms (<= 16) with the correctness check of the
# main rows. The first entry is the lowering's default (one block per step); the others use
# multi-block steps (qops/ops/triton/blockwise4.py, "Multi-block steps"): STEP_BYTES per row, scale
# "product" (a dot pair per block) or "weight" (the scaled tile, one wide dot).
MULTI = dict(blocks_per_step=16, scale="product")
NF4_STEPS = [
    {},
    # Entries override the lowering's current gemv config. Run 1 (99e1780,
    # ...-99e1780-nf4-steps.json): multi-block steps at 4 warps and one program per SM gained nothing
    # (0.63-0.91x) except the weight-scaled tile at BLOCK_N 64 (1.05x). Run 2 (b72e09a,
    # ...-b72e09a-nf4-steps-2.json): more programs per SM; BLOCK_N 64 with ~4 programs per SM (1.17x)
    # became the default. Run 3 (6f38b91, ...-6f38b91-nf4-steps-3.json): a hand pipeline carrying
    # 1-3 steps in registers, 0.63-0.85x (taken out). Each run's configs are recorded in its file.
    dict(BLOCK_N=128, programs_per_sm=1),
    dict(programs_per_sm=8),
    dict(MULTI, STEP_BYTES=128, scale="weight"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_bnb_int8.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=common.parse_shapes, help="comma-separated NxK; default the five of PERF.md")
    p.add_argument("--ms", type=common.parse_ms, help="comma-separated M; default 1,16,64,256")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=5.0, help="GPU time per timed trial")
    p.add_argument("--sweep", action="store_true", help="also time the GEMV configs of SWEEP (each kind at its own M, 1 by default) and print the best")
    p.add_argument("--sweep-kinds", default="int8,nf4", help="which of SWEEP's kinds --sweep times (default int8,nf4; also nf4_fma, nf4_m16, nf4_fma_m2, nf4_fma_m4, nf4_native, nf4_native_m16)")
    p.add_argument("--fma-up-to", type=int, default=0, help="also time NF4 through the CUDA-core GEMV at each M of --ms up to this")
    p.add_argument("--sweep-nf4", action="store_true", help="also time the NF4 GEMV K steps of NF4_STEPS at each M <= 16")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference lowering: checks the plumbing only")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--tol", type=float, default=2e-3, help="largest relative error counted correct (fp16 activations)")
    a = p.parse_args(argv)
    a.shape_list = a.shapes or (DRY_SHAPES if a.dry_run else common.PERF_SHAPES)
    a.m_list = a.ms or (DRY_MS if a.dry_run else MS)
    return a



def int8_weight(n, k, dev, gen):
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev, generator=gen)
    s = (torch.rand(n, device=dev, generator=gen) + 0.5) * 0.01
    return prepare_int8_weight(q, s, dtype=torch.float16, format_name="eetq")


def nf4_weight(n, k, dev, gen, layout=None):
    """A random nested NF4 weight prepared as qops would (``layout`` None: the chosen lowering's byte order)."""
    nb = n * k // BLOCKSIZE
    return prepare_blockwise4(
        qweight=torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, device=dev, generator=gen),
        code=codebook("nf4").to(dev),
        absmax=torch.randint(0, 256, (nb,), dtype=torch.uint8, device=dev, generator=gen),
        nested_code=dynamic_map().to(dev),
        nested_absmax=(torch.rand(-(-nb // 256), device=dev, generator=gen) + 0.5) * 0.02,
        nested_offset=torch.tensor([0.03], device=dev),
        out_features=n, in_features=k, blocksize=BLOCKSIZE, nested_blocksize=256,
        dtype=torch.float16, format_name="bitsandbytes-nf4", layout=layout,
    )


def decode_rows(w, rows: int) -> torch.Tensor:
    """float64 W[:rows] from the runtime tensors, decoded here (not with qops' unpacking)."""
    if hasattr(w, "scales"):
        return w.qweight[:rows].double() * w.scales[:rows].double()[:, None]
    k = w.in_features
    b = w.qweight[: rows * k // 2]
    if w.layout == LAYOUT_TILE16:  # rows come in 16-row tiles of (K/128 chunks, 16 rows, 64 bytes)
        b = b.reshape(rows // 16, k // 128, 16, 64).permute(0, 2, 1, 3).reshape(-1)
    b = b.long()
    codes = torch.stack([b // 16, b % 16], dim=1).reshape(rows, k)
    u = w.absmax[: rows * k // BLOCKSIZE].long()
    blk = torch.arange(u.numel(), device=u.device)
    absmax = (w.nested_code.double()[u].float() * w.nested_absmax[blk // 256].float() + w.nested_offset.float()).double()
    return w.code.double()[codes] * absmax.repeat_interleave(BLOCKSIZE).reshape(rows, k)


def call(w, x, out=None):
    if hasattr(w, "scales"):
        if out is None:
            return torch.ops.qops.mm_int8_weight(x, w.qweight, w.scales, None, int(w.kernel))
        return torch.ops.qops.mm_int8_weight_out(x, w.qweight, w.scales, None, int(w.kernel), out, None)
    args = (x, *w._weight_args(), None, *w._static_args(), int(w.kernel))
    if out is None:
        return torch.ops.qops.mm_blockwise4(*args)
    return torch.ops.qops.mm_blockwise4_out(*args, out, None)


def weight_bytes(kind: str, n: int, k: int) -> float:
    if kind == "int8":
        return n * k + 4 * n
    if kind == "nf4":
        nb = n * k / BLOCKSIZE
        return n * k / 2 + nb + 4 * nb / 256 + 1024 + 64
    return 2 * n * k


def lowering_of(w) -> str:
    family = "int8_weight" if hasattr(w, "scales") else "blockwise4"
    return LOWERINGS_BY_KERNEL[(family, w.kernel)].name


def as_triton(ws: list) -> list:
    """The same weights, called through the Triton lowering (the native one outranks it), NF4 in the
    checkpoint's byte order: on the native kernel's tile16 order the Triton lowering takes its dense
    path (dequantize, then cuBLAS) at every M, which is not what served NF4 before the native kernel
    (results from 2026-11-30's 4635f3f to 2026-12-05 timed that path as "nf4_triton", ~8x slower)."""
    from qops.ops.blockwise4 import LAYOUT_FLAT

    return [dataclasses.replace(w.with_layout(LAYOUT_FLAT), kernel=Kernel.TRITON) for w in ws]


def path_of(w, m, n, k, dev) -> str:
    from qops.native import blockwise4 as nbw4

    if lowering_of(w) == "native_blockwise4":
        if m > nbw4.SLICED_MAX_M:
            return "native->triton/" + triton_path(w, m, n, k, dev)
        # Above MAX_M rows the op runs MAX_M-row launches (the last one shorter): label the first.
        slices = -(-m // nbw4.MAX_M)
        p = nbw4.plan(min(m, nbw4.MAX_M), n, k, torch.cuda.get_device_properties(dev).multi_processor_count, BLOCKSIZE)
        return ((f"native/{slices}x" if slices > 1 else "native/") + f"{p.scale}-mt{p.mt}-tiles{p.tiles}-warps{p.warps}"
                + (f"-wn{p.wn}" if p.wn > 1 else "") + f"-ring{p.ring}-minb{p.minb}" + ("-persistent" if p.persistent else ""))
    return triton_path(w, m, n, k, dev)


def triton_path(w, m, n, k, dev) -> str:
    """The Triton lowering's path for ``w`` as laid out (NF4 in the tile16 order takes the dense one)."""
    from qops.ops.blockwise4 import LAYOUT_FLAT
    from qops.ops.triton import blockwise4 as tbw4
    from qops.ops.triton import int8_weight as ti8

    p = ti8.plan(m, n, k, dev) if hasattr(w, "scales") else tbw4.plan(m, n, k, BLOCKSIZE, dev, dense=w.layout != LAYOUT_FLAT)
    return f"{p['path']}/split{p['split']}"


def main(argv=None) -> int:
    from qops.ops.triton import blockwise4 as tbw4

    a = parse_args(argv)
    gpu = not a.dry_run
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if gpu else "cpu")

    def timer(fns, trials, target_ms):
        """us per call of the callables ``fns``; of each candidate, trials interleaved, when ``fns`` is a
        dict (name -> callables: common.graph_times)."""
        cands = fns if isinstance(fns, dict) else {"": fns}
        if gpu:
            got = {name: t.us for name, t in common.graph_times(cands, trials, target_ms).items()}
        else:
            got = {name: common.wall_time(f, trials).us for name, f in cands.items()}
        return got if isinstance(fns, dict) else got[""]

    res = {"bench": "bnb_int8", "device": common.device_name(gpu), "torch": torch.__version__,
           "commit": common.git_commit(), "dry_run": a.dry_run, "triton": common.triton_version(),
           **common.run_stamp(a, shapes=common.shape_names(a.shape_list), ms=a.m_list), "rows": []}
    ceil = common.ceilings(a.trials, a.target_ms, gpu)
    bw, peak = ceil.copy_TBps, ceil.bf16_TFLOPs
    res.update(copy_TBps=round(bw, 3), bf16_TFLOPs=round(peak, 1), measured_ceilings=ceil.measured)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    out_paths = common.output_paths("bench_bnb_int8.json", a.out)
    gen = torch.Generator(device=dev).manual_seed(0)
    t_start = time.time()
    for n, k in a.shape_list:
        weights = {"int8": int8_weight(n, k, dev, gen), "nf4": nf4_weight(n, k, dev, gen)}
        for kind, w in weights.items():
            print(f"{n}x{k} {kind}: {w.choice.lowering.name}", flush=True)
        copies = {kind: [w] + [clone_tensors(w) for _ in range(n_copies(weight_bytes(kind, n, k), gpu) - 1)]
                  for kind, w in weights.items()}
        dense = {dt: torch.randn(n, k, device=dev, generator=gen).to(dt) * 0.02 for dt in (torch.float16, torch.bfloat16)}
        dense_copies = {dt: [w] + [w.clone() for _ in range(n_copies(2 * n * k, gpu) - 1)] for dt, w in dense.items()}
        refs = {kind: decode_rows(w, min(CHECK_ROWS, n)) for kind, w in weights.items()}
        triton_copies = []  # the NF4 copies through Triton in the flat order: converted once a shape, on first use

        def triton_nf4() -> list:
            if not triton_copies:
                triton_copies.extend(as_triton(copies["nf4"]))
            return triton_copies

        for m in a.m_list:
            x = torch.randn(m, k, device=dev, generator=gen).half()
            io = 2 * m * (k + n)
            base = {"N": n, "K": k, "M": m, "dtype": "float16"}
            for dt, name in ((torch.float16, "cublas_fp16_us"), (torch.bfloat16, "cublas_bf16_us")):
                xd = x.to(dt)
                base[name] = round(timer([lambda w=w, xd=xd: torch.nn.functional.linear(xd, w) for w in dense_copies[dt]], a.trials, a.target_ms), 2)
            peer = [lambda w=w: torch.nn.functional.linear(x, w) for w in dense_copies[torch.float16]]

            def add(variant, kind, ws):
                """One flat row (PERF.md's fields) for ``variant`` of ``kind`` timed over ``ws``."""
                try:
                    got = measure(kind, ws, x, refs[kind], io, bw, peak, timer, a, gpu, peer)
                except Exception as e:  # noqa: BLE001 - recorded and reported; the other rows still run
                    got = {"op": OPS[kind][0], "format": OPS[kind][1], "error": common.short_err(e)}
                res["rows"].append(row := {**base, "variant": variant, **got})
                print(json.dumps(row), flush=True)

            for kind, ws in copies.items():
                add(kind, kind, ws)
            if "nf4" in copies and gpu and lowering_of(copies["nf4"][0]) != "triton_blockwise4" and m <= 16:
                # What served NF4 before the native kernel (CUDA-core GEMV at M <= 2, tensor-core above), same run.
                add("nf4_triton", "nf4", triton_nf4())
            if "nf4" in copies and m <= a.fma_up_to:
                # The CUDA-core GEMV at an M the tensor-core one serves by default.
                with tbw4.config_override(gemv_fma_max_m=m):
                    add("nf4_fma_gemv", "nf4", triton_nf4())
        if a.sweep_nf4:
            res.setdefault("sweep_nf4", []).extend(sweep_nf4(n, k, triton_nf4(), refs["nf4"], timer, a, dev))
        if a.sweep and gpu and 1 in a.m_list:
            res.setdefault("sweep", []).extend(sweep(n, k, copies, dev, a))
        del weights, copies, dense, dense_copies, refs, triton_copies
        if gpu:
            torch.cuda.empty_cache()
        common.write_json(res, out_paths)
    res["seconds"] = round(time.time() - t_start, 1)
    common.write_json(res, out_paths)
    report(res, a)
    if res.get("sweep_nf4"):
        report_sweep_nf4(res["sweep_nf4"])
    return 0


# kind -> (op, format) of its rows
OPS = {"int8": ("mm_int8_weight", "eetq / bitsandbytes-int8"), "nf4": ("mm_blockwise4", "bitsandbytes-nf4 b64 nested")}


def measure(kind, ws, x, ref, io, bw, peak, timer, a, gpu, peer) -> dict:
    """Check rows [0, CHECK_ROWS) of one qops op against float64, then time it over the copies ``ws``
    with its trials interleaved with those of ``peer`` (cuBLAS fp16 on the same x), whose time in
    this pairing is the ``vs_fp16`` ratio's."""
    w = ws[0]
    m, n, k = x.shape[0], w.out_features, w.in_features
    rows = ref.shape[0]
    want = x.double() @ ref.t()
    got = call(w, x)
    out = torch.full((m, n), float("nan"), device=x.device, dtype=torch.float16)
    call(w, x, out)
    errs = [common.rel_err(got[:, :rows], want), common.rel_err(out[:, :rows], want)]
    # out starts as NaN: an element the op left unwritten anywhere, not only in the checked rows, fails.
    err = math.inf if None in errs or not bool(torch.isfinite(out).all()) else max(errs)
    cands = {"qops": [lambda w=w: common.isolated_call(call, w, x) for w in ws], "cublas_fp16": peer}
    native = gpu and lowering_of(w).startswith("native")
    if native:
        cands["qops_chained"] = [lambda w=w: call(w, x) for w in ws]
    times = timer(cands, a.trials, a.target_ms)
    us = times["qops"]
    roof = common.roofline_us(weight_bytes(kind, n, k) + io, bw, 2 * m * n * k, peak)
    return {"op": OPS[kind][0], "format": OPS[kind][1],
            "lowering": lowering_of(w), "path": path_of(w, m, n, k, x.device) if gpu else "reference",
            "qops_us": round(us, 2), "roofline_us": round(roof, 2), "roofline_pct": round(100 * roof / us, 1),
            "cublas_fp16_paired_us": round(times["cublas_fp16"], 2), "vs_fp16": round(times["cublas_fp16"] / us, 2),
            "rel_err": err, "correct": err <= a.tol} | (
                {"qops_chained_us": round(times["qops_chained"], 2)} if native else {})


def sweep(n, k, copies, dev, a) -> list[dict]:
    from qops.native import blockwise4 as nbw4
    from qops.ops.triton import blockwise4 as tbw4
    from qops.ops.triton import int8_weight as ti8

    found = []
    fma_m = {"gemv_fma_max_m": 4}
    for kind, mod, key, m, extra in (("int8", ti8, "gemv", 1, {}), ("nf4", tbw4, "gemv", 1, {}),
                                     ("nf4_fma", tbw4, "gemv_fma", 1, {}), ("nf4_m16", tbw4, "gemv", 16, {}),
                                     ("nf4_fma_m2", tbw4, "gemv_fma", 2, fma_m), ("nf4_fma_m4", tbw4, "gemv_fma", 4, fma_m),
                                     ("nf4_native", nbw4, None, 1, {}), ("nf4_native_m16", nbw4, None, 16, {})):
        if kind not in a.sweep_kinds.split(","):
            continue
        x = torch.randn(m, k, device=dev).half()
        best = None
        ws = copies[kind.split("_")[0]]
        if mod is tbw4 and lowering_of(ws[0]) != "triton_blockwise4":
            ws = as_triton(ws)
        want = call(ws[0], x).float()  # the default config's output: each config must agree with it
        for cfg in SWEEP[kind]:
            with (mod.plan_override(**cfg) if mod is nbw4 else mod.config_override(**{key: cfg}, **extra)):
                try:
                    err = common.rel_err(call(ws[0], x), want)
                    us = common.graph_time([lambda w=w: call(w, x) for w in ws], 3, a.target_ms).us
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses
                    print(f"sweep {kind} {cfg}: {type(e).__name__}", flush=True)
                    continue
            if err is None or err > 1e-3:
                print(f"sweep {kind} {cfg}: disagrees with the default config (rel err {err})", flush=True)
                continue
            found.append({"kind": kind, "N": n, "K": k, "M": m, "cfg": cfg, "us": round(us, 2), "rel_err_vs_default": err})
            if best is None or us < best[1]:
                best = (cfg, us)
        if best:
            print(f"SWEEP best {kind} {n}x{k} M={m}: {best[0]} {best[1]:.2f} us", flush=True)
    return found


def sweep_nf4(n, k, ws, ref, timer, a, dev) -> list[dict]:
    """Each NF4_STEPS config at each M <= 16 of --ms: checked (rows [0, CHECK_ROWS) against float64),
    then timed over the weight copies ``ws``; one row per (config, M)."""
    from qops.ops.triton import blockwise4 as tbw4

    found = []
    for m in [m for m in a.m_list if m <= 16]:
        x = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(m)).half()
        want = x.double() @ ref.t()
        base = None
        for i, cfg in enumerate(NF4_STEPS):
            row = {"N": n, "K": k, "M": m, "cfg": cfg}
            with tbw4.config_override(gemv=cfg):
                p = tbw4.plan(m, n, k, BLOCKSIZE, dev, torch.float16)
                row.update(STEP=p["STEP"], split=p["split"])
                try:
                    err = common.rel_err(call(ws[0], x)[:, :ref.shape[0]], want)
                    us = timer([lambda w=w: call(w, x) for w in ws], a.trials, a.target_ms)
                except Exception as e:  # noqa: BLE001 - e.g. shared memory the compiler refuses; the rest still run
                    row["error"] = common.short_err(e)
                    print(f"sweep-nf4 {n}x{k} M={m} {cfg}: {row['error']}", flush=True)
                    found.append(row)
                    continue
            base = us if i == 0 else base
            row.update(us=round(us, 2), rel_err=err, correct=err is not None and err <= a.tol,
                       vs_default=round(base / us, 3) if base else None)
            print(json.dumps(row), flush=True)
            found.append(row)
    return found


def report_sweep_nf4(rows) -> None:
    """Per config: the geometric mean of its speedup over the default across the (shape, M) timed."""
    print("\nNF4 GEMV K steps (speedup over the default config; geometric mean over shapes and M)")
    for i, cfg in enumerate(NF4_STEPS):
        mine = [r for r in rows if r["cfg"] == cfg]
        ok = [r for r in mine if r.get("vs_default") and r.get("correct")]
        gm = math.exp(sum(math.log(r["vs_default"]) for r in ok) / len(ok)) if ok else float("nan")
        cells = ", ".join(f"{r['N']}x{r['K']} M={r['M']}: {r['us'] if 'us' in r else 'error'}" for r in mine)
        bad = len(mine) - len(ok)
        print(f"[{i}] {cfg or 'default'}: {gm:.2f}x{f' ({bad} failed)' if bad and i else ''} | {cells}")


def report(res, a) -> None:
    by = {}  # (N, K, M) -> variant -> row
    for r in res["rows"]:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["variant"]] = r

    def cell(v):
        if v is None:
            return "-"
        return f"error: {v['error']}" if "error" in v else f"{v['qops_us']} ({v['roofline_pct']}%, {v['vs_fp16']}x)"

    print("\nN x K, M | cuBLAS fp16 us | int8 us (roof %, x fp16) | NF4 us (roof %, x fp16) | NF4 through triton | paths")
    for (n, k, m), d in by.items():
        paths = ", ".join(d.get(kind, {}).get("path", "-") for kind in ("int8", "nf4"))
        fp16 = next(iter(d.values()))["cublas_fp16_us"]
        print(f"{n}x{k}, {m} | {fp16} | {cell(d.get('int8'))} | {cell(d.get('nf4'))} | {cell(d.get('nf4_triton'))} | {paths}")
    print(f"\nTARGETS ({res['device']}, copy {res['copy_TBps']} TB/s, bf16 {res['bf16_TFLOPs']} TFLOP/s, commit {(res['commit'] or 'unknown')[:12]})")
    main_rows = {kind: [r for r in res["rows"] if r["variant"] == kind] for kind in ("int8", "nf4")}
    bad = [r for rows in main_rows.values() for r in rows if not r.get("correct", False)]
    print(f"correct (rel err <= {a.tol}, no error): {'all rows' if not bad else f'FAILED in {len(bad)} rows'}")
    for kind, key in (("int8", "int8_m1_roof_pct"), ("nf4", "nf4_m1_roof_pct")):
        rows = [r for r in main_rows[kind] if r["M"] == 1 and (r["N"], r["K"]) in LARGE_SHAPES]
        if not rows:
            print(f"{kind} M=1 >= {TARGETS[key]}% of roofline: not measured")
            continue
        pcts = [r.get("roofline_pct", 0.0) for r in rows]
        ok = len(rows) == len(LARGE_SHAPES) and all(p >= TARGETS[key] for p in pcts)
        print(f"{kind} M=1 >= {TARGETS[key]}% of roofline on the large shapes: {'MET' if ok else 'NOT MET'} ({', '.join(f'{p}%' for p in pcts)})")
    rows = [r for r in main_rows["nf4"] if r["M"] <= TARGETS["nf4_vs_fp16_max_m"]]
    if rows:
        ratios = [(r, r.get("vs_fp16", 0.0)) for r in rows]
        slow = [f"{r['N']}x{r['K']} M={r['M']}: {v}x" for r, v in ratios if v <= 1.0]
        print(f"NF4 faster than cuBLAS fp16 up to M={TARGETS['nf4_vs_fp16_max_m']}: {'MET' if not slow else 'NOT MET'}"
              f" ({'; '.join(slow) if slow else ', '.join(f'{v}x' for _, v in ratios)})")
    if a.dry_run:
        print("(dry run: CPU wall-clock times and PERF.md ceilings; the numbers mean nothing)")


if __name__ == "__main__":
    sys.exit(main())
