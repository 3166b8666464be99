"""``torch.ops.qops.*`` definitions and their reference kernels, one module per op family."""
from . import int_weight  # noqa: F401
from . import int8_weight  # noqa: F401
from . import blockwise4  # noqa: F401
from . import fp8  # noqa: F401
