"""FP8 linear layers (``fp8``, ``compressed-tensors-fp8``, ``fp8-block``).

On-disk tensors of one linear (``qops/formats/fp8.py``), K = in_features, N = out_features:

================= =========================================== =====================================
scheme            tensor: dims                                column split (N) / row split (K)
================= =========================================== =====================================
fp8,              weight float8_e4m3fn (N, K)                 free / free
compressed-       weight_scale: per tensor (1,) or ()         replicated / replicated
tensors-fp8       ... per channel (N, 1)                      sliced / replicated
                  ... blocks (ceil(N/bn), ceil(K/bk))         on bn boundaries / on bk boundaries
                  input_scale (1,) or () optional             replicated / replicated
fp8-block         weight + weight_scale_inv (blocks)          as blocks above
================= =========================================== =====================================

Fusing separately stored layers (q/k/v, gate/up) with different per-tensor scales turns their
scales into one per-channel scale (a row per output feature), and their static input scales into
their maximum -- what TGI does. The scale granularity of plain ``fp8`` checkpoints is read from the
stored ``weight_scale`` shape, since the config does not give it.

``get_linear(weight, bias, "fp8", weight_scale=..., input_scale=...)`` takes a float8_e4m3fn weight
with its scale, or a floating weight, quantized here per channel. ``"fp8-kv"`` (fp8 weights with an
fp8 KV cache in LoRAX) loads its linear layers the same way; the KV cache is not a layer concern.
Activations: the format's ``prepare`` chooses W8A8 (static, or dynamic per token -- per token and 128
K values for 128 x 128 blocks where the lowering reads that) where a native FP8 GEMM serves the weight
and W8A16 otherwise (CPU, shapes or block scales the GEMM does not take).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FORMATS
from ..formats.fp8 import FP8_DTYPE, Fp8BlockCheckpoint, Fp8Checkpoint, check_block
from ..ops.fp8 import Fp8Weight, mm_fp8
from .base import LinearMethod, QuantConfig, QuantLinear
from .layout import FLOAT, Dim, LinearLayout, LinearScheme, TensorLayout, WeightsError, checked, join, stores_weight_of

GRANULARITIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme(LinearScheme):
    format: str = "fp8"  # or "compressed-tensors-fp8"
    granularity: str | None = None  # None: read from the stored weight_scale (specialize)
    block: tuple[int, int] | None = None  # (bn, bk) for block scales
    scale_ndim: int = 1  # per-tensor scales are stored (1,) or, by older writers, ()
    input_ndim: int = 1
    key = "weight"
    group_size = -1
    bits = 8

    def stores(self, source, prefix):
        return stores_weight_of(source, prefix, FP8_DTYPE, "weight_scale", self.format)

    def specialize(self, source, prefix):
        name = join(prefix, "weight_scale")
        if not source.has(name):
            return self  # the missing tensor is reported when read
        shape = source.shape(name)
        granularity = self.granularity
        if granularity is None:
            granularity = "tensor" if len(shape) <= 1 and (not shape or shape[0] == 1) else "channel"
        input_name = join(prefix, "input_scale")
        input_ndim = len(source.shape(input_name)) if source.has(input_name) else 1
        return Fp8Scheme(self.format, granularity, self.block, len(shape) if granularity == "tensor" else 2, input_ndim)

    @property
    def layout(self):
        if self.granularity == "block":
            bn, bk = self.block
            scale = (Dim("n", block=bn), Dim("k", block=bk))
        elif self.granularity == "channel":
            scale = (Dim("n"), Dim(None))
        else:
            scale = (Dim(None),) * self.scale_ndim
        return LinearLayout(tensors=(
            TensorLayout("weight", (Dim("n"), Dim("k")), FP8_DTYPE),
            TensorLayout("weight_scale", scale, FLOAT, across="per_channel"),
            TensorLayout("input_scale", (Dim(None),) * self.input_ndim, FLOAT, optional=True, across="max"),
        ))

    def dims(self, source, prefix):
        n, k = source.shape(join(prefix, "weight"))
        return k, n

    def make(self, t, k, n, group_size):
        return Fp8Checkpoint(weight=t["weight"], weight_scale=t["weight_scale"], input_scale=t["input_scale"],
                             block_size=self.block if self.granularity == "block" else None)


@dataclass(frozen=True)
class Fp8BlockScheme(LinearScheme):
    block: tuple[int, int]
    key = "weight"
    format = "fp8-block"
    group_size = -1
    bits = 8

    def stores(self, source, prefix):
        return stores_weight_of(source, prefix, FP8_DTYPE, "weight_scale_inv", self.format)

    @property
    def layout(self):
        bn, bk = self.block
        return LinearLayout(tensors=(
            TensorLayout("weight", (Dim("n"), Dim("k")), FP8_DTYPE),
            TensorLayout("weight_scale_inv", (Dim("n", block=bn), Dim("k", block=bk)), FLOAT),
        ))

    def dims(self, source, prefix):
        n, k = source.shape(join(prefix, "weight"))
        return k, n

    def make(self, t, k, n, group_size):
        return Fp8BlockCheckpoint(weight=t["weight"], weight_scale_inv=t["weight_scale_inv"], block_size=self.block)


class Fp8Linear(QuantLinear):
    """``y = x @ W.T + bias`` on a prepared FP8 weight: ``qops::mm_fp8_weight`` (W8A16;
    ``mm_fp8_weight_out`` with a workspace, :meth:`QuantLinear.use_workspace`) or fp8 activations
    and ``qops::scaled_mm_fp8`` (W8A8, which needs no scratch), as chosen when the weight was prepared.

    Buffers: ``weight``, ``weight_scale``, ``input_scale`` (None without a static one), ``bias``.
    """

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if bias is not None and tuple(bias.shape) != (weight.out_features,):
            raise ValueError(f"Fp8Linear: bias must have shape ({weight.out_features},), got {tuple(bias.shape)}")
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.block_n, self.block_k = weight.block_n, weight.block_k
        self.activations = weight.activations
        self.x_group_size = weight.x_group_size  # static: the quantization's shape is fixed per weight
        self.kernel = int(weight.kernel)
        self.choice = weight.choice
        self.register_buffer("weight", weight.weight)
        self.register_buffer("weight_scale", weight.weight_scale)
        self.register_buffer("input_scale", weight.input_scale if weight.activations == "static" else None)
        self.register_buffer("bias", bias)

    @classmethod
    def from_checkpoint(cls, checkpoint, bias=None, *, dtype=None) -> "Fp8Linear":
        if isinstance(checkpoint, Fp8BlockCheckpoint):
            fmt = FORMATS["fp8-block"]
        elif isinstance(checkpoint, Fp8Checkpoint):
            fmt = FORMATS["compressed-tensors-fp8" if checkpoint.block_size is not None else "fp8"]
        else:
            raise TypeError(f"Fp8Linear.from_checkpoint: expected an Fp8Checkpoint or Fp8BlockCheckpoint, got {type(checkpoint).__name__}")
        if bias is not None and dtype is not None:
            bias = bias.to(dtype)
        return cls(fmt.prepare(checkpoint, dtype=dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "none":
            args = (x, self.weight, self.weight_scale, self.bias, self.block_n, self.block_k, self.kernel)
            out_args = self._out_args(x)
            if out_args is None:
                return torch.ops.qops.mm_fp8_weight(*args)
            torch.ops.qops.mm_fp8_weight_out(*args, *out_args)
            return out_args[0]
        return mm_fp8(x, self.weight, self.weight_scale, self.bias, self.block_n, self.block_k, self.input_scale, self.kernel,
                      self.x_group_size)

    def extra_repr(self) -> str:
        low = self.choice.lowering.name if self.choice is not None else f"kernel={self.kernel}"
        acts = self.activations if self.x_group_size == -1 else f"{self.activations} (groups of {self.x_group_size})"
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks=({self.block_n}, {self.block_k}), activations={acts}, {low}"


class Fp8Method(LinearMethod):
    accepts = ("a float8_e4m3fn (N, K) weight with weight_scale (and optional input_scale), a floating weight "
               "(quantized per channel here), or an Fp8Checkpoint / Fp8BlockCheckpoint")

    def __init__(self, quantize: str) -> None:
        self.quantize = quantize

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        if isinstance(weight, (Fp8Checkpoint, Fp8BlockCheckpoint)):
            self.check_no_extras(fan_in_fan_out, weight_scale, input_scale)
            return Fp8Linear.from_checkpoint(weight, bias, dtype=dtype)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
            raise self.refuse(weight)
        if fan_in_fan_out:
            weight = weight.t().contiguous()
        if weight.dtype == FP8_DTYPE:
            if weight_scale is None:
                raise ValueError(f"get_linear(quantize={self.quantize!r}): a float8_e4m3fn weight needs its weight_scale")
            c = Fp8Checkpoint(weight=weight, weight_scale=weight_scale, input_scale=input_scale)
        else:
            if weight_scale is not None:
                raise ValueError(f"get_linear(quantize={self.quantize!r}): weight_scale goes with a float8_e4m3fn weight, got a {weight.dtype} one")
            c = FORMATS["fp8"].quantize(weight, granularity="channel", input_scale=input_scale)
        return Fp8Linear.from_checkpoint(c, bias, dtype=dtype)


FP8_METHOD, FP8_KV_METHOD = Fp8Method("fp8"), Fp8Method("fp8-kv")


def _config_block(value, key: str, *, who: str) -> tuple[int, int]:
    """``[bn, bk]`` of a config, each checked as the format checks a block size, before the
    layout computes scale shapes from them."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise WeightsError(f"{who}: quantization_config {key!r} must be [block_n, block_k], got {value!r}")
    for i, block in enumerate(value):
        checked(check_block, block, f"{key}[{i}]", who=f"{who}: quantization_config")
    return tuple(value)


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """HF ``quant_method == "fp8"``: per-tensor/per-channel scales, or ``weight_block_size`` blocks
    stored as ``weight_scale_inv`` (DeepSeek)."""

    block: tuple[int, int] | None = None
    quantize = "fp8"

    @classmethod
    def from_dict(cls, qc: dict) -> "Fp8Config":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise WeightsError(f"fp8: only e4m3 weights are supported, got fmt={fmt!r}")
        block = qc.get("weight_block_size")
        return cls(block=None if block is None else _config_block(block, "weight_block_size", who="fp8"))

    def scheme(self, prefix):
        return Fp8Scheme("fp8") if self.block is None else Fp8BlockScheme(self.block)


def compressed_tensors_float(group: dict, who: str) -> LinearScheme:
    """compressed-tensors ``float-quantized`` (fp8) weights of one config group; its activations
    (dynamic per token, or static with a stored ``input_scale``) are fp8 too or absent."""
    weights, acts = group["weights"], group.get("input_activations")
    if acts and (acts.get("type") != "float" or int(acts.get("num_bits", 8)) != 8):
        raise WeightsError(f"{who}: float-quantized input activations must be 8-bit floats, got {acts!r}")
    if weights.get("type") != "float" or int(weights.get("num_bits", 8)) != 8:
        raise WeightsError(f"{who}: float-quantized weights must be 8-bit floats, got type={weights.get('type')!r} num_bits={weights.get('num_bits')!r}")
    strategy = weights.get("strategy", "tensor")
    if strategy not in GRANULARITIES:
        raise WeightsError(f"{who}: weight strategy {strategy!r} is not supported; supported: {list(GRANULARITIES)}")
    block = None
    if strategy == "block":
        block = _config_block(weights.get("block_structure"), "block_structure", who=who)
    return Fp8Scheme("compressed-tensors-fp8", strategy, block, 1 if strategy == "tensor" else 2)
