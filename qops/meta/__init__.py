"""Fake kernels, one module per module of ``qops/ops``."""
from . import int_weight  # noqa: F401
from . import int8_weight  # noqa: F401
from . import blockwise4  # noqa: F401
from . import fp8  # noqa: F401
