"""Checkpoint layouts, one module each. Adding a format is one module plus one line below."""
from __future__ import annotations

from . import awq, compressed_tensors, gptq
from . import bitsandbytes, eetq
from . import fp8
from .base import CheckpointFormat
from .integer import IntQuantized, quantize_rtn

FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (gptq.FORMAT, awq.FORMAT, compressed_tensors.FORMAT, *fp8.FORMATS)}
FORMATS.update({f.name: f for f in (eetq.FORMAT, bitsandbytes.INT8, bitsandbytes.NF4, bitsandbytes.FP4)})


def get_format(name: str) -> CheckpointFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown checkpoint format {name!r}; known formats: {sorted(FORMATS)}") from None


__all__ = ["FORMATS", "get_format", "CheckpointFormat", "IntQuantized", "quantize_rtn"]
