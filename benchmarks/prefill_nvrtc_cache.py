"""Fill the NVRTC cache on a machine without a GPU, from the builds a GPU run recorded.

A cold GPU machine spends much of a short device call compiling native kernels (a whole native test
file needs a few hundred builds; stop 33 lost 21 tests of a call to it). The cache key
(``qops.native.compiler.cache_key``) holds the source, its headers, the options, the arch and NVRTC's
version, and no device facts, so any machine with the same NVRTC version can fill it (the H200 machine's
is 13.0, what `scripts/install.py` installs here; a different version fills keys the GPU never asks for:
the summary line prints it). What to build comes
from a record: run the GPU job with ``QOPS_NVRTC_RECORD=$OUT/nvrtc-builds.jsonl`` (``scripts/gpu_run.sh``
sets it) and commit the file that comes back; each line names a source, an arch and the defines of one
module (``benchmarks/record_native_builds.py`` writes the same records without a GPU, for weights a
device run has not warmed up yet). The record names builds, not cache keys, so it stays useful after
the sources change: this script compiles the *current* sources with those defines.

    QOPS_CACHE_DIR=.snap/nvrtc-cache python benchmarks/prefill_nvrtc_cache.py \\
        benchmarks/results/h200-...-nvrtc-builds.jsonl --jobs 2

then carry the cache directory with the GPU call (with ``QOPS_CACHE_DIR`` pointing at it there).
Builds whose defines the current sources no longer accept are reported and skipped. ``--keep-only``
deletes the cache entries no recorded build needs (the device call's carry is limited in size).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import common

common.add_repo_to_path()


def read_builds(paths) -> list[tuple[str, str, tuple]]:
    """The distinct (source name, arch, sorted defines) of the record files, in first-seen order."""
    seen: dict[tuple, None] = {}
    for path in paths:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                build = (str(rec["source"]), str(rec["arch"]), tuple(sorted(rec["defines"].items())))
            except (ValueError, KeyError, AttributeError, TypeError) as e:
                raise SystemExit(f"prefill_nvrtc_cache: {path}:{n} is not a build record ({e})") from None
            seen.setdefault(build, None)
    return list(seen)


def build_key(build) -> str:
    from qops.native import compiler
    source, arch, defines = build
    return compiler.cache_key(compiler.native_source(source), arch, compiler.native_options(dict(defines)))


def compile_one(build) -> tuple[str, bool, str | None]:
    """(cache key, whether it was compiled now, error): compiled into the cache unless already there."""
    from qops.native import compiler
    source, arch, defines = build
    try:
        key = build_key(build)
        hit = compiler.read_cache_entry(compiler.cache_path(key)) is not None  # a truncated entry is built again
        if not hit:
            compiler.compile_cached(compiler.native_source(source), arch, compiler.native_options(dict(defines)))
        return key, not hit, None
    except Exception as e:  # noqa: BLE001 - one build that no longer compiles is reported, not fatal
        return "", False, f"{source} {arch} {dict(defines)}: {common.short_err(e)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="prefill_nvrtc_cache.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records", nargs="+", help="JSON-lines files written through QOPS_NVRTC_RECORD")
    p.add_argument("--jobs", type=int, default=2, help="compiling processes (default 2)")
    p.add_argument("--keep-only", action="store_true", help="then delete cache entries that no recorded build needs")
    a = p.parse_args(argv)
    from qops.native import compiler
    if compiler.runtime_missing():
        print(f"prefill_nvrtc_cache: cannot compile here: {compiler.runtime_missing()}", file=sys.stderr)
        return 2
    builds = read_builds(a.records)
    t0 = time.time()
    keys, compiled, errors = set(), 0, []
    with ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=multiprocessing.get_context("spawn")) as ex:
        for key, new, err in ex.map(compile_one, builds):
            if err:
                errors.append(err)
                continue
            keys.add(key)
            compiled += new
    for err in errors:
        print(f"  skipped: {err}", flush=True)
    removed = 0
    if a.keep_only:
        for path in compiler.cache_dir().glob("*.cubin"):
            if path.stem not in keys:
                path.unlink()
                removed += 1
    size = sum(f.stat().st_size for f in compiler.cache_dir().glob("*.cubin"))
    print(f"prefill_nvrtc_cache: NVRTC {'.'.join(map(str, compiler.nvrtc_version()))}: {len(builds)} builds ({compiled} compiled, {len(keys) - compiled} already cached, "
          f"{len(errors)} skipped) in {time.time() - t0:.1f} s; {removed} entries removed; cache {compiler.cache_dir()} "
          f"{size / 2**20:.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
