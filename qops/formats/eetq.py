"""EETQ checkpoints (``quant_method == "eetq"``): int8 weight-only, one scale per output channel (W8A16).

Tensors of one linear, N = out_features, K = in_features:

- ``weight`` int8, shape ``(K, N)`` (in_features first, as EETQ's ``EetqLinear`` registers it).
- ``weight_scales`` float16 ``(N,)``; optional ``bias``.
- ``W[n, k] = weight_scales[n] * q[k, n]`` with ``q`` signed int8.

``q`` is what EETQ's ``quant_weights(w.t(), torch.int8, ...)`` computes from the transposed dense
weight (FasterTransformer's ``symmetric_quantize``): ``weight_scales[n] = max_k |W[n, k]| / 128``
(float32, stored as float16) and ``q = clamp(round(W / scale), -128, 127)``, rounding half away from
zero against the float32 scale.

Two byte orders of ``weight`` exist, named by ``layout``:

- ``"row_major"``: ``q`` itself, row-major ``(K, N)`` (EETQ's unprocessed tensor).
- ``"ampere"`` (default: what ``quant_weights(..., False)`` / ``preprocess_weights`` return and what
  transformers' EETQ integration saves): FasterTransformer's ``preprocess_weights_for_mixed_gemm``
  for int8 on sm75-sm89 (``LayoutDetailsB<uint8_t>``: ThreadblockK 64, 2 columns interleaved,
  imma LDSM), applied to ``q`` ``(K, N)``, K % 64 == 0 and N % 64 == 0:

  1. within every 16 rows, row ``t`` takes source row ``[0,1,8,9,2,3,10,11,4,5,12,13,6,7,14,15][t]``;
  2. transpose to column-major: ``B[n, k]``;
  3. interleave column pairs: byte ``k % 64`` of tile ``k // 64`` of column ``n`` goes to
     ``[n // 2][k // 64][n % 2][k % 64]`` of the output;
  4. add 128 to every byte (int8 wrap), then swap bytes 1 and 2 of every 4.

  The result keeps the shape ``(K, N)``; only the order of its bytes changed.

Sources: EETQ ``csrc/cutlass_kernels/cutlass_preprocessors.cc`` (``permute_B_rows_for_mixed_gemm``,
``subbyte_transpose``, ``interleave_column_major_tensor``, ``add_bias_and_interleave_int8s_inplace``),
``fpA_intB_gemm_wrapper.cu`` (``symmetric_quantize_last_axis_of_tensor``: weight (K, N), scales
(N,)), ``python/eetq/modules/qlinear.py`` (``EetqLinear``: ``weight`` (in, out) int8,
``weight_scales`` (out,) fp16); text-generation-inference's EETQ layer (quantizes fp16 weights at
load time with the same call); the ``LayoutDetailsB<uint8_t>`` constants of ``mixed_gemm_B_layout.h``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import CheckpointFormat
from .bitsandbytes import _check_int8_meaning, _get, int8_meaning
from .integer import IntQuantized

LAYOUTS = ("ampere", "row_major")
# Step 1 of the Ampere preprocessing: row t of every 16 is source row ROW_PERMUTATION[t].
ROW_PERMUTATION = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
_ROW_INVERSE = tuple(sorted(range(16), key=ROW_PERMUTATION.__getitem__))
TILE_K = 64  # ThreadblockK for int8
_BYTE_SWAP = (0, 2, 1, 3)  # step 4: bytes 1 and 2 of every 4 trade places (its own inverse)


@dataclass
class EETQCheckpoint:
    weight: torch.Tensor  # (K, N) int8, bytes in `layout` order
    weight_scales: torch.Tensor  # (N,) float16
    bias: torch.Tensor | None = None
    layout: str = "ampere"

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]


def _check(c: EETQCheckpoint) -> None:
    who = "eetq"
    if c.layout not in LAYOUTS:
        raise ValueError(f"{who}: layout must be one of {LAYOUTS}, got {c.layout!r}")
    if c.weight.dtype != torch.int8 or c.weight.dim() != 2:
        raise ValueError(f"{who}: weight must be a 2-D int8 tensor (K, N), got {c.weight.dtype} {tuple(c.weight.shape)}")
    k, n = c.weight.shape
    if c.layout == "ampere" and (k % TILE_K or n % TILE_K):
        raise ValueError(f"{who}: the ampere layout needs K and N multiples of {TILE_K}, got weight (K, N) = ({k}, {n})")
    if not c.weight_scales.is_floating_point() or tuple(c.weight_scales.shape) != (n,):
        raise ValueError(f"{who}: weight_scales must be floating point of shape ({n},) (N), got {c.weight_scales.dtype} {tuple(c.weight_scales.shape)}")


def ampere_preprocess(q_kn: torch.Tensor) -> torch.Tensor:
    """Row-major int8 ``q`` ``(K, N)`` -> the ``"ampere"`` byte order, same shape."""
    k, n = q_kn.shape
    b = q_kn.reshape(k // 16, 16, n)[:, list(ROW_PERMUTATION), :].reshape(k, n)  # 1
    b = b.t()  # 2: (N, K)
    b = b.reshape(n // 2, 2, k // TILE_K, TILE_K).permute(0, 2, 1, 3)  # 3
    u = (b.reshape(-1).view(torch.uint8) ^ 0x80).reshape(-1, 4)[:, list(_BYTE_SWAP)]  # 4
    return u.reshape(k, n).view(torch.int8)


def ampere_to_nk(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ampere_preprocess`, returning the runtime ``(N, K)`` row-major int8 ``q^T``."""
    k, n = stored.shape
    u = stored.contiguous().view(torch.uint8).reshape(-1, 4)[:, list(_BYTE_SWAP)].reshape(-1) ^ 0x80
    b = u.view(torch.int8).reshape(n // 2, k // TILE_K, 2, TILE_K).permute(0, 2, 1, 3).reshape(n, k)
    return b.reshape(n, k // 16, 16)[:, :, list(_ROW_INVERSE)].reshape(n, k).contiguous()


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


class EETQFormat(CheckpointFormat):
    name = "eetq"
    family = "int8_weight"
    bits = (8,)
    group_sizes = "-1 only (one scale per output channel)"

    def quantize(self, w, *, bits=8, group_size=-1, sym=True, layout="ampere", bias=None) -> EETQCheckpoint:
        if bits != 8 or group_size != -1 or not sym:
            raise ValueError(f"eetq: holds symmetric 8-bit per-channel weights (bits=8, group_size=-1, sym=True), got bits={bits}, group_size={group_size}, sym={sym}")
        wf = w.float()
        scale = wf.abs().amax(dim=1) * (1.0 / 128)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = _round_half_away(wf / safe.unsqueeze(1)).clamp(-128, 127).to(torch.int8)
        return self._from_q(q.t().contiguous(), scale.to(torch.float16), layout, bias)

    def _from_q(self, q_kn: torch.Tensor, scales: torch.Tensor, layout: str, bias) -> EETQCheckpoint:
        c = EETQCheckpoint(weight=q_kn, weight_scales=scales, bias=bias, layout=layout)
        _check(c)
        if layout == "ampere":
            c.weight = ampere_preprocess(q_kn)
        return c

    def pack(self, iq: IntQuantized, *, layout: str = "ampere", bias=None) -> EETQCheckpoint:
        _check_int8_meaning(iq, self.name)
        q = (iq.q.to(torch.int16) - 128).to(torch.int8)
        return self._from_q(q.t().contiguous(), iq.scales[:, 0].to(torch.float16), layout, bias)

    def runtime_qweight(self, c: EETQCheckpoint) -> torch.Tensor:
        """The signed int8 weight as ``(N, K)`` row-major (a new tensor)."""
        _check(c)
        if c.layout == "ampere":
            return ampere_to_nk(c.weight)
        return c.weight.t().contiguous()

    def unpack(self, c: EETQCheckpoint) -> IntQuantized:
        return int8_meaning(self.runtime_qweight(c), c.weight_scales)

    def prepare(self, c: EETQCheckpoint, *, dtype: torch.dtype | None = None):
        """Runtime ``(N, K)`` int8 built once; drop the checkpoint afterwards (same bytes)."""
        from ..ops.int8_weight import prepare_int8_weight

        return prepare_int8_weight(self.runtime_qweight(c), c.weight_scales, dtype=dtype, format_name=self.name)

    def from_state_dict(self, tensors: dict, prefix: str = "", layout: str = "ampere") -> EETQCheckpoint:
        c = EETQCheckpoint(
            weight=_get(tensors, prefix, "weight", who=self.name),
            weight_scales=_get(tensors, prefix, "weight_scales", who=self.name),
            bias=_get(tensors, prefix, "bias", required=False, who=self.name),
            layout=layout,
        )
        _check(c)
        return c

    def to_state_dict(self, c: EETQCheckpoint, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {prefix + "weight": c.weight, prefix + "weight_scales": c.weight_scales}
        if c.bias is not None:
            out[prefix + "bias"] = c.bias
        return out


FORMAT = EETQFormat()
