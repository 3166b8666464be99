"""Fake (meta) kernels of ``qops/ops/int_weight.py``: the same argument checks, no data access."""
from __future__ import annotations

import torch

from ..lowerings import lowering_for
from ..ops._common import check_dequantize_dtype, check_out, check_workspace
from ..ops.int_weight import FAMILY, call_facts, check_int_weight, check_mm_int_weight, check_mm_int_weight_swiglu, swiglu_shape


@torch.library.register_fake("qops::mm_int_weight")
def _mm_int_weight_fake(x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset, kernel):
    shape = check_mm_int_weight("mm_int_weight", x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset)
    lowering_for(FAMILY, kernel, x.device, "mm_int_weight", call_facts(x, shape, act_perm, in_features, bits, group_size))
    return x.new_empty(shape)


@torch.library.register_fake("qops::dequantize_int_weight")
def _dequantize_int_weight_fake(qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset, dtype):
    n = check_int_weight("dequantize_int_weight", in_features, qweight, scales, qzeros, act_perm, bits, group_size, zero_offset, qweight.device)
    check_dequantize_dtype("dequantize_int_weight", dtype)
    return qweight.new_empty((n, in_features), dtype=dtype)


@torch.library.register_fake("qops::mm_int_weight_out")
def _mm_int_weight_out_fake(x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset, kernel, out, workspace):
    shape = check_mm_int_weight("mm_int_weight_out", x, qweight, scales, qzeros, act_perm, bias, in_features, bits, group_size, zero_offset)
    check_out("mm_int_weight_out", out, shape, x)
    check_workspace("mm_int_weight_out", workspace, x)
    lowering_for(FAMILY, kernel, x.device, "mm_int_weight_out", call_facts(x, shape, act_perm, in_features, bits, group_size))


@torch.library.register_fake("qops::mm_int_weight_swiglu")
def _mm_int_weight_swiglu_fake(x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset, kernel):
    shape = check_mm_int_weight_swiglu("mm_int_weight_swiglu", x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset)
    lowering_for(FAMILY, kernel, x.device, "mm_int_weight_swiglu", call_facts(x, shape, act_perm, in_features, bits, group_size))
    return x.new_empty(swiglu_shape(shape))


@torch.library.register_fake("qops::mm_int_weight_swiglu_out")
def _mm_int_weight_swiglu_out_fake(x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset, kernel, out, workspace):
    shape = check_mm_int_weight_swiglu("mm_int_weight_swiglu_out", x, qweight, scales, qzeros, act_perm, in_features, bits, group_size, zero_offset)
    check_out("mm_int_weight_swiglu_out", out, swiglu_shape(shape), x)
    check_workspace("mm_int_weight_swiglu_out", workspace, x)
    lowering_for(FAMILY, kernel, x.device, "mm_int_weight_swiglu_out", call_facts(x, shape, act_perm, in_features, bits, group_size))
