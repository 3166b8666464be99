"""Does an L2 prefetch of the next matmul's weight shorten that matmul at batch-1 decode (H200)?

Each candidate is a short sequence captured in a CUDA graph once per rotated weight copy (method of
``common.py``: copies totalling > 256 MB, trials interleaved), timed per sequence:

- ``attn``: ``qops::decode_attention`` alone (Llama-3-8B layer: 32 / 8 heads of 128, one row at
  position ``--pos``); ``attn+mm``: then the native W4A16 matmul (GPTQ g128, bf16 x, M = 1) on copy i;
  ``attn_pf+mm``: the same with copy i's tensors passed as the attention's ``prefetch`` hint (what the
  model's ``l2_prefetch`` does);
- ``sleep``: a spin kernel of ``--sleep-cycles`` (``torch.cuda._sleep``), DRAM idle under it;
  ``sleep+mm`` / ``pf+sleep+mm``: the matmul after it, without / with ``l2_prefetch.request`` of copy
  i launched just before the spin on the same stream (isolates the prefetch from the side stream);
- ``mm``: the matmul alone on copy i (cold, back to back); ``mm_hot``: on copy 0 every time (its
  weight in L2: the floor a perfect prefetch could reach).

The matmul's cost behind X is ``X+mm - X``. Prints one line per shape; JSON with ``--out``.

    PYTHONPATH=. python benchmarks/probe_l2_prefetch.py [--shapes 4096x4096,6144x4096] [--trials 7]
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

import common
from common import clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.models import attention as _attention  # noqa: E402,F401  (registers qops::decode_attention)
from qops.native import int_weight as niw  # noqa: E402
from qops.native import l2_prefetch  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096)]  # Llama-3-8B o_proj, qkv


def tensors(w) -> list[torch.Tensor]:
    return [t for t in (w.qweight, w.scales, w.qzeros) if t is not None]


def main(argv=None) -> int:
    p = common.probe_parser("probe_l2_prefetch.py", __doc__, SHAPES, [1], 7)
    p.add_argument("--pos", type=int, default=80, help="the token's position (cache positions attended)")
    p.add_argument("--sleep-cycles", type=int, default=8000, help="torch.cuda._sleep cycles (~4 us at 1.98 GHz)")
    a = p.parse_args(argv)
    res = common.probe_result("l2_prefetch")
    if res is None:
        return 2
    dev = torch.device("cuda")
    assert l2_prefetch.warmup(dev)
    dtype = torch.bfloat16
    h, hk, d, seq = 32, 8, 128, 128
    qkv = torch.randn(1, (h + 2 * hk) * d, device=dev, dtype=dtype)
    emb = torch.outer(torch.arange(seq, dtype=torch.float32, device=dev), torch.rand(d // 2, device=dev)).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.tensor([a.pos], device=dev)
    kc = torch.randn(1, hk, seq, d, device=dev, dtype=dtype)
    vc = torch.randn(1, hk, seq, d, device=dev, dtype=dtype)

    def attn(ahead=None):
        return torch.ops.qops.decode_attention(qkv, cos, sin, pos, kc, vc, h, hk, d ** -0.5, ahead)

    for n, k in a.shapes:
        w16 = gptq_native(n, k)
        w = dataclasses.replace(w16, scales=w16.scales.to(dtype))
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device=dev, dtype=dtype)

            def mm(w):
                return niw.native_mm(x, w.qweight, w.scales, w.qzeros, w.act_perm, None, 4, 128, w.zero_offset)

            def sleep():
                torch.cuda._sleep(a.sleep_cycles)

            def pf_sleep_mm(w):
                l2_prefetch.request(tensors(w))
                sleep()
                return mm(w)

            cands = {
                "attn": [lambda: attn() for _ in ws],
                "attn+mm": [lambda w=w: (attn(), mm(w)) for w in ws],
                "attn_pf+mm": [lambda w=w: (attn(tensors(w)), mm(w)) for w in ws],
                "sleep": [sleep for _ in ws],
                "sleep+mm": [lambda w=w: (sleep(), mm(w)) for w in ws],
                "pf+sleep+mm": [lambda w=w: pf_sleep_mm(w) for w in ws],
                "mm": [lambda w=w: mm(w) for w in ws],
                "mm_hot": [lambda: mm(ws[0]) for _ in ws],
            }
            roof = common.roofline_us(w.nbytes(), res["copy_TBps"])
            row = {"N": n, "K": k, "M": m, "dtype": "bf16", "plan": str(niw.plan(m, n, k, 0)), "weight_bytes": w.nbytes(),
                   "copies": len(ws), "roofline_us": round(roof, 2)}
            for name, t in common.graph_times(cands, a.trials, 5.0).items():
                row[f"{name}_us"] = round(t.us, 2)
            row["mm_behind_attn_us"] = round(row["attn+mm_us"] - row["attn_us"], 2)
            row["mm_behind_attn_pf_us"] = round(row["attn_pf+mm_us"] - row["attn_us"], 2)
            row["mm_behind_sleep_us"] = round(row["sleep+mm_us"] - row["sleep_us"], 2)
            row["mm_behind_pf_sleep_us"] = round(row["pf+sleep+mm_us"] - row["sleep_us"], 2)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del ws, w16
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_l2_prefetch.json", a.out))
    print("\nN x K | M | mm cold | mm hot | behind attn | behind attn+pf | behind sleep | behind pf+sleep")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']} | {r['M']} | {r['mm_us']} | {r['mm_hot_us']} | {r['mm_behind_attn_us']} | {r['mm_behind_attn_pf_us']} | "
              f"{r['mm_behind_sleep_us']} | {r['mm_behind_pf_sleep_us']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
