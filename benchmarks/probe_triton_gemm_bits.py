"""Why is the Triton int-weight GEMM slower at 4 bits than at 8 on the same tile?

On the H100 (h100-2026-12-05-b5a8ad6-tune-rows.json, M = 16, 28672x4096, g128) the tile 16 x 128 x 128
with 2 stages ran 59.7 us at 8 bits and 170.9 us at 4 bits, while 16 x 64 x 128 with 3 stages ran
199.6 us at 8 bits and 101.8 us at 4. Per GEMM config (``--configs``, JSON list) and bit width, this times the lowering's GEMM
path with the variants that separate the suspects, interleaved (A B A B ...) over rotated weight copies:

- ``zeros``: asymmetric (the tuner's case) against symmetric (no zero-point words: no per-group zero
  unpack, whose layout conversions the 4-bit loop has two more of);
- ``dequant``: the weight tile's unpack form (``asm``: inline PTX, the default on a GPU; ``triton``:
  the same arithmetic in Triton operations; ``fp32``: the generic fp32 unpack);
- both widths on the same random words, so the bytes differ by 2x and nothing else;
- at 4 bits, ``asm+even_odd``: the tile as its even and odd K rows (two dots), the shape of the 8-bit tile;
- ``+sym_zero_load``: the symmetric zero point derived from the scales' load instead of a constant.

The first run (h100-2026-12-05-032c3f3-probe-gemm-bits.json) found the tile, not the bytes: the 8-bit
16 x 128 x 128 build ran 59 us asymmetric and 183 us symmetric, and its sm_90 SASS (Triton 3.6) shows
why: the fast build unpacks in the MMA operand's registers, the slow ones store the tile to shared memory.

    PYTHONPATH=. python benchmarks/probe_triton_gemm_bits.py [--shapes 28672x4096] [--ms 16] [--configs JSON] [--out F]
"""
from __future__ import annotations

import json
import sys

import torch

import common

common.add_repo_to_path()

from qops.ops.triton import int_weight as T  # noqa: E402
from tune_triton_int_weight import GROUP, random_weight, single_table  # noqa: E402

CONFIGS = [  # the H100 table's M = 16 picks at 4 and at 8 bits, and the 8-bit one's 3-stage sibling
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 4},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 2},
    {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 4},
]
VARIANTS = [("asym", "asm"), ("sym", "asm"), ("asym", "triton"), ("asym", "fp32")]
# the 4-bit tile as even / odd K halves (``even_odd``: each half shaped as the 8-bit tile), asymmetric and symmetric
EVEN_ODD_VARIANTS = [("asym", "asm+even_odd"), ("sym", "asm+even_odd"), ("sym", "asm+even_odd+sym_zero_load")]
# the symmetric zero point derived from the scales' load (``sym_zero_load``), at both widths
SYM_VARIANTS = [("sym", "asm+sym_zero_load")]


def call(x, w, bits, cfg, zeros, form):
    qweight, scales, qzeros = w
    form, *knobs = form.split("+")
    # every knob off unless the variant names it (``sym_zero_load`` is on by default)
    full = ({"GROUP_M": 8, "impl": "triton", "max_split": 32, "reduce": "partials", "sym_zero_load": 0} | cfg
            | {knob: 1 for knob in knobs})
    with T.config_override(single_table("gemm", full)):
        T._DEQUANT_FORCE = form
        try:
            return T.triton_mm(x, qweight, scales, qzeros if zeros == "asym" else None, None, None, bits, GROUP, 0,
                               force_path="gemm")
        finally:
            T._DEQUANT_FORCE = None


def main(argv=None) -> int:
    p = common.probe_parser("probe_triton_gemm_bits.py", __doc__, [(28672, 4096)], [16], 5)
    p.add_argument("--configs", type=json.loads, default=CONFIGS, help="GEMM configs (JSON list of dicts)")
    a = p.parse_args(argv)
    res = common.probe_result("triton_gemm_bits")
    if res is None:
        return 2
    dev = torch.device("cuda")
    for n, k in a.shapes:
        for m in a.ms:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float16).to(dev)
            for cfg in a.configs:
                cands, meta = {}, {}
                for bits in (4, 8):
                    base = random_weight(n, k, bits, dev, 1)
                    copies = [base] + [tuple(t.clone() for t in base) for _ in range(common.n_copies(base[0].numel() * 4) - 1)]
                    ref = None
                    for zeros, form in VARIANTS + SYM_VARIANTS + (EVEN_ODD_VARIANTS if bits == 4 else []):
                        y = call(x, base, bits, cfg, zeros, form).float()
                        if zeros == "asym":  # every unpack form must give the asm form's answer
                            ref = y if ref is None else ref
                            err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
                        else:
                            err = None
                        name = f"W{bits} {zeros} {form}"
                        cands[name] = [lambda w=w, bits=bits, zeros=zeros, form=form: call(x, w, bits, cfg, zeros, form) for w in copies]
                        meta[name] = dict(bits=bits, zeros=zeros, dequant=form, rel_err_vs_asm=err)
                times = common.graph_times(cands, a.trials, 5.0)
                for name, t in times.items():
                    row = dict(N=n, K=k, M=m, config=cfg, **meta[name], us=round(t.us, 2))
                    res["rows"].append(row)
                    print(json.dumps(row), flush=True)
                del cands
                torch.cuda.empty_cache()
    print("\nN x K | M | config (BM x BN x BK / stages / ctas) | variant | us")
    for r in res["rows"]:
        c = r["config"]
        print(f"{r['N']}x{r['K']} | {r['M']} | {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}/{c['num_stages']}/{c['ctas_per_sm']} | "
              f"W{r['bits']} {r['zeros']} {r['dequant']} | {r['us']}")
    common.write_json(res, common.output_paths("probe_triton_gemm_bits.json", a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
