"""NVRTC builds of many variants at once, with ptxas' report, for the compile-budget tests.

The register-budget tests compile a few hundred kernel variants on CI's two cores, which was most
of a CI run when one compile followed another. NVRTC releases the GIL while it compiles, so a few
threads compile that many variants in about half the time (measured on the 2-core CI box: 8
decode-kernel builds in 3.7 s against 9.7 s one after another).
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping

from qops.native import compiler

ELF_MAGIC = b"\x7fELF"


def ptxas_report(log: str) -> dict[str, tuple[int, int]]:
    """kernel name -> (registers, spill store bytes) from ptxas -v output."""
    out, name = {}, None
    spills = 0
    for line in log.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spills = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = (int(m.group(1)), spills)
    return out


# Builds that NVRTC 13.0 (the H200 machine's, and CI's since stop 26) compiles with a few spilled
# bytes where 13.5 spills none: (source, the defines that single them out, bytes). The H200's timings
# of these builds always included the spills.
NVRTC_13_0_SPILLS = (
    # NF4 at M 9..16, two-tile persistent blocks with a 2-slot ring (a rule plan): 16 bytes of stack
    ("blockwise4_gemv.cu", {"QOPS_MT": 2, "QOPS_R": 2, "QOPS_RING": 2, "QOPS_MINB": 2, "QOPS_PERSISTENT": 1, "QOPS_LUT_IMM": 0}, 16),
    # the W4A16 GEMM with two blocks an SM at M = 33..40 (a measurement knob, not in the rule)
    ("w4a16_gemm.cu", {"QOPS_MT": 5, "QOPS_MINB": 2, "QOPS_STAGES": 3}, 8),
)


def spills_allowed(source_name: str, defines: Mapping[str, int]) -> int:
    """Spill-store bytes the sm_90 budget tests accept for one build: 0 except the listed ones under
    an NVRTC older than 13.5."""
    if compiler.nvrtc_version() >= (13, 5):
        return 0
    return max((b for src, sub, b in NVRTC_13_0_SPILLS if src == source_name and all(defines.get(k) == v for k, v in sub.items())),
               default=0)


def unique(defines: Iterable[Mapping[str, int]]) -> list[dict[str, int]]:
    """The distinct define sets, in first-seen order."""
    seen, out = set(), []
    for d in defines:
        key = tuple(sorted(d.items()))
        if key not in seen:
            seen.add(key)
            out.append(dict(d))
    return out


def covering(defines: Iterable[Mapping[str, int]]) -> list[dict[str, int]]:
    """A subset of the distinct define sets in which every (define, value) pair of the whole list occurs
    at least once (greedy set cover, first-seen order among equals): each value's code path compiled
    once, without every combination."""
    todo = unique(defines)
    missing = {kv for d in todo for kv in d.items()}
    out = []
    while missing:
        best = max(todo, key=lambda d: len(missing.intersection(d.items())))
        out.append(best)
        missing -= set(best.items())
    return out


def builds_for(arch: str, defines: Iterable[Mapping[str, int]]) -> list[dict[str, int]]:
    """What a register-budget test compiles for ``arch``: every distinct define set on sm_90, the
    :func:`covering` subset elsewhere. ``__launch_bounds__`` holds every build to its register budget
    (ptxas spills instead) and spills are the H200's question, checked on sm_90 for every variant; on
    sm_80 what can fail is a code path that does not compile there, which each define's every value
    compiled once finds (the sm_80 builds of every combination were a third of CI's time)."""
    return unique(defines) if arch == "sm_90" else covering(defines)


def compile_reports(source_name: str, arch: str, defines: Iterable[Mapping[str, int]]) -> list[tuple[dict, str]]:
    """(defines, ptxas log) for every distinct define set of ``source_name`` under qops/native, compiled
    for ``arch`` in parallel threads; each cubin is checked to be an ELF image."""
    src = compiler.native_source(source_name)

    def one(d):
        log: list[str] = []
        cubin = compiler.compile(src, arch, compiler.native_options(d, ptxas_options=["-v"]), log=log)
        assert cubin[:4] == ELF_MAGIC, (arch, d)
        return d, log[0]

    todo = unique(defines)
    # cuda.core imported here, once: threads importing it for the first time at once can see the
    # package half-initialized (seen on the CPU box: "cuda.core: lacks Program, ...").
    compiler.core()
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        return list(pool.map(one, todo))
