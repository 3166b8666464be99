"""Digests of the native W4A16 op's outputs on seeded inputs, to compare two commits' kernels bit for bit.

A kernel change that should only move instructions (not the sums or their order) must leave every
output bit as it was. Run this from each commit's tree on the same GPU and compare the two files with
``--compare``: per (dtype, N x K, M) the sha256 of the output bytes and the plan that produced it. The
weights (GPTQ W4 g128 asymmetric, column slabs) and x come from fixed seeds, so both runs see the same
inputs. M covers the decode kernel's tiles (1..16) and the GEMM above it.

    PYTHONPATH=. python benchmarks/probe_output_digest.py [--shapes 28672x4096,...] [--ms 1,4,16] [--out F]
    python benchmarks/probe_output_digest.py --compare A.json B.json
"""
from __future__ import annotations

import hashlib
import json
import sys

import torch

import common

common.add_repo_to_path()

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def digests(shapes, ms, dtypes) -> list[dict]:
    from probe_early_pdl import gptq_native
    from qops.native import int_weight as niw

    rows = []
    for name in dtypes:
        dt = DTYPES[name]
        for n, k in shapes:
            gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
            iw = gptq_native(n, k, dtype=dt, generator=gen)
            for m in ms:
                x = torch.randn(m, k, generator=gen, device="cuda").to(dt)
                y = iw.mm(x)
                torch.cuda.synchronize()
                rows.append({"dtype": name, "N": n, "K": k, "M": m,
                             "plan": str(niw.plan(m, n, k, 0)) if m <= niw.decode_rows(n, k, 0) else "gemm",
                             "sha256": hashlib.sha256(y.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()})
                print(json.dumps(rows[-1]), flush=True)
            del iw
            torch.cuda.empty_cache()
    return rows


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as fa, open(b_path) as fb:
        a, b = json.load(fa), json.load(fb)
    key = lambda r: (r["dtype"], r["N"], r["K"], r["M"])  # noqa: E731
    bi = {key(r): r for r in b["rows"]}
    same = diff = missing = 0
    for r in a["rows"]:
        o = bi.get(key(r))
        if o is None:
            missing += 1
        elif o["sha256"] == r["sha256"]:
            same += 1
        else:
            diff += 1
            print("differs:", key(r), r["plan"], "|", o["plan"])
    print(f"{a.get('commit')} vs {b.get('commit')}: {same} identical, {diff} differ, {missing} missing")
    return 1 if diff or missing else 0


def main(argv=None) -> int:
    p = common.probe_parser("probe_output_digest.py", __doc__, common.PERF_SHAPES, [1, 2, 4, 7, 8, 9, 16, 64], 1)
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two result files and exit (no GPU)")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    res = common.probe_result("output_digest")
    if res is None:
        return 2
    res["rows"] = digests(a.shapes, a.ms, [d for d in a.dtypes.split(",") if d])
    common.write_json(res, common.output_paths("probe_output_digest.json", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
