"""The native W4A16 lowering on its two qweight forms, in one run (H200): flat (GPTQ's (K/8, N) words:
a warp's step reads 128 contiguous bytes of each of 4 rows 4N bytes apart) against 32-column slabs
(qops/ops/int_weight.py: the step's 512 bytes contiguous, consecutive steps adjacent), at the op's
own plan. Stops 17 and 23 timed a reads-only build of the decode kernel that way (QOPS_PROBE 1, wrong
sums): +1.9-3.8% at M = 1 (h200-2026-12-01-2743492-probe-w4-tiled.json). Per shape and M both forms
are timed with interleaved trials over rotated weight copies (method of ``common.py``), GPTQ v2,
4 bits, group 128, asymmetric, fp16 x, and their outputs must be bit-identical (the same sums in the
same order). ``--plans`` adds, on the decode kernel's rows, the slab form at its plan with other
fields (JSON list, e.g. '[{"smem_ring": 4, "smem_bulk": true}]': the ring filled by whole-chunk
bulk copies), each checked against the op's output; a plan the kernel refuses is recorded as
``<plan>_refused``. The same question for the NF4 kernel is ``probe_nf4_native.py --probes
op,tiled``. Needs N % 32 == 0.

    PYTHONPATH=. python benchmarks/probe_w4_slabs.py [--shapes 28672x4096,...] [--ms 1,16,64] [--plans JSON] [--out F]
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
from qops.native import int_weight_gemm as gemm  # noqa: E402
from qops.ops.int_weight import with_qweight_form  # noqa: E402


PLAN_KNOBS = ("nwn", "splits", "cluster", "xfull", "ring", "minb", "fold", "prefetch", "smem_ring", "wgmma")


def main(argv=None) -> int:
    p = common.probe_parser("probe_w4_slabs.py", __doc__, LARGE_SHAPES, [1, 16, 64], 7)
    p.add_argument("--plans", type=json.loads, default=[], help="plan field overrides timed beside flat and slabs (JSON list)")
    a = p.parse_args(argv)
    res = common.probe_result("w4_slabs")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    for n, k in a.shapes:
        if n % 32:
            print(f"{n}x{k}: N % 32 != 0, skipped", flush=True)
            continue
        w = gptq_native(n, k)
        if w.qweight.dim() != 3:
            print(f"{n}x{k}: prepared without column slabs ({tuple(w.qweight.shape)}), skipped", flush=True)
            continue
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        flats = [with_qweight_form(v, "flat") for v in ws]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            decode = m <= niw.decode_rows(n, k, 0)
            used = niw.plan(m, n, k, 0) if decode else gemm.plan(m, n, k, 0)  # --plans: decode plans only
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)

            def variant(fields, used=used, m=m, n=n, k=k):
                """``used`` with ``fields``: the launch-shaping ones through make_plan (shared memory and
                workspace follow), the build-only ones replaced."""
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

            row = {"N": n, "K": k, "M": m, "plan": str(used), "roofline_us": round(roof, 2)}
            variants = {}
            for f in a.plans if decode else []:  # a plan the kernel cannot run is recorded, not timed
                try:
                    variant(f)
                    variants[json.dumps(f, sort_keys=True)] = f
                except ValueError as e:
                    row[json.dumps(f, sort_keys=True) + "_refused"] = str(e)
            want = w.mm(x)
            row["slabs_bit_identical_to_flat"] = bool(torch.equal(flats[0].mm(x), want))
            for name, fields in variants.items():
                row[name + "_rel_err_vs_op"] = common.rel_err(under(fields, lambda w=w: w.mm(x))(), want.float())
            cands = {"flat": [lambda v=v: v.mm(x) for v in flats], "slabs": [lambda v=v: v.mm(x) for v in ws]}
            cands |= {name: [under(fields, lambda w=w: w.mm(x)) for w in ws] for name, fields in variants.items()}
            ts = common.graph_times(cands, a.trials, 5.0)
            for name, t in ts.items():
                common.add_time(row, name, t.us, roof)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del w, ws, flats
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_w4_slabs.json", a.out))
    names = ["flat", "slabs"] + [json.dumps(f, sort_keys=True) for f in a.plans]
    print("\nN x K | M | " + " | ".join(f"{v} us" for v in names) + " | flat / slabs | bit-identical")
    for r in res["rows"]:
        ratio = r["flat_us"] / r["slabs_us"] if r.get("slabs_us") else float("nan")
        print(f"{r['N']}x{r['K']} | {r['M']} | " + " | ".join(str(r.get(v + "_us", "-")) for v in names)
              + f" | {ratio:.3f} | {r['slabs_bit_identical_to_flat']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
