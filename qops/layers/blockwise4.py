"""4-bit blockwise linear layers (bitsandbytes NF4 / FP4).

On-disk tensors of one linear (``qops/formats/bitsandbytes.py``), K = in_features, N =
out_features, B = blocksize: the flat row-major weight as nibbles (``weight`` ``(ceil(N*K/2), 1)``),
one absmax per B flat elements (``weight.absmax``, float32 or uint8 when nested), the codebook
(``weight.quant_map``), the nested tables (``weight.nested_absmax`` per 256 blocks,
``weight.nested_quant_map``) and the JSON ``weight.quant_state.bitsandbytes__<type>``.

Sharding reads the nibbles as ``(N, K/2)`` bytes and the absmax as ``(N, K/B)``: a shard is whole rows
(column split) or whole blocks of every row (row split, K/w a multiple of B), so it needs K % B == 0
(otherwise blocks straddle rows and the layer is only read whole). Nested absmax groups of 256
blocks do not follow a shard's rows, so a sharded nested layer is de-nested to float32 absmax
(4 bytes per block instead of 1: +4.7% at B = 64); whole layers stay nested.

``get_linear(weight, bias, "bitsandbytes-nf4" | "bitsandbytes-fp4")`` takes a ``Bnb4bitCheckpoint``
or a floating ``(N, K)`` weight quantized here (blocksize 64, nested, as bitsandbytes' defaults).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..formats import FORMATS
from ..formats.bitsandbytes import (
    Bnb4bitCheckpoint,
    check_nested_absmax,
    check_nested_quant_map,
    check_nested_state,
    check_quant_state,
)
from ..ops.blockwise4 import LAYOUTS, Blockwise4Weight
from .base import QuantConfig, QuantLinear
from .int8 import BnbInt8Scheme, _QuantizeAtLoad
from .layout import Dim, LinearLayout, LinearScheme, ShardingError, TensorLayout, WeightsError, checked, join, read_pieces


def _state_key(quant_type: str) -> str:
    return f"weight.quant_state.bitsandbytes__{quant_type}"


def read_quant_state(source, prefix: str, quant_type: str) -> dict:
    name = join(prefix, _state_key(quant_type))
    blob = source.read(name, (slice(None),) * len(source.shape(name)))
    try:
        state = json.loads(bytes(blob.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"tensor {name!r} in {source.where(name)} is not a JSON quant_state ({e})") from None
    who = f"tensor {name!r} in {source.where(name)}"
    checked(check_quant_state, state, who=who)
    if _nested(state):
        checked(check_nested_state, state, who=who)
    return state


def _nested(state: dict) -> bool:
    return "nested_blocksize" in state


def _whole_layout(nested: bool) -> LinearLayout:
    # The nibbles are read as bytes whatever bnb_4bit_quant_storage held them, as shards read them.
    return LinearLayout(tensors=(
        TensorLayout("weight", (Dim(None), Dim(None)), torch.uint8, view=lambda k, n: (-(-n * k // 2), 1), view_dtype=torch.uint8),
        TensorLayout("weight.absmax", (Dim(None),), torch.uint8 if nested else torch.float32),
        TensorLayout("weight.quant_map", (Dim(None),), torch.float32),
        TensorLayout("weight.nested_absmax", (Dim(None),), torch.float32, optional=not nested),
        TensorLayout("weight.nested_quant_map", (Dim(None),), torch.float32, optional=not nested),
    ))


def _shard_layout(blocksize: int, nested: bool) -> LinearLayout:
    """Nibbles as (N, K/2) bytes and absmax as (N, K/B): whole rows, whole blocks of a row."""
    return LinearLayout(tensors=(
        TensorLayout("weight", (Dim("n"), Dim("k", block=2)), torch.uint8, view=lambda k, n: (n, k // 2), view_dtype=torch.uint8),
        TensorLayout("weight.absmax", (Dim("n"), Dim("k", block=blocksize)), torch.uint8 if nested else torch.float32,
                     view=lambda k, n: (n, k // blocksize)),
    ))


QUANT_MAP = LinearLayout(tensors=(TensorLayout("weight.quant_map", (Dim(None),), torch.float32),))


@dataclass(frozen=True)
class Bnb4bitScheme(LinearScheme):
    quant_type: str
    group_size = -1
    bits = 4

    @property
    def key(self):
        return _state_key(self.quant_type)

    @property
    def format(self):
        return f"bitsandbytes-{self.quant_type}"

    @property
    def layout(self):
        return _whole_layout(False)

    def dims(self, source, prefix):
        n, k = read_quant_state(source, prefix, self.quant_type)["shape"]
        return k, n

    def read(self, source, pieces, k_range, k, **kw):
        states = {p.prefix: read_quant_state(source, p.prefix, self.quant_type) for p in pieces}
        first = states[pieces[0].prefix]
        if len(pieces) == 1 and (pieces[0].n0, pieces[0].n1) == (0, pieces[0].n) and k_range == (0, k):
            t = read_pieces(source, _whole_layout(_nested(first)), pieces, k_range, k, **kw)
            t["quant_state"] = first
            return t
        blocksize = first["blocksize"]
        if any(s["blocksize"] != blocksize for s in states.values()):
            raise WeightsError(f"cannot fuse {list(states)}: their blocksizes differ ({[s['blocksize'] for s in states.values()]})")
        if k % blocksize:
            raise ShardingError(f"cannot split {pieces[0].prefix!r}: its blocks of {blocksize} straddle rows (K={k}), so it is only read whole")
        device = kw.pop("device", None)
        kw.pop("full_k_blocks", None)
        weights, absmax = [], []
        for p in pieces:
            state = states[p.prefix]
            t = read_pieces(source, _shard_layout(blocksize, _nested(state)), [p], k_range, k, **kw)
            a = t["weight.absmax"]
            if _nested(state):
                a = _denest(source, p.prefix, state, a, p.n0, k_range[0] // blocksize, k // blocksize, p.n)
            weights.append(t["weight"])
            absmax.append(a)
        out = {
            "weight": torch.cat(weights).reshape(-1, 1), "weight.absmax": torch.cat(absmax).reshape(-1),
            "weight.quant_map": read_pieces(source, QUANT_MAP, pieces, k_range, k, **kw)["weight.quant_map"],
            "weight.nested_absmax": None, "weight.nested_quant_map": None,
        }
        if device is not None:
            out = {name: None if v is None else v.to(device) for name, v in out.items()}
        out["quant_state"] = {key: first[key] for key in ("quant_type", "blocksize", "dtype")}
        return out

    def make(self, t, k, n, group_size):
        state = {**t["quant_state"], "shape": [n, k]}
        return Bnb4bitCheckpoint(weight=t["weight"], absmax=t["weight.absmax"], quant_map=t["weight.quant_map"], quant_state=state,
                                 nested_absmax=t["weight.nested_absmax"], nested_quant_map=t["weight.nested_quant_map"])


def _read_checked(source, name: str, check, **facts) -> torch.Tensor:
    """Tensor ``name`` whole, after ``check(t, **facts, who=...)`` (a format check) passed."""
    t = source.read(name, (slice(None),) * len(source.shape(name)))
    checked(check, t, **facts, who=f"tensor {name!r} in {source.where(name)}")
    return t


def _denest(source, prefix: str, state: dict, absmax_u8: torch.Tensor, n0: int, b0: int, blocks_per_row: int, n: int) -> torch.Tensor:
    """float32 absmax of a shard's blocks (rows n0.., row blocks b0..) of a layer of ``n`` rows, from
    their uint8 codes and the layer's nested tables: ``code[u8] * nested_absmax[b // nested_blocksize] + offset``."""
    # Checked as the whole-layer format check does: a shard indexes them by its own blocks.
    code = _read_checked(source, join(prefix, "weight.nested_quant_map"), check_nested_quant_map)
    nested_absmax = _read_checked(source, join(prefix, "weight.nested_absmax"), check_nested_absmax,
                                  n_blocks=n * blocks_per_row, nested_blocksize=state["nested_blocksize"])
    rows, cols = absmax_u8.shape
    block = (torch.arange(n0, n0 + rows).unsqueeze(1) * blocks_per_row + torch.arange(b0, b0 + cols)).reshape(-1)
    scale = nested_absmax.index_select(0, block // state["nested_blocksize"])
    # Multiply first, as bitsandbytes de-nests, then add the offset (all in float32).
    offset = torch.tensor(float(state["nested_offset"]), dtype=torch.float32)
    return (code.index_select(0, absmax_u8.reshape(-1).long()) * scale + offset).reshape(rows, cols)


class Blockwise4Linear(QuantLinear):
    """``y = x @ W.T + bias`` through ``torch.ops.qops.mm_blockwise4`` (bitsandbytes NF4 / FP4;
    ``mm_blockwise4_out`` with a workspace, :meth:`QuantLinear.use_workspace`).

    Buffers: ``qweight`` (nibbles in the byte order ``layout`` names), ``code``, ``absmax``, ``nested_code``, ``nested_absmax``,
    ``nested_offset`` (the last three None unless nested), ``bias``.
    """

    def __init__(self, weight: Blockwise4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if bias is not None and tuple(bias.shape) != (weight.out_features,):
            raise ValueError(f"Blockwise4Linear: bias must have shape ({weight.out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.blocksize, self.nested_blocksize = weight.blocksize, weight.nested_blocksize
        self.layout = weight.layout
        self.kernel = int(weight.kernel)
        self.choice = weight.choice
        for name in ("qweight", "code", "absmax", "nested_code", "nested_absmax", "nested_offset"):
            self.register_buffer(name, getattr(weight, name))
        self.register_buffer("bias", bias)

    @classmethod
    def from_checkpoint(cls, checkpoint, bias=None, *, dtype=None) -> "Blockwise4Linear":
        if not isinstance(checkpoint, Bnb4bitCheckpoint):
            raise TypeError(f"Blockwise4Linear.from_checkpoint: expected a Bnb4bitCheckpoint, got {type(checkpoint).__name__}")
        if bias is not None and dtype is not None:
            bias = bias.to(dtype)
        return cls(FORMATS[f"bitsandbytes-{checkpoint.quant_type}"].prepare(checkpoint, dtype=dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.qweight, self.code, self.absmax, self.nested_code, self.nested_absmax, self.nested_offset, self.bias,
                self.out_features, self.in_features, self.blocksize, self.nested_blocksize, self.layout, self.kernel)
        out_args = self._out_args(x)
        if out_args is None:
            return torch.ops.qops.mm_blockwise4(*args)
        torch.ops.qops.mm_blockwise4_out(*args, *out_args)
        return out_args[0]

    def extra_repr(self) -> str:
        low = self.choice.lowering.name if self.choice is not None else f"kernel={self.kernel}"
        nested = f", nested_blocksize={self.nested_blocksize}" if self.nested_code is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocksize={self.blocksize}{nested}, "
                f"layout={LAYOUTS[self.layout]}, {low}")


class Bnb4bitMethod(_QuantizeAtLoad):
    checkpoint_type, module = Bnb4bitCheckpoint, Blockwise4Linear
    quantize_options = {"group_size": 64, "nested": True}

    def __init__(self, quant_type: str) -> None:
        self.quant_type = quant_type
        self.quantize = self.format = f"bitsandbytes-{quant_type}"
        self.accepts = f"a Bnb4bitCheckpoint ({quant_type}) or a floating (N, K) weight (quantized here: blocksize 64, nested)"

    def linear(self, weight, bias, **kw):
        if isinstance(weight, Bnb4bitCheckpoint) and weight.quant_type != self.quant_type:
            raise TypeError(f"get_linear(quantize={self.quantize!r}) got a {weight.quant_type} checkpoint; use 'bitsandbytes-{weight.quant_type}'")
        return super().linear(weight, bias, **kw)


NF4_METHOD, FP4_METHOD = Bnb4bitMethod("nf4"), Bnb4bitMethod("fp4")
QUANT_TYPES = ("nf4", "fp4")


@dataclass(frozen=True)
class BitsAndBytesConfig(QuantConfig):
    """HF ``quant_method == "bitsandbytes"``: ``load_in_8bit`` (LLM.int8) or ``load_in_4bit`` with
    ``bnb_4bit_quant_type`` nf4 / fp4."""

    quant_type: str | None  # None: int8

    @property
    def quantize(self):
        return "bitsandbytes" if self.quant_type is None else f"bitsandbytes-{self.quant_type}"

    @classmethod
    def from_dict(cls, qc: dict) -> "BitsAndBytesConfig":
        if qc.get("load_in_4bit"):
            quant_type = qc.get("bnb_4bit_quant_type", "fp4")
            if quant_type not in QUANT_TYPES:
                raise WeightsError(f"bitsandbytes: bnb_4bit_quant_type must be one of {list(QUANT_TYPES)}, got {quant_type!r}")
            return cls(quant_type)
        if qc.get("load_in_8bit"):
            return cls(None)
        raise WeightsError("bitsandbytes: quantization_config sets neither load_in_8bit nor load_in_4bit")

    def scheme(self, prefix):
        return BnbInt8Scheme() if self.quant_type is None else Bnb4bitScheme(self.quant_type)

