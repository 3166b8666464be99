"""torch.export of a module holding a layer of every registered checkpoint type (compile_tests/
test_compile_layers.py's ``AllLayers``), the batch dimension dynamic: the exported program keeps each
quantized linear as one ``torch.ops.qops`` call (nothing decomposed, no weight dequantized), survives
``torch.export.save`` / ``load``, and gives the eager numbers at batch sizes other than the traced one.
Other frameworks that take models as exported programs rely on this."""
from __future__ import annotations

import io
from collections import Counter

import torch

import qops  # noqa: F401
from compile_tests.harness import fresh_dynamo  # noqa: F401  (autouse fixture)
from compile_tests.test_compile_layers import K, AllLayers


def _qops_calls(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("qops."))


def test_every_layer_kind_exports_with_a_dynamic_batch_and_round_trips():
    model = AllLayers().eval()
    batch = torch.export.Dim("batch", min=1, max=256)
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randn(3, K),), dynamic_shapes={"x": {0: batch}})
    calls = _qops_calls(ep.graph_module)
    assert calls == Counter({"qops.mm_int_weight.default": 4, "qops.mm_fp8_weight.default": 2, "qops.mm_int8_weight.default": 2,
                             "qops.mm_blockwise4.default": 1}), calls
    assert not any("dequantize" in str(n.target) for n in ep.graph.nodes)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    for b in (1, 17, 256):
        x = torch.randn(b, K, generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            want, got = model(x), loaded(x)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
