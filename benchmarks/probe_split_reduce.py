"""What the split-K reduction costs the Triton int-weight lowering, per reduce mode and reduction form.

The tuner's H100 rows (h100-2026-12-05-a2732ee-tune-rows.json, W4 g128, M = 1, the decode GEMV
256 x 4 chunks x 2 warps x 8 programs an SM) have the atomic reduction 3.4-9.0 us faster than the
partials one on 28672x4096 / 8192x28672 / 4096x14336 and 19.4 us slower on 57344x8192, and the
table can hold one of them. The partials were summed by one program per 256 columns looping over
the S partials one load at a time (16 programs for S = 56 at N = 4096: a chain of L2 round trips);
they are now loaded as one (S, columns) tile (``int_weight._reduce_tile``). Per shape and M this
times, interleaved over rotated weight copies, the shipped table's config for the M with
``reduce`` set to atomic and to partials, the partials summed both ways (``serial``: the old
one-partial-a-step loop, which the kernel runs with a tile of one partial), and the split count the
plan chose. ``--max-splits`` repeats each row with the config's ``max_split`` capped (fewer programs:
is it the reduction or the grid?), and each row records the registers of the kernels it compiled.

The first run (h100-2026-12-05-a530ab6-probe-split-reduce.json) found the tile 0-2.4 us faster than the loop
and the atomic / partials gap unchanged: the reduction is not what separates them.

    PYTHONPATH=. python benchmarks/probe_split_reduce.py [--shapes ...] [--ms 1,16] [--bits 4] [--max-splits 4,8] [--out F]
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch

import common

common.add_repo_to_path()

from qops.ops.triton import int_weight as T  # noqa: E402
from tune_triton_int_weight import GROUP, random_weight, weight_bytes  # noqa: E402

SHAPES = [(28672, 4096), (8192, 28672), (57344, 8192), (4096, 14336)]
# (reduce mode, reduction form): serial is the loop over one partial at a time
VARIANTS = [("atomic", "tile"), ("partials", "tile"), ("partials", "serial")]


@contextlib.contextmanager
def reduction_form(form: str):
    """The partials summed as ``tile`` (the shipped form) or ``serial`` (a tile of one partial, 256 columns)."""
    shipped = T._reduce_tile
    if form == "serial":
        T._reduce_tile = lambda parts: (256, 1)
    try:
        yield
    finally:
        T._reduce_tile = shipped


def table_with_reduce(path: str, m: int, bits: int, reduce: str, max_split: int | None = None) -> dict:
    """The active table with the config serving (path, bits, M) set to ``reduce`` (and ``max_split``
    where given; nothing else changed)."""
    table = json.loads(json.dumps(T.config_for(torch.device("cuda"))))
    section = table[path]
    by_m = section[str(bits)] if str(bits) in section else section["default"]
    bucket = min((b for b in map(int, by_m) if b >= m), default=max(map(int, by_m)))
    by_m[str(bucket)] = {**by_m[str(bucket)], "reduce": reduce} | ({"max_split": max_split} if max_split else {})
    return table


def kernel_registers() -> dict:
    """Registers a thread of every compiled build of the GEMV and GEMM kernels (Triton's JIT caches;
    empty where this Triton keeps them elsewhere)."""
    out = {}
    for name, kern in (("gemv", T._gemv_kernel), ("gemm", T._tc_kernel)):
        try:
            builds = [c for cache in kern.device_caches.values() for c in cache[0].values()]
            out[name] = sorted({(int(c.n_regs), int(c.n_spills), int(c.metadata.num_warps)) for c in builds})
        except Exception as e:  # noqa: BLE001 - a Triton without these attributes
            out[name] = repr(e)
    return out


def main(argv=None) -> int:
    p = common.probe_parser("probe_split_reduce.py", __doc__, SHAPES, [1, 16], 7)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--max-splits", type=common.parse_ms, default=[], help="also with max_split capped to each of these")
    a = p.parse_args(argv)
    res = common.probe_result("split_reduce")
    if res is None:
        return 2
    dev = torch.device("cuda")
    for n, k in a.shapes:
        base = random_weight(n, k, a.bits, dev, 1)
        copies = [base] + [tuple(t.clone() for t in base) for _ in range(common.n_copies(base[0].numel() * 4) - 1)]
        roof = weight_bytes(n, k, a.bits) / (res["copy_TBps"] * 1e6)
        for m in a.ms:
            for cap in [None, *a.max_splits]:
                time_case(res, a, n, k, m, cap, copies, base, roof)
    print("\nN x K | M | path | max_split | split | " + " | ".join(f"{r}_{f} us" for r, f in VARIANTS))
    for r in res["rows"]:
        times = " | ".join(str(r[f"{rd}_{f}_us"]) for rd, f in VARIANTS)
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['path']} | {r['max_split'] or '-'} | {r['split']['partials_tile']} | {times}")
    res["registers"] = kernel_registers()
    print("registers (regs, spills, warps):", json.dumps(res["registers"]))
    common.write_json(res, common.output_paths("probe_split_reduce.json", a.out))
    return 0


def time_case(res, a, n, k, m, cap, copies, base, roof):
    """One row: the variants of (shape, M) with max_split capped at ``cap`` (None: the table's)."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float16).to(dev)
    path = T._plan(m, n, k, a.bits, GROUP, dev)["path"]
    cands, ref, errs, splits = {}, None, {}, {}
    for reduce, form in VARIANTS:
        table = table_with_reduce(path, m, a.bits, reduce, cap)

        def call(w, table=table, form=form):
            with T.config_override(table), reduction_form(form):
                return T.triton_mm(x, *w, None, None, a.bits, GROUP, 0, force_path=path)

        name = f"{reduce}_{form}"
        with T.config_override(table):
            splits[name] = T._plan(m, n, k, a.bits, GROUP, dev, path)["split"]
        y = call(base).float()
        ref = y if ref is None else ref
        errs[name] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
        cands[name] = [lambda w=w, call=call: call(w) for w in copies]
    row = dict(N=n, K=k, M=m, bits=a.bits, path=path, max_split=cap, split=splits, rel_err_vs_first=errs)
    common.time_row(res, row, cands, a.trials, roof)
    del cands
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
