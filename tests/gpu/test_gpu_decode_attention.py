"""``qops::decode_attention`` on a CUDA device (the Triton kernel), against the float64 oracle of
``tests/test_decode_attention.py``, at the Llama-3-8B attention shape per layer (Hkv 8, G 4, D 128):

- eagerly for fp16 and bf16, B in {0, 1, 7, 32} rows of a 32-row cache, max_seq 88 (the decode
  profile's) and 4096, positions 0, max_seq - 1 and random ones mixed per row, ``qkv`` a column
  slice, the caches holding NaN past each row's position (never read) and checked after the call;
- other head dims (64, 256) and group sizes (1, 16): each compiles its own kernel;
- split-KV: the rule splits max_seq 4096 at B = 1 and 7 (32 and 5 programs per row and KV head,
  merged by the second kernel); split counts forced through ``QOPS_ATTN_SPLITS`` (2, 3, 64 and 1 on a
  cache the rule splits), positions in the first split only and at the last;
- under ``torch.compile(fullgraph=True)`` with the batch dimension unbacked: one compilation for
  B = 7, 0, 1, 32, then ``fail_on_recompile``;
- captured into a ``torch.cuda.graph`` (kernel compiled before, on a side stream), replayed on new
  inputs and positions written into the static buffers, the output poisoned between replays;
- the tiny Llama model with ``attention="fused"`` under ``compile_decode`` (reduce-overhead, no
  skipped capture) equal to eager ``"sdpa"``.

Run with ``pytest -m gpu tests/gpu/test_gpu_decode_attention.py``.
"""
from __future__ import annotations

import pytest
import torch

from qops.models import LlamaConfig, LlamaForCausalLM, compile_decode, random_tensors
from qops.models import attention as A
from qops.models.testing import relative_error
from tests.test_decode_attention import OP, TOL, check_caches, clone_args, make_case, oracle

pytestmark = pytest.mark.gpu

HKV, G, D, MAX_BATCH = 8, 4, 128, 32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def positions(b: int, max_seq: int, seed: int) -> list[int]:
    """The first two rows at the last position and at 0, the others random."""
    rest = torch.randint(0, max_seq, (max(b - 2, 0),), generator=torch.Generator().manual_seed(seed)).tolist()
    return ([max_seq - 1, 0] + rest)[:b]


def case(b, dtype, max_seq, *, seed=0, g=G, d=D, hkv=HKV):
    return make_case(b, g, d, dtype, positions(b, max_seq, seed), hkv=hkv, max_batch=MAX_BATCH, max_seq=max_seq, sliced=True, seed=seed,
                     device="cuda")


# Relative L2 error of each (row, query head) output (D values) against the oracle's, in units of the
# dtype's unit roundoff (2^-11, 2^-8). TOL above is an absolute bound sized for O(1) outputs, but a
# row at position p averages p + 1 random v rows (~sqrt(e / p): 0.026 at p = 4095), so on the long
# rows it allows errors of tens of percent in bf16; this bound scales with each head's own output.
# Expected: the output's rounding (~0.4 unit roundoff) and the probabilities rounded to the dtype for
# p @ v (as much again, in quadrature), independent of p. Measured on CPU, the worst (row, head) of
# 6 rows at positions up to 1023: 0.68 (Triton interpreter, fp16, 4 splits), 0.51 (reference kernel,
# fp16 and bf16). A key lost at p ~ 4000 moves a head by ~1 / sqrt(p) of its own size (~4 units in
# bf16, ~30 in fp16); a split of 64 lost or mis-weighted, by ~1 / 8.
HEAD_REL_TOL = {torch.float16: 2.5 * 2.0 ** -11, torch.bfloat16: 2.5 * 2.0 ** -8}


def check(args: dict, got: torch.Tensor, before: dict) -> None:
    want, k_new, v_new = oracle(**before)
    assert got.dtype == args["qkv"].dtype and tuple(got.shape) == tuple(want.shape)
    if want.numel():
        assert got.isfinite().all()
        err = (got.cpu().double() - want).abs().max().item()
        assert err < TOL[got.dtype], f"max abs error {err:.3g}"
        if got.dtype in HEAD_REL_TOL:
            b, d = want.shape[0], before["k_cache"].shape[-1]
            diff, ref = (got.cpu().double() - want).view(b, -1, d), want.view(b, -1, d)
            rel = diff.norm(dim=2) / ref.norm(dim=2)
            row, head = divmod(int(rel.argmax()), rel.shape[1])
            assert rel.max().item() < HEAD_REL_TOL[got.dtype], (
                f"row {row} (position {int(before['positions'][row])}) head {head}: relative error {rel.max().item():.3g} "
                f">= {HEAD_REL_TOL[got.dtype]:.3g}")
    check_caches(before, args, k_new, v_new)


@pytest.mark.parametrize("max_seq", [88, 4096])
@pytest.mark.parametrize("b", [0, 1, 7, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_eager_matches_the_oracle(dtype, b, max_seq):
    args = case(b, dtype, max_seq, seed=b)
    before = clone_args(args)
    got = OP(**args)
    check(args, got, before)


@pytest.mark.parametrize("splits", ["1", "2", "3", "64"])
@pytest.mark.parametrize("b,max_seq", [(1, 4096), (7, 300)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forced_splits_match_the_oracle(dtype, b, max_seq, splits, monkeypatch):
    monkeypatch.setenv(A.SPLIT_ENV, splits)
    pos = positions(b, max_seq, seed=40 + b)
    if b == 7:
        pos[2:4] = [3, max_seq // 3]  # one in the first split only, one past a split boundary
    args = make_case(b, G, D, dtype, pos, hkv=HKV, max_batch=MAX_BATCH, max_seq=max_seq, sliced=True, seed=40 + b, device="cuda")
    before = clone_args(args)
    check(args, OP(**args), before)


@pytest.mark.parametrize("d,g", [(64, 1), (64, 16), (256, 4), (256, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_other_head_dims_and_groups(dtype, d, g):
    args = case(7, dtype, 300, seed=d + g, g=g, d=d, hkv=2)
    before = clone_args(args)
    check(args, OP(**args), before)


def test_fp32_matches_the_oracle():
    args = case(7, torch.float32, 200, seed=3)
    before = clone_args(args)
    check(args, OP(**args), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_compiled_with_an_unbacked_batch(dtype):
    def attend(qkv, cos, sin, positions, k_cache, v_cache):
        return OP(qkv, cos, sin, positions, k_cache, v_cache, G * HKV, HKV, D ** -0.5)

    compiled = torch.compile(attend, fullgraph=True)
    for i, b in enumerate((7, 0, 1, 32)):
        args = case(b, dtype, 88, seed=10 + b)
        before = clone_args(args)
        for name in ("qkv", "positions"):
            torch._dynamo.decorators.mark_unbacked(args[name], 0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compiled(*list(args.values())[:6])
        check(args, got, before)


@pytest.mark.parametrize("b", [1, 7, 32])  # max_seq 4096: 32, 5 and 1 split(s) by the rule
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_graph_capture_replays(dtype, b):
    static = case(b, dtype, 4096, seed=20 + b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        OP(**static)  # compiled and loaded before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(**static)
    for seed in (30, 31):
        fresh = case(b, dtype, 4096, seed=seed + b)
        for name in ("qkv", "positions", "k_cache", "v_cache"):
            static[name].copy_(fresh[name])
        before = clone_args(static)
        out.fill_(float("nan"))
        graph.replay()
        check(static, out, before)


@pytest.mark.parametrize("splits", [None, "3"])
def test_fused_model_reduce_overhead_equals_sdpa(splits, monkeypatch):
    from torch._dynamo.utils import counters

    if splits:
        monkeypatch.setenv(A.SPLIT_ENV, splits)  # the two-kernel path inside the compiled, captured model
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)
    config = LlamaConfig.tiny()
    dense = random_tensors(config, seed=6)
    models = {kind: LlamaForCausalLM.from_tensors(config, dense, device="cuda", dtype=torch.bfloat16, max_batch=4, max_seq=32,
                                                  process_group=None, attention=kind) for kind in ("sdpa", "fused")}
    counters["inductor"].clear()
    step = compile_decode(models["fused"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, b in enumerate((3, 1, 4)):
            prompts = torch.randint(0, config.vocab_size, (b, 5), generator=gen).cuda()
            tok = {k: m.prefill(prompts).argmax(-1) for k, m in models.items()}
            for s in range(3):
                pos = (torch.arange(b, device="cuda") * 7 + 5 + s) % 32
                want = models["sdpa"].decode(tok["sdpa"], pos)
                torch.compiler.cudagraph_mark_step_begin()
                with torch.compiler.set_stance("fail_on_recompile" if i or s else "default"):
                    got = step(tok["fused"].clone(), pos.clone()).clone()
                err = relative_error(got, want)
                assert err < 3e-2, f"batch {b} step {s}: relative error {err:.3g}"
                tok = {k: want.argmax(-1) for k in models}
    assert counters["inductor"]["cudagraph_skips"] == 0
