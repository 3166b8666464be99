"""int8 weight-only linear layers, one scale per output channel (EETQ, bitsandbytes LLM.int8).

On-disk tensors of one linear (``qops/formats/eetq.py``, ``bitsandbytes.py``), K = in_features,
N = out_features:

================== ================================================ ==================================
scheme             tensor: dims                                     column split (N) / row split (K)
================== ================================================ ==================================
eetq (ampere)      weight int8, stored (K, N), bytes ordered        N on tiles of 64 / K on tiles of 64
                   [n // 2][k // 64][n % 2][k % 64] (+ local swaps):
                   read as (N/2, 2K)
eetq (row_major)   weight int8 (K, N)                               free / free
                   weight_scales (N,) fp16                          sliced / replicated
bitsandbytes int8  weight int8 (N, K), SCB (N,) fp32,               free / free
                   weight_format () uint8 (0 = row-major)
================== ================================================ ==================================

The ampere byte order keeps each pair of output columns contiguous and, within a pair, each tile of
64 input rows: a column shard is a run of whole column pairs, a row shard a run of whole tiles per
pair, and either is the ampere order of the sub-matrix itself.

``get_linear(weight, bias, "eetq" | "bitsandbytes")`` takes the format's checkpoint, or a floating
``(N, K)`` weight quantized here (what TGI does at load time). EETQ configs (``quant_method ==
"eetq"``) store the ampere order, which is what transformers saves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FORMATS
from ..formats.bitsandbytes import BnbInt8Checkpoint
from ..formats.eetq import TILE_K, EETQCheckpoint
from ..ops.int8_weight import Int8Weight, prepare_int8_weight
from . import int_weight
from .base import LinearMethod, QuantConfig, QuantLinear
from .layout import FLOAT, INT, Dim, DictSource, LinearLayout, LinearScheme, Piece, TensorLayout, WeightsError, join, read_pieces, stores_weight_of

EETQ_ORDERS = ("ampere", "row_major")


@dataclass(frozen=True)
class EETQScheme(LinearScheme):
    byte_order: str = "ampere"
    key = "weight_scales"
    format = "eetq"
    group_size = -1
    bits = 8

    def stores(self, source, prefix):
        return stores_weight_of(source, prefix, torch.int8, "weight_scales", self.format)

    @property
    def layout(self):
        if self.byte_order == "ampere":
            weight = TensorLayout("weight", (Dim("n", block=2, align=TILE_K), Dim("k", scale=2, align=TILE_K)), torch.int8,
                                  view=lambda k, n: (n // 2, 2 * k))
        else:
            weight = TensorLayout("weight", (Dim("k"), Dim("n")), torch.int8)
        return LinearLayout(tensors=(weight, TensorLayout("weight_scales", (Dim("n"),), FLOAT)))

    def dims(self, source, prefix):
        k, n = source.shape(join(prefix, "weight"))
        return k, n

    def make(self, t, k, n, group_size):
        return EETQCheckpoint(weight=t["weight"].reshape(k, n), weight_scales=t["weight_scales"], layout=self.byte_order)


@dataclass(frozen=True)
class BnbInt8Scheme(LinearScheme):
    scb: str = "SCB"  # older bitsandbytes wrote "weight.SCB"
    format = "bitsandbytes-int8"
    group_size = -1
    bits = 8

    @property
    def key(self):
        return self.scb

    def stores(self, source, prefix):
        return any(source.has(join(prefix, name)) for name in ("SCB", "weight.SCB"))

    def specialize(self, source, prefix):
        return BnbInt8Scheme("SCB" if source.has(join(prefix, "SCB")) else "weight.SCB")

    @property
    def layout(self):
        return LinearLayout(tensors=(
            TensorLayout("weight", (Dim("n"), Dim("k")), torch.int8),
            TensorLayout(self.scb, (Dim("n"),), torch.float32),
            TensorLayout("weight_format", (), INT, optional=True),
        ))

    def dims(self, source, prefix):
        n, k = source.shape(join(prefix, "weight"))
        return k, n

    def make(self, t, k, n, group_size):
        fmt = t["weight_format"]
        return BnbInt8Checkpoint(weight=t["weight"], SCB=t[self.scb], weight_format=0 if fmt is None else int(fmt))


def prepare_eetq(c: EETQCheckpoint, *, dtype: torch.dtype | None = None) -> Int8Weight:
    """``FORMATS["eetq"].prepare(c)``, undoing the ampere byte order column chunk by column chunk
    (runs of 64 columns are ampere checkpoints of their own) so its temporaries stay small."""
    fmt = FORMATS["eetq"]
    k, n = c.weight.shape
    target = max(int_weight.CHUNK_MIN_ELEMENTS, n * k // int_weight.CHUNK_FRACTION)
    cols = max(TILE_K, target // max(k, 1) // TILE_K * TILE_K)
    if c.layout != "ampere" or cols >= n:
        return fmt.prepare(c, dtype=dtype)
    scheme = EETQScheme("ampere")
    source = DictSource({"weight": c.weight, "weight_scales": c.weight_scales}, origin="the EETQCheckpoint")
    qweight = torch.empty((n, k), dtype=torch.int8, device=c.weight.device)
    for n0 in range(0, n, cols):
        n1 = min(n, n0 + cols)
        part = scheme.make(read_pieces(source, scheme.layout, [Piece("", n0, n1, n)], (0, k), k), k, n1 - n0, -1)
        qweight[n0:n1] = fmt.runtime_qweight(part)
    return prepare_int8_weight(qweight, c.weight_scales, dtype=dtype, format_name=fmt.name)


class Int8Linear(QuantLinear):
    """``y = x @ W.T + bias`` through ``torch.ops.qops.mm_int8_weight`` on a prepared int8 weight
    (``mm_int8_weight_out`` with a workspace, :meth:`QuantLinear.use_workspace`).

    Buffers: ``qweight`` int8 ``(N, K)``, ``scales`` ``(N,)``, ``bias``.
    """

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if bias is not None and tuple(bias.shape) != (weight.out_features,):
            raise ValueError(f"Int8Linear: bias must have shape ({weight.out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.kernel = int(weight.kernel)
        self.choice = weight.choice
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_checkpoint(cls, checkpoint, bias=None, *, dtype=None) -> "Int8Linear":
        if isinstance(checkpoint, EETQCheckpoint):
            weight = prepare_eetq(checkpoint, dtype=dtype)
        elif isinstance(checkpoint, BnbInt8Checkpoint):
            weight = FORMATS["bitsandbytes-int8"].prepare(checkpoint, dtype=dtype)  # the checkpoint's own tensors
        else:
            raise TypeError(f"Int8Linear.from_checkpoint: expected an EETQCheckpoint or BnbInt8Checkpoint, got {type(checkpoint).__name__}")
        if bias is not None and dtype is not None:
            bias = bias.to(dtype)
        return cls(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.qweight, self.scales, self.bias, self.kernel)
        out_args = self._out_args(x)
        if out_args is None:
            return torch.ops.qops.mm_int8_weight(*args)
        torch.ops.qops.mm_int8_weight_out(*args, *out_args)
        return out_args[0]

    def extra_repr(self) -> str:
        low = self.choice.lowering.name if self.choice is not None else f"kernel={self.kernel}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {low}"


class _QuantizeAtLoad(LinearMethod):
    """A method whose get_linear takes its checkpoint type, or a floating weight quantized here."""

    checkpoint_type: type
    format: str
    quantize_options: dict

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        if weight_scale is not None or input_scale is not None:
            raise ValueError(f"get_linear(quantize={self.quantize!r}): weight_scale and input_scale belong to fp8 weights")
        if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
            if fan_in_fan_out:
                weight = weight.t().contiguous()
            weight = FORMATS[self.format].quantize(weight, **self.quantize_options)
        elif fan_in_fan_out:
            raise ValueError(f"get_linear(quantize={self.quantize!r}): fan_in_fan_out=True transposes a dense Conv1D weight; it does not apply to {type(weight).__name__}")
        if not isinstance(weight, self.checkpoint_type):
            raise self.refuse(weight)
        return self.module.from_checkpoint(weight, bias, dtype=dtype)


class EETQMethod(_QuantizeAtLoad):
    quantize = "eetq"
    accepts = "an EETQCheckpoint or a floating (N, K) weight (quantized per channel here, as TGI does)"
    checkpoint_type, format, quantize_options, module = EETQCheckpoint, "eetq", {"layout": "row_major"}, Int8Linear


class BnbInt8Method(_QuantizeAtLoad):
    quantize = "bitsandbytes"
    accepts = "a BnbInt8Checkpoint or a floating (N, K) weight (quantized per row here, as TGI does)"
    checkpoint_type, format, quantize_options, module = BnbInt8Checkpoint, "bitsandbytes-int8", {}, Int8Linear


EETQ_METHOD, BNB_INT8_METHOD = EETQMethod(), BnbInt8Method()


@dataclass(frozen=True)
class EETQConfig(QuantConfig):
    quantize = "eetq"

    @classmethod
    def from_dict(cls, qc: dict) -> "EETQConfig":
        if qc.get("weights", "int8") != "int8":
            raise WeightsError(f"eetq: only int8 weights are supported, got weights={qc.get('weights')!r}")
        return cls()

    def scheme(self, prefix):
        return EETQScheme("ampere")
