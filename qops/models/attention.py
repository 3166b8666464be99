"""``qops::decode_attention``: one decode step of grouped-query attention over a static KV cache,
fused with the rotary embedding of q and k and the cache write (what ``LlamaAttention`` does for
``T == 1`` in five kernels: rotate q, rotate k + write k, write v, prepare SDPA's inputs, SDPA).

Arguments (B rows of one token each; H query heads, Hkv KV heads, G = H / Hkv, head dim D):

- ``qkv`` ``(B, (H + 2*Hkv) * D)`` float32 / float16 / bfloat16, any strides: the fused projection
  output, columns ``[q heads | k heads | v heads]``, each head ``D`` wide (``LlamaAttention``'s split).
- ``cos``, ``sin`` float32 ``(R, D)``: rotary tables (the model's ``rope_cos`` / ``rope_sin``), row
  ``p`` for position ``p``. The rotation is ``apply_rotary``'s: ``x * cos + rotate_half(x) * sin``
  in fp32, ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, rounded to the dtype of ``qkv``.
- ``positions`` int64 ``(B,)``: the position of each row's token, in ``[0, S)`` and below ``R``
  (not checked: a check would read device memory).
- ``k_cache``, ``v_cache`` ``(max_batch, Hkv, S, D)``, dtype of ``qkv``, written in place: for each
  row ``b < B`` and KV head, position ``positions[b]`` receives the token's rotated k and its v.
  Nothing else of the caches is written; rows ``b >= B`` are neither read nor written.
- ``num_heads``, ``num_kv_heads``: H and Hkv; ``scale``: the softmax scale (``D ** -0.5`` in Llama).

Returns ``(B, H * D)`` in the dtype of ``qkv``: query head ``h`` (KV head ``h // G``) of row ``b``
attends to cache positions ``0 .. positions[b]`` inclusive (the position just written included;
later positions are masked, whatever the cache holds there): ``softmax(scale * q_rot . k) @ v``,
scores and their softmax in fp32, as ``LlamaAttention``'s ``"sdpa"`` / ``"matmul"`` kinds compute
for ``T == 1``.

Kernels: on CPU (and on CUDA when Triton cannot be imported) :func:`reference_decode_attention`,
plain torch in fp32. On CUDA :func:`triton_decode_attention`: one program per (row, KV head) rotates
the G query heads and the k of its head, stores k and v into the cache, then runs an online softmax
over the cache positions ``[0, positions[b])`` in blocks (never the masked tail), started from the
current token's k and v held in registers (the program never reads back the position it has just
written: nothing orders that store before a load of the same program). Scores and the softmax are
fp32; the probabilities are rounded to the cache dtype for the ``p @ v`` product, as the
``"matmul"`` kind and flash attention do. On long caches with few (row, KV head) pairs (batch 1 at a
few thousand positions) the positions below each row's token are split over several programs
(split-KV: :func:`attention_splits` picks the count from the cache length, statically) and a second
kernel merges their partial softmax sums in split order, so results are the same bits run to run.
No allocation besides the output (and the splits' fp32 partials), no host synchronization:
CUDA-graph capture safe once the kernels are compiled.

On sm_90 the kernel (launched as an ordinary kernel: it waits for the projection that wrote ``qkv``;
with splits, the merging kernel) executes ``griddepcontrol.launch_dependents`` as it starts, so the kernel after it, when launched with
programmatic dependent launch (the native output projection), is scheduled at once and streams its
weight while the attention runs; every such kernel in qops, and Inductor's, waits
(``griddepcontrol.wait``) before it reads what the attention writes or writes what it reads.
Measured at batch 1 on the Llama-3-8B-shaped W4 model: 516.9 -> 529.7 tok/s (two A/B pairs,
``benchmarks/results/h200-2026-12-01-054d64f-attn-release-*.json``). Launched as a PDL dependent
itself (waiting on the projection), the same release had made it slower (benchmarks/NOTES.md, stop 22).

Inference only: no autograd formula is registered (a backward through it raises).
"""
from __future__ import annotations

import functools
import os

import torch

from ..ops._common import ACT_DTYPES, fail, jit_if_triton, on_device_of, pdl_launch

OP = "decode_attention"
# The kernel lets the kernel after it be scheduled as it starts (sm_90, see the module docstring);
# QOPS_ATTN_RELEASE=0 turns that off (read at launch: a captured graph keeps what it was captured with).
RELEASE_ENV = "QOPS_ATTN_RELEASE"
SCHEMA = ("(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "int num_heads, int num_kv_heads, float scale) -> Tensor")


def check_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> list:
    """Validate every argument of ``decode_attention``; returns the output shape ``[B, H * D]``.
    Shared by the kernels and the fake, so works on fake tensors (symbolic B)."""
    who = OP
    for name, t in (("cos", cos), ("sin", sin), ("positions", positions), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != qkv.device:
            raise ValueError(fail(who, f"{name} must be on {qkv.device} (the device of qkv), got {t.device}"))
    torch._check_type(qkv.dtype in ACT_DTYPES, lambda: fail(who, f"qkv must be float32, float16 or bfloat16, got {qkv.dtype}"))
    torch._check_value(qkv.dim() == 2, lambda: fail(who, f"qkv must be 2-D (B, (H + 2*Hkv) * D), got shape {tuple(qkv.shape)}"))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        torch._check_type(t.dtype == qkv.dtype, lambda: fail(who, f"{name} must have the dtype of qkv ({qkv.dtype}), got {t.dtype}"))
        torch._check_value(t.dim() == 4, lambda: fail(who, f"{name} must be 4-D (max_batch, Hkv, S, D), got shape {tuple(t.shape)}"))
    torch._check_value(
        v_cache.shape == k_cache.shape,
        lambda: fail(who, f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}"))
    torch._check_value(num_heads > 0 and num_kv_heads > 0,
                       lambda: fail(who, f"num_heads and num_kv_heads must be positive, got {num_heads}, {num_kv_heads}"))
    torch._check_value(num_heads % num_kv_heads == 0,
                       lambda: fail(who, f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"))
    torch._check_value(
        k_cache.shape[1] == num_kv_heads,
        lambda: fail(who, f"k_cache must have num_kv_heads={num_kv_heads} heads (dimension 1), got shape {tuple(k_cache.shape)}"))
    d = k_cache.shape[3]
    torch._check_value(d % 2 == 0, lambda: fail(who, f"the head dim D={d} (k_cache dimension 3) must be even (rotary pairs)"))
    width = (num_heads + 2 * num_kv_heads) * d
    torch._check_value(
        qkv.shape[1] == width,
        lambda: fail(who, f"qkv must have (num_heads + 2*num_kv_heads) * D = ({num_heads} + 2*{num_kv_heads}) * {d} = {width} "
                          f"columns, got shape {tuple(qkv.shape)}"))
    for name, t in (("cos", cos), ("sin", sin)):
        torch._check_type(t.dtype == torch.float32, lambda: fail(who, f"{name} must be torch.float32, got {t.dtype}"))
        torch._check_value(t.dim() == 2 and t.shape[1] == d,
                           lambda: fail(who, f"{name} must have shape (rows, D={d}), got {tuple(t.shape)}"))
    torch._check_value(sin.shape == cos.shape,
                       lambda: fail(who, f"sin must have the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}"))
    b = qkv.shape[0]
    torch._check_type(positions.dtype == torch.int64, lambda: fail(who, f"positions must be torch.int64, got {positions.dtype}"))
    torch._check_value(positions.dim() == 1 and positions.shape[0] == b,
                       lambda: fail(who, f"positions must have shape (B,) = ({b},) (B from qkv), got {tuple(positions.shape)}"))
    # With an unbacked B this also tells the compiler B <= max_batch (a run-time assert, no sync).
    torch._check_value(b <= k_cache.shape[0],
                       lambda: fail(who, f"qkv has B={b} rows, more than the caches' max_batch={k_cache.shape[0]}"))
    return [b, num_heads * d]


@torch.library.custom_op(f"qops::{OP}", mutates_args=("k_cache", "v_cache"), schema=SCHEMA)
def decode_attention(
    qkv: torch.Tensor,  # (B, (H + 2*Hkv) * D) float
    cos: torch.Tensor,  # (R, D) float32
    sin: torch.Tensor,  # (R, D) float32
    positions: torch.Tensor,  # (B,) int64
    k_cache: torch.Tensor,  # (max_batch, Hkv, S, D), dtype of qkv; written at (b, :, positions[b])
    v_cache: torch.Tensor,  # (max_batch, Hkv, S, D), dtype of qkv; written at (b, :, positions[b])
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:  # (B, H * D), dtype of qkv
    check_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    return reference_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale)


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale):
    check_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    if _triton_kernel() is None:
        return reference_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale)
    with on_device_of(qkv):
        return triton_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale)


@decode_attention.register_fake
def _decode_attention_fake(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale):
    shape = check_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads)
    return qkv.new_empty(shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` of ``qops.models.llama`` on ``x (..., D)``: fp32 math, rounded to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def reference_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale) -> torch.Tensor:
    """The CPU kernel (and the fallback without Triton): plain torch, fp32 scores and softmax."""
    b, h, hk, d = qkv.shape[0], num_heads, num_kv_heads, k_cache.shape[3]
    g, s = h // hk, k_cache.shape[2]
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    c, sn = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, D)
    q = _rotate(q.reshape(b, h, d), c, sn)
    k = _rotate(k.reshape(b, hk, d), c, sn)
    index = (torch.arange(b, device=qkv.device).view(b, 1), torch.arange(hk, device=qkv.device).view(1, hk), positions.view(b, 1))
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v.reshape(b, hk, d))
    visible = (torch.arange(s, device=qkv.device) <= positions.view(b, 1)).view(b, 1, s, 1)  # (B, 1, S, 1)
    kc = k_cache[:b].float()  # (B, Hkv, S, D)
    # Masked values are zeroed, not only their probabilities: the cache may hold inf or NaN there.
    vc = torch.where(visible, v_cache[:b].float(), 0.0)
    scores = torch.matmul(q.float().view(b, hk, g, d), kc.transpose(-1, -2)) * scale  # (B, Hkv, G, S)
    scores = scores.masked_fill(~visible.view(b, 1, 1, s), float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), vc)  # (B, Hkv, G, D)
    return o.reshape(b, h * d).to(qkv.dtype)


# The Triton kernel. Triton is imported on the first CUDA call, not with this module (as everywhere
# in qops): the CPU tests choose Triton's interpreter before its first import.
triton = tl = None  # bound by jit_if_triton

def _decode_attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_ptr,  # split partials (SPLITS > 1): fp32 (B, HKV, SPLITS, BLOCK_H, BLOCK_D + 2) [acc | m | l]
    stride_xb, stride_xc,  # qkv
    stride_cos_s, stride_cos_d, stride_sin_s, stride_sin_d,
    stride_pos,
    stride_kb, stride_kh, stride_ks, stride_kd,  # k_cache
    stride_vb, stride_vh, stride_vs, stride_vd,  # v_cache
    stride_ob,  # out (B, H * D), unit column stride
    scale_log2,  # scale * log2(e): the softmax runs on exp2
    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr, RELEASE: tl.constexpr,
    SPLITS: tl.constexpr,  # programs sharing one (row, KV head): split sp takes its share of [0, pos)
):
    if RELEASE:
        # Let the kernel after this one (launched with PDL: the output projection) be scheduled now;
        # it reads what this kernel writes only after its own griddepcontrol.wait.
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    if SPLITS > 1:
        sp = tl.program_id(2)
    else:
        sp = 0  # a constant: the branch on sp below is resolved at compile time, as before splits existed
    pos = tl.load(pos_ptr + b * stride_pos)  # int64
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    dmask = offs_d < D
    qmask = hmask[:, None] & dmask[None, :]
    # rotate_half: element d pairs with d +- D/2, negated in the first half.
    first = offs_d < D // 2
    partner = tl.where(first, offs_d + D // 2, offs_d - D // 2)
    sign = tl.where(first, -1.0, 1.0)
    cos = tl.load(cos_ptr + pos * stride_cos_s + offs_d * stride_cos_d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin_s + offs_d * stride_sin_d, mask=dmask, other=0.0)

    row = qkv_ptr + b * stride_xb
    q_col = (kvh * G + offs_h)[:, None] * D
    q = tl.load(row + (q_col + offs_d[None, :]) * stride_xc, mask=qmask, other=0.0)
    q_pair = tl.load(row + (q_col + partner[None, :]) * stride_xc, mask=qmask, other=0.0)
    q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_pair.to(tl.float32) * sin[None, :]).to(q_pair.dtype)
    k_base = k_cache_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_cache_ptr + b * stride_vb + kvh * stride_vh
    if sp == 0:
        # The token's own k and v: written to the cache and, held in registers, the start of the online
        # softmax (a finite running max from the start, so a fully masked block cannot give inf - inf).
        k_col = H * D + kvh * D
        k = tl.load(row + (k_col + offs_d) * stride_xc, mask=dmask, other=0.0)
        k_pair = tl.load(row + (k_col + partner) * stride_xc, mask=dmask, other=0.0)
        k = (k.to(tl.float32) * cos + sign * k_pair.to(tl.float32) * sin).to(k_pair.dtype)
        v = tl.load(row + ((H + HKV) * D + kvh * D + offs_d) * stride_xc, mask=dmask, other=0.0)
        tl.store(k_base + pos * stride_ks + offs_d * stride_kd, k.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_base + pos * stride_vs + offs_d * stride_vd, v.to(v_cache_ptr.dtype.element_ty), mask=dmask)
        m = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2  # (BLOCK_H,)
        l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32) + v.to(tl.float32)[None, :]
    else:
        # Another split's share starts empty: weight 0 under a finite floor (exp2(floor - m) is 0 for any
        # real score, and a split with no position left below pos stays (floor, 0, 0) for the combine).
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # The row's own positions below its token, in SPLITS shares of whole blocks: the work follows the
    # position, not the cache length (early in a long cache the splits stay balanced, the later ones empty).
    chunk = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_S) * BLOCK_S
    lo = sp * chunk
    hi = tl.minimum(pos, lo + chunk)
    for start in range(lo, hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        smask = offs_s < hi
        kvmask = smask[:, None] & dmask[None, :]
        kb = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kvmask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        s = tl.where(smask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vb = tl.load(v_base + offs_s[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kvmask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m = m_new
    if SPLITS == 1:
        o = acc / l_sum[:, None]
        out = out_ptr + b * stride_ob + (kvh * G + offs_h)[:, None] * D + offs_d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # Unnormalized: the combine kernel weighs each split by 2^(m_split - max m).
        W: tl.constexpr = BLOCK_D + 2
        part = part_ptr + ((b * HKV + kvh) * SPLITS + sp) * (BLOCK_H * W) + offs_h * W
        tl.store(part[:, None] + offs_d[None, :], acc, mask=qmask)
        tl.store(part + BLOCK_D, m, mask=hmask)
        tl.store(part + BLOCK_D + 1, l_sum, mask=hmask)


def _decode_attention_combine_kernel(
    part_ptr, out_ptr, stride_ob,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, RELEASE: tl.constexpr,
):
    """The splits of one (row, KV head) merged in split order (a fixed order: the same bits every run)."""
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()  # as the split kernel's release above, for the projection after
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    qmask = hmask[:, None] & (offs_d < D)[None, :]
    W: tl.constexpr = BLOCK_D + 2
    base = part_ptr + (b * HKV + kvh) * SPLITS * (BLOCK_H * W) + offs_h * W
    m = tl.load(base + BLOCK_D, mask=hmask, other=0.0)  # split 0 always holds the token itself: l >= 1
    l_sum = tl.load(base + BLOCK_D + 1, mask=hmask, other=1.0)
    acc = tl.load(base[:, None] + offs_d[None, :], mask=qmask, other=0.0)
    for sp in range(1, SPLITS):
        part = base + sp * (BLOCK_H * W)
        m_sp = tl.load(part + BLOCK_D, mask=hmask, other=-1.0e30)
        m_new = tl.maximum(m, m_sp)
        alpha = tl.math.exp2(m - m_new)
        beta = tl.math.exp2(m_sp - m_new)
        l_sum = l_sum * alpha + tl.load(part + BLOCK_D + 1, mask=hmask, other=0.0) * beta
        acc = acc * alpha[:, None] + tl.load(part[:, None] + offs_d[None, :], mask=qmask, other=0.0) * beta[:, None]
        m = m_new
    o = acc / l_sum[:, None]
    out = out_ptr + b * stride_ob + (kvh * G + offs_h)[:, None] * D + offs_d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=qmask)


@functools.cache
def _triton_kernel():
    """The jitted kernel, or None when Triton cannot be imported."""
    return jit_if_triton(_decode_attention_kernel)


@functools.cache
def _triton_combine_kernel():
    return jit_if_triton(_decode_attention_combine_kernel)


def launch_config(head_dim: int, group: int) -> dict:
    """Tile sizes and launch parameters for head dim D and G query heads per KV head. ``BLOCK_H``
    pads G to a tensor-core tile (16 rows); ``BLOCK_S`` cache positions per loop step keep a k and a
    v tile of 16 KiB (fp16) each in registers."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return {"BLOCK_H": max(16, 1 << (group - 1).bit_length()), "BLOCK_D": block_d, "BLOCK_S": 64 if block_d <= 128 else 32,
            "num_warps": 4, "num_stages": 2}


# Splitting the cache positions over more programs (split-KV, "flash decoding"). One program per
# (row, KV head) reads its whole history alone: 8 programs at batch 1 on an 8B-shaped model, each
# looping over its positions 64 at a time, so a long cache leaves the GPU idle. With SPLITS > 1 each
# program takes a share of them and writes its unnormalized partial (acc, running max, sum) to a
# scratch tensor, and a second kernel merges them. The split count is static (a captured graph keeps
# its grid), taken from the cache length, the programs already there and the SMs; each split takes an
# equal share of the row's positions below its token, computed in the kernel, so the work follows
# the position.
# Short caches keep one split: the merge is one more launch on the path (~3 us).
# Measured (benchmarks/results/h200-2026-12-01-bd2a6b9-probe-attention.json, shares of the cache
# length then): B = 1, full caches of 1024 / 4096 / 32768 positions 25.0 -> 9.1, 91.3 -> 17.4,
# 711 -> 49.2 us; a 4000-token context decoded at 212 -> 433 tok/s (batch 1) and 1481 -> 2327 (batch 8)
# (`...-bd2a6b9-decode-4k-{1,rule}.json`).
SPLIT_ENV = "QOPS_ATTN_SPLITS"  # "1": never split; an integer n > 1: n splits (measurements); unset: the rule
SPLIT_MIN_SEQ = 512  # caches this long or shorter are not split
SPLIT_MIN_BLOCKS = 2  # no more splits than a full cache has pairs of BLOCK_S blocks
SPLIT_MAX = 64


def attention_splits(b: int, num_kv_heads: int, max_seq: int, block_s: int, sms: int) -> int:
    """How many programs share one (row, KV head)'s cache positions: about two programs an SM in all,
    each with at least ``SPLIT_MIN_BLOCKS`` blocks, none for caches of ``SPLIT_MIN_SEQ`` positions or
    fewer (``QOPS_ATTN_SPLITS`` overrides, read at each launch)."""
    raw = os.environ.get(SPLIT_ENV, "").strip()
    if raw:
        try:
            forced = int(raw)
        except ValueError:
            raise ValueError(f"{SPLIT_ENV}={raw!r}: expected a split count (1 = never split)") from None
        return max(1, min(forced, -(-max_seq // block_s), SPLIT_MAX))
    programs = max(b * num_kv_heads, 1)
    if max_seq <= SPLIT_MIN_SEQ or programs >= sms:
        return 1
    want = -(-2 * sms // programs)
    return max(1, min(want, max_seq // (block_s * SPLIT_MIN_BLOCKS), SPLIT_MAX))


def triton_decode_attention(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale, *,
                            config: dict | None = None, splits: int | None = None) -> torch.Tensor:
    """The Triton kernels' launcher (arguments as the op's, already checked). ``config`` overrides
    :func:`launch_config` (the interpreter tests use small tiles); ``splits`` overrides
    :func:`attention_splits` (tests)."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError(fail(OP, "triton is not importable"))
    b, d = qkv.shape[0], k_cache.shape[3]
    g = num_heads // num_kv_heads
    out = torch.empty((b, num_heads * d), dtype=qkv.dtype, device=qkv.device)
    if b == 0:
        return out
    cfg = {**launch_config(d, g), **(config or {})}
    max_seq = k_cache.shape[2]
    if splits is None:
        from ..ops.triton.common import sm_count  # imports Triton, as this launcher may

        # Under Triton's interpreter (CPU tensors) one "SM": no split unless the caller asks for one.
        splits = attention_splits(b, num_kv_heads, max_seq, cfg["BLOCK_S"], sm_count(qkv.device, 1))
    splits = max(1, min(splits, -(-max_seq // cfg["BLOCK_S"])))  # no more splits than blocks of positions
    release = pdl_launch(qkv.device) and os.environ.get(RELEASE_ENV, "1") != "0"
    part = (torch.empty((b, num_kv_heads, splits, cfg["BLOCK_H"], cfg["BLOCK_D"] + 2), dtype=torch.float32, device=qkv.device)
            if splits > 1 else out)  # (unused with one split)
    kernel[(b, num_kv_heads, splits)](
        qkv, cos, sin, positions, k_cache, v_cache, out, part,
        qkv.stride(0), qkv.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        positions.stride(0),
        *k_cache.stride(), *v_cache.stride(),
        out.stride(0),
        scale * 1.4426950408889634,
        H=num_heads, HKV=num_kv_heads, G=g, D=d,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], BLOCK_S=cfg["BLOCK_S"], IEEE=qkv.dtype == torch.float32,
        RELEASE=release and splits == 1, SPLITS=splits,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _triton_combine_kernel()[(b, num_kv_heads)](
            part, out, out.stride(0),
            HKV=num_kv_heads, G=g, D=d, BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"], SPLITS=splits, RELEASE=release,
            num_warps=cfg["num_warps"],
        )
    return out
