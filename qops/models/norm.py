"""``qops::add_rmsnorm``: a residual add and the RMSNorm after it in one kernel (what Inductor ran as
two or three small kernels between a decoder layer's attention and its MLP: benchmarks/NOTES.md, stop 21).

Arguments: ``x`` and ``residual`` ``(..., K)`` of one float dtype, ``weight`` ``(K,)`` of that dtype
(all three any strides), ``eps``. Returns ``(out, summed)``, both ``(..., K)`` contiguous in that dtype:

- ``summed = x + residual``, rounded to the dtype (the new residual stream);
- ``out = weight * (s * rsqrt(mean(s^2) + eps))`` with ``s = summed`` in fp32, the normalized value
  rounded to the dtype before the multiply by ``weight`` (also rounded): ``LlamaRMSNorm``'s order.

Kernels: on CPU (and on CUDA when Triton cannot be imported) :func:`reference_add_rmsnorm`, plain
torch. On CUDA :func:`triton_add_rmsnorm`: one program a row, the whole row in registers (K up to
65536), sum of squares in fp32; on sm_90 launched with programmatic dependent launch (it waits for
the kernel ahead before its loads and lets the next one start after them, as Inductor's kernels
do). No allocation besides the outputs, no host synchronization.

Inference only: no autograd formula is registered (a backward through it raises).
"""
from __future__ import annotations

import functools

import torch

from ..ops._common import ACT_DTYPES, fail, jit_if_triton, on_device_of, pdl_launch

OP = "add_rmsnorm"
SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"
MAX_K = 65536  # one program holds a row in registers


def check_add_rmsnorm(x, residual, weight) -> list:
    """Validate the arguments (eagerly and under fake tensors); returns the outputs' shape."""
    torch._check_type(x.dtype in ACT_DTYPES, lambda: fail(OP, f"x must be float32, float16 or bfloat16, got {x.dtype}"))
    torch._check_value(x.dim() >= 1, lambda: fail(OP, "x must have at least one dimension (..., K)"))
    for name, t in (("residual", residual), ("weight", weight)):
        if t.device != x.device:
            raise ValueError(fail(OP, f"{name} must be on {x.device} (the device of x), got {t.device}"))
        torch._check_type(t.dtype == x.dtype, lambda name=name, t=t: fail(OP, f"{name} must have the dtype of x ({x.dtype}), got {t.dtype}"))
    torch._check_value(residual.shape == x.shape,
                       lambda: fail(OP, f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"))
    k = x.shape[-1]
    torch._check_value(weight.dim() == 1 and weight.shape[0] == k, lambda: fail(OP, f"weight must have shape ({k},) (K), got {tuple(weight.shape)}"))
    torch._check_value(k <= MAX_K, lambda: fail(OP, f"K={k} is above {MAX_K} (a row is held in one program)"))
    return list(x.shape)


@torch.library.custom_op(f"qops::{OP}", mutates_args=(), schema=SCHEMA)
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_add_rmsnorm(x, residual, weight)
    return reference_add_rmsnorm(x, residual, weight, eps)


@add_rmsnorm.register_kernel("cuda")
def _add_rmsnorm_cuda(x, residual, weight, eps):
    check_add_rmsnorm(x, residual, weight)
    # The kernel's offsets are 32-bit: larger tensors take the reference kernel.
    if _triton_kernel() is None or x.numel() >= 2**31 or residual.numel() >= 2**31:
        return reference_add_rmsnorm(x, residual, weight, eps)
    with on_device_of(x):
        return triton_add_rmsnorm(x, residual, weight, eps)


@add_rmsnorm.register_fake
def _add_rmsnorm_fake(x, residual, weight, eps):
    shape = check_add_rmsnorm(x, residual, weight)
    return x.new_empty(shape), x.new_empty(shape)


def reference_add_rmsnorm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in plain torch (``LlamaRMSNorm`` of the sum)."""
    summed = (x + residual).contiguous()
    sf = summed.float()
    normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).contiguous(), summed


triton = tl = None  # bound by jit_if_triton


def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_xk, stride_r, stride_rk, stride_w, K, eps,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    if PDL:
        # The next kernel may start now: it is a matmul whose weight loads (its prologue) then run
        # while this one waits. It reads what this kernel writes only after its own wait, which
        # returns once this grid has completed.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x and residual come from the kernels ahead
    x = tl.load(x_ptr + row * stride_x + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs * stride_rk, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs * stride_w, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * K + offs, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / K + eps)
    normed = (sf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * K + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _triton_kernel():
    """The jitted kernel, or None when Triton cannot be imported."""
    return jit_if_triton(_add_rmsnorm_kernel)


def triton_add_rmsnorm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's launcher (arguments as the op's, already checked)."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError(fail(OP, "triton is not importable"))
    k = x.shape[-1]
    x2, r2 = x.reshape(-1, k), residual.reshape(-1, k)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or k == 0:
        return out, summed
    block = triton.next_power_of_2(k)
    pdl = pdl_launch(x.device)
    extra = {"launch_pdl": True} if pdl else {}
    kernel[(rows,)](x2, r2, weight, out, summed, x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1), weight.stride(0), k, eps,
                    BLOCK_K=block, PDL=pdl, num_warps=max(1, min(16, block // 512)), **extra)
    return out, summed
