"""torch.compile of the whole reference decoder's step (``LlamaForCausalLM.decode``), for every
quantization scheme (one per registered format) with the lowering it gets on this machine:
``fullgraph=True`` (no graph break), one compilation serving every batch size (0, 1, 2, 7 and
the maximum, the batch dimension unbacked) and every decode step (then ``fail_on_recompile``), the
logits and KV-cache writes of a second, eager model of the same weights on its own cache (the
compiled model's cache holds NaN wherever its decode steps must write), a graph holding exactly one
opaque qops call per quantized linear -- the ``_out`` op, all of them given the model's workspace
buffer as the one graph input it is, never cloned or copied -- and no dequantized weight, and a
compiled greedy generation equal to the eager one. Every scheme also in fp16 and bf16 (logits and cache
writes against the eager model in that dtype, within a few unit roundoffs)."""
from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import qops  # noqa: F401
from qops.formats import FORMATS
from qops.models import QUANT_SCHEMES, LlamaConfig, LlamaForCausalLM, compile_decode, generate
from qops.models.testing import relative_error, scheme_lowerings

CONFIG = LlamaConfig.tiny()
MAX_BATCH = 8
# The first compiles; the others must not recompile. Batch 0 (no rows) too: the unbacked batch
# dimension does not specialize on it, and the step returns (0, vocab) logits.
BATCHES = (2, 1, 0, 7, MAX_BATCH)
STEPS = 3
HALF_STEPS = 2
# Compiled against eager in fp16 / bf16: Inductor keeps fp32 inside a fused kernel where eager rounds
# every op's output to the dtype, so the two differ by rounding: measured 2.1-2.2 u on the logits (fp16
# 1.0e-3, bf16 8.8e-3) and at most 1.1 u on the cache entries, u = 2^-11 (fp16) or 2^-8 (bf16). Bound:
# 6 u. A lost cache write does not depend on it: it leaves a NaN (``prefill_then_poison``).
HALF_BOUND = {dtype: 6 * torch.finfo(dtype).eps / 2 for dtype in (torch.float16, torch.bfloat16)}
PAIRS = [("none", "dense")] + scheme_lowerings("cpu")
# The layers hold the model's workspace, so they call the _out ops (on CPU every fp8 layer is W8A16).
OPS = {"int_weight": "mm_int_weight_out", "fp8": "mm_fp8_weight_out", "int8_weight": "mm_int8_weight_out",
       "blockwise4": "mm_blockwise4_out"}
# The families with a gated op: the MLP's gate/up layer calls it instead of OPS' op.
SWIGLU_OPS = {"int_weight": "mm_int_weight_swiglu_out"}


def out_op_counts(family: str, with_out: int, mlps: int) -> dict[str, int]:
    """Calls of each ``_out`` op in a decode step of ``mlps`` layers, ``with_out`` linears on the
    workspace: the gate/up ones through the family's gated op where it has one."""
    if family not in SWIGLU_OPS:
        return {OPS[family]: with_out}
    return {OPS[family]: with_out - mlps, SWIGLU_OPS[family]: mlps}


def check_workspace_in_place(code: str, counts: dict[str, int]) -> None:
    """``counts[op]`` calls of each ``qops::op`` in the generated ``code``, all of them given the same
    graph input as their workspace (the last argument), which no line clones or copies."""
    workspaces = set()
    for op, count in counts.items():
        calls = re.findall(rf"torch\.ops\.qops\.{op}\.default\((.*)\)", code)
        assert len(calls) == count, f"{len(calls)} calls of qops::{op}, expected {count}"
        workspaces |= {call.rsplit(",", 1)[1].strip() for call in calls}
    assert len(workspaces) == 1, workspaces
    (ws,) = workspaces
    assert re.fullmatch(r"arg\d+_1", ws), f"the workspace is {ws!r}, not a graph input"
    assert not [line for line in code.splitlines() if re.search(rf"\b{ws}\b", line) and ("copy_" in line or "clone" in line)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _unbacked(*ts):
    for t in ts:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    return ts


def test_op_table_covers_the_families():
    assert {FORMATS[s].family for s in QUANT_SCHEMES} == set(OPS)


def _caches(model: LlamaForCausalLM) -> list[torch.Tensor]:
    return [t for layer in model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def prefill_then_poison(model: LlamaForCausalLM, prompts: torch.Tensor) -> torch.Tensor:
    """``model.prefill(prompts)`` on a zeroed cache (the prefill's attention masks later positions
    with an additive -inf, which a NaN there would turn into NaN), then NaN in every cache entry from
    the first decode position on. A decode step reads only positions up to its own (the fused
    attention never uses the rest), so every entry it reads is one the prefill or an earlier step of
    this model wrote: a step whose cache writes are lost makes the next step's logits NaN."""
    for cache in _caches(model):
        cache.zero_()
    logits = model.prefill(prompts)
    for cache in _caches(model):
        cache[:, :, prompts.shape[1]:] = float("nan")
    return logits


def assert_caches_match(got: LlamaForCausalLM, want: LlamaForCausalLM, rows: int, positions: int, bound: float) -> None:
    """The cache entries of rows ``[0, rows)`` at positions ``[0, positions)`` (the prefill's and
    every decode step's, the last step's too, which no step reads back) agree between the models."""
    for i, (g, w) in enumerate(zip(_caches(got), _caches(want))):
        g, w = g[:rows, :, :positions], w[:rows, :, :positions]
        assert g.isfinite().all(), f"cache {i}: an entry a step should have written is still NaN"
        assert relative_error(g, w) < bound, f"cache {i}: {relative_error(g, w):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("scheme,lowering", PAIRS, ids=[f"{s}-{low}" for s, low in PAIRS])
def test_decode_compiles_once_for_every_batch_size_and_step(scheme, lowering, dtype):
    def build():
        return LlamaForCausalLM.random(CONFIG, None if scheme == "none" else scheme, seed=1, dtype=dtype, max_batch=MAX_BATCH,
                                       max_seq=16, process_group=None)

    # The eager reference runs on its own model: on a shared cache it would leave every entry the
    # compiled step is meant to write already written, and a compiled step that lost its writes would pass.
    model, eager = build(), build()
    if scheme != "none":
        assert {m.choice.lowering.name for m in model.quantized_linears()} == {lowering}
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(model.decode, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    workspace, ptr = model.workspace.buffer, model.workspace.buffer.data_ptr()
    worst = 0.0
    with torch.no_grad():
        for i, b in enumerate(BATCHES):
            prompts = torch.randint(0, CONFIG.vocab_size, (b, 3), generator=gen)
            tok = eager.prefill(prompts).argmax(-1)
            prefill_then_poison(model, prompts)
            for s in range(STEPS):
                pos = torch.full((b,), 3 + s, dtype=torch.long)
                want = eager.decode(tok, pos)
                tok_c, pos_c = _unbacked(tok.clone(), pos.clone())
                if i == 0 and s == 0:
                    got, (code, *_) = run_and_get_code(step, tok_c, pos_c)
                    if scheme != "none":
                        check_workspace_in_place(code, out_op_counts(FORMATS[scheme].family, 4 * CONFIG.num_hidden_layers, CONFIG.num_hidden_layers))
                    assert "dequantize" not in code
                else:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        got = step(tok_c, pos_c)
                assert got.shape == (b, CONFIG.vocab_size)
                assert got.isfinite().all(), f"batch {b} step {s}: non-finite logits (a NaN cache entry read)"
                worst = max(worst, relative_error(got, want))
                tok = want.argmax(-1)
            assert_caches_match(model, eager, b, 3 + STEPS, 1e-5)  # fp32: measured at most 2e-7
        # A compiled greedy generation equals the eager one, token for token.
        prompts = torch.randint(0, CONFIG.vocab_size, (5, 4), generator=gen)
        want_gen = generate(eager, prompts, 6, keep_logits=True)
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled = generate(model, prompts, 6, step=lambda t, p: step(*_unbacked(t, p)), keep_logits=True,
                                prefill=lambda p: prefill_then_poison(model, p))
    assert counter.frame_count == 1, f"{counter.frame_count} compilations"
    assert model.workspace.buffer is workspace and workspace.data_ptr() == ptr, "the workspace was reallocated"
    assert worst < 1e-5, worst
    assert torch.equal(compiled.tokens, want_gen.tokens)
    assert relative_error(compiled.logits, want_gen.logits) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme,lowering", PAIRS[1:], ids=[f"{s}-{low}" for s, low in PAIRS[1:]])
def test_decode_compiles_in_half_precision(scheme, lowering, dtype):
    def build():
        return LlamaForCausalLM.random(CONFIG, scheme, seed=1, dtype=dtype, max_batch=4, max_seq=8, process_group=None)

    model, eager = build(), build()  # the eager reference on its own cache, as above
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(model.decode, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for i, b in enumerate((3, 1, 4)):
            prompts = torch.randint(0, CONFIG.vocab_size, (b, 2), generator=gen)
            tok = eager.prefill(prompts).argmax(-1)
            prefill_then_poison(model, prompts)
            for s in range(HALF_STEPS):
                pos = torch.full((b,), 2 + s, dtype=torch.long)
                want = eager.decode(tok, pos)
                with torch.compiler.set_stance("fail_on_recompile" if i or s else "default"):
                    got = step(*_unbacked(tok.clone(), pos.clone()))
                assert got.dtype == dtype
                assert got.isfinite().all(), f"batch {b} step {s}: non-finite logits (a NaN cache entry read)"
                worst = max(worst, relative_error(got, want))
                tok = want.argmax(-1)
            assert_caches_match(model, eager, b, 2 + HALF_STEPS, HALF_BOUND[dtype])
    assert worst < HALF_BOUND[dtype], worst
    assert counter.frame_count == 1


def test_compiled_step_refuses_a_batch_over_max_batch_before_tracing():
    """A batch over max_batch once failed inside Dynamo ("Guard failed on the same frame it was
    created. This is a bug") after a first compilation, and in torch's index_put_ before one."""
    model = LlamaForCausalLM.random(CONFIG, None, seed=1, dtype=torch.float32, max_batch=2, max_seq=8, process_group=None)
    counter = CompileCounterWithBackend("inductor")
    step = compile_decode(model, backend=counter)
    three = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        with pytest.raises(ValueError, match="compile_decode step: a batch of 3 rows is more than the cache's max_batch=2"):
            step(three, three)
        assert counter.frame_count == 0
        step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        with pytest.raises(ValueError, match="compile_decode step: a batch of 3 rows is more than the cache's max_batch=2"):
            step(three, three)
        with pytest.raises(ValueError, match=r"compile_decode step: positions must have the shape of tokens \(1,\)"):
            step(three[:1], three[:2])
    assert counter.frame_count == 1
