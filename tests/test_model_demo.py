"""``python -m qops demo`` end to end with tiny settings, in a subprocess as a user runs it: compiled
(the default), eagerly, and from checkpoint directories (unquantized: quantized on the way;
quantized: loaded as stored); ``--help`` documents every option."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from qops.models import QUANT_SCHEMES, LlamaConfig, save_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--hidden", "128", "--vocab", "256", "--batch", "2", "--prompt-len", "3", "--tokens", "4"]


def _demo(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-m", "qops", "demo", *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"demo failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _tokens_per_s(out: str) -> float:
    m = re.search(r"^decode: ([\d,.]+) tokens/s", out, re.M)
    assert m, out
    return float(m.group(1).replace(",", ""))


def _logit_error(out: str) -> float:
    m = re.search(r"^logit error vs unquantized: ([\d.]+) \(relative Frobenius", out, re.M)
    assert m, out
    return float(m.group(1))


def test_help_documents_every_option():
    import argparse

    from qops.demo import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = subprocess.run([sys.executable, "-m", "qops", "demo", "--help"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    for action in p._actions:
        for flag in action.option_strings:
            assert flag in out
        assert action.help and action.help.strip()
    assert re.search(r"\(default:\s+gptq\)", out)


def _on_gpu() -> bool:
    """Whether the demo's default device (``--device auto``) is CUDA here, as the subprocess sees it."""
    import torch

    return torch.cuda.is_available()


def test_compiled_default_format():
    out = _demo(*TINY)
    # The default device is the GPU where there is one: compiled and captured in CUDA graphs there.
    mode = "(compiled + CUDA graphs;" if _on_gpu() else "(compiled;"
    assert "format: gptq (GPTQ int4, group 128" in out and mode in out, out
    assert _tokens_per_s(out) > 0
    assert 0 < _logit_error(out) < 0.5


def test_eager_other_format():
    out = _demo(*TINY, "--no-compile", "--format", "bitsandbytes-nf4", "--dtype", "bfloat16")
    assert "(eager;" in out and "bfloat16" in out
    assert 0 < _logit_error(out) < 0.5


@pytest.mark.parametrize("scheme", [None, "compressed-tensors"], ids=["unquantized", "quantized"])
def test_checkpoint_directory(tmp_path, scheme):
    save_random_checkpoint(str(tmp_path), LlamaConfig.tiny(num_hidden_layers=1), scheme)
    out = _demo("--checkpoint", str(tmp_path), "--no-compile", "--format", "awq", "--batch", "1", "--tokens", "3")
    if scheme is None:
        assert "format: awq" in out and 0 < _logit_error(out) < 0.5
    else:
        assert "--format ignored" in out and "n/a (the checkpoint is already quantized)" in out
    # Four int-weight linears: the reference kernel on a CPU; on a GPU whichever CUDA lowering the
    # chooser picks for these shapes (the lowerings line names it).
    if _on_gpu():
        from qops.lowerings import LOWERINGS

        line = re.search(r"^lowerings: (.*)$", out, re.M)
        used = dict(re.findall(r"(\S+) x(\d+)", line.group(1))) if line else {}
        cuda = {low.name for low in LOWERINGS if low.family == "int_weight" and low.name != "reference_int_weight"}
        assert used and set(used) <= cuda and sum(map(int, used.values())) == 4, out
    else:
        assert "lowerings: reference_int_weight x4" in out, out


def test_quantize_head():
    out = _demo(*TINY, "--no-compile", "--quantize-head")
    # One decoder layer's four linears and the head.
    used = dict(re.findall(r"(\S+) x(\d+)", re.search(r"^lowerings: (.*)$", out, re.M).group(1)))
    assert sum(map(int, used.values())) == 5, out
    assert 0 < _logit_error(out) < 0.5


@pytest.mark.parametrize("scheme", [s for s in QUANT_SCHEMES if s != "gptq"])
def test_quantize_head_every_format(scheme, capsys):
    """Every format the demo lists quantizes the head (in process: about a second each). The
    compressed-tensors ones once kept lm_head on their config's ignore list and failed to load it."""
    from qops.__main__ import main

    assert main(["demo", *TINY, "--no-compile", "--quantize-head", "--format", scheme]) == 0
    out = capsys.readouterr().out
    used = dict(re.findall(r"(\S+) x(\d+)", re.search(r"^lowerings: (.*)$", out, re.M).group(1)))
    assert sum(map(int, used.values())) == 5, out


def test_random_config_keeps_k_and_v_on_the_formats_blocks():
    """--hidden 1152 (18 heads) once took 3 KV heads: k/v of 192 columns, which fp8-block's 128-wide
    scale blocks cannot fuse, so the model could not be built at any world size."""
    import torch

    from qops.demo import random_config
    from qops.models import LlamaForCausalLM

    assert random_config(1152, 1, 256).num_key_value_heads == 3  # no block to keep to: a quarter of the heads, as before
    config = random_config(1152, 1, 256, QUANT_SCHEMES["fp8-block"].multiple)
    assert config.num_key_value_heads == 2 and config.num_attention_heads == 18
    model = LlamaForCausalLM.random(config, "fp8-block", dtype=torch.float32, max_batch=1, max_seq=4, process_group=None)
    assert len(model.quantized_linears()) == 4


@pytest.mark.parametrize("args,message", [
    (["--device", "foo"], "qops demo: --device must be auto, cpu, cuda or cuda:N, got 'foo'"),
    (["--device", "meta"], "qops demo: --device must be auto, cpu, cuda or cuda:N, got 'meta'"),
    (["--device", "cuda:x"], "qops demo: --device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    (["--checkpoint", "/nonexistent/qops-checkpoint"], "qops demo: --checkpoint /nonexistent/qops-checkpoint: no such directory"),
    (["--checkpoint", "{tmp}"], "qops demo: --checkpoint {tmp}: no config.json there"),
])
def test_bad_device_or_checkpoint_is_a_clean_message(args, message, tmp_path):
    """Each once ended in a traceback: torch's device-string RuntimeError, 'Tensor.item() cannot be called
    on meta tensors' deep in the run, a FileNotFoundError for config.json."""
    from qops.__main__ import main

    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as e:
        main(["demo", *TINY, "--no-compile", *args])
    assert str(e.value).startswith(message.format(tmp=tmp_path)), e.value


def test_one_token_has_no_decode_rate(capsys):
    # Once printed "decode: nan tokens/s (eager; 2 x 0 steps in 0.000 s)".
    from qops.__main__ import main

    assert main(["demo", *TINY[:-2], "--tokens", "1", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^decode: n/a \(no decode steps: the only new token comes from the prefill\); prefill 2 x 3 tokens in", out, re.M), out
    assert "nan" not in out


def test_quantize_head_refuses_a_vocabulary_off_the_tile():
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [*TINY[:4], "--vocab", "250", "--quantize-head", "--no-compile"]
    r = subprocess.run([sys.executable, "-m", "qops", "demo", *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode != 0 and "--quantize-head needs a vocabulary that is a multiple of 128 for gptq; this model's is 250" in r.stderr, r.stderr
