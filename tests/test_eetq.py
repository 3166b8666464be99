"""EETQ checkpoints: the FasterTransformer "ampere" byte order, the quantizer, the state dict.

The ops of the int8 family (which EETQ maps to) are checked over every registered format of the
family in ``tests/test_bitsandbytes.py``; here are the EETQ layout facts, against the loop
transcription of FasterTransformer's preprocessing in ``tests/bnb_cases.py``.
"""
from __future__ import annotations

import pytest
import torch

from qops.formats import FORMATS
from qops.formats import eetq as E

from tests import bnb_cases as C
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small CPU matmuls on one thread)

FMT = FORMATS["eetq"]


def test_row_permutation_is_the_documented_map():
    # Rows 0..15 of one 16-row group, written as the loop formula computes them.
    pos = C._permute_rows(torch.arange(16).reshape(16, 1).numpy())[:, 0].tolist()
    assert pos == list(E.ROW_PERMUTATION) == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]


@pytest.mark.parametrize("k,n", [(64, 64), (128, 64), (64, 192), (192, 128)])
def test_ampere_preprocess_matches_the_loops(k, n):
    q = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=torch.Generator().manual_seed(k + n))
    stored = E.ampere_preprocess(q)
    assert stored.shape == (k, n) and stored.dtype == torch.int8
    assert torch.equal(stored, C.eetq_preprocess(q))
    assert torch.equal(E.ampere_to_nk(stored), q.t().contiguous())


def test_ampere_byte_facts():
    # One 64x64 tile: q[k, n] = k (as int8) in every column; stored bytes are k + 128 (wrapped),
    # column pairs interleaved per 64 K values, bytes 1 and 2 of every 4 swapped, rows permuted.
    k, n = 64, 64
    q = torch.arange(k, dtype=torch.int8).reshape(k, 1).expand(k, n).contiguous()
    raw = E.ampere_preprocess(q).reshape(-1).view(torch.uint8).long()
    row = [E.ROW_PERMUTATION[i % 16] + 16 * (i // 16) for i in range(64)]  # step 1 on k
    want_first_col = [(v + 128) % 256 for v in row]
    for i in range(0, 64, 4):  # step 4
        want_first_col[i + 1], want_first_col[i + 2] = want_first_col[i + 2], want_first_col[i + 1]
    assert raw[:64].tolist() == want_first_col  # column 0, K 0..63
    assert raw[64:128].tolist() == want_first_col  # column 1 follows in the same tile (interleave 2)


def test_quantizer_facts():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 0.01171875, 1.5, 2.0]]).repeat(1, 16)  # N=3, K=64
    c = FMT.quantize(w, layout="row_major")
    assert c.weight.shape == (64, 3) and c.weight_scales.dtype == torch.float16
    assert torch.equal(c.weight_scales, torch.tensor([1 / 128, 0.0, 3 / 128]).half())  # max|w| / 128
    q = c.weight.t()[:, :4].tolist()
    assert q[0] == [127, -64, 32, 0]  # 1.0 / (1/128) = 128 clamps to 127
    assert q[1] == [0, 0, 0, 0]
    # -3 -> -128; 0.01171875 / (3/128) = 0.5 rounds half away from zero to 1; 1.5 -> 64; 2.0 -> 85.33 -> 85
    assert q[2] == [-128, 1, 64, 85]


def test_layouts_and_state_dict():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    amp = FMT.quantize(w)
    row = FMT.quantize(w, layout="row_major")
    assert amp.layout == "ampere" and torch.equal(amp.weight, E.ampere_preprocess(row.weight))
    assert torch.equal(FMT.dequantize(amp), FMT.dequantize(row))
    assert C.rel_err(FMT.dequantize(amp), C.eetq(amp.weight, amp.weight_scales, "ampere")) == 0
    assert C.rel_err(FMT.dequantize(amp), w.double()) < 1e-2
    sd = FMT.to_state_dict(amp, prefix="m.")
    assert set(sd) == {"m.weight", "m.weight_scales"}
    back = FMT.from_state_dict(sd, prefix="m.")
    assert torch.equal(back.weight, amp.weight) and back.layout == "ampere"
    assert torch.equal(FMT.pack(FMT.unpack(amp)).weight, amp.weight)


def test_refusals():
    with pytest.raises(ValueError, match="ampere layout needs K and N multiples of 64"):
        FMT.quantize(torch.randn(33, 97))
    with pytest.raises(ValueError, match="layout must be one of"):
        FMT.quantize(torch.randn(64, 64), layout="sm90")
    with pytest.raises(ValueError, match="bits=8, group_size=-1"):
        FMT.quantize(torch.randn(64, 64), bits=4)
    with pytest.raises(ValueError, match=r"weight_scales must be floating point of shape \(64,\)"):
        FMT.from_state_dict({"weight": torch.zeros(64, 64, dtype=torch.int8), "weight_scales": torch.zeros(32)})
