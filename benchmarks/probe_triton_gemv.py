"""The Triton lowering's decode GEMV at M = 1 (H200): the shipped kernel at several configs against a
variant that reads x once a step (measurements only; in no lowering).

Why (benchmarks/NOTES.md, stop 42): the Triton path reads 40-58% of the roofline at M = 1 where PERF.md
asks 70%. Its sm_90 SASS (triton 3.9 on the CPU box, launch specializations applied) spends 4.25
instructions a 4-bit value at the shipped config (BLOCK_N 256, 4 chunks of 32 rows a step, 2 warps) in
254 registers: 3 are the value's work (a LOP3 into the fp32 mantissa, an FFMA taking off the magic and
the zero point, the accumulating FFMA), the rest mostly x (one 2-byte load, a conversion and its address
a K row, for the thread's 4 columns). ``_gemv_xtile_kernel`` below loads a step's x as one (rows, 8) tile
of 16-byte pieces and splits it into its eight columns in registers (``tl.split``): 4.2 a value in 128
registers at BLOCK_N 256 and 2 chunks. Which matters on the GPU -- instructions, registers (warps an SM),
or neither -- is what this probe measures: every candidate timed interleaved over rotated weight copies
(GPTQ W4 g128 asymmetric, fp16 x, the op's split-K plan and atomic reduction at each config), each
checked against the float64 product with the dequantized weight (``_rel_err``; the committed run at 3a913fd
compared with the shipped op's output, ``_rel_err_vs_op``).

Stop 59 added ``prefetch`` (a step's words, zero points and scales loaded during the step before: each warp's
loads then overlap its own arithmetic; 168 registers against 128 at the shipped config, so 6 programs an SM
instead of 8) and values past bit 23 read from ``w >> 12`` (4.2 -> 4.0 instructions a value). A config's
fourth field asks for the prefetch. Stop 60 made the shipped kernel load x as vectors, once a word (``x_vec``,
on by default; a fifth field 0 turns it off: the key then ends ``_scalarx``); a sixth caps the build's
registers (``maxnreg``: 104 holds 9 programs of 2 warps an SM where 124 holds 8; measured 4% slower on an
H100). Stop 61's seventh field asks for the packed fp16 dot (``half_dot`` 1, or 2 for two words a half-sum: the
key ends ``_halfdot`` / ``_halfdot2``); stop 62's eighth, 0, zeroes the atomic sum with ``zero_()`` before the
launch instead of by a kernel it is the programmatic dependent of (``pdl_zero``; the key then ends ``_zerofirst``);
``--ms`` times other rows of x than 1 (the one config at every M). ``--xtile`` times the x-tile
variant too; ``--baseline MODULE`` also times the ``_gemv_kernel`` of another copy of ``int_weight.py`` (say
the previous commit's, put beside it in the snapshot) at the configs without it, interleaved with the rest.

    PYTHONPATH=. python benchmarks/probe_triton_gemv.py [--shapes 28672x4096,...] [--configs 256,4,2[,1] ...]
        [--baseline qops.ops.triton.MODULE] [--out F]
"""
from __future__ import annotations

import copy
import importlib
import json
import sys

import torch
import triton
import triton.language as tl

import common
from common import LARGE_SHAPES, clone_tensors, n_copies

common.add_repo_to_path()

from probe_early_pdl import gptq_native  # noqa: E402
from qops.ops.triton import int_weight as T  # noqa: E402
from qops.ops.triton.int_weight import _high_word, _store_rows, _value, _word_columns, _zero_points  # noqa: E402


@triton.jit
def _pairs(t):
    """(R, 2n) -> its even and its odd columns, (R, n) each; (R, 2) -> two (R,) vectors."""
    if t.shape[1] == 2:
        return tl.split(t)
    else:
        return tl.split(tl.reshape(t, (t.shape[0], t.shape[1] // 2, 2)))


@triton.jit
def _columns8(t):
    """The eight columns of ``t`` (R, 8), in order."""
    e, o = _pairs(t)
    ee, eo = _pairs(e)
    oe, oo = _pairs(o)
    c0, c4 = _pairs(ee)
    c2, c6 = _pairs(eo)
    c1, c5 = _pairs(oe)
    c3, c7 = _pairs(oo)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _gemv_xtile_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, K, n_wrows,
    stride_xm, stride_xk, stride_qw, stride_qslab, stride_s, stride_qz, stride_ys, stride_ym, stride_yn,
    split_len, group_size, zero_offset, magic,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    OUT_MODE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """``_gemv_kernel``'s arguments; 4 bits, one row of x, no act_perm, whole steps (the probe's case).
    A step is R = 4 CHUNKS word rows: the (R, BLOCK_N) words, and x's (R, 8) values as one tile."""
    tl.static_assert(BITS == 4 and BLOCK_M == 1 and not HAS_PERM and EVEN_K)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    R: tl.constexpr = CHUNKS * 4
    STEP: tl.constexpr = 32 * CHUNKS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    nmask = offs_n < N
    qcol = _word_columns(offs_n, stride_qslab, BLOCK_N)
    r = tl.arange(0, R)
    k_lo = pid_k * split_len
    k_hi = tl.minimum(K, k_lo + split_len)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, STEP):
        g = k0 // group_size
        zf = _zero_points(qz_ptr, g, stride_qz, offs_n, nmask, zero_offset, BITS, HAS_ZEROS)[None, :]
        w_ptrs = qw_ptr + ((k0 // 32) * 4 + r)[:, None] * stride_qw + qcol[None, :]
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=nmask[None, :], other=0)
        w_hi = _high_word(w)
        xk = k0 + r[:, None] * 8 + tl.arange(0, 8)[None, :]
        xs = _columns8(tl.load(x_ptr + xk * stride_xk).to(tl.float32))
        p = tl.zeros([R, BLOCK_N], tl.float32)
        for i in tl.static_range(8):
            p += xs[i][:, None] * _value(w, w_hi, w, zf, magic, i, BITS)
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=nmask, other=0.0).to(tl.float32)
        acc += s * tl.sum(p, axis=0)
    _store_rows(y_ptr, bias_ptr, acc, 0, pid_k, M, N, offs_n, nmask, stride_ys, stride_ym, stride_yn, HAS_BIAS, OUT_MODE)


def decode_table(block_n: int, chunks: int, warps: int, prefetch: int = 0, x_vec: int = 1, maxnreg: int = 0,
                 half_dot: int = 0, pdl_zero: int = 1, pdl_reduce: int | None = None, device: str = "cuda") -> dict:
    """The shipped table (``device``'s) with one decode config for 4 bits, serving M <= 4 (``pdl_reduce`` set
    where given: 0 for a kernel without the ``PDL`` constexpr)."""
    table = copy.deepcopy(T.config_for(torch.device(device)))
    table["decode_max_m"] = {**table["decode_max_m"], "4": 4} if isinstance(table["decode_max_m"], dict) else 4
    by_m = table["decode"].get("4", table["decode"]["default"])
    own = {key: v for key, v in by_m["1"].items() if key != "short_split"}  # each candidate runs as written, at every K
    cfg = dict(own, BLOCK_N=block_n, CHUNKS=chunks, num_warps=warps, prefetch=prefetch, x_vec=x_vec, maxnreg=maxnreg,
               half_dot=half_dot, pdl_zero=pdl_zero, **({} if pdl_reduce is None else {"pdl_reduce": pdl_reduce}))
    table["decode"]["4"] = {"1": cfg}
    return table


def run_with(table: dict, kernel, f):
    """``f`` with the config ``table`` and the decode kernel ``kernel`` in force (both read at launch,
    so a captured graph keeps what it was captured with)."""
    def g():
        saved = T._gemv_kernel
        T._gemv_kernel = kernel
        try:
            with T.config_override(table):
                return f()
        finally:
            T._gemv_kernel = saved
    return g


def main(argv=None) -> int:
    p = common.probe_parser("probe_triton_gemv.py", __doc__, LARGE_SHAPES, [1], 7)
    p.add_argument("--configs", nargs="+", default=["256,4,2", "256,4,2,1", "256,2,2,1", "512,2,4", "512,2,4,1"],
                   help="BLOCK_N,CHUNKS,num_warps[,prefetch[,x_vec[,maxnreg[,half_dot[,pdl_zero]]]]] of each candidate "
                        "(x_vec and pdl_zero 1 unless given)")
    p.add_argument("--xtile", action="store_true", help="time the x-tile variant too (stop 42's, configs without prefetch)")
    p.add_argument("--baseline", help="a module whose _gemv_kernel is timed too (configs without prefetch, x loaded a value at a time)")
    a = p.parse_args(argv)
    kernels = [("shipped", T._gemv_kernel)] + ([("xtile", _gemv_xtile_kernel)] if a.xtile else [])
    if a.baseline:
        kernels.append(("baseline", importlib.import_module(a.baseline)._gemv_kernel))
    res = common.probe_result("triton_gemv")
    if res is None:
        return 2
    bw = res["copy_TBps"]
    configs = [(tuple(int(v) for v in c.split(",")) + (0, 1, 0, 0, 1)[c.count(",") - 2:])[:8] for c in a.configs]
    for (n, k), m in [(shape, m) for shape in a.shapes for m in a.ms]:
        w = gptq_native(n, k, "triton_int_weight")
        ws = [w] + [clone_tensors(w) for _ in range(n_copies(w.nbytes()) - 1)]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        roof = common.roofline_us(w.nbytes() + 2 * (k + n), bw)
        want = x.double() @ w.dequantize(torch.float64).T  # the float64 oracle of every candidate
        row = {"N": n, "K": k, "M": m, "roofline_us": round(roof, 2), "op_rel_err": common.rel_err(w.mm(x), want)}
        cands = {"op": [lambda v=v: v.mm(x) for v in ws]}
        for bn, ch, nw, pf, xv, cap, hd, zp in configs:
            for name, kern in kernels if not (pf or cap or hd or not zp) else kernels[:1]:
                # the other kernels know no XVEC (they run with x loaded a value at a time), no PDL (their reduction is an
                # ordinary launch) and no ZERO_WAIT (they zero the sum first)
                own = name == "shipped"
                table = decode_table(bn, ch, nw, pf, xv if own else 0, cap, hd, zp if own else 0, None if own else 0)
                key = (f"{name}_{bn}_{ch}_{nw}" + ("_prefetch" if pf else "") + ("_scalarx" if name == "shipped" and not xv else "")
                       + (f"_maxnreg{cap}" if cap else "") + ("_halfdot" if hd else "") + ("2" if hd == 2 else "")
                       + ("_zerofirst" if not zp else ""))
                try:
                    row[key + "_rel_err"] = common.rel_err(run_with(table, kern, lambda: w.mm(x))(), want)
                except Exception as e:  # noqa: BLE001  (a config the compiler or the device refuses)
                    row[key + "_error"] = common.short_err(e)
                    continue
                cands[key] = [run_with(table, kern, lambda v=v: v.mm(x)) for v in ws]
        for name, t in common.graph_times(cands, a.trials, 5.0).items():
            common.add_time(row, name, t.us, roof)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del w, ws
        torch.cuda.empty_cache()
    common.write_json(res, common.output_paths("probe_triton_gemv.json", a.out))
    print("\nN x K, M | " + " | ".join(sorted({key[:-3] for r in res["rows"] for key in r if key.endswith("_us") and key != "roofline_us"})))
    for r in res["rows"]:
        times = {key[:-3]: r[key] for key in r if key.endswith("_us") and key != "roofline_us"}
        print(f"{r['N']}x{r['K']}, {r['M']} | " + " | ".join(f"{key} {v} ({r.get(key + '_roof_pct', '-')}%)" for key, v in sorted(times.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
