"""``benchmarks/bench_decode.py --dry-run``: the end-to-end decode benchmark's building (the W4
model from random GPTQ integers through the loader, the dense one), compiling, timing, JSON and
TARGETS code, on a tiny model on the CPU (its numbers mean nothing)."""
from __future__ import annotations

import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_every_row_and_the_targets(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import bench_decode

    torch._dynamo.reset()
    out = tmp_path / "d.json"
    assert bench_decode.main(["--dry-run", "--batches", "1,3", "--steps", "2", "--trials", "1", "--out", str(out)]) == 0
    torch._dynamo.reset()
    res = json.loads(out.read_text())
    assert res["dry_run"] and set(res["models"]) == {"w4", "dense"}
    assert res["models"]["w4"]["lowerings"] == {"reference_int_weight": 4 * res["config"]["num_hidden_layers"]}
    assert res["models"]["w4"]["weights_bytes"] < res["models"]["dense"]["weights_bytes"] / 2
    assert [(r["model"], r["batch"]) for r in res["rows"]] == [("w4", 1), ("w4", 3), ("dense", 1), ("dense", 3)]
    assert all(r["tokens_per_s"] > 0 and r["finite"] for r in res["rows"])
    assert set(res["targets"]) == {"w4_batch1_tok_s", "w4_over_bf16_batch1", "w4_over_bf16_batch3", "w4_scratch_bytes"}
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("  note: the scratch")
    assert "TARGETS" in printed and "DRY RUN" in printed


def test_batch_one_alone_keeps_its_speedup_target(monkeypatch):
    # With --batches 1 the largest batch is 1: its "faster than bf16" entry must not replace the
    # batch-1 target of 2.8x (it did, on the H200 run of b72e09a).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_decode

    res = {"args": {"batches": [1]}, "models": {"w4": {"scratch_bytes": 0}},
           "rows": [{"model": "w4", "batch": 1, "tokens_per_s": 425.0}, {"model": "bf16", "batch": 1, "tokens_per_s": 225.0}]}
    t = bench_decode.targets(res, dry=False)
    assert set(t) == {"w4_batch1_tok_s", "w4_over_bf16_batch1", "w4_scratch_bytes"}
    assert t["w4_over_bf16_batch1"]["target"] == f">= {bench_decode.TARGET_SPEEDUP_B1}"
    assert t["w4_over_bf16_batch1"]["ok"] is False


def test_w4_fp16_runs_in_fp16_and_gets_its_own_targets(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_decode

    assert bench_decode.model_dtype("w4-fp16", torch.bfloat16) == torch.float16
    assert bench_decode.model_dtype("w4", torch.bfloat16) == torch.bfloat16
    assert bench_decode.model_dtype("w4-fp16", torch.float32) == torch.float32  # the dry run stays fp32
    res = {"args": {"batches": [1]}, "models": {"w4": {"scratch_bytes": 0}},
           "rows": [{"model": "w4", "batch": 1, "tokens_per_s": 500.0}, {"model": "w4-fp16", "batch": 1, "tokens_per_s": 660.0},
                    {"model": "bf16", "batch": 1, "tokens_per_s": 220.0}]}
    t = bench_decode.targets(res, dry=False)
    assert t["w4_batch1_tok_s"]["value"] == 500.0  # the model the targets name stays w4
    assert t["w4_fp16_batch1_tok_s"]["ok"] is False
    assert t["w4_fp16_over_bf16_batch1"]["value"] == 3.0 and t["w4_fp16_over_bf16_batch1"]["ok"] is True


def test_random_gptq_checkpoint_is_a_valid_checkpoint(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_decode

    from qops.formats import FORMATS
    from qops.formats.gptq import GPTQCheckpoint
    from qops.models import LlamaConfig

    cfg = LlamaConfig.tiny(num_hidden_layers=1)
    t, qc = bench_decode.random_gptq_checkpoint(cfg, torch.device("cpu"), 0)
    p = "model.layers.0.mlp.down_proj"
    c = GPTQCheckpoint(qweight=t[f"{p}.qweight"], qzeros=t[f"{p}.qzeros"], scales=t[f"{p}.scales"], g_idx=None, bits=4,
                       group_size=128, in_features=cfg.intermediate_size, version="v2")
    w = FORMATS["gptq"].dequantize(c)
    assert w.shape == (cfg.hidden_size, cfg.intermediate_size)
    # Weights of std ~ 1/sqrt(K), mean ~ 0: activations keep their scale through the layers.
    assert abs(w.std().item() * cfg.intermediate_size ** 0.5 - 1) < 0.2 and abs(w.mean().item()) < 0.1 * w.std().item()
    assert qc["checkpoint_format"] == "gptq_v2"


def test_profile_decode_dry_run_and_kernel_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import profile_decode

    torch._dynamo.reset()
    out = tmp_path / "p.json"
    assert profile_decode.main(["--dry-run", "--variants", "w4:sdpa,w4:matmul,bf16", "--steps", "2", "--out", str(out)]) == 0
    torch._dynamo.reset()
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["rows"]] == ["w4:sdpa", "w4:matmul", "bf16"]
    assert all("error" not in r for r in res["rows"]), res["rows"]
    # The two attention kinds agree on the same weights and inputs.
    assert res["rows"][1]["first_logits_rel_err_vs_first_variant"] < 1e-5

    class Ev:  # a profiler event on the device: name, (start, end) in microseconds
        def __init__(self, name, s, e):
            self.name, self.device_type = name, "DeviceType.CUDA"
            self.time_range = type("R", (), {"start": s, "end": e})()

    evs = [Ev("w4a16_gemv", 0, 10), Ev("triton_poi_fused_add_0", 12, 14), Ev("w4a16_gemv", 13, 23), Ev("sm90_xmma_gemm", 30, 40)]
    t = profile_decode.kernel_table(evs, steps=2)
    assert t["kernels_per_step"] == 2 and t["span_us_per_step"] == 20
    assert t["busy_us_per_step"] == (10 + 11 + 10) / 2  # the overlapping pair counts once
    assert t["kinds"]["qops native"] == {"us_per_step": 10, "launches_per_step": 1}
    assert t["kinds"]["cublas"]["us_per_step"] == 5 and t["kinds"]["inductor triton"]["us_per_step"] == 1
    assert t["top"][0]["name"] == "w4a16_gemv"


def test_dry_run_quantized_head_variant(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import bench_decode

    torch._dynamo.reset()
    out = tmp_path / "d.json"
    assert bench_decode.main(["--dry-run", "--models", "w4,w4-qhead", "--batches", "1", "--steps", "2", "--trials", "1",
                              "--out", str(out)]) == 0
    torch._dynamo.reset()
    res = json.loads(out.read_text())
    layers = res["config"]["num_hidden_layers"]
    assert res["models"]["w4-qhead"]["lowerings"] == {"reference_int_weight": 4 * layers + 1}
    assert res["models"]["w4-qhead"]["weights_bytes"] < res["models"]["w4"]["weights_bytes"]
    assert [r["model"] for r in res["rows"]] == ["w4", "w4-qhead"] and all(r["finite"] for r in res["rows"])


def test_layer_timeline_spans_from_stamps(monkeypatch):
    """``probe_layer_timeline.site_rows`` (the analysis behind benchmarks/NOTES.md's stop-29 table) on
    hand-written stamps: two launches of two blocks each, nanoseconds."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import probe_layer_timeline as plt

    d = {"QOPS_NWN": 1, "QOPS_CLUSTER": 1, "QOPS_GLU": 0}
    sites = [{"defines": d, "grid": [2, 1, 1], "blocks": 2, "offset": 0, "name": "a"},
             {"defines": d, "grid": [2, 1, 1], "blocks": 2, "offset": 2 * plt.SLOTS, "name": "b"}]
    # entry, wait returned, x staged, loop done, end; then cycles of the three spans
    stamps = torch.tensor([
        [1000, 3000, 3500, 6500, 7000, 10, 20, 30],
        [1500, 3100, 3600, 7600, 8000, 11, 21, 31],
        [2000, 9000, 9200, 9800, 9900, 12, 22, 32],
        [2500, 9000, 9300, 9500, 9600, 13, 23, 33],
    ], dtype=torch.int64).flatten()
    a, b = plt.site_rows(stamps, sites)
    assert (a["start"], a["wait_min"], a["wait_max"], a["end"], a["post_wait"]) == (0.0, 2.0, 2.1, 7.0, 5.0)
    assert (a["x_med"], a["loop_max"], a["gap_before"]) == (0.5, 4.0, None)
    assert (a["start_max"], b["start_max"]) == (0.5, 1.5)  # the last block's entry: a second wave shows here
    assert (b["start"], b["wait_min"], b["end"], b["post_wait"], b["gap_before"]) == (1.0, 8.0, 8.9, 0.9, 1.0)
    assert b["loop_max"] == 0.6 and b["cycles_med"][0] in (12, 13)


def _fake_kernel(registers: int):
    import types

    return types.SimpleNamespace(attributes=types.SimpleNamespace(num_regs=registers))


def test_stamper_keeps_two_blocks_an_sm_where_the_stamps_would_cost_it(monkeypatch):
    """A stamped build whose registers cross 128 where the shipped build's do not is rebuilt with
    QOPS_MINB 2 (the fp16 28672x4096 M = 1 build: 128 -> 133 registers with the stamps, one block an SM);
    one already above 128 (a plan that runs one block an SM) keeps its defines."""
    import types

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import probe_layer_timeline as plt

    def regs(defines):
        base = defines["base"] + 5 * defines.get("QOPS_STAMPS", 0)
        return min(base, 128) if defines["QOPS_MINB"] >= 2 else base

    asked = []

    def get_kernel(device, source, defines, name, **kw):
        asked.append(dict(defines))
        return _fake_kernel(regs(defines))

    niw = types.SimpleNamespace(SOURCE="w4a16_gemv.cu", GEMV="gemv", REDUCE="reduce")
    st = plt.Stamper(types.SimpleNamespace(get_kernel=get_kernel, launch=None), niw, None)
    st.on = True
    k = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_MINB": 1, "base": 128}, "gemv")
    assert k.attributes.num_regs == 128 and st.defines_of[id(k)]["QOPS_MINB"] == 2 and st.defines_of[id(k)]["QOPS_STAMPS"] == 1
    k = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_MINB": 1, "base": 140}, "gemv")
    assert k.attributes.num_regs == 145 and st.defines_of[id(k)]["QOPS_MINB"] == 1
    k = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_MINB": 1, "base": 110}, "gemv")
    assert k.attributes.num_regs == 115 and st.defines_of[id(k)]["QOPS_MINB"] == 1


def test_layer_timeline_late_release_only_for_gated_builds(monkeypatch):
    """``probe_layer_timeline``'s ``late`` variants: while on, the early-release flag is 0 for the gated
    decode-kernel builds the Stamper handed out and unchanged for the others; restored after."""
    import types

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import probe_layer_timeline as plt

    niw = types.SimpleNamespace(SOURCE="w4a16_gemv.cu", GEMV="gemv", REDUCE="reduce", early_dependents_flag=lambda kernel, *a: 16)
    compiler = types.SimpleNamespace(get_kernel=lambda device, source, defines, name, **kw: _fake_kernel(120), launch=None)
    st = plt.Stamper(compiler, niw, None)
    gated = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_GLU": 1}, "gemv")
    plain = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_GLU": 0}, "gemv")
    original = niw.early_dependents_flag
    with st.late_gated_release(False):
        assert niw.early_dependents_flag is original
    with st.late_gated_release(True):
        assert niw.early_dependents_flag(gated, 0, 224, 256, 0) == 0
        assert niw.early_dependents_flag(plain, 0, 192, 256, 0) == 16
    assert niw.early_dependents_flag is original


def test_stamper_puts_stamps_after_the_workspace_partials_and_points_the_finish_there(monkeypatch):
    """``Stamper.launch`` on the split-K workspace path: the stamped launch's ws leaves S x M x N fp32
    partials before its stamps (as w4a16_gemv.cu's QOPS_STAMPS places them), the split-K finish launched
    next reads that ws, and the site records where the stamps are; other launches pass through."""
    import types

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import probe_layer_timeline as plt

    launched = []
    niw = types.SimpleNamespace(SOURCE="w4a16_gemv.cu", GEMV="gemv", REDUCE="reduce", _EARLY_DEPENDENTS=16)
    compiler = types.SimpleNamespace(get_kernel=lambda device, source, defines, name, **kw: _fake_kernel(120),
                                     launch=lambda kernel, grid, block, shmem, stream, *args, **kw: launched.append(args),
                                     max_active_blocks=lambda *a: 2)
    buf = torch.zeros(4096, dtype=torch.int64)
    st = plt.Stamper(compiler, niw, buf, mts=(2,))
    st.on = True
    gemv = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 2, "QOPS_CLUSTER": 1}, "gemv")
    reduce = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 2, "QOPS_CLUSTER": 1}, "reduce")
    other = st.get_kernel(0, "w4a16_gemv.cu", {"QOPS_MT": 1, "QOPS_CLUSTER": 1}, "gemv")  # not a stamped height
    stream = types.SimpleNamespace(device_index=0)
    m, n, splits = 3, 64, 4
    gemv_args = ["qw", "s", "z", "x", "b", "out", 12345, m, n, 256, 256, n, 1, 0, 0]
    st.launch(gemv, (2, splits, 1), (256, 1, 1), 0, stream, *gemv_args)
    partial_slots = splits * m * n // 2  # 64-bit slots the fp32 partials take
    assert launched[-1][6] == buf.data_ptr() and st.sites[-1]["offset"] == partial_slots
    assert st.used == partial_slots + 2 * splits * plt.SLOTS
    st.launch(reduce, (1, 1, 1), (256, 1, 1), 0, stream, 999, "b", "out", m, n, n, splits, 0)
    assert launched[-1][0] == buf.data_ptr() and st.reduce_ws is None
    st.launch(reduce, (1, 1, 1), (256, 1, 1), 0, stream, 999, "b", "out", m, n, n, splits, 0)
    assert launched[-1][0] == 999  # only the finish right after a stamped launch is redirected
    st.launch(other, (2, splits, 1), (256, 1, 1), 0, stream, *gemv_args)
    assert launched[-1][6] == 12345 and len(st.sites) == 1


def test_probe_time_row_adds_times_ratio_and_prints(monkeypatch, capsys):
    """``common.time_row`` (every probe's timing step) with the CUDA-graph timer stubbed out."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import common

    fake = {"a": common.Timing(2.0, {}), "b": common.Timing(8.0, {})}
    monkeypatch.setattr(common, "graph_times", lambda cands, trials, target_ms: {k: fake[k] for k in cands})
    res = {"rows": []}
    row = common.time_row(res, {"N": 1}, {"a": [], "b": []}, 3, roof_us=1.0, ratio=("a_over_b", "a", "b"))
    assert res["rows"] == [row]
    assert (row["a_us"], row["a_roof_pct"], row["b_us"], row["b_roof_pct"], row["a_over_b"]) == (2.0, 50.0, 8.0, 12.5, 0.25)
    assert json.loads(capsys.readouterr().out) == row


def test_interleaved_trials_rotate_the_order_every_round(monkeypatch):
    """``bench_decode.interleaved_trials``: each runner timed once a round, round r starting at runner
    r mod n, so over n rounds every runner is measured first once."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_decode

    calls = []
    runners = {k: (lambda k=k: calls.append(k) or float(len(calls))) for k in ("a", "b", "c")}
    times = bench_decode.interleaved_trials(runners, 3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [1.0, 6.0, 8.0], "b": [2.0, 4.0, 9.0], "c": [3.0, 5.0, 7.0]}


def test_record_native_builds_lists_what_the_warm_up_of_an_h200_asks_for(monkeypatch):
    """``record_native_builds``: the decode-kernel builds of the pretended H200's plans (the gated one for
    ``:glu``), the GEMM's sm_90a builds above the decode rows, no duplicates, and torch.cuda restored."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import record_native_builds as rnb

    from qops.native import int_weight as niw

    capability = torch.cuda.get_device_capability
    builds = rnb.record_builds([rnb.parse_weight("28672x4096:glu")], torch.float16, 1)
    with rnb.pretend_device():
        want = niw.plan(1, 28672, 4096, 0).defines(torch.float16, True, True)
    assert builds == [{"source": niw.SOURCE, "arch": "sm_90", "defines": want}]
    assert want["QOPS_GLU"] == 1 and want["QOPS_DT"] == 0
    builds = rnb.record_builds([rnb.parse_weight("4096x4096")], torch.bfloat16, 64)
    assert len({json.dumps(b, sort_keys=True) for b in builds}) == len(builds)
    assert any(b["source"] == "w4a16_gemm.cu" and b["arch"] == "sm_90a" for b in builds)
    assert all(b["defines"]["QOPS_DT"] == 1 for b in builds)
    assert torch.cuda.get_device_capability is capability


def test_stamps_sm_spread_reads_the_sm_ids_and_finds_a_slow_sm(monkeypatch):
    """``probe_w4_stamps.sm_spread``: slot 5's bits 48..63 are the block's SM (its cycles below them); an SM
    slow in every launch shows as the slowest and as a correlation of 1 between the two halves of the launches."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import probe_layer_timeline as plt
    import probe_w4_stamps as pws

    blocks, launches = 6, 4
    buf = torch.zeros(blocks * launches * plt.SLOTS, dtype=torch.int64)
    sites = []
    for i in range(launches):
        off = i * blocks * plt.SLOTS
        v = buf[off: off + blocks * plt.SLOTS].view(blocks, plt.SLOTS)
        sms = torch.tensor([0, 1, 2, 3, 4, 4])  # SM 4 holds two blocks
        loop_ns = 1000 + 100 * sms + 10 * i  # SM k runs its loop in 1 + 0.1 k us
        v[:, 2] = 5000
        v[:, 3] = 5000 + loop_ns
        v[:, 5] = 777 | (sms << 48)
        sites.append({"offset": off, "blocks": blocks})
    assert plt.block_sms(plt.block_stamps(buf, sites[0])).tolist() == [0, 1, 2, 3, 4, 4]
    out = pws.sm_spread(buf, sites)
    assert out["sms_seen"] == 5 and out["sm_loop_corr_halves"] == 1.0
    assert list(out["slowest_sms_loop_us"])[0] == 4 and set(out["loop_us_by_blocks_on_sm"]) == {1, 2}
    assert out["sm_loop_us_min_med_max"][0] < out["sm_loop_us_min_med_max"][2]
