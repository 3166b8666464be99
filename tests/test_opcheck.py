"""torch.library.opcheck on every op registered under ``torch.ops.qops``, on several inputs each.

``SAMPLES`` maps each op name to a function returning named argument tuples. A newly registered op
without an entry fails ``test_every_registered_op_has_samples``: add its samples here.
"""
from __future__ import annotations

import pytest
import torch

import qops  # noqa: F401  (registers the ops)

from tests.bnb_cases import OPCHECK_SAMPLES as BNB_OPCHECK_SAMPLES
from tests.test_add_rmsnorm import OPCHECK_SAMPLES as NORM_OPCHECK_SAMPLES
from tests.test_decode_attention import OPCHECK_SAMPLES as ATTENTION_OPCHECK_SAMPLES
from tests.test_layer_kernel import OPCHECK_SAMPLES as LAYERS_OPCHECK_SAMPLES
from tests.int_weight_cases import Case, build, one_thread  # noqa: F401  (one_thread: autouse fixture)

TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _weights():
    # sym without act-order (no qzeros, no act_perm); v1 asym act-order 3-bit with zeros up to 2**b
    # (zero_offset 1) and a partial last group; AWQ; compressed-tensors int8 act-order. The "g128"
    # ones are what native_w4a16 serves (4-bit, groups of 128; fp16/bf16 x): GPTQ v1 act-order and
    # compressed-tensors act-order with a partial last group, AWQ.
    specs = {
        "gptq4sym": Case("gptq", 4, 32, True, False, "v2", 24, 72),
        "gptq3v1act": Case("gptq", 3, 32, False, True, "v1", 24, 100),
        "gptq4g128act": Case("gptq", 4, 128, False, True, "v1", 20, 200),
        "awq": Case("awq", 4, 64, False, False, None, 16, 136),
        "awq4g128": Case("awq", 4, 128, False, False, None, 16, 256),
        "ct8act": Case("compressed-tensors", 8, 32, False, True, None, 8, 72),
        "ct4g128act": Case("compressed-tensors", 4, 128, True, True, None, 12, 264),
    }
    return {name: build(case).weight for name, case in specs.items()}


def _weight_args(w):
    return (w.qweight, w.scales, w.qzeros, w.act_perm)


def _static(w):
    return (w.bits, w.group_size, w.zero_offset)


def mm_int_weight_samples():
    ws = _weights()
    assert ws["gptq3v1act"].zero_offset == 1 and ws["gptq3v1act"].act_perm is not None
    assert ws["gptq4sym"].qzeros is None
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, w in ws.items():
        k, n = w.in_features, w.out_features
        variants = {
            "fp32-grad-bias-grad": (torch.randn(5, k, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()),
            "fp16-3d-grad": (torch.randn(2, 3, k, generator=g).half().requires_grad_(), None),
            "bf16-m1-bias": (torch.randn(1, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()),
        }
        if name == "gptq3v1act":
            variants["fp32-m0-grad"] = (torch.randn(0, k, generator=g).requires_grad_(), None)
            variants["fp32-transposed-grad-frozen-bias"] = (torch.randn(k, 4, generator=g).t().requires_grad_(), torch.randn(n, generator=g))
        for vname, (x, bias) in variants.items():
            out[f"{name}-{vname}"] = (x, *_weight_args(w), bias, w.in_features, *_static(w), int(w.kernel))
    return out


def mm_int_weight_out_samples():
    ws = _weights()
    g = torch.Generator().manual_seed(1)
    out = {}
    for name in ("gptq4sym", "gptq3v1act", "gptq4g128act", "awq4g128", "ct8act", "ct4g128act"):
        w = ws[name]
        k, n = w.in_features, w.out_features
        variants = {
            "fp32-workspace-bias": (torch.randn(5, k, generator=g), torch.randn(n, generator=g), torch.empty(256, dtype=torch.uint8)),
            "fp16-3d": (torch.randn(2, 3, k, generator=g).half(), None, None),
        }
        for vname, (x, bias, workspace) in variants.items():
            o = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
            out[f"{name}-{vname}"] = (x, *_weight_args(w), bias, w.in_features, *_static(w), int(w.kernel), o, workspace)
    return out


def mm_int_weight_swiglu_samples():
    ws = _weights()
    g = torch.Generator().manual_seed(2)
    out = {}
    for name in ("gptq4sym", "gptq3v1act", "gptq4g128act", "awq4g128", "ct4g128act"):
        w = ws[name]
        k = w.in_features
        variants = {
            "fp32-grad": torch.randn(5, k, generator=g).requires_grad_(),
            "fp16-3d-grad": torch.randn(2, 3, k, generator=g).half().requires_grad_(),
            "bf16-m1": torch.randn(1, k, generator=g).bfloat16(),
        }
        if name == "gptq3v1act":
            variants["fp32-m0-grad"] = torch.randn(0, k, generator=g).requires_grad_()
        for vname, x in variants.items():
            out[f"{name}-{vname}"] = (x, *_weight_args(w), w.in_features, *_static(w), int(w.kernel))
    return out


def mm_int_weight_swiglu_out_samples():
    ws = _weights()
    g = torch.Generator().manual_seed(3)
    out = {}
    for name in ("gptq4sym", "gptq4g128act", "awq4g128", "ct4g128act"):
        w = ws[name]
        k, h = w.in_features, w.out_features // 2
        for vname, (x, workspace) in {
            "fp32-workspace": (torch.randn(5, k, generator=g), torch.empty(256, dtype=torch.uint8)),
            "fp16-3d": (torch.randn(2, 3, k, generator=g).half(), None),
        }.items():
            o = torch.empty(*x.shape[:-1], h, dtype=x.dtype)
            out[f"{name}-{vname}"] = (x, *_weight_args(w), w.in_features, *_static(w), int(w.kernel), o, workspace)
    return out


def dequantize_int_weight_samples():
    ws = _weights()
    out = {}
    for name, dtype in (("gptq4sym", torch.float32), ("gptq3v1act", torch.float16), ("awq", torch.bfloat16), ("ct8act", torch.float32)):
        w = ws[name]
        out[f"{name}-{str(dtype)[6:]}"] = (*_weight_args(w), w.in_features, *_static(w), dtype)
    return out


def _fp8_weights():
    from qops.formats.fp8 import quantize_rtn
    from qops.ops.fp8 import prepare_fp8_weight

    g = torch.Generator().manual_seed(2)
    # (N, K) off every tile grid; the "16" pair meets torch._scaled_mm's multiples of 16 and "block128"
    # (DeepSeek's 128 x 128 blocks, two along K) F.scaled_mm's block recipe (the GPU suite's scaled_mm_fp8
    # lowering serves only those).
    specs = {"tensor": ("tensor", None, (40, 72)), "channel": ("channel", None, (40, 72)), "block": ("block", (16, 32), (40, 72)),
             "tensor16": ("tensor", None, (48, 64)), "channel16": ("channel", None, (48, 64)),
             "block128": ("block", (128, 128), (128, 256))}
    return {name: prepare_fp8_weight(quantize_rtn(torch.randn(*shape, generator=g), gran, block or (128, 128)), activations="none")
            for name, (gran, block, shape) in specs.items()}


def _fp8_static(w):
    return (w.weight, w.weight_scale)


def mm_fp8_weight_samples():
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, w in _fp8_weights().items():
        k, n = w.in_features, w.out_features
        variants = {
            "fp32-grad-bias-grad": (torch.randn(5, k, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()),
            "fp16-3d-grad": (torch.randn(2, 3, k, generator=g).half().requires_grad_(), None),
            "bf16-m1-bias": (torch.randn(1, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()),
        }
        if name == "block":
            variants["fp32-m0-grad"] = (torch.randn(0, k, generator=g).requires_grad_(), None)
            variants["fp32-transposed-grad"] = (torch.randn(k, 4, generator=g).t().requires_grad_(), torch.randn(n, generator=g))
        for vname, (x, bias) in variants.items():
            out[f"{name}-{vname}"] = (x, *_fp8_static(w), bias, w.block_n, w.block_k, int(w.kernel))
    return out


def mm_fp8_weight_out_samples():
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, w in _fp8_weights().items():
        k, n = w.in_features, w.out_features
        variants = {
            "fp32-workspace-bias": (torch.randn(5, k, generator=g), torch.randn(n, generator=g), torch.empty(256, dtype=torch.uint8)),
            "fp16-3d": (torch.randn(2, 3, k, generator=g).half(), None, None),
        }
        if name == "block":
            variants["bf16-m0-workspace"] = (torch.randn(0, k, generator=g).bfloat16(), None, torch.empty(0, dtype=torch.uint8))
        for vname, (x, bias, workspace) in variants.items():
            o = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
            out[f"{name}-{vname}"] = (x, *_fp8_static(w), bias, w.block_n, w.block_k, int(w.kernel), o, workspace)
    return out


def scaled_mm_fp8_samples():
    from qops.ops.fp8 import quantize_fp8_activations

    g = torch.Generator().manual_seed(4)
    out = {}
    for name, w in _fp8_weights().items():
        k, n = w.in_features, w.out_features
        x = torch.randn(2, 3, k, generator=g)
        per_token = quantize_fp8_activations(x)
        per_tensor = quantize_fp8_activations(x, torch.tensor([0.02]))
        variants = {
            "per-token-fp16-bias-grad": (*per_token, torch.randn(n, generator=g).half().requires_grad_(), torch.float16),
            "per-tensor-fp32": (*per_tensor, None, torch.float32),
            "per-token-m0-bf16-bias": (*quantize_fp8_activations(torch.randn(0, k)), torch.randn(n, generator=g), torch.bfloat16),
            # one scale per token and 128 K values: (2, 3, ceil(K/128))
            "per-group-bf16-bias-grad": (*quantize_fp8_activations(x, group_size=128), torch.randn(n, generator=g).bfloat16().requires_grad_(),
                                         torch.bfloat16),
            "per-group-fp16": (*quantize_fp8_activations(x, group_size=128), None, torch.float16),
        }
        for vname, (x_fp8, x_scale, bias, out_dtype) in variants.items():
            out[f"{name}-{vname}"] = (x_fp8, x_scale, *_fp8_static(w), bias, w.block_n, w.block_k, out_dtype, int(w.kernel))
    return out


def dequantize_fp8_samples():
    samples = {f"{name}-{str(dtype)[6:]}": (*_fp8_static(w), w.block_n, w.block_k, dtype)
               for (name, w), dtype in zip(_fp8_weights().items(), (torch.float32, torch.float16, torch.bfloat16))}
    # A column-major weight (the op takes any strides): the result is row-major, as the fake says.
    name, w = next(iter(_fp8_weights().items()))
    weight, scale = _fp8_static(w)
    samples[f"{name}-column-major"] = (weight.t().contiguous().t(), scale, w.block_n, w.block_k, torch.float32)
    return samples


SAMPLES = {
    "mm_int_weight": mm_int_weight_samples,
    "mm_int_weight_out": mm_int_weight_out_samples,
    "mm_int_weight_swiglu": mm_int_weight_swiglu_samples,
    "mm_int_weight_swiglu_out": mm_int_weight_swiglu_out_samples,
    "dequantize_int_weight": dequantize_int_weight_samples,
    "mm_fp8_weight": mm_fp8_weight_samples,
    "mm_fp8_weight_out": mm_fp8_weight_out_samples,
    "scaled_mm_fp8": scaled_mm_fp8_samples,
    "dequantize_fp8": dequantize_fp8_samples,
}
SAMPLES.update(BNB_OPCHECK_SAMPLES)
SAMPLES.update(ATTENTION_OPCHECK_SAMPLES)
SAMPLES.update(NORM_OPCHECK_SAMPLES)
SAMPLES.update(LAYERS_OPCHECK_SAMPLES)


@pytest.fixture(autouse=True)
def _float8_comparable(monkeypatch):
    """opcheck's test_schema compares every tensor an op (and its kernel) touches before and after
    with ``torch.allclose``, which has no float8 kernel on CPU: compare float8 tensors bit for bit."""
    allclose = torch.allclose

    def fp8_aware(a, b, *args, **kwargs):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", fp8_aware)


def registered_ops() -> dict[str, torch._ops.OpOverload]:
    """Every overload of every op in the qops namespace, keyed ``name.overload``."""
    out = {}
    for qualname in torch._C._dispatch_get_all_op_names():
        ns, _, rest = qualname.partition("::")
        if ns != "qops":
            continue
        name = rest.split(".")[0]
        packet = getattr(torch.ops.qops, name)
        for overload in packet.overloads():
            out[f"{name}.{overload}"] = getattr(packet, overload)
    return out


def test_every_registered_op_has_samples():
    ops = registered_ops()
    assert {"mm_int_weight.default", "mm_int_weight_out.default", "dequantize_int_weight.default"} <= set(ops)
    missing = sorted(k for k in ops if k.split(".")[0] not in SAMPLES)
    assert not missing, f"ops without opcheck samples (add them to SAMPLES in tests/test_opcheck.py): {missing}"
    stale = sorted(set(SAMPLES) - {k.split(".")[0] for k in ops})
    assert not stale, f"SAMPLES names ops that are not registered: {stale}"


def _params():
    params = []
    for name, make in SAMPLES.items():
        for sample_id, args in make().items():
            params.append(pytest.param(name, args, id=f"{name}-{sample_id}"))
    return params


@pytest.mark.parametrize("name,args", _params())
def test_opcheck(name, args):
    packet = getattr(torch.ops.qops, name)
    for overload in packet.overloads():
        result = torch.library.opcheck(getattr(packet, overload), args, test_utils=TEST_UTILS)
        assert result == {t: "SUCCESS" for t in TEST_UTILS}, result


OUT_OPS = {"mm_int_weight_out": "mm_int_weight", "mm_int_weight_swiglu_out": "mm_int_weight_swiglu",
           "mm_fp8_weight_out": "mm_fp8_weight", "mm_int8_weight_out": "mm_int8_weight", "mm_blockwise4_out": "mm_blockwise4"}


def _requires_grad(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def test_samples_include_requires_grad_inputs():
    grads = {name for name, make in SAMPLES.items() if any(_requires_grad(args) for args in make().values())}
    assert {"mm_int_weight", "mm_int_weight_swiglu", "mm_fp8_weight", "mm_int8_weight", "mm_blockwise4", "scaled_mm_fp8"} <= grads
    # The _out ops refuse such inputs (test below): their samples are the calls they serve.
    assert not grads & set(OUT_OPS)


def _grad_call(name: str, sample: tuple, which: str) -> tuple:
    """``sample`` with x (``which`` "x"), or bias / out, made to require grad."""
    args = list(sample)
    names = [a.name for a in getattr(torch.ops.qops, name).default._schema.arguments]
    i = names.index(which)
    args[i] = args[i].detach().clone().requires_grad_()
    return tuple(args)


@pytest.mark.parametrize("name", sorted(OUT_OPS))
def test_out_ops_refuse_gradients_and_overlapping_buffers(name):
    """An _out op records no autograd (torch.library has none for ops that write their arguments): an
    argument requiring grad in grad mode would leave out silently without a gradient, so it is refused
    by name, eagerly and when torch.compile traces it; under no_grad / inference_mode, or detached, the
    call runs and writes out. An out carved from x or from the workspace is refused (the CUDA kernels
    would write it while reading them)."""
    op = getattr(torch.ops.qops, name)
    sample_id, sample = next((sid, args) for sid, args in SAMPLES[name]().items() if "bias" in sid or name == "mm_int_weight_swiglu_out")
    names = [a.name for a in op.default._schema.arguments]
    whiches = ["x", "out"] + (["bias"] if "bias" in names and sample[names.index("bias")] is not None else [])
    for which in whiches:
        args = _grad_call(name, sample, which)
        with pytest.raises(RuntimeError, match=rf"qops\.{name}: {which} requires grad, .* call qops::{OUT_OPS[name]} to differentiate"):
            op(*args)

        def traced(*a):
            op(*a)
            return a[names.index("out")] * 1

        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"qops\.{name}: {which} requires grad"):
            torch.compile(traced, fullgraph=True, backend="aot_eager")(*args)
        out = args[names.index("out")]
        for mode in (torch.no_grad, torch.inference_mode):
            out.detach().fill_(float("nan"))
            with mode():
                op(*args)
            assert out.isfinite().all(), (which, mode)
    # A written argument sharing memory with another: refused on real tensors, naming both.
    args = list(sample)
    x, out = args[0], args[names.index("out")]
    assert out.numel() <= x.numel() and "workspace" in names
    ws = torch.empty(out.numel() * out.element_size() + 64, dtype=torch.uint8)
    aliased = {"x": x.detach().reshape(-1)[:out.numel()].view(out.shape), "workspace": ws[64:].view(out.dtype).view(out.shape)}
    for other, view in aliased.items():
        args = list(sample)
        args[names.index("out")] = view
        if other == "workspace":
            args[names.index("workspace")] = ws
        for mode in (torch.enable_grad, torch.inference_mode):  # inference mode skips the autograd keys: checked in the op
            with mode(), pytest.raises(ValueError, match=rf"qops\.{name}: out shares memory with {other}: "):
                op(*args)
    # The op the message names differentiates the same call.
    args = _grad_call(name, sample, "x")
    getattr(torch.ops.qops, OUT_OPS[name])(*[a for a, n in zip(args, names) if n not in ("out", "workspace")]).float().sum().backward()
    assert args[0].grad is not None and args[0].grad.isfinite().all()


def _random_view(base: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A view of ``base`` (1-d, float32): contiguous runs, column-strided and transposed matrices, a
    broadcast row, an empty slice."""
    kind = int(torch.randint(0, 5, (), generator=gen))
    start = int(torch.randint(0, base.numel() - 64, (), generator=gen))
    if kind == 0:
        return base[start:start + int(torch.randint(1, 64, (), generator=gen))]
    if kind == 1:
        return base[start:start + 60].view(6, 10)[:, ::3]
    if kind == 2:
        return base[start:start + 48].view(8, 6).t()
    if kind == 3:
        return base[start:start + 5].expand(4, 5)
    return base[start:start]


def test_check_disjoint_refuses_exactly_the_overlapping_byte_ranges():
    """check_disjoint (every _out op's aliasing check) against the byte ranges read off the elements'
    own addresses: random views of one buffer, written pairs and written / read pairs; parameters are
    checked like tensors, fake and meta tensors never."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qops.ops._common import check_disjoint

    def span(t):  # [first byte, end) of the elements, from every element's address
        if t.numel() == 0:
            return None
        offsets = torch.as_strided(torch.arange(t.untyped_storage().nbytes() // 4), t.shape, t.stride(), t.storage_offset())
        base = t.untyped_storage().data_ptr()
        return base + 4 * int(offsets.min()), base + 4 * int(offsets.max()) + 4

    def overlap(a, b):
        return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]

    gen = torch.Generator().manual_seed(0)
    base = torch.zeros(512)
    refused = accepted = 0
    for i in range(400):
        out, ws, x = (_random_view(base, gen) for _ in range(3))
        if i % 7 == 0:
            x = torch.nn.Parameter(x, requires_grad=False)
        expected = overlap(span(out), span(ws)) or overlap(span(out), span(x)) or overlap(span(ws), span(x))
        if expected:
            with pytest.raises(ValueError, match="shares memory with"):
                check_disjoint("op", (("out", out), ("workspace", ws)), (("x", x), ("bias", None)))
            refused += 1
        else:
            check_disjoint("op", (("out", out), ("workspace", ws)), (("x", x), ("bias", None)))
            accepted += 1
    assert refused > 50 and accepted > 50, (refused, accepted)
    same = torch.zeros(8)
    check_disjoint("op", (("out", same.to("meta")),), (("x", same.to("meta")),))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(same)
        check_disjoint("op", (("out", fake),), (("x", fake),))


# Where the bias sits among each differentiable op's inputs (x is input 0).
BIAS_INDEX = {"mm_int_weight": 5, "mm_int8_weight": 3, "mm_blockwise4": 7, "mm_fp8_weight": 3}


@pytest.mark.parametrize("name", sorted(BIAS_INDEX))
def test_bias_gradient_is_summed_in_fp32(name):
    """fp16 activations over more rows than an fp16 sum can count (65504): the fp32 bias's gradient of
    a gradient of ones is the row count, not inf."""
    args = list(next(iter(SAMPLES[name]().values())))
    rows, n = 66000, None
    args[0] = torch.zeros(rows, args[0].shape[-1], dtype=torch.float16, requires_grad=True)
    y = getattr(torch.ops.qops, name)(*args[:BIAS_INDEX[name]], None, *args[BIAS_INDEX[name] + 1:])
    n = y.shape[-1]
    bias = torch.zeros(n, requires_grad=True)
    args[BIAS_INDEX[name]] = bias
    y = getattr(torch.ops.qops, name)(*args)
    y.backward(torch.ones_like(y))
    assert bias.grad.dtype == torch.float32 and torch.equal(bias.grad, torch.full((n,), float(rows)))
