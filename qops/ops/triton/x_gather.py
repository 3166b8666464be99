"""x's columns gathered once a call, for the int-weight kernels that read x in an order other than its own:
the wgmma kernel's K order (the MMA's, with the act-order permutation folded in) and the Triton GEMM's act-order
``x[:, act_perm]``. Each call's gather writes into the caller's workspace, so a graph replays it without an
allocation.

Two routes (:func:`transposes`):

- **direct** (:func:`_gather_kernel`): a program copies ``GATHER_BLOCK`` columns of one row,
  ``xg[m, q] = x[m, src(q)]``. Without act-order ``src`` stays inside each 32-column block, so a warp's loads
  share their 32-byte sectors. Through an act-order permutation the columns are scattered over the row and each
  2-byte value costs a whole sector: at M = 64 on an H100 the wgmma call of 8192x28672 took 93.4 us against 81.5
  without act-order, and 4096x14336 4.3 us more (``h100-2026-12-07-721d288-probe-actorder.log``).
- **transposed** (act-order calls of at least :data:`TRANSPOSED_FROM_MK` values, M x K): x is first copied transposed,
  ``xt[k, m] = x[m, k]`` (a tile a program, both sides coalesced), then the gather reads whole rows of ``xt``:
  ``xg[m, q] = xt[src(q), m]``, M values side by side (a full sector from 16 fp16 rows). One launch more, and
  ``M * K`` elements of scratch more (:func:`gather_scratch`).

What the routes cost on an H100 (W4 g128, an act-order weight with each route forced, against the same shape
without act-order; ``probe_wgmma_w4 --act-order``, each row checked against float64), us, plain / direct / transposed.
The Triton lowering (the Triton GEMM's gather or the wgmma kernel's, as the H100 table routes each call;
``h100-2026-12-07-565aae4-actorder*`` and ``-faa855a-call80a-actorder*.json``): 4096x14336 M = 16 20.41 / 23.44 / 24.79, M = 32 25.07 / 29.38 / 29.83, M = 64
27.32 / 31.36 / 29.36; 8192x28672 M = 16 52.45 / 54.57 / 53.93, M = 64 85.65 / 99.11 / 90.97. The native lowering
(``h100-2026-12-07-a7e513d-call81a-native-actorder.json``): 4096x14336 M = 32 20.87 / 25.91 / 26.26, M = 64 25.33 /
31.94 / 31.30; 28672x4096 M = 32 33.65 / 37.17 / 38.89, M = 64 38.63 / 43.29 / 45.20. The direct route's cost grows
with M x K (each value its own sector), the transposed route's is a second launch and coalesced traffic: direct wins
up to 262144 values (28672x4096 M = 64, by 1.9 us), they tie at 458752 (4096x14336 M = 32: direct by 0.35-0.45 us;
8192x28672 M = 16: transposed by 0.64), transposed wins from 917504 (by 0.6-8 us). The switch is 2^19. Under it, on
another H100 (``h100-2026-12-07-b47f900-call81c-*-actorder.json``), 28672x4096 again took the direct route faster
through the native lowering (M = 32 37.80 / 39.52, M = 64 43.80 / 45.64) and through the Triton lowering at M = 64
(43.32 / 44.19), but not at M = 32 (38.43 / 36.82, where the shipped call, the direct route, took 37.24): about 1 us of
noise between replays of the same launches.

Either gather also zeroes the 32-bit words a later launch adds or counts into (a split's fp32 sum, the stream-K
counts), spread over its programs, and may start the next launch early as its programmatic (PDL) primary.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import scratch_aligned, workspace_view

# x columns one program of the direct route moves
GATHER_BLOCK = 1024
# act-order calls of at least this many values of x (M x K) take the transposed route (measured on an H100: see the
# module docstring)
TRANSPOSED_FROM_MK = 1 << 19
# the transposed route's tiles: (rows, columns) of x a transposing program copies; K positions a gathering
# program writes (for every row of its row block, at most TRANSPOSED_ROWS)
TRANSPOSE_TILE = (64, 64)
TRANSPOSED_Q = 64
TRANSPOSED_ROWS = 64


def transposes(m: int, k: int, act_order: bool) -> bool:
    """Whether a gather of an ``(m, k)`` x takes the transposed route (see the module docstring)."""
    return act_order and m * k >= TRANSPOSED_FROM_MK


def gather_scratch(m: int, k: int, itemsize: int, act_order: bool) -> tuple[int, int]:
    """Scratch bytes of a gather of ``(m, k)`` x (``itemsize`` bytes a value), each ``common.scratch_aligned``: x
    gathered, and x transposed on the way (0 on the direct route, :func:`transposes`)."""
    xg = scratch_aligned(m * k * itemsize)
    return xg, xg if transposes(m, k, act_order) else 0


@triton.jit
def _mma_k_order(q):
    """The weight row the wgmma kernel's K position ``q`` multiplies (``int_weight_wgmma._order_of``)."""
    r = q % 32
    return (q // 32) * 32 + ((r // 2) % 4) * 8 + (r // 16) * 2 + (r // 8) % 2 + (r % 2) * 4


@triton.jit
def _source(q, inside, perm_ptr, HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr):
    """The column of x that K position ``q`` of the gathered x holds."""
    src = q
    if MMA_ORDER:
        src = _mma_k_order(q)
    if HAS_PERM:
        src = tl.load(perm_ptr + src, mask=inside, other=0)
    return src


@triton.jit
def _zero_share(zero_ptr, zero_words, zero_chunk, program, BLOCK: tl.constexpr):
    """Zero this ``program``'s ``zero_chunk`` words of the ``zero_words`` at ``zero_ptr`` (in program order)."""
    lo = program * zero_chunk
    hi = tl.minimum(lo + zero_chunk, zero_words)
    for c0 in range(0, zero_chunk, BLOCK):
        c = lo + c0 + tl.arange(0, BLOCK)
        tl.store(zero_ptr + c, tl.zeros([BLOCK], tl.int32), mask=c < hi)


@triton.jit
def _gather_kernel(x_ptr, perm_ptr, xg_ptr, zero_ptr, K, zero_words, zero_chunk, stride_xm, stride_xk, stride_gm,
                   BLOCK: tl.constexpr, HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr, PDL: tl.constexpr,
                   DEPENDENT: tl.constexpr = False):
    """The direct route: ``xg[m, q] = x[m, src(q)]`` for row ``m`` = program 0 (M on the grid's unbounded axis) and
    ``BLOCK`` columns (:func:`_source`); the programs also zero ``zero_words`` words, ``zero_chunk`` a program.
    PDL: the next launch may be placed as soon as every program here has started (it waits for this grid before
    reading what it writes). DEPENDENT (launched as the programmatic dependent of the launch ahead, whatever it is):
    first wait for that grid (x may be its output, the zeroed words its input), and only then let the next launch
    be placed, so that nothing after this grid starts before the grid ahead has finished."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = q < K
    src = _source(q, inside, perm_ptr, HAS_PERM, MMA_ORDER)
    tl.store(xg_ptr + m * stride_gm + q, tl.load(x_ptr + m * stride_xm + src * stride_xk, mask=inside), mask=inside)
    _zero_share(zero_ptr, zero_words, zero_chunk, m * tl.num_programs(1) + tl.program_id(1), BLOCK)


@triton.jit
def _transpose_kernel(x_ptr, xt_ptr, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr, DEPENDENT: tl.constexpr = False):
    """``xt[k, m] = x[m, k]`` (``xt`` contiguous ``(K, M)``) for a ``BLOCK_M x BLOCK_K`` tile (K tiles on the
    grid's first axis). Triton gives the load and the store each a coalesced layout and converts between them
    through shared memory. PDL: the gather after it is its programmatic dependent. DEPENDENT: as
    :func:`_gather_kernel`'s (the gather after it zeroes words before its own wait, so it must not be placed
    before the grid ahead of this one has finished)."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = (rm[:, None] < M) & (rk[None, :] < K)
    v = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :].to(tl.int64) * stride_xk, mask=inside)
    tl.store(xt_ptr + rk[None, :].to(tl.int64) * M + rm[:, None], v, mask=inside)


@triton.jit
def _gather_rows_kernel(xt_ptr, perm_ptr, xg_ptr, zero_ptr, M, K, zero_words, zero_chunk, stride_gm,
                        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_BLOCK: tl.constexpr,
                        MMA_ORDER: tl.constexpr, PDL: tl.constexpr):
    """The transposed route's gather: ``xg[m, q] = xt[src(q), m]`` for ``BLOCK_Q`` K positions (the grid's first
    axis) and ``BLOCK_M`` rows; each source row of ``xt`` is read whole. The zeroing first: it does not depend on
    the transpose, so with PDL (this grid the transpose's programmatic dependent, and primary of the next launch)
    it overlaps the transpose, and only the reads of ``xt`` wait for it."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _zero_share(zero_ptr, zero_words, zero_chunk, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0),
                ZERO_BLOCK)
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = q < K
    src = _source(q, inside, perm_ptr, True, MMA_ORDER).to(tl.int64)
    both = inside[:, None] & (rm[None, :] < M)
    if PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(xt_ptr + src[:, None] * M + rm[None, :], mask=both)
    tl.store(xg_ptr + rm[None, :].to(tl.int64) * stride_gm + q[:, None], v, mask=both)


def gather_x(x2: torch.Tensor, act_perm: torch.Tensor | None, xg: torch.Tensor, zeroed: torch.Tensor | None = None,
             pdl: bool = False, mma_order: bool = True, xt: torch.Tensor | None = None, dependent: bool = False) -> None:
    """``xg = x2[:, idx]``, ``idx`` the wgmma kernel's K order through ``act_perm`` (``mma_order``; else
    ``act_perm`` itself), zeroing the contiguous 32-bit ``zeroed`` (int32 counts or an fp32 sum) in the same
    launch. ``xt`` (``M * K`` elements of x's dtype, contiguous; where :func:`transposes`): scratch for the
    transposed route. ``pdl``: the next launch may be the gather's programmatic dependent. ``dependent`` (with
    ``pdl``): the gather's first launch is itself the programmatic dependent of the launch ahead on the stream, its
    programs placed while that one runs (its launch latency hidden); they wait for it before touching memory."""
    dependent = dependent and pdl
    m, k = x2.shape
    if not mma_order and act_perm is None:
        raise ValueError("gather_x: nothing to gather (no act_perm and no MMA order)")
    words = 0 if zeroed is None else zeroed.numel()
    zero_ptr = xg if zeroed is None else zeroed.view(torch.int32)
    if xt is None:
        grid = (m, triton.cdiv(k, GATHER_BLOCK))
        _gather_kernel[grid](
            x2, x2 if act_perm is None else act_perm, xg, zero_ptr, k, words, -(-words // (grid[0] * grid[1])),
            x2.stride(0), x2.stride(1), xg.stride(0), BLOCK=GATHER_BLOCK, HAS_PERM=act_perm is not None,
            MMA_ORDER=mma_order, PDL=pdl, DEPENDENT=dependent, num_warps=4, **({"launch_pdl": True} if dependent else {}))
        return
    if act_perm is None:
        raise ValueError("gather_x: the transposed route (xt) is for an act-order gather; act_perm is None")
    if xt.numel() < m * k or xt.dtype != x2.dtype or not xt.is_contiguous():
        raise ValueError(f"gather_x: xt must be contiguous {x2.dtype} of >= {m * k} elements, got "
                         f"{xt.dtype} {tuple(xt.shape)}")
    tm, tk = TRANSPOSE_TILE
    _transpose_kernel[(triton.cdiv(k, tk), triton.cdiv(m, tm))](
        x2, xt, m, k, x2.stride(0), x2.stride(1), BLOCK_M=tm, BLOCK_K=tk, PDL=pdl, DEPENDENT=dependent, num_warps=4,
        **({"launch_pdl": True} if dependent else {}))
    rows = min(TRANSPOSED_ROWS, triton.next_power_of_2(m))
    grid = (triton.cdiv(k, TRANSPOSED_Q), triton.cdiv(m, rows))
    _gather_rows_kernel[grid](
        xt, act_perm, xg, zero_ptr, m, k, words, -(-words // (grid[0] * grid[1])), xg.stride(0),
        BLOCK_Q=TRANSPOSED_Q, BLOCK_M=rows, ZERO_BLOCK=1024, MMA_ORDER=mma_order, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))


def gather_act_order(x2: torch.Tensor, act_perm: torch.Tensor, workspace: torch.Tensor | None,
                     pdl: bool = False) -> tuple[torch.Tensor, int]:
    """``x2[:, act_perm]`` (contiguous) gathered into the start of ``workspace`` (fresh memory where it has no room:
    ``common.workspace_view``), by whichever route :func:`transposes` takes, and the bytes its parts hold there
    (:func:`gather_scratch`): where the caller's own scratch begins. ``pdl``: the gather is a link of a PDL chain,
    the dependent of the launch ahead and the primary of the next (:func:`gather_x`'s ``pdl`` and ``dependent``)."""
    m, k = x2.shape
    gathered, transposed = gather_scratch(m, k, x2.dtype.itemsize, True)
    xg = workspace_view(workspace, (m, k), x2.dtype, x2.device)
    xt = workspace_view(workspace, (m * k,), x2.dtype, x2.device, offset=gathered) if transposed else None
    gather_x(x2, act_perm, xg, pdl=pdl, mma_order=False, xt=xt, dependent=pdl)
    return xg, gathered + transposed
