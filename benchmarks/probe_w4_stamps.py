"""Where one native W4A16 decode-kernel launch spends its time, per M (H200): the op alone.

Each (shape, M) runs the op's own plan with the decode kernel built with ``QOPS_STAMPS``
(``qops/native/w4a16_gemv.cu``; the builds differ from the shipped ones only by the stamps, a few
instructions in thread 0): each block's thread 0 stamps the global timer at entry, after the wait,
after x is staged, after the main loop and at its end, with the SM cycles of the last three spans
(``probe_layer_timeline.Stamper``, here for every tile height; on the workspace path the stamps
follow the partials, which the split-K finish still reads). Launches are plain stream launches with
the op's programmatic dependent launch, ``--trials`` in a row over rotated weight copies totalling
> 256 MB (``common.n_copies``), so the weights come from DRAM as in the benchmarks (0f300c6's run,
``h200-2026-12-02-0f300c6-probe-stamps.json``, used one weight: partly L2-hot); per launch the median
block's spans, then the median over launches. The question it answers: what M = 16 adds to M = 1 -- x staging (the
prologue each block runs before its loop), the loop, or the epilogue -- and the loop's SM cycles a
warp-chunk (128 K rows x 32 columns). Outputs are checked against the unstamped op.

    PYTHONPATH=. python benchmarks/probe_w4_stamps.py [--shapes 28672x4096,...] [--ms 1,8,16] [--trials 10] [--out F]
"""
from __future__ import annotations

import statistics
import sys

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from probe_layer_timeline import Stamper, block_loops_us, block_sms, block_stamps, site_rows  # noqa: E402
from qops.native import compiler  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

SPANS = ("pre_wait_med", "x_med", "loop_med", "loop_max", "epi_med", "post_wait")


def sm_spread(buf, sites) -> dict:
    """Whether the slow blocks' loops belong to particular SMs: per SM the mean main-loop span of the
    blocks it ran, in the first and the second half of the launches, and their correlation across SMs
    (near 1: the same SMs are slow launch after launch; near 0: the spread moves); the loop span by how
    many of the launch's blocks shared the SM; the five slowest SMs."""
    halves = [{}, {}]
    by_share: dict[int, list[float]] = {}
    for i, site in enumerate(sites):
        v = block_stamps(buf, site)
        loops, sms = block_loops_us(v).tolist(), block_sms(v).tolist()
        share = {sm: sms.count(sm) for sm in set(sms)}
        for lp, sm in zip(loops, sms):
            halves[0 if i < len(sites) // 2 else 1].setdefault(sm, []).append(lp)
            by_share.setdefault(share[sm], []).append(lp)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    common_sms = sorted(set(halves[0]) & set(halves[1]))
    a = torch.tensor([mean(halves[0][sm]) for sm in common_sms], dtype=torch.float64)
    b = torch.tensor([mean(halves[1][sm]) for sm in common_sms], dtype=torch.float64)
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if len(common_sms) > 2 else None
    overall = {sm: mean(halves[0].get(sm, []) + halves[1].get(sm, [])) for sm in set(halves[0]) | set(halves[1])}
    slowest = sorted(overall, key=overall.get, reverse=True)[:5]
    return {"sms_seen": len(overall), "sm_loop_corr_halves": None if corr is None else round(corr, 3),
            "loop_us_by_blocks_on_sm": {k: round(mean(v), 2) for k, v in sorted(by_share.items())},
            "slowest_sms_loop_us": {int(sm): round(overall[sm], 2) for sm in slowest},
            "sm_loop_us_min_med_max": [round(min(overall.values()), 2), round(statistics.median(overall.values()), 2),
                                       round(max(overall.values()), 2)]}


def main(argv=None) -> int:
    p = common.probe_parser("probe_w4_stamps.py", __doc__, LARGE_SHAPES, [1, 8, 16], 10)  # trials: stamped launches
    a = p.parse_args(argv)
    res = common.probe_result("w4_stamps")
    if res is None:
        return 2
    buf = torch.zeros(1 << 25, dtype=torch.int64, device="cuda")
    st = Stamper(compiler, niw, buf, mts=(1, 2, 3, 4))
    compiler.get_kernel, compiler.launch = st.get_kernel, st.launch
    try:
        for n, k in a.shapes:
            w = gptq_native(n, k)
            copies = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
            for m in a.ms:
                if m > niw.decode_rows(n, k, 0):
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                want = w.mm(x)
                plan = niw.plan(m, n, k, 0)
                st.on = True
                try:
                    got = w.mm(x)  # compiles and loads the stamped build
                    torch.cuda.synchronize()
                    st.sites.clear()
                    st.used = 0
                    for i in range(max(a.trials, len(copies))):
                        copies[i % len(copies)].mm(x)
                    torch.cuda.synchronize()
                finally:
                    st.on = False
                rows = [site_rows(buf, [s])[0] for s in st.sites]
                row = {"N": n, "K": k, "M": m, "plan": str(plan), "launches": len(rows), "weight_copies": len(copies),
                       "warp_chunks": niw.warp_chunks(k, plan.nwn, plan.splits),
                       "rel_err_vs_unstamped": common.rel_err(got, want.float())}
                for f in SPANS:
                    row[f] = round(statistics.median(r[f] for r in rows), 2)
                row["span"] = round(statistics.median(r["end"] - r["start"] for r in rows), 2)
                cyc = [statistics.median(r["cycles_med"][i] for r in rows) for i in range(3)]
                row["cycles_x_loop_epi"] = cyc
                row["loop_cycles_a_warp_chunk"] = round(cyc[1] / max(row["warp_chunks"], 1), 1)
                row.update(sm_spread(buf, list(st.sites)))
                res["rows"].append(row)
                print(row, flush=True)
            del w, copies
            torch.cuda.empty_cache()
    finally:
        compiler.get_kernel, compiler.launch = st._get, st._launch
    common.write_json(res, common.output_paths("probe_w4_stamps.json", a.out))
    print("\nN x K | M | chunks a warp | launch span | pre-wait | x | loop med / max | epilogue | loop cycles a warp-chunk")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['warp_chunks']} | {r['span']} | {r['pre_wait_med']} | {r['x_med']} | "
              f"{r['loop_med']} / {r['loop_max']} | {r['epi_med']} | {r['loop_cycles_a_warp_chunk']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
