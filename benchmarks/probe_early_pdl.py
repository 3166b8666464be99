"""Does releasing the next PDL launch at a native kernel's start (``kEarlyDependents``, switch
``QOPS_NATIVE_EARLY_PDL``) beat releasing it after the main loop (the default)?

Times, per shape and M, the native W4A16 kernel (GPTQ W4 g128 asym) and the native NF4 kernel (b64,
nested) over rotated weight copies with the method of ``common.py`` (CUDA-graph replays, the launches
chained by programmatic dependent launch as in a decoder), both settings captured in their own
graphs and timed with interleaved trials (``common.graph_times``).

    PYTHONPATH=. python benchmarks/probe_early_pdl.py [--shapes 28672x4096,...] [--ms 1,16] [--out F]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

import common
from common import clone_tensors, n_copies

common.add_repo_to_path()

from bench_bnb_int8 import call, nf4_weight, weight_bytes  # noqa: E402
from qops.native import int_weight as niw  # noqa: E402

SHAPES = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672), (6144, 4096), (4096, 4096)]


def gptq_native(n: int, k: int, lowering: str = "native_w4a16", dtype: torch.dtype = torch.float16,
                generator: torch.Generator | None = None, sym: bool = False):
    """A GPTQ W4 g128 (N, K) weight on the GPU, asymmetric unless ``sym``, prepared for ``dtype`` x, run by
    ``lowering`` (``generator``: the random weights' source, for inputs two runs must share)."""
    from qops.formats import FORMATS
    from qops.lowerings import LOWERINGS_BY_NAME

    fmt = FORMATS["gptq"]
    w = (torch.randn(n, k, device="cuda", generator=generator) * 0.02).to(dtype)
    iw = fmt.prepare(fmt.quantize(w, bits=4, group_size=128, sym=sym), dtype=dtype)
    return dataclasses.replace(iw, kernel=LOWERINGS_BY_NAME[lowering].kernel)


def under(early: str, f):
    """``f`` called with the switch set to ``early``: the flag is read at launch, so a graph keeps the
    setting its calls were captured under."""
    def g():
        os.environ[niw.EARLY_ENV] = early
        return f()
    return g


def main(argv=None) -> int:
    a = common.probe_parser("probe_early_pdl.py", __doc__, SHAPES, [1, 16], 7).parse_args(argv)
    res = common.probe_result("early_pdl")
    if res is None:
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in a.shapes:
        w4 = gptq_native(n, k)
        w4s = [w4] + [clone_tensors(w4) for _ in range(n_copies(w4.nbytes()) - 1)]
        nf = nf4_weight(n, k, torch.device("cuda"), gen)
        nfs = [nf] + [clone_tensors(nf) for _ in range(n_copies(weight_bytes("nf4", n, k)) - 1)]
        for m in a.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
            row = {"N": n, "K": k, "M": m}
            cands = {}
            for early in ("0", "1"):
                cands[f"w4/early={early}"] = [under(early, lambda w=w: w.mm(x)) for w in w4s]
                cands[f"nf4/early={early}"] = [under(early, lambda w=w: call(w, x)) for w in nfs]
            ts = {name: t.us for name, t in common.graph_times(cands, a.trials, 5.0).items()}
            os.environ.pop(niw.EARLY_ENV, None)
            for name, t in ts.items():
                row[name] = round(t, 2)
            for kind in ("w4", "nf4"):
                row[f"{kind}_early_over_default"] = round(row[f"{kind}/early=1"] / row[f"{kind}/early=0"], 3)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del w4s, nfs
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_early_pdl.json", a.out))
    print("\nN x K, M | w4 default / early us | nf4 default / early us")
    for r in res["rows"]:
        print(f"{r['N']}x{r['K']}, {r['M']} | {r['w4/early=0']} / {r['w4/early=1']} ({r['w4_early_over_default']}x) | "
              f"{r['nf4/early=0']} / {r['nf4/early=1']} ({r['nf4_early_over_default']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
