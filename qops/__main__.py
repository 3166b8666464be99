"""``python -m qops``: the command-line entry point.

    python -m qops info     the support matrix on this machine: formats x lowerings, usable or why not
    python -m qops demo     quantize, compile and run a small Llama-style model; tokens/s and logit error
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _devices() -> list[torch.device]:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.append(torch.device("cuda", torch.cuda.current_device()))
    return devs


def _versions() -> str:
    parts = [f"qops {__import__('qops').__version__}", f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except Exception:  # noqa: BLE001
        parts.append("triton: not importable")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        parts.append(f"GPU {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        parts.append("no CUDA device")
    return " | ".join(parts)


def support_matrix() -> list[tuple[str, str, str]]:
    """(format, lowering, verdict) for every format and every lowering of its op family."""
    from .formats import FORMATS
    from .lowerings import LOWERINGS, disabled_lowerings

    disabled = disabled_lowerings()
    rows = []
    for fmt in FORMATS.values():
        for low in sorted(LOWERINGS, key=lambda l: -l.priority):
            if low.family != fmt.family:
                continue
            if fmt.name not in low.formats:
                verdict = "no: format not served"
            elif low.name in disabled:
                verdict = "no: disabled by QOPS_DISABLE_LOWERINGS"
            else:
                bits = sorted(set(fmt.bits) & low.bits)
                if not bits:
                    verdict = f"no: bits {list(fmt.bits)} not served"
                else:
                    where = [str(d) for d in _devices() if low.device_refusal(d) is None]
                    if where:
                        verdict = f"yes on {', '.join(where)} (bits {','.join(map(str, bits))})"
                    else:
                        if "cuda" in low.device_types and not torch.cuda.is_available():
                            verdict = "no: needs a CUDA device; this machine has none"
                        else:
                            reasons = {low.device_refusal(d) for d in _devices()}
                            verdict = "no: " + "; ".join(sorted(r for r in reasons if r))
            rows.append((fmt.name, low.name, verdict))
    return rows


def _pdl_device_refusal() -> str | None:
    """Why this machine's current GPU cannot launch with programmatic dependent launch (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (it needs one of sm_90 or later)"
    major, minor = torch.cuda.get_device_capability()
    return None if major >= 9 else f"the GPU is sm_{major}{minor}; it needs sm_90 or later"


def _native_launch_facts() -> str:
    """Whether the native kernels launch with programmatic dependent launch here, and why not: the
    device must take it (sm_90+) and cuda.core must express it."""
    try:
        from .native import compiler
    except Exception as e:  # noqa: BLE001 - cuda-python missing: reported, not fatal
        return f"unavailable ({type(e).__name__}: {e})"
    why = _pdl_device_refusal() or compiler.pdl_missing()
    return "programmatic dependent launch available (sm_90+; QOPS_NATIVE_PDL=0 turns it off)" if why is None else f"no programmatic dependent launch: {why}"


def _native_plan_table_line(gpu: str, sms: int) -> str:
    """The native W4A16 plan table a GPU named ``gpu`` with ``sms`` SMs reads, or why none."""
    try:
        from .native import int_weight as native_int_weight

        found = native_int_weight.plan_table(gpu)
        others = ", ".join(f"{g} ({t['sms']} SMs)" for g, t in sorted(native_int_weight.plan_tables().items())) or "none"
    except Exception as e:  # noqa: BLE001 - a missing cuda-python or a malformed table: reported, not fatal
        return f"Native W4A16 plan table: unavailable ({type(e).__name__}: {e})"
    if found is not None and found[1]["sms"] == sms:
        path, plans = found
        return f"Native W4A16 plan table: plans/{os.path.basename(path)} ({len(plans['plans'])} measured plans; other shapes take the rule)"
    return f"Native W4A16 plan table: none for {gpu!r} with {sms} SMs, every shape takes the rule (tables: {others})"


def _sliced_rows_line(gpu: str) -> str:
    """How many rows past 64 the native lowering runs in 64-row GEMM slices on a Hopper GPU named ``gpu``,
    and whether that was measured on it or is the H200's."""
    try:
        from .native import int_weight as native_int_weight
    except Exception as e:  # noqa: BLE001 - a missing cuda-python: reported, not fatal
        return f"Native W4A16 slices past 64 rows: unavailable ({type(e).__name__}: {e})"
    table = native_int_weight.sliced_rows_table(gpu)
    limits = ", ".join(f"{rows} for >= 2^{size.bit_length() - 1} elements" if size else f"{rows} below" for size, rows in table)
    where = (f"measured on {gpu}" if gpu in native_int_weight.SLICED_ROWS
             else f"the {native_int_weight.SLICED_ROWS_DEFAULT_GPU}'s, none measured on {gpu!r}")
    return f"Native W4A16 slices past 64 rows (Hopper; more go to Triton): up to {limits} ({where})"


def measured_tables(gpu: str, sms: int) -> list[str]:
    """Which measured launch tables a GPU named ``gpu`` with ``sms`` SMs reads, and where it has none
    (its calls then take the untuned generic table or the plan rule): one line a table."""
    from .ops.triton import int_weight as triton_int_weight

    stem = triton_int_weight.gpu_key(gpu)
    table = triton_int_weight.load_config(stem)
    if table.get("tuned"):
        amended = len(table.get("amended", []))
        lines = [f"Triton int-weight launch configs: configs/{stem}.json (measured: {table['source']}"
                 + (f"; {amended} entries amended by hand, each naming its measurement" if amended else "") + ")"]
    else:
        measured = [s for s in triton_int_weight.config_stems() if s != triton_int_weight.DEFAULT_CONFIG]
        lines = [f"Triton int-weight launch configs: configs/{triton_int_weight.DEFAULT_CONFIG}.json, UNTUNED: no measured "
                 f"file for {gpu!r} (measured files: {', '.join(measured) or 'none'})"]
    lines.append(_native_plan_table_line(gpu, sms))
    lines.append(_sliced_rows_line(gpu))
    lines.append("fp8, int8 and 4-bit codebook kernels: constants measured on the H200, in their modules, used on every GPU")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    import qops
    from .lowerings import LOWERINGS

    print(_versions())
    print("\nLowerings (highest priority first):")
    for low in sorted(LOWERINGS, key=lambda l: -l.priority):
        cap = f" sm>={low.min_capability[0]}{low.min_capability[1]}" if low.min_capability else ""
        acts = ",".join(str(d).replace("torch.", "") for d in sorted(low.act_dtypes, key=str))
        print(f"  {low.name:<24} kernel={int(low.kernel)} on {'/'.join(sorted(low.device_types))}{cap}; "
              f"bits {','.join(map(str, sorted(low.bits)))}; activations {acts}. {low.note}")
    print("\nSupport matrix on this machine (format x lowering):")
    rows = support_matrix()
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for f, l, v in rows:
        print(f"  {f:<{w0}}  {l:<{w1}}  {v}")
    print(f"\nNative kernels: {_native_launch_facts()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        print(f"\nMeasured tables on this GPU ({props.name}):")
        for line in measured_tables(props.name, props.multi_processor_count):
            print(f"  {line}")
    ops = sorted(n for n in dir(torch.ops.qops) if not n.startswith("_") and isinstance(getattr(torch.ops.qops, n), torch._ops.OpOverloadPacket))
    print(f"\nOps: {', '.join('qops::' + o for o in ops)}  (reference: docs/OPS.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qops", description="qops: quantized matmul operators for torch.compile")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the support matrix for this machine")
    p.set_defaults(func=cmd_info)
    from . import demo

    p = sub.add_parser("demo", help="quantize, compile and run a small Llama-style model: tokens/s and logit error",
                       description=demo.__doc__.strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
