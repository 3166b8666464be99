"""``qops::add_rmsnorm`` on a CUDA device (the Triton kernel, launched with programmatic dependent
launch on sm_90), against the float64 oracle of ``tests/test_add_rmsnorm.py``: the decoder's
widths, odd K, strided x and weight, no rows (2-D and 3-D), all three dtypes, eagerly and replayed from a CUDA graph
right behind the kernel that writes its input (outputs NaN before each replay)."""
from __future__ import annotations

import pytest
import torch

from tests.oracle import stride_two
from tests.test_add_rmsnorm import EPS, TOL, check, inputs

pytestmark = pytest.mark.gpu

OP = torch.ops.qops.add_rmsnorm.default


@pytest.mark.parametrize("shape", [(0, 4096), (1, 4096), (7, 8192), (33, 1000), (2, 3, 5120), (2, 0, 5120)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_the_oracle(shape, dtype):
    for strided in (False, True):
        x, r, w = inputs(shape, dtype, seed=len(shape), strided=strided, device="cuda")  # the view taken on the GPU: .cuda() of one is contiguous
        got = tuple(t.cpu() for t in OP(x, r, w, EPS))
        check(got, x.cpu(), r.cpu(), w.cpu(), f"{shape} {dtype} strided={strided}")
        if strided:  # the weight of stride 2 too (the Triton kernel read it as contiguous before 559d92d)
            ws = stride_two(w)
            got = tuple(t.cpu() for t in OP(x, r, ws, EPS))
            check(got, x.cpu(), r.cpu(), ws.cpu(), f"{shape} {dtype} strided x, weight of stride 2")


def test_replayed_behind_the_kernel_writing_its_input():
    x0, r, w = inputs((4, 4096), torch.bfloat16, seed=5, device="cuda")
    x = torch.empty_like(x0)
    src = torch.empty_like(x0)
    OP(x0, r, w, EPS)  # compiled before the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.copy_(src * 2)  # the kernel ahead writes x
        out, summed = OP(x, r, w, EPS)
    for seed in (6, 7):
        src.copy_(inputs((4, 4096), torch.bfloat16, seed=seed, device="cuda")[0])
        out.fill_(float("nan"))  # a replay that wrote nothing fails, the first one too
        summed.fill_(float("nan"))
        g.replay()
        xs = (src * 2).cpu()
        check((out.cpu(), summed.cpu()), xs, r.cpu(), w.cpu(), f"replay seed {seed}")
