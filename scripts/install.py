"""Install qops and its dependencies, taking the CPU build of torch on machines without a GPU.

    python3 scripts/install.py           # qops
    python3 scripts/install.py --test    # qops and the test tools

A plain ``pip install torch`` on Linux takes a CUDA build of several GB; a CPU-only machine needs
the CPU wheels, which live on PyTorch's own index. When that index cannot be reached, the pinned
release is taken from the configured sources.

qops itself is installed editable. Where the build backend pyproject.toml names (setuptools >= 68,
with ``wheel`` below setuptools 70.1) is already installed, it is built with that one
(``--no-build-isolation``), so a machine that has every package needs no network; otherwise pip
fetches setuptools from the configured sources into an isolated build environment.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

TORCH_MIN = (2, 11)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FALLBACK_TORCH = "torch==2.13.0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pip(*args: str, env: dict | None = None) -> int:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def torch_ok() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if out.returncode:
        return False
    major, minor = (int(p) for p in out.stdout.strip().split(".")[:2])
    return (major, minor) >= TORCH_MIN


def _version(dist: str) -> tuple[int, ...] | None:
    """The leading numbers of an installed distribution's version ("84.2.1" -> (84, 2, 1)), or None."""
    try:
        raw = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", raw.split("+")[0])[:3]) or None


def build_backend_installed() -> bool:
    """Whether pyproject.toml's build backend can build qops here without fetching anything:
    setuptools >= 68, plus ``wheel`` for setuptools older than 70.1 (which builds wheels itself)."""
    setuptools = _version("setuptools")
    if setuptools is None or setuptools < (68,):
        return False
    return setuptools >= (70, 1) or _version("wheel") is not None


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


def install_torch() -> None:
    if torch_ok():
        return
    want = f"torch>={TORCH_MIN[0]}.{TORCH_MIN[1]}"
    if has_gpu():
        if pip(want):
            sys.exit("installing torch failed")
        return
    # Only PyTorch's CPU index, with local pip configuration ignored, so no CUDA build can slip in.
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    if pip("--retries", "1", "--timeout", "20", "--index-url", CPU_INDEX, want, env=env) == 0:
        return
    print(f"the CPU index is unreachable; installing {FALLBACK_TORCH} from the configured sources", flush=True)
    if pip(FALLBACK_TORCH):
        sys.exit("installing torch failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", action="store_true",
                    help="also install the test tools (pytest, expecttest, bitsandbytes as a second oracle) and the test pins (triton>=3.8, nvidia-cuda-nvrtc==13.0.*)")
    args = ap.parse_args()
    install_torch()
    target = ROOT + ("[test]" if args.test else "")
    isolation = ("--no-build-isolation",) if build_backend_installed() else ()
    if pip(*isolation, "-e", target):
        sys.exit("installing qops failed")


if __name__ == "__main__":
    main()
