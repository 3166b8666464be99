"""A float64 reference for every integer checkpoint layout, written from FORMATS.md alone.

Nothing here imports qops: the unpacking is a different algorithm from qops' (each int32 word is
exploded into its 32 bits, the bits are laid end to end, and every value is read back bit by bit),
so a shared misreading of a layout cannot hide a bug in both. Every function takes the checkpoint
tensors exactly as stored and returns the dequantized weight ``W`` as a float64 ``(N, K)`` tensor
(N = out_features, K = in_features), which is exact: scales of at most 24 significant bits times
integers below 2**9 fit in float64's 53.

The packers (``pack_stream``, ``awq_pack``) exist so tests can hand-build checkpoints without qops.
"""
from __future__ import annotations

import numpy as np
import torch

_WORD_BITS = 32
# AWQ GEMM: nibble i of a word holds column 8c + AWQ_NIBBLE_COLUMN[i] of its group of eight columns.
AWQ_NIBBLE_COLUMN = (0, 2, 4, 6, 1, 3, 5, 7)


def _np_int(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().to(torch.int64).numpy()
    return np.asarray(t, dtype=np.int64)


def _np_float(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def words_to_bits(words) -> np.ndarray:
    """int32 words ``(..., W)`` -> bits ``(..., 32*W)``: bit b of word j is stream position 32*j + b."""
    w = _np_int(words) & 0xFFFFFFFF
    bits = (w[..., None] >> np.arange(_WORD_BITS, dtype=np.int64)) & 1
    return bits.reshape(*w.shape[:-1], w.shape[-1] * _WORD_BITS)


def unpack_stream(words, bits: int, length: int) -> np.ndarray:
    """Values ``[0, length)`` of a little-endian ``bits``-wide stream held along the last axis of ``words``.

    Value i is made of stream bits ``i*bits .. i*bits+bits-1`` (least significant first), whether or
    not they lie in one word: 3-bit values 10 and 21 of every 32 straddle two words.
    """
    stream = words_to_bits(words)
    need = length * bits
    if stream.shape[-1] < need:
        raise ValueError(f"oracle: {stream.shape[-1]} stream bits cannot hold {length} values of {bits} bits")
    if stream.shape[-1] - need >= _WORD_BITS:
        raise ValueError(f"oracle: {stream.shape[-1]} stream bits hold more than a padding word beyond {length} values of {bits} bits")
    per_value = stream[..., :need].reshape(*stream.shape[:-1], length, bits)
    weights = np.int64(1) << np.arange(bits, dtype=np.int64)
    return (per_value * weights).sum(-1)


def pack_stream(values, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_stream` along the last axis; returns int32 words, zero padded."""
    v = _np_int(values)
    if v.size and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"oracle: values must lie in [0, {1 << bits})")
    length = v.shape[-1]
    n_words = -(-length * bits // _WORD_BITS)
    stream = ((v[..., None] >> np.arange(bits, dtype=np.int64)) & 1).reshape(*v.shape[:-1], length * bits)
    pad = n_words * _WORD_BITS - length * bits
    stream = np.concatenate([stream, np.zeros((*v.shape[:-1], pad), dtype=np.int64)], axis=-1)
    words = (stream.reshape(*v.shape[:-1], n_words, _WORD_BITS) << np.arange(_WORD_BITS, dtype=np.int64)).sum(-1)
    words = np.where(words >= 1 << 31, words - (1 << 32), words)
    return torch.from_numpy(words.astype(np.int32))


def _groups(k: int, group_size: int, g_idx) -> np.ndarray:
    if g_idx is not None:
        return _np_int(g_idx)
    if group_size == -1:
        return np.zeros(k, dtype=np.int64)
    return np.arange(k, dtype=np.int64) // group_size


def _dequant(q_nk: np.ndarray, z_ng: np.ndarray, s_ng: np.ndarray, g: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(s_ng[:, g] * (q_nk - z_ng[:, g]).astype(np.float64))


def gptq(qweight, qzeros, scales, g_idx, *, bits: int, group_size: int, in_features: int, version: str) -> torch.Tensor:
    """GPTQ: qweight ``(ceil(K*b/32), N)`` packed along K, qzeros ``(G, ceil(N*b/32))`` packed along N,
    scales ``(G, N)``; v1 stores ``zero - 1``."""
    k = in_features
    n = qweight.shape[1]
    q = unpack_stream(_np_int(qweight).T, bits, k)  # (N, K)
    z = unpack_stream(qzeros, bits, n).T  # (N, G)
    if version == "v1":
        z = z + 1
    elif version != "v2":
        raise ValueError(f"oracle: unknown GPTQ version {version!r}")
    return _dequant(q, z, _np_float(scales).T, _groups(k, group_size, g_idx))


def awq(qweight, qzeros, scales, *, group_size: int) -> torch.Tensor:
    """AWQ GEMM: qweight ``(K, N/8)``, qzeros ``(G, N/8)``, nibbles interleaved along N."""

    def columns(words) -> np.ndarray:
        w = _np_int(words) & 0xFFFFFFFF
        rows, n_words = w.shape
        out = np.empty((rows, 8 * n_words), dtype=np.int64)
        for c in range(n_words):
            for nibble, col in enumerate(AWQ_NIBBLE_COLUMN):
                out[:, 8 * c + col] = (w[:, c] >> (4 * nibble)) & 0xF
        return out

    q = columns(qweight).T  # (N, K)
    z = columns(qzeros).T  # (N, G)
    return _dequant(q, z, _np_float(scales).T, _groups(q.shape[1], group_size, None))


def awq_pack(values) -> torch.Tensor:
    """``(R, N)`` nibbles -> ``(R, N/8)`` int32 words in AWQ's interleaved order."""
    v = _np_int(values)
    rows, n = v.shape
    words = np.zeros((rows, n // 8), dtype=np.int64)
    for c in range(n // 8):
        for nibble, col in enumerate(AWQ_NIBBLE_COLUMN):
            words[:, c] |= v[:, 8 * c + col] << (4 * nibble)
    words = np.where(words >= 1 << 31, words - (1 << 32), words)
    return torch.from_numpy(words.astype(np.int32))


def compressed_tensors(weight_packed, weight_scale, weight_shape, weight_zero_point, weight_g_idx, *, bits: int, group_size: int) -> torch.Tensor:
    """pack-quantized: weight_packed ``(N, ceil(K*b/32))`` along K, values stored + 2**(b-1);
    weight_zero_point ``(ceil(N*b/32), G)`` packed along dim 0 with the same offset, or None
    (symmetric: signed zero point 0)."""
    n, k = (int(v) for v in _np_int(weight_shape))
    offset = 1 << (bits - 1)
    q_signed = unpack_stream(weight_packed, bits, k) - offset  # (N, K)
    s = _np_float(weight_scale)
    if weight_zero_point is None:
        z_signed = np.zeros((n, s.shape[1]), dtype=np.int64)
    else:
        z_signed = unpack_stream(_np_int(weight_zero_point).T, bits, n).T - offset  # (N, G)
    return _dequant(q_signed, z_signed, s, _groups(k, group_size, weight_g_idx))


def dequantize(format_name: str, checkpoint) -> torch.Tensor:
    """The float64 ``(N, K)`` weight of a qops checkpoint object, read only through its stored tensors."""
    c = checkpoint
    if format_name == "gptq":
        return gptq(c.qweight, c.qzeros, c.scales, c.g_idx, bits=c.bits, group_size=c.group_size,
                    in_features=c.in_features, version=c.version)
    if format_name == "awq":
        return awq(c.qweight, c.qzeros, c.scales, group_size=c.group_size)
    if format_name == "compressed-tensors":
        return compressed_tensors(c.weight_packed, c.weight_scale, c.weight_shape, c.weight_zero_point,
                                  c.weight_g_idx, bits=c.bits, group_size=c.group_size)
    raise KeyError(f"oracle: no reference for format {format_name!r}; add one to tests/oracle.py")


def stride_two(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s values in a view whose last dimension has stride 2, the elements between them ``t``'s
    reversed (valid values of the same kind: a kernel that reads them as if the view were
    contiguous gives a wrong answer, not a crash). None stays None."""
    if t is None:
        return None
    wide = torch.stack([t, t.flip(-1)], dim=-1)
    return wide.select(-1, 0)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ w.T + bias`` for the oracle weight ``w`` (N, K)."""
    y = x.detach().double() @ w.t()
    if bias is not None:
        y = y + bias.detach().double()
    return y



# Unit roundoff of the arithmetic a kernel may use for each activation dtype: the output's own rounding, and
# the rounding of a dequantized weight to the MMA's input type. fp32 activations may go through TF32 MMAs
# (10-bit mantissa), so they get TF32's.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-11}


def elementwise_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                      c_out: float = 2.0, c_dot: float = 8.0) -> torch.Tensor:
    """Per-element error bound of a dot-product kernel against float64 ``x @ w.T + bias``.

    Two kinds of rounding move an output. Rounding the result (and a bias) to ``dtype`` moves it by
    at most a unit roundoff of its own size: ``c_out * u * (|y| + |bias|)``. Rounding each weight (or
    a TF32 x) to the MMA's input type, and fp32 accumulation, perturb the K terms independently, so
    their sum moves like ``u * sqrt(sum_k (x_k w_k)**2)`` (a random-walk size, not the worst case
    ``u * sum_k |x_k w_k|``, which is ~sqrt(K) looser and would let a 5% error in one element pass);
    ``c_dot`` = 8 is ~14 standard deviations of that sum, room for the kernels that round twice (a
    zero point times a scale, then the difference) or keep split-K partials in the output dtype.
    The smallest subnormal covers outputs that round to zero. Unlike one relative norm over the whole
    output, this catches a single wrong element.
    """
    x64, w64 = x.detach().double(), w.double()
    y = x64 @ w64.t()
    spread = (x64 * x64) @ (w64 * w64).t()
    bound = c_out * y.abs() + c_dot * spread.sqrt()
    if bias is not None:
        bound = bound + c_out * bias.detach().double().abs()
    return UNIT_ROUNDOFF[dtype] * bound + torch.finfo(dtype).smallest_normal * 2.0**-10


def check_elementwise(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype, what: str = "", **bound_kw) -> None:
    """Every element of ``got`` within :func:`elementwise_bound` of float64 ``x @ w.T + bias``.

    ``x`` is what the kernel read (already in its activation dtype) and ``w`` the exact float64 weight.
    The message names the worst element, its error and its bound.
    """
    want = matmul(x, w, bias)
    bound = elementwise_bound(x, w, bias, dtype, **bound_kw)
    err = (got.detach().double() - want).abs()
    ratio = (err / bound).reshape(-1)
    if ratio.numel() and not bool((ratio <= 1).all()):
        worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
        idx = tuple(int(i) for i in np.unravel_index(worst, tuple(err.shape)))
        raise AssertionError(
            f"{what}: {int((~(ratio <= 1)).sum())} of {ratio.numel()} elements past the elementwise bound; worst at "
            f"{idx}: error {float(err.reshape(-1)[worst]):.3e}, bound {float(bound.reshape(-1)[worst]):.3e}")
