"""Past 64 rows: is the native W4A16 GEMM in 64-row slices faster than the Triton lowering, and up to what M?

Above ``int_weight_gemm.MAX_M`` (64) rows the native lowering hands a call to Triton (its tiled GEMM or
its dense path: dequantized slabs, then cuBLAS) unless ``int_weight.SLICED_ROWS`` lets it run the call
as 64-row GEMM launches and one for the rest (the rest up to 16 or 23 rows in the decode kernel), each
launch reading the whole weight. Per shape and M this times, interleaved over rotated weight copies
(method of ``common.py``): the op through the Triton lowering, the op through the native lowering with
every M sliced (``QOPS_NATIVE_SLICED_ROWS``), and cuBLAS fp16 on a dense copy; the sliced output is
checked against a float64 reference. GPTQ v2, 4 bits, group 128, asymmetric, fp16 x (``--dtype
bfloat16``: bf16 x and scales, and cuBLAS bf16). The last column of the table is what ``SLICED_ROWS``
is fitted to: Triton's time over the slices'.

    PYTHONPATH=. python benchmarks/probe_gemm_slices.py [--shapes 28672x4096,...] [--ms 65,96,128,...] [--dtype bfloat16] [--out F]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

import common
from common import PERF_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.lowerings import LOWERINGS_BY_NAME  # noqa: E402
from qops.native import int_weight as native  # noqa: E402

SHAPES = PERF_SHAPES + [(6144, 4096), (14336, 4096)]
MS = [65, 80, 96, 128, 160, 192, 256]


def sliced(f):
    """``f`` with every M of the call run as native slices (the override read at each call)."""
    def g():
        kept = os.environ.get(native.SLICED_ROWS_ENV)
        os.environ[native.SLICED_ROWS_ENV] = str(1 << 20)
        try:
            return f()
        finally:
            if kept is None:
                del os.environ[native.SLICED_ROWS_ENV]
            else:
                os.environ[native.SLICED_ROWS_ENV] = kept
    return g


def main(argv=None) -> int:
    p = common.probe_parser("probe_gemm_slices.py", __doc__, SHAPES, MS, 5)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="activation dtype")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    res = common.probe_result("gemm_slices")
    if res is None:
        return 2
    res["dtype"] = a.dtype
    bw = res["copy_TBps"]
    triton_kernel = LOWERINGS_BY_NAME["triton_int_weight"].kernel
    for n, k in a.shapes:
        w = gptq_native(n, k, dtype=dtype)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        wt = [dataclasses.replace(v, kernel=triton_kernel) for v in ws]
        dense = w.dequantize(dtype)
        ds = [dense] + [dense.clone() for _ in range(n_copies(dense.numel() * 2) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)
            row = {"N": n, "K": k, "M": m, "roofline_us": round(roof, 2)}
            want = (x.double() @ dense.double().t()).float()
            row["sliced_rel_err"] = common.rel_err(sliced(lambda: w.mm(x))(), want)
            row["triton_rel_err"] = common.rel_err(wt[0].mm(x), want)
            cands = {"sliced": [sliced(lambda v=v: v.mm(x)) for v in ws], "triton": [lambda v=v: v.mm(x) for v in wt],
                     "cublas": [lambda d=d: torch.nn.functional.linear(x, d) for d in ds]}
            common.time_row(res, row, cands, a.trials, roof, ratio=("triton_over_sliced", "triton", "sliced"))
            row["cublas_over_sliced"] = round(row["cublas_us"] / row["sliced_us"], 3)
            common.write_json(res, common.output_paths("probe_gemm_slices.json", a.out))
        del w, ws, wt, ds, dense
        torch.cuda.empty_cache()
    print(f"\n{a.dtype}: N x K | M | sliced us | triton us | cuBLAS us | triton / sliced | cuBLAS / sliced")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['sliced_us']} | {r['triton_us']} | {r['cublas_us']} | "
              f"{r['triton_over_sliced']} | {r['cublas_over_sliced']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
