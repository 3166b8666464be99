"""What bounds the native NF4 GEMV at decode sizes (H200): its loads, or its decode and math? And
which plan is fastest?

Times, per shape and M (``--ms``, default 1), over the same rotated weight copies with the method of ``common.py`` (CUDA-graph
replays over copies > 256 MB, median of trials), the native kernel (``qops/native/blockwise4_gemv.cu``)
at its plan and two measurement builds of it (``QOPS_PROBE``):

- ``op``: the kernel as it runs;
- ``loads``: the same launch, ring and loads (weights and absmax), each loaded word folded into the
  output without decoding (so the loads stay);
- ``math``: the same launch, table, x reads, lookups, MMAs and scaling, on register data (no weight
  or absmax loads);

each as a percentage of the roofline of the op's bytes, with the blocks an SM each build fits (the
builds compile on their own, so a ``loads`` build may run at a higher occupancy than the op). If
``loads`` is near the op, the access pattern bounds it; if ``math`` is, the instructions do.
``--plans`` times the same for other plan fields (JSON, e.g. '[{}, {"tiles": 1, "ring": 6, "minb":
3}]') and ``--layouts`` for qweight's byte orders (flat, tile16), every (plan, layout) pair of a
probe with interleaved trials (``common.graph_times``), each one's op checked against the default
plan's output in the flat order.

    PYTHONPATH=. python benchmarks/probe_nf4_native.py [--shapes 28672x4096,...] [--ms 1,8] [--layouts flat,tile16] [--out F]
"""
from __future__ import annotations

import json
import sys

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from bench_bnb_int8 import call, nf4_weight, weight_bytes  # noqa: E402
from qops.ops.blockwise4 import LAYOUT_FLAT, LAYOUTS  # noqa: E402
from qops.native import blockwise4 as nbw4  # noqa: E402
from qops.native import compiler  # noqa: E402


def under(fields: dict, f):
    """``f`` called with the plan fields forced: a graph keeps the kernel its calls were captured with."""
    def g():
        with nbw4.plan_override(**fields):
            return f()
    return g


def main(argv=None) -> int:
    p = common.probe_parser("probe_nf4_native.py", __doc__, LARGE_SHAPES, [1], 5)
    p.add_argument("--plans", type=json.loads, default=[{}], help="plan field overrides to probe (JSON list)")
    p.add_argument("--probes", default="op,loads,math", help="which of op, loads, math to time (default all three)")
    p.add_argument("--layouts", default="tile16", help="qweight byte orders to time, comma-separated: flat, tile16 (default tile16)")
    a = p.parse_args(argv)
    res = common.probe_result("nf4_native")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    probes = [(name, code) for name, code in (("op", 0), ("loads", 1), ("math", 2)) if name in a.probes.split(",")]
    layouts = [{v: k for k, v in LAYOUTS.items()}[name] for name in a.layouts.split(",")]
    # Every (plan, layout) pair of a shape and M is one candidate; a probe's candidates are timed
    # with interleaved trials (a drift of clocks moves all alike).
    variants = [(fields, layout) for fields in a.plans for layout in layouts]
    for n, k in a.shapes:
        w0 = nf4_weight(n, k, torch.device("cuda"), gen, layout=LAYOUT_FLAT)
        by_layout = {layout: w0.with_layout(layout) for layout in layouts}
        copies = n_copies(weight_bytes("nf4", n, k)) - 1
        ws = {layout: [w] + [clone_tensors(w) for _ in range(copies)] for layout, w in by_layout.items()}
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            roof = common.roofline_us(weight_bytes("nf4", n, k) + 2 * m * (k + n), bw)
            want = call(w0, x).float()
            rows = [{"N": n, "K": k, "M": m, "plan": fields, "layout": LAYOUTS[layout], "roofline_us": round(roof, 2)}
                    for fields, layout in variants]
            for name, probe in probes:
                cands = {i: [under({**fields, "probe": probe}, lambda w=w: call(w, x)) for w in ws[layout]]
                         for i, (fields, layout) in enumerate(variants)}
                times = common.graph_times(cands, a.trials, 5.0)
                for i, (fields, layout) in enumerate(variants):
                    row, w = rows[i], by_layout[layout]
                    with nbw4.plan_override(**fields, probe=probe):
                        used = nbw4.plan(m, n, k, sms, w.blocksize)
                        if probe == 0:  # every variant's op must agree with the default plan's in the flat order
                            row["rel_err_vs_default"] = common.rel_err(call(w, x), want)
                    row["plan_used"] = str(used)
                    # Each build runs at its own occupancy (a loads or math build may fit more blocks
                    # an SM than the op): recorded, so its time is read against the right one.
                    gemv = nbw4._kernel(0, used, x.dtype, True, w.blocksize, w.nested_blocksize, w.layout)
                    row[name + "_blocks_per_sm"] = compiler.max_active_blocks(gemv, 0, 32 * used.warps, used.shmem_bytes)
                    common.add_time(row, name, times[i].us, roof)
            for row in rows:
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        del w0, by_layout, ws
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_nf4_native.json", a.out))
    print("\nN x K | M | plan | layout | op % | loads % | math % (of the roofline; blocks an SM)")
    for r in res["rows"]:
        cells = [f"{r.get(p + '_roof_pct', '-')} ({r.get(p + '_blocks_per_sm', '-')})" for p in ("op", "loads", "math")]
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['plan'] or 'default'} | {r['layout']} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
