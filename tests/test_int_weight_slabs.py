"""The column-slab form of an integer weight's qweight (qops/ops/int_weight.py): its definition, every
op on it (bit-identical to the flat form through the reference kernel), the checks that keep the two
forms apart, and which prepared weights get it.

The Triton kernels on it run in tests/test_triton_int_weight.py (interpreter) and on the GPU; the
native kernels in tests/gpu/test_gpu_native_int_weight.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import qops.ops.int_weight as iw
from qops.formats import FORMATS
from qops.lowerings import LOWERINGS_BY_NAME, Choice, Kernel
from tests.int_weight_cases import Case, pack, random_int_quantized


def _flat(rows=9, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (rows, n), generator=g, dtype=torch.int32)


def test_slab_words_are_where_the_definition_puts_them():
    flat = _flat()
    slabs = iw.to_column_slabs(flat)
    assert slabs.shape == (3, 9, 32) and slabs.is_contiguous()
    for j, n in [(0, 0), (8, 95), (3, 31), (3, 32), (5, 64), (7, 50)]:
        assert slabs[n // 32, j, n % 32] == flat[j, n]
    assert torch.equal(iw.flat_qweight(slabs), flat)
    assert iw.flat_qweight(flat) is flat


@pytest.mark.parametrize("form", ["flat", "slabs"])
def test_strides_address_every_word(form):
    """``qweight_strides``: word (j, n) at j * row + (n // 32) * slab + n % 32, what the kernels compute."""
    flat = _flat(rows=5, n=64, seed=1)
    q = flat if form == "flat" else iw.to_column_slabs(flat)
    row, slab = iw.qweight_strides(q)
    storage = q.reshape(-1)
    j = torch.arange(5)[:, None]
    n = torch.arange(64)[None, :]
    assert torch.equal(storage[j * row + (n // 32) * slab + n % 32], flat)
    assert iw.qweight_columns(q) == 64 and iw.qweight_word_rows(q) == 5


def test_to_column_slabs_refuses_n_off_the_slab_width():
    with pytest.raises(ValueError, match="N % 32 == 0, got N=40"):
        iw.to_column_slabs(_flat(n=40))


# (format, N, K, group, sym, act-order, version): N multiples of 32, K and groups off round numbers.
CASES = [
    ("gptq", 64, 200, 64, False, True, "v1"),
    ("gptq", 96, 136, -1, True, False, "v2"),
    ("awq", 64, 192, 32, False, False, None),
    ("compressed-tensors", 32, 100, 32, True, True, None),
]


def _weights(case, bits=4):
    fmt, n, k, g, sym, act, ver = case
    c = Case(fmt, bits, g, sym, act, ver, n, k)
    w = FORMATS[fmt].prepare(pack(c, random_int_quantized(c, torch.Generator().manual_seed(n + k))))
    assert w.qweight.dim() == 2  # the CPU's reference lowering keeps the flat form
    return w, dataclasses.replace(w, qweight=iw.to_column_slabs(w.qweight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-g{c[3]}")
def test_every_op_on_slabs_equals_the_flat_form(case, dtype):
    flat, slabs = _weights(case)
    x = torch.randn(3, 5, flat.in_features, dtype=dtype)[:, ::2]  # batched, not contiguous
    bias = torch.randn(flat.out_features, dtype=dtype)
    assert torch.equal(slabs.dequantize(), flat.dequantize())
    assert torch.equal(slabs.mm(x, bias), flat.mm(x, bias))
    assert torch.equal(slabs.mm_swiglu(x), flat.mm_swiglu(x))
    out = torch.full((3, 3, flat.out_features), float("nan"), dtype=dtype)
    torch.ops.qops.mm_int_weight_out(x, slabs.qweight, slabs.scales, slabs.qzeros, slabs.act_perm, bias, slabs.in_features,
                                     slabs.bits, slabs.group_size, slabs.zero_offset, int(slabs.kernel), out, None)
    assert torch.equal(out, flat.mm(x, bias))


def test_gradient_through_slabs():
    flat, slabs = _weights(CASES[0])
    x0 = torch.randn(4, flat.in_features)
    grads = []
    for w in (flat, slabs):
        x = x0.clone().requires_grad_()
        (w.mm(x) ** 2).sum().backward()
        grads.append(x.grad)
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])


def test_fake_tensors_take_the_slab_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, slabs = _weights(CASES[1])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(7, slabs.in_features))
        q = mode.from_tensor(slabs.qweight)
        y = torch.ops.qops.mm_int_weight(x, q, slabs.scales, slabs.qzeros, slabs.act_perm, None, slabs.in_features,
                                         slabs.bits, slabs.group_size, slabs.zero_offset, int(slabs.kernel))
        assert tuple(y.shape) == (7, 96)
        d = torch.ops.qops.dequantize_int_weight(q, slabs.scales, slabs.qzeros, slabs.act_perm, slabs.in_features,
                                                 slabs.bits, slabs.group_size, slabs.zero_offset, torch.float16)
        assert tuple(d.shape) == (96, slabs.in_features)


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
def test_malformed_slabs_are_refused_naming_qweight(fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, w = _weights(CASES[1])
    x = torch.randn(2, w.in_features)
    bad = {
        "slab width": (w.qweight[..., :16].contiguous(), r"qweight in column slabs must have shape \(N/32, ceil\(K\*bits/32\), 32\)"),
        "word rows": (w.qweight[:, :-1].contiguous(), r"qweight must have 17 word rows"),
        "4-D": (w.qweight[None], r"qweight must be 2-D .* or column slabs .*, got 4-D"),
        "scales of another N": (w.qweight[:2].contiguous(), r"scales must have shape \(1, 64\)"),
    }
    for what, (q, msg) in bad.items():
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises((ValueError, RuntimeError), match=msg):
                torch.ops.qops.mm_int_weight(mode.from_tensor(x), mode.from_tensor(q), w.scales, w.qzeros, w.act_perm, None,
                                             w.in_features, w.bits, w.group_size, w.zero_offset, int(w.kernel))
        else:
            with pytest.raises((ValueError, RuntimeError), match=msg):
                torch.ops.qops.mm_int_weight(x, q, w.scales, w.qzeros, w.act_perm, None, w.in_features, w.bits,
                                             w.group_size, w.zero_offset, int(w.kernel))


def test_preferred_form():
    assert iw.preferred_qweight_form(Kernel.NATIVE, 4, 4096) == "slabs"
    assert iw.preferred_qweight_form(Kernel.NATIVE, 4, 1000) == "flat"  # N % 32 != 0
    assert iw.preferred_qweight_form(Kernel.NATIVE, 8, 4096) == "flat"  # the native kernels are 4-bit
    assert iw.preferred_qweight_form(Kernel.TRITON, 4, 4096) == "flat"
    assert iw.preferred_qweight_form(Kernel.REFERENCE, 4, 4096) == "flat"


@pytest.mark.parametrize("n, want", [(64, 3), (40, 2)])
def test_with_lowering_gives_slabs_to_a_weight_chosen_for_the_native_kernel(monkeypatch, n, want):
    """The chooser is told to pick native_w4a16 (as on a GPU): the prepared qweight is then in slabs
    where N allows, and the op still equals the flat weight's result through the reference kernel."""
    native = LOWERINGS_BY_NAME["native_w4a16"]
    monkeypatch.setattr(iw, "choose", lambda spec: Choice(native, ()))
    monkeypatch.setattr(iw, "warm_up", lambda lowering, weight: None)
    c = Case("gptq", 4, 32, False, False, "v2", n, 100)
    iq = random_int_quantized(c, torch.Generator().manual_seed(5))
    w = FORMATS["gptq"].prepare(pack(c, iq))
    assert w.kernel == Kernel.NATIVE and w.qweight.dim() == want
    ref = dataclasses.replace(w, qweight=iw.flat_qweight(w.qweight), kernel=Kernel.REFERENCE)
    assert torch.equal(dataclasses.replace(w, kernel=Kernel.REFERENCE).dequantize(), ref.dequantize())


def test_with_qweight_form_copies_only_on_a_change():
    flat, slabs = _weights(CASES[1])
    assert iw.with_qweight_form(flat, "flat") is flat and iw.with_qweight_form(slabs, "slabs") is slabs
    assert torch.equal(iw.with_qweight_form(flat, "slabs").qweight, slabs.qweight)
    back = iw.with_qweight_form(slabs, "flat").qweight
    assert back.is_contiguous() and torch.equal(back, flat.qweight)
    with pytest.raises(ValueError, match="form must be 'flat' or 'slabs', got 'tiles'"):
        iw.with_qweight_form(flat, "tiles")


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
def test_chunked_preparation_writes_slabs_directly(monkeypatch, act_order):
    """``qops.layers.int_weight.prepare`` over column chunks (N = 2048, K = 128: four chunks of 512
    columns), chosen for the native lowering: the qweight is assembled in slabs chunk by chunk and
    equals the flat preparation's words; scales and zeros unchanged."""
    from qops.layers.int_weight import _chunk_columns, prepare

    n, k = 2048, 128
    assert _chunk_columns(k, n, k) < n
    c = Case("gptq", 4, 64, False, act_order, "v1", n, k)
    ckpt = pack(c, random_int_quantized(c, torch.Generator().manual_seed(7)))
    flat = prepare(ckpt)
    assert flat.qweight.dim() == 2
    native = LOWERINGS_BY_NAME["native_w4a16"]
    monkeypatch.setattr(iw, "choose", lambda spec: Choice(native, ()))
    monkeypatch.setattr(iw, "warm_up", lambda lowering, weight: None)
    copies = []
    real = iw.to_column_slabs
    monkeypatch.setattr(iw, "to_column_slabs", lambda q: copies.append(q.shape) or real(q))
    slabs = prepare(ckpt)
    assert slabs.kernel == Kernel.NATIVE and slabs.qweight.shape == (n // 32, k // 8, 32)
    assert not copies, "with_lowering copied the whole layer into slabs after the chunks"
    assert torch.equal(iw.flat_qweight(slabs.qweight), flat.qweight)
    assert torch.equal(slabs.scales, flat.scales) and torch.equal(slabs.qzeros, flat.qzeros)
    assert (slabs.act_perm is None) == (not act_order)
