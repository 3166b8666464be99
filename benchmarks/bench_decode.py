"""End-to-end decode benchmark: a Llama-3-8B-shaped model, W4 g128 (GPTQ) against bf16, both
compiled with CUDA graphs, in one run (PERF.md target: >= 700 tok/s at batch 1 and >= 2.8x bf16).

Models (``qops.models.llama``, random weights, one GPU, no tensor parallelism):

- shape: hidden 4096, MLP 14336, 32 layers, 32 query heads / 8 KV heads of 128, vocab 128256,
  Llama 3 rotary scaling; embeddings, norms and ``lm_head`` in bf16 for both models;
- W4: every decoder linear a GPTQ v2 checkpoint (4 bits, group 128, asymmetric) built directly on
  the GPU from random integers (qweight and qzeros uniform, fp16 scales sized so that weights have
  std ~ 1/sqrt(K)) -- no 8B-float quantization on the CPU -- then loaded through ``qops.layers``
  (sharding, preparation, lowering choice and warm-up as for a real checkpoint);
- bf16: random ``N(0, 1/K)`` weights, ``FastLinear`` (cuBLAS);
- ``w4-qhead`` (timed in the same run where ``--models`` names it): w4 with ``lm_head`` a GPTQ
  4-bit g128 layer too, as in checkpoints that quantize the head; not the model the targets name;
- ``w4-flat``: w4 with every qweight put back in the flat form after preparation gave the native
  lowering column slabs (``qops.ops.int_weight.preferred_qweight_form``): the slabs' effect, same run;
- ``w4-fp16``: w4 run in fp16 (activations, embeddings, norms and ``lm_head`` fp16), the dtype GPTQ
  checkpoints store their scales in and the one many int4 stacks run them in; the comparison is still
  with the bf16 model.
- ``w4-layers``: w4 with ``use_layer_kernel()``: a batch-1 step runs every decoder layer as one
  ``qops::decode_layers`` op (one persistent kernel on the GPU; experimental), compiled per batch size.

Method: ``qops.models.compile_decode`` (``torch.compile(fullgraph=True)``, batch dimension
unbacked: one compilation per model). Per (model, batch): a random prompt of ``--prompt-len`` tokens
prefilled eagerly, then ``--steps`` greedy decode steps. ``--loop captured`` (default): the compiled
step, its argmax and the position update captured into one ``torch.cuda.graph`` per batch
(``qops.models.CapturedDecode``, what a serving loop replays), the replays timed with CUDA events.
``--loop reduce-overhead``: ``mode="reduce-overhead"`` (``torch.compiler.cudagraph_mark_step_begin()``
each step; argmax and position update eager), wall clock around the loop between two device
synchronizations; it adds the per-step host cost of guards and input copies. Median of
``--trials``; tokens/s = batch x steps / time. Every (model, batch) is prepared (prefilled, captured,
warmed) first; then (``--loop captured``) the trials run interleaved, one trial of each in turn, the
order rotated from one round to the next, so no model is measured earlier or later than another
(measured one after the other, the second model of a run was 1.1-1.6% faster whichever it was:
benchmarks/NOTES.md, stop 32).
Attention (``--attention``): ``fused`` (default, ``qops::decode_attention``) reads each row's cache
positions up to its own token only, split over several programs per KV head on caches longer than
512 positions (split-KV); ``sdpa`` / ``matmul`` attend over all ``--max-seq`` positions (static
shapes), masked past the token. ``--prompt-len 4000`` measures decode at a long context (the cache
is then ``--max-seq`` = prompt + steps + 8 positions).
Memory per model: weight bytes, the workspace (scratch) it preallocated and how many of its layers
run on it, the layer op's own workspace where it has one, its KV cache; per (model, batch) run the
peak allocated bytes (``torch.cuda.max_memory_allocated`` after a reset, with every model built so
far resident), what was allocated when it started, and the difference (what the run added). The 8B weights (~16 GB bf16, ~4.6 GB W4) are far larger than the 50 MB L2.

Writes ``$OUT/bench_decode.json`` (and ``--out``) after every measurement; prints one line per row,
then a TARGETS block last. ``--budget-s``: no new row starts after that many seconds (skipped rows
are listed).

    PYTHONPATH=. python benchmarks/bench_decode.py                     # H200: < 4 min
    PYTHONPATH=. python benchmarks/bench_decode.py --batches 1 --steps 32
    PYTHONPATH=. python benchmarks/bench_decode.py --dry-run --out /tmp/d.json   # CPU, tiny model

``--dry-run`` runs a tiny model on the CPU (float32, compiled without CUDA graphs, wall clock):
its numbers mean nothing; it checks the building, compiling, timing, JSON and TARGETS code.
Exit status: 0 (targets are reported, not enforced), 2 without a CUDA device (and no --dry-run).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time

import common  # the benchmarks' shared metadata and JSON writer (this script's folder is on sys.path)

GROUP = 128
# PERF.md "Targets for qops on the H200": Llama-3-8B-shaped model, W4 g128, compiled + CUDA graphs.
TARGET_TOK_S_B1 = 700.0
TARGET_SPEEDUP_B1 = 2.8
TARGET_SCRATCH = 64 << 20


# --models: the W4 and bf16 models the targets compare, and a variant timed in the same run.
MODEL_KINDS = {
    "w4": "every decoder linear GPTQ 4-bit g128; lm_head bf16 (the model the targets name)",
    "bf16": "every linear bf16 (cuBLAS)",
    "w4-qhead": "w4 with lm_head GPTQ 4-bit g128 too (checkpoints that quantize the head)",
    "w4-flat": "w4 with every qweight flat instead of in the column slabs prepared for the native lowering",
    "w4-fp16": "w4 run in fp16 activations (embeddings, norms, lm_head fp16 too)",
    "w4-layers": "w4 with batch-1 steps through qops::decode_layers (every layer in one persistent kernel)",
}
W4_KINDS = ("w4", "w4-qhead", "w4-flat", "w4-fp16", "w4-layers")


def model_dtype(kind: str, dtype):
    """The dtype a model kind runs in: ``dtype`` (bf16 on the GPU), fp16 for ``w4-fp16`` on the GPU."""
    import torch

    return torch.float16 if kind == "w4-fp16" and dtype == torch.bfloat16 else dtype


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU: checks the plumbing, numbers mean nothing")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; dry run 1,2,4)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per trial (default 64; dry run 4)")
    p.add_argument("--trials", type=int, default=None, help="trials per (model, batch), median reported (default 3; dry run 2)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens prefilled before decoding (default 16)")
    p.add_argument("--max-seq", type=int, default=None, help="KV cache positions per row (default prompt + steps + 8)")
    p.add_argument("--models", default="w4,bf16",
                   help="which models (default w4,bf16): " + "; ".join(f"{k}: {v}" for k, v in MODEL_KINDS.items()))
    p.add_argument("--loop", choices=("captured", "reduce-overhead"), default="captured",
                   help="captured (default): the step compiled fullgraph, captured with argmax and position update into one "
                        "torch.cuda.graph per batch (qops.models.CapturedDecode), replays timed with CUDA events; "
                        "reduce-overhead: torch.compile's mode='reduce-overhead' loop with eager argmax, wall clock "
                        "(the dry run always uses this one, without graphs)")
    p.add_argument("--attention", choices=("fused", "sdpa", "matmul"), default="fused", help="the model's attention (default fused)")
    p.add_argument("--budget-s", type=float, default=210.0, help="no new row starts after this many seconds (default 210)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.batch_list = [int(b) for b in (args.batches or ("1,2,4" if dry else "1,8,32")).split(",")]
    args.steps = args.steps or (4 if dry else 64)
    args.trials = args.trials or (2 if dry else 3)
    args.max_seq = args.max_seq or args.prompt_len + args.steps + 8
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    if not set(args.model_list) <= set(MODEL_KINDS):
        p.error(f"--models takes {', '.join(MODEL_KINDS)}; got {args.models!r}")
    return args


def model_config(dry: bool):
    from qops.models import LlamaConfig

    if dry:
        return LlamaConfig.tiny(num_hidden_layers=2, vocab_size=512)
    return LlamaConfig.llama3_8b()


def shared_tensors(config, device, dtype, seed):
    """Embeddings, norms and lm_head (dense in every model; w4-qhead replaces lm_head)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h = config.hidden_size

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    t = {"model.embed_tokens.weight": rnd(config.vocab_size, h, std=1.0), "lm_head.weight": rnd(config.vocab_size, h, std=h ** -0.5),
         "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    for i in range(config.num_hidden_layers):
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{n}.weight"] = torch.ones(h, device=device, dtype=dtype)
    return t


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """Checkpoint linear prefix -> (N, K)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size), "self_attn.v_proj": (kv, c.hidden_size),
           "self_attn.o_proj": (c.hidden_size, q), "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
           "mlp.up_proj": (c.intermediate_size, c.hidden_size), "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    return {f"model.layers.{i}.{name}": shape for i in range(c.num_hidden_layers) for name, shape in per.items()}


def random_gptq_checkpoint(config, device, seed, head: bool = False):
    """GPTQ v2 tensors (4 bits, group 128, asymmetric) of every decoder linear (and ``lm_head`` with
    ``head``), from random integers."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed + 1)
    t = {}
    shapes = linear_shapes(config)
    if head:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    for prefix, (n, k) in shapes.items():
        groups = -(-k // GROUP)
        t[f"{prefix}.qweight"] = torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int32, device=device, generator=g)
        t[f"{prefix}.qzeros"] = torch.randint(-2**31, 2**31, (groups, n // 8), dtype=torch.int32, device=device, generator=g)
        # q - z, both uniform on 0..15, has std sqrt(2 * (16**2 - 1) / 12) ~ 6.5.
        scale = 1.0 / (6.5 * math.sqrt(k))
        t[f"{prefix}.scales"] = (scale * (1 + 0.1 * torch.randn(groups, n, generator=g, device=device))).to(torch.float16)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"}
    return t, qc


def random_dense_linears(config, device, dtype, seed):
    import torch

    g = torch.Generator(device=device).manual_seed(seed + 2)
    return {f"{prefix}.weight": (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)
            for prefix, (n, k) in linear_shapes(config).items()}


def layers_on(model, workspace) -> int:
    """How many of ``model``'s quantized layers run their ``_out`` ops on ``workspace``."""
    return sum(1 for m in model.modules() if m is not model and getattr(m, "workspace", None) is workspace)


def layer_op_scratch_bytes(model) -> int:
    """Bytes of the layer op's own workspace (``qops::decode_layers``), 0 for a model without one."""
    ws = getattr(model, "layer_workspace", None)
    return 0 if ws is None else ws.numel() * ws.element_size()


def build(kind, config, device, dtype, args, attention="fused"):
    from qops.models import LlamaForCausalLM

    shared = shared_tensors(config, device, dtype, args.seed)
    if kind in W4_KINDS:
        linears, qc = random_gptq_checkpoint(config, device, args.seed, head=kind == "w4-qhead")
        if kind == "w4-qhead":
            del shared["lm_head.weight"]  # the loader then reads lm_head as the GPTQ layer it now is
    else:
        linears, qc = random_dense_linears(config, device, dtype, args.seed), None
    model = LlamaForCausalLM.from_tensors(config, {**shared, **linears}, qc, device=device, dtype=dtype, max_batch=max(args.batch_list),
                                          max_seq=args.max_seq, process_group=None, attention=attention)
    if kind == "w4-flat":
        _flatten_qweights(model)
    if kind == "w4-layers":
        model.use_layer_kernel()
    del shared, linears
    gc.collect()
    return model


def _flatten_qweights(model) -> None:
    """Every integer layer's qweight back to the flat form (the same kernels read it: a flag, not a build)."""
    from qops.layers.int_weight import IntWeightLinear
    from qops.ops.int_weight import flat_qweight

    for layer in model.modules():
        if isinstance(layer, IntWeightLinear) and layer.qweight.dim() == 3:
            layer.qweight = flat_qweight(layer.qweight).contiguous()


def time_captured(cap, tokens, positions, steps: int, trials: int) -> list[float]:
    """Milliseconds per step of ``steps`` chained replays of a ``CapturedDecode``, one per trial
    (CUDA events around the replays; each trial restarts from ``tokens`` / ``positions``)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(trials):
        cap.start(tokens, positions)
        a.record()
        for _ in range(steps):
            cap.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / steps)
    return out


def interleaved_trials(runners: dict, trials: int) -> dict:
    """``trials`` timings of each runner (key -> zero-argument callable returning seconds), run one of
    each per round with the order rotated every round (round r starts at runner r mod n): a drift of the
    machine over the run (clocks, temperature) reaches every runner alike instead of the later ones."""
    keys = list(runners)
    out = {k: [] for k in keys}
    for r in range(trials):
        for i in range(len(keys)):
            k = keys[(r + i) % len(keys)]
            out[k].append(runners[k]())
    return out


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run(args) -> int:
    import torch

    t_start = time.time()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("bench_decode: no CUDA device; use --dry-run to check the plumbing on CPU", file=sys.stderr)
        return 2
    common.add_repo_to_path()
    import qops  # noqa: F401
    from qops.models import CapturedDecode, compile_decode, generate

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    cuda_graphs = not dry
    captured = args.loop == "captured" and not dry
    config = model_config(dry)
    triton_ver = common.triton_version()
    commit = common.git_commit()
    res = {
        "bench": "decode",
        "gpu": common.device_name(not dry),
        "torch": torch.__version__, "triton": triton_ver, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "qops_commit": commit, "qops_dirty": common.git_dirty("qops"),
        "dry_run": dry,
        "config": config.to_dict(),
        **common.run_stamp(args, batches=args.batch_list, models=args.model_list),
        "method": {
            "compile": "qops.models.compile_decode: torch.compile(model.decode, fullgraph=True"
                       + (", mode='reduce-overhead')" if cuda_graphs and not captured else ")") + ", batch dimension unbacked",
            "timing": ("qops.models.CapturedDecode: step + argmax + position update in one CUDA graph per batch, replays "
                       "between CUDA events, median of trials") if captured else
                      ("wall clock around the decode loop between device synchronizations, median of trials; "
                       "argmax and position update eager each step"),
            "tokens_per_s": "batch * steps / median time",
            "attention": (f"{args.attention}: positions up to each row's token of max_seq={args.max_seq} (split-KV past 512)"
                          if args.attention == "fused" else
                          f"{args.attention}: every step attends over max_seq={args.max_seq} cache positions (masked)"),
            "w4": "GPTQ v2 4-bit g128 asymmetric from random integers, loaded through qops.layers",
            "bf16": "random N(0, 1/K) weights, FastLinear",
        },
        "models": {}, "rows": [], "skipped": [],
    }
    out_paths = common.output_paths("bench_decode.json", args.out)
    print(f"bench_decode: {res['gpu']} | torch {res['torch']} | triton {triton_ver} | commit {commit} | "
          f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}", flush=True)

    models, steps_fn = {}, {}
    for kind in args.model_list:
        label = kind if kind != "bf16" or not dry else "dense"
        t = time.time()
        kind_dtype = model_dtype(kind, dtype)
        model = build(kind, config, device, kind_dtype, args, attention=args.attention)
        sync(device)
        info = {"kind": kind, "dtype": str(kind_dtype).replace("torch.", ""), "build_s": round(time.time() - t, 2),
                "weights_bytes": model.weight_bytes(), "scratch_bytes": model.workspace.nbytes,
                "scratch_needs_max": max(model.workspace.needs.values(), default=0),
                "layers_on_scratch": layers_on(model, model.workspace),
                "layer_op_scratch_bytes": layer_op_scratch_bytes(model),
                "kv_cache_bytes": model.cache_bytes(), "lowerings": model.lowerings(), "describe": MODEL_KINDS[kind]}
        if device.type == "cuda":
            info["allocated_after_build_bytes"] = torch.cuda.memory_allocated()
        res["models"][label] = info
        models[label] = model
        # w4-layers: a static batch, so that batch 1 takes the layer op (an unbacked batch never does).
        steps_fn[label] = compile_decode(model, cuda_graphs=cuda_graphs and not captured, greedy=captured,
                                         dynamic_batch=kind != "w4-layers")
        print(f"built {label}: {info['build_s']} s, weights {info['weights_bytes'] / 2**30:.2f} GiB, scratch "
              f"{info['scratch_bytes'] / 2**20:.2f} MiB, lowerings {info['lowerings']}", flush=True)
        common.write_json(res, out_paths)

    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        # Prepare every (model, batch) first: prefill, capture (or record the reduce-overhead graph), warm.
        prepared = {}  # (label, batch) -> (one timed trial in seconds, its final tokens, warm-up seconds)
        for label, model in models.items():
            step = steps_fn[label]
            for b in args.batch_list:
                if time.time() - t_start > args.budget_s:
                    res["skipped"].append({"model": label, "batch": b, "why": f"budget of {args.budget_s} s spent"})
                    print(f"skipped {label} batch {b}: budget spent", flush=True)
                    continue
                prompts = torch.randint(0, config.vocab_size, (b, args.prompt_len), generator=gen).to(device)
                t = time.time()
                if captured:
                    first = model.prefill(prompts).argmax(-1)
                    cap = CapturedDecode(model, step, b, start_position=args.prompt_len)  # compiles on the first batch
                    start = (first, torch.full((b,), args.prompt_len, dtype=torch.long, device=device))

                    def trial(cap=cap, start=start):
                        return time_captured(cap, *start, args.steps, 1)[0] * args.steps / 1e3

                    def final(cap=cap):
                        return cap.tokens.clone()
                else:
                    generate(model, prompts, 4, step=step, cuda_graphs=cuda_graphs)  # compile (first batch) + record this batch's graph
                    last = {}

                    def trial(model=model, step=step, prompts=prompts, last=last):
                        g = generate(model, prompts, args.steps + 1, step=step, cuda_graphs=cuda_graphs)
                        last["tokens"] = g.tokens[:, -1]
                        return g.decode_s

                    def final(last=last):
                        return last["tokens"]
                sync(device)
                prepared[(label, b)] = (trial, final, time.time() - t)

        # The trials, interleaved; each runner's peak memory from its first trial (after a reset), and
        # what was allocated when it started (every model built so far is resident): the difference is
        # what that run itself added (activations, its graph's pool).
        peaks = {}

        def with_peak(key, trial):
            def run_one():
                first = key not in peaks
                if first and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    resident = torch.cuda.memory_allocated()
                t = trial()
                if first:
                    peaks[key] = (torch.cuda.max_memory_allocated(), resident) if device.type == "cuda" else None
                return t
            return run_one

        runners = {key: with_peak(key, p[0]) for key, p in prepared.items()}
        if captured:
            times_of = interleaved_trials(runners, args.trials)
        else:  # torch.compile's graph trees re-record when other models' graphs run in between: one at a time
            times_of = {key: interleaved_trials({key: run}, args.trials)[key] for key, run in runners.items()}
        for (label, b), (_, final, warm_s) in prepared.items():
            model, times = models[label], times_of[(label, b)]
            last = final()
            med = statistics.median(times)
            row = {"model": label, "batch": b, "loop": args.loop, "steps": args.steps, "tokens_per_s": b * args.steps / med,
                   "step_ms": 1e3 * med / args.steps, "trials_s": times, "warmup_s": round(warm_s, 2),
                   "finite": bool(torch.isfinite(model.decode(last, torch.full((b,), args.prompt_len, device=device))).all())}
            if peaks.get((label, b)) is not None:
                row["peak_bytes"], row["resident_at_start_bytes"] = peaks[(label, b)]
                row["peak_over_resident_bytes"] = row["peak_bytes"] - row["resident_at_start_bytes"]
            res["rows"].append(row)
            print(f"{label:8s} batch {b:3d}: {row['tokens_per_s']:10.1f} tok/s  {row['step_ms']:7.3f} ms/step  "
                  f"(warm-up {warm_s:.1f} s)", flush=True)
            common.write_json(res, out_paths)
        prepared.clear()
    res["targets"] = targets(res, dry)
    res["elapsed_s"] = round(time.time() - t_start, 1)
    common.write_json(res, out_paths)
    print(render_targets(res, dry), flush=True)
    return 0


def _row(res, label, b):
    return next((r for r in res["rows"] if r["model"] == label and r["batch"] == b), None)


def _batch1_targets(prefix: str, w1, d1) -> dict:
    """The two batch-1 targets (tokens/s, and the ratio over the bf16 model's row ``d1``) of the W4 row ``w1``."""
    sp = w1["tokens_per_s"] / d1["tokens_per_s"] if w1 and d1 else None
    return {f"{prefix}_batch1_tok_s": {"value": w1 and w1["tokens_per_s"], "target": f">= {TARGET_TOK_S_B1}",
                                       "ok": None if w1 is None else w1["tokens_per_s"] >= TARGET_TOK_S_B1},
            f"{prefix}_over_bf16_batch1": {"value": sp, "target": f">= {TARGET_SPEEDUP_B1}", "ok": None if sp is None else sp >= TARGET_SPEEDUP_B1}}


def targets(res, dry) -> dict:
    base = "dense" if dry else "bf16"
    d1 = _row(res, base, 1)
    out = _batch1_targets("w4", _row(res, "w4", 1), d1)
    bmax = max(res["args"]["batches"])
    if bmax > 1:  # the large-batch target (issue #7: batch 32 faster than bf16); at bmax 1 it would overwrite batch 1's
        wm, dm = _row(res, "w4", bmax), _row(res, base, bmax)
        spm = wm["tokens_per_s"] / dm["tokens_per_s"] if wm and dm else None
        out[f"w4_over_bf16_batch{bmax}"] = {"value": spm, "target": "> 1", "ok": None if spm is None else spm > 1}
    f1 = _row(res, "w4-fp16", 1)
    if f1 is not None:  # the same targets for the W4 model run in fp16 (a variant the targets do not name)
        out |= _batch1_targets("w4_fp16", f1, d1)
    scratch = res["models"].get("w4", {}).get("scratch_bytes")
    out["w4_scratch_bytes"] = {"value": scratch, "target": f"<= {TARGET_SCRATCH}", "ok": None if scratch is None else scratch <= TARGET_SCRATCH}
    return out


def render_targets(res, dry) -> str:
    lines = ["", "TARGETS (PERF.md and issue #7, Llama-3-8B-shaped model, compiled + CUDA graphs)" + (" -- DRY RUN: tiny model on CPU, meaningless" if dry else "")]
    for name, t in res["targets"].items():
        v = t["value"]
        shown = "n/a" if v is None else (f"{v / 2**20:.2f} MiB" if "bytes" in name else f"{v:.2f}")
        verdict = "NOT MEASURED" if t["ok"] is None else ("PASS" if t["ok"] else "FAIL")
        lines.append(f"  {name:24s} {shown:>14s}  target {t['target']:>14s}  {verdict}")
    if res["skipped"]:
        skipped = ", ".join(f"{s['model']} batch {s['batch']}" for s in res["skipped"])
        lines.append(f"  skipped: {skipped}")
    if res["models"].get("w4"):
        lines.append("  note: the scratch is the workspace the model preallocates and its quantized layers pass to the _out ops")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
