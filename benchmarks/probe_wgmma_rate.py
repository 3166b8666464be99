"""How fast do Hopper's warpgroup MMAs run at the shapes a W4A16 GEMM at M = 64 can use (H200)?

Question it answers (benchmarks/NOTES.md stop 43): the native GEMM's loop without its weight copies and
dequantization ran at 526 TFLOP/s -- m64n64k16 wgmma with A from registers, two warpgroups an SM. Is that
the rate of that instruction shape, and would the weight as the B operand (N = 128 or 256 columns, A = x
from shared memory) run faster? This script times MMA-only kernels: each warpgroup issues ``--iters`` x 4
wgmma m64nNk16 (f16 inputs, fp32 accumulation into one accumulator set, a commit per 4 and at most
``depth`` groups in flight), A from registers (``rs``) or shared memory (``ss``), B from shared memory,
1 or 2 warpgroups a block, one block an SM. The operands are zeros, or with ``--data random`` f16 values of
magnitude 0.5..1 with random signs and mantissas (the tensor cores draw more power on such data, and the
clock may drop under the power limit: dense cuBLAS on random weights measures 739-796 TFLOP/s).

Writes ``$OUT/probe_wgmma_rate.json`` (and ``--out``); prints one line per variant.

    PYTHONPATH=. python benchmarks/probe_wgmma_rate.py [--ns 64,128,256] [--iters 2048]
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch

import common

VARIANTS = [(n, a, wgs, depth) for n in (64, 128, 256) for a in ("rs", "ss") for wgs in (1, 2) for depth in (1, 2)]
UNROLL = 4  # wgmmas a commit group


def wgmma_asm(n: int, a_from: str) -> str:
    """The inline asm of one ``wgmma.mma_async m64n{n}k16.f32.f16.f16`` accumulating into d[0 .. n/2 - 1]."""
    nd = n // 2
    d = ", ".join(f"%{i}" for i in range(nd))
    if a_from == "rs":
        a_ops = "{%" + f"{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}" + "}"
        b_op, tail = f"%{nd + 4}", "p, 1, 1, 0"
        inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)'
    else:
        a_ops, b_op, tail = f"%{nd}", f"%{nd + 1}", "p, 1, 1, 0, 0"
        inputs = '"l"(desc_a), "l"(desc_b)'
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    return (f'asm volatile("{{\\n\\t.reg .pred p;\\n\\tsetp.ne.b32 p, 1, 0;\\n\\t'
            f'wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{d}}}, {a_ops}, {b_op}, {tail};\\n\\t}}"'
            f" : {outputs} : {inputs});")


def source(n: int, a_from: str, wgs: int, depth: int, data: str = "zeros", btiles: int = 1) -> str:
    """An MMA-only kernel: shared memory holds one 64 x 16 A tile (ss) and ``btiles`` 16 x n B tiles (a power
    of two; the wgmmas take them in turn, as a GEMM's k steps take distinct tiles), K-major core matrices
    without swizzle (the layout w4a16_gemm.cu's x image uses), zero-filled or (``data`` "random") filled
    with hashed f16 pairs, as are the A registers (rs)."""
    assert btiles >= 1 and btiles & (btiles - 1) == 0 and 2048 + btiles * 32 * n <= 48 * 1024, btiles
    rnd = int(data == "random")
    smem_bytes = 2048 + btiles * 32 * n
    return rf"""
typedef unsigned int u32;
__device__ __forceinline__ unsigned long long desc(u32 addr, u32 lbo, u32 sbo) {{
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32);
}}
extern "C" __global__ void __launch_bounds__({128 * wgs}, 1) probe(float* sink, int iters) {{
  __shared__ __align__(128) unsigned char smem[{smem_bytes}];
  // f16 pairs of magnitude 0.5..1: a hash's sign and mantissa bits over 0x3800 (or zeros).
  auto fill = [](u32 i) {{ u32 h = (i + 1u) * 2654435761u; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
                           return {rnd} ? (h & 0x83FF83FFu) | 0x38003800u : 0u; }};
  for (int i = threadIdx.x; i < {smem_bytes} / 4; i += blockDim.x) reinterpret_cast<u32*>(smem)[i] = fill(i);
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  u32 base;
  asm("{{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }}" : "=r"(base) : "l"(smem));
  // A: 64 rows x 16 (2 K halves of 8 core matrices of 128 bytes); B: n columns x 16, core matrices of 8 columns.
  [[maybe_unused]] const unsigned long long desc_a = desc(base, 8 * 128, 128);
  const unsigned long long desc_b0 = desc(base + 2048, ({n} / 8) * 128, 128);
  [[maybe_unused]] const u32 a[4] = {{fill(4096u + 4u * threadIdx.x), fill(4097u + 4u * threadIdx.x), fill(4098u + 4u * threadIdx.x),
                                      fill(4099u + 4u * threadIdx.x)}};
  float d[{n // 2}];
#pragma unroll
  for (int i = 0; i < {n // 2}; ++i) d[i] = 0.f;
  for (int it = 0; it < iters; ++it) {{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int u = 0; u < {UNROLL}; ++u) {{
      const unsigned long long desc_b = desc_b0 + ((it * {UNROLL} + u) & {btiles - 1}) * {2 * n};  // tile b at + b 32 n bytes
      {wgmma_asm(n, a_from)}
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"({depth}) : "memory");
  }}
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < {n // 2}; ++i) s += d[i];
  if (s == 1234.5f) sink[0] = s;  // never true: keeps the MMAs
}}
"""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="64,128,256", help="MMA N values (64, 128, 256)")
    ap.add_argument("--iters", type=int, default=2048, help="commit groups a warpgroup issues a launch")
    ap.add_argument("--data", default="zeros", choices=("zeros", "random"), help="the operands' contents")
    ap.add_argument("--btiles", type=int, default=1, help="B tiles taken in turn (a power of two; 48 KiB of static shared memory in all)")
    ap.add_argument("--variants", default="all", help="'all' or 'gemm': the N = 64 rs and N = 256 ss variants only, depth 1")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def run(args) -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("probe_wgmma_rate: needs a compute capability 9.0 device (wgmma is sm_90a code)", file=sys.stderr)
        return 2
    from qops.native import compiler

    dev = torch.cuda.current_device()
    cc = compiler.core()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ns = {int(v) for v in args.ns.split(",")}
    res = {"gpu": common.device_name(True), "qops_commit": common.git_commit(), "iters": args.iters, "unroll": UNROLL, "data": args.data, "btiles": args.btiles,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": []}
    paths = common.output_paths("probe_wgmma_rate.json", args.out)
    sink = torch.zeros(1, dtype=torch.float32, device="cuda")
    for n, a_from, wgs, depth in VARIANTS:
        if n not in ns or (args.variants == "gemm" and ((n, a_from) not in ((64, "rs"), (256, "ss")) or depth != 1)):
            continue
        btiles = min(args.btiles, max(b for b in (1, 2, 4, 8, 16, 32) if 2048 + b * 32 * n <= 48 * 1024))
        cubin = compiler.compile(source(n, a_from, wgs, depth, args.data, btiles), "sm_90a")
        cc.Device(dev).set_current()
        kernel = cc.ObjectCode.from_cubin(cubin).get_kernel("probe")
        fn = [lambda kernel=kernel, wgs=wgs: compiler.launch(kernel, (sms, 1, 1), (128 * wgs, 1, 1), 0, torch.cuda.current_stream(),
                                                              sink.data_ptr(), compiler.i32(args.iters))]
        t = common.graph_time(fn, args.trials, 3.0).us
        flops = 2 * 64 * n * 16 * UNROLL * args.iters * wgs * sms
        row = {"data": args.data, "btiles": btiles, "N": n, "A": a_from, "warpgroups": wgs, "depth": depth, "us": round(t, 2), "TFLOPs": round(flops / (t * 1e-6) / 1e12, 1)}
        res["rows"].append(row)
        print(f"m64n{n}k16 {a_from} warpgroups={wgs} depth={depth} {args.data} btiles={btiles}: {t:9.2f} us {row['TFLOPs']:7.1f} TFLOP/s", flush=True)
        common.write_json(res, paths)
    return 0


def main(argv=None) -> int:
    common.add_repo_to_path()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
