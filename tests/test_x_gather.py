"""x gathered once a call (``qops/ops/triton/x_gather.py``) under Triton's interpreter: both routes (direct, and
through x transposed) against indexing of x by an index built here, the 32-bit words they zero, their refusals,
and the scratch the wgmma kernel and the Triton GEMM set aside for them. The GPU suite runs the gathers compiled,
through the kernels' float64 oracle tests (act-order weights at M = 1 / 17 / 64 / 257)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from qops.ops.triton import common as C
from qops.ops.triton import int_weight_wgmma as G
from qops.ops.triton import x_gather as X


def mma_order(k: int) -> torch.Tensor:
    """The wgmma kernel's K order written from its definition (module docstring of ``int_weight_wgmma``): the MMA's
    K position ``32b + 16cc + 8h + 2t + e`` holds weight row ``32b + 8t + 2cc + h + 4e``."""
    order = torch.empty(k, dtype=torch.int64)
    for b in range(k // 32):
        for cc in range(2):
            for h in range(2):
                for t in range(4):
                    for e in range(2):
                        order[32 * b + 16 * cc + 8 * h + 2 * t + e] = 32 * b + 8 * t + 2 * cc + h + 4 * e
    return order


def k_strided(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """An (m, k) x stored column-major (K-strided), cut out of a wider buffer."""
    return torch.randn(m, k + 32, dtype=torch.float32)[:, 32:].to(dtype).t().contiguous().t()


def with_guard(scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scratch`` re-made as the front of a buffer whose 7 words after it hold 3: (scratch, buffer, guard)."""
    after = torch.full((7,), 3, dtype=torch.int32)
    backing = torch.cat([scratch.view(torch.int32).reshape(-1), after])
    return backing[:scratch.numel()].view(scratch.dtype).view(scratch.shape), backing, after


def test_the_kernels_mma_order_is_the_reference_index():
    assert torch.equal(G.x_gather_index(256, None, torch.device("cpu")), mma_order(256))
    perm = torch.randperm(256)
    assert torch.equal(G.x_gather_index(256, perm, torch.device("cpu")), perm[mma_order(256)])


@pytest.mark.interpreter
@pytest.mark.parametrize("route", ["direct", "transposed"])
@pytest.mark.parametrize("m,k,order,zeroed,dtype", [
    (5, 64, True, "counts", torch.float16),    # one column block a row
    (17, 1088, True, "sum", torch.bfloat16),   # K off the 64-wide tiles; M off the 16-row tiles
    (64, 96, False, None, torch.float16),      # act-order alone (the Triton GEMM's gather)
    (70, 160, True, "sum", torch.float32),     # two row blocks of the transposed gather
    (1, 32, False, "counts", torch.bfloat16),
])
def test_gather_orders_x_and_zeroes_the_scratch(route, m, k, order, zeroed, dtype):
    x = k_strided(m, k, dtype)
    perm = torch.randperm(k).to(torch.int32)
    want = x[:, (perm.long()[mma_order(k)] if order else perm.long())]
    xg = torch.full((m, k), float("nan"), dtype=dtype)
    scratch = guard = backing = None
    if zeroed is not None:
        raw = {"counts": torch.full((2500,), 7, dtype=torch.int32),
               "sum": torch.full((m, 1001), float("nan"), dtype=torch.float32)}[zeroed]
        scratch, backing, guard = with_guard(raw)
    xt = torch.full((m * k + 5,), float("nan"), dtype=dtype) if route == "transposed" else None
    X.gather_x(x, perm, xg, scratch, mma_order=order, xt=xt)
    assert torch.equal(xg, want)
    if route == "transposed":
        assert torch.equal(xt[:m * k].view(k, m), x.t())
    if scratch is not None:
        assert bool((scratch == 0).all()) and torch.equal(backing[scratch.numel():], guard)


@pytest.mark.interpreter
def test_gather_without_act_order_takes_the_mma_order_alone():
    x = torch.randn(3, 128, dtype=torch.float16)
    xg = torch.empty(3, 128, dtype=torch.float16)
    X.gather_x(x, None, xg)
    assert torch.equal(xg, x[:, mma_order(128)])


def test_gather_refuses_what_it_cannot_do():
    x = torch.randn(16, 64, dtype=torch.float16)
    xg = torch.empty_like(x)
    perm = torch.randperm(64).to(torch.int32)
    with pytest.raises(ValueError, match="nothing to gather"):
        X.gather_x(x, None, xg, mma_order=False)
    with pytest.raises(ValueError, match="act_perm is None"):
        X.gather_x(x, None, xg, xt=torch.empty(16 * 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="xt must be contiguous torch.float16 of >= 1024"):
        X.gather_x(x, perm, xg, xt=torch.empty(16 * 64 - 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="xt must be contiguous"):
        X.gather_x(x, perm, xg, xt=torch.empty(16 * 64, dtype=torch.bfloat16))


def test_the_transposed_route_is_act_orders_from_its_size():
    mk = X.TRANSPOSED_FROM_MK
    assert mk == 1 << 19
    assert not X.transposes(31, 16384, True) and X.transposes(32, 16384, True) and X.transposes(128, 4096, True)
    assert not X.transposes(127, 4096, True) and not X.transposes(4096, 4096, False)
    assert X.gather_scratch(32, 16384, 2, True) == (2 * 32 * 16384,) * 2
    assert X.gather_scratch(32, 16384, 2, False)[1] == X.gather_scratch(31, 16384, 2, True)[1] == 0
    assert X.gather_scratch(3, 100, 2, True) == (256 * -(-2 * 3 * 100 // 256), 0)


def test_the_wgmma_workspace_holds_x_transposed_after_its_other_parts():
    for tile in ({"split": 3}, {"split": 3, "reduce": "partials"}, {}):
        go = G.plan(130, 4104, 4096, 4, 128, tile)
        parts = G._scratch_parts(130, 4104, 4096, go, act_order=True)
        assert parts[3] == X.gather_scratch(130, 4096, 2, True)[1] >= 2 * 130 * 4096
        assert G.workspace_bytes(130, 4104, 4096, go, act_order=True) == G.workspace_bytes(130, 4104, 4096, go) + parts[3]
        assert all(p % C.SCRATCH_ALIGN == 0 for p in parts)  # each part starts aligned
    go = G.plan(64, 4104, 4096, 4, 128, {"split": 2})
    assert G._scratch_parts(64, 4104, 4096, go, act_order=True)[3] == 0  # under TRANSPOSED_FROM_MK: direct


SM90_BUILDS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qops.ops.triton import x_gather as X

consts = {"BLOCK": 1024, "HAS_PERM": True, "MMA_ORDER": True, "PDL": True, "DEPENDENT": True, "BLOCK_M": 64,
          "BLOCK_K": 64, "BLOCK_Q": 64, "ZERO_BLOCK": 1024}
ptrs = {"x_ptr": "*fp16", "xt_ptr": "*fp16", "xg_ptr": "*fp16", "perm_ptr": "*i32", "zero_ptr": "*i32"}
found = {}
for kernel in ("_gather_kernel", "_transpose_kernel", "_gather_rows_kernel"):
    fn = getattr(X, kernel)
    sig = {name: "constexpr" if name in consts else ptrs.get(name, "i32") for name in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, {n: v for n, v in consts.items() if n in fn.arg_names}),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
    found[kernel] = sorted((op for op in ("griddepcontrol.launch_dependents", "griddepcontrol.wait") if op in ptx),
                           key=ptx.index)  # in the order they come
print(json.dumps(found))
"""


def test_gathers_compile_for_sm90_as_pdl_links():
    # What CI can prove of the compiled kernels without a GPU (a process of its own: this one runs Triton's
    # interpreter, which has no griddepcontrol steps): each builds for sm_90 and lets its dependent start early. As
    # dependents of the launch ahead the direct gather and the transpose wait for it (griddepcontrol.wait) before
    # they let theirs be placed; the transposed route's gather lets its dependent start, then waits for the
    # transpose before it reads xt.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SM90_BUILDS], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"_gather_kernel": ["griddepcontrol.wait", "griddepcontrol.launch_dependents"],
                     "_transpose_kernel": ["griddepcontrol.wait", "griddepcontrol.launch_dependents"],
                     "_gather_rows_kernel": ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]}, found
