"""Random integer-weight checkpoints for every registered format, and what each format supports.

``SUPPORT`` is the tests' own statement of what each registered checkpoint format can hold. It is
checked against the int_weight formats of ``qops.formats.FORMATS`` (one registered without a row
here fails ``test_support_table_covers_the_registry``), and every combination a format cannot hold is an
explicit opt-out whose refusal is itself tested, never a skip.
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

from qops.formats import FORMATS
from qops.formats.integer import IntQuantized, act_order_g_idx

from tests import oracle

ALL_BITS = (2, 3, 4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
# (N, K) pairs off round numbers; every group size above leaves a partial last group except groups 32 and 64 at K=192.
SHAPES = ((40, 100), (72, 200), (40, 328), (72, 192))
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative Frobenius error allowed against the float64 oracle, by activation dtype.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Support:
    bits: tuple[int, ...]
    act_order: bool
    versions: tuple[str | None, ...]  # zero conventions a checkpoint may be written in
    n_multiple: int = 1
    why_not: str = ""  # what the format cannot hold, for the opt-out tests' ids and messages


SUPPORT: dict[str, Support] = {
    "gptq": Support(bits=(2, 3, 4, 8), act_order=True, versions=("v1", "v2")),
    "awq": Support(bits=(4,), act_order=False, versions=(None,), n_multiple=8,
                   why_not="AWQ GEMM packs nibbles along N (bits=4 only, N % 8 == 0) and has no act-order"),
    "compressed-tensors": Support(bits=(4, 8), act_order=True, versions=(None,),
                                  why_not="pack-quantized integer checkpoints are int4 or int8"),
}


def int_weight_formats() -> list[str]:
    """Registered formats served by the int_weight op family (other families have their own suites)."""
    return [name for name, f in FORMATS.items() if f.family == "int_weight"]


def zero_range(fmt: str, bits: int, version: str | None) -> tuple[int, int]:
    """Inclusive range of the zero points a checkpoint of this format can hold."""
    if fmt == "gptq" and version == "v1":
        return 1, 2**bits  # stored as z - 1
    return 0, 2**bits - 1


@dataclass(frozen=True)
class Case:
    fmt: str
    bits: int
    group_size: int
    sym: bool
    act_order: bool
    version: str | None
    n: int
    k: int

    @property
    def supported(self) -> bool:
        s = SUPPORT.get(self.fmt)
        if s is None:  # a format missing from SUPPORT is tested in full, and fails loudly
            return True
        return self.bits in s.bits and (s.act_order or not self.act_order) and self.n % s.n_multiple == 0

    @property
    def id(self) -> str:
        parts = [self.fmt, f"b{self.bits}", f"g{self.group_size}", "sym" if self.sym else "asym"]
        if self.act_order:
            parts.append("actorder")
        if self.version:
            parts.append(self.version)
        parts.append(f"{self.n}x{self.k}")
        return "-".join(parts)


def all_cases() -> list[Case]:
    """Every format x bits x group size x sym x act-order x version, shapes rotated through SHAPES."""
    cases = []
    for fmt in int_weight_formats():
        versions = SUPPORT[fmt].versions if fmt in SUPPORT else (None,)
        combos = itertools.product(ALL_BITS, GROUP_SIZES, (True, False), (False, True), versions)
        # With one group (-1) every row is in group 0: act-order changes nothing, so it is not a case.
        combos = [c for c in combos if not (c[3] and c[1] == -1)]
        for i, (bits, gs, sym, act, ver) in enumerate(combos):
            n, k = SHAPES[i % len(SHAPES)]
            cases.append(Case(fmt, bits, gs, sym, act, ver, n, k))
    return cases


def n_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-k // group_size)


def random_int_quantized(case: Case, gen: torch.Generator, scale_dtype: torch.dtype = torch.float16) -> IntQuantized:
    """Random codes, zeros spanning the format's whole range (both ends present) and random scales."""
    n, k, bits = case.n, case.k, case.bits
    g = n_groups(k, case.group_size)
    q = torch.randint(0, 2**bits, (n, k), generator=gen).to(torch.uint8)
    if case.sym:
        zeros = torch.full((n, g), 2 ** (bits - 1), dtype=torch.int32)
    else:
        lo, hi = zero_range(case.fmt, bits, case.version)
        zeros = torch.randint(lo, hi + 1, (n, g), generator=gen, dtype=torch.int32)
        zeros.view(-1)[0], zeros.view(-1)[-1] = lo, hi
    sign = torch.randint(0, 2, (n, g), generator=gen) * 2 - 1
    scales = ((torch.rand(n, g, generator=gen) * 0.9 + 0.1) * sign * 0.02).to(scale_dtype)
    if case.act_order:
        g_idx = act_order_g_idx(k, case.group_size, generator=gen)
    else:
        g_idx = torch.arange(k) // (k if case.group_size == -1 else case.group_size)
    return IntQuantized(q=q, zeros=zeros, scales=scales, g_idx=g_idx, bits=bits, group_size=case.group_size)


def pack(case: Case, iq: IntQuantized):
    """The checkpoint object of ``case.fmt`` holding ``iq``."""
    fmt = FORMATS[case.fmt]
    if case.fmt == "gptq":
        return fmt.pack(iq, version=case.version)
    if case.fmt == "compressed-tensors":
        return fmt.pack(iq, sym=case.sym)
    return fmt.pack(iq)


@dataclass
class Built:
    case: Case
    iq: IntQuantized
    checkpoint: object
    w64: torch.Tensor  # oracle (N, K) float64
    weight: object  # qops IntWeight


def seed_of(case: Case) -> int:
    return zlib.crc32(case.id.encode())


def build(case: Case, seed: int | None = None, scale_dtype: torch.dtype = torch.float16) -> Built:
    gen = torch.Generator().manual_seed(seed_of(case) if seed is None else seed)
    iq = random_int_quantized(case, gen, scale_dtype)
    ckpt = pack(case, iq)
    w64 = oracle.dequantize(case.fmt, ckpt)
    return Built(case, iq, ckpt, w64, FORMATS[case.fmt].prepare(ckpt))


def rel_err(got: torch.Tensor, want64: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against the float64 reference."""
    diff = torch.linalg.vector_norm(got.double() - want64)
    ref = torch.linalg.vector_norm(want64)
    return float(diff / ref) if ref > 0 else float(diff)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run a module's tiny matmuls on one thread, restoring the count after.

    On a 2-core CI machine shared with other jobs, OpenMP's second thread spin-waits for a core
    and makes these small products about ten times slower (measured: 150 s vs 12 s for
    test_int_weight_ops.py); one thread loses nothing at these sizes.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Native W4A16 split-K reductions compared bit for bit (tests/gpu/test_gpu_native_int_weight.py
# test_cluster_and_workspace_reductions_agree_bitwise; tests/test_gpu_suite_facts.py pins the plans
# on an H200's facts). The cluster sizes the H200 plans use (the rule's 2, the table's 4 and 8).
CLUSTER_SPLITS = (2, 4, 8)
CLUSTER_COMPARE_M = (1, 7, 16, 17, 24, 32)
# The M of CLUSTER_COMPARE_M at which the rule's own plan on an H200 (132 SMs) sums in a cluster, by
# (N, K) of that test: those comparisons are of the plan production runs there.
RULE_CLUSTER_M = {(4096, 4096): (1, 7, 17), (1024, 8192): (), (6144, 4096): (1, 7, 17, 24, 32)}


def native_cluster_pairs(n: int, k: int, sms: int, smem_limit: int) -> list[tuple[int, object, object, object]]:
    """(m, rule plan, cluster plan, workspace plan) for each M of ``CLUSTER_COMPARE_M``: the rule's
    plan on a device of ``sms`` SMs with clusters, with its split count taken down to the nearest of
    ``CLUSTER_SPLITS`` (2 where it does not split), once summing inside a cluster and once through
    the workspace, everything else the rule's. ValueError where the kernel cannot run one."""
    from qops.native import int_weight as native

    out = []
    for m in CLUSTER_COMPARE_M:
        rule = native._plan(m, n, k, sms, True)
        splits = max([s for s in CLUSTER_SPLITS if s <= rule.splits] or [CLUSTER_SPLITS[0]])
        cl = native.remake_plan(rule, n, k, smem_limit, splits=splits, cluster=True)
        ws = native.remake_plan(rule, n, k, smem_limit, splits=splits, cluster=False)
        out.append((m, rule, cl, ws))
    return out
