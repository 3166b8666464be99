"""Summarise Nsight Compute's per-instruction page (``ncu -i REP --page source --csv --print-source
sass``, plain or gzipped): for each kernel, where its warps stall and whether its global loads ask
the L2 for more sectors than they need.

    python benchmarks/ncu_stalls.py benchmarks/results/h200-2026-11-30-89b7c63-ncu-source.csv.gz [--top 12]

Per kernel: the share of warp-stall samples by reason (long_sb: waiting on a global load; short_sb:
on shared memory; wait: a fixed-latency dependency; mio: the memory-instruction queue; barrier:
__syncthreads), the instructions with the most samples, and every executed global load or cp.async
whose L2 sectors exceed the ideal count (the doubled sectors of the smem ring's .cg copies showed
up this way). Runs anywhere: it reads a text file.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys


def read_rows(path: str) -> list[list[str]]:
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else open(path, "rb").read()
    return list(csv.reader(io.StringIO(raw.decode())))


def kernels(rows: list[list[str]]):
    """(kernel name, header, instruction rows) for each kernel section of the page."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    for a, b in zip(starts, starts[1:]):
        header = rows[a + 1]
        yield rows[a][1], header, [r for r in rows[a + 2:b] if len(r) >= len(header)]


def summarise(name: str, header: list[str], body: list[list[str]], top: int) -> str:
    ix = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = collections.Counter()
    lines = []
    for r in body:
        samples = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        per = {h[6:]: int(r[ix[h]] or 0) for h in reasons}
        total.update(per)
        lines.append((samples, r[ix["Address"]][-5:], r[ix["Source"]].strip(), sorted(((v, k) for k, v in per.items() if v), reverse=True)[:2]))
    n = sum(total.values()) or 1
    out = [f"{name}: {n} stall samples over {len(body)} instructions",
           "  by reason: " + ", ".join(f"{k} {100 * v / n:.1f}%" for k, v in total.most_common(8))]
    for s, addr, src, why in sorted(lines, reverse=True)[:top]:
        out.append(f"  {s:6d}  {addr}  {src[:64]:64s} {', '.join(f'{k} {v}' for v, k in why)}")
    for r in body:
        src = r[ix["Source"]]
        if "LDG" not in src or r[ix["Instructions Executed"]] in ("", "0"):
            continue
        got, ideal = (float(r[ix[h]] or 0) for h in ("L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal"))
        if ideal and got > 1.05 * ideal:
            out.append(f"  excess L2 sectors {got / ideal:.1f}x  {r[ix['Address']][-5:]}  {src.strip()[:64]}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ncu_stalls.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="the source page as CSV (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=10, help="instructions listed per kernel (default 10)")
    a = p.parse_args(argv)
    for name, header, body in kernels(read_rows(a.path)):
        print(summarise(name, header, body, a.top))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
