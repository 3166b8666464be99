"""The kernel capability table and the chooser.

Each lowering declares, as data, what it can serve: op family, device type, minimum compute
capability, checkpoint formats, bits, group sizes, activation dtypes, alignment, priority. When
weights are prepared, :func:`choose` walks the table by priority, skips lowerings disabled through
``QOPS_DISABLE_LOWERINGS`` (comma-separated names), and returns the first that fits together with
every refusal reason. The choice is recorded in the prepared weight and passed to the op as its
``kernel`` argument, so nothing is decided from tensor values per call.
"""
from __future__ import annotations

import enum
import functools
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true

DISABLE_ENV = "QOPS_DISABLE_LOWERINGS"


class Kernel(enum.IntEnum):
    """Lowering ids as they cross op schemas (``kernel: int``). Values are stable public API."""

    REFERENCE = 0
    TRITON = 1
    NATIVE = 2
    SCALED_MM = 3  # torch's cuBLASLt FP8 GEMM (torch._scaled_mm; F.scaled_mm for block scales)


@dataclass(frozen=True)
class WeightSpec:
    """Static facts about one prepared weight: all the chooser may look at."""

    family: str
    format: str
    bits: int
    group_size: int
    n: int
    k: int
    act_order: bool
    symmetric: bool
    device: torch.device
    act_dtype: torch.dtype
    # fp8 family: rows per weight-scale block (-1: all of N, 1: per channel), and the dtype a W8A8
    # GEMM writes (None: the activation dtype is not fp8, or not known).
    block_n: int = -1
    out_dtype: torch.dtype | None = None


# fp8 W8A8 activation-scale layouts (``qops::scaled_mm_fp8``'s ``x_scale``): one scale for the
# tensor, one per token, or one per token and group of X_SCALE_GROUP consecutive K values (DeepSeek-V3's
# 1x128 activation quantization).
X_SCALE_LAYOUTS = ("tensor", "token", "group")
X_SCALE_GROUP = 128


@dataclass(frozen=True)
class CallFacts:
    """What one op call tells about its weight: the static facts a lowering's capabilities name,
    less the checkpoint format (ops take tensors, not formats)."""

    bits: int
    group_size: int
    act_dtype: torch.dtype
    n: int
    k: int
    act_order: bool = False
    block_n: int = -1  # as WeightSpec.block_n
    out_dtype: torch.dtype | None = None  # as WeightSpec.out_dtype
    x_scale: str | None = None  # fp8 W8A8: one of X_SCALE_LAYOUTS; None: not known (when preparing) or not W8A8


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the lowering cannot run
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def _nothing_missing() -> str | None:
    return None


def _blockwise_scaled_mm_missing() -> str | None:
    f = torch.nn.functional
    if not hasattr(f, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (block-scaled FP8 GEMM)"
    if not hasattr(getattr(f, "ScalingType", None), "BlockWise1x128"):
        return f"torch {torch.__version__}'s torch.nn.functional.ScalingType has no BlockWise1x128 / BlockWise128x128"
    return None


def _native_missing() -> str | None:
    try:
        from .native.compiler import runtime_missing
    except Exception as e:  # noqa: BLE001 - numpy or the module itself failing to import
        return f"qops.native is not importable ({type(e).__name__}: {e})"
    return runtime_missing()


def _native_or_triton_missing() -> str | None:
    """Why a native lowering cannot run here: qops.native unusable, or triton missing, to which it hands
    every call it does not serve itself (past its rows, or tensors refused at call time)."""
    why = _triton_missing()
    return _native_missing() or (f"it delegates the calls it does not serve to triton: {why}" if why else None)


@dataclass(frozen=True)
class BlockScaling:
    """What a lowering needs of weights whose scales vary along K (``group_size != -1``) where that
    differs from its general capabilities: a library recipe for block scales can have stricter
    shapes, GPUs and output dtypes than the same library's tensor- or row-wise GEMM."""

    blocks: frozenset[tuple[int, int]]  # (block_n, group_size) served
    n_multiple: int
    k_multiple: int
    capability_majors: frozenset[int]  # compute capability majors it runs on (exactly)
    out_dtypes: frozenset[torch.dtype]  # W8A8 output dtypes
    x_scales: frozenset[str]  # activation-scale layouts (X_SCALE_LAYOUTS) it reads with these weights
    recipe: str  # names the library recipe in refusals
    software: Callable[[], str | None] = field(default=_nothing_missing, compare=False)

    def call_refusal(self, facts: CallFacts) -> str | None:
        if (facts.block_n, facts.group_size) not in self.blocks:
            shapes = " or ".join(f"{bn} x {bk}" for bn, bk in sorted(self.blocks))
            return f"{self.recipe} takes {shapes} weight blocks, not {facts.block_n} x {facts.group_size}"
        if not guard_or_true(facts.n % self.n_multiple == 0):
            return f"{self.recipe} needs N a multiple of {self.n_multiple}, got N={facts.n}"
        if not guard_or_true(facts.k % self.k_multiple == 0):
            return f"{self.recipe} needs K a multiple of {self.k_multiple}, got K={facts.k}"
        if facts.out_dtype is not None and facts.out_dtype not in self.out_dtypes:
            return (f"{self.recipe} writes {sorted(str(d) for d in self.out_dtypes)}, not {facts.out_dtype} "
                    "(fp32 output of cuBLASLt's block-scaled FP8 GEMM is not verified here)")
        if facts.x_scale is not None and facts.x_scale not in self.x_scales:
            return f"{self.recipe} reads {sorted(self.x_scales)} activation scales, not {facts.x_scale}"
        return None

    def device_refusal(self, capability: tuple[int, int] | None) -> str | None:
        if capability is not None and capability[0] not in self.capability_majors:
            return f"{self.recipe} needs compute capability {' or '.join(f'{c}.x' for c in sorted(self.capability_majors))}, device has {capability}"
        return self.software()


@dataclass(frozen=True)
class Lowering:
    name: str
    kernel: Kernel
    family: str
    device_types: frozenset[str]
    formats: frozenset[str]
    bits: frozenset[int]
    act_dtypes: frozenset[torch.dtype]
    priority: int
    entry: str  # "module:function" implementing the op family for this lowering, imported lazily
    min_capability: tuple[int, int] | None = None  # CUDA only
    group_sizes: frozenset[int] | None = None  # None: -1 and any positive size
    n_multiple: int = 1
    k_multiple: int = 1
    act_order: bool = True
    # fp8 W8A8: the activation-scale layouts (X_SCALE_LAYOUTS) the entry reads.
    x_scales: frozenset[str] = frozenset({"tensor", "token"})
    # Stricter needs for weights with scales along K (None: the general ones above hold for them too).
    block_scaling: BlockScaling | None = None
    # "module:function(weight)" run once when a weight is prepared for this lowering: compiles and
    # loads its kernels then, never later during CUDA-graph capture.
    warmup: str | None = None
    # "module:function" with the entry's contract computing silu(gate) * up of a fused [gate; up]
    # weight (gate rows first) in the kernel, N/2 wide, and its warm-up; None: the gated ops run
    # ``entry`` and then SiLU-and-multiply (:func:`swiglu_implementation`).
    swiglu_entry: str | None = None
    swiglu_warmup: str | None = None
    note: str = ""
    software: Callable[[], str | None] = field(default=_nothing_missing, compare=False)

    def static_refusal(self, spec: WeightSpec) -> str | None:
        """Why this lowering cannot serve ``spec`` regardless of the machine, or None."""
        if spec.family != self.family:
            return f"serves op family {self.family}, not {spec.family}"
        if spec.format not in self.formats:
            return f"format {spec.format} not in {sorted(self.formats)}"
        return self.call_refusal(CallFacts(spec.bits, spec.group_size, spec.act_dtype, spec.n, spec.k, spec.act_order,
                                           block_n=spec.block_n, out_dtype=spec.out_dtype))

    def call_refusal(self, facts: CallFacts) -> str | None:
        """Why this lowering cannot serve a call with these facts, or None: the part of
        :meth:`static_refusal` an op can check from its own arguments (it does not know the format)."""
        if facts.bits not in self.bits:
            return f"bits={facts.bits} not in {sorted(self.bits)}"
        if self.group_sizes is not None and facts.group_size not in self.group_sizes:
            return f"group_size={facts.group_size} not in {sorted(self.group_sizes)}"
        if facts.act_dtype not in self.act_dtypes:
            return f"activation dtype {facts.act_dtype} not in {sorted(str(d) for d in self.act_dtypes)}"
        # guard_or_true: under symbolic shapes an undecidable multiple passes here and is checked at run time.
        if not guard_or_true(facts.n % self.n_multiple == 0):
            return f"N={facts.n} is not a multiple of {self.n_multiple}"
        if not guard_or_true(facts.k % self.k_multiple == 0):
            return f"K={facts.k} is not a multiple of {self.k_multiple}"
        if facts.act_order and not self.act_order:
            return "act-order weights are not served"
        if self.block_scaling is not None and facts.group_size != -1:
            return self.block_scaling.call_refusal(facts)
        if facts.x_scale is not None and facts.x_scale not in self.x_scales:
            return f"{facts.x_scale} activation scales not in {sorted(self.x_scales)}"
        return None

    def device_refusal(self, device: torch.device) -> str | None:
        """Why this lowering cannot run on ``device`` on this machine, or None."""
        if device.type not in self.device_types:
            return f"runs on {sorted(self.device_types)}, not {device.type}"
        if device.type == "cuda":
            cap = _cuda_capability(device)
            if cap is None:
                return "no CUDA device is available"
            if self.min_capability is not None and cap < self.min_capability:
                return f"needs compute capability >= {self.min_capability}, device has {cap}"
        return self.software()

    def block_device_refusal(self, spec: WeightSpec) -> str | None:
        """Why this lowering's block-scale recipe cannot run on ``spec.device``, for weights that use it."""
        if self.block_scaling is None or spec.group_size == -1 or spec.device.type != "cuda":
            return None
        return self.block_scaling.device_refusal(_cuda_capability(spec.device))

    def refusal(self, spec: WeightSpec) -> str | None:
        if self.name in disabled_lowerings():
            return f"disabled by {DISABLE_ENV}"
        return self.static_refusal(spec) or self.device_refusal(spec.device) or self.block_device_refusal(spec)


INT_WEIGHT_FORMATS = frozenset({"gptq", "awq", "compressed-tensors"})
INT8_WEIGHT_FORMATS = frozenset({"eetq", "bitsandbytes-int8"})
BLOCKWISE4_FORMATS = frozenset({"bitsandbytes-nf4", "bitsandbytes-fp4"})
BNB_BLOCKSIZES = frozenset({32, 64, 128, 256, 512, 1024, 2048, 4096})
FLOAT_ACTS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# fp8 family: WeightSpec.group_size is block_k (-1: scales constant along K); act_dtype float8_e4m3fn
# means W8A8 (activations quantized to fp8 before the GEMM), a float dtype W8A16.
FP8_FORMATS = frozenset({"fp8", "compressed-tensors-fp8", "fp8-block"})

# The table. The CPU reference comes first; GPU lowerings are added beside it.
LOWERINGS: tuple[Lowering, ...] = (
    Lowering(
        name="reference_int_weight",
        kernel=Kernel.REFERENCE,
        family="int_weight",
        device_types=frozenset({"cpu", "cuda"}),
        formats=INT_WEIGHT_FORMATS,
        bits=frozenset({2, 3, 4, 8}),
        act_dtypes=FLOAT_ACTS,
        priority=0,
        entry="qops.ops.int_weight:reference_mm",
        note="pure torch: dequantize in fp32, then matmul (fp32 accumulation)",
    ),
    Lowering(
        name="triton_int_weight",
        kernel=Kernel.TRITON,
        family="int_weight",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=INT_WEIGHT_FORMATS,
        bits=frozenset({2, 3, 4, 8}),
        act_dtypes=frozenset({torch.float16, torch.bfloat16}),
        priority=10,
        entry="qops.ops.triton.int_weight:triton_mm",
        note="Triton: split-K GEMV for small M, tiled GEMM above the measured threshold",
        software=_triton_missing,
    ),
    Lowering(
        name="native_w4a16",
        kernel=Kernel.NATIVE,
        family="int_weight",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=INT_WEIGHT_FORMATS,
        bits=frozenset({4}),
        group_sizes=frozenset({-1, 128, 256, 512, 1024}),
        n_multiple=4,
        act_dtypes=frozenset({torch.float16, torch.bfloat16}),
        priority=20,
        entry="qops.native.int_weight:native_mm",
        warmup="qops.native.int_weight:warmup",
        # One launch instead of the matmul and Inductor's SiLU-and-multiply kernel: 0.62-0.90x their
        # time at M <= 16 on five gate/up shapes (h200-2026-11-30-cdcd80d-probe-swiglu.json).
        swiglu_entry="qops.native.int_weight:native_mm_swiglu",
        swiglu_warmup="qops.native.int_weight:warmup_swiglu",
        # Ranked above triton from measurement: faster at every M <= 16 on the five shapes measured
        # side by side (H200, benchmarks/results/h200-2026-11-30-26b1d5b-int-weight.json); one launch
        # of the decode kernel serves up to 32 rows (the Llama-3-8B-shaped decode at batch 32: 1.04x
        # bf16, ...-36b2c80-decode-b32-b8.json; on Hopper 16 or 23: int_weight.decode_rows), one of the
        # GEMM the rows above to 64 (1.09-2.0x triton on the
        # five shapes at M = 33, 48, 64: ...-8d70817-probe-gemm-plans.json; with Hopper's wgmma
        # 1.02-1.41x faster again, 1.07-1.23x cuBLAS fp16 at M = 64 on the four large shapes:
        # ...-531f5ae-int-weight.json); on Hopper 64-row GEMM slices up to 96-192 rows by the weight's
        # size (int_weight.SLICED_ROWS: 1.02-2.41x triton there, ...-93edcde-probe-gemm-slices.json, ...-b5386cc-probe-slices-*.json);
        # above that it delegates to triton, so the times match.
        note="CUDA C++ via NVRTC: tensor-core W4A16 GEMV for M<=32 (Hopper: M<=16 or 23) and GEMM for M<=64 (Hopper: 64-row slices up to M=96, 160 or 192 for weights of >= 2^24, 2^25, 2^26 elements), deterministic split-K; larger M delegated to triton",
        software=_native_or_triton_missing,
    ),
    Lowering(
        name="reference_fp8",
        kernel=Kernel.REFERENCE,
        family="fp8",
        device_types=frozenset({"cpu", "cuda"}),
        formats=FP8_FORMATS,
        bits=frozenset({8}),
        act_dtypes=FLOAT_ACTS | {torch.float8_e4m3fn},
        x_scales=frozenset(X_SCALE_LAYOUTS),
        priority=0,
        entry="qops.ops.fp8:reference_mm",
        note="pure torch: fp8 weight times its scales in fp32, then matmul (fp32 accumulation)",
    ),
    Lowering(
        name="triton_fp8",
        kernel=Kernel.TRITON,
        family="fp8",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=FP8_FORMATS,
        bits=frozenset({8}),
        act_dtypes=FLOAT_ACTS | {torch.float8_e4m3fn},
        group_sizes=frozenset({-1, 32, 64, 128, 256, 512, 1024}),
        priority=10,
        entry="qops.ops.triton.fp8:triton_mm",
        note="Triton: GEMV (split-K when N is small) for M <= 4, tl.dot GEMM above; fp8 -> fp16/bf16 in registers",
        software=_triton_missing,
    ),
    Lowering(
        name="scaled_mm_fp8",
        kernel=Kernel.SCALED_MM,
        family="fp8",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 9),
        formats=FP8_FORMATS,
        bits=frozenset({8}),
        act_dtypes=frozenset({torch.float8_e4m3fn}),
        group_sizes=frozenset({-1, 128}),
        n_multiple=16,
        k_multiple=16,
        # DeepSeek-style blocks go through torch's other cuBLASLt recipe, with its own limits. Declared
        # conservatively: what benchmarks/probe_blockfp8.py verified on the H200 with torch 2.11 (bf16
        # output; N, K multiples of 128); torch itself refuses it off sm_90 and needs N, K % 16.
        block_scaling=BlockScaling(
            blocks=frozenset({(128, 128)}),
            n_multiple=128,
            k_multiple=128,
            capability_majors=frozenset({9}),
            out_dtypes=frozenset({torch.float16, torch.bfloat16}),
            x_scales=frozenset(X_SCALE_LAYOUTS),
            recipe="F.scaled_mm's BlockWise1x128 x BlockWise128x128 recipe",
            software=_blockwise_scaled_mm_missing,
        ),
        priority=20,
        entry="qops.ops.fp8:scaled_mm_lowering",
        note="cuBLASLt W8A8: torch._scaled_mm with tensor-wise or row-wise scales; F.scaled_mm with 1x128 activation "
             "and 128x128 weight block scales (sm_90); M padded to 16",
    ),
    Lowering(
        name="reference_int8_weight",
        kernel=Kernel.REFERENCE,
        family="int8_weight",
        device_types=frozenset({"cpu", "cuda"}),
        formats=INT8_WEIGHT_FORMATS,
        bits=frozenset({8}),
        act_dtypes=FLOAT_ACTS,
        priority=0,
        entry="qops.ops.int8_weight:reference_mm",
        note="pure torch: int8 -> fp32 times per-channel scales, then matmul (fp32 accumulation)",
    ),
    Lowering(
        name="triton_int8_weight",
        kernel=Kernel.TRITON,
        family="int8_weight",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=INT8_WEIGHT_FORMATS,
        bits=frozenset({8}),
        act_dtypes=FLOAT_ACTS,
        priority=10,
        entry="qops.ops.triton.int8_weight:triton_mm",
        note="Triton: 16-byte-load GEMV (optional split-K) for M <= 2, tl.dot GEMM above",
        software=_triton_missing,
    ),
    Lowering(
        name="reference_blockwise4",
        kernel=Kernel.REFERENCE,
        family="blockwise4",
        device_types=frozenset({"cpu", "cuda"}),
        formats=BLOCKWISE4_FORMATS,
        bits=frozenset({4}),
        act_dtypes=FLOAT_ACTS,
        priority=0,
        entry="qops.ops.blockwise4:reference_mm",
        note="pure torch: 4-bit codebook lookup times de-nested block absmax, then matmul (fp32 accumulation)",
    ),
    Lowering(
        name="triton_blockwise4",
        kernel=Kernel.TRITON,
        family="blockwise4",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=BLOCKWISE4_FORMATS,
        bits=frozenset({4}),
        act_dtypes=FLOAT_ACTS,
        group_sizes=BNB_BLOCKSIZES,
        priority=10,
        entry="qops.ops.triton.blockwise4:triton_mm",
        note="Triton: register-codebook (prmt) decode, on CUDA cores for M <= 2 and into a narrow tensor-core dot to M = 16 "
             "(16-row slices to 32), dequantized N-slabs + cuBLAS above; absmax de-nested in the kernels",
        software=_triton_missing,
    ),
    Lowering(
        name="native_blockwise4",
        kernel=Kernel.NATIVE,
        family="blockwise4",
        device_types=frozenset({"cuda"}),
        min_capability=(8, 0),
        formats=BLOCKWISE4_FORMATS,
        bits=frozenset({4}),
        act_dtypes=frozenset({torch.float16, torch.bfloat16}),
        group_sizes=frozenset(b for b in BNB_BLOCKSIZES if b % 64 == 0),
        k_multiple=128,
        priority=20,
        entry="qops.native.blockwise4:native_mm",
        warmup="qops.native.blockwise4:warmup",
        note="CUDA C++ via NVRTC: codes looked up a byte at a time in a shared-memory table, tensor-core GEMV "
             "for M<=16 (N*K < 2^31), 16-row slices to M=64, larger M delegated to triton; reads the tile16 layout "
             "prepared for it (1 KiB-contiguous steps) or the flat one",
        software=_native_or_triton_missing,
    ),
)

LOWERINGS_BY_NAME = {l.name: l for l in LOWERINGS}
LOWERINGS_BY_KERNEL: dict[tuple[str, Kernel], Lowering] = {(l.family, l.kernel): l for l in LOWERINGS}


def disabled_lowerings() -> frozenset[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = names - LOWERINGS_BY_NAME.keys()
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown lowerings {sorted(unknown)}; known: {sorted(LOWERINGS_BY_NAME)}")
    return names


class NoLoweringError(RuntimeError):
    pass


@dataclass(frozen=True)
class Choice:
    lowering: Lowering
    refusals: tuple[tuple[str, str], ...]  # (lowering name, reason) for each one skipped

    def explain(self) -> str:
        lines = [f"chose {self.lowering.name}"]
        lines += [f"  refused {name}: {why}" for name, why in self.refusals]
        return "\n".join(lines)


def choose(spec: WeightSpec) -> Choice:
    """The highest-priority lowering of ``spec``'s op family that serves it on this machine, with every
    refusal (of that family: the others serve other ops)."""
    family = [low for low in LOWERINGS if low.family == spec.family]
    if not family:
        raise NoLoweringError(f"no lowering serves op family {spec.family!r}; families: {sorted({low.family for low in LOWERINGS})}")
    refusals = []
    for low in sorted(family, key=lambda l: -l.priority):
        why = low.refusal(spec)
        if why is None:
            return Choice(low, tuple(refusals))
        refusals.append((low.name, why))
    reasons = "; ".join(f"{n}: {w}" for n, w in refusals)
    raise NoLoweringError(f"no lowering serves {spec}: {reasons}")


@functools.cache
def _entry(path: str):
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


def lowering_for(family: str, kernel: int, device: torch.device, who: str, facts: CallFacts | None = None) -> Lowering:
    """The lowering that id ``kernel`` names in ``family``, checked to run on ``device`` and, given the
    call's ``facts``, to serve them (the chooser never picks a lowering that refuses a weight; a
    caller naming ``kernel`` directly gets this error instead of a wrong answer from the kernel).

    Imports nothing, so fake kernels call it too and a bad ``kernel`` fails while tracing, as it
    does eagerly. Tensors on the "meta" device (shape inference, not a run) pass the device check.
    """
    try:
        low = LOWERINGS_BY_KERNEL[(family, Kernel(kernel))]
    except (KeyError, ValueError):
        known = sorted(int(k) for f, k in LOWERINGS_BY_KERNEL if f == family)
        raise ValueError(f"qops.{who}: kernel must be one of {known} for {family}, got {kernel}") from None
    if device.type != "meta" and device.type not in low.device_types:
        raise ValueError(f"qops.{who}: kernel={int(kernel)} ({low.name}) runs on {sorted(low.device_types)}, but the inputs are on {device}")
    why = low.call_refusal(facts) if facts is not None else None
    if why is not None:
        raise ValueError(f"qops.{who}: kernel={int(kernel)} ({low.name}) does not serve this call: {why}")
    return low


def implementation(family: str, kernel: int, device: torch.device, who: str, facts: CallFacts | None = None):
    """The function implementing ``family`` for lowering id ``kernel`` on ``device`` (checked as in
    :func:`lowering_for`), run with ``device`` current (:func:`_on_device`)."""
    return _on_device(_entry(lowering_for(family, kernel, device, who, facts).entry), device)


def swiglu_implementation(family: str, kernel: int, device: torch.device, who: str, facts: CallFacts | None = None):
    """The function computing ``silu(gate) * up`` of a fused ``[gate; up]`` weight for lowering id
    ``kernel`` (checked as in :func:`lowering_for`): the lowering's own gated kernel where it
    declares one, else its matmul followed by :func:`silu_mul`. Same contract as the entry, the
    result N/2 wide."""
    low = lowering_for(family, kernel, device, who, facts)
    if low.swiglu_entry is not None:
        return _on_device(_entry(low.swiglu_entry), device)
    return _on_device(functools.partial(_matmul_then_silu_mul, _entry(low.entry)), device)


def cuda_elsewhere(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device other than the current one. Triton and the native launches run on the
    current device and its stream, which need not be the inputs' one: a model split over GPUs by layer in one
    process (accelerate's ``device_map``) calls each layer with the first GPU current."""
    return device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device()


def _on_device(fn: Callable, device: torch.device) -> Callable:
    """``fn``, or where ``device`` is :func:`cuda_elsewhere`, ``fn`` called with it current."""
    return functools.partial(_call_on_device, fn, device) if cuda_elsewhere(device) else fn


def _call_on_device(fn: Callable, device: torch.device, *args, **kwargs):
    with torch.cuda.device(device):
        return fn(*args, **kwargs)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """``silu(y[..., :H]) * y[..., H:]`` for ``y (..., 2H)``, in fp32, returned in y's dtype."""
    h = y.shape[-1] // 2
    yf = y.float()
    return (torch.nn.functional.silu(yf[..., :h]) * yf[..., h:]).to(y.dtype)


def _matmul_then_silu_mul(mm, x, *args, out=None, workspace=None):
    gated = silu_mul(mm(x, *args, workspace=workspace))
    return gated if out is None else out.copy_(gated)


def warm_up(lowering: Lowering, weight) -> None:
    """Run the lowering's warm-up (kernel compile and load) for a freshly prepared weight, for the
    activation dtype the weight records (``act_dtype``: the one it was prepared for)."""
    if lowering.warmup is not None:
        _entry(lowering.warmup)(weight)


def warm_up_swiglu(lowering: Lowering, weight) -> None:
    """Run the warm-up of the lowering's gated kernel (:attr:`Lowering.swiglu_entry`) for ``weight``,
    for the activation dtype it records, as :func:`warm_up`."""
    if lowering.swiglu_warmup is not None:
        _entry(lowering.swiglu_warmup)(weight)
