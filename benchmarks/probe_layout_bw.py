"""Read bandwidth of the native W4A16 kernel's weight access pattern against a contiguous one (H200).

Question it answers: is the decode kernel's gap to the roofline (60-68% at M = 1) in the access
pattern itself? The kernel reads qops' runtime layout (qweight ``(K/8, N)`` u32, N contiguous): a
warp's 16-byte loads cover 4 rows x 128 bytes, a block ``nwn`` x 128 bytes of each row, rows
``4 N`` bytes apart. A layout repacked at prepare time could instead give each warp 2 KiB
contiguous per iteration. This script times a load-only kernel (no math, same load instruction,
same loads in flight per warp) over the same bytes in both patterns, for the perf shapes'
qweight sizes, with the method of ``common.py`` (CUDA-graph replays, rotated buffers > 256 MB).

Writes ``$OUT/probe_layout_bw.json`` (and ``--out``); prints one line per (shape, pattern).

    PYTHONPATH=. python benchmarks/probe_layout_bw.py
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

import common
from common import PERF_SHAPES

# Load-only kernel. mode 0 ("strips"): the decode kernel's pattern for a block of 8 warps, NWN along N
# (128 bytes each) and 8 / NWN along K; per iteration a warp issues four 16-byte loads per lane, rows
# 16 * it + 4 j + lane % 4 of its column strip, 16 rows per warp per iteration. mode 1 ("tiles"): each
# warp owns a contiguous run of 2 KiB units and reads one unit per iteration, 512 contiguous bytes
# per load instruction. Both read every byte once, unroll two iterations, and fold the words into
# one value so that the loads cannot be removed.
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in PERF_SHAPES[1:]), help="N x K list (qweight is K/8 x N u32)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def run(args) -> int:
    if not torch.cuda.is_available():
        print("probe_layout_bw: needs a CUDA device", file=sys.stderr)
        return 2
    from qops.native import compiler

    dev = torch.cuda.current_device()
    cc = compiler.core()
    cubin = compiler.compile(SOURCE, compiler.device_arch(dev))
    cc.Device(dev).set_current()
    kernel = cc.ObjectCode.from_cubin(cubin).get_kernel("probe")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_bw = common.copy_TBps(args.trials)
    res = {"gpu": common.device_name(True), "qops_commit": common.git_commit(), "copy_TBps": round(copy_bw, 4),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    paths = common.output_paths("probe_layout_bw.json", args.out)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    i32 = compiler.i32
    for n, k in common.parse_shapes(args.shapes):
        rows, cols = k // 8, n
        nbytes = rows * cols * 4
        bufs = [torch.randint(0, 2**31 - 1, (rows, cols), dtype=torch.int32, device="cuda") for _ in range(common.n_copies(nbytes))]
        patterns = []
        for nwn in (1, 2, 4):
            for splits in (1, 2, 4):
                if rows % (splits * 16 * (8 // nwn)) == 0 and cols % (32 * nwn) == 0:
                    patterns.append((f"strips nwn={nwn} splits={splits}", (cols // (32 * nwn), splits, 1), nwn, 0))
        for blocks in (sms, 2 * sms, 4 * sms):
            patterns.append((f"tiles blocks={blocks}", (blocks, 1, 1), 1, 1))
        for name, grid, nwn, mode in patterns:
            # The stream is read at each call: graph_time warms up on a side stream and captures on
            # the graph's stream (a stream fixed here made the capture record nothing).
            fns = [lambda b=b, grid=grid, nwn=nwn, mode=mode: compiler.launch(
                kernel, grid, (256, 1, 1), 0, torch.cuda.current_stream(), b.data_ptr(), sink.data_ptr(), i32(rows), i32(cols), i32(nwn), i32(mode))
                for b in bufs]
            t = common.graph_time(fns, args.trials, 4.0).us
            tbps = nbytes / (t * 1e-6) / 1e12
            res["rows"].append({"N": n, "K": k, "pattern": name, "us": round(t, 2), "TBps": round(tbps, 3),
                                "pct_of_copy": round(100 * tbps / copy_bw, 1)})
            print(f"{n}x{k} {name:28s} {t:8.2f} us {tbps:6.3f} TB/s ({100 * tbps / copy_bw:5.1f}% of copy)", flush=True)
            common.write_json(res, paths)
        del bufs
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    common.add_repo_to_path()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
