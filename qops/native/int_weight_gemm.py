"""The native W4A16 GEMM (``w4a16_gemm.cu``): rows of x past the decode kernel's one launch.

:mod:`qops.native.int_weight` serves M <= ``int_weight.MAX_M`` (32) with its decode kernel (on
Hopper up to ``int_weight.decode_rows``: 16 or 23, where this kernel's wgmma build measured faster) and
hands M up to :data:`MAX_M` (64) to this one: one launch, the weight read once for every row, the
dequantized weight scaled in the activation dtype so the MMAs accumulate straight into the output
(design notes at the top of ``w4a16_gemm.cu``). Split K goes through the decode kernel's workspace
reduction (``qops_w4a16_reduce``: fixed order, bit-identical run to run).

Plans. A block is 8 warps, ``nwn`` along N (16 ``tw`` columns each: 32, or 16 in measurements) and
8 / ``nwn`` along K; ``splits``
blocks share one column tile's K range; ``stages`` iterations of x and weights in flight through
shared memory; ``wgmma``: Hopper's warpgroup MMAs (an sm_90a build, taken wherever the device is
one); ``xpre`` (with wgmma): x permuted once per call by a small kernel into the workspace, after a
split-K plan's partials (:func:`x_image_bytes`), and copied into the stages as it lies; ``ws`` (with
xpre): 1, 2 or 4 producer warps copy every stage (cp.async for the weights, one bulk copy of the image)
and the eight others only dequantize and issue MMAs, stages handed over through mbarriers (the rule's:
four, where a block runs enough iterations). The rule
(:func:`plan`) is in :func:`_rule`; ``QOPS_W4_GEMM_PLAN`` (e.g. ``"nwn=4,stages=3,splits=2"``,
``"wgmma=0"``, ``"xpre=0"``, ``"ws=1"``) or :func:`plan_override` replace its fields for measurements.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from . import compiler

SOURCE = "w4a16_gemm.cu"
KERNEL = "qops_w4a16_gemm"
X_IMAGE = "qops_w4a16_x_image"  # the xpre plans' x permuted once per call (w4a16_gemm.cu)
REDUCE_SOURCE = "w4a16_gemv.cu"  # its qops_w4a16_reduce adds the (S, M, N) partials in order
REDUCE = "qops_w4a16_reduce"
MAX_M = 64  # 8 MMA tiles of 8 rows (QOPS_MT <= 8)
THREADS = 256  # the GEMM's compute warps; ws plans add their producer warps (Plan.threads)
CHUNK_K = 128
SHMEM_DEFAULT_BYTES = 48 * 1024
SHMEM_SM_BYTES = 226 * 1024  # sm_90's 227 KiB a block (228 an SM) less 1 KiB of static shared memory a block
PLAN_ENV = "QOPS_W4_GEMM_PLAN"
_DT = {torch.float16: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class Plan:
    m: int
    mt: int  # 8-row MMA tiles of x: ceil(M / 8)
    nwn: int  # warps along N; a block covers 16 * tw * nwn columns with 8 / nwn warps along K
    splits: int  # S: blocks sharing one column tile's K range (S > 1: fp32 partials in the workspace)
    stages: int  # cp.async pipeline stages in shared memory (2..8)
    minb: int  # resident blocks per SM promised to the register allocator
    tiles: int
    shmem: int
    workspace: int
    wgmma: bool = False  # warpgroup MMAs (sm_90a build; nwn 4 or 8)
    tw: int = 2  # 16-column MMA tiles a warp (1: half the accumulators, so two blocks an SM fit 128 registers)
    probe: int = 0  # measurements only (benchmarks/probe_w4_gemm.py, wgmma builds): 1 no MMAs, 2 no dequantization, 3 no x;
    # ws builds: 4 the producers copy x only (the weights left stale), 5 no dequantization, 6 neither
    wgdepth: int = 1  # ws builds: wgmma groups (32-row steps) left in flight after each step (1..3)
    xnat: bool = False  # wgmma builds: weight fragments in natural K order, x through cp.async in the stages (measured slower)
    krot: bool = False  # each column tile starts its K loop at a different chunk group (measured: no change)
    xpre: bool = False  # wgmma builds: x permuted once per call into the workspace (X_IMAGE), copied by cp.async
    x_image: int = 0  # xpre: bytes of that image, the workspace's last part (after a split-K plan's fp32 partials)
    ws: int = 0  # xpre builds: warp-specialized, 1, 2 or 4 producer warps beside the eight compute warps (mbarrier stages)

    @property
    def threads(self) -> int:
        return THREADS + 32 * self.ws

    def defines(self, dtype: torch.dtype, has_zeros: bool) -> dict[str, int]:
        d = {"QOPS_DT": _DT[dtype], "QOPS_MT": self.mt, "QOPS_NWN": self.nwn, "QOPS_HAS_Z": int(has_zeros),
             "QOPS_STAGES": self.stages, "QOPS_MINB": self.minb}
        if self.wgmma:  # only then: the builds of before keep their cache keys
            d["QOPS_WGMMA"] = 1
        if self.tw != 2:
            d["QOPS_TW"] = self.tw
        if self.probe:
            d["QOPS_PROBE"] = self.probe
        if self.xnat:
            d["QOPS_XNAT"] = 1
        if self.krot:
            d["QOPS_KROT"] = 1
        if self.xpre:
            d["QOPS_XPRE"] = 1
        if self.ws:
            d["QOPS_WS"] = self.ws
        if self.wgdepth != 1:
            d["QOPS_WGDEPTH"] = self.wgdepth
        return d


WGMMA_X_BUFFERS = 3  # kXbufs in w4a16_gemm.cu
WS_PRODUCERS = 4  # the rule's ws plans: producer warps (one a sub-partition; 1 was 1.1-1.2x slower than xpre, 2 between)
WS_MIN_ITERATIONS = 9  # ... and the fewest iterations a block runs for them (8, 6144x4096 at M = 32: 0.99x)
WS_MIN_ROWS = 17  # ... and the fewest rows (the Hopper GEMM's first; fewer rows were never timed with ws)


def x_image_bytes(m: int, k: int) -> int:
    """The xpre plans' image of x: per 128-row chunk of K, 16 core matrices of 128 bytes per 8 rows of x
    (kChunkImg in w4a16_gemm.cu), i.e. x padded to 8 ceil(M / 8) rows and whole chunks, 2 bytes a value."""
    return max(-(-k // CHUNK_K), 1) * 16 * 128 * -(-m // 8)


def warp_stage_bytes(tw: int) -> int:
    """kWarpW in w4a16_gemm.cu: a warp's weights (4 rows of 4 tw bytes a lane), scales, zero words."""
    return 4 * 32 * 4 * 2 * tw + 32 * 2 * 2 * tw + 32 * 4


WARP_STAGE_BYTES = warp_stage_bytes(2)


def shmem_bytes(m: int, nwn: int, stages: int, wgmma: bool = False, tw: int = 2, xnat: bool = False, xpre: bool = False,
                ws: int = 0) -> int:
    """Pipeline stages (x: M rows of 8 / nwn chunks, rows padded by 4 slots; the 8 warps' weights), or
    the warps' partial sums if larger. With wgmma the stages hold weights only, and three x buffers
    (8 / nwn chunks of 128 rows by 8 MT rows of x, 2 bytes a value) follow them; with xnat or xpre each
    stage holds its weights and one such x buffer; ws (producer warps) adds a full and an empty mbarrier a stage after them."""
    nwk = 8 // nwn
    mt = -(-m // 8)
    x_buffer = nwk * CHUNK_K * 8 * mt * 2
    if xnat or xpre:
        pipeline = stages * (8 * warp_stage_bytes(tw) + x_buffer) + (16 * stages if ws else 0)
    elif wgmma:
        pipeline = stages * 8 * warp_stage_bytes(tw) + WGMMA_X_BUFFERS * x_buffer
    else:
        pipeline = stages * (m * (nwk * 16 + 4) * 16 + 8 * warp_stage_bytes(tw))
    partials = (nwk - 1) * nwn * mt * tw * 32 * 16
    return max(pipeline, partials)


def make_plan(m: int, n: int, k: int, *, nwn: int, splits: int, stages: int, minb: int = 1,
              smem_limit: int = SHMEM_SM_BYTES, wgmma: bool = False, tw: int = 2, xnat: bool = False, krot: bool = False,
              xpre: bool = False, ws: int = 0, wgdepth: int = 1) -> Plan:
    """A plan with every choice given; raises ValueError naming the field the kernel cannot run.
    ``smem_limit``: the shared memory a block may opt in to on the device (sm_90's by default).
    Whether the device runs wgmma (sm_90a) is :func:`plan`'s check, not this one's."""
    chunks = max(-(-k // CHUNK_K), 1)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"native_w4a16 gemm: M={m} outside 1..{MAX_M}")
    if nwn not in (1, 2, 4, 8):
        raise ValueError(f"native_w4a16 gemm: nwn={nwn} is not 1, 2, 4 or 8")
    if not 1 <= splits <= min(chunks, 16):
        raise ValueError(f"native_w4a16 gemm: splits={splits} outside 1..min(chunks={chunks}, 16)")
    if not 2 <= stages <= 8:
        raise ValueError(f"native_w4a16 gemm: stages={stages} outside 2..8")
    if not 1 <= minb <= 2:
        raise ValueError(f"native_w4a16 gemm: minb={minb} outside 1..2")
    if tw not in (1, 2):
        raise ValueError(f"native_w4a16 gemm: tw={tw} is not 1 or 2")
    if minb == 2 and m > 40 and tw == 2:
        raise ValueError(f"native_w4a16 gemm: minb=2 with M={m}: MT = {-(-m // 8)} needs more than 128 registers a thread, two blocks an SM spill")
    if wgmma and nwn not in (4, 8):
        raise ValueError(f"native_w4a16 gemm: wgmma with nwn={nwn}: a warpgroup's four warps must share their K chunk (nwn 4 or 8)")
    if wgmma and minb != 1 and tw == 2 and not (m <= 16 or (m <= 32 and (nwn == 8 or xnat))):
        # NVRTC 13.0's ptxas: 199-253 registers at M = 33..64; within 128 and no spills up to 16 rows,
        # and up to 32 at nwn 8 or with xnat (nwn 4 with zeros spills 4-20 bytes at 17..32 rows)
        raise ValueError(f"native_w4a16 gemm: wgmma with minb={minb}, tw=2, nwn={nwn} at M={m}: more than 128 registers a thread "
                         "or spills (two blocks an SM: M <= 16, or M <= 32 at nwn 8 or with xnat)")
    if xnat and not (wgmma and tw == 2):
        raise ValueError(f"native_w4a16 gemm: xnat with wgmma={wgmma}, tw={tw}: a wgmma build with two tiles a warp")
    if xpre and not (wgmma and not xnat and not krot and stages >= 3):
        raise ValueError(f"native_w4a16 gemm: xpre with wgmma={wgmma}, xnat={xnat}, krot={krot}, stages={stages}: "
                         "a wgmma build with the weight's own K order, chunks in order and at least 3 stages")
    if ws not in (0, 1, 2, 4):
        raise ValueError(f"native_w4a16 gemm: ws={ws} producer warps is not 0, 1, 2 or 4")
    if ws and not (xpre and tw == 2 and minb == 1):
        raise ValueError(f"native_w4a16 gemm: ws with xpre={xpre}, tw={tw}, minb={minb}: an xpre build with two tiles a warp, "
                         "one block an SM")
    if wgdepth not in (1, 2, 3) or (wgdepth != 1 and not ws):
        raise ValueError(f"native_w4a16 gemm: wgdepth={wgdepth} with ws={ws}: 1..3, above 1 a ws build's")
    shmem = shmem_bytes(m, nwn, stages, wgmma, tw, xnat, xpre, ws)
    if shmem * minb > smem_limit:
        raise ValueError(f"native_w4a16 gemm: {stages} stages of M={m} with nwn={nwn} need {shmem} bytes of shared memory "
                         f"a block, {minb} block(s) an SM: more than the device's {smem_limit}")
    tiles = -(-n // (16 * tw * nwn))
    image = x_image_bytes(m, k) if xpre else 0
    partials = splits * m * n * 4 if splits > 1 else 0
    if image:
        partials = -(-partials // 256) * 256  # the image starts 256-byte aligned (w4a16_gemm.cu's ximg)
    return Plan(m, -(-m // 8), nwn, splits, stages, minb, tiles, shmem, partials + image, bool(wgmma), tw,
                xnat=bool(xnat), krot=bool(krot), xpre=bool(xpre), x_image=image, ws=int(ws), wgdepth=wgdepth)


# The rule's cost model (microseconds), fitted to the H200 plan sweep at M = 33, 48, 64 on the five
# PERF.md shapes (benchmarks/results/h200-2026-12-01-8d70817-probe-gemm-plans.json): the main loop
# streams the weight at a rate that falls with M (the MMAs per byte grow), stretched by the share of
# SM slots the grid leaves idle in its last wave; each column tile reads all of x from L2; split K
# writes and reads back fp32 partials. It picks the measured best of the sweep's seven plans on
# every shape (within 3% at 8192x28672, where 4 splits of 256 columns beat 2 of 128 by 3-10%).
MAIN_US_PER_MB = (0.3, 0.009)  # a + b * M microseconds per MB of weight
X_US_PER_MB = 0.17
PARTIAL_US_PER_MB = 0.67


def plan_cost_us(m: int, n: int, k: int, nwn: int, splits: int, sms: int) -> float:
    """The rule's estimate of a plan's time (one block an SM)."""
    tiles = -(-n // (32 * nwn))
    blocks = tiles * splits
    fill = blocks / (-(-blocks // sms) * sms)
    main = (n * k / 2 / 1e6) * (MAIN_US_PER_MB[0] + MAIN_US_PER_MB[1] * m) / fill
    x_reads = tiles * m * k * 2 / 1e6
    partials = splits * m * n * 8 / 1e6 if splits > 1 else 0.0
    return main + X_US_PER_MB * x_reads + PARTIAL_US_PER_MB * partials


@functools.lru_cache(maxsize=1024)
def _rule(m: int, n: int, k: int, sms: int, smem_limit: int = SHMEM_SM_BYTES, wgmma: bool = False) -> Plan:
    # One block an SM (the MT = 5..8 builds take 115-160 registers a thread; two blocks an SM were
    # faster only where the column tiles alone make two waves: 57344x8192 at M = 33). Column tiles
    # of 256 or 128 and 1..16 splits of K (each block at least two iterations), the cheapest by
    # plan_cost_us. Four stages, or as many as the device's shared memory holds (sm_80: 163 KiB).
    # wgmma (Hopper) wherever the device runs it: 1.02-1.41x faster than the mma.sync build at every
    # M = 33 / 48 / 64 case of the five PERF.md shapes, and the same tiles stay the fastest with it
    # (h200-2026-12-01-b0e9694-probe-wgmma-plans.json: six tiles and six stages timed).
    chunks = max(-(-k // CHUNK_K), 1)
    best = None
    for nwn in (8, 4):
        for splits in range(1, 17):
            if splits > 1 and chunks < splits * 2 * (8 // nwn):
                break
            cost = plan_cost_us(m, n, k, nwn, splits, sms)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, nwn, splits)
    # With wgmma, x permuted once per call (xpre) where three stages fit: 1.06-1.32x faster than the
    # register-staged x at M = 33 / 48 / 64 on all five shapes, 4, 5 or 6 stages alike, 3 slower
    # (h200-2026-12-02-a03ced7-probe-xpre.json). The tiles were fitted before it (x's cost changed).
    nwn = best[1]
    xpre = wgmma and shmem_bytes(m, nwn, 3, wgmma, xpre=True) <= smem_limit
    # Warp-specialized with four producer warps (ws) where a block runs at least WS_MIN_ITERATIONS iterations:
    # 1.03-1.11x faster than xpre at M = 33 and 64 on the four large shapes (14-64 iterations), 0.95-0.97x on
    # 4096x4096 (4) in two runs (h200-2026-12-03-789f82a-probe-ws.json, ...-df06eb1-probe-ws.json); at M = 17 / 24 / 32
    # 1.05-1.11x on 28672x4096 (32), 57344x8192 (64), 8192x28672 (56) and 14336x4096 (16), 0.99-1.01x on 4096x14336
    # (14), 0.99x on 6144x4096 at M = 32 (8), 0.90-0.94x on 4096x4096 (4) in two runs
    # (h200-2026-12-03-26af5f6-probe-ws-below33.json, h200-2026-12-04-9fd3b1b-probe-ws-below33.json).
    iterations = chunks // best[2] // (8 // nwn)
    ws = WS_PRODUCERS if xpre and m >= WS_MIN_ROWS and iterations >= WS_MIN_ITERATIONS else 0
    stages = max([s for s in (2, 3, 4) if shmem_bytes(m, nwn, s, wgmma, xpre=xpre, ws=ws) <= smem_limit], default=2)
    return make_plan(m, n, k, nwn=nwn, splits=best[2], stages=stages, smem_limit=smem_limit, wgmma=wgmma, xpre=xpre, ws=ws)


_override = None


@contextlib.contextmanager
def plan_override(fn):
    """Inside the block, ``fn(m, n, k, rule_plan) -> Plan`` decides every plan (measurements, tests)."""
    global _override
    prev, _override = _override, fn
    try:
        yield
    finally:
        _override = prev


def _env_fields() -> dict[str, int]:
    raw = os.environ.get(PLAN_ENV, "").strip()
    if not raw:
        return {}
    out = {}
    for item in raw.split(","):
        key, _, val = item.partition("=")
        if key.strip() not in ("nwn", "splits", "stages", "minb", "wgmma", "tw", "xnat", "krot", "xpre", "ws", "wgdepth"):
            raise ValueError(f"{PLAN_ENV}: unknown field {key.strip()!r} (nwn, splits, stages, minb, wgmma, tw, xnat, krot, xpre, ws, wgdepth)")
        out[key.strip()] = int(val)
    return out


def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _smem_limit(device: int) -> int:
    """Dynamic shared memory a block may opt in to: the device's maximum less 1 KiB of static."""
    return min(compiler.max_shared_optin(device) - 1024, SHMEM_SM_BYTES)


def wgmma_missing(device: int) -> str | None:
    """Why the device cannot run the wgmma builds, or None: they are sm_90a code (Hopper, compute
    capability 9.0 exactly; an sm_90a cubin loads on no other architecture)."""
    cap = _capability(device)
    if cap != (9, 0):
        return f"wgmma builds are sm_90a code; cuda:{device} has compute capability {cap[0]}.{cap[1]}"
    return None


@functools.lru_cache(maxsize=None)
def _capability(device: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def plan(m: int, n: int, k: int, device: int) -> Plan:
    """The plan for an (m, K) x (K, N) call on CUDA device ``device``."""
    p = _rule(m, n, k, _sm_count(device), _smem_limit(device), wgmma_missing(device) is None)
    fields = _env_fields()
    if fields:
        p = with_fields(p, n, k, smem_limit=_smem_limit(device), **fields)
    if _override is not None:
        p = _override(m, n, k, p)
    if p.wgmma and (why := wgmma_missing(device)) is not None:
        raise ValueError(f"native_w4a16 gemm: plan {p} asks for wgmma: {why}")
    return p


def reduce_blocks(m: int, cols: int) -> int:
    """Blocks of ``qops_w4a16_reduce`` for ``m`` rows of ``cols`` output columns, 4 a thread (N % 4 == 0 for
    every native int weight, and N % 8 == 0 for a gated one: ``cols`` is always a multiple of 4)."""
    if cols % 4:
        raise ValueError(f"native_w4a16: the split-K reduction takes output columns in fours, not {cols}")
    return -(-m * cols // (THREADS * 4))


def _reduce_kernel(dev: int, dtype: torch.dtype):
    return compiler.get_kernel(dev, REDUCE_SOURCE, {"QOPS_DT": _DT[dtype]}, REDUCE)


def launch(p: Plan, x2, qweight, scales, qzeros, bias, o2, ws, n: int, k: int, chunks_per_group: int, zero_offset: int,
           flags: int, dev: int, stream, pdl: bool) -> None:
    """One GEMM launch of plan ``p`` (``ws``: scratch of ``p.workspace`` bytes when it needs any: a
    split-K plan's fp32 partials, then an xpre plan's x image), the x image's launch before it and the
    reduction of its partials after it. ``flags``: the bias and scale-dtype bits of ``w4a16_gemv.cu``."""
    m = x2.shape[0]
    has_z = qzeros is not None
    defines = p.defines(x2.dtype, has_z)
    kernel = compiler.get_kernel(dev, SOURCE, defines, KERNEL, arch_specific=p.wgmma)
    i32 = compiler.i32
    ws_ptr = ws.data_ptr() if ws is not None else 0
    if p.xpre:
        image = compiler.get_kernel(dev, SOURCE, defines, X_IMAGE, arch_specific=p.wgmma)  # the GEMM's module
        compiler.launch(image, (-(-p.x_image // 16 // THREADS), 1, 1), (THREADS, 1, 1), 0, stream,
                        x2.data_ptr(), ws_ptr + p.workspace - p.x_image, i32(m), i32(k), i32(x2.stride(0)), pdl=pdl)
    compiler.launch(
        kernel, (p.tiles, p.splits, 1), (p.threads, 1, 1), p.shmem, stream,
        qweight.data_ptr(), scales.data_ptr(), qzeros.data_ptr() if has_z else 0, x2.data_ptr(),
        bias.data_ptr() if bias is not None else 0, o2.data_ptr(), ws_ptr,
        i32(m), i32(n), i32(k), i32(x2.stride(0)), i32(o2.stride(0)), i32(chunks_per_group), i32(zero_offset), i32(flags),
        pdl=pdl,
    )
    if p.splits > 1:
        compiler.launch(
            _reduce_kernel(dev, x2.dtype), (reduce_blocks(m, n), 1, 1), (THREADS, 1, 1), 0, stream,
            ws_ptr, bias.data_ptr() if bias is not None else 0, o2.data_ptr(), i32(m), i32(n), i32(o2.stride(0)),
            i32(p.splits), i32(flags), pdl=pdl,
        )


def warmup(dev: int, dtype: torch.dtype, n: int, k: int, has_zeros: bool, m_lo: int, m_hi: int, stream, pdl: bool) -> int:
    """Compile, load and launch once with no work every GEMM kernel M = m_lo..m_hi needs; returns how many."""
    seen = set()
    i0 = compiler.i32(0)
    for m in range(max(m_lo, 1), min(m_hi, MAX_M) + 1):
        p = plan(m, n, k, dev)
        defines = p.defines(dtype, has_zeros)
        key = (p.shmem, p.splits, tuple(sorted(defines.items())))
        if key in seen:
            continue
        seen.add(key)
        kernel = compiler.get_kernel(dev, SOURCE, defines, KERNEL, arch_specific=p.wgmma)
        if p.shmem > SHMEM_DEFAULT_BYTES:  # the opt-in, made now rather than at a first launch inside a capture
            compiler.allow_dynamic_shared(kernel, dev, p.shmem)
        compiler.launch(kernel, (1, 1, 1), (p.threads, 1, 1), 0, stream, 0, 0, 0, 0, 0, 0, 0, *([i0] * 8), pdl=pdl)
        if p.xpre:
            image = compiler.get_kernel(dev, SOURCE, defines, X_IMAGE, arch_specific=p.wgmma)
            compiler.launch(image, (1, 1, 1), (THREADS, 1, 1), 0, stream, 0, 0, i0, i0, i0, pdl=pdl)
        if p.splits > 1:
            compiler.launch(_reduce_kernel(dev, dtype), (1, 1, 1), (THREADS, 1, 1), 0, stream, 0, 0, 0, *([i0] * 5), pdl=pdl)
    return len(seen)


def with_fields(p: Plan, n: int, k: int, smem_limit: int = SHMEM_SM_BYTES, **fields) -> Plan:
    """``p`` with some of nwn / splits / stages / minb / wgmma / tw / xnat / krot / xpre / ws replaced (validated, shared
    memory and workspace re-derived), and the build-only ``probe``. ``nwn`` 1 or 2 without ``wgmma`` given
    turns wgmma off; a choice xpre cannot serve without ``xpre`` given turns xpre off, and one ws cannot
    serve (or probes 1-3) without ``ws`` given turns ws off."""
    probe = fields.pop("probe", p.probe)
    if "wgmma" not in fields and fields.get("nwn", p.nwn) not in (4, 8):
        fields["wgmma"] = False  # a width warpgroups cannot share (nwn 1, 2) asks for the mma.sync build
    if not fields.get("wgmma", p.wgmma) and "xnat" not in fields:
        fields["xnat"] = False
    if probe and not fields.get("wgmma", p.wgmma):
        raise ValueError("native_w4a16 gemm: probe builds are wgmma builds")
    if "xpre" not in fields:  # a build xpre cannot be (the mma.sync one, xnat, krot, 2 stages) asks for the other x path
        merged = {"wgmma": p.wgmma, "xnat": p.xnat, "krot": p.krot, "stages": p.stages} | fields
        if not merged["wgmma"] or merged["xnat"] or merged["krot"] or merged["stages"] < 3:
            fields["xpre"] = False
    if "ws" not in fields:  # likewise ws: an xpre build, two tiles a warp, one block an SM
        merged = {"xpre": p.xpre, "tw": p.tw, "minb": p.minb} | fields
        if not merged["xpre"] or merged["tw"] != 2 or merged["minb"] != 1:
            fields["ws"] = 0
    if 1 <= probe <= 3 and "ws" not in fields:
        fields["ws"] = 0  # probes 1-3 measure the xpre build's loop
    if not fields.get("ws", p.ws) and "wgdepth" not in fields:
        fields["wgdepth"] = 1  # ws dropped: so is its depth
    base = {"nwn": p.nwn, "splits": p.splits, "stages": p.stages, "minb": p.minb, "wgmma": p.wgmma, "tw": p.tw, "xnat": p.xnat, "krot": p.krot,
            "xpre": p.xpre, "ws": p.ws, "wgdepth": p.wgdepth}
    q = make_plan(p.m, n, k, smem_limit=smem_limit, **(base | fields)) if fields else p
    if not 0 <= probe <= 6:
        raise ValueError(f"native_w4a16 gemm: probe={probe} outside 0..6")
    if probe and bool(q.ws) != (probe >= 4):
        raise ValueError("native_w4a16 gemm: probes 4-6 are the ws builds', probes 1-3 the other wgmma builds'")
    return dataclasses.replace(q, probe=probe) if probe != q.probe else q
