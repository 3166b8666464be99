"""Tiny checkpoints in each format's real on-disk layout, for the layer, loader and TP tests.

Each :class:`Variant` writes one linear layer's tensors under their on-disk names (spelled out here,
from FORMATS.md, not derived from the loader) and the ``quantization_config`` a model with that
layout carries in ``config.json``. :func:`write_checkpoint` quantizes dense weights into a directory
of safetensors shards plus index json and config.json, as a hub checkpoint looks.

The tensor-parallel test ranks (:func:`tp_worker` here, ``qops.models.testing``'s) read, from the
environment of the test process: ``QOPS_TP_WATCHDOG_S`` (a rank still running after that many seconds
prints every thread's stack and exits; off by default), ``QOPS_TP_TRACE=1`` (each rank prints each
phase as it starts) and, in :func:`tp_worker`, ``QOPS_TP_TIMEOUT_S`` (the process group's timeout,
180 s by default).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors.torch import save_file

from ..formats import FORMATS
from ..formats.integer import act_order_g_idx


@dataclass(frozen=True)
class Variant:
    name: str
    quant_method: str | None  # config.json quant_method (None: unquantized)
    config: dict | None  # quantization_config
    # (dense (N, K), seed) -> ({suffix: tensor as stored}, the fp32 (N, K) weight they mean)
    write: Callable[[torch.Tensor, int], tuple[dict[str, torch.Tensor], torch.Tensor]]
    k_multiple: int = 1  # in_features this variant's layers need to be a multiple of
    tags: tuple[str, ...] = field(default=())


def _act_order(k: int, group_size: int, seed: int) -> torch.Tensor:
    # Layers reading the same input share one act-order permutation (GPTQ derives it from the
    # input's Hessian), which fused q/k/v need: seed it with K.
    return act_order_g_idx(k, group_size, torch.Generator().manual_seed(seed * 100003 + k))


def _dense(w, seed):
    return {"weight": w.to(torch.float32)}, w.float()


def _gptq(bits, group_size, sym, act_order, version):
    def write(w, seed):
        k = w.shape[1]
        g_idx = _act_order(k, group_size, seed) if act_order else None
        c = FORMATS["gptq"].quantize(w, bits=bits, group_size=group_size, sym=sym, g_idx=g_idx, version=version)
        return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales, "g_idx": c.g_idx}, FORMATS["gptq"].dequantize(c)

    return write


def _gptq_config(bits, group_size, sym, act_order, version):
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
            "checkpoint_format": "gptq_v2" if version == "v2" else "gptq"}


def _awq(group_size):
    def write(w, seed):
        c = FORMATS["awq"].quantize(w, bits=4, group_size=group_size, sym=False)
        return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales}, FORMATS["awq"].dequantize(c)

    return write


def _ct(bits, group_size, sym, act_order):
    def write(w, seed):
        k = w.shape[1]
        g_idx = _act_order(k, group_size, seed) if act_order else None
        c = FORMATS["compressed-tensors"].quantize(w, bits=bits, group_size=group_size, sym=sym, g_idx=g_idx)
        out = {"weight_packed": c.weight_packed, "weight_scale": c.weight_scale.to(torch.float16), "weight_shape": c.weight_shape}
        if c.weight_zero_point is not None:
            out["weight_zero_point"] = c.weight_zero_point
        if c.weight_g_idx is not None:
            out["weight_g_idx"] = c.weight_g_idx
        return out, FORMATS["compressed-tensors"].dequantize(c)

    return write


def _fp8(granularity, block=None, input_scale=None, scale_name="weight_scale"):
    def write(w, seed):
        if granularity == "block":
            c = FORMATS["fp8-block"].quantize(w, block_size=block)
            return {"weight": c.weight, scale_name: c.weight_scale_inv}, FORMATS["fp8-block"].dequantize(c)
        c = FORMATS["fp8"].quantize(w, granularity=granularity, input_scale=input_scale)
        out = {"weight": c.weight, "weight_scale": c.weight_scale}
        if c.input_scale is not None:
            out["input_scale"] = c.input_scale
        return out, FORMATS["fp8"].dequantize(c)

    return write


def _eetq(w, seed):
    c = FORMATS["eetq"].quantize(w)  # the ampere byte order transformers saves
    return {"weight": c.weight, "weight_scales": c.weight_scales}, FORMATS["eetq"].dequantize(c)


def _bnb_int8(w, seed):
    c = FORMATS["bitsandbytes-int8"].quantize(w)
    return {"weight": c.weight, "SCB": c.SCB, "weight_format": torch.tensor(0, dtype=torch.uint8)}, FORMATS["bitsandbytes-int8"].dequantize(c)


def _bnb_4bit(quant_type, nested):
    def write(w, seed):
        fmt = FORMATS[f"bitsandbytes-{quant_type}"]
        c = fmt.quantize(w, group_size=64, nested=nested, dtype=torch.bfloat16)
        # bitsandbytes' own keys (weight, weight.absmax, weight.quant_map, weight.nested_*, and the
        # JSON blob weight.quant_state.bitsandbytes__<type>), byte for byte.
        return fmt.to_state_dict(c), fmt.dequantize(c)

    return write


def _ct_fp8_config(block, ignore=("lm_head_odd",)):
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block", "block_structure": list(block)}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": list(ignore)}


def _ct_config(bits, group_size, sym, act_order, ignore=("lm_head_odd",)):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group", "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": list(ignore)}


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("dense", None, None, _dense),
    Variant("gptq-v1-4bit-sym", "gptq", _gptq_config(4, 32, True, False, "v1"), _gptq(4, 32, True, False, "v1"), 32),
    Variant("gptq-v2-4bit-actorder", "gptq", _gptq_config(4, 32, False, True, "v2"), _gptq(4, 32, False, True, "v2"), 32, ("act-order",)),
    Variant("gptq-v1-3bit-actorder", "gptq", _gptq_config(3, 32, False, True, "v1"), _gptq(3, 32, False, True, "v1"), 32, ("act-order",)),
    Variant("gptq-v2-8bit-channel", "gptq", _gptq_config(8, -1, False, False, "v2"), _gptq(8, -1, False, False, "v2"), 4),
    Variant("awq-gemm", "awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, _awq(32), 32),
    Variant("ct-4bit-sym-group", "compressed-tensors", _ct_config(4, 32, True, False), _ct(4, 32, True, False), 32),
    Variant("ct-8bit-asym-channel", "compressed-tensors", _ct_config(8, -1, False, False), _ct(8, -1, False, False), 4),
    Variant("ct-4bit-actorder", "compressed-tensors", _ct_config(4, 32, False, True), _ct(4, 32, False, True), 32, ("act-order",)),
    Variant("fp8-tensor-static", "fp8", {"quant_method": "fp8", "activation_scheme": "static"}, _fp8("tensor", input_scale=0.02)),
    Variant("fp8-channel", "fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}, _fp8("channel")),
    Variant("fp8-block", "fp8", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
            _fp8("block", (32, 32), scale_name="weight_scale_inv"), 32),
    Variant("ct-fp8-block", "compressed-tensors", _ct_fp8_config((32, 32)), _fp8("block", (32, 32), scale_name="weight_scale"), 32),
    Variant("eetq-ampere", "eetq", {"quant_method": "eetq", "weights": "int8"}, _eetq, 64),
    Variant("bnb-int8", "bitsandbytes", {"quant_method": "bitsandbytes", "load_in_8bit": True}, _bnb_int8),
    Variant("bnb-nf4-nested", "bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                               "bnb_4bit_use_double_quant": True}, _bnb_4bit("nf4", True), 64),
    Variant("bnb-fp4", "bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
            _bnb_4bit("fp4", False), 64),
)}


def write_checkpoint(
    path: str,
    variant: Variant,
    layers: dict[str, torch.Tensor],
    dense: dict[str, torch.Tensor] | None = None,
    *,
    seed: int = 0,
    shards: int = 2,
) -> None:
    """Quantize each ``layers[prefix]`` (dense (N, K)) in ``variant``'s layout and store it, with
    the ``dense`` tensors (biases, embeddings, unquantized layers) as they are, in ``shards``
    safetensors files plus ``model.safetensors.index.json`` and ``config.json``."""
    tensors: dict[str, torch.Tensor] = {}
    for prefix, w in layers.items():
        for suffix, t in variant.write(w, seed)[0].items():
            tensors[f"{prefix}.{suffix}"] = t.contiguous()
    for name, t in (dense or {}).items():
        tensors[name] = t.contiguous()
    os.makedirs(path, exist_ok=True)
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}, f)
    config = {"model_type": "qops-test"}
    if variant.config is not None:
        config["quantization_config"] = variant.config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


# A tiny transformer block using every tensor-parallel layer kind. Sizes split on every legal
# boundary of every variant for world sizes 1, 2 and 3 (EETQ's ampere order needs N and K shards
# of 64, 3-bit GPTQ of 32); the odd vocabulary (400) does not divide by 3, so that head stays whole.
HIDDEN, INTERMEDIATE, HEADS, VOCAB, VOCAB_ODD = 384, 768, 6, 384, 400
QKV = "layers.0.attn.qkv_proj"
Q_K_V = ["layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj"]
O_PROJ, GATE_UP, DOWN = "layers.0.attn.o_proj", "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"
# Column outputs are split per fused block: the block sizes of each, for slicing a full output.
COLUMN_BLOCKS = {"qkv": [HIDDEN] * 3, "q_k_v": [HIDDEN] * 3, "gate_up": [INTERMEDIATE] * 2}


def block_tensors(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(quantized layers, dense tensors) of the tiny block."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.05):
        return torch.randn(*shape, generator=gen) * scale

    layers = {QKV: rnd(3 * HIDDEN, HIDDEN), O_PROJ: rnd(HIDDEN, HIDDEN), GATE_UP: rnd(2 * INTERMEDIATE, HIDDEN),
              DOWN: rnd(HIDDEN, INTERMEDIATE), "lm_head": rnd(VOCAB, HIDDEN)}
    layers.update({p: rnd(HIDDEN, HIDDEN) for p in Q_K_V})
    dense = {"model.embed_tokens.weight": rnd(VOCAB_ODD, HIDDEN, scale=1.0), "lm_head_odd.weight": rnd(VOCAB_ODD, HIDDEN),
             f"{QKV}.bias": rnd(3 * HIDDEN), f"{O_PROJ}.bias": rnd(HIDDEN), f"{DOWN}.bias": rnd(HIDDEN)}
    return layers, dense


class TinyBlock(torch.nn.Module):
    def __init__(self, weights) -> None:
        from .tensor_parallel import TensorParallelColumnLinear, TensorParallelEmbedding, TensorParallelHead, TensorParallelRowLinear

        super().__init__()
        self.embed = TensorParallelEmbedding("model.embed_tokens", weights)
        self.qkv = TensorParallelColumnLinear.load_qkv(None, QKV, weights, bias=True, num_heads=HEADS, num_key_value_heads=HEADS)
        self.q_k_v = TensorParallelColumnLinear.load_multi(None, Q_K_V, weights, bias=False, dim=0)
        self.o_proj = TensorParallelRowLinear.load(None, O_PROJ, weights, bias=True)
        self.gate_up = TensorParallelColumnLinear.load_gate_up(None, GATE_UP, weights, bias=False)
        self.down = TensorParallelRowLinear.load(None, DOWN, weights, bias=True)
        self.head = TensorParallelHead.load(None, "lm_head", weights)
        self.head_odd = TensorParallelHead.load(None, "lm_head_odd", weights)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        e = self.embed(ids)
        qkv = self.qkv(e)
        q, k, v = qkv.chunk(3, dim=-1)
        m = self.q_k_v(e)
        q2, k2, v2 = m.chunk(3, dim=-1)
        a = self.o_proj(q * k + v + q2 * k2 + v2) + e
        gu = self.gate_up(a)
        g, u = gu.chunk(2, dim=-1)
        d = self.down(torch.nn.functional.silu(g) * u) + a
        return {"embed": e, "qkv": qkv, "q_k_v": m, "o_proj": a, "gate_up": gu, "down": d,
                "head": self.head(d), "head_odd": self.head_odd(d)}


def rank_slice(full: torch.Tensor, blocks: list[int], rank: int, world: int) -> torch.Tensor:
    """The part of a full column output that rank ``rank`` of ``world`` computes."""
    parts, start = [], 0
    for size in blocks:
        shard = size // world
        parts.append(full[..., start + rank * shard:start + (rank + 1) * shard])
        start += size
    return torch.cat(parts, dim=-1)


def write_block(path: str, variant: Variant, seed: int = 0) -> None:
    layers, dense = block_tensors(seed)
    write_checkpoint(path, variant, layers, dense, seed=seed)


_BLOCKS: dict[int, str] = {}


def block_checkpoints(seed: int = 0) -> str:
    """A directory holding every variant's TinyBlock checkpoint (``<dir>/<variant name>``), written
    once per process (quantizing them takes seconds) and removed at exit."""
    if seed not in _BLOCKS:
        root = tempfile.mkdtemp(prefix="qops-blocks-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        for name, v in VARIANTS.items():
            write_block(os.path.join(root, name), v, seed)
        _BLOCKS[seed] = root
    return _BLOCKS[seed]


class Blocks(torch.nn.Module):
    """Several TinyBlocks run on the same ids: one graph (one compilation) for all of them."""

    def __init__(self, blocks: dict[str, TinyBlock]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({k.replace("-", "_"): v for k, v in blocks.items()})

    def forward(self, ids: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        return {k: b(ids) for k, b in self.blocks.items()}


def sample_ids(seed: int, device) -> torch.Tensor:
    """Token ids with some outside the vocabulary (they embed to zero)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_ODD, (2, 6), generator=gen)
    ids[0, 1], ids[1, 4] = VOCAB_ODD + 7, -2
    return ids.to(device)


# Modes of tp_worker: how the tensor-parallel model runs before it is compared.
TP_MODES = ("eager", "compiled", "cuda_graph", "compiled_cuda_graph", "reduce_overhead")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    """A loopback TCP port free now, for a test's process-group rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_watchdog(rank: int):
    """Arm a spawned rank's watchdog and return its ``trace(what)`` function.

    ``QOPS_TP_WATCHDOG_S``: a rank still running after that many seconds prints every thread's stack
    and exits (a hung collective or compile then names itself instead of eating the caller's time
    limit); ``QOPS_TP_TRACE=1``: ``trace`` prints each phase as it starts, with the rank's clock.
    """
    import faulthandler
    import time

    watchdog = float(os.environ.get("QOPS_TP_WATCHDOG_S", "0"))
    if watchdog > 0:
        faulthandler.dump_traceback_later(watchdog, exit=True)
    t0 = time.monotonic()

    def trace(what: str) -> None:
        if os.environ.get("QOPS_TP_TRACE") == "1":
            print(f"[rank {rank} +{time.monotonic() - t0:.1f}s] {what}", file=sys.stderr, flush=True)

    return trace


def start_rank(backend: str, rank: int, world: int, port: int, timeout_s: int) -> torch.device:
    """Join a test's process group on loopback; the rank's device (one GPU per rank with NCCL).

    Call first in a spawned rank, before anything compiles.
    """
    import datetime

    import torch.distributed as dist

    if backend == "nccl":
        os.environ.update(NVLS_OFF)  # multicast can take the host's GPUs down (device docs)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # CI: every core already runs a rank
        device = torch.device("cpu")
        # One Inductor cache per rank: ranks compile the same graphs at the same moment, and a
        # shared cache directory is one more thing they race on.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"qops-inductor-rank{rank}"))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return device


def end_rank() -> None:
    """Leave a spawned rank whose checks all passed without running interpreter teardown.

    With gloo on CPU, about one run in four aborted at exit ("terminate called without an active
    exception") after every check had passed and the process group was destroyed: a native thread
    still alive at shutdown, not a failed check. Failures still raise before this is reached.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_rank(backend: str, error: BaseException | None) -> None:
    """Leave a spawned rank at the end of its checks: raise ``error`` (a failed check) to the
    spawning test, or exit without interpreter teardown (:func:`end_rank`).

    NCCL: ``destroy_process_group`` never returned on two H200s (torch 2.11, 0705a1e) after every
    check of a run had passed, its collectives having been captured in CUDA graphs; the spawning
    test then waited for the rank until its time limit. So an NCCL rank leaves without it: an error
    is printed to stderr and the rank exits with status 1 (the spawning test fails, naming the rank's
    exit code; the traceback is in the captured output).
    """
    import traceback

    import torch.distributed as dist

    if backend == "nccl":
        if error is not None:
            traceback.print_exception(error)
            sys.stderr.flush()
            os._exit(1)
        torch.cuda.synchronize()
        end_rank()
    dist.destroy_process_group()
    if error is not None:
        raise error
    end_rank()


def tp_worker(rank: int, world: int, root: str, port: int, backend: str, dtype: torch.dtype, modes: tuple[str, ...], names: tuple[str, ...], tolerances: dict[str, float]) -> None:
    """One rank of the tensor-parallel equivalence check (``torch.multiprocessing.spawn`` target).

    Loads every variant's TinyBlock sharded over the group and whole (world size 1) from the
    checkpoints under ``root``, runs the sharded model in each of ``modes``, and compares every
    output with the whole model's (column outputs with this rank's slice). Mismatches of all modes
    are collected and raised together at the end, so every rank runs the same collectives.
    """
    import torch.distributed as dist

    from .loader import Weights

    trace = rank_watchdog(rank)
    device = start_rank(backend, rank, world, port, int(os.environ.get("QOPS_TP_TIMEOUT_S", "180")))
    trace("process group up")
    try:
        if backend == "gloo":
            torch._inductor.config.compile_threads = 1  # CI: every core already runs a rank
        group = dist.group.WORLD
        sharded, whole = {}, {}
        for name in names:
            path = os.path.join(root, name)
            sharded[name] = TinyBlock(Weights.from_pretrained(path, device=device, dtype=dtype, process_group=group))
            whole[name] = TinyBlock(Weights.from_pretrained(path, device=device, dtype=dtype))
        model, reference = Blocks(sharded), Blocks(whole)
        trace(f"loaded {', '.join(names)}")
        failures: list[str] = []

        def check(mode: str, got: dict, ids: torch.Tensor) -> None:
            with torch.no_grad():
                want = reference(ids)
            for key, outs in want.items():
                name = key.replace("_", "-")
                tol = tolerances.get(name, tolerances["default"])
                for out, ref in outs.items():
                    if out in COLUMN_BLOCKS:
                        ref = rank_slice(ref, COLUMN_BLOCKS[out], rank, world)
                    g = got[key][out]
                    if g.shape != ref.shape:
                        failures.append(f"rank {rank} {mode} {name} {out}: shape {tuple(g.shape)} != {tuple(ref.shape)}")
                        continue
                    err = (g.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
                    if not err <= tol:
                        failures.append(f"rank {rank} {mode} {name} {out}: relative error {err:.3g} > {tol}")

        ids, ids2 = sample_ids(0, device), sample_ids(1, device)
        with torch.no_grad():
            if "eager" in modes:
                trace("eager")
                check("eager", model(ids), ids)
            compiled = None
            if "compiled" in modes or "compiled_cuda_graph" in modes:
                trace("compiled")
                compiled = torch.compile(model, fullgraph=True)
                check("compiled", compiled(ids), ids)
                with torch.compiler.set_stance("fail_on_recompile"):
                    check("compiled (second call)", compiled(ids2), ids2)
            for mode, fn in (("cuda_graph", model), ("compiled_cuda_graph", compiled)):
                if mode in modes:
                    trace(mode)
                    _check_cuda_graph(mode, fn, ids, ids2, check)
            if "reduce_overhead" in modes:
                trace("reduce_overhead")
                torch._inductor.config.triton.cudagraph_or_error = True
                ro = torch.compile(model, fullgraph=True, mode="reduce-overhead")
                for step, x in enumerate((ids, ids2, ids)):
                    torch.compiler.cudagraph_mark_step_begin()
                    out = ro(x)
                    # Copy out before the next replay overwrites the graph's outputs.
                    check(f"reduce_overhead (call {step})", {k: {o: t.clone() for o, t in v.items()} for k, v in out.items()}, x)
        trace(f"done, {len(failures)} mismatches")
        if failures:
            raise AssertionError(f"{len(failures)} mismatches:\n" + "\n".join(failures[:40]))
    except BaseException as e:
        close_rank(backend, e)
    close_rank(backend, None)


def _check_cuda_graph(mode, fn, ids, ids2, check) -> None:
    """Capture ``fn`` on static ids, replay on other ids, zero the outputs and replay again."""
    static = ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: NCCL communicators, kernels loaded and tuned before capture
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    static.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    check(f"{mode} (replay)", out, ids2)
    for v in out.values():
        for t in v.values():
            t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check(f"{mode} (replay after zeroing the outputs)", out, ids2)
