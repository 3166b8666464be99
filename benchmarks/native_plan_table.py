"""Build the native W4A16 plan table (``qops/native/plans/<gpu>.json``) from confirmed plan sweeps.

``sweep_native.py --confirm N`` re-times, per (N, K, M), the plan the rule picks and the N fastest
plans of its sweep with their trials interleaved. A case enters the table when its best confirmed
plan is at least ``--min-gain`` faster than the rule's in that same round; every other shape and M
keeps the rule (``qops.native.int_weight._plan``). An entry measured at M serves the rows from the
previous measured M of that shape plus one up to M (measured at 1, 4, 8, 16: rows 1, 2-4, 5-8,
9-16), and is kept only if ``make_plan`` accepts it for every M of that range within the device's
shared memory. Runs anywhere (no GPU):

    python benchmarks/native_plan_table.py benchmarks/results/h200-2026-11-30-f4c8e4f-sweep-table.json \\
        --out qops/native/plans/h200.json

A sweep run with the table in force (``default_plans`` "table": its confirmed default is the plan the
table gave, or the rule where it gave none) refreshes the table built from the sweeps before it: a case
whose best confirmed plan beats that default by the margin replaces the entry measured at its M (or adds
one); every other entry stays. Kernels change after a table is swept, and this re-times the shipped plans
against new candidates in one interleaved round without throwing away entries a narrower sweep did not
find again. Such sweeps come after the rule sweeps on the command line. The table lists its input files
in order (``sweeps``), so it can be rebuilt from them.

``--pass-over NxK:M`` sets aside a case's fastest confirmed plan for its next fastest (which must still beat
the default by the margin): for a plan that must not ship although it timed fastest, such as one whose
build spills registers on sm_90 (``tests/test_native_compile.py`` refuses those). The table lists what was
set aside (``passed_over``), so the rebuild needs the same flags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="sweep_native.py JSON files with confirmed cases (later files win; "
                    "sweeps of the table's plans last)")
    ap.add_argument("--min-gain", type=float, default=0.03, help="fraction faster than the rule's plan (in a refresh: the shipped plan) an entry must be")
    ap.add_argument("--pass-over", action="append", default=[], type=parse_case, metavar="NxK:M",
                    help="take this confirmed case's second-fastest plan (repeatable)")
    ap.add_argument("--out", required=True, help="the table to write")
    return ap.parse_args(argv)


def parse_case(text: str) -> tuple[int, int, int]:
    """'NxK:M' -> (N, K, M)."""
    try:
        shape, m = text.split(":")
        n, k = shape.lower().split("x")
        return int(n), int(k), int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NxK:M (e.g. 57344x8192:16)") from None


def m_ranges(ms: list[int]) -> dict[int, tuple[int, int]]:
    """Measured M -> the rows it serves: from the previous measured M + 1 (or 1) up to it."""
    ms = sorted(set(ms))
    return {m: ((ms[i - 1] + 1) if i else 1, m) for i, m in enumerate(ms)}


def measured_minb(plan, sms: int) -> int:
    """The blocks an SM to promise the register allocator for a swept plan: at least two where its grid
    has more blocks than the GPU has SMs. The sweeps ran such plans with ``minb`` 1 at two blocks an SM
    because ptxas then kept the kernel within 128 registers; later builds of the same plan took 131-152
    (the gated epilogue of stop 21), one block an SM, and ran up to 1.64x slower (28672x4096 at M = 8
    34.4 us against the table's 23.6; ``h200-2026-12-01-e985209-probe-plan-table.json``). Promising two
    keeps the occupancy that was measured."""
    grid = plan.tiles * plan.splits
    return max(plan.minb, 2) if grid > sms and plan.mt <= 2 else plan.minb


def _entry(native, c: dict, best: dict, lo: int, hi: int, name: str, limit, sms: int, rule_us: float) -> dict:
    """The entry of confirmed case ``c`` taking ``best``, serving rows lo..hi (refused if the plan cannot)."""
    n, k, m = c["N"], c["K"], c["M"]
    fields = {f: best["plan"][f] for f in native.PLAN_FIELDS}
    for mm in range(lo, hi + 1):
        try:
            native.make_plan(mm, n, k, smem_limit=limit, **fields)
        except ValueError as e:
            raise SystemExit(f"native_plan_table: {n}x{k} M={m}'s plan does not serve M={mm}: {e}") from None
    fields["minb"] = measured_minb(native.make_plan(m, n, k, smem_limit=limit, **fields), sms)
    return {"n": n, "k": k, "m_min": lo, "m_max": hi, "plan": fields, "us": round(best["us"], 2),
            "rule_us": round(rule_us, 2), "measured_at_m": m, "source": os.path.basename(name)}


def _winner(c: dict, min_gain: float, passed_over: list[dict] | None = None) -> dict | None:
    """Case ``c``'s fastest confirmed plan if it beats the default (confirmed first: the rule's plan, or in a
    refresh the table's) by at least ``min_gain``, else None. With ``passed_over`` (a list) the fastest is
    set aside (appended to it) and the next fastest considered."""
    default = c["confirmed"][0]
    ranked = sorted(c["confirmed"], key=lambda r: r["us"])
    if passed_over is not None:
        if ranked[0] is default:
            raise SystemExit(f"native_plan_table: --pass-over {c['N']}x{c['K']}:{c['M']}: its fastest plan is the default, "
                             "which cannot be passed over")
        passed_over.append({"n": c["N"], "k": c["K"], "m": c["M"], "us": round(ranked[0]["us"], 2),
                            "plan": dict(ranked[0]["plan"])})
        ranked = ranked[1:]
    best = ranked[0]
    return None if best is default or 1 - best["us"] / default["us"] < min_gain else best


def build(sweeps: list[dict], names: list[str], min_gain: float, pass_over=()) -> dict:
    from qops.native import int_weight as native

    gpus = {s["gpu"] for s in sweeps}
    if len(gpus) != 1:
        raise SystemExit(f"native_plan_table: sweeps of several GPUs ({sorted(gpus)}): one table is one GPU")
    # One table serves both activation dtypes from fp16 sweeps (sweeps before the field were fp16). A bf16
    # sweep is a measurement: it found the fp16 plans within 2.4% of its best in 11 of 12 cases of the
    # Llama shapes at M = 4..16 (benchmarks/NOTES.md, stop 41), too few to give the table a dtype dimension.
    dtypes = sorted({s.get("dtype", "float16") for s in sweeps})
    if dtypes != ["float16"]:
        raise SystemExit(f"native_plan_table: the table is built from float16 sweeps; got {dtypes}")
    # Sweeps before the tables existed had no such field: their defaults were the rule's.
    kinds = [sweep.get("default_plans", "rule") for sweep in sweeps]
    n_rule = kinds.index("table") if "table" in kinds else len(kinds)
    if n_rule == 0 or any(kind != "table" for kind in kinds[n_rule:]):
        raise SystemExit("native_plan_table: a sweep that timed the table's plans as its defaults refreshes a table built from "
                         "sweeps of the rule (QOPS_NATIVE_PLANS=rule) given before it")
    sms = sweeps[0]["sms"]
    pass_over, passed_over = set(pass_over), []
    cases = {}
    measured: dict[tuple[int, int], set[int]] = {}  # every confirmed M of a shape, in any sweep
    for sweep, name in zip(sweeps, names):
        for c in sweep["cases"]:
            if "confirmed" in c:
                measured.setdefault((c["N"], c["K"]), set()).add(c["M"])
                if sweep.get("default_plans", "rule") == "rule":
                    cases[c["N"], c["K"], c["M"]] = (c, name)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for n, k, m in cases:
        by_shape.setdefault((n, k), []).append(m)
    entries = {}
    for (n, k), ms in sorted(by_shape.items()):
        for m, (lo, hi) in m_ranges(ms).items():
            c, name = cases[n, k, m]
            best = _winner(c, min_gain, passed_over if (n, k, m) in pass_over else None)
            if best is None:
                continue
            limit = sweeps[names.index(name)].get("smem_optin")
            entries[n, k, m] = _entry(native, c, best, lo, hi, name, limit, sms, c["confirmed"][0]["us"])
    for sweep, name in zip(sweeps[n_rule:], names[n_rule:]):
        for c in sweep["cases"]:
            if "confirmed" not in c:
                continue
            n, k, m = c["N"], c["K"], c["M"]
            best = _winner(c, min_gain, passed_over if (n, k, m) in pass_over else None)
            if best is None:
                continue
            lo = max((mm for mm in measured[n, k] if mm < m), default=0) + 1
            old = entries.get((n, k, m))
            if old is not None and (old["m_min"], old["m_max"]) != (lo, m):
                raise SystemExit(f"native_plan_table: {n}x{k} M={m} in {name} serves rows {lo}..{m}, the entry it replaces "
                                 f"{old['m_min']}..{old['m_max']}: sweep the table at the Ms it was built at")
            if any(key[:2] == (n, k) and key[2] != m and e["m_min"] <= m and lo <= e["m_max"] for key, e in entries.items()):
                raise SystemExit(f"native_plan_table: {n}x{k} M={m} in {name} would serve rows {lo}..{m}, which another entry serves")
            entries[n, k, m] = _entry(native, c, best, lo, m, name, sweep.get("smem_optin"), sms,
                                      old["rule_us"] if old is not None else c["confirmed"][0]["us"])
    return {"gpu": gpus.pop(), "sms": sms, "min_gain": min_gain,
            "note": "built by benchmarks/native_plan_table.py from confirmed sweep_native.py cases (fp16 activations); "
                    "shapes and M not listed take qops.native.int_weight's rule",
            "sweeps": [os.path.basename(nm) for nm in names],
            "plans": [entries[key] for key in sorted(entries)]} | ({"passed_over": passed_over} if passed_over else {})


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sweeps = [json.load(open(p)) for p in args.sweeps]
    table = build(sweeps, args.sweeps, args.min_gain, args.pass_over)
    missing = set(args.pass_over) - {(p["n"], p["k"], p["m"]) for p in table.get("passed_over", [])}
    if missing:
        raise SystemExit(f"native_plan_table: --pass-over names no confirmed case: {sorted(missing)}")
    with open(args.out, "w") as fh:
        json.dump(table, fh, indent=1)
        fh.write("\n")
    for e in table["plans"]:
        print(f"{e['n']:>6}x{e['k']:<6} M {e['m_min']:>2}-{e['m_max']:<2} {e['rule_us']:>8.2f} -> {e['us']:>8.2f} us  {e['plan']}")
    print(f"{len(table['plans'])} entries -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
