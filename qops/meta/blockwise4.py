"""Fake (meta) kernels of ``qops/ops/blockwise4.py``: the same argument checks, no data access."""
from __future__ import annotations

import torch

from ..lowerings import lowering_for
from ..ops.blockwise4 import FAMILY, call_facts, check_blockwise4, check_mm_blockwise4
from ..ops._common import check_dequantize_dtype, check_out, check_workspace


@torch.library.register_fake("qops::mm_blockwise4")
def _mm_blockwise4_fake(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features,
                        in_features, blocksize, nested_blocksize, layout, kernel):
    shape = check_mm_blockwise4("mm_blockwise4", x, qweight, code, absmax, nested_code, nested_absmax, nested_offset,
                                bias, out_features, in_features, blocksize, nested_blocksize, layout)
    lowering_for(FAMILY, kernel, x.device, "mm_blockwise4", call_facts(x, shape, blocksize))
    return x.new_empty(shape)


@torch.library.register_fake("qops::mm_blockwise4_out")
def _mm_blockwise4_out_fake(x, qweight, code, absmax, nested_code, nested_absmax, nested_offset, bias, out_features,
                            in_features, blocksize, nested_blocksize, layout, kernel, out, workspace):
    shape = check_mm_blockwise4("mm_blockwise4_out", x, qweight, code, absmax, nested_code, nested_absmax,
                                nested_offset, bias, out_features, in_features, blocksize, nested_blocksize, layout)
    check_out("mm_blockwise4_out", out, shape, x)
    check_workspace("mm_blockwise4_out", workspace, x)
    lowering_for(FAMILY, kernel, x.device, "mm_blockwise4_out", call_facts(x, shape, blocksize))


@torch.library.register_fake("qops::dequantize_blockwise4")
def _dequantize_blockwise4_fake(qweight, code, absmax, nested_code, nested_absmax, nested_offset, out_features,
                                in_features, blocksize, nested_blocksize, layout, dtype):
    n = check_blockwise4("dequantize_blockwise4", in_features, qweight, code, absmax, nested_code, nested_absmax,
                         nested_offset, out_features, blocksize, nested_blocksize, layout, qweight.device)
    check_dequantize_dtype("dequantize_blockwise4", dtype)
    return qweight.new_empty((n, in_features), dtype=dtype)
