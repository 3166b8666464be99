"""Compare two ``bench_int_weight.py`` results files row by row: the A/B of two tables or two commits.

    python benchmarks/compare_bench.py A.json B.json [--lowering triton_int_weight]

Rows are paired by (lowering, format, bits, group size, sym, N, K, M, dtype); rows that failed
correctness or timed nothing in either file are listed as unpaired. Prints, per pair, A's and B's
microseconds and A / B (above 1: B is faster), then the geometric mean of A / B over the pairs.
Exit status 1 if nothing pairs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

KEY = ("lowering", "format", "bits", "group_size", "sym", "N", "K", "M", "dtype")


def timed_rows(doc: dict, lowering: str | None) -> dict:
    """(key -> qops microseconds) of a results file's rows that were timed and correct."""
    out = {}
    for row in doc.get("rows", []):
        if lowering is not None and row.get("lowering") != lowering:
            continue
        if row.get("qops_us") and not row.get("error"):
            out[tuple(row.get(k) for k in KEY)] = float(row["qops_us"])
    return out


def _order(key: tuple) -> tuple:
    """Sort key: lowering, N, K, M (numerically), then the rest as text."""
    row = dict(zip(KEY, key))
    return str(row["lowering"]), row["N"] or 0, row["K"] or 0, row["M"] or 0, str(key)


def compare(a: dict, b: dict, lowering: str | None = None) -> tuple[list[tuple], float | None, list[tuple]]:
    """(pairs (key, A us, B us, A / B), geomean of A / B or None, keys timed in only one file)."""
    ra, rb = timed_rows(a, lowering), timed_rows(b, lowering)
    pairs = [(key, ra[key], rb[key], ra[key] / rb[key]) for key in sorted(ra.keys() & rb.keys(), key=_order)]
    geo = math.exp(sum(math.log(p[3]) for p in pairs) / len(pairs)) if pairs else None
    return pairs, geo, sorted(ra.keys() ^ rb.keys(), key=_order)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--lowering", help="only this lowering's rows (e.g. triton_int_weight)")
    args = p.parse_args(argv)
    with open(args.a) as fa, open(args.b) as fb:
        pairs, geo, lone = compare(json.load(fa), json.load(fb), args.lowering)
    print("lowering | N x K | M | A us | B us | A / B")
    for key, ta, tb, ratio in pairs:
        row = dict(zip(KEY, key))
        print(f"{row['lowering']} | {row['N']}x{row['K']} | {row['M']} | {ta:.2f} | {tb:.2f} | {ratio:.3f}")
    for key in lone:
        print("unpaired:", dict(zip(KEY, key)))
    if geo is None:
        print("no rows timed in both files")
        return 1
    print(f"geomean A / B {geo:.3f} over {len(pairs)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
