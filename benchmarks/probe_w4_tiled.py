"""Would a tile-major weight layout make the native W4A16 decode kernel faster (H200)?

The runtime layout keeps GPTQ's (K/8, N) int32 words: a warp's load reads 128 contiguous bytes of
each of 4 rows N*4 bytes apart, and its next step the next 4 rows. ``QOPS_PROBE = 1`` builds the
kernel at its own plan reading the same number of bytes as if each 32 columns were stored as one
(K/8, 32) slab (a step 512 contiguous bytes, consecutive steps adjacent): wrong sums, same work. Per
shape and M, the op and that build are timed with interleaved trials over rotated weight copies
(method of ``common.py``), GPTQ v2, 4 bits, group 128, asymmetric, fp16 x. ``--plans`` adds the op at
its plan with other fields (JSON list, e.g. '[{"smem_ring": 4}]': a 4-stage shared-memory ring), each
checked against the op's output. (Stop 18 also timed an L2 fetch size on the weight loads and a ring
filled by per-row bulk copies this way, at 525f5d4 and c9b8957; neither paid, both were taken out.) The same questions for the NF4 kernel are
``probe_nf4_native.py --probes op,tiled --plans ...``. Needs N % 32 == 0.

    PYTHONPATH=. python benchmarks/probe_w4_tiled.py [--shapes 28672x4096,...] [--ms 1,16] [--plans JSON] [--out F]
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402


PLAN_KNOBS = ("nwn", "splits", "cluster", "xfull", "ring", "minb", "fold", "prefetch", "smem_ring")


def main(argv=None) -> int:
    p = common.probe_parser("probe_w4_tiled.py", __doc__, LARGE_SHAPES, [1], 7)
    p.add_argument("--plans", type=json.loads, default=[], help="plan field overrides timed beside op and tiled (JSON list)")
    a = p.parse_args(argv)
    res = common.probe_result("w4_tiled")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    for n, k in a.shapes:
        if n % 32:
            print(f"{n}x{k}: N % 32 != 0, skipped", flush=True)
            continue
        w = gptq_native(n, k)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            used = niw.plan(m, n, k, 0)
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)

            def variant(fields, used=used, m=m, n=n, k=k):
                """``used`` with ``fields``: the launch-shaping ones through make_plan (shared memory and
                workspace follow), the build-only ones (probe) replaced."""
                shaping = {f: fields[f] for f in PLAN_KNOBS if f in fields}
                p = used
                if shaping:
                    base = {f: getattr(used, f) for f in PLAN_KNOBS}
                    p = niw.make_plan(m, n, k, **(base | shaping), smem_limit=niw.smem_optin_bytes(0))
                return dataclasses.replace(p, **{f: v for f, v in fields.items() if f not in PLAN_KNOBS})

            def under(fields, f):
                p = variant(fields)

                def g():
                    with niw.plan_override(lambda *_: p):
                        return f()
                return g

            variants = {"op": {}, "tiled": {"probe": 1}} | {json.dumps(f, sort_keys=True): f for f in a.plans}
            row = {"N": n, "K": k, "M": m, "plan": str(used), "roofline_us": round(roof, 2)}
            want = w.mm(x).float()
            for name, fields in variants.items():
                if name not in ("op", "tiled"):
                    row[name + "_rel_err_vs_op"] = common.rel_err(under(fields, lambda w=w: w.mm(x))(), want)
            cands = {name: [under(fields, lambda w=w: w.mm(x)) for w in ws] for name, fields in variants.items()}
            ts = common.graph_times(cands, a.trials, 5.0)
            for name, t in ts.items():
                common.add_time(row, name, t.us, roof)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del w, ws
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_w4_tiled.json", a.out))
    names = ["op", "tiled"] + [json.dumps(f, sort_keys=True) for f in a.plans]
    print("\nN x K | M | " + " | ".join(f"{v} %" for v in names) + " (of the roofline)")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | " + " | ".join(str(r.get(v + "_roof_pct", "-")) for v in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
