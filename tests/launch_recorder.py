"""A stand-in for a Triton kernel in launch-order tests (the interpreter has no grid dependencies, so what a
GPU launch would chain is read from the launch arguments instead)."""
from __future__ import annotations


class KernelRecorder:
    """``kernel[grid](*args, **kw)`` appends ``(name, kw)`` to ``launches``, the grid as ``kw["grid"]``."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.name, {**kw, "grid": tuple(grid)}))
