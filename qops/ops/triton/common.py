"""Pieces the Triton lowerings of this package share, each written once.

In-kernel helpers (``@triton.jit``, inlined into the calling kernel, so they cost nothing at run time):

- :func:`grouped_tile`: the grouped ("GROUP_M swizzle") order of 2-D output tiles behind a 1-D program
  id, so that ``GROUP_M`` row tiles share each weight column tile while it sits in L2.
- :func:`store_row` / :func:`store_tile`: the split-K epilogue of one output row / one output tile: with
  ``ATOMIC`` the fp32 partial sum is added into a zeroed fp32 ``(M, N)`` buffer with relaxed atomics (the bias
  is left to whoever casts the buffer; ``ZERO_WAIT``: after waiting for the buffer's zeroing,
  :func:`split_sum`), else the bias is added and the output dtype written. The W4A16 kernels of ``int_weight``
  keep their own epilogue: it has a third mode (fp32 partials per split) and loads the bias before forming the
  output pointers, an order that ptxas schedules differently, so sharing one helper would change the SASS of
  one family or the other.

Integer -> half conversion without a conversion instruction (:func:`half_pair_lanes`,
:func:`half_unpack_asm`): a 2-, 4- or 8-bit value OR-ed into the mantissa of the fp16 1024.0 (bf16
128.0), whose unit in the last place is 1, reads as ``1024 + q`` (``128 + q``). A word of packed
values is converted two K-adjacent values at a time, straight into the f16x2 / bf16x2 register the
tensor-core operand is built from: a byte permute puts the two values' bytes into the two halves,
one LOP3 (mask, OR magic) makes the pair, one packed FMA removes the magic and the zero point. A
value left at offset ``s`` inside its byte reads as ``magic + q * 2**s`` and the FMA multiplies by
``2**-s``; one too high for the mantissa is read from the word shifted down by ``bits``. Every
intermediate is an integer (or that times a power of two) well inside the format's range, so the
result ``q - z`` is exact (``|q - z| <= 256``: 8 significant bits, which bf16 has). The PTX form
needs a GPU; under Triton's CPU interpreter the same lanes are computed with plain Triton operations
(:func:`interpreting` tells which). A pair whose two values sit 16 bits apart in the word (values ``i`` and
``i + 16 / bits``: what the wgmma kernel's K order pairs) needs no byte permute: one LOP3 masks both halves of
the word (or of the word shifted down) in place.

Host helpers: SM count, M buckets of a config table, split-K sizing, fp32 scratch carved from the
caller's workspace (and :func:`zero_ahead`, its zeroing as a PDL primary), the split-K chain of the int8 and
fp8 kernels (:func:`split_sum`: the sum zeroed ahead of a kernel that is its programmatic dependent;
:func:`reduce_sums`: the one reduction, + bias, cast, as a dependent of the kernel; int_weight's partials use
it too), and the int8/blockwise4 config table and 2-D views. The blockwise4 kernels keep ``zero_()`` and
:func:`finish`: chained the same way, NF4 at M = 1 ran 3.5-5% slower on the three largest shapes of an H100.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .._common import deterministic_requested, pdl_launch

@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in grouped order: ``GROUP_M`` row tiles per column sweep."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    return pid_m, pid_n


@triton.jit
def store_row(y_ptr, bias_ptr, acc, row, offs_n, nmask, stride_ym, stride_yn, HAS_BIAS: tl.constexpr,
              ATOMIC: tl.constexpr, ZERO_WAIT: tl.constexpr = False):
    """Write ``acc`` (``(BLOCK_N,)`` fp32) as output row ``row``. ZERO_WAIT (ATOMIC, the kernel launched as the
    programmatic dependent of the sum's zeroing, :func:`split_sum`): the adds wait for that grid."""
    y_ptrs = y_ptr + row * stride_ym + offs_n * stride_yn
    if ATOMIC:
        if ZERO_WAIT:
            tl.extra.cuda.gdc_wait()
        tl.atomic_add(y_ptrs, acc, mask=nmask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def store_tile(y_ptr, bias_ptr, acc, offs_m, offs_n, mmask, nmask, stride_ym, stride_yn,
               HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, ZERO_WAIT: tl.constexpr = False):
    """Write ``acc`` (``(BLOCK_M, BLOCK_N)`` fp32) as the output tile at rows ``offs_m``, columns ``offs_n``
    (ZERO_WAIT as :func:`store_row`'s)."""
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    ymask = mmask[:, None] & nmask[None, :]
    if ATOMIC:
        if ZERO_WAIT:
            tl.extra.cuda.gdc_wait()
        tl.atomic_add(y_ptrs, acc, mask=ymask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


# Mantissa bits, the bit pattern of the magic (a power of two with ulp 1) and its value, per half type.
HALF_FORMATS = {"f16": (10, 0x6400, 1024.0), "bf16": (7, 0x4300, 128.0)}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), which cannot run
    inline PTX."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The 4-bit values of a word in the order of the even / odd K split (``half_unpack_asm``'s ``order``):
# the even-numbered values first, then the odd, so each half fills one K tile of half the height.
EVEN_ODD_4 = (0, 2, 4, 6, 1, 3, 5, 7)


def half_pair_lanes(bits: int, half: str, order=None) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """How pair ``i`` (values ``order[2i]`` and ``order[2i + 1]`` of a 32-bit word of ``bits``-bit
    values, default the word's order, in the
    low and high half of one f16x2 / bf16x2 register) is found: for each half ``(shift, byte, s)``,
    the value sits at bit ``s`` of byte ``byte`` of ``word >> shift``. A value whose in-place offset
    leaves no room under the mantissa is read from the word shifted down by ``bits``. A pair 16 bits
    apart has ``byte`` None: its values sit at bit ``s`` of the two halves of ``word >> shift`` (no byte
    permute; ``shift`` a multiple of ``bits``, as small as the mantissa allows). Raises when the
    half type cannot hold a value at all (8-bit in bf16: ``128 + q`` needs 9 significant bits)."""
    mant = HALF_FORMATS[half][0]
    if 32 % bits or 8 % bits or bits > mant:
        raise ValueError(f"no {half} pair unpack for {bits}-bit values")

    def where(pos):
        shift, s = 0, pos % 8
        if s + bits > mant:
            shift, s = bits, s - bits
        return shift, (pos - shift) // 8, s

    def in_place(pos):  # a pair 16 bits apart: both values at bit s of their half of word >> shift
        s = pos % 8
        while s + bits > mant:
            s -= bits
        return pos - s, None, s

    order = tuple(range(32 // bits)) if order is None else tuple(order)
    if sorted(order) != list(range(32 // bits)):
        raise ValueError(f"order {order} is not a permutation of the {32 // bits} values of a word")
    lanes = []
    for i in range(16 // bits):
        lo, hi = order[2 * i] * bits, order[2 * i + 1] * bits
        if bits < 8 and hi == lo + 16:
            lanes.append((in_place(lo), in_place(lo)))
        else:
            lanes.append((where(lo), where(hi)))
    return lanes


def half_offsets(bits: int, half: str, order=None) -> list[tuple[int, int]]:
    """The distinct ``(s_lo, s_hi)`` of :func:`half_pair_lanes`: one packed bias operand each."""
    return sorted({(lo[2], hi[2]) for lo, hi in half_pair_lanes(bits, half, order)})


def half_unpack_asm(bits: int, half: str, order=None, scaled: bool = False) -> tuple[str, str]:
    """(PTX, constraints) turning one word into its ``32 // bits`` values ``q - z`` as ``half``
    (``s * (q - z)`` when ``scaled``: one packed multiply a pair by the last operand, ``(s, s)``).

    Operands: outputs ``$0 .. $(vpw - 1)`` (16-bit, in ``order``, default the word's: outputs ``2i,
    2i + 1`` are the halves of one register, K-adjacent as the tensor-core operand wants them), the word, then one
    packed bias ``(-(magic * 2**-s_lo + z), -(magic * 2**-s_hi + z))`` per entry of
    :func:`half_offsets`. Per pair: a PRMT moves the two values' bytes into the two halves, a LOP3
    keeps their bits and ORs the magic, a packed FMA scales by ``2**-s`` and adds the bias; 8-bit
    values need no LOP3 (the PRMT fills the magic's byte), a pair 16 bits apart no PRMT (its LOP3 reads
    the word, or the word shifted down once for all such pairs of that shift).
    """
    mant, magic, _ = HALF_FORMATS[half]
    lanes = half_pair_lanes(bits, half, order)
    offsets = half_offsets(bits, half, order)
    vpw = 32 // bits
    word = f"${vpw}"
    fma = "fma.rn.f16x2" if half == "f16" else "fma.rn.bf16x2"
    mul = "mul.rn.f16x2" if half == "f16" else "mul.rn.bf16x2"
    one = 0x3C00 if half == "f16" else 0x3F80

    def pow2(s):  # 2**-s in the half format (exponent field moved down by s)
        return one - (s << mant)

    permuted = [(lo, hi) for lo, hi in lanes if lo[1] is not None]
    shifts = sorted({lo[0] for lo, hi in lanes if lo[1] is None} - {0})  # the in-place pairs' shifted words
    regs = f".reg .b32 q<{len(lanes)}>, b<{len(lanes)}>, w1, m, c<{len(offsets)}>"
    body = ["{", regs + (f", s<{len(shifts)}>;" if shifts else ";")]
    for j, (slo, shi) in enumerate(offsets):
        body.append(f"mov.b32 c{j}, 0x{(pow2(shi) << 16) | pow2(slo):08x};")
    if any(lo[0] or hi[0] for lo, hi in permuted):
        body.append(f"shr.b32 w1, {word}, {bits};")
    elif permuted:
        body.append(f"mov.b32 w1, {word};")
    for j, shift in enumerate(shifts):
        body.append(f"shr.b32 s{j}, {word}, {shift};")
    if bits == 8:
        body.append(f"mov.b32 m, 0x{magic >> 8:02x}{magic >> 8:02x}{magic >> 8:02x}{magic >> 8:02x};")
    done = {}
    for i, (lo, hi) in enumerate(lanes):
        # PRMT selector: result bytes 0, 1 from the low value's byte, 2, 3 from the high one's
        # (index 4..7: the second source, w1 or the magic bytes).
        if lo[1] is None:  # in place: the LOP3 reads the (shifted) word itself
            src = word if lo[0] == 0 else f"s{shifts.index(lo[0])}"
        elif bits == 8:
            sel = lo[1] | (4 << 4) | (hi[1] << 8) | (4 << 12)
            src2 = "m"
        else:
            blo = lo[1] + (4 if lo[0] else 0)
            bhi = hi[1] + (4 if hi[0] else 0)
            sel = blo | (blo << 4) | (bhi << 8) | (bhi << 12)
            src2 = "w1"
        if lo[1] is not None:
            if sel not in done:
                done[sel] = f"b{len(done)}"
                body.append(f"prmt.b32 {done[sel]}, {word}, {src2}, 0x{sel:04x};")
            src = done[sel]
        j = offsets.index((lo[2], hi[2]))
        if bits == 8:
            body.append(f"{fma} q{i}, {src}, c{j}, ${vpw + 1 + j};")
        else:
            val = (1 << bits) - 1
            mask = (val << lo[2]) | (val << (16 + hi[2]))
            # lop3 0xea: (a & b) | c.
            body.append(f"lop3.b32 q{i}, {src}, 0x{mask:08x}, 0x{magic | (magic << 16):08x}, 0xea;")
            body.append(f"{fma} q{i}, q{i}, c{j}, ${vpw + 1 + j};")
        if scaled:
            body.append(f"{mul} q{i}, q{i}, ${vpw + 1 + len(offsets)};")
        body.append(f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, q{i};")
    body.append("}")
    constraints = ",".join(["=h"] * vpw + ["r"] * (1 + len(offsets) + scaled))
    return "\n".join(body), constraints


# fp16 constants of the packed dot: 2**-4 and 2**-8 in both halves.
_F16_POW2_M4 = 0x2C002C00
_F16_POW2_M8 = 0x1C001C00


def half_dot_asm(carry_in: bool = False, finish: bool = True) -> tuple[str, str]:
    """(PTX, constraints) of the GEMV's packed dot of one word of eight 4-bit values with one row of
    x, in fp16: ``sum_i x_i * (q_i - z) / 16``.

    Operands: ``$0`` the output; ``$1`` the word; ``$2`` / ``$3`` the bias pairs ``-(64 + z / 16)`` and
    ``-(4 + z / 16)`` (both halves alike); ``$4`` an f16x2 carry (read only with ``carry_in``); ``$5 ..
    $12`` x's values as the halves of the four f16x2 pairs ``(x0, x4), (x1, x5), (x2, x6), (x3, x7)``
    (:data:`X_PAIRS_ASM`; each pair two halves of one register, which ptxas joins without an
    instruction). Why those pairs: one LOP3 of the word with ``0x000f000f`` puts values 0 and 4 into
    the two halves at bit 0 (no byte permute), ``0x00f000f0`` values 1 and 5 at bit 4; the word
    shifted down a byte gives 2 / 6 and 3 / 7. The packed FMA scales ``1024 + q`` by ``2**-4``
    (``1024 + 16 q`` by ``2**-8``) and adds the bias: ``(q - z) / 16`` exactly (5 significant bits), so
    each product has the magnitude of x. One HMUL2 (an HFMA2 onto the carry with ``carry_in``) and
    three HFMA2 sum four products in each half, one fp16 rounding each. With ``finish`` the two halves
    are added in fp32 (an f32 output); without, the f16x2 sums are the output, the carry of the next
    word's call (``half_dot`` 2: eight products a half). The caller multiplies the scale by 16. A
    half's sum over ``w`` words is at most ``4 w |x|`` (``|q - z| <= 16``): no fp16 overflow below
    ``|x| = 16384 / w``. Rows of x are separate calls: ptxas computes the word's pairs once for all of
    them (4-bit M = 4 on sm_90: 260 LOP3 a pass either way). Per word and row: 5 + 4 instructions for
    the pairs, 4 for the sums, 3 to finish (the fp32 loop took 24).
    """
    body = ["{", ".reg .b32 w1, a<4>, d, c4, c8, m, x<4>;", ".reg .f16 l, h;", ".reg .f32 fl, fh;",
            f"mov.b32 c4, 0x{_F16_POW2_M4:08x};", f"mov.b32 c8, 0x{_F16_POW2_M8:08x};",
            f"mov.b32 m, 0x{0x6400 | (0x6400 << 16):08x};",
            "lop3.b32 a0, $1, 0x000f000f, m, 0xea;",
            "lop3.b32 a1, $1, 0x00f000f0, m, 0xea;",
            "shr.b32 w1, $1, 8;",
            "lop3.b32 a2, w1, 0x000f000f, m, 0xea;",
            "lop3.b32 a3, w1, 0x00f000f0, m, 0xea;",
            "fma.rn.f16x2 a0, a0, c4, $2;",
            "fma.rn.f16x2 a1, a1, c8, $3;",
            "fma.rn.f16x2 a2, a2, c4, $2;",
            "fma.rn.f16x2 a3, a3, c8, $3;"]
    body += [f"mov.b32 x{i}, {{${5 + 2 * i}, ${6 + 2 * i}}};" for i in range(4)]
    body += ["fma.rn.f16x2 d, a0, x0, $4;" if carry_in else "mul.rn.f16x2 d, a0, x0;",
             "fma.rn.f16x2 d, a1, x1, d;",
             "fma.rn.f16x2 d, a2, x2, d;",
             "fma.rn.f16x2 d, a3, x3, d;"]
    if finish:
        body += ["mov.b32 {l, h}, d;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", "add.f32 $0, fl, fh;"]
    else:
        body.append("mov.b32 $0, d;")
    body.append("}")
    return "\n".join(body), ",".join(["=f" if finish else "=r"] + ["r"] * 4 + ["h"] * 8)


# The f16x2 x pairs of :func:`half_dot_asm` from a word's eight x values, run with ``pack=8``: the inputs
# ``$4 .. $7`` hold x0 x1 / x2 x3 / x4 x5 / x6 x7, the outputs x0 x4 / x1 x5 / x2 x6 / x3 x7 (a PRMT each).
X_PAIRS_ASM = ("prmt.b32 $0, $4, $6, 0x5410;\nprmt.b32 $1, $4, $6, 0x7632;\n"
               "prmt.b32 $2, $5, $7, 0x5410;\nprmt.b32 $3, $5, $7, 0x7632;")
X_PAIRS_CONSTRAINTS = "=r,=r,=r,=r,r,r,r,r"


@functools.cache
def sm_count(device: torch.device, interpreter: int) -> int:
    """SMs of a CUDA device (looked up once); ``interpreter`` for Triton's CPU interpreter in tests,
    where it only shapes the grid."""
    if device.type != "cuda":
        return interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_bucket(buckets: Sequence[tuple], m: int) -> tuple:
    """The first ``(m_max, ...)`` entry with ``m <= m_max`` (``m_max`` None: unbounded), else the last.

    ``buckets`` is ordered by ``m_max``: configs are keyed by bucketed M, so CUDA graphs and
    torch.compile see a bounded set of launch configurations.
    """
    for entry in buckets:
        if entry[0] is None or m <= entry[0]:
            return entry
    return buckets[-1]


def pow2_at_most(v: int, cap: int, floor: int = 16) -> int:
    """The power of two >= ``v`` (and >= ``floor``), but at most ``cap``: a tile for a small dimension."""
    return max(floor, min(cap, triton.next_power_of_2(max(v, 1))))


def split_k(k: int, unit: int, tiles: int, want: int, max_split: int) -> tuple[int, int]:
    """(split count, K length per split, a multiple of ``unit``) so that ``tiles * split >= want``
    programs when K allows, with at most ``max_split`` splits (one when deterministic results are
    requested: the splits meet through atomic adds, whose order varies). K = 0 gives one empty split."""
    if deterministic_requested():
        max_split = 1
    steps = max(1, triton.cdiv(k, unit))
    split = 1
    if tiles < want:
        split = max(1, min(triton.cdiv(want, tiles), max_split, steps))
    per = triton.cdiv(steps, split) * unit
    return triton.cdiv(k, per), per


@functools.lru_cache(maxsize=4096)
def split_in_waves(k: int, unit: int, tiles: int, split: int, slots: int) -> tuple[int, int]:
    """A split count from :func:`split_k` lowered where its grid would end in a partial wave, and its K
    length per split. ``slots`` is how many programs of the kernel build the GPU holds at once. Among
    the split counts up to ``split``, the one with the fewest rounds of a program's work (waves x K
    steps a program) wins, the smaller on a tie (fewer partial sums to add). split_k asks for at
    least a number of programs; a few programs past what the SMs hold run as a second wave as long as
    the first (the W4 GEMV on 57344x8192 at M = 1 on an H100: 224 tiles x 5 splits = 1120 programs,
    1056 resident, 127.8 us; 4 splits, 108.1 us)."""
    steps = max(1, triton.cdiv(k, unit))
    best = None
    for s in range(1, max(1, split) + 1):
        per_steps = triton.cdiv(steps, s)
        real = triton.cdiv(steps, per_steps)
        cost = triton.cdiv(tiles * real, max(1, slots)) * per_steps
        if best is None or cost < best[0]:
            best = (cost, real, per_steps * unit)
    return best[1], best[2]


def stream_k_runs(k: int, unit: int, tiles: int, slots: int) -> tuple[int, int]:
    """(programs, K length a program covers) of a stream-K launch: the ``tiles`` output tiles' K steps of
    ``unit`` rows laid end to end (tile by tile), cut into equal runs, at most ``slots`` of them (one wave of
    the programs the GPU holds at once). Each run is ``ceil(total / slots)`` steps, the last one shorter.
    Against a split count, whose grid fills whole waves only for some tile counts, every program does the
    same work: 224 tiles of 32 steps on 396 slots take 19 steps a program, where 3 splits of 11 steps
    take two waves (22)."""
    total = tiles * max(1, triton.cdiv(k, unit))
    per = triton.cdiv(total, max(1, slots))
    return triton.cdiv(total, per), per * unit


def resident_programs(n_regs: int, shared: int, num_warps: int, props) -> int | None:
    """Programs of one kernel build an SM holds at once, from its registers a thread, its shared memory
    and warps, and the device's properties (``torch.cuda.get_device_properties``); None where those
    lack a figure. Registers go to a warp in 256s and to each of the SM's four schedulers' quarter of
    the file; a program's shared memory comes with 1 KiB the system reserves; 32 programs an SM at most."""
    regs = getattr(props, "regs_per_multiprocessor", None)
    threads = getattr(props, "max_threads_per_multi_processor", None)
    smem = getattr(props, "shared_memory_per_multiprocessor", None)
    if not (regs and threads and smem and num_warps > 0):
        return None
    per_warp = max(256, -(-n_regs * 32 // 256) * 256)
    by_regs = 4 * ((regs // 4) // per_warp) // num_warps
    by_threads = threads // (32 * num_warps)
    by_smem = smem // (shared + 1024)
    return max(0, min(32, by_regs, by_threads, by_smem))


@triton.jit
def _zero_kernel(y_ptr, numel, BLOCK: tl.constexpr):
    """Zeros ``numel`` fp32 values, starting its dependent launch at once (:func:`zero_ahead`)."""
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < numel)


# fp32 values one zeroing program writes: 16 a thread at 4 warps (the tail mask keeps them 4-byte stores,
# each coalesced across its warp).
ZERO_BLOCK = 2048


def zero_ahead(buf: torch.Tensor) -> None:
    """Zero the contiguous fp32 ``buf`` with a kernel that starts the next launch at once. That launch must be
    a programmatic dependent (``launch_pdl=True``) that runs ``gdc_wait`` before its first write to ``buf``:
    its loads and arithmetic then overlap the zeroing and its launch, which a ``zero_()`` before it would
    serialize. What it reads before the wait must be complete before this launch (an ordinary launch:
    everything launched earlier is). sm_90+ only (:func:`qops.ops._common.pdl_launch`)."""
    numel = buf.numel()
    _zero_kernel[(triton.cdiv(numel, ZERO_BLOCK),)](buf, numel, BLOCK=ZERO_BLOCK, num_warps=4)


# Each part of a scratch carved from one workspace starts on this many bytes, so that every part's pointer keeps the
# alignment Triton specializes on (16 bytes) whatever the parts before it hold
SCRATCH_ALIGN = 256


def scratch_aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`SCRATCH_ALIGN`: a scratch part's size when another part follows it."""
    return -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN


def workspace_view(workspace: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device,
                   offset: int = 0) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` at byte ``offset`` of the caller's workspace (uint8, contiguous, on ``device``,
    16-byte aligned: the ops check it, ``ops._common.check_workspace``) when it is large enough, else a fresh
    (uninitialised) tensor on ``device``."""
    nbytes = dtype.itemsize * math.prod(shape)
    if workspace is not None and workspace.numel() >= offset + nbytes:
        return workspace[offset:offset + nbytes].view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# The split-K reduction: fp32 partials or one fp32 sum (+ bias), cast to the output
# --------------------------------------------------------------------------------------------


@triton.jit
def _reduce_kernel(p_ptr, bias_ptr, y_ptr, M, N, S, stride_ps, stride_pm, stride_ym, stride_yn,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """y[m, :] = sum over S fp32 partials (+ bias), cast to y's dtype.

    BLOCK_S partials are loaded as one (BLOCK_S, BLOCK) tile and summed in registers: the loads of a
    loop over single partials wait on each other's adds, and with few programs (N = 4096 gives 16 at
    M = 1) that chain of S L2 round trips, not bandwidth, is what the reduction costs. The summation
    order depends only on S and BLOCK_S, so results are the same run to run.

    PDL (launched as a programmatic dependent of the split-K kernel): its programs are placed while
    that kernel's last programs run, and wait here until that grid has completed and its writes are
    visible; the launch's latency is what this hides, nothing is read early."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nmask = offs_n < N
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ss = s0 + offs_s
        tile = tl.load(p_ptr + ss[:, None] * stride_ps + m * stride_pm + offs_n[None, :],
                       mask=(ss < S)[:, None] & nmask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


# Partials a reduction program loads at once, at most; beyond it the program loops (split counts
# stay <= max_split, 64 in every shipped table).
REDUCE_MAX_S = 64


def reduce_tile(parts: int) -> tuple[int, int]:
    """(columns, partials) of one reduction program's tile: every partial of a column in one load
    (up to REDUCE_MAX_S), about 4096 values a program (32 a thread at 4 warps)."""
    block_s = min(REDUCE_MAX_S, triton.next_power_of_2(max(1, parts)))
    return max(64, min(512, 4096 // block_s)), block_s


def reduce_sums(y: torch.Tensor, bias: torch.Tensor | None, o2: torch.Tensor, parts: int, pdl: bool) -> None:
    """``o2 = the sum of the fp32 partials y (+ bias)``, cast: ``y`` contiguous, ``parts`` partials ``(S, M, N)``
    or (``parts`` 1) the one ``(M, N)`` sum of a split launch's atomic adds; the reduction launched as a
    programmatic dependent where ``pdl`` (the split-K kernel before it then starts its dependents)."""
    m, n = o2.shape
    block, block_s = reduce_tile(parts)
    _reduce_kernel[(-(-n // block), m)](
        y, bias if bias is not None else y, o2, m, n, parts, m * n if parts > 1 else 0, n,
        o2.stride(0), o2.stride(1), HAS_BIAS=bias is not None, BLOCK=block, BLOCK_S=block_s, num_warps=4,
        **({"PDL": True, "launch_pdl": True} if pdl else {}),
    )


def split_sum(workspace: torch.Tensor | None, m: int, n: int, device) -> tuple[torch.Tensor, bool]:
    """A split launch's zeroed fp32 ``(M, N)`` sum (the caller's workspace where large enough) and whether the
    launch is chained: on a GPU with PDL the sum is zeroed by :func:`zero_ahead`, and the split kernel, launched
    as its programmatic dependent, must wait before its atomic adds (``ZERO_WAIT`` of :func:`store_row` /
    :func:`store_tile`) and start its own dependents at once, so that :func:`reduce_sums` with ``pdl`` is placed
    while it runs; elsewhere (the interpreter, pre-Hopper GPUs) the sum is zeroed by ``zero_()`` before it. The
    GEMM / GEMV of ``int_weight`` do the same with knobs of their own (``pdl_zero``, ``pdl_reduce``)."""
    pdl = pdl_launch(torch.device(device))
    buf = fp32_scratch(workspace, (m, n), not pdl, device)
    if pdl:
        zero_ahead(buf)
    return buf, pdl


def fp32_scratch(workspace: torch.Tensor | None, shape: tuple[int, ...], zero: bool, device, offset: int = 0) -> torch.Tensor:
    """fp32 scratch of ``shape`` (zeroed when ``zero``) at byte ``offset`` of the caller's workspace
    (:func:`workspace_view`)."""
    buf = workspace_view(workspace, shape, torch.float32, device, offset)
    return buf.zero_() if zero else buf


class ConfigTable:
    """A module's launch configs (data), with a context manager that swaps in a modified copy.

    ``gemm`` holds ``(largest M of the bucket, tile config)`` pairs; the last bucket takes every larger M.
    """

    def __init__(self, configs: dict):
        self.active = configs

    @contextlib.contextmanager
    def override(self, **changes):
        """Use the table updated with ``changes`` (top-level keys; dict values are merged) in this block. A key
        the table does not have (a misspelling) is refused, naming it, rather than added and never read."""
        if unknown := sorted(set(changes) - set(self.active)):
            raise ValueError(f"config_override: unknown keys {unknown} (known: {sorted(self.active)})")
        table = copy.deepcopy(self.active)
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(table.get(key), dict):
                table[key] = {**table[key], **value}
            else:
                table[key] = value
        saved, self.active = self.active, table
        try:
            yield table
        finally:
            self.active = saved

    def __getitem__(self, key):
        return self.active[key]

    def gemm(self, m: int) -> dict:
        """The tile config of the M bucket holding ``m``."""
        return pick_bucket(self.active["gemm"], m)[1]


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(M, K)``, a view when its strides allow (any strides are fine for the kernels)."""
    return x.reshape(-1, x.shape[-1])


def output_2d(x2: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """Where the kernels write: ``out`` viewed as ``(M, N)`` when possible, else a fresh tensor."""
    if out is not None:
        try:
            return out.view(x2.shape[0], n)
        except RuntimeError:
            pass
    return torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)


def finish(y2: torch.Tensor, acc: torch.Tensor | None, bias, x: torch.Tensor, n: int, out: torch.Tensor | None):
    """Epilogue on the host side: cast/bias a split-K accumulator, copy into ``out`` if it was not viewable."""
    if acc is not None:
        if bias is not None:
            acc += bias.float()
        y2.copy_(acc)
    y = y2.view(*x.shape[:-1], n)
    if out is None:
        return y
    if y.data_ptr() != out.data_ptr():
        out.copy_(y)
    return out
