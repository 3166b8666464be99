"""torch.library.opcheck on every op registered under ``torch.ops.qops``, on several inputs each.

``SAMPLES`` maps each op name to a function returning named argument tuples. A newly registered op
without an entry fails ``test_every_registered_op_has_samples``: add its samples here.
"""
from __future__ import annotations

import pytest
import torch

import qops  # noqa: F401  (registers the ops)

from tests.int_weight_cases import Case, build

TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _weights():
    # sym without act-order (no qzeros, no act_perm); v1 asym act-order 3-bit with zeros up to 2**b
    # (zero_offset 1) and a partial last group; AWQ; compressed-tensors int8 act-order.
    specs = {
        "gptq4sym": Case("gptq", 4, 32, True, False, "v2", 24, 72),
        "gptq3v1act": Case("gptq", 3, 32, False, True, "v1", 24, 100),
        "awq": Case("awq", 4, 64, False, False, None, 16, 136),
        "ct8act": Case("compressed-tensors", 8, 32, False, True, None, 8, 72),
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
            out[f"{name}-{vname}"] = (x, *_weight_args(w), bias, *_static(w), int(w.kernel))
    return out


def mm_int_weight_out_samples():
    ws = _weights()
    g = torch.Generator().manual_seed(1)
    out = {}
    for name in ("gptq4sym", "gptq3v1act", "ct8act"):
        w = ws[name]
        k, n = w.in_features, w.out_features
        variants = {
            "fp32-workspace-bias": (torch.randn(5, k, generator=g), torch.randn(n, generator=g), torch.empty(256, dtype=torch.uint8)),
            "fp16-3d-grad": (torch.randn(2, 3, k, generator=g).half().requires_grad_(), None, None),
        }
        for vname, (x, bias, workspace) in variants.items():
            o = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
            out[f"{name}-{vname}"] = (x, *_weight_args(w), bias, *_static(w), int(w.kernel), o, workspace)
    return out


def dequantize_int_weight_samples():
    ws = _weights()
    out = {}
    for name, dtype in (("gptq4sym", torch.float32), ("gptq3v1act", torch.float16), ("awq", torch.bfloat16), ("ct8act", torch.float32)):
        w = ws[name]
        out[f"{name}-{str(dtype)[6:]}"] = (*_weight_args(w), w.in_features, *_static(w), dtype)
    return out


SAMPLES = {
    "mm_int_weight": mm_int_weight_samples,
    "mm_int_weight_out": mm_int_weight_out_samples,
    "dequantize_int_weight": dequantize_int_weight_samples,
}


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


def test_samples_include_requires_grad_inputs():
    grads = [name for name, make in SAMPLES.items()
             if any(isinstance(a, torch.Tensor) and a.requires_grad for args in make().values() for a in args)]
    assert {"mm_int_weight", "mm_int_weight_out"} <= set(grads)
