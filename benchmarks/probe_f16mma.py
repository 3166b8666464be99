"""Is the native W4A16 kernel faster on bf16 x when its MMAs run in f16 (H200)?

bf16's dequantization takes three more shifts a word than f16's, and the kernel ran 3-9% slower on
bf16 x at M = 1 (benchmarks/NOTES.md, stop 20). ``Plan.f16mma`` stages bf16 x as f16 with a
power-of-two scale a row and runs the MMAs in f16 (w4a16_gemv.cu, QOPS_F16MMA). Per shape and M the
plan the op uses on bf16 x is timed as it is and with ``f16mma``, interleaved, over rotated weight
copies (method of ``common.py``), with the op on fp16 x beside them for reference; each row also
gives the two bf16 results' relative difference. GPTQ v2, 4 bits, group 128, asymmetric. Plans that
stage x per iteration are skipped (the option needs x staged once).

    PYTHONPATH=. python benchmarks/probe_f16mma.py [--shapes 28672x4096,...] [--ms 1,4,8,16] [--out F]
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import common
from common import clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

# The decode layers' shapes: Llama-3 8B (qkv, o, gate/up, down) and the two 70B-sized PERF shapes.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]


def main(argv=None) -> int:
    a = common.probe_parser("probe_f16mma.py", __doc__, SHAPES, [1, 4, 8, 16], 7).parse_args(argv)
    res = common.probe_result("f16mma")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    for n, k in a.shapes:
        w16 = gptq_native(n, k)
        wb = dataclasses.replace(w16, scales=w16.scales.to(torch.bfloat16))
        copies = {"fp16": [w16] + [clone_tensors(w16) for _ in range(n_copies(w16.nbytes()) - 1)]}
        copies["bf16"] = [wb] + [clone_tensors(wb) for _ in range(len(copies["fp16"]) - 1)]
        for m in a.ms:
            p = dataclasses.replace(niw.plan(m, n, k, 0), f16mma=False)  # the bf16 MMAs, whatever the rule picks
            row = {"N": n, "K": k, "M": m, "plan": str(p)}
            if not p.xfull:
                row["skipped"] = "the plan stages x per iteration"
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                continue
            on = dataclasses.replace(p, f16mma=True)
            x16 = torch.randn(m, k, device="cuda", dtype=torch.float16)
            xb = x16.to(torch.bfloat16)
            roof = common.roofline_us(w16.nbytes() + 2 * m * (k + n), bw)
            row["roofline_us"] = round(roof, 2)

            def under(plan, f):
                def g():
                    with niw.plan_override(lambda *_: plan):
                        return f()
                return g

            row["f16mma_rel_diff_vs_bf16"] = common.rel_err(under(on, lambda: wb.mm(xb))(), under(p, lambda: wb.mm(xb))().double())
            cands = {"fp16": [under(p, lambda w=w: w.mm(x16)) for w in copies["fp16"]],
                     "bf16": [under(p, lambda w=w: w.mm(xb)) for w in copies["bf16"]],
                     "bf16_f16mma": [under(on, lambda w=w: w.mm(xb)) for w in copies["bf16"]]}
            common.time_row(res, row, cands, a.trials, roof, ratio=("f16mma_over_bf16", "bf16_f16mma", "bf16"))
        del copies, w16, wb
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_f16mma.json", a.out))
    print("\nN x K | M | fp16 us | bf16 us | bf16 f16mma us | f16mma / bf16 | rel diff")
    for r in res["rows"]:
        if "skipped" in r:
            print(f"{r['N']}x{r['K']} | {r['M']} | skipped: {r['skipped']}")
            continue
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['fp16_us']} | {r['bf16_us']} | {r['bf16_f16mma_us']} | {r['f16mma_over_bf16']} | "
              f"{r['f16mma_rel_diff_vs_bf16']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
