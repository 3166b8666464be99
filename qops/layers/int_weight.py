"""Integer weight-only linear layers (GPTQ, AWQ, compressed-tensors pack-quantized).

The on-disk tensors of each format, described per dimension (``qops/layers/layout.py``) so that
sharding follows the packing; K = in_features, N = out_features, b = bits, G = group_size:

=================== =============================================== ===============================
format              tensor: dims                                    column split (N) / row split (K)
=================== =============================================== ===============================
gptq                qweight (K packed b-bit, N) int32               N free / K on words: K/w*b % 32
                    qzeros  (K in groups of G, N packed b-bit)      N on words: N/w*b % 32 / groups
                    scales  (K in groups of G, N)                   N free / K on groups: K/w % G
                    g_idx   (K,) optional                           whole / rank's rows
awq (gemm)          qweight (K, N packed 8 per word, interleaved)   N/w % 8 / K free
                    qzeros, scales (K in groups of G, N ...)        N/w % 8 / K on groups
compressed-tensors  weight_packed (N, K packed b-bit) int32         N free / K on words
(pack-quantized)    weight_scale (N, K in groups of G)              N free / K on groups
                    weight_zero_point (N packed b-bit, groups)      N on words / K on groups
                    weight_shape [N, K]; weight_g_idx (K,) opt.     rewritten / rank's rows
=================== =============================================== ===============================

(compressed-tensors configs, which may mix these layers with fp8 ones, are parsed in
``compressed_tensors.py``.)

Act-order row-parallel shards (a non-trivial ``g_idx``) do not split groups: each rank reads its
rows in checkpoint order, its ``g_idx`` and every group's scales and zeros, and rewrites that into
an act-order layer of its own (``act_order.py``) -- the same op and lowering, no slow path.

GPTQ weights given as LoRAX/TGI's 7-tuple ``(qweight, qzeros, scales, g_idx, bits, groupsize,
use_exllama)`` are read as **v1** checkpoints (stored zero = z - 1), which is what TGI's GPTQ
kernels assume for that tuple; pass a ``GPTQCheckpoint`` with ``version="v2"`` for v2 zeros.
``use_exllama`` is ignored: the lowering is chosen when the weight is prepared.

Preparation runs column chunk by column chunk for large layers (``prepare``), so loading a layer
never holds more than a fraction of its dense size in unpacking temporaries.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import FORMATS
from ..formats.awq import AWQCheckpoint
from ..formats.compressed_tensors import CompressedTensorsCheckpoint
from ..formats.gptq import GPTQCheckpoint, version_from_config
from ..formats.integer import check_bits, check_group_size, check_tensor_arg, n_groups_for
from ..lowerings import Kernel, warm_up_swiglu
from ..ops.int_weight import SLAB_COLUMNS, IntWeight, qweight_form_for, to_column_slabs, with_lowering
from . import act_order
from .base import InputPadded, LinearMethod, QuantConfig, QuantLinear
from .layout import FLOAT, INT, Dim, DictSource, LinearLayout, LinearScheme, Piece, TensorLayout, WeightsError, checked, join, read_pieces, require


@dataclass(frozen=True)
class GPTQScheme(LinearScheme):
    bits: int
    group_size: int
    version: str = "v1"
    key = "qweight"
    format = "gptq"

    @property
    def layout(self):
        b, g = self.bits, self.group_size
        return LinearLayout(
            tensors=(
                TensorLayout("qweight", (Dim("k", bits=b), Dim("n")), torch.int32),
                TensorLayout("qzeros", (Dim("k", block=g), Dim("n", bits=b)), torch.int32),
                TensorLayout("scales", (Dim("k", block=g), Dim("n")), FLOAT),
                TensorLayout("g_idx", (Dim("k"),), INT, optional=True),
            ),
            g_idx="g_idx",
        )

    def dims(self, source, prefix):
        qweight = source.shape(join(prefix, "qweight"))
        if len(qweight) != 2:
            raise WeightsError(f"tensor {join(prefix, 'qweight')!r} in {source.where(join(prefix, 'qweight'))} must be 2-D, got shape {qweight}")
        g_name = join(prefix, "g_idx")
        if source.has(g_name):
            return source.shape(g_name)[0], qweight[1]
        if qweight[0] * 32 % self.bits:
            raise WeightsError(f"{prefix}: without g_idx, K cannot be inferred from {qweight[0]} rows of {self.bits}-bit values")
        return qweight[0] * 32 // self.bits, qweight[1]

    def make(self, t, k, n, group_size):
        return GPTQCheckpoint(qweight=t["qweight"], qzeros=t["qzeros"], scales=t["scales"], g_idx=t["g_idx"],
                              bits=self.bits, group_size=group_size, in_features=k, version=self.version)


@dataclass(frozen=True)
class AWQScheme(LinearScheme):
    group_size: int
    bits: int = 4
    key = "qweight"
    format = "awq"

    @property
    def layout(self):
        g = self.group_size
        return LinearLayout(
            tensors=(
                TensorLayout("qweight", (Dim("k"), Dim("n", bits=4)), torch.int32),
                TensorLayout("qzeros", (Dim("k", block=g), Dim("n", bits=4)), torch.int32),
                TensorLayout("scales", (Dim("k", block=g), Dim("n")), FLOAT),
            )
        )

    def dims(self, source, prefix):
        qweight = source.shape(join(prefix, "qweight"))
        if len(qweight) != 2:
            raise WeightsError(f"tensor {join(prefix, 'qweight')!r} in {source.where(join(prefix, 'qweight'))} must be 2-D, got shape {qweight}")
        return qweight[0], qweight[1] * 8

    def make(self, t, k, n, group_size):
        return AWQCheckpoint(qweight=t["qweight"], qzeros=t["qzeros"], scales=t["scales"], group_size=group_size)


@dataclass(frozen=True)
class CompressedTensorsScheme(LinearScheme):
    bits: int
    group_size: int
    symmetric: bool
    key = "weight_packed"
    format = "compressed-tensors"

    @property
    def layout(self):
        b, g = self.bits, self.group_size
        return LinearLayout(
            tensors=(
                TensorLayout("weight_packed", (Dim("n"), Dim("k", bits=b)), torch.int32),
                TensorLayout("weight_scale", (Dim("n"), Dim("k", block=g)), FLOAT),
                TensorLayout("weight_zero_point", (Dim("n", bits=b), Dim("k", block=g)), torch.int32, optional=self.symmetric),
                TensorLayout("weight_g_idx", (Dim("k"),), INT, optional=True),
            ),
            g_idx="weight_g_idx",
        )

    def dims(self, source, prefix):
        name = join(prefix, "weight_shape")
        require(source, name)
        if source.shape(name) != (2,) or source.dtype_of(name).is_floating_point:
            raise WeightsError(f"tensor {name!r} in {source.where(name)} must be an integer tensor of shape (2,) = [N, K], got {source.dtype_of(name)} {source.shape(name)}")
        n, k = (int(v) for v in source.read(name, (slice(None),)).tolist())
        return k, n

    def make(self, t, k, n, group_size):
        return CompressedTensorsCheckpoint(
            weight_packed=t["weight_packed"], weight_scale=t["weight_scale"],
            weight_shape=torch.tensor([n, k], dtype=torch.int64), weight_zero_point=t["weight_zero_point"],
            weight_g_idx=t["weight_g_idx"], bits=self.bits, group_size=group_size,
        )


# Checkpoint dataclass -> (its scheme, K, N): how a checkpoint in memory is re-read in chunks.
CHECKPOINT_SCHEMES = {
    GPTQCheckpoint: lambda c: (GPTQScheme(c.bits, c.group_size, c.version), c.in_features, c.out_features),
    AWQCheckpoint: lambda c: (AWQScheme(c.group_size, c.bits), c.in_features, c.out_features),
    CompressedTensorsCheckpoint: lambda c: (
        CompressedTensorsScheme(c.bits, c.group_size, c.weight_zero_point is None), c.in_features, c.out_features),
}

# Target of one preparation chunk, in weight elements. Unpacking and repacking cost up to ~50 bytes
# of temporaries per element (3-bit; ~18 for 4-bit), so chunks of N*K/64 elements keep them under a
# byte per element of the layer, half its fp16 size (measured in tests/test_loader.py).
CHUNK_MIN_ELEMENTS = 1 << 16
CHUNK_FRACTION = 64


def _chunk_columns(k: int, n: int, k_budget: int) -> int:
    """Columns per chunk: N * k_budget / CHUNK_FRACTION elements (k_budget: the K the memory
    budget is counted in -- the activations' K for an act-order shard padded to more rows)."""
    target = max(CHUNK_MIN_ELEMENTS, n * k_budget // CHUNK_FRACTION)
    return max(32, target // max(k, 1) // 32 * 32)


def _tensor_fields(c) -> dict[str, torch.Tensor]:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if isinstance(getattr(c, f.name), torch.Tensor)}


def prepare(checkpoint, *, dtype: torch.dtype | None = None, input_pad: int = 0) -> IntWeight:
    """``FORMATS[format].prepare(checkpoint)``, run over column chunks of large layers.

    The result is the same runtime weight (bit for bit) as one whole preparation; a layer whose
    chunks disagree on the zero encoding (some symmetric, some not) is prepared whole instead. The
    chunks are written in the qweight form the lowering will read (column slabs for the native one:
    chunks are whole slabs), so no second whole-layer copy is made to change the form.
    """
    scheme, k, n = CHECKPOINT_SCHEMES[type(checkpoint)](checkpoint)
    fmt = FORMATS[scheme.format]
    cols = _chunk_columns(k, n, k - input_pad)
    if cols >= n:
        return fmt.prepare(checkpoint, dtype=dtype)
    fields = _tensor_fields(checkpoint)
    source = DictSource(fields, origin=f"the {type(checkpoint).__name__}")
    first = qweight = scales = None
    shared = None  # the checkpoint tensor the runtime qweight is (GPTQ without act-order), if any
    slabs = False  # qweight assembled in column slabs (chunks of whole 32-column slabs)
    zeros = []
    for n0 in range(0, n, cols):
        n1 = min(n, n0 + cols)
        t = read_pieces(source, scheme.layout, [Piece("", n0, n1, n)], (0, k), k)
        w = fmt.prepare(scheme.make(t, k, n1 - n0, scheme.group_size), dtype=dtype, choose_lowering=False)
        if first is None:
            first = w
            rows = w.qweight.shape[0]
            slabs = qweight_form_for(dataclasses.replace(w, out_features=n), scheme.format, dtype) == "slabs"
            if not slabs:
                shared = next((v for v in fields.values() if v.shape == (rows, n) and w.qweight.data_ptr() == v[:, n0:n1].data_ptr()), None)
            if shared is None:
                qweight = w.qweight.new_empty((n // SLAB_COLUMNS, rows, SLAB_COLUMNS) if slabs else (rows, n))
            scales = w.scales.new_empty((w.scales.shape[0], n))
        elif not _same_encoding(first, w):
            return fmt.prepare(checkpoint, dtype=dtype)
        if shared is not None:
            if w.qweight.data_ptr() != shared[:, n0:n1].data_ptr():
                return fmt.prepare(checkpoint, dtype=dtype)
        elif slabs:
            qweight[n0 // SLAB_COLUMNS : n1 // SLAB_COLUMNS] = to_column_slabs(w.qweight)
        else:
            qweight[:, n0:n1] = w.qweight
        scales[:, n0:n1] = w.scales
        zeros.append(w.qzeros)
    qzeros = None if first.qzeros is None else torch.cat(zeros, dim=1)
    whole = dataclasses.replace(first, qweight=shared if shared is not None else qweight, scales=scales, qzeros=qzeros, out_features=n)
    return with_lowering(whole, scheme.format, dtype)


def _same_encoding(a: IntWeight, b: IntWeight) -> bool:
    if (a.qzeros is None) != (b.qzeros is None) or a.zero_offset != b.zero_offset:
        return False
    if (a.act_perm is None) != (b.act_perm is None):
        return False
    return a.act_perm is None or torch.equal(a.act_perm, b.act_perm)


class IntWeightLinear(QuantLinear):
    """``y = x @ W.T + bias`` through ``torch.ops.qops.mm_int_weight`` on a prepared integer weight
    (``mm_int_weight_out`` with a workspace, :meth:`QuantLinear.use_workspace`).

    Buffers: ``qweight``, ``scales``, ``qzeros`` (None when symmetric), ``act_perm`` (None without
    act-order), ``bias``; the static facts (bits, group size, zero offset, lowering) are ints.
    ``input_pad`` zero columns are appended to ``x`` first (act-order row shards).
    """

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None = None, *, input_pad: int = 0) -> None:
        super().__init__()
        if bias is not None and tuple(bias.shape) != (weight.out_features,):
            raise ValueError(f"IntWeightLinear: bias must have shape ({weight.out_features},), got {tuple(bias.shape)}")
        self.in_features = weight.in_features - input_pad
        self.out_features = weight.out_features
        self.input_pad = input_pad
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.zero_offset = weight.zero_offset
        self.kernel = int(weight.kernel)
        self.choice = weight.choice
        self.act_dtype = weight.act_dtype
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("qzeros", weight.qzeros)
        self.register_buffer("act_perm", weight.act_perm)
        self.register_buffer("bias", bias)

    @classmethod
    def from_checkpoint(cls, checkpoint, bias=None, *, dtype=None) -> "IntWeightLinear":
        pad = 0
        if isinstance(checkpoint, InputPadded):
            checkpoint, pad = checkpoint.checkpoint, checkpoint.pad
        if type(checkpoint) not in CHECKPOINT_SCHEMES:
            raise TypeError(f"IntWeightLinear.from_checkpoint: expected one of {sorted(t.__name__ for t in CHECKPOINT_SCHEMES)}, got {type(checkpoint).__name__}")
        if bias is not None and dtype is not None:
            bias = bias.to(dtype)
        return cls(prepare(checkpoint, dtype=dtype, input_pad=pad), bias, input_pad=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_pad:
            x = F.pad(x, (0, self.input_pad))
        args = (x, self.qweight, self.scales, self.qzeros, self.act_perm, self.bias,
                self.in_features + self.input_pad, self.bits, self.group_size, self.zero_offset, self.kernel)
        out_args = self._out_args(x)
        if out_args is None:
            return torch.ops.qops.mm_int_weight(*args)
        torch.ops.qops.mm_int_weight_out(*args, *out_args)
        return out_args[0]

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this fused ``[gate; up]`` layer through ``mm_int_weight_swiglu``
        (``_out`` with a workspace): one kernel where the lowering has a gated one. With a bias, or
        an odd ``out_features``, the product and then SiLU-and-multiply."""
        if self.bias is not None or self.out_features % 2:
            return super().forward_swiglu(x)
        if self.input_pad:
            x = F.pad(x, (0, self.input_pad))
        args = (x, self.qweight, self.scales, self.qzeros, self.act_perm, self.in_features + self.input_pad,
                self.bits, self.group_size, self.zero_offset, self.kernel)
        out_args = self._out_args(x, self.out_features // 2)
        if out_args is None:
            return torch.ops.qops.mm_int_weight_swiglu(*args)
        torch.ops.qops.mm_int_weight_swiglu_out(*args, *out_args)
        return out_args[0]

    def prepare_swiglu(self) -> None:
        if self.choice is not None:
            warm_up_swiglu(self.choice.lowering, self.prepared())

    def prepared(self) -> IntWeight:
        """The runtime weight this layer holds (its buffers, not copies), as ``prepare`` returned it."""
        return IntWeight(self.qweight, self.scales, self.qzeros, self.act_perm, self.in_features + self.input_pad, self.out_features,
                         self.bits, self.group_size, self.zero_offset, Kernel(self.kernel), self.choice, self.act_dtype)

    def extra_repr(self) -> str:
        low = self.choice.lowering.name if self.choice is not None else f"kernel={self.kernel}"
        pad = f", input_pad={self.input_pad}" if self.input_pad else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, group_size={self.group_size}, {low}{pad}"


def _row_shard_from_tuple(scheme, tensors: dict, k_local: int):
    """A TGI-style row shard: local rows with their g_idx, every group's scales and zeros."""
    n_groups = tensors["scales"].shape[0]
    t, k_rt, g_new, pad = act_order.localize(tensors, scheme.layout, k_local=k_local, n_groups=n_groups,
                                              group_size=scheme.group_size, bits=scheme.bits)
    n = tensors["scales"].shape[1]
    c = scheme.make(t, k_rt, n, g_new)
    return InputPadded(c, pad) if pad else c


def _check_tuple(quantize: str, qweight, qzeros, scales, bits, groupsize, g_idx=None) -> None:
    """A TGI tuple's static arguments and tensor ranks, checked before K, N and the group count are
    derived from them (the format checks the shapes once the checkpoint is built)."""
    who = f"get_linear(quantize={quantize!r})"
    check_bits(bits, FORMATS[quantize].bits, who=who)
    check_group_size(groupsize, who=who)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_tensor_arg(t, name, 2, who=who)
    if g_idx is not None:
        check_tensor_arg(g_idx, "g_idx", 1, who=who)


class GPTQMethod(LinearMethod):
    quantize = "gptq"
    accepts = "a GPTQCheckpoint or the tuple (qweight, qzeros, scales, g_idx, bits, groupsize, use_exllama) (v1 zeros)"

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        self.check_no_extras(fan_in_fan_out, weight_scale, input_scale)
        inner = weight.checkpoint if isinstance(weight, InputPadded) else weight
        if isinstance(inner, GPTQCheckpoint):
            return IntWeightLinear.from_checkpoint(weight, bias, dtype=dtype)
        if not (isinstance(weight, tuple) and len(weight) == 7):
            raise self.refuse(weight)
        qweight, qzeros, scales, g_idx, bits, groupsize, _use_exllama = weight
        _check_tuple(self.quantize, qweight, qzeros, scales, bits, groupsize, g_idx)
        scheme = GPTQScheme(bits, groupsize, "v1")
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
        k, n = scheme.dims(DictSource(tensors, origin="the gptq tuple"), "")
        if g_idx is not None and groupsize != -1 and scales.shape[0] > n_groups_for(k, groupsize):
            c = _row_shard_from_tuple(scheme, tensors, k)
        else:
            c = scheme.make(tensors, k, n, scheme.group_size)
        return IntWeightLinear.from_checkpoint(c, bias, dtype=dtype)


class AWQMethod(LinearMethod):
    quantize = "awq"
    accepts = "an AWQCheckpoint or the tuple (qweight, qzeros, scales, g_idx, bits, groupsize, use_exllama) (g_idx ignored)"

    def linear(self, weight, bias, *, fan_in_fan_out, weight_scale, input_scale, dtype):
        self.check_no_extras(fan_in_fan_out, weight_scale, input_scale)
        if isinstance(weight, tuple) and len(weight) == 7:
            qweight, qzeros, scales, _g_idx, bits, groupsize, _ = weight
            _check_tuple(self.quantize, qweight, qzeros, scales, bits, groupsize)
            weight = AWQCheckpoint(qweight=qweight, qzeros=qzeros, scales=scales, group_size=groupsize, bits=bits)
        if not isinstance(weight, AWQCheckpoint):
            raise self.refuse(weight)
        return IntWeightLinear.from_checkpoint(weight, bias, dtype=dtype)


GPTQ_METHOD, AWQ_METHOD = GPTQMethod(), AWQMethod()


def _config_int(qc: dict, *keys: str, check, who: str, default: int | None = None, where: str = "quantization_config") -> int:
    """The first of ``keys`` set in ``qc`` (else ``default``), validated by the format's ``check``
    before anything computes with it: a bad value is a WeightsError naming its config key."""
    for key in keys:
        if qc.get(key) is not None:
            checked(check, qc[key], who=f"{who}: {where} {key!r}")
            return qc[key]
    if default is not None:
        return default
    raise WeightsError(f"{who}: {where} needs {' or '.join(map(repr, keys))}")


@dataclass(frozen=True)
class GPTQConfig(QuantConfig):
    bits: int
    group_size: int
    version: str
    desc_act: bool = False
    quantize = "gptq"

    @classmethod
    def from_dict(cls, qc: dict) -> "GPTQConfig":
        try:
            version = version_from_config(qc)
        except ValueError as e:
            raise WeightsError(str(e)) from None
        return cls(bits=_config_int(qc, "bits", check=check_bits, who="gptq"),
                   group_size=_config_int(qc, "group_size", check=check_group_size, who="gptq", default=-1),
                   version=version, desc_act=bool(qc.get("desc_act", False)))

    def scheme(self, prefix):
        return GPTQScheme(self.bits, self.group_size, self.version)


AWQ_VERSIONS = ("gemm",)


@dataclass(frozen=True)
class AWQConfig(QuantConfig):
    group_size: int
    quantize = "awq"

    @classmethod
    def from_dict(cls, qc: dict) -> "AWQConfig":
        version = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if version not in AWQ_VERSIONS:
            raise WeightsError(f"awq: version {version!r} is not supported; supported: {list(AWQ_VERSIONS)} (GEMV and other layouts differ)")
        _config_int(qc, "bits", "w_bit", check=functools.partial(check_bits, allowed=FORMATS["awq"].bits), who="awq", default=4)
        if not qc.get("zero_point", True):
            raise WeightsError("awq: zero_point=false checkpoints are not supported (the GEMM layout stores zeros)")
        return cls(group_size=_config_int(qc, "group_size", "q_group_size", check=check_group_size, who="awq", default=-1))

    def scheme(self, prefix):
        return AWQScheme(self.group_size)


def compressed_tensors_pack(group: dict, who: str) -> LinearScheme:
    """compressed-tensors ``pack-quantized`` (integer, weight-only) weights of one config group."""
    if group.get("input_activations"):
        raise WeightsError(f"{who}: pack-quantized layers are weight-only; quantized input activations are not supported")
    weights = group["weights"]
    if weights.get("type", "int") != "int":
        raise WeightsError(f"{who}: pack-quantized weights must have type 'int', got {weights.get('type')!r}")
    strategy = weights.get("strategy", "group")
    if strategy == "group":
        group_size = _config_int(weights, "group_size", check=check_group_size, who=who, where="weights")
    elif strategy == "channel":
        group_size = -1
    else:
        raise WeightsError(f"{who}: weight strategy {strategy!r} is not supported; supported: ['group', 'channel']")
    bits = _config_int(weights, "num_bits", check=functools.partial(check_bits, allowed=FORMATS["compressed-tensors"].bits), who=who, where="weights")
    return CompressedTensorsScheme(bits=bits, group_size=group_size, symmetric=bool(weights.get("symmetric", True)))
