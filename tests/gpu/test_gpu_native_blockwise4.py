"""The native 4-bit blockwise lowering (``native_blockwise4``: bitsandbytes NF4 / FP4 through
``qops/native/blockwise4_gemv.cu``) on a CUDA device, through the public ops.

Each check is against float64 ``x @ W.T (+ bias)`` with W from the oracles of ``tests/bnb_cases.py``
(written without qops), on fresh random x: every M the kernel takes (1..16, and 0), M = 17 and 64 (two
and four 16-row slices), 65 and 257 (delegated to Triton), fp16 and bf16, plain and nested absmax, blocksizes 64
to 4096 (blocks that straddle rows included), N off the 32-row tile grid, both byte orders of qweight
(tile16 where prepare builds it: N % 16 == 0; flat elsewhere, and the same weight in both orders
bit for bit), non-contiguous and misaligned x, bias in the activation dtype and in fp32, a
caller-owned ``out`` poisoned with NaN, determinism, CUDA-graph capture after warm-up, and the
chooser's refusals.
"""
from __future__ import annotations

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import Kernel
from qops.native import blockwise4 as nbw4
from qops.ops.blockwise4 import LAYOUT_FLAT, LAYOUT_TILE16

from tests import bnb_cases as C

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
CASES = (
    C.Case("bitsandbytes-nf4", 1000, 2048, blocksize=64, nested=True),  # N % 32 = 8
    C.Case("bitsandbytes-fp4", 1024, 4096, blocksize=128, nested=False),
    C.Case("bitsandbytes-nf4", 33, 640, blocksize=256, nested=False),  # K % blocksize != 0: blocks straddle rows
    C.Case("bitsandbytes-nf4", 72, 1024, blocksize=4096, nested=True),  # a block holds four rows
    C.Case("bitsandbytes-fp4", 4096, 4096, blocksize=64, nested=True),  # a decode-sized layer
)
MS = (1, 2, 7, 8, 9, 16, 17, 64, 65, 257, 0)
_BUILT: dict = {}


def gpu_weight(case: C.Case, dtype: torch.dtype):
    key = (case, dtype)
    if key not in _BUILT:
        fmt = FORMATS[case.fmt]
        state = C.random_state(case, torch.Generator().manual_seed(C.seed_of(case)))
        ckpt = fmt.from_state_dict({k: v.cuda() for k, v in state.items()})
        _BUILT[key] = (fmt.prepare(ckpt, dtype=dtype), C.oracle_of(case, state).cuda())
    return _BUILT[key]


def check(y, x, w64, bias, dtype, what):
    C.check_output(y, x, w64, bias, dtype, TOL[dtype], what)


def test_chooser_picks_native_where_it_serves():
    for case in CASES:
        w, _ = gpu_weight(case, torch.float16)
        assert w.kernel == Kernel.NATIVE and w.choice.lowering.name == "native_blockwise4", (case.id, w.choice.explain())
    refused = {
        C.Case("bitsandbytes-nf4", 520, 1024, blocksize=32, nested=False): "group_size=32",
        C.Case("bitsandbytes-nf4", 33, 192, blocksize=64, nested=True): "K=192 is not a multiple of 128",
    }
    for case, why in refused.items():
        w, w64 = gpu_weight(case, torch.float16)
        assert w.kernel == Kernel.TRITON, w.choice.explain()
        assert why in dict(w.choice.refusals)["native_blockwise4"], w.choice.explain()
        x = torch.randn(3, case.k, device="cuda", dtype=torch.float16)
        check(w.mm(x), x, w64, None, torch.float16, case.id)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_m_against_float64(case, dtype):
    w, w64 = gpu_weight(case, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(case.n, device="cuda", generator=gen).to(dtype)
    for m in MS:
        x = torch.randn(m, case.k, device="cuda", generator=gen).to(dtype)
        b = bias if m % 2 else None
        check(w.mm(x, b), x, w64, b, dtype, f"M={m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_strided_misaligned_x_fp32_bias_and_out(dtype):
    case = CASES[0]
    w, w64 = gpu_weight(case, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    bias32 = torch.randn(case.n, device="cuda", generator=gen)
    for m in (1, 5, 16):
        base = torch.randn(m, case.k + 2, device="cuda", generator=gen).to(dtype)
        for name, x in (("transposed", torch.randn(case.k, m, device="cuda", generator=gen).to(dtype).t()),
                        ("odd offset", base[:, 1:-1]), ("padded rows", base[:, :-2])):
            check(w.mm(x, bias32), x, w64, bias32, dtype, f"{name} M={m} fp32 bias")
            out = torch.full((m, case.n), float("nan"), device="cuda", dtype=dtype)
            torch.ops.qops.mm_blockwise4_out(x, *w._weight_args(), bias32, *w._static_args(), int(w.kernel), out, None)
            check(out, x, w64, bias32, dtype, f"{name} M={m} out")
            wide = torch.full((m, 2 * case.n), float("nan"), device="cuda", dtype=dtype)
            torch.ops.qops.mm_blockwise4_out(x, *w._weight_args(), None, *w._static_args(), int(w.kernel), wide[:, ::2], None)
            check(wide[:, ::2], x, w64, None, dtype, f"{name} M={m} strided out")


def test_batched_leading_dims_and_agreement_with_triton():
    case = CASES[1]
    w, w64 = gpu_weight(case, torch.float16)
    x = torch.randn(2, 3, case.k, device="cuda", dtype=torch.float16)
    y = w.mm(x)
    assert y.shape == (2, 3, case.n)
    check(y.reshape(6, case.n), x.reshape(6, case.k), w64, None, torch.float16, "(2, 3, K)")
    tri = torch.ops.qops.mm_blockwise4(x, *w._weight_args(), None, *w._static_args(), int(Kernel.TRITON))
    assert C.rel_err(y, tri.double()) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tile16_is_prepared_for_the_kernel_and_equals_the_flat_order(dtype):
    for case in (CASES[1], CASES[4]):
        w, w64 = gpu_weight(case, dtype)
        assert w.layout == LAYOUT_TILE16, case.id
        flat = w.with_layout(LAYOUT_FLAT)
        assert flat.kernel == Kernel.NATIVE and torch.equal(flat.with_layout(LAYOUT_TILE16).qweight, w.qweight)
        gen = torch.Generator(device="cuda").manual_seed(2)
        for m in (1, 8, 16, 17, 40, 80):  # 80: past the native slices, Triton's dense path reads tile16
            x = torch.randn(m, case.k, device="cuda", generator=gen).to(dtype)
            y = w.mm(x)
            sliced = m <= nbw4.SLICED_MAX_M
            assert torch.equal(y, flat.mm(x)) if sliced else C.rel_err(y, flat.mm(x).double()) < TOL[dtype], (case.id, m)
            check(y, x, w64, None, dtype, f"{case.id} tile16 M={m}")
    for case in (CASES[0], CASES[2], CASES[3]):  # N % 16 != 0: no tile16 form
        assert gpu_weight(case, dtype)[0].layout == LAYOUT_FLAT, case.id


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_nested_groups_change_inside_a_warps_steps(dtype):
    # 224 blocks a row, 256 a nested group: most rows enter a new group mid-row, inside a warp's 14
    # steps (the other cases have at most one group a warp's range).
    case = C.Case("bitsandbytes-nf4", 64, 14336, blocksize=64, nested=True)
    w, w64 = gpu_weight(case, dtype)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for m in (1, 3, 8, 16):
        x = torch.randn(m, case.k, device="cuda", generator=gen).to(dtype)
        check(w.mm(x), x, w64, None, dtype, f"M={m}")


@pytest.mark.parametrize("n", [12304, 9000])  # tile16 with a last tile of 16 rows; flat, N % 16 != 0
def test_persistent_blocks_take_several_tiles(n):
    # More 32-row tiles than the SMs hold blocks: each block takes several, requesting the next
    # tile's first steps before summing the current one. Bit for bit the one-tile-a-block result.
    case = C.Case("bitsandbytes-nf4", n, 512, blocksize=64, nested=True)
    w, w64 = gpu_weight(case, torch.float16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert nbw4.plan(1, n, 512, sms, 64).tiles_of(n) > 2 * sms
    gen = torch.Generator(device="cuda").manual_seed(5)
    for m in (1, 5, 16):
        x = torch.randn(m, case.k, device="cuda", generator=gen).half()
        y = w.mm(x)
        with nbw4.plan_override(persistent=True):
            yp = w.mm(x)
        assert torch.equal(yp, y), m
        check(yp, x, w64, None, torch.float16, f"persistent M={m}")


def test_deterministic_and_plans_agree():
    case = CASES[4]
    w, w64 = gpu_weight(case, torch.bfloat16)
    x = torch.randn(16, case.k, device="cuda", dtype=torch.bfloat16)
    first = w.mm(x)
    for _ in range(3):
        assert torch.equal(w.mm(x), first)
    for fields in ({"tiles": 1}, {"tiles": 2, "minb": 1}, {"warps": 4}, {"warps": 16, "minb": 1}, {"ring": 2}, {"ring": 4, "minb": 1},
                   {"scale": "prescale"}, {"scale": "chains", "minb": 1}, {"lut_imm": True}, {"lut_imm": False},
                   {"lut_imm": True, "tiles": 1, "ring": 3}, {"lut_imm": False, "scale": "chains", "tiles": 1},
                   {"scale": "cols", "lut_imm": False}, {"scale": "cols", "tiles": 1, "ring": 3}, {"persistent": True},
                   {"persistent": True, "tiles": 1, "ring": 3}, {"wn": 8, "tiles": 1, "ring": 3}, {"wn": 4, "tiles": 1, "ring": 3},
                   {"wn": 2}, {"wn": 4}, {"wn": 8, "tiles": 1, "ring": 3, "persistent": True}, {"wn": 4, "warps": 16, "minb": 1}):
        with nbw4.plan_override(**fields):
            for m in ((1, 4, 5, 8) if fields.get("scale") == "cols" else (1, 16)):
                check(w.mm(x[:m]), x[:m], w64, None, torch.bfloat16, f"{fields} M={m}")
    # 5 steps of K over 8 warps: warps with no step
    w5, w5_64 = gpu_weight(CASES[2], torch.float16)
    x5 = torch.randn(3, CASES[2].k, device="cuda", dtype=torch.float16)
    for fields in ({}, {"lut_imm": False, "scale": "chains"}, {"warps": 4, "ring": 4, "tiles": 1}, {"wn": 4, "tiles": 1, "ring": 3}):
        with nbw4.plan_override(**fields):
            check(w5.mm(x5), x5, w5_64, None, torch.float16, f"K=640 {fields}")
    # Warp groups side by side along N: N = 1000 ends inside a group of the last block.
    w0, w0_64 = gpu_weight(CASES[0], torch.float16)
    x0 = torch.randn(9, CASES[0].k, device="cuda", dtype=torch.float16)
    for fields in ({"wn": 8, "tiles": 1, "ring": 3}, {"wn": 2, "tiles": 2}):
        with nbw4.plan_override(**fields):
            for m in (1, 9):
                check(w0.mm(x0[:m]), x0[:m], w0_64, None, torch.float16, f"N=1000 {fields} M={m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alu_decoding_is_the_table_bit_for_bit(dtype):
    # QOPS_ALU (a measurement knob): words decoded by prmt selections from the codes' bytes in registers
    # instead of the shared-memory table give the same operands, so the same bits, for every share of
    # the words, NF4 and FP4 codebooks, one-block (blocksize 128) and two-block (64, pre-scaled and
    # chains) steps, M in both x tiles.
    for case in (CASES[0], CASES[1], CASES[4]):
        w, w64 = gpu_weight(case, dtype)
        x = torch.randn(16, case.k, device="cuda", dtype=dtype)
        for base in ({}, {"scale": "chains", "minb": 1}, {"lut_imm": False}):
            for m in (1, 5, 16):
                with nbw4.plan_override(**base):
                    want = w.mm(x[:m])
                for alu in (1, 2, 4, 5, 8):
                    with nbw4.plan_override(**base, alu=alu):
                        y = w.mm(x[:m])
                    assert torch.equal(y, want), f"{case} {base} alu={alu} M={m}"
                check(y, x[:m], w64, None, dtype, f"{case} alu=8 M={m}")


@pytest.mark.parametrize("m", [1, 9])
def test_cuda_graph_capture_after_warmup(m):
    case = CASES[0]
    w, w64 = gpu_weight(case, torch.float16)
    assert nbw4.warmup(w) >= 2  # M <= 8 and M <= 16 variants
    C.check_graph_replay(w, w64, m, TOL[torch.float16])


def test_torch_compile_fullgraph_with_cuda_graphs():
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    case = CASES[3]
    w, w64 = gpu_weight(case, torch.bfloat16)
    bias = torch.randn(case.n, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        f = torch.compile(lambda x: torch.relu(w.mm(x, bias)), fullgraph=True, mode="reduce-overhead")
        for m in (1, 4, 16, 4):
            x = torch.randn(m, case.k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                y = f(x).clone()
            assert C.rel_err(y, torch.relu(C.matmul(x, w64, bias))) <= TOL[torch.bfloat16], f"M={m}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch._dynamo.reset()


def test_occupancy_is_known_before_the_first_launch():
    """The early PDL release of one-wave grids rests on the occupancy calculator. Queried before a
    kernel's first launch (warm-up does), it answered 0 for the 65 KiB table until the query opted
    the kernel in to its dynamic shared memory first (so the release never engaged)."""
    from qops.native import compiler
    from qops.native.int_weight import early_dependents_flag, use_pdl

    with nbw4.plan_override(warps=4, minb=4, ring=3):  # a variant no other test launches
        p = nbw4.plan(1, 4096, 1024, torch.cuda.get_device_properties(0).multi_processor_count, 64)
    kernel = nbw4._kernel(0, p, torch.float16, True, 64, 256, LAYOUT_TILE16)
    assert p.shmem_bytes > 48 * 1024
    assert compiler.max_active_blocks(kernel, 0, 32 * p.warps, p.shmem_bytes) >= 2  # the table fits three blocks an SM
    if use_pdl(0):
        assert early_dependents_flag(kernel, 0, p.grid(4096, 0), 32 * p.warps, p.shmem_bytes) != 0
