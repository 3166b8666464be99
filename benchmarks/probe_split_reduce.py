"""What the split-K reduction and the split count cost the Triton int-weight lowering.

The tuner's H100 rows (h100-2026-12-05-a2732ee-tune-rows.json, W4 g128, M = 1, the decode GEMV
256 x 4 chunks x 2 warps x 8 programs an SM) have the atomic reduction 3.4-9.0 us faster than the
partials one on 28672x4096 / 8192x28672 / 4096x14336 and 19.4 us slower on 57344x8192, and the
table can hold one of them. The partials were summed by one program per 256 columns looping over
the S partials one load at a time (16 programs for S = 56 at N = 4096: a chain of L2 round trips);
they are now loaded as one (S, columns) tile (``int_weight._reduce_tile``). The first run
(h100-2026-12-05-a530ab6-probe-split-reduce.json) found the tile 0-2.4 us faster than that loop and
the atomic / partials gap unchanged; the second (``--max-splits``, -23d7f9f-) put it in the grid: with
4 splits the atomic GEMV took 57344x8192 in 109.3 us against 130.7 with the plan's 5, and its two
builds had 125 and 96 registers (8 and 10 programs an SM), so 224 tiles x 5 splits = 1120 programs
would be a second wave of 64 for the 125-register one. The launch now lowers such splits
(``common.split_in_waves``, ``fit``); the third run (-a93d446-probe-split-waves*) confirmed it: the
atomic GEMV build holds 8 programs an SM, the partials one 10; the fitted splits took 57344x8192 M = 1
from 127.8 to 108.1 us and the 16-row GEMM at M = 4 / 16 11-16% down on 8192x28672, 4096x14336 and
4096x4096 (9 -> 6, 16 -> 12, 16 -> 11 splits, three programs an SM), nothing else moving at 4 bits;
8 bits gained at M = 1 (atomic 2-8%; partials 201 -> 161 us on 57344x8192); 2 bits at M = 4
(the GEMV on 4 rows) moved -5 to +6%.

Per shape and M this times, interleaved over rotated weight copies, the shipped table's config for the
M with ``reduce`` set to atomic and to partials, each with the split fitted to the resident programs
(``fit``, the shipped launch) and as the plan asks (``nofit``), and the split counts launched.
``--max-splits`` repeats each row with the config's ``max_split`` capped, and the JSON records every
kernel build compiled with the programs an SM holds. ``--pdl`` times, in place of fit / nofit, each
reduction with the table's ``pdl_reduce`` off and on (fitted splits): the reduction launched as a
programmatic dependent of the split-K kernel, its launch latency hidden under that kernel's tail.
Its first run (h100-2026-12-06-16c396d-probe-pdl, where the off variants were named without a suffix)
had the atomic reduction 0.26-0.97 us faster with PDL in all 15 rows and the partials one mixed (-0.8
to +3.5 us), so PDL is now the atomic reduction's default (``int_weight.reduce_pdl``).

    PYTHONPATH=. python benchmarks/probe_split_reduce.py [--shapes ...] [--ms 1,2,4,16,32,64] [--bits 4] [--max-splits 4,8] [--pdl] [--out F]
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys

import torch
import triton

import common

common.add_repo_to_path()

from qops.ops.triton import int_weight as T  # noqa: E402
from qops.ops.triton.common import pick_bucket  # noqa: E402
from tune_triton_int_weight import GROUP, random_weight, weight_bytes  # noqa: E402

SHAPES = [(28672, 4096), (8192, 28672), (57344, 8192), (4096, 14336), (4096, 4096), (6144, 4096), (14336, 4096)]
# (reduce mode, split count, pdl_reduce): fit is the launch's, nofit the plan's; pdl_reduce None is the
# launch's default (PDL with the atomic reduction), --pdl times both reductions with it off and on
VARIANTS = [("atomic", "fit", None), ("atomic", "nofit", None), ("partials", "fit", None), ("partials", "nofit", None)]
PDL_VARIANTS = [("atomic", "fit", 0), ("atomic", "fit", 1), ("partials", "fit", 0), ("partials", "fit", 1)]


def variant_name(reduce: str, form: str, pdl: int | None) -> str:
    return f"{reduce}_{form}" + {None: "", 0: "_nopdl", 1: "_pdl"}[pdl]


@contextlib.contextmanager
def split_form(form: str, launched: list):
    """The launch's split fitted to the resident programs (``fit``) or the plan's (``nofit``); the
    split counts launched are appended to ``launched``."""
    shipped = T.split_in_waves

    def fitted(k, unit, tiles, split, slots):
        got = shipped(k, unit, tiles, split, slots) if form == "fit" else (split, triton.cdiv(triton.cdiv(k, unit), split) * unit)
        launched.append(got[0])
        return got

    T.split_in_waves = fitted
    try:
        yield
    finally:
        T.split_in_waves = shipped


def table_with_reduce(path: str, m: int, bits: int, reduce: str, max_split: int | None = None, pdl: int | None = None) -> dict:
    """The active table with the config serving (path, bits, M) set to ``reduce`` (and ``pdl_reduce`` and
    ``max_split`` where given; nothing else changed)."""
    table = copy.deepcopy(T.config_for(torch.device("cuda")))
    section = table[path]
    by_m = section[str(bits)] if str(bits) in section else section["default"]
    # the bucket the lowering reads (int_weight._bucket's rule)
    bucket, cfg = pick_bucket([(b, by_m[str(b)]) for b in sorted(int(b) for b in by_m)], m)
    by_m[str(bucket)] = ({**cfg, "reduce": reduce} | ({"max_split": max_split} if max_split else {})
                         | ({"pdl_reduce": pdl} if pdl is not None else {}))
    return table


def build_facts() -> list[dict]:
    """Every kernel build the launches compiled: its constexprs, launch options, the stages that fit and
    the programs an SM holds (``int_weight._BUILD_FACTS``)."""
    names = {id(T._gemv_kernel): "gemv", id(T._tc_kernel): "gemm"}
    return [dict(kernel=names.get(key[0], "?"), **dict(key[1]), **dict(key[2]),
                 dtype=str(key[3]), fitting_stages=facts[0], programs_per_sm=facts[1]) for key, facts in T._BUILD_FACTS.items()]


def main(argv=None) -> int:
    p = common.probe_parser("probe_split_reduce.py", __doc__, SHAPES, [1, 2, 4, 16, 32, 64], 7)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=GROUP, help="quantization group size (default 128)")
    p.add_argument("--max-splits", type=common.parse_ms, default=[], help="also with max_split capped to each of these")
    p.add_argument("--pdl", action="store_true", help="time each reduction launched with and without PDL (fitted splits)")
    a = p.parse_args(argv)
    variants = PDL_VARIANTS if a.pdl else VARIANTS
    res = common.probe_result("split_reduce")
    if res is None:
        return 2
    dev = torch.device("cuda")
    for n, k in a.shapes:
        base = random_weight(n, k, a.bits, dev, 1, a.group)
        copies = [base] + [tuple(t.clone() for t in base) for _ in range(common.n_copies(base[0].numel() * 4) - 1)]
        roof = weight_bytes(n, k, a.bits, a.group) / (res["copy_TBps"] * 1e6)
        for m in a.ms:
            for cap in [None, *a.max_splits]:
                time_case(res, a, n, k, m, cap, copies, base, roof, variants)
    print("\nN x K | M | path | max_split | splits planned / launched (atomic, partials) | " + " | ".join(f"{variant_name(*v)} us" for v in variants))
    for r in res["rows"]:
        times = " | ".join(str(r[f"{variant_name(*v)}_us"]) for v in variants)
        atomic, partials = (r["split"][variant_name(*variants[i])] for i in (0, 2))
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['path']} | {r['max_split'] or '-'} | "
              f"{atomic[0]}/{atomic[1]}, {partials[0]}/{partials[1]} | {times}")
    res["builds"] = build_facts()
    for b in res["builds"]:
        print("build:", json.dumps(b))
    common.write_json(res, common.output_paths("probe_split_reduce.json", a.out))
    return 0


def time_case(res, a, n, k, m, cap, copies, base, roof, variants):
    """One row: the variants of (shape, M) with max_split capped at ``cap`` (None: the table's)."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float16).to(dev)
    path = T._plan(m, n, k, a.bits, a.group, dev)["path"]
    cands, ref, errs, splits = {}, None, {}, {}
    for reduce, form, pdl in variants:
        table = table_with_reduce(path, m, a.bits, reduce, cap, pdl)
        name = variant_name(reduce, form, pdl)
        launched = []

        def call(w, table=table, form=form, launched=launched):
            with T.config_override(table), split_form(form, launched):
                return T.triton_mm(x, *w, None, None, a.bits, a.group, 0, force_path=path)

        y = call(base).float()
        with T.config_override(table):
            plan_split = T._plan(m, n, k, a.bits, a.group, dev, path)["split"]
        splits[name] = [plan_split, launched[-1] if launched else plan_split]
        ref = y if ref is None else ref
        errs[name] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
        cands[name] = [lambda w=w, call=call: call(w) for w in copies]
    row = dict(N=n, K=k, M=m, bits=a.bits, group=a.group, path=path, max_split=cap, split=splits, rel_err_vs_first=errs)
    common.time_row(res, row, cands, a.trials, roof)
    del cands
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
