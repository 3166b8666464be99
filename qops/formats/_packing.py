"""Bit-stream packing of small unsigned integers into int32 words.

Every integer layout qops reads stores values as a little-endian bit stream along one dimension:
element ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the stream, word ``j`` holds stream bits
``[32*j, 32*j+32)``. For bits in {2, 4, 8} no value crosses a word; for 3 bits, 32 values fill
exactly 3 words and values 10 and 21 of each run straddle two words (GPTQ's 3-bit layout).
The stream is padded with zero bits up to a whole word.
"""
from __future__ import annotations

import torch

_MASK32 = (1 << 32) - 1


def packed_length(length: int, bits: int) -> int:
    """Number of int32 words holding ``length`` values of ``bits`` bits."""
    return (length * bits + 31) // 32


def _to_int32(words64: torch.Tensor) -> torch.Tensor:
    # Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement wrap).
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def pack_bits(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``values`` (< 2**bits) along ``dim`` into int32 words."""
    dim = dim % values.dim()
    v = values.movedim(dim, -1).to(torch.int64)
    length = v.shape[-1]
    n_words = packed_length(length, bits)
    if 32 % bits == 0:
        per = 32 // bits
        pad = n_words * per - length
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))
        v = v.reshape(*v.shape[:-1], n_words, per)
        shifts = torch.arange(per, dtype=torch.int64, device=v.device) * bits
        words = (v << shifts).sum(-1)
    else:
        pos = torch.arange(length, dtype=torch.int64, device=v.device) * bits
        word, off = pos // 32, pos % 32
        lo = (v << off) & _MASK32
        words = torch.zeros(*v.shape[:-1], n_words + 1, dtype=torch.int64, device=v.device)
        words.index_add_(-1, word, lo)
        # High part of values that straddle a word boundary goes to the next word.
        hi = torch.where(off + bits > 32, v >> (32 - off).clamp(max=63), torch.zeros_like(v))
        words.index_add_(-1, word + 1, hi)
        words = words[..., :n_words]
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``length`` unsigned values along ``dim``, as uint8 when bits <= 8."""
    dim = dim % packed.dim()
    w = packed.movedim(dim, -1).to(torch.int64) & _MASK32
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = torch.arange(per, dtype=torch.int64, device=w.device) * bits
        v = ((w.unsqueeze(-1) >> shifts) & mask).reshape(*w.shape[:-1], -1)[..., :length]
    else:
        pos = torch.arange(length, dtype=torch.int64, device=w.device) * bits
        word, off = pos // 32, pos % 32
        w_ext = torch.nn.functional.pad(w, (0, 1))
        lo = w_ext.index_select(-1, word) >> off
        hi = w_ext.index_select(-1, word + 1) << (32 - off)
        v = (lo | hi) & mask
    out_dtype = torch.uint8 if bits <= 8 else torch.int32
    return v.to(out_dtype).movedim(-1, dim).contiguous()
