"""Probe: does this torch's scaled_mm take DeepSeek-style block scales (activations 1x128 per token,
weight 128x128) on this GPU, in which scale layouts, at which M, and how fast (a CUDA graph of 20 calls
on one weight, so L2-warm: a feasibility probe, not a benchmark)?

Variants: ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128``
and the weight's scale grid (N/128, K/128) padded along K to a multiple of 4 then transposed (v2_padT),
transposed only (v2_T) or as stored (v2_plain); ``torch._scaled_mm`` inferring the recipe from the
scale shapes (v1_infer, v1_inferT). Checked against a float64 product of the dequantized operands.

    PYTHONPATH=. python benchmarks/probe_blockfp8.py [OUT_DIR]     # writes OUT_DIR/probe-blockfp8.json
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn


def q_blocks(t, bm, bk):
    n, k = t.shape
    tt = t.float().reshape(n // bm, bm, k // bk, bk)
    amax = tt.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = amax / 448.0
    qv = (tt / s[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(n, k)
    return qv, s  # decode scale s: t ~= q * s


def ref(xq, xs, wq, ws):
    x = xq.float().reshape(xq.shape[0], -1, 128) * xs[:, :, None]
    w = wq.float().reshape(wq.shape[0] // 128, 128, -1, 128) * ws[:, None, :, None]
    return x.reshape(xq.shape[0], -1).double() @ w.reshape(wq.shape[0], -1).double().t()


def main() -> int:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cap": torch.cuda.get_device_capability(), "has_F_scaled_mm": hasattr(F, "scaled_mm")}
    ST = getattr(F, "ScalingType", None)
    out["scaling_types"] = [n for n in dir(ST) if not n.startswith("_")] if ST is not None else None
    res = []
    for (m, n, k) in [(1, 4096, 4096), (16, 4096, 4096), (17, 4096, 4096), (257, 4096, 4096), (64, 28672, 4096), (2048, 4096, 14336), (16, 384, 640)]:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda"); w = torch.randn(n, k, device="cuda") * 0.02
        xq, xs = q_blocks(x, 1, 128); wq, ws = q_blocks(w, 128, 128)
        want = ref(xq, xs, wq, ws)
        row = {"m": m, "n": n, "k": k}
        variants = {}
        if hasattr(F, "scaled_mm"):
            L = ws.shape[1]; L4 = -(-L // 4) * 4
            wsp = torch.nn.functional.pad(ws, (0, L4 - L))
            variants["v2_padT"] = lambda: F.scaled_mm(xq, wq.t(), xs.t().contiguous().t(), ST.BlockWise1x128, wsp.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)
            variants["v2_T"] = lambda: F.scaled_mm(xq, wq.t(), xs.t().contiguous().t(), ST.BlockWise1x128, ws.t(), ST.BlockWise128x128, output_dtype=torch.bfloat16)
            variants["v2_plain"] = lambda: F.scaled_mm(xq, wq.t(), xs.t().contiguous().t(), ST.BlockWise1x128, ws, ST.BlockWise128x128, output_dtype=torch.bfloat16)
        variants["v1_infer"] = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws, out_dtype=torch.bfloat16)
        variants["v1_inferT"] = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=torch.bfloat16)
        for name, f in variants.items():
            try:
                y = f(); torch.cuda.synchronize()
                err = ((y.double() - want).norm() / want.norm()).item()
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2): f()
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(g):
                    for _ in range(20): f()
                g.replay(); torch.cuda.synchronize()
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record(); g.replay(); b.record(); b.synchronize()
                row[name] = {"rel_err": err, "us": a.elapsed_time(b) * 1e3 / 20}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res.append(row); print(json.dumps(row), flush=True)
    out["rows"] = res
    json.dump(out, open(os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "probe-blockfp8.json"), "w"), indent=1)
    print({k: v for k, v in out.items() if k != "rows"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
