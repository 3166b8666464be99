"""Fake kernels, one module per module of ``qops/ops``."""
from . import int_weight  # noqa: F401
