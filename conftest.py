"""Test-wide setup: Triton's CPU interpreter on machines without a GPU, and the ``gpu`` and
``interpreter`` markers (each skipped where it cannot run)."""
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    # Must precede the first `import triton` (COMPILE.md): Triton kernels then run on CPU tensors.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before conftest could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        # TRITON_INTERPRET is read once per process, and a GPU machine compiles: tests that launch
        # Triton kernels on CPU tensors cannot run here; tests/gpu checks the compiled kernels.
        skip = pytest.mark.skip(reason="runs Triton on CPU tensors under the interpreter, which a GPU machine does not "
                                       "enable; tests/gpu checks the compiled kernels")
        marker = "interpreter"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA device (no GPU on this machine)")
        marker = "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
