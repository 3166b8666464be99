"""Read bandwidth of the native W4A16 kernel's weight access pattern against a contiguous one (H200).

Question it answers: is the decode kernel's gap to the roofline (60-68% at M = 1) in the access
pattern itself? The kernel reads qops' runtime layout (qweight ``(K/8, N)`` u32, N contiguous): a
warp's 16-byte loads cover 4 rows x 128 bytes, a block ``nwn`` x 128 bytes of each row, rows
``4 N`` bytes apart. A layout repacked at prepare time could instead give each warp 2 KiB
contiguous per iteration. This script times a load-only kernel (no math, same load instruction,
same loads in flight per warp) over the same bytes in both patterns, for the perf shapes'
qweight sizes, with the method of ``common.py`` (CUDA-graph replays, rotated buffers > 256 MB).

Writes ``$OUT/probe_layout_bw.json`` (and ``--out``); prints one line per (shape, pattern).

    PYTHONPATH=. python benchmarks/probe_layout_bw.py
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

import common
from common import PERF_SHAPES
from read_floor import LoadOnlyKernel


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in PERF_SHAPES[1:]), help="N x K list (qweight is K/8 x N u32)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def run(args) -> int:
    if not torch.cuda.is_available():
        print("probe_layout_bw: needs a CUDA device", file=sys.stderr)
        return 2
    probe = LoadOnlyKernel()
    sms = probe.sms
    copy_bw = common.copy_TBps(args.trials)
    res = {"gpu": common.device_name(True), "qops_commit": common.git_commit(), "copy_TBps": round(copy_bw, 4),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    paths = common.output_paths("probe_layout_bw.json", args.out)
    for n, k in common.parse_shapes(args.shapes):
        rows, cols = k // 8, n
        nbytes = rows * cols * 4
        bufs = [torch.randint(0, 2**31 - 1, (rows, cols), dtype=torch.int32, device="cuda") for _ in range(common.n_copies(nbytes))]
        patterns = []
        for nwn in (1, 2, 4):
            for splits in (1, 2, 4):
                if rows % (splits * 16 * (8 // nwn)) == 0 and cols % (32 * nwn) == 0:
                    patterns.append((f"strips nwn={nwn} splits={splits}", (cols // (32 * nwn), splits, 1), nwn, 0))
        for blocks in (sms, 2 * sms, 4 * sms):
            patterns.append((f"tiles blocks={blocks}", (blocks, 1, 1), 1, 1))
        for name, grid, nwn, mode in patterns:
            fns = [lambda b=b, grid=grid, nwn=nwn, mode=mode: probe.launch(b, grid, rows, cols, nwn, mode) for b in bufs]
            t = common.graph_time(fns, args.trials, 4.0).us
            tbps = nbytes / (t * 1e-6) / 1e12
            res["rows"].append({"N": n, "K": k, "pattern": name, "us": round(t, 2), "TBps": round(tbps, 3),
                                "pct_of_copy": round(100 * tbps / copy_bw, 1)})
            print(f"{n}x{k} {name:28s} {t:8.2f} us {tbps:6.3f} TB/s ({100 * tbps / copy_bw:5.1f}% of copy)", flush=True)
            common.write_json(res, paths)
        del bufs
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    common.add_repo_to_path()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
