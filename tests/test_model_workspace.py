"""The model's scratch (``qops.workspace``): one registered, non-persistent uint8 buffer, sized once
from the layers' lowerings (the largest need of any layer for any M up to the model's max batch),
never grown; and the ``_out`` ops take it in place under torch.compile (no copy of the buffer)."""
from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import qops  # noqa: F401
from qops import workspace as ws_mod
from qops.formats import FORMATS
from qops.layers import QuantLinear
from qops.models import LlamaConfig, LlamaForCausalLM
from qops.workspace import ALIGN, SCRATCH_BYTES, Workspace, WorkspaceTooSmall, layer_scratch_bytes

CONFIG = LlamaConfig.tiny()


def test_size_functions_name_real_lowerings():
    from qops.lowerings import LOWERINGS_BY_NAME

    assert set(SCRATCH_BYTES) <= set(LOWERINGS_BY_NAME)


def test_reference_lowerings_need_no_scratch():
    model = LlamaForCausalLM.random(CONFIG, "gptq", dtype=torch.float32, max_batch=4, max_seq=8, process_group=None)
    assert model.workspace.nbytes == 0
    assert len(model.workspace.needs) == 4 * CONFIG.num_hidden_layers and not any(model.workspace.needs.values())
    assert "workspace.buffer" in dict(model.named_buffers())
    assert not any("workspace" in k for k in model.state_dict())


def test_sized_from_the_largest_need_of_any_layer_and_batch(monkeypatch):
    calls = []

    def need(layer, m, device):
        calls.append(m)
        return 4 * m * layer.out_features + 1 if layer.out_features > 256 else 0  # fused qkv (512) and gate_up (512)

    monkeypatch.setitem(SCRATCH_BYTES, "reference_int_weight", need)
    monkeypatch.setattr(ws_mod, "_NEEDS", {})
    model = LlamaForCausalLM.random(CONFIG, "gptq", dtype=torch.float32, max_batch=6, max_seq=8, process_group=None)
    want = 4 * 6 * 2 * CONFIG.intermediate_size + 1  # gate_up at M = 6
    assert model.workspace.nbytes == -(-want // ALIGN) * ALIGN
    assert max(calls) == 6 and min(calls) == 1
    assert model.workspace.needs["layers.0.mlp.gate_up_proj.linear"] == want
    assert model.workspace.needs["layers.0.self_attn.o_proj.linear"] == 0
    model.workspace.check(model)
    ptr = model.workspace.buffer.data_ptr()
    assert model.workspace.take(want).numel() == want and model.workspace.buffer.data_ptr() == ptr
    with pytest.raises(WorkspaceTooSmall, match="sized for M <= 6"):
        model.workspace.take(model.workspace.nbytes + 1)
    # A workspace too small for the model is an error, never a reallocation.
    with pytest.raises(WorkspaceTooSmall, match=r"qkv_proj.linear \(reference_int_weight\) needs 12289 bytes for M <= 6, 3072 held"):
        Workspace(want // 4, max_m=6).check(model)
    assert layer_scratch_bytes(model.layers[0].mlp.gate_up_proj.linear, 6, torch.device("cpu")) == want


def test_moves_with_the_model():
    w = Workspace(1000, max_m=2)
    assert w.nbytes == 1024 and w.buffer.dtype == torch.uint8
    m = torch.nn.Module()
    m.workspace = w
    m.to(torch.float16)  # dtype casts leave integer buffers alone
    assert m.workspace.buffer.dtype == torch.uint8


class _OutLinear(torch.nn.Module):
    """What a quantized layer wired to the model's workspace would run: the ``_out`` op with the
    shared buffer (a buffer of a submodule, hence a static input for cudagraph trees)."""

    def __init__(self, linear, workspace):
        super().__init__()
        self.linear, self.workspace = linear, workspace

    def forward(self, x):
        lin = self.linear
        out = x.new_empty(*x.shape[:-1], lin.out_features)
        torch.ops.qops.mm_int_weight_out(x, lin.qweight, lin.scales, lin.qzeros, lin.act_perm, lin.bias, lin.in_features, lin.bits,
                                         lin.group_size, lin.zero_offset, lin.kernel, out, self.workspace.buffer)
        return out


def test_out_op_takes_the_workspace_in_place_under_compile():
    torch._dynamo.reset()
    ckpt = FORMATS["gptq"].quantize(torch.randn(256, 128), bits=4, group_size=128, sym=False)
    module = _OutLinear(QuantLinear.from_checkpoint(ckpt, dtype=torch.float32), Workspace(4096, max_m=4))
    x = torch.randn(3, 128)
    with torch.no_grad():
        got, (code,) = run_and_get_code(torch.compile(module, fullgraph=True), x)
        torch.testing.assert_close(got, module.linear(x))
    calls = [line for line in code.splitlines() if "torch.ops.qops.mm_int_weight_out.default(" in line]
    assert len(calls) == 1
    # The buffer goes to the op as the graph input it is: not cloned, not copied back.
    assert "clone" not in code and "copy_" not in code
