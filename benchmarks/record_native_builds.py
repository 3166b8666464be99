"""List, on a machine without a GPU, the native W4A16 builds that warming up given weights asks for
on an H200, as the build records ``benchmarks/prefill_nvrtc_cache.py`` reads.

A GPU run writes such records itself (``QOPS_NVRTC_RECORD``), but only for what it ran: a new model
variant (another activation dtype, another batch range) would compile cold on the device, in the
middle of a short device call. The plans (``qops.native.int_weight.plan``, the GEMM's ``plan``) depend
on the device only through a few facts, which this script supplies for an H200 (132 SMs, compute
capability 9.0, 227 KiB of shared memory a block by opt-in); it then runs
``qops.native.int_weight.warmup_shape`` with ``compiler.get_kernel`` recording instead of compiling
and the launches skipped.

    python benchmarks/record_native_builds.py --dtype float16 --max-m 32 \\
        6144x4096 4096x4096 28672x4096:glu 4096x14336 > builds.jsonl
    QOPS_CACHE_DIR=... python benchmarks/prefill_nvrtc_cache.py builds.jsonl --jobs 2

``:glu`` marks a fused gate/up weight (its gated builds). Every weight is taken as asymmetric (zeros),
as GPTQ checkpoints are.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from unittest import mock

import common

common.add_repo_to_path()

# The facts of the device the records are for (an H200 as lent here).
H200 = types.SimpleNamespace(multi_processor_count=132, major=9, minor=0, shared_memory_per_block_optin=232448,
                             name="NVIDIA H200")


@contextlib.contextmanager
def pretend_device(props=H200):
    """torch.cuda's device queries answer with ``props``; the native compiler records instead of
    building (yielded: the list the records go to) and launches nothing."""
    import torch

    from qops.native import compiler
    from qops.native import int_weight as niw
    from qops.native import int_weight_gemm as gemm

    records: list[dict] = []

    def get_kernel(device, source_name, defines, kernel_name, *, arch_specific=False):
        arch = f"sm_{props.major}{props.minor}" + ("a" if arch_specific else "")
        records.append({"source": source_name, "arch": arch, "defines": dict(defines)})
        return kernel_name

    cached = [f for mod in (niw, gemm, compiler) for f in vars(mod).values() if hasattr(f, "cache_clear")]
    for f in cached:
        f.cache_clear()  # facts of a real device asked before must not leak in (nor ours out, below)
    with contextlib.ExitStack() as st:
        st.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: props))
        st.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (props.major, props.minor)))
        st.enter_context(mock.patch.object(torch.cuda, "get_device_name", lambda *a, **k: props.name))
        st.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
        st.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: None))
        st.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        st.enter_context(mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()))
        st.enter_context(mock.patch.object(compiler, "get_kernel", get_kernel))
        st.enter_context(mock.patch.object(compiler, "launch", lambda *a, **k: None))
        st.enter_context(mock.patch.object(compiler, "allow_dynamic_shared", lambda *a, **k: None))
        st.enter_context(mock.patch.object(compiler, "max_active_blocks", lambda *a, **k: 2))
        st.enter_context(mock.patch.object(compiler, "i32", lambda v: v))
        try:
            yield records
        finally:
            for f in cached:
                f.cache_clear()


def parse_weight(spec: str) -> tuple[int, int, bool]:
    """``NxK`` or ``NxK:glu`` -> (N, K, gated)."""
    shape, _, flag = spec.partition(":")
    if flag not in ("", "glu"):
        raise SystemExit(f"record_native_builds: {spec!r}: the only flag is ':glu'")
    n, k = (int(v) for v in shape.lower().split("x"))
    return n, k, bool(flag)


def record_builds(weights, dtype, max_m: int) -> list[dict]:
    """The distinct build records (first-seen order) of warming up ``weights`` ((N, K, gated) each)
    for ``dtype`` activations and up to ``max_m`` rows on the pretended H200."""
    from qops.native import int_weight as niw

    with pretend_device() as records:
        for n, k, glu in weights:
            niw.warmup_shape(0, dtype, n, k, True, max_m, glu=glu)
    out, seen = [], set()
    for r in records:
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="record_native_builds.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", nargs="+", help="NxK (out x in features), NxK:glu for a fused gate/up weight")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16", help="activation dtype")
    p.add_argument("--max-m", type=int, default=64, help="rows up to which the warm-up builds (a model's max batch)")
    a = p.parse_args(argv)
    builds = record_builds([parse_weight(w) for w in a.weights], getattr(torch, a.dtype), a.max_m)
    for r in builds:
        print(json.dumps(r, sort_keys=True))
    print(f"record_native_builds: {len(builds)} builds", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
