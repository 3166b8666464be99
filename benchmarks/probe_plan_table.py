"""Do the native W4A16 plan table's entries still beat the rule, and by what (H200)?

The table (``qops/native/plans/<gpu>.json``) holds plans measured by sweeps at one commit; later
builds of the same plan can differ (registers, and with them the blocks an SM). For each entry
(default: those whose grid has more blocks than the GPU has SMs; ``--all``: every one), at the M it
was measured at, this times with interleaved trials over rotated weight copies (method of
``common.py``; GPTQ v2, 4 bits, group 128, asymmetric, fp16 x, as the sweeps):

- ``table``: the op as shipped (the entry's plan);
- each override of ``--plans`` (JSON list of plan fields applied to the entry, e.g. '[{"minb": 1}]':
  the plan as swept before minb was promoted), checked against the op's output;
- ``rule``: the plan ``qops.native.int_weight``'s rule picks for that shape.

It prints the entry's sweep time beside them (``us`` in the table).

    PYTHONPATH=. python benchmarks/probe_plan_table.py [--all] [--plans JSON] [--trials 7] [--out F]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import common
from common import clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="probe_plan_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="every entry, not only grids of more blocks than SMs")
    p.add_argument("--plans", type=json.loads, default=[], help="plan field overrides of each entry (JSON list)")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--out")
    a = p.parse_args(argv)
    res = common.probe_result("plan_table")
    if res is None:
        return 2
    dev = torch.cuda.current_device()
    table = niw.plan_tables().get(torch.cuda.get_device_name(dev))
    if table is None:
        print(f"no plan table for {torch.cuda.get_device_name(dev)}", file=sys.stderr)
        return 2
    sms, cluster_ok = niw._device_facts(dev)
    limit = niw.smem_optin_bytes(dev)
    bw = res["copy_TBps"]
    by_shape: dict = {}
    for e in table["plans"]:
        m = e["measured_at_m"]
        shipped = niw.make_plan(m, e["n"], e["k"], smem_limit=limit, **e["plan"])
        if a.all or shipped.tiles * shipped.splits > sms:
            by_shape.setdefault((e["n"], e["k"]), []).append((e, shipped))
    for (n, k), entries in by_shape.items():
        w = gptq_native(n, k)
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        for e, shipped in entries:
            m = e["measured_at_m"]
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            roof = common.roofline_us(w.nbytes() + 2 * m * (k + n), bw)
            row = {"N": n, "K": k, "M": m, "m_min": e["m_min"], "m_max": e["m_max"], "plan": e["plan"],
                   "sweep_us": e["us"], "sweep_rule_us": e["rule_us"], "roofline_us": round(roof, 2)}
            variants = {"table": None, "rule": niw._plan(m, n, k, sms, cluster_ok)}
            for fields in a.plans:
                variants[json.dumps(fields, sort_keys=True)] = niw.make_plan(m, n, k, smem_limit=limit, **(e["plan"] | fields))

            def under(plan, f):
                def g():
                    if plan is None:
                        return f()
                    with niw.plan_override(lambda *_: plan):
                        return f()
                return g

            want = w.mm(x).float()
            for name, plan in variants.items():
                if name not in ("table", "rule"):
                    row[name + "_rel_err_vs_op"] = common.rel_err(under(plan, lambda: w.mm(x))(), want)
            cands = {name: [under(plan, lambda v=v: v.mm(x)) for v in ws] for name, plan in variants.items()}
            common.time_row(res, row, cands, a.trials, roof)
        del w, ws
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_plan_table.json", a.out))
    names = ["table"] + [json.dumps(f, sort_keys=True) for f in a.plans] + ["rule"]
    print("\nN x K | M | sweep us | " + " | ".join(f"{v} us" for v in names))
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['sweep_us']} | " + " | ".join(str(r.get(v + "_us")) for v in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
