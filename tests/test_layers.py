"""The layer API in one process: get_linear over the LoRAX/TGI quantize strings, the typed API over
every registered checkpoint type, the buffers the modules hold, chunked preparation and act-order
row shards."""
import dataclasses
import fnmatch

import pytest
import torch

import qops  # noqa: F401
from qops.formats import FORMATS
from qops.formats.awq import AWQCheckpoint
from qops.formats.bitsandbytes import Bnb4bitCheckpoint, BnbInt8Checkpoint
from qops.formats.compressed_tensors import CompressedTensorsCheckpoint
from qops.formats.eetq import EETQCheckpoint
from qops.formats.fp8 import FP8_DTYPE, Fp8BlockCheckpoint, Fp8Checkpoint
from qops.formats.gptq import GPTQCheckpoint
from qops.formats.integer import act_order_g_idx
from qops.layers import (
    CHECKPOINT_LINEARS,
    LINEAR_METHODS,
    FastLinear,
    InputPadded,
    IntWeightLinear,
    QuantLinear,
    WeightsError,
    get_linear,
)
from qops.layers import act_order
from qops.layers import int_weight as lw
from qops.layers.fp8 import Fp8Linear
from qops.layers.registry import NOT_YET

LORAX_QUANTIZE = [None, "fp8", "fp8-kv", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "gptq", "awq", "hqq-4bit", "hqq-2bit"]
N, K = 64, 96


def _w(n=N, k=K, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def _act(k, g, seed=1):
    return act_order_g_idx(k, g, torch.Generator().manual_seed(seed))


# One checkpoint per registered checkpoint type (a new type without an entry here fails
# test_every_checkpoint_type_has_a_case): checkpoint -> (checkpoint, reference fp32 weight).
CHECKPOINTS = {
    GPTQCheckpoint: lambda: FORMATS["gptq"].quantize(_w(), bits=4, group_size=32, sym=False, g_idx=_act(K, 32), version="v1"),
    AWQCheckpoint: lambda: FORMATS["awq"].quantize(_w(), bits=4, group_size=32),
    CompressedTensorsCheckpoint: lambda: FORMATS["compressed-tensors"].quantize(_w(), bits=8, group_size=-1, sym=False),
    Fp8Checkpoint: lambda: FORMATS["fp8"].quantize(_w(), granularity="channel"),
    Fp8BlockCheckpoint: lambda: FORMATS["fp8-block"].quantize(_w(), block_size=(32, 32)),
    EETQCheckpoint: lambda: FORMATS["eetq"].quantize(_w(64, 128)),  # the ampere order needs multiples of 64
    BnbInt8Checkpoint: lambda: FORMATS["bitsandbytes-int8"].quantize(_w()),
    Bnb4bitCheckpoint: lambda: FORMATS["bitsandbytes-nf4"].quantize(_w(), group_size=64, nested=True),
}
FORMAT_OF = {GPTQCheckpoint: "gptq", AWQCheckpoint: "awq", CompressedTensorsCheckpoint: "compressed-tensors",
             Fp8Checkpoint: "fp8", Fp8BlockCheckpoint: "fp8-block", EETQCheckpoint: "eetq", BnbInt8Checkpoint: "bitsandbytes-int8",
             Bnb4bitCheckpoint: "bitsandbytes-nf4"}


def test_every_checkpoint_type_has_a_case():
    assert set(CHECKPOINTS) == set(CHECKPOINT_LINEARS)


@pytest.mark.parametrize("quantize", LORAX_QUANTIZE, ids=str)
def test_every_lorax_quantize_string_is_served_or_refused_with_the_supported_list(quantize):
    if quantize in LINEAR_METHODS:
        assert LINEAR_METHODS[quantize].quantize == quantize
        return
    assert any(fnmatch.fnmatchcase(quantize, p) for p in NOT_YET)
    with pytest.raises(NotImplementedError) as e:
        get_linear(torch.zeros(4, 4), None, quantize)
    for q in LINEAR_METHODS:
        assert repr(q) in str(e.value)


def test_unknown_quantize_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"unknown quantize='int3'.*supported: \[None, 'awq'"):
        get_linear(torch.zeros(4, 4), None, "int3")


def test_fast_linear_and_fan_in_fan_out():
    w, b, x = _w(), torch.randn(N), torch.randn(3, K)
    lin = get_linear(w, b, None)
    assert isinstance(lin, FastLinear) and torch.equal(lin(x), torch.nn.functional.linear(x, w, b))
    conv1d = get_linear(w.t().contiguous(), b, None, fan_in_fan_out=True)  # Conv1D stores (K, N)
    torch.testing.assert_close(conv1d(x), lin(x))
    assert not lin.weight.requires_grad


@pytest.mark.parametrize("ctype", list(CHECKPOINTS), ids=lambda t: t.__name__)
def test_from_checkpoint_is_the_reference_dequantization(ctype):
    c = CHECKPOINTS[ctype]()
    ref = FORMATS[FORMAT_OF[ctype]].dequantize(c)
    n, k = ref.shape
    lin = QuantLinear.from_checkpoint(c, dtype=torch.float32)
    # One-hot activations make the matmul return the dequantized weight exactly.
    assert torch.equal(lin(torch.eye(k)), ref.t())
    bias = torch.randn(n)
    x = torch.randn(5, k)
    with_bias = QuantLinear.from_checkpoint(c, bias, dtype=torch.float32)
    torch.testing.assert_close(with_bias(x), x @ ref.t() + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ctype", list(CHECKPOINTS), ids=lambda t: t.__name__)
def test_forward_swiglu_is_silu_of_the_gate_half_times_the_up_half(ctype):
    # The layer read as a fused [gate; up] projection: first half gate, second half up, in float64
    # from the format's own dequantization; with a bias too (the gated op has none: the layer composes).
    c = CHECKPOINTS[ctype]()
    ref = FORMATS[FORMAT_OF[ctype]].dequantize(c).double()
    n, k = ref.shape
    x = torch.randn(3, 2, k)
    bias = torch.randn(n)
    for b in (None, bias):
        lin = QuantLinear.from_checkpoint(c, b, dtype=torch.float32)
        lin.prepare_swiglu()
        y = x.double() @ ref.t() + (0 if b is None else b.double())
        want = torch.nn.functional.silu(y[..., : n // 2]) * y[..., n // 2:]
        torch.testing.assert_close(lin.forward_swiglu(x).double(), want, rtol=1e-5, atol=1e-5)


def test_column_layer_swiglu_for_dense_and_quantized_layers():
    from qops.layers.tensor_parallel import TensorParallelColumnLinear

    w = _w()
    x = torch.randn(4, K)
    y = x.double() @ w.double().t()
    want = torch.nn.functional.silu(y[:, : N // 2]) * y[:, N // 2:]
    dense = TensorParallelColumnLinear(FastLinear(w))
    dense.prepare_swiglu()
    torch.testing.assert_close(dense.forward_swiglu(x).double(), want, rtol=1e-5, atol=1e-5)
    c = FORMATS["gptq"].quantize(w, bits=8, group_size=32, sym=False)
    q = TensorParallelColumnLinear(QuantLinear.from_checkpoint(c, dtype=torch.float32))
    yq = x.double() @ FORMATS["gptq"].dequantize(c).double().t()
    torch.testing.assert_close(q.forward_swiglu(x).double(), torch.nn.functional.silu(yq[:, : N // 2]) * yq[:, N // 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ctype", list(CHECKPOINTS), ids=lambda t: t.__name__)
def test_modules_hold_the_runtime_layout_as_buffers(ctype):
    c = CHECKPOINTS[ctype]()
    lin = QuantLinear.from_checkpoint(c, dtype=torch.float32)
    n, k = lin.out_features, lin.in_features
    bias = torch.randn(n)
    lin = QuantLinear.from_checkpoint(c, bias, dtype=torch.float32)
    buffers = dict(lin.named_buffers())
    assert "bias" in buffers and not list(lin.parameters())
    # No dense copy of the weight: no floating buffer as large as N*K.
    assert all(not (t.is_floating_point() and t.dtype != FP8_DTYPE and t.numel() >= n * k) for t in buffers.values())
    # forward reads the buffers themselves (what .to() replaces): doubled scales double the output.
    x = torch.randn(2, k)
    before = lin(x) - bias
    for name in ("scales", "weight_scale", "weight_scale_inv", "code"):
        if name in buffers:
            setattr(lin, name, buffers[name] * 2)
    torch.testing.assert_close(lin(x) - bias, 2 * before, rtol=1e-5, atol=1e-5)


def test_gptq_tuple_is_read_as_v1_as_tgi_does():
    v1 = FORMATS["gptq"].quantize(_w(), bits=4, group_size=32, sym=False, version="v1")
    tup = (v1.qweight, v1.qzeros, v1.scales, v1.g_idx, 4, 32, True)
    lin = get_linear(tup, None, "gptq", dtype=torch.float32)
    assert torch.equal(lin(torch.eye(K)), FORMATS["gptq"].dequantize(v1).t())
    # A v2 checkpoint must come typed: as a tuple its zeros would read one too high.
    v2 = FORMATS["gptq"].quantize(_w(), bits=4, group_size=32, sym=False, version="v2")
    typed = get_linear(v2, None, "gptq", dtype=torch.float32)
    assert torch.equal(typed(torch.eye(K)), FORMATS["gptq"].dequantize(v2).t())
    as_tuple = get_linear((v2.qweight, v2.qzeros, v2.scales, v2.g_idx, 4, 32, False), None, "gptq", dtype=torch.float32)
    assert not torch.equal(as_tuple(torch.eye(K)), typed(torch.eye(K)))


def test_awq_tuple():
    c = FORMATS["awq"].quantize(_w(), bits=4, group_size=32)
    lin = get_linear((c.qweight, c.qzeros, c.scales, None, 4, 32, False), None, "awq", dtype=torch.float32)
    assert torch.equal(lin(torch.eye(K)), FORMATS["awq"].dequantize(c).t())


def test_gptq_tuple_row_shard_with_every_group_resolves_act_order_locally():
    # TGI's act-order row shard: the rank's rows in checkpoint order with their g_idx, and the
    # scales/zeros of every group.
    k, g = 256, 32
    c = FORMATS["gptq"].quantize(_w(N, k), bits=4, group_size=g, sym=False, g_idx=_act(k, g), version="v1")
    ref = FORMATS["gptq"].dequantize(c)
    k0, k1 = 128, 256
    tup = (c.qweight[k0 // 8:k1 // 8], c.qzeros, c.scales, c.g_idx[k0:k1], 4, g, False)
    lin = get_linear(tup, None, "gptq", dtype=torch.float32)
    assert lin.act_perm is not None and lin.in_features == k1 - k0
    x = torch.randn(3, k1 - k0)
    torch.testing.assert_close(lin(x), x @ ref[:, k0:k1].t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qzeros_rows", [7, 10])
def test_gptq_tuple_row_shard_needs_the_zeros_of_every_group(qzeros_rows):
    # scales say 8 groups; qzeros with fewer rows crashed in index_select, with more was accepted.
    k, g = 256, 32
    c = FORMATS["gptq"].quantize(_w(N, k), bits=4, group_size=g, sym=False, g_idx=_act(k, g), version="v1")
    qzeros = torch.cat([c.qzeros, c.qzeros])[:qzeros_rows]
    tup = (c.qweight[16:32], qzeros, c.scales, c.g_idx[128:256], 4, g, False)
    with pytest.raises(WeightsError, match=rf"act-order shard: qzeros has {qzeros_rows} group rows along K \(dim 0\), expected 8"):
        get_linear(tup, None, "gptq", dtype=torch.float32)


def test_gptq_tuple_scales_with_a_group_more_than_qzeros_is_refused():
    # One scales row more than K needs reads as a row shard; its qzeros must still match.
    c = FORMATS["gptq"].quantize(_w(), bits=4, group_size=32, sym=False, version="v1")
    tup = (c.qweight, c.qzeros, torch.cat([c.scales, c.scales[-1:]]), c.g_idx, 4, 32, False)
    with pytest.raises(WeightsError, match=r"act-order shard: qzeros has 3 group rows along K \(dim 0\), expected 4"):
        get_linear(tup, None, "gptq", dtype=torch.float32)


def _tuple(quantize, **changes):
    c = FORMATS[quantize].quantize(_w(), bits=4, group_size=32, sym=False)
    t = dict(qweight=c.qweight, qzeros=c.qzeros, scales=c.scales, g_idx=getattr(c, "g_idx", None), bits=4, groupsize=32, use_exllama=False)
    t.update(changes)
    return tuple(t.values())


@pytest.mark.parametrize("quantize, changes, error, match", [
    ("gptq", dict(groupsize=0), ValueError, r"get_linear\(quantize='gptq'\): group_size must be -1 or a positive integer, got 0"),
    ("gptq", dict(bits=0, g_idx=None), ValueError, r"get_linear\(quantize='gptq'\): bits must be one of \[2, 3, 4, 8\], got 0"),
    ("gptq", dict(bits=4.0), TypeError, r"get_linear\(quantize='gptq'\): bits must be an integer, got float 4\.0"),
    ("gptq", dict(qzeros=None), TypeError, r"get_linear\(quantize='gptq'\): qzeros must be a tensor, got NoneType"),
    ("gptq", dict(g_idx=torch.zeros(1, K, dtype=torch.int32)), ValueError, r"get_linear\(quantize='gptq'\): g_idx must be 1-D, got shape \(1, 96\)"),
    ("awq", dict(scales=torch.ones(3 * N, dtype=torch.float16)), ValueError, r"get_linear\(quantize='awq'\): scales must be 2-D, got shape \(192,\)"),
    ("awq", dict(groupsize=32.0), TypeError, r"get_linear\(quantize='awq'\): group_size must be an integer, got float 32\.0"),
], ids=["gptq-groupsize-0", "gptq-bits-0", "gptq-bits-float", "gptq-qzeros-None", "gptq-g_idx-2d", "awq-scales-1d", "awq-groupsize-float"])
def test_tgi_tuples_are_checked_before_their_shapes_are_used(quantize, changes, error, match):
    with pytest.raises(error, match=match):
        get_linear(_tuple(quantize, **changes), None, quantize, dtype=torch.float32)


def test_awq_checkpoint_scales_rank_is_checked_before_n_is_read():
    c = FORMATS["awq"].quantize(_w(), bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"awq: scales must be 2-D, got shape \(192,\)"):
        get_linear(dataclasses.replace(c, scales=c.scales.flatten()), None, "awq", dtype=torch.float32)


@pytest.mark.parametrize("quantize", ["eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_methods_that_quantize_at_load_take_a_floating_weight(quantize):
    w = _w(64, 128)
    fmt = {"eetq": "eetq", "bitsandbytes": "bitsandbytes-int8"}.get(quantize, quantize)
    options = {"eetq": {"layout": "row_major"}, "bitsandbytes": {}}.get(quantize, {"group_size": 64, "nested": True})
    ref = FORMATS[fmt].dequantize(FORMATS[fmt].quantize(w, **options))
    lin = get_linear(w, None, quantize, dtype=torch.float32)
    assert torch.equal(lin(torch.eye(128)), ref.t())
    conv1d = get_linear(w.t().contiguous(), None, quantize, fan_in_fan_out=True, dtype=torch.float32)
    assert torch.equal(conv1d(torch.eye(128)), ref.t())


def test_fp8_get_linear_takes_tgi_weights():
    c = FORMATS["fp8"].quantize(_w(), granularity="tensor", input_scale=0.05)
    lin = get_linear(c.weight, None, "fp8", weight_scale=c.weight_scale, input_scale=c.input_scale, dtype=torch.float32)
    assert isinstance(lin, Fp8Linear)
    assert torch.equal(lin(torch.eye(K)), FORMATS["fp8"].dequantize(c).t())
    kv = get_linear(c.weight, None, "fp8-kv", weight_scale=c.weight_scale, dtype=torch.float32)
    assert torch.equal(kv(torch.eye(K)), lin(torch.eye(K)))
    # A floating weight is quantized here, per channel; fan_in_fan_out transposes it first.
    w = _w()
    q = get_linear(w.t().contiguous(), None, "fp8", fan_in_fan_out=True, dtype=torch.float32)
    assert torch.equal(q(torch.eye(K)), FORMATS["fp8"].dequantize(FORMATS["fp8"].quantize(w, granularity="channel")).t())
    with pytest.raises(ValueError, match="needs its weight_scale"):
        get_linear(c.weight, None, "fp8")


@pytest.mark.parametrize("quantize, weight, kwargs, error, match", [
    ("gptq", torch.zeros(4, 4), {}, TypeError, r"quantize='gptq'\) takes a GPTQCheckpoint"),
    (None, (1, 2), {}, TypeError, r"quantize=None\) takes a dense"),
    ("awq", "awq", {"fan_in_fan_out": True}, ValueError, "fan_in_fan_out=True transposes a dense Conv1D weight"),
    ("awq", "awq", {"weight_scale": torch.ones(1)}, ValueError, "weight_scale and input_scale belong to fp8"),
    ("compressed-tensors", "awq", {}, TypeError, "takes a CompressedTensorsCheckpoint"),
], ids=["gptq-dense", "dense-tuple", "fan_in_fan_out", "weight_scale", "ct-awq"])
def test_get_linear_refuses_weights_of_another_method(quantize, weight, kwargs, error, match):
    if weight == "awq":
        weight = CHECKPOINTS[AWQCheckpoint]()
    with pytest.raises(error, match=match):
        get_linear(weight, None, quantize, **kwargs)


def test_from_checkpoint_refuses_unknown_types():
    with pytest.raises(TypeError, match="known checkpoint types"):
        QuantLinear.from_checkpoint(object())
    with pytest.raises(TypeError, match="expected one of .*got Fp8Checkpoint"):
        IntWeightLinear.from_checkpoint(CHECKPOINTS[Fp8Checkpoint]())


CHUNK_CASES = {
    "gptq-4bit": lambda: FORMATS["gptq"].quantize(_w(200, 128), bits=4, group_size=32, sym=False),
    "gptq-4bit-actorder": lambda: FORMATS["gptq"].quantize(_w(200, 128), bits=4, group_size=32, sym=True, g_idx=_act(128, 32)),
    "gptq-3bit-v1": lambda: FORMATS["gptq"].quantize(_w(200, 128), bits=3, group_size=32, sym=False, version="v1"),
    "awq": lambda: FORMATS["awq"].quantize(_w(200, 128), bits=4, group_size=32),
    "ct-8bit-actorder": lambda: FORMATS["compressed-tensors"].quantize(_w(200, 128), bits=8, group_size=32, sym=False, g_idx=_act(128, 32)),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunked_preparation_is_the_whole_preparation(case, monkeypatch):
    c = CHUNK_CASES[case]()
    fmt = FORMATS[lw.CHECKPOINT_SCHEMES[type(c)](c)[0].format]
    whole = fmt.prepare(c, dtype=torch.float16)
    monkeypatch.setattr(lw, "CHUNK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(lw, "CHUNK_FRACTION", 10**9)  # 32-column chunks: 7 of them, the last partial
    chunked = lw.prepare(c, dtype=torch.float16)
    for name in ("qweight", "scales", "qzeros", "act_perm"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    for name in ("in_features", "out_features", "bits", "group_size", "zero_offset", "kernel"):
        assert getattr(whole, name) == getattr(chunked, name), name
    if case == "gptq-4bit":
        assert chunked.qweight is c.qweight  # already the runtime packing: not copied


def test_chunked_eetq_preparation_is_the_whole_preparation(monkeypatch):
    from qops.layers import int8

    c = FORMATS["eetq"].quantize(_w(320, 128))  # ampere order: 64-column chunks, 5 of them
    whole = FORMATS["eetq"].prepare(c, dtype=torch.float16)
    monkeypatch.setattr(lw, "CHUNK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(lw, "CHUNK_FRACTION", 10**9)
    chunked = int8.prepare_eetq(c, dtype=torch.float16)
    assert torch.equal(chunked.qweight, whole.qweight) and torch.equal(chunked.scales, whole.scales)
    assert (chunked.kernel, chunked.in_features, chunked.out_features) == (whole.kernel, whole.in_features, whole.out_features)


def test_chunked_preparation_falls_back_when_chunks_encode_zeros_differently(monkeypatch):
    # Columns 0..31 symmetric (zero at the midpoint), the rest not: chunk by chunk the zero
    # encodings differ, so the layer is prepared whole.
    iq = FORMATS["gptq"].unpack(FORMATS["gptq"].quantize(_w(64, 64), bits=4, group_size=32, sym=False))
    iq.zeros[:32] = 8
    c = FORMATS["compressed-tensors"].pack(iq, sym=False)
    monkeypatch.setattr(lw, "CHUNK_MIN_ELEMENTS", 1)
    monkeypatch.setattr(lw, "CHUNK_FRACTION", 10**9)
    chunked = lw.prepare(c, dtype=torch.float32)
    whole = FORMATS["compressed-tensors"].prepare(c, dtype=torch.float32)
    assert torch.equal(chunked.qzeros, whole.qzeros) and torch.equal(chunked.qweight, whole.qweight)


def _row_shard(c, k0, k1):
    """GPTQ act-order row shard tensors: local packed rows and g_idx, every group's scales/zeros."""
    return {"qweight": c.qweight[k0 * c.bits // 32:k1 * c.bits // 32], "qzeros": c.qzeros, "scales": c.scales, "g_idx": c.g_idx[k0:k1]}


@pytest.mark.parametrize("bits, world", [(4, 2), (4, 3), (3, 2), (8, 4)])
def test_act_order_row_shards_become_act_order_layers_of_their_own(bits, world):
    k, g = 384, 64
    c = FORMATS["gptq"].quantize(_w(N, k), bits=bits, group_size=g, sym=False, g_idx=_act(k, g), version="v2")
    ref = FORMATS["gptq"].dequantize(c)
    scheme = lw.GPTQScheme(bits, g, "v2")
    total = 0
    x = torch.randn(4, k)
    for r in range(world):
        k0, k1 = r * k // world, (r + 1) * k // world
        t, k_rt, g_new, pad = act_order.localize(_row_shard(c, k0, k1), scheme.layout, k_local=k1 - k0, n_groups=k // g, group_size=g, bits=bits)
        assert k_rt == k1 - k0 + pad and g % g_new == 0
        # Every new group holds exactly g_new rows: a valid act-order layer.
        assert torch.equal(torch.bincount(t["g_idx"].long()), torch.full((k_rt // g_new,), g_new))
        lin = QuantLinear.from_checkpoint(InputPadded(scheme.make(t, k_rt, N, g_new), pad) if pad else scheme.make(t, k_rt, N, g_new), dtype=torch.float32)
        assert lin.act_perm is not None and lin.input_pad == pad
        y = lin(x[:, k0:k1])
        torch.testing.assert_close(y, x[:, k0:k1] @ ref[:, k0:k1].t(), rtol=1e-5, atol=1e-5)
        total = total + y
    torch.testing.assert_close(total, x @ ref.t(), rtol=1e-5, atol=1e-5)


def test_act_order_shards_split_evenly_need_no_padding():
    # Each group's rows split evenly between the two halves of K: G' = G/2 and no padding.
    k, g = 512, 64
    g_idx = torch.empty(k, dtype=torch.int64)
    perm = torch.randperm(k // 2, generator=torch.Generator().manual_seed(3))
    g_idx[: k // 2] = (torch.arange(k // 2) // (g // 2))[perm]
    g_idx[k // 2:] = (torch.arange(k // 2) // (g // 2))[torch.randperm(k // 2, generator=torch.Generator().manual_seed(4))]
    c = FORMATS["gptq"].quantize(_w(N, k), bits=4, group_size=g, sym=True, g_idx=g_idx)
    _, k_rt, g_new, pad = act_order.localize(_row_shard(c, 0, k // 2), lw.GPTQScheme(4, g, "v2").layout, k_local=k // 2, n_groups=k // g, group_size=g, bits=4)
    assert (k_rt, g_new, pad) == (k // 2, g // 2, 0)


def test_act_order_group_size_minimises_runtime_bytes_over_multiples_of_32():
    counts = torch.tensor([64, 64, 60, 70])  # G=128 split over two ranks
    best = act_order.choose_group_size(counts, 128, 4)
    costs = {d: act_order._runtime_bytes_per_column(counts, d, 4)[0] for d in (32, 64, 128)}
    assert costs[best] == min(costs.values())
    assert act_order.choose_group_size(torch.tensor([128, 128]), 128, 4) == 128
    assert act_order.choose_group_size(torch.tensor([9, 7]), 16, 4) == 8  # G < 32: any divisor of G


@pytest.fixture
def static_fp8_activations(monkeypatch):
    """fp8 layers prepared W8A8 with the checkpoint's input_scale, as "auto" prepares them where
    torch._scaled_mm serves (CPU "auto" is W8A16; the reference lowering reads fp8 activations too)."""
    from qops.ops import fp8 as ops_fp8

    prepare = ops_fp8.prepare_fp8_weight
    monkeypatch.setattr(ops_fp8, "prepare_fp8_weight", lambda fq, **kw: prepare(fq, **{**kw, "activations": "static"}))


@pytest.mark.parametrize("world", [2, 3])
def test_static_w8a8_shards_compose_to_the_whole_layer(tmp_path, static_fp8_activations, world):
    # The TP tests run W8A16 on the CPU; this is the W8A8 path of the two-GPU fp8-tensor-static
    # test, in fp32, where sharding may only change the summation order. Input scales differ per
    # layer (q/k/v fuse to their max) and reach 448 * input_scale (saturation).
    from qops.distributed import FakeGroup
    from qops.layers import TensorParallelColumnLinear as Col
    from qops.layers import TensorParallelRowLinear as Row
    from qops.layers import Weights
    from qops.layers.testing import VARIANTS, rank_slice, write_checkpoint

    k, n = 96, 192
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for prefix, rows, w_scale, in_scale in (("q", n, 0.02, 0.01), ("k", n, 0.2, 0.03), ("v", n, 1.0, 0.02), ("o", n, 0.05, 0.005),
                                            ("gate_up", 2 * n, 0.1, 0.02)):
        c = FORMATS["fp8"].quantize(torch.randn(rows, k, generator=gen) * w_scale, granularity="tensor", input_scale=in_scale)
        tensors.update({f"{prefix}.weight": c.weight, f"{prefix}.weight_scale": c.weight_scale, f"{prefix}.input_scale": c.input_scale})
    write_checkpoint(str(tmp_path), VARIANTS["fp8-tensor-static"], {}, tensors, shards=1)
    load = {"q_k_v": lambda w: Col.load_multi(None, ["q", "k", "v"], w, bias=False), "col": lambda w: Col.load(None, "o", w, bias=False),
            "gate_up": lambda w: Col.load_gate_up(None, "gate_up", w, bias=False), "row": lambda w: Row.load(None, "o", w, bias=False)}
    x = torch.randn(7, k, generator=gen)
    whole = {name: f(Weights.from_pretrained(str(tmp_path))) for name, f in load.items()}
    assert all(m.linear.activations == "static" for m in whole.values())
    assert whole["q_k_v"].linear.input_scale.item() == pytest.approx(0.03)
    assert (x.abs() > 448 * 0.005).any()  # o's input saturates
    want = {name: m(x) for name, m in whole.items()}
    total = 0
    for rank in range(world):
        shard = {name: f(Weights.from_pretrained(str(tmp_path), process_group=FakeGroup(rank, world))) for name, f in load.items()}
        for name, blocks in (("q_k_v", [n] * 3), ("col", [n]), ("gate_up", [n] * 2)):
            assert torch.equal(shard[name].linear.input_scale, whole[name].linear.input_scale), name
            torch.testing.assert_close(shard[name](x), rank_slice(want[name], blocks, rank, world), rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(shard["row"].linear.input_scale, whole["row"].linear.input_scale)
        total = total + shard["row"](x[:, rank * k // world:(rank + 1) * k // world], reduce=False)
    torch.testing.assert_close(total, want["row"], rtol=1e-5, atol=1e-5)
