"""``qops.native.l2_prefetch``: the byte ranges a prefetch requests (CPU: pure arithmetic on
addresses), and the kernel's builds (NVRTC, sm_80 and sm_90; the sm_90 build must use the bulk
prefetch, the sm_80 one the per-line form). Run on a GPU: ``tests/gpu/test_gpu_decode_attention.py``.
"""
from __future__ import annotations

import pytest
import torch

from qops.native import compiler
from qops.native import l2_prefetch as P


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first and one-past-last byte the tensor's elements occupy, by enumeration."""
    offsets = torch.zeros((), dtype=torch.long)
    for size, stride in zip(t.shape, t.stride()):
        offsets = (offsets.unsqueeze(-1) + torch.arange(size) * stride).flatten()
    lo = t.data_ptr() + int(offsets.min()) * t.element_size()
    return lo, t.data_ptr() + (int(offsets.max()) + 1) * t.element_size()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(37, 5),
    lambda: torch.randn(64, 40)[3:, 5:29],  # a slice: offset storage, row stride 40
    lambda: torch.randn(10, 12).t(),  # transposed
    lambda: torch.randint(0, 9, (30, 1, 7), dtype=torch.uint8)[:, :, 1:],  # 1-byte elements, odd offset
], ids=["contiguous", "slice", "transposed", "bytes"])
def test_a_range_is_the_tensors_span_trimmed_inward_to_16_bytes(make):
    t = make()
    lo, hi = _span(t)
    (addr, n), = P.ranges([t])
    assert addr % P.ALIGN == 0 and n % P.ALIGN == 0
    assert lo <= addr < lo + P.ALIGN and hi - P.ALIGN < addr + n <= hi


def test_largest_first_at_most_four_and_empty_ones_dropped():
    ts = [torch.empty(n, dtype=torch.uint8) for n in (64, 4096, 16, 1024, 256, 8)] + [torch.empty(0), None]
    got = P.ranges(ts)
    assert [n for _, n in got] == [4096, 1024, 256, 64]
    assert [a for a, _ in got] == [ts[i].data_ptr() for i in (1, 3, 4, 0)]  # the CPU allocator aligns to 64
    assert P.ranges([torch.empty(0), None]) == []


def test_no_launch_without_bytes():
    # Nothing to request: no kernel, no device needed (the CPU box has none).
    assert P.request([torch.empty(0)]) == 0
    assert P.request_beside([torch.empty(0)], side=None) is None


def test_refuses_a_cpu_device():
    assert "not a CUDA device" in P.refusal(torch.device("cpu"))
    assert P.warmup(torch.device("cpu")) is False


def _ptx(source: str, arch: str, defines: dict) -> str:
    """NVRTC's PTX for ``arch`` (through cuda.bindings: no driver needed)."""
    from cuda.bindings import nvrtc  # noqa: PLC0415 - present where runtime_missing() is None

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"l2_prefetch.cu", 0, [], [])
    opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"-I" + str(compiler.NATIVE_DIR).encode(), b"-std=c++17"]
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
    assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * n
    nvrtc.nvrtcGetPTX(prog, buf)
    return buf.decode(errors="replace")


@pytest.mark.skipif(compiler.runtime_missing() is not None, reason=f"NVRTC unusable: {compiler.runtime_missing()}")
@pytest.mark.parametrize("arch,instruction", [("sm_90", "cp.async.bulk.prefetch.L2.global"), ("sm_80", "prefetch.global.L2")])
def test_each_architecture_builds_its_form(arch, instruction):
    defines = {"QOPS_PREFETCH_CHUNK": P.CHUNK}
    src = compiler.native_source(P.SOURCE)
    assert compiler.compile(src, arch, compiler.native_options(defines))[:4] == b"\x7fELF"
    ptx = _ptx(src, arch, defines)
    assert instruction in ptx
    if arch == "sm_80":
        assert "cp.async.bulk" not in ptx
