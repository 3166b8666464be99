"""The model's scratch (``qops.workspace``): one registered, non-persistent uint8 buffer, sized once
from the layers' lowerings (the largest need of any layer for any M up to the model's max batch),
never grown; attached to every quantized linear, which then calls its family's ``_out`` op with that
buffer; and the ``_out`` ops take it in place under torch.compile (no copy of the buffer)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import qops  # noqa: F401
from qops import workspace as ws_mod
from qops.formats import FORMATS
from qops.layers import QuantLinear
from qops.lowerings import LOWERINGS_BY_NAME
from qops.models import QUANT_SCHEMES, LlamaConfig, LlamaForCausalLM
from qops.workspace import ALIGN, SCRATCH_BYTES, Workspace, WorkspaceTooSmall, attach_workspace, layer_scratch_bytes

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


class _QopsCalls(TorchDispatchMode):
    """Records every ``torch.ops.qops`` call: (op name, args)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qops":
            self.calls.append((func._schema.name.split("::")[1], args))
        return func(*args, **(kwargs or {}))


# The decoder's ops that take no scratch: the attention and the residual add + norm.
NO_SCRATCH = {"decode_attention", "add_rmsnorm"}


def _same_memory(a, b) -> bool:
    return a is not None and b is not None and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _scratch_for_reference_lowerings(monkeypatch):
    """Pretend the CPU reference lowerings split K (4*M*N bytes), so the workspace is not empty."""
    monkeypatch.setattr(ws_mod, "_NEEDS", {})
    for name in ("reference_int_weight", "reference_fp8", "reference_int8_weight", "reference_blockwise4"):
        monkeypatch.setitem(SCRATCH_BYTES, name, lambda layer, m, device: 4 * m * layer.out_features)


@pytest.mark.parametrize("scheme", sorted(QUANT_SCHEMES))
def test_every_layer_kind_hands_the_model_workspace_to_its_out_op(scheme, monkeypatch):
    _scratch_for_reference_lowerings(monkeypatch)
    model = LlamaForCausalLM.random(CONFIG, scheme, seed=2, dtype=torch.float32, max_batch=4, max_seq=8, process_group=None)
    ws = model.workspace
    assert ws.nbytes >= 4 * 4 * 2 * CONFIG.intermediate_size
    layers = model.quantized_linears()
    assert len(layers) == 4 * CONFIG.num_hidden_layers and all(m.workspace is ws for m in layers)
    # A plain reference: the buffer has one owner and one name; nothing of it in the state dict.
    assert [k for k, _ in model.named_buffers() if k.endswith("buffer")] == ["workspace.buffer"]
    assert not any("workspace" in k for k in model.state_dict())
    family = FORMATS[scheme].family
    op = {"int_weight": "mm_int_weight", "fp8": "mm_fp8_weight", "int8_weight": "mm_int8_weight", "blockwise4": "mm_blockwise4"}[family]
    tok, pos = torch.tensor([3, 7, 1]), torch.tensor([0, 0, 0])
    with torch.no_grad():
        with _QopsCalls() as log:
            got = model.decode(tok, pos)
        mm_calls = [(name, args) for name, args in log.calls if name not in NO_SCRATCH]
        # A layer's qkv, o, gate/up and down projections; the gate/up one through the gated op where the family has one.
        gated = f"{op}_swiglu" if family == "int_weight" else op
        per_layer = [f"{op}_out", f"{op}_out", f"{gated}_out", f"{op}_out"]
        assert [name for name, _ in mm_calls] == per_layer * CONFIG.num_hidden_layers
        assert all(args[-1] is ws.buffer for _, args in mm_calls), "every layer passes the model's buffer"
        # The same logits as the allocating ops (the layers without a workspace).
        attach_workspace(model, None)
        with _QopsCalls() as plain:
            want = model.decode(tok, pos)
        assert [name for name, _ in plain.calls if name not in NO_SCRATCH] == [op, op, gated, op] * CONFIG.num_hidden_layers
    assert torch.equal(got, want)


def test_never_reallocated_across_batch_sizes_and_longer_calls_allocate(monkeypatch):
    _scratch_for_reference_lowerings(monkeypatch)
    max_batch = 5
    model = LlamaForCausalLM.random(CONFIG, "gptq", dtype=torch.float32, max_batch=max_batch, max_seq=8, process_group=None)
    buffer, ptr = model.workspace.buffer, model.workspace.buffer.data_ptr()
    with torch.no_grad():
        for b in range(1, max_batch + 1):
            with _QopsCalls() as log:
                model.decode(torch.arange(b), torch.full((b,), b))
            mm_calls = [args for name, args in log.calls if name not in NO_SCRATCH]
            assert all(_same_memory(args[-1], buffer) for args in mm_calls) and mm_calls
            assert model.workspace.buffer is buffer and buffer.data_ptr() == ptr
        # A prefill of B*T = 12 > max_batch rows: the buffer was sized for M <= 5, so the ops get
        # None and their lowering allocates, as a standalone layer's does.
        with _QopsCalls() as log:
            model.prefill(torch.arange(12).view(3, 4))
        mm_calls = [(name, args) for name, args in log.calls if name not in NO_SCRATCH]
        assert {name for name, _ in mm_calls} == {"mm_int_weight_out", "mm_int_weight_swiglu_out"}
        assert all(args[-1] is None for _, args in mm_calls)
    assert model.workspace.buffer is buffer and buffer.data_ptr() == ptr


def test_a_workspace_too_small_is_refused_naming_the_layer(monkeypatch):
    _scratch_for_reference_lowerings(monkeypatch)
    model = LlamaForCausalLM.random(CONFIG, "eetq", dtype=torch.float32, max_batch=4, max_seq=8, process_group=None)
    small = Workspace(4 * 4 * CONFIG.hidden_size, max_m=4)  # holds o_proj's and down_proj's need, not qkv's
    with pytest.raises(WorkspaceTooSmall, match=r"layer layers\.0\.self_attn\.qkv_proj\.linear \(reference_int8_weight\) needs 8192 bytes for M <= 4, 2048 held"):
        attach_workspace(model, small)
    assert all(m.workspace is model.workspace for m in model.quantized_linears()), "a refused workspace is attached nowhere"
    layer = model.layers[0].self_attn.qkv_proj.linear
    with pytest.raises(WorkspaceTooSmall, match=r"layer Int8Linear\(N=512, K=128\) \(reference_int8_weight\) needs 8192 bytes"):
        layer.use_workspace(small)
    model.layers[0].self_attn.o_proj.linear.use_workspace(small)  # fits


def test_standalone_layer_with_a_workspace():
    ckpt = FORMATS["gptq"].quantize(torch.randn(64, 128), bits=4, group_size=32, sym=False)
    layer = QuantLinear.from_checkpoint(ckpt, torch.randn(64), dtype=torch.float32)
    x = torch.randn(2, 3, 128)
    want = layer(x)
    ws = Workspace(1024, max_m=6)
    layer.use_workspace(ws)
    assert list(dict(layer.named_modules())) == [""] and not any("workspace" in k for k, _ in layer.named_buffers())
    with _QopsCalls() as log:
        got = layer(x)
    assert [n for n, _ in log.calls] == ["mm_int_weight_out"] and log.calls[0][1][-1] is ws.buffer
    assert torch.equal(got, want) and got.shape == (2, 3, 64)
    # Gradients go through the allocating op (the _out ops have no autograd).
    xg = x.clone().requires_grad_()
    with _QopsCalls() as log:
        y = layer(xg)
    assert [n for n, _ in log.calls] == ["mm_int_weight"]
    y.sum().backward()
    assert xg.grad is not None and xg.grad.shape == x.shape


# The device facts a size function reads, faked as an H200's (132 SMs, sm_90 clusters), so they can
# be evaluated without a GPU: native_w4a16 reads qops.native.int_weight._device_facts, the Triton
# integer lowering its config table (num_sms overrides the device lookup), the others sm_count.
H200_SMS = 132


@pytest.fixture
def h200_facts(monkeypatch):
    from qops.native import int_weight as native
    from qops.native import int_weight_gemm as gemm
    from qops.ops.triton import blockwise4, fp8, int8_weight
    from qops.ops.triton import int_weight as tri

    monkeypatch.setattr(ws_mod, "_NEEDS", {})
    monkeypatch.setattr(native, "_device_facts", lambda index: (H200_SMS, True))
    monkeypatch.setattr(gemm, "_sm_count", lambda index: H200_SMS)  # the GEMM's plans (M = 33..64)
    monkeypatch.setattr(gemm, "_smem_limit", lambda index: gemm.SHMEM_SM_BYTES)
    monkeypatch.setattr(gemm, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(native, "_device_name", lambda index: "NVIDIA H200")  # its measured plan table too
    monkeypatch.setattr(native, "smem_optin_bytes", lambda index: 227 * 1024 - native.STATIC_SHMEM_BYTES)
    for mod in (int8_weight, blockwise4, fp8):
        monkeypatch.setattr(mod, "sm_count", lambda device, interpreter: H200_SMS)
    with tri.config_override({**tri.load_config("h200"), "num_sms": H200_SMS}):
        yield torch.device("cuda", 0)
    ws_mod._NEEDS.clear()


LLAMA3_8B_LOWERINGS = [
    ("native_w4a16", dict(bits=4, group_size=128, act_perm=None)),
    ("native_w4a16", dict(bits=4, group_size=128, act_perm=torch.arange(1))),  # act-order: the gathered x too
    ("triton_int_weight", dict(bits=4, group_size=128, act_perm=None)),
    ("triton_int_weight", dict(bits=4, group_size=128, act_perm=torch.arange(1))),
    ("triton_int_weight", dict(bits=3, group_size=128, act_perm=None)),
    ("triton_int_weight", dict(bits=8, group_size=-1, act_perm=None)),
    ("triton_int8_weight", {}),
    ("triton_blockwise4", dict(blocksize=64, layout=0)),
    ("triton_fp8", dict(block_k=-1, activations="none")),
    ("triton_fp8", dict(block_k=128, activations="none")),
]


def _facts_key(facts: dict) -> tuple:
    """A layer's facts as a key (act_perm as whether it has one)."""
    return tuple(sorted((k, v is not None) if k == "act_perm" else (k, v) for k, v in facts.items()))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_scratch_for_llama3_8b_at_batch_64_fits_64_mib(h200_facts, deterministic, monkeypatch):
    from qops.native import int_weight as native

    monkeypatch.setattr(native, "_deterministic", deterministic)
    c = LlamaConfig.llama3_8b()
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (4096, 14336, 32, 8, 128256)
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q), "gate_up": (2 * c.intermediate_size, c.hidden_size),
              "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
    needs = {}
    for lowering, facts in LLAMA3_8B_LOWERINGS:
        choice = SimpleNamespace(lowering=LOWERINGS_BY_NAME[lowering])
        for name, (n, k) in shapes.items():
            layer = SimpleNamespace(choice=choice, out_features=n, in_features=k, input_pad=0, **facts)
            needs[lowering, _facts_key(facts), name] = layer_scratch_bytes(layer, 64, h200_facts)
    worst = max(needs, key=needs.get)
    assert needs[worst] <= 64 << 20, f"{worst}: {needs[worst]} bytes at M <= 64"
    # The size functions are live: the integer lowerings split K for decode-sized M on these shapes.
    plain = (("act_perm", False), ("bits", 4), ("group_size", 128))
    assert needs["native_w4a16", plain, "o"] > 0
    assert needs["triton_int_weight", plain, "gate_up"] > 0
