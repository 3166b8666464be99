"""Where a decode step's time goes: the Llama-3-8B-shaped model of ``bench_decode.py`` with fewer
layers (the per-layer cost is what matters; embeddings and the 128256 x 4096 ``lm_head`` are kept
whole), timed and profiled kernel by kernel, in several variants from one run.

A variant is ``model[:option+option...]``:

- model ``w4`` (GPTQ v2 4-bit g128, qops) or ``bf16`` (``FastLinear``, cuBLAS), built as in
  ``bench_decode.py``;
- ``matmul`` / ``sdpa`` / ``fused``: the model's attention (``LlamaForCausalLM(attention=...)``,
  default fused);
- ``nopdl``: Inductor's kernels without programmatic dependent launch (``compile_decode(pdl=False)``;
  on by default on sm_90);
- ``nonativepdl``: the native W4A16 kernel launched without PDL (``QOPS_NATIVE_PDL=0``);
- ``ro``: also time the ``mode="reduce-overhead"`` loop of ``bench_decode.py`` (one more compile);
- ``fp16``: the model in fp16 instead of bf16 (``bench_decode.py``'s ``w4-fp16``);
- ``prewait``, ``l2pf``, ``bf16mma``, ``f16mma``, ``fold``, ``minb2``: measurements of M = 1 launch plans of the native W4A16
  kernel (the shipped plans changed as :func:`prewait_plan`, :func:`l2pf_plan`, :func:`bf16mma_plan`,
  :func:`f16mma_plan`, :func:`fold_plan`, :func:`minb2_plan` say, through ``qops.native.int_weight.plan_override``; the options compose).

Per variant: ``compile_decode(cuda_graphs=False)`` captured by ``qops.models.CapturedDecode``
(step, argmax and position update in one graph), ``--steps`` replays between CUDA events, median of
``--trials`` -> ``graph_step_ms``; then ``torch.profiler`` over ``--profile-steps`` replays: per
kernel name its microseconds and launches per step, kernels grouped by kind (qops native, qops or
Inductor Triton, cuBLAS, attention, copies), the busy time (union of kernel intervals) and the span.
``span - busy`` is the time between kernels. The first step's logits of each variant are compared
with the first variant's (same weights, prompt and positions).

    PYTHONPATH=. python benchmarks/profile_decode.py --variants w4:sdpa,w4:fused,w4:sdpa+nopdl,bf16:sdpa
    PYTHONPATH=. python benchmarks/profile_decode.py --dry-run      # CPU, tiny model: plumbing only

Writes ``$OUT/profile_decode.json`` (and ``--out``) after each variant; prints a table per variant.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import bench_decode  # the model builders (this script's folder is on sys.path)
import common

OPTIONS = ("matmul", "sdpa", "fused", "nopdl", "nonativepdl", "ro", "fp16", "prewait", "l2pf", "bf16mma", "f16mma", "fold", "minb2")
# Kernel kinds, first match wins: (kind, substrings of the kernel name).
KINDS = (
    ("qops native", ("w4a16",)),
    ("attention", ("fmha", "flash", "attention", "attn", "sdpa")),
    ("inductor triton", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("cublas", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "splitk")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
    ("torch eager", ("at::native",)),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, no graphs: checks the plumbing")
    p.add_argument("--variants", default="w4:fused+ro,w4:sdpa,w4:fused+nopdl,w4:fused+nonativepdl,bf16:fused",
                   help="comma-separated model[:option+...] (options: " + ", ".join(OPTIONS) + ")")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4; the 8B model has 32)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=48, help="replays per timed trial (default 48)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-seq", type=int, default=88, help="cache positions (default 88, as bench_decode's default run)")
    p.add_argument("--budget-s", type=float, default=420.0, help="no new variant starts after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.variant_list = []
    for v in args.variants.split(","):
        model, _, opts = v.strip().partition(":")
        opts = [o for o in opts.split("+") if o]
        bad = [o for o in opts if o not in OPTIONS]
        if model not in ("w4", "bf16") or bad:
            p.error(f"variant {v!r}: model must be w4 or bf16, options among {OPTIONS}")
        args.variant_list.append((v.strip(), model, opts))
    if args.prompt_len + args.steps + 2 > args.max_seq:
        p.error("--max-seq must exceed --prompt-len + --steps + 2 (replays advance the positions)")
    # bench_decode.build reads these.
    args.batch_list = [args.batch]
    return args


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "qops triton" if low.startswith(("_", "qops")) else "other"  # qops' Triton kernels are _*_kernel


def kernel_table(events, steps: int) -> dict:
    """Per-step kernel statistics from profiler events on the device."""
    per_name = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in events:
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        tr = e.time_range
        per_name[e.name][0] += tr.end - tr.start
        per_name[e.name][1] += 1
        spans.append((tr.start, tr.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    kinds = defaultdict(lambda: [0.0, 0.0])
    rows = []
    for name, (us, n) in per_name.items():
        k = kind_of(name)
        kinds[k][0] += us / steps
        kinds[k][1] += n / steps
        rows.append({"name": name[:160], "kind": k, "us_per_step": us / steps, "launches_per_step": n / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    # The last step kernel by kernel: [name, start, duration] in us from its first kernel's start
    # (with programmatic dependent launch a kernel starts before the one ahead ends and its
    # duration includes that wait; without it, gaps and durations are the kernels' own).
    last = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                   if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)))[-(len(spans) // max(steps, 1)):]
    t0 = last[0][0] if last else 0.0
    timeline = [[name[:60], round(s - t0, 2), round(e - s, 2)] for s, e, name in last]
    return {"kernels_per_step": len(spans) / steps, "busy_us_per_step": busy / steps, "span_us_per_step": span / steps,
            "kinds": {k: {"us_per_step": v[0], "launches_per_step": v[1]} for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
            "top": rows[:40], "timeline": timeline}


SMEM_PER_SM = 228 * 1024  # sm_90: shared memory of one SM (blocks also carry 1 KiB of static shared memory each)


def _remade(p, n: int, k: int, **changes):
    """``p`` with ``changes``, within the current device's shared memory."""
    import torch
    from qops.native import int_weight as niw

    return niw.remake_plan(p, n, k, niw.smem_optin_bytes(torch.cuda.current_device()), **changes)


def prewait_plan(p, m: int, n: int, k: int, sms: int):
    """``prewait``: the shared-memory ring holds every chunk of a warp (stages = chunks + 1) where that
    keeps as many blocks an SM as the grid needs (else the deepest ring that does, if deeper than the
    register ring's two chunks). Plans that fold the zero point or take f16 MMAs are left as they are:
    the gated gate/up projection (28672x4096 in the 8B model) is one, and the kernel's gated build has
    no shared-memory ring (an override cannot tell a gated call from a plain one).
    Measured at 6713cae: 664 -> 754 us an 8-layer step (`h200-2026-12-01-6713cae-profile-prewait.json`).
    """
    from qops.native import int_weight as niw

    if not p.xfull or p.smem_ring or p.nwn == 8 or p.fold or p.f16mma:
        return p
    per_sm = -(-p.tiles * p.splits // sms)
    for stages in range(min(niw.warp_chunks(k, p.nwn, p.splits) + 1, niw.SMEM_RING_MAX), 3, -1):  # > 3: deeper than the register ring
        try:
            q = _remade(p, n, k, smem_ring=stages)
        except ValueError:
            continue
        if per_sm * (q.shmem + niw.STATIC_SHMEM_BYTES) <= SMEM_PER_SM:
            return q
    return p


def l2pf_plan(p, m: int, n: int, k: int, sms: int):
    """``l2pf``: a warp of at most four chunks (6144x4096, 4096x4096 at M = 1) prefetches into L2, before
    griddepcontrol.wait, the chunks its register ring does not request then (QOPS_PREFETCH = its chunks:
    no prefetch is left for the main loop). The stamps (`h200-2026-12-01-4aa6c01-probe-layer-timeline.json`)
    put 2.6-3.3 us of these projections' time after the wait in their main loops. Measured
    (`...-8593935-probe-layer-timeline.json`): the loops unchanged, the 32-layer step 1900 against 1883 us:
    the loops do not wait for those loads."""
    from qops.native import int_weight as niw

    chunks = niw.warp_chunks(k, p.nwn, p.splits)
    if not p.xfull or p.smem_ring or p.prefetch or chunks > 4:
        return p
    return _remade(p, n, k, prefetch=chunks)


def bf16mma_plan(p, m: int, n: int, k: int, sms: int):
    """``bf16mma``: no f16 MMAs for bf16 x (``Plan.f16mma`` off). The stamps put 2.6 us of the gated
    28672x4096 projection's time after the wait in staging x, against 0.5-1 us for the plans without:
    the f16 path finds each row's largest magnitude first. Measured (`...-8593935-probe-layer-timeline.json`):
    x 1.0 us, the loop 15.6 -> 11.5 us, but the blocks entered it over 14 us; the step 1877 against 1883 us."""
    return _remade(p, n, k, f16mma=False) if p.f16mma else p


def f16mma_plan(p, m: int, n: int, k: int, sms: int):
    """``f16mma``: f16 MMAs for bf16 x (``Plan.f16mma`` on) in every plan that stages x once, not only from
    ``F16MMA_MIN_NK`` weights on. The bf16 and fp16 timelines of e4000e9 (`f1afed9-timeline-*.json`) put the
    bf16 model's o projection loop at 3.6 us against 2.6 in fp16 (the f16 dequantization is shorter)."""
    return _remade(p, n, k, f16mma=True) if p.xfull and not (p.f16mma or p.wgmma or p.smem_ring) else p


def fold_plan(p, m: int, n: int, k: int, sms: int):
    """``fold``: the bias and zero point taken off after the MMA (``Plan.fold``) where x is staged once:
    half the dequantization instructions for bf16 x (one and-or per two values, no subtraction). The
    stamps put the main loop of the 4-chunk projections at 1100-1360 SM cycles a chunk after the wait,
    unchanged with the chunks L2-hot (``l2pf``): the dequantization's issue, not the loads."""
    if not p.xfull or p.fold or p.smem_ring or p.mt != 1:
        return p
    return _remade(p, n, k, fold=True)


def minb2_plan(p, m: int, n: int, k: int, sms: int):
    """``minb2``: builds promising two blocks an SM (``__launch_bounds__(256, 2)``) for grids of more
    blocks than SMs. For the question of stop 29 / 30: the gated projection's bf16mma build (minb 1,
    127 registers) ran its 224 blocks in two waves where the f16mma build (held to minb 2) ran one."""
    return _remade(p, n, k, minb=2) if p.minb < 2 and p.tiles * p.splits > sms else p


PLAN_OPTIONS = {"prewait": prewait_plan, "l2pf": l2pf_plan, "bf16mma": bf16mma_plan, "f16mma": f16mma_plan, "fold": fold_plan,
                "minb2": minb2_plan}


def plan_override_for(opts):
    """A ``qops.native.int_weight.plan_override`` function applying the plan options in ``opts`` at
    M = 1 (None where there are none: the shipped plans)."""
    chosen = [PLAN_OPTIONS[o] for o in opts if o in PLAN_OPTIONS]
    if not chosen:
        return None

    def override(m: int, n: int, k: int, sms: int, cluster_ok: bool):
        if m != 1:
            return None
        import torch
        from qops.native import int_weight as niw

        p = base = niw.shipped_plan(m, n, k, torch.cuda.current_device())
        for f in chosen:
            p = f(p, m, n, k, sms)
        return None if p is base else p

    return override


def set_options(opts) -> None:
    import torch

    torch._dynamo.reset()
    if "nonativepdl" in opts:
        os.environ["QOPS_NATIVE_PDL"] = "0"
    else:
        os.environ.pop("QOPS_NATIVE_PDL", None)


def run_variant(label, kind, opts, config, device, dtype, args, ref_logits):
    set_options(opts)
    override = plan_override_for(opts)
    if override is not None:
        from qops.native import int_weight as niw

        with niw.plan_override(override):  # warm-up (in build) and capture both see the plans
            return _run_variant(label, kind, opts, config, device, dtype, args, ref_logits)
    return _run_variant(label, kind, opts, config, device, dtype, args, ref_logits)


def _run_variant(label, kind, opts, config, device, dtype, args, ref_logits):
    import torch

    from qops.models import CapturedDecode, compile_decode, generate

    attention = next((a for a in ("matmul", "sdpa") if a in opts), "fused")
    if "fp16" in opts:
        dtype = bench_decode.model_dtype("w4-fp16", dtype)
    row = {"variant": label, "model": kind, "options": opts, "attention": attention, "dtype": str(dtype).replace("torch.", "")}
    t = time.time()
    model = bench_decode.build(kind, config, device, dtype, args, attention=attention)
    row["build_s"] = round(time.time() - t, 1)
    row["lowerings"] = model.lowerings()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    start_tok = torch.randint(0, config.vocab_size, (args.batch,), generator=gen).to(device)
    start_pos = torch.full((args.batch,), args.prompt_len, dtype=torch.long, device=device)
    with torch.no_grad():
        model.prefill(prompts)
        pdl = False if "nopdl" in opts else None
        step = compile_decode(model, cuda_graphs=False, greedy=True, pdl=pdl)
        t = time.time()
        first = step(start_tok, start_pos)[0].float()
        bench_decode.sync(device)
        row["compile_s"] = round(time.time() - t, 1)
        row["first_logits_rel_err_vs_first_variant"] = None if ref_logits is None else common.rel_err(first, ref_logits)
        if device.type != "cuda":
            row["note"] = "dry run: no CUDA graph, no device profile"
            return row, first
        cap = CapturedDecode(model, step, args.batch, start_position=args.prompt_len)
        times = bench_decode.time_captured(cap, start_tok, start_pos, args.steps, args.trials)
        row["graph_step_ms"] = statistics.median(times)
        row["graph_trials_ms"] = times
        row["tokens_per_s"] = args.batch * 1e3 / row["graph_step_ms"]
        cap.start(start_tok, start_pos)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                cap.replay()
            torch.cuda.synchronize()
        row["profile"] = kernel_table(prof.events(), args.profile_steps)
        del cap
        if "ro" in opts:
            ro = compile_decode(model, cuda_graphs=True, pdl=pdl)
            generate(model, prompts, 4, step=ro, cuda_graphs=True)
            ts = []
            for _ in range(3):
                g = generate(model, prompts, args.steps + 1, step=ro, cuda_graphs=True)
                ts.append(1e3 * g.decode_s / g.decode_steps)
            row["reduce_overhead_step_ms"] = statistics.median(ts)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row, first


def render(row) -> str:
    lines = [f"== {row['variant']}: " + (f"{row['graph_step_ms'] * 1e3:.1f} us/step captured graph ({row['tokens_per_s']:.0f} tok/s)"
                                          if "graph_step_ms" in row else row.get("error", row.get("note", "")))]
    if "reduce_overhead_step_ms" in row:
        lines.append(f"   reduce-overhead loop: {row['reduce_overhead_step_ms'] * 1e3:.1f} us/step")
    if row.get("first_logits_rel_err_vs_first_variant") is not None:
        lines.append(f"   first-step logits vs first variant: rel err {row['first_logits_rel_err_vs_first_variant']:.2e}")
    pr = row.get("profile")
    if pr:
        lines.append(f"   kernels/step {pr['kernels_per_step']:.0f}, busy {pr['busy_us_per_step']:.1f} us, span {pr['span_us_per_step']:.1f} us, "
                     f"between kernels {pr['span_us_per_step'] - pr['busy_us_per_step']:.1f} us")
        for k, v in pr["kinds"].items():
            lines.append(f"   {k:16s} {v['us_per_step']:9.1f} us  {v['launches_per_step']:6.1f} launches")
        for r in pr["top"][:14]:
            lines.append(f"     {r['us_per_step']:8.1f} us x{r['launches_per_step']:4.1f}  {r['name'][:90]}")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    t0 = time.time()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("profile_decode: no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    common.add_repo_to_path()
    import qops  # noqa: F401
    from qops.models import LlamaConfig

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    config = (LlamaConfig.tiny(num_hidden_layers=2, vocab_size=512) if dry
              else dataclasses.replace(LlamaConfig.llama3_8b(), num_hidden_layers=args.layers))
    res = {"bench": "profile_decode", "gpu": common.device_name(not dry), "torch": torch.__version__, "triton": common.triton_version(),
           "qops_commit": common.git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "dry_run": dry, "config": config.to_dict(),
           "args": {k: v for k, v in vars(args).items() if k not in ("variant_list", "batch_list")}, "rows": [], "skipped": []}
    paths = common.output_paths("profile_decode.json", args.out)
    ref = None
    pdl_env = os.environ.get("QOPS_NATIVE_PDL")  # the variants set it; restored after them
    for label, kind, opts in args.variant_list:
        if time.time() - t0 > args.budget_s:
            res["skipped"].append(label)
            print(f"skipped {label}: budget spent", flush=True)
            continue
        try:
            row, first = run_variant(label, kind, opts, config, device, dtype, args, ref if kind == "w4" else None)
            if ref is None and kind == "w4":
                ref = first
        except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
            row = {"variant": label, "error": common.short_err(e)}
            torch._dynamo.reset()
        res["rows"].append(row)
        print(render(row), flush=True)
        common.write_json(res, paths)
    if pdl_env is None:
        os.environ.pop("QOPS_NATIVE_PDL", None)
    else:
        os.environ["QOPS_NATIVE_PDL"] = pdl_env
    res["elapsed_s"] = round(time.time() - t0, 1)
    common.write_json(res, paths)
    return 0


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
