"""torch.compile of the whole reference decoder's step (``LlamaForCausalLM.decode``), for every
quantization scheme (one per registered format) with the lowering it gets on this machine:
``fullgraph=True`` (no graph break), one compilation serving every batch size (1, 2, 7 and the
maximum, the batch dimension unbacked) and every decode step (then ``fail_on_recompile``), the
eager logits, a graph holding exactly one opaque qops call per quantized linear -- the ``_out`` op,
all of them given the model's workspace buffer as the one graph input it is, never cloned or copied
-- and no dequantized weight, and a compiled greedy generation equal to the eager one."""
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
BATCHES = (2, 1, 7, MAX_BATCH)  # the first compiles; the others must not recompile
STEPS = 3
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


@pytest.mark.parametrize("dtype", [torch.float32], ids=str)
@pytest.mark.parametrize("scheme,lowering", PAIRS, ids=[f"{s}-{low}" for s, low in PAIRS])
def test_decode_compiles_once_for_every_batch_size_and_step(scheme, lowering, dtype):
    model = LlamaForCausalLM.random(CONFIG, None if scheme == "none" else scheme, seed=1, dtype=dtype, max_batch=MAX_BATCH,
                                    max_seq=16, process_group=None)
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
            tok = model.prefill(prompts).argmax(-1)
            for s in range(STEPS):
                pos = torch.full((b,), 3 + s, dtype=torch.long)
                want = model.decode(tok, pos)  # the compiled step then rewrites the same cache entries
                tok_c, pos_c = _unbacked(tok.clone(), pos.clone())
                if i == 0 and s == 0:
                    got, (code, *_) = run_and_get_code(step, tok_c, pos_c)
                    if scheme != "none":
                        check_workspace_in_place(code, out_op_counts(FORMATS[scheme].family, 4 * CONFIG.num_hidden_layers, CONFIG.num_hidden_layers))
                    assert "dequantize" not in code
                else:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        got = step(tok_c, pos_c)
                worst = max(worst, relative_error(got, want))
                tok = want.argmax(-1)
        # A compiled greedy generation equals the eager one, token for token.
        prompts = torch.randint(0, CONFIG.vocab_size, (5, 4), generator=gen)
        eager = generate(model, prompts, 6, keep_logits=True)
        with torch.compiler.set_stance("fail_on_recompile"):
            compiled = generate(model, prompts, 6, step=lambda t, p: step(*_unbacked(t, p)), keep_logits=True)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations"
    assert model.workspace.buffer is workspace and workspace.data_ptr() == ptr, "the workspace was reallocated"
    assert worst < 1e-5, worst
    assert torch.equal(compiled.tokens, eager.tokens)
    assert relative_error(compiled.logits, eager.logits) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme,lowering", [("gptq", "reference_int_weight")], ids=["gptq-reference_int_weight"])
def test_decode_compiles_in_half_precision(scheme, lowering, dtype):
    model = LlamaForCausalLM.random(CONFIG, scheme, seed=1, dtype=dtype, max_batch=4, max_seq=8, process_group=None)
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(model.decode, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, b in enumerate((3, 1, 4)):
            tok = torch.randint(0, CONFIG.vocab_size, (b,), generator=gen)
            pos = torch.full((b,), i, dtype=torch.long)
            want = model.decode(tok, pos)
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                got = step(*_unbacked(tok.clone(), pos.clone()))
            assert got.dtype == dtype
            assert relative_error(got, want) < 1e-2
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
