"""GPTQ checkpoints: the layout facts of FORMATS.md on hand-built tensors, v1/v2, act-order, errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.formats.gptq import GPTQCheckpoint, convert_version, version_from_config
from qops.formats.integer import act_order_g_idx

from tests import oracle
from tests.int_weight_cases import TOL, one_thread, rel_err  # noqa: F401  (one_thread: autouse fixture)

GPTQ = FORMATS["gptq"]
MASK = 0xFFFFFFFF


def u32(t: torch.Tensor) -> list:
    return [w & MASK for w in t.flatten().tolist()]


def hand_built(q_kn, z_gn, scales_gn, *, bits, group_size, version, g_idx=None) -> GPTQCheckpoint:
    """A checkpoint packed by the oracle's packer: q (K, N), stored zeros (G, N), scales (G, N)."""
    k = q_kn.shape[0]
    return GPTQCheckpoint(
        qweight=oracle.pack_stream(torch.as_tensor(q_kn).t(), bits).t().contiguous(),
        qzeros=oracle.pack_stream(torch.as_tensor(z_gn), bits),
        scales=torch.as_tensor(scales_gn, dtype=torch.float16),
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        in_features=k,
        version=version,
    )


def test_4bit_row_k_is_nibble_k_mod_8_of_word_k_div_8():
    k, n = 16, 3
    q = torch.arange(k * n).reshape(k, n) % 16
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for kk in range(k):
        words[kk // 8] |= q[kk] << (4 * (kk % 8))
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    ckpt = hand_built(q, torch.zeros(1, n, dtype=torch.int64), torch.ones(1, n), bits=4, group_size=-1, version="v2")
    assert torch.equal(ckpt.qweight, qweight)
    assert torch.equal(GPTQ.unpack(ckpt).q, q.t().to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_of_hand_packed_values(bits):
    gen = torch.Generator().manual_seed(bits)
    k, n, gs = 70, 13, 32  # K=70: a partial last group of 6; 3-bit words straddle
    g = 3
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    z = torch.randint(0, 2**bits, (g, n), generator=gen)
    s = torch.rand(g, n, generator=gen) + 0.5
    for version in ("v1", "v2"):
        ckpt = hand_built(q, z, s, bits=bits, group_size=gs, version=version)
        iq = GPTQ.unpack(ckpt)
        assert torch.equal(iq.q, q.t().to(torch.uint8))
        assert torch.equal(iq.zeros, (z + (version == "v1")).t().to(torch.int32))
        assert torch.equal(iq.g_idx, torch.arange(k) // gs)
        assert torch.equal(GPTQ.dequantize(ckpt).double(), oracle.dequantize("gptq", ckpt))
        assert ckpt.qweight.shape == (-(-k * bits // 32), n) and ckpt.qzeros.shape == (g, -(-n * bits // 32))


def test_3bit_packs_32_values_in_3_words():
    q = torch.arange(32).reshape(32, 1) % 8
    ckpt = hand_built(q, torch.zeros(1, 1), torch.ones(1, 1), bits=3, group_size=-1, version="v2")
    assert ckpt.qweight.shape == (3, 1)
    stream = sum(int(v) << (3 * i) for i, v in enumerate(q.flatten()))
    assert u32(ckpt.qweight) == [(stream >> (32 * j)) & MASK for j in range(3)]
    packed = GPTQ.pack(GPTQ.unpack(ckpt), version="v2")
    assert torch.equal(packed.qweight, ckpt.qweight)


def test_symmetric_4bit_v1_zeros_are_0x77777777():
    w = torch.randn(24, 64)
    v1 = GPTQ.quantize(w, bits=4, group_size=32, sym=True, version="v1")
    v2 = GPTQ.quantize(w, bits=4, group_size=32, sym=True, version="v2")
    assert set(u32(v1.qzeros)) == {0x77777777}
    assert set(u32(v2.qzeros)) == {0x88888888}
    assert torch.equal(oracle.dequantize("gptq", v1), oracle.dequantize("gptq", v2))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_convert_version_both_ways(bits):
    gen = torch.Generator().manual_seed(10 + bits)
    k, n, gs = 96, 40, 32
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    stored_v1 = torch.randint(0, 2**bits - 1, (k // gs, n), generator=gen)  # v1 zero 2**b would not fit v2
    v1 = hand_built(q, stored_v1, torch.rand(k // gs, n, generator=gen) + 0.1, bits=bits, group_size=gs, version="v1")
    v2 = convert_version(v1, "v2")
    assert v2.version == "v2" and v2.qweight is v1.qweight and v2.scales is v1.scales
    assert torch.equal(v2.qzeros, oracle.pack_stream(stored_v1 + 1, bits))
    back = convert_version(v2, "v1")
    assert back.version == "v1" and torch.equal(back.qzeros, v1.qzeros)
    assert convert_version(v1, "v1") is v1
    w = oracle.dequantize("gptq", v1)
    assert torch.equal(oracle.dequantize("gptq", v2), w)
    assert torch.equal(GPTQ.dequantize(v2).double(), w)
    if bits == 4:
        assert u32(v2.qzeros) == [(x + 0x11111111) & MASK for x in u32(v1.qzeros)]
        assert u32(back.qzeros) == [(x - 0x11111111) & MASK for x in u32(v2.qzeros)]


def test_convert_version_refuses_unrepresentable_zeros():
    ones = torch.ones(1, 8)
    q = torch.zeros(8, 8, dtype=torch.int64)
    v1_full = hand_built(q, torch.full((1, 8), 15), ones, bits=4, group_size=-1, version="v1")  # zero 16
    with pytest.raises(ValueError, match="v1 zero of 16"):
        convert_version(v1_full, "v2")
    v2_zero = hand_built(q, torch.zeros(1, 8, dtype=torch.int64), ones, bits=4, group_size=-1, version="v2")
    with pytest.raises(ValueError, match="zero point of 0"):
        convert_version(v2_zero, "v1")
    with pytest.raises(ValueError, match="version must be one of"):
        convert_version(v2_zero, "v3")


def test_v1_stored_max_means_zero_2_pow_bits():
    # A v1 word of 0xFFFFFFFF is z = 16 for every column: the runtime layout needs zero_offset = 1.
    gen = torch.Generator().manual_seed(5)
    k, n = 64, 16
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (2, n), generator=gen)
    z[0] = 15
    ckpt = hand_built(q, z, torch.rand(2, n, generator=gen) + 0.1, bits=4, group_size=32, version="v1")
    assert u32(ckpt.qzeros[0]) == [MASK, MASK]
    w = oracle.dequantize("gptq", ckpt)
    assert torch.equal(GPTQ.unpack(ckpt).zeros[:, 0], torch.full((n,), 16, dtype=torch.int32))
    assert torch.equal(GPTQ.dequantize(ckpt).double(), w)
    weight = GPTQ.prepare(ckpt)
    assert weight.zero_offset == 1
    x = torch.randn(5, k)
    assert rel_err(weight.mm(x), oracle.matmul(x, w)) < TOL[torch.float32]
    with pytest.raises(ValueError, match=r"zero points must be < 2\*\*bits = 16 in a v2 checkpoint"):
        GPTQ.pack(GPTQ.unpack(ckpt), version="v2")


def test_partial_last_group():
    gen = torch.Generator().manual_seed(6)
    k, n, gs = 100, 24, 32  # groups of 32, 32, 32 and 4
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (4, n), generator=gen)
    s = torch.rand(4, n, generator=gen) + 0.1
    ckpt = hand_built(q, z, s, bits=4, group_size=gs, version="v2")
    assert ckpt.qweight.shape == (13, n)
    w = GPTQ.dequantize(ckpt)
    s16 = s.to(torch.float16).float()
    assert torch.equal(w[:, 96:], (s16[3][:, None] * (q[96:].t() - z[3][:, None])).float())
    assert torch.equal(w.double(), oracle.dequantize("gptq", ckpt))
    x = torch.randn(3, k)
    assert rel_err(GPTQ.prepare(ckpt).mm(x), oracle.matmul(x, oracle.dequantize("gptq", ckpt))) < TOL[torch.float32]


def test_act_order_g_idx():
    gen = torch.Generator().manual_seed(7)
    k, n, gs = 100, 16, 32
    g_idx = act_order_g_idx(k, gs, generator=gen).to(torch.int32)
    assert sorted(torch.bincount(g_idx).tolist()) == [4, 32, 32, 32]
    q = torch.randint(0, 8, (k, n), generator=gen)
    z = torch.randint(0, 8, (4, n), generator=gen)
    ckpt = hand_built(q, z, torch.rand(4, n, generator=gen) + 0.1, bits=3, group_size=gs, version="v2", g_idx=g_idx)
    w = oracle.dequantize("gptq", ckpt)
    # The same checkpoint read with the default g_idx is a different weight: g_idx is honoured.
    assert not torch.equal(w, oracle.dequantize("gptq", dataclasses.replace(ckpt, g_idx=None)))
    assert torch.equal(GPTQ.dequantize(ckpt).double(), w)
    weight = GPTQ.prepare(ckpt)
    assert weight.act_perm is not None and sorted(weight.act_perm.tolist()) == list(range(k))
    assert torch.equal(weight.dequantize().double(), w)
    x = torch.randn(4, k)
    assert rel_err(weight.mm(x), oracle.matmul(x, w)) < TOL[torch.float32]


def test_g_idx_none_is_k_div_group_size():
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(0, 16, (64, 8), generator=gen)
    ckpt = hand_built(q, torch.randint(0, 16, (2, 8), generator=gen), torch.rand(2, 8) + 0.1, bits=4, group_size=32, version="v2")
    explicit = dataclasses.replace(ckpt, g_idx=(torch.arange(64) // 32).to(torch.int32))
    assert torch.equal(GPTQ.dequantize(ckpt), GPTQ.dequantize(explicit))


def test_prepare_without_act_order_uses_the_checkpoint_qweight():
    ckpt = GPTQ.quantize(torch.randn(32, 96), bits=4, group_size=32, sym=False, version="v2")
    assert GPTQ.prepare(ckpt).qweight.data_ptr() == ckpt.qweight.data_ptr()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_rtn_quantizer_error_is_half_a_step(bits, sym):
    w = torch.randn(40, 200)
    ckpt = GPTQ.quantize(w, bits=bits, group_size=64, sym=sym, version="v2")
    deq = oracle.dequantize("gptq", ckpt).float()
    step = ckpt.scales.float().abs().repeat_interleave(64, dim=0)[:200].t()
    # Half a step, plus what clamping adds because codes are rounded against the fp16-rounded scale.
    slack = 0.5 + 2**bits * 2**-11
    assert bool(((deq - w).abs() <= slack * step + 1e-6).all())


@pytest.mark.parametrize(
    "fmt,version", [({"checkpoint_format": "gptq"}, "v1"), ({"checkpoint_format": "gptq_v2"}, "v2"),
                    ({"format": "gptq_v2"}, "v2"), ({"format": "gptq"}, "v1"), ({}, "v1")])
def test_version_from_config(fmt, version):
    assert version_from_config({"bits": 4, **fmt}) == version


def test_version_from_config_rejects_unknown():
    with pytest.raises(ValueError, match="checkpoint_format must be 'gptq' or 'gptq_v2', got 'marlin'"):
        version_from_config({"checkpoint_format": "marlin"})


def _good() -> GPTQCheckpoint:
    return GPTQ.quantize(torch.randn(40, 100), bits=4, group_size=32, sym=False, version="v2")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("qweight", torch.zeros(12, 40, dtype=torch.int32), r"qweight must have shape \(13, 40\)"),
        ("qweight", torch.zeros(13, 40, dtype=torch.int64), "qweight must be torch.int32"),
        ("qzeros", torch.zeros(4, 6, dtype=torch.int32), r"qzeros must have shape \(4, 5\)"),
        ("qzeros", torch.zeros(3, 5, dtype=torch.int32), r"qzeros must have shape \(4, 5\)"),
        ("qzeros", torch.zeros(4, 5, dtype=torch.int16), "qzeros must be torch.int32"),
        ("scales", torch.ones(4, 41, dtype=torch.float16), r"scales must have shape \(4, 40\)"),
        ("scales", torch.ones(4, 40, dtype=torch.int32), "scales must be floating point"),
        ("scales", torch.ones(4, 40, dtype=torch.float64), r"scales must be floating point \(float16, bfloat16, float32\), got torch.float64"),
        ("scales", torch.ones(4, 40).to(torch.float8_e4m3fn), r"scales must be floating point \(.*\), got torch.float8_e4m3fn"),
        ("g_idx", torch.zeros(99, dtype=torch.int32), r"g_idx must have shape \(100,\)"),
        ("g_idx", torch.zeros(100, dtype=torch.float32), "g_idx must be an integer tensor"),
        ("bits", 5, r"bits must be one of \[2, 3, 4, 8\], got 5"),
        ("group_size", 0, "group_size must be -1 or a positive integer, got 0"),
        ("version", "v3", "version must be one of"),
    ],
)
def test_inconsistent_checkpoint_is_refused_naming_the_tensor(field, value, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(ValueError, match=match):
        GPTQ.unpack(bad)
    with pytest.raises(ValueError, match=match):
        GPTQ.prepare(bad)


@pytest.mark.parametrize(
    "field,value,exc,match",
    [
        ("bits", 4.0, TypeError, r"gptq: bits must be an integer, got float 4\.0"),
        ("bits", True, TypeError, r"gptq: bits must be an integer, got bool True"),
        ("group_size", 32.0, TypeError, r"gptq: group_size must be an integer, got float 32\.0"),
        ("qzeros", None, TypeError, r"gptq: qzeros must be a tensor, got NoneType"),
        ("scales", [[1.0] * 40] * 4, TypeError, r"gptq: scales must be a tensor, got list"),
        ("qweight", torch.zeros(1, 13, 40, dtype=torch.int32), ValueError, r"gptq: qweight must be 2-D, got shape \(1, 13, 40\)"),
    ],
)
def test_arguments_are_checked_before_they_are_used(field, value, exc, match):
    bad = dataclasses.replace(_good(), **{field: value})
    with pytest.raises(exc, match=match):
        GPTQ.unpack(bad)
