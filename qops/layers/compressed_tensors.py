"""compressed-tensors checkpoints (``quant_method == "compressed-tensors"``): the config's groups.

A config holds ``config_groups``, each with ``targets`` (``"Linear"``, layer names, or ``re:``
regexes), a ``weights`` scheme and a ``format`` (per group, or once for the whole config), plus an
``ignore`` list of layers left unquantized. Each format qops serves maps a group to a scheme:
``pack-quantized`` (integer, ``qops/layers/int_weight.py``) and ``float-quantized`` (fp8,
``qops/layers/fp8.py``). A layer named by a group's targets takes that group; otherwise the group
targeting every ``Linear``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..formats.compressed_tensors import CompressedTensorsCheckpoint
from ..formats.fp8 import Fp8Checkpoint
from .base import InputPadded, LinearMethod, QuantConfig
from .fp8 import Fp8Linear, compressed_tensors_float
from .int_weight import IntWeightLinear, compressed_tensors_pack
from .layout import LinearScheme, WeightsError

# format string -> scheme of one config group (the group dict, a name for errors)
COMPRESSED_TENSORS_FORMATS = {"pack-quantized": compressed_tensors_pack, "float-quantized": compressed_tensors_float}


def _target_matches(target: str, prefix: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return prefix == target or prefix.endswith("." + target)


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantConfig):
    groups: tuple[tuple[tuple[str, ...], LinearScheme], ...]  # (targets, scheme)
    ignore: tuple[str, ...] = ()
    quantize = "compressed-tensors"

    @classmethod
    def from_dict(cls, qc: dict) -> "CompressedTensorsConfig":
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            who = f"compressed-tensors config group {name!r}"
            fmt = group.get("format") or qc.get("format")
            if fmt not in COMPRESSED_TENSORS_FORMATS:
                raise WeightsError(f"{who}: format {fmt!r} is not supported; supported: {sorted(COMPRESSED_TENSORS_FORMATS)}")
            if not group.get("weights"):
                raise WeightsError(f"{who}: has no 'weights' quantization")
            groups.append((tuple(group.get("targets", ["Linear"])), COMPRESSED_TENSORS_FORMATS[fmt](group, who)))
        if not groups:
            raise WeightsError("compressed-tensors: quantization_config has no config_groups")
        return cls(groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()))

    def scheme(self, prefix):
        if any(_target_matches(t, prefix) for t in self.ignore):
            return None
        # A group naming the layer beats a group targeting every Linear.
        for targets, scheme in self.groups:
            if any(t != "Linear" and _target_matches(t, prefix) for t in targets):
                return scheme
        for targets, scheme in self.groups:
            if "Linear" in targets:
                return scheme
        return None


class CompressedTensorsMethod(LinearMethod):
    quantize = "compressed-tensors"
    accepts = "a CompressedTensorsCheckpoint (pack-quantized) or an Fp8Checkpoint (float-quantized)"

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        self.check_no_extras(fan_in_fan_out, weight_scale, input_scale)
        inner = weight.checkpoint if isinstance(weight, InputPadded) else weight
        if isinstance(inner, CompressedTensorsCheckpoint):
            return IntWeightLinear.from_checkpoint(weight, bias, dtype=dtype)
        if isinstance(weight, Fp8Checkpoint):
            return Fp8Linear.from_checkpoint(weight, bias, dtype=dtype)
        raise self.refuse(weight)


METHOD = CompressedTensorsMethod()
