"""The two byte orders of a 4-bit blockwise weight (``qops.ops.blockwise4``: ``LAYOUT_FLAT``, the
checkpoint's stream, and ``LAYOUT_TILE16``, what the native lowering reads) on the CPU.

Where each byte goes is checked against the layout's formula written out here element by element;
the ops on tile16 weights against the float64 oracles of ``tests/bnb_cases.py`` and against the same
weight in the flat order (the reference kernel computes identical values from both); the Triton dense
path under the interpreter; and the errors for a layout a shape has no form in, eagerly and under
fake tensors. The native kernel's reads of tile16 are checked on the GPU
(``tests/gpu/test_gpu_native_blockwise4.py``).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qops.ops import blockwise4 as bw4
from qops.ops.blockwise4 import LAYOUT_FLAT, LAYOUT_TILE16, from_tile16, to_tile16

from tests import bnb_cases as C
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small CPU matmuls on one thread)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed on this platform")

# Shapes with a tile16 form (N % 16 == 0, K % 128 == 0): two tiles and three chunks, one tile and
# two chunks; nested and plain absmax, blocks of 64 (two a chunk) and 128 (one).
TILED_CASES = (
    C.Case("bitsandbytes-nf4", 32, 384, blocksize=64, nested=True),
    C.Case("bitsandbytes-fp4", 16, 256, blocksize=128, nested=False),
)


def tile16_oracle(flat: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The tile16 bytes from the layout's definition, one byte at a time."""
    row_bytes = k // 2
    out = torch.empty_like(flat)
    for row in range(n):
        for kb in range(row_bytes):
            out[(row // 16) * 16 * row_bytes + (kb // 64) * 1024 + (row % 16) * 64 + kb % 64] = flat[row * row_bytes + kb]
    return out


def tiled(case: C.Case, dtype: torch.dtype | None = None):
    """(flat weight, the same prepared in tile16, float64 oracle W)."""
    b = C.build(case, dtype)
    return b.weight, C.as_tile16(b.weight), b.w64


@pytest.mark.parametrize("n, k", [(16, 128), (48, 384), (32, 1024)])
def test_tile16_puts_each_byte_where_the_layout_says(n, k):
    flat = torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    t = to_tile16(flat, n, k)
    assert t.shape == flat.shape and t.is_contiguous()
    assert torch.equal(t, tile16_oracle(flat, n, k))
    assert torch.equal(from_tile16(t, n, k), flat)


def test_tile16_fits_only_whole_tiles_and_chunks():
    assert bw4.tile16_fits(16, 128) and bw4.tile16_fits(4096, 14336)
    assert not bw4.tile16_fits(24, 256) and not bw4.tile16_fits(32, 192) and not bw4.tile16_fits(1000, 2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: c.id)
def test_ops_on_tile16_match_the_oracle_and_the_flat_order(case, dtype):
    flat, t, w64 = tiled(case, dtype)
    assert t.layout == LAYOUT_TILE16 and flat.layout == LAYOUT_FLAT  # the CPU chooses the reference: flat by default
    assert not torch.equal(t.qweight, flat.qweight)  # the bytes did move
    assert t.nbytes() == flat.nbytes()
    gen = torch.Generator().manual_seed(C.seed_of(case))
    for m in (0, 1, 17, 257):
        x = torch.randn(m, case.k, generator=gen).to(dtype)
        bias = torch.randn(case.n, generator=gen).to(dtype) if m % 2 else None
        y = t.mm(x, bias)
        assert torch.equal(y, flat.mm(x, bias)), m
        if m:
            assert C.rel_err(y, C.matmul(x, w64, bias)) <= C.TOL[dtype], m
        out = torch.full((m, case.n), float("nan"), dtype=dtype)
        torch.ops.qops.mm_blockwise4_out(x, *t._weight_args(), bias, *t._static_args(), int(t.kernel), out, None)
        assert torch.equal(out, y)
    xt = torch.randn(case.k, 3, generator=gen).to(dtype).t()  # non-contiguous rows
    assert torch.equal(t.mm(xt), flat.mm(xt))
    assert torch.equal(t.dequantize(), flat.dequantize())


def test_gradient_through_tile16():
    flat, t, w64 = tiled(TILED_CASES[0])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, TILED_CASES[0].k, generator=gen).requires_grad_()
    g = torch.randn(5, TILED_CASES[0].n, generator=gen)
    t.mm(x).backward(g)
    assert C.rel_err(x.grad, g.double() @ w64) <= C.TOL[torch.float32]


def test_prepare_refuses_a_layout_the_shape_has_no_form_in():
    w = C.build(C.BLOCKWISE4_CASES[4]).weight  # 24 x 256: N % 16 != 0
    kw = dict(qweight=w.qweight, code=w.code, absmax=w.absmax, nested_code=w.nested_code, nested_absmax=w.nested_absmax,
              nested_offset=w.nested_offset, out_features=w.out_features, in_features=w.in_features, blocksize=w.blocksize,
              nested_blocksize=w.nested_blocksize)
    with pytest.raises(ValueError, match=r"prepare_blockwise4: layout=1 \(tile16\) needs N % 16 == 0 and K % 128 == 0, got N=24"):
        bw4.prepare_blockwise4(**kw, layout=LAYOUT_TILE16)
    with pytest.raises(ValueError, match="prepare_blockwise4: layout must be one of"):
        bw4.prepare_blockwise4(**kw, layout=7)
    flat = bw4.prepare_blockwise4(**kw)
    assert flat.layout == LAYOUT_FLAT and flat.with_layout(LAYOUT_FLAT) is flat
    with pytest.raises(ValueError, match=r"Blockwise4Weight.with_layout: layout=1 \(tile16\) needs N % 16 == 0"):
        flat.with_layout(LAYOUT_TILE16)


def test_with_layout_round_trips():
    flat, t, _ = tiled(TILED_CASES[0])
    back = t.with_layout(LAYOUT_FLAT)
    assert back.layout == LAYOUT_FLAT and torch.equal(back.qweight, flat.qweight)
    assert torch.equal(back.with_layout(LAYOUT_TILE16).qweight, t.qweight)


def test_preferred_layout_is_tile16_for_the_native_kernel_only():
    from qops.lowerings import Kernel

    assert bw4.preferred_layout(Kernel.NATIVE, 4096, 14336) == LAYOUT_TILE16
    assert bw4.preferred_layout(Kernel.NATIVE, 1000, 2048) == LAYOUT_FLAT  # no tile16 form
    assert bw4.preferred_layout(Kernel.TRITON, 4096, 14336) == LAYOUT_FLAT
    assert bw4.preferred_layout(Kernel.REFERENCE, 4096, 14336) == LAYOUT_FLAT


@pytest.mark.parametrize("fake", [False, True], ids=["eager", "fake"])
@pytest.mark.parametrize("layout, message", [(2, r"mm_blockwise4: layout must be one of \{0: 'flat', 1: 'tile16'\}"),
                                             (1, r"mm_blockwise4: layout=1 \(tile16\) needs N % 16 == 0 and K % 128 == 0, got N=24, K=256")])
def test_op_errors_name_the_layout(layout, message, fake):
    w = C.build(C.BLOCKWISE4_CASES[4]).weight
    args = [torch.randn(3, w.in_features), *w._weight_args(), None, *w._static_args(), int(w.kernel)]
    args[12] = layout
    if fake:
        mode = FakeTensorMode()
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode, pytest.raises(ValueError, match=message):
            torch.ops.qops.mm_blockwise4(*args)
    else:
        with pytest.raises(ValueError, match=message):
            torch.ops.qops.mm_blockwise4(*args)


def test_fake_kernels_take_tile16():
    _, t, _ = tiled(TILED_CASES[0], torch.float16)
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, TILED_CASES[0].k, dtype=torch.float16)
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in t._weight_args()]
        y = torch.ops.qops.mm_blockwise4(x, *args, None, *t._static_args(), int(t.kernel))
        w = torch.ops.qops.dequantize_blockwise4(*args, *t._static_args(), torch.float16)
    assert y.shape == (4, TILED_CASES[0].n) and w.shape == (TILED_CASES[0].n, TILED_CASES[0].k)


@pytest.mark.interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: c.id)
def test_triton_reads_tile16_through_its_dense_path(case, dtype):
    # Every M: only the dense path's dequantization kernel reads tile16. Slabs of 8 rows start
    # mid-tile (slab_bytes 1), a partial last slab follows where N is not a multiple of 8 slabs.
    from qops.ops.triton import blockwise4 as tbw4

    flat, t, w64 = tiled(case)
    gen = torch.Generator().manual_seed(C.seed_of(case) + 2)
    bias = torch.randn(case.n, generator=gen).to(dtype)
    for m, slab_bytes in ((1, 1), (5, 128 << 20), (33, 1)):
        x = torch.randn(m, case.k, generator=gen).to(dtype)
        assert tbw4.plan(m, case.n, case.k, case.blocksize, x.device, dtype, dense=True)["path"] == "dense"
        with tbw4.config_override(slab_bytes=slab_bytes):
            y = tbw4.triton_mm(x, *t._weight_args(), bias, t.out_features, t.blocksize, t.nested_blocksize, t.layout)
        assert C.rel_err(y, C.matmul(x, w64, bias)) <= (2e-6 if dtype == torch.float32 else 2e-3), (m, slab_bytes)

