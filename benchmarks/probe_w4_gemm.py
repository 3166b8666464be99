"""Is the native W4A16 GEMM (``w4a16_gemm.cu``, M = 33..64) faster than what served those rows before?

Per shape and M: the op through the native lowering at the rule's GEMM plan, the same weight through
the Triton lowering (its plan: the tiled GEMM or the dense path), cuBLAS fp16 on a dense copy, and
the GEMM at each plan of ``--plans`` (JSON list of field overrides, e.g. '[{"nwn": 2}, {"splits": 2},
{"ring": 3}]'), each checked against the op's output. ``"gemm": 1`` in a plan sends every row to the GEMM
(the op's routing pointed there for that call), ``"gemm": 0`` rows up to 32 to the decode kernel; without
it, the op's own routing (``int_weight.decode_rows``). Timed with interleaved trials over rotated weight
copies (method of ``common.py``), GPTQ v2, 4 bits, group 128, asymmetric, fp16 x.

    PYTHONPATH=. python benchmarks/probe_w4_gemm.py [--shapes 28672x4096,...] [--ms 33,48,64] [--plans JSON] [--out F]
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import common
from common import PERF_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.lowerings import LOWERINGS_BY_NAME  # noqa: E402
from qops.native import int_weight as native  # noqa: E402
from qops.native import int_weight_gemm as gemm  # noqa: E402


def main(argv=None) -> int:
    p = common.probe_parser("probe_w4_gemm.py", __doc__, PERF_SHAPES, [33, 48, 64], 7)
    p.add_argument("--plans", type=json.loads, default=[], help="GEMM plan field overrides timed beside the rule (JSON list)")
    a = p.parse_args(argv)
    res = common.probe_result("w4_gemm")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    triton_kernel = LOWERINGS_BY_NAME["triton_int_weight"].kernel
    dev = torch.cuda.current_device()
    for n, k in a.shapes:
        w = gptq_native(n, k)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        wt = [dataclasses.replace(v, kernel=triton_kernel) for v in ws]
        dense = w.dequantize(torch.float16)
        ds = [dense] + [dense.clone() for _ in range(n_copies(dense.numel() * 2) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            rule = gemm.plan(m, n, k, dev)
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)
            row = {"N": n, "K": k, "M": m, "plan": str(rule), "roofline_us": round(roof, 2)}
            want = (x.double() @ dense.double().t()).float()
            row["op_rel_err"] = common.rel_err(w.mm(x), want)
            row["triton_rel_err"] = common.rel_err(wt[0].mm(x), want)

            def under(fields, f, m=m, n=n, k=k):
                fields = dict(fields)
                route = fields.pop("gemm", None)
                rows = native.decode_rows if route is None else (lambda *_: 0 if route else native.MAX_M)
                q = gemm.with_fields(gemm.plan(m, n, k, dev), n, k, **fields)

                def g():
                    kept = native.decode_rows
                    native.decode_rows = rows  # the rows the decode kernel takes; 0: every call to the GEMM
                    try:
                        with gemm.plan_override(lambda *_: q):
                            return f()
                    finally:
                        native.decode_rows = kept
                return g

            cands = {"op": [lambda v=v: v.mm(x) for v in ws], "triton": [lambda v=v: v.mm(x) for v in wt],
                     "cublas_fp16": [lambda d=d: torch.nn.functional.linear(x, d) for d in ds]}
            for fields in a.plans:
                name = json.dumps(fields, sort_keys=True)
                try:
                    row[name + "_rel_err_vs_op"] = common.rel_err(under(fields, lambda: w.mm(x))(), w.mm(x).float())
                except ValueError as e:
                    row[name] = common.short_err(e)
                    continue
                cands[name] = [under(fields, lambda v=v: v.mm(x)) for v in ws]
            ts = common.graph_times(cands, a.trials, 5.0)
            for name, t in ts.items():
                common.add_time(row, name, t.us, roof)
            row["op_vs_triton"] = round(ts["triton"].us / ts["op"].us, 3)
            row["op_vs_cublas_fp16"] = round(ts["cublas_fp16"].us / ts["op"].us, 3)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del w, ws, wt, ds, dense
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_w4_gemm.json", a.out))
    names = ["op", "triton", "cublas_fp16"] + [json.dumps(f, sort_keys=True) for f in a.plans]
    print("\nN x K | M | " + " | ".join(f"{v} us" for v in names) + " | op vs triton | op vs cuBLAS fp16")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | " + " | ".join(str(r.get(v + "_us", "-")) for v in names)
              + f" | {r['op_vs_triton']} | {r['op_vs_cublas_fp16']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
