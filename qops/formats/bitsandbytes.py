"""bitsandbytes checkpoints: LLM.int8 storage (``Linear8bitLt``) and 4-bit NF4 / FP4 (``Linear4bit``).

Both are read from a module's state dict exactly as bitsandbytes (0.4x-0.50) writes it; keys below are
relative to the linear layer's prefix. N = out_features, K = in_features.

**int8** (``quant_method == "bitsandbytes"``, ``load_in_8bit``):

- ``weight`` int8 ``(N, K)``, row-major; ``SCB`` float32 ``(N,)`` (older writers: ``weight.SCB``), the
  absolute maximum of each row; ``weight_format`` uint8 scalar, 0 = row-major (the only layout
  written since bitsandbytes 0.45; the tiled ``col32``/``col_turing``/``col_ampere`` = 1/2/3 are
  refused); optional ``bias``.
- ``W[n, k] = weight[n, k] * SCB[n] / 127``. Quantization rounds ``w * 127 / SCB`` half to even.

**4-bit** (``load_in_4bit``, ``bnb_4bit_quant_type`` "nf4" or "fp4"):

- ``weight`` uint8 ``(ceil(N*K/2), 1)``: the flat row-major weight, two 4-bit codes per byte, element
  ``2i`` in the **high** nibble of byte ``i`` and ``2i+1`` in the low one (an odd count pads a zero
  low nibble). With ``bnb_4bit_quant_storage`` other than uint8 the same bytes are held in a tensor
  of that dtype, shape ``(ceil(N*K/2) / itemsize, 1)``.
- ``weight.absmax``: one value per block of ``blocksize`` flat elements (blocks may span rows; the
  last may be partial): float32 ``(n_blocks,)``, or with nested ("double") quantization uint8
  indices into ``weight.nested_quant_map`` (float32 ``(256,)``, bitsandbytes' dynamic map), scaled by
  ``weight.nested_absmax`` (float32, one per 256 blocks) and shifted by ``nested_offset``:
  ``absmax[b] = nested_quant_map[absmax_u8[b]] * nested_absmax[b // 256] + nested_offset``.
- ``weight.quant_map`` float32 ``(16,)``: the codebook (:data:`NF4_CODE` or :data:`FP4_CODE`).
- ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``): uint8 bytes of a UTF-8 JSON object with
  ``quant_type``, ``blocksize`` (32, 64 (default), 128, ..., 4096), ``dtype`` (the original weight
  dtype, e.g. "bfloat16"), ``shape`` ``[N, K]``, and when nested ``nested_blocksize`` (256),
  ``nested_dtype`` ("float32"), ``nested_offset`` (a float).
- ``W.flat[e] = quant_map[code(e)] * absmax[e // blocksize]`` (see :mod:`qops.formats.blockwise4`).

Sources: bitsandbytes ``functional.py`` (``QuantState.as_dict``/``from_dict``, ``get_4bit_type``,
``quantize_4bit`` with ``compress_statistics``, ``create_dynamic_map``), ``utils.pack_dict_to_tensor``,
``nn/modules.py`` (``Linear4bit``/``Linear8bitLt._save_to_state_dict``); checked against bitsandbytes
0.50.2's CPU path in ``tests/test_bitsandbytes.py`` when it is installed.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

import torch

from .base import CheckpointFormat
from .blockwise4 import (
    Blockwise4Quantized,
    NestedAbsmax,
    n_blocks_for,
    pack_nibbles,
    quantize_blockwise4,
    unpack_nibbles,
)
from .integer import IntQuantized, check_integer

# bitsandbytes' NF4 codebook (QLoRA's NormalFloat: quantiles of N(0, 1) normalized to [-1, 1]).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# bitsandbytes' FP4 (1 sign bit 0b1000, 2 exponent bits, 1 mantissa bit, bias 2) in code order, before
# normalization: the table is these divided by 12 in float32.
FP4_UNNORMALIZED = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
QUANT_TYPES = ("nf4", "fp4")
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}


def codebook(quant_type: str) -> torch.Tensor:
    """The float32 ``(16,)`` codebook bitsandbytes writes as ``quant_map`` for ``quant_type``."""
    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32)
    if quant_type == "fp4":
        return torch.tensor(FP4_UNNORMALIZED, dtype=torch.float32) / 12.0
    raise ValueError(f"bitsandbytes: quant_type must be one of {QUANT_TYPES}, got {quant_type!r}")


def _get(tensors: dict, prefix: str, *names: str, required: bool = True, who: str):
    for name in names:
        if prefix + name in tensors:
            return tensors[prefix + name]
    if required:
        raise KeyError(f"{who}: state dict has no {' or '.join(repr(prefix + n) for n in names)}")
    return None


# ---------------------------------------------------------------------------------------------- int8


@dataclass
class BnbInt8Checkpoint:
    weight: torch.Tensor  # (N, K) int8, row-major
    SCB: torch.Tensor  # (N,) float32, row absmax
    bias: torch.Tensor | None = None
    weight_format: int = 0  # 0 = row

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)


def _check_int8(c: BnbInt8Checkpoint) -> None:
    who = "bitsandbytes-int8"
    if c.weight_format != 0:
        name = WEIGHT_FORMATS.get(c.weight_format, "unknown")
        raise ValueError(f"{who}: weight_format {c.weight_format} ({name}) is not supported; only 0 (row-major) is")
    if c.weight.dtype != torch.int8 or c.weight.dim() != 2:
        raise ValueError(f"{who}: weight must be a 2-D int8 tensor (N, K), got {c.weight.dtype} {tuple(c.weight.shape)}")
    n = c.weight.shape[0]
    if c.SCB.dtype != torch.float32 or tuple(c.SCB.shape) != (n,):
        raise ValueError(f"{who}: SCB must be float32 of shape ({n},) (N), got {c.SCB.dtype} {tuple(c.SCB.shape)}")


class BitsAndBytesInt8Format(CheckpointFormat):
    name = "bitsandbytes-int8"
    family = "int8_weight"
    bits = (8,)
    group_sizes = "-1 only (one scale per output row)"

    def quantize(self, w, *, bits=8, group_size=-1, sym=True, bias=None) -> BnbInt8Checkpoint:
        if bits != 8 or group_size != -1 or not sym:
            raise ValueError(f"{self.name}: holds symmetric 8-bit per-row weights (bits=8, group_size=-1, sym=True), got bits={bits}, group_size={group_size}, sym={sym}")
        wf = w.float()
        scb = wf.abs().amax(dim=1)
        q = torch.round(wf * (127.0 / scb.clamp(min=1e-38)).unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        return BnbInt8Checkpoint(weight=q, SCB=scb, bias=bias)

    def pack(self, iq: IntQuantized, *, bias=None) -> BnbInt8Checkpoint:
        _check_int8_meaning(iq, self.name)
        q = (iq.q.to(torch.int16) - 128).to(torch.int8)
        return BnbInt8Checkpoint(weight=q, SCB=(iq.scales[:, 0].double() * 127).float(), bias=bias)

    def unpack(self, c: BnbInt8Checkpoint) -> IntQuantized:
        _check_int8(c)
        return int8_meaning(c.weight, c.SCB.float() / 127)

    def prepare(self, c: BnbInt8Checkpoint, *, dtype: torch.dtype | None = None):
        from ..ops.int8_weight import prepare_int8_weight

        _check_int8(c)
        # The checkpoint's weight is the runtime layout: no copy. SCB / 127 is N floats.
        return prepare_int8_weight(c.weight, c.SCB / 127, dtype=dtype, format_name=self.name)

    def from_state_dict(self, tensors: dict, prefix: str = "") -> BnbInt8Checkpoint:
        who = self.name
        fmt = _get(tensors, prefix, "weight_format", required=False, who=who)
        c = BnbInt8Checkpoint(
            weight=_get(tensors, prefix, "weight", who=who),
            SCB=_get(tensors, prefix, "SCB", "weight.SCB", who=who),
            bias=_get(tensors, prefix, "bias", required=False, who=who),
            weight_format=0 if fmt is None else int(fmt),
        )
        _check_int8(c)
        return c

    def to_state_dict(self, c: BnbInt8Checkpoint, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {prefix + "weight": c.weight}
        if c.bias is not None:
            out[prefix + "bias"] = c.bias
        out[prefix + "SCB"] = c.SCB
        out[prefix + "weight_format"] = torch.tensor(c.weight_format, dtype=torch.uint8)
        return out


def int8_meaning(q_int8: torch.Tensor, scales: torch.Tensor) -> IntQuantized:
    """Signed int8 ``(N, K)`` times per-row ``scales`` as the shared integer meaning (zero 128)."""
    n, k = q_int8.shape
    return IntQuantized(
        q=(q_int8.to(torch.int16) + 128).to(torch.uint8),
        zeros=torch.full((n, 1), 128, dtype=torch.int32),
        scales=scales.reshape(n, 1),
        g_idx=torch.zeros(k, dtype=torch.int64),
        bits=8,
        group_size=-1,
    )


def _check_int8_meaning(iq: IntQuantized, who: str) -> None:
    if iq.bits != 8 or iq.group_size != -1 or not bool((iq.zeros == 128).all()):
        raise ValueError(f"{who}: holds symmetric 8-bit per-row weights (bits=8, group_size=-1, zero 128), got bits={iq.bits}, group_size={iq.group_size}")


# ---------------------------------------------------------------------------------------------- 4-bit


@dataclass
class Bnb4bitCheckpoint:
    weight: torch.Tensor  # (ceil(N*K/2), 1) uint8 (or the same bytes in another storage dtype)
    absmax: torch.Tensor  # (n_blocks,) float32, or uint8 when nested
    quant_map: torch.Tensor  # (16,) float32
    quant_state: dict  # the JSON blob: quant_type, blocksize, dtype, shape [, nested_*]
    nested_absmax: torch.Tensor | None = None  # (ceil(n_blocks/256),) float32
    nested_quant_map: torch.Tensor | None = None  # (256,) float32
    bias: torch.Tensor | None = None

    @property
    def quant_type(self) -> str:
        return self.quant_state["quant_type"]

    @property
    def blocksize(self) -> int:
        return int(self.quant_state["blocksize"])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.quant_state["shape"])

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None


def _weight_bytes(weight: torch.Tensor) -> torch.Tensor:
    """The packed bytes of ``weight`` as a flat uint8 view (any quant_storage dtype)."""
    w = weight if weight.dtype == torch.uint8 else weight.contiguous().view(torch.uint8)
    return w.reshape(-1)


def _check_positive(value, name: str, *, who: str) -> None:
    check_integer(value, name, who=who)
    if value <= 0:
        raise ValueError(f"{who}: {name} must be positive, got {value}")


def check_quant_state(qs: dict, *, who: str) -> None:
    """The quant_state JSON's keys and their types, checked before any value is used."""
    for key in ("quant_type", "blocksize", "shape", "dtype"):
        if key not in qs:
            raise ValueError(f"{who}: quant_state JSON lacks {key!r} (has {sorted(qs)})")
    shape = qs["shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise ValueError(f"{who}: shape must be 2-D [N, K] for a linear weight, got {shape!r}")
    for i, size in enumerate(shape):
        check_integer(size, f"quant_state shape[{i}]", who=who)
        if size < 0:
            raise ValueError(f"{who}: quant_state shape[{i}] must not be negative, got {size}")
    _check_positive(qs["blocksize"], "blocksize", who=who)


def check_nested_state(qs: dict, *, who: str) -> None:
    """The quant_state keys of a nested absmax: a positive nested_blocksize and a float nested_offset."""
    if "nested_blocksize" not in qs or "nested_offset" not in qs:
        raise ValueError(f"{who}: nested absmax needs nested_blocksize and nested_offset in quant_state, got {qs}")
    _check_positive(qs["nested_blocksize"], "nested_blocksize", who=who)
    offset = qs["nested_offset"]
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"{who}: nested_offset must be a number, got {type(offset).__name__} {offset!r}")


def check_nested_quant_map(nested_quant_map: torch.Tensor | None, *, who: str) -> None:
    if nested_quant_map is None or nested_quant_map.dtype != torch.float32 or nested_quant_map.numel() != 256:
        got = "None" if nested_quant_map is None else f"{nested_quant_map.dtype} {tuple(nested_quant_map.shape)}"
        raise ValueError(f"{who}: nested_quant_map must be float32 with 256 values, got {got}")


def check_nested_absmax(nested_absmax: torch.Tensor, n_blocks: int, nested_blocksize: int, *, who: str) -> None:
    """One float32 per ``nested_blocksize`` of the layer's ``n_blocks`` absmax blocks."""
    want = n_blocks_for(n_blocks, nested_blocksize)
    if nested_absmax.dtype != torch.float32 or nested_absmax.numel() != want:
        raise ValueError(f"{who}: nested_absmax must be float32 with {want} values (ceil(n_blocks/{nested_blocksize})), got {nested_absmax.dtype} {tuple(nested_absmax.shape)}")


def _check_4bit(c: Bnb4bitCheckpoint, quant_type: str) -> None:
    who = f"bitsandbytes-{quant_type}"
    qs = c.quant_state
    check_quant_state(qs, who=who)
    if qs["quant_type"] != quant_type:
        raise ValueError(f"{who}: quant_state says quant_type {qs['quant_type']!r}; use FORMATS['bitsandbytes-{qs['quant_type']}']")
    n, k = c.shape
    nbytes = (n * k + 1) // 2
    wb = _weight_bytes(c.weight)
    if wb.numel() != nbytes:
        raise ValueError(f"{who}: weight must hold ceil(N*K/2) = {nbytes} bytes (shape [{n}, {k}]), got {wb.numel()} ({c.weight.dtype} {tuple(c.weight.shape)})")
    nb = n_blocks_for(n * k, c.blocksize)
    want = torch.uint8 if c.nested else torch.float32
    if c.absmax.dtype != want or c.absmax.numel() != nb:
        raise ValueError(f"{who}: absmax must be {want} with {nb} values (ceil(N*K/blocksize), blocksize={c.blocksize}){' (nested)' if c.nested else ''}, got {c.absmax.dtype} {tuple(c.absmax.shape)}")
    if c.quant_map.dtype != torch.float32 or c.quant_map.numel() != 16:
        raise ValueError(f"{who}: quant_map must be float32 with 16 values, got {c.quant_map.dtype} {tuple(c.quant_map.shape)}")
    if c.nested:
        check_nested_state(qs, who=who)
        check_nested_quant_map(c.nested_quant_map, who=who)
        check_nested_absmax(c.nested_absmax, nb, qs["nested_blocksize"], who=who)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BitsAndBytes4bitFormat(CheckpointFormat):
    family = "blockwise4"
    bits = (4,)
    group_sizes = "blocksize in 32, 64, 128, ..., 4096 (flat blocks, may span rows)"

    def __init__(self, quant_type: str):
        codebook(quant_type)  # validates
        self.quant_type = quant_type
        self.name = f"bitsandbytes-{quant_type}"

    @property
    def state_key(self) -> str:
        return f"weight.quant_state.bitsandbytes__{self.quant_type}"

    def quantize(self, w, *, bits=4, group_size=64, sym=True, nested=True, dtype=None, bias=None) -> Bnb4bitCheckpoint:
        """bitsandbytes' ``quantize_4bit``: ``group_size`` is the blocksize; ``nested`` its
        ``compress_statistics``; ``dtype`` the recorded original dtype (default: that of ``w``)."""
        if bits != 4 or not sym:
            raise ValueError(f"{self.name}: holds 4-bit codebook weights (bits=4, sym=True), got bits={bits}, sym={sym}")
        blocksize = 64 if group_size == -1 else group_size
        if blocksize not in BLOCKSIZES:
            raise ValueError(f"{self.name}: blocksize (group_size) must be one of {list(BLOCKSIZES)}, got {group_size}")
        bq = quantize_blockwise4(w, codebook(self.quant_type), blocksize, nested)
        return self.pack(bq, dtype=dtype or (w.dtype if w.is_floating_point() else torch.float32), bias=bias)

    def pack(self, bq: Blockwise4Quantized, *, dtype: torch.dtype = torch.float16, bias=None) -> Bnb4bitCheckpoint:
        n, k = bq.shape
        qs = {"quant_type": self.quant_type, "blocksize": bq.blocksize, "dtype": _dtype_name(dtype), "shape": [n, k]}
        nested_absmax = nested_map = None
        if bq.nested is not None:
            qs.update(nested_blocksize=bq.nested.blocksize, nested_dtype="float32", nested_offset=float(bq.nested.offset))
            nested_absmax, nested_map = bq.nested.absmax.float(), bq.nested.code.float()
        c = Bnb4bitCheckpoint(
            weight=pack_nibbles(bq.codes).unsqueeze(1),
            absmax=bq.absmax,
            quant_map=bq.code.float(),
            quant_state=qs,
            nested_absmax=nested_absmax,
            nested_quant_map=nested_map,
            bias=bias,
        )
        _check_4bit(c, self.quant_type)
        return c

    def unpack(self, c: Bnb4bitCheckpoint) -> Blockwise4Quantized:
        _check_4bit(c, self.quant_type)
        n, k = c.shape
        nested = None
        if c.nested:
            nested = NestedAbsmax(
                code=c.nested_quant_map, absmax=c.nested_absmax,
                offset=float(c.quant_state["nested_offset"]), blocksize=int(c.quant_state["nested_blocksize"]),
            )
        return Blockwise4Quantized(
            codes=unpack_nibbles(_weight_bytes(c.weight), n * k).reshape(n, k),
            code=c.quant_map, absmax=c.absmax, blocksize=c.blocksize, nested=nested,
        )

    def prepare(self, c: Bnb4bitCheckpoint, *, dtype: torch.dtype | None = None):
        """Runtime layout = the checkpoint's tensors as views (nested absmax de-nested in the kernel)."""
        from ..ops.blockwise4 import prepare_blockwise4

        _check_4bit(c, self.quant_type)
        n, k = c.shape
        offset = None
        if c.nested:
            offset = torch.tensor([float(c.quant_state["nested_offset"])], dtype=torch.float32, device=c.absmax.device)
        return prepare_blockwise4(
            qweight=_weight_bytes(c.weight), code=c.quant_map, absmax=c.absmax,
            nested_code=c.nested_quant_map, nested_absmax=c.nested_absmax, nested_offset=offset,
            out_features=n, in_features=k, blocksize=c.blocksize,
            nested_blocksize=int(c.quant_state.get("nested_blocksize", 0)) if c.nested else 0,
            dtype=dtype, format_name=self.name,
        )

    def from_state_dict(self, tensors: dict, prefix: str = "") -> Bnb4bitCheckpoint:
        """A linear layer's tensors as bitsandbytes saved them (keys after ``prefix``)."""
        who = self.name
        blob = _get(tensors, prefix, self.state_key, required=False, who=who)
        if blob is None:
            other = [key for key in tensors if key.startswith(prefix + "weight.quant_state.")]
            raise KeyError(f"{who}: state dict has no {prefix + self.state_key!r}" + (f" (found {other})" if other else ""))
        qs = json.loads(bytes(blob.detach().cpu().to(torch.uint8).numpy()).decode("utf-8"))
        nested_absmax = _get(tensors, prefix, "weight.nested_absmax", required=False, who=who)
        c = Bnb4bitCheckpoint(
            weight=_get(tensors, prefix, "weight", who=who),
            absmax=_get(tensors, prefix, "weight.absmax", who=who),
            quant_map=_get(tensors, prefix, "weight.quant_map", who=who),
            quant_state=qs,
            nested_absmax=nested_absmax,
            nested_quant_map=_get(tensors, prefix, "weight.nested_quant_map", required=nested_absmax is not None, who=who),
            bias=_get(tensors, prefix, "bias", required=False, who=who),
        )
        _check_4bit(c, self.quant_type)
        return c

    def to_state_dict(self, c: Bnb4bitCheckpoint, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors bitsandbytes' ``Linear4bit`` saves, byte-identical JSON blob included."""
        out = {prefix + "weight": c.weight}
        if c.bias is not None:
            out[prefix + "bias"] = c.bias
        out[prefix + "weight.absmax"] = c.absmax
        out[prefix + "weight.quant_map"] = c.quant_map
        if c.nested:
            out[prefix + "weight.nested_absmax"] = c.nested_absmax
            out[prefix + "weight.nested_quant_map"] = c.nested_quant_map
        blob = json.dumps(c.quant_state).encode("utf-8")
        out[prefix + self.state_key] = torch.tensor(list(blob), dtype=torch.uint8)
        return out


INT8 = BitsAndBytesInt8Format()
NF4 = BitsAndBytes4bitFormat("nf4")
FP4 = BitsAndBytes4bitFormat("fp4")
