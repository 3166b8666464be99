"""What the GPU machine's older torch (2.11) refuses in code Dynamo traces, checked here where CI runs 2.13.

torch 2.11's Dynamo takes a ``torch._check`` message only from a function that reads nothing from
outside it; 2.13's accepts a closure. A closure there failed every compiled model step on the H200
(46 GPU tests at 9e22224) while CI passed. The model's and the layers' forward code is what Dynamo
traces, so its ``torch._check*`` messages must be constants; the ops' argument checks (qops/ops, and
the model-level ops' in qops/models/attention.py, norm.py, layer_kernel.py) run inside their fake
kernels under fake tensors, where Dynamo does not look, and may format their messages.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qops

ROOT = Path(qops.__file__).parent
TRACED = [ROOT / "models" / "llama.py", *sorted((ROOT / "layers").glob("*.py"))]


def _message_problems(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("_check")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        msg = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "message"), None)
        if msg is None:
            continue
        if not (isinstance(msg, ast.Lambda) and isinstance(msg.body, ast.Constant)):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(msg)}")
    return out


@pytest.mark.parametrize("path", TRACED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_traced_checks_have_constant_messages(path):
    assert not _message_problems(path), "torch._check messages Dynamo 2.11 cannot extract (make them constants): " + "; ".join(_message_problems(path))


def test_the_scan_finds_a_closure(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import torch\ndef f(who, x):\n    torch._check(x.shape[0] == 1, lambda: f"{who}: one row")\n    torch._check(x.shape[0] == 1, lambda: "fine")\n')
    assert _message_problems(bad) == ['bad.py:3: lambda: f\'{who}: one row\'']
