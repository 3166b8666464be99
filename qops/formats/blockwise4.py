"""The meaning shared by 4-bit codebook checkpoints with one absmax per block (bitsandbytes NF4/FP4).

A weight ``W`` of shape ``(N, K)`` is read as one flat sequence in row-major order: element ``e``
is ``W[e // K, e % K]``. Consecutive runs of ``blocksize`` elements form blocks (a block may span
the end of one row and the start of the next when ``K % blocksize != 0``; the last block may be
partial), and

    W.flat[e] = code[codes.flat[e]] * absmax[e // blocksize]

with ``code`` a 16-entry float32 codebook and ``codes`` 4-bit indices. ``absmax`` is either float32
per block, or *nested* (bitsandbytes' double quantization): a uint8 index per block into a 256-entry
float32 codebook ``nested.code``, scaled per run of ``nested.blocksize`` blocks and shifted by one
float32 ``nested.offset``:

    absmax[b] = nested.code[absmax_u8[b]] * nested.absmax[b // nested.blocksize] + nested.offset

evaluated in float32, multiply first (as bitsandbytes de-nests before dequantizing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NESTED_BLOCKSIZE = 256  # what bitsandbytes uses for the second level


@dataclass
class NestedAbsmax:
    code: torch.Tensor  # (256,) float32, sorted
    absmax: torch.Tensor  # (ceil(n_blocks / blocksize),) float32
    offset: float  # a float32 value
    blocksize: int = NESTED_BLOCKSIZE


@dataclass
class Blockwise4Quantized:
    codes: torch.Tensor  # (N, K) uint8, values < 16
    code: torch.Tensor  # (16,) float32 codebook
    absmax: torch.Tensor  # (n_blocks,) float32, or uint8 indices into nested.code
    blocksize: int
    nested: NestedAbsmax | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def block_absmax(self) -> torch.Tensor:
        """float32 ``(n_blocks,)``: the absmax of each block, de-nested when nested."""
        return denest_absmax(self.absmax, self.nested)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``(N, K)``."""
        n, k = self.shape
        return dequantize_flat(self.codes, self.code, self.block_absmax(), self.blocksize, n, k)


def n_blocks_for(numel: int, blocksize: int) -> int:
    return -(-numel // blocksize)


def denest_absmax(absmax: torch.Tensor, nested: NestedAbsmax | None) -> torch.Tensor:
    if nested is None:
        return absmax.float()
    return denest(absmax, nested.code, nested.absmax, nested.offset, nested.blocksize)


def denest(absmax_u8, nested_code, nested_absmax, nested_offset, nested_blocksize: int) -> torch.Tensor:
    """float32 block absmax from uint8 indices; ``nested_offset`` a float or a float32 tensor of one value."""
    scale = nested_absmax.float().repeat_interleave(nested_blocksize)[: absmax_u8.numel()]
    offset = nested_offset.float().reshape(()) if isinstance(nested_offset, torch.Tensor) else torch.tensor(nested_offset, dtype=torch.float32)
    return nested_code.float()[absmax_u8.long()] * scale + offset


def dequantize_flat(codes: torch.Tensor, code: torch.Tensor, block_absmax: torch.Tensor, blocksize: int, n: int, k: int) -> torch.Tensor:
    """fp32 ``(N, K)`` from flat 4-bit ``codes`` (``N*K`` values), the codebook and float32 block absmax."""
    s = block_absmax.float().repeat_interleave(blocksize)[: n * k]
    return (code.float()[codes.reshape(-1).long()] * s).reshape(n, k)


def dynamic_map() -> torch.Tensor:
    """The 256-entry signed "dynamic" 8-bit map bitsandbytes quantizes nested absmax with.

    Seven decades ``10**(i-6)``, i = 0..6; decade i holds the midpoints of ``2**i + 1`` points
    spaced evenly over [0.1, 1] (float32), times the decade, with both signs; plus 0 and 1. Sorted.
    """
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        decade = 10.0 ** (i - 6)
        values += (decade * mids).tolist() + (-decade * mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index into ``code`` of the nearest value to each of ``scaled``; a tie goes to the smaller value."""
    order = torch.argsort(code)
    ordered = code[order]
    mids = (ordered[:-1] + ordered[1:]) / 2
    return order[torch.bucketize(scaled, mids)]


def _block_absmax_and_scaled(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Whole blocks are multiplied by the reciprocal of their absmax, a partial last block divided by
    # it: bitsandbytes' own quantizer does both, and matching it keeps checkpoints byte-identical.
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1).reshape(-1)
    if full < n:
        tail = flat[full:]
        am = tail.abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail.abs().amax().reshape(1)])
        scaled = torch.cat([scaled, (tail / am).clamp(-1, 1)])
    return absmax, scaled


def quantize_blockwise4(w: torch.Tensor, code: torch.Tensor, blocksize: int, nested: bool) -> Blockwise4Quantized:
    """Round-to-nearest codebook quantization of ``w`` (N, K) with one absmax per ``blocksize`` run.

    Each block is divided by its absolute maximum (computed in float32, multiplied by its
    reciprocal) and every value mapped to the nearest codebook entry. With ``nested``, the float32
    absmax minus their mean is quantized again with :func:`dynamic_map`, blocks of 256.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise4: w must be 2-D (N, K), got {w.dim()}-D")
    if blocksize <= 0:
        raise ValueError(f"quantize_blockwise4: blocksize must be positive, got {blocksize}")
    code = code.to(torch.float32)
    absmax, scaled = _block_absmax_and_scaled(w.reshape(-1).float(), blocksize)
    codes = _nearest(scaled, code).to(torch.uint8).reshape(w.shape)
    if not nested:
        return Blockwise4Quantized(codes=codes, code=code, absmax=absmax, blocksize=blocksize)
    offset = absmax.mean()
    code2 = dynamic_map()
    absmax2, scaled2 = _block_absmax_and_scaled(absmax - offset, NESTED_BLOCKSIZE)
    q2 = _nearest(scaled2, code2).to(torch.uint8)
    return Blockwise4Quantized(
        codes=codes, code=code, absmax=q2, blocksize=blocksize,
        nested=NestedAbsmax(code=code2, absmax=absmax2, offset=float(offset), blocksize=NESTED_BLOCKSIZE),
    )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (any shape, < 16) read flat -> uint8 ``(ceil(n/2),)``, element 2i in the HIGH nibble."""
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    return (flat[0::2] << 4) | flat[1::2]


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``numel`` uint8 codes, flat."""
    b = packed.reshape(-1)
    return torch.stack([b >> 4, b & 0xF], dim=-1).reshape(-1)[:numel]
