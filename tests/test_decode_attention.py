"""``qops::decode_attention`` (``qops.models.attention``) on CPU.

The oracle is float64 and written out independently: the KV heads repeated per query head, each
row's keys taken from the cache at positions ``0 .. p - 1`` plus the token's own rotated key at
``p``, an explicit softmax. The caches hold garbage past each row's position and in the rows the
call does not own (NaN, so any read of it shows), and random history before it. Checked: the CPU
kernel for fp32 / fp16 / bf16, B in {0, 1, 3}, G in {1, 4}, D 64 and 128, positions 0 and
max_seq - 1 and mixed per row, a column slice as ``qkv``; the caches after the call (the rotated k
and the v at each row's position, every other element bit for bit untouched); the Triton kernel
under ``TRITON_INTERPRET=1`` (fp32 / fp16: the interpreter computes bf16 wrongly) against the same
oracle, with small tiles so its loop runs several blocks, a partial one and none, and split over
several programs merged by the second kernel (split-KV), empty splits included; the split rule;
``opcheck``;
errors naming the argument, eagerly and under ``FakeTensorMode``; the Llama model with
``attention="fused"`` equal to ``"sdpa"``, eagerly and through ``compile_decode`` (fullgraph, one
compilation for batch sizes 1..4, the op called once per layer on the caches in place).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

from qops.models import LlamaConfig, LlamaForCausalLM, compile_decode, random_tensors
from qops.models import attention as A
from qops.models.testing import relative_error
from tests.int_weight_cases import one_thread  # noqa: F401  (autouse: small products on one thread)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP = torch.ops.qops.decode_attention.default
MAX_BATCH, HKV = 4, 2
# Max abs error of the output against the float64 oracle (outputs are O(1)): fp32 rounding, or the
# output's rounding to fp16 / bf16 plus, in the Triton kernel, the probabilities rounded to it for
# p @ v. Measured on CPU: fp32 5e-7, fp16 1e-3 (Triton interpreter), bf16 4e-3 (reference kernel).
TOL = {torch.float32: 2e-6, torch.float16: 2.5e-3, torch.bfloat16: 1.6e-2}


def rope_tables(max_seq: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    emb = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv).repeat(1, 2)
    return emb.cos().float(), emb.sin().float()


def make_case(b, g, d, dtype, positions, *, hkv=HKV, max_batch=MAX_BATCH, max_seq=12, sliced=False, seed=0, device=DEVICE):
    """Op arguments (a dict in schema order): random qkv, rotary tables, caches holding random
    history before each row's position and NaN at and after it and in rows >= B."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h = g * hkv
    width = (h + 2 * hkv) * d
    if sliced:  # a column slice: row stride width + 7, storage offset 3
        qkv = torch.randn(b, width + 7, generator=gen, device=device).to(dtype)[:, 3:3 + width]
    else:
        qkv = torch.randn(b, width, generator=gen, device=device).to(dtype)
    cos, sin = rope_tables(max_seq, d)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    # Garbage from position p on (p itself is written by the call) and in the rows >= B.
    stale = torch.arange(max_seq, device=device) >= torch.cat([pos, pos.new_zeros(max_batch - b)]).view(-1, 1)
    stale[b:] = True
    stale = stale.view(max_batch, 1, max_seq, 1)
    caches = [torch.randn(max_batch, hkv, max_seq, d, generator=gen, device=device).masked_fill_(stale, float("nan")).to(dtype)
              for _ in range(2)]
    return dict(qkv=qkv, cos=cos.to(device), sin=sin.to(device), positions=pos, k_cache=caches[0], v_cache=caches[1],
                num_heads=h, num_kv_heads=hkv, scale=d ** -0.5)


def oracle(qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, scale):
    """``(out (B, H*D) float64, k (B, Hkv, D), v (B, Hkv, D))``: the attention output and the key and
    value each row's token must leave in the caches, from the caches as they were before the call."""
    b, d = qkv.shape[0], k_cache.shape[-1]
    h, hk, dtype = num_heads, num_kv_heads, qkv.dtype
    x = qkv.cpu().double()
    q, k, v = x[:, :h * d].view(b, h, d), x[:, h * d:(h + hk) * d].view(b, hk, d), x[:, (h + hk) * d:].view(b, hk, d)
    pos = positions.cpu()
    c, s = cos.cpu().double()[pos].unsqueeze(1), sin.cpu().double()[pos].unsqueeze(1)

    def rotate(t):  # t * cos + rotate_half(t) * sin, rounded to the dtype (what the cache and SDPA see)
        half = d // 2
        return (t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s).to(dtype)

    q_rot, k_rot, v_new = rotate(q).double(), rotate(k), v.to(dtype)
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        p = int(pos[i])
        keys = torch.cat([k_cache[i, :, :p].cpu().double(), k_rot[i].double().unsqueeze(1)], 1)  # (Hkv, p + 1, D)
        vals = torch.cat([v_cache[i, :, :p].cpu().double(), v_new[i].double().unsqueeze(1)], 1)
        keys, vals = keys.repeat_interleave(h // hk, 0), vals.repeat_interleave(h // hk, 0)  # (H, p + 1, D)
        scores = (q_rot[i].unsqueeze(1) * keys).sum(-1) * scale  # (H, p + 1)
        w = (scores - scores.max(-1, keepdim=True).values).exp()
        out[i] = ((w / w.sum(-1, keepdim=True)).unsqueeze(-1) * vals).sum(1)
    return out.reshape(b, h * d), k_rot, v_new


def check_caches(before: dict, after: dict, k_new, v_new) -> None:
    """Each row's position holds its token's k (within an ulp: fp32 rotation, fused or not) and v
    (exactly); every other element is bit for bit what it was (NaN included)."""
    pos = before["positions"].cpu()
    b = pos.shape[0]
    rows = torch.arange(b)
    for name, new in (("k_cache", k_new), ("v_cache", v_new)):
        got, old = after[name].cpu(), before[name].cpu()
        written = got[rows, :, pos]  # (B, Hkv, D)
        if name == "k_cache":
            torch.testing.assert_close(written, new, rtol=2 * torch.finfo(new.dtype).eps, atol=1e-6)
        else:
            assert torch.equal(written, new)
        rest = got.clone()
        rest[rows, :, pos] = old[rows, :, pos]
        assert torch.equal(_bits(rest), _bits(old)), f"{name}: an element besides the written positions changed"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def clone_args(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run_and_check(args: dict, kernel, dtype) -> None:
    before = clone_args(args)
    want, k_new, v_new = oracle(**before)
    got = kernel(**args)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    if want.numel():
        err = (got.cpu().double() - want).abs().max().item()
        assert err < TOL[dtype], f"max abs error {err:.3g}"
    check_caches(before, args, k_new, v_new)


def positions_for(b: int, max_seq: int) -> list[int]:
    return [max_seq - 1, 0, 5][:b]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("b", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_op_matches_the_oracle(dtype, b, g, d):
    args = make_case(b, g, d, dtype, positions_for(b, 12), sliced=b == 3, seed=b + 10 * g, device="cpu")
    run_and_check(args, OP, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_at_position_zero_and_the_last(dtype):
    """A row at position 0 attends to its own token only (output = its v); rows share nothing."""
    args = make_case(4, 2, 64, dtype, [0, 11, 0, 11], seed=3, device="cpu")
    run_and_check(args, OP, dtype)
    h, d = 4, 64
    fresh = make_case(4, 2, 64, dtype, [0, 11, 0, 11], seed=3, device="cpu")
    out = OP(**fresh)
    v0 = fresh["qkv"][0, (h + HKV) * d:].view(HKV, 1, d).expand(HKV, 2, d).reshape(h * d)
    assert torch.equal(out[0], v0)


# Triton under the interpreter (or the GPU when there is one): small tiles so that the loop over the
# cache runs several full blocks, a partial one (positions not a multiple of BLOCK_S) and none (p = 0).
INTERPRETER_CASES = {
    # id: (b, g, d, positions, max_seq, config)
    "b0": (0, 4, 64, [], 40, {"BLOCK_S": 16}),
    "b1-g1-last": (1, 1, 64, [39], 40, {"BLOCK_S": 16}),
    "b3-g4-mixed": (3, 4, 64, [0, 17, 32], 40, {"BLOCK_S": 16}),
    "b3-g3-d128": (3, 3, 128, [16, 1, 39], 40, {"BLOCK_S": 16}),
    "b2-g16-d32": (2, 16, 32, [9, 30], 40, {"BLOCK_S": 16}),
    "b2-default-tiles": (2, 4, 128, [87, 64], 88, {}),
}


@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_kernel_matches_the_oracle(dtype, case):
    b, g, d, positions, max_seq, config = INTERPRETER_CASES[case]
    args = make_case(b, g, d, dtype, positions, max_seq=max_seq, sliced=True, seed=len(positions) + g)
    assert b == 0 or args["qkv"].stride(0) == args["qkv"].shape[1] + 7
    run_and_check(args, lambda **a: A.triton_decode_attention(**a, config=config), dtype)


# Split-KV (several programs per (row, KV head), merged by a second kernel; each split an equal share of
# whole blocks of the row's positions): rows at position 0 (every split empty but the token's), shares
# ending in a partial block, fewer blocks than splits (the later splits empty), more splits asked than
# the cache has blocks.
SPLIT_CASES = {
    # id: (b, g, d, positions, max_seq, BLOCK_S, splits)
    "b3-g4-s3": (3, 4, 64, [0, 17, 39], 40, 8, 3),
    "b2-g1-d32-s5": (2, 1, 32, [16, 31], 40, 8, 5),
    "b1-g3-s4-first-only": (1, 3, 64, [5], 40, 8, 4),
    "b2-g16-s9": (2, 16, 32, [9, 40], 41, 16, 9),
}


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_split_kernels_match_the_oracle(dtype, case):
    b, g, d, positions, max_seq, block_s, splits = SPLIT_CASES[case]
    args = make_case(b, g, d, dtype, positions, max_seq=max_seq, sliced=True, seed=len(positions) + 3 * g)
    run_and_check(args, lambda **a: A.triton_decode_attention(**a, config={"BLOCK_S": block_s}, splits=splits), dtype)


def test_split_rule(monkeypatch):
    monkeypatch.delenv(A.SPLIT_ENV, raising=False)
    sms = 132
    assert A.attention_splits(1, 8, 88, 64, sms) == 1  # short caches: one program per (row, KV head)
    assert A.attention_splits(1, 8, A.SPLIT_MIN_SEQ, 64, sms) == 1
    assert A.attention_splits(1, 8, 4096, 64, sms) == 32  # ~2 programs an SM, >= 2 blocks each
    assert A.attention_splits(1, 8, 1024, 64, sms) == 8  # 1024 / (64 * 2)
    assert A.attention_splits(7, 8, 4096, 64, sms) == 5
    assert A.attention_splits(32, 8, 4096, 64, sms) == 1  # 256 programs already fill the SMs
    assert A.attention_splits(1, 1, 10 ** 6, 64, sms) == A.SPLIT_MAX
    monkeypatch.setenv(A.SPLIT_ENV, "1")
    assert A.attention_splits(1, 8, 4096, 64, sms) == 1
    monkeypatch.setenv(A.SPLIT_ENV, "3")
    assert A.attention_splits(32, 8, 88, 64, sms) == 2  # no more splits than blocks of positions
    monkeypatch.setenv(A.SPLIT_ENV, "many")
    with pytest.raises(ValueError, match=A.SPLIT_ENV):
        A.attention_splits(1, 8, 4096, 64, sms)


def decode_attention_samples() -> dict[str, tuple]:
    out = {}
    for name, (b, g, d, dtype, positions) in {
        "fp32-b3-g4": (3, 4, 64, torch.float32, [11, 0, 5]),
        "fp16-b1-g1-sliced": (1, 1, 64, torch.float16, [7]),
        "bf16-b0": (0, 2, 64, torch.bfloat16, []),
    }.items():
        out[name] = tuple(make_case(b, g, d, dtype, positions, sliced=name.endswith("sliced"), device="cpu").values())
    # NaN garbage in the caches would make opcheck's before/after comparisons fail on NaN != NaN.
    for args in out.values():
        for cache in args[4:6]:
            cache.nan_to_num_(0.5)
    return out


# For tests/test_opcheck.py (SAMPLES.update(OPCHECK_SAMPLES)): every qops op needs samples there.
OPCHECK_SAMPLES = {"decode_attention": decode_attention_samples}


@pytest.mark.parametrize("sample", sorted(decode_attention_samples()))
def test_opcheck(sample):
    args = decode_attention_samples()[sample]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(OP, args, test_utils=utils)
    assert result == {t: "SUCCESS" for t in utils}, result


def test_no_backward():
    """An inference op: a backward through it raises instead of returning a wrong gradient."""
    args = make_case(1, 1, 64, torch.float32, [3], device="cpu")
    args["qkv"].requires_grad_()
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        OP(**args).sum().backward()


def _bad_inputs() -> dict[str, tuple[dict, str]]:
    ok = lambda **kw: {**make_case(2, 2, 64, torch.float16, [3, 4], device="cpu"), **kw}  # noqa: E731
    base = ok()
    w = base["qkv"].shape[1]
    return {
        "cache-dtype": (ok(k_cache=base["k_cache"].float()), r"k_cache must have the dtype of qkv \(torch.float16\), got torch.float32"),
        "qkv-dtype": (ok(qkv=base["qkv"].to(torch.int32)), r"qkv must be float32, float16 or bfloat16, got torch.int32"),
        "heads-divide": (ok(num_heads=3), r"num_heads=3 is not a multiple of num_kv_heads=2"),
        "kv-heads": (ok(num_heads=8, num_kv_heads=4), r"k_cache must have num_kv_heads=4 heads"),
        "odd-d": (ok(k_cache=torch.zeros(4, 2, 12, 63, dtype=torch.float16), v_cache=torch.zeros(4, 2, 12, 63, dtype=torch.float16)),
                  r"head dim D=63 .* must be even"),
        "qkv-width": (ok(qkv=base["qkv"][:, :w - 64]), rf"qkv must have \(num_heads \+ 2\*num_kv_heads\) \* D = \(4 \+ 2\*2\) \* 64 = {w} columns"),
        "qkv-1d": (ok(qkv=base["qkv"][0]), r"qkv must be 2-D"),
        "v-shape": (ok(v_cache=base["v_cache"][:, :, :8]), r"v_cache must have the shape of k_cache \(4, 2, 12, 64\), got \(4, 2, 8, 64\)"),
        "cache-3d": (ok(k_cache=base["k_cache"][0]), r"k_cache must be 4-D"),
        "batch": (ok(qkv=base["qkv"].repeat(3, 1), positions=torch.zeros(6, dtype=torch.long)), r"B=6 rows, more than the caches' max_batch=4"),
        "positions-dtype": (ok(positions=base["positions"].int()), r"positions must be torch.int64, got torch.int32"),
        "positions-shape": (ok(positions=base["positions"][:1]), r"positions must have shape \(B,\) = \(2,\)"),
        "cos-dtype": (ok(cos=base["cos"].half()), r"cos must be torch.float32, got torch.float16"),
        "sin-shape": (ok(sin=base["sin"][:, :32]), r"sin must have shape \(rows, D=64\)"),
        "rope-rows": (ok(sin=base["sin"][:6]), r"sin must have the shape of cos \(12, 64\), got \(6, 64\)"),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("mode", ["eager", "fake"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_errors_name_the_argument(name, mode):
    args, pattern = BAD[name]
    values = list(args.values())
    with pytest.raises((TypeError, ValueError)) as info:
        if mode == "eager":
            OP(*values)
        else:
            with FakeTensorMode() as m:
                OP(*[m.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values])
    assert re.search(pattern, str(info.value)), str(info.value)
    assert str(info.value).startswith("qops.decode_attention: "), str(info.value)


def test_devices_must_match():
    args = make_case(1, 1, 64, torch.float32, [2], device="cpu")
    with FakeTensorMode() as m:
        fakes = {k: m.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        fakes["k_cache"] = m.from_tensor(torch.empty(args["k_cache"].shape, device="meta"))
        with pytest.raises(ValueError, match=r"k_cache must be on cpu \(the device of qkv\), got meta"):
            OP(**fakes)


# The model.

CONFIG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def dense():
    return random_tensors(CONFIG, seed=4)


def _models(dense, dtype=torch.float32, max_batch=4, max_seq=16):
    return {kind: LlamaForCausalLM.from_tensors(CONFIG, dense, dtype=dtype, max_batch=max_batch, max_seq=max_seq, process_group=None,
                                                attention=kind) for kind in ("sdpa", "fused")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_model_equals_sdpa(dense, dtype):
    models = _models(dense, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, CONFIG.vocab_size, (3, 4), generator=gen)
    with torch.no_grad():
        first = {k: m.prefill(prompts) for k, m in models.items()}
        assert torch.equal(first["fused"], first["sdpa"])  # prefill (T > 1) takes the sdpa path
        tok = first["sdpa"].argmax(-1)
        for step, pos in enumerate(([4, 4, 4], [5, 9, 0], [6, 15, 1])):  # rows at their own positions, the last included
            pos = torch.tensor(pos)
            out = {k: m.decode(tok, pos) for k, m in models.items()}
            err = relative_error(out["fused"], out["sdpa"])
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"step {step}: {err:.3g}"
            tok = out["sdpa"].argmax(-1)
    for a, b in zip(models["fused"].layers, models["sdpa"].layers):
        for name in ("k_cache", "v_cache"):
            torch.testing.assert_close(getattr(a.self_attn, name), getattr(b.self_attn, name), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                       atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_model_compiles_once_with_the_caches_in_place(dense):
    models = _models(dense)
    fused = models["fused"]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    step = compile_decode(fused, backend=counter)
    caches = [(layer.self_attn.k_cache, layer.self_attn.k_cache.data_ptr()) for layer in fused.layers]
    gen = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for i, b in enumerate((2, 1, 3, 4)):
                prompts = torch.randint(0, CONFIG.vocab_size, (b, 3), generator=gen)
                tok = {k: m.prefill(prompts).argmax(-1) for k, m in models.items()}
                assert torch.equal(tok["fused"], tok["sdpa"])
                for s in range(2):
                    pos = torch.arange(3 + s, 3 + s + b) % 16  # mixed positions
                    want = models["sdpa"].decode(tok["sdpa"], pos)
                    if i == 0 and s == 0:
                        got, (code, *_) = run_and_get_code(step, tok["fused"].clone(), pos.clone())
                        check_code(code)
                    else:
                        with torch.compiler.set_stance("fail_on_recompile"):
                            got = step(tok["fused"].clone(), pos.clone())
                    assert relative_error(got, want) < 1e-5, (b, s)
                    tok = {"fused": want.argmax(-1), "sdpa": want.argmax(-1)}
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"{counter.frame_count} compilations"
    assert all(t is layer.self_attn.k_cache and t.data_ptr() == p for (t, p), layer in zip(caches, fused.layers))


def check_code(code: str) -> None:
    """One decode_attention call per layer, each given two graph inputs as caches, which no line
    copies or clones (Inductor mutates them in place), and no index_put of the sdpa path."""
    calls = re.findall(r"torch\.ops\.qops\.decode_attention\.default\((.*)\)", code)
    assert len(calls) == CONFIG.num_hidden_layers, calls
    for call in calls:
        args = [a.strip() for a in call.split(",")]
        for cache in args[4:6]:
            assert re.fullmatch(r"arg\d+_1", cache), f"the cache is {cache!r}, not a graph input"
            assert not [line for line in code.splitlines() if re.search(rf"\b{cache}\b", line) and ("copy_" in line or "clone" in line)]
    assert "index_put" not in code and "scaled_dot_product" not in code
