"""A Llama-style decoder built only from qops layers, for whole-model compilation and CUDA graphs.

Architecture (Hugging Face ``LlamaForCausalLM`` tensor names and numerics): token embedding
(``TensorParallelEmbedding``), ``num_hidden_layers`` blocks of RMSNorm -> grouped-query attention
with rotary embeddings (fused ``[q; k; v]`` column-parallel projection, row-parallel ``o_proj``)
-> RMSNorm -> SwiGLU MLP (fused ``[gate; up]`` column-parallel, row-parallel ``down_proj``), a final
RMSNorm and a vocabulary-parallel ``lm_head`` (``TensorParallelHead``; the embedding when
``tie_word_embeddings``). Linear layers come from the loader, so any checkpoint format the layer
registry serves loads (quantized or dense), sharded over ``process_group``.

Static shapes for CUDA graphs. Every tensor a step touches lives at a fixed address:

- KV cache: per layer, registered buffers ``k_cache`` / ``v_cache`` of shape
  ``(max_batch, kv_heads_local, max_seq, head_dim)``. A step writes its keys and values in place
  (``index_put_`` at ``(row, kv head, position)``) and attends over all
  ``max_seq`` positions of its rows, masking positions after the query's own; batch row b of a call
  uses cache row b. ``attention="fused"`` (default) runs a decode step (T == 1) as one
  ``qops::decode_attention`` call per layer (:mod:`qops.models.attention`: rotary, cache write and
  attention over positions ``0..p`` only, one kernel on CUDA; 3.6 us a layer on the H200 against
  ~8 us for the five kernels of "sdpa") and a longer step (prefill) as ``"sdpa"``; ``"sdpa"``
  writes the cache with ``index_put_`` and attends with one ``F.scaled_dot_product_attention`` call
  per layer under an additive mask computed once per step; ``"matmul"`` spells that out (two
  batched matmuls around a masked softmax, fp32 scores).
- Rotary tables: buffers ``(max_seq, head_dim)``, gathered at the step's positions.
- Scratch: ``model.workspace`` (:class:`qops.workspace.Workspace`), sized once from the layers'
  lowerings for ``max_batch`` rows and attached to every quantized linear, which then calls its
  op's ``_out`` variant with that buffer as scratch (``qops.workspace.attach_workspace``).

A decode step is :meth:`LlamaForCausalLM.decode` ``(tokens (B,), positions (B,)) -> logits (B, V)``:
no host synchronization, no data-dependent Python control flow, no allocation outside torch's
allocator, so ``torch.compile(model.decode, fullgraph=True, mode="reduce-overhead")`` and a manual
``torch.cuda.graph`` capture both take it whole. Inputs: B in ``[0, max_batch]`` (an empty batch returns empty logits), T at most
``max_seq``, positions of the tokens' shape, each in ``[0, max_seq)``, token ids in ``[0, vocab_size)``.
Shapes are checked on every call: eagerly, and in a compiled step as run-time asserts without a
host sync (positions against tokens; B against max_batch where the attention slices the cache);
:func:`compile_decode`'s step checks them all on the host before anything is traced.
Values are checked eagerly only: a compiled or CUDA-graph-captured step takes positions and ids as
given (reading them would be a host synchronization), and :func:`generate` checks its prompts and
cache length once, up front.

Tensor parallelism: with world size w, each rank holds ``num_attention_heads / w`` query heads and
``num_key_value_heads / w`` KV heads (both must divide), ``intermediate_size / w`` MLP columns and
``vocab_size / w`` logits (all-gathered). Without ``torch.distributed`` initialized the model runs
in one process (world size 1, no collectives in the graph).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ..layers import (
    QuantLinear,
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
    Weights,
    WeightsError,
)
from ..layers.layout import join
from ..layers.loader import read_quantization_config
from ..workspace import Workspace, attach_workspace
from . import attention as _attention  # noqa: F401  (registers qops::decode_attention)
from . import layer_kernel as _layer_kernel
from .checkpoint import QuantScheme, TensorWeights, get_scheme, quantize_tensors, save_pretrained

ARCHITECTURES = ("LlamaForCausalLM",)  # (Mistral adds sliding-window attention, not implemented here)


# Fields that must hold a positive int (head_dim may also be None: derived from the others).
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_kind(rope_scaling: dict | None) -> str:
    """The rotary scaling type of a config's ``rope_scaling`` (Hugging Face spells the key both ways)."""
    rs = rope_scaling or {}
    return rs.get("rope_type", rs.get("type", "default"))


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape, with Hugging Face ``config.json`` names."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if name == "head_dim" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive number, got {value!r}")
        if rope_kind(self.rope_scaling) == "llama3":
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"LlamaConfig: rope_scaling of type llama3 lacks {missing}; it needs {list(LLAMA3_ROPE_KEYS)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` (unknown keys ignored; missing ones take Llama defaults)."""
        archs = d.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"LlamaConfig: architectures {archs} are not Llama-style; supported: {list(ARCHITECTURES)}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = d.get("num_attention_heads", cls.num_attention_heads)
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, path: str) -> "LlamaConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama")
        return d

    @classmethod
    def tiny(cls, **kw) -> "LlamaConfig":
        """The test model: every N and K of its linears is a multiple of 128 (GPTQ/AWQ groups,
        fp8 128x128 blocks, EETQ tiles), grouped-query attention with two query heads per KV head."""
        base = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64)
        return cls(**{**base, **kw})

    @classmethod
    def llama3_8b(cls) -> "LlamaConfig":
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})

    def linear_prefixes(self, head: bool = False) -> list[str]:
        """Every linear layer of the decoder blocks (what a quantized checkpoint quantizes), and
        ``lm_head`` last with ``head`` (checkpoints that quantize the head too; the loader reads a
        layer as quantized wherever the checkpoint holds the scheme's tensors for it)."""
        out = []
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            out += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            out += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
        return out + (["lm_head"] if head else [])


def check_checkpoint_shapes(config: LlamaConfig, weights: Weights) -> None:
    """Raise a WeightsError naming the tensor and the config fields where a checkpoint's embedding,
    norms, linear layers or head do not have the shapes ``config`` gives them. Reads shapes only
    (:meth:`~qops.layers.Weights.linear_dims`), so an inconsistent checkpoint fails at load, not in
    torch at the first step; a model built anyway would ignore config sizes it does not use."""
    c = config
    # (what the config says, the size it gives)
    hidden = (f"hidden_size={c.hidden_size}", c.hidden_size)
    vocab = (f"vocab_size={c.vocab_size}", c.vocab_size)
    inter = (f"intermediate_size={c.intermediate_size}", c.intermediate_size)
    q = (f"num_attention_heads * head_dim = {c.num_attention_heads} * {c.head_dim}", c.num_attention_heads * c.head_dim)
    kv = (f"num_key_value_heads * head_dim = {c.num_key_value_heads} * {c.head_dim}", c.num_key_value_heads * c.head_dim)
    tensors = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    linears = {"lm_head": (hidden, vocab)}  # (K, N)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)})
        linears.update({f"{p}.self_attn.q_proj": (hidden, q), f"{p}.self_attn.k_proj": (hidden, kv), f"{p}.self_attn.v_proj": (hidden, kv),
                        f"{p}.self_attn.o_proj": (q, hidden), f"{p}.mlp.gate_proj": (hidden, inter), f"{p}.mlp.up_proj": (hidden, inter),
                        f"{p}.mlp.down_proj": (inter, hidden)})
    for name, dims in tensors.items():
        shape = weights.shape(name)
        want = tuple(size for _, size in dims)
        if shape != want:
            raise WeightsError(f"tensor {name!r} in {weights.where(name)} has shape {shape}; the config gives {want} "
                               f"({', '.join(said for said, _ in dims)})")
    for prefix, dims in linears.items():
        for axis, (said, want), have in zip(("K (in_features)", "N (out_features)"), dims, weights.linear_dims(prefix)):
            if have != want:
                raise WeightsError(f"linear layer {prefix!r} in {weights.where(join(prefix, 'weight'))} has {axis} {have}; "
                                   f"the config gives {want} ({said})")


def outside(values: torch.Tensor, end: int) -> torch.Tensor:
    """Where ``values`` fall outside ``[0, end)``."""
    return (values < 0) | (values >= end)


def some_of(values: torch.Tensor, where: torch.Tensor) -> list[int]:
    """The first few distinct ``values[where]``, for an error message."""
    return sorted(set(values[where].tolist()))[:8]


def values_readable(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values on the host now: not while torch.compile traces (the
    compiled step would synchronize, or break its graph) nor while a CUDA graph is captured (a
    synchronization is illegal there)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def default_process_group():
    """torch.distributed's world group when it is initialized, else None (one process)."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies (float64), with Llama 3 ``rope_scaling`` applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = config.rope_scaling or {}
    kind = rope_kind(rs)
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not supported; supported: default, llama3")
    return inv


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_add(self, delta: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + delta), residual + delta)`` in one kernel (``qops::add_rmsnorm``; where
        the weight's dtype differs from the activations', the sum and then :meth:`forward`)."""
        if self.weight.dtype != delta.dtype:
            summed = residual + delta
            return self(summed), summed
        return torch.ops.qops.add_rmsnorm(delta, residual, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (B, T, H, D)`` rotated by the angles whose cos/sin are ``(B, T, 1, D)`` (fp32 math)."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


ATTENTION_KINDS = ("sdpa", "matmul", "fused")


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, prefix: str, weights: Weights, *, max_batch: int, max_seq: int,
                 attention: str = "fused") -> None:
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"{prefix}: attention={attention!r} is not one of {ATTENTION_KINDS}")
        self.attention = attention
        world = weights.world_size
        for what, h in (("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads)):
            if h % world:
                raise ValueError(f"{prefix}: {what}={h} does not split over world size {world}")
        self.num_heads = config.num_attention_heads // world
        self.num_kv_heads = config.num_key_value_heads // world
        self.head_dim = d = config.head_dim
        self.scale = d ** -0.5
        self.qkv_proj = TensorParallelColumnLinear.load_multi(
            config, [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")], weights, bias=config.attention_bias)
        self.o_proj = TensorParallelRowLinear.load(config, f"{prefix}.o_proj", weights, bias=False)
        shape = (max_batch, self.num_kv_heads, max_seq, d)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=weights.dtype, device=weights.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=weights.dtype, device=weights.device), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: tuple[torch.Tensor, ...], bias: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``bias``: ``(1, B*Hkv, G*T, S)`` additive mask, 0 where a query row sees a key, -inf elsewhere.
        ``rope``: the model's rotary tables ``(rope_cos, rope_sin)`` ``(max_seq, D)``, which the
        ``"fused"`` decode step reads at the positions ``index[2]`` itself."""
        b, t, _ = x.shape
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.attention == "fused" and t == 1:
            qkv = self.qkv_proj(x).view(b, (h + 2 * hk) * d)
            o = torch.ops.qops.decode_attention(qkv, rope[0], rope[1], index[2].reshape(b), self.k_cache, self.v_cache, h, hk, self.scale)
            return self.o_proj(o.view(b, 1, h * d))
        q, k, v = self.qkv_proj(x).split([h * d, hk * d, hk * d], dim=-1)
        q = apply_rotary(q.view(b, t, h, d), cos, sin)
        k = apply_rotary(k.view(b, t, hk, d), cos, sin)
        # In place at (row, kv head, position): the cache keeps its address across steps. The
        # values keep their (B, T, Hkv, D) shape: merging B into another dimension with a reshape of
        # the non-contiguous split is miscompiled by Inductor when B is unbacked (torch 2.13).
        self.k_cache.index_put_(index, k)
        self.v_cache.index_put_(index, v.view(b, t, hk, d))
        # B <= max_batch, said to the compiler: with an unbacked B the slice's size is then B itself,
        # not a new unbacked min(B, max_batch), which torch 2.11's Inductor fails to lower.
        torch._check(b <= self.k_cache.shape[0])
        kc, vc = self.k_cache[:b], self.v_cache[:b]  # (B, Hkv, S, D)
        g = h // hk
        # Query rows grouped under their KV head: (B, Hkv, G*T, D), no copy of the cache per head.
        qg = q.view(b, t, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * t, d)
        # Rows and KV heads merged into one head dimension of a batch of 1: with an unbacked B, SDPA's
        # shape checks would otherwise guard on B == 1 (torch 2.11), while B*Hkv == 1 is known false.
        s = kc.shape[2]
        qg, kc, vc = qg.reshape(1, b * hk, g * t, d), kc.reshape(1, b * hk, s, d), vc.reshape(1, b * hk, s, d)
        if self.attention != "matmul":  # "fused" prefills through SDPA
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=bias, scale=self.scale)  # (1, B*Hkv, G*T, D)
        else:
            scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * self.scale + bias  # (1, B*Hkv, G*T, S)
            p = torch.softmax(scores, dim=-1).to(vc.dtype)
            o = torch.matmul(p, vc)
        o = o.view(b, hk, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, prefix: str, weights: Weights) -> None:
        super().__init__()
        self.gate_up_proj = TensorParallelColumnLinear.load_multi(config, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], weights, bias=False)
        self.down_proj = TensorParallelRowLinear.load(config, f"{prefix}.down_proj", weights, bias=False)
        self.gate_up_proj.prepare_swiglu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One kernel where the gate/up lowering computes silu(gate) * up in its epilogue.
        return self.down_proj(self.gate_up_proj.forward_swiglu(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, prefix: str, weights: Weights, *, max_batch: int, max_seq: int,
                 attention: str = "fused") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.input_layernorm.weight"), config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", weights, max_batch=max_batch, max_seq=max_seq,
                                        attention=attention)
        self.post_attention_layernorm = RMSNorm(weights.get_tensor(f"{prefix}.post_attention_layernorm.weight"), config.rms_norm_eps)
        self.mlp = LlamaMLP(config, f"{prefix}.mlp", weights)

    def forward(self, x, cos, sin, index, bias, rope=None, delta=None):
        """``x``: the residual stream; ``delta``: the previous layer's MLP output, not yet added to it
        (None for the first layer). Returns ``(residual, mlp_out)`` for the caller to add: each
        residual add happens with the norm after it, in one kernel (``RMSNorm.forward_add``), not as
        Inductor's two or three (benchmarks/NOTES.md, stop 21)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.forward_add(delta, x)
        h, x = self.post_attention_layernorm.forward_add(self.self_attn(h, cos, sin, index, bias, rope), x)
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """The decoder (see the module docstring). Build with :meth:`from_pretrained`,
    :meth:`from_tensors` or :meth:`random`; run with :meth:`decode`, :meth:`forward` or
    :func:`generate`."""

    def __init__(self, config: LlamaConfig, weights: Weights, *, max_batch: int = 8, max_seq: int = 256,
                 attention: str = "fused", progress: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        if max_batch < 1 or max_seq < 1:
            raise ValueError(f"LlamaForCausalLM: max_batch and max_seq must be positive, got {max_batch}, {max_seq}")
        check_checkpoint_shapes(config, weights)
        self.config = config
        self.max_batch, self.max_seq = max_batch, max_seq
        self.attention = attention
        self.dtype, self.device = weights.dtype, weights.device
        self.world_size = weights.world_size
        self.embed_tokens = TensorParallelEmbedding("model.embed_tokens", weights)
        layers = []
        for i in range(config.num_hidden_layers):
            layers.append(LlamaDecoderLayer(config, f"model.layers.{i}", weights, max_batch=max_batch, max_seq=max_seq,
                                            attention=attention))
            if progress is not None:
                progress(i + 1, config.num_hidden_layers)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(weights.get_tensor("model.norm.weight"), config.rms_norm_eps)
        self.lm_head = TensorParallelHead.load(config, "lm_head", weights)
        freqs = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().float().to(self.device), persistent=False)
        self.register_buffer("rope_sin", emb.sin().float().to(self.device), persistent=False)
        self.register_buffer("key_positions", torch.arange(max_seq, device=self.device), persistent=False)
        self.workspace = Workspace.for_model(self, max_m=max_batch, device=self.device)
        attach_workspace(self, self.workspace)
        self._layer_args = None  # qops::decode_layers' arguments once use_layer_kernel() is called

    # Construction.

    @classmethod
    def from_weights(cls, config: LlamaConfig, weights: Weights, **kw) -> "LlamaForCausalLM":
        """From any ``qops.layers.Weights`` (files, or :class:`~qops.models.checkpoint.TensorWeights`)."""
        if config.tie_word_embeddings and not weights.has("lm_head.weight"):
            weights.aliases = {**weights.aliases, "lm_head.weight": ["model.embed_tokens.weight"]}
        return cls(config, weights, **kw)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype: torch.dtype = torch.bfloat16, process_group="default",
                        **kw) -> "LlamaForCausalLM":
        """A Hugging Face checkpoint directory (config.json + safetensors), quantized or not, through
        ``qops.layers.Weights``. ``process_group="default"``: :func:`default_process_group`."""
        config = LlamaConfig.from_pretrained(path)
        pg = default_process_group() if process_group == "default" else process_group
        weights = Weights.from_pretrained(path, device=device, dtype=dtype, process_group=pg)
        return cls.from_weights(config, weights, **kw)

    @classmethod
    def from_tensors(cls, config: LlamaConfig, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None, *,
                     device="cpu", dtype: torch.dtype = torch.bfloat16, process_group="default", **kw) -> "LlamaForCausalLM":
        """Checkpoint tensors in memory (HF names; see ``qops.models.checkpoint``), through the loader."""
        pg = default_process_group() if process_group == "default" else process_group
        weights = TensorWeights(tensors, device=device, dtype=dtype, process_group=pg, quantization_config=quantization_config)
        return cls.from_weights(config, weights, **kw)

    @classmethod
    def random(cls, config: LlamaConfig, scheme: str | QuantScheme | None = None, *, seed: int = 0, device="cpu",
               dtype: torch.dtype = torch.bfloat16, **kw) -> "LlamaForCausalLM":
        """Random weights (:func:`random_tensors`), quantized with ``scheme``'s reference quantizer."""
        sch = get_scheme(scheme) if not isinstance(scheme, QuantScheme) else scheme
        tensors = quantize_tensors(random_tensors(config, seed=seed), config.linear_prefixes(), sch)
        return cls.from_tensors(config, tensors, None if sch is None else sch.config, device=device, dtype=dtype, **kw)

    # Checking a step's inputs.

    def check_input_shapes(self, who: str, tokens: torch.Tensor, positions: torch.Tensor, dims: int) -> None:
        """ValueError naming ``who`` unless ``tokens`` is ``(B,)`` (``dims=1``) or ``(B, T)``
        (``dims=2``), ``positions`` has its shape, B is at most ``max_batch`` and T at most
        ``max_seq``. Reads no data. Under torch.compile the positions' sizes become run-time asserts
        (Dynamo takes their messages only when they hold constants); B and T are not bounded there:
        an upper bound of 1 on an unbacked B (max_batch=1) keeps Inductor from deciding the views
        after it, and the attention already asserts B <= max_batch where it slices the cache
        (:func:`compile_decode`'s step checks both on the host before tracing)."""
        if tokens.dim() != dims or positions.dim() != dims:
            raise ValueError(f"{who}: tokens and positions must both be {('(B,)', '(B, T)')[dims - 1]}, "
                             f"got {tuple(tokens.shape)} and {tuple(positions.shape)}")
        max_batch, max_seq = self.max_batch, self.max_seq
        if torch.compiler.is_compiling():
            for i in range(dims):
                # A constant message: torch 2.11's Dynamo refuses a message function that reads a variable
                # from outside it (``who`` here), the whole step with it (2.13's accepts one).
                torch._check(positions.shape[i] == tokens.shape[i], lambda: "qops model step: positions must have the shape of tokens")
            return
        if positions.shape != tokens.shape:
            raise ValueError(f"{who}: positions must have the shape of tokens {tuple(tokens.shape)}, got {tuple(positions.shape)}")
        if tokens.shape[0] > max_batch:
            raise ValueError(f"{who}: a batch of {tokens.shape[0]} rows is more than the cache's max_batch={max_batch}")
        if dims == 2 and tokens.shape[1] > max_seq:
            raise ValueError(f"{who}: {tokens.shape[1]} positions per row are more than the cache's max_seq={max_seq}")

    def check_input_values(self, who: str, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """ValueError naming ``who`` unless every token id is in ``[0, vocab_size)`` and every
        position in ``[0, max_seq)`` (a negative one wraps to the cache's end; ids outside the
        vocabulary embed as zeros). Reads the values: one host synchronization on a GPU."""
        vocab = self.config.vocab_size
        bad_ids, bad_positions = outside(tokens, vocab), outside(positions, self.max_seq)
        ids_wrong, positions_wrong = torch.stack([bad_ids.any(), bad_positions.any()]).tolist()  # one read of both
        if ids_wrong:
            raise ValueError(f"{who}: tokens hold ids outside [0, vocab_size={vocab}): {some_of(tokens, bad_ids)}")
        if positions_wrong:
            raise ValueError(f"{who}: positions outside [0, max_seq={self.max_seq}): {some_of(positions, bad_positions)}")

    def _check_inputs(self, who: str, tokens: torch.Tensor, positions: torch.Tensor, dims: int) -> None:
        """The shape checks always; the value checks only where reading values costs no sync inside
        a compiled or captured step."""
        self.check_input_shapes(who, tokens, positions, dims)
        if values_readable(tokens):
            self.check_input_values(who, tokens, positions)

    # Running.

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens``, ``positions`` ``(B, T)`` -> logits ``(B, T, vocab)``; writes the KV cache of
        rows ``[0, B)`` at ``positions`` (each row's positions distinct). Checks its inputs
        (module docstring: values only when not compiled or captured)."""
        self._check_inputs("LlamaForCausalLM.forward", tokens, positions, dims=2)
        return self._forward(tokens, positions)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        hk = self.config.num_key_value_heads // self.world_size
        g = self.config.num_attention_heads // self.config.num_key_value_heads
        # Cache index (row, kv head, position) of each key of the step, broadcast to (B, T, Hkv).
        index = (torch.arange(b, device=tokens.device).view(b, 1, 1), torch.arange(hk, device=tokens.device).view(1, 1, hk),
                 positions.unsqueeze(-1))
        if self.attention == "fused" and t == 1:
            cos = sin = bias = None  # the fused decode op reads the rotary tables and masks by position itself
        else:
            cos = self.rope_cos[positions].unsqueeze(2)  # (B, T, 1, D)
            sin = self.rope_sin[positions].unsqueeze(2)
            # Masked: keys after the query's position (not written yet, or stale from an earlier
            # sequence). One additive mask for every layer: (1, B*Hkv, G*T, S), 0 where visible,
            # -inf elsewhere; query rows grouped (g, t) under their KV head.
            masked = (self.key_positions > positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)
            masked = masked.unsqueeze(2).expand(b, hk, g, t, self.max_seq).reshape(1, b * hk, g * t, self.max_seq)
            bias = torch.where(masked, float("-inf"), 0.0).to(self.dtype)
        x, delta = self.embed_tokens(tokens), None
        for layer in self.layers:
            x, delta = layer(x, cos, sin, index, bias, (self.rope_cos, self.rope_sin), delta)
        return self.lm_head(self.norm(x) if delta is None else self.norm.forward_add(delta, x)[0])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens``, ``positions`` ``(B,)`` -> logits ``(B, vocab)``; a batch of
        one through ``qops::decode_layers`` after :meth:`use_layer_kernel` (a batch size the
        compiler does not know statically, e.g. unbacked, takes the layer-by-layer path). Checks its
        inputs (module docstring: positions and ids only when not compiled or captured)."""
        self._check_inputs("LlamaForCausalLM.decode", tokens, positions, dims=1)
        return self._decode(tokens, positions)

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` without its input checks (for callers that checked them: :func:`generate`)."""
        if self._layer_args is not None and guard_or_false(tokens.shape[0] == 1):
            return self._decode_one(tokens, positions)
        return self._forward(tokens.unsqueeze(1), positions.unsqueeze(1)).squeeze(1)

    def _decode_one(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens.view(1, 1)).view(1, self.config.hidden_size)
        h = torch.ops.qops.decode_layers(x, positions.view(1), self.rope_cos, self.rope_sin, *self._layer_args,
                                         self.layer_workspace, *self._layer_statics)
        return self.lm_head(self.norm(h.view(1, 1, -1))).squeeze(1)

    def layer_kernel_refusal(self) -> str | None:
        """Why :meth:`use_layer_kernel` cannot serve this model (None: it can)."""
        if self.world_size != 1:
            return f"world size {self.world_size}: the layer op runs one process's whole layers"
        if self.attention != "fused":
            return f"attention={self.attention!r}: the layer op computes the fused decode attention"
        first = None
        for i, layer in enumerate(self.layers):
            for name, sup in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                              ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
                lin = sup.linear
                where = f"layer {i} {name}"
                if getattr(lin, "qweight", None) is None or not hasattr(lin, "act_perm"):
                    return f"{where} is {type(lin).__name__}, not an integer-weight layer (GPTQ / AWQ / compressed-tensors)"
                if lin.bits != 4:
                    return f"{where} has {lin.bits}-bit weights; the layer op takes 4-bit"
                if lin.act_perm is not None or lin.input_pad or lin.bias is not None:
                    return f"{where} has act-order, input padding or a bias"
                enc = (lin.group_size, lin.zero_offset, lin.qzeros is None, lin.scales.dtype)
                if first is None:
                    first = enc
                if enc != first:
                    return f"{where}: group size, zeros or scales' dtype differ from the other projections'"
        return None

    def layer_kernel_native_refusal(self) -> str | None:
        """Why ``qops::decode_layers`` would run its reference kernel, not the native one, for this
        model after :meth:`use_layer_kernel` (None: the native kernel runs)."""
        if self._layer_args is None:
            return "use_layer_kernel() has not been called"
        norm1, _, qweight, scales, qzeros, kc, vc = self._layer_args
        x = norm1[0].view(1, -1)
        return _layer_kernel.native_refusal(_layer_kernel.dims_of(self.config), x, self.rope_cos, self.rope_sin, qweight, scales,
                                            qzeros, kc, vc)

    def use_layer_kernel(self, enable: bool = True) -> None:
        """Run batch-1 decode steps through ``qops::decode_layers`` (``qops.models.layer_kernel``):
        every decoder layer in one op, on a GPU one persistent kernel (experimental:
        slower than the layer-by-layer steps on the H200 so far, benchmarks/NOTES.md stops 46-48). Allocates the op's
        workspace (``layer_workspace``, :func:`~qops.models.layer_kernel.workspace_bytes`) once.
        Raises ValueError naming what does not qualify (:meth:`layer_kernel_refusal`)."""
        if not enable:
            self._layer_args = None
            return
        why = self.layer_kernel_refusal()
        if why is not None:
            raise ValueError(f"LlamaForCausalLM.use_layer_kernel: {why}")
        qweight, scales, qzeros = [], [], []
        for layer in self.layers:
            for sup in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                qweight.append(sup.linear.qweight)
                scales.append(sup.linear.scales)
                qzeros.append(sup.linear.qzeros)
        norm1 = [layer.input_layernorm.weight for layer in self.layers]
        norm2 = [layer.post_attention_layernorm.weight for layer in self.layers]
        kc = [layer.self_attn.k_cache for layer in self.layers]
        vc = [layer.self_attn.v_cache for layer in self.layers]
        lin = self.layers[0].self_attn.qkv_proj.linear
        dims = _layer_kernel.dims_of(self.config)
        workspace = torch.zeros(_layer_kernel.workspace_bytes(dims), dtype=torch.uint8, device=self.device)
        args = (norm1, norm2, qweight, scales, qzeros, kc, vc)
        statics = (self.config.num_key_value_heads, lin.group_size, lin.zero_offset)
        # The op's own checks now (shapes, group size, ...), so a model it cannot take fails here, not at its first step.
        probe = torch.empty(1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        position = torch.zeros(1, dtype=torch.long, device=self.device)
        try:
            _layer_kernel.check_decode_layers(probe, position, self.rope_cos, self.rope_sin, *args, workspace, *statics)
        except ValueError as e:
            raise ValueError(f"LlamaForCausalLM.use_layer_kernel: {e}") from None
        self.register_buffer("layer_workspace", workspace, persistent=False)
        self._layer_args = args
        self._layer_statics = (*statics, self.config.rms_norm_eps, self.layers[0].self_attn.scale)

    def decode_greedy(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step and its greedy choice: ``(logits (B, vocab), next tokens (B,))``, the
        choice by :func:`greedy_argmax` (compiled with the step)."""
        logits = self.decode(tokens, positions)
        return logits, greedy_argmax(logits)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prompts ``(B, T)`` at positions ``0..T-1`` -> logits of the last position ``(B, vocab)``."""
        if tokens.dim() != 2:
            raise ValueError(f"LlamaForCausalLM.prefill: tokens must be (B, T), got shape {tuple(tokens.shape)}")
        self._check_inputs("LlamaForCausalLM.prefill", tokens, self._prompt_positions(tokens), dims=2)
        return self._prefill(tokens)

    def _prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`prefill` without its input checks (for callers that checked them: :func:`generate`)."""
        return self._forward(tokens, self._prompt_positions(tokens))[:, -1]

    @staticmethod
    def _prompt_positions(tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        return torch.arange(t, device=tokens.device).expand(b, t)

    # Facts.

    def quantized_linears(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, QuantLinear)]

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (parameters and weight buffers; no caches, no scratch)."""
        skip = {id(t) for m in self.modules() for t in (getattr(m, "k_cache", None), getattr(m, "v_cache", None)) if t is not None}
        skip |= {id(self.rope_cos), id(self.rope_sin), id(self.key_positions), id(self.workspace.buffer)}
        if hasattr(self, "layer_workspace"):
            skip.add(id(self.layer_workspace))
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if id(t) in skip or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def cache_bytes(self) -> int:
        return sum(layer.self_attn.k_cache.nbytes + layer.self_attn.v_cache.nbytes for layer in self.layers)

    def lowerings(self) -> dict[str, int]:
        """How many quantized linears each lowering serves."""
        out: dict[str, int] = {}
        for m in self.quantized_linears():
            name = m.choice.lowering.name if getattr(m, "choice", None) is not None else "unknown"
            out[name] = out.get(name, 0) + 1
        return out


def _argmax_chunks(v: int) -> int:
    """How many equal chunks :func:`greedy_argmax` splits a row of ``v`` into: the divisor of ``v``
    nearest ``sqrt(v)`` (1 below 16384 entries, where one pass is already short)."""
    if v < 16384:
        return 1
    root = math.isqrt(v)
    divisors = [d for i in range(1, root + 1) if v % i == 0 for d in (i, v // i)]
    return min(divisors, key=lambda d: (abs(d - root), d))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first index of the maximum) in two reductions that both run in
    parallel: the maximum of each of ~sqrt(V) chunks, then the best chunk. One row of a 128k
    vocabulary is otherwise a single-program reduction: ~30 us per decode step on an H200, eager or
    generated by Inductor, against ~5 us."""
    v = logits.shape[-1]
    chunks = _argmax_chunks(v)
    if chunks == 1:
        return logits.argmax(-1)
    width = v // chunks
    best, where = logits.reshape(*logits.shape[:-1], chunks, width).max(-1)  # first maximum of each chunk
    c = best.argmax(-1, keepdim=True)  # the first chunk holding the maximum
    return (where.gather(-1, c) + c * width).squeeze(-1)


def random_tensors(config: LlamaConfig, *, seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense checkpoint with random weights (HF names): linears ~ N(0, 1/fan_in) so activations
    keep their scale through the blocks, embeddings ~ N(0, 1), norms ~ 1 + N(0, 0.1^2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    h, d = c.hidden_size, c.head_dim
    t = {"model.embed_tokens.weight": rnd(c.vocab_size, h, std=1.0), "model.norm.weight": 1 + rnd(h, std=0.1)}
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = rnd(c.vocab_size, h, std=h ** -0.5)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = 1 + rnd(h, std=0.1)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + rnd(h, std=0.1)
        for name, n in (("q_proj", c.num_attention_heads * d), ("k_proj", c.num_key_value_heads * d), ("v_proj", c.num_key_value_heads * d)):
            t[f"{p}.self_attn.{name}.weight"] = rnd(n, h, std=h ** -0.5)
            if c.attention_bias:
                t[f"{p}.self_attn.{name}.bias"] = rnd(n, std=0.02)
        t[f"{p}.self_attn.o_proj.weight"] = rnd(h, c.num_attention_heads * d, std=(c.num_attention_heads * d) ** -0.5)
        t[f"{p}.mlp.gate_proj.weight"] = rnd(c.intermediate_size, h, std=h ** -0.5)
        t[f"{p}.mlp.up_proj.weight"] = rnd(c.intermediate_size, h, std=h ** -0.5)
        t[f"{p}.mlp.down_proj.weight"] = rnd(h, c.intermediate_size, std=c.intermediate_size ** -0.5)
    return t


def save_random_checkpoint(path: str, config: LlamaConfig, scheme: str | None = None, *, seed: int = 0) -> None:
    """Write a random-weight checkpoint (quantized with ``scheme``) as a Hugging Face directory."""
    sch = get_scheme(scheme)
    tensors = quantize_tensors(random_tensors(config, seed=seed), config.linear_prefixes(), sch)
    save_pretrained(path, tensors, config.to_dict(), None if sch is None else sch.config)


def is_quantized_checkpoint(path: str) -> bool:
    return read_quantization_config(path) is not None


def compile_decode(model: LlamaForCausalLM, *, cuda_graphs: bool | None = None, greedy: bool = False, pdl: bool | None = None,
                   dynamic_batch: bool = True, **compile_kw) -> Callable:
    """``model.decode`` (``greedy``: ``model.decode_greedy``) under ``torch.compile(fullgraph=True)``,
    compiled once for every batch size:
    the batch dimension of each call's inputs is marked unbacked (``mark_dynamic`` would still
    specialize batch 1). ``cuda_graphs`` (default: on a CUDA device) adds Inductor's CUDA graphs
    (``mode="reduce-overhead"``); a decode loop then calls ``torch.compiler.cudagraph_mark_step_begin()``
    before each step (:func:`generate` with ``cuda_graphs=True``). ``pdl`` (default: on a CUDA device
    of compute capability 9.0 or more) has Inductor's kernels use programmatic dependent launch
    (``triton.enable_pdl``): each may start while the kernel ahead of it drains (measured on an H200:
    4% off a decode step). ``dynamic_batch=False``: no unbacked batch dimension, one compilation per
    batch size (batch 1 then takes :meth:`LlamaForCausalLM.use_layer_kernel`'s op where enabled). A
    ``mode`` or ``options`` in ``compile_kw`` is passed as given.

    The returned step checks its inputs' shapes on the host (B at most ``max_batch``) before calling
    the compiled function, and takes positions and token ids as given: reading them would be a host
    synchronization per step (:func:`generate` checks its prompts and cache length once)."""
    if cuda_graphs is None:
        cuda_graphs = model.device.type == "cuda"
    if pdl is None:
        pdl = model.device.type == "cuda" and torch.cuda.get_device_capability(model.device)[0] >= 9
    if "mode" not in compile_kw and "options" not in compile_kw:
        options = {"triton.cudagraphs": True} if cuda_graphs else {}  # what mode="reduce-overhead" sets
        if pdl:
            options["triton.enable_pdl"] = True
        if options:
            compile_kw["options"] = options
    compiled = torch.compile(model.decode_greedy if greedy else model.decode, fullgraph=True, **compile_kw)

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Sizes the compiled graph cannot take fail here, not as a failed guard inside Dynamo.
        model.check_input_shapes("compile_decode step", tokens, positions, dims=1)
        if dynamic_batch:
            torch._dynamo.decorators.mark_unbacked(tokens, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
        return compiled(tokens, positions)

    return step


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, new_tokens) generated ids
    logits: torch.Tensor | None  # (B, new_tokens, vocab) float32, when kept
    prefill_s: float
    decode_s: float  # wall time of the decode steps (after the first token)
    decode_steps: int


def generate(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int, *, step: Callable | None = None,
             keep_logits: bool = False, cuda_graphs: bool = False, prefill: Callable | None = None) -> Generation:
    """Greedy decoding of ``new_tokens`` tokens after ``prompts`` ``(B, T0)``.

    The prompt goes through ``prefill`` (default ``model.prefill``), each later token through
    ``step`` (default ``model.decode``; pass a compiled one). ``cuda_graphs``: call
    ``torch.compiler.cudagraph_mark_step_begin()`` before each step (``mode="reduce-overhead"``), and
    copy what a step returns before the next replay overwrites it.

    Checks its arguments once, up front (prompt ids, batch, cache length), so a compiled ``step``,
    which takes positions and ids as given, never sees one outside the cache or the vocabulary; the
    default ``prefill`` and ``step`` then run unchecked (the tokens fed back are argmaxes, the positions
    counted here: checking them again would read them back from the device every step).
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"generate: new_tokens must be a positive integer, got {new_tokens!r}")
    if prompts.dim() != 2 or prompts.shape[1] < 1 or prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
        raise ValueError(f"generate: prompts must be integer token ids of shape (B, T) with T >= 1, got {prompts.dtype} of shape "
                         f"{tuple(prompts.shape)}")
    b, t0 = prompts.shape
    if not 1 <= b <= model.max_batch:
        raise ValueError(f"generate: batch {b} is outside [1, max_batch={model.max_batch}]")
    if t0 + new_tokens - 1 > model.max_seq:
        # The prompt fills positions 0..t0-1 and each new token but the last is fed back at the next one.
        raise ValueError(f"generate: a prompt of {t0} tokens and {new_tokens} new tokens need {t0 + new_tokens - 1} cache positions, "
                         f"more than max_seq={model.max_seq}")
    bad = outside(prompts, model.config.vocab_size)
    if bad.any():
        raise ValueError(f"generate: prompts hold ids outside [0, vocab_size={model.config.vocab_size}): {some_of(prompts, bad)}")
    step = step or model._decode
    sync = torch.cuda.synchronize if prompts.device.type == "cuda" else (lambda: None)
    kept = []
    t = time.perf_counter()
    logits = (prefill or model._prefill)(prompts)
    tok = logits.argmax(-1)
    if keep_logits:
        kept.append(logits.float())
    out = [tok]
    sync()
    prefill_s = time.perf_counter() - t
    positions = torch.full((b,), t0, dtype=torch.long, device=prompts.device)
    t = time.perf_counter()
    for _ in range(new_tokens - 1):
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(tok, positions)
        tok = logits.argmax(-1)
        if keep_logits:
            kept.append(logits.float().clone())
        out.append(tok)
        positions = positions + 1
    sync()
    decode_s = time.perf_counter() - t
    return Generation(torch.stack(out, 1), torch.stack(kept, 1) if keep_logits else None, prefill_s, decode_s, new_tokens - 1)


class CapturedDecode:
    """Greedy decode steps of one batch size captured once into a ``torch.cuda.graph``, as a serving
    loop runs them: no Python, no guards and no input copies per step.

    ``step`` (``model.decode_greedy`` or a :func:`compile_decode` ``greedy=True`` result without CUDA
    graphs: it returns the logits and the argmax) runs on static ``tokens`` / ``positions`` buffers
    of ``batch`` rows; the graph also writes the argmax back into ``tokens`` and advances
    ``positions``, so replays chain. :meth:`start` loads a batch's first
    tokens and positions; :meth:`replay` runs one step; ``logits`` holds the last step's output.
    The caller keeps positions below ``model.max_seq`` (nothing is checked inside the graph).
    Kernels compile and load in two warm-up steps on a side stream before capture (they write the
    KV cache at the start positions, which the first replay then overwrites).
    """

    def __init__(self, model: LlamaForCausalLM, step: Callable | None, batch: int, *, start_position: int = 0) -> None:
        if not 1 <= batch <= model.max_batch:
            raise ValueError(f"CapturedDecode: batch {batch} is outside [1, max_batch={model.max_batch}]")
        if model.device.type != "cuda":
            raise ValueError(f"CapturedDecode: the model is on {model.device}; CUDA graphs need a CUDA device")
        step = step or model.decode_greedy
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
        self.positions = torch.full((batch,), start_position, dtype=torch.long, device=model.device)
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                step(self.tokens, self.positions)
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits, chosen = step(self.tokens, self.positions)
            self.tokens.copy_(chosen)
            self.positions.add_(1)

    def start(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)

    def replay(self) -> None:
        self.graph.replay()
