"""The Gluon W4A16 GEMM (``qops/ops/triton/int_weight_wgmma.py``: the weight as the warpgroup MMA's register
operand, asynchronous MMAs over a ``cp.async`` ring) against the shipped Triton lowering and cuBLAS fp16.

Why (benchmarks/NOTES.md, stop 64): the Triton GEMM's M = 64 tile waits for its MMAs every K step and stores its
unpacked weight tile to shared memory first; #3's M = 64 target (2x cuBLAS fp16) is missed at 1.09-1.29x on an
H100. First every candidate tile is checked against the float64 product with the dequantized weight on odd
cases (M = 1 / 17 / 64 / 257, N off the tile grid, fp16 and bf16, asymmetric and symmetric, act-order, flat and
column-slab qweight, K splits, a strided x); a failed check is printed and the candidate is not timed. Then,
per shape and M, the shipped op (``w.mm``, the Triton lowering), each candidate and ``F.linear`` with the fp16
weight are timed interleaved over rotated weight copies (CUDA-graph replays, ``common.graph_times``).

    PYTHONPATH=. python benchmarks/probe_wgmma_w4.py [--shapes 28672x4096,...] [--ms 16,32,64,128]
        [--tiles JSON] [--splits 1,2,3] [--act-order] [--out F]

``--act-order`` also times the shipped op on an act-order weight of each shape (``shipped_actorder``), checked
against its own float64 product (stop 72: the x gather reads ``act_perm`` itself; one launch fewer a call), and the
same op with x's gather forced onto each of its routes (``actorder_direct`` / ``actorder_transposed``:
``x_gather.TRANSPOSED_FROM_MK`` set for the call; the shipped op takes the transposed route from that many values, M x K).
``--lowering native_w4a16`` times the native lowering as the shipped op (with ``--tiles '{}'``: no candidates).
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.ops import int_weight as IW  # noqa: E402
from qops.ops.triton import int_weight_wgmma as G  # noqa: E402
from qops.ops.triton import x_gather as X  # noqa: E402

TILES = {"n128m64": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4},
         "n64m64": {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 64, "STAGES": 4},
         "n128m64k128": {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3},
         "n128m16": {"BLOCK_N": 128, "BLOCK_M": 16, "BLOCK_K": 64, "STAGES": 4}}


def routed(fn, from_mk: int):
    """``fn`` run with the act-order gather's transposed route taken from ``from_mk`` values of x (1: always; a huge
    number: never); the graph capture records whichever launches that gives."""
    def call():
        keep = X.TRANSPOSED_FROM_MK
        X.TRANSPOSED_FROM_MK = from_mk
        try:
            return fn()
        finally:
            X.TRANSPOSED_FROM_MK = keep
    return call


def act_order_weight(n: int, k: int, dtype: torch.dtype, sym: bool):
    """A GPTQ W4 g128 weight whose groups are scattered over K (act-order), prepared for ``dtype``."""
    from qops.formats import FORMATS

    fmt = FORMATS["gptq"]
    w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    g_idx = (torch.randperm(k, device="cuda") // 128).to(torch.int32)
    return fmt.prepare(fmt.quantize(w, bits=4, group_size=128, sym=sym, g_idx=g_idx), dtype=dtype)


def check_cases() -> list[dict]:
    """(N, K, M, dtype, symmetric, act-order, qweight form, split, strided x) cases for the oracle check."""
    cases = []
    for m in (1, 17, 64, 257):
        cases.append(dict(n=4104, k=1024, m=m, dtype=torch.float16, sym=False, act=False, form="flat", split=1, strided=False))
    cases += [
        dict(n=4104, k=1024, m=17, dtype=torch.bfloat16, sym=False, act=False, form="flat", split=1, strided=False),
        dict(n=4096, k=2048, m=64, dtype=torch.bfloat16, sym=True, act=False, form="slabs", split=3, strided=True),
        dict(n=4104, k=1024, m=33, dtype=torch.float16, sym=True, act=True, form="flat", split=2, strided=False),
        dict(n=4096, k=1024, m=64, dtype=torch.float16, sym=False, act=True, form="slabs", split=1, strided=True),
        dict(n=2048, k=4096, m=64, dtype=torch.float16, sym=False, act=False, form="flat", split=4, strided=False),
    ]
    return cases


def checked(tile: dict) -> list[dict]:
    """The oracle check of ``tile`` over :func:`check_cases` (one row each, with its relative error)."""
    rows = []
    for c in check_cases():
        if c["act"]:
            w = act_order_weight(c["n"], c["k"], c["dtype"], c["sym"])
        else:
            w = gptq_native(c["n"], c["k"], "triton_int_weight", dtype=c["dtype"], sym=c["sym"])
        qw = IW.flat_qweight(w.qweight) if c["form"] == "flat" else IW.to_column_slabs(IW.flat_qweight(w.qweight))
        base = torch.randn(c["m"], c["k"] + 64, device="cuda", dtype=c["dtype"])
        x = base[:, 32:32 + c["k"]] if c["strided"] else base[:, :c["k"]].contiguous()
        bias = torch.randn(c["n"], device="cuda", dtype=c["dtype"])
        want = x.double() @ w.dequantize(torch.float64).T + bias.double()
        row = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in c.items()}
        try:
            split = None if tile.get("stream_k") else c["split"]  # a stream-K tile is checked as it runs
            got = G.wgmma_mm(x, qw, w.scales, w.qzeros, w.act_perm, bias, w.group_size, w.zero_offset, tile, split)
            row["rel_err"] = common.rel_err(got, want)
            limit = 2e-3 if c["dtype"] == torch.float16 else 1.5e-2
            row["ok"] = row["rel_err"] is not None and row["rel_err"] < limit
        except Exception as e:  # noqa: BLE001 - the failure is the result
            row.update(ok=False, error=common.short_err(e))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = common.probe_parser("probe_wgmma_w4.py", __doc__, LARGE_SHAPES, [16, 32, 64, 128], 7)
    p.add_argument("--tiles", type=json.loads, default=TILES, help="candidate tiles, JSON {name: {BLOCK_N, BLOCK_M, ...}}")
    p.add_argument("--splits", default="1,2,3", help="K splits timed for each tile; 0: the tile's own launch "
                   "(stream-K where it says stream_k, else its ctas_per_sm rule)")
    p.add_argument("--act-order", action="store_true",
                   help="also time the shipped op on an act-order weight of each shape (its groups scattered over K), "
                        "checked against its own float64 product: what act-order costs the shipped launch")
    p.add_argument("--lowering", default="triton_int_weight",
                   help="the lowering the shipped op (and --act-order's) runs on (native_w4a16: the native decode "
                        "kernel and GEMM, whose act-order gather is x_gather's too); candidate tiles are the wgmma kernel's")
    a = p.parse_args(argv)
    res = common.probe_result("wgmma_w4")
    if res is None:
        return 2
    res["lowering"] = a.lowering
    splits = [int(s) or None for s in a.splits.split(",")]
    res["checks"] = {}
    good = {}
    for name, tile in a.tiles.items():
        rows = checked(tile)
        res["checks"][name] = rows
        bad = [r for r in rows if not r["ok"]]
        print(f"check {name}: {len(rows) - len(bad)}/{len(rows)} ok" + "".join(f"\n  FAILED {r}" for r in bad), flush=True)
        if not bad:
            good[name] = tile
    bw = res["copy_TBps"]
    for (n, k), m in [(shape, m) for shape in a.shapes for m in a.ms]:
        w = gptq_native(n, k, a.lowering)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        flat = [dataclasses.replace(v, qweight=IW.flat_qweight(v.qweight)) for v in ws]
        dense = [v.dequantize(torch.float16) for v in ws[:max(2, n_copies(2 * n * k))]]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        want = x.double() @ w.dequantize(torch.float64).T
        roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)
        row = {"N": n, "K": k, "M": m, "roofline_us": round(roof, 2)}
        cands = {"shipped": [lambda v=v: v.mm(x) for v in ws], "cublas_fp16": [lambda d=d: F.linear(x, d) for d in dense]}
        wa = was = None
        if a.act_order:
            wa = dataclasses.replace(act_order_weight(n, k, torch.float16, False), kernel=ws[0].kernel)
            was = [wa] + [clone_tensors(wa) for _ in range(len(ws) - 1)]
            want_a = x.double() @ wa.dequantize(torch.float64).T
            row["shipped_actorder_rel_err"] = common.rel_err(wa.mm(x), want_a)
            cands["shipped_actorder"] = [lambda v=v: v.mm(x) for v in was]
            for route, from_mk in (("direct", 1 << 62), ("transposed", 1)):
                row[f"actorder_{route}_rel_err"] = common.rel_err(routed(lambda: wa.mm(x), from_mk)(), want_a)
                cands[f"actorder_{route}"] = [routed(lambda v=v: v.mm(x), from_mk) for v in was]
        for name, tile in good.items():
            for s in splits:
                cname = f"{name}_s{s}" if s else f"{name}_own"

                def call(v, tile=tile, s=s):
                    return G.wgmma_mm(x, v.qweight, v.scales, v.qzeros, v.act_perm, None, v.group_size, v.zero_offset, tile, s)
                try:
                    row[cname + "_rel_err"] = common.rel_err(call(flat[0]), want)
                    cands[cname] = [lambda v=v, call=call: call(v) for v in flat]
                except Exception as e:  # noqa: BLE001
                    row[cname + "_error"] = common.short_err(e)
        common.time_row(res, row, cands, a.trials, roof)
        tiles = [c for c in cands if c not in ("shipped", "shipped_actorder", "cublas_fp16") and not c.startswith("actorder_")
                 and c + "_us" in row]
        best = min(tiles, key=lambda c: row[c + "_us"], default=None)
        if best:
            row["best"] = best
            row["best_vs_shipped"] = round(row["shipped_us"] / row[best + "_us"], 3)
            row["best_vs_cublas"] = round(row["cublas_fp16_us"] / row[best + "_us"], 3)
        del w, ws, flat, dense, cands, wa, was
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_wgmma_w4.json", a.out))
    print("\nN x K, M | shipped us | cuBLAS fp16 us | best wgmma (us) | x shipped | x cuBLAS")
    for r in res["rows"]:
        b = r.get("best")
        print(f"{r['N']}x{r['K']}, {r['M']} | {r.get('shipped_us')} | {r.get('cublas_fp16_us')} | "
              f"{b} ({r.get(b + '_us') if b else None}) | {r.get('best_vs_shipped')} | {r.get('best_vs_cublas')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
