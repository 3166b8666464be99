"""bitsandbytes checkpoints (LLM.int8 storage, NF4, FP4) and the two op families they map to.

Layout facts on hand-built tensors; the ops of both families (``int8_weight``: EETQ and bitsandbytes
int8; ``blockwise4``: NF4/FP4) against the float64 oracles of ``tests/bnb_cases.py`` over every
registered format of those families; error inputs eagerly and under FakeTensorMode; the Triton
kernels under the interpreter; and, when the ``bitsandbytes`` package is installed (it is not a qops
dependency), bitsandbytes itself as a second oracle.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qops  # noqa: F401
from qops.formats import FORMATS
from qops.formats import bitsandbytes as bnbfmt
from qops.formats.blockwise4 import NESTED_BLOCKSIZE, dynamic_map
from qops.lowerings import LOWERINGS_BY_NAME, Kernel, WeightSpec

from tests import bnb_cases as C
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small CPU matmuls on one thread)
from tests.launch_recorder import KernelRecorder
from tests.oracle import check_elementwise, elementwise_bound, stride_two

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (the second oracle; qops[test] installs it on x86-64 Linux)")
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed on this platform")

CASES = C.INT8_CASES + C.BLOCKWISE4_CASES


def test_cases_cover_the_families_registry():
    covered = {c.fmt for c in CASES}
    want = {name for name, f in FORMATS.items() if f.family in ("int8_weight", "blockwise4")}
    assert covered == want, f"add cases for {want - covered} to tests/bnb_cases.py"


# --------------------------------------------------------------------------------- layout facts


def _state4(quant_type, weight_bytes, absmax, n, k, blocksize):
    qs = {"quant_type": quant_type, "blocksize": blocksize, "dtype": "float32", "shape": [n, k]}
    return {
        "weight": torch.tensor(weight_bytes, dtype=torch.uint8).reshape(-1, 1),
        "weight.absmax": torch.tensor(absmax, dtype=torch.float32),
        "weight.quant_map": bnbfmt.codebook(quant_type),
        f"weight.quant_state.bitsandbytes__{quant_type}": torch.tensor(list(json.dumps(qs).encode()), dtype=torch.uint8),
    }


def test_first_element_in_the_high_nibble_and_odd_count_pads():
    # N*K = 3 (odd): bytes 0x1F, 0x80 hold codes 1, 15, 8 and a zero pad nibble.
    state = _state4("nf4", [0x1F, 0x80], [2.0], 1, 3, 32)
    w = FORMATS["bitsandbytes-nf4"].dequantize(FORMATS["bitsandbytes-nf4"].from_state_dict(state))
    nf4 = bnbfmt.NF4_CODE
    assert w.tolist() == [[2 * nf4[1], 2 * nf4[15], 2 * nf4[8]]]
    assert torch.equal(w.double(), C.bnb4(state, "nf4"))


def test_blocks_are_flat_and_span_rows():
    # N=2, K=48, blocksize 32: block 1 covers row 0, k 32..47 and row 1, k 0..15.
    codes = torch.full((96,), 15)
    state = _state4("nf4", C.pack_codes(codes).flatten().tolist(), [1.0, 10.0, 100.0], 2, 48, 32)
    w = FORMATS["bitsandbytes-nf4"].dequantize(FORMATS["bitsandbytes-nf4"].from_state_dict(state))
    assert w[0, :32].eq(1).all() and w[0, 32:].eq(10).all() and w[1, :16].eq(10).all() and w[1, 16:].eq(100).all()


def test_codebooks_are_bitsandbytes_tables():
    assert bnbfmt.codebook("nf4").tolist() == list(C.NF4)
    fp4 = bnbfmt.codebook("fp4")
    assert torch.equal(fp4, torch.from_numpy(C.fp4_table()))
    assert fp4[3] == 1.0 and fp4[11] == -1.0 and fp4[1] == pytest.approx(0.0625 / 12) and fp4[6] == pytest.approx(2 / 12)
    assert (fp4[8:] <= 0).all() and (fp4[:8] >= 0).all()  # bit 3 is the sign


def test_dynamic_map_facts():
    d = dynamic_map()
    assert d.shape == (256,) and d.dtype == torch.float32
    assert torch.equal(d, torch.sort(d).values) and d.unique().numel() == 256
    assert d[-1] == 1.0 and (d == 0).sum() == 1
    pos, neg = d[d > 0], d[d < 0]
    assert torch.equal(torch.sort(-neg).values, pos[:-1]), "signed: every value but 1 has its negative"


@pytest.mark.parametrize("case", C.BLOCKWISE4_CASES, ids=lambda c: c.id)
def test_state_dict_round_trip_is_exact(case):
    state = C.random_state(case, torch.Generator().manual_seed(3))
    fmt = FORMATS[case.fmt]
    back = fmt.to_state_dict(fmt.from_state_dict(state))
    assert set(back) == set(state)
    for key in state:
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key]), key


def test_prefixed_keys_and_bias():
    case = C.BLOCKWISE4_CASES[0]
    state = {f"model.l.{k}": v for k, v in C.random_state(case, torch.Generator().manual_seed(0)).items()}
    state["model.l.bias"] = torch.randn(case.n)
    fmt = FORMATS[case.fmt]
    c = fmt.from_state_dict(state, prefix="model.l.")
    assert torch.equal(c.bias, state["model.l.bias"])
    assert set(fmt.to_state_dict(c, prefix="model.l.")) == set(state)


def test_quant_storage_other_than_uint8_is_read_through_its_bytes():
    case = C.BLOCKWISE4_CASES[4]  # 24x256: an even byte count
    state = C.random_state(case, torch.Generator().manual_seed(1))
    fmt = FORMATS[case.fmt]
    as_bf16 = dict(state, weight=state["weight"].reshape(-1).view(torch.bfloat16).reshape(-1, 1))
    assert torch.equal(fmt.dequantize(fmt.from_state_dict(as_bf16)), fmt.dequantize(fmt.from_state_dict(state)))


def test_from_state_dict_errors_name_what_is_wrong():
    case = C.BLOCKWISE4_CASES[0]
    state = C.random_state(case, torch.Generator().manual_seed(0))
    other = "bitsandbytes-fp4" if case.fmt.endswith("nf4") else "bitsandbytes-nf4"
    with pytest.raises(KeyError, match="quant_state.bitsandbytes__"):
        FORMATS[other].from_state_dict(state)
    with pytest.raises(ValueError, match="absmax must be torch.uint8 with"):
        FORMATS[case.fmt].from_state_dict(dict(state, **{"weight.absmax": state["weight.absmax"][:-1]}))
    with pytest.raises(ValueError, match="weight must hold ceil"):
        FORMATS[case.fmt].from_state_dict(dict(state, weight=state["weight"][:-1]))
    s8 = C.random_state(C.INT8_CASES[0], torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="weight_format 1 .col32. is not supported"):
        FORMATS["bitsandbytes-int8"].from_state_dict(dict(s8, weight_format=torch.tensor(1, dtype=torch.uint8)))
    with pytest.raises(KeyError, match="SCB"):
        FORMATS["bitsandbytes-int8"].from_state_dict({"weight": s8["weight"]})
    legacy = {"weight": s8["weight"], "weight.SCB": s8["SCB"]}
    assert torch.equal(FORMATS["bitsandbytes-int8"].from_state_dict(legacy).SCB, s8["SCB"])


@pytest.mark.parametrize("change,exc,match", [
    (dict(shape=["64", 128]), TypeError, r"quant_state shape\[0\] must be an integer, got str '64'"),
    (dict(shape=[64.0, 128]), TypeError, r"quant_state shape\[0\] must be an integer, got float 64\.0"),
    (dict(shape=[64, -128]), ValueError, r"quant_state shape\[1\] must not be negative, got -128"),
    (dict(blocksize=64.0), TypeError, r"blocksize must be an integer, got float 64\.0"),
    (dict(nested_blocksize="256"), TypeError, r"nested_blocksize must be an integer, got str '256'"),
    (dict(nested_offset="x"), TypeError, r"nested_offset must be a number, got str 'x'"),
], ids=["shape-str", "shape-float", "shape-negative", "blocksize-float", "nested_blocksize-str", "nested_offset-str"])
def test_quant_state_values_are_checked_before_use(change, exc, match):
    fmt = FORMATS["bitsandbytes-nf4"]
    c = fmt.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), group_size=64, nested=True)
    bad = dataclasses.replace(c, quant_state={**c.quant_state, **change})
    with pytest.raises(exc, match=rf"bitsandbytes-nf4: {match}"):
        fmt.unpack(bad)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False])
def test_reference_quantizer(quant_type, nested):
    fmt = FORMATS[f"bitsandbytes-{quant_type}"]
    w = torch.randn(40, 100, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    c = fmt.quantize(w, group_size=64, nested=nested)
    qs = c.quant_state
    assert list(qs)[:4] == ["quant_type", "blocksize", "dtype", "shape"] and qs["shape"] == [40, 100]
    if nested:
        assert qs["nested_blocksize"] == NESTED_BLOCKSIZE and c.absmax.dtype == torch.uint8
    codes = C.codes_of(c.weight, 4000)
    absmax = w.reshape(-1).abs().reshape(-1)
    blocks = torch.nn.functional.pad(absmax, (0, 64 * 63 - 4000)).reshape(63, 64).amax(1)
    scaled = (w.reshape(-1) / blocks.repeat_interleave(64)[:4000]).double()
    table = torch.from_numpy(C.codebook(quant_type)).double()
    dist = (scaled[:, None] - table[None, :]).abs()
    picked = dist[torch.arange(4000), torch.from_numpy(codes)]
    assert torch.all(picked <= dist.min(1).values + 1e-6), "every value maps to its nearest code"
    w_hat = fmt.dequantize(c)
    assert C.rel_err(w_hat, w.double()) < (0.12 if quant_type == "nf4" else 0.2)


def test_int8_reference_quantizer():
    w = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    c = FORMATS["bitsandbytes-int8"].quantize(w)
    assert torch.equal(c.SCB, w.abs().amax(1))
    assert torch.equal(c.weight, torch.round(w * (127 / c.SCB[:, None])).to(torch.int8))
    assert c.weight.abs().amax(1).eq(127).all()


# ------------------------------------------------------------------------------ ops vs oracle


def _x(m, k, dtype, gen, layout):
    """Activations (M, K) of ``dtype``: "contiguous", "transposed" (column-major) or "strided" (K
    stride 2). The view is taken after the conversion (``.to(dtype)`` of a strided view returns a
    contiguous copy), and its strides are checked so that no layout is one in name only."""
    if layout == "transposed":
        x, strides = torch.randn(k, m, generator=gen).to(dtype).t(), (1, max(m, 1))
    elif layout == "strided":
        x, strides = torch.randn(m, 2 * k, generator=gen).to(dtype)[:, ::2], (2 * k, 2)
    else:
        x, strides = torch.randn(m, k, generator=gen).to(dtype), (k, 1)
    assert x.stride() == strides, f"{layout} x {dtype}: strides {x.stride()}, want {strides}"
    return x


@pytest.mark.parametrize("dtype", C.ACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ops_match_oracle(case, dtype):
    b = C.build(case, dtype)
    w = b.weight
    assert w.kernel == Kernel.REFERENCE  # CPU
    gen = torch.Generator().manual_seed(C.seed_of(case))
    n, k = case.n, case.k
    for i, m in enumerate(C.MS):
        x = _x(m, k, dtype, gen, ("contiguous", "transposed", "strided")[i % 3])
        bias = torch.randn(n, generator=gen).to(dtype) if i % 2 else None
        y = w.mm(x, bias)
        C.check_output(y, x, b.w64, bias, dtype, C.TOL[dtype], f"M={m}")
        out = torch.full((m, n), float("nan"), dtype=dtype)
        _mm_out(w, x, bias, out)
        assert torch.equal(out, y)
    x3 = torch.randn(2, 3, k, generator=gen).to(dtype)
    C.check_output(w.mm(x3), x3, b.w64, None, dtype, C.TOL[dtype], "(2, 3, K)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [C.INT8_CASES[0], C.BLOCKWISE4_CASES[2]], ids=lambda c: c.id)
def test_check_output_catches_one_wrong_element(case, dtype):
    """C.check_output (the GPU suites' check) passes the kernel's output and fails it with one element
    moved 1.5x its elementwise bound, which the relative error over the whole output lets pass."""
    b = C.build(case, dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, case.k, generator=gen).to(dtype)
    bias = torch.randn(case.n, generator=gen).to(dtype)
    y = b.weight.mm(x, bias)
    C.check_output(y, x, b.w64, bias, dtype, C.TOL[dtype], "as computed")
    want = C.matmul(x, b.w64, bias)
    r, col = 17, case.n // 2
    bad = y.clone()
    bad[r, col] = want[r, col] + 1.5 * elementwise_bound(x[r:r + 1], b.w64[col:col + 1], bias[col:col + 1], dtype)[0, 0]
    assert C.rel_err(bad, want) <= C.TOL[dtype]
    with pytest.raises(AssertionError, match=f"1 of {64 * case.n} elements past the elementwise bound; worst at \\({r}, {col}\\)"):
        C.check_output(bad, x, b.w64, bias, dtype, C.TOL[dtype], "one wrong")


def _mm_out(w, x, bias, out, workspace=None):
    if hasattr(w, "scales"):
        torch.ops.qops.mm_int8_weight_out(x, w.qweight, w.scales, bias, int(w.kernel), out, workspace)
    else:
        torch.ops.qops.mm_blockwise4_out(x, *w._weight_args(), bias, *w._static_args(), int(w.kernel), out, workspace)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_hot_activations_return_the_weight(case):
    b = C.build(case, torch.float32)
    y = b.weight.mm(torch.eye(case.k))
    if case.fmt == "bitsandbytes-int8":  # the runtime scale is SCB / 127 rounded once
        torch.testing.assert_close(y.double(), b.w64.t(), rtol=2e-7, atol=0)
    else:
        assert torch.equal(y, b.w64.t().float()), "one-hot x must return W exactly"
    assert torch.equal(b.weight.dequantize(), y.t())


@pytest.mark.parametrize("dtype", C.ACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", [C.INT8_CASES[0], C.INT8_CASES[2], C.BLOCKWISE4_CASES[0], C.BLOCKWISE4_CASES[3]], ids=lambda c: c.id)
def test_gradient(case, dtype):
    b = C.build(case, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, case.k, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(case.n, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(5, case.n, generator=gen).to(dtype)
    b.weight.mm(x, bias).backward(g)
    assert x.grad.dtype == dtype
    assert C.rel_err(x.grad, g.double() @ b.w64) <= C.TOL[dtype]
    assert C.rel_err(bias.grad, g.double().sum(0)) <= C.TOL[dtype]


def test_runtime_weight_is_the_checkpoint():
    # bitsandbytes int8 and 4-bit: the runtime tensors are the checkpoint's own storage.
    b = C.build(C.INT8_CASES[0])
    assert b.weight.qweight.data_ptr() == b.checkpoint.weight.data_ptr()
    for case in C.BLOCKWISE4_CASES[:2]:
        b = C.build(case)
        c = b.checkpoint
        assert b.weight.qweight.data_ptr() == c.weight.data_ptr() and b.weight.absmax.data_ptr() == c.absmax.data_ptr()
        ckpt_bytes = sum(t.numel() * t.element_size() for t in (c.weight, c.absmax, c.quant_map, c.nested_absmax, c.nested_quant_map) if t is not None)
        assert b.weight.nbytes() <= ckpt_bytes + 4  # + the nested offset, a float in the JSON blob


def test_triton_lowering_refusals():
    low = LOWERINGS_BY_NAME["triton_blockwise4"]
    spec = WeightSpec(family="blockwise4", format="bitsandbytes-nf4", bits=4, group_size=64, n=33, k=96,
                      act_order=False, symmetric=True, device=torch.device("cuda"), act_dtype=torch.float16)
    assert low.static_refusal(spec) is None  # K % blocksize != 0: served by the dense path (below)
    assert "group_size=48" in low.static_refusal(WeightSpec(**{**spec.__dict__, "group_size": 48, "k": 96}))
    assert LOWERINGS_BY_NAME["triton_int8_weight"].static_refusal(WeightSpec(**{**spec.__dict__, "family": "int8_weight", "format": "eetq", "bits": 8, "group_size": -1})) is None


# ----------------------------------------------------------------------------------- errors


META = torch.device("meta")


def _int8_args(w, x):
    return [x, w.qweight, w.scales, None, int(w.kernel)]


def _bw4_args(w, x):
    return [x, *w._weight_args(), None, *w._static_args(), int(w.kernel)]


INT8_BAD = [
    ("x", lambda a: a.__setitem__(0, a[0].to(torch.int32)), "x must be float32"),
    ("qweight dtype", lambda a: a.__setitem__(1, a[1].to(torch.int16)), "qweight must be torch.int8"),
    ("qweight K", lambda a: a.__setitem__(1, a[1][:, :-1]), "qweight must have K="),
    ("scales shape", lambda a: a.__setitem__(2, a[2][:-1]), r"scales must have shape \("),
    ("scales dtype", lambda a: a.__setitem__(2, a[2].to(torch.int32)), "scales must be float32"),
    ("bias", lambda a: a.__setitem__(3, torch.zeros(3)), r"bias must have shape \("),
    ("kernel", lambda a: a.__setitem__(4, 7), "kernel must be one of"),
    # devices: "meta" stands in for a second device on a CPU-only machine
    ("qweight device", lambda a: a.__setitem__(1, a[1].to(META)), r"qweight must be on cpu \(the device of x\), got meta"),
    ("scales device", lambda a: a.__setitem__(2, a[2].to(META)), r"scales must be on cpu \(the device of x\), got meta"),
    ("bias device", lambda a: a.__setitem__(3, torch.zeros(33, device=META)), r"bias must be on cpu \(the device of x\), got meta"),
    ("x device", lambda a: a.__setitem__(0, a[0].to(META)), r"qweight must be on meta \(the device of x\), got cpu"),
]
BW4_BAD = [
    ("qweight", lambda a: a.__setitem__(1, a[1][:-1]), r"qweight must have shape \("),
    ("code", lambda a: a.__setitem__(2, a[2][:8]), r"code must have shape \(16,\)"),
    ("absmax count", lambda a: a.__setitem__(3, a[3][:-1]), r"absmax must have shape \("),
    ("absmax dtype", lambda a: a.__setitem__(3, a[3].to(torch.float16)), "absmax must be torch.float32 .plain. or torch.uint8"),
    ("nested missing", lambda a: a.__setitem__(6, None), "nested_offset is required when absmax is uint8"),
    ("nested_absmax", lambda a: a.__setitem__(5, a[5][:0]), r"nested_absmax must have shape \("),
    ("blocksize", lambda a: a.__setitem__(10, 0), "blocksize must be positive"),
    ("out_features", lambda a: a.__setitem__(8, a[8] + 1), r"qweight must have shape \("),
    ("in_features", lambda a: a.__setitem__(9, a[9] + 1), r"x must have in_features=97 in its last dimension, got shape \(3, 96\)"),
    ("layout", lambda a: a.__setitem__(12, 3), "layout must be one of"),
    ("layout shape", lambda a: a.__setitem__(12, 1), r"layout=1 \(tile16\) needs N % 16 == 0 and K % 128 == 0"),
    ("kernel", lambda a: a.__setitem__(13, 9), "kernel must be one of"),
    # devices, each weight tensor (the case's absmax is nested: all six are tensors), the bias and x
    *((f"{name} device", lambda a, i=i: a.__setitem__(i, a[i].to(META)), rf"{name} must be on cpu \(the device of x\), got meta")
      for i, name in enumerate(("qweight", "code", "absmax", "nested_code", "nested_absmax", "nested_offset"), start=1)),
    ("bias device", lambda a: a.__setitem__(7, torch.zeros(33, device=META)), r"bias must be on cpu \(the device of x\), got meta"),
    ("x device", lambda a: a.__setitem__(0, a[0].to(META)), r"qweight must be on meta \(the device of x\), got cpu"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("bad", INT8_BAD + BW4_BAD, ids=lambda b: b[0])
def test_errors_name_the_argument(bad, fake):
    name, mutate, message = bad
    is_int8 = bad in INT8_BAD
    case = C.INT8_CASES[0] if is_int8 else C.BLOCKWISE4_CASES[0]
    w = C.build(case).weight
    args = (_int8_args if is_int8 else _bw4_args)(w, torch.randn(3, case.k))
    mutate(args)
    op_name = "mm_int8_weight" if is_int8 else "mm_blockwise4"
    op = getattr(torch.ops.qops, op_name)
    # The op's own check (named after the op, a ValueError or TypeError), not a failure inside torch.
    pattern = f"{op_name}: {message}"
    if fake:
        mode = FakeTensorMode()
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode, pytest.raises((ValueError, TypeError), match=pattern):
            op(*args)
    else:
        with pytest.raises((ValueError, TypeError), match=pattern):
            op(*args)


DEQUANTIZE_BAD = [
    ("int8 qweight 0-d", True, lambda a: a.__setitem__(0, torch.tensor(1, dtype=torch.int8)), r"qweight must be 2-D \(N, K\), got 0-D"),
    ("int8 dtype", True, lambda a: a.__setitem__(2, torch.int32), r"dtype must be one of .*got torch.int32"),
    ("blockwise4 in_features", False, lambda a: a.__setitem__(7, -3), r"in_features must be >= 0, got -3"),
    ("blockwise4 dtype", False, lambda a: a.__setitem__(11, torch.uint8), r"dtype must be one of .*got torch.uint8"),
]


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("bad", DEQUANTIZE_BAD, ids=lambda b: b[0])
def test_dequantize_errors_name_the_argument(bad, fake):
    """Static arguments a dequantize op takes (no x to check them against): refused by name, where an
    integer dtype returned truncated weights and a 0-d qweight or a negative K failed inside torch."""
    _, is_int8, mutate, message = bad
    w = C.build(C.INT8_CASES[0] if is_int8 else C.BLOCKWISE4_CASES[0]).weight
    args = [w.qweight, w.scales, torch.float16] if is_int8 else [*w._weight_args(), *w._static_args(), torch.float16]
    mutate(args)
    op = torch.ops.qops.dequantize_int8_weight if is_int8 else torch.ops.qops.dequantize_blockwise4
    with FakeTensorMode(allow_non_fake_inputs=False) if fake else contextlib.nullcontext() as mode:
        if fake:
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises((ValueError, TypeError), match=message):
            op(*args)


def test_plain_absmax_refuses_nested_tables():
    w = C.build(C.BLOCKWISE4_CASES[1]).weight  # not nested
    args = _bw4_args(w, torch.randn(2, w.in_features))
    args[4] = torch.zeros(256)
    with pytest.raises(ValueError, match="nested_code must be None when absmax is float32"):
        torch.ops.qops.mm_blockwise4(*args)


# --------------------------------------------------------------- Triton kernels (interpreter)


def _triton_case(case, dtype, m, override, mod, gen, strided=False):
    """(y, its float64 oracle, the plan), y already checked element by element against the oracle's
    bound (tests/oracle.py); ``strided``: bias (and int8's scales) as views of stride 2."""
    b = C.build(case)
    w = b.weight
    x = _x(m, case.k, dtype, gen, "transposed" if m % 2 else "contiguous")
    bias = torch.randn(case.n, generator=gen).to(dtype)
    view = stride_two if strided else (lambda t: t)  # noqa: E731
    with mod.config_override(**override):
        if hasattr(w, "scales"):
            y = mod.triton_mm(x, w.qweight, view(w.scales), view(bias))
        else:
            y = mod.triton_mm(x, *w._weight_args(), view(bias), w.out_features, w.blocksize, w.nested_blocksize, w.layout)
        p = mod.plan(m, case.n, case.k, x.device) if hasattr(w, "scales") else mod.plan(m, case.n, case.k, w.blocksize, x.device, dtype)
    check_elementwise(y, x, b.w64, bias, dtype, f"{case.id} M={m} {p['path']}")
    return y, C.matmul(x, b.w64, bias), p


TINY_GEMM = [(1 << 62, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2})]
TRITON_RUNS = [
    # (case, M, override, expected path, split > 1)
    (C.INT8_CASES[0], 1, {}, "gemv", None),
    # The GEMV takes M = 1 by default; forced to two rows of x here (a program per row) with a K split.
    (C.INT8_CASES[0], 2, {"gemv_max_m": 2, "gemv": {"BLOCK_K": 32, "programs_per_sm": 64}}, "gemv", True),
    (C.INT8_CASES[2], 3, {"gemm": TINY_GEMM, "gemm_max_split": 1}, "gemm", False),
    (C.INT8_CASES[3], 17, {"gemm": TINY_GEMM, "gemm_max_split": 4}, "gemm", True),
    # M = 1 in 16 bits goes to the CUDA-core GEMV (test_triton_gemv_fma); gemv_fma_max_m 0 keeps the dot one.
    (C.BLOCKWISE4_CASES[4], 1, {"gemv_fma_max_m": 0, "gemv": {"max_split": 1}}, "gemv", False),  # 24x256 b128 nested
    (C.BLOCKWISE4_CASES[5], 2, {"gemv_fma_max_m": 0, "gemv": {"STEP_BYTES": 64, "programs_per_sm": 64}}, "gemv", True),
    (C.BLOCKWISE4_CASES[10], 1, {"gemv_fma_max_m": 0, "gemv": {"STEP_BYTES": 16}}, "gemv", None),  # fp4
    (C.BLOCKWISE4_CASES[11], 16, {"gemv": {"BLOCK_N": 16}}, "gemv", None),  # the largest default GEMV M
    (C.BLOCKWISE4_CASES[4], 17, {"gemv_max_m": 32}, "gemv", None),  # a 32-wide dot, 15 rows masked
    (C.BLOCKWISE4_CASES[4], 5, {"gemv_max_m": 2, "gemv_slices_max_m": 0, "gemm": TINY_GEMM, "gemm_max_split": 1}, "gemm", False),
    (C.BLOCKWISE4_CASES[11], 17, {"gemv_slices_max_m": 0, "gemm": TINY_GEMM, "gemm_max_split": 4}, "gemm", True),
    # The weight tile scaled before the dots (what large BLOCK_M uses), nested and plain.
    (C.BLOCKWISE4_CASES[10], 17, {"gemv_slices_max_m": 0, "gemm": TINY_GEMM, "gemm_max_split": 1, "scale_after_max_block_m": 0}, "gemm", False),
    (C.BLOCKWISE4_CASES[5], 3, {"gemv_max_m": 2, "gemv_slices_max_m": 0, "gemm": TINY_GEMM, "gemm_max_split": 2, "scale_after_max_block_m": 0}, "gemm", True),
    # Above gemv_max_m: the small-M kernel over row slices (the last one partial), with and without split-K.
    (C.BLOCKWISE4_CASES[4], 37, {"dense_above_m": 64}, "gemv_slices", None),
    (C.BLOCKWISE4_CASES[5], 7, {"gemv_max_m": 2, "gemv_fma_max_m": 0, "gemv": {"STEP_BYTES": 64, "programs_per_sm": 64}},
     "gemv_slices", True),
    # M = 257: past every M tile and bucket edge (the int8 GEMM, the 4-bit dense path and GEMM).
    (C.INT8_CASES[3], 257, {"gemm": TINY_GEMM}, "gemm", None),
    (C.BLOCKWISE4_CASES[4], 257, {}, "dense", None),
    (C.BLOCKWISE4_CASES[11], 257, {"dense_above_m": 1 << 30, "gemv_slices_max_m": 0, "gemm": TINY_GEMM, "gemm_max_split": 1}, "gemm", False),
]


# bf16 x only where the interpreter computes it: the int8 GEMVs and the 4-bit dense path convert x to
# fp32 on load; the other kernels dot bf16 operands (tl.dot), which the interpreter multiplies wrongly
# (~1e9 off on a plain 16x32x16 dot, Triton 3.9), so the GPU suite checks them in bf16.
TRITON_RUN_DTYPES = [(r, d) for r in TRITON_RUNS for d in (torch.float16, torch.float32, torch.bfloat16)
                     if d != torch.bfloat16 or (r[0] in C.INT8_CASES and r[3] == "gemv") or r[3] == "dense"]
TRITON_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 6e-3}  # bf16: measured 2.1e-3, its output rounding


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("run,dtype", TRITON_RUN_DTYPES,
                         ids=[f"{r[0].id}-m{r[1]}-{r[3]}{'-split' if r[4] else ''}-{d}" for r, d in TRITON_RUN_DTYPES])
def test_triton_kernels_in_the_interpreter(run, dtype):
    from qops.ops.triton import blockwise4 as tbw4
    from qops.ops.triton import int8_weight as ti8

    case, m, override, path, split = run
    mod = ti8 if case in C.INT8_CASES else tbw4
    y, want, p = _triton_case(case, dtype, m, override, mod, torch.Generator().manual_seed(m))
    assert p["path"] == path and (split is None or (p["split"] > 1) == split), p
    assert y.dtype == dtype and y.shape == (m, case.n)
    assert C.rel_err(y, want) <= TRITON_TOL[dtype], C.rel_err(y, want)


# The int8 GEMV and GEMM with K splits. The blockwise4 (NF4 / FP4) launches keep zero_() and the host epilogue: chained
# the same way, NF4 at M = 1 ran 3.5-5% slower on the three largest shapes of an H100 (faster at M = 16; stop 73).
SPLIT_RUNS = [TRITON_RUNS[1], TRITON_RUNS[3]]


@needs_triton
@pytest.mark.parametrize("gpu_pdl", [True, False])
@pytest.mark.parametrize("run", SPLIT_RUNS, ids=lambda r: f"{r[0].id}-m{r[1]}-{r[3]}")
def test_a_split_launch_is_chained_where_the_gpu_has_pdl(run, gpu_pdl, monkeypatch):
    """A split launch of the int8 Triton kernels with its kernels replaced by recorders (the
    interpreter has no grid dependencies): on a GPU with PDL the fp32 sum is zeroed by ``zero_ahead``, the kernel
    is its programmatic dependent (PDL: waits before its adds, starts its dependents) and the one reduction
    (+ bias, cast) is the kernel's; elsewhere ``zero_()``, plain launches. Either way one reduction launch and no
    torch epilogue."""
    from qops.ops.triton import common as tc
    from qops.ops.triton import int8_weight as mod

    case, m, override, path, _ = run
    launches, zeroed = [], []
    for name in ("_gemv_kernel", "_gemm_kernel"):
        monkeypatch.setattr(mod, name, KernelRecorder(name, launches))
    monkeypatch.setattr(tc, "_reduce_kernel", KernelRecorder("_reduce_kernel", launches))
    monkeypatch.setattr(tc, "zero_ahead", lambda buf: zeroed.append((tuple(buf.shape), buf.dtype)))
    monkeypatch.setattr(tc, "pdl_launch", lambda device: gpu_pdl)
    b = C.build(case)
    w = b.weight
    x = torch.randn(m, case.k).to(torch.float16)
    bias = torch.randn(case.n).to(torch.float16)
    with mod.config_override(**override):
        p = mod.plan(m, case.n, case.k, x.device)
        assert p["path"] == path and p["split"] > 1, p
        mod.triton_mm(x, w.qweight, w.scales, bias)
    names = [name for name, _ in launches]
    assert names[-1] == "_reduce_kernel" and names.count("_reduce_kernel") == 1 and len(names) == 2, names
    kernel, reduce = launches[0][1], launches[1][1]
    assert kernel["ATOMIC"] and reduce["HAS_BIAS"], (kernel, reduce)
    chained = {"PDL": True, "launch_pdl": True}
    assert all(kernel.get(key) == value for key, value in chained.items()) == gpu_pdl, kernel
    assert all(reduce.get(key) == value for key, value in chained.items()) == gpu_pdl, reduce
    assert zeroed == ([((m, case.n), torch.float32)] if gpu_pdl else [])


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("run", [r for r in TRITON_RUNS if r[1] in (1, 17)] + [(C.BLOCKWISE4_CASES[4], 1, {}, "gemv_fma", None)],
                         ids=lambda r: f"{r[0].id}-m{r[1]}-{r[3]}")
def test_triton_small_tensors_with_any_strides(run):
    """The ops accept a bias and int8 scales with any strides; the kernels read them with unit stride,
    so the entries make them contiguous (read as if contiguous they were off by ~600-1400x)."""
    from qops.ops.triton import blockwise4 as tbw4
    from qops.ops.triton import int8_weight as ti8

    case, m, override, path, _ = run
    mod = ti8 if case in C.INT8_CASES else tbw4
    y, want, p = _triton_case(case, torch.float16, m, override, mod, torch.Generator().manual_seed(m), strided=True)
    assert p["path"] == path, p
    assert C.rel_err(y, want) <= 2e-3, C.rel_err(y, want)


@pytest.mark.interpreter
@needs_triton
def test_triton_k_not_a_multiple_of_the_step():
    # 8x256 int8 with BLOCK_K 96 -> 128: K steps end inside a tile (masked loads). 4-bit: 8x96 b32
    # (3 steps of 16 bytes per row) in 2 splits: the second split is one step long.
    from qops.ops.triton import blockwise4 as tbw4
    from qops.ops.triton import int8_weight as ti8

    gen = torch.Generator().manual_seed(0)
    case = C.Case("bitsandbytes-int8", 8, 200)
    y, want, p = _triton_case(case, torch.float32, 1, {"gemv": {"BLOCK_K": 128}}, ti8, gen)
    assert not p["EVEN_K"] and C.rel_err(y, want) <= 2e-6
    case4 = C.Case("bitsandbytes-nf4", 8, 96, blocksize=32, nested=True)
    y, want, p = _triton_case(case4, torch.float32, 1, {"gemv": {"max_split": 2, "programs_per_sm": 64}}, tbw4, gen)
    assert (p["split"], p["split_bytes"], p["STEP"]) == (2, 32, 16) and C.rel_err(y, want) <= 2e-6


# The GEMV (M <= 16) over what bitsandbytes writes: NF4 and FP4, nested and plain absmax, the
# blocksizes 64 (default), 32, 256 and 4096, N off the row tile, M = 1, 2 and 17 (a 32-wide dot).
GEMV_CASES = tuple(
    C.Case(f"bitsandbytes-{qt}", n, k, blocksize=b, nested=nested)
    for qt, (n, k, b), nested in (
        ("nf4", (40, 192, 64), True), ("nf4", (40, 192, 64), False), ("fp4", (21, 128, 64), True),
        ("fp4", (19, 64, 32), False), ("nf4", (5, 512, 256), True), ("fp4", (3, 4096, 4096), True),
    )
)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: c.id)
def test_triton_gemv_over_bitsandbytes_layouts(case, dtype):
    from qops.ops.triton import blockwise4 as tbw4

    for m in (1, 2, 17):
        y, want, p = _triton_case(case, dtype, m, {"gemv_max_m": 32, "gemv_fma_max_m": 0, "gemv": {"BLOCK_N": 16}}, tbw4,
                                  torch.Generator().manual_seed(m))
        # fp32 x: the FMA dot is as wide as M (rounded up to a power of 2); fp16: 16 at least.
        assert p["path"] == "gemv" and p["BLOCK_M"] == ({1: 1, 2: 2, 17: 32} if dtype == torch.float32 else {1: 16, 2: 16, 17: 32})[m], p
        assert y.dtype == dtype and y.shape == (m, case.n)
        assert C.rel_err(y, want) <= (2e-6 if dtype == torch.float32 else 2e-3), (m, C.rel_err(y, want))


# The CUDA-core GEMV (M <= gemv_fma_max_m, 16-bit x): up to four (weight row, row of x) products a
# program. Over what bitsandbytes writes (GEMV_CASES: N odd, so the last program's later weight rows
# are missing), x read as int32 pairs (contiguous; one transposed row) or element by element (an odd
# offset, a K stride of 2), a step below a block, one block, and several; K split or not; M = 1..4
# (M = 3: the fourth row of x missing).
FMA_CONFIGS = (
    ({"ROWS": 2, "STEP_BYTES": 1024}, {}),
    ({"ROWS": 4, "STEP_BYTES": 32}, {}),
    ({"ROWS": 1, "STEP_BYTES": 16}, {"programs_per_sm": 64, "max_split": 4}),
    ({"ROWS": 2, "STEP_BYTES": 64}, {"programs_per_sm": 64, "max_split": 3}),
)


def _fma_pairs():
    """Every case under every configuration, except (a) the short steps (32 and 16 bytes) over K =
    4096: 128-256 steps a row under the interpreter (36 and 16 s on the CI box) that the five other
    cases already run; that case's 4096-value blocks run under the two configurations of long steps;
    (b) the second of two cases that differ only in nesting, under all but the first configuration:
    nesting changes how the absmax is read, once a program, which one configuration checks, while the
    configurations change the steps and rows (20-25 s each under the interpreter on the CI box)."""
    seen = set()
    for case in GEMV_CASES:
        twin = (case.fmt, case.n, case.k, case.blocksize)
        for i, cfg in enumerate(FMA_CONFIGS):
            if case.k >= 4096 and cfg[0]["STEP_BYTES"] < 64:
                continue
            if twin in seen and i > 0:
                continue
            yield pytest.param(case, cfg, id=f"{case.id}-rows{cfg[0]['ROWS']}-step{cfg[0]['STEP_BYTES']}{'-split' if cfg[1] else ''}")
        seen.add(twin)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("case, cfg", list(_fma_pairs()))
def test_triton_gemv_fma(case, cfg):
    from qops.ops.triton import blockwise4 as tbw4

    b = C.build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(C.seed_of(case))
    bias = torch.randn(case.n, generator=gen).half()
    xs = {
        "pairs": torch.randn(4, case.k, generator=gen).half(),
        "pairs-transposed-row": torch.randn(case.k, 1, generator=gen).t().half(),
        "odd-offset": torch.randn(4, case.k + 1, generator=gen).half()[:, 1:],
        "k-stride-2": _x(4, case.k, torch.float16, gen, "strided"),
    }
    ms = {"pairs": (1, 2, 3, 4), "pairs-transposed-row": (1,), "odd-offset": (1, 3), "k-stride-2": (2,)}
    if cfg[1]:  # the K split: its own rows of x are enough (the interpreter is slow on 16-byte steps)
        ms = {"pairs": (1, 3)}
    for name, x in xs.items():
        if name not in ms:
            continue
        for m in ms[name]:
            xm = x[:m]
            with tbw4.config_override(gemv_fma_max_m=4, gemv_fma=dict(cfg[0], **cfg[1])):
                y = tbw4.triton_mm(xm, *w._weight_args(), bias, w.out_features, w.blocksize, w.nested_blocksize, w.layout)
                p = tbw4.plan(m, case.n, case.k, w.blocksize, xm.device, xm.dtype)
            assert p["path"] == "gemv_fma" and p["XROWS"] * p["grid"][0] >= m and p["ROWS"] * p["XROWS"] <= 4, p
            if cfg[1] and (case.k // 2) // p["STEP"] >= 2:
                assert p["split"] > 1, p  # the K split (atomic adds into the fp32 scratch) is exercised
            C.check_output(y, xm, b.w64, bias, torch.float16, 2e-3, f"{name} M={m}")


def test_triton_gemv_fma_plan():
    from qops.ops.triton import blockwise4 as tbw4

    cpu = torch.device("cpu")
    # The default: M = 1 in 16 bits, two weight rows, STEP_BYTES capped so that whole steps tile the
    # row; M = 2 too (two rows of x); fp32 x and M = 3 take the dot GEMV.
    for (n, k, bs), step in (((28672, 4096, 64), 1024), ((4096, 192, 64), 32), ((3, 4096, 4096), 1024),
                             ((8192, 28672, 32), 1024), ((40, 192, 64), 32), ((21, 128, 64), 64)):
        p = tbw4.plan(1, n, k, bs, cpu, torch.bfloat16)
        assert p["path"] == "gemv_fma" and p["STEP"] == step and p["ROWS"] == 2, (n, k, bs, p)
        assert (k // 2) % step == 0 and p["split_bytes"] % step == 0, p
        assert p["grid"] == (1, -(-n // 2), p["split"]) and p["XROWS"] == 1
    assert tbw4.plan(1, 4096, 4096, 64, cpu, torch.float32)["path"] == "gemv"
    p = tbw4.plan(2, 4096, 4096, 64, cpu, torch.float16)  # two rows of x by two weight rows
    assert (p["path"], p["XROWS"], p["ROWS"], p["grid"][:2]) == ("gemv_fma", 2, 2, (1, 2048)), p
    assert tbw4.plan(3, 4096, 4096, 64, cpu, torch.float16)["path"] == "gemv"
    assert tbw4.plan(1, 4096, 4096 + 32, 64, cpu, torch.float16)["path"] == "dense"  # K % blocksize: flat stream only


# Multi-block GEMV steps (gemv.blocks_per_step > 1): a step spans G whole blocks per row. NF4 and FP4,
# nested and plain absmax, blocksizes 64, 32, 128 and 256, N off the 16-row tile, both ways of scaling
# (each block's product, or the weight tile before one wide dot), K split into whole steps (one split,
# equal splits, a shorter last split), and a STEP that does not divide the row falling back to fewer
# blocks. Each: (case, STEP_BYTES, blocks_per_step, scale, max_split, expected STEP, expected split).
MULTI_BLOCK_RUNS = (
    (C.Case("bitsandbytes-nf4", 40, 512, blocksize=64, nested=True), 128, 8, "product", 1, 128, 1),
    (C.Case("bitsandbytes-nf4", 40, 512, blocksize=64, nested=False), 64, 2, "product", 4, 64, 4),
    (C.Case("bitsandbytes-fp4", 21, 384, blocksize=32, nested=True), 64, 8, "product", 2, 64, 2),  # 2 + 1 steps
    (C.Case("bitsandbytes-fp4", 19, 768, blocksize=128, nested=False), 256, 8, "product", 3, 128, 3),  # 384 % 256
    (C.Case("bitsandbytes-nf4", 5, 1024, blocksize=256, nested=True), 256, 8, "product", 2, 256, 2),
    (C.Case("bitsandbytes-nf4", 40, 512, blocksize=64, nested=True), 128, 4, "weight", 2, 128, 2),
    (C.Case("bitsandbytes-fp4", 21, 384, blocksize=32, nested=False), 64, 4, "weight", 1, 64, 1),
    (C.Case("bitsandbytes-fp4", 5, 1024, blocksize=256, nested=False), 256, 2, "weight", 2, 256, 2),
)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("run", MULTI_BLOCK_RUNS, ids=lambda r: f"{r[0].id}-s{r[1]}-{r[3]}-split{r[6]}")
def test_triton_gemv_multi_block_steps(run, dtype):
    from qops.ops.triton import blockwise4 as tbw4

    case, step_bytes, blocks, scale, max_split, step, split = run
    gemv = {"BLOCK_N": 16, "STEP_BYTES": step_bytes, "blocks_per_step": blocks, "scale": scale,
            "max_split": max_split, "programs_per_sm": 64}
    for m in (1, 2, 16, 17):  # 17: a 16-row slice and a 1-row slice
        y, want, p = _triton_case(case, dtype, m, {"gemv_fma_max_m": 0, "gemv": gemv}, tbw4, torch.Generator().manual_seed(m))
        assert p["path"] == ("gemv" if m <= 16 else "gemv_slices"), p
        assert (p["STEP"], p["split"], p["SCALE_W"]) == (step, split, scale == "weight"), p
        assert p["split_bytes"] % step == 0 and 2 * step > case.blocksize
        assert y.dtype == dtype and y.shape == (m, case.n)
        assert C.rel_err(y, want) <= (2e-6 if dtype == torch.float32 else 2e-3), (m, C.rel_err(y, want))


@pytest.mark.parametrize("module", ["blockwise4", "int8_weight"])
def test_triton_config_override_refuses_a_key_the_table_lacks(module):
    """A misspelt top-level knob is refused, naming it, not added to the table and never read; the table is
    unchanged after the refusal."""
    mod = importlib.import_module(f"qops.ops.triton.{module}")
    before = copy.deepcopy(mod.TABLE.active)
    with pytest.raises(ValueError, match=r"config_override: unknown keys \['gemv_max_M'\]"):
        with mod.config_override(gemv_max_M=4):
            pass
    assert mod.TABLE.active == before
    with mod.config_override(gemv_max_m=3) as table:  # a key it has: taken
        assert table["gemv_max_m"] == 3 and mod.TABLE["gemv_max_m"] == 3
    assert mod.TABLE.active == before


def test_triton_gemv_step_plan():
    from qops.ops.triton import blockwise4 as tbw4

    cpu = torch.device("cpu")
    # The default config: one block at most (32 bytes at blocksize 64, 16 at 32), as measured so far.
    for bs, step in ((64, 32), (32, 16), (128, 32), (4096, 32)):
        p = tbw4.plan(3, 8192, 28672, bs, cpu, torch.float16)  # M = 3: the dot GEMV (M <= 2: test_triton_gemv_fma_plan)
        assert (p["STEP"], p["SCALE_W"]) == (step, False), p
    with tbw4.config_override(gemv={"STEP_BYTES": 256, "blocks_per_step": 8, "max_split": 4}):
        for (n, k, bs), step in (((8192, 28672, 64), 256), ((4096, 11008, 64), 128), ((4096, 4096, 32), 128),
                                 ((4096, 4096, 4096), 256), ((4096, 192, 64), 32)):
            p = tbw4.plan(3, n, k, bs, cpu, torch.float16)
            assert p["STEP"] == step and (k // 2) % step == 0 and p["split_bytes"] % step == 0, (n, k, bs, p)
            assert (p["split"] - 1) * p["split_bytes"] < k // 2 <= p["split"] * p["split_bytes"], p


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``sel`` nibble i (low 3 bits) of
    {b, a}, or that byte's sign bit replicated when the nibble's bit 3 is set."""
    src = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _run_decode_asm(word: int, tables: list[int]) -> list[int]:
    """Execute ``_DECODE_ASM`` (and, shr, or, prmt on .b32) on one byte word with the 8 table words."""
    from qops.ops.triton import blockwise4 as tbw4

    # Operands as the kernel binds them: $0-$3 outputs, $4 the byte word, table word i at $(5 + 4i).
    regs = {"$4": word, **{f"${5 + 4 * i}": t for i, t in enumerate(tables)}}
    for line in str(tbw4._DECODE_ASM.value).splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        v = [regs[t] if t in regs else int(t, 0) for t in srcs]
        if op == "and.b32":
            regs[dst] = v[0] & v[1]
        elif op == "or.b32":
            regs[dst] = v[0] | v[1]
        elif op == "shr.u32":
            regs[dst] = v[0] >> v[1]
        elif op == "prmt.b32":
            regs[dst] = _prmt(v[0], v[1], v[2])
        else:
            raise AssertionError(f"unknown instruction {op}")
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_prmt_decode_returns_the_codes(quant_type, dtype):
    # The GPU decodes codes with inline PTX, which Triton's interpreter cannot run: the instruction
    # sequence is executed here, on every byte value in every byte position of the word.
    code = torch.from_numpy(C.codebook(quant_type))
    bits = [int(v) & 0xFFFF for v in code.to(dtype).view(torch.int16)]
    planes = [sum(((bits[4 * w + i] >> (8 * high)) & 0xFF) << (8 * i) for i in range(4)) for high in (0, 1) for w in range(4)]
    for v in range(256):
        for pos in range(4):
            word = (v << (8 * pos)) | (((v * 37 + 11) & 0xFF) << (8 * ((pos + 1) % 4)))
            outs = _run_decode_asm(word, planes)
            got_even = [outs[0] & 0xFFFF, outs[0] >> 16, outs[1] & 0xFFFF, outs[1] >> 16]
            got_odd = [outs[2] & 0xFFFF, outs[2] >> 16, outs[3] & 0xFFFF, outs[3] >> 16]
            for j in range(4):
                byte = (word >> (8 * j)) & 0xFF
                assert got_even[j] == bits[byte // 16] and got_odd[j] == bits[byte % 16], (v, pos, j)


@pytest.mark.interpreter
@needs_triton
def test_triton_writes_out_and_uses_the_workspace():
    from qops.ops.triton import int8_weight as ti8

    b = C.build(C.INT8_CASES[1])
    w = b.weight
    x = torch.randn(2, w.in_features, dtype=torch.float16)
    out = torch.full((2, w.out_features), float("nan"), dtype=torch.float16)
    ws = torch.full((4 * 2 * w.out_features + 7,), 255, dtype=torch.uint8)
    with ti8.config_override(gemv={"BLOCK_K": 32, "programs_per_sm": 64}):
        r = ti8.triton_mm(x, w.qweight, w.scales, None, out=out, workspace=ws)
    assert r is out
    C.check_output(out, x, b.w64, None, torch.float16, 2e-3, "out + workspace")


# Above 32 rows the 4-bit lowering dequantizes N-slabs of W and multiplies with torch.mm: NF4 and FP4,
# nested and plain absmax, blocksizes 64, 32 and 128, K off the blocksize (96 at 64, 99 at 32: rows
# start mid-block and, for odd K, on odd nibbles) and odd N. slab_bytes 1 forces the smallest slab
# (8 rows), so slab edges fall inside blocks and a partial last slab follows.
DENSE_CASES = tuple(
    C.Case(f"bitsandbytes-{qt}", n, k, blocksize=b, nested=nested)
    for qt, (n, k, b), nested in (
        ("nf4", (33, 96, 64), True), ("nf4", (40, 128, 64), False), ("fp4", (21, 99, 32), True),
        ("fp4", (19, 256, 128), False),
    )
)


def _dense_mm(w, x, bias, **kw):
    from qops.ops.triton import blockwise4 as tbw4

    return tbw4.triton_mm(x, *w._weight_args(), bias, w.out_features, w.blocksize, w.nested_blocksize, w.layout, **kw)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: c.id)
def test_triton_dense_path(case, dtype):
    from qops.ops.triton import blockwise4 as tbw4

    b = C.build(case)
    gen = torch.Generator().manual_seed(C.seed_of(case))
    bias = torch.randn(case.n, generator=gen).to(dtype)
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    for i, (shape, slab_bytes) in enumerate((((33,), 1), ((70,), 128 << 20), ((2, 35), 1))):
        x = torch.randn(*shape, case.k, generator=gen).to(dtype)
        if i == 1:
            x = x.t().contiguous().t()  # column-major rows
        bb = bias if i != 1 else None
        with tbw4.config_override(slab_bytes=slab_bytes):
            p = tbw4.plan(x.shape[:-1].numel(), case.n, case.k, case.blocksize, x.device, dtype)
            y = _dense_mm(b.weight, x, bb)
        assert p["path"] == "dense" and p["slab"] == (min(8, case.n) if slab_bytes == 1 else case.n), p
        C.check_output(y, x, b.w64, bb, dtype, tol, f"{shape} slab_bytes={slab_bytes}")


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [c for c in DENSE_CASES if c.k % c.blocksize], ids=lambda c: c.id)
def test_triton_k_not_a_multiple_of_the_block_takes_the_dense_path_at_every_m(case, dtype):
    # Blocks straddle rows: the gemv and gemm kernels index blocks per row and would read the wrong
    # absmax (a wrong answer, NaN on the GPU); the dense path indexes the flat stream.
    from qops.ops.triton import blockwise4 as tbw4

    w = C.build(case)
    gen = torch.Generator().manual_seed(C.seed_of(case) + 1)
    bias = torch.randn(case.n, generator=gen).to(dtype)
    for m in (0, 1, 5, 17):
        x = _x(m, case.k, dtype, gen, "transposed" if m % 2 else "contiguous")
        assert tbw4.plan(m, case.n, case.k, case.blocksize, x.device, dtype)["path"] == "dense"
        y = _dense_mm(w.weight, x, bias)
        C.check_output(y, x, w.w64, bias, dtype, 2e-6 if dtype == torch.float32 else 2e-3, f"M={m}")


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", DENSE_CASES[::2], ids=lambda c: c.id)
def test_triton_dense_slabs_are_the_reference_dequantization(case, dtype):
    # One-hot rows (K > 32 of them: the dense path) return the dequantized slabs exactly: the
    # kernel's nibble order, block index and de-nesting are the reference's, rounded once to dtype.
    from qops.ops.blockwise4 import reference_dequantize
    from qops.ops.triton import blockwise4 as tbw4

    w = C.build(case).weight
    want = reference_dequantize(*w._weight_args(), w.out_features, w.in_features, w.blocksize, w.nested_blocksize, w.layout)
    with tbw4.config_override(slab_bytes=1):
        y = _dense_mm(w, torch.eye(case.k, dtype=dtype), None)
    assert torch.equal(y, want.t().to(dtype))


@pytest.mark.interpreter
@needs_triton
def test_triton_dense_writes_out_and_takes_the_workspace_only_when_it_fits():
    from qops.ops.triton import blockwise4 as tbw4

    case = DENSE_CASES[2]  # fp4 21x99 b32 nested
    b = C.build(case)
    w = b.weight
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, case.k, generator=gen).to(torch.float16)
    bias = torch.randn(case.n, generator=gen).to(torch.float16)
    with tbw4.config_override(slab_bytes=1):
        need = 2 * 8 * case.k  # one 8-row fp16 slab
        for size, used in ((need + 5, True), (need - 1, False)):
            ws = torch.full((size,), 255, dtype=torch.uint8)
            out = torch.full((40, case.n), float("nan"), dtype=torch.float16)
            r = _dense_mm(w, x, bias, out=out, workspace=ws)
            assert r is out
            C.check_output(out, x, b.w64, bias, torch.float16, 2e-3, f"workspace of {size} bytes")
            assert bool((ws[:need] != 255).any()) == used and bool((ws[need:] == 255).all())
        # A column-major out (cuBLAS writes its column slices in place), and one that is no (M, N)
        # view (written through a fresh buffer, then copied).
        for out in (torch.full((case.n, 40), float("nan"), dtype=torch.float16).t(),
                    torch.full((20, 2, case.n), float("nan"), dtype=torch.float16).transpose(0, 1)):
            xs = x.view(*out.shape[:-1], case.k)
            r = _dense_mm(w, xs, bias, out=out)
            assert r is out
            C.check_output(out, xs, b.w64, bias, torch.float16, 2e-3, f"out {tuple(out.shape)} strides {out.stride()}")


def test_triton_blockwise4_plan_takes_the_dense_path_above_32_rows():
    from types import SimpleNamespace

    from qops.ops.triton import blockwise4 as tbw4
    from qops.workspace import SCRATCH_BYTES

    cpu = torch.device("cpu")
    paths = {m: tbw4.plan(m, 4096, 4096, 64, cpu, torch.float16)["path"] for m in (1, 16, 17, 32, 33, 64, 300, 8192)}
    assert paths == {1: "gemv_fma", 16: "gemv", 17: "gemv_slices", 32: "gemv_slices", 33: "dense", 64: "dense",
                     300: "dense", 8192: "dense"}
    # Slabs: whole multiples of 8 rows within 128 MB of x's dtype, all of N when it fits.
    assert tbw4.plan(64, 4096, 4096, 64, cpu, torch.float16)["slab"] == 4096
    assert tbw4.plan(64, 28672, 8192, 64, cpu, torch.bfloat16)["slab"] == 8192
    assert tbw4.plan(64, 28672, 8192, 64, cpu, torch.float32)["slab"] == 4096
    assert tbw4.plan(64, 100, 3 << 20, 64, cpu, torch.float32)["slab"] == 8
    assert tbw4.plan(64, 50000, 4000, 64, cpu, torch.float16)["slab"] == (128 << 20) // 8000 // 8 * 8
    # The dense path declares no workspace (it allocates the slab unless the one given holds it).
    layer = SimpleNamespace(out_features=4096, in_features=4096, blocksize=64, layout=0)
    assert SCRATCH_BYTES["triton_blockwise4"](layer, 300, cpu) == 0


def test_triton_blockwise4_scratch_covers_every_activation_dtype():
    """A layer learns x's dtype only when called, and fp32 x splits K at M <= 2 where 16-bit x takes the
    unsplit CUDA-core GEMV: the declared need is the dearest dtype's (it was fp16's, 0 bytes, and the
    fp32 call allocated its accumulator per call)."""
    from types import SimpleNamespace

    from qops.ops.triton import blockwise4 as tbw4
    from qops.workspace import SCRATCH_BYTES

    cpu = torch.device("cpu")
    layer = SimpleNamespace(out_features=64, in_features=8192, blocksize=64, layout=0)
    for m in (1, 2):
        assert tbw4.plan(m, 64, 8192, 64, cpu, torch.float16)["split"] == 1
        assert tbw4.plan(m, 64, 8192, 64, cpu, torch.float32)["split"] > 1
        assert SCRATCH_BYTES["triton_blockwise4"](layer, m, cpu) == 4 * m * 64


# ---------------------------------------------------------------- bitsandbytes as a second oracle


@needs_bnb
def test_codebooks_and_dynamic_map_equal_bitsandbytes():
    import bitsandbytes.functional as F

    assert torch.equal(bnbfmt.codebook("nf4"), F.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(bnbfmt.codebook("fp4"), F.get_4bit_type("fp4", device="cpu"))
    assert torch.equal(dynamic_map(), F.create_dynamic_map())


@needs_bnb
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 256, 4096])
@pytest.mark.parametrize("nested", [True, False])
def test_bitsandbytes_checkpoints_load_unchanged(quant_type, blocksize, nested):
    import bitsandbytes.functional as F

    gen = torch.Generator().manual_seed(blocksize)
    w = torch.randn(40, 200, generator=gen).to(torch.bfloat16)
    q, st = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)
    state = {"weight": q, **{f"weight.{k}": v for k, v in st.as_dict(packed=True).items()}}
    fmt = FORMATS[f"bitsandbytes-{quant_type}"]
    c = fmt.from_state_dict(state)
    want = F.dequantize_4bit(q, st).double()  # bf16, rounded from the fp32 product
    mine = fmt.dequantize(c)
    assert torch.equal(mine.to(torch.bfloat16).double(), want)
    assert C.rel_err(C.bnb4(state, quant_type), mine.double()) < 1e-7
    back = fmt.to_state_dict(c)
    assert all(torch.equal(back[key], state[key]) for key in state)
    # qops' quantizer writes what bitsandbytes writes (nested absmax: nearest-code ties may differ by one).
    mine_state = fmt.to_state_dict(fmt.quantize(w, group_size=blocksize, nested=nested))
    assert set(mine_state) == set(state)
    for key in state:
        if key == "weight.absmax" and nested:
            assert (mine_state[key].int() - state[key].int()).abs().max() <= 1
        else:
            assert torch.equal(mine_state[key], state[key]), key
    # and bitsandbytes reads qops' state dict back.
    stats = {k[len("weight."):]: v for k, v in mine_state.items() if k != "weight"}
    st2 = F.QuantState.from_dict(stats, device=torch.device("cpu"))
    assert C.rel_err(F.dequantize_4bit(mine_state["weight"], st2).double(), fmt.dequantize(fmt.from_state_dict(mine_state)).double()) < 1e-2


@needs_bnb
def test_bitsandbytes_modules_state_dicts():
    import bitsandbytes as bnb

    # K a multiple of the blocksize: bitsandbytes 0.50.2's CPU dequantizer (not its quantizer, not
    # the format) misplaces blocks for some other shapes, e.g. 64x96 at blocksize 64.
    w = torch.randn(64, 128, dtype=torch.float16, generator=torch.Generator().manual_seed(0))
    lin4 = bnb.nn.Linear4bit(128, 64, bias=True, compress_statistics=True, quant_type="nf4")
    lin4.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True)
    lin4 = lin4.to("cpu")
    sd = lin4.state_dict()
    c = FORMATS["bitsandbytes-nf4"].from_state_dict(sd)
    assert torch.equal(c.bias, sd["bias"])
    import bitsandbytes.functional as F

    want = F.dequantize_4bit(lin4.weight.data, lin4.weight.quant_state).double()
    assert torch.equal(FORMATS["bitsandbytes-nf4"].dequantize(c).half().double(), want)

    lin8 = bnb.nn.Linear8bitLt(128, 64, bias=True, has_fp16_weights=False)
    lin8.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    sd8 = lin8.to("cpu").state_dict()
    c8 = FORMATS["bitsandbytes-int8"].from_state_dict(sd8)
    assert C.rel_err(FORMATS["bitsandbytes-int8"].dequantize(c8), C.bnb_int8(sd8["weight"], sd8["SCB"])) < 1e-7
    assert C.rel_err(C.bnb_int8(sd8["weight"], sd8["SCB"]), w.double()) < 1e-2
    mine = FORMATS["bitsandbytes-int8"].quantize(w.float())
    assert torch.equal(mine.weight, sd8["weight"]) and torch.allclose(mine.SCB, sd8["SCB"])


@pytest.mark.interpreter
@needs_triton
def test_probe_nf4_bw_dry_run(tmp_path, monkeypatch):
    """benchmarks/probe_nf4_bw.py under the interpreter: its load-only kernels read every weight byte
    once with the GEMV's plan (the script asserts their sums), and it writes a row per kernel."""
    import json
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import probe_nf4_bw

    out = tmp_path / "p.json"
    assert probe_nf4_bw.main(["--dry-run", "--trials", "1", "--shapes", "128x512", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["op", "loads", "loads+absmax"]
    assert rows[1]["plan"]["STEP"] == 32 and rows[1]["plan"]["grid"][1] == rows[1]["plan"]["split"]
