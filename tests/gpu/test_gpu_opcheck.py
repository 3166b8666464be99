"""torch.library.opcheck of every op family through each of its CUDA lowerings, on a CUDA device.

The CPU suite (tests/test_opcheck.py) checks the ops with the reference kernel. Here the same
samples are moved to the GPU and their ``kernel`` argument is set to each CUDA lowering of the
family (Triton, native, ``torch._scaled_mm``), so the schema, the fake (its output and strides
against the real CUDA kernel's), the autograd registration and AOT dispatch are checked against
the code that runs in production. Test ids name ``<format>-<lowering>-<op>`` (read by
scripts/guarantee_matrix.py for the "opcheck passes" column).

A sample the lowering does not serve (an activation dtype, bit width, shape multiple or scale
layout outside its declared capabilities, which the op refuses with an error naming the lowering;
any other error fails) is left out;
every (format, lowering) pair must keep at least one sample of each mm op the format has samples
for, or the test fails.

Two things differ from the CPU suite, both torch's, not the ops':
- the checks run with deterministic algorithms requested: split-K kernels otherwise sum through
  atomic adds, and AOT dispatch compares its output with eager's at fp32 tolerances that a
  different order of the same sums can exceed;
- ``test_schema`` is left out for samples holding float8 tensors: its mutation check compares
  inputs with ``torch.allclose``, which has no CUDA float8 kernel (the CPU suite runs it on the
  same ops and samples).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from qops.formats import FORMATS
from qops.lowerings import LOWERINGS
from tests.test_opcheck import SAMPLES, TEST_UTILS

pytestmark = pytest.mark.gpu


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _matrix_tables():
    """scripts/guarantee_matrix.py's tables of each family's ops and each format's opcheck samples: the
    samples this test runs for a format are the ones the matrix credits its "opcheck passes" cell with
    (CI checks that table against the CPU suite's sample ids)."""
    gm = sys.modules.get("guarantee_matrix")
    if gm is None:
        spec = importlib.util.spec_from_file_location("guarantee_matrix", os.path.join(ROOT, "scripts", "guarantee_matrix.py"))
        gm = sys.modules["guarantee_matrix"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(gm)
    return gm.FAMILY_OPS, gm.OPCHECK_SAMPLES


FAMILY_OPS, FORMAT_SAMPLES = _matrix_tables()


def _takes_kernel(op_name: str) -> bool:
    return "kernel" in [a.name for a in getattr(torch.ops.qops, op_name).default._schema.arguments]


def _sample_name(sample_id: str) -> str:
    # Sample ids are "<sample>-<variant>..." (the matrix's table names the first part).
    return sample_id.split("-")[0]


def _pairs():
    for fmt_name, fmt in FORMATS.items():
        for low in LOWERINGS:
            if low.family == fmt.family and fmt_name in low.formats and "cuda" in low.device_types and not low.name.startswith("reference"):
                yield fmt_name, low


def _to_cuda(a):
    if isinstance(a, torch.Tensor):
        t = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
        t.copy_(a.detach())
        return t.requires_grad_(a.requires_grad)
    return a


def _with_kernel(op_name: str, args: tuple, kernel: int) -> tuple:
    """``args`` on the GPU with the ``kernel`` argument replaced."""
    names = [a.name for a in getattr(torch.ops.qops, op_name).default._schema.arguments]
    moved = [_to_cuda(a) for a in args]
    moved[names.index("kernel")] = kernel
    return tuple(moved)


@pytest.fixture
def _deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def _served(op_name: str, sample_id: str, cuda_args: tuple, low) -> bool:
    """Whether ``low`` serves the sample: an unserved one is refused with an error naming the lowering
    (qops.lowerings.lowering_for: "kernel=K (<name>) does not serve this call", the fp8 ops' checks
    alike, an entry's own "<name>: ..."); any other error is a bug in a lowering's Python path, not a
    sample it does not serve, and CUDA errors are RuntimeErrors: both fail."""
    try:
        getattr(torch.ops.qops, op_name).default(*[a.detach() if isinstance(a, torch.Tensor) else a for a in cuda_args])
    except (ValueError, NotImplementedError, TypeError) as e:
        if low.name not in str(e):
            raise AssertionError(f"{op_name}[{sample_id}] on {low.name}: {type(e).__name__} that is not the lowering's "
                                 f"refusal: {e}") from e
        print(f"{op_name}[{sample_id}] not served by {low.name}: {e}")
        return False
    return True


def _has_fp8(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)


@pytest.mark.parametrize("fmt,low", [pytest.param(f, l, id=f"{f}-{l.name}") for f, l in _pairs()])
def test_gpu_opcheck(fmt, low, _deterministic):
    if low.device_refusal(torch.device("cuda")) is not None:
        pytest.skip(low.device_refusal(torch.device("cuda")))
    samples = FORMAT_SAMPLES[fmt]
    with_samples = set()
    checked: dict[str, int] = {}
    for op_name in FAMILY_OPS[low.family]:
        if op_name not in SAMPLES or not _takes_kernel(op_name):  # the dequantize ops run no lowering
            continue
        packet = getattr(torch.ops.qops, op_name)
        for sample_id, args in SAMPLES[op_name]().items():
            if _sample_name(sample_id) not in samples:
                continue
            with_samples.add(op_name)
            cuda_args = _with_kernel(op_name, args, int(low.kernel))
            if not _served(op_name, sample_id, cuda_args, low):
                continue
            utils = [t for t in TEST_UTILS if not (t == "test_schema" and _has_fp8(cuda_args))]
            result = torch.library.opcheck(packet.default, cuda_args, test_utils=utils)
            assert result == {t: "SUCCESS" for t in utils}, (op_name, sample_id, result)
            checked[op_name] = checked.get(op_name, 0) + 1
    if low.name == "scaled_mm_fp8":
        # fp8-block: the "block128" samples (128 x 128 blocks, per-token and per-token-group scales)
        # through F.scaled_mm's block recipe; the 16 x 32 "block" samples are refused.
        assert checked.get("scaled_mm_fp8", 0) >= 1, f"no scaled_mm_fp8 sample served on {low.name}: {checked}"
    else:
        ops = [o for o in FAMILY_OPS[low.family] if o in with_samples and o != "scaled_mm_fp8"]
        assert all(checked.get(o, 0) >= 1 for o in ops), f"{fmt} on {low.name}: samples checked per op {checked}"


@pytest.mark.parametrize("fmt,low", [pytest.param(f, l, id=f"{f}-{l.name}") for f, l in _pairs() if l.name != "scaled_mm_fp8"])
def test_gpu_out_ops_refuse_gradients_and_aliased_buffers(fmt, low):
    """On CUDA, where the _out ops' refusals matter most (the autograd key is AutogradCUDA; the kernels
    write out while other programs read x): every _out op of the family, on each sample the lowering
    serves, refuses an x that requires grad and an out sharing x's memory, naming them, and under
    inference mode writes what its functional op returns on the same lowering."""
    if low.device_refusal(torch.device("cuda")) is not None:
        pytest.skip(low.device_refusal(torch.device("cuda")))
    guarded = 0
    for op_name in FAMILY_OPS[low.family]:
        if not op_name.endswith("_out") or op_name not in SAMPLES:
            continue
        op = getattr(torch.ops.qops, op_name).default
        names = [a.name for a in op._schema.arguments]
        for sample_id, args in SAMPLES[op_name]().items():
            if _sample_name(sample_id) not in FORMAT_SAMPLES[fmt]:
                continue
            cuda_args = _with_kernel(op_name, args, int(low.kernel))
            if not _served(op_name, sample_id, cuda_args, low):
                continue
            x, out = cuda_args[0], cuda_args[names.index("out")]
            grad = list(cuda_args)
            grad[0] = x.detach().clone().requires_grad_()
            with pytest.raises(RuntimeError, match=rf"qops\.{op_name}: x requires grad"):
                op(*grad)
            buf = torch.empty(max(x.numel(), out.numel()), dtype=x.dtype, device=x.device)
            aliased = list(cuda_args)
            aliased[0] = buf[:x.numel()].view(x.shape).copy_(x)
            aliased[names.index("out")] = buf[:out.numel()].view(out.shape)
            if x.numel() and out.numel():
                with pytest.raises(ValueError, match=rf"qops\.{op_name}: out shares memory with x"):
                    op(*aliased)
            out.fill_(float("nan"))
            with torch.inference_mode():
                op(*cuda_args)
                want = getattr(torch.ops.qops, op_name[:-len("_out")]).default(
                    *[a for a, n in zip(cuda_args, names) if n not in ("out", "workspace")])
            assert out.isfinite().all() and (out.float() - want.float()).norm() <= 1e-2 * want.float().norm() + 1e-6, \
                (op_name, sample_id)
            guarded += 1
    assert guarded >= 1, f"no _out sample served on {low.name} for {fmt}"
