"""``torch.ops.qops.*`` definitions and their reference kernels, one module per op family."""
from . import int_weight  # noqa: F401
