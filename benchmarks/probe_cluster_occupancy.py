"""How many thread-block clusters of the native W4A16 decode kernel the driver lets run at once, against
the blocks an SM it fits (the occupancy calculator; cuOccupancyMaxActiveClusters through cuda.core).

Stream-K plans (256 blocks in clusters of 4 or 8; built in stop 38, since removed) ran 1.6-1.8x slower
than the whole-tile grids they were to even out (h200-2026-12-03-3196cf9-streamk-probe.json): a grid whose
clusters do not all fit at once runs in waves (h200-2026-12-03-0301e3e-cluster-occupancy.json). Each row: the plan, its blocks, the blocks an SM, the clusters that fit
and the waves that makes.

    PYTHONPATH=. python benchmarks/probe_cluster_occupancy.py [--out F]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import common

common.add_repo_to_path()

from qops.native import compiler  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

# (N, K, M, plan fields): the shipped split-2 cluster plans, and plain K splits in clusters of 2..8 on
# one shape (the cluster size alone).
CASES = [
    (4096, 14336, 1, dict(nwn=1, splits=2, cluster=True, xfull=True, minb=1)),
    (8192, 28672, 1, dict(nwn=2, splits=2, cluster=True, xfull=True, minb=1, fold=True)),
] + [(4096, 4096, 1, dict(nwn=4, splits=s, cluster=True, xfull=True)) for s in (2, 3, 4, 6, 8)]


def active_clusters(kernel, grid, shmem: int) -> int | str:
    cc = compiler.core()
    cfg = cc.LaunchConfig(grid=grid, block=(niw.THREADS, 1, 1), shmem_size=shmem)
    dev = cc.Device(torch.cuda.current_device())
    try:
        return int(kernel.occupancy.max_active_clusters(cfg, stream=dev.default_stream))
    except TypeError:
        try:
            return int(kernel.occupancy.max_active_clusters(cfg))
        except Exception as e:  # noqa: BLE001
            return f"error: {e}"
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for n, k, m, fields in CASES:
        p = niw.make_plan(m, n, k, smem_limit=niw.smem_optin_bytes(dev), **fields)
        kern = compiler.get_kernel(dev, niw.SOURCE, p.defines(torch.float16, True), niw.GEMV)
        per_sm = compiler.max_active_blocks(kern, dev, niw.THREADS, p.shmem)
        clusters = active_clusters(kern, (p.tiles, p.splits, 1), p.shmem)
        row = {"N": n, "K": k, "M": m, "plan": str(p), "blocks": p.tiles * p.splits, "cluster_blocks": p.splits,
               "blocks_per_sm": per_sm, "slots": per_sm * sms, "max_active_clusters": clusters}
        if isinstance(clusters, int) and clusters:
            row["waves"] = round(p.tiles / clusters, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"probe": "cluster_occupancy", "device": common.device_name(True), "commit": common.git_commit(), "rows": rows}
    common.write_json(res, common.output_paths("probe_cluster_occupancy.json", a.out))
    print("\nN x K | M | cluster | blocks | blocks/SM | clusters at once | waves")
    for r in rows:
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['cluster_blocks']} | {r['blocks']} | {r['blocks_per_sm']} | {r['max_active_clusters']} | {r.get('waves', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
