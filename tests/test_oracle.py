"""The float64 oracle itself, then qops' formats and op checked against it over the whole registry."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qops.formats import FORMATS

from tests import oracle
from tests.int_weight_cases import SUPPORT, all_cases, build, int_weight_formats, one_thread, pack, random_int_quantized  # noqa: F401  (one_thread: autouse fixture)

CASES = all_cases()
SUPPORTED = [c for c in CASES if c.supported]
OPTED_OUT = [c for c in CASES if not c.supported]


def _python_int_words(values, bits):
    """A third packer, on one Python integer: the whole stream, cut into 32-bit words."""
    stream = 0
    for i, v in enumerate(values):
        stream |= int(v) << (i * bits)
    n_words = -(-len(values) * bits // 32)
    words = [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(n_words)]
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def test_unpack_stream_4bit_word():
    # Row k = 8r + i sits in bits 4i..4i+3 of word r.
    assert oracle.unpack_stream(np.array([0x76543210]), 4, 8).tolist() == list(range(8))
    assert oracle.unpack_stream(np.array([0x89ABCDEF - (1 << 32)]), 4, 8).tolist() == list(range(15, 7, -1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_and_unpack_stream_against_python_ints(bits):
    rng = np.random.default_rng(bits)
    for length in (1, 10, 11, 21, 22, 32, 33, 100):
        values = rng.integers(0, 2**bits, length)
        words = _python_int_words(values, bits)
        assert oracle.pack_stream(values, bits).tolist() == words
        assert oracle.unpack_stream(np.array(words), bits, length).tolist() == values.tolist()


def test_3bit_values_straddle_words():
    # 32 three-bit values fill 3 words; value 10 has bits 30..32, value 21 bits 63..65.
    values = [0] * 32
    values[10] = 0b111
    values[21] = 0b101
    words = [w & 0xFFFFFFFF for w in oracle.pack_stream(values, 3).tolist()]
    assert words == [0b11 << 30, 0b1 | (0b1 << 31), 0b10]
    assert oracle.unpack_stream(oracle.pack_stream(values, 3), 3, 32).tolist() == values


def test_awq_nibble_order():
    # Nibble i of word c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i].
    words = torch.tensor([[0x76543210, 0x0FEDCBA9]], dtype=torch.int32)
    w = oracle.awq(words, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 16), group_size=-1)  # (N=16, K=1)
    assert w[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert w[8:, 0].tolist() == [9, 13, 10, 14, 11, 15, 12, 0]
    v = torch.arange(16).reshape(1, 16) % 16
    assert oracle.awq_pack(v).tolist() == [[0x75316420, 0xFDB9ECA8 - (1 << 32)]]


def test_support_table_covers_the_registry():
    names = int_weight_formats()
    assert {"gptq", "awq", "compressed-tensors"} <= set(names)
    assert set(SUPPORT) == set(names), "add every int_weight format to tests/int_weight_cases.py:SUPPORT"
    for name in names:
        assert tuple(FORMATS[name].bits) == SUPPORT[name].bits, name


@pytest.mark.parametrize("case", SUPPORTED, ids=lambda c: c.id)
def test_pack_unpack_roundtrip(case):
    gen = torch.Generator().manual_seed(1)
    iq = random_int_quantized(case, gen)
    back = FORMATS[case.fmt].unpack(pack(case, iq))
    assert back.bits == iq.bits and back.group_size == iq.group_size
    assert back.q.dtype == torch.uint8
    assert torch.equal(back.q, iq.q)
    assert torch.equal(back.zeros.to(torch.int32), iq.zeros)
    assert torch.equal(back.scales, iq.scales)
    assert torch.equal(back.g_idx.long(), iq.g_idx.long())


@pytest.mark.parametrize("case", SUPPORTED, ids=lambda c: c.id)
def test_oracle_agrees_with_qops_exactly(case):
    b = build(case, seed=2)
    # fp16 scales times integers below 2**9 are exact in fp32: no tolerance anywhere below.
    assert torch.equal(FORMATS[case.fmt].dequantize(b.checkpoint).double(), b.w64)
    assert torch.equal(b.weight.dequantize(torch.float32).double(), b.w64)
    assert torch.equal(b.iq.dequantize().double(), b.w64)
    # One-hot activations return the weight, transposed, bit for bit.
    eye = torch.eye(case.k)
    assert torch.equal(b.weight.mm(eye).double(), b.w64.t())


@pytest.mark.parametrize("case", OPTED_OUT, ids=lambda c: c.id)
def test_unsupported_combination_is_refused(case):
    gen = torch.Generator().manual_seed(3)
    iq = random_int_quantized(case, gen)
    with pytest.raises(ValueError, match=r"bits|act-order"):
        pack(case, iq)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 64, 4096])
def test_elementwise_bound_passes_a_rounded_kernel_and_catches_one_wrong_element(dtype, k):
    """The bound holds (with room) for a product computed as a kernel does -- weights rounded to the
    activation dtype, fp32 accumulation, the output rounded -- and fails when one element is off by
    10%, or NaN, which a relative norm over the whole output lets pass."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(17, k, generator=gen).to(dtype)
    w = torch.randint(-8, 8, (70, k), generator=gen).double() * 0.013
    bias = torch.randn(70, generator=gen).to(dtype)
    y = (x.float() @ w.to(dtype).float().t() + bias.float()).to(dtype)
    oracle.check_elementwise(y, x, w, bias, dtype, "as computed")
    ratio = (y.double() - oracle.matmul(x, w, bias)).abs() / oracle.elementwise_bound(x, w, bias, dtype)
    assert float(ratio.max()) < 0.5
    want = oracle.matmul(x, w, bias)
    r, c = divmod(int(want.abs().reshape(-1).argmax()), 70)
    for bad in (want[r, c] * 1.1, float("nan")):
        y_bad = y.clone()
        y_bad[r, c] = bad
        with pytest.raises(AssertionError, match=f"1 of {17 * 70} elements"):
            oracle.check_elementwise(y_bad, x, w, bias, dtype, "one wrong")
    oracle.check_elementwise(y[:0], x[:0], w, bias, dtype, "M = 0")
