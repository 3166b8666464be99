"""Does splitting the cache positions over more programs (split-KV) pay for ``qops::decode_attention``,
and from which cache length (H200)?

The Llama-3-8B attention of one layer (8 KV heads, 4 query heads each, head dim 128, bf16) at B rows,
timed alone with interleaved trials over rotated cache copies (method of ``common.py``): ``one``, one
program per (row, KV head) looping over the row's positions (the kernel before split-KV), and
``rule``, the split count ``qops.models.attention.attention_splits`` picks (``one`` again where it
picks 1). Each row's token sits at ``pos`` = ``max_seq - 1`` (a full cache) or ``max_seq / 8`` (early
in a long cache: the positions past it cost the split kernel idle programs). The roofline is the
k and v bytes read below ``pos`` at the measured copy bandwidth. Each row also compares the two
outputs.

    PYTHONPATH=. python benchmarks/probe_attention.py [--batches 1,8] [--seqs 88,512,...] [--out F]
"""
from __future__ import annotations

import sys

import torch

import common

common.add_repo_to_path()

from qops.models import attention as A  # noqa: E402

HKV, G, D = 8, 4, 128
SEQS = [88, 512, 1024, 2048, 4096, 8192, 16384, 32768]
MAX_CACHE_BYTES = 2**30  # both caches of one copy; larger (B, max_seq) pairs are skipped


def tables(max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device="cuda") / D))
    emb = torch.outer(torch.arange(max_seq, dtype=torch.float32, device="cuda"), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def main(argv=None) -> int:
    p = common.probe_parser("probe_attention.py", __doc__, [], [1], 7)
    p.add_argument("--batches", type=common.parse_ms, default=[1, 8])
    p.add_argument("--seqs", type=common.parse_ms, default=SEQS)
    a = p.parse_args(argv)
    res = common.probe_result("attention_splits")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b in a.batches:
        for max_seq in a.seqs:
            cache_bytes = 2 * b * HKV * max_seq * D * 2
            if cache_bytes > MAX_CACHE_BYTES:
                continue
            cos, sin = tables(max_seq)
            copies = common.n_copies(cache_bytes)
            caches = [(torch.randn(b, HKV, max_seq, D, generator=gen, device="cuda", dtype=dtype),
                       torch.randn(b, HKV, max_seq, D, generator=gen, device="cuda", dtype=dtype)) for _ in range(copies)]
            qkv = torch.randn(b, (HKV * G + 2 * HKV) * D, generator=gen, device="cuda", dtype=dtype)
            rule = A.attention_splits(b, HKV, max_seq, A.launch_config(D, G)["BLOCK_S"], sms)
            for pos in sorted({max_seq - 1, max_seq // 8}):
                positions = torch.full((b,), pos, dtype=torch.long, device="cuda")

                def attend(kc, vc, splits):
                    return A.triton_decode_attention(qkv, cos, sin, positions, kc, vc, HKV * G, HKV, D ** -0.5, splits=splits)

                roof = common.roofline_us(2 * b * HKV * pos * D * 2, bw)
                row = {"B": b, "max_seq": max_seq, "pos": pos, "rule_splits": rule, "roofline_us": round(roof, 2),
                       "rule_rel_err_vs_one": common.rel_err(attend(*caches[0], rule).float(), attend(*caches[0], 1).float())}
                cands = {"one": [lambda c=c: attend(*c, 1) for c in caches], "rule": [lambda c=c: attend(*c, rule) for c in caches]}
                common.time_row(res, row, cands, a.trials, roof, ratio=("rule_over_one", "rule", "one"))
            del caches
            torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_attention.json", a.out))
    print("\nB | max_seq | pos | splits | one us | rule us | rule / one | roofline us")
    for r in res["rows"]:
        print(f"{r['B']} | {r['max_seq']} | {r['pos']} | {r['rule_splits']} | {r['one_us']} | {r['rule_us']} | {r['rule_over_one']} | {r['roofline_us']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
