"""What does computing silu(gate) * up in the native W4A16 kernel's epilogue save (H200)?

A fused gate/up weight (N = 2H columns: gate, then up) at decode sizes, timed two ways with
interleaved trials over rotated weight copies (method of ``common.py``): ``unfused``, the native
matmul writing the (M, 2H) product followed by Inductor's SiLU-and-multiply kernel (what the decode
model ran before), and ``fused``, one launch writing the (M, H) gated output
(``qops.native.int_weight.native_mm(..., glu=True)``). GPTQ v2, 4 bits, group 128, asymmetric. Each
row also checks the fused output against the unfused one.

    PYTHONPATH=. python benchmarks/probe_swiglu.py [--shapes 28672x4096,...] [--ms 1,4,8,16] [--dtypes fp16,bf16] [--out F]
"""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

import common
from common import clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

# Gate/up of Llama-3 8B (TP 1, 2), Llama-3 70B at TP 8, Llama-2 7B, Qwen2.5 7B.
SHAPES = [(28672, 4096), (14336, 4096), (7168, 8192), (22016, 4096), (37888, 3584)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    h = y.shape[-1] // 2
    return F.silu(y[..., :h]) * y[..., h:]


def main(argv=None) -> int:
    p = common.probe_parser("probe_swiglu.py", __doc__, SHAPES, [1, 4, 8, 16], 7)
    p.add_argument("--dtypes", default="fp16,bf16", help="activation dtypes: fp16, bf16")
    a = p.parse_args(argv)
    res = common.probe_result("swiglu")
    if res is None:
        return 2
    compiled = torch.compile(silu_mul, dynamic=False)
    bw = res["copy_TBps"]
    for n, k in a.shapes:
        w16 = gptq_native(n, k)
        for dname in a.dtypes.split(","):
            dtype = DTYPES[dname]
            w = dataclasses.replace(w16, scales=w16.scales.to(dtype))
            ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
            for m in a.ms:
                x = torch.randn(m, k, device="cuda", dtype=dtype)

                def mm(w, glu):
                    return niw.native_mm(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, 4, 128, w.zero_offset, glu=glu)

                roof = common.roofline_us(w.nbytes() + 2 * m * (k + n // 2), bw)
                want = compiled(mm(w, False))
                row = {"N": n, "K": k, "M": m, "dtype": dname, "plan": str(niw.plan(m, n, k, 0)), "roofline_us": round(roof, 2),
                       "fused_rel_err_vs_unfused": common.rel_err(mm(w, True), want.float())}
                cands = {"unfused": [lambda w=w: compiled(mm(w, False)) for w in ws], "fused": [lambda w=w: mm(w, True) for w in ws]}
                common.time_row(res, row, cands, a.trials, roof, ratio=("fused_over_unfused", "fused", "unfused"))
            del ws
        del w16
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_swiglu.json", a.out))
    print("\nN x K | dtype | M | unfused us | fused us | fused / unfused | err")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['dtype']} | {r['M']} | {r['unfused_us']} | {r['fused_us']} | {r['fused_over_unfused']} | {r['fused_rel_err_vs_unfused']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
