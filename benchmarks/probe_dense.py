"""Where does the Triton lowering's dense path (M >= 256: dequantize N-slabs, multiply with cuBLAS) lose
to cuBLAS fp16, and which dense config wins back the most (H200)?

Per shape and M, with interleaved trials over rotated weight copies (method of ``common.py``), GPTQ
v2, 4 bits (``--bits 8``: 8), group 128, asymmetric, fp16 x:

- ``op``: ``triton_mm`` at the shipped config;
- each config of ``--configs`` (JSON list of dense-config fields merged into the shipped bucket, e.g.
  '[{"slab_bytes": 268435456}, {"overlap": 1}]': a 256 MB slab; slab i + 1 dequantized on a side
  stream under slab i's GEMM), each checked against the op's output;
- the parts of the shipped config alone: ``dequant`` (its dequantization launches into one slab
  buffer), ``gemms`` (its cuBLAS calls on an already dense slab buffer), and ``cublas`` (one
  ``F.linear`` on the whole dense fp16 weight, the peer the PERF.md target names).

    PYTHONPATH=. python benchmarks/probe_dense.py [--shapes 8192x28672,...] [--ms 256,2048] [--configs JSON] [--out F]
"""
from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F

import common
from common import PERF_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from qops.formats import FORMATS  # noqa: E402
from qops.ops.triton import int_weight as T  # noqa: E402


def gptq_weight(n: int, k: int, bits: int):
    """A GPTQ ``bits``-bit g128 asymmetric (N, K) weight on the GPU, prepared for fp16 x."""
    fmt = FORMATS["gptq"]
    w = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
    return fmt.prepare(fmt.quantize(w, bits=bits, group_size=128, sym=False), dtype=torch.float16)


def table_with(base: dict, bits: int, m: int, fields: dict) -> dict:
    """The config table ``base`` with the dense fields ``fields`` merged into the bucket M falls in."""
    t = copy.deepcopy(base)
    by_m = t["gemm"][str(bits)]
    key = str(T.pick_bucket([(b, b) for b in sorted(int(b) for b in by_m)], m)[1])
    by_m[key] = {**by_m[key], **fields}
    return t


def main(argv=None) -> int:
    p = common.probe_parser("probe_dense.py", __doc__, PERF_SHAPES, [256, 2048], 7)
    p.add_argument("--configs", type=json.loads, default=[], help="dense config field overrides (JSON list)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    a = p.parse_args(argv)
    res = common.probe_result("dense")
    if res is None:
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    base = T.config_for(dev)
    bw = res["copy_TBps"]
    res["bf16_TFLOPs"] = round(common.bf16_TFLOPs(5), 1)  # measured once: the roofline's compute ceiling
    for n, k in a.shapes:
        w = gptq_weight(n, k, a.bits)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        dense = w.dequantize(torch.float16)
        ds = [dense] + [dense.clone() for _ in range(n_copies(dense.numel() * 2) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            plan = T._plan(m, n, k, a.bits, 128, dev, "dense")
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw, 2.0 * m * n * k, res["bf16_TFLOPs"])
            row = {"N": n, "K": k, "M": m, "bits": a.bits, "slab": plan["slab"], "cfg": plan["cfg"], "roofline_us": round(roof, 2)}

            def op(v, table):
                def f():
                    with T.config_override(table):
                        return T.triton_mm(x, v.qweight, v.scales, v.qzeros, v.act_perm, None, a.bits, 128, v.zero_offset, force_path="dense")
                return f

            want = op(w, base)()
            cands = {"op": [op(v, base) for v in ws]}
            for fields in a.configs:
                name = json.dumps(fields, sort_keys=True)
                t = table_with(base, a.bits, m, fields)
                row[name + "_rel_err_vs_op"] = common.rel_err(op(w, t)(), want)
                cands[name] = [op(v, t) for v in ws]
            buf = torch.empty((k, plan["slab"]), dtype=torch.float16, device="cuda")
            out = torch.empty((m, n), dtype=torch.float16, device="cuda")

            def dequant(v):
                def f():
                    for n0 in range(0, n, plan["slab"]):
                        T._dequant_slab(plan, v.qweight, v.scales, v.qzeros, v.act_perm, a.bits, 128, v.zero_offset, k, n, n0, buf)
                return f

            def gemms():
                for n0 in range(0, n, plan["slab"]):
                    width = min(plan["slab"], n - n0)
                    torch.mm(x, buf[:, :width], out=out[:, n0:n0 + width])

            cands["dequant"] = [dequant(v) for v in ws]
            cands["gemms"] = [gemms]
            cands["cublas"] = [lambda d=d: F.linear(x, d) for d in ds]
            common.time_row(res, row, cands, a.trials, roof, 20.0, ratio=("op_x_cublas", "cublas", "op"))
        del w, ws, dense, ds
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_dense.json", a.out))
    names = ["op"] + [json.dumps(f, sort_keys=True) for f in a.configs] + ["dequant", "gemms", "cublas"]
    print("\nN x K | M | " + " | ".join(f"{v} us" for v in names))
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | " + " | ".join(str(r.get(v + "_us")) for v in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
