"""``qops::decode_layers``: every decoder layer of a Llama-style model for one token in one op -- on
a GPU one persistent kernel (``qops/native/decode_layers.cu``) whose warps prefetch the layers'
4-bit weights into L2 ahead of use, across the layer's phase boundaries.

Arguments (L layers; hidden size H, intermediate size I, Hq query heads, Hkv KV heads, head dim D;
the projections' weights in qops' runtime int-weight layout, ``qops/ops/int_weight.py``):

- ``hidden`` ``(1, H)`` float16 / bfloat16 (float32: the reference kernel only): the token's embedding (the residual stream entering
  layer 0).
- ``positions`` int64 ``(1,)``: the token's position, in ``[0, S)`` (not checked: a check would
  read device memory). ``cos``, ``sin`` float32 ``(R, D)``: rotary tables, as ``decode_attention``.
- ``norm1``, ``norm2``: L tensors ``(H,)``: the input and post-attention RMSNorm weights.
- ``qweight``, ``scales``, ``qzeros``: 4 L tensors, layer by layer ``[q; k; v]`` (N = (Hq + 2 Hkv) D,
  K = H), ``o`` (H, Hq D), ``[gate; up]`` (2 I, H), ``down`` (H, I): 4-bit, flat ``(K/8, N)`` or column
  slabs ``(N/32, K/8, 32)``; scales ``(n_groups, N)``, one float dtype for all; qzeros ``(n_groups,
  N/8)`` int32 for every projection or None for every one (symmetric, zero 8). No act-order, no bias.
- ``k_cache``, ``v_cache``: L tensors ``(max_batch, Hkv, S, D)``, written in place at row 0,
  ``positions[0]``.
- ``workspace`` uint8, at least :func:`workspace_bytes` bytes, caller-owned scratch (its counters,
  the weights' address table, activations and partial sums).
- ``num_kv_heads``, ``group_size`` (a multiple of 128, or -1), ``zero_offset``, ``eps`` (the RMSNorms'),
  ``scale`` (the softmax's).

Returns the residual stream after the last layer ``(1, H)``. Each layer computes what
``LlamaDecoderLayer`` does for one token with ``attention="fused"``: ``x = rmsnorm(h)``;
``qkv = x W_qkv^T`` (fp32 sums, rounded); rotary, cache write and attention as ``decode_attention``;
``h = round(h + round(attn W_o^T))``; ``x = rmsnorm(h)``; ``a = round(silu(g) u)`` from the fp32 sums of
``[gate; up]``; ``h = round(h + round(a W_down^T))``.

Kernels: on CPU (and wherever the native kernel refuses, :func:`native_refusal` says why)
:func:`reference_decode_layers`, plain torch in fp32 with the same roundings. On CUDA (sm_80+, measured
on the H200 only) the native kernel, launched with one block of 8 warps an SM (or 16 warps an SM at <= 128
registers, two blocks of 8 or one of 16: :func:`grid_shape_wanted`, then the occupancy calculator); it
needs every block resident at once (grid barriers), which the occupancy check and nothing else holding
an SM for good guarantee.
Experimental: on the H200 it is so far ~1.5x slower than the layer-by-layer path (end to end 347 against
536 tok/s at 4410df4; 82.2 us a Llama-3-8B layer against ~55: its weight loops take ~48 us for 109 MB,
waiting on the ~32 KiB of weights an SM has in flight in registers, the four phase boundaries ~5 us each
and the attention ~8.5; benchmarks/NOTES.md stops 46-48 have the per-phase timelines), so nothing routes
to it unless asked (``LlamaForCausalLM.use_layer_kernel``). Sums run in a fixed order (no
floating-point atomics): results are the same bits run to run. Scores, softmax and the attention's
sums stay in fp32 (``decode_attention`` rounds the probabilities to the dtype before ``p @ v``; this
kernel does not), so outputs agree with the layer-by-layer model within rounding, not bit for bit.

Each call first copies the zeroed counters and the weights' address table into the workspace's
head (one host-to-device copy of ~4 KiB from pinned memory, a node of a captured graph), so the op
keeps no state about a workspace between calls.
Inference only: no autograd formula is registered.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..ops._common import ACT_DTYPES, check_workspace, fail, on_device_of
from . import attention as _attention

OP = "decode_layers"
SCHEMA = ("(Tensor hidden, Tensor positions, Tensor cos, Tensor sin, Tensor[] norm1, Tensor[] norm2, Tensor[] qweight, "
          "Tensor[] scales, Tensor?[] qzeros, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, Tensor(c!) workspace, "
          "int num_kv_heads, int group_size, int zero_offset, float eps, float scale) -> Tensor")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
SOURCE = "decode_layers.cu"
KERNEL = "qops_decode_layers"
MAX_SPLITS = 32            # the attention's shares of the cache positions per KV head (workspace sized for it)
TABLE_WORDS = 16           # pointers a layer (decode_layers.cu LayerWeights)
STAMPS = 24                # timer words a block in QOPS_STAMPS builds (decode_layers.cu kStamps)
MAX_STAMP_BLOCKS = 512
# 16 warps an SM (two blocks of 8 or one of 16: <= 128 registers a thread) only where the attention's
# per-lane arrays fit: GQ x D <= 512 (ptxas, sm_90: no spills at GQ 4 x D 128 or GQ 8 x D 64; GQ 8 x D 128
# spills 144 bytes in the attention, GQ 8 x D 256 872).
SIXTEEN_WARPS_MAX_GQ_D = 512
MAX_BLOCKS_PER_SM = 2      # decode_layers.cu's QOPS_BPS is 1 or 2: the grid is at most this many blocks an SM


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int


def _n_k(t: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a 4-bit qweight in either form."""
    if t.dim() == 3:
        return t.shape[0] * t.shape[2], t.shape[1] * 8
    return t.shape[1], t.shape[0] * 8


def check_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                        num_kv_heads: int, group_size: int, zero_offset: int) -> Dims:
    """Validate every argument (eagerly and under fake tensors); returns the model's dimensions."""
    who = OP
    dt = hidden.dtype
    torch._check_type(dt in ACT_DTYPES, lambda: fail(who, f"hidden must be float32, float16 or bfloat16, got {dt}"))
    torch._check_value(hidden.dim() == 2 and hidden.shape[0] == 1,
                       lambda: fail(who, f"hidden must be (1, H) (one token), got shape {tuple(hidden.shape)}"))
    h = int(hidden.shape[1])
    n_layers = len(norm1)
    if n_layers < 1:
        raise ValueError(fail(who, "norm1 is empty: give at least one layer"))
    for name, lst, want in (("norm2", norm2, n_layers), ("k_cache", k_cache, n_layers), ("v_cache", v_cache, n_layers),
                            ("qweight", qweight, 4 * n_layers), ("scales", scales, 4 * n_layers), ("qzeros", qzeros, 4 * n_layers)):
        if len(lst) != want:
            raise ValueError(fail(who, f"{name} must hold {want} tensors ({'4 a layer: ' + ', '.join(PROJECTIONS) if want != n_layers else 'one a layer'}), got {len(lst)}"))
    dev = hidden.device
    named = [("positions", positions), ("cos", cos), ("sin", sin), ("workspace", workspace)]
    for name, lst in (("norm1", norm1), ("norm2", norm2), ("qweight", qweight), ("scales", scales), ("qzeros", qzeros),
                      ("k_cache", k_cache), ("v_cache", v_cache)):
        named += [(f"{name}[{i}]", t) for i, t in enumerate(lst) if t is not None]
    for name, t in named:
        if t.device != dev:
            raise ValueError(fail(who, f"{name} must be on {dev} (the device of hidden), got {t.device}"))
    torch._check_type(positions.dtype == torch.int64 and positions.numel() == 1,
                      lambda: fail(who, f"positions must be int64 with one element, got {positions.dtype} {tuple(positions.shape)}"))
    kc0 = k_cache[0]
    if kc0.dim() != 4:
        raise ValueError(fail(who, f"k_cache[0] must be 4-D (max_batch, Hkv, S, D), got shape {tuple(kc0.shape)}"))
    d = int(kc0.shape[3])
    if kc0.shape[1] != num_kv_heads:
        raise ValueError(fail(who, f"k_cache[0] holds {kc0.shape[1]} KV heads, num_kv_heads is {num_kv_heads}"))
    for name, t in (("cos", cos), ("sin", sin)):
        torch._check_type(t.dtype == torch.float32, lambda name=name, t=t: fail(who, f"{name} must be float32, got {t.dtype}"))
        if t.dim() != 2 or t.shape[1] != d:
            raise ValueError(fail(who, f"{name} must be (R, D={d}), got shape {tuple(t.shape)}"))
    for name, lst in (("k_cache", k_cache), ("v_cache", v_cache)):
        for i, t in enumerate(lst):
            if tuple(t.shape) != tuple(kc0.shape) or t.dtype != dt:
                raise ValueError(fail(who, f"{name}[{i}] must be {dt} of shape {tuple(kc0.shape)}, got {t.dtype} {tuple(t.shape)}"))
    for name, lst in (("norm1", norm1), ("norm2", norm2)):
        for i, t in enumerate(lst):
            if tuple(t.shape) != (h,) or t.dtype != dt:
                raise ValueError(fail(who, f"{name}[{i}] must be {dt} of shape ({h},), got {t.dtype} {tuple(t.shape)}"))
    qkv_n, _ = _n_k(qweight[0])
    if qkv_n % d or qkv_n // d <= 2 * num_kv_heads:
        raise ValueError(fail(who, f"qweight[0] ([q; k; v]) has N={qkv_n}, not (Hq + 2 Hkv) * D with D={d}, Hkv={num_kv_heads}"))
    heads = qkv_n // d - 2 * num_kv_heads
    if heads % num_kv_heads:
        raise ValueError(fail(who, f"query heads {heads} are not a multiple of num_kv_heads={num_kv_heads}"))
    inter2, _ = _n_k(qweight[2])
    if inter2 % 2:
        raise ValueError(fail(who, f"qweight[2] ([gate; up]) has an odd N={inter2}"))
    dims = Dims(n_layers, h, inter2 // 2, heads, num_kv_heads, d)
    want_nk = ((qkv_n, h), (h, heads * d), (inter2, h), (h, inter2 // 2))
    if group_size != -1 and (group_size <= 0 or group_size % 128):
        raise ValueError(fail(who, f"group_size must be a multiple of 128 or -1, got {group_size}"))
    has_z = qzeros[0] is not None
    for i in range(4 * n_layers):
        p = PROJECTIONS[i % 4]
        qw, sc, qz = qweight[i], scales[i], qzeros[i]
        n, k = want_nk[i % 4]
        if qw.dtype != torch.int32 or qw.dim() not in (2, 3) or _n_k(qw) != (n, k) or (qw.dim() == 3 and qw.shape[2] != 32):
            raise ValueError(fail(who, f"qweight[{i}] ({p} of layer {i // 4}) must be int32 4-bit (K/8, N) or slabs (N/32, K/8, 32) "
                                       f"with N={n}, K={k}; got {qw.dtype} {tuple(qw.shape)}"))
        groups = 1 if group_size == -1 else -(-k // group_size)
        if sc.dtype != scales[0].dtype or sc.dtype not in ACT_DTYPES or tuple(sc.shape) != (groups, n):
            raise ValueError(fail(who, f"scales[{i}] ({p}) must be float32, float16 or bfloat16 (the dtype of scales[0]) of shape ({groups}, {n}), "
                                       f"got {sc.dtype} {tuple(sc.shape)}"))
        if (qz is not None) != has_z:
            raise ValueError(fail(who, f"qzeros[{i}] ({p}): give zeros for every projection or for none"))
        if qz is not None and (qz.dtype != torch.int32 or tuple(qz.shape) != (groups, -(-n // 8))):
            raise ValueError(fail(who, f"qzeros[{i}] ({p}) must be int32 of shape ({groups}, {-(-n // 8)}), got {qz.dtype} {tuple(qz.shape)}"))
    if zero_offset not in (0, 1):
        raise ValueError(fail(who, f"zero_offset must be 0 or 1, got {zero_offset}"))
    need = workspace_bytes(dims)
    check_workspace(who, workspace, hidden)  # uint8, 1-D, contiguous, 16-byte aligned, as the _out ops'
    if workspace.numel() < need:
        raise ValueError(fail(who, f"workspace must be uint8 1-D with at least {need} bytes (workspace_bytes), got {workspace.dtype} {tuple(workspace.shape)}"))
    return dims


# --- the workspace --------------------------------------------------------------------------------


def _projection_shapes(dims: Dims) -> list[tuple[int, int, int]]:
    """(column groups, 128-row chunks, slab-chunks a unit) of [q; k; v], o, [gate; up], down."""
    d = dims
    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    return [(qkv_n // 32, d.hidden // 128, 1), (d.hidden // 32, d.heads * d.head_dim // 128, 1),
            (d.inter // 32, d.hidden // 128, 2), (d.hidden // 32, d.inter // 128, 1)]


def _align(n: int, a: int = 256) -> int:
    return -(-n // a) * a


def workspace_layout(dims: Dims) -> dict[str, int]:
    """Byte offsets of the workspace's parts (and ``"bytes"``, the total): counters, the weights'
    address table, the [q; k; v] / attention / SiLU outputs, the projections' and the attention's
    partial sums."""
    shapes = _projection_shapes(dims)
    groups = max(g for g, _, _ in shapes)
    lay = {"attn_ctr": 2 + groups}
    off = _align(4 * (2 + groups + dims.kv_heads))
    lay["ctr_bytes"] = off
    lay["table"] = off
    off += _align(8 * TABLE_WORDS * dims.layers)
    for name, n in (("qkv", (dims.heads + 2 * dims.kv_heads) * dims.head_dim), ("attn", dims.heads * dims.head_dim), ("act", dims.inter)):
        lay[name] = off
        off += _align(2 * n)
    lay["part"] = off
    off += _align(4 * max(g * c * 32 * s for g, c, s in shapes))
    lay["apart"] = off
    off += _align(4 * dims.kv_heads * MAX_SPLITS * (dims.heads // dims.kv_heads) * (dims.head_dim + 2))
    lay["stamps"] = off  # QOPS_STAMPS measurement builds: STAMPS timer words a block, up to MAX_STAMP_BLOCKS blocks
    off += _align(8 * STAMPS * MAX_STAMP_BLOCKS)
    lay["bytes"] = off
    return lay


def workspace_bytes(dims: Dims) -> int:
    return workspace_layout(dims)["bytes"]


def dims_of(config) -> Dims:
    """The op's dimensions for a ``LlamaConfig`` (one process: the op takes no tensor-parallel shards)."""
    return Dims(config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
                config.num_key_value_heads, config.head_dim)


# --- the reference kernel --------------------------------------------------------------------------


def _rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _sums(x: torch.Tensor, qw, sc, qz, k: int, group_size: int, zero_offset: int) -> torch.Tensor:
    w = torch.ops.qops.dequantize_int_weight(qw, sc, qz, None, k, 4, group_size, zero_offset, torch.float32)
    return x.float() @ w.t()


def reference_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                            num_kv_heads, group_size, zero_offset, eps, scale) -> torch.Tensor:
    dims = check_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                               num_kv_heads, group_size, zero_offset)
    dt = hidden.dtype
    h = hidden.clone()
    for layer in range(dims.layers):
        def proj(i, x, k):
            j = 4 * layer + i
            return _sums(x, qweight[j], scales[j], qzeros[j], k, group_size, zero_offset)
        qkv = proj(0, _rmsnorm(h, norm1[layer], eps), dims.hidden).to(dt)
        attn = _attention.reference_decode_attention(qkv, cos, sin, positions.view(1), k_cache[layer], v_cache[layer],
                                                     dims.heads, num_kv_heads, scale)
        h = (h.float() + proj(1, attn, dims.heads * dims.head_dim).to(dt).float()).to(dt)
        gu = proj(2, _rmsnorm(h, norm2[layer], eps), dims.hidden)
        g, u = gu[:, :dims.inter], gu[:, dims.inter:]
        act = (g * torch.sigmoid(g) * u).to(dt)
        h = (h.float() + proj(3, act, dims.inter).to(dt).float()).to(dt)
    return h


@torch.library.custom_op(f"qops::{OP}", mutates_args=("k_cache", "v_cache", "workspace"), schema=SCHEMA)
def decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                  num_kv_heads, group_size, zero_offset, eps, scale):
    return reference_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache,
                                   workspace, num_kv_heads, group_size, zero_offset, eps, scale)


@decode_layers.register_fake
def _decode_layers_fake(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                        num_kv_heads, group_size, zero_offset, eps, scale):
    check_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                        num_kv_heads, group_size, zero_offset)
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@decode_layers.register_kernel("cuda")
def _decode_layers_cuda(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                        num_kv_heads, group_size, zero_offset, eps, scale):
    dims = check_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                               num_kv_heads, group_size, zero_offset)
    why = native_refusal(dims, hidden, cos, sin, qweight, scales, qzeros, k_cache, v_cache)
    if why is not None:
        return reference_decode_layers(hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache,
                                       workspace, num_kv_heads, group_size, zero_offset, eps, scale)
    with on_device_of(hidden):
        return native_decode_layers(dims, hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache,
                                    v_cache, workspace, group_size, zero_offset, eps, scale)


# --- the native kernel -----------------------------------------------------------------------------

DISABLE_ENV = "QOPS_LAYER_KERNEL"  # "0": the reference kernel on CUDA too (measurements)
DEFINES_ENV = "QOPS_LAYER_DEFINES"  # JSON of extra NVRTC macros (measurement knobs of decode_layers.cu)


def native_refusal(dims: Dims, hidden, cos, sin, qweight, scales, qzeros, k_cache, v_cache) -> str | None:
    """Why the native kernel cannot run these arguments (None: it can)."""
    dev = hidden.device
    if dev.type != "cuda":
        return f"{dev} is not a CUDA device"
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    from ..native import compiler

    if compiler.runtime_missing() is not None:
        return compiler.runtime_missing()
    major, _ = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"compute capability {major}.x: the kernel needs sm_80 or later (bf16 MMAs)"
    for what, t in (("hidden", hidden), ("scales", scales[0])):
        if t.dtype not in (torch.float16, torch.bfloat16):
            return f"{what} is {t.dtype}: the kernel takes float16 or bfloat16"
    if any(t.dim() != 3 for t in qweight):
        return "a qweight is flat: the kernel reads column slabs (weights prepared for the native lowering)"
    if dims.head_dim % 32 or dims.head_dim > 256:
        return f"head_dim={dims.head_dim}: the kernel takes multiples of 32 up to 256"
    for what, v in (("hidden", dims.hidden), ("intermediate", dims.inter), ("heads * head_dim", dims.heads * dims.head_dim)):
        if v % 128:
            return f"{what}={v} is not a multiple of 128 (the kernel's row chunks)"
    tensors = [hidden, cos, sin, *qweight, *scales, *[z for z in qzeros if z is not None], *k_cache, *v_cache]
    if any(not t.is_contiguous() for t in tensors):
        return "a tensor is not contiguous"
    if any(t.data_ptr() % 16 for t in tensors):
        return "a tensor's address is not 16-byte aligned (the kernel's 16-byte loads)"
    sms, smem_optin = device_facts(dev)
    smem, plan = smem_plan(dims, sms, smem_optin)
    most_blocks = MAX_BLOCKS_PER_SM * sms
    if most_blocks > MAX_STAMP_BLOCKS:
        return f"{sms} SMs: the workspace's layout holds {MAX_STAMP_BLOCKS} blocks' measurement stamps"
    units = max(g * c for g, c, _ in _projection_shapes(dims))
    if units * most_blocks >= 2**32:
        return f"{units} units of a projection over {most_blocks} blocks: the kernel's unit arithmetic is 32-bit"
    if plan["ncg"] > 64:
        return f"a block would hold {plan['ncg']} column groups of one projection (the kernel's flags hold 64)"
    if smem is None:
        return f"the model's activations and scratch take more than {compiler.max_shared_optin(dev)} bytes of shared memory"
    return None


def _unit_begin(units: int, b: int, grid: int) -> int:
    return units * b // grid


@functools.lru_cache(maxsize=64)
def _scratch_floats(dims: Dims, grid: int, warps: int = 8) -> tuple[int, int]:
    """(column groups a block holds at most in one projection, floats of scratch the kernel needs with
    ``warps`` warps a block). Cached: every native call asks (twice), and the answer walks every block
    of every projection."""
    ncg = 1
    for groups, chunks, _ in _projection_shapes(dims):
        units = groups * chunks
        for b in range(grid):
            i0, i1 = _unit_begin(units, b, grid), _unit_begin(units, b + 1, grid)
            if i1 > i0:
                ncg = max(ncg, (i1 - 1) // chunks - i0 // chunks + 1)
    gq, d = dims.heads // dims.kv_heads, dims.head_dim
    attention = (gq + 1) * d + d + warps * gq * (d + 2)
    return ncg, max(warps * ncg * 64, attention, warps)


def device_facts(dev: torch.device) -> tuple[int, int]:
    """(SMs, opt-in shared memory bytes a block) of a CUDA device."""
    from ..native import compiler

    return torch.cuda.get_device_properties(dev).multi_processor_count, compiler.max_shared_optin(dev)


def smem_plan(dims: Dims, grid: int, smem_optin: int, warps: int = 8) -> tuple[int | None, dict]:
    """(dynamic shared memory bytes a block of ``warps`` warps, or None when they exceed ``smem_optin``;
    the launch facts: grid, column groups and scratch floats a block, the longest K)."""
    ncg, scratch = _scratch_floats(dims, grid, warps)
    kmax = max(dims.hidden, dims.inter, dims.heads * dims.head_dim)
    smem = 128 + 2 * _align(kmax, 8) + 4 * scratch + 4 * 64 + 2 * 64 * 32  # x, scratch, flags, h_pre
    plan = dict(grid=grid, ncg=ncg, scratch=scratch, kmax=kmax)
    return (smem if smem <= smem_optin else None), plan


def build_defines(dims: Dims, dtype: torch.dtype, scale_dtype: torch.dtype, has_zeros: bool, blocks_per_sm: int = 1,
                  warps: int = 8) -> dict[str, int]:
    """The NVRTC macros of one build of the kernel."""
    return {"QOPS_DT": int(dtype == torch.bfloat16), "QOPS_SDT": int(scale_dtype == torch.bfloat16), "QOPS_HAS_Z": int(has_zeros),
            "QOPS_HD": dims.head_dim, "QOPS_GQ": dims.heads // dims.kv_heads, "QOPS_BPS": blocks_per_sm, "QOPS_WARPS": warps}


@dataclass(frozen=True)
class GridShape:
    """Blocks an SM and warps a block of one launch (decode_layers.cu QOPS_BPS, QOPS_WARPS)."""
    blocks_per_sm: int
    warps: int

    @property
    def threads(self) -> int:
        return 32 * self.warps


EIGHT_WARPS = GridShape(1, 8)  # the fallback: every build fits it
# Measured (benchmarks/NOTES.md, 8 Llama-3-8B layers on the H200): stop 47, one block of 8 warps (two stages
# of weights in flight) 92.7 us a layer, two blocks of 8 an SM 96.3 (their loops are faster, their grid
# barriers and finishers slower); stop 48 (no L2 prefetch), one block of 8 82.24, one of 16 82.21, two of 8
# 83.87 -- the same bytes in flight an SM. Every shape stays selectable (QOPS_LAYER_DEFINES
# {"QOPS_BPS": 2} or {"QOPS_WARPS": 16}) and tested.
PREFERRED_SHAPE = EIGHT_WARPS


def grid_shape_wanted(dims: Dims) -> tuple[GridShape, str]:
    """(the launch shape the kernel is built for before occupancy is known, why): PREFERRED_SHAPE, and
    never 16 warps an SM where the attention's per-lane arrays would spill at 128 registers."""
    if PREFERRED_SHAPE == EIGHT_WARPS:
        return EIGHT_WARPS, "one block of 8 warps an SM: 16 warps measured no faster (stops 47-48)"
    gq_d = dims.heads // dims.kv_heads * dims.head_dim
    if gq_d > SIXTEEN_WARPS_MAX_GQ_D:
        return EIGHT_WARPS, f"GQ x head_dim = {gq_d} > {SIXTEEN_WARPS_MAX_GQ_D}: the attention's arrays need more than 128 registers"
    return PREFERRED_SHAPE, "16 warps an SM"


def _addresses(dims: Dims, qweight, scales, qzeros, norm1, norm2, k_cache, v_cache) -> tuple:
    """The layers' address table (decode_layers.cu LayerWeights, 16 words a layer)."""
    table = []
    for layer in range(dims.layers):
        ws = range(4 * layer, 4 * layer + 4)
        table += [qweight[i].data_ptr() for i in ws] + [scales[i].data_ptr() for i in ws]
        table += [0 if qzeros[i] is None else qzeros[i].data_ptr() for i in ws]
        table += [norm1[layer].data_ptr(), norm2[layer].data_ptr(), k_cache[layer].data_ptr(), v_cache[layer].data_ptr()]
    return tuple(table)


_headers: dict[tuple, torch.Tensor] = {}  # (counter bytes, address table) -> pinned bytes: zeros, then the table


def _workspace_header(lay: dict, table: tuple, *, pin: bool = True) -> torch.Tensor:
    """The bytes every call writes at the workspace's start: zeroed counters, then the layers'
    address table. Pinned host memory kept for the process (a captured copy reads it at each replay)."""
    key = (lay["ctr_bytes"], table)
    buf = _headers.get(key)
    if buf is None:
        words = np.zeros(lay["table"] // 8 + len(table), dtype=np.uint64)
        words[lay["table"] // 8:] = np.array(table, dtype=np.uint64)
        buf = torch.from_numpy(words.view(np.uint8))
        if not pin:
            return buf
        buf = buf.pin_memory()
        _headers[key] = buf
    return buf


@functools.lru_cache(maxsize=64)
def _launch_plan_cached(dims: Dims, index: int, dtype: torch.dtype, scale_dtype: torch.dtype, has_zeros: bool, extra: str | None):
    from ..native import compiler

    dev = torch.device("cuda", index)
    sms, smem_optin = device_facts(dev)
    forced = json.loads(extra) if extra else {}  # measurement builds (benchmarks/probe_layer_kernel.py)
    named = "QOPS_BPS" in forced or "QOPS_WARPS" in forced  # a measurement names its shape: no fallback
    shape = GridShape(int(forced.get("QOPS_BPS", 1)), int(forced.get("QOPS_WARPS", 8))) if named else grid_shape_wanted(dims)[0]
    while True:
        smem, plan = smem_plan(dims, shape.blocks_per_sm * sms, smem_optin, shape.warps)
        defines = build_defines(dims, dtype, scale_dtype, has_zeros, shape.blocks_per_sm, shape.warps)
        defines.update({str(k): int(v) for k, v in forced.items()})
        kernel = compiler.get_kernel(dev, SOURCE, defines, KERNEL)
        # Every block must be resident at once (grid barriers): ask the occupancy calculator.
        fits = smem is not None and compiler.max_active_blocks(kernel, dev, shape.threads, smem) >= shape.blocks_per_sm
        if fits:
            return kernel, shape, shape.blocks_per_sm * sms, smem, plan
        if shape == EIGHT_WARPS or named:
            raise RuntimeError(fail(OP, f"{shape.blocks_per_sm} blocks of the kernel do not fit an SM ({shape.threads} threads, "
                                        f"{smem} bytes of shared memory)"))
        shape = EIGHT_WARPS  # the wanted shape does not fit (shared memory): one block of 8 warps


def _launch_plan(dims: Dims, dev: torch.device, dtype, scale_dtype, has_zeros: bool):
    """(kernel, GridShape, grid, dynamic shared memory bytes, smem_plan's facts): the shape
    grid_shape_wanted asks for (or QOPS_LAYER_DEFINES' QOPS_BPS / QOPS_WARPS) where the occupancy
    calculator says it fits, else one block of 8 warps."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _launch_plan_cached(dims, index, dtype, scale_dtype, has_zeros, os.environ.get(DEFINES_ENV) or None)


def native_decode_layers(dims, hidden, positions, cos, sin, norm1, norm2, qweight, scales, qzeros, k_cache, v_cache, workspace,
                         group_size, zero_offset, eps, scale) -> torch.Tensor:
    from ..native import compiler

    dev = hidden.device
    lay = workspace_layout(dims)
    # Counters and the address table rewritten by every call (one small copy; a captured graph replays
    # it): the op keeps no state about a workspace between calls.
    header = _workspace_header(lay, _addresses(dims, qweight, scales, qzeros, norm1, norm2, k_cache, v_cache))
    workspace[:header.numel()].copy_(header, non_blocking=True)
    kernel, shape, grid, smem, plan = _launch_plan(dims, dev, hidden.dtype, scales[0].dtype, qzeros[0] is not None)
    nsplit = max(1, min(MAX_SPLITS, grid // dims.kv_heads))
    out = hidden.clone(memory_format=torch.contiguous_format)
    base = workspace.data_ptr()
    i32 = compiler.i32
    compiler.launch(
        kernel, (grid, 1, 1), (shape.threads, 1, 1), smem, torch.cuda.current_stream(dev),
        base + lay["table"], i32(dims.layers), out.data_ptr(), base, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        i32(dims.hidden), i32(dims.inter), i32(dims.kv_heads), i32(k_cache[0].shape[2]), i32(0 if group_size == -1 else group_size // 128),
        i32(nsplit), i32(plan["kmax"]), i32(plan["ncg"]), i32(zero_offset), np.float32(eps), np.float32(scale),
        i32(lay["qkv"]), i32(lay["attn"]), i32(lay["act"]), i32(lay["part"]), i32(lay["apart"]), i32(lay["attn_ctr"]),
        i32(plan["scratch"]),
    )
    return out
