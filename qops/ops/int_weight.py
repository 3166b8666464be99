"""Integer weight-only matmul (GPTQ, AWQ, compressed-tensors once prepared): ops, runtime layout,
argument checks shared with the fakes, and the pure-torch reference kernel.

Runtime layout (what ``prepare_int_weight`` builds and every lowering reads), K = in_features,
N = out_features, b = bits, G = group_size (K when -1), n_groups = ceil(K / G):

- ``qweight`` int32 ``(ceil(K*b/32), N)``: column n is a little-endian bit stream along the runtime
  K order, row j at stream bits ``[j*b, (j+1)*b)`` (GPTQ's packing; 3-bit values may straddle words).
  Or the same words in column slabs, int32 ``(N/32, ceil(K*b/32), 32)``: ``slabs[s, j, i]`` is word
  ``(j, 32*s + i)``, so each 32 columns' whole K stream is contiguous (N % 32 == 0). The shape says
  which form a tensor is in, so neither can be read as the other. Weights prepared for the native
  lowering get slabs (:func:`preferred_qweight_form`): a warp's 4 word rows x 32 columns are then 512
  contiguous bytes instead of four 128-byte pieces 4N bytes apart. Measured against the flat form in
  one run, same plans, bit-identical outputs: M = 1 1.9-5.3% faster on the four large PERF.md shapes,
  M = 16 -0.4..+3.5%, M = 64 (the GEMM) +0.4-0.8%, 4096x4096 within 1%
  (``benchmarks/results/h200-2026-12-02-e08906c-probe-slabs.json``).
- ``scales`` float ``(n_groups, N)``: runtime rows ``[g*G, (g+1)*G)`` form group g (the last group
  may be partial), so groups are contiguous in K.
- ``qzeros`` int32 ``(n_groups, ceil(N*b/32))``, a bit stream along N, the zero being the stored
  value plus ``zero_offset`` (1 keeps GPTQ v1 zeros of 2**b representable); or None for symmetric
  weights, whose zero is 2**(b-1).
- ``act_perm`` int32 ``(K,)`` or None: runtime row j is checkpoint row ``act_perm[j]`` (act-order
  resolved once, here); the op gathers ``x[..., act_perm]``.

``y = x[..., act_perm] @ W_rt.T + bias``, ``W_rt[n, j] = scales[j // G, n] * (q[j, n] - zero[j // G, n])``.
A GPTQ checkpoint without act-order is already in this layout and is used without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..formats._packing import pack_bits, packed_length, unpack_bits
from ..formats.integer import IntQuantized, default_g_idx, n_groups_for
from ..lowerings import CallFacts, Choice, Kernel, WeightSpec, choose, implementation, swiglu_implementation, warm_up
from ._common import (check_act_dtype, check_bias, check_dequantize_dtype, check_devices, check_disjoint,
                      check_in_features, check_out, check_workspace, check_x, fail, reference_matmul, refuse_gradients,
                      register_frozen_weight_autograd)

FAMILY = "int_weight"
SUPPORTED_BITS = (2, 3, 4, 8)
SLAB_COLUMNS = 32  # columns of one slab of the column-slab qweight form


def qweight_columns(qweight: torch.Tensor) -> int:
    """N of a qweight in either form (the 2-D one's columns, or 32 per slab)."""
    return qweight.shape[0] * SLAB_COLUMNS if qweight.dim() == 3 else qweight.shape[1]


def qweight_word_rows(qweight: torch.Tensor) -> int:
    """ceil(K*bits/32): the word rows of a qweight in either form."""
    return qweight.shape[-2]


def qweight_strides(qweight: torch.Tensor) -> tuple[int, int]:
    """(words from one word row to the next, words from one 32-column slab to the next), so that word
    ``(j, n)`` is at ``j * row + (n // 32) * slab + n % 32`` in either form (the flat form's slab
    stride is 32). Needs unit stride along the columns."""
    if qweight.dim() == 3:
        return qweight.stride(1), qweight.stride(0)
    return qweight.stride(0), SLAB_COLUMNS


def to_column_slabs(qweight: torch.Tensor) -> torch.Tensor:
    """A flat ``(rows, N)`` qweight in column slabs ``(N/32, rows, 32)`` (a copy)."""
    rows, n = qweight.shape
    if n % SLAB_COLUMNS:
        raise ValueError(f"to_column_slabs: qweight needs N % {SLAB_COLUMNS} == 0, got N={n}")
    return qweight.reshape(rows, n // SLAB_COLUMNS, SLAB_COLUMNS).permute(1, 0, 2).contiguous()


def flat_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """The flat ``(rows, N)`` qweight of either form (a copy for slabs, qweight itself when flat)."""
    if qweight.dim() == 2:
        return qweight
    slabs, rows, _ = qweight.shape
    return qweight.permute(1, 0, 2).reshape(rows, slabs * SLAB_COLUMNS)


def preferred_qweight_form(kernel: Kernel, bits: int, n: int) -> str:
    """``"slabs"`` or ``"flat"``: the qweight form a weight prepared for lowering ``kernel`` gets. Slabs
    for the native 4-bit kernels, which read them (and the Triton kernels they delegate to read either
    form); the Triton lowering's own tuned configurations were measured on the flat form."""
    return "slabs" if kernel == Kernel.NATIVE and bits == 4 and n % SLAB_COLUMNS == 0 else "flat"


def check_int_weight(
    who: str,
    k,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: Optional[torch.Tensor],
    act_perm: Optional[torch.Tensor],
    bits: int,
    group_size: int,
    zero_offset: int,
    device: torch.device,
):
    """Validate the runtime weight for ``k`` input features; returns N. Works on fake tensors."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(fail(who, f"bits must be one of {list(SUPPORTED_BITS)}, got {bits}"))
    if group_size != -1 and group_size <= 0:
        raise ValueError(fail(who, f"group_size must be -1 or positive, got {group_size}"))
    if zero_offset not in (0, 1):
        raise ValueError(fail(who, f"zero_offset must be 0 or 1, got {zero_offset}"))
    check_in_features(who, k)
    check_devices(who, (("qweight", qweight), ("scales", scales), ("qzeros", qzeros), ("act_perm", act_perm)), device)
    torch._check_type(qweight.dtype == torch.int32, lambda: fail(who, f"qweight must be torch.int32, got {qweight.dtype}"))
    torch._check_value(qweight.dim() in (2, 3), lambda: fail(who, f"qweight must be 2-D (ceil(K*bits/32), N) or column slabs (N/32, ceil(K*bits/32), 32), got {qweight.dim()}-D"))
    if qweight.dim() == 3:
        torch._check_value(qweight.shape[2] == SLAB_COLUMNS, lambda: fail(who, f"qweight in column slabs must have shape (N/32, ceil(K*bits/32), {SLAB_COLUMNS}), got {tuple(qweight.shape)}"))
    n = qweight_columns(qweight)
    rows = (k * bits + 31) // 32
    torch._check_value(qweight_word_rows(qweight) == rows, lambda: fail(who, f"qweight must have {rows} word rows (ceil(K*bits/32) with K={k}, bits={bits}), got {qweight_word_rows(qweight)}"))
    n_groups = 1 if group_size == -1 else (k + group_size - 1) // group_size
    check_act_dtype(who, "scales", scales)
    torch._check_value(
        scales.dim() == 2 and scales.shape[0] == n_groups and scales.shape[1] == n,
        lambda: fail(who, f"scales must have shape ({n_groups}, {n}) (n_groups=ceil(K/group_size) with K={k}, group_size={group_size}; N from qweight), got {tuple(scales.shape)}"),
    )
    if qzeros is not None:
        zcols = (n * bits + 31) // 32
        torch._check_type(qzeros.dtype == torch.int32, lambda: fail(who, f"qzeros must be torch.int32, got {qzeros.dtype}"))
        torch._check_value(
            qzeros.dim() == 2 and qzeros.shape[0] == n_groups and qzeros.shape[1] == zcols,
            lambda: fail(who, f"qzeros must have shape ({n_groups}, {zcols}) (ceil(N*bits/32) with N={n}), got {tuple(qzeros.shape)}"),
        )
    if act_perm is not None:
        torch._check_type(act_perm.dtype in (torch.int32, torch.int64), lambda: fail(who, f"act_perm must be int32 or int64, got {act_perm.dtype}"))
        torch._check_value(act_perm.dim() == 1 and act_perm.shape[0] == k, lambda: fail(who, f"act_perm must have shape ({k},) (K), got {tuple(act_perm.shape)}"))
    return n


def check_mm_int_weight(who, x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset) -> list:
    """Validate every argument of ``mm_int_weight``; returns the output shape."""
    # K is an argument, not read off x: 71 and 72 features pack into the same 9 rows at 4 bits, so
    # the packed shapes alone would let a wrong x through.
    check_x(who, x, in_features)
    n = check_int_weight(who, in_features, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset, x.device)
    check_bias(who, bias, n, x.device)
    return [*x.shape[:-1], n]


def check_mm_int_weight_swiglu(who, x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset) -> list:
    """Validate every argument of ``mm_int_weight_swiglu``; returns the shape of the full product
    ``(..., N)`` (the output is ``(..., N/2)``)."""
    shape = check_mm_int_weight(who, x, qweight, scales, qzeros, act_perm, None, in_features, bits, group_size, zero_offset)
    torch._check_value(shape[-1] % 2 == 0, lambda: fail(who, f"qweight must have an even N (gate columns, then as many up columns), got N={shape[-1]}"))
    return shape


def call_facts(x, shape, act_perm, in_features, bits, group_size) -> CallFacts:
    """What a lowering must serve for this call (checked when the op names its kernel)."""
    return CallFacts(bits, group_size, x.dtype, shape[-1], in_features, act_perm is not None)


# Schemas are written out so that bits, group sizes and kernel ids are plain `int` (not SymInt):
# they are static facts of the weight and Dynamo must specialize on them.
MM_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? act_perm, Tensor? bias, "
    "int in_features, int bits, int group_size, int zero_offset, int kernel) -> Tensor"
)
MM_OUT_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? act_perm, Tensor? bias, "
    "int in_features, int bits, int group_size, int zero_offset, int kernel, Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
SWIGLU_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? act_perm, "
    "int in_features, int bits, int group_size, int zero_offset, int kernel) -> Tensor"
)
SWIGLU_OUT_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? act_perm, "
    "int in_features, int bits, int group_size, int zero_offset, int kernel, Tensor(a!) out, Tensor(b!)? workspace) -> ()"
)
DEQUANT_SCHEMA = (
    "(Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? act_perm, int in_features, "
    "int bits, int group_size, int zero_offset, ScalarType dtype) -> Tensor"
)


@torch.library.custom_op("qops::mm_int_weight", mutates_args=(), schema=MM_SCHEMA)
def mm_int_weight(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (ceil(K*bits/32), N) int32, bit stream along K, or its column slabs (N/32, ., 32)
    scales: torch.Tensor,  # (n_groups, N) float
    qzeros: Optional[torch.Tensor],  # (n_groups, ceil(N*bits/32)) int32 or None (symmetric)
    act_perm: Optional[torch.Tensor],  # (K,) int32 or None
    bias: Optional[torch.Tensor],  # (N,) or None
    in_features: int,  # K
    bits: int,
    group_size: int,
    zero_offset: int,
    kernel: int,  # qops.lowerings.Kernel
) -> torch.Tensor:  # (..., N), dtype of x
    shape = check_mm_int_weight("mm_int_weight", x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset)
    impl = implementation(FAMILY, kernel, x.device, "mm_int_weight", call_facts(x, shape, act_perm, in_features, bits, group_size))
    return impl(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset)


@torch.library.custom_op("qops::mm_int_weight_out", mutates_args=("out", "workspace"), schema=MM_OUT_SCHEMA)
def mm_int_weight_out(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (ceil(K*bits/32), N) int32
    scales: torch.Tensor,  # (n_groups, N) float
    qzeros: Optional[torch.Tensor],  # (n_groups, ceil(N*bits/32)) int32 or None
    act_perm: Optional[torch.Tensor],  # (K,) int32 or None
    bias: Optional[torch.Tensor],  # (N,) or None
    in_features: int,  # K
    bits: int,
    group_size: int,
    zero_offset: int,
    kernel: int,
    out: torch.Tensor,  # (..., N), dtype of x, caller-owned; written
    workspace: Optional[torch.Tensor],  # caller-owned scratch (uint8, >= the lowering's need); clobbered
) -> None:
    shape = check_mm_int_weight("mm_int_weight_out", x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset)
    check_out("mm_int_weight_out", out, shape, x)
    check_workspace("mm_int_weight_out", workspace, x)
    check_disjoint("mm_int_weight_out", (("out", out), ("workspace", workspace)),
                   (("x", x), ("qweight", qweight), ("scales", scales), ("qzeros", qzeros), ("act_perm", act_perm), ("bias", bias)))
    impl = implementation(FAMILY, kernel, x.device, "mm_int_weight_out", call_facts(x, shape, act_perm, in_features, bits, group_size))
    impl(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=out, workspace=workspace)


refuse_gradients("mm_int_weight_out", "mm_int_weight")


# The gated forms: a fused [gate; up] weight (N = 2H, the gate projection's rows first) and
# y = silu(x @ W_gate.T) * (x @ W_up.T), (..., H): a SwiGLU MLP's first half in one op, which a
# lowering with a gated kernel computes in its epilogue from the fp32 sums
# (qops.lowerings.swiglu_implementation). No bias: SwiGLU MLPs have none.
@torch.library.custom_op("qops::mm_int_weight_swiglu", mutates_args=(), schema=SWIGLU_SCHEMA)
def mm_int_weight_swiglu(
    x: torch.Tensor,  # (..., K) float32 / float16 / bfloat16
    qweight: torch.Tensor,  # (ceil(K*bits/32), 2H) int32: gate columns 0..H-1, up columns H..2H-1
    scales: torch.Tensor,  # (n_groups, 2H) float
    qzeros: Optional[torch.Tensor],  # (n_groups, ceil(2H*bits/32)) int32 or None
    act_perm: Optional[torch.Tensor],  # (K,) int32 or None
    in_features: int,  # K
    bits: int,
    group_size: int,
    zero_offset: int,
    kernel: int,
) -> torch.Tensor:  # (..., H), dtype of x
    shape = check_mm_int_weight_swiglu("mm_int_weight_swiglu", x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset)
    impl = swiglu_implementation(FAMILY, kernel, x.device, "mm_int_weight_swiglu", call_facts(x, shape, act_perm, in_features, bits, group_size))
    return impl(x, qweight, scales, qzeros, act_perm, None, bits, group_size, zero_offset)


@torch.library.custom_op("qops::mm_int_weight_swiglu_out", mutates_args=("out", "workspace"), schema=SWIGLU_OUT_SCHEMA)
def mm_int_weight_swiglu_out(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (ceil(K*bits/32), 2H) int32
    scales: torch.Tensor,  # (n_groups, 2H) float
    qzeros: Optional[torch.Tensor],
    act_perm: Optional[torch.Tensor],
    in_features: int,
    bits: int,
    group_size: int,
    zero_offset: int,
    kernel: int,
    out: torch.Tensor,  # (..., H), dtype of x, caller-owned; written
    workspace: Optional[torch.Tensor],  # caller-owned scratch (the need of the (..., 2H) product); clobbered
) -> None:
    shape = check_mm_int_weight_swiglu("mm_int_weight_swiglu_out", x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset)
    check_out("mm_int_weight_swiglu_out", out, swiglu_shape(shape), x)
    check_workspace("mm_int_weight_swiglu_out", workspace, x)
    check_disjoint("mm_int_weight_swiglu_out", (("out", out), ("workspace", workspace)),
                   (("x", x), ("qweight", qweight), ("scales", scales), ("qzeros", qzeros), ("act_perm", act_perm)))
    impl = swiglu_implementation(FAMILY, kernel, x.device, "mm_int_weight_swiglu_out", call_facts(x, shape, act_perm, in_features, bits, group_size))
    impl(x, qweight, scales, qzeros, act_perm, None, bits, group_size, zero_offset, out=out, workspace=workspace)


refuse_gradients("mm_int_weight_swiglu_out", "mm_int_weight_swiglu")


def swiglu_shape(shape: list) -> list:
    """The gated output's shape from the full product's ``(..., 2H)``."""
    return [*shape[:-1], shape[-1] // 2]


def _swiglu_setup_context(ctx, inputs, output):
    x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset, _ = inputs
    ctx.save_for_backward(x, qweight, scales, qzeros, act_perm)
    ctx.statics = (in_features, bits, group_size, zero_offset)


def _swiglu_backward(ctx, grad):
    """Frozen weight: the gradient of x only, from the fp32 product recomputed with the dequantized
    weight: d gate = grad * up * silu'(gate), d up = grad * silu(gate), grad_x = [d gate, d up] @ W."""
    x, qweight, scales, qzeros, act_perm = ctx.saved_tensors
    grads = [None] * 10
    if ctx.needs_input_grad[0]:
        w = torch.ops.qops.dequantize_int_weight(qweight, scales, qzeros, act_perm, *ctx.statics, torch.float32)
        gate, up = (x.float() @ w.t()).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        d = torch.cat((g * up * sig * (1 + gate * (1 - sig)), g * gate * sig), dim=-1)
        grads[0] = (d @ w).to(x.dtype)
    return tuple(grads)


mm_int_weight_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


@torch.library.custom_op("qops::dequantize_int_weight", mutates_args=(), schema=DEQUANT_SCHEMA)
def dequantize_int_weight(
    qweight: torch.Tensor,  # (ceil(K*bits/32), N) int32
    scales: torch.Tensor,  # (n_groups, N) float
    qzeros: Optional[torch.Tensor],  # (n_groups, ceil(N*bits/32)) int32 or None
    act_perm: Optional[torch.Tensor],  # (K,) int32 or None
    in_features: int,  # K
    bits: int,
    group_size: int,
    zero_offset: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K) in checkpoint K order
    check_int_weight("dequantize_int_weight", in_features, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset, qweight.device)
    check_dequantize_dtype("dequantize_int_weight", dtype)
    w = reference_dequantize(qweight, scales, qzeros, in_features, bits, group_size, zero_offset)
    if act_perm is not None:
        w = torch.empty_like(w).index_copy_(1, act_perm.long(), w)
    # Row-major like the fake's output (w is a transposed view here).
    return w.to(dtype).contiguous()


def reference_dequantize(qweight, scales, qzeros, k, bits, group_size, zero_offset) -> torch.Tensor:
    """fp32 ``(N, K)`` weight in runtime K order, straight from the layout's definition."""
    qweight = flat_qweight(qweight)
    n = qweight.shape[1]
    g = k if group_size == -1 else group_size
    q = unpack_bits(qweight, bits, k, dim=0).float()  # (K, N)
    if qzeros is None:
        z = torch.full((scales.shape[0], n), float(2 ** (bits - 1)), device=qweight.device)
    else:
        z = unpack_bits(qzeros, bits, n, dim=1).float() + zero_offset
    rows = torch.arange(k, device=qweight.device) // max(g, 1)
    w = scales.float().index_select(0, rows) * (q - z.index_select(0, rows))
    return w.t()


def reference_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=None, workspace=None) -> torch.Tensor:
    """The CPU kernel (and the GPU fallback): dequantize in fp32, matmul with fp32 accumulation.

    Lowering entry contract (every lowering's entry has it): arguments already validated; x any
    strides; returns a fresh ``(..., N)`` tensor of x's dtype, or writes ``out`` and returns it.
    No host synchronisation.
    """
    k = x.shape[-1]
    w = reference_dequantize(qweight, scales, qzeros, k, bits, group_size, zero_offset)
    xs = x if act_perm is None else x.index_select(-1, act_perm.long())
    return reference_matmul(xs, w, bias, out)


# Inputs (x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset, kernel).
register_frozen_weight_autograd(
    mm_int_weight, torch.ops.qops.dequantize_int_weight, tensors=(1, 2, 3, 4), statics=(6, 7, 8, 9), bias=5,
)


@dataclass
class IntWeight:
    """A prepared integer weight: runtime tensors plus the static facts the op takes."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    act_perm: torch.Tensor | None
    in_features: int
    out_features: int
    bits: int
    group_size: int
    zero_offset: int
    kernel: Kernel
    choice: Choice | None = None
    # The activation dtype it was prepared (and warmed up) for: what the chooser was asked about
    # (with_lowering records it). None before a lowering is chosen; warm-ups then take the scales'.
    act_dtype: torch.dtype | None = None

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.qops.mm_int_weight(
            x, self.qweight, self.scales, self.qzeros, self.act_perm, bias, self.in_features,
            self.bits, self.group_size, self.zero_offset, int(self.kernel),
        )

    def mm_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this fused ``[gate; up]`` weight (``mm_int_weight_swiglu``)."""
        return torch.ops.qops.mm_int_weight_swiglu(
            x, self.qweight, self.scales, self.qzeros, self.act_perm, self.in_features,
            self.bits, self.group_size, self.zero_offset, int(self.kernel),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.ops.qops.dequantize_int_weight(
            self.qweight, self.scales, self.qzeros, self.act_perm, self.in_features,
            self.bits, self.group_size, self.zero_offset, dtype,
        )

    def nbytes(self) -> int:
        ts = (self.qweight, self.scales, self.qzeros, self.act_perm)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _resolve_act_order(iq: IntQuantized) -> torch.Tensor | None:
    """The permutation making groups contiguous in K, or None when they already are."""
    k = iq.q.shape[1]
    g = iq.group_size if iq.group_size != -1 else max(k, 1)
    expected = default_g_idx(k, iq.group_size, iq.g_idx.device)
    if torch.equal(iq.g_idx, expected):
        return None
    n_groups = n_groups_for(k, iq.group_size)
    if bool(((iq.g_idx < 0) | (iq.g_idx >= n_groups)).any()):
        raise ValueError(f"g_idx: values must lie in [0, {n_groups}) (n_groups = ceil(K/group_size), K={k}, group_size={iq.group_size})")
    perm = torch.argsort(iq.g_idx, stable=True)
    if not torch.equal(iq.g_idx.index_select(0, perm), expected):
        counts = torch.bincount(iq.g_idx, minlength=n_groups).tolist()
        raise ValueError(f"g_idx: each group must hold group_size={g} rows (the last one K - (n_groups-1)*group_size); got group sizes {counts[:8]}{'...' if len(counts) > 8 else ''}")
    return perm


def prepare_int_weight(
    iq: IntQuantized,
    *,
    dtype: torch.dtype | None = None,
    format_name: str = "gptq",
    checkpoint_qweight: torch.Tensor | None = None,
    choose_lowering: bool = True,
) -> IntWeight:
    """Build the runtime layout from the shared meaning and choose the lowering for its device.

    ``dtype`` is the activation dtype the weight will see (default: the scales' dtype).
    ``checkpoint_qweight``, when given, is a qweight already in the runtime packing (GPTQ without
    act-order), used as is instead of repacking. ``choose_lowering=False`` leaves the reference
    kernel in place, for callers that assemble a weight from pieces and choose once at the end
    (:func:`with_lowering`).
    """
    n, k = iq.q.shape
    bits = iq.bits
    perm = _resolve_act_order(iq)
    if perm is not None or checkpoint_qweight is None:
        q_rt = iq.q if perm is None else iq.q.index_select(1, perm)
        qweight = pack_bits(q_rt.t(), bits, dim=0)
    else:
        qweight = checkpoint_qweight
    mid = 2 ** (bits - 1)
    zeros = iq.zeros
    if bool((zeros == mid).all()):
        qzeros, zero_offset = None, 0
    else:
        zero_offset = 1 if bool((zeros >= 2**bits).any()) else 0
        stored = zeros - zero_offset
        if bool(((stored < 0) | (stored >= 2**bits)).any()):
            raise ValueError(f"zeros: values span more than {bits} bits ({int(zeros.min())}..{int(zeros.max())}); cannot be stored")
        qzeros = pack_bits(stored.t(), bits, dim=1)
    weight = IntWeight(
        qweight=qweight,
        scales=iq.scales.t().contiguous(),
        qzeros=qzeros,
        act_perm=None if perm is None else perm.to(torch.int32),
        in_features=k,
        out_features=n,
        bits=bits,
        group_size=iq.group_size,
        zero_offset=zero_offset,
        kernel=Kernel.REFERENCE,
    )
    return with_lowering(weight, format_name, dtype) if choose_lowering else weight


def with_qweight_form(weight: IntWeight, form: str) -> IntWeight:
    """``weight`` with its qweight in ``form`` ("flat" or "slabs"), copied only when the form changes."""
    if form not in ("flat", "slabs"):
        raise ValueError(f"with_qweight_form: form must be 'flat' or 'slabs', got {form!r}")
    if (weight.qweight.dim() == 3) == (form == "slabs"):
        return weight
    q = to_column_slabs(weight.qweight) if form == "slabs" else flat_qweight(weight.qweight).contiguous()
    return replace(weight, qweight=q)


def _weight_spec(weight: IntWeight, format_name: str, dtype: torch.dtype | None) -> WeightSpec:
    return WeightSpec(
        family=FAMILY, format=format_name, bits=weight.bits, group_size=weight.group_size,
        n=weight.out_features, k=weight.in_features, act_order=weight.act_perm is not None,
        symmetric=weight.qzeros is None, device=weight.qweight.device,
        act_dtype=dtype if dtype is not None else weight.scales.dtype,
    )


def qweight_form_for(weight: IntWeight, format_name: str, dtype: torch.dtype | None = None) -> str:
    """The qweight form :func:`with_lowering` will give ``weight`` (from the chooser's pick), for
    callers assembling a weight from pieces that can write them in that form straight away."""
    return preferred_qweight_form(choose(_weight_spec(weight, format_name, dtype)).lowering.kernel, weight.bits, weight.out_features)


def with_lowering(weight: IntWeight, format_name: str, dtype: torch.dtype | None = None) -> IntWeight:
    """``weight`` with the lowering the chooser picks for its device, in the qweight form that lowering
    reads fastest, warmed up (kernels loaded) for the activation dtype the chooser was asked about."""
    spec = _weight_spec(weight, format_name, dtype)
    choice = choose(spec)
    weight = with_qweight_form(weight, preferred_qweight_form(choice.lowering.kernel, weight.bits, weight.out_features))
    weight = replace(weight, kernel=choice.lowering.kernel, choice=choice, act_dtype=spec.act_dtype)
    warm_up(choice.lowering, weight)
    return weight


def runtime_nbytes_bound(n: int, k: int, bits: int, group_size: int) -> int:
    """Bytes of the runtime layout with zeros and a permutation (the largest case)."""
    g = n_groups_for(k, group_size)
    return 4 * (packed_length(k, bits) * n + g * packed_length(n, bits) + k) + 2 * g * n
