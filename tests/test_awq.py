"""AWQ GEMM checkpoints: N-packed interleaved nibbles, zeros without +1, no act-order, errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.formats.awq import AWQCheckpoint
from qops.formats.integer import IntQuantized, act_order_g_idx

from tests import oracle
from tests.int_weight_cases import TOL, one_thread, rel_err  # noqa: F401  (one_thread: autouse fixture)

AWQ = FORMATS["awq"]


def hand_built(q_kn, z_gn, scales_gn, group_size) -> AWQCheckpoint:
    return AWQCheckpoint(
        qweight=oracle.awq_pack(q_kn),
        qzeros=oracle.awq_pack(z_gn),
        scales=torch.as_tensor(scales_gn, dtype=torch.float16),
        group_size=group_size,
    )


def test_nibble_i_holds_column_of_interleaved_order():
    # One row, columns 0..15 valued 0..15: word c holds nibbles [8c+0, 8c+2, 8c+4, 8c+6, 8c+1, ...].
    q = torch.arange(16).reshape(1, 16)
    iq = IntQuantized(q=q.t().to(torch.uint8).contiguous(), zeros=torch.zeros(16, 1, dtype=torch.int32),
                      scales=torch.ones(16, 1, dtype=torch.float16), g_idx=torch.zeros(1, dtype=torch.int64),
                      bits=4, group_size=-1)
    ckpt = AWQ.pack(iq)
    assert [w & 0xFFFFFFFF for w in ckpt.qweight[0].tolist()] == [0x75316420, 0xFDB9ECA8]
    assert torch.equal(AWQ.unpack(ckpt).q, iq.q)


def test_unpack_of_hand_packed_values():
    gen = torch.Generator().manual_seed(1)
    k, n, gs = 100, 40, 32  # partial last group of 4
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (4, n), generator=gen)
    s = torch.rand(4, n, generator=gen) + 0.1
    ckpt = hand_built(q, z, s, gs)
    assert ckpt.qweight.shape == (k, n // 8) and ckpt.qzeros.shape == (4, n // 8)
    iq = AWQ.unpack(ckpt)
    assert torch.equal(iq.q, q.t().to(torch.uint8))
    assert torch.equal(iq.zeros, z.t().to(torch.int32))
    assert torch.equal(iq.g_idx, torch.arange(k) // gs)
    w = oracle.dequantize("awq", ckpt)
    assert torch.equal(AWQ.dequantize(ckpt).double(), w)
    packed = AWQ.pack(iq)
    assert torch.equal(packed.qweight, ckpt.qweight) and torch.equal(packed.qzeros, ckpt.qzeros)
    x = torch.randn(3, k)
    assert rel_err(AWQ.prepare(ckpt).mm(x), oracle.matmul(x, w)) < TOL[torch.float32]


def test_zero_has_no_plus_one():
    # q == stored zero dequantizes to exactly 0 (GPTQ v1 would give -scale).
    q = torch.full((8, 8), 5)
    ckpt = hand_built(q, torch.full((1, 8), 5), torch.full((1, 8), 0.5), group_size=-1)
    assert torch.equal(AWQ.dequantize(ckpt), torch.zeros(8, 8))
    ckpt = hand_built(q, torch.full((1, 8), 4), torch.full((1, 8), 0.5), group_size=-1)
    assert torch.equal(AWQ.dequantize(ckpt), torch.full((8, 8), 0.5))


def test_quantize_is_asymmetric_by_default():
    w = torch.randn(16, 64)
    iq = AWQ.unpack(AWQ.quantize(w, group_size=32))
    assert not bool((iq.zeros == 8).all())
    assert rel_err(AWQ.dequantize(AWQ.quantize(w, group_size=32)), w.double()) < 0.2


def test_act_order_is_refused():
    iq = AWQ.unpack(AWQ.quantize(torch.randn(16, 64), group_size=32))
    iq.g_idx = act_order_g_idx(64, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no act-order; g_idx must be k // group_size"):
        AWQ.pack(iq)


def test_bits_other_than_4_are_refused():
    with pytest.raises(ValueError, match="bits must be 4"):
        AWQ.quantize(torch.randn(16, 64), bits=8, group_size=32)
    with pytest.raises(ValueError, match="bits must be 4"):
        AWQ.unpack(dataclasses.replace(AWQ.quantize(torch.randn(16, 64), group_size=32), bits=8))


def test_n_not_multiple_of_8_is_refused():
    with pytest.raises(ValueError, match="N must be a multiple of 8, got 12"):
        AWQ.quantize(torch.randn(12, 64), group_size=32)


def _good() -> AWQCheckpoint:
    return AWQ.quantize(torch.randn(40, 100), group_size=32)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("qzeros", torch.zeros(3, 5, dtype=torch.int32), r"qzeros must have shape \(4, 5\)"),
        ("qzeros", torch.zeros(4, 4, dtype=torch.int32), r"qzeros must have shape \(4, 5\)"),
        ("qzeros", torch.zeros(4, 5, dtype=torch.int64), "qzeros must be torch.int32"),
        ("qweight", torch.zeros(100, 5, dtype=torch.float32), "qweight must be torch.int32"),
        ("qweight", torch.zeros(100, 4, dtype=torch.int32), r"qweight must have shape \(100, 5\)"),
        ("scales", torch.ones(3, 40, dtype=torch.float16), r"scales must have shape \(4, 40\)"),
        ("scales", torch.ones(4, 40, dtype=torch.int32), "scales must be floating point"),
        ("scales", torch.ones(4, 40, dtype=torch.float64), r"scales must be floating point \(float16, bfloat16, float32\), got torch.float64"),
        ("group_size", 0, "group_size must be -1 or a positive integer, got 0"),
    ],
)
def test_inconsistent_checkpoint_is_refused_naming_the_tensor(field, value, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(ValueError, match=match):
        AWQ.unpack(bad)
    with pytest.raises(ValueError, match=match):
        AWQ.prepare(bad)


@pytest.mark.parametrize(
    "field,value,exc,match",
    [
        ("bits", 4.0, TypeError, r"awq: bits must be an integer, got float 4\.0"),
        ("group_size", 32.0, TypeError, r"awq: group_size must be an integer, got float 32\.0"),
        ("qzeros", None, TypeError, r"awq: qzeros must be a tensor, got NoneType"),
        ("scales", torch.ones(160, dtype=torch.float16), ValueError, r"awq: scales must be 2-D, got shape \(160,\)"),
        ("qweight", torch.zeros(500, dtype=torch.int32), ValueError, r"awq: qweight must be 2-D, got shape \(500,\)"),
    ],
)
def test_arguments_are_checked_before_they_are_used(field, value, exc, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(exc, match=match):
        AWQ.unpack(bad)
