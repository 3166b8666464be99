"""Bad inputs fail with a message naming the argument and what it must be: eagerly, under fake
tensors and under torch.compile(fullgraph=True). Then the chooser's refusals and its switch."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qops
from qops.formats import FORMATS
from qops.formats.integer import act_order_g_idx
from qops.lowerings import DISABLE_ENV, LOWERINGS, NoLoweringError, WeightSpec, choose, disabled_lowerings

from tests import bnb_cases
from tests.int_weight_cases import Case, build, one_thread, random_int_quantized  # noqa: F401  (one_thread: autouse fixture)

MODES = ("eager", "fake", "compile")
# asym act-order 4-bit, K=72 (9 qweight rows), N=24, 3 groups of 32 (the last partial)
CASE = Case("gptq", 4, 32, False, True, "v2", 24, 72)
META = torch.device("meta")


@pytest.fixture(scope="module")
def weight():
    return build(CASE).weight


def mm_args(w, **changes) -> dict:
    args = dict(x=torch.randn(3, w.in_features), qweight=w.qweight, scales=w.scales, qzeros=w.qzeros,
                act_perm=w.act_perm, bias=torch.randn(w.out_features), in_features=w.in_features, bits=w.bits, group_size=w.group_size,
                zero_offset=w.zero_offset, kernel=int(w.kernel))
    args.update(changes)
    return args


def run(op, args: dict, mode: str):
    values = list(args.values())
    if mode == "eager":
        return op(*values)
    if mode == "fake":
        with FakeTensorMode() as m:
            fakes = [m.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
            return op(*fakes)
    torch._dynamo.reset()
    return torch.compile(lambda *a: op(*a), fullgraph=True, backend="eager")(*values)


def expect_error(op, args: dict, mode: str, pattern: str, exc=(TypeError, ValueError)):
    """The op fails with ``pattern`` in its message; under compile Dynamo wraps it, keeping the text."""
    with pytest.raises(Exception) as info:
        run(op, args, mode)
    assert re.search(pattern, str(info.value)), f"{mode}: {pattern!r} not in {str(info.value)[:2000]!r}"
    if mode != "compile":
        assert isinstance(info.value, exc), type(info.value)


def _bad_mm_inputs(w):
    k, n = w.in_features, w.out_features
    return {
        # dtypes
        "x-float64": (dict(x=torch.randn(3, k, dtype=torch.float64)), r"x must be float32, float16 or bfloat16, got torch.float64"),
        "x-int32": (dict(x=torch.ones(3, k, dtype=torch.int32)), r"x must be float32, float16 or bfloat16, got torch.int32"),
        "qweight-int64": (dict(qweight=w.qweight.long()), r"qweight must be torch.int32, got torch.int64"),
        "qweight-uint8": (dict(qweight=w.qweight.to(torch.uint8)), r"qweight must be torch.int32, got torch.uint8"),
        "scales-float64": (dict(scales=w.scales.double()), r"scales must be float32, float16 or bfloat16, got torch.float64"),
        "scales-int32": (dict(scales=w.scales.int()), r"scales must be float32, float16 or bfloat16, got torch.int32"),
        "qzeros-int64": (dict(qzeros=w.qzeros.long()), r"qzeros must be torch.int32, got torch.int64"),
        "act_perm-float": (dict(act_perm=w.act_perm.float()), r"act_perm must be int32 or int64, got torch.float32"),
        "bias-float64": (dict(bias=torch.randn(n, dtype=torch.float64)), r"bias must be float32, float16 or bfloat16, got torch.float64"),
        "bias-int64": (dict(bias=torch.ones(n, dtype=torch.int64)), r"bias must be float32, float16 or bfloat16, got torch.int64"),
        # devices: "meta" stands in for a second device on a CPU-only machine
        "qweight-meta": (dict(qweight=w.qweight.to(META)), r"qweight must be on cpu \(the device of x\), got meta"),
        "scales-meta": (dict(scales=w.scales.to(META)), r"scales must be on cpu \(the device of x\), got meta"),
        "qzeros-meta": (dict(qzeros=w.qzeros.to(META)), r"qzeros must be on cpu \(the device of x\), got meta"),
        "act_perm-meta": (dict(act_perm=w.act_perm.to(META)), r"act_perm must be on cpu \(the device of x\), got meta"),
        "bias-meta": (dict(bias=torch.randn(n, device=META)), r"bias must be on cpu \(the device of x\), got meta"),
        "x-meta": (dict(x=torch.randn(3, k, device=META)), r"qweight must be on meta \(the device of x\), got cpu"),
        # shapes
        "K-misaligned": (dict(x=torch.randn(3, k - 8), in_features=k - 8), r"qweight must have 8 word rows \(ceil\(K\*bits/32\) with K=64, bits=4\), got 9"),
        "K-too-large": (dict(x=torch.randn(3, k + 8), in_features=k + 8), r"qweight must have 10 word rows \(ceil\(K\*bits/32\) with K=80, bits=4\), got 9"),
        # 71 features pack into the same 9 rows as 72: only in_features tells them apart.
        "x-K-within-a-word": (dict(x=torch.randn(3, k - 1)), r"x must have in_features=72 in its last dimension, got shape \(3, 71\)"),
        "x-K-vs-in_features": (dict(x=torch.randn(3, k + 8)), r"x must have in_features=72 in its last dimension, got shape \(3, 80\)"),
        "qweight-1d": (dict(qweight=w.qweight.flatten()), r"qweight must be 2-D \(ceil\(K\*bits/32\), N\) or column slabs \(N/32, ceil\(K\*bits/32\), 32\), got 1-D"),
        "scales-groups": (dict(scales=w.scales[:2]), r"scales must have shape \(3, 24\) .*got \(2, 24\)"),
        "scales-N": (dict(scales=torch.cat([w.scales, w.scales[:, :1]], 1)), r"scales must have shape \(3, 24\) .*got \(3, 25\)"),
        "qzeros-shape": (dict(qzeros=w.qzeros[:, :2]), r"qzeros must have shape \(3, 3\) .*got \(3, 2\)"),
        "act_perm-length": (dict(act_perm=w.act_perm[:-1]), r"act_perm must have shape \(72,\) \(K\), got \(71,\)"),
        "bias-shape": (dict(bias=torch.randn(n + 1)), r"bias must have shape \(24,\) \(N\), got \(25,\)"),
        "x-0d": (dict(x=torch.tensor(1.0)), r"x must have at least one dimension"),
        # static arguments
        "bits-5": (dict(bits=5), r"bits must be one of \[2, 3, 4, 8\], got 5"),
        "group_size-0": (dict(group_size=0), r"group_size must be -1 or positive, got 0"),
        "group_size-neg": (dict(group_size=-2), r"group_size must be -1 or positive, got -2"),
        "zero_offset-2": (dict(zero_offset=2), r"zero_offset must be 0 or 1, got 2"),
        "kernel-unknown": (dict(kernel=97), r"kernel must be one of \[[0-9, ]+\] for int_weight, got 97"),
        "kernel-negative": (dict(kernel=-1), r"kernel must be one of \[[0-9, ]+\] for int_weight, got -1"),
        "kernel-cuda-only": (dict(kernel=int(qops.Kernel.TRITON)),
                             r"kernel=1 \(triton_int_weight\) runs on \['cuda'\], but the inputs are on cpu"),
    }


BAD_MM = sorted(_bad_mm_inputs(build(CASE).weight))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", BAD_MM)
def test_mm_int_weight_bad_input(weight, bad, mode):
    changes, pattern = _bad_mm_inputs(weight)[bad]
    expect_error(torch.ops.qops.mm_int_weight, mm_args(weight, **changes), mode, pattern)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["qweight-int64", "K-misaligned", "bits-5", "kernel-unknown", "kernel-cuda-only", "bias-meta"])
def test_mm_int_weight_out_bad_input(weight, bad, mode):
    changes, pattern = _bad_mm_inputs(weight)[bad]
    args = mm_args(weight, **changes)
    m = args["x"].shape[0]
    args.update(out=torch.empty(m, weight.out_features), workspace=None)
    expect_error(torch.ops.qops.mm_int_weight_out, args, mode, pattern)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "out,pattern",
    [
        (torch.empty(3, 24, dtype=torch.float16), r"out must have the dtype of x \(torch.float32\), got torch.float16"),
        (torch.empty(3, 25), r"out must have shape \(3, 24\), got \(3, 25\)"),
        (torch.empty(3, 1, 24), r"out must have shape \(3, 24\), got \(3, 1, 24\)"),
        (torch.empty(3, 24, device=META), r"out must be on cpu \(the device of x\), got meta"),
    ],
    ids=["dtype", "shape", "rank", "device"],
)
def test_mm_int_weight_out_bad_out(weight, out, pattern, mode):
    args = mm_args(weight)
    args.update(out=out, workspace=None)
    expect_error(torch.ops.qops.mm_int_weight_out, args, mode, pattern)


def swiglu_args(w, **changes) -> dict:
    """``mm_int_weight_swiglu``'s arguments: ``mm_int_weight``'s without the bias."""
    args = mm_args(w, **changes)
    del args["bias"]
    return args


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["x-float64", "qweight-int64", "scales-meta", "K-misaligned", "act_perm-length", "bits-5", "kernel-unknown",
                                 "kernel-cuda-only"])
def test_mm_int_weight_swiglu_bad_input(weight, bad, mode):
    changes, pattern = _bad_mm_inputs(weight)[bad]
    expect_error(torch.ops.qops.mm_int_weight_swiglu, swiglu_args(weight, **changes), mode, pattern)


@pytest.mark.parametrize("mode", MODES)
def test_mm_int_weight_swiglu_needs_an_even_n(mode):
    odd = build(Case("gptq", 4, 32, False, False, "v2", 23, 72)).weight
    expect_error(torch.ops.qops.mm_int_weight_swiglu, swiglu_args(odd), mode,
                 r"mm_int_weight_swiglu: qweight must have an even N \(gate columns, then as many up columns\), got N=23")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out,pattern", [
    (torch.empty(3, 24), r"out must have shape \(3, 12\), got \(3, 24\)"),
    (torch.empty(3, 12, dtype=torch.bfloat16), r"out must have the dtype of x \(torch.float32\), got torch.bfloat16"),
], ids=["full-width", "dtype"])
def test_mm_int_weight_swiglu_out_bad_out(weight, out, pattern, mode):
    args = swiglu_args(weight)
    args.update(out=out, workspace=None)
    expect_error(torch.ops.qops.mm_int_weight_swiglu_out, args, mode, pattern)


def _deq_args(w, **changes):
    args = dict(qweight=w.qweight, scales=w.scales, qzeros=w.qzeros, act_perm=w.act_perm, in_features=w.in_features,
                bits=w.bits, group_size=w.group_size, zero_offset=w.zero_offset, dtype=torch.float32)
    args.update(changes)
    return args


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(in_features=80), r"qweight must have 10 word rows \(ceil\(K\*bits/32\) with K=80, bits=4\), got 9"),
        (dict(bits=5), r"bits must be one of \[2, 3, 4, 8\], got 5"),
        (dict(group_size=0), r"group_size must be -1 or positive, got 0"),
        (dict(zero_offset=2), r"zero_offset must be 0 or 1, got 2"),
        (dict(scales=torch.ones(3, 24, dtype=torch.float64)), r"scales must be float32, float16 or bfloat16, got torch.float64"),
        (dict(act_perm=torch.arange(72.0)), r"act_perm must be int32 or int64, got torch.float32"),
        (dict(qzeros=torch.zeros(3, 3, dtype=torch.int32, device=META)), r"qzeros must be on cpu \(the device of x\), got meta"),
        (dict(in_features=-1), r"dequantize_int_weight: in_features must be >= 0, got -1"),
        (dict(dtype=torch.int32), r"dequantize_int_weight: dtype must be one of .*got torch.int32"),
    ],
    ids=["K", "bits", "group_size", "zero_offset", "scales-dtype", "act_perm-dtype", "qzeros-device", "K-negative", "dtype-int"],
)
def test_dequantize_int_weight_bad_input(weight, changes, pattern, mode):
    expect_error(torch.ops.qops.dequantize_int_weight, _deq_args(weight, **changes), mode, pattern)


def test_meta_tensors_still_infer_shapes(weight):
    # Real "meta" tensors (a model built on the meta device) run the fake kernel: shapes, no device refusal.
    args = mm_args(weight)
    meta = {k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    y = torch.ops.qops.mm_int_weight(*meta.values())
    assert y.device == META and y.shape == (3, 24)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_intweight_mm_checks_in_features(weight, mode):
    # 71 features pack into the same 9 qweight rows as 72: only the prepared weight knows K.
    x = torch.randn(3, weight.in_features - 1)
    fn = weight.mm if mode == "eager" else torch.compile(weight.mm, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"x must have in_features=72 in its last dimension, got shape \(3, 71\)"):
        fn(x)


def test_inconsistent_g_idx_at_prepare():
    gen = torch.Generator().manual_seed(0)
    gptq = FORMATS["gptq"]
    iq = random_int_quantized(CASE, gen)
    g = iq.g_idx.clone()
    g[g == 0] = 1  # group 0 empty, group 1 twice as large
    iq.g_idx = g
    ckpt = gptq.pack(iq, version="v2")
    with pytest.raises(ValueError, match=r"g_idx: each group must hold group_size=32 rows .*got group sizes \[0, 64, 8\]"):
        gptq.prepare(ckpt)
    iq.g_idx = torch.where(g == 2, torch.full_like(g, 3), g)
    with pytest.raises(ValueError, match=r"g_idx: values must lie in \[0, 3\)"):
        gptq.prepare(gptq.pack(iq, version="v2"))
    iq.g_idx = torch.where(g == 2, torch.full_like(g, -1), g)
    with pytest.raises(ValueError, match=r"g_idx: values must lie in \[0, 3\)"):
        gptq.prepare(gptq.pack(iq, version="v2"))


@pytest.mark.parametrize("bad", [7, -1])
@pytest.mark.parametrize("fmt, field", [("gptq", "g_idx"), ("compressed-tensors", "weight_g_idx")])
def test_g_idx_outside_the_groups_at_unpack(fmt, field, bad):
    # The reference path (unpack, dequantize) reads g_idx's values; before, a group that does not
    # exist passed unpack and crashed in dequantize's index_select.
    g_idx = act_order_g_idx(96, 32, torch.Generator().manual_seed(0))
    c = FORMATS[fmt].quantize(torch.randn(24, 96, generator=torch.Generator().manual_seed(1)), bits=4, group_size=32, sym=True, g_idx=g_idx)
    bad_g_idx = getattr(c, field).clone()
    bad_g_idx[5] = bad
    bad_c = dataclasses.replace(c, **{field: bad_g_idx})
    for read in (FORMATS[fmt].unpack, FORMATS[fmt].dequantize):
        with pytest.raises(ValueError, match=rf"{fmt}: {field}: values must lie in \[0, 3\) .*got {min(bad, 0)}\.\.{max(bad, 2)}"):
            read(bad_c)


def test_zeros_wider_than_bits_at_prepare():
    gen = torch.Generator().manual_seed(1)
    iq = random_int_quantized(Case("gptq", 4, 32, False, False, "v2", 24, 72), gen)
    iq.zeros[0, 0], iq.zeros[0, 1] = 0, 16  # needs 5 bits whatever the offset
    with pytest.raises(ValueError, match=r"zeros: values span more than 4 bits \(0\.\.16\)"):
        qops.prepare_int_weight(iq)


# The chooser


def _spec(**changes) -> WeightSpec:
    base = dict(family="int_weight", format="gptq", bits=4, group_size=128, n=4096, k=4096, act_order=False,
                symmetric=True, device=torch.device("cpu"), act_dtype=torch.float16)
    base.update(changes)
    return WeightSpec(**base)


def _family_lowerings(family="int_weight"):
    return [low for low in LOWERINGS if low.family == family]


def test_choose_on_cpu_reports_every_refusal(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    choice = choose(_spec())
    assert choice.lowering.name == "reference_int_weight"
    refused = dict(choice.refusals)
    higher = [low.name for low in _family_lowerings() if low.priority > choice.lowering.priority]
    assert sorted(higher) == sorted(refused), "every higher-priority lowering of the family says why it was refused, no other"
    assert "cuda" in refused["triton_int_weight"]
    text = choice.explain()
    assert text.startswith("chose reference_int_weight")
    for name, why in refused.items():
        assert f"refused {name}: {why}" in text


@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(bits=5), r"reference_int_weight: bits=5 not in \[2, 3, 4, 8\]"),
        (dict(format="marlin"), r"reference_int_weight: format marlin not in \['awq', 'compressed-tensors', 'gptq'\]"),
        (dict(act_dtype=torch.float64), r"reference_int_weight: activation dtype torch.float64 not in"),
        (dict(family="no_such_family"), r"no lowering serves op family 'no_such_family'; families: \['blockwise4', 'fp8', 'int8_weight', 'int_weight'\]"),
        (dict(device=META), r"reference_int_weight: runs on \['cpu', 'cuda'\], not meta"),
    ],
    ids=["bits", "format", "act_dtype", "family", "device"],
)
def test_choose_fails_listing_every_reason(monkeypatch, changes, pattern):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    spec = _spec(**changes)
    with pytest.raises(NoLoweringError, match=pattern) as info:
        choose(spec)
    for low in LOWERINGS:
        named = f"{low.name}: " in str(info.value)
        assert named == (low.family == spec.family), f"{low.name} {'missing from' if not named else 'of another family in'} {info.value}"


def test_disable_env_removes_named_lowerings(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, " triton_int_weight , reference_int_weight,")
    assert disabled_lowerings() == {"triton_int_weight", "reference_int_weight"}
    with pytest.raises(NoLoweringError, match=r"reference_int_weight: disabled by QOPS_DISABLE_LOWERINGS"):
        choose(_spec())
    with pytest.raises(NoLoweringError, match=r"triton_int_weight: disabled by QOPS_DISABLE_LOWERINGS"):
        build(CASE)
    monkeypatch.setenv(DISABLE_ENV, "triton_int_weight")
    choice = choose(_spec())
    assert choice.lowering.name == "reference_int_weight"
    assert dict(choice.refusals)["triton_int_weight"] == "disabled by QOPS_DISABLE_LOWERINGS"


def test_disable_env_unknown_name_lists_known(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "triton_int_weight,no_such_lowering")
    known = sorted(low.name for low in LOWERINGS)
    with pytest.raises(ValueError, match=re.escape(f"{DISABLE_ENV} names unknown lowerings ['no_such_lowering']; known: {known}")):
        choose(_spec())
    with pytest.raises(ValueError, match="no_such_lowering"):
        build(CASE)


def test_prepared_weight_records_its_choice(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    w = build(CASE).weight
    assert w.kernel == qops.Kernel.REFERENCE and w.choice.lowering.kernel == w.kernel
    assert w.choice.lowering.name == "reference_int_weight"


def _fp8_out_args(**changes) -> dict:
    from qops.formats.fp8 import quantize_rtn
    from qops.ops.fp8 import prepare_fp8_weight

    w = prepare_fp8_weight(quantize_rtn(torch.randn(24, 64, generator=torch.Generator().manual_seed(0)), "channel", (128, 128)),
                           activations="none")
    args = dict(x=torch.randn(3, 64), weight=w.weight, weight_scale=w.weight_scale, bias=None, block_n=w.block_n, block_k=w.block_k,
                kernel=int(w.kernel), out=torch.empty(3, 24), workspace=torch.empty(128, dtype=torch.uint8))
    args.update(changes)
    return args


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(out=torch.empty(3, 24, dtype=torch.bfloat16)), r"qops\.mm_fp8_weight_out: out must have the dtype of x \(torch.float32\), got torch.bfloat16"),
        (dict(out=torch.empty(3, 1, 24)), r"qops\.mm_fp8_weight_out: out must have shape \(3, 24\), got \(3, 1, 24\)"),
        (dict(x=torch.randn(3, 65)), r"qops\.mm_fp8_weight_out: weight must have K=65 columns"),
        (dict(kernel=1), r"qops\.mm_fp8_weight_out: kernel=1 \(triton_fp8\) runs on \['cuda'\]"),
    ],
    ids=["out-dtype", "out-rank", "K", "kernel-cuda-only"],
)
def test_mm_fp8_weight_out_bad_input(changes, pattern, mode):
    expect_error(torch.ops.qops.mm_fp8_weight_out, _fp8_out_args(**changes), mode, pattern)


# The int8_weight and blockwise4 families' _out ops (their allocating ops' bad inputs are in
# tests/test_bitsandbytes.py): every input check and each check of out, under the _out op's name.
INT8_CASE = bnb_cases.INT8_CASES[0]  # bitsandbytes int8, N=33, K=97
BLOCKWISE4_CASE = bnb_cases.BLOCKWISE4_CASES[0]  # NF4, N=33, K=96, blocksize 64, nested absmax


@pytest.fixture(scope="module")
def int8_weight():
    return bnb_cases.build(INT8_CASE).weight


@pytest.fixture(scope="module")
def blockwise4_weight():
    return bnb_cases.build(BLOCKWISE4_CASE).weight


def _int8_out_args(w, **changes) -> dict:
    n = w.qweight.shape[0]
    args = dict(x=torch.randn(3, w.in_features), qweight=w.qweight, scales=w.scales, bias=torch.randn(n), kernel=int(w.kernel),
                out=torch.empty(3, n), workspace=None)
    args.update(changes)
    return args


def _blockwise4_out_args(w, **changes) -> dict:
    names = ("qweight", "code", "absmax", "nested_code", "nested_absmax", "nested_offset")
    statics = ("out_features", "in_features", "blocksize", "nested_blocksize", "layout")
    args = dict(x=torch.randn(3, w.in_features), **dict(zip(names, w._weight_args())), bias=torch.randn(w.out_features),
                **dict(zip(statics, w._static_args())), kernel=int(w.kernel), out=torch.empty(3, w.out_features), workspace=None)
    args.update(changes)
    return args


def _bad_out(n: int) -> dict:
    """Bad ``out`` buffers for an op whose output is (3, n) float32 (x: (3, K) float32 on the CPU)."""
    return {
        "out-dtype": (dict(out=torch.empty(3, n, dtype=torch.float16)), r"out must have the dtype of x \(torch.float32\), got torch.float16"),
        "out-shape": (dict(out=torch.empty(3, n + 1)), rf"out must have shape \(3, {n}\), got \(3, {n + 1}\)"),
        "out-rank": (dict(out=torch.empty(3, 1, n)), rf"out must have shape \(3, {n}\), got \(3, 1, {n}\)"),
        "out-device": (dict(out=torch.empty(3, n, device=META)), r"out must be on cpu \(the device of x\), got meta"),
    }


def _bad_workspace() -> dict:
    """Bad ``workspace`` buffers for an ``_out`` op called with x (3, K) float32 on the CPU. Misalignment
    is eager only: a FakeTensor has no address, and under torch.compile the op may be handed a copy."""
    return {
        "workspace-device": (dict(workspace=torch.empty(256, dtype=torch.uint8, device=META)),
                             r"workspace must be on cpu \(the device of x\), got meta"),
        "workspace-float32": (dict(workspace=torch.empty(64)), r"workspace must be torch.uint8 \(bytes\), got torch.float32"),
        "workspace-2d": (dict(workspace=torch.empty(16, 16, dtype=torch.uint8)), r"workspace must be 1-D and contiguous, got shape \(16, 16\)"),
        "workspace-strided": (dict(workspace=torch.empty(512, dtype=torch.uint8)[::2]),
                              r"workspace must be 1-D and contiguous, got shape \(256,\) strides \(2,\)"),
    }


def _bad_int8_out_inputs(w) -> dict:
    k, n = w.in_features, w.qweight.shape[0]
    return {
        "x-float64": (dict(x=torch.randn(3, k, dtype=torch.float64)), r"x must be float32, float16 or bfloat16, got torch.float64"),
        "qweight-int16": (dict(qweight=w.qweight.to(torch.int16)), r"qweight must be torch.int8, got torch.int16"),
        "qweight-K": (dict(qweight=w.qweight[:, :-1]), rf"qweight must have K={k} columns \(the last dimension of x\), got {k - 1}"),
        "scales-shape": (dict(scales=w.scales[:-1]), rf"scales must have shape \({n},\) \(N from qweight\), got \({n - 1},\)"),
        "scales-int32": (dict(scales=w.scales.int()), r"scales must be float32, float16 or bfloat16, got torch.int32"),
        "bias-shape": (dict(bias=torch.randn(n + 1)), rf"bias must have shape \({n},\) \(N\), got \({n + 1},\)"),
        "qweight-meta": (dict(qweight=w.qweight.to(META)), r"qweight must be on cpu \(the device of x\), got meta"),
        "scales-meta": (dict(scales=w.scales.to(META)), r"scales must be on cpu \(the device of x\), got meta"),
        "bias-meta": (dict(bias=torch.randn(n, device=META)), r"bias must be on cpu \(the device of x\), got meta"),
        "x-meta": (dict(x=torch.randn(3, k, device=META), out=torch.empty(3, n, device=META)), r"qweight must be on meta \(the device of x\), got cpu"),
        "kernel-unknown": (dict(kernel=97), r"kernel must be one of \[[0-9, ]+\] for int8_weight, got 97"),
        "kernel-cuda-only": (dict(kernel=int(qops.Kernel.TRITON)), r"kernel=1 \(triton_int8_weight\) runs on \['cuda'\], but the inputs are on cpu"),
        **_bad_out(n),
        **_bad_workspace(),
    }


def _bad_blockwise4_out_inputs(w) -> dict:
    k, n = w.in_features, w.out_features
    tensors = {name: t for name, t in zip(("qweight", "code", "absmax", "nested_code", "nested_absmax", "nested_offset"), w._weight_args())}
    return {
        "x-K": (dict(x=torch.randn(3, k + 1)), rf"x must have in_features={k} in its last dimension, got shape \(3, {k + 1}\)"),
        "qweight-shape": (dict(qweight=w.qweight[:-1]), rf"qweight must have shape \({n * k // 2},\) .*got \({n * k // 2 - 1},\)"),
        "code-shape": (dict(code=w.code[:8]), r"code must have shape \(16,\), got \(8,\)"),
        "absmax-shape": (dict(absmax=w.absmax[:-1]), r"absmax must have shape \(50,\) .*got \(49,\)"),
        "absmax-float16": (dict(absmax=w.absmax.half()), r"absmax must be torch.float32 \(plain\) or torch.uint8 \(nested\), got torch.float16"),
        "nested_offset-missing": (dict(nested_offset=None), r"nested_offset is required when absmax is uint8 \(nested\)"),
        "bias-shape": (dict(bias=torch.randn(n + 1)), rf"bias must have shape \({n},\) \(N\), got \({n + 1},\)"),
        **{f"{name}-meta": (dict(**{name: t.to(META)}), rf"{name} must be on cpu \(the device of x\), got meta") for name, t in tensors.items()},
        "bias-meta": (dict(bias=torch.randn(n, device=META)), r"bias must be on cpu \(the device of x\), got meta"),
        "x-meta": (dict(x=torch.randn(3, k, device=META), out=torch.empty(3, n, device=META)), r"qweight must be on meta \(the device of x\), got cpu"),
        "layout": (dict(layout=3), r"layout must be one of .*got 3"),
        "kernel-unknown": (dict(kernel=97), r"kernel must be one of \[[0-9, ]+\] for blockwise4, got 97"),
        "kernel-cuda-only": (dict(kernel=int(qops.Kernel.TRITON)), r"kernel=1 \(triton_blockwise4\) runs on \['cuda'\], but the inputs are on cpu"),
        **_bad_out(n),
        **_bad_workspace(),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", sorted(_bad_int8_out_inputs(bnb_cases.build(INT8_CASE).weight)))
def test_mm_int8_weight_out_bad_input(int8_weight, bad, mode):
    changes, pattern = _bad_int8_out_inputs(int8_weight)[bad]
    # Named after the _out op: a message from the allocating op's checks would say mm_int8_weight.
    expect_error(torch.ops.qops.mm_int8_weight_out, _int8_out_args(int8_weight, **changes), mode, "mm_int8_weight_out: " + pattern)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", sorted(_bad_blockwise4_out_inputs(bnb_cases.build(BLOCKWISE4_CASE).weight)))
def test_mm_blockwise4_out_bad_input(blockwise4_weight, bad, mode):
    changes, pattern = _bad_blockwise4_out_inputs(blockwise4_weight)[bad]
    expect_error(torch.ops.qops.mm_blockwise4_out, _blockwise4_out_args(blockwise4_weight, **changes), mode, "mm_blockwise4_out: " + pattern)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", sorted(_bad_workspace()))
@pytest.mark.parametrize("op", ["mm_int_weight_out", "mm_int_weight_swiglu_out", "mm_fp8_weight_out"])
def test_the_other_out_ops_refuse_a_bad_workspace(weight, op, bad, mode):
    changes, pattern = _bad_workspace()[bad]
    if op == "mm_fp8_weight_out":
        args = _fp8_out_args(**changes)
    else:
        args = mm_args(weight) if op == "mm_int_weight_out" else swiglu_args(weight)
        args.update(out=torch.empty(3, weight.out_features // (2 if "swiglu" in op else 1)), **changes)
    expect_error(getattr(torch.ops.qops, op), args, mode, f"{op}: " + pattern)


def _out_args_of(op: str, weights: dict, **changes) -> dict:
    if op == "mm_int_weight_out":
        return {**mm_args(weights["int"]), "out": torch.empty(3, weights["int"].out_features), "workspace": None, **changes}
    if op == "mm_int_weight_swiglu_out":
        return {**swiglu_args(weights["int"]), "out": torch.empty(3, weights["int"].out_features // 2), "workspace": None, **changes}
    if op == "mm_fp8_weight_out":
        return _fp8_out_args(**changes)
    if op == "mm_int8_weight_out":
        return _int8_out_args(weights["int8"], **changes)
    return _blockwise4_out_args(weights["blockwise4"], **changes)


OUT_OPS = ("mm_int_weight_out", "mm_int_weight_swiglu_out", "mm_fp8_weight_out", "mm_int8_weight_out", "mm_blockwise4_out")


@pytest.mark.parametrize("op", OUT_OPS)
def test_out_ops_refuse_a_misaligned_workspace_and_take_an_aligned_slice(weight, int8_weight, blockwise4_weight, op):
    """Eager: a slice 4 bytes into a buffer is refused, naming the offset; one 16 bytes in is taken and the
    result is the same as with no workspace."""
    weights = dict(int=weight, int8=int8_weight, blockwise4=blockwise4_weight)
    buffer = torch.empty(4096 + 16, dtype=torch.uint8)
    expect_error(getattr(torch.ops.qops, op), _out_args_of(op, weights, workspace=buffer[4:4 + 4096]), "eager",
                 rf"{op}: workspace must start at a 16-byte aligned address, got one 4 bytes past it")
    given = _out_args_of(op, weights, workspace=buffer[16:])
    own = {**given, "out": torch.empty_like(given["out"]), "workspace": None}
    getattr(torch.ops.qops, op)(*given.values())
    getattr(torch.ops.qops, op)(*own.values())
    torch.testing.assert_close(given["out"], own["out"], rtol=0, atol=0)


def _fake_cuda(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("what", ["native-bits-3", "triton-int-fp32-x", "triton-blockwise4-blocksize-48", "triton-fp8-block_k-48"])
def test_a_named_kernel_refuses_a_call_it_does_not_serve_under_fake_cuda_tensors(what):
    """An op called with a ``kernel`` whose declared capabilities exclude the call (the chooser would
    never pick it) fails at trace time with the capability it misses, instead of running a kernel
    that assumes it (a wrong answer) or quietly handing the call to another lowering."""
    k, n = 256, 64
    with FakeTensorMode():
        if what == "native-bits-3":
            args = (_fake_cuda(2, k), _fake_cuda(k * 3 // 32, n, dtype=torch.int32), _fake_cuda(1, n), None, None, None,
                    k, 3, -1, 0, int(qops.Kernel.NATIVE))
            op, pattern = torch.ops.qops.mm_int_weight, r"mm_int_weight: kernel=2 \(native_w4a16\) does not serve this call: bits=3 not in \[4\]"
        elif what == "triton-int-fp32-x":
            args = (_fake_cuda(2, k, dtype=torch.float32), _fake_cuda(k // 8, n, dtype=torch.int32), _fake_cuda(2, n), None, None, None,
                    k, 4, 128, 0, int(qops.Kernel.TRITON))
            op, pattern = torch.ops.qops.mm_int_weight, r"kernel=1 \(triton_int_weight\) does not serve this call: activation dtype torch.float32 not in"
        elif what == "triton-fp8-block_k-48":
            args = (_fake_cuda(2, k), _fake_cuda(n, k, dtype=torch.float8_e4m3fn), _fake_cuda(n, -(-k // 48), dtype=torch.float32),
                    None, 1, 48, int(qops.Kernel.TRITON))
            op, pattern = torch.ops.qops.mm_fp8_weight, r"mm_fp8_weight: kernel=1 \(triton_fp8\) does not serve this call: group_size=48 not in"
        else:
            args = (_fake_cuda(2, k), _fake_cuda(n * k // 2, dtype=torch.uint8), _fake_cuda(16, dtype=torch.float32),
                    _fake_cuda(n * k // 48 + 1, dtype=torch.float32), None, None, None, None, n, k, 48, 256, 0, int(qops.Kernel.TRITON))
            op, pattern = torch.ops.qops.mm_blockwise4, r"mm_blockwise4: kernel=1 \(triton_blockwise4\) does not serve this call: group_size=48 not in"
        with pytest.raises(ValueError, match=pattern):
            op(*args)
