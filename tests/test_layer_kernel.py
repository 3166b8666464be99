"""``qops::decode_layers`` (qops.models.layer_kernel) on the CPU: its reference kernel against a float64
oracle written here (its own nibble unpacking, RMSNorm, rotary, softmax attention and SwiGLU, rounding
to the dtype where ``LlamaDecoderLayer`` does; h and its update h - hidden checked), that check failing
an attention with one share mis-weighted at position 4000, argument errors eagerly and under fake tensors,
opcheck, the Llama model's batch-1 steps through the op (eager and compiled fullgraph) against its
layer-by-layer steps, and the workspace's layout. The GPU file (tests/gpu/test_gpu_layer_kernel.py)
runs the native kernel against the same oracle.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from qops.models import LlamaConfig, LlamaForCausalLM
from qops.models import layer_kernel as LK
from qops.models.llama import inv_freq
from qops.models.testing import relative_error
from qops.ops.int_weight import to_column_slabs

OP = torch.ops.qops.decode_layers
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2, torch.float32: 1e-5}


@dataclass
class Case:
    hidden: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    norm1: list
    norm2: list
    qweight: list  # flat (K/8, N) int32
    scales: list
    qzeros: list
    k_cache: list
    v_cache: list
    dims: LK.Dims
    group_size: int
    zero_offset: int
    eps: float = 1e-5

    @property
    def scale(self) -> float:
        return self.dims.head_dim ** -0.5

    def args(self, workspace: torch.Tensor, slabs: bool = False) -> tuple:
        qw = [to_column_slabs(q) for q in self.qweight] if slabs else self.qweight
        return (self.hidden, self.positions, self.cos, self.sin, self.norm1, self.norm2, qw, self.scales, self.qzeros,
                self.k_cache, self.v_cache, workspace, self.dims.kv_heads, self.group_size, self.zero_offset, self.eps, self.scale)

    def clone_caches(self) -> "Case":
        c = Case(**{**self.__dict__})
        c.k_cache = [t.clone() for t in self.k_cache]
        c.v_cache = [t.clone() for t in self.v_cache]
        return c


def make_case(dims: LK.Dims, *, dtype=torch.bfloat16, device="cpu", pos: int = 5, max_seq: int = 16, max_batch: int = 2,
              group_size: int = 128, zeros: bool = True, zero_offset: int = 0, scale_dtype=None, seed: int = 0) -> Case:
    """Random weights and activations sized so that every layer keeps the residual stream's scale;
    cache positions after ``pos`` (and the rows after 0) hold NaN: the op must never read them."""
    g = torch.Generator().manual_seed(seed)
    d = dims
    sdt = scale_dtype or dtype

    def weight(n, k):
        qw = torch.randint(-2**31, 2**31, (k // 8, n), generator=g, dtype=torch.int64).to(torch.int32)
        groups = 1 if group_size == -1 else -(-k // group_size)
        sc = (torch.rand(groups, n, generator=g) * 0.5 + 0.75) * (k ** -0.5) / 4
        qz = None
        if zeros:
            qz = torch.randint(-2**31, 2**31, (groups, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
        return qw.to(device), sc.to(sdt).to(device), None if qz is None else qz.to(device)

    qkv_n = (d.heads + 2 * d.kv_heads) * d.head_dim
    shapes = ((qkv_n, d.hidden), (d.hidden, d.heads * d.head_dim), (2 * d.inter, d.hidden), (d.hidden, d.inter))
    qweight, scales, qzeros = [], [], []
    for _ in range(d.layers):
        for n, k in shapes:
            qw, sc, qz = weight(n, k)
            qweight.append(qw)
            scales.append(sc)
            qzeros.append(qz)
    cfg = LlamaConfig(hidden_size=d.hidden, num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, head_dim=d.head_dim)
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    kc, vc = [], []
    for _ in range(d.layers):
        for lst in (kc, vc):
            t = torch.full((max_batch, d.kv_heads, max_seq, d.head_dim), float("nan"), dtype=dtype)
            t[0, :, :pos] = torch.randn(d.kv_heads, pos, d.head_dim, generator=g).to(dtype)
            lst.append(t.to(device))
    return Case(
        hidden=torch.randn(1, d.hidden, generator=g).to(dtype).to(device),
        positions=torch.tensor([pos], dtype=torch.int64, device=device),
        cos=emb.cos().float().to(device), sin=emb.sin().float().to(device),
        norm1=[(1 + 0.1 * torch.randn(d.hidden, generator=g)).to(dtype).to(device) for _ in range(d.layers)],
        norm2=[(1 + 0.1 * torch.randn(d.hidden, generator=g)).to(dtype).to(device) for _ in range(d.layers)],
        qweight=qweight, scales=scales, qzeros=qzeros, k_cache=kc, v_cache=vc, dims=d, group_size=group_size,
        zero_offset=zero_offset,
    )


def _dequant64(qw: torch.Tensor, sc: torch.Tensor, qz, group_size: int, zero_offset: int) -> torch.Tensor:
    """W (N, K) float64 from a flat 4-bit qweight, written from the layout's definition."""
    kw, n = qw.shape
    k = 8 * kw
    shifts = 4 * torch.arange(8, dtype=torch.int64)
    q = ((qw.long().unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(k, n)  # row 8 j + i = nibble i of word j
    g = torch.zeros(k, dtype=torch.long) if group_size == -1 else torch.arange(k) // group_size
    if qz is None:
        z = torch.full((sc.shape[0], n), 8.0, dtype=torch.float64)
    else:
        z = (((qz.long().unsqueeze(2) >> shifts.view(1, 1, 8)) & 15).reshape(qz.shape[0], -1)[:, :n] + zero_offset).double()
    return (sc.double()[g] * (q.double() - z[g])).t()


def oracle(case: Case, weights=None) -> tuple[torch.Tensor, list, list]:
    """(h after the last layer, each layer's k and v written at the position) in float64, with the
    activations rounded to the dtype where the model rounds them. ``weights``: a function replacing
    the attention's probabilities (Hkv, GQ, pos + 1) (a deliberate fault for the checks' own test)."""
    c = case.clone_caches()
    c = Case(**{k: (v.cpu() if isinstance(v, torch.Tensor) else [t.cpu() if isinstance(t, torch.Tensor) else t for t in v]
                    if isinstance(v, list) else v) for k, v in c.__dict__.items()})
    d, dt = c.dims, c.hidden.dtype
    r = lambda t: t.to(dt).double()  # noqa: E731 - rounding to the model's dtype
    pos = int(c.positions[0])
    h = c.hidden.double()[0]
    ks, vs = [], []
    for layer in range(d.layers):
        def proj(i, x):
            j = 4 * layer + i
            return _dequant64(c.qweight[j], c.scales[j], c.qzeros[j], c.group_size, c.zero_offset) @ x

        def norm(x, w):
            return r(w.double() * r(x * (x.pow(2).mean() + c.eps).rsqrt()))

        qkv = r(proj(0, norm(h, c.norm1[layer])))
        hd, nh, nkv = d.head_dim, d.heads, d.kv_heads
        q = qkv[:nh * hd].view(nh, hd)
        k = qkv[nh * hd:(nh + nkv) * hd].view(nkv, hd)
        v = qkv[(nh + nkv) * hd:].view(nkv, hd)
        cs, sn = c.cos[pos].double(), c.sin[pos].double()

        def rot(x):
            return r(x * cs + torch.cat((-x[:, hd // 2:], x[:, :hd // 2]), dim=-1) * sn)

        q, k = rot(q), rot(k)
        ks.append(k)
        vs.append(v)
        kc = torch.cat((c.k_cache[layer][0, :, :pos].double(), k.unsqueeze(1)), dim=1)  # (Hkv, pos + 1, D)
        vc = torch.cat((c.v_cache[layer][0, :, :pos].double(), v.unsqueeze(1)), dim=1)
        grp = nh // nkv
        scores = torch.einsum("hgd,hpd->hgp", q.view(nkv, grp, hd), kc) * case.scale
        probs = torch.softmax(scores, dim=-1)
        attn = r(torch.einsum("hgp,hpd->hgd", probs if weights is None else weights(probs), vc).reshape(nh * hd))
        h = r(h + r(proj(1, attn)))
        gu = proj(2, norm(h, c.norm2[layer]))
        gate, up = gu[:d.inter], gu[d.inter:]
        h = r(h + r(proj(3, r(gate * torch.sigmoid(gate) * up))))
    return h.view(1, -1), ks, vs


def check_against_oracle(case: Case, got: torch.Tensor, k_cache: list, v_cache: list) -> None:
    want, ks, vs = oracle(case)
    dt = case.hidden.dtype
    err = relative_error(got.cpu(), want)
    assert err < TOL[dt], f"h: relative error {err:.3e} >= {TOL[dt]}"
    # The layers' update of the residual stream, relative to its own size: measured on h, a wrong attention
    # is diluted by hidden (and, with the MLP, by what the MLP adds); see attention_alone.
    hidden = case.hidden.cpu().double()
    err = relative_error(got.cpu().double() - hidden, want - hidden)
    assert err < TOL[dt], f"update h - hidden: relative error {err:.3e} >= {TOL[dt]}"
    pos = int(case.positions[0])
    for layer in range(case.dims.layers):
        for name, cache, ref in (("k", k_cache, ks), ("v", v_cache, vs)):
            written = cache[layer][0, :, pos].cpu()
            e = relative_error(written, ref[layer])
            assert e < TOL[dt], f"layer {layer} {name} at {pos}: relative error {e:.3e}"
            # Nothing else written: rows other than 0 and positions after pos keep their NaN.
            assert torch.isnan(cache[layer][1:].float()).all() and torch.isnan(cache[layer][0, :, pos + 1:].float()).all()


def attention_alone(case: Case, o_scale: float = 8.0) -> Case:
    """The case with every MLP's down-projection scales zeroed (the MLP adds exactly 0: h - hidden is the
    layers' o_proj(attention), rounded into h) and o_proj's scales times ``o_scale`` (a power of two:
    exact). At position 4000 the attention's output is ~0.06 a value (softmax over ~4000 random keys) and
    o_proj alone adds ~10% of |h|: an ulp of h is ~10 ulps of the update, and h's rounding alone leaves
    the update a floor of ~1.4e-2 in bf16. Times 8 the update is 0.3-0.9 |h| and its error against this
    oracle perturbed by a relative 1e-5 before each rounding (the kernel's fp32 sums in another order)
    4e-3 to 8e-3 in bf16, at worst 1.4e-2, and at worst 1.7e-3 in fp16 (the GPU file's twelve cases):
    under 0.6 TOL."""
    c = Case(**{**case.__dict__})
    c.scales = list(case.scales)
    for layer in range(case.dims.layers):
        c.scales[4 * layer + 1] = case.scales[4 * layer + 1] * o_scale
        c.scales[4 * layer + 3] = torch.zeros_like(case.scales[4 * layer + 3])
    return c


SMALL = LK.Dims(layers=2, hidden=256, inter=384, heads=4, kv_heads=2, head_dim=64)


def workspace(dims: LK.Dims, device="cpu") -> torch.Tensor:
    return torch.zeros(LK.workspace_bytes(dims), dtype=torch.uint8, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zeros,group_size,pos", [(True, 128, 5), (False, -1, 0), (True, 128, 15)])
def test_reference_matches_oracle(dtype, zeros, group_size, pos):
    case = make_case(SMALL, dtype=dtype, zeros=zeros, group_size=group_size, pos=pos)
    run = case.clone_caches()
    got = OP(*run.args(workspace(SMALL)))
    check_against_oracle(case, got, run.k_cache, run.v_cache)


def share_weighted(factor: float, kv_head: int, share: int, shares: int):
    """A fault for ``oracle(case, weights=...)``: KV head ``kv_head``'s attention probabilities over one
    share of the positions (decode_layers.cu splits 0 .. pos - 1 into ``shares``; the last share also
    holds the new token) times ``factor``, the rows renormalized -- what a share merge scaling one
    share's sums (l and o alike) computes."""
    def weights(p):
        pos = p.shape[-1] - 1
        lo, hi = pos * share // shares, pos * (share + 1) // shares if share < shares - 1 else pos + 1
        p = p.clone()
        p[kv_head, :, lo:hi] *= factor
        return p / p.sum(-1, keepdim=True)
    return weights


def test_checks_catch_one_mis_weighted_attention_share_at_4000():
    """What the GPU file's attention-alone cases are for. At position 4000, one KV head's attention over one
    of 16 shares weighted 1.5 (its query heads' outputs off by ~10%) moves a whole bf16 layer's h (and its
    update, mostly the MLP's) by ~1.5e-2: TOL (2.5e-2) lets it pass. With attention_alone the update is off
    by ~7e-2 and check_against_oracle fails it in fp16 and bf16 (in bf16 by the update alone: h moves
    2.4e-2); the reference kernel passes."""
    dims = LK.Dims(layers=1, hidden=512, inter=512, heads=8, kv_heads=2, head_dim=128)
    fault = share_weighted(1.5, kv_head=0, share=7, shares=16)
    whole = make_case(dims, dtype=torch.bfloat16, pos=4000, max_seq=4001, max_batch=1, seed=3)
    want, _, _ = oracle(whole)
    wrong, _, _ = oracle(whole, weights=fault)
    hidden = whole.hidden.double()
    assert 0 < relative_error(wrong, want) < TOL[torch.bfloat16] and relative_error(wrong - hidden, want - hidden) < TOL[torch.bfloat16]
    for dtype in (torch.float16, torch.bfloat16):
        case = attention_alone(make_case(dims, dtype=dtype, pos=4000, max_seq=4001, max_batch=1, seed=4))
        run = case.clone_caches()
        got = OP(*run.args(workspace(dims)))
        check_against_oracle(case, got, run.k_cache, run.v_cache)
        want, _, _ = oracle(case)
        wrong, _, _ = oracle(case, weights=fault)
        hidden = case.hidden.double()
        assert relative_error(wrong - hidden, want - hidden) > 2 * TOL[torch.bfloat16]
        with pytest.raises(AssertionError, match="relative error"):
            check_against_oracle(case, wrong.to(dtype), run.k_cache, run.v_cache)


def test_slabs_and_flat_agree():
    case = make_case(SMALL, dtype=torch.float16, zero_offset=1)
    a, b = case.clone_caches(), case.clone_caches()
    ya = OP(*a.args(workspace(SMALL)))
    yb = OP(*b.args(workspace(SMALL), slabs=True))
    assert torch.equal(ya, yb)


def test_workspace_layout_is_disjoint_and_aligned():
    d = LK.Dims(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    lay = LK.workspace_layout(d)
    parts = ["table", "qkv", "attn", "act", "part", "apart", "bytes"]
    offs = [lay[p] for p in parts]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs)
    assert lay["ctr_bytes"] >= 4 * (2 + 14336 // 32 + 8)  # arrivals, generation, [gate; up]'s 448 groups, 8 KV heads
    assert lay["act"] - lay["attn"] >= 2 * 32 * 128 and lay["apart"] - lay["part"] >= 4 * 448 * 32 * 64
    assert lay["bytes"] < 8 << 20  # well inside PERF.md's 64 MiB of scratch


def _bad(case: Case, **change):
    args = list(case.args(workspace(case.dims)))
    names = ["hidden", "positions", "cos", "sin", "norm1", "norm2", "qweight", "scales", "qzeros", "k_cache", "v_cache",
             "workspace", "num_kv_heads", "group_size", "zero_offset", "eps", "scale"]
    for k, v in change.items():
        args[names.index(k)] = v
    return args


@pytest.mark.parametrize("fake", [False, True])
def test_errors_name_the_argument(fake):
    case = make_case(SMALL, dtype=torch.bfloat16)
    bad = {
        "hidden": (dict(hidden=case.hidden.expand(2, -1)), "hidden must be (1, H)"),
        "positions": (dict(positions=case.positions.int()), "positions must be int64"),
        "norm2": (dict(norm2=case.norm2[:1]), "norm2 must hold 2 tensors"),
        "qweight": (dict(qweight=[case.qweight[0][:-1]] + case.qweight[1:]), "qweight[0]"),
        "scales": (dict(scales=case.scales[:3] + [case.scales[3].float()] + case.scales[4:]), "scales[3]"),
        "qzeros": (dict(qzeros=case.qzeros[:5] + [None] + case.qzeros[6:]), "qzeros[5]"),
        "k_cache": (dict(k_cache=case.k_cache[:1] + [case.k_cache[1][:, :, :8]]), "k_cache[1]"),
        "group_size": (dict(group_size=64), "group_size must be a multiple of 128"),
        "workspace": (dict(workspace=torch.zeros(64, dtype=torch.uint8)), "workspace must be uint8"),
        "workspace-strided": (dict(workspace=workspace(case.dims).repeat_interleave(2)[::2]), "workspace must be 1-D and contiguous"),
        "num_kv_heads": (dict(num_kv_heads=4), "num_kv_heads"),
    }
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else None
    for name, (change, msg) in bad.items():
        args = _bad(case, **change)
        if mode is not None:
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                    [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list) else a for a in args]
            with mode, pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(msg)):
                OP(*args)
        else:
            with pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(msg)):
                OP(*args)


def test_a_misaligned_workspace_is_refused():
    case = make_case(SMALL, dtype=torch.bfloat16)
    ws = workspace(case.dims)
    shifted = torch.empty(ws.numel() + 8, dtype=torch.uint8)[8:]
    with pytest.raises(ValueError, match=re.escape("workspace must start at a 16-byte aligned address, got one 8 bytes past it")):
        OP(*_bad(case, workspace=shifted))


def decode_layers_samples() -> dict:
    """opcheck samples (caches without NaN: opcheck compares the mutated caches across runs)."""
    out = {}
    for name, dtype, zeros in (("fp16-zeros", torch.float16, True), ("bf16-symmetric", torch.bfloat16, False)):
        case = make_case(LK.Dims(layers=1, hidden=128, inter=128, heads=2, kv_heads=1, head_dim=64), dtype=dtype, pos=3, zeros=zeros)
        for t in case.k_cache + case.v_cache:
            t.nan_to_num_(0.0)
        out[name] = case.args(workspace(case.dims))
    return out


# For tests/test_opcheck.py (SAMPLES.update(OPCHECK_SAMPLES)): every qops op needs samples there.
OPCHECK_SAMPLES = {"decode_layers": decode_layers_samples}


def _model(scheme="gptq", dtype=torch.bfloat16, seed=0):
    cfg = LlamaConfig.tiny()
    return LlamaForCausalLM.random(cfg, scheme, dtype=dtype, max_batch=4, max_seq=24, seed=seed)


@pytest.mark.parametrize("scheme", ["gptq", "awq"])
def test_model_batch1_through_the_op_matches_layer_by_layer(scheme):
    a, b = _model(scheme), _model(scheme)
    b.use_layer_kernel()
    tokens = torch.tensor([7])
    for p in range(6):
        pos = torch.tensor([p])
        la, lb = a.decode(tokens, pos), b.decode(tokens, pos)
        assert relative_error(lb, la) < 1e-2, p
        tokens = la.argmax(-1)
    # Batch 2 keeps the layer-by-layer path (fresh caches: the ones above differ by rounding).
    c, d = _model(scheme), _model(scheme)
    d.use_layer_kernel()
    t2, p2 = torch.tensor([1, 2]), torch.tensor([0, 0])
    assert torch.equal(c.decode(t2, p2), d.decode(t2, p2))


def test_model_layer_op_compiles_fullgraph_without_recompiles():
    from qops.models import compile_decode

    torch._dynamo.reset()
    eager, m = _model(), _model()
    m.use_layer_kernel()
    step = compile_decode(m, cuda_graphs=False, dynamic_batch=False)
    tokens = torch.tensor([5])
    with torch._dynamo.config.patch(error_on_recompile=False):
        first = step(tokens, torch.tensor([0]))
    assert relative_error(first, eager.decode(tokens, torch.tensor([0]))) < 1e-2
    with torch.compiler.set_stance("fail_on_recompile"):
        for p in range(1, 5):
            got = step(tokens, torch.tensor([p]))
            assert relative_error(got, eager.decode(tokens, torch.tensor([p]))) < 1e-2
    torch._dynamo.reset()


def test_model_refusals_name_the_layer():
    m = LlamaForCausalLM.random(LlamaConfig.tiny(), "fp8", dtype=torch.bfloat16, max_batch=2, max_seq=8)
    assert "layer 0 qkv_proj" in m.layer_kernel_refusal()
    with pytest.raises(ValueError, match="use_layer_kernel: layer 0 qkv_proj"):
        m.use_layer_kernel()
    dense = LlamaForCausalLM.random(LlamaConfig.tiny(), None, dtype=torch.bfloat16, max_batch=2, max_seq=8)
    assert "not an integer-weight layer" in dense.layer_kernel_refusal()


def test_native_refusal_on_cpu_says_why():
    case = make_case(SMALL, dtype=torch.bfloat16)
    why = LK.native_refusal(case.dims, case.hidden, case.cos, case.sin, case.qweight, case.scales, case.qzeros, case.k_cache, case.v_cache)
    assert why is not None and "not a CUDA device" in why


def test_scratch_floats_cover_every_block():
    """The kernel's per-block column-group count (scratch rows) is the largest any block meets."""
    d = LK.Dims(layers=1, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    ncg, floats = LK._scratch_floats(d, 132)
    assert ncg == max(
        (i1 - 1) // c - i0 // c + 1
        for g, c, _ in LK._projection_shapes(d)
        for b in range(132)
        for i0, i1 in [(g * c * b // 132, g * c * (b + 1) // 132)] if i1 > i0)
    assert floats >= 8 * ncg * 64 and ncg <= 64


@pytest.mark.parametrize("preferred", [LK.GridShape(2, 8), LK.GridShape(1, 16)])
def test_grid_shape_rule(preferred, monkeypatch):
    """The preferred shape; 16 warps an SM only where the attention's per-lane arrays fit 128 registers
    (GQ x D <= 512), else one block of 8, with a reason."""
    llama3 = LK.Dims(layers=1, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    monkeypatch.setattr(LK, "PREFERRED_SHAPE", LK.EIGHT_WARPS)
    assert LK.grid_shape_wanted(llama3)[0] == LK.EIGHT_WARPS
    monkeypatch.setattr(LK, "PREFERRED_SHAPE", preferred)
    assert LK.grid_shape_wanted(llama3)[0] == preferred
    assert LK.grid_shape_wanted(LK.Dims(1, 512, 1536, 8, 1, 64))[0] == preferred
    shape, why = LK.grid_shape_wanted(LK.Dims(1, 4096, 14336, 64, 8, 128))
    assert shape == LK.EIGHT_WARPS and "GQ x head_dim = 1024" in why
    defines = LK.build_defines(llama3, torch.bfloat16, torch.bfloat16, True, preferred.blocks_per_sm, preferred.warps)
    assert (defines["QOPS_BPS"], defines["QOPS_WARPS"]) == (preferred.blocks_per_sm, preferred.warps)
    assert preferred.threads == 32 * preferred.warps


def test_scratch_holds_every_warps_partials():
    """Scratch grows with the warps of a block: their column-group partials and attention partials."""
    d = LK.Dims(layers=1, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    ncg8, f8 = LK._scratch_floats(d, 132, 8)
    ncg16, f16 = LK._scratch_floats(d, 132, 16)
    assert ncg8 == ncg16 and f8 >= 8 * ncg8 * 64 and f16 >= 16 * ncg16 * 64 and f16 >= 16 * 4 * 130


# sm_80: ptxas spills ~60 bytes in project at two blocks (not the default; measured on sm_90 only)
@pytest.mark.parametrize("arch", ["sm_90"])
@pytest.mark.parametrize("shape", [LK.GridShape(2, 8), LK.GridShape(1, 16)], ids=["two_blocks_of_8", "one_block_of_16"])
def test_sixteen_warp_builds_fit_128_registers_with_at_most_a_word_spilled(arch, shape):
    """The rule's edge (GQ 4 x D 128, Llama-3-8B): ptxas gives both 16-warp builds <= 128 registers, at
    most one spilled word in project (a value kept across its weight loop; more would cost the loop what the
    second block buys), none in the attention, and a few bytes in the kernel's own body (its per-layer
    state, outside the loops)."""
    from qops.native import compiler

    if compiler.runtime_missing() is not None:
        pytest.skip(compiler.runtime_missing())
    llama3 = LK.Dims(layers=1, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128)
    opts = compiler.native_options(LK.build_defines(llama3, torch.bfloat16, torch.bfloat16, True, shape.blocks_per_sm, shape.warps))
    opts["ptxas_options"] = ["-v"]
    log: list = []
    compiler.compile(compiler.native_source(LK.SOURCE), arch, opts, log=log)
    text = "\n".join(str(x) for x in log)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    assert regs and max(regs) <= 128, text
    spills = dict(re.findall(r"Function properties for (\S+)\s+ptxas\s+\.\s+\d+ bytes stack frame, \d+ bytes spill stores, (\d+) bytes spill loads", text))
    loops = {name: int(n) for name, n in spills.items() if "project" in name or "attention" in name}
    assert len(loops) == 2, text
    assert all(n <= (16 if "project" in name else 0) for name, n in loops.items()), text
    assert int(spills[LK.KERNEL]) <= 64, text


def test_workspace_header_holds_zeroed_counters_then_the_address_table():
    """What every native call copies to the workspace's head (built on the CPU here)."""
    case = make_case(SMALL, dtype=torch.float16)
    lay = LK.workspace_layout(SMALL)
    table = LK._addresses(SMALL, case.qweight, case.scales, case.qzeros, case.norm1, case.norm2, case.k_cache, case.v_cache)
    assert len(table) == LK.TABLE_WORDS * SMALL.layers
    assert table[:4] == tuple(t.data_ptr() for t in case.qweight[:4]) and table[12] == case.norm1[0].data_ptr()
    assert table[15] == case.v_cache[0].data_ptr() and table[16] == case.qweight[4].data_ptr()
    header = LK._workspace_header(lay, table, pin=False)
    assert header.numel() == lay["table"] + 8 * len(table) and not header[:lay["ctr_bytes"]].any()
    words = header[lay["table"]:].view(torch.int64)
    assert [w & (2**64 - 1) for w in words.tolist()] == list(table)


def test_probe_stamp_spans_from_hand_written_stamps(monkeypatch):
    """``benchmarks/probe_layer_kernel.stamp_spans`` (the phase table of benchmarks/NOTES.md stop 46) on
    hand-written stamps: two blocks, each phase boundary 1 us after the last, block 1 ending 0.5 us later."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import probe_layer_kernel as plk

    n = len(plk.STAMP_POINTS)
    offset = 256
    ws = torch.zeros(offset + 8 * LK.STAMPS * LK.MAX_STAMP_BLOCKS, dtype=torch.uint8)
    words = ws[offset:].view(torch.int64).view(LK.MAX_STAMP_BLOCKS, LK.STAMPS)
    words[0, :n] = 10_000 + 1000 * torch.arange(n)
    words[1, :n] = 10_000 + 1000 * torch.arange(n)
    words[1, n - 1] += 500  # block 1's last span is 1.5 us
    spans = plk.stamp_spans(ws, offset, torch, LK.MAX_STAMP_BLOCKS, LK.STAMPS)
    assert len(spans) == n and spans[0]["what"] == "start -> norm1 staged"
    assert spans[0] == {"what": "start -> norm1 staged", "median_us": 1.0, "max_us": 1.0, "end_spread_us": 0.0}
    assert spans[n - 2]["max_us"] == 1.5 and spans[n - 2]["end_spread_us"] == 0.5
    assert spans[-1]["what"].startswith("layer") and spans[-1]["max_us"] == (n - 1) + 0.5


def test_model_with_a_group_size_the_op_refuses_fails_at_use_layer_kernel():
    """GPTQ with groups of 64: every layer qualifies by kind, the op's own check refuses the group size."""
    import dataclasses

    from qops.formats import FORMATS
    from qops.models.checkpoint import get_scheme

    def write64(w):
        c = FORMATS["gptq"].quantize(w, bits=4, group_size=64, sym=False, version="v2")
        return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales, "g_idx": c.g_idx}

    base = get_scheme("gptq")
    scheme = dataclasses.replace(base, config={**base.config, "group_size": 64}, write=write64)
    m = LlamaForCausalLM.random(LlamaConfig.tiny(), scheme, dtype=torch.bfloat16, max_batch=2, max_seq=8)
    assert m.layers[0].self_attn.qkv_proj.linear.group_size == 64 and m.layer_kernel_refusal() is None
    with pytest.raises(ValueError, match="use_layer_kernel: .*group_size must be a multiple of 128"):
        m.use_layer_kernel()
    assert m._layer_args is None
