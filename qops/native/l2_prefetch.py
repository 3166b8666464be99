"""L2 prefetch of tensors a later kernel will read (``l2_prefetch.cu``): a hint, never a result.

At batch-1 decode a layer's small kernels (the attention of one token, the norms) leave DRAM idle,
and the matmul after each starts with its weight in DRAM. :func:`request` asks the memory system to
bring up to :data:`MAX_RANGES` tensors' bytes into L2 and returns at once; run beside the small
kernel (on a side stream, :func:`request_beside`), the next matmul then reads what fits of its weight
from L2. The H200's L2 is 60 MB, so one projection of a Llama-8B layer (the 8.9 MB ``o_proj`` at
W4) fits with room to spare; a prefetched tensor that is evicted before use costs its bytes twice.

Each range is trimmed inward to 16-byte boundaries (the bulk prefetch's unit); the few bytes cut
off stay where they are. Nothing is read into registers or written, so a prefetch can never change
a result: the only effect is timing.

The kernel is compiled and loaded by :func:`warmup` (or the first eager call), never during CUDA-graph
capture (:class:`qops.native.compiler.NativeNotReadyError` then, as for every native kernel).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import compiler

SOURCE = "l2_prefetch.cu"
KERNEL = "qops_l2_prefetch"
MAX_RANGES = 4  # ranges one launch takes (grid.y)
CHUNK = 8192  # bytes a thread requests (QOPS_PREFETCH_CHUNK)
THREADS = 32
ALIGN = 16


def refusal(device: torch.device) -> str | None:
    """Why a prefetch cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    return compiler.runtime_missing()


def ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each tensor's storage span, trimmed inward to 16 bytes; empty spans
    dropped, the largest :data:`MAX_RANGES` kept (largest first)."""
    out = []
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        lo = t.data_ptr()
        # The span the tensor's elements cover (any strides, none negative in torch).
        hi = lo + (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
        a, b = -(-lo // ALIGN) * ALIGN, hi // ALIGN * ALIGN
        if b > a:
            out.append((a, b - a))
    out.sort(key=lambda r: -r[1])
    return out[:MAX_RANGES]


def _kernel(device: torch.device):
    return compiler.get_kernel(device, SOURCE, {"QOPS_PREFETCH_CHUNK": CHUNK}, KERNEL)


def request(tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None) -> int:
    """Launch one prefetch of ``tensors`` (all on one CUDA device) on ``stream`` (default: the
    current one); returns the bytes requested (0: nothing to do, no launch)."""
    spans = ranges(tensors)
    if not spans:
        return 0
    device = next(t.device for t in tensors if t is not None)
    stream = stream or torch.cuda.current_stream(device)
    kernel = _kernel(device)
    args = []
    for i in range(MAX_RANGES):
        addr, n = spans[i] if i < len(spans) else (0, 0)
        args += [addr, np.uint64(n)]
    per_block = THREADS * CHUNK
    grid = (-(-max(n for _, n in spans) // per_block), len(spans), 1)
    compiler.launch(kernel, grid, (THREADS, 1, 1), 0, stream, *args)
    return sum(n for _, n in spans)


def request_beside(tensors: Sequence[torch.Tensor], side: torch.cuda.Stream) -> torch.cuda.Event | None:
    """:func:`request` on ``side`` after the current stream's work so far; returns the event the
    current stream must wait on before its capture (or the caller) ends, or None when nothing was
    launched. The caller launches its own kernel on the current stream in between, so the two run
    at once."""
    if not ranges(tensors):
        return None
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        request(tensors, side)
        done = torch.cuda.Event()
        done.record(side)
    return done


def warmup(device: torch.device) -> bool:
    """Compile and load the kernel for ``device`` and launch it once with nothing to do (so the
    driver makes its code resident before any capture); False where it cannot run."""
    if refusal(device) is not None:
        return False
    if torch.cuda.is_current_stream_capturing():
        raise compiler.NativeNotReadyError("qops.native.l2_prefetch.warmup must run before CUDA-graph capture, not during it")
    kernel = _kernel(device)
    args = [0, np.uint64(0)] * MAX_RANGES
    compiler.launch(kernel, (1, 1, 1), (THREADS, 1, 1), 0, torch.cuda.current_stream(device), *args)
    return True
