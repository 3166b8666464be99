"""The Triton lowerings of the int8 (EETQ, bitsandbytes LLM.int8) and 4-bit blockwise (bitsandbytes
NF4 / FP4) families on a CUDA device, through the public ops: eagerly (every path: GEMV, GEMM,
split-K, the 4-bit dense path), with a caller-owned ``out`` poisoned with NaN and a workspace, under
``torch.compile(fullgraph=True)`` with CUDA graphs (a skipped capture fails), and in a hand-captured
CUDA graph replayed on new inputs. The reference is float64 ``x @ W.T (+ bias)`` with W from the
oracles of ``tests/bnb_cases.py`` (checkpoints built on the CPU, moved to the GPU, prepared there),
checked by a relative error and a bound on every element (``C.check_output``).
The native 4-bit lowering, which ranks above Triton, is disabled here (its own suite:
``test_gpu_native_blockwise4.py``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import Kernel
from qops.models.testing import forced_lowering
from qops.ops.triton import blockwise4 as tbw4
from qops.ops.triton import int8_weight as ti8

from tests import bnb_cases as C
from tests.oracle import stride_two

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
MS = (0, 1, 2, 3, 16, 17, 64, 257)
CASES = (
    C.Case("bitsandbytes-int8", 1000, 2048),
    C.Case("eetq", 1024, 4096, layout="ampere"),
    C.Case("bitsandbytes-nf4", 1000, 2048, blocksize=64, nested=True),
    C.Case("bitsandbytes-fp4", 1024, 4096, blocksize=128, nested=False),
    C.Case("bitsandbytes-nf4", 520, 1024, blocksize=32, nested=False),
    # N and K odd (bitsandbytes' int8 storage takes any shape; EETQ's ampere layout needs multiples of
    # 64 and its row-major one is the same (N, K) int8 at run time): masked N tiles, K steps ending
    # inside a tile, weight rows and x rows at odd byte offsets.
    C.Case("bitsandbytes-int8", 999, 1001),
)
_BUILT: dict = {}


def gpu_weight(case: C.Case, dtype: torch.dtype):
    """(prepared weight on cuda, float64 W on cuda), built once per (case, dtype)."""
    key = (case, dtype)
    if key not in _BUILT:
        fmt = FORMATS[case.fmt]
        state = C.random_state(case, torch.Generator().manual_seed(C.seed_of(case)))
        w64 = C.oracle_of(case, state).cuda()
        kwargs = {"layout": case.layout} if case.fmt == "eetq" else {}
        ckpt = fmt.from_state_dict({k: v.cuda() for k, v in state.items()}, **kwargs)
        with forced_lowering("bitsandbytes-nf4", "triton_blockwise4"):
            _BUILT[key] = (fmt.prepare(ckpt, dtype=dtype), w64)
    return _BUILT[key]


def mm_out(w, x, bias, out, workspace=None):
    if hasattr(w, "scales"):
        torch.ops.qops.mm_int8_weight_out(x, w.qweight, w.scales, bias, int(w.kernel), out, workspace)
    else:
        torch.ops.qops.mm_blockwise4_out(x, *w._weight_args(), bias, *w._static_args(), int(w.kernel), out, workspace)


def check(y, x, w64, bias, dtype, what):
    C.check_output(y, x, w64, bias, dtype, TOL[dtype], what)


def test_chooser_picks_triton_where_it_serves():
    for case in CASES:
        w, _ = gpu_weight(case, torch.float16)
        assert w.kernel == Kernel.TRITON, (case.id, w.choice.explain())
    odd = C.Case("bitsandbytes-nf4", 33, 96, blocksize=64, nested=True)  # K % blocksize != 0: the dense path
    for dtype in (torch.float16, torch.bfloat16):
        w, w64 = gpu_weight(odd, dtype)
        assert w.kernel == Kernel.TRITON, w.choice.explain()
        for m in (1, 5, 17, 40):
            x = torch.randn(m, 96, device="cuda", dtype=dtype)
            check(w.mm(x), x, w64, None, dtype, f"K % blocksize != 0, M={m}")


# Every case in fp16 over every M; bf16 on every format (and the odd int8 shape), fp32 on one case
# per family, at M = 1, 16, 17 (each (dtype, M bucket, bias, x layout) is a Triton compile). For NF4 /
# FP4, M <= 16 is the GEMV with the in-register (prmt) code decode, in fp16 and bf16; fp32 x looks
# codes up in memory.
EAGER = ([(case, torch.float16, MS) for case in CASES]
         + [(case, torch.bfloat16, (1, 16, 17)) for case in (*CASES[:4], CASES[5])]
         + [(case, torch.float32, (1, 16, 17)) for case in (CASES[0], CASES[2])])


@pytest.mark.parametrize("case,dtype,ms", EAGER, ids=lambda v: v.id if isinstance(v, C.Case) else str(v).replace("torch.", "").replace(", ", "-"))
def test_eager(case, dtype, ms):
    """``w.mm`` (a bias at odd M) and ``mm_out`` into NaN with a poisoned workspace, x contiguous and
    as a transposed view, against the float64 oracle (relative and elementwise: C.check_output)."""
    w, w64 = gpu_weight(case, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(case.n, device="cuda", generator=gen).to(dtype)
    for m in ms:
        for layout in ("contiguous", "transposed"):
            if layout == "transposed":
                x = torch.randn(case.k, m, device="cuda", generator=gen).to(dtype).t()
            else:
                x = torch.randn(m, case.k, device="cuda", generator=gen).to(dtype)
            what = f"M={m} {layout} x"
            check(w.mm(x, bias if m % 2 else None), x, w64, bias if m % 2 else None, dtype, what)
            out = torch.full((m, case.n), float("nan"), device="cuda", dtype=dtype)
            mm_out(w, x, bias, out, torch.full((4 * m * case.n,), 255, dtype=torch.uint8, device="cuda"))
            check(out, x, w64, bias, dtype, f"{what} out+workspace")


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.id)
def test_small_tensors_with_any_strides(case):
    """A bias (and int8's scales) as views of stride 2 (the ops accept any strides): the oracle's
    result on every path's M."""
    w, w64 = gpu_weight(case, torch.float16)
    if hasattr(w, "scales"):
        w = dataclasses.replace(w, scales=stride_two(w.scales))
    bias = torch.randn(case.n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).half()
    for m in (1, 3, 64, 257):
        x = torch.randn(m, case.k, device="cuda").half()
        check(w.mm(x, stride_two(bias)), x, w64, bias, torch.float16, f"M={m} strided")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_blockwise4_cuda_core_gemv(dtype):
    # The CUDA-core GEMV (M <= 4 with gemv_fma_max_m 4): x read as int32 pairs (4-byte aligned rows)
    # and element by element (an odd offset), M = 1 and 3 (the fourth product lane of the program
    # empty), each against float64 and the tensor-core GEMV on the same inputs.
    from qops.ops.triton import blockwise4 as tbw4

    for case in (CASES[2], CASES[3], CASES[4]):
        w, w64 = gpu_weight(case, dtype)
        base = torch.randn(3, case.k + 2, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
        for name, x3 in (("pairs", base[:, :-2]), ("odd offset", base[:, 1:-1])):
            for m in (1, 3):
                x = x3[:m]
                with tbw4.config_override(gemv_fma_max_m=4):
                    assert tbw4.plan(m, case.n, case.k, case.blocksize, x.device, dtype)["path"] == "gemv_fma"
                    check(w.mm(x), x, w64, None, dtype, f"{case.id} {name} M={m}")
                with tbw4.config_override(gemv_fma_max_m=0):
                    check(w.mm(x), x, w64, None, dtype, f"{case.id} {name} M={m}, tensor-core GEMV")


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.id)
def test_forced_split_k_agrees(case):
    # M = 32 takes the GEMM of both families (4-bit: its row slicing turned off); M = 1 the GEMV of
    # both, and M = 16 the 4-bit GEMV (the int8 GEMM): forced to many K splits, each must match the
    # float64 reference and the default.
    w, w64 = gpu_weight(case, torch.float16)
    mod = ti8 if hasattr(w, "scales") else tbw4
    x = torch.randn(32, case.k, device="cuda", dtype=torch.float16)
    base = w.mm(x)
    slicing = {} if mod is ti8 else {"gemv_slices_max_m": 0}
    with mod.config_override(**slicing, gemm_max_split=8, gemm=[(1 << 62, {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3})],
                             gemv={"programs_per_sm": 64}):
        split = w.mm(x)
        split1 = w.mm(x[:1])
        split16 = w.mm(x[:16])
    check(split, x, w64, None, torch.float16, "split gemm")
    check(split1, x[:1], w64, None, torch.float16, "split gemv")
    check(split16, x[:16], w64, None, torch.float16, "split M=16")
    assert C.rel_err(split, base.double()) < 2e-3
    assert C.rel_err(split16, base[:16].double()) < 2e-3


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.id)
def test_torch_compile_with_cuda_graphs(case):
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    w, w64 = gpu_weight(case, torch.bfloat16)
    bias = torch.randn(case.n, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return torch.relu(w.mm(x, bias))

    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
        for m in (1, 2, 7, 64, 7, 1):
            x = torch.randn(m, case.k, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):  # warm-up runs, then recorded and replayed
                torch.compiler.cudagraph_mark_step_begin()
                y = compiled(x).clone()
            want = torch.relu(C.matmul(x, w64, bias))
            assert C.rel_err(y, want) <= TOL[torch.bfloat16], f"M={m}"
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.id)
def test_cuda_graph_replay(case, m):
    w, w64 = gpu_weight(case, torch.float16)
    C.check_graph_replay(w, w64, m, TOL[torch.float16])


# Above 32 rows the 4-bit lowering dequantizes W into N-slabs and multiplies with cuBLAS: a
# realistic 4096 x 4096 layer, NF4 nested at blocksize 64 and FP4 plain at 128, in one slab (with a
# workspace that holds it) and in five (slabs of 1000 rows, the last partial).
DENSE_CASES = (
    C.Case("bitsandbytes-nf4", 4096, 4096, blocksize=64, nested=True),
    C.Case("bitsandbytes-fp4", 4096, 4096, blocksize=128, nested=False),
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: c.id)
def test_dense_path_at_a_realistic_shape(case, dtype):
    w, w64 = gpu_weight(case, dtype)
    assert w.kernel == Kernel.TRITON, w.choice.explain()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(case.n, device="cuda", generator=gen).to(dtype)
    for m in (64, 300):
        p = tbw4.plan(m, case.n, case.k, case.blocksize, torch.device("cuda"), dtype)
        assert p["path"] == "dense" and p["slab"] == case.n, p
        x = torch.randn(m, case.k, device="cuda", generator=gen).to(dtype)
        b = bias if m == 300 else None
        check(w.mm(x, b), x, w64, b, dtype, f"M={m}")
        out = torch.full((m, case.n), float("nan"), device="cuda", dtype=dtype)
        mm_out(w, x, bias, out, torch.full((2 * case.n * case.k,), 255, dtype=torch.uint8, device="cuda"))
        check(out, x, w64, bias, dtype, f"M={m} out+workspace")
        with tbw4.config_override(slab_bytes=1000 * case.k * 2):
            check(w.mm(x, bias), x, w64, bias, dtype, f"M={m} 5 slabs")
