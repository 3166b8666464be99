"""qops: quantized matmul operators for torch.compile.

Importing qops registers every ``torch.ops.qops.*`` op, its fake kernel and its autograd formula.
"""
from . import ops  # noqa: F401  (defines the ops)
from . import meta  # noqa: F401  (registers their fakes)
from .models import attention as _attention  # noqa: F401  (defines qops::decode_attention, the decoder's op)
from .models import norm as _norm  # noqa: F401  (defines qops::add_rmsnorm)
from .formats import FORMATS, get_format
from .lowerings import LOWERINGS, Kernel, choose
from .ops.int_weight import IntWeight, prepare_int_weight

__version__ = "0.1.0"

__all__ = ["FORMATS", "get_format", "LOWERINGS", "Kernel", "choose", "IntWeight", "prepare_int_weight"]
