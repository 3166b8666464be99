"""The native 4-bit blockwise kernel without a GPU: every variant its plans and sweeps ask for compiles
with NVRTC for sm_80 and sm_90 within its register budget (no spills on sm_90), the launch rule, the
refusals that send calls to Triton, and its place in the lowering table. Its numerics are checked on
the GPU (``tests/gpu/test_gpu_native_blockwise4.py``)."""
from __future__ import annotations

import re

import pytest
import torch

from qops.lowerings import LOWERINGS_BY_NAME, Kernel, WeightSpec
from qops.ops.blockwise4 import LAYOUT_FLAT, LAYOUT_TILE16
from qops.native import blockwise4 as nbw4
from qops.native import compiler
from tests.native_builds import builds_for, compile_reports, spills_allowed

pytestmark = pytest.mark.skipif(compiler.runtime_missing() is not None, reason=f"NVRTC unusable: {compiler.runtime_missing()}")

H200_SMS = 132


def _variants():
    """(defines, promised blocks an SM) for each dtype x row tiles x N tiles x nesting, blocksizes 64
    and 4096, both byte orders of qweight, and the warps / ring depths / warp groups the sweep tries."""
    for dt in (torch.float16, torch.bfloat16):
        for m in (1, 16):
            for n in (4096, 28672):  # (4096: one tile at M <= 8, the 216-register ring at M > 8)
                for nested, bs in ((True, 64), (False, 4096)):
                    layout = LAYOUT_TILE16 if nested else LAYOUT_FLAT
                    yield nbw4.plan(m, n, 4096, H200_SMS, bs).defines(dt, nested, bs, 256, layout)
    for m, fields in ((16, {"warps": 4, "minb": 2}), (1, {"warps": 16, "minb": 1, "tiles": 1}), (1, {"ring": 4, "tiles": 1}),
                      (16, {"ring": 4, "tiles": 1, "scale": "chains", "persistent": False}), (16, {"ring": 2, "minb": 1, "scale": "chains"}),
                      (1, {"scale": "chains", "lut_imm": False}), (1, {"scale": "chains", "tiles": 1}),
                      (1, {"scale": "cols"}), (8, {"scale": "cols", "tiles": 1}), (8, {"scale": "cols", "lut_imm": False}),
                      (1, {"persistent": True}), (16, {"persistent": True}), (1, {"persistent": True, "tiles": 1, "ring": 3}),
                      (1, {"wn": 8, "tiles": 1, "ring": 3}), (1, {"wn": 4, "tiles": 1, "ring": 3}), (16, {"wn": 2, "tiles": 1}),
                      (8, {"wn": 8, "tiles": 1, "ring": 3, "persistent": True}),
                      (1, {"alu": 1}), (1, {"alu": 8, "ring": 2}), (16, {"alu": 1})):  # ALU decoding (a measurement knob)
        with nbw4.plan_override(**fields):
            yield nbw4.plan(m, 28672, 4096, H200_SMS, 64).defines(torch.float16, True, 64, 256, LAYOUT_TILE16)


def _ptxas(log: str) -> tuple[int, int]:
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores", log)
    return regs, int(spills.group(1)) if spills else 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_planned_variant_compiles_without_spills(arch):
    for defines, log in compile_reports(nbw4.SOURCE, arch, builds_for(arch, _variants())):
        regs, spills = _ptxas(log)
        assert regs <= 65536 // (32 * defines["QOPS_WARPS"] * defines["QOPS_MINB"]), (defines, log)  # the promised blocks fit an SM
        if arch == "sm_90":
            assert spills <= spills_allowed(nbw4.SOURCE, defines), (defines, log)


def test_a_bad_compile_time_configuration_is_refused():
    src = compiler.native_source(nbw4.SOURCE)
    with pytest.raises(compiler.NativeCompileError, match="multiple of 64"):
        compiler.compile(src, "sm_90", compiler.native_options({"QOPS_BLOCKSIZE": 32}))
    with pytest.raises(compiler.NativeCompileError, match="QOPS_MT"):
        compiler.compile(src, "sm_90", compiler.native_options({"QOPS_MT": 3}))


def test_plan_rule():
    # Wide tiles where every SM still gets a block, and always at M > 8. Pre-scaled everywhere; the
    # one-prmt table addresses at M <= 8.
    P = nbw4.Plan
    assert nbw4.plan(1, 28672, 4096, H200_SMS, 64) == P(mt=1, tiles=2, warps=8, ring=3, minb=2, scale="prescale", lut_imm=True, wn=4)
    assert nbw4.plan(1, 57344, 8192, H200_SMS, 64).ring == 2
    # Warp groups along N at M <= 8, 16 steps a warp, where 1.5 blocks an SM remain.
    assert [nbw4.plan(m, 57344, 8192, H200_SMS, 64).wn for m in (1, 8, 9, 16)] == [2, 2, 1, 1]
    assert nbw4.plan(1, 8192, 28672, H200_SMS, 64).wn == 1 and nbw4.plan(1, 4096, 14336, H200_SMS, 64).wn == 1
    assert nbw4.plan(1, 14336, 4096, H200_SMS, 64).wn == 1  # 112 blocks of four groups: too few
    with nbw4.plan_override(tiles=1, ring=3):
        assert nbw4.plan(1, 28672, 4096, H200_SMS, 64).wn == 1
    with nbw4.plan_override(wn=2):
        assert nbw4.plan(1, 28672, 4096, H200_SMS, 64).wn == 2
    with pytest.raises(ValueError, match="wn=3 does not divide warps=8"):
        P(mt=1, tiles=2, warps=8, ring=2, minb=2, wn=3)
    assert nbw4.plan(8, 28672, 4096, H200_SMS, 64).mt == 1
    assert nbw4.plan(1, 4096, 14336, H200_SMS, 64).tiles == 1
    assert nbw4.plan(8, 8192, 28672, H200_SMS, 64) == P(mt=1, tiles=2, warps=8, ring=2, minb=2, scale="prescale", lut_imm=True)
    assert nbw4.plan(8, 4096, 14336, H200_SMS, 64) == P(mt=1, tiles=1, warps=8, ring=3, minb=2, scale="prescale", lut_imm=True)
    assert nbw4.plan(9, 57344, 8192, H200_SMS, 64) == P(mt=2, tiles=2, warps=8, ring=2, minb=2, scale="prescale", persistent=True)
    assert not nbw4.plan(8, 57344, 8192, H200_SMS, 64).persistent and not nbw4.plan(16, 8192, 28672, H200_SMS, 64).persistent
    assert nbw4.plan(16, 4096, 4096, H200_SMS, 64) == P(mt=2, tiles=2, warps=8, ring=3, minb=1, scale="prescale")
    assert nbw4.plan(16, 8192, 4096, H200_SMS, 64) == P(mt=2, tiles=2, warps=8, ring=2, minb=2, scale="prescale")
    # One block a step: 8 rows of x a tile whatever the scale field says.
    assert nbw4.plan(8, 8192, 28672, H200_SMS, 128).mt == 1
    assert nbw4.plan(1, 1000, 128, H200_SMS, 64).grid(1000, 0) == 63
    with nbw4.plan_override(persistent=True):
        p = nbw4.plan(1, 28672, 4096, H200_SMS, 64)
    assert p.grid(28672, 2 * H200_SMS) == 2 * H200_SMS and p.grid(4096, 2 * H200_SMS) == 128 and p.grid(28672, 0) == 896
    assert p.shmem_bytes == 256 * 256 + 256 * 4 + 8 * 2 * 1 * 32 * 16  # the partials after the table
    with nbw4.plan_override(warps=16, ring=2, minb=1):
        assert nbw4.plan(1, 4096, 4096, H200_SMS, 64) == P(mt=1, tiles=1, warps=16, ring=2, minb=1, scale="prescale", lut_imm=True)
    assert nbw4.plan(1, 4096, 4096, H200_SMS, 64).warps == 8
    # Overrides of the scale decide the x tiles: 4 rows of x a tile in separate block columns.
    with nbw4.plan_override(scale="cols"):
        assert nbw4.plan(4, 8192, 28672, H200_SMS, 64).mt == 1
        assert nbw4.plan(5, 8192, 28672, H200_SMS, 64).mt == 2
        assert nbw4.plan(5, 8192, 28672, H200_SMS, 128).mt == 1  # one block a step: no block columns
    with nbw4.plan_override(scale="cols"), pytest.raises(ValueError, match="M=9 needs 3 x tiles"):
        nbw4.plan(9, 8192, 28672, H200_SMS, 64)
    with pytest.raises(ValueError, match="scale='both'"):
        P(mt=1, tiles=1, warps=8, ring=2, minb=2, scale="both")


@pytest.mark.parametrize("args,why", [
    ((4096, 4096, 64, torch.float32), "activation dtype torch.float32"),
    ((4096, 4000, 64, torch.float16), "K=4000 is not a multiple of 128"),
    ((4096, 4096, 32, torch.bfloat16), "blocksize=32 is not a multiple of 64"),
    ((2**18, 2**13, 64, torch.float16), "does not fit the kernel's 32-bit flat index"),
    ((4096, 4096, 64, torch.float16, 255), "nested_blocksize=255 is odd"),
])
def test_refusals_name_the_reason(args, why):
    assert why in nbw4.refusal(*args)


def test_served_shapes_are_not_refused():
    for n, k, bs in ((28672, 4096, 64), (4096, 14336, 64), (57344, 8192, 64), (8192, 28672, 4096), (33, 640, 256)):
        assert nbw4.refusal(n, k, bs, torch.bfloat16) is None and nbw4.refusal(n, k, bs, torch.float16, 256) is None


def test_lowering_entry_and_its_declared_capabilities():
    low = LOWERINGS_BY_NAME["native_blockwise4"]
    assert low.kernel == Kernel.NATIVE and low.priority > LOWERINGS_BY_NAME["triton_blockwise4"].priority
    assert low.group_sizes == frozenset({64, 128, 256, 512, 1024, 2048, 4096}) and low.k_multiple == 128
    spec = WeightSpec(family="blockwise4", format="bitsandbytes-nf4", bits=4, group_size=32, n=64, k=128, act_order=False,
                      symmetric=True, device=torch.device("cuda"), act_dtype=torch.float16)
    assert "group_size=32" in low.static_refusal(spec)
    assert low.static_refusal(WeightSpec(**{**spec.__dict__, "group_size": 64})) is None
    assert "K=192 is not a multiple of 128" in low.static_refusal(WeightSpec(**{**spec.__dict__, "group_size": 64, "k": 192}))
    from qops.lowerings import _entry

    assert _entry(low.entry) is nbw4.native_mm and _entry(low.warmup) is nbw4.warmup


def test_the_shared_window_base_is_not_measured_during_capture(monkeypatch):
    """lut_imm kernels bake the base into their code: it is measured (a launch and a sync) at warm-up,
    and asking for it first during CUDA-graph capture is a clear error, not a capture failure."""
    monkeypatch.setattr(compiler, "_shared_base", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(compiler.NativeNotReadyError, match="dynamic shared memory base of cuda:0"):
        compiler.dynamic_shared_base(0)
    monkeypatch.setattr(compiler, "_shared_base", {0: 1024})
    assert compiler.dynamic_shared_base(0) == 1024, "known once measured"


def test_shared_memory_a_block_follows_the_table_layout():
    plan = nbw4.plan(1, 28672, 4096, H200_SMS, 64)
    assert plan.lut_imm and plan.shmem_bytes == 256 * 256 + 256 * 4
    assert nbw4.plan(16, 28672, 4096, H200_SMS, 64).shmem_bytes == 256 * 128 + 256 * 4 + 8 * 2 * 2 * 32 * 16  # persistent: + partials
    assert plan.defines(torch.float16, True, 64, 256, LAYOUT_TILE16, 1024)["QOPS_SMEM_BASE"] == 1024
    with nbw4.plan_override(lut_imm=False):
        assert nbw4.plan(1, 28672, 4096, H200_SMS, 64).defines(torch.float16, True, 64, 256, LAYOUT_TILE16, 1024)["QOPS_SMEM_BASE"] == 0
