"""Float64 oracles for bitsandbytes (LLM.int8, NF4, FP4) and EETQ checkpoints, and random checkpoints.

Nothing above the "qops side" line imports qops: the oracles are written from FORMATS.md and the
facts of the bitsandbytes / EETQ sources (cited in ``qops/formats/bitsandbytes.py`` and
``eetq.py``), by different means than qops (codes read with integer division instead of shifts, the
FP4 table from its bit patterns, EETQ's preprocessing as the loops of FasterTransformer's
``cutlass_preprocessors.cc`` rather than qops' reshapes). Each returns the weight ``W`` as a float64
``(N, K)`` tensor.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from tests.oracle import check_elementwise

NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
# FP4 magnitudes by the three low bits (bitsandbytes' comment table); bit 3 is the sign; / 12.
FP4_MAGNITUDE = {0b000: 0.0, 0b001: 0.0625, 0b010: 8.0, 0b011: 12.0, 0b100: 4.0, 0b101: 6.0, 0b110: 2.0, 0b111: 3.0}


def fp4_table() -> np.ndarray:
    vals = [(-1.0 if c >= 8 else 1.0) * FP4_MAGNITUDE[c % 8] for c in range(16)]
    return (np.array(vals, dtype=np.float32) / np.float32(12.0)).astype(np.float32)


def codebook(quant_type: str) -> np.ndarray:
    return np.array(NF4, dtype=np.float32) if quant_type == "nf4" else fp4_table()


def _np(t, dtype) -> np.ndarray:
    return t.detach().cpu().numpy().astype(dtype) if isinstance(t, torch.Tensor) else np.asarray(t, dtype=dtype)


def codes_of(weight_bytes, numel: int) -> np.ndarray:
    """4-bit codes of the flat weight: byte i holds element 2i in its upper half (b // 16), 2i+1 in b % 16."""
    b = _np(weight_bytes, np.int64).reshape(-1)
    out = np.empty(2 * b.size, dtype=np.int64)
    out[0::2] = b // 16
    out[1::2] = b % 16
    return out[:numel]


def pack_codes(codes) -> torch.Tensor:
    """Inverse of :func:`codes_of`: uint8 ``(ceil(n/2), 1)`` as bitsandbytes stores it."""
    c = _np(codes, np.int64).reshape(-1)
    if c.size % 2:
        c = np.concatenate([c, [0]])
    return torch.from_numpy((c[0::2] * 16 + c[1::2]).astype(np.uint8)).reshape(-1, 1)


def block_absmax_f32(absmax, nested_quant_map=None, nested_absmax=None, nested_offset=None, nested_blocksize=256):
    """float32 numpy absmax per block (nested: map[u8] * nested_absmax[b // 256] + offset, in float32)."""
    if nested_absmax is None:
        return _np(absmax, np.float32)
    u = _np(absmax, np.int64)
    code2 = _np(nested_quant_map, np.float32)
    scale = _np(nested_absmax, np.float32)[np.arange(u.size) // nested_blocksize]
    return (code2[u] * scale).astype(np.float32) + np.float32(nested_offset)


def bnb4(state: dict, quant_type: str, prefix: str = "") -> torch.Tensor:
    """A bitsandbytes 4-bit linear's state dict -> float64 W, read only through the stored tensors."""
    blob = state[prefix + f"weight.quant_state.bitsandbytes__{quant_type}"]
    qs = json.loads(bytes(_np(blob, np.uint8)).decode("utf-8"))
    assert qs["quant_type"] == quant_type
    n, k = qs["shape"]
    weight = state[prefix + "weight"]
    raw = weight if weight.dtype == torch.uint8 else weight.contiguous().view(torch.uint8)
    codes = codes_of(raw, n * k)
    nested = prefix + "weight.nested_absmax" in state
    s = block_absmax_f32(
        state[prefix + "weight.absmax"],
        state.get(prefix + "weight.nested_quant_map"), state.get(prefix + "weight.nested_absmax"),
        qs.get("nested_offset"), qs.get("nested_blocksize", 256),
    ) if nested else block_absmax_f32(state[prefix + "weight.absmax"])
    table = codebook(quant_type).astype(np.float64)
    w = table[codes] * s.astype(np.float64)[np.arange(n * k) // int(qs["blocksize"])]
    return torch.from_numpy(w.reshape(n, k))


def bnb_int8(weight, scb) -> torch.Tensor:
    """LLM.int8 storage: W = weight * SCB / 127 per row."""
    return torch.from_numpy(_np(weight, np.float64) * _np(scb, np.float64)[:, None] / 127.0)


# EETQ / FasterTransformer int8 preprocessing for sm75-sm89 (ThreadblockK 64, 2 columns interleaved),
# transcribed as loops over element positions; applied to positions it gives where each byte goes.


def _permute_rows(a: np.ndarray) -> np.ndarray:
    k = a.shape[0]
    out = np.empty_like(a)
    for base in range(0, k, 16):
        for tile_row in range(16):
            read = base + 8 * ((tile_row % 4) // 2) + tile_row % 2 + 2 * (tile_row // 4)
            out[base + tile_row] = a[read]
    return out


def _interleave(col_major: np.ndarray, k: int, n: int) -> np.ndarray:
    words = col_major.reshape(n, k // 4, 4)
    out = np.empty((n * k // 4, 4), dtype=col_major.dtype)
    num_vec_rows, vec_rows_per_tile, interleave = k // 4, 16, 2
    for read_col in range(n):
        write_col = read_col // interleave
        for base in range(0, num_vec_rows, vec_rows_per_tile):
            for v in range(base, min(num_vec_rows, base + vec_rows_per_tile)):
                vec_write_row = interleave * base + vec_rows_per_tile * (read_col % interleave) + v % vec_rows_per_tile
                out[write_col * num_vec_rows * interleave + vec_write_row] = words[read_col, v]
    return out.reshape(-1)


def eetq_positions(k: int, n: int) -> np.ndarray:
    """``pos[i]``: the flat index in row-major q ``(K, N)`` of the byte stored at position i."""
    pos = np.arange(k * n, dtype=np.int64).reshape(k, n)
    pos = _permute_rows(pos)
    pos = np.ascontiguousarray(pos.T)  # column-major
    pos = _interleave(pos, k, n).reshape(-1, 4)
    pos[:, [1, 2]] = pos[:, [2, 1]]
    return pos.reshape(-1)


def _wrap8(v: np.ndarray) -> np.ndarray:
    return (v + 128) % 256 - 128


def eetq_preprocess(q_kn) -> torch.Tensor:
    """FasterTransformer ``preprocess_weights`` on row-major int8 ``(K, N)``: moves, then +128 (wrap)."""
    q = _np(q_kn, np.int64)
    k, n = q.shape
    stored = _wrap8(q.reshape(-1)[eetq_positions(k, n)] + 128)
    return torch.from_numpy(stored.astype(np.int8).reshape(k, n))


def eetq(weight, weight_scales, layout: str) -> torch.Tensor:
    """EETQ: weight int8 ``(K, N)`` (``layout`` byte order), W[n, k] = weight_scales[n] * q[k, n]."""
    stored = _np(weight, np.int64)
    k, n = stored.shape
    if layout == "ampere":
        q = np.empty(k * n, dtype=np.int64)
        q[eetq_positions(k, n)] = _wrap8(stored.reshape(-1) - 128)
        q = q.reshape(k, n)
    else:
        q = stored
    return torch.from_numpy(q.T.astype(np.float64) * _np(weight_scales, np.float64)[:, None])


def matmul(x: torch.Tensor, w64: torch.Tensor, bias=None) -> torch.Tensor:
    y = x.detach().double() @ w64.t()
    return y if bias is None else y + bias.detach().double()


def rel_err(got: torch.Tensor, want64: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm(got.double() - want64)
    ref = torch.linalg.vector_norm(want64)
    return float(diff / ref) if ref > 0 else float(diff)


def check_output(y, x, w64, bias, dtype, tol: float, what: str) -> None:
    """``y`` (a kernel's output) against float64 ``x @ W.T + bias``: dtype, shape, finite, relative error
    <= tol, and every element within ``tests.oracle.elementwise_bound`` (one wrong element, which the
    relative norm over the whole output lets pass, fails)."""
    want = matmul(x, w64, bias)
    assert y.dtype == dtype and y.shape == want.shape, what
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output"
    err = rel_err(y, want)
    assert err <= tol, f"{what}: relative error {err:.2e}"
    check_elementwise(y, x, w64, bias, dtype, what)


def check_graph_replay(w, w64, m: int, tol: float) -> None:
    """``w.mm`` on fp16 x of ``m`` rows captured in a CUDA graph after eager calls on a side stream,
    then replayed on new x with the output poisoned with NaN: each replay against float64."""
    k = w64.shape[1]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            w.mm(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = w.mm(x)
    for seed in (1, 2):
        x.copy_(torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).half())
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_output(y, x, w64, None, torch.float16, tol, f"replay {seed}")


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MS = (0, 1, 2, 3, 17, 128, 257)


# --------------------------------------------------------------------------------------- qops side


@dataclass(frozen=True)
class Case:
    fmt: str
    n: int
    k: int
    blocksize: int = 0  # 4-bit only
    nested: bool = False  # 4-bit only
    layout: str = ""  # eetq only

    @property
    def id(self) -> str:
        extra = f"-b{self.blocksize}{'-nested' if self.nested else ''}" if self.blocksize else (f"-{self.layout}" if self.layout else "")
        return f"{self.fmt}{extra}-{self.n}x{self.k}"


INT8_CASES = (
    Case("bitsandbytes-int8", 33, 97),
    Case("bitsandbytes-int8", 8, 256),
    Case("eetq", 64, 128, layout="ampere"),
    Case("eetq", 33, 97, layout="row_major"),
)
BLOCKWISE4_CASES = tuple(
    Case(f"bitsandbytes-{qt}", n, k, blocksize=b, nested=nested)
    for qt in ("nf4", "fp4")
    for (n, k, b) in ((33, 96, 64), (17, 129, 32), (24, 256, 128))
    for nested in (True, False)
)


def random_state(case: Case, gen: torch.Generator) -> dict:
    """A random checkpoint as a state dict, built here without qops (every code value present)."""
    n, k = case.n, case.k
    if case.fmt == "bitsandbytes-int8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        q.view(-1)[:2] = torch.tensor([-127, 127], dtype=torch.int8)
        return {"weight": q, "SCB": torch.rand(n, generator=gen) * 3 + 0.1, "weight_format": torch.tensor(0, dtype=torch.uint8)}
    if case.fmt == "eetq":
        q = torch.randint(-128, 128, (k, n), generator=gen, dtype=torch.int8)
        q.view(-1)[:2] = torch.tensor([-128, 127], dtype=torch.int8)
        scales = ((torch.rand(n, generator=gen) + 0.1) * 0.02).half()
        return {"weight": eetq_preprocess(q) if case.layout == "ampere" else q, "weight_scales": scales}
    quant_type = case.fmt.split("-")[1]
    numel = n * k
    nb = -(-numel // case.blocksize)
    codes = torch.randint(0, 16, (numel,), generator=gen)
    codes[:16] = torch.arange(16)
    qs = {"quant_type": quant_type, "blocksize": case.blocksize, "dtype": "float16", "shape": [n, k]}
    state = {"weight": pack_codes(codes), "weight.quant_map": torch.from_numpy(codebook(quant_type))}
    if case.nested:
        state["weight.absmax"] = torch.randint(0, 256, (nb,), generator=gen).to(torch.uint8)
        state["weight.nested_absmax"] = torch.rand(-(-nb // 256), generator=gen) * 0.05 + 0.01
        state["weight.nested_quant_map"] = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
        qs.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.0421)
    else:
        state["weight.absmax"] = torch.rand(nb, generator=gen) * 0.1 + 0.01
    state[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(qs).encode()), dtype=torch.uint8)
    return state


def oracle_of(case: Case, state: dict) -> torch.Tensor:
    if case.fmt == "bitsandbytes-int8":
        return bnb_int8(state["weight"], state["SCB"])
    if case.fmt == "eetq":
        return eetq(state["weight"], state["weight_scales"], case.layout)
    return bnb4(state, case.fmt.split("-")[1])


@dataclass
class Built:
    case: Case
    state: dict
    checkpoint: object
    w64: torch.Tensor
    weight: object  # qops Int8Weight / Blockwise4Weight


def as_tile16(w):
    """The prepared 4-bit weight ``w`` again, its qweight in the tile16 byte order."""
    from qops.ops.blockwise4 import LAYOUT_TILE16

    return w.with_layout(LAYOUT_TILE16)


def seed_of(case: Case) -> int:
    return zlib.crc32(case.id.encode())


def build(case: Case, dtype: torch.dtype | None = None) -> Built:
    from qops.formats import FORMATS

    fmt = FORMATS[case.fmt]
    state = random_state(case, torch.Generator().manual_seed(seed_of(case)))
    kwargs = {"layout": case.layout} if case.fmt == "eetq" else {}
    ckpt = fmt.from_state_dict(state, **kwargs)
    return Built(case, state, ckpt, oracle_of(case, state), fmt.prepare(ckpt, dtype=dtype))


# ------------------------------------------------------------------------- opcheck samples
# Used by tests/test_opcheck.py (SAMPLES.update(OPCHECK_SAMPLES)): op name -> function returning
# {sample id: argument tuple}.


def _opcheck_weights():
    return {
        "bnb8": build(INT8_CASES[0]).weight,
        "eetq": build(INT8_CASES[2]).weight,
        "nf4nested": build(BLOCKWISE4_CASES[0]).weight,  # K % blocksize != 0, nested
        "fp4plain": build(BLOCKWISE4_CASES[9]).weight,  # odd N*K, plain absmax
        # K % 128 == 0, blocksize 128: shapes the native lowering serves (16-bit x samples only)
        "nf4k256": build(BLOCKWISE4_CASES[4]).weight,  # nested
        "fp4k256": build(BLOCKWISE4_CASES[11]).weight,  # plain absmax
        # the tile16 byte order (N % 16 == 0, K % 128 == 0), nested, two blocks a 128-wide chunk
        "nf4tile16": as_tile16(build(Case("bitsandbytes-nf4", 32, 256, blocksize=64, nested=True)).weight),
    }


def _args(w, x, bias):
    if hasattr(w, "scales"):
        return (x, w.qweight, w.scales, bias, int(w.kernel))
    return (x, *w._weight_args(), bias, *w._static_args(), int(w.kernel))


def _variants(k, n, g):
    return {
        "fp32-grad-bias-grad": (torch.randn(5, k, generator=g).requires_grad_(), torch.randn(n, generator=g).requires_grad_()),
        "fp16-3d-grad": (torch.randn(2, 3, k, generator=g).half().requires_grad_(), None),
        "bf16-m1-bias": (torch.randn(1, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()),
        "fp32-m0-grad": (torch.randn(0, k, generator=g).requires_grad_(), None),
        "fp32-transposed-grad": (torch.randn(k, 4, generator=g).t().requires_grad_(), torch.randn(n, generator=g)),
    }


def _mm_samples(int8: bool):
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, w in _opcheck_weights().items():
        if hasattr(w, "scales") != int8:
            continue
        for vname, (x, bias) in _variants(w.in_features, w.out_features, g).items():
            out[f"{name}-{vname}"] = _args(w, x, bias)
    return out


def _mm_out_samples(int8: bool):
    g = torch.Generator().manual_seed(6)
    out = {}
    for name, w in _opcheck_weights().items():
        if hasattr(w, "scales") != int8:
            continue
        k, n = w.in_features, w.out_features
        for vname, (x, bias, ws) in {
            "fp32-workspace-bias": (torch.randn(5, k, generator=g), torch.randn(n, generator=g), torch.empty(256, dtype=torch.uint8)),
            "fp16-3d": (torch.randn(2, 3, k, generator=g).half(), None, None),
        }.items():
            o = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
            out[f"{name}-{vname}"] = (*_args(w, x, bias), o, ws)
    return out


def _dequant_samples(int8: bool):
    out = {}
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32, torch.bfloat16, torch.float16)
    for (name, w), dtype in zip(_opcheck_weights().items(), dtypes):
        if hasattr(w, "scales") != int8:
            continue
        if int8:
            out[name] = (w.qweight, w.scales, dtype)
            # A column-major qweight (the op takes any strides): the result is row-major, as the fake says.
            out[f"{name}-column-major"] = (w.qweight.t().contiguous().t(), w.scales, dtype)
        else:
            out[name] = (*w._weight_args(), *w._static_args(), dtype)
    return out


OPCHECK_SAMPLES = {
    "mm_int8_weight": lambda: _mm_samples(True),
    "mm_int8_weight_out": lambda: _mm_out_samples(True),
    "dequantize_int8_weight": lambda: _dequant_samples(True),
    "mm_blockwise4": lambda: _mm_samples(False),
    "mm_blockwise4_out": lambda: _mm_out_samples(False),
    "dequantize_blockwise4": lambda: _dequant_samples(False),
}
