"""The Triton lowering of mm_int_weight, called directly (``triton_mm``), on small shapes.

Without a GPU the root conftest sets TRITON_INTERPRET=1 and the kernels run on CPU tensors (fp16 and
fp32; bf16 x only on the decode and dense paths, which convert it to fp32 on load: the interpreter's
bf16 arithmetic and bf16 ``tl.dot`` are wrong, ~1e9 off on a plain 16x32x16 dot, so the GEMM path's
bf16 is checked by the GPU suite only). Every path is forced through a config table
(``config_override``) or ``force_path``, with tiles small enough for the interpreter. The runtime
tensors are packed, and the oracle's float64 weight decoded from them, bit by bit by ``tests.oracle``
(not qops' packing or ``reference_dequantize``: a misreading of the layout shared by qops' reference
and its Triton kernels would pass a comparison of the two); every result is held to
a relative Frobenius error and to ``tests.oracle.check_elementwise`` (a bound per element, which the
GPU suite applies to the compiled kernels: here it is shown to hold on their arithmetic).
"""
from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

from qops.formats import FORMATS
from qops.formats.integer import act_order_g_idx
from qops.ops.int_weight import to_column_slabs
from qops.ops.triton import common as C
from qops.ops.triton import int_weight as T
from qops.ops.triton import x_gather as X

from tests import oracle as O
from tests.launch_recorder import KernelRecorder
from tests.oracle import check_elementwise, stride_two

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# Small tiles so the interpreter stays fast; num_sms makes the split-K rule produce several splits.
_DECODE = {"BLOCK_N": 64, "CHUNKS": 2, "num_warps": 1, "num_stages": 1, "ctas_per_sm": 4, "max_split": 8}
_GEMM = {"impl": "triton", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 1,
         "num_stages": 1, "ctas_per_sm": 4, "max_split": 8}
_DENSE = {"impl": "dense", "DQ_BLOCK_K": 32, "DQ_BLOCK_N": 32, "slab_bytes": 200 * 2 * 32}


def table(reduce="partials", decode_max_m=4, dense_from=None, max_split=8):
    gemm = {"64": {**_GEMM, "reduce": reduce, "max_split": max_split}}
    if dense_from is not None:
        gemm = {str(dense_from - 1): gemm["64"], "1000000": _DENSE}
    return {
        "gpu": "test", "tuned": False, "source": "tests", "num_sms": 4, "decode_max_m": decode_max_m,
        "decode": {"default": {"16": {**_DECODE, "reduce": reduce, "max_split": max_split}}},
        "gemm": {"default": gemm},
    }


def runtime_weight(n, k, bits, group_size, sym, act_order, zero_offset=1, scale_dtype=torch.float16, seed=0):
    """Random runtime tensors (the layout of qops.ops.int_weight), built without qops' prepare."""
    g = torch.Generator().manual_seed(seed)
    n_groups = 1 if group_size == -1 else -(-k // group_size)
    q = torch.randint(0, 2**bits, (k, n), generator=g)
    qweight = O.pack_stream(q.t(), bits).t().contiguous()  # (ceil(K*bits/32), N): each column's K values a stream
    scales = (torch.rand(n_groups, n, generator=g) * 0.02 + 0.005).to(scale_dtype)
    if sym:
        qzeros, zero_offset = None, 0
    else:
        stored = torch.randint(0, 2**bits, (n_groups, n), generator=g)
        qzeros = O.pack_stream(stored, bits)  # (G, ceil(N*bits/32)): each group's N zeros a stream
    act_perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(qweight), to(scales), to(qzeros), to(act_perm), zero_offset


def independent_weight(qweight, scales, qzeros, k, bits, group_size, zero_offset) -> torch.Tensor:
    """The float64 weight (N, K) of flat runtime tensors, read bit by bit (``tests.oracle.unpack_stream``):
    value (k, n) is bits ``k*bits ..`` of column n's stream, zero (g, n) bits ``n*bits ..`` of group g's
    plus ``zero_offset`` (2**(bits-1) without zeros), scale (g, n), g = k // group_size. Exact: a scale of
    at most 24 significant bits times an integer below 2**9."""
    n = qweight.shape[1]
    q = O.unpack_stream(qweight.cpu().t(), bits, k)  # (N, K)
    n_groups = scales.shape[0]
    if qzeros is None:
        z = np.full((n, n_groups), 2 ** (bits - 1), dtype=np.int64)
    else:
        z = O.unpack_stream(qzeros.cpu(), bits, n).T + zero_offset  # (N, G)
    g = np.zeros(k, dtype=np.int64) if group_size == -1 else np.arange(k) // group_size
    s = scales.cpu().double().numpy().T  # (N, G)
    return torch.from_numpy(s[:, g] * (q - z[:, g]).astype(np.float64))


def oracle_operands(x, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset):
    """(x with its K columns in the weight's order, float64; the float64 weight (N, K)) of the reference."""
    k = x.shape[-1]
    w = independent_weight(qweight, scales, qzeros, k, bits, group_size, zero_offset)
    xs = x.cpu().double()
    if act_perm is not None:
        xs = xs.index_select(-1, act_perm.cpu().long())
    return xs, w


def oracle(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset):
    xs, w = oracle_operands(x, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset)
    y = xs @ w.t()
    return y if bias is None else y + bias.cpu().double()


def rel_err(y, ref):
    return ((y.cpu().double() - ref).norm() / ref.norm()).item()


def assert_matches(y, x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, what=""):
    """``y`` against the float64 oracle: the relative Frobenius error under ``TOL`` and every element
    within ``check_elementwise``'s bound (which one wrong element fails)."""
    err = rel_err(y, oracle(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset))
    assert err < TOL[x.dtype], f"{what}: relative error {err:.2e}"
    xs, w = oracle_operands(x, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset)
    check_elementwise(y.cpu(), xs, w, None if bias is None else bias.cpu(), x.dtype, what)


def check(m, n, k, bits, group_size, sym, act_order, has_bias, dtype, path, zero_offset=1, seed=0, x_shape=None, slabs=False,
          strided=False, scale_dtype=torch.float16):
    """The kernel on the flat qweight (or, ``slabs``, on its column slabs) against the oracle of the flat one;
    ``strided``: scales, qzeros, act_perm and bias passed as views of stride 2 along their last dimension."""
    qweight, scales, qzeros, act_perm, zo = runtime_weight(n, k, bits, group_size, sym, act_order, zero_offset, scale_dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*(x_shape or (m,)), k, generator=g).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE) if has_bias else None
    q_in = to_column_slabs(qweight) if slabs else qweight
    view = stride_two if strided else (lambda t: t)  # noqa: E731
    y = T.triton_mm(x, q_in, *map(view, (scales, qzeros, act_perm, bias)), bits, group_size, zo, force_path=path)
    assert y.shape == (*x.shape[:-1], n) and y.dtype == dtype
    assert_matches(y, x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zo, f"{path} M={m} N={n} K={k} bits={bits} g={group_size}")
    return y


# (M, N, K, group_size, sym, act_order, bias, dtype): partial last groups in all but the first.
CASES = [
    (1, 40, 64, -1, True, False, False, torch.float32),
    (3, 72, 200, 32, False, True, True, torch.float16),
    (17, 56, 136, 64, False, False, True, torch.float16),
    (2, 48, 200, 128, True, True, False, torch.float32),
]


@pytest.fixture(autouse=True)
def small_tiles():
    with T.config_override(table()):
        yield


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("path", ["decode", "gemm", "dense"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}{'-act' if c[5] else ''}{'-bias' if c[6] else ''}-{str(c[7])[6:]}")
def test_paths_match_float64_oracle(case, path, bits):
    m, n, k, group_size, sym, act_order, has_bias, dtype = case
    check(m, n, k, bits, group_size, sym, act_order, has_bias, dtype, path)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("path", ["gemm", "dense"])  # the decode path serves a few rows (and takes a minute here at 257)
def test_prefill_paths_at_257_rows(path, bits):
    # Past every M tile and bucket edge, act-order, asymmetric, a bias and partial groups (K = 72, g 32).
    check(257, 40, 72, bits, 32, False, True, True, torch.float16, path)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("path", ["decode", "dense"])
def test_bf16_activations(path, bits):
    # Act-order, asymmetric, a bias, partial groups; M = 3 (decode) and 17 (past a tile) where bf16 runs here.
    for m in (3, 17) if path == "dense" else (3,):
        check(m, 72, 200, bits, 32, False, True, True, torch.bfloat16, path)


@pytest.mark.parametrize("bits", [3, 4])  # a value straddling words; whole words (the half-tile forms)
@pytest.mark.parametrize("path", ["decode", "gemm", "dense"])
def test_column_slabs(path, bits):
    """qweight in 32-column slabs (what weights prepared for the native lowering hold, which delegates
    here): three slabs, the last tile of columns partly outside N, act-order, a partial last group;
    the same result as the flat form, bit for bit (the same words in the same order)."""
    case = (5, 96, 136, bits, 64, False, True, True, torch.float16, path)
    with T.config_override(table(max_split=2)):
        assert torch.equal(check(*case, slabs=True), check(*case))


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("path", ["gemm", "dense"])
def test_group_size_that_splits_words(path, bits):
    # group 48: not a power of two and, for 3 bits, group boundaries fall inside words: the
    # per-element (gather) unpack with per-row scales.
    check(5, 40, 152, bits, 48, False, True, True, torch.float16, path)


@pytest.mark.parametrize("bits,group_size,block_k", [(2, 128, 128), (2, 32, 32), (4, 32, 32), (4, 64, 64), (8, 32, 32), (3, 32, 32)])
def test_gemm_keeps_the_word_unpack_for_groups_under_the_k_tile(bits, group_size, block_k):
    """A group smaller than the config's K tile shrinks the tile to the group (whole words, the dot's 16
    rows), so the product is scaled once a tile: the per-element gather (each row reading its own
    word) ran 2-bit g128 at 28672x4096, M = 16 in 1066 us on an H100, 27x the 4-bit g128 GEMM."""
    t = table()
    t["gemm"]["default"]["64"]["BLOCK_K"] = 256
    with T.config_override(t):
        plan = T._plan(16, 64, 1024, bits, group_size, torch.device(DEVICE), "gemm")
    assert plan["tile_group"] and plan["block_k"] == block_k, plan


@pytest.mark.parametrize("parts", [1, 5, C.REDUCE_MAX_S + 6])
def test_reduce_kernel_sums_every_partial(parts):
    """The split-K reduction alone against a float64 sum: a split count off the power of two (masked
    partial rows), more partials than one program loads at once (its loop), N off the column tile, a
    bias, and an output with a row stride of its own (a column slice)."""
    m, n = 3, 100
    g = torch.Generator().manual_seed(parts)
    p = torch.randn(parts, m, n, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(torch.float16).to(DEVICE)
    y = torch.zeros(m, n + 7, dtype=torch.float16, device=DEVICE)[:, 3:n + 3]
    block, block_s = C.reduce_tile(parts)
    assert block_s <= C.REDUCE_MAX_S and (parts <= C.REDUCE_MAX_S) == (block_s >= parts) and n % block
    C._reduce_kernel[(-(-n // block), m)](p, bias, y, m, n, parts, m * n, n, y.stride(0), y.stride(1),
                                          HAS_BIAS=True, BLOCK=block, BLOCK_S=block_s, num_warps=4)
    want = p.cpu().double().sum(0) + bias.cpu().double()
    torch.testing.assert_close(y.cpu().double(), want.to(torch.float16).double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("reduce", ["partials", "atomic"])
@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_split_k_reductions(reduce, path):
    with T.config_override(table(reduce=reduce)):
        plan = T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), path)
        assert plan["split"] > 1 and plan["reduce"] == reduce
        check(3, 72, 256, 4, 32, False, False, True, torch.float16, path)


@pytest.mark.parametrize("bits,group_size,k,dtype,act_order", [(4, 128, 1024, torch.float16, False), (8, 64, 512, torch.float16, True),
                                                               (2, 256, 1024, torch.float32, False), (4, -1, 1024, torch.float16, False)])
def test_prefetched_scales_give_the_same_bits(bits, group_size, k, dtype, act_order):
    """``prefetch_scales`` (the next K tile's scales loaded one iteration ahead) over several groups a split
    and several splits: the same output bit for bit as loading them where they are used, and the oracle's."""
    dev = torch.device(DEVICE)
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, k, bits, group_size, False, act_order, seed=3)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    out = {}
    for prefetch in (0, 1):
        t = table()
        t["gemm"]["default"]["64"]["prefetch_scales"] = prefetch
        with T.config_override(t):
            plan = T._plan(17, 72, k, bits, group_size, dev, "gemm")
            assert plan["split"] > 1 and plan["tile_group"] and plan["split_len"] >= 2 * plan["block_k"]
            assert group_size == -1 or plan["split_len"] > group_size  # a split crosses groups
            out[prefetch] = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, bits, group_size, zo, force_path="gemm")
    assert torch.equal(out[0], out[1])
    assert_matches(out[1], x, qweight, scales, qzeros, act_perm, None, bits, group_size, zo, f"prefetch bits={bits} g={group_size}")


@pytest.mark.parametrize("m,bits,group_size,k,dtype,act_order,sym,slabs", [
    (1, 4, 128, 1024, torch.float16, False, False, False),  # several groups a split, several splits
    (3, 8, 64, 512, torch.float16, True, False, True),      # act-order, column slabs, three rows
    (4, 2, 256, 1024, torch.float32, False, True, False),   # symmetric
    (2, 4, -1, 200, torch.bfloat16, False, False, False),   # K past the last whole step
    (1, 4, 32, 200, torch.float16, True, False, False),     # one run a step (g32), K tail, act-order
    (1, 3, 128, 512, torch.float16, False, False, False),   # 3 bits: asked for, not taken
])
def test_gemv_prefetch_gives_the_same_bits(m, bits, group_size, k, dtype, act_order, sym, slabs):
    """The decode GEMV with ``prefetch`` (each step's words, zero points and scales loaded during the step
    before) at N off the tile: the same output bit for bit as without it, and the oracle's."""
    dev = torch.device(DEVICE)
    n = 96  # off the 64-column tile, whole 32-column slabs
    qweight, scales, qzeros, act_perm, zo = runtime_weight(n, k, bits, group_size, sym, act_order, seed=5)
    q_in = to_column_slabs(qweight) if slabs else qweight
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    out = {}
    for prefetch in (0, 1):
        # two splits of several steps each (one where K is short: a program runs PREFETCH_MIN_STEPS or more)
        t = table(max_split=2 if k >= 512 else 1)
        t["decode"]["default"]["16"]["prefetch"] = prefetch
        with T.config_override(t):
            plan = T._plan(m, n, k, bits, group_size, dev, "decode")
            assert (plan["split"] > 1 or k < 512) and T.gemv_steps(plan) >= T.PREFETCH_MIN_STEPS
            build = T._split_k_build(plan, 1, dtype, bits, qzeros, act_perm, None)[1]
            assert build.get("PREFETCH", False) == (prefetch == 1 and bits != 3)
            out[prefetch] = T.triton_mm(x, q_in, scales, qzeros, act_perm, None, bits, group_size, zo, force_path="decode")
    assert torch.equal(out[0], out[1])
    assert_matches(out[1], x, qweight, scales, qzeros, act_perm, None, bits, group_size, zo, f"gemv prefetch bits={bits} g={group_size}")


@pytest.mark.parametrize("m,bits,group_size,k,dtype,act_order,prefetch,k_stride", [
    (1, 4, 128, 1024, torch.float16, False, 0, 1),   # several groups a split, several splits
    (4, 2, 128, 1024, torch.float16, False, 0, 1),   # 2 bits: two 8-value loads a word; four rows
    (3, 8, 64, 512, torch.bfloat16, False, 1, 1),    # 8 bits: 4-value loads; with the prefetch
    (2, 4, -1, 200, torch.float16, False, 0, 1),     # K past the last whole step: masked loads
    (1, 2, 32, 200, torch.float32, False, 0, 1),     # fp32 x, one run a step, K tail
    (3, 4, 128, 512, torch.float16, False, 0, 3),    # x's K stride 3 (a strided view)
    (1, 4, 128, 512, torch.float16, True, 0, 1),     # act-order: not taken
    (1, 3, 128, 512, torch.float16, False, 0, 1),    # 3 bits: not taken
])
def test_gemv_x_vec_gives_the_same_bits(m, bits, group_size, k, dtype, act_order, prefetch, k_stride):
    """The decode GEMV loading x as vectors (``x_vec``, the default) at N off the tile: bit for bit as with
    one scalar load a value (the same products in the same order), and the oracle's; x's K stride need
    not be 1."""
    dev = torch.device(DEVICE)
    n = 96
    qweight, scales, qzeros, act_perm, zo = runtime_weight(n, k, bits, group_size, False, act_order, seed=11)
    x = torch.randn(m, k * k_stride, generator=torch.Generator().manual_seed(12)).to(dtype).to(DEVICE)[:, ::k_stride]
    assert x.stride(1) == k_stride
    out = {}
    for x_vec in (0, 1):
        t = table(max_split=2)
        t["decode"]["default"]["16"].update(x_vec=x_vec, prefetch=prefetch)
        with T.config_override(t):
            plan = T._plan(m, n, k, bits, group_size, dev, "decode")
            assert plan["split"] > 1
            build = T._split_k_build(plan, 1, dtype, bits, qzeros, act_perm, None)[1]
            assert build.get("XVEC", False) == (x_vec == 1 and bits != 3 and not act_order), build
            out[x_vec] = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, bits, group_size, zo, force_path="decode")
    assert torch.equal(out[0], out[1])
    assert_matches(out[1], x, qweight, scales, qzeros, act_perm, None, bits, group_size, zo, f"gemv x_vec bits={bits}")


def test_gemv_x_vec_is_the_default_where_it_applies():
    assert [T.gemv_x_vec({}, b, False) for b in (2, 3, 4, 8)] == [True, False, True, True]
    assert not T.gemv_x_vec({}, 4, True) and not T.gemv_x_vec({"x_vec": 0}, 4, False)


@pytest.mark.parametrize("m,group_size,k,sym,zero_offset,k_stride,prefetch,words", [
    (1, 128, 1024, False, 1, 1, 0, 1),   # several groups a split; GPTQ v1's offset: zero points up to 16
    (4, 128, 512, False, 0, 1, 1, 1),    # four rows, with the prefetch
    (3, -1, 200, True, 0, 1, 0, 1),      # per-channel, symmetric, K past the last whole step (masked x)
    (2, 32, 512, False, 1, 3, 0, 1),     # x's K stride 3
    (1, 128, 1024, False, 1, 1, 1, 2),   # two words a half-sum, with the prefetch
    (3, -1, 200, True, 0, 3, 0, 2),      # two words: per-channel, K tail, x's K stride 3, three rows
])
def test_gemv_half_dot_matches_the_oracle(m, group_size, k, sym, zero_offset, k_stride, prefetch, words):
    """The decode GEMV's packed fp16 dot (``half_dot`` 1, or 2: two words a half-sum; here its plain-Triton
    form, the PTX's own test is ``test_half_dot_ptx_sums_x_times_q_minus_z_over_16``) at N off the tile,
    against the oracle, with x's sizes spread from 1e-3 to 2000 (the half-sums stay far from fp16's
    overflow)."""
    dev = torch.device(DEVICE)
    n = 96
    qweight, scales, qzeros, act_perm, zo = runtime_weight(n, k, 4, group_size, sym, False, zero_offset, seed=21)
    g = torch.Generator().manual_seed(22)
    size = 10 ** (torch.rand(m, k * k_stride, generator=g) * 6.3 - 3)
    x = (torch.randn(m, k * k_stride, generator=g) * size).half().to(DEVICE)[:, ::k_stride]
    t = table(max_split=2)
    t["decode"]["default"]["16"].update(half_dot=words, prefetch=prefetch)
    with T.config_override(t):
        plan = T._plan(m, n, k, 4, group_size, dev, "decode")
        assert plan["split"] > 1
        build = T._split_k_build(plan, 1, torch.float16, 4, qzeros, act_perm, None)[1]
        assert build["HALF_DOT"] == T.HalfDot.TRITON and build["XVEC"] and build.get("DOT_WORDS", 1) == words, build
        y = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, 4, group_size, zo, force_path="decode")
    assert_matches(y, x, qweight, scales, qzeros, act_perm, None, 4, group_size, zo, f"gemv half_dot M={m} K={k}")


def test_gemv_half_dot_only_where_asked_and_possible(monkeypatch):
    on = {"half_dot": 1}
    fp16, bf16 = torch.float16, torch.bfloat16
    assert T.gemv_half_dot(on, 4, fp16, True, False) == T.HalfDot.TRITON  # the interpreter's form
    monkeypatch.setattr(T, "interpreting", lambda: False)  # as on a GPU
    assert T.gemv_half_dot(on, 4, fp16, True, False) == T.HalfDot.ASM
    assert T.gemv_half_dot({}, 4, fp16, True, False) == T.HalfDot.OFF  # not asked
    # 2, 3 and 8 bits, bf16 and fp32 x, x loaded a value at a time (act-order, x_vec 0): not possible
    assert [T.gemv_half_dot(on, b, fp16, True, False) for b in (2, 3, 8)] == [T.HalfDot.OFF] * 3
    assert [T.gemv_half_dot(on, 4, d, True, False) for d in (bf16, torch.float32)] == [T.HalfDot.OFF] * 2
    assert T.gemv_half_dot(on, 4, fp16, False, False) == T.HalfDot.OFF
    # paired with the prefetch: taken with it, dropped where the prefetch is (programs too short)
    paired = {"half_dot": 1, "prefetch": 1}
    assert T.gemv_half_dot(paired, 4, fp16, True, True) == T.HalfDot.ASM
    assert T.gemv_half_dot(paired, 4, fp16, True, False) == T.HalfDot.OFF
    assert T.gemv_half_dot({"half_dot": 2}, 4, fp16, True, False) == T.HalfDot.ASM  # two words a half-sum
    with pytest.raises(ValueError, match="half_dot must be 0, 1 or 2"):
        T.gemv_half_dot({"half_dot": 3}, 4, fp16, True, False)


def test_gemv_prefetch_only_for_whole_words_and_long_programs():
    on, steps = {"prefetch": 1}, T.PREFETCH_MIN_STEPS
    assert [T.gemv_prefetch_applies(on, b, steps) for b in (2, 3, 4, 8)] == [True, False, True, True]
    assert not T.gemv_prefetch_applies({}, 4, steps) and not T.gemv_prefetch_applies({"prefetch": 0}, 4, steps)
    assert not T.gemv_prefetch_applies(on, 4, steps - 1)  # its extra first step would not be hidden


def test_gemv_steps_counts_a_programs_steps():
    with T.config_override(table(max_split=2)):
        plan = T._plan(1, 96, 1000, 4, 128, torch.device(DEVICE), "decode")
    assert plan["split"] == 2 and T.gemv_steps(plan) == -(-plan["split_len"] // (32 * plan["chunks"]))
    assert T.gemv_steps({"split_len": 512, "chunks": 4}) == 4 and T.gemv_steps({"split_len": 520, "chunks": 4}) == 5


@pytest.mark.parametrize("m,n,k,group_size,sym,act_order,has_bias,block_m,slabs", [
    (17, 72, 1024, 128, False, False, True, 16, False),   # off-tile M and N, several splits
    (1, 40, 512, -1, True, True, False, 16, False),       # per-channel, symmetric, act-order
    (33, 72, 256, 128, False, True, False, 128, False),   # tall tile: the scale enters the weight tile
    (5, 96, 1000, -1, False, False, False, 16, True),     # K off the tile (masked words), column slabs
])
def test_even_odd_k_halves_match_the_oracle(m, n, k, group_size, sym, act_order, has_bias, block_m, slabs):
    """``even_odd`` (4 bits: the even and the odd K rows as two dots, x split alike) against the float64
    oracle: both scale placements, masked K, slabs, act-order. fp16 only: the interpreter's bf16 dot is
    not exact (test_bf16_activations); bf16 runs in the PTX test below and on the GPU."""
    dtype = torch.float16
    t = table()
    t["gemm"]["default"]["64"].update(even_odd=1, BLOCK_M=block_m)
    assert T.even_odd_applies(t["gemm"]["default"]["64"], 4, T.dequant_form(dtype, 4, True))
    with T.config_override(t):
        plan = T._plan(m, n, k, 4, group_size, torch.device(DEVICE), "gemm")
        assert plan["tile_group"] and plan["block_k"] == 128 and (2 * block_m > plan["block_k"]) == (block_m == 128)
        check(m, n, k, 4, group_size, sym, act_order, has_bias, dtype, "gemm", slabs=slabs)


@pytest.mark.parametrize("sym_zero_load", [0, 1])
@pytest.mark.parametrize("bits,group_size,even_odd,block_m", [(8, 128, 0, 16), (4, -1, 1, 16), (4, 128, 0, 128), (2, 256, 0, 16)])
def test_symmetric_zero_point_from_the_scales_matches_the_oracle(bits, group_size, even_odd, block_m, sym_zero_load):
    """``sym_zero_load`` (symmetric weights: the zero point 2**(b-1) derived from the scales' load) and the
    constant zero point, each forced by the config, against the oracle, with and without the even / odd
    split, on both scale placements."""
    t = table()
    t["gemm"]["default"]["64"].update(sym_zero_load=sym_zero_load, even_odd=even_odd, BLOCK_M=block_m)
    with T.config_override(t):
        check(17, 72, 1024, bits, group_size, True, False, True, torch.float16, "gemm")
        check(3, 40, 256, bits, group_size, False, True, False, torch.float16, "gemm")  # asymmetric: the knob does nothing


def test_symmetric_zero_point_is_derived_where_it_keeps_the_unpack_in_registers():
    half = T.Dequant.HALF_ASM
    assert T.sym_zero_load_applies({"BLOCK_M": 16}, 8, half, True)
    assert T.sym_zero_load_applies({"BLOCK_M": 32, "even_odd": 1}, 4, half, True)
    assert not T.sym_zero_load_applies({"BLOCK_M": 16}, 4, half, True)  # the 4-bit interleave: shared memory anyway
    assert not T.sym_zero_load_applies({"BLOCK_M": 64}, 8, half, True)  # wgmma: the weight from shared memory
    assert not T.sym_zero_load_applies({"BLOCK_M": 16}, 8, half, False)  # zero points of its own
    assert not T.sym_zero_load_applies({"BLOCK_M": 16}, 8, T.Dequant.FP32, True)  # the fp32 unpack: not measured
    assert T.sym_zero_load_applies({"BLOCK_M": 64, "sym_zero_load": 1}, 4, half, True)
    assert not T.sym_zero_load_applies({"BLOCK_M": 16, "sym_zero_load": 0}, 8, half, True)


def test_even_odd_is_only_taken_where_it_applies():
    cfg = {"even_odd": 1}
    assert T.even_odd_applies(cfg, 4, T.Dequant.HALF_ASM) and T.even_odd_applies(cfg, 4, T.Dequant.HALF_TRITON)
    assert not T.even_odd_applies(cfg, 8, T.Dequant.HALF_ASM) and not T.even_odd_applies(cfg, 2, T.Dequant.HALF_ASM)
    assert not T.even_odd_applies(cfg, 4, T.Dequant.FP32) and not T.even_odd_applies({}, 4, T.Dequant.HALF_ASM)
    # fp32 activations and groups that split the K tile take the fp32 unpack, so not the split either
    assert T.dequant_form(torch.float32, 4, True) == T.Dequant.FP32 and T.dequant_form(torch.float16, 4, False) == T.Dequant.FP32


@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_single_split_writes_output_directly(path):
    with T.config_override(table(max_split=1)):
        assert T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), path)["split"] == 1
        check(3, 72, 256, 4, 32, False, True, True, torch.float16, path)


def test_zero_offset_zero_and_fp32_scales():
    qweight, scales, qzeros, act_perm, zo = runtime_weight(40, 96, 4, 32, False, False, zero_offset=0, scale_dtype=torch.float32)
    x = torch.randn(2, 96).half().to(DEVICE)
    for path in ("decode", "gemm", "dense"):
        y = T.triton_mm(x, qweight, scales, qzeros, None, None, 4, 32, zo, force_path=path)
        assert_matches(y, x, qweight, scales, qzeros, None, None, 4, 32, zo, path)


@pytest.mark.parametrize("path", ["decode", "gemm", "dense"])
def test_strided_and_batched_activations(path):
    qweight, scales, qzeros, act_perm, zo = runtime_weight(40, 64, 4, 32, False, True)
    base = torch.randn(2, 3, 2 * 64).half().to(DEVICE)
    x = base[..., ::2]  # (2, 3, 64), stride 2 along K
    y = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, 4, 32, zo, force_path=path)
    assert y.shape == (2, 3, 40)
    assert_matches(y, x, qweight, scales, qzeros, act_perm, None, 4, 32, zo, path)


@pytest.mark.parametrize("path", ["decode", "gemm", "dense"])
def test_small_tensors_with_any_strides(path):
    """The op accepts scales, qzeros, act_perm and bias with any strides; the kernels read rows of them
    with unit stride, so the entry makes those rows contiguous (a strided bias read as if contiguous
    was off by ~500x, qzeros and act_perm by ~100%)."""
    check(5, 72, 200, 4, 32, False, True, True, torch.float16, path, strided=True)


@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_out_and_workspace(path):
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, 256, 4, 32, False, False)
    x = torch.randn(3, 256).half().to(DEVICE)
    need = T.workspace_bytes(3, 72, 256, 4, 32, torch.device(DEVICE))
    assert need > 0
    workspace = torch.full((need,), 255, dtype=torch.uint8, device=DEVICE)  # garbage: must not matter
    out = torch.full((3, 72), float("nan"), dtype=torch.float16, device=DEVICE)
    ret = T.triton_mm(x, qweight, scales, qzeros, None, None, 4, 32, zo, out=out, workspace=workspace, force_path=path)
    assert ret is out
    assert_matches(out, x, qweight, scales, qzeros, None, None, 4, 32, zo, path)
    # A non-contiguous out is written too.
    big = torch.full((72, 3), float("nan"), dtype=torch.float16, device=DEVICE)
    ret = T.triton_mm(x, qweight, scales, qzeros, None, None, 4, 32, zo, out=big.t(), force_path=path)
    assert_matches(big.t(), x, qweight, scales, qzeros, None, None, 4, 32, zo, f"{path} transposed out")


# bf16 through the GEMM is not exact under the interpreter (test_bf16_activations): on a GPU only
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("m", [5, 33])
def test_gemm_gathers_act_order_x_into_the_workspace(dtype, m, monkeypatch):
    """With an act_perm the GEMM reads x gathered once (``x[:, act_perm]`` at the workspace's start, the split's
    fp32 sums after it) instead of one element at a time through act_perm; from ``x_gather.TRANSPOSED_FROM_MK``
    values of x (here set to 32 rows' worth: M = 33) through x transposed, which takes as much again. The decode GEMV keeps its in-kernel gather.
    ``workspace_bytes(act_order=True)`` covers every part: with a garbage-filled workspace of exactly that size the
    gathered x lands in it and the result matches the oracle, for a strided x too."""
    monkeypatch.setattr(X, "TRANSPOSED_FROM_MK", 32 * 256)  # (the shipped switch is far above these small calls)
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, 256, 4, 32, False, True, seed=9)
    dev = torch.device(DEVICE)
    plain, gathered = (T.workspace_bytes(m, 72, 256, 4, 32, dev, act_order=a) for a in (False, True))
    copies = 2 if m >= 32 else 1  # x gathered (+ x transposed), each sized for fp32 x
    assert plain > 0 and gathered == plain + copies * m * 256 * 4, (plain, gathered)
    assert T.workspace_bytes(1, 72, 256, 4, 32, dev, act_order=True) == T.workspace_bytes(1, 72, 256, 4, 32, dev)
    base = torch.randn(m, 300, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    for x in (base[:, :256].contiguous(), base[:, 40:296]):
        workspace = torch.full((gathered,), 255, dtype=torch.uint8, device=DEVICE)
        y = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, 4, 32, zo, workspace=workspace, force_path="gemm")
        assert_matches(y, x, qweight, scales, qzeros, act_perm, None, 4, 32, zo, f"gemm act-order {dtype} M={m}")
        xg = workspace[:m * 256 * dtype.itemsize].view(dtype).view(m, 256)
        assert torch.equal(xg, x[:, act_perm.long()])


def test_empty_and_zero_k():
    qweight, scales, qzeros, _, zo = runtime_weight(40, 64, 4, 32, False, False)
    x = torch.randn(0, 64).half().to(DEVICE)
    assert T.triton_mm(x, qweight, scales, qzeros, None, None, 4, 32, zo).shape == (0, 40)
    x3 = torch.randn(2, 0, 64).half().to(DEVICE)
    assert T.triton_mm(x3, qweight, scales, qzeros, None, None, 4, 32, zo).shape == (2, 0, 40)


def test_gptq_act_order_checkpoint_end_to_end():
    # A real format's prepare (act-order GPTQ v1, partial last group) feeding the Triton entry.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(56, 200, generator=gen)
    ckpt = FORMATS["gptq"].quantize(w, bits=4, group_size=64, sym=False, g_idx=act_order_g_idx(200, 64, gen), version="v1")
    iw = FORMATS["gptq"].prepare(ckpt)
    assert iw.act_perm is not None
    x = torch.randn(3, 200, generator=gen).half()
    w64 = FORMATS["gptq"].dequantize(ckpt).double()
    ref = x.double() @ w64.t()
    for path in ("decode", "gemm", "dense"):
        qzeros = None if iw.qzeros is None else iw.qzeros.to(DEVICE)
        y = T.triton_mm(x.to(DEVICE), iw.qweight.to(DEVICE), iw.scales.to(DEVICE), qzeros, iw.act_perm.to(DEVICE),
                        None, iw.bits, iw.group_size, iw.zero_offset, force_path=path)
        assert rel_err(y, ref) < TOL[torch.float16]
        check_elementwise(y.cpu(), x, w64, None, torch.float16, path)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("path", ["decode", "gemm", "dense"])
def test_scale_dtypes(path, scale_dtype):
    """Checkpoints store scales in the model dtype, which need not be the activations' (bf16 and fp32
    scales with fp16 x; fp16 scales are every other test's): each path reads them at their own width.
    M = 5 is two row tiles of the decode kernel, the second partial."""
    check(5, 72, 200, 4, 32, False, True, True, torch.float16, path, scale_dtype=scale_dtype)


def test_elementwise_check_catches_one_wrong_element():
    """A GEMM output that passes both checks, then the same output with its largest element off by
    1%: the relative Frobenius error still passes (1% of one element of 17 x 56), the elementwise
    bound does not. The bound is what lets a kernel test see a single wrong element."""
    m, n, k = 17, 56, 136
    qweight, scales, qzeros, act_perm, zo = runtime_weight(n, k, 4, 64, False, True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    y = T.triton_mm(x, qweight, scales, qzeros, act_perm, None, 4, 64, zo, force_path="gemm")
    assert_matches(y, x, qweight, scales, qzeros, act_perm, None, 4, 64, zo, "as computed")
    want = oracle(x, qweight, scales, qzeros, act_perm, None, 4, 64, zo)
    r, c = divmod(int(want.abs().reshape(-1).argmax()), n)
    bad = y.clone()
    bad[r, c] = float(want[r, c]) * 1.01
    assert rel_err(bad, want) < TOL[torch.float16], "the perturbation must be one the relative norm lets pass"
    with pytest.raises(AssertionError, match=f"1 of {m * n} elements past the elementwise bound; worst at \\({r}, {c}\\)"):
        assert_matches(bad, x, qweight, scales, qzeros, act_perm, None, 4, 64, zo, "one wrong element")


def test_one_hot_rows_return_the_dequantized_weight():
    # x = I picks out columns of W exactly (fp32): a bit-exact probe of the unpacking.
    for bits in (2, 3, 4, 8):
        qweight, scales, qzeros, act_perm, zo = runtime_weight(40, 64, bits, 32, False, False, scale_dtype=torch.float32)
        w = independent_weight(qweight, scales, qzeros, 64, bits, 32, zo).float()  # rounded once, as the kernel's fp32 product
        eye = torch.eye(64, device=DEVICE)
        for path in ("gemm", "dense"):
            y = T.triton_mm(eye, qweight, scales, qzeros, None, None, bits, 32, zo, force_path=path)
            assert torch.equal(y.cpu(), w.t()), (bits, path)


def test_plan_follows_the_table():
    dev = torch.device(DEVICE)
    with T.config_override(table(decode_max_m=2, dense_from=33)):
        assert T._plan(1, 4096, 4096, 4, 128, dev)["path"] == "decode"
        assert T._plan(2, 4096, 4096, 4, 128, dev)["path"] == "decode"
        assert T._plan(3, 4096, 4096, 4, 128, dev)["path"] == "gemm"
        assert T._plan(32, 4096, 4096, 4, 128, dev)["path"] == "gemm"
        assert T._plan(33, 4096, 4096, 4, 128, dev)["path"] == "dense"
    # decode_max_m per bit width (the tuner writes one a width), "default" for the others.
    with T.config_override(table(decode_max_m={"8": 1, "default": 2})):
        assert [T._plan(2, 4096, 4096, bits, 128, dev)["path"] for bits in (2, 4, 8)] == ["decode", "decode", "gemm"]
        assert T._plan(1, 4096, 4096, 8, 128, dev)["path"] == "decode"
    with T.config_override(table(decode_max_m=2, dense_from=33)):
        # A group size that is not a multiple of 32 has no decode path: the GEMM serves M = 1.
        assert T._plan(1, 4096, 4096, 4, 48, dev)["path"] == "gemm"
        # The decode step stays inside a group: 32 rows per step for group 32.
        assert T._plan(1, 4096, 4096, 4, 32, dev)["chunks"] == 1
        # The GEMM K tile shrinks to divide the group (8-bit words allow 64-row tiles).
        assert T._plan(32, 4096, 4096, 8, 64, dev)["block_k"] <= 64
        # 2 bits, group 32: the word unpack on a K tile of the group (two word rows). A 256-row tile
        # here needed 598 KB of shared memory on the H200 (the GPU suite's first failure).
        plan = T._plan(16, 200, 333, 2, 32, dev, "gemm")
        assert plan["tile_group"] and plan["block_k"] == 32
        # Group 40: no K tile of 16 rows or more divides it: per-element scaling on 16 rows.
        plan = T._plan(16, 200, 333, 4, 40, dev, "gemm")
        assert not plan["tile_group"] and plan["block_k"] == 16


def short_split_table(short: dict) -> dict:
    t = table()
    t["decode"]["default"]["16"]["short_split"] = short
    return t


def test_decode_short_split_where_each_program_runs_one_unit():
    """A decode entry's ``short_split`` replaces its keys where the entry's own split leaves each program one
    split unit (a group here): K too short for the programs the entry asks for. Elsewhere the entry stands."""
    dev = torch.device(DEVICE)
    with T.config_override(short_split_table({"BLOCK_N": 32, "CHUNKS": 1})):
        # 64 columns, 4 SMs x 4 programs wanted: K = 128 in groups of 64 splits at most in two, one group each.
        short = T._plan(1, 64, 128, 4, 64, dev)
        assert (short["cfg"]["BLOCK_N"], short["chunks"], short["grid"]) == (32, 1, (2, 2, 1))
        assert "short_split" not in short["cfg"] and short["cfg"]["max_split"] == 8  # the entry's other keys stand
        # K = 1024: eight splits of two groups each; the entry's own form.
        own = T._plan(1, 64, 1024, 4, 64, dev)
        assert (own["cfg"]["BLOCK_N"], own["split"], own["split_len"]) == (64, 8, 128)
        # Without groups the unit is the entry's step (2 runs of 32 rows): K = 64 is one step.
        assert T._plan(1, 64, 64, 4, -1, dev)["cfg"]["BLOCK_N"] == 32
        assert T._plan(1, 64, 1024, 4, -1, dev)["cfg"]["BLOCK_N"] == 64
    with T.config_override(table()):
        assert T._plan(1, 64, 128, 4, 64, dev)["cfg"]["BLOCK_N"] == 64  # no short_split: the entry everywhere


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group_size", [(72, 128, 64), (72, 200, -1), (40, 96, 32)])
def test_decode_short_split_matches_the_oracle(m, dtype, n, k, group_size):
    # N off the narrower tile, K with a partial last group or step, both the entry's and the short form's plans
    with T.config_override(short_split_table({"BLOCK_N": 32, "CHUNKS": 1, "prefetch": 1, "half_dot": 1})):
        plan = T._plan(m, n, k, 4, group_size, torch.device(DEVICE))
        assert plan["cfg"]["BLOCK_N"] == 32, plan
        check(m, n, k, 4, group_size, False, group_size != -1, True, dtype, "decode", x_shape=(m,), strided=True)


def test_every_shipped_config_is_checked():
    assert {"default", "h100", "h200"} <= set(T.config_stems())


@pytest.mark.parametrize("stem", T.config_stems())
def test_shipped_configs(stem):
    path = T.CONFIG_DIR / f"{stem}.json"
    data = json.loads(path.read_text())
    assert {"gpu", "tuned", "source", "decode_max_m", "decode", "gemm"} <= data.keys()
    if not data["tuned"]:
        assert "untuned" in data["source"].lower(), "an untuned table must say so in its source"
    else:  # a measured table is read by the GPU it names, and says where it was measured
        assert T.gpu_key(data["gpu"]) == stem and f"on {data['gpu']}" in data["source"]
    assert all(T.decode_max_m(data, bits) >= 1 for bits in (2, 3, 4, 8))
    for section in ("decode", "gemm"):
        assert "default" in data[section]
        for by_m in data[section].values():
            assert all(int(b) > 0 for b in by_m)
    for m in (1, 2, 3, 16, 64, 257, 2048, 100000):
        T._bucket(data["gemm"], 4, m)
        T._bucket(data["decode"], 4, m)
    assert T.entry_key_refusal(data) is None


def test_decode_max_m_by_bits_needs_a_default(tmp_path, monkeypatch):
    base = json.loads((T.CONFIG_DIR / "default.json").read_text())
    monkeypatch.setattr(T, "CONFIG_DIR", tmp_path)
    T.load_config.cache_clear()
    try:
        (tmp_path / "x100.json").write_text(json.dumps({**base, "decode_max_m": {"8": 2}}))
        with pytest.raises(ValueError, match="x100.json: decode_max_m by bits needs a 'default' entry"):
            T.load_config("x100")
        (tmp_path / "y100.json").write_text(json.dumps({**base, "decode_max_m": {"8": 2, "default": 4}}))
        assert [T.decode_max_m(T.load_config("y100"), bits) for bits in (4, 8)] == [4, 2]
    finally:
        T.load_config.cache_clear()


def test_a_misspelt_entry_key_is_refused_naming_it(tmp_path, monkeypatch):
    """A knob the lowering does not read (a misspelling) is refused where the table is loaded or put in force,
    naming the entry and the key; the shipped tables have none (test_shipped_configs loads each)."""
    base = json.loads((T.CONFIG_DIR / "default.json").read_text())
    bad = copy.deepcopy(base)
    bad["gemm"]["default"]["16"] = {**bad["gemm"]["default"]["16"], "stream_K": 1}
    with pytest.raises(ValueError, match=r"gemm\['default'\]\['16'\]: unknown keys \['stream_K'\]"):
        with T.config_override(bad):
            pass
    bad = copy.deepcopy(base)
    bad["gemm"]["default"]["64"] = {**bad["gemm"]["default"]["64"], "wgmma": {"BLOCK_M": 64, "stream_k_min_wave": 1}}
    with pytest.raises(ValueError, match=r"\['64'\]\['wgmma'\]: unknown keys \['stream_k_min_wave'\]"):
        with T.config_override(bad):
            pass
    for where, short, refusal in [
            ("decode", {"BLOCK_N": 256, "CHUNK": 4}, r"decode\['default'\]\['1'\]\['short_split'\]: unknown keys \['CHUNK'\]"),
            ("decode", {"short_split": {}}, r"\['short_split'\]: unknown keys \['short_split'\]"),
            ("decode", 256, r"\['short_split'\]: expected a mapping of keys, got int"),
            ("gemm", {"BLOCK_N": 64}, r"gemm\['default'\]\['16'\]: unknown keys \['short_split'\]")]:
        bad = copy.deepcopy(base)
        bucket = "1" if where == "decode" else "16"
        bad[where]["default"][bucket] = {**bad[where]["default"][bucket], "short_split": short}
        with pytest.raises(ValueError, match=refusal):
            with T.config_override(bad):
                pass
    # a knob of the other kind of entry is not read there: refused too
    for where, bucket, key in [("decode", "1", "stream_k"), ("gemm", "16", "CHUNKS"), ("gemm", "16", "half_dot")]:
        bad = copy.deepcopy(base)
        bad[where]["default"][bucket] = {**bad[where]["default"][bucket], key: 1}
        with pytest.raises(ValueError, match=rf"{where}\['default'\]\['{bucket}'\]: unknown keys \['{key}'\]"):
            with T.config_override(bad):
                pass
    monkeypatch.setattr(T, "CONFIG_DIR", tmp_path)
    T.load_config.cache_clear()
    try:
        (tmp_path / "x100.json").write_text(json.dumps({**base, "dense": {"slab_byte": 1 << 20}}))
        with pytest.raises(ValueError, match=r"x100.json: dense: unknown keys \['slab_byte'\]"):
            T.load_config("x100")
    finally:
        T.load_config.cache_clear()


def test_gpu_key():
    assert T.gpu_key("NVIDIA H200") == "h200"
    assert T.gpu_key("NVIDIA H100 80GB HBM3") == "h100"
    assert T.gpu_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert T.load_config("no-such-gpu")["gpu"] == "any"


# The fp16/bf16 weight tile (Dequant.HALF_*): on a GPU inline PTX, under the interpreter the same
# lanes in plain Triton. The GEMM cases above mostly scale per element (group < K tile) or run in
# fp32, so these force the whole-word, one-group tile in fp16.
HALF_CASES = [(4, 128), (4, -1), (8, 128), (8, 64), (2, -1), (2, 256), (2, 128), (2, 32), (4, 32), (4, 64), (8, 32)]  # the last five: groups under the K tile


@pytest.mark.parametrize("bits,group_size", HALF_CASES)
@pytest.mark.parametrize("sym", [True, False])
def test_half_weight_tile_matches_oracle(bits, group_size, sym):
    dev = torch.device(DEVICE)
    plan = T._plan(17, 40, 520, bits, group_size, dev, "gemm")
    assert plan["tile_group"]
    want = T.Dequant.HALF_TRITON if C.interpreting() else T.Dequant.HALF_ASM
    assert T.dequant_form(torch.float16, bits, True) == want
    check(17, 40, 520, bits, group_size, sym, True, True, torch.float16, "gemm")
    with T.dequant_override("fp32"):
        check(17, 40, 520, bits, group_size, sym, False, False, torch.float16, "gemm", seed=1)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("bits,group_size", [(4, 128), (8, 64)])
def test_tall_tiles_scale_the_half_tile(bits, group_size, scale_dtype):
    # BLOCK_M > BLOCK_K / 2: the group scale multiplies the fp16 weight tile instead of the fp32
    # product (fewer instructions for tall tiles); the weight is then rounded once, like a
    # dequantized fp16 weight. The scale is first rounded to fp16 there (bf16 and fp32 scales too).
    tall = table()
    tall["gemm"]["default"]["64"] = {**_GEMM, "BLOCK_M": 128, "reduce": "partials"}
    with T.config_override(tall):
        plan = T._plan(17, 40, 520, bits, group_size, torch.device(DEVICE), "gemm")
        assert plan["tile_group"] and 2 * plan["block_m"] > plan["block_k"]
        check(17, 40, 520, bits, group_size, False, True, True, torch.float16, "gemm", scale_dtype=scale_dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("zero_offset", [0, 1])
def test_half_weight_tile_one_hot_is_exact(bits, zero_offset):
    # x = I in fp16: each output is fp16(s * (q - z)), the reference's weight rounded once, so the
    # half tile must give q - z exactly (zero_offset 1: GPTQ v1's z + 1, up to 2**bits).
    group_size = -1 if bits == 2 else 128
    qweight, scales, qzeros, _, zo = runtime_weight(40, 128, bits, group_size, False, False, zero_offset, torch.float32)
    w = independent_weight(qweight, scales, qzeros, 128, bits, group_size, zo).float()
    eye = torch.eye(128, dtype=torch.float16, device=DEVICE)
    assert T.dequant_form(torch.float16, bits, True) != T.Dequant.FP32
    y = T.triton_mm(eye, qweight, scales, qzeros, None, None, bits, group_size, zo, force_path="gemm")
    assert torch.equal(y.cpu(), w.t().half())


def test_dequant_form_selection(monkeypatch):
    D = T.Dequant
    fp16, bf16 = torch.float16, torch.bfloat16
    monkeypatch.setattr(T, "interpreting", lambda: False)  # as on a GPU
    assert [T.dequant_form(fp16, b, True) for b in (2, 4, 8)] == [D.HALF_ASM] * 3
    assert [T.dequant_form(bf16, b, True) for b in (2, 4)] == [D.HALF_ASM] * 2
    # 8-bit in bf16 (128 + q needs 9 significant bits), 3 bits (values straddle words), fp32
    # activations and per-element scales keep the fp32 form.
    assert T.dequant_form(bf16, 8, True) == D.FP32
    assert T.dequant_form(fp16, 3, True) == D.FP32
    assert T.dequant_form(torch.float32, 4, True) == D.FP32
    assert T.dequant_form(fp16, 4, False) == D.FP32
    with T.dequant_override("triton"):
        assert T.dequant_form(fp16, 4, True) == D.HALF_TRITON
    with T.dequant_override("fp32"):
        assert T.dequant_form(bf16, 4, True) == D.FP32
        assert T.dequant_form(fp16, 3, True) == D.FP32
    monkeypatch.setattr(T, "interpreting", lambda: True)  # the interpreter cannot run inline PTX
    assert T.dequant_form(fp16, 4, True) == D.HALF_TRITON
    with T.dequant_override("asm"):
        assert T.dequant_form(fp16, 4, True) == D.HALF_TRITON
    with pytest.raises(ValueError, match="known"):
        with T.dequant_override("lop3"):
            pass


def _run_ptx(code: str, operands: dict[int, int], half: str) -> dict[int, int]:
    """Execute the small PTX subset of ``common.half_unpack_asm`` / ``half_dot_asm`` / ``X_PAIRS_ASM`` on
    32-bit integers (numbers as Python ints; halves through torch's fp16/bf16, each packed operation
    computed in float64 and rounded once, as the GPU's fused ones are; f32 through torch's float32).
    Returns the outputs' bit patterns by operand number (16-bit halves or 32-bit words)."""
    hdt = torch.float16 if half == "f16" else torch.bfloat16
    regs: dict[str, int] = {}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return operands[int(tok[1:])]
        if tok.startswith("0x"):
            return int(tok, 16)
        return regs[tok] if tok in regs else int(tok)

    def halves(v):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(hdt).double()

    def packed(f):
        h = f.to(hdt).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(h[0]) | (int(h[1]) << 16)

    def f32(v):
        return torch.tensor([v], dtype=torch.int64).to(torch.int32).view(torch.float32)

    out: dict[int, int] = {}

    def put(dest, value):
        if dest.startswith("$"):
            out[int(dest[1:])] = value
        else:
            regs[dest] = value

    for line in code.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # a register's halves into two 16-bit ones
            lo, hi, src = re.match(r"\{([$\w]+), ([$\w]+)\}, (\w+)", args).groups()
            put(lo, regs[src] & 0xFFFF)
            put(hi, regs[src] >> 16)
            continue
        if op == "mov.b32" and "{" in args:  # two 16-bit operands into one register's halves
            d, lo, hi = re.match(r"([$\w]+), \{([$\w]+), ([$\w]+)\}", args).groups()
            put(d, (val(lo) & 0xFFFF) | ((val(hi) & 0xFFFF) << 16))
            continue
        d, *a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            r = val(a[0])
        elif op == "shr.b32":
            r = val(a[0]) >> val(a[1])
        elif op == "prmt.b32":
            src = val(a[0]) | (val(a[1]) << 32)
            sel = val(a[2])
            r = sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op == "lop3.b32":
            assert val(a[3]) == 0xEA
            r = (val(a[0]) & val(a[1])) | val(a[2])
        elif op.startswith("fma.rn.") and op.endswith("x2"):
            r = packed(halves(val(a[0])) * halves(val(a[1])) + halves(val(a[2])))
        elif op in ("mul.rn.f16x2", "mul.rn.bf16x2"):
            r = packed(halves(val(a[0])) * halves(val(a[1])))
        elif op == "cvt.f32.f16":
            h = torch.tensor([val(a[0]) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16)
            r = int(h.float().view(torch.int32)) & 0xFFFFFFFF
        elif op == "add.f32":
            r = int((f32(val(a[0])) + f32(val(a[1]))).view(torch.int32)) & 0xFFFFFFFF
        else:
            raise AssertionError(f"unexpected PTX {op}")
        put(d, r & 0xFFFFFFFF)
    return out


# Orders pairing values 16 bits apart (the wgmma kernel's): their pairs need no byte permute.
APART_4 = (0, 4, 1, 5, 2, 6, 3, 7)
APART_2 = (0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)


@pytest.mark.parametrize("bits,half,order,scaled", [
    (2, "f16", None, False), (4, "f16", None, False), (8, "f16", None, False), (2, "bf16", None, False),
    (4, "bf16", None, False), (4, "f16", C.EVEN_ODD_4, False), (4, "bf16", C.EVEN_ODD_4, False),
    (4, "f16", APART_4, False), (4, "bf16", APART_4, False), (2, "f16", APART_2, False), (2, "bf16", APART_2, False),
    (4, "f16", None, True), (4, "f16", APART_4, True), (4, "bf16", APART_4, True)])
def test_half_unpack_ptx_gives_q_minus_z(bits, half, order, scaled):
    # The inline PTX cannot run here; its text is executed instruction by instruction instead, on
    # words holding every value and zero points over the whole range (z + zero_offset <= 2**bits);
    # scaled, each value is s * (q - z) rounded once to the half type.
    code, constraints = C.half_unpack_asm(bits, half, order, scaled=scaled)
    vpw = 32 // bits
    order = list(range(vpw)) if order is None else list(order)
    offsets = C.half_offsets(bits, half, order)
    assert constraints.split(",") == ["=h"] * vpw + ["r"] * (1 + len(offsets) + scaled)
    if order in (list(APART_4), list(APART_2)):
        assert "prmt" not in code
    hdt = torch.float16 if half == "f16" else torch.bfloat16
    magic = C.HALF_FORMATS[half][2]
    gen = torch.Generator().manual_seed(0)
    for trial in range(24):
        q = torch.randint(0, 2**bits, (vpw,), generator=gen).tolist()
        if trial == 0:
            q = [(2**bits - 1) if i % 2 else 0 for i in range(vpw)]
        word = sum(v << (bits * i) for i, v in enumerate(q))
        z = int(torch.randint(0, 2**bits + 1, (), generator=gen))
        ops = {vpw: word}
        for j, (slo, shi) in enumerate(offsets):
            pair = torch.tensor([-(magic / 2**slo + z), -(magic / 2**shi + z)]).to(hdt).view(torch.int16).to(torch.int32) & 0xFFFF
            ops[vpw + 1 + j] = int(pair[0]) | (int(pair[1]) << 16)
        scale = float(torch.empty(()).uniform_(0.001, 0.1, generator=gen).to(hdt)) if scaled else 1.0
        if scaled:
            bits16 = int(torch.tensor(scale).to(hdt).view(torch.int16)) & 0xFFFF
            ops[vpw + 1 + len(offsets)] = bits16 | (bits16 << 16)
        out = _run_ptx(code, ops, half)
        got = torch.tensor([out[i] for i in range(vpw)], dtype=torch.int32).to(torch.int16).view(hdt).float()
        want = torch.tensor([scale * (q[i] - z) for i in order], dtype=torch.float64).to(hdt).float()
        assert got.tolist() == want.tolist(), (trial, q, z)


def _f16_bits(values) -> list[int]:
    return (torch.as_tensor(values, dtype=torch.float64).half().view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


def _half_bits_to_float(bits: int) -> float:
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16))


@pytest.mark.parametrize("words", [1, 2])
def test_half_dot_ptx_sums_x_times_q_minus_z_over_16(words):
    # The GEMV's packed dot cannot run here: its PTX (the x pairs, then the dot of one word, or of two
    # words chained through the f16x2 carry) is executed instruction by instruction instead, on words
    # holding every value, zero points over the whole range (to 16: GPTQ v1's offset), and x from 1e-3
    # to ~2000 in size, against the float64 sum. Each half sums 4 products a word with one fp16 rounding
    # each (and fp16's subnormal spacing below 2**-14).
    codes = [C.half_dot_asm()] if words == 1 else [C.half_dot_asm(finish=False), C.half_dot_asm(carry_in=True)]
    for (code, constraints), finish in zip(codes, [True] if words == 1 else [False, True]):
        assert constraints.split(",") == ["=f" if finish else "=r"] + ["r"] * 4 + ["h"] * 8
    gen = torch.Generator().manual_seed(1 + words)
    for trial in range(32):
        z = 16 if trial == 1 else int(torch.randint(0, 17, (), generator=gen))
        lo, hi = _f16_bits([-(64 + z / 16), -(4 + z / 16)])
        carry, terms, halves = 0, [], [0.0, 0.0]
        for word in range(words):
            q = torch.randint(0, 16, (8,), generator=gen).double()
            if trial == 0:
                q = torch.tensor([15.0, 0.0] * 4, dtype=torch.float64)
            size = 10 ** float(torch.empty(()).uniform_(-3, 3.3, generator=gen))
            x = (torch.randn(8, generator=gen, dtype=torch.float64) * size).half().double()
            h = _f16_bits(x)
            pairs = _run_ptx(C.X_PAIRS_ASM, {4 + i: h[2 * i] | h[2 * i + 1] << 16 for i in range(4)}, "f16")
            assert [pairs[i] for i in range(4)] == [h[i] | h[i + 4] << 16 for i in range(4)]  # (x_i, x_i+4)
            ops = {1: sum(int(v) << (4 * i) for i, v in enumerate(q.tolist())), 2: lo | lo << 16, 3: hi | hi << 16,
                   4: carry}
            for i in range(4):
                ops[5 + 2 * i], ops[6 + 2 * i] = pairs[i] & 0xFFFF, pairs[i] >> 16
            out = _run_ptx(codes[word][0], ops, "f16")[0]
            t = x * (q - z) / 16
            terms.append(t)
            halves = [halves[0] + float(t[:4].abs().sum()), halves[1] + float(t[4:].abs().sum())]
            if word < words - 1:
                carry = out  # the f16x2 sums: each half within its rounding of the float64 half-sum
                for k, part in enumerate((t[:4], t[4:])):
                    got_half = _half_bits_to_float(out >> (16 * k))
                    assert abs(got_half - float(part.sum())) <= 4 * 2**-11 * float(part.abs().sum()) + 4 * 2**-25
        got = float(torch.tensor([out], dtype=torch.int64).to(torch.int32).view(torch.float32))
        want = float(torch.cat(terms).sum())
        bound = 4 * words * 2**-11 * (halves[0] + halves[1]) + 8 * words * 2**-25
        assert abs(got - want) <= bound, (trial, got, want, bound)


def test_half_pair_lanes_refuses_what_does_not_fit():
    with pytest.raises(ValueError):
        C.half_pair_lanes(8, "bf16")
    with pytest.raises(ValueError, match="permutation"):
        C.half_pair_lanes(4, "f16", (0, 2, 4, 6, 1, 3, 5, 5))
    with pytest.raises(ValueError):
        C.half_pair_lanes(3, "f16")


def test_compile_retries_with_fewer_stages_when_shared_memory_runs_out(monkeypatch):
    """A build whose pipeline does not fit the device's shared memory (OutOfResources when its binary is
    loaded) is compiled again with one stage fewer, down to one; the registers and shared memory of the
    build that fits give the programs an SM holds."""
    import types

    import triton

    from qops.ops.triton import int_weight as tiw

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    calls = []

    class Build:
        def __init__(self, stages, fits):
            self.stages, self.fits = stages, fits
            self.n_regs = 168
            self.metadata = types.SimpleNamespace(shared=40000 * stages, num_warps=4)

        def _init_handles(self):
            if not self.fits(self.stages):
                raise triton.runtime.errors.OutOfResources(299008, 232448, "shared memory")

    class FakeKernel:
        def __init__(self, fits):
            self.fits = fits

        def warmup(self, *args, grid, num_warps, num_stages, **constexprs):
            calls.append(num_stages)
            return Build(num_stages, self.fits)

    facts = tiw._compiled_facts(FakeKernel(lambda stages: stages <= 2), (1,), (), {"BLOCK_M": 16},
                                {"num_warps": 4, "num_stages": 4}, "cuda")
    # 2 stages: 81 KiB of shared memory (2 programs); 168 registers: 5376 a warp, 3 warps a scheduler -> 3 programs
    assert calls == [4, 3, 2] and facts == (2, 2)
    del calls[:]
    with pytest.raises(triton.runtime.errors.OutOfResources):
        tiw._compiled_facts(FakeKernel(lambda stages: False), (1,), (), {"BLOCK_M": 64}, {"num_warps": 4, "num_stages": 3}, "cuda")
    assert calls == [3, 2, 1], "one stage is the last try"


@pytest.mark.parametrize("n_regs,shared,warps,want", [
    (125, 0, 2, 8),        # 128 a thread: 4096 a warp, 4 warps a scheduler -> 16 warps -> 8 programs of 2
    (96, 0, 2, 10),        # 3072 a warp: 5 a scheduler -> 20 warps -> 10 programs
    (32, 0, 1, 32),        # the 32-program limit
    (64, 100000, 4, 2),    # shared memory binds: 233472 // (100000 + 1024)
    (255, 0, 8, 1),        # 8192 a warp: 8 warps an SM
])
def test_resident_programs(n_regs, shared, warps, want):
    import types

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  shared_memory_per_multiprocessor=233472)
    assert C.resident_programs(n_regs, shared, warps, props) == want
    assert C.resident_programs(n_regs, shared, warps, types.SimpleNamespace()) is None


@pytest.mark.parametrize("k,unit,tiles,split,slots,want", [
    (8192, 128, 224, 5, 1056, (4, 2048)),     # 1120 programs on 1056 slots: 4 splits in one wave
    (4096, 128, 112, 8, 1056, (8, 512)),      # 896 programs fit: unchanged
    (28672, 128, 32, 32, 1056, (32, 896)),
    (4096, 128, 224, 3, 396, (3, 1408)),      # 2 waves of 11 steps beat 2 of 16 and 1 of 32
    (4096, 128, 224, 3, 528, (2, 2048)),      # 1 wave of 16 steps beats 2 of 11
    (1000, 32, 3, 3, 4, (1, 1024)),           # K off the unit: 3 waves of 11 steps lose to 1 of 32 (or 2 of 16: the smaller)
    (1000, 32, 3, 4, 4, (4, 256)),            # 3 waves of 8 steps win
    (1000, 32, 3, 4, 1000, (4, 256)),
])
def test_split_in_waves(k, unit, tiles, split, slots, want):
    assert C.split_in_waves(k, unit, tiles, split, slots) == want
    got_split, per = want
    assert (got_split - 1) * per < k <= got_split * per, "every K row in exactly one split"


@pytest.mark.parametrize("path", ["decode", "gemm"])
@pytest.mark.parametrize("reduce", ["partials", "atomic"])
def test_split_fitted_to_resident_programs_matches_the_oracle(monkeypatch, path, reduce):
    """Where the build's resident programs say the plan's grid would end in a partial wave, the launch
    takes fewer splits (each longer); the result is the oracle's at each count it takes."""
    dev = torch.device(DEVICE)
    launched = []
    shipped = T.split_in_waves

    def spy(*a):
        launched.append(shipped(*a))
        return launched[-1]

    monkeypatch.setattr(T, "split_in_waves", spy)
    for per_sm in (1, 2, 100):
        monkeypatch.setattr(T, "_build_facts", lambda *a, per_sm=per_sm: (1, per_sm))
        with T.config_override(table(reduce=reduce)):
            plan = T._plan(3, 72, 256, 4, 32, dev, path)
            assert plan["split"] > 1
            check(3, 72, 256, 4, 32, False, False, True, torch.float16, path)
    splits = [s for s, _ in launched]
    assert min(splits) < plan["split"] and splits[-1] == plan["split"], (splits, plan["split"])


def test_split_k_does_not_split_when_determinism_is_requested(monkeypatch):
    """Split-K partial sums meet through atomic adds (order varies run to run): a deterministic
    request (QOPS_DETERMINISTIC=1 or torch's switch) keeps every Triton kernel to one split."""
    from qops.ops.triton.common import split_k

    monkeypatch.delenv("QOPS_DETERMINISTIC", raising=False)
    assert split_k(4096, 64, 4, 132, 16) == (16, 256)
    monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
    assert split_k(4096, 64, 4, 132, 16) == (1, 4096)
    monkeypatch.delenv("QOPS_DETERMINISTIC")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert split_k(4096, 64, 4, 132, 16) == (1, 4096)
    finally:
        torch.use_deterministic_algorithms(False)


def test_cached_plans_follow_a_later_determinism_request(monkeypatch):
    """Plans are cached per shape; a deterministic request made after a shape was first planned
    still gets one split (and no workspace), and dropping it brings the splits back."""
    dev = torch.device(DEVICE)
    monkeypatch.delenv("QOPS_DETERMINISTIC", raising=False)
    with T.config_override(table()):
        for path in ("decode", "gemm"):
            assert T._plan(3, 72, 256, 4, 32, dev, path)["split"] > 1
        assert T.workspace_bytes(3, 72, 256, 4, 32, dev) > 0
        monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
        for path in ("decode", "gemm"):
            assert T._plan(3, 72, 256, 4, 32, dev, path)["split"] == 1
        assert T.workspace_bytes(3, 72, 256, 4, 32, dev) == 0
        check(3, 72, 256, 4, 32, False, True, True, torch.float16, "decode")
        monkeypatch.delenv("QOPS_DETERMINISTIC")
        assert T._plan(3, 72, 256, 4, 32, dev, "gemm")["split"] > 1


def test_dense_slabs_of_equal_width_on_request():
    """``equal``: as many slabs as slab_bytes gives, all of one width (64-column multiples), so no narrow
    last slab; without it, slab_bytes' width and a shorter last slab."""
    k, n = 1000, 4104
    dense = {"impl": "dense", "DQ_BLOCK_K": 64, "DQ_BLOCK_N": 128, "slab_bytes": 1024 * 2 * k}
    for equal, want in ((0, 1024), (1, 832)):  # 5 slabs: 1024 x 4 + 8, or ceil(4104 / 5) = 821 -> 832
        t = table(dense_from=64)
        t["gemm"]["default"]["1000000"] = {**dense, "equal": equal}
        with T.config_override(t):
            plan = T._plan(300, n, k, 4, 128, torch.device("cpu"), "dense")
        assert plan["slab"] == want and -(-n // plan["slab"]) == 5, plan


def test_gemm_builds_compile_for_sm90(tmp_path):
    """``benchmarks/compile_triton_gemm.py`` with this machine's Triton: the 4-bit even / odd tile and a 2-bit
    g128 one compile for sm_90 to cubin (no GPU needed), without local memory; the tool exits 0 only then."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_triton_gemm.py"), "--out", str(out),
                           "--cases", '[[4, 128, "fp16", 16, 128, 1], [2, 128, "bf16", 16, 128, 0]]'],
                          capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["BLOCK_K"] for r in rows] == [128, 128] and rows[0]["even_odd"]
    assert all(r["ok"] and r["cubin_bytes"] > 0 and not r["local_memory"] for r in rows), rows
    # 2-bit g128: the word unpack on a group-deep tile, in one sm_90 block (the per-element gather took 299 KB)
    assert rows[1]["tile_group"] and rows[1]["fits_sm90"], rows[1]


def test_gemv_build_loop_sass_for_sm90(tmp_path):
    """``compile_triton_gemm.py --gemv --sass`` with this machine's Triton: the 4-bit M = 1 decode GEMV compiles
    for sm_90 with the launch's divisibility of its integer arguments, and its main loop's instructions are
    counted per weight value a thread handles (a pass of CHUNKS x 32 K values for BLOCK_N / (32 warps)
    columns), with the registers a thread holds; a build with ``prefetch`` too, and one loading x a value at a
    time (``x_vec`` 0: more loads a pass), and one capped at 96 registers (``maxnreg``). Whether it spills
    depends on the Triton (3.6, the GPU machine's: no; 3.9: yes with x_vec)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "gemv.json"
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_triton_gemm.py"), "--out", str(out), "--sass",
                           "--gemv", '[[4, 128, "fp16", 256, 4, 2, 1], [4, 128, "fp16", 256, 2, 2, 1, 1], [4, 128, "fp16", 256, 4, 2, 1, 0, 0], [4, 128, "fp16", 256, 4, 2, 1, 0, 1, 96]]'],
                          capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    row, prefetching, scalar_x, capped = json.loads(out.read_text())["rows"]
    assert capped["ok"] and capped["maxnreg"] == 96 and capped["registers"] <= 96 < row["registers"], capped
    assert not row["prefetch"] and prefetching["prefetch"] and prefetching["ok"], prefetching
    assert row["x_vec"] and not scalar_x["x_vec"], (row, scalar_x)
    assert row["loop_sass"]["top"]["LDG"] < scalar_x["loop_sass"]["top"]["LDG"], (row, scalar_x)
    assert 0 < row["registers"] <= 255 and 0 < prefetching["registers"] <= 255, (row, prefetching)
    loop = row["loop_sass"]
    assert row["ok"] and row["kernel"] == "gemv" and row["CHUNKS"] == 4 and isinstance(loop["spills"], bool), row
    assert loop["values_per_thread"] == 4 * 32 * 256 // 64 and loop["instructions"] > loop["values_per_thread"], loop
    assert loop["per_value"] == round(loop["instructions"] / loop["values_per_thread"], 2) and loop["top"]["FFMA"] > 0, loop


def record_build_compiles(monkeypatch, facts: tuple) -> list:
    """Builds' compiles faked as on a GPU, each giving ``facts`` (stages, programs an SM) and recorded as
    (kernel, args, constexprs, launch options) in the list returned; the facts cache starts empty."""
    seen = []

    def compiled(kernel, grid, args, constexprs, launch, device):
        seen.append((kernel, args, constexprs, launch))
        return facts

    monkeypatch.setattr(T, "_compiles_for", lambda device: True)
    monkeypatch.setattr(T, "_compiled_facts", compiled)
    monkeypatch.setattr(T, "_BUILD_FACTS", {})
    return seen


def test_builds_differing_in_which_knob_is_on_are_two_builds(monkeypatch):
    """The decode GEMV with the prefetch and x loaded a value at a time, and with neither but x as vectors:
    each takes one optional knob (True at the same place among the constexprs), so the build facts are
    keyed by the constexprs' names too, not their values alone (which made these one build)."""
    seen = record_build_compiles(monkeypatch, (1, 8))
    qweight, scales, qzeros, act_perm, zo = runtime_weight(96, 1024, 4, 128, False, False)
    x = torch.randn(1, 1024).to(torch.float16).to(DEVICE)
    o2 = torch.empty(1, 96, dtype=torch.float16, device=DEVICE)
    tensors = (x, qweight, scales, qzeros, act_perm, None, 4, 128, zo, o2)
    builds = []
    for knobs in ({"prefetch": 1, "x_vec": 0}, {"prefetch": 0, "x_vec": 1}):
        t = table(max_split=2)
        t["decode"]["default"]["16"].update(knobs)
        with T.config_override(t):
            plan = T._plan(1, 96, 1024, 4, 128, torch.device(DEVICE), "decode")
        kernel, constexprs, launch = T._split_k_build(plan, 1, x.dtype, 4, qzeros, act_perm, None)
        builds.append(constexprs)
        T._build_facts(kernel, constexprs, launch, plan, tensors, 1)
    assert builds[0].get("PREFETCH") and builds[1].get("XVEC") and list(builds[0].values()) == list(builds[1].values())
    assert len(seen) == 2 and len(T._BUILD_FACTS) == 2


@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_maxnreg_is_a_launch_option_and_a_build_of_its_own(monkeypatch, path):
    """A config's ``maxnreg`` (a register cap: more programs an SM) reaches the launch options, makes a build
    of its own in the programs-an-SM facts (compiled once each, with the cap), and changes no result (the
    interpreter ignores it; on a GPU the tuner times it)."""
    seen = record_build_compiles(monkeypatch, (2, 4))
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, 256, 4, 128, False, False)
    x = torch.randn(3, 256).to(torch.float16).to(DEVICE)
    o2 = torch.empty(3, 72, dtype=torch.float16, device=DEVICE)
    tensors = (x, qweight, scales, qzeros, None, None, 4, 128, zo, o2)
    def capped(cap):
        t = table()
        for by_m in (*t["decode"].values(), *t["gemm"].values()):
            for cfg in by_m.values():
                cfg.update({"maxnreg": cap} if cap else {})
        return t

    launches = []
    for cap in (None, 104):
        with T.config_override(capped(cap)):
            plan = T._plan(3, 72, 256, 4, 128, torch.device(DEVICE), path)
            kernel, constexprs, launch = T._split_k_build(plan, 1, x.dtype, 4, qzeros, None, None)
            assert launch.get("maxnreg") == cap, launch
            T._build_facts(kernel, constexprs, launch, plan, tensors, 1)
            T._build_facts(kernel, constexprs, launch, plan, tensors, 1)
            launches.append(launch)
    assert [launch for *_, launch in seen] == launches, "each cap its own build, compiled once"
    monkeypatch.undo()
    with T.config_override(capped(104)):
        y = T.triton_mm(x, qweight, scales, qzeros, None, None, 4, 128, zo, force_path=path)
    assert_matches(y, x, qweight, scales, qzeros, None, None, 4, 128, zo, f"maxnreg {path}")


@pytest.mark.parametrize("path", ["decode", "gemm"])
@pytest.mark.parametrize("reduce", ["partials", "atomic"])
def test_split_fitted_down_to_one_writes_the_output_itself(monkeypatch, path, reduce):
    """A fit that leaves one split launches the build that writes the final output (no fp32 scratch, no
    reduction), whichever reduction the plan asked for; the result is the oracle's."""
    import triton

    monkeypatch.setattr(T, "_build_facts", lambda *a: (1, 7))
    monkeypatch.setattr(T, "split_in_waves", lambda k, unit, tiles, split, slots: (1, triton.cdiv(k, unit) * unit))
    reduced = []
    monkeypatch.setattr(C, "reduce_tile", lambda parts: reduced.append(parts) or (64, 1))
    with T.config_override(table(reduce=reduce)):
        assert T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), path)["split"] > 1
        check(3, 72, 256, 4, 32, False, False, True, torch.float16, path)
    assert reduced == []


def record_split_launch(monkeypatch, path, reduce, knob, value, gpu_pdl, one_split=False):
    """One ``triton_mm`` call at M = 3 on ``path`` that the plan splits, with its kernels replaced by recorders
    (the interpreter has no grid dependencies), under a table of reduction ``reduce`` with config key ``knob``
    set to ``value`` in that path's entries (left out for None), on a GPU with PDL or without (``gpu_pdl``);
    ``one_split``: the build fits so few programs that the launch takes one split. Returns (kernel name -> launch keywords, the
    (shape, dtype) of each buffer ``zero_ahead`` zeroed, the ``zero`` argument of each fp32 scratch taken)."""
    import triton

    launches, zeroed, scratch = [], [], []
    for name in ("_gemv_kernel", "_tc_kernel"):
        monkeypatch.setattr(T, name, KernelRecorder(name, launches))
    monkeypatch.setattr(C, "_reduce_kernel", KernelRecorder("_reduce_kernel", launches))
    monkeypatch.setattr(T, "zero_ahead", lambda buf: zeroed.append((tuple(buf.shape), buf.dtype)))
    real_scratch = T.fp32_scratch
    monkeypatch.setattr(T, "fp32_scratch", lambda ws, shape, zero, device, offset=0: scratch.append(zero) or real_scratch(ws, shape, zero, device, offset))
    monkeypatch.setattr(T, "pdl_launch", lambda device: gpu_pdl)
    monkeypatch.setattr(T, "_build_facts", lambda *a: (1, 7 if one_split else None))
    monkeypatch.setattr(T, "split_in_waves", lambda k, unit, tiles, split, slots: (1, triton.cdiv(k, unit) * unit))
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, 256, 4, 32, False, False)
    x = torch.randn(3, 256).to(torch.float16).to(DEVICE)
    t = table(reduce=reduce)
    if value is not None:  # in the entries of the path called (a knob of one kind of entry is refused in the other)
        for cfg in t["decode" if path == "decode" else "gemm"]["default"].values():
            cfg[knob] = value
    with T.config_override(t):
        assert T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), path)["split"] > 1
        T.triton_mm(x, qweight, scales, qzeros, act_perm, None, 4, 32, zo, force_path=path)
    return dict(launches), zeroed, scratch


@pytest.mark.parametrize("path", ["decode", "gemm"])
@pytest.mark.parametrize("reduce", ["partials", "atomic"])
def test_pdl_reduction_only_where_asked(monkeypatch, path, reduce):
    """``pdl_reduce`` on a GPU with PDL: the split-K kernel is built with its trigger and the reduction is
    launched as a programmatic dependent that waits for it (``PDL``, ``launch_pdl``); a config without the
    key gets it with the atomic reduction only. With the knob off, on a GPU without PDL, or where the launch
    takes one split (no reduction), the builds are the plain ones (no ``PDL`` constexpr: the same compiled
    kernels as before the knob)."""
    split_kernel = "_gemv_kernel" if path == "decode" else "_tc_kernel"

    def launched(knob, gpu_pdl, one_split=False):
        return record_split_launch(monkeypatch, path, reduce, "pdl_reduce", knob, gpu_pdl, one_split)[0]

    got = launched(1, True)
    assert got[split_kernel]["PDL"] is True
    assert got["_reduce_kernel"]["PDL"] is True and got["_reduce_kernel"]["launch_pdl"] is True
    got = launched(None, True)
    assert got[split_kernel].get("PDL", False) is (reduce == "atomic")
    assert got["_reduce_kernel"].get("launch_pdl", False) is (reduce == "atomic")
    for knob, gpu_pdl in ((0, True), (1, False), (None, False)):
        got = launched(knob, gpu_pdl)
        assert "PDL" not in got[split_kernel] and not {"PDL", "launch_pdl"} & set(got["_reduce_kernel"]), (knob, gpu_pdl)
    got = launched(1, True, one_split=True)
    assert list(got) == [split_kernel] and "PDL" not in got[split_kernel] and got[split_kernel]["OUT_MODE"] == 0


@pytest.mark.parametrize("path", ["decode", "gemm"])
def test_atomic_sum_zeroed_ahead_only_where_asked(monkeypatch, path):
    """``pdl_zero`` on a GPU with PDL: the atomic sum's fp32 buffer is zeroed by ``common.zero_ahead`` (not
    taken zeroed from the scratch), and the split-K kernel is launched as its programmatic dependent with
    the wait compiled in (``ZERO_WAIT``, ``launch_pdl``); a config without the key gets it. With the knob at
    0, without PDL, with the partials reduction or one split, the zeroing is ``zero_()`` or absent and the
    builds are the plain ones."""
    split_kernel = "_gemv_kernel" if path == "decode" else "_tc_kernel"
    plain = {"ZERO_WAIT", "launch_pdl"}
    for knob in (1, None):
        got, zeroed, scratch = record_split_launch(monkeypatch, path, "atomic", "pdl_zero", knob, True)
        assert zeroed == [((3, 72), torch.float32)] and scratch == [False], (knob, zeroed, scratch)
        assert got[split_kernel]["ZERO_WAIT"] is True and got[split_kernel]["launch_pdl"] is True, knob
        assert got[split_kernel]["OUT_MODE"] == 2 and "_reduce_kernel" in got
    for reduce, knob, gpu_pdl in (("atomic", 0, True), ("atomic", 1, False), ("partials", 1, True)):
        got, zeroed, scratch = record_split_launch(monkeypatch, path, reduce, "pdl_zero", knob, gpu_pdl)
        assert zeroed == [] and scratch == [reduce == "atomic"], (reduce, knob, gpu_pdl, scratch)
        assert not plain & set(got[split_kernel]), (reduce, knob, gpu_pdl)
    got, zeroed, _ = record_split_launch(monkeypatch, path, "atomic", "pdl_zero", 1, True, one_split=True)
    assert list(got) == [split_kernel] and zeroed == [] and not plain & set(got[split_kernel])


@pytest.mark.parametrize("k,unit,tiles,slots,want", [
    (4096, 128, 224, 396, (378, 19 * 128)),   # 28672x4096 at M = 16 (H100): 7168 steps, 19 a program
    (8192, 128, 448, 396, (393, 73 * 128)),   # 57344x8192: 28672 steps, 73 a program (3 waves of 32 as 2 splits)
    (1000, 32, 3, 4, (4, 24 * 32)),           # K off the unit: 96 steps
    (256, 32, 2, 100, (16, 32)),              # fewer steps than slots: one step a program
    (64, 128, 5, 3, (3, 2 * 128)),            # K under one unit: a step a tile
])
def test_stream_k_runs(k, unit, tiles, slots, want):
    programs, run = C.stream_k_runs(k, unit, tiles, slots)
    assert (programs, run) == want
    total, per = tiles * -(-k // unit), run // unit
    assert programs <= slots and (programs - 1) * per < total <= programs * per, "every step in exactly one run"


@pytest.mark.parametrize("m,bits,group_size,sym,act_order,dtype,even_odd", [
    (17, 4, 128, False, False, torch.float16, 0),   # two M tiles, several groups a split
    (17, 4, 64, True, True, torch.float16, 1),      # even / odd halves, act-order, symmetric
    (3, 8, 128, False, True, torch.float16, 0),
    (33, 2, -1, False, False, torch.float16, 0),    # per-channel: one group
    (5, 4, 128, False, False, torch.float32, 0),    # fp32 x: no half form, so not taken
])  # bf16 x: the GPU suite's (the interpreter's bf16 dot is wrong, see the top)
def test_scaled_weight_tile_matches_the_oracle(m, bits, group_size, sym, act_order, dtype, even_odd):
    """``scale_weight``: the half weight tile scaled by its group's scales before the dot at a tile height
    (16 rows, 32 deep) where the fp32 product would be scaled after it, the dots chained into one
    accumulator; built only where a half form applies, and against the float64 oracle."""
    t = table(decode_max_m=0)
    t["gemm"]["default"]["64"].update(scale_weight=1, even_odd=even_odd)
    with T.config_override(t):
        plan = T._plan(m, 72, 512, bits, group_size, torch.device(DEVICE), "gemm")
        assert plan["tile_group"] and 2 * plan["block_m"] <= plan["block_k"] and plan["split"] > 1, plan
        _, consts, _ = T._split_k_build(plan, 1, dtype, bits, None if sym else object(), None, None)
        assert consts.get("SCALE_W", False) == (dtype != torch.float32)
        check(m, 72, 512, bits, group_size, sym, act_order, True, dtype, "gemm")
    plain = T._plan(m, 72, 512, bits, group_size, torch.device(DEVICE), "gemm")  # the table without the knob
    assert "SCALE_W" not in T._split_k_build(plain, 1, dtype, bits, None, None, None)[1]


def stream_k_table(**cfg) -> dict:
    """The test table with ``stream_k`` on its GEMM config (and ``cfg``), the GEMM's from one row."""
    t = table(decode_max_m=0)
    t["gemm"]["default"]["64"].update(stream_k=1, **cfg)
    return t


@pytest.mark.parametrize("m,n,k,bits,group_size,sym,act_order,has_bias,even_odd", [
    (17, 72, 1024, 4, 128, False, False, True, 0),   # two M tiles; 8 steps a tile, runs of 3
    (17, 72, 1024, 4, 128, True, True, False, 1),    # even / odd, act-order, symmetric
    (3, 40, 700, 8, 128, True, True, False, 0),      # 64-row K tiles: runs start inside a group; K off the tile
    (33, 56, 520, 3, 128, False, True, True, 0),     # 3 bits: the per-element gather, 4 steps a group
    (5, 96, 1100, 4, -1, False, False, True, 0),     # per-channel, K off the tile
])
def test_stream_k_matches_the_oracle(monkeypatch, m, n, k, bits, group_size, sym, act_order, has_bias, even_odd):
    """``stream_k``: one program a run of equal length over the tiles' K steps laid end to end, each adding
    one partial sum per tile it touches; against the float64 oracle where runs cross tiles (and groups,
    where a K tile is shorter than the group)."""
    runs = []
    shipped = T.stream_k_runs
    monkeypatch.setattr(T, "stream_k_runs", lambda *a: runs.append((a, shipped(*a))) or runs[-1][1])
    with T.config_override(stream_k_table(even_odd=even_odd)):
        plan = T._plan(m, n, k, bits, group_size, torch.device(DEVICE), "gemm")
        assert plan["stream_k"], plan
        assert T.workspace_bytes(m, n, k, bits, group_size, torch.device(DEVICE)) >= 4 * m * n  # the sum, or more partials
        check(m, n, k, bits, group_size, sym, act_order, has_bias, torch.float16, "gemm")
    (k_, unit, tiles, slots), (programs, run) = runs[-1]
    steps, per = -(-k // unit), run // unit
    assert slots == 4 * 4 and tiles == plan["tiles"] and unit == plan["block_k"]
    ends = [(p * per, min((p + 1) * per, tiles * steps) - 1) for p in range(programs)]
    assert any(a // steps != b // steps for a, b in ends), "no run crosses a tile: the case tests nothing new"


def test_stream_k_where_a_tile_has_several_k_steps(monkeypatch):
    """The knob is the GEMM's: the decode plan ignores it; a GEMM whose tiles have several K steps takes it,
    also where its tiles fill the GPU without a split (one wave of equal runs instead of a partial last
    wave of tiles), and then uses the atomic sum's workspace; one K step or a deterministic request keeps
    the plain launch."""
    dev = torch.device(DEVICE)
    with T.config_override(stream_k_table()):
        assert not T._plan(3, 72, 256, 4, 32, dev, "decode")["stream_k"]
        assert not T._plan(64, 4096, 32, 4, 32, dev, "gemm")["stream_k"]  # 512 tiles, one K step
        plan = T._plan(17, 288, 256, 4, 32, dev, "gemm")  # 18 tiles fill the 16 slots: no split
        assert plan["split"] == 1 and plan["stream_k"] and T.workspace_bytes(17, 288, 256, 4, 32, dev) == 4 * 17 * 288
        check(17, 288, 256, 4, 32, False, False, True, torch.float16, "gemm")
        monkeypatch.setenv("QOPS_DETERMINISTIC", "1")
        plan = T._plan(3, 72, 256, 4, 32, dev, "gemm")
        assert plan["split"] == 1 and not plan["stream_k"]


@pytest.mark.parametrize("per_sm,streamed", [(1, False), (2, True)])
def test_stream_k_taken_where_it_saves_rounds(monkeypatch, per_sm, streamed):
    """Where the builds' figures exist (a GPU), stream-K replaces the fitted split launch only where that launch
    runs at least STREAM_K_GAIN times as many rounds of K steps. 3 tiles of 8 steps on 4 SMs: at one program an
    SM 6 rounds either way (the split launch); at two, 4 against 3 (stream-K). The oracle's result either way."""
    monkeypatch.setattr(T, "_build_facts", lambda *a: (1, per_sm))
    taken = []
    real = T._tc_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: taken.append(kw.get("STREAM_K", False)) or real[grid](*a, **kw)

    monkeypatch.setattr(T, "_tc_kernel", Spy())
    with T.config_override(stream_k_table()):
        check(3, 72, 256, 4, 32, False, False, True, torch.float16, "gemm")
    assert taken == [streamed]


def test_launch_chosen_once_per_plan_and_kind_of_call(monkeypatch):
    """The launch (builds, split, stream-K or not) is chosen at a plan's first call of each kind and kept in the
    plan: later calls build nothing; another dtype, optional tensor, forced tile form or stream-K gain chooses
    again, and so does the plan after a config override. Every result is the oracle's."""
    builds = []
    real = T._split_k_build
    monkeypatch.setattr(T, "_split_k_build", lambda *a, **kw: builds.append(a[:2]) or real(*a, **kw))

    def built(**kw):
        builds.clear()
        check(17, 72, 1024, 4, 128, False, False, True, torch.float16, "gemm", **kw)
        return len(builds)

    with T.config_override(stream_k_table()):
        assert built() >= 2  # the split launch and stream-K's
        assert built() == 0 and built(seed=3) == 0
        with T.dequant_override("fp32"):
            assert built() >= 2
        monkeypatch.setattr(T, "STREAM_K_GAIN", 5.0)
        assert built() >= 2
        builds.clear()
        check(17, 72, 1024, 4, 128, False, False, False, torch.float16, "gemm")  # no bias: another build
        assert builds
    with T.config_override(stream_k_table()):
        assert built() >= 2


def test_stream_k_launch(monkeypatch):
    """The stream-K launch: a 1-D grid of ``stream_k_runs``' programs, the STREAM_K build adding into the fp32
    sum (OUT_MODE 2; zeroed ahead and reduced as programmatic dependents on a GPU with PDL, whatever the
    config's ``reduce``) and a one-partial reduction; the decode path's launch is no stream-K one (a decode entry
    is not read for ``stream_k``: the key is refused there, test_a_misspelt_entry_key_is_refused_naming_it)."""
    got, zeroed, _ = record_split_launch(monkeypatch, "gemm", "partials", "stream_k", 1, True)
    with T.config_override(stream_k_table()):
        plan = T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), "gemm")
    assert got["_tc_kernel"]["STREAM_K"] is True and got["_tc_kernel"]["OUT_MODE"] == 2 and got["_tc_kernel"]["launch_pdl"] is True
    assert got["_tc_kernel"]["grid"] == (C.stream_k_runs(256, plan["block_k"], plan["tiles"], 16)[0],)
    assert zeroed == [((3, 72), torch.float32)] and got["_reduce_kernel"]["PDL"] is True
    got, _, _ = record_split_launch(monkeypatch, "decode", "partials", "stream_k", None, True)
    assert "STREAM_K" not in got["_gemv_kernel"] and got["_gemv_kernel"]["OUT_MODE"] == 1


@pytest.mark.parametrize("path", ["decode", "gemm"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_build_facts_compile_the_launched_build(monkeypatch, path, mode):
    """On a GPU the facts of a build come from compiling it with the launch's own arguments (every run-time
    parameter of the kernel, the output's dtype per mode) and constexprs; once per build. Checked here
    with the compile replaced by a recorder."""
    seen = record_build_compiles(monkeypatch, (2, 5))
    qweight, scales, qzeros, act_perm, zo = runtime_weight(72, 256, 4, 32, False, True)
    x = torch.randn(3, 256).to(torch.float16).to(DEVICE)
    o2 = torch.empty(3, 72, dtype=torch.float16, device=DEVICE)
    bias = torch.randn(72).to(torch.float16).to(DEVICE)
    with T.config_override(table()):
        plan = T._plan(3, 72, 256, 4, 32, torch.device(DEVICE), path)
    tensors = (x, qweight, scales, qzeros, act_perm, bias, 4, 32, zo, o2)
    kernel, constexprs, launch = T._split_k_build(plan, mode, x.dtype, 4, qzeros, act_perm, bias)
    assert T._build_facts(kernel, constexprs, launch, plan, tensors, mode) == (2, 5)
    assert T._build_facts(kernel, constexprs, launch, plan, tensors, mode) == (2, 5) and len(seen) == 1, "once per build"
    k, args, c, l = seen[0]
    import inspect

    params = inspect.signature(getattr(k, "fn", k)).parameters.values()
    runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
    assert k is kernel and c == constexprs and c["OUT_MODE"] == mode and l == launch and len(args) == len(runtime)
    y = args[runtime.index("y_ptr")]
    assert (y is o2) if mode == 0 else (y.dtype == torch.float32)
    assert args[runtime.index("split_len")] == plan["split_len"]
    assert [dict(key[1]) for key in T._BUILD_FACTS] == [constexprs]
