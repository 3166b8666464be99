"""Fake (meta) kernels of ``qops/ops/fp8.py``: the same argument checks, no data access."""
from __future__ import annotations

import torch

from ..ops._common import check_dequantize_dtype, check_out, check_workspace
from ..ops.fp8 import check_fp8_weight, check_mm_fp8_weight, check_scaled_mm_fp8


@torch.library.register_fake("qops::mm_fp8_weight")
def _mm_fp8_weight_fake(x, weight, weight_scale, bias, block_n, block_k, kernel):
    shape = check_mm_fp8_weight("mm_fp8_weight", x, weight, weight_scale, bias, block_n, block_k, kernel)
    return x.new_empty(shape)


@torch.library.register_fake("qops::mm_fp8_weight_out")
def _mm_fp8_weight_out_fake(x, weight, weight_scale, bias, block_n, block_k, kernel, out, workspace):
    shape = check_mm_fp8_weight("mm_fp8_weight_out", x, weight, weight_scale, bias, block_n, block_k, kernel)
    check_out("mm_fp8_weight_out", out, shape, x)
    check_workspace("mm_fp8_weight_out", workspace, x)


@torch.library.register_fake("qops::scaled_mm_fp8")
def _scaled_mm_fp8_fake(x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, kernel):
    shape = check_scaled_mm_fp8("scaled_mm_fp8", x_fp8, x_scale, weight, weight_scale, bias, block_n, block_k, out_dtype, kernel)
    return x_fp8.new_empty(shape, dtype=out_dtype)


@torch.library.register_fake("qops::dequantize_fp8")
def _dequantize_fp8_fake(weight, weight_scale, block_n, block_k, dtype):
    n = check_fp8_weight("dequantize_fp8", None, weight, weight_scale, block_n, block_k, weight.device)
    check_dequantize_dtype("dequantize_fp8", dtype)
    return weight.new_empty((n, weight.shape[1]), dtype=dtype)
