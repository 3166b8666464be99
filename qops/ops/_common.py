"""Argument checks and autograd shared by the op families of ``qops/ops``.

The checks run in the real kernels and in the fakes alike (``torch._check*`` where a symbolic size
may be involved, a plain raise for static facts), and every message begins ``qops.<op>: ``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from typing import Callable, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from ..lowerings import cuda_elsewhere

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEQUANTIZE_DTYPES = (*ACT_DTYPES, torch.float64)  # float64: oracles dequantize exactly


def on_device_of(t: torch.Tensor):
    """A context with ``t``'s CUDA device current where it is not already (``lowerings.cuda_elsewhere``), else a
    null context: for the kernels launched outside the lowerings' entries."""
    return torch.cuda.device(t.device) if cuda_elsewhere(t.device) else contextlib.nullcontext()


def fail(who: str, msg: str) -> str:
    return f"qops.{who}: {msg}"


def check_devices(who: str, tensors, device: torch.device) -> None:
    """Each ``(name, tensor)`` whose tensor is not None lies on ``device``, the device of x."""
    for name, t in tensors:
        if t is not None and t.device != device:
            raise ValueError(fail(who, f"{name} must be on {device} (the device of x), got {t.device}"))


def check_act_dtype(who: str, name: str, t: torch.Tensor) -> None:
    torch._check_type(t.dtype in ACT_DTYPES, lambda: fail(who, f"{name} must be float32, float16 or bfloat16, got {t.dtype}"))


def check_dequantize_dtype(who: str, dtype: torch.dtype) -> None:
    """The ``dtype`` a dequantize op returns: a float type that holds every weight value (an integer
    type would truncate them silently)."""
    torch._check_type(dtype in DEQUANTIZE_DTYPES,
                      lambda: fail(who, f"dtype must be one of {[str(d) for d in DEQUANTIZE_DTYPES]}, got {dtype}"))


def check_in_features(who: str, k) -> None:
    """A K given as an argument (not read from x) is not negative."""
    if isinstance(k, int) and k < 0:
        raise ValueError(fail(who, f"in_features must be >= 0, got {k}"))


def check_x(who: str, x: torch.Tensor, in_features: Optional[int] = None) -> None:
    """Float activations ``(..., K)``; with ``in_features``, K must equal it."""
    check_act_dtype(who, "x", x)
    torch._check_value(x.dim() >= 1, lambda: fail(who, "x must have at least one dimension (..., K)"))
    if in_features is not None:
        torch._check_value(
            x.shape[-1] == in_features,
            lambda: fail(who, f"x must have in_features={in_features} in its last dimension, got shape {tuple(x.shape)}"),
        )


def check_bias(who: str, bias: Optional[torch.Tensor], n, device: torch.device) -> None:
    if bias is None:
        return
    if bias.device != device:
        raise ValueError(fail(who, f"bias must be on {device} (the device of x), got {bias.device}"))
    check_act_dtype(who, "bias", bias)
    torch._check_value(bias.dim() == 1 and bias.shape[0] == n, lambda: fail(who, f"bias must have shape ({n},) (N), got {tuple(bias.shape)}"))


def check_out(who: str, out: torch.Tensor, shape, x: torch.Tensor) -> None:
    """A caller-owned output buffer: on x's device, of x's dtype, of the op's output ``shape``."""
    if out.device != x.device:
        raise ValueError(fail(who, f"out must be on {x.device} (the device of x), got {out.device}"))
    torch._check_type(out.dtype == x.dtype, lambda: fail(who, f"out must have the dtype of x ({x.dtype}), got {out.dtype}"))
    torch._check_value(
        out.dim() == len(shape) and all(a == b for a, b in zip(out.shape, shape)),
        lambda: fail(who, f"out must have shape {tuple(shape)}, got {tuple(out.shape)}"),
    )


WORKSPACE_ALIGN = 16  # bytes: the kernels view the workspace's start as fp32 / int32 and load it in 16-byte vectors


def check_workspace(who: str, workspace: Optional[torch.Tensor], x: torch.Tensor) -> None:
    """A caller-owned scratch buffer (None: the lowering allocates its own): uint8, 1-D, contiguous, on x's
    device, its start 16-byte aligned (checked where it has memory: a FakeTensor has no address). The
    lowerings view it as fp32 partials, counters and a gathered x at byte offsets and hand its address to
    their kernels, so a buffer on another device would be written through a foreign pointer, and a strided
    or misaligned one would fail inside a view or a kernel; how many bytes it must hold is the chosen
    lowering's to check (its ``workspace_bytes``)."""
    if workspace is None:
        return
    if workspace.device != x.device:
        raise ValueError(fail(who, f"workspace must be on {x.device} (the device of x), got {workspace.device}"))
    if workspace.dtype != torch.uint8:
        raise TypeError(fail(who, f"workspace must be torch.uint8 (bytes), got {workspace.dtype}"))
    if workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(fail(who, f"workspace must be 1-D and contiguous, got shape {tuple(workspace.shape)} "
                                   f"strides {tuple(workspace.stride())}"))
    if _has_memory(workspace) and workspace.data_ptr() % WORKSPACE_ALIGN:
        raise ValueError(fail(who, f"workspace must start at a {WORKSPACE_ALIGN}-byte aligned address, got one "
                                   f"{workspace.data_ptr() % WORKSPACE_ALIGN} bytes past it (pass a slice at a multiple of {WORKSPACE_ALIGN})"))


def unit_stride(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` whose last dimension has unit stride (copied only when it has another); None stays None.

    The ops accept a bias, scales, zeros or a permutation with any strides (the reference kernels
    index them as tensors), while the CUDA kernels read a row of each with stride 1 and take only the
    other dimensions' strides as arguments."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def reference_matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ w.T + bias`` for an fp32 ``(N, K)`` weight, accumulated in fp32; a fresh tensor of x's
    dtype, or written into ``out`` and returned (the reference kernels' epilogue)."""
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad`` summed over its leading dimensions in fp32, cast to the bias ``dtype`` (an fp16 sum
    over many rows overflows or loses the small terms, whatever dtype the bias has)."""
    return grad.reshape(-1, grad.shape[-1]).float().sum(0).to(dtype)


# Weights are frozen: the gradient flows to the activations (input 0, through the dequantized
# weight) and the bias only.
def save_frozen_weight(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], tensors: Sequence, statics: Sequence) -> None:
    """Keep what :func:`frozen_weight_grads` needs: the weight ``tensors`` and the ``statics`` that
    follow them in the family's dequantize op."""
    ctx.save_for_backward(*tensors)
    ctx.frozen = (tuple(statics), x.dtype, None if bias is None else bias.dtype)


def frozen_weight_grads(ctx, grad: torch.Tensor, dequantize: Callable, bias_index: int):
    """``(grad_x, grad_bias)``: ``grad @ dequantize(*tensors, *statics, float32)`` in x's dtype, and
    the bias gradient (:func:`bias_grad`)."""
    statics, x_dtype, bias_dtype = ctx.frozen
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize(*ctx.saved_tensors, *statics, torch.float32)
        grad_x = (grad.float() @ w).to(x_dtype)
    if bias_dtype is not None and ctx.needs_input_grad[bias_index]:
        grad_bias = bias_grad(grad, bias_dtype)
    return grad_x, grad_bias


def register_frozen_weight_autograd(op, dequantize: Callable, *, tensors: Sequence[int], statics: Sequence[int], bias: int) -> None:
    """Give ``op(x, ...)`` a backward through its family's ``dequantize`` op.

    ``tensors`` and ``statics`` are the indices of ``op``'s inputs that ``dequantize`` takes, in its
    order (the output dtype is appended); ``bias`` is the index of the bias input.
    """

    def setup_context(ctx, inputs, output):
        save_frozen_weight(ctx, inputs[0], inputs[bias], [inputs[i] for i in tensors], [inputs[i] for i in statics])
        ctx.n_inputs = len(inputs)

    def backward(ctx, grad):
        grads = [None] * ctx.n_inputs
        grads[0], grads[bias] = frozen_weight_grads(ctx, grad, dequantize, bias)
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[first, end)`` that ``t``'s elements lie in (None when it has none)."""
    n = t.numel()
    if n == 0:
        return None
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + n * t.element_size()
    extent = sum((d - 1) * s for d, s in zip(t.shape, t.stride()))
    return first, first + (extent + 1) * t.element_size()


def _has_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` owns real memory (not a FakeTensor, not on the meta device). Plain tensors and
    parameters answer without ``is_fake``, which costs more than the rest of the check together."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return not t.is_meta
    return not (is_fake(t) or t.is_meta)


def check_disjoint(who: str, written: Sequence[tuple[str, Optional[torch.Tensor]]],
                   read: Sequence[tuple[str, Optional[torch.Tensor]]]) -> None:
    """The buffers an ``_out`` op writes (``out``, ``workspace``) share no memory with each other or
    with the tensors it reads: the CUDA kernels write them while reading the rest in parallel, so an
    ``out`` carved from x or from the workspace gives a wrong answer, not an error. By byte range (a
    strided view interleaved with another without sharing an element is refused too: pass a copy), on
    real tensors only: a FakeTensor has no memory, and torch.compile's functionalization copies
    aliased arguments of the ops it traces. Every call outside a CUDA graph pays it, so it is kept
    cheap: each range computed once, plain tensors told real without ``is_fake``."""
    ranges = []
    for name, t in (*written, *read):
        if t is None:
            continue
        if not _has_memory(t):
            return
        ranges.append((name, _byte_range(t)))
    n_written = sum(t is not None for _, t in written)
    for i, (wname, a) in enumerate(ranges[:n_written]):
        if a is None:
            continue
        for oname, b in ranges[i + 1:]:
            if b is not None and a[0] < b[1] and b[0] < a[1]:
                raise ValueError(fail(who, f"{wname} shares memory with {oname}: the kernels write {wname} while they use "
                                           f"{oname}, so the result would be wrong; pass separate buffers"))


# The runtime dispatch keys of the devices the ops run on (FakeTensors take their device's). A kernel
# registered to one of them takes precedence over the "Autograd" alias kernel that
# torch.library.custom_op installs.
_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradMeta")
_REFUSAL_LIBRARIES: list = []  # the registrations live as long as their Library objects


def refuse_gradients(name: str, functional: str) -> None:
    """Make the ``_out`` op ``qops::<name>`` refuse, naming it, an argument that requires grad while grad
    mode is on.

    An ``_out`` op writes into ``out`` and returns nothing, and torch.library cannot give an op that
    mutates its arguments an autograd formula: without this, ``out`` would silently carry no gradient
    of x or bias (a lost gradient, not an error at backward). torch's own ``out=`` functions refuse the
    same call. Raised at the op's autograd dispatch key, so eagerly and when torch.compile traces the
    call (fake tensors); under ``torch.no_grad()`` / ``torch.inference_mode()`` or with detached
    arguments the op runs. ``functional`` names the differentiable op to call instead."""
    overload = getattr(torch.ops.qops, name).default
    arg_names = [a.name for a in overload._schema.arguments]

    def refusal(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            for arg_name, a in itertools.chain(zip(arg_names, args), kwargs.items()):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    raise RuntimeError(fail(name, f"{arg_name} requires grad, but this op writes its result into out and records "
                                                  f"no autograd (as torch's out= functions), so the result would carry no "
                                                  f"gradient: call qops::{functional} to differentiate, or run it under "
                                                  f"torch.no_grad() / with detached arguments"))
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)

    lib = torch.library.Library("qops", "IMPL")
    for key in _AUTOGRAD_KEYS:
        lib.impl(name, refusal, key, with_keyset=True)
    _REFUSAL_LIBRARIES.append(lib)


DETERMINISTIC_ENV = "QOPS_DETERMINISTIC"


def deterministic_requested() -> bool:
    """Whether sums must come out in a fixed order (bit-identical from run to run):
    ``QOPS_DETERMINISTIC=1`` or ``torch.use_deterministic_algorithms(True)``. Split-K kernels then
    do not split (no atomic adds)."""
    env = os.environ.get(DETERMINISTIC_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return env or torch.are_deterministic_algorithms_enabled()


def pdl_launch(device: torch.device) -> bool:
    """Whether a Triton kernel of qops' decoder launches with programmatic dependent launch
    (``launch_pdl=True``, and its ``gdc_*`` calls compiled in): on sm_90+, not in Triton's
    interpreter (no grid dependencies there)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def jit_if_triton(kernel: Callable):
    """``triton.jit(kernel)``, or None when Triton cannot be imported (the caller then runs its
    reference kernel). A kernel written in a module that must import without Triton reads
    ``triton`` and ``tl`` from its module's globals (placeholders there until now): they are bound
    here, before Triton parses the function."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means the reference kernel runs instead
        return None
    kernel.__globals__.update(triton=triton, tl=tl)
    return triton.jit(kernel)
