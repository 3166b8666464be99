"""4-bit codebook weights (bitsandbytes NF4 / FP4 codes, or any 16-value code) through the W4A16 decode
kernel (``w4a16_gemv.cu`` built with ``QOPS_LUT``): measurements, in no lowering yet.

The question it answers: the native NF4 kernel (``blockwise4_gemv.cu``) reaches 49-65% of the roofline
at M = 1 on the large shapes where the W4A16 decode kernel reaches 70-91% on nearly the same bytes
(benchmarks/NOTES.md); does the W4A16 kernel's structure (x staged once, 32-column warps, column slabs,
the tuned plans) keep its speed when its nibbles are decoded through a table of the codebook instead
of the magic-number trick? The table costs one prmt and one shared load a pair of codes, as many issue
slots as the magic-number decode; the scales apply in fp32, a column and 64 rows at a time.

Runtime layout read here (``pack_codes``): ``qweight`` int32 ``(N/32, K/8, 32)``, the int weights'
column slabs, word ``(kw, n)`` holding rows ``8 kw .. 8 kw + 7`` of column n, byte r (r = 0..3) the code
of row ``8 kw + r`` in its high nibble and of row ``8 kw + r + 4`` in its low (the pair one MMA operand
register takes); ``scales`` ``(K/64, N)`` in x's dtype (absmax a column and 64 rows); ``codebook``
float32 ``(16,)``. ``y = x @ W.T``, ``W[n, k] = codebook[code(n, k)] * scales[k // 64, n]``; the codes are
rounded to x's dtype in the table (bf16 x with f16 MMAs: to f16) as bitsandbytes' kernels round them.
"""
from __future__ import annotations

import torch

from ..ops.int_weight import SLAB_COLUMNS
from . import int_weight as niw

GROUP = 64  # rows of K a scale covers
_X_DTYPES = (torch.float16, torch.bfloat16)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``qweight`` of the layout above from codes ``(N, K)`` (integers 0..15; N % 32 == 0, K % 8 == 0)."""
    n, k = codes.shape
    if n % SLAB_COLUMNS or k % 8:
        raise ValueError(f"pack_codes: codes of shape {tuple(codes.shape)} need N % {SLAB_COLUMNS} == 0 and K % 8 == 0")
    c = codes.to(torch.int64).reshape(n, k // 8, 8)  # (n, kw, row i of the word)
    word = torch.zeros(n, k // 8, dtype=torch.int64, device=codes.device)
    for r in range(4):
        byte = (c[:, :, r] << 4) | c[:, :, r + 4]
        word |= byte << (8 * r)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # the same 32 bits as int32
    return word.t().reshape(k // 8, n // SLAB_COLUMNS, SLAB_COLUMNS).permute(1, 0, 2).contiguous()


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Codes ``(N, K)`` (uint8) of a ``pack_codes`` qweight: its inverse."""
    slabs, kw, _ = qweight.shape
    words = qweight.permute(1, 0, 2).reshape(kw, slabs * SLAB_COLUMNS).t().to(torch.int64) & 0xFFFFFFFF  # (n, kw)
    rows = []
    for i in range(8):
        r, low = (i, False) if i < 4 else (i - 4, True)
        byte = (words >> (8 * r)) & 0xFF
        rows.append(byte & 15 if low else byte >> 4)
    return torch.stack(rows, dim=-1).reshape(slabs * SLAB_COLUMNS, kw * 8).to(torch.uint8)


def reference_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in float64 from the layout above (the oracle of the kernel's tests and probes)."""
    codes = unpack_codes(qweight).to(torch.int64)
    w = codebook.double()[codes] * scales.double().t().repeat_interleave(GROUP, dim=1)[:, : codes.shape[1]]
    return x.double() @ w.t()


def refusal(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> str | None:
    """Why :func:`codebook_mm` cannot take these arguments, naming the argument, or None."""
    if x.device.type != "cuda":
        return f"x must be on a CUDA device, got {x.device}"
    if x.dtype not in _X_DTYPES:
        return f"x must be float16 or bfloat16, got {x.dtype}"
    if qweight.dtype != torch.int32 or qweight.dim() != 3 or qweight.shape[2] != SLAB_COLUMNS:
        return f"qweight must be int32 of shape (N/32, K/8, {SLAB_COLUMNS}), got {qweight.dtype} {tuple(qweight.shape)}"
    n, k = qweight.shape[0] * SLAB_COLUMNS, qweight.shape[1] * 8
    if x.shape[-1] != k or k % niw.CHUNK_K:
        return f"x's last dimension must be K = {k}, a multiple of {niw.CHUNK_K}; got x of shape {tuple(x.shape)}"
    if scales.dtype != x.dtype or tuple(scales.shape) != (k // GROUP, n) or not scales.is_contiguous():
        return f"scales must be contiguous {x.dtype} of shape ({k // GROUP}, {n}), got {scales.dtype} {tuple(scales.shape)}"
    if codebook.dtype != torch.float32 or tuple(codebook.shape) != (16,) or not codebook.is_contiguous():
        return f"codebook must be contiguous float32 of shape (16,), got {codebook.dtype} {tuple(codebook.shape)}"
    if any(t.device != x.device for t in (qweight, scales, codebook)):
        return f"qweight, scales and codebook must be on x's device {x.device}"
    # The decode kernel's own needs (qweight contiguous and 16-byte aligned, scales 8-byte aligned: its
    # slab addressing and vector loads), checked as for the int weights it was written for.
    why = niw._refusal(x, qweight, scales, None, 4, -1, n)
    if why is not None:
        return why
    m = x.numel() // k if k else 0
    if m > niw.MAX_M:
        return f"x has {m} rows; the decode kernel takes at most {niw.MAX_M}"
    if m:
        return plan_refusal(m, n, k, x.device.index if x.device.index is not None else torch.cuda.current_device())
    return None


def plan_refusal(m: int, n: int, k: int, device: int) -> str | None:
    """Why the table's plan for ``m`` rows of an (N, K) weight cannot launch on ``device``, or None.

    The plan is the int weights' with the codebook table (:func:`qops.native.int_weight.lut_plan`): x
    staged once beside the table can take more shared memory than a block may have (4096 x 14336 from
    17 rows, 28672 x 4096 from 21 by the rule's plans on an H200), which the row count alone does not tell.
    """
    try:
        p = niw.plan(m, n, k, device)
        if not p.lut:
            niw.lut_plan(p, n, k, niw.smem_optin_bytes(device))
    except ValueError as e:
        return f"x has {m} rows, whose plan for N = {n}, K = {k} with the codebook table cannot launch: {str(e).removeprefix('native_w4a16: ')}"
    return None


def codebook_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor,
                workspace: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., K) -> (..., N)`` through the decode kernel at the int weights' plan for the shape, with
    ``lut`` (the table) and without fold. Raises ValueError naming the argument a call cannot take."""
    why = refusal(x, qweight, scales, codebook)
    if why is not None:
        raise ValueError(f"codebook_mm: {why}")
    n, k = qweight.shape[0] * SLAB_COLUMNS, x.shape[-1]
    lead = x.shape[:-1]
    m = x.numel() // k
    out = x.new_empty((*lead, n))
    if m == 0:
        return out
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    flags = niw._SCALE_BF16 if scales.dtype == torch.bfloat16 else 0
    flags |= niw._Q_SLABS
    with torch.cuda.device(dev):  # launched on x's device's stream, whichever device is current
        niw._launch(x2, qweight, scales, None, None, out.view(m, n), workspace, m, n, k, 1, 0, flags, dev,
                    torch.cuda.current_stream(), codebook=codebook)
    return out
