"""NF4 codes through the W4A16 decode kernel (``qops.native.codebook_w4``: ``w4a16_gemv.cu`` with
``QOPS_LUT``, the codes decoded through a table of the codebook, absmax a column and 64 rows in fp32)
against the native NF4 kernel (``blockwise4_gemv.cu``, nested absmax, as bench_bnb_int8 times it) and
the W4A16 kernel on GPTQ W4 g128, in one run (H200). Each at its own roofline (the bytes it reads:
NF4 nested 0.516 bytes a weight, the table path with f16 absmax 0.531, W4 g128 0.53), interleaved
trials over rotated weight copies (method of ``common.py``). The table path's output is checked
against a float64 oracle of its own tensors.

The question (benchmarks/NOTES.md, stop 39): #5 asks NF4 at M = 1 for 60% of the roofline; the NF4
kernel reaches 57 / 49 / 64 / 65% on the four large shapes where the W4A16 kernel reaches 80 / 70 / 91 /
90% on nearly the same bytes. If the table path keeps most of the W4A16 speed, NF4 belongs on that
kernel (its absmax would then need de-nesting inside the kernel: f16 absmax is 3% over a nested
checkpoint's bytes, which the 2% budget does not allow). ``--plans`` (JSON list of plan fields, e.g.
'[{"minb": 1}, {"nwn": 2, "splits": 2, "cluster": true}]') times the table path at other plans too.

    PYTHONPATH=. python benchmarks/probe_w4_lut.py [--shapes 28672x4096,...] [--ms 1,16] [--plans JSON] [--out F]
"""
from __future__ import annotations

import json
import sys

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from bench_bnb_int8 import call as nf4_call, nf4_weight, weight_bytes  # noqa: E402
from probe_early_pdl import gptq_native  # noqa: E402
from qops.formats.bitsandbytes import codebook  # noqa: E402
from qops.native import codebook_w4 as cw  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

def lut_weight(n: int, k: int, gen: torch.Generator) -> dict:
    """Random NF4 codes in the table path's layout, absmax in f16 (about bitsandbytes' 0.01-0.03 range)."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    scales = ((torch.rand(k // cw.GROUP, n, device="cuda", generator=gen) + 0.5) * 0.02).to(torch.float16)
    return {"qweight": cw.pack_codes(codes), "scales": scales, "codebook": codebook("nf4").cuda().float().contiguous()}


def lut_bytes(n: int, k: int) -> float:
    return n * k / 2 + 2 * n * k / cw.GROUP + 64


def main(argv=None) -> int:
    p = common.probe_parser("probe_w4_lut.py", __doc__, LARGE_SHAPES, [1, 16], 7)
    p.add_argument("--plans", type=json.loads, default=[], help="plan fields for further table-path rows (JSON list)")
    a = p.parse_args(argv)
    res = common.probe_result("w4_lut")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in a.shapes:
        lw = lut_weight(n, k, gen)
        lws = [lw] + [{f: t.clone() for f, t in lw.items()} for _ in range(n_copies(lut_bytes(n, k)) - 1)]
        nf = nf4_weight(n, k, "cuda", gen)
        nfs = [nf] + [clone_tensors(nf) for _ in range(n_copies(weight_bytes("nf4", n, k)) - 1)]
        w4 = gptq_native(n, k)
        w4s = [w4] + [clone_tensors(w4) for _ in range(n_copies(w4.nbytes()) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            io = 2 * m * (k + n)
            roofs = {"nf4": common.roofline_us(weight_bytes("nf4", n, k) + io, bw),
                     "w4": common.roofline_us(w4.nbytes() + io, bw),
                     "lut": common.roofline_us(lut_bytes(n, k) + io, bw)}
            base = niw.plan(m, n, k, 0)
            limit = niw.smem_optin_bytes(0)
            lut = niw.lut_plan(base, n, k, limit)  # what codebook_mm launches
            row = {"N": n, "K": k, "M": m, "w4_plan": str(base), "lut_plan": str(lut)}
            cands = {"nf4": [lambda w=w: nf4_call(w, x) for w in nfs], "w4": [lambda w=w: w.mm(x) for w in w4s]}
            variants = {"lut": None}
            for f in a.plans:
                name = "lut " + json.dumps(f, sort_keys=True)
                try:
                    variants[name] = niw.remake_plan(lut, n, k, limit, **f)
                except ValueError as e:
                    row[name + "_refused"] = str(e)

            def lut_call(lw, plan):
                def g():
                    if plan is None:
                        return cw.codebook_mm(x, lw["qweight"], lw["scales"], lw["codebook"])
                    with niw.plan_override(lambda *_: plan):
                        return cw.codebook_mm(x, lw["qweight"], lw["scales"], lw["codebook"])
                return g

            want = cw.reference_mm(x, lw["qweight"], lw["scales"], lw["codebook"])
            for name, plan in variants.items():
                row[name + "_rel_err"] = common.rel_err(lut_call(lw, plan)(), want)
                cands[name] = [lut_call(v, plan) for v in lws]
                roofs[name] = roofs["lut"]
            for name, t in common.graph_times(cands, a.trials, 5.0).items():
                common.add_time(row, name, t.us, roofs[name])
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            common.write_json(res, common.output_paths("probe_w4_lut.json", a.out))  # a run cut short keeps its rows
        del lws, nfs, w4s, lw, nf, w4
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_w4_lut.json", a.out))
    names = ["nf4", "w4", "lut"] + ["lut " + json.dumps(f, sort_keys=True) for f in a.plans]
    print("\nN x K | M | " + " | ".join(f"{v} us (% roof)" for v in names) + " | lut rel err")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | "
              + " | ".join(f"{r.get(v + '_us', '-')} ({r.get(v + '_roof_pct', '-')})" for v in names) + f" | {r.get('lut_rel_err')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
