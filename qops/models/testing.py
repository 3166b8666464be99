"""Test support for the models: an independent float64 reference, which lowerings serve each
scheme, and the tensor-parallel worker (``torch.multiprocessing.spawn`` target) shared by the CPU
(gloo) and GPU (NCCL) tests.

Test ids name the scheme and the lowering its quantized layers run on (``gptq-reference_int_weight``),
so ``scripts/guarantee_matrix.py`` can read a (format, lowering) cell off them.
"""
from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.nn.functional as F

from ..formats import FORMATS
from ..formats.integer import act_order_g_idx
from ..lowerings import LOWERINGS
from ..layers import QuantLinear
from .checkpoint import QUANT_SCHEMES, QuantScheme, get_scheme, quantize_tensors
from .llama import LlamaConfig, LlamaForCausalLM, inv_freq, random_tensors

from ..layers.testing import NVLS_OFF, close_rank, free_port, rank_watchdog, start_rank  # noqa: F401  (re-exported for the tests)


def _gptq_act_order(w):
    # Layers reading the same input share one act-order permutation (GPTQ derives it from the
    # input's Hessian), which fused q/k/v and gate/up need: seed it with K.
    k = w.shape[1]
    g_idx = act_order_g_idx(k, 128, torch.Generator().manual_seed(k))
    c = FORMATS["gptq"].quantize(w, bits=4, group_size=128, sym=False, g_idx=g_idx, version="v2")
    return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales, "g_idx": c.g_idx}


def _fp8_tensor_static(w):
    c = FORMATS["fp8"].quantize(w, granularity="tensor", input_scale=0.02)
    return {"weight": c.weight, "weight_scale": c.weight_scale, "input_scale": c.input_scale}


# Checkpoint layouts the tests use beyond QUANT_SCHEMES (one scheme per format there), under their
# own names: GPTQ act-order is how most large GPTQ releases (Llama-3-70B among them) are written,
# and its row-parallel shards go through ``qops.layers.act_order``.
TEST_SCHEMES: dict[str, QuantScheme] = {
    "gptq-act-order": QuantScheme("gptq", "GPTQ int4, group 128, act-order (desc_act), asymmetric (v2 zeros)", {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"},
        _gptq_act_order, 128, ("int4", "act-order")),
    "fp8-tensor-static": QuantScheme("fp8", "FP8 e4m3 weights, per-tensor scales, static per-tensor activation scales", {
        "quant_method": "fp8", "activation_scheme": "static"}, _fp8_tensor_static, 1, ("fp8",)),
}


def scheme_by_name(name: str) -> QuantScheme | None:
    """A QUANT_SCHEMES or TEST_SCHEMES scheme by name; None for "none"."""
    return TEST_SCHEMES[name] if name in TEST_SCHEMES else get_scheme(name)


def family_lowerings(scheme: str) -> list:
    """The lowerings of the scheme's op family that list its format, highest priority first."""
    name = scheme_by_name(scheme).name
    fmt = FORMATS[name]
    return sorted((low for low in LOWERINGS if low.family == fmt.family and name in low.formats), key=lambda l: -l.priority)


def scheme_lowerings(device_type: str) -> list[tuple[str, str]]:
    """(scheme, lowering) pairs whose lowering runs on ``device_type`` ("cpu" or "cuda")."""
    return [(s, low.name) for s in QUANT_SCHEMES for low in family_lowerings(s) if device_type in low.device_types]


@contextlib.contextmanager
def forced_lowering(scheme: str, lowering: str):
    """Within the block, preparing ``scheme``'s weights picks ``lowering`` where it serves them:
    every lowering of the family with a higher priority is disabled (``QOPS_DISABLE_LOWERINGS``)."""
    from ..lowerings import DISABLE_ENV, LOWERINGS_BY_NAME

    target = LOWERINGS_BY_NAME[lowering]
    above = [low.name for low in family_lowerings(scheme) if low.priority > target.priority]
    old = os.environ.get(DISABLE_ENV)
    names = [n for n in (old or "").split(",") if n.strip()] + above
    os.environ[DISABLE_ENV] = ",".join(names)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = old


def reference_logits(tensors: dict[str, torch.Tensor], config: LlamaConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, T, V)`` of a dense checkpoint on ``tokens`` ``(B, T)`` at positions 0..T-1, in
    float64, written out from the Llama definition (repeated KV heads, full causal attention)."""
    c = config
    t = {k: v.double() for k, v in tensors.items()}
    b, n = tokens.shape
    h, d, hk = c.num_attention_heads, c.head_dim, c.num_key_value_heads

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rot(x, cos, sin):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq(c)[None]
    cos, sin = torch.cat((ang, ang), -1).cos()[None, :, None], torch.cat((ang, ang), -1).sin()[None, :, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        y = rms(x, t[f"{p}.input_layernorm.weight"])

        def proj(name, heads):
            out = y @ t[f"{p}.self_attn.{name}.weight"].T
            if f"{p}.self_attn.{name}.bias" in t:
                out = out + t[f"{p}.self_attn.{name}.bias"]
            return out.view(b, n, heads, d)

        q, k, v = rot(proj("q_proj", h), cos, sin), rot(proj("k_proj", hk), cos, sin), proj("v_proj", hk)
        k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, n, h * d)
        x = x + o @ t[f"{p}.self_attn.o_proj.weight"].T
        y = rms(x, t[f"{p}.post_attention_layernorm.weight"])
        gate, up = y @ t[f"{p}.mlp.gate_proj.weight"].T, y @ t[f"{p}.mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ t[f"{p}.mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms(x, t["model.norm.weight"]) @ head.T


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ``||got - want|| / ||want||`` in float64."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def tp_model_worker(rank: int, world: int, port: int, backend: str, dtype: torch.dtype, schemes: tuple, modes: tuple[str, ...],
                    tolerance: float | dict[str, float], config: LlamaConfig | None = None, report: str | None = None) -> None:
    """One rank: the model of each scheme (``config``, default ``LlamaConfig.tiny()``; a scheme is a
    QUANT_SCHEMES or TEST_SCHEMES name, or "none") sharded over ``world`` ranks against the whole
    model (world size 1, same process), on decode steps at batch sizes 1, 3 and 4.

    An item of ``schemes`` is a name (the chooser picks its lowering) or a (scheme, lowering) pair
    (that lowering forced; "dense" for "none"), so one spawn can run one scheme through several
    lowerings. ``tolerance``: one bound, or one per item id (the name, or "scheme-lowering" for a pair).

    Modes: "eager"; "compiled" (``fullgraph=True``, one compilation for all batch sizes, then
    ``fail_on_recompile``); "reduce_overhead" (CUDA graphs through cudagraph trees, a skipped
    capture is an error; :data:`TP_STEPS` steps at each of :data:`TP_BATCHES`, and a visit that
    replays no recorded graph is a failure). Mismatches, and errors while an item loads or compiles, are collected and
    raised together at the end so that every rank runs the same collectives; with ``report`` (a
    path) the rank writes ``<report>.<rank>`` as JSON instead of raising: item id -> {"failures":
    [...], "refused": the chooser's reason where the forced lowering does not serve the sharded
    layers (not compared; without ``report`` that is a failure)}.
    """
    trace = rank_watchdog(rank)
    device = start_rank(backend, rank, world, port, 300)
    trace("process group up")
    results: dict[str, dict] = {}
    try:
        torch._inductor.config.compile_threads = 1
        config = config or LlamaConfig.tiny()
        for item in schemes:
            scheme, lowering = item if isinstance(item, tuple) else (item, None)
            item_id = f"{scheme}-{lowering}" if isinstance(item, tuple) else item
            lowering = None if scheme == "none" else lowering
            tol = tolerance[item_id] if isinstance(tolerance, dict) else tolerance
            res = results[item_id] = {"failures": [], "refused": None}
            trace(f"scheme {item_id}")
            try:
                res["refused"] = _tp_item(rank, scheme, lowering, modes, config, device, dtype, tol, res["failures"], trace)
            except Exception as e:  # noqa: BLE001 - reported with the item; the next item still runs
                res["failures"].append(f"{item_id}: {type(e).__name__}: {str(e)[:300]}")
        if report is not None:
            with open(f"{report}.{rank}", "w") as fh:
                json.dump(results, fh)
        else:
            flat = [f for r in results.values() for f in r["failures"] + ([r["refused"]] if r["refused"] else [])]
            if flat:
                raise AssertionError(f"rank {rank}: {len(flat)} mismatches:\n" + "\n".join(flat[:40]))
    except BaseException as e:
        close_rank(backend, e)
    close_rank(backend, None)


HEAD_SUFFIX = "+head"


def _tp_item(rank, scheme, lowering, modes, config, device, dtype, tolerance, failures, trace) -> str | None:
    """One scheme (with ``lowering`` forced, or the chooser's): sharded and whole models, each mode
    compared. Returns the chooser's reason, without comparing, where the forced lowering does not
    serve every sharded layer."""
    import torch.distributed as dist

    # "<scheme>+head": lm_head quantized too (the vocabulary-parallel head then shards a quantized layer).
    base, head = (scheme[:-len(HEAD_SUFFIX)], True) if scheme.endswith(HEAD_SUFFIX) else (scheme, False)
    ctx = forced_lowering(base, lowering) if lowering else contextlib.nullcontext()
    sch = scheme_by_name(base)
    tensors = quantize_tensors(random_tensors(config, seed=3), config.linear_prefixes(head=head), sch)
    qc = None if sch is None else sch.config
    with ctx:
        sharded = LlamaForCausalLM.from_tensors(config, tensors, qc, device=device, dtype=dtype, max_batch=4, max_seq=16,
                                                process_group=dist.group.WORLD)
        whole = LlamaForCausalLM.from_tensors(config, tensors, qc, device=device, dtype=dtype, max_batch=4, max_seq=16,
                                              process_group=None)
    if lowering:
        chosen = {m.choice.lowering.name for m in sharded.quantized_linears()}
        if chosen != {lowering}:
            why = next(m.choice.explain() for m in sharded.quantized_linears() if m.choice.lowering.name != lowering)
            return f"{scheme}: layers prepared for {sorted(chosen)}, not {lowering}: {why}"
    if head and not (isinstance(sharded.lm_head.linear, QuantLinear) and sharded.lm_head.should_gather):
        failures.append(f"{scheme}: lm_head is {type(sharded.lm_head.linear).__name__}, gathered: {sharded.lm_head.should_gather}")
    trace(f"{scheme} loaded")
    for mode in modes:
        _tp_compare(rank, scheme, mode, sharded, whole, device, tolerance, failures)
        trace(f"{scheme} {mode} compared")
    return None


# Batch sizes visited and decode steps per visit, by mode. cudagraph trees key a graph on the
# unbacked batch size (a SymInt input) and, for each new key, run the first call eagerly (warm-up),
# record on the second and replay from the third (torch/_inductor/cudagraph_trees.py,
# CUDAGraphTreeManager._run: a function not in ``warmed_up_functions`` runs eagerly, then
# ``record_function``, then ``execute_node`` -> ``CUDAGraphNode.run_graph``). So reduce-overhead
# takes three steps per batch size, each with new tokens and positions, and visits batch size 3
# again: a replay on new data for every key, and a key replayed after the others were recorded.
# A compiled step takes two steps per batch size, so the second reads the cache entry the first
# wrote through the compiled graph (one step read only the eager prefill's: a compiled step that
# lost its cache writes passed).
TP_BATCHES = {"reduce_overhead": (1, 3, 4, 3)}
TP_STEPS = {"reduce_overhead": 3, "compiled": 2}


def _tp_compare(rank, scheme, mode, sharded, whole, device, tolerance, failures) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    step = sharded.decode
    replays = [0]
    restore = None
    if mode == "compiled":
        step = torch.compile(sharded.decode, fullgraph=True)
    elif mode == "reduce_overhead":
        from torch._inductor import cudagraph_trees

        torch._inductor.config.triton.cudagraph_or_error = True
        step = torch.compile(sharded.decode, fullgraph=True, mode="reduce-overhead")
        run_graph = restore = cudagraph_trees.CUDAGraphNode.run_graph

        def counted(node):
            replays[0] += 1
            return run_graph(node)

        cudagraph_trees.CUDAGraphNode.run_graph = counted
        counters["inductor"]["cudagraph_skips"] = 0
    gen = torch.Generator().manual_seed(7)
    try:
        _tp_steps(scheme, mode, step, sharded, whole, device, tolerance, failures, gen, replays)
    finally:
        if restore is not None:
            cudagraph_trees.CUDAGraphNode.run_graph = restore
    if mode == "reduce_overhead" and counters["inductor"]["cudagraph_skips"]:
        failures.append(f"{scheme} {mode}: {counters['inductor']['cudagraph_skips']} skipped cudagraph captures")


def _tp_steps(scheme, mode, step, sharded, whole, device, tolerance, failures, gen, replays) -> None:
    steps = TP_STEPS.get(mode, 1)
    with torch.no_grad():
        for i, b in enumerate(TP_BATCHES.get(mode, (1, 3, 4))):
            prompts = torch.randint(0, sharded.config.vocab_size, (b, 3), generator=gen).to(device)
            want_first, got_first = whole.prefill(prompts), sharded.prefill(prompts)
            tok = want_first.argmax(-1)
            replayed = replays[0]
            for s in range(steps):
                pos = torch.full((b,), 3 + s, dtype=torch.long, device=device)
                want = whole.decode(tok, pos)
                tok_c, pos_c = tok.clone(), pos.clone()
                if mode != "eager":
                    torch._dynamo.decorators.mark_unbacked(tok_c, 0)
                    torch._dynamo.decorators.mark_unbacked(pos_c, 0)
                if mode == "reduce_overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                stance = torch.compiler.set_stance("fail_on_recompile") if (mode != "eager" and (i or s)) else contextlib.nullcontext()
                try:
                    with stance:
                        got = step(tok_c, pos_c).clone()
                except Exception as e:  # noqa: BLE001 - reported with the others
                    failures.append(f"{scheme} {mode} batch {b} step {s}: {type(e).__name__}: {str(e)[:300]}")
                    break
                checks = (("decode", got, want),) if s else (("prefill", got_first, want_first), ("decode", got, want))
                for what, g, w in checks:
                    err = relative_error(g, w)
                    if not err <= tolerance:
                        failures.append(f"{scheme} {mode} batch {b} step {s} {what}: relative error {err:.3g} > {tolerance}")
                tok = want.argmax(-1)
            else:
                if mode == "reduce_overhead" and replays[0] == replayed:
                    failures.append(f"{scheme} {mode} batch {b} (visit {i}): {steps} steps replayed no CUDA graph")
