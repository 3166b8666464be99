"""Fake (meta) kernels of ``qops/ops/int8_weight.py``: the same argument checks, no data access."""
from __future__ import annotations

import torch

from ..lowerings import lowering_for
from ..ops.int8_weight import FAMILY, call_facts, check_int8_weight, check_mm_int8_weight
from ..ops._common import check_dequantize_dtype, check_out, check_workspace


@torch.library.register_fake("qops::mm_int8_weight")
def _mm_int8_weight_fake(x, qweight, scales, bias, kernel):
    shape = check_mm_int8_weight("mm_int8_weight", x, qweight, scales, bias)
    lowering_for(FAMILY, kernel, x.device, "mm_int8_weight", call_facts(x, shape))
    return x.new_empty(shape)


@torch.library.register_fake("qops::mm_int8_weight_out")
def _mm_int8_weight_out_fake(x, qweight, scales, bias, kernel, out, workspace):
    shape = check_mm_int8_weight("mm_int8_weight_out", x, qweight, scales, bias)
    check_out("mm_int8_weight_out", out, shape, x)
    check_workspace("mm_int8_weight_out", workspace, x)
    lowering_for(FAMILY, kernel, x.device, "mm_int8_weight_out", call_facts(x, shape))


@torch.library.register_fake("qops::dequantize_int8_weight")
def _dequantize_int8_weight_fake(qweight, scales, dtype):
    n = check_int8_weight("dequantize_int8_weight", None, qweight, scales, qweight.device)
    check_dequantize_dtype("dequantize_int8_weight", dtype)
    return qweight.new_empty((n, qweight.shape[-1]), dtype=dtype)
