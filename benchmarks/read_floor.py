"""A load-only kernel: the time a launch that does nothing but read a weight's bytes takes (H200).

Why: a matmul's % of the roofline mixes two losses, what any isolated launch of that many bytes
loses (start, ramp, tail; a larger share of the smaller shapes) and what the kernel's own work
adds. Timed beside the kernel in the same run, with the same method (``common.graph_times``:
CUDA-graph replays over rotated buffers, each launch after the previous has finished), the
load-only kernel over the same byte count separates them: ``read_floor_us`` is a floor no kernel
reading those bytes in one launch beats by much, and ``qops_us / read_floor_us`` is what the
kernel's own work costs.

Two read patterns (``probe_layout_bw.py`` times both over the qweight alone): mode 0 ("strips") is the
native decode kernel's pattern for a block of 8 warps, NWN column strips of 128 bytes and 8 / NWN warps
along K, four 16-byte loads a lane per iteration; mode 1 ("tiles") gives each warp a contiguous run
of 2 KiB units, one unit per iteration, 512 contiguous bytes a load instruction. Both read every byte
once with the decode kernel's load instruction and fold the words into one value, stored only if it
equals a constant, so no load can be removed. The floor uses tiles over two blocks an SM: within
0-4% of the fastest of twelve patterns on every large shape (`h200-2026-11-30-0f7e4a1-probe-layout-bw.json`).
"""
from __future__ import annotations

import torch

import common

SOURCE = r"""
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
extern "C" __global__ void __launch_bounds__(256, 2)
probe(const u32* w, u32* sink, int rows, int cols, int nwn, int mode) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 acc = 0;
  if (mode == 0) {
    const int nwk = 8 / nwn, wn = warp % nwn, wk = warp / nwn;
    const int col = blockIdx.x * nwn * 32 + wn * 32 + 4 * (lane >> 2);
    const int rstart = blockIdx.y * (rows / gridDim.y);
    const int rend = rstart + rows / gridDim.y;
#pragma unroll 2
    for (int r = rstart + wk * 16 + (lane & 3); r < rend; r += nwk * 16) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = ld_stream(w + (size_t)(r + 4 * j) * cols + col);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  } else {
    const size_t units = (size_t)rows * cols / 512;  // 2 KiB units
    const size_t warps = (size_t)gridDim.x * gridDim.y * 8;
    const size_t gw = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 8 + warp;
    const size_t per = (units + warps - 1) / warps;
    const size_t u0 = gw * per, u1 = u0 + per < units ? u0 + per : units;
#pragma unroll 2
    for (size_t u = u0; u < u1; ++u) {
      uint4 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = ld_stream(w + u * 512 + (size_t)(j * 32 + lane) * 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""

UNIT_BYTES = 2048  # the tiles pattern reads whole 2 KiB units


class LoadOnlyKernel:
    """The compiled probe kernel on the current CUDA device and a launcher for it."""

    def __init__(self):
        from qops.native import compiler

        self._compiler = compiler
        dev = torch.cuda.current_device()
        cc = compiler.core()
        cubin = compiler.compile(SOURCE, compiler.device_arch(dev))
        cc.Device(dev).set_current()
        self.kernel = cc.ObjectCode.from_cubin(cubin).get_kernel("probe")
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def launch(self, buf: torch.Tensor, grid, rows: int, cols: int, nwn: int, mode: int) -> None:
        # The stream is read at each call: graph timing warms up on a side stream and captures on the
        # graph's own (a stream fixed at construction made the capture record nothing).
        i32 = self._compiler.i32
        self._compiler.launch(self.kernel, grid, (256, 1, 1), 0, torch.cuda.current_stream(), buf.data_ptr(),
                              self.sink.data_ptr(), i32(rows), i32(cols), i32(nwn), i32(mode))


def read_floor_callables(kernel: LoadOnlyKernel, nbytes: int) -> list:
    """Callables over rotated buffers of ``nbytes`` (rounded up to whole 2 KiB units), each one
    load-only launch in the tiles pattern over two blocks an SM: the candidate ``read_floor``."""
    units = -(-int(nbytes) // UNIT_BYTES)
    cols = UNIT_BYTES // 4
    bufs = [torch.randint(0, 2**31 - 1, (units, cols), dtype=torch.int32, device="cuda")
            for _ in range(common.n_copies(units * UNIT_BYTES))]
    grid = (2 * kernel.sms, 1, 1)
    return [lambda b=b: kernel.launch(b, grid, units, cols, 1, 1) for b in bufs]
