"""One call of each chosen op, bracketed for Nsight Compute (``ncu``), to see what bounds the kernels.

The timing scripts say how fast a kernel is; the hardware counters say why. This script makes the
weights, warms every case up (NVRTC and Triton compiles, module loads), then runs one call per case
between ``cudaProfilerStart`` and ``cudaProfilerStop``, each inside an NVTX range named after the
case, so that ``ncu --profile-from-start off`` profiles exactly those launches and names them.
Cases (``--cases``, comma separated, ``KIND:NxK:M``):

- ``w4native``: GPTQ v2, 4 bits, group 128, asymmetric, fp16 x, the native W4A16 kernel;
- ``w4nativebf16``: the same weight (fp16 scales) with bf16 x, as the decode benchmark's model runs it;
- ``w4triton``: the same weight through the Triton lowering;
- ``w4wgmma``: the same weight through the Triton lowering's Gluon kernel (``int_weight_wgmma``) with the H100
  table's M = 64 tile and one K split, whatever the card's table says (Hopper only);
- ``nf4native``: bitsandbytes NF4, blocksize 64, nested absmax, fp16 x, the native kernel;
- ``nf4lut``: NF4 codes through the W4A16 kernel's codebook table (``qops.native.codebook_w4``, f16 absmax);
- ``w4gemmprobe4`` .. ``w4gemmprobe6``: ``w4native`` at M = 17..64 through a measurement build of the GEMM's
  rule plan (``int_weight_gemm.Plan.probe``: 4 no weight copies, 5 no dequantization, 6 neither; wrong sums,
  so not checked), to see what the MMA-only loop waits on;
- ``cublasfp16``: the peer, ``F.linear`` on a dense fp16 weight (cuBLAS);
- ``scaledmmfp8``: the peer, ``torch._scaled_mm`` on e4m3 x and weight with per-tensor scales (cuBLASLt): at
  M = 64 it streams twice the W4 weight's bytes faster than the W4 GEMM does (stop 42), so its kernel's launch
  shape, occupancy and memory throughput are the reference for that GEMM.

Under ``ncu`` (the device's image has it; ``--clock-control none`` leaves the clocks as found):

    ncu --profile-from-start off --nvtx --clock-control none --set full -o OUT/prof \\
        python benchmarks/profile_ncu.py --cases w4native:28672x4096:1,nf4native:28672x4096:1

Without ``ncu`` it runs the same calls and checks each output against a float64 reference of a few
rows, so a profile never describes a kernel that computes the wrong thing.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import common

common.add_repo_to_path()

from bench_bnb_int8 import call, decode_rows, nf4_weight  # noqa: E402
from probe_early_pdl import gptq_native  # noqa: E402
from probe_w4_lut import lut_weight  # noqa: E402
from qops.native import codebook_w4 as cw  # noqa: E402
from qops.lowerings import LOWERINGS_BY_NAME  # noqa: E402

KINDS = ("w4native", "w4nativebf16", "w4triton", "w4wgmma", "nf4native", "nf4lut", "cublasfp16", "scaledmmfp8", "w4gemmprobe4", "w4gemmprobe5",
         "w4gemmprobe6")
CHECK_ROWS = 64
WGMMA_TILE = {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "STAGES": 3}


def parse_cases(text: str) -> list[tuple[str, int, int, int]]:
    cases = []
    for item in text.split(","):
        try:
            kind, shape, m = item.split(":")
            n, k = (int(v) for v in shape.lower().split("x"))
            cases.append((kind, n, k, int(m)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"case {item!r} is not KIND:NxK:M") from None
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"case {item!r}: kind must be one of {', '.join(KINDS)}")
    return cases


def make_case(kind: str, n: int, k: int, m: int, gen):
    """(zero-argument call, float64 reference of the first CHECK_ROWS output columns)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    if kind == "w4nativebf16":
        x = x.to(torch.bfloat16)
    if kind == "nf4native":
        w = nf4_weight(n, k, "cuda", gen)
        w = dataclasses.replace(w, kernel=LOWERINGS_BY_NAME["native_blockwise4"].kernel)
        want = x.double() @ decode_rows(w, CHECK_ROWS).T
        return (lambda: call(w, x)), want
    if kind == "nf4lut":
        lw = lut_weight(n, k, gen)
        want = cw.reference_mm(x, lw["qweight"][: CHECK_ROWS // 32], lw["scales"][:, :CHECK_ROWS], lw["codebook"])
        return (lambda: cw.codebook_mm(x, lw["qweight"], lw["scales"], lw["codebook"])), want
    if kind in ("cublasfp16", "scaledmmfp8"):
        w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * 0.02
        if kind == "cublasfp16":
            return (lambda: torch.nn.functional.linear(x, w)), x.double() @ w[:CHECK_ROWS].double().T
        x8, w8 = x.to(torch.float8_e4m3fn), (w * 64).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        want = x8.double() @ w8[:CHECK_ROWS].double().T
        return (lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float16)), want
    w = gptq_native(n, k, "triton_int_weight" if kind in ("w4triton", "w4wgmma") else "native_w4a16")
    want = x.double() @ w.dequantize(torch.float64)[:CHECK_ROWS].T
    if kind == "w4wgmma":
        from qops.ops import int_weight as IW
        from qops.ops.triton import int_weight_wgmma as G
        qw = IW.flat_qweight(w.qweight)
        return (lambda: G.wgmma_mm(x, qw, w.scales, w.qzeros, w.act_perm, None, w.group_size, w.zero_offset,
                                   WGMMA_TILE)), want
    if kind.startswith("w4gemmprobe"):
        from qops.native import int_weight_gemm as gemm
        probe = gemm.with_fields(gemm.plan(m, n, k, torch.cuda.current_device()), n, k, probe=int(kind[-1]))

        def probed():
            with gemm.plan_override(lambda *_: probe):
                return w.mm(x)
        return probed, None
    return (lambda: w.mm(x)), want


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="profile_ncu.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=parse_cases, required=True, help="KIND:NxK:M, comma separated")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_ncu.py needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for kind, n, k, m in a.cases:
        f, want = make_case(kind, n, k, m, gen)
        for _ in range(3):
            got = f()
        torch.cuda.synchronize()
        if want is None:
            print(f"{kind}:{n}x{k}:{m} a measurement build: not checked", flush=True)
            runs.append((f"{kind}:{n}x{k}:{m}", f))
            continue
        err = common.rel_err(got[:, :CHECK_ROWS], want)
        print(f"{kind}:{n}x{k}:{m} rel err {err:.2e}", flush=True)
        if err is None or err > 1e-2:
            print("wrong result: not profiled", file=sys.stderr)
            return 1
        runs.append((f"{kind}:{n}x{k}:{m}", f))
    torch.cuda.profiler.start()
    for name, f in runs:
        with torch.cuda.nvtx.range(name):
            f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(name for name, _ in runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
