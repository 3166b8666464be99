"""Time ``qops::decode_layers`` alone on Llama-3-8B-shaped layers (random 4-bit weights on the GPU),
per measurement build of ``qops/native/decode_layers.cu`` (``QOPS_LAYER_DEFINES``): one op call
captured in a CUDA graph, replayed; the median replay over the layers gives microseconds a layer and
the weight stream's rate (the layers' qweight, scales and zeros bytes / time).

    python3 benchmarks/probe_layer_kernel.py --layers 8 --variants '[{}, {"QOPS_PROBE": 1}, {"QOPS_STAMPS": 1}]'

Knobs (decode_layers.cu): QOPS_PROBE bit 1 skips the warps' math, bit 2 the grid barriers (results
wrong; what is left of the time); QOPS_PF the L2 prefetch distance in stages; QOPS_STAMPS 1 records
the global timer at each phase boundary of one layer in every block (printed as spans).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import common  # noqa: F401  (puts the repo on sys.path)


# decode_layers.cu's stamp points (QOPS_STAMPS builds), in order, for the stamped layer.
STAMP_POINTS = ["start", "norm1 staged", "qkv loop", "qkv finished", "barrier", "attention", "barrier", "attn out staged",
                "o loop", "o finished", "barrier", "norm2 staged", "gate/up loop", "gate/up finished", "barrier", "act staged",
                "down loop", "down finished", "barrier"]


def stamp_spans(ws, offset: int, torch, blocks: int, words: int) -> list[dict]:
    """Per span between consecutive stamp points of the stamped layer: the median and largest time a
    block spent in it, and how far apart the blocks' ends of it lie (max - min of the end stamp).
    ``blocks``, ``words``: the stamp region's shape (layer_kernel.MAX_STAMP_BLOCKS, STAMPS)."""
    n = len(STAMP_POINTS)
    t = ws[offset:offset + 8 * words * blocks].view(torch.int64).view(blocks, words)[:, :n].cpu()
    t = t[t[:, 0] > 0].double() / 1e3  # microseconds; blocks that ran
    out = []
    for i in range(1, n):
        d = t[:, i] - t[:, i - 1]
        out.append({"what": f"{STAMP_POINTS[i - 1]} -> {STAMP_POINTS[i]}", "median_us": round(float(d.median()), 2),
                    "max_us": round(float(d.max()), 2), "end_spread_us": round(float(t[:, i].max() - t[:, i].min()), 2)})
    out.append({"what": "layer (start -> last barrier)", "median_us": round(float((t[:, n - 1] - t[:, 0]).median()), 2),
                "max_us": round(float((t[:, n - 1] - t[:, 0]).max()), 2), "end_spread_us": round(float(t[:, n - 1].max() - t[:, n - 1].min()), 2)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--variants", default='[{}]', help="JSON list of define dicts")
    p.add_argument("--pos", type=int, default=80, help="the token's position (cache positions before it attended)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    p.add_argument("--profile-one", action="store_true",
                   help="after warming the first variant up, run one call between cudaProfilerStart and Stop and exit "
                        "(for ncu --profile-from-start off)")
    args = p.parse_args(argv)
    common.add_repo_to_path()
    import torch

    from qops.models import layer_kernel as LK

    dev = torch.device("cuda")
    dt = getattr(torch, args.dtype)
    d = LK.Dims(layers=args.layers, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = (((d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden), (d.hidden, d.heads * d.head_dim), (2 * d.inter, d.hidden),
              (d.hidden, d.inter))
    qweight, scales, qzeros, nbytes = [], [], [], 0
    for _ in range(d.layers):
        for n, k in shapes:
            qw = torch.randint(-2**31, 2**31 - 1, (n // 32, k // 8, 32), generator=g, device=dev, dtype=torch.int32)
            sc = (torch.rand(k // 128, n, generator=g, device=dev) * k ** -0.5 / 4).to(dt)
            qz = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), generator=g, device=dev, dtype=torch.int32)
            qweight.append(qw)
            scales.append(sc)
            qzeros.append(qz)
            nbytes += qw.nbytes + sc.nbytes + qz.nbytes
    max_seq = max(256, args.pos + 1)
    kc = [torch.randn(1, d.kv_heads, max_seq, d.head_dim, generator=g, device=dev).to(dt) for _ in range(d.layers)]
    vc = [torch.randn(1, d.kv_heads, max_seq, d.head_dim, generator=g, device=dev).to(dt) for _ in range(d.layers)]
    norms = [torch.ones(d.hidden, device=dev, dtype=dt) for _ in range(d.layers)]
    ang = torch.rand(max_seq, d.head_dim, device=dev)
    cos, sin = ang.cos(), ang.sin()
    hidden = torch.randn(1, d.hidden, generator=g, device=dev).to(dt)
    positions = torch.tensor([args.pos], device=dev)
    ws = torch.zeros(LK.workspace_bytes(d), dtype=torch.uint8, device=dev)
    op = torch.ops.qops.decode_layers
    call = (hidden, positions, cos, sin, norms, norms, qweight, scales, qzeros, kc, vc, ws, d.kv_heads, 128, 0, 1e-5, d.head_dim ** -0.5)
    rows = []
    print(f"probe_layer_kernel: {torch.cuda.get_device_name()} | {d.layers} Llama-3-8B layers, {nbytes / d.layers / 1e6:.1f} MB of weights a layer | pos {args.pos}")
    for variant in json.loads(args.variants):
        os.environ[LK.DEFINES_ENV] = json.dumps(variant)
        out = op(*call)
        torch.cuda.synchronize()
        if args.profile_one:
            torch.cuda.cudart().cudaProfilerStart()
            op(*call)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled one call of {json.dumps(variant)}")
            return 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(*call)
        times = []
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            graph.replay()
        for _ in range(args.reps):
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        med = statistics.median(times)
        spans = (stamp_spans(ws, LK.workspace_layout(d)["stamps"], torch, LK.MAX_STAMP_BLOCKS, LK.STAMPS)
                 if variant.get("QOPS_STAMPS") else None)
        row = {"defines": variant, "us_call": round(med, 1), "us_layer": round(med / d.layers, 2),
               "weight_GBps": round(nbytes / (med * 1e-6) / 1e9, 1), "finite": bool(torch.isfinite(out).all())}
        if spans is not None:
            row["stamps"] = spans
        rows.append(row)
        print(f"{json.dumps(variant):40s} {row['us_layer']:8.2f} us/layer  {row['weight_GBps']:7.1f} GB/s  finite {row['finite']}", flush=True)
        if spans is not None:
            for sp in spans:
                print(f"    {sp['what']:34s} median {sp['median_us']:6.2f}  max {sp['max_us']:6.2f} us   ends spread {sp['end_spread_us']:5.2f} us")
        del graph
    os.environ.pop(LK.DEFINES_ENV, None)
    res = {"gpu": torch.cuda.get_device_name(), "layers": d.layers, "pos": args.pos, "dtype": args.dtype,
           "weight_bytes_per_layer": nbytes // d.layers, "commit": os.environ.get("QOPS_COMMIT"), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
