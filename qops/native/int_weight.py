"""Native lowering of ``qops::mm_int_weight`` (lowering ``native_w4a16``): 4-bit weights at decode sizes.

Serves the runtime layout of ``qops/ops/int_weight.py`` with bits = 4, group_size -1 or a multiple
of 128, float16/bfloat16 activations and scales, N % 4 == 0, a 16-byte aligned contiguous qweight,
and M = prod(x.shape[:-1]) <= 64 (on Hopper more, in slices: below): up to 32 rows (``MAX_M``) the
decode kernel, 33..64 rows (``int_weight_gemm.MAX_M``, K % 8 == 0) the GEMM of
:mod:`qops.native.int_weight_gemm` (on Hopper, whose GEMM build runs warpgroup MMAs, from 17 or 24
rows: :func:`decode_rows`); one launch either way, the weight read once for all rows. Past 64 rows on
Hopper, up to :func:`rows_served` (by the weight's size and the GPU, ``SLICED_ROWS``: measured
faster than Triton there), 64-row GEMM launches and one for the rest. Anything else goes to the
Triton lowering (``qops.ops.triton.int_weight.triton_mm``), except in deterministic mode, where any M
runs over such slices (32-row decode-kernel slices where K % 8 != 0): bit-identical run to run.

Kernels: ``w4a16_gemv.cu`` and ``w4a16_gemm.cu`` (design notes at their tops). act_perm is
applied by gathering x once before the launch (``qops.ops.triton.x_gather``, the Triton lowering's gather) into
the start of the caller's workspace, so a graph replays it without an allocation; the split partials follow it.

Plans. For (M, N, K) on a device, :func:`plan` fixes the tile shape (by M), the number S of blocks
splitting K for one column tile (only when the column tiles leave SMs idle), and how the S partial
sums meet: for S = 2 on sm_90 a thread-block cluster adds them through distributed shared memory
(one kernel, no workspace); otherwise each block writes fp32 partials to a workspace of
:func:`workspace_bytes` and a second kernel adds them. Both add in a fixed order, so results do
not change from run to run; the choice of S depends only on the shape and the device.
Where the device has a plan table (``qops/native/plans/<gpu>.json``: measured plans for listed
(N, K) and ranges of M, built by ``benchmarks/native_plan_table.py`` from confirmed sweeps), its
entry wins over the rule. The H200's covers the decode shapes of Llama-3 8B and 70B (TP = 1 and 2),
Llama-2 7B and Qwen2.5 7B at M = 1..16, wherever the sweep beat the rule by 3% or more (65 of 92
cases: ``...-f4c8e4f-sweep-table.json``, ``...-1e6491f-sweep-table-{a,b}.json``). The H100 (SXM)'s covers
the 19 shapes its sweep reached in its budget (of 23: the Llama-3 8B / 70B layers and PERF.md's first) at
M = 1..16, 59 of 74 cases, 1.03-1.82x the rule, 1.18x geomean (``h100-2026-12-05-b5a8ad6-sweep-rule.json``). Entries whose grid
has more blocks than SMs promise two blocks an SM (the occupancy they were swept at; see
``benchmarks/native_plan_table.py``'s ``measured_minb``).

Plans with x staged once may keep the weights in flight in a shared-memory ring (``smem_ring``
stages a warp) instead of registers: more than 48 KiB of shared memory a block, which the launch
opts in to and :func:`make_plan` / :func:`plan` refuse above the device's opt-in maximum (x staged
once may then exceed 48 KiB too). The rule never picks it: since its copies go through L1 (822a60e)
it matches the register ring at M = 1 (4 stages 1-2% faster on 28672 x 4096 and 4096 x 14336,
slower on the long-K shapes), and neither three or four blocks per SM promised (``minb`` 3, 4: it
holds no chunk in registers) nor M = 16 plans staging x once beat the defaults
(``...-ee2bf78-sweep-smem-minb.json``, ``...-5ea9ca4-sweep-m16-smem.json``; benchmarks/NOTES.md,
stop 19). ``QOPS_NATIVE_SMEM_RING=S`` gives it to the rule's x-staged-once plans for measurements.

Compilation and module loading happen in :func:`warmup` (which compiles every variant M = 1..64
needs for a weight) or, failing that, at the first eager call of a shape; never during CUDA-graph
capture, where a missing kernel raises :class:`~qops.native.compiler.NativeNotReadyError`.

On sm_90 and later the kernels are launched with programmatic dependent launch (:func:`use_pdl`;
``QOPS_NATIVE_PDL=0`` turns it off): a launch may start streaming its weights while the kernel ahead
of it on the stream, which typically writes x, is still finishing. The kernel reads x, bias and the
workspace and writes anything only after waiting for that kernel, so the one assumption is that the
kernel right before a launch on the same stream does not write qweight, scales or qzeros. Weights
are written when they are loaded and prepared; :func:`warmup` after that is enough, since its
launches wait for the kernels ahead of them. A captured CUDA graph keeps the setting it was
captured with.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..lowerings import silu_mul
from ..ops._common import DETERMINISTIC_ENV, deterministic_requested  # noqa: F401  (DETERMINISTIC_ENV: the switch's name, re-exported)
from ..ops.int_weight import qweight_columns
from . import compiler
from . import int_weight_gemm as gemm

SOURCE = "w4a16_gemv.cu"
GEMV = "qops_w4a16_gemv"
REDUCE = "qops_w4a16_reduce"
MAX_M = 32  # rows one launch of the decode kernel takes (four 8-row MMA tiles)
# Above MAX_M rows the GEMM (int_weight_gemm, up to its MAX_M), then triton (outside deterministic
# mode). Two 32-row decode launches lost to triton at M = 64 (h200-2026-11-30-6f38b91-int-weight.json:
# each reads the whole weight again); the GEMM reads it once and beat triton on the five PERF.md
# shapes at M = 33, 48, 64 with its rule's plans (h200-2026-12-01-8d70817-probe-gemm-plans.json).
# On Hopper the GEMM's wgmma build also beats the decode kernel below 33 rows: side by side on the
# five shapes it was 1.04-1.32x faster at M = 32, 1.02-1.29x at 24 and 1.04-1.29x at 20 on the four
# of >= 2^25 weights, but 0.93x at 20 on 4096x4096 and slower on all five at 16
# (h200-2026-12-01-0c22849-probe-gemm-small-m.json, ...-probe-gemm-m20-28.json). There the decode
# kernel keeps (smallest N*K, rows): the first entry the weight reaches applies.
WGMMA_DECODE_ROWS = ((1 << 25, 16), (0, 23))
# Past gemm.MAX_M rows (outside deterministic mode) the call runs as 64-row GEMM launches and one for
# the rest, each reading the whole weight, while that is faster than the Triton lowering's tiled GEMM
# or dense path; above, it is handed to Triton. Per GPU (data, measured there by
# benchmarks/probe_gemm_slices.py): (smallest N*K, most rows), as WGMMA_DECODE_ROWS, for the wgmma
# GEMM (Hopper); a Hopper GPU not listed takes the H200's; elsewhere the slices were never measured
# and the limit is gemm.MAX_M. Where it pays depends on the GPU because the Triton side's dense path
# writes and reads 4 bytes a weight more than the slices: the less bandwidth, the further slices win.
# H200, measured side by side in three runs (h200-2026-12-04-93edcde-probe-gemm-slices.json, fp16, and
# ...-b5386cc-probe-slices-{fp16,bf16}.json), Triton's time over the slices': at 192 rows 1.23-1.45x on
# the three weights of >= 2^26, and at 160 1.08-1.15x on the two of 2^25.8 (at 192 14336x4096 tied:
# 0.99-1.04x); at 96 1.19-1.21x on 4096x4096 and 1.02-1.04x on 6144x4096 (0.92-0.95x at 128); at M = 65
# 1.30-2.41x everywhere. At 256 only 8192x28672 kept winning (1.07-1.11x; 57344x8192 0.96-1.03x,
# 28672x4096 1.00-1.05x): not taken. Smaller weights were not measured: one launch, gemm.MAX_M rows.
# H100 80GB HBM3 (0.7x the H200's bandwidth; h100-2026-12-05-b5a8ad6-probe-slices.json, fp16, against its
# own Triton table), Triton's time over the slices': at 320 rows 1.06-1.22x on the three weights of
# >= 2^26 (at 384 0.97x and 0.98x on two of them); at 192 1.38x and 1.64x on the two of 2^25.8, at 256 1.07x
# in the probe but 0.96x on 4096x14336 in the bench after it (h100-2026-12-05-032c3f3-bench.json): not
# taken; at 128 1.15x on 4096x4096 and 0.94x on 6144x4096, as on the H200 (0.92-0.95x there), so its 96
# stands. With these limits the bench's M = 256 rows ran 1.14 / 1.52 / 1.32x faster than the Triton path
# on 28672x4096 / 8192x28672 / 57344x8192 (against h100-2026-12-05-a7183d6-triton-h100table.json).
# QOPS_NATIVE_SLICED_ROWS=R replaces the table (measurements).
SLICED_ROWS_DEFAULT_GPU = "NVIDIA H200"
SLICED_ROWS = {
    "NVIDIA H200": ((1 << 26, 192), (1 << 25, 160), (1 << 24, 96), (0, 64)),
    "NVIDIA H100 80GB HBM3": ((1 << 26, 320), (1 << 25, 192), (1 << 24, 96), (0, 64)),
}
SLICED_ROWS_ENV = "QOPS_NATIVE_SLICED_ROWS"
THREADS = 256
CHUNK_K = 128
PDL_ENV = "QOPS_NATIVE_PDL"

# `flags` bits, as in w4a16_gemv.cu (and w4.cuh: kQSlabs, qweight in 32-column slabs)
_X_VEC, _BIAS_T, _BIAS_F32, _SCALE_BF16, _Q_SLABS = 1, 2, 4, 8, 32
_DT = {torch.float16: 0, torch.bfloat16: 1}

_deterministic: bool | None = None


def read_deterministic() -> bool:
    """Read the deterministic switch now (QOPS_DETERMINISTIC=1 or torch's deterministic algorithms)."""
    global _deterministic
    _deterministic = deterministic_requested()
    return _deterministic


def deterministic() -> bool:
    """The switch as read at the last warm-up (read once, lazily, if no warm-up ran)."""
    return read_deterministic() if _deterministic is None else _deterministic


def use_pdl(device: int) -> bool:
    """Launch on ``device`` with programmatic dependent launch: sm_90 or later, unless QOPS_NATIVE_PDL=0.

    Read at every launch (a dictionary lookup), so the switch acts without re-warming; kernels are the
    same either way. Where cuda.core cannot express it the launch is an ordinary one
    (``compiler.pdl_missing()`` says why).
    """
    return _sm90(device) and os.environ.get(PDL_ENV, "1").strip() != "0"


EARLY_ENV = "QOPS_NATIVE_EARLY_PDL"
_EARLY_DEPENDENTS = 16  # kEarlyDependents in ptx.cuh


def early_dependents_flag(kernel, device: int, blocks: int, threads: int, shmem: int) -> int:
    """The ``flags`` bit that releases the next PDL launch when ``kernel`` starts rather than after its
    main loop, for a grid of one wave (every block resident at once, by the driver's occupancy
    calculator) launched with PDL; QOPS_NATIVE_EARLY_PDL=0 turns it off (read at every launch).

    Safe for any grid: the next grid is released only once every block of this one has executed the
    trigger, so it never takes a slot one of this grid's blocks still waits for, and it reads x and
    writes only after its own griddepcontrol.wait. Kept to one wave because that is what was measured
    (benchmarks/results/h200-2026-11-30-4d76d20-early-pdl.json, M = 1, interleaved with the default):
    W4A16 0.91-0.95x the time on 28672x4096, 4096x14336, 6144x4096, 4096x4096 and NF4 0.82-0.91x on
    4096x14336, 6144x4096, 4096x4096, the rest within 2.5%.
    """
    if os.environ.get(EARLY_ENV, "1").strip() == "0" or not use_pdl(device):
        return 0
    per_sm = compiler.max_active_blocks(kernel, device, threads, shmem)
    return _EARLY_DEPENDENTS if per_sm and blocks <= per_sm * _device_facts(device)[0] else 0


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol needs sm_90


@dataclass(frozen=True)
class Plan:
    m: int
    mt: int  # 8-row MMA tiles of x: ceil(M / 8), 1..4
    nwn: int  # warps along N; a block covers 32 * nwn columns with 8 / nwn warps along K
    splits: int  # S: blocks sharing one column tile's K range
    cluster: bool  # the S blocks sum inside a thread-block cluster (sm_90) instead of through the workspace
    tiles: int
    shmem: int
    workspace: int  # bytes of fp32 partials (0 unless S > 1 without a cluster)
    xfull: bool = False  # x of the block's K range staged once (no barrier in the main loop)
    ring: int = 0  # register ring depth (0: the kernel's default for mt)
    minb: int = 2  # resident blocks per SM promised to the register allocator
    fold: bool = False  # (x staged once, M <= 8) magic bias and zero point subtracted after the MMA, from x sums
    prefetch: int = 0  # weights prefetched into L2 this many iterations ahead of the loads (0: none)
    smem_ring: int = 0  # (x staged once) stages of the per-warp shared-memory weight ring (0: the register ring)
    smem_bulk: bool = False  # measurements: that ring filled by whole-chunk bulk copies (sm_90, qweight in column slabs)
    xu: int = 8  # (x staged once) 16-byte x slots a thread loads before using any (1..8; 1: one round trip per 256 slots)
    # (x staged once, bf16 x) x staged as f16 scaled by a power of two a row and the MMAs run in f16
    # (w4a16_gemv.cu, QOPS_F16MMA); no effect on f16 x or on plans staging x per iteration.
    f16mma: bool = False
    # (x staged once, nwn 4 or 8) Hopper's warpgroup MMAs (w4a16_gemv.cu, QOPS_WGMMA; an sm_90a build;
    # measured slower than the mma.sync build on the large shapes: measurements only, in no plan)
    wgmma: bool = False
    # (x staged once) 4-bit codebook weights (w4a16_gemv.cu, QOPS_LUT; :mod:`qops.native.codebook_w4`):
    # the codes decoded through a table of the codebook in shared memory (LUT_TABLE_BYTES more a block),
    # scales a column and 64 rows; no zeros, no fold. Measurements: in no plan table.
    lut: bool = False
    # (a cluster) measurements: the cluster's exit barrier with the release arrive it had until stop 39
    # (every thread waiting for its output stores first); the kernel's own is relaxed (ptx.cuh cluster_exit_sync).
    exit_fence: bool = False

    def defines(self, dtype: torch.dtype, has_zeros: bool, glu: bool = False, smem_base: int = 0) -> dict[str, int]:
        """``smem_base``: where the device puts a block's dynamic shared memory (read by ``lut`` builds)."""
        return {
            "QOPS_GLU": int(glu),
            "QOPS_DT": _DT[dtype],
            "QOPS_MT": self.mt,
            "QOPS_NWN": self.nwn,
            "QOPS_HAS_Z": int(has_zeros),
            "QOPS_CLUSTER": self.splits if self.cluster else 1,
            "QOPS_XFULL": int(self.xfull),
            "QOPS_RING": self.ring,
            # f16mma takes ~16 more registers a thread: promised two blocks an SM (MT <= 2), ptxas keeps
            # the register ring's 128 (no spills at sm_90) instead of halving the blocks an SM.
            "QOPS_MINB": max(self.minb, 2) if self._f16mma_on(dtype) and self.mt <= 2 else self.minb,
            "QOPS_FOLD": int(self.fold),
            "QOPS_PREFETCH": self.prefetch,
            "QOPS_SMEM_RING": self.smem_ring,
            "QOPS_SMEM_BULK": int(self.smem_bulk),
            "QOPS_XU": self.xu,
            "QOPS_F16MMA": int(self._f16mma_on(dtype)),
        } | ({"QOPS_WGMMA": 1} if self.wgmma else {}) \
          | ({"QOPS_LUT": 1, "QOPS_SMEM_BASE": smem_base} if self.lut else {}) \
          | ({"QOPS_EXIT_FENCE": 1} if self.exit_fence else {})
        # (only when set: the other builds keep their cache keys)

    def _f16mma_on(self, dtype: torch.dtype) -> bool:
        return self.f16mma and self.xfull and dtype == torch.bfloat16


def _mt(m: int) -> int:
    return -(-m // 8)  # 8-row B tiles of the MMA


def _ring(mt: int, ring: int = 0) -> int:
    return ring if ring > 0 else (3 if mt == 1 else 2)  # as ring_depth<MT>() in w4a16_gemv.cu


SHMEM_MAX_BYTES = 48 * 1024  # the default dynamic shared memory limit (above it a kernel must opt in)
# One stage of the shared-memory weight ring for the block's 8 warps (kSmemStage in w4a16_gemv.cu:
# 2 KiB of qweight, 256 bytes of scales and 128 of zeros a warp).
SMEM_RING_STAGE_BYTES = 8 * (4 * 32 * 16 + 32 * 8 + 32 * 4)
SMEM_RING_MAX = 16  # stages (QOPS_SMEM_RING <= 16 in the kernel)
# The largest opt-in of the devices served (sm_90: 227 KiB a block), less the 1 KiB of static shared
# memory the sm_90 build carries (cuobjdump -res-usage: SHARED:1024), which counts against it.
STATIC_SHMEM_BYTES = 1024
SHMEM_OPTIN_MAX_BYTES = 227 * 1024 - STATIC_SHMEM_BYTES
SMEM_RING_ENV = "QOPS_NATIVE_SMEM_RING"
# The codebook table of lut plans (codebook4.cuh with 256-byte entries: 256 byte values x 32 lane copies),
# before everything else in a block's dynamic shared memory.
LUT_TABLE_BYTES = 256 * 256


def smem_ring_bytes(stages: int) -> int:
    """Shared memory of a ``stages``-deep weight ring for one block (8 warps)."""
    return stages * SMEM_RING_STAGE_BYTES


def staged_x_slots(mt: int, nwk: int) -> int:
    """16-byte x slots one iteration of per-iteration staging can copy (kXSlots * 256 in the kernel):
    two a thread for MT <= 2, enough for all 8 * MT rows for MT >= 3."""
    return THREADS * (2 if mt <= 2 else -(-8 * mt * nwk * 16 // THREADS))


def xfull_bytes(m: int, k: int, splits: int, fold: bool = False, wgmma: bool = False) -> int:
    """Shared memory the x-staged-once mode needs: M rows of the block's K range, padded rows (and
    with ``fold`` two fp32 sums per chunk for 8 rows); with ``wgmma`` the core-matrix image of 8 MT rows."""
    chunks = -(-max(-(-k // CHUNK_K), 1) // splits)
    if wgmma:
        return chunks * 16 * _mt(m) * 128
    return m * (chunks * 16 + 4) * 16 + (chunks * 8 * 8 if fold else 0)


def _plan_error(m: int, k: int, nwn: int, splits: int, cluster: bool, xfull: bool, ring: int, fold: bool = False,
                minb: int = 2, opt_in: bool = False, wgmma: bool = False) -> str | None:
    """Why the kernel cannot run this combination (its compile-time and launch limits), or None.

    ``opt_in``: the launch may opt in to more than 48 KiB of shared memory, so x staged once may
    take up to the largest opt-in (:func:`make_plan` checks the total). :func:`make_plan` allows it
    for every x-staged-once plan (measurements; a shared-memory ring); the rule keeps to 48 KiB."""
    nwk = 8 // nwn
    if nwn not in (1, 2, 4, 8):
        return f"nwn={nwn} is not 1, 2, 4 or 8"
    if not 1 <= splits <= min(max(-(-k // CHUNK_K), 1), 16):
        return f"splits={splits} outside 1..min(chunks, 16)"
    if cluster and not 2 <= splits <= 8:
        return f"a cluster of {splits} blocks (2..8 supported)"
    if not 1 <= m <= MAX_M:
        return f"M={m} outside 1..{MAX_M}"
    if not 1 <= minb <= 4:
        return f"minb={minb} outside 1..4"
    mt = _mt(m)
    if mt >= 3 and minb != 1:
        return f"minb={minb} with M={m}: MT = {mt} needs 150-240 registers a thread, two blocks per SM would spill"
    if mt >= 3 and _ring(mt, ring) > 3:
        return f"a register ring {_ring(mt, ring)} deep with M={m} (MT = {mt} keeps spill-free up to 3)"
    if fold and not (xfull and m <= 8):
        return f"fold needs x staged once (xfull) and M <= 8 (got xfull={xfull}, M={m})"
    if wgmma and not (xfull and nwn in (4, 8) and not fold):
        return (f"wgmma needs x staged once (xfull), nwn 4 or 8 (a warpgroup's four warps share their K chunk) and no fold "
                f"(got xfull={xfull}, nwn={nwn}, fold={fold})")
    x_limit = SHMEM_OPTIN_MAX_BYTES if opt_in else SHMEM_MAX_BYTES
    x_bytes = xfull_bytes(m, k, splits, fold, wgmma)
    if xfull and x_bytes > x_limit:
        return f"x of M={m}, K={k} split {splits} ways needs {x_bytes} bytes of shared memory (> {x_limit})"
    if not xfull and m * nwk * 16 > staged_x_slots(mt, nwk):
        return f"per-iteration x staging of M={m} rows with {nwk} warps along K exceeds {staged_x_slots(mt, nwk)} slots"
    if not xfull and _ring(mt, ring) * m * (nwk * 16 + 4) * 16 > SHMEM_MAX_BYTES:
        return "per-iteration x stages exceed the default shared memory limit"
    if _reduction_bytes(m, nwn, cluster) > SHMEM_MAX_BYTES:
        return f"the reduction of M={m} rows over {32 * nwn} columns{' in a cluster' if cluster else ''} exceeds the default shared memory limit"
    return None


def _reduction_bytes(m: int, nwn: int, cluster: bool) -> int:
    """Shared memory of the final reduction: fp32 [NWK][M][NBLK] (+ [M][NBLK] read by the cluster)."""
    nblk, nwk = 32 * nwn, 8 // nwn
    return nwk * m * nblk * 4 + (m * nblk * 4 if cluster else 0)


# bf16 x through f16 MMAs (Plan.f16mma) at M = 1 from this many weights on: measured against the
# bf16 MMAs with the same plans, 0.93x the time on 57344x8192, 0.98x on 28672x4096 and 8192x28672,
# but 1.01-1.07x on the three smaller decode shapes and 1.02-1.26x at M = 4..16, where staging the
# converted x costs more than the shorter dequantization saves
# (benchmarks/results/h200-2026-11-30-e538c97-probe-f16mma.json).
F16MMA_MIN_NK = 1 << 26


def make_plan(m: int, n: int, k: int, *, nwn: int, splits: int, cluster: bool, xfull: bool, ring: int = 0, minb: int = 2,
              fold: bool = False, prefetch: int = 0, smem_ring: int = 0, smem_limit: int | None = None, xu: int = 8,
              f16mma: bool | None = None, wgmma: bool = False, lut: bool = False) -> Plan:
    """A plan with every choice given (shared memory and workspace derived); :func:`plan` picks them.

    ``smem_limit``: the dynamic shared memory a block may opt in to on the target device
    (:func:`smem_optin_bytes`); None: the largest any served device allows (``SHMEM_OPTIN_MAX_BYTES``).
    ``f16mma`` None: at M = 1 with x staged once on weights of at least ``F16MMA_MIN_NK`` values (the
    rule's and the tables' plans alike). Only plans given here with x staged once or a shared-memory ring go above ``SHMEM_MAX_BYTES``
    (:func:`plan`'s rule keeps x within it). Raises ValueError for a
    combination the kernel cannot run.
    """
    why = _plan_error(m, k, nwn, splits, cluster, xfull, ring, fold, minb, opt_in=xfull, wgmma=wgmma)
    if why is None and not 0 <= prefetch <= 16:
        why = f"prefetch={prefetch} outside 0..16"
    if why is None and smem_ring and not 2 <= smem_ring <= SMEM_RING_MAX:
        why = f"smem_ring={smem_ring} is not 0 or 2..{SMEM_RING_MAX}"
    if why is None and wgmma and f16mma:
        why = "wgmma with f16mma: the wgmma build stages x in its own type (no bf16-through-f16 staging)"
    if why is None and wgmma and smem_ring:
        why = f"wgmma with smem_ring={smem_ring}: the wgmma build keeps its weights in the register ring"
    if why is None and smem_ring and not xfull:
        why = f"smem_ring={smem_ring} needs x staged once (xfull): the per-iteration x stages share the barrier the ring avoids"
    if why is None and not 1 <= xu <= 8:
        why = f"xu={xu} outside 1..8"
    if why is None and lut and not (xfull and not fold and not smem_ring and not wgmma):
        why = (f"lut needs x staged once (xfull) and no fold, smem_ring or wgmma (got xfull={xfull}, fold={fold}, "
               f"smem_ring={smem_ring}, wgmma={wgmma})")
    if why is None and minb > 2 and not smem_ring:
        why = f"minb={minb} leaves <= {65536 // (THREADS * minb)} registers a thread: only the shared-memory ring fits (the register ring spills)"
    if why is not None:
        raise ValueError(f"native_w4a16: {why}")
    mt = _mt(m)
    nblk, nwk = 32 * nwn, 8 // nwn
    tiles = -(-n // nblk)
    xs_bytes = xfull_bytes(m, k, splits, fold, wgmma) if xfull else _ring(mt, ring) * m * (nwk * 16 + 4) * 16
    shmem = max(xs_bytes + smem_ring_bytes(smem_ring), _reduction_bytes(m, nwn, cluster)) + (LUT_TABLE_BYTES if lut else 0)
    ws = splits * m * n * 4 if (splits > 1 and not cluster) else 0
    limit = SHMEM_OPTIN_MAX_BYTES if smem_limit is None else smem_limit
    if shmem > limit:
        raise ValueError(f"native_w4a16: x staged once, a {smem_ring}-stage shared-memory ring{' and the codebook table' if lut else ''} "
                         f"need {shmem} bytes of shared memory a block (x {xs_bytes} + ring {smem_ring_bytes(smem_ring)}"
                         f"{f' + table {LUT_TABLE_BYTES}' if lut else ''}); the device allows {limit} (its opt-in maximum): "
                         f"take fewer stages or split K more")
    if f16mma is None:
        f16mma = m == 1 and xfull and n * k >= F16MMA_MIN_NK and not wgmma
    return Plan(m, mt, nwn, splits, cluster, tiles, shmem, ws, xfull, ring, minb, fold, prefetch, smem_ring, xu=xu, f16mma=f16mma,
                wgmma=wgmma, lut=lut)


def warp_chunks(k: int, nwn: int, splits: int) -> int:
    """Iterations (128-row chunks) each warp of a decode-kernel block runs: the K chunks split over the
    S blocks of a column tile, then over the block's 8 / nwn warps along K."""
    chunks = max(-(-k // CHUNK_K), 1)
    return -(-(-(-chunks // splits)) // (8 // nwn))


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, sms: int, cluster_ok: bool) -> Plan:
    # From the H200 launch-plan sweeps (benchmarks/results/h200-2026-11-30-sweep-native-*.json):
    # - the plan that wins has about 1.5-2 blocks per SM, and wider column tiles (nwn = 4, 512
    #   contiguous bytes of a qweight row per block) win over splitting K whenever the column
    #   tiles alone give that many blocks; so take the widest tile, then the fewest splits (1 or 2),
    #   that reach 1.4 blocks per SM without exceeding the 2 that fit at once (~125 registers a
    #   thread): a second, partial wave costs more than the blocks it adds (6144 x 4096: 384 blocks
    #   on 264 slots); where no plan fits in one wave (large N), the first with 1.5 blocks per SM;
    # - x staged once (no barrier in the main loop) is 2-7% faster at M <= 8 wherever it fits; at
    #   M = 16 its serial prologue costs more than it saves on short blocks (measured before its
    #   loads overlapped, xu = 8: that made M = 1 another 4-16% faster, `...-0fd49bb-sweep-xu.json`;
    #   M = 16 staging x once is now 6-7% faster on the two long-K shapes: the plan table takes it there);
    # - two K splits sum faster inside a cluster than through the workspace, more do not;
    # - one block per SM promised to the register allocator (minb = 1) gains 1-2% at M <= 8;
    # - an L2 prefetch 2 iterations ahead gained 7-10% where each warp runs >= 24 iterations
    #   (57344 x 8192, 8192 x 28672 at M = 1) while x's prologue was serialized; with xu = 8 it costs
    #   8-12% there, so the M <= 16 plans take none;
    # - folding the bias and zero point out of the loop gains 3-6% on blocks of <= 4096 rows of K
    #   (fp16 4096 x 4096, 6144 x 4096, 28672 x 4096) and, with the prefetch, on the long ones; alone
    #   it lost 3-5% there before xu. The long ones keep it without the prefetch (88% and 86% of the
    #   roofline at 47d2a6e); folding off was not re-measured there.
    # - at M <= 8 the widest tile (nwn = 8: eight warps side by side, no K reduction in the block)
    #   where it alone makes one wave: 57344 x 8192 at M = 1 77.1 us against 85.9 for nwn = 4
    #   (`h200-2026-11-30-9cc0d6c-sweep-smem-joint.json`); it was not a candidate before.
    # Otherwise (small N, no candidate fits, or M <= 8 where x cannot be staged once) the earlier
    # rule: the tile by M, K split to about two blocks per SM, two blocks per SM promised. At M = 4
    # on 8192 x 28672 and 4096 x 14336 it measured 49 and 15 us where the wide-tile rule with one
    # block promised gave 75 and 21 us (sweep-native-1 at 5992169 against int-weight at 26b1d5b).
    if m > 16:
        return _plan_tall(m, n, k, sms, cluster_ok)
    chunks = max(-(-k // CHUNK_K), 1)
    for one_wave in (True, False):
        for xfull in ((True,) if m <= 8 else (False,)):
            for nwn in ((8, 4, 2, 1) if m <= 8 else (4, 2, 1)):
                for s in ((1,) if nwn == 8 else (1, 2)):
                    blocks = (-(-n // (32 * nwn))) * s
                    low, high = (1.4 * sms, 2 * sms) if one_wave else (1.5 * sms, float("inf"))
                    if not low <= blocks <= high or (s > 1 and s > chunks // (8 // nwn)):
                        continue
                    cluster = cluster_ok and s == 2
                    # The L2 prefetch no longer pays since x's loads overlap (xu): 57344 x 8192 and
                    # 8192 x 28672 at M = 1 run 8-12% faster without it (`...-1560c6f-sweep-m1-joint.json`).
                    # Folding stays where it was measured to pay: short blocks, and long warps.
                    fold = xfull and (warp_chunks(k, nwn, s) >= 24 or -(-k // s) <= 4096)
                    if _plan_error(m, k, nwn, s, cluster, xfull, 0, fold) is None:
                        return make_plan(m, n, k, nwn=nwn, splits=s, cluster=cluster, xfull=xfull, minb=1 if m <= 8 else 2,
                                         fold=fold)
    nwn = 1 if m <= 4 else (2 if m <= 8 else 4)
    tiles = -(-n // (32 * nwn))
    s = 1
    if tiles < sms:
        s = max(1, min(round(2 * sms / tiles), 16, chunks // (8 // nwn)))
    return make_plan(m, n, k, nwn=nwn, splits=s, cluster=cluster_ok and s == 2, xfull=False)


def _plan_tall(m: int, n: int, k: int, sms: int, cluster_ok: bool) -> Plan:
    """M = 17..32 (MT = 3, 4). Not yet measured: the one-wave rule of M <= 16 for one resident block.

    The accumulators of 24-32 rows take the registers of a second block (150-240 a thread; promising
    two blocks per SM spills), so a wave is one block per SM: the widest tile (nwn = 8 first: its x
    stage and K reduction are the smallest) and the fewest splits (1 or 2) giving 0.7-1 block per
    SM, else the first giving >= 0.75 block per SM; failing both, nwn = 4 with K split to about one
    block per SM. Per-iteration x staging (x staged once fits only <= 640 rows of K a block at
    M = 32). With eight warps per SM and one chunk in flight each in the register ring, loads keep
    ~2 MB in flight over 132 SMs against the ~8 MB DRAM needs, so the weights are also prefetched
    into L2 two iterations ahead (the prefetch holds no register).
    """
    chunks = max(-(-k // CHUNK_K), 1)
    for one_wave in (True, False):
        for nwn in (8, 4, 2):
            for s in (1, 2):
                blocks = (-(-n // (32 * nwn))) * s
                low, high = (0.7 * sms, sms) if one_wave else (0.75 * sms, float("inf"))
                if not low <= blocks <= high or (s > 1 and s > chunks // (8 // nwn)):
                    continue
                cluster = cluster_ok and s == 2
                if _plan_error(m, k, nwn, s, cluster, False, 0, minb=1) is None:
                    return make_plan(m, n, k, nwn=nwn, splits=s, cluster=cluster, xfull=False, minb=1, prefetch=2)
    tiles = -(-n // 128)
    s = max(1, min(round(sms / tiles), 16, chunks // 2))
    return make_plan(m, n, k, nwn=4, splits=s, cluster=cluster_ok and s == 2, xfull=False, minb=1, prefetch=2)


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, bool]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major >= 9


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


# Measured plans (data): one JSON file a GPU in qops/native/plans/, built by
# benchmarks/native_plan_table.py from confirmed sweeps. An entry names (N, K), a range of M and the
# plan's knobs; it applies on a device of that name and SM count. Everything else takes the rule.
PLAN_TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plans")
PLANS_ENV = "QOPS_NATIVE_PLANS"  # "rule": ignore the tables (for sweeps that measure the rule)
# The plan fields a table entry gives (the builder writes all of them) and their JSON types. The
# measurement knobs (lut, wgmma, f16mma, smem_bulk, exit_fence) are no table's: a lut plan launched for
# int weights reads the qzeros pointer (or 0) as its codebook.
PLAN_FIELDS = {"nwn": int, "splits": int, "cluster": bool, "xfull": bool, "ring": int, "minb": int, "fold": bool,
               "prefetch": int, "smem_ring": int, "xu": int}
_ENTRY_INTS = ("n", "k", "m_min", "m_max")


@functools.lru_cache(maxsize=None)
def _plan_table_files() -> dict[str, list[tuple[str, dict]]]:
    """GPU name -> (path, parsed JSON) of each table file under PLAN_TABLE_DIR naming it. A file that is
    not JSON or names no GPU belongs to no device: skipped with a warning, so that it fails no GPU's calls."""
    tables: dict[str, list[tuple[str, dict]]] = {}
    for path in sorted(glob.glob(os.path.join(PLAN_TABLE_DIR, "*.json"))):
        try:
            with open(path) as fh:
                table = json.load(fh)
        except (OSError, ValueError) as e:
            warnings.warn(f"native_w4a16: plan table {path} is not readable JSON ({e}); ignored", stacklevel=2)
            continue
        gpu = table.get("gpu") if isinstance(table, dict) else None
        if not isinstance(gpu, str):
            warnings.warn(f"native_w4a16: plan table {path} names no GPU (a string 'gpu'); ignored", stacklevel=2)
            continue
        tables.setdefault(gpu, []).append((path, table))
    return tables


@functools.lru_cache(maxsize=None)
def plan_table(gpu: str) -> tuple[str, dict] | None:
    """(path, table) of ``gpu``'s plan table, checked (:func:`check_plan_table`) when a device of that
    name first asks for it, or None where it has none. A malformed table raises for its GPU only."""
    found = _plan_table_files().get(gpu, [])
    if len(found) > 1:
        raise ValueError(f"native_w4a16: two plan tables for {gpu!r} ({', '.join(path for path, _ in found)})")
    if not found:
        return None
    path, table = found[0]
    check_plan_table(path, table)
    return path, table


def plan_tables() -> dict[str, dict]:
    """GPU name -> its checked plan table, for every table under PLAN_TABLE_DIR."""
    return {gpu: plan_table(gpu)[1] for gpu in _plan_table_files()}


def check_plan_table(path: str, table: dict) -> None:
    """Raise ValueError naming ``path`` (and the entry's index) where ``table`` is not what
    benchmarks/native_plan_table.py writes: an int ``sms``, a list of ``plans`` whose entries have int
    n, k, m_min, m_max and exactly the ``PLAN_FIELDS`` of the right types, and a plan :func:`make_plan`
    accepts for every M of the entry's range."""
    if type(table.get("sms")) is not int or not isinstance(table.get("plans"), list):
        raise ValueError(f"native_w4a16: plan table {path} needs an integer 'sms' and a list 'plans'")
    for i, e in enumerate(table["plans"]):
        why = _table_entry_error(e)
        if why is not None:
            raise ValueError(f"native_w4a16: plan table {path}, entry {i}: {why}")


def _table_entry_error(e) -> str | None:
    """Why plan-table entry ``e`` is malformed (:func:`check_plan_table`), or None."""
    if not isinstance(e, dict) or not isinstance(e.get("plan"), dict):
        return "not an object with a 'plan' object"
    not_ints = [key for key in _ENTRY_INTS if type(e.get(key)) is not int]
    if not_ints:
        return f"{', '.join(not_ints)} must be integers (got {', '.join(repr(e.get(key)) for key in not_ints)})"
    fields = e["plan"]
    unknown = sorted(set(fields) - set(PLAN_FIELDS))
    if unknown:
        return f"plan fields {unknown} are not table fields {list(PLAN_FIELDS)}"
    wrong = [f"{f} ({t.__name__})" for f, t in PLAN_FIELDS.items() if type(fields.get(f)) is not t]
    if wrong:
        return f"plan fields missing or not of their type: {', '.join(wrong)}"
    if not 1 <= e["m_min"] <= e["m_max"] <= MAX_M:
        return f"M range {e['m_min']}..{e['m_max']} is not within 1..{MAX_M}"
    for m in range(e["m_min"], e["m_max"] + 1):
        try:
            make_plan(m, e["n"], e["k"], **fields)
        except ValueError as ex:
            return f"its plan does not serve M={m}: {ex}"
    return None


@functools.lru_cache(maxsize=4096)
def measured_plan(m: int, n: int, k: int, gpu: str, sms: int, cluster_ok: bool, smem_limit: int) -> Plan | None:
    """The plan table's plan for ``m`` rows of an (N, K) weight on a ``gpu`` with ``sms`` SMs, or None.

    The table was checked against :func:`make_plan` at the largest opt-in of the devices served when it
    was loaded; a ValueError here names the entry whose plan needs more than this device's ``smem_limit``."""
    found = plan_table(gpu)
    if found is None or found[1]["sms"] != sms:
        return None
    path, table = found
    for i, e in enumerate(table["plans"]):
        if e["n"] == n and e["k"] == k and e["m_min"] <= m <= e["m_max"] and (cluster_ok or not e["plan"]["cluster"]):
            try:
                return make_plan(m, n, k, smem_limit=smem_limit, **e["plan"])
            except ValueError as ex:
                raise ValueError(f"native_w4a16: plan table {path}, entry {i}: {ex}") from None
    return None


def _env_plans() -> str:
    raw = os.environ.get(PLANS_ENV, "").strip().lower()
    if raw not in ("", "table", "rule"):
        raise ValueError(f"{PLANS_ENV}={raw!r}: expected 'table' (the default) or 'rule'")
    return raw or "table"


@functools.lru_cache(maxsize=None)
def smem_optin_bytes(index: int) -> int:
    """Dynamic shared memory a block of this kernel may opt in to on device ``index``: the device's
    opt-in maximum less the kernel's static shared memory (``STATIC_SHMEM_BYTES``)."""
    return compiler.max_shared_optin(index) - STATIC_SHMEM_BYTES


_plan_override = None  # benchmarks only: a function (m, n, k, sms, cluster_ok) -> Plan | None


@contextlib.contextmanager
def plan_override(fn):
    """Within the block, :func:`plan` asks ``fn(m, n, k, sms, cluster_ok)`` first (None: the usual plan).

    For benchmarks that compare plans (benchmarks/sweep_native.py); not thread-safe.
    """
    global _plan_override
    prev, _plan_override = _plan_override, fn
    try:
        yield
    finally:
        _plan_override = prev


def plan(m: int, n: int, k: int, device: torch.device | int) -> Plan:
    """The launch plan for ``m`` rows (<= ``MAX_M``) of x against an (N, K) weight on ``device``.

    The device's plan table where it has an entry (:func:`measured_plan`; ``QOPS_NATIVE_PLANS=rule``,
    read at each call, skips the tables), else the rule (:func:`_plan`).
    ``QOPS_NATIVE_SMEM_RING=S`` (read at each call, for measurements: set it before warm-up) gives
    the default plans that stage x once an S-stage shared-memory ring where the device has the
    shared memory for it; unset or 0, no ring. A plan needing more shared memory than the device
    allows raises ValueError.
    """
    idx = device if isinstance(device, int) else (device.index if device.index is not None else torch.cuda.current_device())
    sms, cluster_ok = _device_facts(idx)
    p = _plan_override(m, n, k, sms, cluster_ok) if _plan_override is not None else None
    if p is None:
        p = shipped_plan(m, n, k, idx)
        stages = _env_smem_ring()
        if stages and p.xfull:
            p = _with_smem_ring(p, n, k, stages, smem_optin_bytes(idx)) or p
    if p.wgmma and (why := gemm.wgmma_missing(idx)) is not None:
        raise ValueError(f"native_w4a16: the plan {p} is a wgmma build: {why}")
    if p.shmem > SHMEM_MAX_BYTES and p.shmem > smem_optin_bytes(idx):
        raise ValueError(f"native_w4a16: the plan {p} needs {p.shmem} bytes of shared memory a block; "
                         f"cuda:{idx} allows {smem_optin_bytes(idx)} (its opt-in maximum)")
    return p


def shipped_plan(m: int, n: int, k: int, idx: int) -> Plan:
    """The device's plan table entry, else the rule's plan (what :func:`plan` takes without an override
    or ``QOPS_NATIVE_SMEM_RING``; ``QOPS_NATIVE_PLANS=rule`` skips the tables)."""
    sms, cluster_ok = _device_facts(idx)
    p = measured_plan(m, n, k, _device_name(idx), sms, cluster_ok, smem_optin_bytes(idx)) if _env_plans() == "table" else None
    return p or _plan(m, n, k, sms, cluster_ok)


def remake_plan(p: Plan, n: int, k: int, smem_limit: int | None = None, **changes) -> Plan:
    """``p`` with the choices named in ``changes`` (``make_plan``'s keywords) replaced, its shared
    memory and workspace derived again; ValueError for a combination the kernel cannot run."""
    fields = dict(nwn=p.nwn, splits=p.splits, cluster=p.cluster, xfull=p.xfull, ring=p.ring, minb=p.minb, fold=p.fold,
                  prefetch=p.prefetch, smem_ring=p.smem_ring, xu=p.xu, f16mma=p.f16mma, wgmma=p.wgmma, lut=p.lut)
    return make_plan(p.m, n, k, smem_limit=smem_limit, **{**fields, **changes})


def lut_plan(p: Plan, n: int, k: int, smem_limit: int | None = None) -> Plan:
    """The plan of 4-bit codebook weights (:mod:`qops.native.codebook_w4`) from the int weights' plan ``p``
    for the shape: the codebook table (``lut``), x staged once, no fold, and two blocks an SM promised
    where M <= 16 -- the table's lookups take ~20 more registers a thread, and minb 1 let the M = 1
    builds take ~150 and one block an SM (128 without spills with two: tests/test_native_compile.py)."""
    return remake_plan(p, n, k, smem_limit, lut=True, xfull=True, fold=False, minb=2 if p.mt <= 2 else p.minb)


def _env_smem_ring() -> int:
    raw = os.environ.get(SMEM_RING_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SMEM_RING_ENV}={raw!r}: expected a stage count (0, or 2..{SMEM_RING_MAX})") from None


@functools.lru_cache(maxsize=4096)
def _with_smem_ring(p: Plan, n: int, k: int, stages: int, limit: int) -> Plan | None:
    """``p`` with an ``stages``-deep shared-memory ring, or None where the device lacks the memory."""
    try:
        return remake_plan(p, n, k, limit, smem_ring=stages)
    except ValueError:
        if not 2 <= stages <= SMEM_RING_MAX:
            raise
        return None


def workspace_bytes(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device | int | None = None,
                    act_order: bool = False) -> int:
    """Scratch bytes ``native_mm`` needs for an (m, K) x (K, N) product on ``device``.

    The signature is the Triton lowering's, so callers size either the same way (``act_order``: the weight has
    an act_perm, which only the Triton lowering's GEMM takes scratch for). 0 unless the plan
    splits K through the workspace. For m > ``gemm.MAX_M`` outside deterministic mode (or K % 8 != 0
    above ``MAX_M``), the Triton lowering's need, since those calls are handed to it.
    """
    if m <= 0 or n <= 0:
        return 0
    if device is None:
        if not torch.cuda.is_available():
            # the most any plan asks for: 16 splits of 32 rows, or the GEMM's (Hopper's from 17 rows) of
            # up to 64 rows with its x image
            rows = min(m, gemm.MAX_M)
            gemm_need = -(-16 * rows * n * 4 // 256) * 256 + gemm.x_image_bytes(rows, k)
            return _gather_bytes(m, k, act_order) + max(
                16 * min(m, MAX_M) * n * 4, gemm_need if m > min(r for _, r in WGMMA_DECODE_ROWS) else 0)
        device = torch.cuda.current_device()
    dev = device if isinstance(device, int) else (device.index if device.index is not None else torch.cuda.current_device())
    if _delegated(m, n, k, dev):
        return int(_triton_module().workspace_bytes(m, n, k, bits, group_size, torch.device("cuda", dev), act_order))
    # Slices of _slice_rows(m, k) rows and a shorter last one, one after another on the same scratch.
    step = _slice_rows(m, k)
    return _gather_bytes(m, k, act_order) + max(
        (plan(r, n, k, dev) if r <= decode_rows(n, k, dev) else gemm.plan(r, n, k, dev)).workspace
        for r in {min(step, m), m % step} if r)


def _gather_bytes(m: int, k: int, act_order: bool) -> int:
    """Workspace bytes ahead of the split partials: x gathered through act_perm (fp16/bf16, both gather routes'
    parts, ``x_gather.gather_scratch``); 0 without act-order."""
    return sum(_x_gather().gather_scratch(m, k, 2, True)) if act_order else 0


def _gathered_x(x2: torch.Tensor, act_perm: torch.Tensor, workspace: Optional[torch.Tensor], pdl: bool) -> tuple[torch.Tensor, int]:
    """``x2[:, act_perm]`` gathered into the start of ``workspace`` (``x_gather.gather_act_order``; fresh memory
    without one, a refusal where it is too small: :func:`_workspace`), and the byte offset after the gather's
    parts, where the split partials go. ``pdl``: the gather is the programmatic dependent of the launch ahead and
    the primary of the kernel after it (which waits for it before it reads x), as the native launches are of each
    other."""
    xgm = _x_gather()
    used = sum(xgm.gather_scratch(*x2.shape, x2.dtype.itemsize, True))
    return xgm.gather_act_order(x2, act_perm, _workspace(workspace, used, x2.device), pdl=pdl)


def _x_gather():
    try:
        from ..ops.triton import x_gather
    except ImportError as e:
        raise ImportError(f"native_w4a16 gathers act-order x with qops.ops.triton.x_gather, which is not importable: {e}") from e
    return x_gather


def decode_rows(n: int, k: int, device: int) -> int:
    """Most rows of a call the decode kernel serves; the GEMM takes those above (up to gemm.MAX_M).

    MAX_M, except where the GEMM can copy x (K % 8 == 0) and runs its wgmma build (compute
    capability 9.0): WGMMA_DECODE_ROWS. While a decode plan override is active (benchmarks and tests
    of the decode kernel's own plans) the decode kernel keeps all MAX_M rows.
    """
    if k % 8 or _plan_override is not None or gemm.wgmma_missing(device) is not None:
        return MAX_M
    return next(rows for size, rows in WGMMA_DECODE_ROWS if n * k >= size)


def _launch_rows(k: int) -> int:
    """Rows one native launch takes: the GEMM's up to gemm.MAX_M where it can copy x (K % 8 == 0), else
    the decode kernel's."""
    return gemm.MAX_M if k % 8 == 0 else MAX_M


def rows_served(n: int, k: int, device: int) -> int:
    """Most rows of a call this lowering runs itself outside deterministic mode (more go to Triton):
    one launch's (:func:`_launch_rows`), or on the wgmma GEMM's devices as many as the device's
    SLICED_ROWS gives the weight in slices of gemm.MAX_M rows (``QOPS_NATIVE_SLICED_ROWS``, read at
    every call, replaces it for measurements)."""
    one = _launch_rows(k)
    if one < gemm.MAX_M or gemm.wgmma_missing(device) is not None:
        return one
    raw = os.environ.get(SLICED_ROWS_ENV, "").strip()
    if raw:
        try:
            return max(int(raw), one)
        except ValueError:
            raise ValueError(f"{SLICED_ROWS_ENV}={raw!r} is not an integer number of rows") from None
    return max(next(rows for size, rows in sliced_rows_table(_device_name(device)) if n * k >= size), one)


def sliced_rows_table(gpu: str) -> tuple[tuple[int, int], ...]:
    """The (smallest N*K, most rows) entries of SLICED_ROWS measured on ``gpu``, else the H200's."""
    return SLICED_ROWS.get(gpu, SLICED_ROWS[SLICED_ROWS_DEFAULT_GPU])


def _delegated(m: int, n: int, k: int, device: int) -> bool:
    """Whether an m-row call goes to Triton: past rows_served outside deterministic mode. Calls one launch
    serves (every decode call) skip rows_served's environment and device checks."""
    return m > _launch_rows(k) and m > rows_served(n, k, device) and not deterministic()


def _slice_rows(m: int, k: int) -> int:
    """Rows of each launch of an m-row call (calls past one launch's rows run in slices: rows_served, or deterministic mode)."""
    return MAX_M if m <= MAX_M else _launch_rows(k)


def _triton_module():
    try:
        from ..ops.triton import int_weight as tri
    except ImportError as e:
        raise ImportError(f"native_w4a16 delegates shapes it does not serve to qops.ops.triton.int_weight, which is not importable: {e}") from e
    return tri


def _refusal(x, qweight, scales, qzeros, bits, group_size, n) -> str | None:
    """Why this kernel does not serve the call (static facts only), or None."""
    if x.device.type != "cuda":
        return "x is not on a CUDA device"
    if x.dtype not in _DT:
        return f"activation dtype {x.dtype}"
    if scales.dtype not in _DT:
        return f"scales dtype {scales.dtype}"
    if bits != 4:
        return f"bits={bits}"
    if group_size != -1 and group_size % CHUNK_K:
        return f"group_size={group_size} is not -1 or a multiple of {CHUNK_K}"
    if n % 4:
        return f"N={n} is not a multiple of 4"
    if not qweight.is_contiguous() or qweight.data_ptr() % 16:
        return "qweight is not contiguous and 16-byte aligned"
    if not scales.is_contiguous() or scales.data_ptr() % 8:
        return "scales are not contiguous and 8-byte aligned"
    if qzeros is not None and not qzeros.is_contiguous():
        return "qzeros are not contiguous"
    return None


def native_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=None, workspace=None,
              glu: bool = False) -> torch.Tensor:
    """Lowering entry (contract of ``qops.ops.int_weight.reference_mm``): ``x (..., K) -> (..., N)``.

    Arguments are already validated, and x's device is the current one (the op's entry,
    ``lowerings.implementation``, makes it so). Returns a fresh tensor of x's dtype, or writes ``out`` and
    returns it. ``workspace`` (uint8, >= :func:`workspace_bytes`) is used for split partials when
    given, else they are allocated from torch's caching allocator. No host synchronisation.

    ``glu``: the weight is a fused gate/up projection (gate rows of the checkpoint first, then up, N
    even) and the result is ``silu(y[..., :N/2]) * y[..., N/2:]``, ``(..., N/2)``: computed in the
    kernel's epilogue from the fp32 sums where the kernel serves the call (N % 8 == 0, no bias),
    else from the unfused product.
    """
    k = x.shape[-1]
    n = qweight_columns(qweight)
    lead = x.shape[:-1]
    m = math.prod(lead)
    if glu and (n % 2 or bias is not None):
        raise ValueError(f"native_w4a16: the gated output needs an even N and no bias (got N={n}, bias {'given' if bias is not None else 'None'})")
    nout = n // 2 if glu else n
    refused = _refusal(x, qweight, scales, qzeros, bits, group_size, n) is not None
    dev = None if refused else (x.device.index if x.device.index is not None else torch.cuda.current_device())
    last = 0 if refused else decode_rows(n, k, dev)  # rows above it go to the GEMM
    if glu and (refused or m > last or n % 8):  # the gated epilogue is the decode kernel's
        y = native_mm(x, qweight, scales, qzeros, act_perm, None, bits, group_size, zero_offset, None, workspace)
        gated = silu_mul(y)
        return gated if out is None else out.copy_(gated)
    if refused or _delegated(m, n, k, dev):
        return _delegate(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out, workspace)

    if out is None:
        result = torch.empty((*lead, nout), dtype=x.dtype, device=x.device)
        o2 = result.view(m, nout)
    else:
        result = out
        o2 = out_view(out, m, nout)
    if m == 0 or n == 0:
        return result

    x2 = x.reshape(m, k)
    sums_at = 0  # byte offset of the split partials in the workspace
    if act_perm is not None:
        x2, sums_at = _gathered_x(x2, act_perm, workspace, use_pdl(dev))
    elif k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    step = _slice_rows(m, k)
    if m > last and (x2.data_ptr() % 16 or x2.stride(0) % 8 or x2.stride(1) != 1):
        x2 = x2.clone(memory_format=torch.contiguous_format)  # the GEMM copies x in aligned 16-byte pieces
    target = o2 if o2 is not None else torch.empty((m, nout), dtype=x.dtype, device=x.device)

    if bias is not None and bias.dtype not in (x.dtype, torch.float32):
        bias = bias.float()
    flags = _SCALE_BF16 if scales.dtype == torch.bfloat16 else 0
    if qweight.dim() == 3:
        flags |= _Q_SLABS
    if bias is not None:
        flags |= _BIAS_T if bias.dtype == x.dtype else _BIAS_F32
        if not bias.is_contiguous():
            bias = bias.contiguous()
    chunks_per_group = 0 if group_size == -1 else group_size // CHUNK_K
    stream = torch.cuda.current_stream()
    for r0 in range(0, m, step):  # one launch, or slices (rows_served; any M in deterministic mode)
        rows = min(step, m - r0)
        if rows <= last:
            _launch(x2[r0 : r0 + rows], qweight, scales, qzeros, bias, target[r0 : r0 + rows], workspace,
                    rows, n, k, chunks_per_group, zero_offset, flags, dev, stream, glu, workspace_offset=sums_at)
        else:
            p = gemm.plan(rows, n, k, dev)
            ws = _workspace(workspace, p.workspace, x2.device, sums_at) if p.workspace else None
            gemm.launch(p, x2[r0 : r0 + rows], qweight, scales, qzeros, bias, target[r0 : r0 + rows], ws, n, k,
                        chunks_per_group, zero_offset, flags, dev, stream, use_pdl(dev))
    if o2 is None:
        out.copy_(target.view(out.shape))
    return result


def native_mm_swiglu(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=None, workspace=None) -> torch.Tensor:
    """The gated lowering entry (``qops.lowerings.Lowering.swiglu_entry``): :func:`native_mm` with ``glu=True``."""
    return native_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out, workspace, glu=True)


def out_view(out: torch.Tensor, m: int, n: int) -> torch.Tensor | None:
    """``out`` as an (m, n) view with unit column stride, or None when it has no such view."""
    try:
        o2 = out.view(m, n)
    except RuntimeError:
        return None
    return o2 if (n <= 1 or o2.stride(1) == 1) else None


def launch_shmem(p: Plan, glu: bool) -> int:
    """Dynamic shared memory of a launch of plan ``p``: the gated output of a single block per column
    tile pairs gate with up in shared memory after the K reduction (the cluster's buffer)."""
    table = LUT_TABLE_BYTES if p.lut else 0  # (the buffer comes after the codebook table)
    return max(p.shmem, table + _reduction_bytes(p.m, p.nwn, True)) if glu and p.splits == 1 else p.shmem


def _launch(x2, qweight, scales, qzeros, bias, o2, workspace, m, n, k, chunks_per_group, zero_offset, flags, dev, stream,
            glu: bool = False, codebook: torch.Tensor | None = None, workspace_offset: int = 0) -> None:
    """``codebook`` (fp32, 16 values; :mod:`qops.native.codebook_w4`): qweight holds codes of it, scales a
    column and 64 rows, no qzeros; the plan is the int weights' with ``lut`` (and no fold). The split partials
    go at byte ``workspace_offset`` of ``workspace``."""
    p = plan(m, n, k, dev)
    if codebook is not None and not p.lut:
        p = lut_plan(p, n, k, smem_optin_bytes(dev))
    if p.lut and codebook is None:  # the build would read the qzeros pointer (or 0) as its codebook
        raise ValueError(f"native_w4a16: the plan {p} decodes through a codebook (lut), and this call gives none")
    if p.smem_bulk:  # only measurement overrides set it: one bulk copy moves a warp's whole chunk
        needs = [why for bad, why in ((not flags & _Q_SLABS, "qweight in column slabs"), (not p.smem_ring, "a shared-memory ring"),
                                      (not _sm90(dev), "sm_90"), (scales.data_ptr() % 16, "16-byte aligned scales"),
                                      (qzeros is not None and qzeros.data_ptr() % 16, "16-byte aligned qzeros")) if bad]
        if needs:
            raise ValueError(f"native_w4a16: a plan with smem_bulk needs {', '.join(needs)} (N={n}, cuda:{dev})")
    has_z = qzeros is not None and codebook is None
    defines = p.defines(x2.dtype, has_z, glu, compiler.dynamic_shared_base(dev) if p.lut else 0)
    shmem = launch_shmem(p, glu)
    gemv = compiler.get_kernel(dev, SOURCE, defines, GEMV, arch_specific=p.wgmma)
    ldx = x2.stride(0) if m > 1 else k
    ldo = o2.stride(0) if m > 1 else o2.shape[1]
    if x2.data_ptr() % 16 == 0 and ldx % 8 == 0 and k % 8 == 0:
        flags |= _X_VEC
    gemv_flags = flags
    if m <= 8:  # at M = 16 the W4A16 rows measured 0.99-1.03x: not taken
        gemv_flags |= early_dependents_flag(gemv, dev, p.tiles * p.splits, THREADS, shmem)
    ws = _workspace(workspace, p.workspace, x2.device, workspace_offset) if p.workspace else None
    ws_ptr = ws.data_ptr() if ws is not None else 0
    i32 = compiler.i32
    pdl = use_pdl(dev)
    compiler.launch(
        gemv, (p.tiles, p.splits, 1), (THREADS, 1, 1), shmem, stream,
        qweight.data_ptr(), scales.data_ptr(), codebook.data_ptr() if codebook is not None else (qzeros.data_ptr() if has_z else 0), x2.data_ptr(),
        bias.data_ptr() if bias is not None else 0, o2.data_ptr(), ws_ptr,
        i32(m), i32(n), i32(k), i32(ldx), i32(ldo), i32(chunks_per_group), i32(zero_offset), i32(gemv_flags),
        pdl=pdl,
    )
    if p.workspace:
        reduce = compiler.get_kernel(dev, SOURCE, defines, REDUCE, arch_specific=p.wgmma)
        compiler.launch(
            reduce, (gemm.reduce_blocks(m, o2.shape[1]), 1, 1), (THREADS, 1, 1), 0, stream,
            ws_ptr, bias.data_ptr() if bias is not None else 0, o2.data_ptr(),
            i32(m), i32(n), i32(ldo), i32(p.splits), i32(flags),
            pdl=pdl,
        )


def _workspace(workspace: Optional[torch.Tensor], need: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """``need`` bytes of the caller's workspace from byte ``offset`` (a multiple of 16), uint8 (the ops have checked
    it: contiguous, on x's device, 16-byte aligned, ``ops._common.check_workspace``); fresh memory where there is
    none."""
    if workspace is not None:
        have = workspace.numel()
        if have < offset + need:
            raise ValueError(f"native_w4a16: workspace holds {have} bytes, this call needs {offset + need} "
                             "(qops.native.int_weight.workspace_bytes)")
        return workspace[offset:offset + need]
    # From torch's caching allocator; freed after the launches, reused only in stream order.
    return torch.empty(need, dtype=torch.uint8, device=device)


def _delegate(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out, workspace):
    if x.dtype not in _DT:
        from ..ops.int_weight import reference_mm

        return reference_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=out, workspace=workspace)
    tri = _triton_module()
    return tri.triton_mm(x, qweight, scales, qzeros, act_perm, bias, bits, group_size, zero_offset, out=out, workspace=workspace)


def serves(n: int, k: int, bits: int, group_size: int, act_dtype: torch.dtype, scales_dtype: torch.dtype) -> bool:
    return bits == 4 and (group_size == -1 or group_size % CHUNK_K == 0) and n % 4 == 0 and act_dtype in _DT and scales_dtype in _DT


def warmup_shape(device: torch.device | int, act_dtype: torch.dtype, n: int, k: int, has_zeros: bool, max_m: int = gemm.MAX_M, *,
                 deterministic: bool | None = None, glu: bool = False) -> int:
    """Compile and load every kernel M = 1..max_m needs for an (N, K) weight (``glu``: its gated
    output, see :func:`native_mm`); returns how many.

    Each kernel is launched once with no work, so the driver makes its code resident now and
    not during a later CUDA-graph capture. Reads the deterministic switch (or takes ``deterministic``).
    """
    global _deterministic
    _deterministic = read_deterministic() if deterministic is None else bool(deterministic)
    dev = device if isinstance(device, int) else (device.index if device.index is not None else torch.cuda.current_device())
    if torch.cuda.is_current_stream_capturing():
        raise compiler.NativeNotReadyError("qops.native.int_weight.warmup must run before CUDA-graph capture, not during it")
    seen = set()
    pdl = use_pdl(dev)  # the launch path the calls will take, exercised before any capture
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream()
        last = decode_rows(n, k, dev)
        for m in range(1, min(max_m, last) + 1):
            p = plan(m, n, k, dev)
            defines = p.defines(act_dtype, has_zeros, glu)
            shmem = launch_shmem(p, glu)
            key = (p.splits, p.cluster, shmem, tuple(sorted(defines.items())))
            if key in seen:
                continue
            seen.add(key)
            gemv = compiler.get_kernel(dev, SOURCE, defines, GEMV, arch_specific=p.wgmma)
            if shmem > SHMEM_MAX_BYTES:  # the opt-in, made now rather than at a first launch inside a capture
                compiler.allow_dynamic_shared(gemv, dev, shmem)
            compiler.max_active_blocks(gemv, dev, THREADS, shmem)  # the early-release check's occupancy query, cached now
            i0 = compiler.i32(0)
            compiler.launch(gemv, (1, p.splits, 1), (THREADS, 1, 1), 0, stream, 0, 0, 0, 0, 0, 0, 0, *([i0] * 8), pdl=pdl)
            if p.workspace:
                reduce = compiler.get_kernel(dev, SOURCE, defines, REDUCE, arch_specific=p.wgmma)
                compiler.launch(reduce, (1, 1, 1), (THREADS, 1, 1), 0, stream, 0, 0, 0, *([i0] * 5), pdl=pdl)
        if max_m > last and k % 8 == 0:  # the GEMM's rows (gated calls there run it unfused, then silu_mul)
            return len(seen) + gemm.warmup(dev, act_dtype, n, k, has_zeros, last + 1, max_m, stream, pdl)
    return len(seen)


def warmup(weight, act_dtype: torch.dtype | None = None, max_m: int = gemm.MAX_M, *, deterministic: bool | None = None,
           glu: bool = False) -> int:
    """:func:`warmup_shape` for a prepared weight (``qops.IntWeight``); no-op when this kernel does not serve it.

    ``act_dtype`` defaults to the activation dtype the weight was prepared for (``weight.act_dtype``;
    a GPTQ checkpoint's fp16 scales prepared for bf16 calls need the bf16 builds), else the scales'
    dtype. Call after preparing weights and before capturing CUDA graphs.
    """
    act_dtype = act_dtype or weight.act_dtype or weight.scales.dtype
    if weight.qweight.device.type != "cuda" or not serves(weight.out_features, weight.in_features, weight.bits, weight.group_size, act_dtype, weight.scales.dtype):
        return 0
    return warmup_shape(weight.qweight.device, act_dtype, weight.out_features, weight.in_features, weight.qzeros is not None, max_m,
                        deterministic=deterministic, glu=glu)


def warmup_swiglu(weight, act_dtype: torch.dtype | None = None, max_m: int = gemm.MAX_M, *, deterministic: bool | None = None) -> int:
    """:func:`warmup` of the gated kernels (:func:`native_mm_swiglu`) for a fused gate/up weight."""
    return warmup(weight, act_dtype, max_m, deterministic=deterministic, glu=True)
