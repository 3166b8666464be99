"""Which parts of a linear layer's checkpoint tensors a shard needs, and reading exactly those.

A linear layer ``y = x @ W.T`` has two axes: ``n`` (out_features, N) and ``k`` (in_features, K).
Each dimension of each checkpoint tensor runs along one of them, in one of three ways
(:class:`Dim`):

- plainly: index i is value i of the axis (``scales`` dim 1 runs along n);
- packed: ``bits``-bit values as a little-endian bit stream in int32 words, so index j holds the
  values whose stream bits fall in ``[32*j, 32*j+32)`` (GPTQ ``qweight`` dim 0 runs along k);
- blocked: index j holds one entry per ``block`` consecutive values, ``block == -1`` meaning one
  entry for the whole axis (GPTQ ``scales`` dim 0 runs along k in groups of ``group_size``).

A shard is a set of value ranges along n (column parallel: one range per fused block or per
concatenated prefix) or one range along k (row parallel). A range maps to an index range of each
dimension only at legal boundaries: a packed dimension splits on whole words, a blocked one on whole
blocks; a range may end inside a word or block only at the end of the axis and only as the last
piece of a concatenation. Anything else is a :class:`ShardingError` naming the tensor, the
dimension and the world size. Reading slices before materializing (safetensors ``get_slice``), so a
rank reads its shard and never the whole tensor.

This module knows nothing about any particular format: each one describes its tensors as a
:class:`LinearLayout` (see ``qops/layers/int_weight.py`` and ``dense.py``).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class WeightsError(ValueError):
    """A checkpoint is missing a tensor, or holds one of the wrong dtype or shape, or is unreadable."""


def checked(check: Callable[..., None], *args, **kwargs) -> None:
    """Run a format's check (``qops.formats``), its TypeError / ValueError re-raised as a
    WeightsError with the same message: the ``who`` passed names the tensor or config key."""
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise WeightsError(str(e)) from None


class ShardingError(ValueError):
    """A tensor cannot be split for the requested world size at a legal boundary."""


@dataclass(frozen=True)
class Dim:
    axis: str | None = None  # "n", "k", or None (never split)
    bits: int = 0  # > 0: values of this many bits packed into int32 words
    block: int = 0  # > 0: one entry per `block` values; -1: one entry for the whole axis
    scale: int = 0  # > 0: `scale` entries per value (interleaved byte layouts)
    align: int = 0  # > 0: splits must also fall on multiples of `align` values (layout tiles)

    def length(self, total: int) -> int | None:
        """The tensor's size along this dimension for an axis of ``total`` values (None: any)."""
        if self.axis is None:
            return None
        if self.block == -1:
            return 1
        if self.block:
            return -(-total // self.block)
        if self.bits:
            return -(-total * self.bits // 32)
        if self.scale:
            return total * self.scale
        return total

    def describe(self, total: int) -> str:
        ax = {"n": "N", "k": "K"}[self.axis]
        if self.align:
            return f"{ax}={total} in tiles of {self.align}"
        if self.block == -1:
            return f"one entry for all {ax}={total}"
        if self.block:
            return f"groups of {self.block} along {ax}={total}"
        if self.bits:
            if 32 % self.bits == 0:
                return f"{ax}={total} values packed {32 // self.bits} per int32 word"
            return f"{ax}={total} {self.bits}-bit values packed across int32 words"
        return f"{ax}={total}"

    def index(self, a: int, b: int, total: int, partial_end_ok: bool) -> slice:
        """Index range holding axis values ``[a, b)``; raises ``ValueError(reason)`` off a boundary."""
        if self.axis is None or self.block == -1:
            return slice(None)
        end_ok = b == total and partial_end_ok
        if self.align:
            if a % self.align:
                raise ValueError(f"the shard starts at {a}, inside a tile of {self.align}")
            if b % self.align and not end_ok:
                raise ValueError(f"the shard ends at {b}, inside a tile of {self.align}")
        if self.block:
            if a % self.block:
                raise ValueError(f"the shard starts at {a}, inside a group of {self.block}")
            if b % self.block and not end_ok:
                raise ValueError(f"the shard ends at {b}, inside a group of {self.block}")
            return slice(a // self.block, -(-b // self.block))
        if self.bits:
            if a * self.bits % 32:
                raise ValueError(f"the shard starts at value {a}, inside an int32 word ({a} * {self.bits} bits is not a multiple of 32)")
            if b * self.bits % 32 and not end_ok:
                raise ValueError(f"the shard ends at value {b}, inside an int32 word ({b} * {self.bits} bits is not a multiple of 32)")
            return slice(a * self.bits // 32, -(-b * self.bits // 32))
        if self.scale:
            return slice(a * self.scale, b * self.scale)
        return slice(a, b)


# Dtype classes a TensorLayout may name instead of one exact dtype.
FLOAT = "float"
INT = "int"


@dataclass(frozen=True)
class TensorLayout:
    name: str  # suffix after the layer prefix, e.g. "qweight"
    dims: tuple[Dim, ...]
    dtype: torch.dtype | str  # exact dtype, FLOAT or INT
    optional: bool = False
    convert: bool = False  # floating tensors converted to the model dtype (dense weights, biases)
    # A tensor without an n dimension, fused from several layers: "equal" (must be identical, e.g.
    # g_idx), "max" (elementwise maximum, e.g. static activation scales) or "per_channel" (a scalar
    # per layer becomes one row per output feature, (N, 1), unless all layers agree).
    across: str = "equal"
    # Read the stored bytes as another shape (and dtype): view(K, N) -> shape. For layouts whose
    # stored shape hides the axes (bitsandbytes' flat nibbles, EETQ's interleaved bytes).
    view: Callable[[int, int], tuple[int, ...]] | None = None
    view_dtype: torch.dtype | None = None

    def dtype_ok(self, dtype: torch.dtype) -> bool:
        if self.dtype == FLOAT:
            return dtype.is_floating_point and dtype.itemsize >= 2
        if self.dtype == INT:
            return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
        return dtype == self.dtype


@dataclass(frozen=True)
class LinearLayout:
    """Every tensor of one linear layer in one scheme, and which of them carries ``g_idx``."""

    tensors: tuple[TensorLayout, ...]
    g_idx: str | None = None  # the (K,) group index tensor, if the scheme has act-order


class LinearScheme(abc.ABC):
    """One quantization scheme's linear layer: its tensors, its static parameters and its result.

    ``key`` names the tensor whose presence under a prefix says the layer is stored in this scheme.
    """

    key: str
    format: str  # FORMATS name, or "dense"
    group_size: int  # k-block of the group tensors (-1: one group)
    bits: int  # bits of the packed values (0: unpacked)

    @property
    @abc.abstractmethod
    def layout(self) -> LinearLayout: ...

    @abc.abstractmethod
    def dims(self, source: "Source", prefix: str) -> tuple[int, int]:
        """(K, N) of the full layer stored under ``prefix``."""

    @abc.abstractmethod
    def make(self, tensors: dict[str, torch.Tensor | None], k: int, n: int, group_size: int):
        """The layer's weight object (a dense tensor or the format's checkpoint dataclass)."""

    def stores(self, source: "Source", prefix: str) -> bool:
        """Whether the layer under ``prefix`` is stored in this scheme."""
        return source.has(join(prefix, self.key))

    def specialize(self, source: "Source", prefix: str) -> "LinearScheme":
        """This scheme with whatever the config leaves open read from the stored tensors."""
        return self

    def read(self, source: "Source", pieces: list["Piece"], k_range: tuple[int, int], k: int, **kw) -> dict:
        """The tensors of a shard (see :func:`read_pieces`, which schemes whose tensors all slice
        plainly use as is)."""
        return read_pieces(source, self.layout, pieces, k_range, k, **kw)


class Source(Protocol):
    """Where tensors come from: checkpoint files (``Weights``) or tensors in memory (``DictSource``)."""

    def has(self, name: str) -> bool: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype_of(self, name: str) -> torch.dtype: ...
    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype | None = None,
             view: tuple[tuple[int, ...], torch.dtype] | None = None) -> torch.Tensor:
        """``tensor[index]`` (converted to ``dtype`` when given; its bytes first read as ``view`` =
        (shape, dtype) when given); files return a copy holding only the slice, memory may return a
        view."""
    def where(self, name: str) -> str: ...
    def names_under(self, prefix: str) -> list[str]: ...


class DictSource:
    """Tensors already in memory, under their full names."""

    def __init__(self, tensors: dict[str, torch.Tensor | None], origin: str = "the given tensors"):
        self.tensors = {k: v for k, v in tensors.items() if v is not None}
        self.origin = origin

    def has(self, name):
        return name in self.tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype_of(self, name):
        return self.tensors[name].dtype

    def read(self, name, index, dtype=None, view=None):
        t = self.tensors[name]
        if view is not None:
            t = t.contiguous().view(view[1]).reshape(view[0])
        t = t[index]
        return t if dtype is None else t.to(dtype)

    def where(self, name):
        return self.origin

    def names_under(self, prefix):
        return sorted(n for n in self.tensors if n.startswith(prefix))


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class Piece:
    """Values ``[n0, n1)`` along n of the layer stored under ``prefix`` (whose N is ``n``)."""

    prefix: str
    n0: int
    n1: int
    n: int


def require(source: Source, name: str, t: TensorLayout | None = None) -> None:
    if not source.has(name):
        prefix = name.rsplit(".", 1)[0] if "." in name else ""
        near = source.names_under(prefix + "." if prefix else "")[:12]
        hint = f"; tensors under {prefix!r}: {near}" if near else f"; nothing is stored under {prefix!r}"
        what = f" (the {t.name} tensor of this layout)" if t is not None else ""
        raise WeightsError(f"tensor {name!r}{what} not found in {source.where(name)}{hint}")


def stores_weight_of(source: Source, prefix: str, dtype: torch.dtype, scale: str, scheme: str) -> bool:
    """Whether the layer under ``prefix`` stores its ``weight`` as ``dtype`` (a quantized scheme's).

    A ``weight`` of another dtype beside the scheme's ``scale`` tensor is an inconsistent checkpoint:
    falling back to a dense read would silently drop the scale, so it is refused."""
    name = join(prefix, "weight")
    if not source.has(name):
        return False
    if source.dtype_of(name) == dtype:
        return True
    if source.has(join(prefix, scale)):
        raise WeightsError(f"tensor {name!r} in {source.where(name)} has dtype {source.dtype_of(name)} beside {join(prefix, scale)!r}: the "
                           f"config's {scheme} scheme stores {dtype} weights with that scale, and a dense read would drop it")
    return False


def view_of(t: TensorLayout, source: Source, name: str, k: int, n: int) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The (shape, dtype) ``name``'s bytes are read as, or None to read them as stored."""
    if t.view is None:
        return None
    return t.view(k, n), t.view_dtype or source.dtype_of(name)


def check_tensor(source: Source, name: str, t: TensorLayout, k: int, n: int) -> None:
    """Raise WeightsError unless ``name`` has the dtype and the full shape the layout gives it."""
    dtype = source.dtype_of(name)
    shape = source.shape(name)
    view = view_of(t, source, name, k, n)
    if view is not None:
        stored = math.prod(shape) * dtype.itemsize
        if stored != math.prod(view[0]) * view[1].itemsize:
            raise WeightsError(f"tensor {name!r} in {source.where(name)} holds {stored} bytes ({dtype} {shape}); "
                               f"expected {math.prod(view[0]) * view[1].itemsize} ({view[1]} {view[0]}) for K={k}, N={n}")
        shape, dtype = view
    if not t.dtype_ok(dtype):
        want = {FLOAT: "a floating dtype", INT: "an integer dtype"}.get(t.dtype, t.dtype)
        raise WeightsError(f"tensor {name!r} in {source.where(name)} has dtype {dtype}; this layout stores it as {want}")
    expect = tuple(d.length(k if d.axis == "k" else n) for d in t.dims)
    if len(shape) != len(expect) or any(e is not None and e != s for e, s in zip(expect, shape)):
        want = tuple("*" if e is None else e for e in expect)
        raise WeightsError(f"tensor {name!r} in {source.where(name)} has shape {shape}; expected {want} for K={k}, N={n}")


def _index(name: str, t: TensorLayout, ranges: dict[str, tuple[int, int, int, bool]], world: int, rank: int) -> tuple[slice, ...]:
    idx = []
    for d_i, d in enumerate(t.dims):
        if d.axis is None or d.axis not in ranges:
            idx.append(slice(None))
            continue
        a, b, total, partial_end_ok = ranges[d.axis]
        try:
            idx.append(d.index(a, b, total, partial_end_ok))
        except ValueError as e:
            whole = _whole_piece_refusal(d, total, partial_end_ok)
            if whole is not None:
                # Not the world size's doing: the layer, read whole, is a piece of a fusion that it does not end.
                raise ShardingError(
                    f"cannot fuse {name!r} with the layer after it along dim {d_i} ({d.describe(total)}): read whole, {whole}. "
                    f"The tensor's groups do not fall on the fused pieces' boundaries, so no world size helps.") from None
            raise ShardingError(
                f"cannot split {name!r} along dim {d_i} ({d.describe(total)}) for world size {world} (rank {rank} takes "
                f"{d.axis.upper()} values [{a}, {b})): {e}. Pick a world size whose shards fall on these boundaries."
            ) from None
    return tuple(idx)


def _whole_piece_refusal(d: Dim, total: int, partial_end_ok: bool) -> str | None:
    """Why a layer's whole axis of ``total`` values is off ``d``'s boundaries as a piece that may not
    end partially (one fused before another), or None where it is not."""
    try:
        d.index(0, total, total, partial_end_ok)
    except ValueError as e:
        return str(e)
    return None


def _fuse(t: TensorLayout, parts: list[tuple[str, torch.Tensor]], pieces: list[Piece]) -> torch.Tensor:
    """One tensor without an n dimension from each fused layer -> the fused layer's."""
    first_name, first = parts[0]
    same = all(v.shape == first.shape and torch.equal(v, first) for _, v in parts[1:])
    if same:
        return first
    if t.across == "max":
        out = first
        for _, v in parts[1:]:
            out = torch.maximum(out, v)
        return out
    if t.across == "per_channel" and all(v.numel() == 1 for _, v in parts):
        by_prefix = {p.prefix: v for p, (_, v) in zip(_unique(pieces), parts)}
        return torch.cat([by_prefix[p.prefix].reshape(1, 1).expand(p.n1 - p.n0, 1) for p in pieces])
    names = [nm for nm, _ in parts]
    raise WeightsError(f"tensors {names} differ, but the layers are fused into one and must share them")


def _unique(pieces: list[Piece]) -> list[Piece]:
    seen, out = set(), []
    for p in pieces:
        if p.prefix not in seen:
            seen.add(p.prefix)
            out.append(p)
    return out


def read_pieces(
    source: Source,
    layout: LinearLayout,
    pieces: list[Piece],
    k_range: tuple[int, int],
    k: int,
    *,
    world: int = 1,
    rank: int = 0,
    full_k_blocks: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor | None]:
    """Read each layout tensor restricted to ``pieces`` along n and ``k_range`` along k.

    Tensors with an n dimension are concatenated piece by piece along it; tensors without one
    (``g_idx``, per-tensor scales) are read once per prefix and fused by their ``across`` rule.
    ``full_k_blocks`` reads blocked k dimensions whole (act-order row shards need every group).
    Tensors marked ``convert`` become ``dtype``; everything lands on ``device``.
    """
    out: dict[str, torch.Tensor | None] = {}
    for t in layout.tensors:
        names = [join(p.prefix, t.name) for p in pieces]
        present = [source.has(nm) for nm in names]
        if not any(present) and t.optional:
            out[t.name] = None
            continue
        for nm, ok in zip(names, present):
            if not ok:
                require(source, nm, t)
        for p, nm in zip(pieces, names):
            check_tensor(source, nm, t, k, p.n)
        n_dim = next((i for i, d in enumerate(t.dims) if d.axis == "n"), None)
        k0, k1 = k_range
        conv = dtype if t.convert and dtype is not None and source.dtype_of(names[0]).is_floating_point else None
        if n_dim is None:
            ranges = {"k": (k0, k1, k, True)}
            if full_k_blocks and any(d.axis == "k" and d.block for d in t.dims):
                ranges = {}
            parts = []
            for p in _unique(pieces):
                nm = join(p.prefix, t.name)
                parts.append((nm, source.read(nm, _index(nm, t, ranges, world, rank), conv, view_of(t, source, nm, k, p.n))))
            out[t.name] = _fuse(t, parts, pieces)
            continue
        chunks = []
        for i, (p, nm) in enumerate(zip(pieces, names)):
            ranges = {"n": (p.n0, p.n1, p.n, i == len(pieces) - 1)}
            if not (full_k_blocks and any(d.axis == "k" and d.block for d in t.dims)):
                ranges["k"] = (k0, k1, k, True)
            chunks.append(source.read(nm, _index(nm, t, ranges, world, rank), conv, view_of(t, source, nm, k, p.n)))
        out[t.name] = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=n_dim)
    if device is not None:
        out = {name: None if v is None else v.to(device) for name, v in out.items()}
    return out
