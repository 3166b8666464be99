"""FP8 benchmark: qops W8A8 against ``torch._scaled_mm`` called directly, qops W8A16 against cuBLAS
fp16/bf16, with the copy-bandwidth roofline measured in the same run.

Method (PERF.md "How to time", as ``../shared/anchors/bench_anchors.py``): correctness against a
float64 reference first; then CUDA-graph replays of calls over rotated weight copies (> 256 MB in all,
so the 50 MB L2 cannot hold the weight), CUDA events, median of trials. Per shape (N x K) one random
fp16 weight quantized per channel (``FORMATS["fp8"]``):

- ``mm_fp8_weight`` rows (W8A16, fp16 activations): ``qops_us`` is ``Fp8Weight.mm`` with the lowering
  the chooser picked (Triton on CUDA); ``cublas_fp16_us`` / ``cublas_bf16_us`` are ``F.linear`` on the
  dense weight.
- ``scaled_mm_fp8`` rows (W8A8, bf16 output), three scalings: ``rowwise`` (per-token activations x
  per-channel weight, what dynamic quantization produces), ``tensorwise`` (static input scale,
  per-tensor weight) and ``block`` (the same weight quantized in DeepSeek's 128 x 128 blocks,
  ``FORMATS["fp8-block"]``, with the activation scales the prepared weight asks for: per token and
  128 K values where the scaled_mm lowering serves it). ``qops_us`` is
  ``torch.ops.qops.scaled_mm_fp8`` on already-quantized activations; ``scaled_mm_us`` is the raw
  cuBLASLt call on the same tensors, called directly (no M padding; None where it raises):
  ``torch._scaled_mm`` for the first two, ``F.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128``
  for ``block`` (its scale layouts made outside the timed call; qops makes them inside);
  ``qops_e2e_us`` adds the activation quantization run eagerly (under torch.compile it fuses into the
  producer of x).
- ``roofline_us`` = ``(N*K + 2*M*(N+K))`` bytes / copy bandwidth (PERF.md's, or this run's where higher).

Writes ``$OUT/bench_fp8.json`` (and ``--out``); prints rows as they come, then a table and the
targets last (W8A8 >= 0.95x ``_scaled_mm`` at M >= 16; W8A16 M = 1 >= 70% of the roofline on the four
large shapes). About 2 minutes on an H200.

    PYTHONPATH=. python benchmarks/bench_fp8.py [--quick] [--shapes 4096x4096] [--ms 1,16]
    PYTHONPATH=. python benchmarks/bench_fp8.py --sweep          # M=1 gemv launch configs (tuning aid)
    PYTHONPATH=. python benchmarks/bench_fp8.py --dry-run        # CPU: plumbing only, numbers mean nothing
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

import common
from common import LARGE_SHAPES, clone_tensors, n_copies, rel_err

common.add_repo_to_path()

import qops  # noqa: E402,F401
from qops.formats import FORMATS  # noqa: E402
from qops.ops.fp8 import quantize_fp8_activations  # noqa: E402

MS = [1, 16, 64, 256, 2048]
W8A8_MIN_RATIO, W8A16_M1_MIN_ROOF = 0.95, 0.70


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=common.parse_shapes, help="comma-separated NxK; default the five of PERF.md")
    p.add_argument("--ms", type=common.parse_ms, help="comma-separated M; default 1,16,64,256,2048")
    p.add_argument("--quick", action="store_true", help="3 trials of ~5 ms instead of 5 of ~10 ms")
    p.add_argument("--trials", type=int)
    p.add_argument("--sweep", action="store_true", help="time gemv launch configs at M=1 on the large shapes and print the best")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, wall clock: checks the plumbing only")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    a.shape_list = a.shapes or ([(256, 512), (72, 200)] if a.dry_run else common.PERF_SHAPES)
    a.m_list = a.ms or ([1, 16] if a.dry_run else MS)
    a.trials = a.trials or (3 if a.quick or a.dry_run else 5)
    a.target_ms = 5.0 if a.quick or a.dry_run else 10.0
    return a


def safe(fn):
    """``fn()``, or None with the error printed (a peer that refuses a shape leaves its column empty)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"    ({common.short_err(e)[:200]})", flush=True)
        return None


def bench_shape(n, k, args, timer, dev, bw, rows):
    g = torch.Generator(device=dev).manual_seed(0)
    w16 = torch.randn(n, k, device=dev, generator=g, dtype=torch.float16) * 0.02
    fmt = FORMATS["fp8"]
    ckpt = fmt.quantize(w16, granularity="channel")
    ckpt_t = fmt.quantize(w16, granularity="tensor", input_scale=4.0 / 448)
    ckpt_b = FORMATS["fp8-block"].quantize(w16)
    w_deq = fmt.dequantize(ckpt).double()
    deq = {"rowwise": w_deq, "tensorwise": fmt.dequantize(ckpt_t).double(), "block": FORMATS["fp8-block"].dequantize(ckpt_b).double()}
    a16 = fmt.prepare(ckpt, dtype=torch.float16, activations="none")
    w8 = {"rowwise": fmt.prepare(ckpt, dtype=torch.bfloat16, activations="dynamic"),
          "tensorwise": fmt.prepare(ckpt_t, dtype=torch.bfloat16, activations="static"),
          "block": FORMATS["fp8-block"].prepare(ckpt_b, dtype=torch.bfloat16, activations="dynamic")}
    print(f"== {n}x{k}: W8A16 {a16.choice.lowering.name}; W8A8 " + ", ".join(f"{s} {w.choice.lowering.name}" for s, w in w8.items())
          + f" (block activation groups {w8['block'].x_group_size})", flush=True)
    gpu = torch.device(dev).type == "cuda"
    r8, r16 = n_copies(n * k, gpu), n_copies(2 * n * k, gpu)
    a16s = [clone_tensors(a16) for _ in range(r8)]
    w8s = {s: [clone_tensors(w) for _ in range(r8)] for s, w in w8.items()}
    dense16 = [w16.clone() for _ in range(r16)]
    dense_bf = [w16.bfloat16() for _ in range(r16)]
    for m in args.m_list:
        roof = common.roofline_us(n * k + 2 * m * (n + k), bw)
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float16)
        xb = x.bfloat16()
        # W8A16
        want16 = x.double() @ w_deq.t()
        err = rel_err(a16.mm(x), want16)
        err_out = common.out_form_err(lambda out: torch.ops.qops.mm_fp8_weight_out(
            x, a16.weight, a16.weight_scale, None, a16.block_n, a16.block_k, int(a16.kernel), out, None), n, x, want16)
        paired = safe(lambda: timer({"qops": [lambda w=w: w.mm(x) for w in a16s],
                                     "cublas_fp16": [lambda d=d: torch.nn.functional.linear(x, d) for d in dense16]})) or {}
        row = dict(op="mm_fp8_weight", format="fp8", scaling="channel", N=n, K=k, M=m, dtype="float16",
                   lowering=a16.choice.lowering.name, rel_err=err, rel_err_out=err_out, roofline_us=round(roof, 2),
                   qops_us=paired.get("qops"),
                   cublas_fp16_us=paired.get("cublas_fp16"),
                   cublas_bf16_us=safe(lambda: timer([lambda d=d: torch.nn.functional.linear(xb, d) for d in dense_bf])),
                   scaled_mm_us=None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        cublas16 = row["cublas_fp16_us"]
        # W8A8
        for scaling, ws in w8s.items():
            w = w8[scaling]
            x_fp8, x_scale = quantize_fp8_activations(xb, w.input_scale if w.activations == "static" else None, w.x_group_size)
            xs64 = x_scale.double()
            if w.x_group_size != -1:
                xs64 = xs64.repeat_interleave(w.x_group_size, dim=-1)[..., :k]
            want = (x_fp8.double() * xs64) @ deq[scaling].t()

            def op(w):
                return torch.ops.qops.scaled_mm_fp8(x_fp8, x_scale, w.weight, w.weight_scale, None, w.block_n, w.block_k,
                                                    torch.bfloat16, int(w.kernel))

            if scaling == "block":
                peer = block_peer(x_fp8, x_scale, ws)
            else:
                if scaling == "rowwise":
                    sa, sb = x_scale.reshape(m, 1), w.weight_scale.reshape(1, n)
                else:
                    sa, sb = x_scale.reshape(()), w.weight_scale.reshape(())
                peer = [lambda w=w: torch._scaled_mm(x_fp8, w.weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16) for w in ws]
            # The op and its peer with interleaved trials (common.graph_times): their ratio is the target.
            # A peer that refuses the shape (cuBLASLt's block recipe at M = 1) leaves the op timed alone.
            cands = {"qops": [lambda w=w: op(w) for w in ws]}
            if safe(peer[0]) is not None:
                cands["scaled_mm"] = peer
            paired = safe(lambda: timer(cands)) or {}
            row = dict(op="scaled_mm_fp8", format="fp8-block" if scaling == "block" else "fp8", scaling=scaling, N=n, K=k, M=m, dtype="bfloat16",
                       lowering=w.choice.lowering.name, rel_err=rel_err(op(w), want), roofline_us=round(roof, 2),
                       qops_us=paired.get("qops"),
                       qops_e2e_us=safe(lambda: timer([lambda w=w: w.mm(xb) for w in ws])),
                       scaled_mm_us=paired.get("scaled_mm"),
                       cublas_fp16_us=cublas16)
            rows.append(row)
            print(json.dumps(row), flush=True)
    del a16s, w8s, dense16, dense_bf
    torch.cuda.empty_cache()


def block_peer(x_fp8, x_scale, ws):
    """The raw ``F.scaled_mm`` DeepSeek-recipe call on each weight copy (benchmarks/probe_blockfp8.py's
    ``v2_padT``), its scale layouts made here, outside the timed call: activation scales outer-dim-major,
    the weight's grid padded along K/128 to a multiple of 4 and transposed."""
    f = torch.nn.functional
    sa = x_scale.t().contiguous().t()
    sbs = [f.pad(w.weight_scale, (0, -w.weight_scale.shape[1] % 4)).t() for w in ws]
    return [lambda w=w, sb=sb: f.scaled_mm(x_fp8, w.weight.t(), sa, f.ScalingType.BlockWise1x128, sb, f.ScalingType.BlockWise128x128,
                                           output_dtype=torch.bfloat16) for w, sb in zip(ws, sbs)]


def sweep(args, dev):
    """Time gemv launch configurations at M=1 (tuning aid for qops/ops/triton/fp8.py).

    Prints the five fastest per shape and writes every timing to ``$OUT/bench_fp8_sweep.json``
    (and ``--out`` with ``-sweep`` before the suffix)."""
    from qops.ops.triton.fp8 import triton_mm

    bw = common.copy_TBps()
    res = {"gpu": common.device_name(True), "torch": torch.__version__, "triton": common.triton_version(),
           "qops_commit": common.git_commit(), "copy_TBps": round(bw, 4), "shapes": []}
    extra = args.out.replace(".json", "-sweep.json") if args.out else None
    paths = common.output_paths("bench_fp8_sweep.json", extra)
    for n, k in LARGE_SHAPES:
        w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        pw = FORMATS["fp8"].prepare(FORMATS["fp8"].quantize(w16, granularity="channel"), dtype=torch.float16, activations="none")
        ws = [pw.weight.clone() for _ in range(n_copies(n * k))]
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        roof = common.roofline_us(n * k + 2 * (n + k), bw)
        default = common.graph_time([lambda w=w: triton_mm(x, None, w, pw.weight_scale, None, 1, -1, torch.float16) for w in ws], 3, 5.0).us
        results = []
        # Rows x bytes per step x warps x pipeline stages, 16-64 weight bytes a thread per step, no
        # split: the first sweep (85c0cb8: 2-32 rows, 4-16 KiB tiles, 4/8 warps, split 1/2/4) had its
        # best at 2 rows x 2048 bytes, 4 warps, split 1, at the small end of its grid.
        for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (2, 4, 8), (2, 3, 4)):
            if not 16 <= bn * bk // (32 * warps) <= 64:
                continue
            cfg = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=warps, num_stages=stages)
            t = safe(lambda: common.graph_time([lambda w=w: triton_mm(x, None, w, pw.weight_scale, None, 1, -1, torch.float16, config=cfg)
                                                for w in ws], 3, 5.0).us)
            if t:
                results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        print(f"{n}x{k} M=1 default config {default:7.2f} us = {100 * roof / default:5.1f}% of roofline", flush=True)
        for t, cfg in results[:5]:
            print(f"{n}x{k} M=1 {t:7.2f} us = {100 * roof / t:5.1f}% of roofline  {cfg}", flush=True)
        res["shapes"].append({"N": n, "K": k, "roofline_us": round(roof, 2), "default_us": round(default, 2),
                              "configs": [{"us": round(t, 2), "roof_pct": round(100 * roof / t, 1), **cfg} for t, cfg in results]})
        common.write_json(res, paths)
        del ws, pw, w16
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the plumbing on a CPU)")
        return 2
    if args.sweep:
        sweep(args, dev)
        return 0
    torch.manual_seed(0)
    meta = {"device": common.device_name(dev == "cuda"), "torch": torch.__version__,
            "triton": common.triton_version(), "commit": common.git_commit(), "dry_run": args.dry_run,
            **common.run_stamp(args, shapes=common.shape_names(args.shape_list), ms=args.m_list)}
    ceil = common.ceilings(args.trials, 20.0, not args.dry_run)
    bw = ceil.copy_TBps
    meta.update(copy_TBps=round(bw, 3), measured_ceilings=ceil.measured)
    print(meta, flush=True)

    def timer(fns):
        """us per call of the callables ``fns``, or of each candidate of a dict (name -> callables),
        their trials interleaved (common.graph_times)."""
        cands = fns if isinstance(fns, dict) else {"": fns}
        if args.dry_run:
            got = {name: round(common.wall_time(f, args.trials).us, 2) for name, f in cands.items()}
        else:
            got = {name: round(t.us, 2) for name, t in common.graph_times(cands, args.trials, args.target_ms).items()}
        return got if isinstance(fns, dict) else got[""]

    rows: list[dict] = []
    t0 = time.time()
    for n, k in args.shape_list:
        bench_shape(n, k, args, timer, dev, bw, rows)
    meta["seconds"] = round(time.time() - t0, 1)
    result = dict(meta, rows=rows)
    common.write_json(result, common.output_paths("bench_fp8.json", args.out))
    report(rows, args)
    return 0


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def report(rows, args):
    print("\nop             scaling     N      K      M     qops_us  scaled_mm  cublas16  cublas_bf16  roof_us  err")
    for r in rows:
        f = lambda v: f"{v:9.2f}" if isinstance(v, (int, float)) else f"{'-':>9}"  # noqa: E731
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "NaN"
        print(f"{r['op']:<14} {r['scaling']:<10} {r['N']:>6} {r['K']:>6} {r['M']:>5} {f(r['qops_us'])}  {f(r['scaled_mm_us'])} "
              f"{f(r['cublas_fp16_us'])}  {f(r.get('cublas_bf16_us'))}   {f(r['roofline_us'])}  {err}")
    print("\nTARGETS (PERF.md)")
    w8a8 = [r for r in rows if r["op"] == "scaled_mm_fp8" and r["M"] >= 16]
    for r in w8a8:
        ratio = _ratio(r["scaled_mm_us"], r["qops_us"])
        verdict = "n/a" if ratio is None else ("met" if ratio >= W8A8_MIN_RATIO else "NOT met")
        print(f"  W8A8 {r['scaling']:<10} {r['N']}x{r['K']} M={r['M']}: {ratio and round(ratio, 3)}x of _scaled_mm "
              f"(target >= {W8A8_MIN_RATIO}) {verdict}")
    for r in rows:
        if r["op"] == "mm_fp8_weight" and r["M"] == 1 and (r["N"], r["K"]) in LARGE_SHAPES:
            frac = _ratio(r["roofline_us"], r["qops_us"])
            verdict = "n/a" if frac is None else ("met" if frac >= W8A16_M1_MIN_ROOF else "NOT met")
            speed = _ratio(r["cublas_fp16_us"], r["qops_us"])
            print(f"  W8A16 M=1 {r['N']}x{r['K']}: {frac and round(100 * frac, 1)}% of roofline (target >= "
                  f"{100 * W8A16_M1_MIN_ROOF:.0f}%) {verdict}; {speed and round(speed, 2)}x cuBLAS fp16")
    bad = [r for r in rows if any(r.get(e, 0) is None or r.get(e, 0) > 2e-2 for e in ("rel_err", "rel_err_out"))]
    print(f"  correctness: {len(rows) - len(bad)}/{len(rows)} rows within 2e-2 of the float64 reference"
          + ("" if not bad else f"; FAILED: {[(r['op'], r['scaling'], r['N'], r['K'], r['M']) for r in bad]}"))


if __name__ == "__main__":
    sys.exit(main())
