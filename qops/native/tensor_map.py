"""Tensor maps (``CUtensorMap``) for the sm_90 tensor-memory-accelerator copies of the native kernels.

A map describes a 2-D tensor in global memory (address, sizes, row stride) and the box one copy
moves. Encoding is host work done by the driver (``cuTensorMapEncodeTiled``); the kernels read the
128 bytes from global memory, so they are copied to the device once, which a CUDA-graph capture
does not allow: maps are built on first use outside capture (a warm-up call, as for compiling) and
kept for the life of the process. The cache key is everything a map encodes, so an entry is never
stale: another tensor at the same address with the same sizes is described by the same bytes.
Entries are never dropped, because a captured graph may hold their address.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from . import compiler

MAP_BYTES = 128  # sizeof(CUtensorMap); the kernels find map i at byte 128 * i


@dataclass(frozen=True)
class Box2D:
    """A row-major 2-D tensor of ``elem_bytes``-byte elements and the box one copy moves."""

    ptr: int  # 16-byte aligned
    elem_bytes: int  # 2 or 4
    rows: int
    cols: int
    row_stride: int  # bytes, a multiple of 16
    box_rows: int  # <= 256
    box_cols: int  # box_cols * elem_bytes a multiple of 16 (and <= 128 with the swizzle)
    swizzle128: bool = False  # 16-byte slot s of box row r lands at slot s ^ (r % 8); needs a 1024-byte aligned destination

    def problem(self) -> str | None:
        """Why the driver would refuse this map, or None."""
        if self.elem_bytes not in (2, 4):
            return f"{self.elem_bytes}-byte elements (2 or 4 supported)"
        if self.ptr % 16:
            return f"address {self.ptr:#x} is not 16-byte aligned"
        if self.row_stride % 16 or self.row_stride < self.cols * self.elem_bytes:
            return f"row stride of {self.row_stride} bytes (a multiple of 16, at least a row of {self.cols * self.elem_bytes})"
        if not (1 <= self.box_rows <= 256 and 1 <= self.box_cols <= 256):
            return f"box {self.box_rows} x {self.box_cols} (each side 1..256)"
        inner = self.box_cols * self.elem_bytes
        if inner % 16 or (self.swizzle128 and inner > 128):
            return f"box rows of {inner} bytes (a multiple of 16{', at most 128 with the swizzle' if self.swizzle128 else ''})"
        if not (1 <= self.rows < 2**32 and 1 <= self.cols < 2**32):
            return f"sizes {self.rows} x {self.cols}"
        return None


def encode(box: Box2D) -> bytes:
    """The 128 bytes of the driver's map for ``box`` (zero fill out of bounds, 128-byte L2 promotion)."""
    why = box.problem()
    if why is not None:
        raise ValueError(f"qops.native.tensor_map: {why}")
    from cuda.bindings import driver

    dtype = driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32 if box.elem_bytes == 4 else \
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16
    swizzle = driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if box.swizzle128 else \
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t  # some cuda-bindings versions take no plain ints for these
    err, tmap = driver.cuTensorMapEncodeTiled(
        dtype, 2, box.ptr, [u64(box.cols), u64(box.rows)], [u64(box.row_stride)], [u32(box.box_cols), u32(box.box_rows)],
        [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"qops.native.tensor_map: cuTensorMapEncodeTiled refused {box}: {err}")
    words = [int(w) for w in tmap.opaque]
    return b"".join(w.to_bytes(8, "little") for w in words)


_maps: dict[tuple, torch.Tensor] = {}
_lock = threading.Lock()


def device_maps(device: int, boxes: tuple[Box2D, ...]) -> int:
    """Address of ``boxes``' maps, 128 bytes each in order, in global memory of ``device`` (built once)."""
    key = (device, boxes)
    t = _maps.get(key)
    if t is not None:
        return t.data_ptr()
    if torch.cuda.is_current_stream_capturing():
        raise compiler.NativeNotReadyError(
            f"qops.native: tensor maps for {len(boxes)} tensors at {', '.join(hex(b.ptr) for b in boxes)} on cuda:{device} are "
            "not built yet, and copying them to the device during CUDA-graph capture is not allowed. Warm up first (one "
            "eager call with the same weights) before capturing.")
    with _lock:
        t = _maps.get(key)
        if t is None:
            host = torch.frombuffer(bytearray(b"".join(encode(b) for b in boxes)), dtype=torch.uint8)
            t = host.to(torch.device("cuda", device))  # torch's allocations are 512-byte aligned (a map needs 64)
            _maps[key] = t
    return t.data_ptr()
