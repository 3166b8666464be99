"""4-bit codebook weights with one absmax per flat block (bitsandbytes NF4 / FP4): ops, runtime
layout, argument checks shared with the fakes, and the pure-torch reference kernel.

Runtime layout (what ``prepare_blockwise4`` builds and every lowering reads) = the checkpoint's own
tensors, as views: K = in_features, N = out_features (``out_features``), B = ``blocksize``,
n_blocks = ceil(N*K / B), e = n*K + k the flat index of ``W[n, k]``:

- ``qweight`` uint8 ``(ceil(N*K/2),)``: code of element e in the high nibble of byte e // 2 when e
  is even, in the low nibble when odd.
- ``code`` float32 ``(16,)``: the codebook.
- ``absmax`` float32 ``(n_blocks,)``, or uint8 ``(n_blocks,)`` when nested, with ``nested_code``
  float32 ``(256,)``, ``nested_absmax`` float32 ``(ceil(n_blocks / nested_blocksize),)`` and
  ``nested_offset`` float32 ``(1,)``:
  ``absmax[b] = nested_code[absmax_u8[b]] * nested_absmax[b // nested_blocksize] + nested_offset``.

``W.flat[e] = code[nibble(e)] * absmax[e // B]``; ``y = x @ W.T + bias``.

``qweight`` comes in one of two byte orders, named by the ops' ``layout`` argument (absmax and the
nested tables are the same in both):

- ``LAYOUT_FLAT`` (0): the checkpoint's byte stream above, used as a view.
- ``LAYOUT_TILE16`` (1), for N % 16 == 0 and K % 128 == 0: the same bytes reordered so that each
  16-row tile of W is contiguous, and inside a tile each 64-byte column chunk of its 16 rows (1 KiB,
  row after row) follows the previous chunk: byte ``kb`` of row n (K values 2kb, 2kb + 1) sits at
  ``(n // 16) * 8K + (kb // 64) * 1024 + (n % 16) * 64 + kb % 64``. It is what a warp of the native
  kernel reads in one 128-wide step of K, so each of its requests is 1 KiB contiguous where the
  flat order gives 64 bytes from each of 16 rows K/2 bytes apart (the same kernel on the H200 at
  M = 1: 7-12% faster, ``benchmarks/results/h200-2026-11-30-4635f3f-probe-nf4-layout.json``).
  ``prepare_blockwise4`` builds it (one copy, the same byte count) when the chosen lowering reads
  it; every lowering serves both.

Nested absmax stays nested at run time and is de-nested inside the kernels: de-nesting to float32
would add 3 bytes per block (+9.4% over the checkpoint at B = 64), to float16 1 byte (+3.1%), both
over the 2% budget; the nested tables cost 1 KiB plus 4 bytes per 256 blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..formats.blockwise4 import denest, dequantize_flat, unpack_nibbles
from ..lowerings import CallFacts, Choice, Kernel, WeightSpec, choose, implementation, warm_up
from ._common import (check_bias, check_dequantize_dtype, check_devices, check_disjoint, check_in_features, check_out,
                      check_workspace, check_x, fail, reference_matmul, refuse_gradients,
                      register_frozen_weight_autograd)

FAMILY = "blockwise4"
LAYOUT_FLAT, LAYOUT_TILE16 = 0, 1
LAYOUTS = {LAYOUT_FLAT: "flat", LAYOUT_TILE16: "tile16"}
TILE_ROWS, CHUNK_BYTES = 16, 64  # LAYOUT_TILE16: rows a tile, row bytes a chunk (128 K values)


def tile16_fits(n: int, k: int) -> bool:
    """Whether an (N, K) weight has a ``LAYOUT_TILE16`` form (whole tiles and whole chunks)."""
    return n % TILE_ROWS == 0 and k % (2 * CHUNK_BYTES) == 0


def to_tile16(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``LAYOUT_TILE16`` bytes of a ``LAYOUT_FLAT`` qweight (a new contiguous tensor)."""
    rows = qweight.reshape(n // TILE_ROWS, TILE_ROWS, k // (2 * CHUNK_BYTES), CHUNK_BYTES)  # (tile, row, chunk, byte)
    return rows.permute(0, 2, 1, 3).contiguous().view(-1)


def from_tile16(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``LAYOUT_FLAT`` bytes of a ``LAYOUT_TILE16`` qweight (a new contiguous tensor)."""
    tiles = qweight.reshape(n // TILE_ROWS, k // (2 * CHUNK_BYTES), TILE_ROWS, CHUNK_BYTES)  # (tile, chunk, row, byte)
    return tiles.permute(0, 2, 1, 3).contiguous().view(-1)


def check_blockwise4(who, k, qweight, code, absmax, nested_code, nested_absmax, nested_offset,
                     out_features: int, blocksize: int, nested_blocksize: int, layout: int, device: torch.device):
    """Validate the runtime weight for ``k`` input features; returns N. Works on fake tensors."""
    if out_features < 0:
        raise ValueError(fail(who, f"out_features must be >= 0, got {out_features}"))
    check_in_features(who, k)
    if blocksize <= 0:
        raise ValueError(fail(who, f"blocksize must be positive, got {blocksize}"))
    if layout not in LAYOUTS:
        raise ValueError(fail(who, f"layout must be one of {LAYOUTS} (qweight's byte order), got {layout}"))
    if layout == LAYOUT_TILE16 and not tile16_fits(out_features, k):
        raise ValueError(fail(who, f"layout={LAYOUT_TILE16} (tile16) needs N % {TILE_ROWS} == 0 and K % {2 * CHUNK_BYTES} == 0, "
                                   f"got N={out_features}, K={k}"))
    tensors = (("qweight", qweight), ("code", code), ("absmax", absmax), ("nested_code", nested_code),
               ("nested_absmax", nested_absmax), ("nested_offset", nested_offset))
    check_devices(who, tensors, device)
    n = out_features
    numel = n * k
    torch._check_type(qweight.dtype == torch.uint8, lambda: fail(who, f"qweight must be torch.uint8, got {qweight.dtype}"))
    torch._check_value(
        qweight.dim() == 1 and qweight.shape[0] == (numel + 1) // 2,
        lambda: fail(who, f"qweight must have shape ({(numel + 1) // 2},) (ceil(N*K/2) with N={n}, K={k}), got {tuple(qweight.shape)}"),
    )
    torch._check_type(code.dtype == torch.float32, lambda: fail(who, f"code must be torch.float32, got {code.dtype}"))
    torch._check_value(code.dim() == 1 and code.shape[0] == 16, lambda: fail(who, f"code must have shape (16,), got {tuple(code.shape)}"))
    n_blocks = (numel + blocksize - 1) // blocksize
    nested = absmax.dtype == torch.uint8
    torch._check_type(
        absmax.dtype in (torch.float32, torch.uint8),
        lambda: fail(who, f"absmax must be torch.float32 (plain) or torch.uint8 (nested), got {absmax.dtype}"),
    )
    torch._check_value(
        absmax.dim() == 1 and absmax.shape[0] == n_blocks,
        lambda: fail(who, f"absmax must have shape ({n_blocks},) (ceil(N*K/blocksize) with N={n}, K={k}, blocksize={blocksize}), got {tuple(absmax.shape)}"),
    )
    parts = (("nested_code", nested_code), ("nested_absmax", nested_absmax), ("nested_offset", nested_offset))
    if not nested:
        for name, t in parts:
            if t is not None:
                raise ValueError(fail(who, f"{name} must be None when absmax is float32 (not nested)"))
        return n
    for name, t in parts:
        if t is None:
            raise ValueError(fail(who, f"{name} is required when absmax is uint8 (nested)"))
        torch._check_type(t.dtype == torch.float32, lambda: fail(who, f"{name} must be torch.float32, got {t.dtype}"))
    if nested_blocksize <= 0:
        raise ValueError(fail(who, f"nested_blocksize must be positive when absmax is nested, got {nested_blocksize}"))
    torch._check_value(
        nested_code.dim() == 1 and nested_code.shape[0] == 256,
        lambda: fail(who, f"nested_code must have shape (256,), got {tuple(nested_code.shape)}"),
    )
    n_nested = (n_blocks + nested_blocksize - 1) // nested_blocksize
    torch._check_value(
        nested_absmax.dim() == 1 and nested_absmax.shape[0] == n_nested,
        lambda: fail(who, f"nested_absmax must have shape ({n_nested},) (ceil(n_blocks/nested_blocksize) with n_blocks={n_blocks}, nested_blocksize={nested_blocksize}), got {tuple(nested_absmax.shape)}"),
    )
    torch._check_value(
        nested_offset.dim() == 1 and nested_offset.shape[0] == 1,
        lambda: fail(who, f"nested_offset must have shape (1,), got {tuple(nested_offset.shape)}"),
    )
    return n


def check_mm_blockwise4(who, x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias,
                        out_features, in_features, blocksize, nested_blocksize, layout) -> list:
    """Validate every argument of ``mm_blockwise4``; returns the output shape."""
    # in_features is explicit because the flat packing cannot tell K from K + 1 when N is 1 and K odd.
    check_x(who, x, in_features)
    n = check_blockwise4(who, in_features, qweight, code, absmax, nested_code, nested_absmax, nested_offset,
                         out_features, blocksize, nested_blocksize, layout, x.device)
    check_bias(who, bias, n, x.device)
    return [*x.shape[:-1], n]


def call_facts(x, shape, blocksize) -> CallFacts:
    """What a lowering must serve for this call (checked when the op names its kernel)."""
    return CallFacts(4, blocksize, x.dtype, shape[-1], x.shape[-1])


_WEIGHT_ARGS = (
    "Tensor qweight, Tensor code, Tensor absmax, Tensor? nested_code, Tensor? nested_absmax, Tensor? nested_offset"
)
# layout: qweight's byte order (LAYOUTS); required, so that no call reads tile16 bytes as flat ones.
_STATIC_ARGS = "int out_features, int in_features, int blocksize, int nested_blocksize, int layout"
MM_SCHEMA = f"(Tensor x, {_WEIGHT_ARGS}, Tensor? bias, {_STATIC_ARGS}, int kernel) -> Tensor"
MM_OUT_SCHEMA = (
    f"(Tensor x, {_WEIGHT_ARGS}, Tensor? bias, {_STATIC_ARGS}, int kernel, "
    "Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
DEQUANT_SCHEMA = (
    f"({_WEIGHT_ARGS}, {_STATIC_ARGS}, ScalarType dtype) -> Tensor"
)


@torch.library.custom_op("qops::mm_blockwise4", mutates_args=(), schema=MM_SCHEMA)
def mm_blockwise4(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (ceil(N*K/2),) uint8, flat, first element in the high nibble
    code: torch.Tensor,  # (16,) float32 codebook
    absmax: torch.Tensor,  # (n_blocks,) float32, or uint8 when nested
    nested_code: Optional[torch.Tensor],  # (256,) float32 or None
    nested_absmax: Optional[torch.Tensor],  # (ceil(n_blocks/nested_blocksize),) float32 or None
    nested_offset: Optional[torch.Tensor],  # (1,) float32 or None
    bias: Optional[torch.Tensor],  # (N,) or None
    out_features: int,  # N
    in_features: int,  # K, the last dimension of x
    blocksize: int,
    nested_blocksize: int,  # ignored unless nested
    layout: int,  # LAYOUT_FLAT or LAYOUT_TILE16: qweight's byte order
    kernel: int,  # qops.lowerings.Kernel
) -> torch.Tensor:  # (..., N), dtype of x
    shape = check_mm_blockwise4("mm_blockwise4", x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias,
                                out_features, in_features, blocksize, nested_blocksize, layout)
    impl = implementation(FAMILY, kernel, x.device, "mm_blockwise4", call_facts(x, shape, blocksize))
    return impl(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
                nested_blocksize, layout)


@torch.library.custom_op("qops::mm_blockwise4_out", mutates_args=("out", "workspace"), schema=MM_OUT_SCHEMA)
def mm_blockwise4_out(
    x: torch.Tensor,
    qweight: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    nested_code: Optional[torch.Tensor],
    nested_absmax: Optional[torch.Tensor],
    nested_offset: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    out_features: int,
    in_features: int,
    blocksize: int,
    nested_blocksize: int,
    layout: int,
    kernel: int,
    out: torch.Tensor,  # (..., N), dtype of x, caller-owned; written
    workspace: Optional[torch.Tensor],  # caller-owned scratch (uint8); clobbered
) -> None:
    shape = check_mm_blockwise4("mm_blockwise4_out", x, qweight, code, absmax, nested_code, nested_absmax,
                                nested_offset, bias, out_features, in_features, blocksize, nested_blocksize, layout)
    check_out("mm_blockwise4_out", out, shape, x)
    check_workspace("mm_blockwise4_out", workspace, x)
    check_disjoint("mm_blockwise4_out", (("out", out), ("workspace", workspace)),
                   (("x", x), ("qweight", qweight), ("code", code), ("absmax", absmax), ("nested_code", nested_code),
                    ("nested_absmax", nested_absmax), ("nested_offset", nested_offset), ("bias", bias)))
    impl = implementation(FAMILY, kernel, x.device, "mm_blockwise4_out", call_facts(x, shape, blocksize))
    impl(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
         nested_blocksize, layout, out=out, workspace=workspace)


refuse_gradients("mm_blockwise4_out", "mm_blockwise4")


@torch.library.custom_op("qops::dequantize_blockwise4", mutates_args=(), schema=DEQUANT_SCHEMA)
def dequantize_blockwise4(
    qweight: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    nested_code: Optional[torch.Tensor],
    nested_absmax: Optional[torch.Tensor],
    nested_offset: Optional[torch.Tensor],
    out_features: int,  # N
    in_features: int,  # K
    blocksize: int,
    nested_blocksize: int,
    layout: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K)
    check_blockwise4("dequantize_blockwise4", in_features, qweight, code, absmax, nested_code, nested_absmax,
                     nested_offset, out_features, blocksize, nested_blocksize, layout, qweight.device)
    check_dequantize_dtype("dequantize_blockwise4", dtype)
    w = reference_dequantize(qweight, code, absmax, nested_code, nested_absmax, nested_offset, out_features,
                             in_features, blocksize, nested_blocksize, layout)
    return w.to(dtype)


def block_absmax(absmax, nested_code, nested_absmax, nested_offset, nested_blocksize) -> torch.Tensor:
    """float32 ``(n_blocks,)``, de-nested when ``absmax`` is uint8."""
    if absmax.dtype != torch.uint8:
        return absmax.float()
    return denest(absmax, nested_code, nested_absmax, nested_offset, nested_blocksize)


def reference_dequantize(qweight, code, absmax, nested_code, nested_absmax, nested_offset, n, k, blocksize,
                         nested_blocksize, layout) -> torch.Tensor:
    """fp32 ``(N, K)`` weight, straight from the layout's definition."""
    s = block_absmax(absmax, nested_code, nested_absmax, nested_offset, nested_blocksize)
    if layout == LAYOUT_TILE16:
        qweight = from_tile16(qweight, n, k)
    return dequantize_flat(unpack_nibbles(qweight, n * k), code, s, blocksize, n, k)


def reference_mm(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
                 nested_blocksize, layout, out=None, workspace=None) -> torch.Tensor:
    """The CPU kernel (and the GPU fallback): the lowering entry contract of this family, ``x (..., K)
    -> (..., N)`` (or written into ``out``), arguments already validated; ``workspace`` unused."""
    w = reference_dequantize(qweight, code, absmax, nested_code, nested_absmax, nested_offset, out_features,
                             x.shape[-1], blocksize, nested_blocksize, layout)
    return reference_matmul(x, w, bias, out)


# Inputs (x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features,
# in_features, blocksize, nested_blocksize, layout, kernel).
register_frozen_weight_autograd(
    mm_blockwise4, torch.ops.qops.dequantize_blockwise4, tensors=(1, 2, 3, 4, 5, 6), statics=(8, 9, 10, 11, 12), bias=7,
)


@dataclass
class Blockwise4Weight:
    """A prepared 4-bit blockwise weight: runtime tensors (checkpoint views, or for ``LAYOUT_TILE16``
    the reordered bytes) plus static facts."""

    qweight: torch.Tensor
    code: torch.Tensor
    absmax: torch.Tensor
    nested_code: torch.Tensor | None
    nested_absmax: torch.Tensor | None
    nested_offset: torch.Tensor | None
    in_features: int
    out_features: int
    blocksize: int
    nested_blocksize: int
    kernel: Kernel
    choice: Choice | None = None
    act_dtype: torch.dtype = torch.float16  # the activation dtype it was prepared (and warmed up) for
    layout: int = LAYOUT_FLAT  # qweight's byte order

    def _weight_args(self):
        return (self.qweight, self.code, self.absmax, self.nested_code, self.nested_absmax, self.nested_offset)

    def _static_args(self):
        return (self.out_features, self.in_features, self.blocksize, self.nested_blocksize, self.layout)

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.qops.mm_blockwise4(x, *self._weight_args(), bias, *self._static_args(), int(self.kernel))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.qops.dequantize_blockwise4(*self._weight_args(), *self._static_args(), dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._weight_args() if t is not None)

    def with_layout(self, layout: int) -> "Blockwise4Weight":
        """This weight with qweight in byte order ``layout`` (the bytes copied when it changes), warmed
        up for its lowering: to compare the orders, or to keep the checkpoint's stream."""
        if layout == self.layout:
            return self
        check_blockwise4("Blockwise4Weight.with_layout", self.in_features, *self._weight_args(), self.out_features,
                         self.blocksize, self.nested_blocksize, layout, self.qweight.device)
        n, k = self.out_features, self.in_features
        flat = self.qweight if self.layout == LAYOUT_FLAT else from_tile16(self.qweight, n, k)
        weight = replace(self, qweight=flat if layout == LAYOUT_FLAT else to_tile16(flat, n, k), layout=layout)
        if self.choice is not None:
            warm_up(self.choice.lowering, weight)
        return weight


def preferred_layout(kernel: Kernel, n: int, k: int) -> int:
    """The byte order a weight prepared for lowering ``kernel`` is given: tile16 for the native
    kernel wherever the weight has that form (its reads are 1 KiB contiguous there), the
    checkpoint's own bytes (no copy) otherwise. Every lowering reads both."""
    return LAYOUT_TILE16 if kernel == Kernel.NATIVE and tile16_fits(n, k) else LAYOUT_FLAT


def prepare_blockwise4(
    *,
    qweight: torch.Tensor,
    code: torch.Tensor,
    absmax: torch.Tensor,
    nested_code: torch.Tensor | None,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    out_features: int,
    in_features: int,
    blocksize: int,
    nested_blocksize: int,
    dtype: torch.dtype | None = None,
    format_name: str = "bitsandbytes-nf4",
    layout: int | None = None,
) -> Blockwise4Weight:
    """Wrap the runtime tensors and choose the lowering for their device.

    ``dtype`` is the activation dtype the weight will see (default float16). ``layout`` (None: the
    one the chosen lowering reads fastest, see :func:`preferred_layout`) is qweight's byte order at
    run time: ``LAYOUT_FLAT`` keeps the checkpoint's bytes as a view, ``LAYOUT_TILE16`` copies them
    once into tile order (the same byte count).
    """
    dev = qweight.device
    args = dict(
        qweight=qweight.reshape(-1),
        code=code.to(dev),
        absmax=absmax.reshape(-1),
        nested_code=None if nested_code is None else nested_code.to(dev).reshape(-1),
        nested_absmax=None if nested_absmax is None else nested_absmax.to(dev).reshape(-1),
        nested_offset=None if nested_offset is None else nested_offset.to(dev).reshape(1),
    )
    check_blockwise4("prepare_blockwise4", in_features, *args.values(), out_features, blocksize, nested_blocksize,
                     LAYOUT_FLAT, dev)
    act_dtype = dtype if dtype is not None else torch.float16
    spec = WeightSpec(
        family=FAMILY, format=format_name, bits=4, group_size=blocksize, n=out_features, k=in_features,
        act_order=False, symmetric=True, device=dev, act_dtype=act_dtype,
    )
    choice = choose(spec)
    if layout is None:
        layout = preferred_layout(choice.lowering.kernel, out_features, in_features)
    if layout != LAYOUT_FLAT:  # the checks name an unknown layout, or a shape without the tile16 form
        check_blockwise4("prepare_blockwise4", in_features, *args.values(), out_features, blocksize, nested_blocksize,
                         layout, dev)
        args["qweight"] = to_tile16(args["qweight"], out_features, in_features)
    weight = Blockwise4Weight(**args, in_features=in_features, out_features=out_features, blocksize=blocksize,
                              nested_blocksize=nested_blocksize if absmax.dtype == torch.uint8 else 0,
                              kernel=choice.lowering.kernel, choice=choice, act_dtype=act_dtype, layout=layout)
    warm_up(choice.lowering, weight)
    return weight
