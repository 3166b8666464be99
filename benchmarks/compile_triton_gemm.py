"""Compile builds of the Triton int-weight GEMM (``_tc_kernel``) for sm_90 on a machine without a GPU.

A change to the GEMM's plan or tile that no GPU has run yet can at least be compiled by the Triton
the GPU machine has (3.6 today) down to cubin, which catches what the interpreter cannot: layouts
Triton cannot lower, shared memory past the device's, spills to local memory. Put that Triton first
on the path (``pip install --no-deps --target DIR triton==3.6.0``; its wheel carries ptxas):

    PYTHONPATH=DIR:. python benchmarks/compile_triton_gemm.py [--cases JSON | --gemv JSON] [--sass] [--out F]

Each case is (bits, group size, activation dtype, BLOCK_M, BLOCK_N, even_odd[, maxnreg: a register cap, 0 for
none[, stream_k[, scale_weight]]]); the plan is the one the lowering makes for a 4096x4096 weight at M = BLOCK_M with a 128-deep K tile
configured, built with the inline-PTX unpack as on a GPU. Prints one JSON line a build: the K tile and whether
it lies in one group (``tile_group``), whether it compiled, its shared memory and whether that fits one sm_90
block (a build past it is retried with fewer stages at run time), and whether its PTX touches local memory.
Stop 57 compiled the small-group tiles of branch ``small-group-tiles`` with it (14 builds, all to cubin).

``--gemv JSON`` compiles decode GEMV builds (``_gemv_kernel``) instead, each (bits, group size, activation
dtype, BLOCK_N, CHUNKS, num_warps, M[, prefetch, x_vec, maxnreg, half_dot]), as the lowering plans them for 28672x4096
(each row says which knobs the build took).
``--sass`` adds, for every build, the SASS of its main loop (the longest block ending in a backward branch,
read with the wheel's nvdisasm): instructions a pass, the most frequent opcodes and, for a GEMV, the weight
values a thread handles a pass and the instructions per value, and the registers a thread uses. Integer
arguments equal to 1 (x's unit stride, GPTQ v1's zero offset) become constants, as a launch makes them:
without that, stop 58 counted 4.8 instructions a value for the 4-bit M = 1 GEMV, whose launched build issues
4.2 (x's address arithmetic was the difference); stop 59's ``w >> 12`` took it to 4.0, stop 60's x loaded as
vectors (``x_vec``, the ninth field, 1 unless given) to 3.76.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

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
DEFAULTED = ("DEQUANT", "PREFETCH_S", "EVEN_ODD", "SYM_ZERO_LOAD", "PDL", "PREFETCH", "XVEC", "HALF_DOT", "DOT_WORDS", "STREAM_K", "SCALE_W",
             "ZERO_WAIT")
SM90_SHARED = 232448  # bytes of shared memory one block may have on sm_90 (227 KiB opt-in)


def act_dtype(dtype: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


def one_config_table(decode_max_m: int, decode: dict, gemm: dict) -> dict:
    """A launch table whose decode and GEMM sections each hold one config (every bit width, every M)."""
    return {"gpu": "compile", "tuned": False, "source": "compile_triton_gemm", "num_sms": 132, "decode_max_m": decode_max_m,
            "decode": {"default": {"4": decode}}, "gemm": {"default": {"1": gemm}}}


def compile_case(bits: int, group: int, dtype: str, block_m: int, block_n: int, even_odd: int, maxnreg: int = 0,
                 stream_k: int = 0, scale_weight: int = 0, sass: bool = False) -> dict:
    """A GEMM build as planned for a 4096x4096 weight at M = ``block_m``: writing fp32 partials, or with
    ``stream_k`` the stream-K build as sm_90 launches it (atomic sum, PDL reduction and zeroing);
    ``scale_weight`` scales the weight tile, not the product."""
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
           "even_odd": even_odd, "impl": "triton", "ctas_per_sm": 4, "max_split": 32, "maxnreg": maxnreg,
           "stream_k": stream_k, "scale_weight": scale_weight}
    with T.config_override(one_config_table(0, {}, cfg)):
        plan = T._shape_plan(block_m, 4096, 4096, bits, group, torch.device("cpu"), "gemm", False)
    mode = 2 if plan["stream_k"] else 1
    T._DEQUANT_FORCE = "asm"  # the GPU's form (the interpreter's would be the plain-Triton one)
    try:
        fn, consts, launch = T._split_k_build(plan, mode, act_dtype(dtype), bits, object(), None, None, pdl=mode == 2,
                                              zero_wait=mode == 2, stream_k=plan["stream_k"])
    finally:
        T._DEQUANT_FORCE = None
    row = dict(bits=bits, group=group, dtype=dtype, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=plan["block_k"],
               tile_group=plan["tile_group"], maxnreg=maxnreg, stream_k=plan["stream_k"],
               scale_weight=bool(consts.get("SCALE_W")), triton=triton.__version__)
    return compiled_row(row, fn, consts, launch, dtype, sass, launch_ints(fn, plan, mode, block_m, 4096, 4096, bits, group, dtype))


def compile_gemv_case(bits: int, group: int, dtype: str, block_n: int, chunks: int, warps: int, m: int, prefetch: int = 0,
                      x_vec: int = 1, maxnreg: int = 0, half_dot: int = 0, sass: bool = False) -> dict:
    """A decode GEMV build as planned for a 28672x4096 weight at M = ``m`` (atomic reduction, as the tables ship),
    as sm_90 launches it: with the PDL reduction's trigger and the wait for the PDL zeroing of its sum."""
    cfg = {"BLOCK_N": block_n, "CHUNKS": chunks, "num_warps": warps, "num_stages": 1, "ctas_per_sm": 8, "max_split": 64,
           "reduce": "atomic", "prefetch": prefetch, "x_vec": x_vec, "maxnreg": maxnreg,
           "half_dot": half_dot}
    with T.config_override(one_config_table(4, cfg, {})):
        plan = T._shape_plan(m, 28672, 4096, bits, group, torch.device("cpu"), "decode", False)
    fn, consts, launch = T._split_k_build(plan, 2, act_dtype(dtype), bits, object(), None, None, pdl=True, zero_wait=True)
    row = dict(kernel="gemv", bits=bits, group=group, dtype=dtype, M=m, BLOCK_M=plan["block_m"], BLOCK_N=block_n,
               CHUNKS=plan["chunks"], num_warps=warps, prefetch=consts.get("PREFETCH", False), x_vec=consts.get("XVEC", False),
               maxnreg=maxnreg, half_dot=consts.get("HALF_DOT", 0), dot_words=consts.get("DOT_WORDS", 1),
               triton=triton.__version__)
    row = compiled_row(row, fn, consts, launch, dtype, sass, launch_ints(fn, plan, 2, m, 28672, 4096, bits, group, dtype))
    if sass and row.get("loop_sass"):
        # one pass of the loop: CHUNKS runs of 32 K values for the thread's BLOCK_N / (32 warps) columns
        values = plan["chunks"] * 32 * block_n // (32 * warps)
        row["loop_sass"].update(values_per_thread=values, per_value=round(row["loop_sass"]["instructions"] / values, 2))
    return row


def launch_ints(fn, plan, mode: int, m: int, n: int, k: int, bits: int, group: int, dtype: str) -> dict:
    """The integer run-time arguments a launch of this plan passes (``int_weight._split_k_args`` on meta
    tensors of the shapes), by parameter name: a GPU launch specializes those divisible by 16, and so must
    the compile here (without it, ptxas spilled in the GEMV's loop where the GPU's build does not)."""
    meta = torch.device("meta")
    act = act_dtype(dtype)
    groups = 1 if group == -1 else -(-k // group)
    x2 = torch.empty(m, k, dtype=act, device=meta)
    qweight = torch.empty(-(-k * bits // 32), n, dtype=torch.int32, device=meta)
    scales = torch.empty(groups, n, dtype=act, device=meta)
    qzeros = torch.empty(groups, -(-n * bits // 32), dtype=torch.int32, device=meta)
    o2 = torch.empty(m, n, dtype=act, device=meta)
    y = torch.empty(m, n, dtype=torch.float32, device=meta) if mode else o2
    args = T._split_k_args(x2, qweight, scales, qzeros, None, None, bits, group, 1, o2, y, mode, plan["split_len"])
    runtime = [param.name for param in fn.params if not param.is_constexpr]
    return {name: value for name, value in zip(runtime, args) if isinstance(value, int)}


def compiled_row(row: dict, fn, consts: dict, launch: dict, dtype: str, sass: bool, ints: dict | None = None) -> dict:
    """``row`` with what compiling ``fn`` for sm_90 gave (or the error); integer arguments in ``ints`` that are
    multiples of 16 are declared so, as a launch specializes them."""
    for name in DEFAULTED:
        if name in fn.arg_names:
            consts.setdefault(name, fn.params[fn.arg_names.index(name)].default)
    # a launch turns an integer argument equal to 1 (a unit stride, GPTQ v1's zero offset) into a constant
    consts.update({name: 1 for name, value in (ints or {}).items() if value == 1})
    sig = {name: "constexpr" if name in consts else ("*" + dtype if POINTERS.get(name) == "act" else POINTERS.get(name, "i32"))
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or (ints or {}).get(name, 1) % 16 == 0}
    if "EVEN_ODD" in consts:
        row["even_odd"] = bool(consts["EVEN_ODD"])
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=launch)
        ptx = k.asm["ptx"]
        row.update(ok=True, shared=k.metadata.shared, fits_sm90=k.metadata.shared <= SM90_SHARED, cubin_bytes=len(k.asm["cubin"]),
                   local_memory="ld.local" in ptx or "st.local" in ptx)
        if sass:
            row["registers"] = registers(k.asm["cubin"])
            row["loop_sass"] = loop_mix(k.asm["cubin"])
    except Exception as e:  # noqa: BLE001 - the failure is the result
        row.update(ok=False, error=repr(e)[:400])
    return row


SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")
LABEL = re.compile(r"^(\.L_x_\d+):")
BACK_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def read_cubin(tool: str, *args: str, cubin: bytes) -> str:
    """What ``tool`` (one of the binaries beside the Triton wheel's ptxas) prints for ``cubin``."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([exe, *args, path], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes) -> int | None:
    """Registers a thread of the build uses (cuobjdump): with the warps, how many programs an SM holds."""
    m = re.search(r"REG:(\d+)", read_cubin("cuobjdump", "--dump-resource-usage", cubin=cubin))
    return int(m.group(1)) if m else None


def loop_mix(cubin: bytes) -> dict | None:
    """The opcode mix of the cubin's main loop: the longest run of instructions from a label to a branch
    back to it with no such loop inside (nvdisasm beside Triton's ptxas), and whether any of the cubin
    spills to local memory; None when no loop is found."""
    lines = read_cubin("nvdisasm", "-c", cubin=cubin).splitlines()
    starts = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line.strip()))}
    loops = [(starts[m.group(1)], i) for i, line in enumerate(lines)
             if (m := BACK_BRANCH.search(line)) and m.group(1) in starts and starts[m.group(1)] < i]
    # innermost loops only: the stream-K build's K loop, not the loop over a program's tiles around it
    inner = [(a, b) for a, b in loops if not any(a <= c and d < b for c, d in loops if (c, d) != (a, b))]
    best = max(inner, key=lambda ab: ab[1] - ab[0], default=None)
    if best is None:
        return None
    opcodes = [(i, m.group(1), m.group(2) or "") for i, line in enumerate(lines) if (m := SASS_LINE.search(line))]
    ops = collections.Counter(op + (".F32" if op == "HADD2" and ".F32" in suffix else "")
                              for i, op, suffix in opcodes if best[0] <= i <= best[1])
    # ptxas spills appear only here, not in the PTX that ``local_memory`` reads
    spills = any(op in ("LDL", "STL") for _, op, _ in opcodes)
    return dict(instructions=sum(ops.values()), top=dict(ops.most_common(12)), spills=spills)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=json.loads, default=CASES, help="JSON list of [bits, group, dtype, BLOCK_M, BLOCK_N, even_odd(, maxnreg, stream_k, scale_weight)]")
    p.add_argument("--gemv", type=json.loads, help="JSON list of [bits, group, dtype, BLOCK_N, CHUNKS, num_warps, M(, prefetch, x_vec, maxnreg, half_dot)]: GEMV builds instead")
    p.add_argument("--sass", action="store_true", help="the main loop's SASS instruction mix of each build")
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = []
    for case in a.gemv if a.gemv is not None else a.cases:
        rows.append((compile_gemv_case if a.gemv is not None else compile_case)(*case, sass=a.sass))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        common.write_json({"tool": "compile_triton_gemm", "rows": rows}, [a.out])
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
