"""The weight loader over checkpoints written here in each format's on-disk layout (safetensors
shards + index json + config.json): whole layers, every sharded layer kind for world sizes 2 and 3
(ranks simulated with FakeGroup, outputs composed by hand), laziness and peak memory, config
parsing, and the errors for bad inputs."""
import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import save_file
from torch.profiler import ProfilerActivity, profile

import qops  # noqa: F401
from qops.distributed import FakeGroup
from qops.formats import FORMATS
from qops.formats.integer import act_order_g_idx
from qops.layers import (
    CONFIG_METHODS,
    LINEAR_METHODS,
    ShardingError,
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
    Weights,
    WeightsError,
    parse_quantization_config,
)
from qops.layers import int_weight as lw
from qops.layers import loader
from qops.layers.testing import (
    COLUMN_BLOCKS,
    DOWN,
    GATE_UP,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    O_PROJ,
    Q_K_V,
    QKV,
    VARIANTS,
    VOCAB_ODD,
    block_checkpoints,
    block_tensors,
    rank_slice,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def blocks():
    return pathlib.Path(block_checkpoints())


def test_every_registered_method_has_a_variant():
    methods = {v.quant_method for v in VARIANTS.values()} - {None}
    assert methods == set(CONFIG_METHODS)
    quantize = {parse_quantization_config(v.config).quantize for v in VARIANTS.values()}
    # "fp8-kv" loads its linear layers exactly as "fp8" does.
    assert set(LINEAR_METHODS) - {"fp8-kv"} <= quantize
    assert type(LINEAR_METHODS["fp8-kv"]) is type(LINEAR_METHODS["fp8"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_whole_layers_are_what_the_checkpoint_stores(blocks, name):
    variant = VARIANTS[name]
    w = Weights.from_pretrained(str(blocks / name), dtype=torch.float32)
    assert w.quantize == parse_quantization_config(variant.config).quantize
    layers, dense = block_tensors()
    for prefix, dense_w in layers.items():
        ref = variant.write(dense_w, 0)[1]
        lin = w.linear(w.get_weights(prefix))
        # One-hot activations read back the dequantized weight exactly.
        assert torch.equal(lin(torch.eye(dense_w.shape[1])), ref.t()), prefix
        # ... which is the original weight up to quantization error (no transposed or swapped axes).
        assert (ref - dense_w).abs().mean() < 0.3 * dense_w.abs().mean(), prefix
    head = w.linear(w.get_weights("lm_head_odd"))  # unquantized in every variant
    assert torch.equal(head.weight, dense["lm_head_odd.weight"])


def _load_all(weights, reduce):
    return {
        "col": TensorParallelColumnLinear.load(None, DOWN, weights, bias=True),
        "qkv": TensorParallelColumnLinear.load_qkv(None, QKV, weights, bias=True, num_heads=HEADS, num_key_value_heads=HEADS),
        "q_k_v": TensorParallelColumnLinear.load_multi(None, Q_K_V, weights, bias=False, dim=0),
        "gate_up": TensorParallelColumnLinear.load_gate_up(None, GATE_UP, weights, bias=False),
        "o_proj": TensorParallelRowLinear.load(None, O_PROJ, weights, bias=True),
        "down": TensorParallelRowLinear.load(None, DOWN, weights, bias=True),
        "head": TensorParallelHead.load(None, "lm_head", weights),
        "head_odd": TensorParallelHead.load(None, "lm_head_odd", weights),
        "embed": TensorParallelEmbedding("model.embed_tokens", weights, reduce=reduce),
    }


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_shards_compose_to_the_whole_layer(blocks, name, world):
    path = str(blocks / name)
    full = _load_all(Weights.from_pretrained(path, dtype=torch.float32), reduce=True)
    gen = torch.Generator().manual_seed(0)
    xh, xi = torch.randn(5, HIDDEN, generator=gen), torch.randn(5, INTERMEDIATE, generator=gen)
    ids = torch.tensor([[0, 5, VOCAB_ODD - 1, VOCAB_ODD + 50, -3, 133, 134, 267]])  # two ids outside the vocabulary
    inputs = {"col": xi, "qkv": xh, "q_k_v": xh, "gate_up": xh, "o_proj": xh, "down": xi, "head": xh, "head_odd": xh}
    expect = {k: full[k](x) for k, x in inputs.items()}
    expect["embed"] = full["embed"](ids)
    assert torch.equal(expect["embed"][0, 3], torch.zeros(HIDDEN)) and torch.equal(expect["embed"][0, 4], torch.zeros(HIDDEN))
    got = {k: [] for k in expect}
    for rank in range(world):
        shard = _load_all(Weights.from_pretrained(path, dtype=torch.float32, process_group=FakeGroup(rank, world)), reduce=False)
        for k in ("col", "qkv", "q_k_v", "gate_up"):
            got[k].append(shard[k](inputs[k]))
            blocks_ = COLUMN_BLOCKS.get(k, [HIDDEN])
            torch.testing.assert_close(got[k][-1], rank_slice(expect[k], blocks_, rank, world), rtol=1e-5, atol=1e-5, msg=k)
        for k in ("o_proj", "down"):
            kk = inputs[k].shape[-1]
            got[k].append(shard[k](inputs[k][:, rank * kk // world:(rank + 1) * kk // world], reduce=False))
        for k in ("head", "head_odd"):
            got[k].append(shard[k].linear(inputs[k]))
            assert shard[k].should_gather == (k == "head" or VOCAB_ODD % world == 0)
        got["embed"].append(shard["embed"](ids))
    for k in ("o_proj", "down", "embed"):
        torch.testing.assert_close(sum(got[k]), expect[k], rtol=1e-5, atol=1e-5, msg=k)
    for k in ("head", "head_odd"):
        gathered = torch.cat(got[k], dim=-1) if len(got[k][0][0]) < expect[k].shape[-1] else got[k][0]
        torch.testing.assert_close(gathered, expect[k], rtol=1e-5, atol=1e-5, msg=k)


def test_a_rank_reads_its_shard_not_the_tensor(blocks):
    path = str(blocks / "gptq-v2-4bit-actorder")
    whole = Weights.from_pretrained(path)
    whole.get_weights(GATE_UP)
    full = whole.bytes_read
    col = Weights.from_pretrained(path, process_group=FakeGroup(1, 2))
    col.get_weights_col_packed_gate_up(GATE_UP)
    assert col.bytes_read <= full / 2 + HIDDEN * 4  # half of everything split along N, plus g_idx
    whole.bytes_read = 0
    whole.get_weights(DOWN)
    row = Weights.from_pretrained(path, process_group=FakeGroup(0, 2))
    row.get_weights_row(DOWN)
    qweight = INTERMEDIATE // 8 * HIDDEN * 4
    # Half the packed rows; scales and zeros of every group (act-order); g_idx read twice.
    assert row.bytes_read <= whole.bytes_read - qweight // 2 + INTERMEDIATE * 4


def _peak_over_final(fn):
    """Bytes allocated at the peak of ``fn`` above what it leaves allocated (exact: allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak - live


@pytest.mark.parametrize("name", ["dense", "gptq-v1-3bit-actorder", "gptq-v2-8bit-channel", "awq-gemm", "ct-4bit-actorder", "fp8-channel",
                                  "eetq-ampere", "bnb-nf4-nested"])
def test_loading_peaks_below_one_dense_layer_above_the_final_footprint(tmp_path, name, monkeypatch):
    # The floor on chunk size only matters for layers smaller than production ones; without it the
    # bound holds at any size where a chunk of N/64 columns is at least 32 columns wide.
    monkeypatch.setattr(lw, "CHUNK_MIN_ELEMENTS", 0)
    n, k = 4096, 256
    write_checkpoint(str(tmp_path), VARIANTS[name], {"layer": torch.randn(n, k) * 0.05}, shards=1)
    for how, world in (("whole", 1), ("col", 2), ("row", 2)):
        w = Weights.from_pretrained(str(tmp_path), dtype=torch.float16, process_group=FakeGroup(0, world))
        get = {"whole": w.get_weights, "col": w.get_weights_col, "row": w.get_weights_row}[how]
        layer, over = _peak_over_final(lambda: w.linear(get("layer")))
        dense = n * k * 2 // world
        assert over <= dense, f"{how}: {over} bytes above the final footprint, one dense fp16 shard is {dense}"
        del layer


def _write(path, tensors, config=None, name="model.safetensors"):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, name))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"quantization_config": config} if config else {}, f)


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}


def _gptq_tensors(n=64, k=96, bits=4, group_size=32, prefix="l", g_idx=None, seed=0):
    # Seeded: a v1 checkpoint cannot hold a zero point of 0, which unseeded data hit now and then
    # (a group whose values are all >= -scale/2 rounds its zero to 0).
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    c = FORMATS["gptq"].quantize(w, bits=bits, group_size=group_size, sym=False, g_idx=g_idx, version="v1")
    return {f"{prefix}.qweight": c.qweight, f"{prefix}.qzeros": c.qzeros, f"{prefix}.scales": c.scales, f"{prefix}.g_idx": c.g_idx}


@pytest.mark.parametrize("drop, change, match", [
    ("l.qzeros", None, r"tensor 'l.qzeros' \(the qzeros tensor of this layout\) not found in .*tensors under 'l': \['l.g_idx', 'l.qweight', 'l.scales'\]"),
    (None, ("l.scales", lambda t: t.to(torch.int32)), r"tensor 'l.scales' in .*model.safetensors has dtype torch.int32; this layout stores it as a floating dtype"),
    (None, ("l.qweight", lambda t: t.float()), r"tensor 'l.qweight' .* has dtype torch.float32; this layout stores it as torch.int32"),
    (None, ("l.qzeros", lambda t: t[:, :7].contiguous()), r"tensor 'l.qzeros' .* has shape \(3, 7\); expected \(3, 8\) for K=96, N=64"),
    (None, ("l.scales", lambda t: t[:, :60].contiguous()), r"tensor 'l.scales' .* has shape \(3, 60\); expected \(3, 64\)"),
], ids=["missing", "scales-dtype", "qweight-dtype", "qzeros-shape", "scales-shape"])
def test_bad_tensors_are_named(tmp_path, drop, change, match):
    t = _gptq_tensors()
    if drop:
        del t[drop]
    if change:
        t[change[0]] = change[1](t[change[0]])
    _write(str(tmp_path), t, GPTQ_CONFIG)
    with pytest.raises(WeightsError, match=match):
        Weights.from_pretrained(str(tmp_path)).get_weights("l")


def test_no_layer_under_a_prefix(tmp_path):
    _write(str(tmp_path), _gptq_tensors(), GPTQ_CONFIG)
    with pytest.raises(WeightsError, match=r"no linear layer under 'm': expected 'm.qweight' or 'm.weight'"):
        Weights.from_pretrained(str(tmp_path)).get_weights("m")


FP8_CONFIG = {"quant_method": "fp8"}
CT_FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized",
                 "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}


def _fp8_tensors(weight_dtype=None):
    c = FORMATS["fp8"].quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)), granularity="channel")
    weight = c.weight if weight_dtype is None else c.weight.to(weight_dtype)
    return {"l.weight": weight, "l.weight_scale": c.weight_scale}


@pytest.mark.parametrize("tensors, config, match", [
    (lambda: _fp8_tensors(torch.bfloat16), FP8_CONFIG,
     r"tensor 'l.weight' in .* has dtype torch.bfloat16 beside 'l.weight_scale': the config's fp8 scheme stores torch.float8_e4m3fn weights"),
    (lambda: _fp8_tensors(torch.float8_e5m2), FP8_CONFIG, r"tensor 'l.weight' .* has dtype torch.float8_e5m2 beside 'l.weight_scale'"),
    (lambda: _fp8_tensors(torch.bfloat16), CT_FP8_CONFIG,
     r"tensor 'l.weight' .* has dtype torch.bfloat16 beside 'l.weight_scale': the config's compressed-tensors-fp8 scheme"),
    (lambda: {"l.weight": (w := FORMATS["fp8-block"].quantize(torch.randn(64, 96), block_size=(32, 32))).weight.float(),
              "l.weight_scale_inv": w.weight_scale_inv},
     {"quant_method": "fp8", "weight_block_size": [32, 32]}, r"tensor 'l.weight' .* has dtype torch.float32 beside 'l.weight_scale_inv'"),
    (lambda: {"l.weight": (w := FORMATS["eetq"].quantize(torch.randn(64, 64))).weight.view(torch.uint8), "l.weight_scales": w.weight_scales},
     {"quant_method": "eetq", "weights": "int8"}, r"tensor 'l.weight' .* has dtype torch.uint8 beside 'l.weight_scales': the config's eetq scheme stores torch.int8"),
], ids=["fp8-bf16", "fp8-e5m2", "ct-fp8-bf16", "fp8-block-fp32", "eetq-uint8"])
def test_a_weight_of_another_dtype_beside_the_scale_is_refused(tmp_path, tensors, config, match):
    # Read as dense, these layers dropped their scale: a silently wrong output.
    _write(str(tmp_path), tensors(), config)
    with pytest.raises(WeightsError, match=match):
        Weights.from_pretrained(str(tmp_path)).get_weights("l")


def test_no_layer_names_each_expected_key_once_and_the_dtype_it_found(tmp_path):
    _write(str(tmp_path), {"l.weight": _fp8_tensors()["l.weight"].to(torch.float8_e5m2)}, FP8_CONFIG)
    with pytest.raises(WeightsError, match=r"no linear layer under 'l': expected 'l.weight' in .*model.safetensors; 'l.weight' has dtype "
                                           r"torch.float8_e5m2, which no layout for it \(fp8, dense\) reads; tensors under it: \['l.weight'\]"):
        Weights.from_pretrained(str(tmp_path)).get_weights("l")


def test_truncated_and_foreign_files(tmp_path):
    _write(str(tmp_path), _gptq_tensors(), GPTQ_CONFIG)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(WeightsError, match=r"cannot read safetensors file .*model.safetensors: .*truncated"):
        Weights.from_pretrained(str(tmp_path))
    f.write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightsError, match=r"cannot read safetensors file .*model.safetensors"):
        Weights.from_pretrained(str(tmp_path))


def test_index_errors(tmp_path):
    _write(str(tmp_path), _gptq_tensors(), GPTQ_CONFIG, name="a.safetensors")
    save_file({"l.qweight": torch.zeros(2, dtype=torch.int32)}, str(tmp_path / "b.safetensors"))
    index = tmp_path / loader.INDEX_NAME

    def write_index(m):
        index.write_text(json.dumps({"metadata": {}, "weight_map": m}))

    write_index({"l.qweight": "a.safetensors", "x": "c.safetensors"})
    with pytest.raises(WeightsError, match="lists c.safetensors, which is missing"):
        Weights.from_pretrained(str(tmp_path))
    write_index({"l.qweight": "a.safetensors", "l.bias": "b.safetensors"})
    with pytest.raises(WeightsError, match=r"tensor 'l.qweight' is stored twice"):
        Weights.from_pretrained(str(tmp_path))
    os.remove(tmp_path / "b.safetensors")
    write_index({"l.qweight": "a.safetensors", "l.bias": "a.safetensors"})
    with pytest.raises(WeightsError, match=r"tensor 'l.bias' is listed in the index .* but no safetensors file holds it"):
        Weights.from_pretrained(str(tmp_path))
    index.write_text("{not json")
    with pytest.raises(WeightsError, match="not a safetensors index"):
        Weights.from_pretrained(str(tmp_path))


def test_fused_layers_must_share_g_idx(tmp_path):
    t = {**_gptq_tensors(prefix="q", g_idx=act_order_g_idx(96, 32, torch.Generator().manual_seed(0))),
         **_gptq_tensors(prefix="k", g_idx=act_order_g_idx(96, 32, torch.Generator().manual_seed(1)))}
    _write(str(tmp_path), t, GPTQ_CONFIG)
    with pytest.raises(WeightsError, match=r"\['q.g_idx', 'k.g_idx'\] differ, but the layers are fused"):
        Weights.from_pretrained(str(tmp_path)).get_multi_weights_col(["q", "k"])


@pytest.mark.parametrize("tensors, config, call, match", [
    (lambda: _gptq_tensors(n=72), GPTQ_CONFIG, lambda w: w.get_weights_col("l"),
     r"cannot split 'l.qzeros' along dim 1 \(N=72 values packed 8 per int32 word\) for world size 2 \(rank 0 takes N values \[0, 36\)\): "
     r"the shard ends at value 36, inside an int32 word"),
    (lambda: _gptq_tensors(), GPTQ_CONFIG, lambda w: w.get_weights_row("l"),
     r"cannot split 'l.qzeros' along dim 0 \(groups of 32 along K=96\) for world size 2 .* the shard ends at 48, inside a group of 32"),
    (lambda: _gptq_tensors(bits=3, group_size=16), {**GPTQ_CONFIG, "bits": 3, "group_size": 16}, lambda w: w.get_weights_row("l"),
     r"cannot split 'l.qweight' along dim 0 \(K=96 3-bit values packed across int32 words\) for world size 2 .* inside an int32 word \(48 \* 3 bits"),
    (lambda: {f"l.{k}": v for k, v in vars(FORMATS["awq"].quantize(torch.randn(40, 64), bits=4, group_size=32)).items() if isinstance(v, torch.Tensor)},
     {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, lambda w: w.get_weights_col("l"),
     r"cannot split 'l.qweight' along dim 1 \(N=40 values packed 8 per int32 word\) for world size 2 .* ends at value 20"),
    (lambda: {"l.weight": (w := FORMATS["fp8-block"].quantize(torch.randn(96, 64), block_size=(32, 32))).weight, "l.weight_scale_inv": w.weight_scale_inv},
     {"quant_method": "fp8", "weight_block_size": [32, 32]}, lambda w: w.get_weights_col("l"),
     r"cannot split 'l.weight_scale_inv' along dim 0 \(groups of 32 along N=96\) for world size 2 .* inside a group of 32"),
    (lambda: {"l.weight": torch.randn(10, 8)}, None, lambda w: w.get_weights_col("l"),
     r"cannot split 'l' \(a block of 10 of N=10\) evenly for world size 4"),
    (lambda: {"l.weight": torch.randn(6 * 16, 8)}, None, lambda w: w.get_weights_col_packed_qkv("l", 4, 1),
     r"cannot split 'l': num_key_value_heads=1 is not a multiple of world size"),
    (lambda: {"l.weight": (w := FORMATS["eetq"].quantize(torch.randn(128, 64))).weight, "l.weight_scales": w.weight_scales},
     {"quant_method": "eetq", "weights": "int8"}, lambda w: w.get_weights_col("l"),
     r"cannot split 'l.weight' along dim 0 \(N=128 in tiles of 64\) for world size 4 .* the shard ends at 32, inside a tile of 64"),
    (lambda: {f"l.{k}": v for k, v in FORMATS["bitsandbytes-nf4"].to_state_dict(FORMATS["bitsandbytes-nf4"].quantize(torch.randn(64, 96), group_size=64)).items()},
     {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, lambda w: w.get_weights_col("l"),
     r"cannot split 'l': its blocks of 64 straddle rows \(K=96\), so it is only read whole"),
], ids=["gptq-qzeros-N", "gptq-groups-K", "gptq-3bit-words-K", "awq-N", "fp8-blocks-N", "uneven", "kv-heads", "eetq-tiles-N", "bnb4-blocks"])
def test_illegal_splits_name_tensor_dim_and_world_size(tmp_path, tensors, config, call, match):
    _write(str(tmp_path), tensors(), config)
    world = 4 if "world size 4" in match else 2
    with pytest.raises(ShardingError, match=match):
        call(Weights.from_pretrained(str(tmp_path), process_group=FakeGroup(0, world)))


def test_fusing_layers_off_their_groups_names_the_fusion_not_the_world_size(tmp_path):
    # At world size 1 this once advised "Pick a world size whose shards fall on these boundaries".
    block = lambda n: FORMATS["fp8-block"].quantize(torch.randn(n, 64), block_size=(32, 32))  # noqa: E731
    k, v = block(48), block(48)
    _write(str(tmp_path), {"k.weight": k.weight, "k.weight_scale_inv": k.weight_scale_inv, "v.weight": v.weight,
                           "v.weight_scale_inv": v.weight_scale_inv}, {"quant_method": "fp8", "weight_block_size": [32, 32]})
    with pytest.raises(ShardingError, match=r"cannot fuse 'k.weight_scale_inv' with the layer after it along dim 0 \(groups of 32 along "
                                            r"N=48\): read whole, the shard ends at 48, inside a group of 32. The tensor's groups do not "
                                            r"fall on the fused pieces' boundaries, so no world size helps"):
        Weights.from_pretrained(str(tmp_path)).get_multi_weights_col(["k", "v"])


BNB4_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
BNB4_STATE = "l.weight.quant_state.bitsandbytes__nf4"


def _bnb4_tensors(**state_changes):
    """A nested nf4 layer (N=64, K=128: 128 blocks of 64, one nested block) under prefix "l"."""
    fmt = FORMATS["bitsandbytes-nf4"]
    c = fmt.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), group_size=64, nested=True)
    t = {f"l.{k}": v for k, v in fmt.to_state_dict(c).items()}
    state = {k: v for k, v in {**c.quant_state, **state_changes}.items() if v is not None}
    t[BNB4_STATE] = torch.tensor(list(json.dumps(state).encode("utf-8")), dtype=torch.uint8)
    return t


@pytest.mark.parametrize("tensor_changes, state_changes, named, match", [
    ({"l.weight.nested_absmax": lambda t: t[:0]}, {}, "nested_absmax",
     r"tensor 'l.weight.nested_absmax' in .*: nested_absmax must be float32 with 1 values \(ceil\(n_blocks/256\)\), got torch.float32 \(0,\)"),
    ({"l.weight.nested_absmax": lambda t: t.repeat(3)}, {}, "nested_absmax", r"tensor 'l.weight.nested_absmax' .*: nested_absmax must be float32 with 1 values"),
    ({"l.weight.nested_absmax": lambda t: t.half()}, {}, "nested_absmax", r"tensor 'l.weight.nested_absmax' .*: nested_absmax must be float32 .* got torch.float16"),
    ({"l.weight.nested_quant_map": lambda t: t[:255]}, {}, "nested_quant_map",
     r"tensor 'l.weight.nested_quant_map' .*: nested_quant_map must be float32 with 256 values"),
    ({"l.weight.nested_quant_map": lambda t: torch.cat([t, t[:44]])}, {}, "nested_quant_map",
     r"tensor 'l.weight.nested_quant_map' .*: nested_quant_map must be float32 with 256 values"),
    ({}, {"blocksize": 0}, "blocksize", rf"tensor '{BNB4_STATE}' .*: blocksize must be positive, got 0"),
    ({}, {"blocksize": -64}, "blocksize", rf"tensor '{BNB4_STATE}' .*: blocksize must be positive, got -64"),
    ({}, {"nested_blocksize": 0}, "nested_blocksize", rf"tensor '{BNB4_STATE}' .*: nested_blocksize must be positive, got 0"),
    ({}, {"nested_offset": None}, "nested_offset", rf"tensor '{BNB4_STATE}' .*: nested absmax needs nested_blocksize and nested_offset in quant_state"),
    ({}, {"shape": ["a", 128]}, r"shape\[0\]", rf"tensor '{BNB4_STATE}' .*: quant_state shape\[0\] must be an integer, got str 'a'"),
], ids=["nested_absmax-short", "nested_absmax-long", "nested_absmax-fp16", "nested_quant_map-255", "nested_quant_map-300", "blocksize-0",
        "blocksize-negative", "nested_blocksize-0", "no-nested_offset", "shape-str"])
def test_bnb4_sharded_reads_refuse_what_whole_reads_refuse(tmp_path, tensor_changes, state_changes, named, match):
    """A column shard de-nests the absmax itself, so it must check the nested tables and quant_state
    as the whole layer's format check does (instead of an IndexError, or a silently wrong absmax)."""
    t = _bnb4_tensors(**state_changes)
    for name, change in tensor_changes.items():
        t[name] = change(t[name])
    _write(str(tmp_path), t, BNB4_CONFIG)
    whole = Weights.from_pretrained(str(tmp_path), dtype=torch.float32)
    with pytest.raises(ValueError, match=named):
        whole.linear(whole.get_weights("l"))
    shard = Weights.from_pretrained(str(tmp_path), dtype=torch.float32, process_group=FakeGroup(0, 2))
    with pytest.raises(WeightsError, match=match):
        shard.get_weights_col("l")


@pytest.mark.parametrize("world", [1, 2])
def test_bnb4_quant_storage_other_than_uint8_is_read_through_its_bytes(tmp_path, world):
    """bnb_4bit_quant_storage=bfloat16 keeps the same bytes in a bf16 tensor: whole layers read it
    as shards (and the format) do, instead of refusing its dtype."""
    t = _bnb4_tensors()
    _write(str(tmp_path / "uint8"), t, BNB4_CONFIG)
    _write(str(tmp_path / "bf16"), dict(t, **{"l.weight": t["l.weight"].reshape(-1).view(torch.bfloat16).reshape(-1, 1)}), BNB4_CONFIG)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    outs = []
    for storage in ("uint8", "bf16"):
        w = Weights.from_pretrained(str(tmp_path / storage), dtype=torch.float32, process_group=FakeGroup(0, world))
        outs.append(w.linear(w.get_weights_col("l"))(x))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "hqq", "nbits": 4}, r"quant_method 'hqq' is not supported by qops.layers; supported: \['awq', 'bitsandbytes', 'compressed-tensors', 'eetq', 'fp8', 'gptq'\]"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, r"bnb_4bit_quant_type must be one of \['nf4', 'fp4'\]"),
    ({"quant_method": "bitsandbytes"}, "sets neither load_in_8bit nor load_in_4bit"),
    ({"quant_method": "eetq", "weights": "int4"}, "only int8 weights"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format must be 'gptq' or 'gptq_v2'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version 'gemv' is not supported; supported: \['gemm'\]"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}},
     r"format 'naive-quantized' is not supported; supported: \['float-quantized', 'pack-quantized'\]"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     r"weight strategy 'tensor' is not supported; supported: \['group', 'channel'\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3 weights"),
], ids=["hqq", "bnb-int4", "bnb-nothing", "eetq-int4", "gptq-marlin", "awq-gemv", "ct-naive", "ct-int-tensor", "fp8-e5m2"])
def test_unsupported_configs_say_what_is_supported(qc, match):
    with pytest.raises(WeightsError, match=match):
        parse_quantization_config(qc)


def _ct(weights: dict, fmt: str = "pack-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 0}, r"gptq: quantization_config 'bits': bits must be one of \[2, 3, 4, 8\], got 0"),
    ({"quant_method": "gptq", "bits": 4.5}, r"gptq: quantization_config 'bits': bits must be an integer, got float 4\.5"),
    ({"quant_method": "gptq", "bits": "4bit"}, r"gptq: quantization_config 'bits': bits must be an integer, got str '4bit'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"gptq: quantization_config 'group_size': group_size must be -1 or a positive integer, got 0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -2}, r"gptq: quantization_config 'group_size': group_size must be -1 or a positive integer, got -2"),
    ({"quant_method": "awq", "w_bit": 8, "q_group_size": 128}, r"awq: quantization_config 'w_bit': bits must be one of \[4\], got 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": -5}, r"awq: quantization_config 'group_size': group_size must be -1 or a positive integer, got -5"),
    (_ct({"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32}),
     r"config group 'g': weights 'num_bits': bits must be one of \[4, 8\], got 3"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 0}),
     r"config group 'g': weights 'group_size': group_size must be -1 or a positive integer, got 0"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"fp8: quantization_config 'weight_block_size' must be \[block_n, block_k\], got \[128\]"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, r"fp8: quantization_config: weight_block_size\[0\] must be -1 .* or positive, got 0"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128.0]}, r"fp8: quantization_config: weight_block_size\[1\] must be an integer, got float 128\.0"),
    (_ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, -3]}, "float-quantized"),
     r"config group 'g': quantization_config: block_structure\[1\] must be -1 .* or positive, got -3"),
], ids=["gptq-bits-0", "gptq-bits-float", "gptq-bits-str", "gptq-group-0", "gptq-group-negative", "awq-w_bit-8", "awq-group-negative",
        "ct-bits-3", "ct-group-0", "fp8-block-1d", "fp8-block-0", "fp8-block-float", "ct-fp8-block-negative"])
def test_config_values_are_checked_naming_their_key(qc, match):
    # Unchecked, these reached the layouts as divisors and shapes: ZeroDivisionError, negative
    # expected shapes, or a 4.5 truncated to 4.
    with pytest.raises(WeightsError, match=match):
        parse_quantization_config(qc)


def test_config_variants():
    gptq = parse_quantization_config
    assert gptq({"quant_method": "gptq", "bits": 4, "group_size": 128}).version == "v1"
    assert gptq({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}).version == "v2"
    assert gptq({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2"}).version == "v2"
    assert gptq({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}).group_size == 64
    ct = parse_quantization_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*gate$"],
        "config_groups": {
            "all": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
            "mlp": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}},
        },
    })
    assert ct.scheme("model.layers.0.self_attn.q_proj") == lw.CompressedTensorsScheme(4, 128, True)
    assert ct.scheme("model.layers.0.mlp.down_proj") == lw.CompressedTensorsScheme(8, -1, False)
    assert ct.scheme("lm_head") is None and ct.scheme("model.layers.0.mlp.gate") is None


def test_autogptq_side_config(tmp_path):
    save_file(_gptq_tensors(), str(tmp_path / "model.safetensors"))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "desc_act": False, "sym": False}))
    w = Weights.from_pretrained(str(tmp_path))
    assert w.quantize == "gptq" and w.get_weights("l").version == "v1"


def test_single_tensor_access(tmp_path):
    t = {"a": torch.randn(6, 4), "b": torch.arange(12, dtype=torch.int32).reshape(6, 2), "c": torch.randn(7, 3).to(torch.bfloat16)}
    _write(str(tmp_path), t)
    w = Weights.from_pretrained(str(tmp_path), dtype=torch.float16, process_group=FakeGroup(1, 2), aliases={"tied": ["a"]})
    assert w.get_tensor("a").dtype == torch.float16 and w.get_tensor("b").dtype == torch.int32
    assert torch.equal(w.get_tensor("a", to_dtype=False), t["a"]) and torch.equal(w.get_tensor("tied", to_dtype=False), t["a"])
    assert torch.equal(w.get_sharded("b", dim=0), t["b"][3:])
    assert torch.equal(w.get_sharded("a", dim=1, to_dtype=False), t["a"][:, 2:])
    assert torch.equal(w.get_partial_sharded("c", dim=0, to_dtype=False), t["c"][4:])  # blocks of 4: 4 + 3
    assert torch.equal(w.get_packed_sharded("a", dim=0, block_sizes=[2, 4], to_dtype=False), torch.cat([t["a"][1:2], t["a"][4:6]]))
    with pytest.raises(ShardingError, match="evenly for world size 2"):
        w.get_sharded("c", dim=0)


@pytest.mark.parametrize("dtype, to", [(torch.bfloat16, None), (torch.float32, torch.float16), (torch.int32, None), (torch.float8_e4m3fn, None), (torch.bfloat16, torch.float32)])
def test_positioned_reads_equal_in_memory_slicing(tmp_path, dtype, to, monkeypatch):
    monkeypatch.setattr(loader, "STAGING_BYTES", 64)  # convert through many small staging rounds
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(5, 7, 9, generator=gen) * 4).to(dtype)
    save_file({"t": t}, str(tmp_path / "m.safetensors"))
    w = Weights([str(tmp_path / "m.safetensors")])
    entry = w.entries["t"]
    for index in [(), (slice(1, 3),), (slice(None), slice(2, 5)), (slice(0, 5), slice(0, 7), slice(3, 4)), (slice(4, 5), slice(1, 6), slice(2, 9)), (slice(2, 2),)]:
        want = t[index] if to is None else t[index].to(to)
        got = loader._read_slice(entry, index, to)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), index
