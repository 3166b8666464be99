"""Test-wide setup: Triton's CPU interpreter on machines without a GPU (its leftovers undone after each test), and
the ``gpu`` and ``interpreter`` markers (each skipped where it cannot run)."""
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


def _language_namespaces() -> list:
    """The namespaces whose builtins Triton's interpreter swaps for its own while it runs a kernel."""
    try:
        import triton.language as tl
    except ImportError:
        return []
    spaces = [tl, tl.core, tl.math, tl.core.tensor]
    descriptor = getattr(tl.core, "tensor_descriptor_base", None)  # not in every Triton release
    return spaces + ([descriptor] if descriptor is not None else [])


# Triton's interpreter (3.9) patches a kernel's language builtins while it runs and restores them after, except
# for those a nested @triton.jit call patches: they stay patched (57 names of triton.language.core after
# tests/test_add_rmsnorm.py), and a later compile for a real GPU target (the sm_90 builds of
# tests/test_int_weight_wgmma.py, cold cache) then codegens through the interpreter's builder and fails. The
# namespaces as imported are kept here and put back after every test.
_LANGUAGE = [(space, dict(vars(space))) for space in (_language_namespaces() if not HAS_CUDA else [])]


def pytest_runtest_teardown(item, nextitem):
    for space, names in _LANGUAGE:
        now = vars(space)
        for name, value in names.items():
            if now.get(name, value) is not value:
                setattr(space, name, value)


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
