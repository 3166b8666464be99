"""The registries of the layer API, and ``get_linear``. Adding a format is one module plus a line in
each table below that applies to it.

- ``LINEAR_METHODS``: LoRAX/TGI ``quantize`` string -> :class:`~qops.layers.base.LinearMethod`
  (what ``get_linear`` accepts for it).
- ``CHECKPOINT_LINEARS``: checkpoint dataclass -> module builder (the typed API,
  ``QuantLinear.from_checkpoint``; also what the loader's results go through).
- ``CONFIG_METHODS``: ``quantization_config["quant_method"]`` -> parser returning a
  :class:`~qops.layers.base.QuantConfig`.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..formats.awq import AWQCheckpoint
from ..formats.bitsandbytes import Bnb4bitCheckpoint, BnbInt8Checkpoint
from ..formats.compressed_tensors import CompressedTensorsCheckpoint
from ..formats.eetq import EETQCheckpoint
from ..formats.fp8 import Fp8BlockCheckpoint, Fp8Checkpoint
from ..formats.gptq import GPTQCheckpoint
from . import blockwise4, compressed_tensors, dense, fp8, int8, int_weight
from .base import InputPadded, LinearMethod

LINEAR_METHODS: dict[str | None, LinearMethod] = {
    m.quantize: m for m in (dense.METHOD, int_weight.GPTQ_METHOD, int_weight.AWQ_METHOD, compressed_tensors.METHOD,
                            fp8.FP8_METHOD, fp8.FP8_KV_METHOD, int8.EETQ_METHOD, int8.BNB_INT8_METHOD,
                            blockwise4.NF4_METHOD, blockwise4.FP4_METHOD)
}

CHECKPOINT_LINEARS = {
    GPTQCheckpoint: int_weight.IntWeightLinear.from_checkpoint,
    AWQCheckpoint: int_weight.IntWeightLinear.from_checkpoint,
    CompressedTensorsCheckpoint: int_weight.IntWeightLinear.from_checkpoint,
    Fp8Checkpoint: fp8.Fp8Linear.from_checkpoint,
    Fp8BlockCheckpoint: fp8.Fp8Linear.from_checkpoint,
    EETQCheckpoint: int8.Int8Linear.from_checkpoint,
    BnbInt8Checkpoint: int8.Int8Linear.from_checkpoint,
    Bnb4bitCheckpoint: blockwise4.Blockwise4Linear.from_checkpoint,
}

CONFIG_METHODS = {
    "gptq": int_weight.GPTQConfig.from_dict,
    "awq": int_weight.AWQConfig.from_dict,
    "compressed-tensors": compressed_tensors.CompressedTensorsConfig.from_dict,
    "fp8": fp8.Fp8Config.from_dict,
    "eetq": int8.EETQConfig.from_dict,
    "bitsandbytes": blockwise4.BitsAndBytesConfig.from_dict,
}

# LoRAX/TGI quantize strings without a qops implementation yet; they get a clearer error.
NOT_YET = ("hqq-*", "exl2", "marlin")


def supported_quantize() -> list[str | None]:
    return sorted(LINEAR_METHODS, key=lambda q: (q is not None, q or ""))


def get_linear(
    weight,
    bias: torch.Tensor | None,
    quantize: str | None,
    fan_in_fan_out: bool = False,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The linear module for ``weight`` quantized with ``quantize`` (LoRAX/TGI convention).

    ``weight`` is what that method stores: a dense ``(N, K)`` tensor for None (``(K, N)`` with
    ``fan_in_fan_out=True``, a Conv1D weight), GPTQ's 7-tuple or a ``GPTQCheckpoint`` for "gptq",
    and so on (``LINEAR_METHODS[q].accepts``). ``dtype`` is the activation dtype the module will see.
    """
    try:
        method = LINEAR_METHODS[quantize]
    except (KeyError, TypeError):
        supported = supported_quantize()
        if isinstance(quantize, str) and any(fnmatch.fnmatchcase(quantize, p) for p in NOT_YET):
            raise NotImplementedError(f"get_linear: quantize={quantize!r} is a LoRAX/TGI method qops does not implement yet; supported: {supported}") from None
        raise ValueError(f"get_linear: unknown quantize={quantize!r}; supported: {supported}") from None
    return method.linear(weight, bias, fan_in_fan_out=fan_in_fan_out, weight_scale=weight_scale, input_scale=input_scale, dtype=dtype)


def linear_from_weight(weight, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The module for a loaded weight, chosen by its type: a dense tensor or a format's checkpoint."""
    if isinstance(weight, torch.Tensor):
        return dense.METHOD.linear(weight, bias, fan_in_fan_out=False, weight_scale=None, input_scale=None, dtype=dtype)
    inner = weight.checkpoint if isinstance(weight, InputPadded) else weight
    try:
        build = CHECKPOINT_LINEARS[type(inner)]
    except KeyError:
        known = ["Tensor"] + sorted(t.__name__ for t in CHECKPOINT_LINEARS)
        raise TypeError(f"no linear module serves a {type(inner).__name__}; known: {known}") from None
    return build(weight, bias, dtype=dtype)
