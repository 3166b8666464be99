"""The reference decoder (``qops.models.llama``) eagerly on CPU: the dense model equals a float64
Llama written out independently; every quantization scheme (one per registered format) builds
through the loader, decodes step by step exactly as the whole sequence runs at once, stays close
to the dense model, gives in fp16 and bf16 its fp32 logits on every step (prefill and each decode
step, within half-precision rounding), and loads back from a Hugging Face checkpoint directory
with the same logits."""
from __future__ import annotations

import json

import pytest
import torch

import qops  # noqa: F401
from qops.formats import FORMATS
from qops.layers import CONFIG_METHODS, QuantLinear
from qops.models import QUANT_SCHEMES, LlamaConfig, LlamaForCausalLM, generate, quantize_tensors, random_tensors, save_pretrained
from qops.models.checkpoint import get_scheme
from qops.models.llama import inv_freq
from qops.models.testing import reference_logits, relative_error, scheme_lowerings
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small products on one thread)

CONFIG = LlamaConfig.tiny()
CPU_PAIRS = scheme_lowerings("cpu")
PAIR_IDS = [f"{s}-{low}" for s, low in CPU_PAIRS]
# Bound on the relative logit error of each scheme against the dense model (the tiny random model,
# fp32), about twice what was measured: int4 0.16-0.18, nf4 0.16, fp4 0.19, fp8 0.04-0.05, int8 0.012.
QUANT_ERROR = {"int4": 0.3, "nf4": 0.3, "fp4": 0.35, "int8": 0.03, "fp8": 0.1}


@pytest.fixture(scope="module")
def dense_tensors():
    return random_tensors(CONFIG, seed=0)


def _model(tensors, scheme, dtype=torch.float32, **kw):
    sch = get_scheme(scheme)
    q = quantize_tensors(tensors, CONFIG.linear_prefixes(), sch)
    return LlamaForCausalLM.from_tensors(CONFIG, q, None if sch is None else sch.config, dtype=dtype,
                                         max_batch=kw.pop("max_batch", 4), max_seq=kw.pop("max_seq", 16), process_group=None, **kw)


def _prompts(b, t, seed=0):
    return torch.randint(0, CONFIG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def test_schemes_cover_the_format_registry():
    assert set(QUANT_SCHEMES) == set(FORMATS), "add a scheme to qops.models.checkpoint.QUANT_SCHEMES for each new format"
    for s in QUANT_SCHEMES.values():
        assert s.quant_method in CONFIG_METHODS, (s.name, s.quant_method)
        assert s.tags and all(t in QUANT_ERROR for t in s.tags), s.name


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_dense_model_equals_the_float64_reference(dense_tensors, attention):
    model = _model(dense_tensors, None, max_seq=8, attention=attention)
    tokens = _prompts(3, 7)
    with torch.no_grad():
        got = model(tokens, torch.arange(7).expand(3, 7))
    want = reference_logits(dense_tensors, CONFIG, tokens)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("vocab", [256, 16384, 32000, 128256, 151936, 16411])
def test_greedy_argmax_is_argmax_with_its_ties(vocab):
    from qops.models.llama import _argmax_chunks, greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-50, 50, (5, vocab), generator=g).float()  # many ties: the first index must win
    logits[1, -1] = 1000.0
    logits[2, 0] = 1000.0
    logits[3, vocab // 2] = logits[3, vocab // 2 + 1] = 1000.0
    assert torch.equal(greedy_argmax(logits), logits.argmax(-1))
    assert torch.equal(greedy_argmax(logits.bfloat16()), logits.bfloat16().argmax(-1))
    assert vocab % _argmax_chunks(vocab) == 0
    if vocab >= 16384 and vocab != 16411:  # (16411 is prime: one chunk of the whole row)
        assert 32 <= _argmax_chunks(vocab) <= vocab // 32


def test_greedy_argmax_compiles_fullgraph_for_an_unbacked_batch():
    from qops.models.llama import greedy_argmax

    torch._dynamo.reset()
    f = torch.compile(greedy_argmax, fullgraph=True)
    for b in (1, 3):
        logits = torch.randn(b, 128256, generator=torch.Generator().manual_seed(b))
        torch._dynamo.decorators.mark_unbacked(logits, 0)
        with torch.compiler.set_stance("fail_on_recompile" if b > 1 else "default"):
            assert torch.equal(f(logits), logits.argmax(-1))
    torch._dynamo.reset()


def test_unknown_attention_kind_is_refused(dense_tensors):
    with pytest.raises(ValueError, match="attention='flash'"):
        _model(dense_tensors, None, attention="flash")


def test_llama3_rope_scaling_matches_the_published_rule():
    cfg = LlamaConfig.llama3_8b()
    inv = inv_freq(cfg)
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * torch.pi / base
    # High frequencies (short wavelengths) keep theirs; wavelengths beyond 8192 are divided by 8.
    assert torch.equal(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])
    torch.testing.assert_close(inv[wavelen > 8192], base[wavelen > 8192] / 8)


@pytest.mark.parametrize("kw,field", [
    (dict(num_key_value_heads=0), "num_key_value_heads"), (dict(num_attention_heads=0, head_dim=None), "num_attention_heads"),
    (dict(num_key_value_heads=-2), "num_key_value_heads"), (dict(hidden_size=0), "hidden_size"), (dict(head_dim=0), "head_dim"),
    (dict(vocab_size=0), "vocab_size"), (dict(num_hidden_layers=0), "num_hidden_layers"), (dict(intermediate_size=-1), "intermediate_size"),
    (dict(vocab_size="256"), "vocab_size"), (dict(num_hidden_layers=True), "num_hidden_layers"), (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(rope_theta=0.0), "rope_theta"), (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
])
def test_config_refuses_invalid_values(kw, field):
    # Each once built a model that failed far away (ZeroDivisionError, KeyError) or ran with no layers.
    with pytest.raises(ValueError, match=rf"LlamaConfig: .*{field}"):
        LlamaConfig.tiny(**kw)


@pytest.mark.parametrize("scheme,lowering", CPU_PAIRS, ids=PAIR_IDS)
def test_decode_steps_equal_the_whole_sequence(dense_tensors, scheme, lowering):
    model = _model(dense_tensors, scheme)
    assert {m.choice.lowering.name for m in model.quantized_linears()} == {lowering}
    assert len(model.quantized_linears()) == 4 * CONFIG.num_hidden_layers  # qkv, o, gate_up, down
    prompts = _prompts(3, 4)
    with torch.no_grad():
        g = generate(model, prompts, 6, keep_logits=True)
        seq = torch.cat([prompts, g.tokens[:, :-1]], dim=1)
        whole = model(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:]
    assert relative_error(g.logits, whole) < 1e-5
    # Against the dense model on the same tokens: the quantization error only.
    dense = _model(dense_tensors, None)
    with torch.no_grad():
        ref = dense(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:]
    err = relative_error(g.logits, ref)
    bound = QUANT_ERROR[QUANT_SCHEMES[scheme].tags[0]]
    assert 0 < err < bound, f"{scheme}: logit error {err:.3g} (bound {bound})"


# Bound on the relative logit error of a half-precision model against the same weights in fp32, in
# units of the dtype's unit roundoff u (fp16 2^-11, bf16 2^-8): the activations are rounded to the
# dtype after every layer op (embedding, norms, projections, attention, residual adds), and the
# logits measured 1.7-2.6 u off on every step, prefill and decode alike (fp16 8e-4..1.2e-3, bf16
# 6.7e-3..1.0e-2); a step at a wrong cache position or with a wrong attention is off by O(0.1-1).
HALF_ERROR_IN_UNITS = 6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme,lowering", CPU_PAIRS, ids=PAIR_IDS)
def test_half_precision(dense_tensors, scheme, lowering, dtype):
    """Every step's logits in fp16 / bf16 (the prefill and each decode step, through the KV cache)
    against the same weights in fp32 run on the whole sequence at once, teacher-forced on the tokens
    the half-precision model chose: a near tie that flips a greedy choice cannot part the two."""
    model = _model(dense_tensors, scheme, dtype=dtype)
    full = _model(dense_tensors, scheme, dtype=torch.float32)
    assert {m.choice.lowering.name for m in model.quantized_linears()} == {lowering}
    prompts = _prompts(2, 3, seed=1)
    with torch.no_grad():
        g = generate(model, prompts, 4, keep_logits=True)
        seq = torch.cat([prompts, g.tokens[:, :-1]], dim=1)
        want = full(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, prompts.shape[1] - 1:]
    assert g.logits.shape == want.shape and g.logits.isfinite().all()
    errors = [relative_error(g.logits[:, i], want[:, i]) for i in range(want.shape[1])]
    bound = HALF_ERROR_IN_UNITS * torch.finfo(dtype).eps / 2
    assert max(errors) < bound, f"relative logit error per step (prefill first) {[f'{e:.2e}' for e in errors]}, bound {bound:.2e}"


@pytest.mark.parametrize("scheme", ["none", "gptq", "awq", "compressed-tensors", "fp8", "bitsandbytes-nf4", "eetq"])
def test_checkpoint_directory_loads_the_same_model(dense_tensors, scheme, tmp_path):
    sch = get_scheme(scheme)
    tensors = quantize_tensors(dense_tensors, CONFIG.linear_prefixes(), sch)
    save_pretrained(str(tmp_path), tensors, CONFIG.to_dict(), None if sch is None else sch.config, shard_bytes=1 << 18)
    assert (tmp_path / "model.safetensors.index.json").exists()  # several shards
    assert json.loads((tmp_path / "config.json").read_text()).get("quantization_config") == (None if sch is None else sch.config)
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, max_batch=2, max_seq=8, process_group=None)
    memory = LlamaForCausalLM.from_tensors(CONFIG, tensors, None if sch is None else sch.config, dtype=torch.float32,
                                           max_batch=2, max_seq=8, process_group=None)
    tokens = _prompts(2, 5)
    with torch.no_grad():
        assert torch.equal(loaded(tokens, torch.arange(5).expand(2, 5)), memory(tokens, torch.arange(5).expand(2, 5)))
    assert loaded.weight_bytes() == memory.weight_bytes()


def test_tied_embeddings_use_the_embedding_as_head():
    cfg = LlamaConfig.tiny(tie_word_embeddings=True)
    tensors = random_tensors(cfg, seed=2)
    assert "lm_head.weight" not in tensors
    model = LlamaForCausalLM.from_tensors(cfg, tensors, dtype=torch.float32, max_batch=1, max_seq=8, process_group=None)
    tokens = _prompts(1, 5)
    with torch.no_grad():
        got = model(tokens, torch.arange(5).expand(1, 5))
    assert relative_error(got, reference_logits(tensors, cfg, tokens)) < 1e-5


@pytest.mark.parametrize("scheme", ["gptq", "bitsandbytes-nf4", "fp8"])
def test_quantized_head(dense_tensors, scheme, tmp_path):
    """``linear_prefixes(head=True)``: lm_head quantized too, read back as a quantized layer from memory
    and from a checkpoint directory; decode steps equal the whole sequence, close to the dense model."""
    sch = get_scheme(scheme)
    tensors = quantize_tensors(dense_tensors, CONFIG.linear_prefixes(head=True), sch)
    assert CONFIG.linear_prefixes(head=True)[-1] == "lm_head"
    stored = tensors.get("lm_head.weight")  # GPTQ: none; bnb: packed uint8; fp8: float8
    assert stored is None or stored.dtype != dense_tensors["lm_head.weight"].dtype
    kw = dict(dtype=torch.float32, max_batch=3, max_seq=16, process_group=None)
    model = LlamaForCausalLM.from_tensors(CONFIG, tensors, sch.config, **kw)
    assert isinstance(model.lm_head.linear, QuantLinear)
    assert len(model.quantized_linears()) == 4 * CONFIG.num_hidden_layers + 1
    save_pretrained(str(tmp_path), tensors, CONFIG.to_dict(), sch.config)
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path), **kw)
    assert isinstance(loaded.lm_head.linear, QuantLinear)
    prompts = _prompts(3, 4, seed=5)
    with torch.no_grad():
        g = generate(model, prompts, 5, keep_logits=True)
        seq = torch.cat([prompts, g.tokens[:, :-1]], dim=1)
        whole = model(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:]
        assert torch.equal(loaded(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:], whole)
        ref = _model(dense_tensors, None)(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:]
        body_only = _model(dense_tensors, scheme)(seq, torch.arange(seq.shape[1]).expand_as(seq))[:, 3:]
    assert relative_error(g.logits, whole) < 1e-5
    err = relative_error(whole, ref)
    # The head's own quantization error adds to the body's (independent errors: a sum of squares).
    bound = QUANT_ERROR[sch.tags[0]] * 1.5
    assert relative_error(body_only, ref) < err < bound, f"{scheme}: logit error {err:.3g} (bound {bound})"


def test_quantized_head_of_tied_embeddings_keeps_the_embedding_dense():
    cfg = LlamaConfig.tiny(tie_word_embeddings=True)
    dense = random_tensors(cfg, seed=2)
    sch = get_scheme("gptq")
    tensors = quantize_tensors({**dense, "lm_head.weight": dense["model.embed_tokens.weight"]}, cfg.linear_prefixes(head=True), sch)
    model = LlamaForCausalLM.from_tensors(cfg, tensors, sch.config, dtype=torch.float32, max_batch=1, max_seq=8, process_group=None)
    assert isinstance(model.lm_head.linear, QuantLinear)
    assert torch.equal(model.embed_tokens.weight[:-1], dense["model.embed_tokens.weight"])
    tokens = _prompts(1, 5)
    with torch.no_grad():
        got = model(tokens, torch.arange(5).expand(1, 5))
    body = LlamaForCausalLM.from_tensors(cfg, quantize_tensors(dense, cfg.linear_prefixes(), sch), sch.config, dtype=torch.float32,
                                         max_batch=1, max_seq=8, process_group=None)
    with torch.no_grad():
        want = body(tokens, torch.arange(5).expand(1, 5))
    assert 0 < relative_error(got, want) < 0.3  # only the head's quantization differs


def test_rows_keep_their_own_positions(dense_tensors):
    """Batch rows at different positions: each row's step equals that row run alone."""
    model = _model(dense_tensors, "gptq")
    prompts = _prompts(2, 5, seed=3)
    with torch.no_grad():
        model.prefill(prompts)
        tok = torch.tensor([7, 9])
        both = model.decode(tok, torch.tensor([5, 2]))  # row 1 overwrites its position 2 and attends to 0..2
        model.prefill(prompts[1:, :2])
        alone = model.decode(tok[1:], torch.tensor([2]))
    assert relative_error(both[1:], alone) < 1e-6


def test_quantized_model_holds_no_dense_copies(dense_tensors):
    model = _model(dense_tensors, "gptq")
    dense = _model(dense_tensors, None)
    linears = sum(t.numel() for k, t in dense_tensors.items() if ".layers." in k and k.endswith("proj.weight"))
    # 4-bit weights plus fp16 scales and packed zeros per 128: about 1/7 of the fp32 linear bytes.
    assert dense.weight_bytes() - model.weight_bytes() > 0.8 * 4 * linears
    assert all(isinstance(m, QuantLinear) for m in model.quantized_linears())


@pytest.mark.parametrize("attention", ["fused", "sdpa", "matmul"])
def test_direct_calls_check_batch_positions_and_ids(dense_tensors, attention):
    """Eager calls outside the cache or the vocabulary are refused by name. They once returned NaN
    logits (position -1, fused / matmul), wrong ones (-1 wrapped to the cache's last slot, sdpa; ids
    past the vocabulary embedded as zeros) or failed deep in torch (IndexError)."""
    model = _model(dense_tensors, None, max_batch=2, max_seq=8, attention=attention)
    one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    cases = [
        (lambda: model.decode(torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), r"decode: a batch of 3 rows .* max_batch=2"),
        (lambda: model.decode(one, torch.tensor([8])), r"decode: positions outside \[0, max_seq=8\): \[8\]"),
        (lambda: model.decode(one, torch.tensor([-1])), r"decode: positions outside \[0, max_seq=8\): \[-1\]"),
        (lambda: model.decode(torch.tensor([256]), zero), r"decode: tokens hold ids outside \[0, vocab_size=256\): \[256\]"),
        (lambda: model.decode(torch.tensor([1, 2]), zero), r"decode: positions must have the shape of tokens \(2,\)"),
        (lambda: model.decode(one.view(1, 1), zero.view(1, 1)), r"decode: tokens and positions must both be \(B,\)"),
        (lambda: model.prefill(torch.ones(1, 9, dtype=torch.long)), r"prefill: 9 positions per row .* max_seq=8"),
        (lambda: model.prefill(torch.ones(3, 2, dtype=torch.long)), r"prefill: a batch of 3 rows .* max_batch=2"),
        (lambda: model.prefill(torch.tensor([[1, -7, 3]])), r"prefill: tokens hold ids outside \[0, vocab_size=256\): \[-7\]"),
        (lambda: model.prefill(torch.ones(3, dtype=torch.long)), r"prefill: tokens must be \(B, T\)"),
        (lambda: model(torch.ones(1, 2, dtype=torch.long), torch.tensor([[7, 8]])), r"forward: positions outside .*: \[8\]"),
    ]
    with torch.no_grad():
        for call, match in cases:
            with pytest.raises(ValueError, match=match):
                call()


def test_generate_checks_its_bounds(dense_tensors):
    model = _model(dense_tensors, None, max_batch=2, max_seq=8)
    with pytest.raises(ValueError, match="max_batch=2"):
        generate(model, _prompts(3, 2), 2)
    with pytest.raises(ValueError, match="a prompt of 4 tokens and 6 new tokens need 9 cache positions, more than max_seq=8"):
        generate(model, _prompts(1, 4), 6)
    # Once: new_tokens 0 or -3 returned one token (decode_steps -1 / -4); an empty prompt was refused as
    # needing "1 cache positions; max_seq=8"; a 1-D prompt failed to unpack; ids past the vocabulary ran.
    for n in (0, -3, 2.0):
        with pytest.raises(ValueError, match=rf"generate: new_tokens must be a positive integer, got {n}"):
            generate(model, _prompts(1, 2), n)
    for bad in (torch.zeros(1, 0, dtype=torch.long), _prompts(1, 3)[0], _prompts(1, 3).float()):
        with pytest.raises(ValueError, match=r"generate: prompts must be integer token ids of shape \(B, T\) with T >= 1"):
            generate(model, bad, 2)
    with pytest.raises(ValueError, match=r"generate: prompts hold ids outside \[0, vocab_size=256\): \[-7, 999\]"):
        generate(model, torch.tensor([[5, 999], [-7, 1]]), 3)


@pytest.mark.parametrize("config_kw,tensor,shape,match", [
    (dict(num_key_value_heads=4), None, None, r"'model.layers.0.self_attn.k_proj' .* N \(out_features\) 128; .*num_key_value_heads \* head_dim"),
    (dict(num_attention_heads=2), None, None, r"'model.layers.0.self_attn.q_proj' .* N \(out_features\) 256; .*num_attention_heads \* head_dim"),
    (dict(head_dim=32), None, None, r"'model.layers.0.self_attn.q_proj' .* head_dim = 4 \* 32"),
    (dict(hidden_size=256), None, None, r"'model.embed_tokens.weight' .* shape \(256, 128\); .* hidden_size=256"),
    (dict(vocab_size=300), None, None, r"'model.embed_tokens.weight' .* shape \(256, 128\); the config gives \(300, 128\) \(vocab_size=300"),
    ({}, "lm_head.weight", (300, 128), r"'lm_head' .* N \(out_features\) 300; the config gives 256 \(vocab_size=256\)"),
    ({}, "model.layers.0.post_attention_layernorm.weight", (64,), r"'model.layers.0.post_attention_layernorm.weight' .* \(64,\); .*hidden_size"),
    ({}, "model.norm.weight", (64,), r"'model.norm.weight' .* \(64,\)"),
    ({}, "model.layers.0.self_attn.o_proj.weight", (128, 192), r"'model.layers.0.self_attn.o_proj' .* K \(in_features\) 192"),
    ({}, "model.layers.0.mlp.down_proj.weight", (128, 200), r"'model.layers.0.mlp.down_proj' .* K \(in_features\) 200; .*intermediate_size"),
    ({}, "model.layers.0.mlp.up_proj.weight", (200, 128), r"'model.layers.0.mlp.up_proj' .* N \(out_features\) 200"),
])
def test_checkpoint_inconsistent_with_the_config_is_a_load_error(config_kw, tensor, shape, match):
    """Each of these loaded and failed in torch at the first step (split sizes, broadcasting, matmul
    shapes), or ran with a vocabulary the checkpoint does not hold (ids past it embedded as zeros)."""
    import dataclasses

    from qops.layers import WeightsError

    base = LlamaConfig.tiny(num_hidden_layers=1)
    tensors = random_tensors(base)
    if tensor is not None:
        tensors[tensor] = torch.zeros(shape)
    with pytest.raises(WeightsError, match=match):
        LlamaForCausalLM.from_tensors(dataclasses.replace(base, **config_kw), tensors, dtype=torch.float32, max_batch=1, max_seq=4,
                                      process_group=None)


def test_quantized_layer_inconsistent_with_the_config_is_a_load_error(dense_tensors):
    from qops.layers import WeightsError

    sch = get_scheme("gptq")
    tensors = quantize_tensors(dense_tensors, CONFIG.linear_prefixes(), sch)
    with pytest.raises(WeightsError, match=r"'model.layers.0.mlp.gate_proj' .* N \(out_features\) 256; the config gives 384"):
        LlamaForCausalLM.from_tensors(LlamaConfig.tiny(intermediate_size=384), tensors, sch.config, dtype=torch.float32, max_batch=1,
                                      max_seq=4, process_group=None)


def test_heads_must_split_over_the_world():
    from qops.distributed import FakeGroup

    from qops.models import TensorWeights

    w = TensorWeights(random_tensors(CONFIG), dtype=torch.float32, process_group=FakeGroup(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not split over world size 4"):
        LlamaForCausalLM.from_weights(CONFIG, w, max_batch=1, max_seq=4)
