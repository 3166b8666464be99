"""FP8 e4m3fn weight checkpoints: per-tensor, per-channel and block scales.

The element type is ``float8_e4m3fn``: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
infinities, one NaN pattern per sign (0x7F/0xFF), largest finite value 448, smallest subnormal 2**-9.
"Packing" is the identity: one byte per weight, ``(N, K)`` row-major as ``torch.nn.Linear`` holds it.

A weight ``W`` of shape ``(N, K)`` (N = out_features, K = in_features) is

    W[n, k] = float(q[n, k]) * scale[n // block_n, k // block_k]

with ``block_n == -1`` (``block_k == -1``) meaning one block spanning all of N (K), so ``scale`` has
shape ``(1 if block_n == -1 else ceil(N / block_n), 1 if block_k == -1 else ceil(K / block_k))``.
The granularities the checkpoints use:

- per-tensor: ``block_n = block_k = -1``, scale ``(1, 1)``;
- per-channel: ``block_n = 1, block_k = -1``, scale ``(N, 1)``;
- blocks: ``block_n = bn, block_k = bk`` (128 x 128 in practice), scale ``(ceil(N/bn), ceil(K/bk))``;
  N and K need not be multiples of the block: the last row/column of blocks is partial.

Checkpoint layouts read here (tensor names exactly as stored; scales are fp32):

- ``fp8`` (vLLM / AutoFP8 serialisation, fbgemm-style per-channel): ``weight`` float8_e4m3fn
  ``(N, K)``; ``weight_scale`` ``(1,)`` (or a 0-d scalar, older writers) per-tensor, or ``(N, 1)``
  per-channel; optional ``input_scale`` ``(1,)`` (or 0-d): a static per-tensor activation scale.
- ``compressed-tensors-fp8`` (``quant_method == "compressed-tensors"``, format ``float-quantized``):
  the same tensor names; additionally the ``block`` strategy stores ``weight_scale`` as
  ``(ceil(N/bn), ceil(K/bk))`` with ``block_structure: [bn, bk]`` in the config.
- ``fp8-block`` (DeepSeek-V3 / HF ``quant_method == "fp8"`` with ``weight_block_size: [128, 128]``):
  ``weight`` float8_e4m3fn ``(N, K)`` and ``weight_scale_inv`` ``(ceil(N/bn), ceil(K/bk))``. Despite
  its name ``weight_scale_inv`` multiplies: ``W = q * weight_scale_inv``. No static input scale.

Activations (W8A8) use the same element type with ``x = x_fp8 * x_scale``, ``x_scale`` per tensor
(``input_scale``) or per token (computed at run time, ``qops.ops.fp8.quantize_fp8_activations``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CheckpointFormat
from .integer import check_integer

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Scales are amax times this (rounded to fp32 by the multiply), never amax / 448: CUDA divides a tensor by
# a Python number as a multiply by its fp32 reciprocal and the CPU divides, so a quotient's last bit (and
# with it the e4m3 code of a value at a rounding tie) depended on the device; one multiply by one fp32
# constant rounds alike on every device, eager or compiled.
FP8_MAX_INV = 1.0 / FP8_MAX
GRANULARITIES = ("tensor", "channel", "block")
DEFAULT_BLOCK = (128, 128)


def scale_shape(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    """Shape of the scale grid for an ``(n, k)`` weight with blocks ``block_n x block_k`` (-1: whole dim)."""
    return (1 if block_n == -1 else -(-n // block_n), 1 if block_k == -1 else -(-k // block_k))


def check_block(block: int, name: str, *, who: str) -> None:
    check_integer(block, name, who=who)
    if block != -1 and block <= 0:
        raise ValueError(f"{who}: {name} must be -1 (one block spanning the dimension) or positive, got {block}")


def granularity_of(block_n: int, block_k: int) -> str:
    if block_k == -1 and block_n == -1:
        return "tensor"
    if block_k == -1 and block_n == 1:
        return "channel"
    return "block"


def expand_scale(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """The fp32 scale of every weight element, ``(n, k)`` (a broadcast view where a block spans a dim)."""
    s = scale.float()
    if block_n != -1:
        s = s.repeat_interleave(block_n, dim=0)[:n]
    if block_k != -1:
        s = s.repeat_interleave(block_k, dim=1)[:, :k]
    return s.expand(n, k)


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """fp32 ``(N, K)`` weight, straight from the definition (pure torch)."""
    n, k = q.shape
    return q.float() * expand_scale(scale, n, k, block_n, block_k)


@dataclass
class Fp8Quantized:
    """The meaning shared by every FP8 checkpoint layout."""

    q: torch.Tensor  # (N, K) float8_e4m3fn
    scale: torch.Tensor  # scale_shape(N, K, block_n, block_k) float32
    block_n: int  # -1: one block over all of N (per-tensor); 1: per-channel
    block_k: int  # -1: one block over all of K
    input_scale: torch.Tensor | None = None  # (1,) float32, static per-tensor activation scale

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def granularity(self) -> str:
        return granularity_of(self.block_n, self.block_k)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``(N, K)``."""
        return dequantize_reference(self.q, self.scale, self.block_n, self.block_k)


def blocks_for(granularity: str, block_size: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """``(block_n, block_k)`` of a granularity name."""
    if granularity == "tensor":
        return -1, -1
    if granularity == "channel":
        return 1, -1
    if granularity == "block":
        bn, bk = block_size
        check_block(bn, "block_size[0]", who="fp8")
        check_block(bk, "block_size[1]", who="fp8")
        return bn, bk
    raise ValueError(f"fp8: granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")


def quantize_rtn(
    w: torch.Tensor,
    granularity: str = "channel",
    block_size: tuple[int, int] = DEFAULT_BLOCK,
    input_scale: torch.Tensor | float | None = None,
) -> Fp8Quantized:
    """Round-to-nearest-even FP8 quantization of ``w`` (N, K): ``scale = amax * fp32(1 / 448)`` per block.

    Blocks whose amax is 0 get scale 1. ``input_scale``, when given, is stored as the static
    activation scale (fp32 ``(1,)``); calibrate it as ``amax(|x|) / 448`` over sample activations.
    """
    if w.dim() != 2:
        raise ValueError(f"fp8: w must be 2-D (N, K), got {w.dim()}-D")
    n, k = w.shape
    block_n, block_k = blocks_for(granularity, block_size)
    sn, sk = scale_shape(n, k, block_n, block_k)
    bn = n if block_n == -1 else block_n
    bk = k if block_k == -1 else block_k
    wf = w.float()
    # Zero padding up to whole blocks leaves each block's amax unchanged.
    padded = torch.nn.functional.pad(wf.abs(), (0, sk * bk - k, 0, sn * bn - n))
    amax = padded.reshape(sn, bn, sk, bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax * FP8_MAX_INV, torch.ones_like(amax))
    s = expand_scale(scale, n, k, block_n, block_k)
    q = (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if input_scale is not None:
        input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=w.device).reshape(1)
    return Fp8Quantized(q=q, scale=scale, block_n=block_n, block_k=block_k, input_scale=input_scale)


@dataclass
class Fp8Checkpoint:
    """``fp8`` and ``compressed-tensors-fp8`` tensors of one linear."""

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    weight_scale: torch.Tensor  # fp32: (1,) or () per-tensor; (N, 1) per-channel; (ceil(N/bn), ceil(K/bk)) blocks
    input_scale: torch.Tensor | None = None  # fp32 (1,) or (), static activation scale
    block_size: tuple[int, int] | None = None  # (bn, bk) for block scales (config), else None


@dataclass
class Fp8BlockCheckpoint:
    """``fp8-block`` (DeepSeek) tensors of one linear."""

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    weight_scale_inv: torch.Tensor  # fp32 (ceil(N/bn), ceil(K/bk)); multiplies despite its name
    block_size: tuple[int, int] = DEFAULT_BLOCK  # config `weight_block_size`


def _check_weight(who: str, weight: torch.Tensor) -> tuple[int, int]:
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{who}: weight must be {FP8_DTYPE}, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{who}: weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    return tuple(weight.shape)


def _check_scale(who: str, name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if not t.is_floating_point() or t.dtype == FP8_DTYPE:
        raise ValueError(f"{who}: {name} must be a float32 (or float16/bfloat16) tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{who}: {name} must have shape {shape} ({what}), got {tuple(t.shape)}")


def _input_scale(who: str, t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if not t.is_floating_point() or t.numel() != 1 or t.dim() > 1:
        raise ValueError(f"{who}: input_scale must be a float tensor of shape (1,) or (), got {t.dtype} {tuple(t.shape)}")
    return t.float().reshape(1)


class Fp8Format(CheckpointFormat):
    """``fp8`` and ``compressed-tensors-fp8``: ``weight`` + ``weight_scale`` (+ ``input_scale``)."""

    family = "fp8"
    bits = (8,)
    group_sizes = "per-tensor or per-channel scales (compressed-tensors also blocks, e.g. 128 x 128)"

    def __init__(self, name: str, granularities: tuple[str, ...]):
        self.name = name
        self.granularities = granularities

    def quantize(self, w, *, granularity: str = "channel", block_size=DEFAULT_BLOCK, input_scale=None) -> Fp8Checkpoint:
        return self.pack(quantize_rtn(w, granularity, block_size, input_scale))

    def pack(self, fq: Fp8Quantized) -> Fp8Checkpoint:
        g = fq.granularity
        if g not in self.granularities:
            raise ValueError(f"{self.name}: {g} scales cannot be stored in this format; it holds {list(self.granularities)}")
        n, _ = fq.shape
        scale = fq.scale.float().contiguous()
        if g == "tensor":
            scale = scale.reshape(1)
        elif g == "channel":
            scale = scale.reshape(n, 1)
        return Fp8Checkpoint(
            weight=fq.q,
            weight_scale=scale,
            input_scale=None if fq.input_scale is None else fq.input_scale.float().reshape(1),
            block_size=(fq.block_n, fq.block_k) if g == "block" else None,
        )

    def unpack(self, c: Fp8Checkpoint) -> Fp8Quantized:
        who = self.name
        n, k = _check_weight(who, c.weight)
        s = c.weight_scale
        if not s.is_floating_point() or s.dtype == FP8_DTYPE:
            raise ValueError(f"{who}: weight_scale must be a float32 tensor, got {s.dtype}")
        if c.block_size is not None:
            if "block" not in self.granularities:
                raise ValueError(f"{who}: block_size is set but this format holds only {list(self.granularities)} scales")
            bn, bk = c.block_size
            check_block(bn, "block_size[0]", who=who)
            check_block(bk, "block_size[1]", who=who)
            _check_scale(who, "weight_scale", s, scale_shape(n, k, bn, bk), f"ceil(N/{bn}), ceil(K/{bk}) with N={n}, K={k}")
            block_n, block_k = bn, bk
        elif s.numel() == 1 and s.dim() <= 1:
            block_n, block_k = -1, -1
        else:
            _check_scale(who, "weight_scale", s, (n, 1), f"per-channel with N={n}; per-tensor scales have shape (1,)")
            block_n, block_k = 1, -1
        return Fp8Quantized(
            q=c.weight,
            scale=s.float().reshape(scale_shape(n, k, block_n, block_k)),
            block_n=block_n,
            block_k=block_k,
            input_scale=_input_scale(who, c.input_scale),
        )

    def prepare(self, c, *, dtype: torch.dtype | None = None, activations: str = "auto"):
        """Checkpoint -> ``qops.ops.fp8.Fp8Weight`` with its lowering chosen (see ``prepare_fp8_weight``)."""
        from ..ops.fp8 import prepare_fp8_weight

        return prepare_fp8_weight(self.unpack(c), dtype=dtype, format_name=self.name, activations=activations)


class Fp8BlockFormat(Fp8Format):
    """``fp8-block`` (DeepSeek): ``weight`` + ``weight_scale_inv`` over ``block_size`` blocks."""

    group_sizes = "blocks of block_size (128 x 128 in DeepSeek checkpoints); partial edge blocks allowed"

    def __init__(self):
        super().__init__("fp8-block", ("block",))

    def quantize(self, w, *, block_size=DEFAULT_BLOCK) -> Fp8BlockCheckpoint:
        return self.pack(quantize_rtn(w, "block", block_size))

    def pack(self, fq: Fp8Quantized) -> Fp8BlockCheckpoint:
        if fq.granularity != "block":
            raise ValueError(f"fp8-block: only block scales can be stored, got {fq.granularity} scales")
        if fq.input_scale is not None:
            raise ValueError("fp8-block: the format has no static input_scale (activations are quantized dynamically)")
        return Fp8BlockCheckpoint(weight=fq.q, weight_scale_inv=fq.scale.float().contiguous(), block_size=(fq.block_n, fq.block_k))

    def unpack(self, c: Fp8BlockCheckpoint) -> Fp8Quantized:
        who = self.name
        n, k = _check_weight(who, c.weight)
        bn, bk = c.block_size
        check_block(bn, "block_size[0]", who=who)
        check_block(bk, "block_size[1]", who=who)
        _check_scale(who, "weight_scale_inv", c.weight_scale_inv, scale_shape(n, k, bn, bk), f"ceil(N/{bn}), ceil(K/{bk}) with N={n}, K={k}")
        return Fp8Quantized(q=c.weight, scale=c.weight_scale_inv.float(), block_n=bn, block_k=bk)


FP8 = Fp8Format("fp8", ("tensor", "channel"))
COMPRESSED_TENSORS_FP8 = Fp8Format("compressed-tensors-fp8", GRANULARITIES)
FP8_BLOCK = Fp8BlockFormat()
FORMATS = (FP8, COMPRESSED_TENSORS_FP8, FP8_BLOCK)
