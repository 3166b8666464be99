"""Safetensors checkpoints served to the layers, shard by shard (LoRAX/TGI ``Weights``).

``Weights.from_pretrained(path)`` reads the safetensors files, through
``model.safetensors.index.json`` when there is one, and ``config.json``'s ``quantization_config``
(or AutoGPTQ's ``quantize_config.json`` / AutoAWQ's ``quant_config.json``): ``quant_method`` gptq
(v1/v2, act-order), awq (gemm), compressed-tensors (pack-quantized, float-quantized), fp8 (per
tensor/channel, blocks), eetq and bitsandbytes (int8, nf4, fp4), as ``registry.CONFIG_METHODS``
lists them. Every file's header is read (and validated by the safetensors library) up front, so a
truncated or foreign file fails at once with its name. Tensors are read lazily, one slice at a
time, with positioned reads of exactly the slice's bytes (dtype conversion goes through a bounded
staging buffer): a rank never reads what it does not keep, loading holds one layer's shard at a
time, and no file is mapped into memory.

Layer methods return what ``get_linear`` / ``linear_from_weight`` take: a dense tensor, a format's
checkpoint dataclass, or an ``InputPadded`` checkpoint (act-order row shards):

- ``get_weights(prefix)``: the whole layer (replicated);
- ``get_weights_col(prefix)``: this rank's slice of N;
- ``get_weights_col_packed(prefix, block_sizes)`` and the ``_qkv`` / ``_gate_up`` forms: a fused
  tensor, each block sliced on its own and the slices concatenated;
- ``get_multi_weights_col(prefixes, dim=0)``: several layers' N-slices concatenated (q/k/v, gate/up);
- ``get_weights_row(prefix)``: this rank's slice of K.

Which scheme stores a layer comes from the config and the data: a layer the config quantizes is
read in its quantized layout when its tensors are there (``qweight``, ``weight_packed``, an fp8
``weight``, ...), and as a dense ``weight`` otherwise (GPTQ ``lm_head``, compressed-tensors
``ignore``, bitsandbytes' skipped modules).
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from ..distributed import group_rank, group_size
from ..formats.integer import n_groups_for
from . import act_order
from .base import InputPadded, QuantConfig
from .dense import BIAS_LAYOUT, DENSE, DenseConfig
from .layout import LinearScheme, Piece, ShardingError, WeightsError, join, read_pieces, require
from .registry import CONFIG_METHODS, linear_from_weight

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
INDEX_NAME = "model.safetensors.index.json"


def parse_quantization_config(qc: dict | None) -> QuantConfig:
    """``quantization_config`` -> the QuantConfig its ``quant_method`` registers (none: dense)."""
    if not qc:
        return DenseConfig()
    method = qc.get("quant_method")
    try:
        parse = CONFIG_METHODS[method]
    except KeyError:
        raise WeightsError(f"quantization_config: quant_method {method!r} is not supported by qops.layers; supported: {sorted(CONFIG_METHODS)} (or no quantization_config)") from None
    return parse(qc)


@dataclass(frozen=True)
class _Entry:
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # of the tensor's first byte in the file


def _entries(path: str) -> dict[str, _Entry]:
    """Every tensor of one safetensors file, its header validated by the safetensors library."""
    try:
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"cannot read safetensors file {path}: {e} (truncated, or not a safetensors file?)") from None
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = {}
    for name in names:
        h = header[name]
        dt = SAFETENSORS_DTYPES.get(h["dtype"])
        if dt is None:
            raise WeightsError(f"tensor {name!r} in {path} has dtype {h['dtype']}, which qops cannot read")
        out[name] = _Entry(path, tuple(h["shape"]), dt, 8 + length + h["data_offsets"][0])
    return out


# Largest staging buffer when a read converts dtype on the way (at most an eighth of the result).
STAGING_BYTES = 1 << 22


def _runs(shape: tuple[int, ...], ranges: list[tuple[int, int]]):
    """(element offset, length) of each contiguous run of ``ranges`` in a C-contiguous tensor."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    d = len(shape) - 1  # the last dimension not taken whole; runs span everything after it
    while d >= 0 and ranges[d] == (0, shape[d]):
        d -= 1
    if d < 0:
        yield 0, math.prod(shape)
        return
    length = (ranges[d][1] - ranges[d][0]) * strides[d]
    for outer in itertools.product(*(range(a, b) for a, b in ranges[:d])):
        yield sum(i * st for i, st in zip(outer, strides)) + ranges[d][0] * strides[d], length


def _read_slice(entry: _Entry, index: tuple[slice, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor[index]`` straight from the file with positioned reads: only the slice's bytes are
    read, into a fresh tensor (of ``dtype`` when given, converted through a bounded staging buffer).

    Positioned reads rather than safetensors' memory map: a view of that map keeps a private map of
    the whole file alive, and its touched pages resident, for as long as the view lives."""
    shape = entry.shape
    idx = list(index) + [slice(None)] * (len(shape) - len(index))
    ranges = []
    for s, size in zip(idx, shape):
        a, b, step = s.indices(size)
        if step != 1:
            raise ValueError("slices with a step are not supported")
        ranges.append((a, max(a, b)))
    want = dtype if dtype is not None else entry.dtype
    out = torch.empty([b - a for a, b in ranges], dtype=want)
    if out.numel() == 0:
        return out
    flat = out.view(-1)
    item = entry.dtype.itemsize
    fd = os.open(entry.file, os.O_RDONLY)
    try:
        if want == entry.dtype:
            pos = 0
            for off, n in _runs(shape, ranges):
                _pread_into(fd, flat[pos:pos + n], entry.offset + off * item, entry.file)
                pos += n
            return out
        stage = torch.empty(min(out.numel(), max(4096, min(out.numel() // 8, STAGING_BYTES // item))), dtype=entry.dtype)
        pos = filled = 0
        for off, n in _runs(shape, ranges):
            while n:
                take = min(n, stage.numel() - filled)
                _pread_into(fd, stage[filled:filled + take], entry.offset + off * item, entry.file)
                filled, off, n = filled + take, off + take, n - take
                if filled == stage.numel():
                    flat[pos:pos + filled] = stage
                    pos, filled = pos + filled, 0
        flat[pos:pos + filled] = stage[:filled]
        return out
    finally:
        os.close(fd)


def _pread_into(fd: int, t: torch.Tensor, offset: int, path: str) -> None:
    buf = memoryview(t.view(torch.uint8).numpy()).cast("B")
    nbytes, done = len(buf), 0
    while done < nbytes:
        got = os.preadv(fd, [buf[done:nbytes]], offset + done)
        if got <= 0:
            raise WeightsError(f"{path}: unexpected end of file at byte {offset + done} (the file is truncated)")
        done += got


class Weights:
    """The tensors of one or many safetensors files, for this rank of ``process_group``."""

    def __init__(
        self,
        filenames: list[str] | str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float16,
        process_group=None,
        aliases: dict[str, list[str]] | None = None,
        quantization_config: dict | QuantConfig | None = None,
        weight_map: dict[str, str] | None = None,
    ) -> None:
        if isinstance(filenames, (str, os.PathLike)):
            filenames = [filenames]
        if not filenames:
            raise WeightsError("Weights: no safetensors files given")
        self.filenames = [str(f) for f in filenames]
        self.device = torch.device(device)
        self.dtype = dtype
        self.process_group = process_group
        self.rank, self.world_size = group_rank(process_group), group_size(process_group)
        self.aliases = aliases or {}
        self.config = quantization_config if isinstance(quantization_config, QuantConfig) else parse_quantization_config(quantization_config)
        self.bytes_read = 0  # bytes sliced out of the files so far
        self.entries: dict[str, _Entry] = {}
        for path in self.filenames:
            if not os.path.exists(path):
                raise WeightsError(f"safetensors file {path} does not exist")
            for name, entry in _entries(path).items():
                if name in self.entries:
                    raise WeightsError(f"tensor {name!r} is stored twice: in {self.entries[name].file} and {path}")
                self.entries[name] = entry
        if weight_map is not None:
            for name, file in weight_map.items():
                entry = self.entries.get(name)
                if entry is None:
                    raise WeightsError(f"tensor {name!r} is listed in the index (file {file}) but no safetensors file holds it")
                if os.path.basename(entry.file) != os.path.basename(file):
                    raise WeightsError(f"tensor {name!r} is listed in the index under {file} but stored in {entry.file}")

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> "Weights":
        """The checkpoint in directory ``path``: config.json + index json or ``*.safetensors``."""
        path = str(path)
        if "quantization_config" not in kwargs:
            kwargs["quantization_config"] = read_quantization_config(path)
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
            files = sorted({os.path.join(path, f) for f in weight_map.values()})
            for f in files:
                if not os.path.exists(f):
                    raise WeightsError(f"{index} lists {os.path.basename(f)}, which is missing from {path}")
            return cls(files, weight_map=weight_map, **kwargs)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise WeightsError(f"no *.safetensors files in {path}")
        return cls(files, **kwargs)

    # The Source protocol of qops.layers.layout.

    def _resolve(self, name: str) -> str:
        if name in self.entries:
            return name
        for alias in self.aliases.get(name, ()):
            if alias in self.entries:
                return alias
        return name

    def has(self, name: str) -> bool:
        return self._resolve(name) in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype_of(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def where(self, name: str) -> str:
        entry = self.entries.get(self._resolve(name))
        return entry.file if entry else f"{len(self.filenames)} file(s) ({os.path.dirname(self.filenames[0]) or '.'})"

    def names_under(self, prefix: str) -> list[str]:
        return sorted(n for n in self.entries if n.startswith(prefix))

    def _entry(self, name: str) -> _Entry:
        require(self, name)
        return self.entries[self._resolve(name)]

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype | None = None,
             view: tuple[tuple[int, ...], torch.dtype] | None = None) -> torch.Tensor:
        entry = self._entry(name)
        if view is not None:
            if math.prod(view[0]) * view[1].itemsize != math.prod(entry.shape) * entry.dtype.itemsize:
                raise WeightsError(f"tensor {name!r} in {entry.file}: {entry.dtype} {entry.shape} cannot be read as {view[1]} {view[0]}")
            entry = _Entry(entry.file, tuple(view[0]), view[1], entry.offset)
        t = _read_slice(entry, index, dtype)
        self.bytes_read += t.numel() * entry.dtype.itemsize
        return t

    # TGI-style access to single tensors.

    def _convert(self, name: str, to_dtype: bool) -> torch.dtype | None:
        dt = self.dtype_of(name)
        return self.dtype if to_dtype and dt.is_floating_point and dt.itemsize >= 2 else None

    def get_shape(self, name: str) -> tuple[int, ...]:
        return self.shape(name)

    def get_tensor(self, name: str, to_dtype: bool = True) -> torch.Tensor:
        return self.read(name, (), self._convert(name, to_dtype)).to(self.device)

    def get_partial_sharded(self, name: str, dim: int, to_dtype: bool = True) -> torch.Tensor:
        """Blocks of ceil(size / world_size) along ``dim``; the last rank's may be short or empty."""
        shape = self.shape(name)
        size = shape[dim]
        block = -(-size // self.world_size)
        start = min(size, self.rank * block)
        stop = min(size, start + block)
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, stop)
        return self.read(name, tuple(index), self._convert(name, to_dtype)).to(self.device)

    def get_sharded(self, name: str, dim: int, to_dtype: bool = True) -> torch.Tensor:
        size = self.shape(name)[dim]
        if size % self.world_size:
            raise ShardingError(f"cannot split {name!r} along dim {dim} (size {size}) evenly for world size {self.world_size}")
        return self.get_partial_sharded(name, dim, to_dtype)

    def get_packed_sharded(self, name: str, dim: int, block_sizes: int | list[int], to_dtype: bool = True) -> torch.Tensor:
        """A fused tensor whose ``dim`` concatenates blocks: each block is split on its own."""
        shape = self.shape(name)
        parts = []
        for start, stop in _block_shards(name, shape[dim], block_sizes, self.rank, self.world_size):
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, stop)
            parts.append(self.read(name, tuple(index), self._convert(name, to_dtype)))
        return torch.cat(parts, dim=dim).to(self.device)

    # Layer weights.

    @property
    def quantize(self) -> str | None:
        """The LoRAX/TGI quantize string of this checkpoint's quantized layers."""
        return self.config.quantize

    def scheme_for(self, prefix: str) -> LinearScheme:
        scheme = self.config.scheme(prefix)
        if scheme is not None and scheme.stores(self, prefix):
            return scheme.specialize(self, prefix)
        if DENSE.stores(self, prefix):
            return DENSE
        schemes = ([scheme] if scheme is not None else []) + [DENSE]
        keys = list(dict.fromkeys(join(prefix, s.key) for s in schemes))  # fp8 and dense both key on "weight"
        weight = join(prefix, DENSE.key)
        why = ""
        if self.has(weight):
            why = f"; {weight!r} has dtype {self.dtype_of(weight)}, which no layout for it ({', '.join(s.format for s in schemes)}) reads"
        near = self.names_under(prefix + ".")[:12]
        raise WeightsError(f"no linear layer under {prefix!r}: expected {' or '.join(map(repr, keys))} in {self.where(keys[0])}{why}; tensors under it: {near}")

    def _read(self, scheme, pieces, k_range, k, **kw):
        return scheme.read(self, pieces, k_range, k, world=self.world_size, rank=self.rank, dtype=self.dtype, device=self.device, **kw)

    def get_weights(self, prefix: str):
        scheme = self.scheme_for(prefix)
        k, n = scheme.dims(self, prefix)
        return scheme.make(self._read(scheme, [Piece(prefix, 0, n, n)], (0, k), k), k, n, scheme.group_size)

    def get_weights_col_packed(self, prefix: str, block_sizes: int | list[int]):
        scheme = self.scheme_for(prefix)
        k, n = scheme.dims(self, prefix)
        pieces = [Piece(prefix, a, b, n) for a, b in _block_shards(prefix, n, block_sizes, self.rank, self.world_size)]
        t = self._read(scheme, pieces, (0, k), k)
        return scheme.make(t, k, sum(p.n1 - p.n0 for p in pieces), scheme.group_size)

    def get_weights_col(self, prefix: str):
        return self.get_weights_col_packed(prefix, 1)

    def linear_dims(self, prefix: str) -> tuple[int, int]:
        """(K in_features, N out_features) of the whole linear layer under ``prefix``, from the stored
        shapes (and the small shape records some formats keep), not from its weights' data."""
        return self.scheme_for(prefix).dims(self, prefix)

    def get_weights_col_packed_qkv(self, prefix: str, num_heads: int, num_key_value_heads: int):
        _, n = self.linear_dims(prefix)
        return self.get_weights_col_packed(prefix, qkv_sizes(prefix, n, num_heads, num_key_value_heads, self.world_size))

    def get_weights_col_packed_gate_up(self, prefix: str):
        return self.get_weights_col_packed(prefix, 2)

    def get_multi_weights_col(self, prefixes: list[str], dim: int = 0):
        if dim != 0:
            raise ValueError(f"get_multi_weights_col: layers concatenate along their output features (dim=0), got dim={dim}")
        schemes = [self.scheme_for(p) for p in prefixes]
        if any(s != schemes[0] for s in schemes[1:]):
            raise WeightsError(f"cannot fuse {prefixes}: they are stored in different schemes {[type(s).__name__ for s in schemes]}")
        scheme = schemes[0]
        dims = [scheme.dims(self, p) for p in prefixes]
        k = dims[0][0]
        if any(d[0] != k for d in dims):
            raise WeightsError(f"cannot fuse {prefixes}: their in_features differ ({[d[0] for d in dims]})")
        pieces = []
        for p, (_, n) in zip(prefixes, dims):
            (a, b), = _block_shards(p, n, 1, self.rank, self.world_size)
            pieces.append(Piece(p, a, b, n))
        t = self._read(scheme, pieces, (0, k), k)
        return scheme.make(t, k, sum(p.n1 - p.n0 for p in pieces), scheme.group_size)

    def get_weights_row(self, prefix: str):
        scheme = self.scheme_for(prefix)
        k, n = scheme.dims(self, prefix)
        if k % self.world_size:
            raise ShardingError(f"cannot split {prefix!r} (K={k} in_features) evenly for world size {self.world_size}")
        k0, k1 = self.rank * k // self.world_size, (self.rank + 1) * k // self.world_size
        pieces = [Piece(prefix, 0, n, n)]
        g_name = scheme.layout.g_idx
        if self.world_size > 1 and g_name and scheme.group_size != -1 and self.has(join(prefix, g_name)):
            g_idx = self.read(join(prefix, g_name), (slice(None),))
            if g_idx.shape == (k,) and not torch.equal(g_idx.long(), torch.arange(k) // scheme.group_size):
                t = self._read(scheme, pieces, (k0, k1), k, full_k_blocks=True)
                t, k_rt, g_new, pad = act_order.localize(t, scheme.layout, k_local=k1 - k0, n_groups=n_groups_for(k, scheme.group_size),
                                                         group_size=scheme.group_size, bits=scheme.bits)
                c = scheme.make(t, k_rt, n, g_new)
                return InputPadded(c, pad) if pad else c
        t = self._read(scheme, pieces, (k0, k1), k)
        if g_name and t.get(g_name) is not None and scheme.group_size != -1:
            # Contiguous groups: the shard's rows start at group k0 // G (k0 is on a group boundary).
            t[g_name] = t[g_name] - k0 // scheme.group_size
        return scheme.make(t, k1 - k0, n, scheme.group_size)

    # Biases: sliced like the layer's N.

    def _bias(self, pieces: list[Piece]) -> torch.Tensor:
        return read_pieces(self, BIAS_LAYOUT, pieces, (0, 0), 0, world=self.world_size, rank=self.rank,
                           dtype=self.dtype, device=self.device)["bias"]

    def get_bias(self, prefix: str) -> torch.Tensor:
        n = self.shape(join(prefix, "bias"))[0]
        return self._bias([Piece(prefix, 0, n, n)])

    def get_bias_col_packed(self, prefix: str, block_sizes: int | list[int]) -> torch.Tensor:
        n = self.shape(join(prefix, "bias"))[0]
        return self._bias([Piece(prefix, a, b, n) for a, b in _block_shards(prefix, n, block_sizes, self.rank, self.world_size)])

    def get_bias_multi_col(self, prefixes: list[str]) -> torch.Tensor:
        pieces = []
        for p in prefixes:
            n = self.shape(join(p, "bias"))[0]
            (a, b), = _block_shards(p, n, 1, self.rank, self.world_size)
            pieces.append(Piece(p, a, b, n))
        return self._bias(pieces)

    def linear(self, weight, bias: torch.Tensor | None = None):
        """The module for a weight these Weights returned, for activations of ``self.dtype``."""
        return linear_from_weight(weight, bias, dtype=self.dtype)


def read_quantization_config(path: str) -> dict | None:
    """``quantization_config`` of the model in ``path``, or the AutoGPTQ/AutoAWQ side file."""
    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        try:
            with open(config) as f:
                qc = json.load(f).get("quantization_config")
        except json.JSONDecodeError as e:
            raise WeightsError(f"{config}: invalid JSON ({e})") from None
        if qc:
            return qc
    for side, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        p = os.path.join(path, side)
        if os.path.exists(p):
            with open(p) as f:
                qc = json.load(f)
            return {"quant_method": method, **qc}
    return None


def _block_shards(name: str, n: int, block_sizes: int | list[int], rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's value range of each block of a fused dimension of size ``n``."""
    if isinstance(block_sizes, int):
        if n % block_sizes:
            raise ShardingError(f"{name!r}: N={n} does not split into {block_sizes} equal blocks")
        block_sizes = [n // block_sizes] * block_sizes
    if sum(block_sizes) != n:
        raise ShardingError(f"{name!r}: block sizes {block_sizes} do not add up to N={n}")
    out, start = [], 0
    for size in block_sizes:
        if size % world:
            raise ShardingError(f"cannot split {name!r} (a block of {size} of N={n}) evenly for world size {world}")
        shard = size // world
        out.append((start + rank * shard, start + (rank + 1) * shard))
        start += size
    return out


def qkv_sizes(prefix: str, n: int, num_heads: int, num_key_value_heads: int, world: int) -> list[int]:
    """Block sizes [q, k, v] of a fused qkv projection; heads must divide over the world size."""
    heads = num_heads + 2 * num_key_value_heads
    if n % heads:
        raise WeightsError(f"{prefix!r}: N={n} is not (num_heads + 2*num_key_value_heads) = {heads} heads of equal size")
    for what, h in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads)):
        if h % world:
            raise ShardingError(f"cannot split {prefix!r}: {what}={h} is not a multiple of world size {world}")
    head_size = n // heads
    return [num_heads * head_size, num_key_value_heads * head_size, num_key_value_heads * head_size]
