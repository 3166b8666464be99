"""Native lowering of ``qops::mm_blockwise4`` (lowering ``native_blockwise4``): bitsandbytes NF4 / FP4
at decode sizes.

Serves the runtime layout of ``qops/ops/blockwise4.py`` (plain or nested absmax; qweight flat or, what
``prepare_blockwise4`` builds for this lowering, tile16) with float16 / bfloat16 x, K % 128 == 0, a
blocksize that is a multiple of 64, N*K < 2^31, and M = prod(x.shape[:-1]) <= 16 (``MAX_M``: one
launch, the weight read once for all rows); M up to ``SLICED_MAX_M`` in 16-row slices, one launch
each. Anything else goes to the Triton lowering (``qops.ops.triton.blockwise4.triton_mm``).

Kernel: ``blockwise4_gemv.cu`` (design notes at its top): the codes are looked up a byte (two codes)
at a time in a bank-conflict-free shared-memory table and multiplied on the tensor cores; one block
of ``warps`` warps per 16 * ``tiles`` rows of N, its warps splitting K and summing in shared memory
in a fixed order (bit-identical from run to run, no workspace).

Compilation and module loading happen in :func:`warmup` (every variant M = 1..16 needs) or at the
first eager call of a shape; never during CUDA-graph capture. Launched with programmatic dependent
launch on sm_90 as ``qops.native.int_weight`` launches (same switch, ``QOPS_NATIVE_PDL``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from . import compiler
from ..ops.blockwise4 import LAYOUT_TILE16
from .int_weight import early_dependents_flag, out_view, use_pdl

SOURCE = "blockwise4_gemv.cu"
GEMV = "qops_blockwise4_gemv"
MAX_M = 16  # rows one launch takes (two 8-row MMA tiles)
# Rows served in MAX_M-row launches (the weight read once a slice). Above, Triton: its dequantized
# N-slabs and cuBLAS. At M = 64 four slices are predicted at 1.4-2.4x the dense path's speed on the
# five benchmark shapes, from one run's M = 16 native and M = 64 dense times (4 x 41.5 against 317 us
# on 28672x4096, 4 x 8.0 against 45.5 on 4096x4096: benchmarks/results/h200-2026-12-01-f28b309-bnb.json);
# at M = 128 the two are even on 28672x4096 and 4096x14336 and dense wins on 4096x4096. Not yet
# measured as slices past M = 32.
SLICED_MAX_M = 64
STEP_K = 128  # K values of a row a lane quad takes per step (kStepK in the kernel)
NESTED_MAP_BYTES = 256 * 4  # the nested code, after the table
SCALES = ("cols", "prescale", "chains")
_DT = {torch.float16: 0, torch.bfloat16: 1}
_BIAS_T, _BIAS_F32 = 2, 4  # kBiasT, kBiasF32 in ptx.cuh


@dataclass(frozen=True)
class Plan:
    mt: int  # 8-column MMA tiles of x, 1 or 2: 8 rows of x a tile, 4 with scale "cols" at blocksize 64
    tiles: int  # 16-row tiles of N a warp group (QOPS_R)
    warps: int  # warps a block: ``wn`` groups side by side along N, each group's warps splitting K
    ring: int  # register ring slots a warp (ring - 1 steps of 128 K values in flight)
    minb: int  # blocks an SM promised to ptxas (__launch_bounds__): 3 caps at 80 registers, 2 at 128
    # How a step's two absmax blocks are applied (blocksize 64 only; one block a step is scaled after
    # its MMA chain in fp32): "cols", in separate MMA columns of each x row, scaled after the MMA in
    # fp32; "prescale", on the decoded weights in the activation dtype, one MMA chain; "chains", two
    # MMA chains over x masked to each block's lanes, scaled in fp32.
    scale: str = "prescale"
    lut_imm: bool = False  # table entries 256 bytes apart, addressed by one prmt and the window base as an immediate
    persistent: bool = False  # one wave of blocks, each taking every grid-th tile (QOPS_PERSISTENT)
    wn: int = 1  # warp groups a block side by side along N, each on ``tiles`` 16-row tiles (QOPS_WN)
    probe: int = 0  # measurements only (benchmarks/probe_nf4_native.py): 1 loads alone, 2 math alone
    alu: int = 0  # measurements only: of a lane's 8 words a step, how many are decoded on the ALU, not the table (QOPS_ALU)

    @property
    def shmem_bytes(self) -> int:
        """Dynamic shared memory a block: the code table (kTableBytes in the kernel), then the nested
        map, then (persistent) the warps' partials."""
        partials = self.warps * self.tiles * self.mt * 32 * 16 if self.persistent else 0
        return 256 * (256 if self.lut_imm else 128) + NESTED_MAP_BYTES + partials

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"native blockwise4 plan: scale={self.scale!r} is not one of {SCALES}")
        if self.wn < 1 or self.warps % self.wn:
            raise ValueError(f"native blockwise4 plan: wn={self.wn} does not divide warps={self.warps}")
        if not 0 <= self.alu <= 8:
            raise ValueError(f"native blockwise4 plan: alu={self.alu} outside 0..8 (words of a lane's eight a step)")

    def defines(self, dtype: torch.dtype, nested: bool, blocksize: int, nested_blocksize: int, layout: int,
                smem_base: int = 0) -> dict[str, int]:
        """``smem_base``: where the device puts a block's dynamic shared memory (used with ``lut_imm``)."""
        return {
            "QOPS_TILE16": int(layout == LAYOUT_TILE16),
            "QOPS_DT": _DT[dtype],
            "QOPS_MT": self.mt,
            "QOPS_R": self.tiles,
            "QOPS_WARPS": self.warps,
            "QOPS_WN": self.wn,
            "QOPS_RING": self.ring,
            "QOPS_MINB": self.minb,
            "QOPS_PROBE": self.probe,
            "QOPS_PERSISTENT": int(self.persistent),
            "QOPS_PRESCALE": int(self.scale == "prescale"),
            "QOPS_BLOCK_COLS": int(self.scale == "cols"),
            "QOPS_NESTED": int(nested),
            "QOPS_BLOCKSIZE": blocksize,
            "QOPS_NESTED_BS": nested_blocksize if nested else 1,
            "QOPS_LUT_IMM": int(self.lut_imm),
            "QOPS_SMEM_BASE": smem_base if self.lut_imm else 0,
        } | ({"QOPS_ALU": self.alu} if self.alu else {})  # only then: the other builds keep their cache keys

    def tiles_of(self, n: int) -> int:
        """Block tiles (16 * ``tiles`` * ``wn`` rows each) of an N-row weight."""
        return -(-n // (16 * self.tiles * self.wn))

    def grid(self, n: int, slots: int) -> int:
        """Blocks to launch; ``slots``: how many of the kernel's blocks the device runs at once (0:
        unknown, one block a tile then; the kernel's tile loop serves any grid)."""
        return min(self.tiles_of(n), slots) if self.persistent and slots > 0 else self.tiles_of(n)


_override: dict = {}


@contextlib.contextmanager
def plan_override(**fields):
    """Force plan fields (any of :class:`Plan`'s) inside the block: for sweeps, probes and tests."""
    global _override
    saved = _override
    _override = {**saved, **fields}
    try:
        yield
    finally:
        _override = saved


def plan(m: int, n: int, k: int, sm_count: int, blocksize: int) -> Plan:
    """The launch plan for M rows against an (N, K) weight of this blocksize on a device with
    ``sm_count`` SMs.

    From the H200 sweeps (benchmarks/results/h200-2026-11-30-f7d4784-nf4-native-16b.json and
    ...-9c36101-nf4-native-prescale.json): two 16-row tiles a block (x loads and table build shared
    by 32 rows) wherever that still gives every SM a block, one otherwise (4096-row shapes at M <= 8);
    at M > 8 always two. Ring depth and register budget: the deepest that compiles without spills
    (ptxas -v, sm_90, nested or not): one tile keeps 2 steps in flight in <= 120 registers (two
    blocks an SM), two tiles 1 step in 128 (two blocks an SM), or at M > 8 with fewer blocks than
    SMs 2 steps in 216 (4096x14336 at M = 16: 24 us against 32). At blocksize 64 a step holds two
    absmax blocks, applied by pre-scaling the decoded weights in the activation dtype ("prescale"):
    two exact MMA chains would double the MMAs and need 168 registers at M > 8; separate MMA columns
    ("cols", 14% fewer instructions in the main loop) measured within 1% at M = 1 on 28672x4096 and
    57344x8192, 0.93-0.96x on 8192x28672 and half the speed on 4096x14336, where its 80 registers
    let a third block onto each SM (...-68788f2-probe-nf4-scale.json, ...-a12f445-probe-nf4-tiled.json).
    At M <= 8 the table is addressed by one prmt (``lut_imm``: 1-4% faster at M = 1,
    ...-5ed6f99-probe-nf4-chains.json). At M > 8, where the two-tile blocks take more than two
    waves (two blocks an SM), the grid is persistent (each block goes on to further tiles, the next
    one's first steps requested before the current one's sums): M = 16 +8% on 28672x4096, +4% on
    57344x8192, within 1.5% on the one-wave shapes; at M = 1 and 8 it is 0.95-1.02x, so not there
    (...-cc2214d-probe-nf4-persistent.json). At M <= 8, two-tile blocks on a K of 32 or 64 steps put
    their warps in groups side by side along N (``wn``), so that each warp takes 16 steps, where
    that still leaves 1.5 blocks an SM (groups of two warps with two steps in flight: ring 3):
    28672x4096 (wn 4) and 57344x8192 (wn 2) at M = 1 +3% and +4%, at M = 8 +1% and +4%, in four
    interleaved runs (h200-2026-12-01-3fbc43a-probe-nf4-wn*.json); other splits were slower (wn 4 on
    57344x8192 -6%, any wn on the one-wave shapes 8192x28672 and 4096x14336 -10% or worse, one-tile
    groups -11 to -21%), and at M = 16 wn 2 on 57344x8192 -10%. Fields forced by
    :func:`plan_override` win (``wn`` follows the forced tiles and warps unless forced itself); the x
    tiles follow from them.
    """
    tiles_two = -(-n // 32)
    fields = {"scale": "prescale", "lut_imm": m <= 8, "persistent": m > 8 and tiles_two > 2 * sm_count, **_override}
    rows = 4 if fields["scale"] == "cols" and blocksize == 64 else 8
    mt = max(1, -(-m // rows))
    if mt > 2:
        raise ValueError(f"native blockwise4 plan: M={m} needs {mt} x tiles of {rows} rows (at most 2)")
    small_n = tiles_two < sm_count
    tiles = 2 if m > 8 or not small_n else 1
    if tiles == 1:
        ring, minb = 3, 2
    elif m > 8 and small_n:  # one block an SM at most anyway: the deeper ring's 216 registers cost nothing
        ring, minb = 3, 1
    else:
        ring, minb = 2, 2
    p = replace(Plan(mt=mt, tiles=tiles, warps=8, ring=ring, minb=minb), **fields)
    if "wn" in _override or m > 8 or p.tiles != 2 or p.persistent:
        return p
    p = replace(p, wn=_warp_groups(n, k, p.warps, sm_count))
    if p.wn == 4 and p.scale == "prescale" and p.lut_imm and "ring" not in _override:
        # Groups of two warps keep two steps in flight in 128 registers without spills (the pre-scaled
        # one-prmt build; one group spills there): 28672x4096 +2.9% at M = 1, +0.8% at M = 8; on
        # 57344x8192 (wn 2) it measured -1.2% (...-db8ab5f-probe-nf4-ring*.json).
        p = replace(p, ring=3)
    return p


def _warp_groups(n: int, k: int, warps: int, sm_count: int) -> int:
    """Warp groups along N for a two-tile block at M <= 8 (:func:`plan`): 16 steps a warp where
    that is 2 or 4 groups and the grid keeps 1.5 blocks an SM, else 1."""
    steps = k // STEP_K
    for wn in (4, 2):
        if steps * wn == 16 * warps and -(-n // (32 * wn)) >= 1.5 * sm_count:
            return wn
    return 1


def refusal(n: int, k: int, blocksize: int, act_dtype: torch.dtype, nested_blocksize: int = 0) -> str | None:
    """Why this kernel does not serve an (N, K) weight with this blocksize (``nested_blocksize``: 0 when
    the absmax is plain) and activation dtype, or None."""
    if act_dtype not in _DT:
        return f"activation dtype {act_dtype} (float16 and bfloat16 only)"
    if k % STEP_K:
        return f"K={k} is not a multiple of {STEP_K}"
    if blocksize % 64:
        return f"blocksize={blocksize} is not a multiple of 64"
    if n * k >= 2**31:
        return f"N*K={n * k} does not fit the kernel's 32-bit flat index"
    if blocksize == 64 and nested_blocksize % 2:
        return f"nested_blocksize={nested_blocksize} is odd (a step's two blocks must share their nested scale)"
    return None


def _call_refusal(x, qweight, absmax, n, blocksize, nested_blocksize) -> str | None:
    """Why the kernel does not serve this call (the weight's facts and the tensors' placement), or None."""
    if x.device.type != "cuda":
        return "x is not on a CUDA device"
    why = refusal(n, x.shape[-1], blocksize, x.dtype, nested_blocksize if absmax.dtype == torch.uint8 else 0)
    if why is not None:
        return why
    if not qweight.is_contiguous() or qweight.data_ptr() % 16:
        return "qweight is not contiguous and 16-byte aligned"
    if not absmax.is_contiguous() or absmax.data_ptr() % (8 if absmax.dtype == torch.float32 else 2):
        return "absmax is not contiguous and 8-byte (float32) / 2-byte (nested) aligned"
    return None


def _delegate(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
              nested_blocksize, layout, out, workspace):
    from ..ops.triton.blockwise4 import triton_mm

    return triton_mm(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
                     nested_blocksize, layout, out=out, workspace=workspace)


def native_mm(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
              nested_blocksize, layout, out=None, workspace=None) -> torch.Tensor:
    """Lowering entry (contract of ``qops.ops.blockwise4.reference_mm``): ``x (..., K) -> (..., N)``.

    Arguments are already validated. Returns a fresh tensor of x's dtype, or writes ``out`` and
    returns it; M > 32 and calls the kernel does not serve go to Triton (which may use ``workspace``).
    """
    args = (x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features, blocksize,
            nested_blocksize, layout)
    n, k = out_features, x.shape[-1]
    lead = x.shape[:-1]
    m = math.prod(lead)
    if m > SLICED_MAX_M or _call_refusal(x, qweight, absmax, n, blocksize, nested_blocksize) is not None:
        return _delegate(*args, out, workspace)
    result = out if out is not None else torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return result
    if k == 0:
        result.copy_(bias.expand(*lead, n) if bias is not None else torch.zeros_like(result))
        return result
    o2 = out_view(result, m, n)
    target = o2 if o2 is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1 or x2.data_ptr() % 16 or (m > 1 and x2.stride(0) % 8):
        x2 = x2.clone(memory_format=torch.contiguous_format)  # 16-byte aligned rows for the kernel's x loads
    nested = absmax.dtype == torch.uint8
    code = code.contiguous()  # (16,), (256,), (n_nested,): checked shapes, any strides
    if nested:
        nested_code, nested_absmax = nested_code.contiguous(), nested_absmax.contiguous()
    flags = 0
    if bias is not None:
        if bias.dtype not in (x.dtype, torch.float32):
            bias = bias.float()
        flags = _BIAS_T if bias.dtype == x.dtype else _BIAS_F32
        bias = bias.contiguous()
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    tables = (code, absmax, nested_code if nested else None, nested_absmax if nested else None,
              nested_offset if nested else None)
    # x's device is the current one here: the op's entry (lowerings.implementation) makes it so
    for r0 in range(0, m, MAX_M):  # one launch up to MAX_M rows, then slices of it
        rows = min(MAX_M, m - r0)
        _launch(dev, x2[r0:r0 + rows], qweight, tables, bias, target[r0:r0 + rows], n, k, blocksize, nested_blocksize,
                layout, flags)
    if o2 is None:
        result.copy_(target.view(result.shape))
    return result


def _launch(dev: int, x2, qweight, tables, bias, target, n: int, k: int, blocksize: int, nested_blocksize: int,
            layout: int, flags: int) -> None:
    """One kernel launch: ``target (M, N) = x2 (M, K) @ W.T`` (+ bias per ``flags``), M <= MAX_M."""
    code, absmax, nested_code, nested_absmax, nested_offset = tables
    nested = nested_code is not None
    m = x2.shape[0]
    p = plan(m, n, k, _sm_count(dev), blocksize)
    gemv = _kernel(dev, p, x2.dtype, nested, blocksize, nested_blocksize, layout)
    grid = p.grid(n, compiler.max_active_blocks(gemv, dev, 32 * p.warps, p.shmem_bytes) * _sm_count(dev) if p.persistent else 0)
    flags |= early_dependents_flag(gemv, dev, grid, 32 * p.warps, p.shmem_bytes)
    i32 = compiler.i32
    compiler.launch(
        gemv, (grid, 1, 1), (32 * p.warps, 1, 1), p.shmem_bytes, torch.cuda.current_stream(),
        qweight.data_ptr(), code.data_ptr(), absmax.data_ptr(),
        nested_code.data_ptr() if nested else 0, nested_absmax.data_ptr() if nested else 0,
        nested_offset.data_ptr() if nested else 0, x2.data_ptr(), bias.data_ptr() if bias is not None else 0,
        target.data_ptr(), i32(m), i32(n), i32(k), i32(x2.stride(0) if m > 1 else k),
        i32(target.stride(0) if m > 1 else n), i32(flags), pdl=use_pdl(dev))


_sms: dict[int, int] = {}


def _kernel(dev: int, p: Plan, dtype: torch.dtype, nested: bool, blocksize: int, nested_blocksize: int, layout: int):
    """The compiled, loaded kernel of plan ``p`` (``compiler.launch`` opts it in to its shared memory)."""
    base = compiler.dynamic_shared_base(dev) if p.lut_imm else 0
    return compiler.get_kernel(dev, SOURCE, p.defines(dtype, nested, blocksize, nested_blocksize, layout, base), GEMV)


def _sm_count(dev: int) -> int:
    if dev not in _sms:
        _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _sms[dev]


def warmup(weight, act_dtype: torch.dtype | None = None) -> int:
    """Compile and load every kernel M = 1..16 needs for a prepared ``Blockwise4Weight``; returns how
    many (0 when this kernel does not serve it). Each is launched once with no work, so the driver
    makes its code resident now and not during a later CUDA-graph capture."""
    qweight = weight.qweight
    act_dtype = act_dtype or weight.act_dtype
    n, k = weight.out_features, weight.in_features
    if qweight.device.type != "cuda" or refusal(n, k, weight.blocksize, act_dtype, weight.nested_blocksize) is not None:
        return 0
    if torch.cuda.is_current_stream_capturing():
        raise compiler.NativeNotReadyError("qops.native.blockwise4.warmup must run before CUDA-graph capture, not during it")
    nested = weight.absmax.dtype == torch.uint8
    dev = qweight.device.index if qweight.device.index is not None else torch.cuda.current_device()
    seen = set()
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream()
        for m in range(1, MAX_M + 1):
            p = plan(m, n, k, _sm_count(dev), weight.blocksize)
            key = (p, act_dtype, nested, weight.blocksize, weight.nested_blocksize, weight.layout)
            if key in seen:
                continue
            seen.add(key)
            gemv = _kernel(dev, *key)
            compiler.max_active_blocks(gemv, dev, 32 * p.warps, p.shmem_bytes)  # the early-release check's query, cached now
            i0 = compiler.i32(0)
            compiler.launch(gemv, (1, 1, 1), (32 * p.warps, 1, 1), p.shmem_bytes, stream, *([0] * 9), *([i0] * 6),
                            pdl=use_pdl(dev))
    return len(seen)
