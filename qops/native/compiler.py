"""NVRTC compilation of qops' CUDA C++ sources, a disk cache, and kernel loading and launch.

The sources under ``qops/native`` include no torch or CUDA headers beyond what NVRTC declares
itself; local headers (``#include "x.cuh"``) are found beside them. Three layers:

- :func:`compile` ``(source, arch, options) -> bytes`` is pure: NVRTC through ``cuda.core``, cubin
  for ``arch`` (``"sm_90"``), no device or driver needed. A failure raises :class:`NativeCompileError`
  carrying NVRTC's log.
- :func:`compile_cached` wraps it with a disk cache under ``$QOPS_CACHE_DIR`` (default
  ``~/.cache/qops``)/``nvrtc``, keyed by the sha256 of the source (with the local headers it
  includes), the options, the arch and the NVRTC version; entries are written to a temporary file
  and renamed into place, so concurrent processes never read half a file, and an entry that is not a
  whole cubin (a copy cut short) is compiled again and replaced.
- :func:`get_kernel` compiles (or reads the cache) and loads a module once per device and kernel
  variant. Loading happens at warm-up; during CUDA-graph capture a kernel that is not loaded yet
  raises :class:`NativeNotReadyError` instead of compiling. :func:`launch` launches on a torch stream,
  with programmatic dependent launch (sm_90) on request where this cuda.core can express it
  (:func:`pdl_missing` says why not), and opts the kernel in to dynamic shared memory above the
  default 48 KiB when a launch asks for more (:func:`allow_dynamic_shared`).

With ``$QOPS_NVRTC_RECORD`` set to a file, :func:`get_kernel` appends one JSON line per module it
builds or reads from the cache (source name, arch, defines): a record of what a run needed, from
which ``benchmarks/prefill_nvrtc_cache.py`` fills a cache on a machine without a GPU (any NVRTC of the
same version: the key holds no device facts), for the current sources, before a GPU run carries it.

``cuda.core`` moved out of ``cuda.core.experimental`` in 1.0; both locations are accepted.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

NATIVE_DIR = Path(__file__).resolve().parent
CACHE_ENV = "QOPS_CACHE_DIR"
RECORD_ENV = "QOPS_NVRTC_RECORD"
DEFAULT_STD = "c++17"


class NativeCompileError(RuntimeError):
    """NVRTC rejected a source; the message holds its log."""


class NativeUnavailableError(RuntimeError):
    """cuda.core or NVRTC cannot be used on this machine."""


class NativeNotReadyError(RuntimeError):
    """A kernel was needed during CUDA-graph capture before it was compiled and loaded."""


# --- cuda.core / NVRTC access -------------------------------------------------------------------


@functools.cache
def core():
    """The ``cuda.core`` module (``cuda.core.experimental`` before cuda-core 1.0)."""
    errors = []
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            mod = __import__(name, fromlist=["Program"])
        except Exception as e:  # noqa: BLE001 - any import failure: try the next location
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        missing = [a for a in ("Program", "ProgramOptions", "ObjectCode", "LaunchConfig", "launch", "Device") if not hasattr(mod, a)]
        if not missing:
            return mod
        errors.append(f"{name}: lacks {', '.join(missing)}")
    raise NativeUnavailableError(
        "qops.native needs cuda-core (pip install 'cuda-core>=1.0' cuda-bindings nvidia-cuda-nvrtc): " + "; ".join(errors)
    )


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor); loads the NVRTC library."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python < 12.6 layout
        except ImportError as e:
            raise NativeUnavailableError(f"qops.native needs cuda-bindings for NVRTC: {e}") from e
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - library not found / not loadable
        raise NativeUnavailableError(f"NVRTC could not be loaded ({type(e).__name__}: {e}); install nvidia-cuda-nvrtc") from e
    if int(err) != 0:
        raise NativeUnavailableError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


@functools.cache
def runtime_missing() -> str | None:
    """Why native kernels cannot be compiled here (cuda.core or NVRTC unusable), or None."""
    try:
        core()
        nvrtc_version()
    except NativeUnavailableError as e:
        return str(e)
    return None


# --- compilation ----------------------------------------------------------------------------------


def _program_options(arch: str, options: Mapping[str, Any]):
    po = core().ProgramOptions
    kwargs = {"std": DEFAULT_STD, **options, "arch": arch}
    try:
        return po(**kwargs)
    except TypeError as e:
        raise NativeUnavailableError(f"this cuda-core's ProgramOptions does not take {sorted(kwargs)}: {e}") from e


def compile(source: str, arch: str, options: Mapping[str, Any] | None = None, *, log: list | None = None) -> bytes:  # noqa: A001
    """Compile CUDA C++ ``source`` to a cubin for ``arch`` (``"sm_80"``, ``"sm_90"``, ...).

    ``options`` are ``cuda.core.ProgramOptions`` fields (``define_macro``, ``include_path``,
    ``ptxas_options``, ...; ``std`` defaults to c++17). NVRTC's log (warnings, or ptxas' report with
    ``ptxas_options=["-v"]``) is appended to ``log`` when given. Needs no GPU.
    """
    cc = core()
    opts = _program_options(arch, dict(options or {}))
    buf = _Log()
    try:
        prog = cc.Program(source, code_type="c++", options=opts)
        try:
            obj = prog.compile("cubin", logs=buf)
        except TypeError:  # cuda-core without the logs argument
            obj = prog.compile("cubin")
    except Exception as e:  # noqa: BLE001 - NVRTCError and friends; the log is in the message or in buf
        text = buf.text() or str(e)
        raise NativeCompileError(f"NVRTC failed to compile for {arch}:\n{text}\n({type(e).__name__}: {e})") from e
    if log is not None:
        log.append(buf.text())
    code = obj.code
    return bytes(code) if not isinstance(code, bytes) else code


class _Log:
    def __init__(self):
        self.parts: list[str] = []

    def write(self, s):
        self.parts.append(s if isinstance(s, str) else s.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.parts).rstrip("\x00").strip()


# #include "name" (group 1) or #include <name> (group 2)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<([^>]+)>)', re.MULTILINE)


def local_headers(source: str, include_path: Sequence[str | Path] = (NATIVE_DIR,), source_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(name as included, text) of every header ``source`` reaches, recursively, resolved as NVRTC
    resolves them: ``#include "x"`` in the including file's directory first (for ``source`` itself
    ``source_dir``: NVRTC looks in its working directory), then in ``include_path`` in order;
    ``#include <x>`` in ``include_path`` only. Headers found in none of these (the CUDA toolkit's, NVRTC's
    built-ins) are not followed. Sorted; one pair for each file reached (a name two includers resolve to
    different files appears twice)."""
    found: dict[Path, tuple[str, str]] = {}  # resolved file -> (name, text)
    todo: list[tuple[str, Path | None]] = [(source, Path(source_dir) if source_dir is not None else None)]
    while todo:
        text, here = todo.pop()
        for quoted, angled in _INCLUDE_RE.findall(text):
            name = quoted or angled
            dirs = ([here] if quoted and here is not None else []) + [Path(d) for d in include_path]
            path = next((d / name for d in dirs if (d / name).is_file()), None)
            if path is None or path.resolve() in found:
                continue
            header = path.read_text()
            found[path.resolve()] = (name, header)
            todo.append((header, path.parent))
    return sorted(set(found.values()))


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qops") / "nvrtc"


def cache_key(source: str, arch: str, options: Mapping[str, Any] | None = None) -> str:
    """sha256 over the source and the headers NVRTC would include (:func:`local_headers`; the top-level
    source's quoted includes are looked up in the working directory first, as NVRTC does), the options,
    the arch and NVRTC's version.

    qops/native in ``include_path`` is keyed by name, not by where this checkout sits (its headers'
    text is in the key): a cache filled on one machine serves another with the same NVRTC. The keys of
    qops' own builds (:func:`native_options`: a sorted list of (name, value) macros) are those of every
    earlier release: prefilled caches carried to another machine stay valid (a test pins two).
    """
    opts = dict(options or {})
    include_path = _as_list(opts.get("include_path"))
    if "include_path" in opts:
        opts["include_path"] = ["<qops/native>" if _same_dir(d, NATIVE_DIR) else os.fspath(d) for d in include_path]
    if "define_macro" in opts:
        opts["define_macro"] = _macro_list(opts["define_macro"])
    payload = {
        "source": source,
        "headers": local_headers(source, include_path, Path.cwd()),
        "options": {"std": DEFAULT_STD, **opts},
        "arch": arch,
        "nvrtc": list(nvrtc_version()),
    }
    blob = json.dumps(payload, sort_keys=True, default=_json_default).encode()
    return hashlib.sha256(blob).hexdigest()


def _macro_list(define_macro) -> list:
    """``define_macro`` as the list of macros ProgramOptions reads from it, each a name or a [name, value]
    pair: one string, or a tuple of two strings, is one macro (``("A", "B")``: -DA=B); any other list or
    tuple holds one macro an item (``["A", "B"]``: -DA -DB). The two spellings serialised alike before."""
    if isinstance(define_macro, str) or (isinstance(define_macro, tuple) and len(define_macro) == 2
                                         and all(isinstance(v, str) for v in define_macro)):
        define_macro = [define_macro]
    return [m if isinstance(m, str) else list(m) for m in define_macro]


def _same_dir(a, b) -> bool:
    return os.path.normpath(os.fspath(a)) == os.path.normpath(os.fspath(b))


def _as_list(v) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _json_default(o):
    if isinstance(o, (Path, os.PathLike)):
        return os.fspath(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=repr)
    return repr(o)


def cache_path(key: str) -> Path:
    """The cache entry of ``key``: a plain cubin (entries written by every earlier version stay valid)."""
    return cache_dir() / f"{key}.cubin"


def compile_cached(source: str, arch: str, options: Mapping[str, Any] | None = None) -> bytes:
    """:func:`compile`, through the disk cache. Returns the cubin. An entry that is not a whole cubin
    (:func:`cubin_problem`: a write or a copy cut short, other bytes) is compiled again and replaced."""
    key = cache_key(source, arch, options)
    data = read_cache_entry(cache_path(key))
    if data is None:
        data = compile(source, arch, options)
        _store(cache_path(key), data)
    return data


def read_cache_entry(path: Path) -> bytes | None:
    """The cubin stored at ``path``, or None where there is none, it cannot be read, or it is not a whole
    cubin (those are compiled again rather than handed to the driver, whose error would not name the file)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if cubin_problem(data) is None else None


_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # e_ident, e_type ... e_shstrndx
_ELF64_SECTION = struct.Struct("<IIQQQQIIQQ")  # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, ...
_SHT_NOBITS = 8  # a section that occupies no bytes of the file (.bss, .nv.shared.*)


def cubin_problem(data: bytes) -> str | None:
    """Why ``data`` is not a whole cubin (a 64-bit little-endian ELF image, what NVRTC writes), or None.

    The ELF header places the program and section header tables, and the section headers the sections'
    bytes: a file cut short ends before one of them (NVRTC writes the tables last)."""
    if len(data) < _ELF64_HEADER.size or data[:4] != b"\x7fELF":
        return "no ELF header"
    if data[4:6] != b"\x02\x01":
        return "not a 64-bit little-endian ELF image"
    fields = _ELF64_HEADER.unpack_from(data)
    phoff, shoff, phentsize, phnum, shentsize, shnum = fields[5], fields[6], fields[9], fields[10], fields[11], fields[12]
    for what, end in (("program header table", phoff + phnum * phentsize), ("section header table", shoff + shnum * shentsize)):
        if end > len(data):
            return f"{len(data)} bytes, but its {what} ends at byte {end}"
    if shnum and shentsize < _ELF64_SECTION.size:
        return f"section headers of {shentsize} bytes"
    for i in range(shnum):
        section = _ELF64_SECTION.unpack_from(data, shoff + i * shentsize)
        end = section[4] + section[5]
        if section[1] != _SHT_NOBITS and end > len(data):
            return f"{len(data)} bytes, but section {i} ends at byte {end}"
    return None


def _store(path: Path, data: bytes) -> None:
    """Write a cache entry through a temporary file renamed into place: concurrent readers see the old
    entry or the new one, never part of one. Readable by others as the umask allows, as any file the user
    writes (mkstemp's 0600 would keep a cache shared by a team or CI from everyone but its writer)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only or full cache directory costs a recompile next time, nothing else


def _umask() -> int:
    """The process's umask. Reading it means setting it, so it is 022 for the instant before it is
    restored (a file another thread creates just then takes that mode); read once a cache write."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def record_build(source_name: str, arch: str, defines: Mapping[str, int | str]) -> None:
    """Append (source name, arch, defines) to ``$QOPS_NVRTC_RECORD`` as one JSON line, when it is set.
    One short write in append mode: lines from concurrent processes do not interleave."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"source": source_name, "arch": arch, "defines": dict(defines)}, sort_keys=True) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError:
        pass  # a record is a convenience for the next run; never a reason to fail this one


def native_source(name: str) -> str:
    return (NATIVE_DIR / name).read_text()


def native_options(defines: Mapping[str, int | str] | None = None, **extra) -> dict[str, Any]:
    """ProgramOptions fields for a source under qops/native with the given macro definitions."""
    # qops/native only: its sources include no CUDA toolkit header (ptx.cuh spells out what they use),
    # so a build depends on no install path and its cache key (cache_key) is the same on every machine.
    opts: dict[str, Any] = {"include_path": [str(NATIVE_DIR)]}
    if defines:
        opts["define_macro"] = [(str(k), str(v)) for k, v in sorted(defines.items())]
    opts.update(extra)
    return opts


# --- devices, loading, launching --------------------------------------------------------------------


def device_arch(device: torch.device | int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


_lock = threading.Lock()
_modules: dict[tuple, Any] = {}  # (device, source, defines) -> ObjectCode; alive for the process
_kernels: dict[tuple, Any] = {}  # (device, source, defines, kernel name) -> Kernel


def _device_index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def _defines_key(defines: Mapping[str, int | str]) -> tuple:
    return tuple(sorted((str(k), str(v)) for k, v in defines.items()))


def is_loaded(device, source_name: str, defines: Mapping[str, int | str], kernel_name: str, *, arch_specific: bool = False) -> bool:
    return (_device_index(device), source_name, _defines_key(defines), arch_specific, kernel_name) in _kernels


def get_kernel(device: torch.device | int, source_name: str, defines: Mapping[str, int | str], kernel_name: str,
               *, arch_specific: bool = False):
    """The loaded kernel ``kernel_name`` of ``qops/native/<source_name>`` built with ``defines``, for ``device``.
    ``arch_specific``: compile for the architecture's feature set (``sm_90a``: wgmma, setmaxnreg), code
    that loads on that exact architecture only; the caller has checked the device is one.

    Compiles (or reads the disk cache) and loads the module on first use per device. Raises
    :class:`NativeNotReadyError` instead when the current stream is capturing a CUDA graph. The
    driver may still defer making the code resident until the first launch, so a warm-up should
    launch each kernel once (an empty launch is enough) before capture.
    """
    idx = _device_index(device)
    dkey = _defines_key(defines)
    key = (idx, source_name, dkey, arch_specific, kernel_name)
    k = _kernels.get(key)
    if k is not None:
        return k
    if torch.cuda.is_current_stream_capturing():
        raise NativeNotReadyError(
            f"qops.native: kernel {kernel_name} of {source_name} with {dict(dkey)} is not loaded on cuda:{idx}, "
            "and compiling or loading during CUDA-graph capture is not allowed. Warm up first "
            "(qops.native.int_weight.warmup(...), or one eager call of the same shape) before capturing."
        )
    with _lock:
        k = _kernels.get(key)
        if k is not None:
            return k
        mkey = (idx, source_name, dkey, arch_specific)
        obj = _modules.get(mkey)
        cc = core()
        if obj is None:
            arch = device_arch(idx) + ("a" if arch_specific else "")
            record_build(source_name, arch, defines)
            cubin = compile_cached(native_source(source_name), arch, native_options(defines))
            with torch.cuda.device(idx):
                cc.Device(idx).set_current()
                obj = cc.ObjectCode.from_cubin(cubin)
        with torch.cuda.device(idx):
            cc.Device(idx).set_current()
            k = obj.get_kernel(kernel_name)  # the driver loads the module here (from_cubin is lazy)
        _modules[mkey] = obj  # only a module that loaded: one that failed is built and loaded again next time
        _kernels[key] = k
        return k



_streams: dict[tuple[int, int], Any] = {}


def _core_stream(stream: torch.cuda.Stream):
    """A cuda.core view of a torch stream, cached by handle (it does not own the stream)."""
    handle = int(stream.cuda_stream)
    key = (stream.device_index, handle)
    s = _streams.get(key)
    if s is None:
        s = _wrap_stream(stream, handle)
        _streams[key] = s
    return s


def _wrap_stream(stream: torch.cuda.Stream, handle: int):
    cc = core()
    if handle == 0:  # torch's default stream is the legacy default stream
        legacy = getattr(cc, "LEGACY_DEFAULT_STREAM", None)
        if legacy is not None:
            return legacy
    from_handle = getattr(getattr(cc, "Stream", None), "from_handle", None)
    if from_handle is not None:
        try:
            return from_handle(handle)
        except Exception:  # noqa: BLE001 - other signatures: fall through
            pass
    return stream  # cuda.core versions that take objects with __cuda_stream__ directly


@functools.cache
def pdl_missing() -> str | None:
    """Why :func:`launch` ignores ``pdl=True`` with this cuda.core, or None when it honours it.

    Decided once, by building a ``LaunchConfig`` with ``programmatic_stream_serialization`` (cuda-core
    1.2 added it; older ones raise TypeError). Needs no device.
    """
    try:
        cc = core()
        cc.LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except Exception as e:  # noqa: BLE001 - any refusal means launching without PDL
        return f"this cuda-core cannot launch with programmatic stream serialization (cuda-core >= 1.2 can): {type(e).__name__}: {e}"
    return None


DEFAULT_SHMEM_BYTES = 48 * 1024  # dynamic shared memory any launch may ask for without opting in

_shmem_allowed: dict[tuple[int, int], int] = {}  # (device, kernel handle) -> bytes opted in to


def max_shared_optin(device: torch.device | int) -> int:
    """The device's opt-in maximum of shared memory a block (227 KiB on sm_90, 163 KiB on sm_80)."""
    idx = _device_index(device)
    v = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", None)
    if v:
        return int(v)
    return int(core().Device(idx).properties.max_shared_memory_per_block_optin)


_shared_base: dict[int, int] = {}


def dynamic_shared_base(device: torch.device | int) -> int:
    """The shared-window address where a block's dynamic shared memory starts on ``device``, for a
    kernel without static shared memory launched without a cluster. Measured once per device by a
    one-thread kernel (``smem_base.cu``; a sync), so it must first be asked for outside CUDA-graph
    capture: kernels that bake it into their code as an immediate ask for it when they are loaded,
    and check it on entry."""
    idx = _device_index(device)
    if idx not in _shared_base:
        if torch.cuda.is_current_stream_capturing():
            raise NativeNotReadyError(f"qops.native: the dynamic shared memory base of cuda:{idx} is not known yet, and "
                                      "measuring it during CUDA-graph capture is not allowed. Warm up first.")
        kernel = get_kernel(idx, "smem_base.cu", {}, "qops_smem_base")
        with torch.cuda.device(idx):
            out = torch.full((1,), -1, dtype=torch.int32, device=torch.device("cuda", idx))
            launch(kernel, (1, 1, 1), (1, 1, 1), 16, torch.cuda.current_stream(), out.data_ptr())
            _shared_base[idx] = int(out.item())
    return _shared_base[idx]


_active_blocks: dict[tuple, int] = {}


def max_active_blocks(kernel, device: torch.device | int, threads: int, shmem: int) -> int:
    """Blocks of ``kernel`` (``threads`` a block, ``shmem`` bytes of dynamic shared memory) that fit on
    one SM of ``device`` at once (the driver's occupancy calculator), or 0 where this cuda.core cannot
    say. Cached per kernel and launch shape."""
    idx = _device_index(device)
    key = (idx, int(kernel.handle), threads, shmem)
    if key not in _active_blocks:
        if shmem > DEFAULT_SHMEM_BYTES:
            # The calculator counts no block of a kernel not yet allowed this much dynamic shared
            # memory (it answered 0 for the 65 KiB NF4 kernel queried before its first launch).
            allow_dynamic_shared(kernel, idx, shmem)
        try:
            with torch.cuda.device(idx):
                core().Device(idx).set_current()
                _active_blocks[key] = int(kernel.occupancy.max_active_blocks_per_multiprocessor(threads, shmem))
        except Exception:  # noqa: BLE001 - older cuda.core: callers then assume nothing about occupancy
            _active_blocks[key] = 0
    return _active_blocks[key]


def allow_dynamic_shared(kernel, device: torch.device | int, nbytes: int) -> None:
    """Let ``kernel`` launch with up to ``nbytes`` of dynamic shared memory on ``device``.

    Above 48 KiB a launch fails unless the function attribute
    ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` was raised first (cuda.core exposes the
    attribute read-only, so this goes to the driver). Remembered per kernel and device: a repeated
    call with no larger size makes no driver call. A refusal raises with the driver's error.
    """
    idx = _device_index(device)
    key = (idx, int(kernel.handle))
    if _shmem_allowed.get(key, DEFAULT_SHMEM_BYTES) >= nbytes:
        return
    _set_max_dynamic_shared(kernel.handle, idx, nbytes)
    _shmem_allowed[key] = nbytes


def _set_max_dynamic_shared(handle, idx: int, nbytes: int) -> None:
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):  # cuda.core loads modules as libraries: a context-free kernel
        err, dev = driver.cuDeviceGet(idx)
        if err == driver.CUresult.CUDA_SUCCESS:
            (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, dev)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"qops.native: could not allow {nbytes} bytes of dynamic shared memory on cuda:{idx} "
                           f"(max_shared_optin: {max_shared_optin(idx)}): {err}")


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], shmem: int, stream: torch.cuda.Stream, *args, pdl: bool = False) -> None:
    """Launch ``kernel`` on ``stream``; ``args``: ints for pointers, numpy scalars for the rest.

    ``pdl``: programmatic dependent launch (sm_90 and later): the kernel may start before the kernel
    ahead of it on the stream has finished, so it must execute ``griddepcontrol.wait`` before it reads
    anything that kernel may write and before it writes global memory. Where this cuda.core cannot
    express it (:func:`pdl_missing`), the launch is an ordinary one, which is always correct.
    ``shmem`` above 48 KiB opts the kernel in first (:func:`allow_dynamic_shared`, once per size).
    """
    cc = core()
    if shmem > DEFAULT_SHMEM_BYTES:
        allow_dynamic_shared(kernel, stream.device_index, shmem)
    if pdl and pdl_missing() is None:
        cfg = cc.LaunchConfig(grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=True)
    else:
        cfg = cc.LaunchConfig(grid=grid, block=block, shmem_size=shmem)
    cc.launch(_core_stream(stream), cfg, kernel, *args)


def i32(v: int) -> np.int32:
    return np.int32(v)
