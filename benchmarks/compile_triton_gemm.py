"""Compile builds of the Triton int-weight GEMM (``_tc_kernel``) for sm_90 on a machine without a GPU.

A change to the GEMM's plan or tile that no GPU has run yet can at least be compiled by the Triton
the GPU machine has (3.6 today) down to cubin, which catches what the interpreter cannot: layouts
Triton cannot lower, shared memory past the device's, spills to local memory. Put that Triton first
on the path (``pip install --no-deps --target DIR triton==3.6.0``; its wheel carries ptxas):

    PYTHONPATH=DIR:. python benchmarks/compile_triton_gemm.py [--cases JSON] [--out F]

Each case is (bits, group size, activation dtype, BLOCK_M, BLOCK_N, even_odd); the plan is the one the
lowering makes for a 4096x4096 weight at M = BLOCK_M with a 128-deep K tile configured, built with
the inline-PTX unpack as on a GPU. Prints one JSON line a build: the K tile and whether it lies in one
group (``tile_group``), whether it compiled, its shared memory and whether that fits one sm_90 block (a
build past it is retried with fewer stages at run time), and whether its PTX touches local memory.
Stop 57 compiled the small-group tiles of branch ``small-group-tiles`` with it (14 builds, all to cubin).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import common

common.add_repo_to_path()

from qops.ops.triton import int_weight as T  # noqa: E402

CASES = [(2, 128, "fp16", 16, 128, 0), (2, 128, "bf16", 16, 128, 0), (2, 32, "fp16", 16, 128, 0), (4, 32, "fp16", 16, 128, 1),
         (4, 64, "bf16", 16, 128, 1), (4, 64, "fp16", 64, 64, 0), (8, 32, "fp16", 16, 128, 0), (4, 128, "fp16", 16, 128, 1)]
POINTERS = {"x_ptr": "act", "qw_ptr": "*i32", "s_ptr": "act", "qz_ptr": "*i32", "perm_ptr": "*i32", "bias_ptr": "act", "y_ptr": "*fp32"}
DEFAULTED = ("DEQUANT", "PREFETCH_S", "EVEN_ODD", "SYM_ZERO_LOAD", "PDL")
SM90_SHARED = 232448  # bytes of shared memory one block may have on sm_90 (227 KiB opt-in)


def compile_case(bits: int, group: int, dtype: str, block_m: int, block_n: int, even_odd: int) -> dict:
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
           "even_odd": even_odd, "impl": "triton", "ctas_per_sm": 4, "max_split": 32}
    table = {"gpu": "compile", "tuned": False, "source": "compile_triton_gemm", "num_sms": 132, "decode_max_m": 0,
             "decode": {"default": {"1": {}}}, "gemm": {"default": {"1": cfg}}}
    with T.config_override(table):
        plan = T._shape_plan(block_m, 4096, 4096, bits, group, torch.device("cpu"), "gemm", False)
    T._DEQUANT_FORCE = "asm"  # the GPU's form (the interpreter's would be the plain-Triton one)
    try:
        fn, consts, launch = T._split_k_build(plan, 1, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype]),
                                              bits, object(), None, None)
    finally:
        T._DEQUANT_FORCE = None
    for name in DEFAULTED:
        consts.setdefault(name, fn.params[fn.arg_names.index(name)].default)
    sig = {name: "constexpr" if name in consts else ("*" + dtype if POINTERS.get(name) == "act" else POINTERS.get(name, "i32"))
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    row = dict(bits=bits, group=group, dtype=dtype, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=plan["block_k"],
               tile_group=plan["tile_group"], even_odd=bool(consts["EVEN_ODD"]), triton=triton.__version__)
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=launch)
        ptx = k.asm["ptx"]
        row.update(ok=True, shared=k.metadata.shared, fits_sm90=k.metadata.shared <= SM90_SHARED, cubin_bytes=len(k.asm["cubin"]),
                   local_memory="ld.local" in ptx or "st.local" in ptx)
    except Exception as e:  # noqa: BLE001 - the failure is the result
        row.update(ok=False, error=repr(e)[:400])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=json.loads, default=CASES, help="JSON list of [bits, group, dtype, BLOCK_M, BLOCK_N, even_odd]")
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = []
    for case in a.cases:
        rows.append(compile_case(*case))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        common.write_json({"tool": "compile_triton_gemm", "rows": rows}, [a.out])
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
