"""What every checkpoint format module provides, so registries and tests can treat them alike."""
from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch


class CheckpointFormat(abc.ABC):
    """One checkpoint layout: its tensors, their exact packing, and conversions to the shared meaning.

    ``checkpoint`` objects are the format's own dataclass holding the tensors exactly as the
    checkpoint stores them plus the config values needed to read them.
    """

    name: ClassVar[str]
    family: ClassVar[str]  # which op family serves it once prepared ("int_weight", ...)
    bits: ClassVar[tuple[int, ...]]
    group_sizes: ClassVar[str] = "-1 or any positive divisor-free size (partial last group allowed)"

    @abc.abstractmethod
    def quantize(self, w: torch.Tensor, **options: Any):
        """Reference round-to-nearest quantization of a dense ``(N, K)`` weight into a checkpoint.

        Options are the family's: ``bits``, ``group_size``, ``sym`` for integer formats; a scale
        ``granularity`` for fp8.
        """

    @abc.abstractmethod
    def pack(self, meaning, **options: Any):
        """Shared meaning (the family's dataclass: ``IntQuantized``, ``Fp8Quantized``) -> checkpoint tensors."""

    @abc.abstractmethod
    def unpack(self, checkpoint):
        """Checkpoint tensors -> shared meaning (exact)."""

    def dequantize(self, checkpoint) -> torch.Tensor:
        """Reference dequantizer: the fp32 ``(N, K)`` weight."""
        return self.unpack(checkpoint).dequantize()

    def prepare(self, checkpoint, *, dtype: torch.dtype | None = None, choose_lowering: bool = True):
        """Checkpoint -> runtime layout with a kernel chosen for its device (``IntWeight``)."""
        from ..ops.int_weight import prepare_int_weight

        return prepare_int_weight(self.unpack(checkpoint), dtype=dtype, format_name=self.name, choose_lowering=choose_lowering)
