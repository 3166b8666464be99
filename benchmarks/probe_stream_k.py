"""The Triton int-weight GEMM with its K splits against the same tile as stream-K (``stream_k`` in a config).

Why (benchmarks/NOTES.md, stop 60): the 4-bit M = 16 tile (16 x 128 x 128, 3 programs an SM by its registers)
runs 28672x4096 as 224 column tiles x 3 splits = 672 programs, 1.70 waves, and is latency-bound at that
occupancy, so the second wave's 30% idle slots cost time. Counting a program's K steps (``common.split_in_waves``'
rounds), the splits take 22 rounds on 28672x4096 (ideal 18.1 = 7168 steps / 396 slots), 96 on 57344x8192 (72.4),
10 on 4096x14336 (9.1), 38 on 8192x28672 (36.2); stream-K takes the ideal plus each program's one or two tile
starts. Per M (``--ms``, GEMM buckets), this times the op with this card's shipped table, ``stream_k`` off (the
``shipped`` candidate: the split launch, as shipped before stop 63) and on (with ``--set``'s keys) on that M's 4-bit
GEMM bucket, interleaved over rotated weight copies (GPTQ W4 g128 asymmetric, fp16 x), each
checked against the float64 product with the dequantized weight; each row says whether the launch took stream-K
(``stream_k_taken``: the lowering takes it only where it saves ``STREAM_K_GAIN`` of the rounds; the first run,
h100-2026-12-06-1eed08c-probe-streamk, took it everywhere).

    PYTHONPATH=. python benchmarks/probe_stream_k.py [--shapes 28672x4096,...] [--ms 4,8,16,32,64] [--set JSON]
        [--variants JSON] [--symmetric] [--out F]

``--variants`` adds candidates: each a set of keys on the shipped bucket (stop 64: the 64-row tile with its
weight tile scaled before the MMA, ``scale_weight``).
"""
from __future__ import annotations

import copy
import json
import sys

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.ops.triton import int_weight as T  # noqa: E402


def bucket_table(m: int, keys: dict, device: str = "cuda") -> dict:
    """The shipped table of ``device`` with ``keys`` set on the 4-bit GEMM bucket that serves M = ``m``, less its
    ``wgmma`` kernel (this probe times the Triton GEMM's launches)."""
    table = copy.deepcopy(T.config_for(torch.device(device)))
    section = table["gemm"]["4"] if "4" in table["gemm"] else table["gemm"]["default"]
    bucket = min((int(b) for b in section if int(b) >= m), default=max(int(b) for b in section))
    section[str(bucket)].pop("wgmma", None)
    section[str(bucket)].update(keys)
    return table


def took_stream_k(f) -> bool:
    """Whether calling ``f`` launched the STREAM_K build (the launch takes it only where it saves rounds)."""
    seen = []
    real = T._tc_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(bool(kw.get("STREAM_K"))) or real[grid](*a, **kw)

        def __getattr__(self, name):  # the compile for the build's figures (``warmup``)
            return getattr(real, name)

    T._tc_kernel = Spy()
    try:
        f()
    finally:
        T._tc_kernel = real
    return any(seen)


def under(table: dict, f):
    """``f`` with ``table`` in force (read at launch, so a captured graph keeps it)."""
    def g():
        with T.config_override(table):
            return f()
    return g


def main(argv=None) -> int:
    p = common.probe_parser("probe_stream_k.py", __doc__, LARGE_SHAPES, [4, 16, 64], 7)
    p.add_argument("--set", type=json.loads, default={},
                   help='more keys for the stream-K candidate\'s bucket, JSON (say {"maxnreg": 168}: the 64 x 64 stream-K '
                        'build at 167 registers, three programs an SM like the split build, where uncapped it takes 189)')
    p.add_argument("--variants", type=json.loads, default={},
                   help='more candidates, JSON {name: keys set on the shipped bucket} (say {"sw": {"scale_weight": 1}}), '
                        'each timed beside the two with its own check and whether its launch took stream-K')
    p.add_argument("--symmetric", action="store_true",
                   help="symmetric weights (no zero points at run time: other builds), as bench_int_weight's")
    a = p.parse_args(argv)
    res = common.probe_result("stream_k")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    for (n, k), m in [(shape, m) for shape in a.shapes for m in a.ms]:
        w = gptq_native(n, k, "triton_int_weight", sym=a.symmetric)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)
        want = x.double() @ w.dequantize(torch.float64).T
        table, split_table = bucket_table(m, {"stream_k": 1, **a.set}), bucket_table(m, {"stream_k": 0})
        with T.config_override(table):
            plan = T._plan(m, n, k, 4, 128, x.device)
        row = {"N": n, "K": k, "M": m, "symmetric": w.qzeros is None, "roofline_us": round(roof, 2), "path": plan["path"],
               "tiles": plan["tiles"], "split": plan["split"], "stream_k": plan["stream_k"], "set": a.set}
        cands = {"shipped": [under(split_table, lambda v=v: v.mm(x)) for v in ws]}
        row["shipped_rel_err"] = common.rel_err(under(split_table, lambda: w.mm(x))(), want)
        try:
            row["stream_k_rel_err"] = common.rel_err(under(table, lambda: w.mm(x))(), want)
            row["stream_k_taken"] = took_stream_k(under(table, lambda: w.mm(x)))
            cands["stream_k"] = [under(table, lambda v=v: v.mm(x)) for v in ws]
        except Exception as e:  # noqa: BLE001  (a build the compiler or the device refuses)
            row["stream_k_error"] = common.short_err(e)
        for name, keys in a.variants.items():
            vt = bucket_table(m, keys)
            try:
                row[f"{name}_rel_err"] = common.rel_err(under(vt, lambda: w.mm(x))(), want)
                row[f"{name}_stream_k_taken"] = took_stream_k(under(vt, lambda: w.mm(x)))
                cands[name] = [under(vt, lambda v=v, vt=vt: v.mm(x)) for v in ws]
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = common.short_err(e)
        common.time_row(res, row, cands, a.trials, roof, ratio=("speedup", "shipped", "stream_k") if "stream_k" in cands else None)
        del w, ws
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_stream_k.json", a.out))
    print("\nN x K, M | shipped us | stream_k us (launch taken) | speedup" + "".join(f" | {v} us" for v in a.variants))
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']}, {r['M']} | {r.get('shipped_us')} | {r.get('stream_k_us', r.get('stream_k_error'))} "
              f"({'stream-K' if r.get('stream_k_taken') else 'split'}) | {r.get('speedup')}"
              + "".join(f" | {r.get(v + '_us', r.get(v + '_error'))}{' SK' if r.get(v + '_stream_k_taken') else ''}"
                        for v in a.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
