"""How much of the NF4 GEMV's gap to the roofline is its loads (H200; next-session probe).

Question it answers: the Triton NF4 GEMV (``qops/ops/triton/blockwise4.py``, gemv path) runs at
~20-24% of the roofline at M = 1, and three sweeps of its launch parameters moved that by at most
1.17x. This script times, for each shape, over the same rotated weight copies and with the method
of ``common.py`` (CUDA-graph replays, copies > 256 MB, median of trials):

- ``op``: ``qops::mm_blockwise4`` at M = 1 (the lowering's plan);
- ``loads``: a Triton kernel with the op's plan (grid, BLOCK_N, STEP, K split, warps, stages) that
  issues exactly the op kernel's weight-byte loads and feeds them, without decoding, to one
  tensor-core dot a step (against ones: so Triton pipelines them as it does the op's), no absmax;
- ``loads+absmax``: the same plus the per-(row, step) absmax byte and its nested absmax;
- the device-to-device copy bandwidth, for the percentages.

If ``loads`` is near the copy bandwidth, decoding and the dot bound the op (issue or dependent
latency); if ``loads`` is itself slow, the grid and access pattern do. Each kernel folds what it
loads into one value per program so that the loads cannot be removed (and checks, before timing, that those values add up to the sum of the
weight bytes: every byte read exactly once).

Writes ``$OUT/probe_nf4_bw.json`` (and ``--out``); prints one line per (shape, kernel).

    PYTHONPATH=. python benchmarks/probe_nf4_bw.py
    PYTHONPATH=. python benchmarks/probe_nf4_bw.py --dry-run   # CPU interpreter, tiny shapes: plumbing only
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

if "--dry-run" in sys.argv:  # before triton is imported (it reads the variable once)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import common  # noqa: E402

common.add_repo_to_path()

from bench_bnb_int8 import BLOCKSIZE, call, nf4_weight, weight_bytes  # noqa: E402
from qops.ops.triton import blockwise4 as tbw4  # noqa: E402

DRY_SHAPES = [(256, 512)]


@triton.jit
def _loads_kernel(w_ptr, am_ptr, nam_ptr, sink_ptr, N, row_bytes, split_bytes,
                  BLOCKSIZE: tl.constexpr, NESTED_BS: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
                  ABSMAX: tl.constexpr):
    # The op kernel's program: BLOCK_N rows, K split pid_k, STEP bytes a row per step (one block at
    # most: the default config), the same masked, evict-first byte loads.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    row_blk = offs_n.to(tl.int64) * ((2 * row_bytes) // BLOCKSIZE)
    offs_b = tl.arange(0, STEP)
    kb_lo = pid_k * split_bytes
    kb_hi = tl.minimum(row_bytes, kb_lo + split_bytes)
    # The bytes feed a tensor-core dot (against ones) as the op's decoded codes do, so that Triton
    # pipelines the loads the same way (cp.async stages for dot operands); row sums stay exact in fp32.
    ones = tl.full([STEP, 16], 1.0, tl.float16)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    extra = tl.zeros([BLOCK_N], tl.int32)
    for kb in range(kb_lo, kb_hi, STEP):
        b = tl.load(w_rows + (kb + offs_b)[None, :], mask=nmask[:, None], other=0, eviction_policy="evict_first")
        acc = tl.dot(b.to(tl.float16), ones, acc)
        if ABSMAX:
            blk = row_blk + (2 * kb) // BLOCKSIZE
            q = tl.load(am_ptr + blk, mask=nmask, other=0).to(tl.int32)
            s = tl.load(nam_ptr + blk // NESTED_BS, mask=nmask, other=0.0)
            extra += q + s.to(tl.int32)
    rows = tl.sum(acc, axis=1) / 16  # each row's byte sum, 16 times over
    total = tl.sum(rows.to(tl.int32), axis=0) + tl.sum(extra, axis=0)
    tl.store(sink_ptr + pid_k * tl.num_programs(0) + pid_n, total)


def launch_loads(w, plan, sink, absmax: bool):
    """The load-only kernel over weight ``w`` (a prepared NF4 weight) with the op's gemv ``plan``."""
    n, k = w.out_features, w.in_features
    _loads_kernel[plan["grid"]](w.qweight, w.absmax, w.nested_absmax, sink, n, k // 2, plan["split_bytes"],
                                BLOCKSIZE=w.blocksize, NESTED_BS=w.nested_blocksize, BLOCK_N=plan["BLOCK_N"],
                                STEP=plan["STEP"], ABSMAX=absmax, num_warps=plan["num_warps"],
                                num_stages=plan["num_stages"])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=common.parse_shapes, help="comma-separated NxK; default the four large PERF.md shapes")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: checks the plumbing only")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    a.shape_list = a.shapes or (DRY_SHAPES if a.dry_run else common.LARGE_SHAPES)
    return a


def run(a) -> int:
    gpu = not a.dry_run
    if gpu and not torch.cuda.is_available():
        print("probe_nf4_bw: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if gpu else "cpu")
    copy_bw = common.copy_TBps(a.trials) if gpu else common.PERF_COPY_TBPS
    res = {"gpu": common.device_name(gpu), "qops_commit": common.git_commit(), "dry_run": a.dry_run,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "copy_TBps": round(copy_bw, 4), "rows": []}
    paths = common.output_paths("probe_nf4_bw.json", a.out)
    # The probe is about the tensor-core GEMV, which M = 1 no longer takes by default (the CUDA-core
    # "gemv_fma" does): pin it for the whole run.
    with tbw4.config_override(gemv_fma_max_m=0):
        return _probe(a, gpu, dev, copy_bw, res, paths)


def _probe(a, gpu, dev, copy_bw, res, paths) -> int:
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in a.shape_list:
        nbytes = weight_bytes("nf4", n, k)
        ws = [nf4_weight(n, k, dev, gen) for _ in range(common.n_copies(nbytes, gpu))]
        plan = tbw4.plan(1, n, k, BLOCKSIZE, dev, torch.float16)
        assert plan["path"] == "gemv", plan
        x = torch.randn(1, k, device=dev, generator=gen).half()
        sink = torch.zeros(plan["grid"][0] * plan["grid"][1], dtype=torch.int32, device=dev)
        # The probe reads every weight byte exactly once: its per-program sums add up to the bytes' sum.
        launch_loads(ws[0], plan, sink, False)
        got, want = int(sink.to(torch.int64).sum()), int(ws[0].qweight.to(torch.int64).sum())
        assert got == want, f"{n}x{k}: the load-only kernel summed {got}, the weight bytes sum to {want}"
        kernels = {
            "op": [lambda w=w: call(w, x) for w in ws],
            "loads": [lambda w=w: launch_loads(w, plan, sink, False) for w in ws],
            "loads+absmax": [lambda w=w: launch_loads(w, plan, sink, True) for w in ws],
        }
        for name, fns in kernels.items():
            t = (common.graph_time(fns, a.trials, 4.0) if gpu else common.wall_time(fns, 1)).us
            roof = common.roofline_us(nbytes, copy_bw)
            row = {"N": n, "K": k, "kernel": name, "us": round(t, 2), "roofline_us": round(roof, 2),
                   "pct_of_roofline": round(100 * roof / t, 1),
                   "plan": {key: plan[key] for key in ("BLOCK_N", "STEP", "split", "num_warps", "num_stages", "grid")}}
            res["rows"].append(row)
            print(f"{n}x{k} {name:13s} {t:9.2f} us ({row['pct_of_roofline']:5.1f}% of the roofline {roof:.2f} us)", flush=True)
            common.write_json(res, paths)
        del ws
        if gpu:
            torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
