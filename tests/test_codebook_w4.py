"""The 4-bit codebook layout of the W4A16 decode kernel's table path (qops.native.codebook_w4), on the CPU:
the packing against an independent bit-level decode, the float64 oracle against the bitsandbytes
formula, and the refusals. The kernel itself runs in tests/gpu/test_gpu_codebook_w4.py; its builds
compile in tests/test_native_compile.py."""
from __future__ import annotations

import contextlib
import unittest.mock as mock

import pytest
import torch

from qops.formats.bitsandbytes import codebook
from qops.native import codebook_w4 as cw


# An H200's facts for the plan a refusal checks (132 SMs, clusters, the opt-in shared memory less the
# kernel's static), in place of a device this machine does not have.
H200_SMEM = 227 * 1024 - 1024


@pytest.fixture(autouse=True)
def h200_plans(monkeypatch):
    monkeypatch.setattr(cw.niw, "plan", lambda m, n, k, device: cw.niw._plan(m, n, k, 132, True))
    monkeypatch.setattr(cw.niw, "smem_optin_bytes", lambda device: H200_SMEM)


def _codes(n, k, seed=0):
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,k", [(32, 8), (64, 384), (96, 136)])
def test_pack_unpack_round_trip(n, k):
    codes = _codes(n, k)
    q = cw.pack_codes(codes)
    assert q.dtype == torch.int32 and tuple(q.shape) == (n // 32, k // 8, 32)
    assert torch.equal(cw.unpack_codes(q), codes)


def test_pack_bit_positions():
    """Word (kw, n) at q[n // 32, kw, n % 32]; its byte r holds the code of row 8 kw + r in the high
    nibble and of row 8 kw + r + 4 in the low: decoded here bit by bit from a Python int."""
    n, k = 64, 32
    codes = _codes(n, k, seed=3)
    q = cw.pack_codes(codes)
    for col in (0, 5, 33, 63):
        for kw in range(k // 8):
            word = int(q[col // 32, kw, col % 32]) & 0xFFFFFFFF
            for r in range(4):
                byte = (word >> (8 * r)) & 0xFF
                assert byte >> 4 == codes[col, 8 * kw + r]
                assert byte & 15 == codes[col, 8 * kw + r + 4]


def test_reference_matches_the_codebook_formula():
    """reference_mm against W[n, k] = code[c(n, k)] * absmax[k // 64, n] written out with loops."""
    n, k, m = 32, 128, 3
    codes = _codes(n, k, seed=5)
    scales = (torch.rand(k // 64, n, generator=torch.Generator().manual_seed(6)) + 0.5).to(torch.float16)
    code = codebook("nf4")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    w = torch.empty(n, k, dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            w[i, j] = float(code[int(codes[i, j])]) * float(scales[j // 64, i])
    got = cw.reference_mm(x, cw.pack_codes(codes), scales, code)
    assert torch.allclose(got, x @ w.t(), rtol=1e-12, atol=1e-12)


def test_pack_refuses_shapes_off_the_slabs():
    with pytest.raises(ValueError, match="N % 32"):
        cw.pack_codes(_codes(48, 16))
    with pytest.raises(ValueError, match="K % 8"):
        cw.pack_codes(_codes(32, 12))


def test_refusal_names_the_device():
    n, k = 32, 128
    q = cw.pack_codes(_codes(n, k))
    s = torch.ones(k // 64, n, dtype=torch.float16)
    x = torch.randn(1, k, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        cw.codebook_mm(x, q, s, codebook("nf4"))


def test_refusals_name_the_argument():
    """Each argument's own message, past the device check (no GPU here: tensors report a CUDA device)."""
    n, k = 32, 128
    q = cw.pack_codes(_codes(n, k))
    s = torch.ones(k // 64, n, dtype=torch.float16)
    code = codebook("nf4")
    x = torch.randn(1, k, dtype=torch.float16)
    cases = {
        "x must be float16": (x.float(), q, s, code),
        "qweight must be int32": (x, q.to(torch.int64), s, code),
        "x's last dimension": (torch.randn(1, k + 8, dtype=torch.float16), q, s, code),
        "scales must be": (x, q, s.float(), code),
        "codebook must be": (x, q, s, code.double()),
        "takes at most 32": (torch.randn(33, k, dtype=torch.float16), q, s, code),
    }
    for want, args in cases.items():
        with mock.patch.object(torch.Tensor, "device", new_callable=mock.PropertyMock, return_value=_OnCuda()):
            why = cw.refusal(*args)
        assert why is not None and want in why, (want, why)
    with mock.patch.object(torch.Tensor, "device", new_callable=mock.PropertyMock, return_value=_OnCuda()):
        assert cw.refusal(x, q, s, code) is None


def test_refusals_name_what_the_decode_kernel_cannot_address():
    """A qweight slice (its slab stride is not K/8 * 32 words: the kernel would read the wrong slabs) and
    scales off 8-byte alignment (its vector loads fault) are refused as int_weight refuses them."""
    n, k = 64, 128  # two slabs: a slice of one would still be contiguous
    q = cw.pack_codes(_codes(n, k))
    sliced = cw.pack_codes(_codes(n, 2 * k))[:, : k // 8, :]
    s = torch.ones(k // 64, n, dtype=torch.float16)
    misaligned = torch.ones(s.numel() + 1, dtype=torch.float16)[1:].view(k // 64, n)
    code = codebook("nf4")
    x = torch.randn(1, k, dtype=torch.float16)
    with mock.patch.object(torch.Tensor, "device", new_callable=mock.PropertyMock, return_value=_OnCuda()):
        assert cw.refusal(x, sliced, s, code) == "qweight is not contiguous and 16-byte aligned"
        assert cw.refusal(x, q, misaligned, code) == "scales are not contiguous and 8-byte aligned"


def test_codebook_mm_launches_on_xs_device(monkeypatch):
    """x on cuda:1 while another device is current: the launch runs with x's device current (its stream)."""
    n, k = 32, 128
    seen = []

    @contextlib.contextmanager
    def device(index):
        seen.append(("enter", index))
        yield
        seen.append(("exit", index))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(cw.niw, "_launch", lambda *a, **k: seen.append(("launch", a[13])))
    args = (torch.randn(1, k, dtype=torch.float16), cw.pack_codes(_codes(n, k)), torch.ones(k // 64, n, dtype=torch.float16), codebook("nf4"))
    with mock.patch.object(torch.Tensor, "device", new_callable=mock.PropertyMock, return_value=_OnCuda(index=1)):
        cw.codebook_mm(*args)
    assert seen == [("enter", 1), ("launch", 1), ("exit", 1)]


class _OnCuda:
    """A device that says it is CUDA and equal to every other."""
    type = "cuda"

    def __init__(self, index: int = 0):
        self.index = index

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


@pytest.mark.parametrize("n,k,fits", [(4096, 14336, 16), (28672, 4096, 20), (4096, 4096, 32)])
def test_refusal_names_rows_whose_table_plan_does_not_fit(n, k, fits):
    """x staged once beside the codebook table outgrows a block's shared memory before MAX_M rows on
    long-K shapes (an H200's plans): refused naming x's rows and the bytes, not raised from the launch
    as the int weights' error."""
    for m in range(1, cw.niw.MAX_M + 1):
        why = cw.plan_refusal(m, n, k, 0)
        if m <= fits:
            assert why is None, (m, why)
        else:
            assert why.startswith(f"x has {m} rows, whose plan for N = {n}, K = {k} with the codebook table cannot launch") and "bytes" in why, why
