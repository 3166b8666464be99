"""``python -m qops demo``: quantize a small Llama-style model, compile it, generate, and report.

Steps: build the model (random weights, or a Hugging Face checkpoint directory), quantize its
linear layers with qops' reference quantizer for ``--format``, load the quantized and the
unquantized model through the layer loader, compile the decode step (``fullgraph=True``; CUDA
graphs through ``mode="reduce-overhead"`` on a GPU), generate greedily, and print decode tokens/s
and the logit error (relative Frobenius) of the quantized model against the unquantized one on
the same tokens. Progress goes to stderr, results to stdout.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .models.checkpoint import DEFAULT_SCHEME, QUANT_SCHEMES

    formats = ", ".join(f"{name} ({s.describe})" for name, s in QUANT_SCHEMES.items())
    p.add_argument("--format", default=DEFAULT_SCHEME, choices=list(QUANT_SCHEMES), metavar="NAME",
                   help=f"quantization scheme of the linear layers (default: {DEFAULT_SCHEME}): {formats}")
    p.add_argument("--quantize-head", action="store_true",
                   help="quantize lm_head to --format as well (by default it stays in --dtype, as in most checkpoints; "
                        "the vocabulary must then be a multiple of the format's tile, 128 for the int4 formats)")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="a Hugging Face Llama-style checkpoint directory (config.json + *.safetensors) instead of random "
                        "weights; an unquantized one is quantized to --format, a quantized one is loaded as it is "
                        "(--format is then ignored and no logit error is reported)")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (cuda when a GPU is present, else cpu), cpu, cuda, cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="activation dtype (default: auto = float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--batch", type=int, default=4, help="prompts decoded together (default: 4)")
    p.add_argument("--prompt-len", type=int, default=8, help="tokens per random prompt (default: 8)")
    p.add_argument("--tokens", type=int, default=32, help="new tokens generated per prompt (default: 32)")
    p.add_argument("--no-compile", action="store_true",
                   help="run the decode step eagerly instead of torch.compile(fullgraph=True) (+ CUDA graphs on a GPU)")
    p.add_argument("--layers", type=int, default=4, help="random model: decoder layers (default: 4)")
    p.add_argument("--hidden", type=int, default=256,
                   help="random model: hidden size, a multiple of 128; heads of 64, a quarter of them KV heads (at least 2; "
                        "fewer where k/v must be a multiple of the format's block), MLP width 3 x hidden (default: 256)")
    p.add_argument("--vocab", type=int, default=2048, help="random model: vocabulary size (default: 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default: 0)")


class Progress:
    """One line per step on stderr, rewritten in place (on a terminal) as a count advances."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # read at each run: a caller may have replaced sys.stderr since import
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.label = ""

    def start(self, label: str) -> None:
        self.label, self.t0 = label, time.perf_counter()
        self.stream.write(f"{label} ...\n" if not self.tty else f"{label} ...")
        self.stream.flush()

    def count(self, done: int, total: int) -> None:
        if self.tty:
            self.stream.write(f"\r{self.label} ... {done}/{total}")
            self.stream.flush()

    def done(self, note: str = "") -> float:
        dt = time.perf_counter() - self.t0
        end = f" {note}" if note else ""
        self.stream.write((f"\r{self.label} ... done in {dt:.1f} s{end}\n") if self.tty else f"  done in {dt:.1f} s{end}\n")
        self.stream.flush()
        return dt


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Only what the demo runs on: torch.device also takes "meta", "xpu", ..., which fail deep in the run.
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise SystemExit(f"qops demo: --device must be auto, cpu, cuda or cuda:N, got {name!r}")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("qops demo: --device cuda asked, but this machine has no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SystemExit(f"qops demo: --device {name} asked, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _check_checkpoint_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise SystemExit(f"qops demo: --checkpoint {path}: no such directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"qops demo: --checkpoint {path}: no config.json there (expected a Hugging Face checkpoint directory)")


def _mb(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def random_config(hidden: int, layers: int, vocab: int, multiple: int = 1):
    """Heads of 64, a quarter of them KV heads (at least 2), fewer where k_proj / v_proj would not be
    ``multiple`` columns wide (a quantization format's block: fp8-block's 128x128 scales cannot be
    fused across a q/k/v boundary inside a block)."""
    from .models import LlamaConfig

    if hidden % 128 or hidden <= 0:
        raise SystemExit(f"qops demo: --hidden must be a positive multiple of 128 (groups and blocks of 128), got {hidden}")
    heads = hidden // 64
    kv = max(2, heads // 4)
    while kv and (heads % kv or kv * 64 % multiple):
        kv -= 1
    if not kv:
        raise SystemExit(f"qops demo: --hidden {hidden} gives {heads} heads of 64, and no KV head count dividing them gives k/v "
                         f"projections a multiple of {multiple} columns wide")
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=64)


def _checkpoint_tensors(path: str, progress: Progress) -> dict[str, torch.Tensor]:
    from .layers import Weights

    w = Weights.from_pretrained(path, dtype=torch.float32)
    names = sorted(w.entries)
    out = {}
    for i, name in enumerate(names):
        out[name] = w.get_tensor(name)
        progress.count(i + 1, len(names))
    return out


def run(args: argparse.Namespace) -> int:
    from .__main__ import _versions
    from .models import LlamaConfig, LlamaForCausalLM, compile_decode, generate, get_scheme, quantize_tensors, random_tensors
    from .models.checkpoint import TensorWeights
    from .models.llama import is_quantized_checkpoint
    from .models.testing import relative_error

    for name in ("batch", "prompt_len", "tokens", "layers", "vocab"):
        if getattr(args, name) < 1:
            raise SystemExit(f"qops demo: --{name.replace('_', '-')} must be at least 1")
    if args.checkpoint is not None:
        _check_checkpoint_dir(args.checkpoint)
    device = _device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    scheme = get_scheme(args.format)
    prog = Progress()
    gen = torch.Generator().manual_seed(args.seed)
    max_seq = args.prompt_len + args.tokens
    kw = dict(device=device, dtype=dtype, max_batch=args.batch, max_seq=max_seq, process_group=None)
    print(f"qops demo | {_versions()} | device {device}, {str(dtype).replace('torch.', '')}")

    quantized_ckpt = args.checkpoint is not None and is_quantized_checkpoint(args.checkpoint)
    if args.checkpoint is None:
        config = random_config(args.hidden, args.layers, args.vocab, scheme.multiple)
        prog.start(f"random weights: {config.num_hidden_layers} layers, hidden {config.hidden_size}")
        dense = random_tensors(config, seed=args.seed)
        prog.done()
        origin = "random weights"
    else:
        config = LlamaConfig.from_pretrained(args.checkpoint)
        origin = f"checkpoint {args.checkpoint}"
        dense = None
        if not quantized_ckpt:
            prog.start(f"reading {args.checkpoint}")
            dense = _checkpoint_tensors(args.checkpoint, prog)
            prog.done()
    params = sum(t.numel() for t in dense.values()) if dense is not None else None
    c = config
    print(f"model: Llama-style decoder from {origin}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"{c.num_attention_heads} heads ({c.num_key_value_heads} KV) of {c.head_dim}, MLP {c.intermediate_size}, "
          f"vocab {c.vocab_size}" + (f", {params / 1e6:.1f}M parameters" if params else ""))

    if quantized_ckpt:
        print(f"format: as stored in the checkpoint ({args.checkpoint}); --format ignored")
        prog.start("loading the quantized checkpoint")
        model = LlamaForCausalLM.from_pretrained(args.checkpoint, progress=prog.count, **kw)
        prog.done()
        reference = None
    else:
        if args.quantize_head and config.vocab_size % scheme.multiple:
            raise SystemExit(f"qops demo: --quantize-head needs a vocabulary that is a multiple of {scheme.multiple} for "
                             f"{scheme.name}; this model's is {config.vocab_size}")
        if args.quantize_head and config.tie_word_embeddings:
            dense = {**dense, "lm_head.weight": dense.get("lm_head.weight", dense["model.embed_tokens.weight"])}
        prefixes = config.linear_prefixes(head=args.quantize_head)
        prog.start(f"quantizing {len(prefixes)} linears to {scheme.name} with qops' reference quantizer")
        qtensors = quantize_tensors(dense, prefixes, scheme, progress=prog.count)
        prog.done()
        print(f"format: {scheme.name} ({scheme.describe})")
        prog.start("loading the quantized model through qops.layers")
        qc = scheme.quantization_config(head=args.quantize_head)
        qweights = TensorWeights(qtensors, device=device, dtype=dtype, quantization_config=qc)
        model = LlamaForCausalLM.from_weights(config, qweights, max_batch=args.batch, max_seq=max_seq, progress=prog.count)
        prog.done()
        del qtensors, qweights
        prog.start("loading the unquantized model")
        reference = LlamaForCausalLM.from_tensors(config, dense, None, progress=prog.count, **kw)
        prog.done()
    lows = ", ".join(f"{n} x{k}" for n, k in model.lowerings().items()) or "none"
    print(f"lowerings: {lows}")

    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    cuda_graphs = device.type == "cuda" and not args.no_compile
    step = None  # eager: generate's own unchecked step (it checks its prompts once)
    with torch.no_grad():
        if not args.no_compile:
            step = compile_decode(model, cuda_graphs=cuda_graphs)
            how = "torch.compile(fullgraph=True" + (", mode='reduce-overhead': CUDA graphs)" if cuda_graphs else ")")
            prog.start(f"compiling the decode step: {how}")
            generate(model, prompts, min(3, args.tokens), step=step, cuda_graphs=cuda_graphs)  # compile + warm up
            prog.done()
        else:
            generate(model, prompts, min(2, args.tokens))  # warm up
        prog.start(f"generating {args.tokens} tokens for {args.batch} prompts of {args.prompt_len}")
        out = generate(model, prompts, args.tokens, step=step, cuda_graphs=cuda_graphs, keep_logits=reference is not None)
        prog.done()

    steps = out.decode_steps
    mode = "eager" if args.no_compile else ("compiled + CUDA graphs" if cuda_graphs else "compiled")
    prefill = f"prefill {args.batch} x {args.prompt_len} tokens in {out.prefill_s:.3f} s"
    if steps and out.decode_s > 0:
        print(f"decode: {args.batch * steps / out.decode_s:,.1f} tokens/s ({mode}; {args.batch} x {steps} steps in {out.decode_s:.3f} s); "
              f"{prefill}")
    else:  # --tokens 1: the one new token comes from the prefill
        print(f"decode: n/a (no decode steps: the only new token comes from the prefill); {prefill}")
    if reference is not None:
        seq = torch.cat([prompts, out.tokens[:, :-1]], dim=1)
        with torch.no_grad():
            ref = reference(seq, torch.arange(seq.shape[1], device=device).expand_as(seq))[:, args.prompt_len - 1:].float()
        err = relative_error(out.logits, ref)
        agree = (out.logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"logit error vs unquantized: {err:.4f} (relative Frobenius over {args.batch} x {args.tokens} positions, "
              f"same tokens); top-1 agreement {100 * agree:.1f}%")
        dense_bytes = reference.weight_bytes()
        print(f"memory: weights {_mb(model.weight_bytes())} (unquantized {_mb(dense_bytes)}); scratch {_mb(model.workspace.nbytes)}; "
              f"KV cache {_mb(model.cache_bytes())}")
    else:
        print("logit error vs unquantized: n/a (the checkpoint is already quantized)")
        print(f"memory: weights {_mb(model.weight_bytes())}; scratch {_mb(model.workspace.nbytes)}; KV cache {_mb(model.cache_bytes())}")
    print(f"sample: prompt 0 {prompts[0].tolist()} -> {out.tokens[0].tolist()[:16]}{' ...' if args.tokens > 16 else ''}")
    return 0
