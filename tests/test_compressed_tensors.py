"""compressed-tensors pack-quantized: K-packed rows with a +2**(b-1) offset, zero points packed
along dim 0, channel and group scales, act-order, errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.formats.compressed_tensors import CompressedTensorsCheckpoint
from qops.formats.integer import act_order_g_idx

from tests import oracle
from tests.int_weight_cases import TOL, one_thread, rel_err  # noqa: F401  (one_thread: autouse fixture)

CT = FORMATS["compressed-tensors"]


def hand_built(q_signed_nk, scale_ng, *, bits, group_size, zp_signed_ng=None, g_idx=None) -> CompressedTensorsCheckpoint:
    """A checkpoint from signed codes and signed zero points, packed by the oracle's packer."""
    off = 2 ** (bits - 1)
    n, k = q_signed_nk.shape
    zp = None
    if zp_signed_ng is not None:
        zp = oracle.pack_stream((zp_signed_ng + off).t(), bits).t().contiguous()
    return CompressedTensorsCheckpoint(
        weight_packed=oracle.pack_stream(q_signed_nk + off, bits),
        weight_scale=scale_ng,
        weight_shape=torch.tensor([n, k]),
        weight_zero_point=zp,
        weight_g_idx=g_idx,
        bits=bits,
        group_size=group_size,
    )


def test_int4_values_are_stored_plus_8():
    # Signed -8..7 along K become nibbles 0..15, element k at bits 4k..4k+3.
    q = (torch.arange(8) - 8).reshape(1, 8)  # -8..-1
    ckpt = hand_built(q, torch.ones(1, 1, dtype=torch.float16), bits=4, group_size=-1)
    assert ckpt.weight_packed.tolist() == [[0x76543210]]
    assert CT.dequantize(ckpt).tolist() == [[-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]]
    iq = CT.unpack(ckpt)
    assert iq.q.tolist() == [list(range(8))] and iq.zeros.tolist() == [[8]]


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_of_hand_packed_values_with_zero_points(bits):
    gen = torch.Generator().manual_seed(bits)
    n, k, gs = 44, 100, 32  # N=44: 4-bit zero points straddle nothing but leave a partial word
    g = 4
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen)
    zp = torch.randint(lo, hi, (n, g), generator=gen)
    s = (torch.rand(n, g, generator=gen) + 0.1).to(torch.bfloat16)
    ckpt = hand_built(q, s, bits=bits, group_size=gs, zp_signed_ng=zp)
    assert ckpt.weight_zero_point.shape == (-(-n * bits // 32), g)
    iq = CT.unpack(ckpt)
    assert torch.equal(iq.q.long(), q + hi)
    assert torch.equal(iq.zeros.long(), zp + hi)
    w = oracle.dequantize("compressed-tensors", ckpt)
    assert torch.equal(w, s.double()[:, torch.arange(k) // gs] * (q - zp[:, torch.arange(k) // gs]))
    assert torch.equal(CT.dequantize(ckpt).double(), w)
    packed = CT.pack(iq)
    assert torch.equal(packed.weight_packed, ckpt.weight_packed)
    assert torch.equal(packed.weight_zero_point, ckpt.weight_zero_point)
    x = torch.randn(3, k)
    assert rel_err(CT.prepare(ckpt).mm(x), oracle.matmul(x, w)) < TOL[torch.float32]


def test_zero_point_is_packed_along_dim_0():
    # 8 output rows of int4 zero points share one word per group column.
    n, k = 8, 64
    zp = torch.tensor([[-8, 7], [-7, 6], [-6, 5], [-5, 4], [-4, 3], [-3, 2], [-2, 1], [-1, 0]])
    ckpt = hand_built(torch.zeros(n, k, dtype=torch.int64), torch.ones(n, 2, dtype=torch.float16),
                      bits=4, group_size=32, zp_signed_ng=zp)
    assert [w & 0xFFFFFFFF for w in ckpt.weight_zero_point[0].tolist()] == [0x76543210, 0x89ABCDEF]
    w = CT.dequantize(ckpt)
    assert torch.equal(w[:, 0], (-zp[:, 0]).float()) and torch.equal(w[:, 63], (-zp[:, 1]).float())
    assert torch.equal(CT.unpack(ckpt).zeros.long(), zp + 8)


def test_symmetric_checkpoint_has_no_zero_point():
    w = torch.randn(24, 64)
    ckpt = CT.quantize(w, bits=4, group_size=32, sym=True)
    assert ckpt.weight_zero_point is None and ckpt.weight_g_idx is None
    assert torch.equal(CT.unpack(ckpt).zeros, torch.full((24, 2), 8, dtype=torch.int32))
    assert CT.prepare(ckpt).qzeros is None
    asym = CT.quantize(w, bits=4, group_size=32, sym=False)
    assert asym.weight_zero_point is not None and asym.weight_zero_point.shape == (3, 2)


def test_sym_true_with_zero_points_is_refused():
    iq = CT.unpack(CT.quantize(torch.randn(16, 64), bits=4, group_size=32, sym=False))
    with pytest.raises(ValueError, match="sym=True needs every zero point at 8"):
        CT.pack(iq, sym=True)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_channel_wise_scale(scale_dtype):
    gen = torch.Generator().manual_seed(3)
    n, k = 24, 200
    q = torch.randint(-128, 128, (n, k), generator=gen)
    s = torch.rand(n, 1, generator=gen).to(scale_dtype) + 0.1
    ckpt = hand_built(q, s, bits=8, group_size=-1)
    w = oracle.dequantize("compressed-tensors", ckpt)
    assert torch.equal(w, s.double() * q)
    # fp32 scales times 8-bit codes are not always exact in fp32: compare the correctly rounded value.
    assert torch.equal(CT.dequantize(ckpt), w.float())
    weight = CT.prepare(ckpt)
    assert torch.equal(weight.dequantize(), w.float())
    x = torch.randn(5, k)
    assert rel_err(weight.mm(x), oracle.matmul(x, w)) < TOL[torch.float32]


def test_act_order_weight_g_idx():
    gen = torch.Generator().manual_seed(4)
    n, k, gs = 16, 100, 32
    g_idx = act_order_g_idx(k, gs, generator=gen).to(torch.int32)
    q = torch.randint(-8, 8, (n, k), generator=gen)
    zp = torch.randint(-8, 8, (n, 4), generator=gen)
    s = (torch.rand(n, 4, generator=gen) + 0.1).to(torch.float16)
    ckpt = hand_built(q, s, bits=4, group_size=gs, zp_signed_ng=zp, g_idx=g_idx)
    w = oracle.dequantize("compressed-tensors", ckpt)
    assert not torch.equal(w, oracle.dequantize("compressed-tensors", dataclasses.replace(ckpt, weight_g_idx=None)))
    assert torch.equal(CT.dequantize(ckpt).double(), w)
    assert torch.equal(CT.pack(CT.unpack(ckpt)).weight_g_idx, g_idx)
    weight = CT.prepare(ckpt)
    assert weight.act_perm is not None
    assert torch.equal(weight.dequantize().double(), w)
    x = torch.randn(4, k)
    assert rel_err(weight.mm(x), oracle.matmul(x, w)) < TOL[torch.float32]


def test_bits_other_than_4_and_8_are_refused():
    ckpt = CT.quantize(torch.randn(16, 64), bits=4, group_size=32, sym=True)
    with pytest.raises(ValueError, match=r"bits must be one of \[4, 8\], got 3"):
        CT.unpack(dataclasses.replace(ckpt, bits=3))
    with pytest.raises(ValueError, match=r"bits must be one of \[4, 8\], got 2"):
        CT.quantize(torch.randn(16, 64), bits=2, group_size=32, sym=True)


def _good() -> CompressedTensorsCheckpoint:
    return CT.quantize(torch.randn(40, 100), bits=4, group_size=32, sym=False)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("weight_packed", torch.zeros(40, 12, dtype=torch.int32), r"weight_packed must have shape \(40, 13\)"),
        ("weight_packed", torch.zeros(40, 13, dtype=torch.int64), "weight_packed must be torch.int32"),
        ("weight_scale", torch.ones(40, 3, dtype=torch.float16), r"weight_scale must have shape \(40, 4\)"),
        ("weight_scale", torch.ones(40, 4, dtype=torch.int32), "weight_scale must be floating point"),
        ("weight_scale", torch.ones(40, 4, dtype=torch.float64), r"weight_scale must be floating point \(float16, bfloat16, float32\), got torch.float64"),
        ("weight_scale", torch.ones(40, 4).to(torch.float8_e4m3fn), r"weight_scale must be floating point \(.*\), got torch.float8_e4m3fn"),
        ("weight_zero_point", torch.zeros(4, 5, dtype=torch.int32), r"weight_zero_point must have shape \(5, 4\)"),
        ("weight_zero_point", torch.zeros(5, 4, dtype=torch.uint8), "weight_zero_point must be torch.int32"),
        ("weight_g_idx", torch.zeros(64, dtype=torch.int32), r"weight_g_idx must have shape \(100,\)"),
        ("weight_shape", torch.tensor([40, 100, 1]), r"weight_shape must have shape \(2,\)"),
        ("weight_shape", torch.tensor([40, 96]), r"weight_packed must have shape \(40, 12\)"),
        ("group_size", 0, "group_size must be -1 or a positive integer, got 0"),
    ],
)
def test_inconsistent_checkpoint_is_refused_naming_the_tensor(field, value, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(ValueError, match=match):
        CT.unpack(bad)
    with pytest.raises(ValueError, match=match):
        CT.prepare(bad)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("bits", 4.0, r"compressed-tensors: bits must be an integer, got float 4\.0"),
        ("group_size", 32.0, r"compressed-tensors: group_size must be an integer, got float 32\.0"),
        ("weight_packed", None, r"compressed-tensors: weight_packed must be a tensor, got NoneType"),
        ("weight_shape", [40, 100], r"compressed-tensors: weight_shape must be a tensor, got list"),
    ],
)
def test_arguments_are_checked_before_they_are_used(field, value, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(TypeError, match=match):
        CT.unpack(bad)
