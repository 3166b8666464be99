"""Linear layers, checkpoint loading and tensor parallelism over the qops ops (LoRAX/TGI layer API).

Data flows: safetensors files -> ``Weights`` (config, lazy quantization-aware sharding) -> a dense
tensor or a format's checkpoint dataclass -> ``get_linear`` / ``QuantLinear.from_checkpoint``
(prepared once, runtime layout in buffers) -> tensor-parallel layers (functional collectives).
"""
from .base import InputPadded, LinearMethod, QuantConfig, QuantLinear
from .blockwise4 import Blockwise4Linear
from .dense import FastLinear
from .fp8 import Fp8Linear
from .int8 import Int8Linear
from .int_weight import IntWeightLinear
from .layout import ShardingError, WeightsError
from .loader import Weights, parse_quantization_config
from .registry import CHECKPOINT_LINEARS, CONFIG_METHODS, LINEAR_METHODS, get_linear, linear_from_weight
from .tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
)

__all__ = [
    "Blockwise4Linear", "CHECKPOINT_LINEARS", "CONFIG_METHODS", "LINEAR_METHODS", "FastLinear", "Fp8Linear", "InputPadded",
    "Int8Linear", "IntWeightLinear",
    "LinearMethod", "QuantConfig", "QuantLinear", "ShardingError", "TensorParallelColumnLinear",
    "TensorParallelEmbedding", "TensorParallelHead", "TensorParallelRowLinear", "Weights", "WeightsError",
    "get_linear", "linear_from_weight", "parse_quantization_config",
]
