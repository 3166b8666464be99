"""On an sm_90 GPU (the H200 the suite is run on), the capability flags other GPU tests skip or
fall back on report available, so a regression in one of them fails here instead of turning ~50
tests into skips (tests/gpu/test_gpu_native_int_weight.py skips on ``gemm.wgmma_missing``,
``compiler.pdl_missing``, ``native._device_facts(0)[1]`` and a missing plan table;
tests/gpu/test_gpu_opcheck.py on ``Lowering.device_refusal``). On other GPUs these flags may
legitimately refuse: skipped.

Run with ``pytest -m gpu tests/gpu/test_gpu_capabilities.py``.
"""
from __future__ import annotations

import pytest
import torch

from qops.lowerings import LOWERINGS, LOWERINGS_BY_NAME
from qops.native import compiler
from qops.native import int_weight as native
from qops.native import int_weight_gemm as gemm

pytestmark = pytest.mark.gpu

H200 = "NVIDIA H200"  # the name qops/native/plans/h200.json is keyed on
MEASURED = (H200, "NVIDIA H100 80GB HBM3")  # the GPUs qops/native/plans/ has a table for (h200.json, h100.json)


@pytest.fixture
def sm90():
    cap = torch.cuda.get_device_capability(0)
    if cap != (9, 0):
        pytest.skip(f"checks sm_90's capability flags; cuda:0 has compute capability {cap}")
    return cap


def test_wgmma_clusters_and_pdl_are_available_on_sm90(sm90, monkeypatch):
    assert gemm.wgmma_missing(0) is None
    assert native._sm90(0)
    sms, cluster_ok = native._device_facts(0)
    assert cluster_ok, "thread-block clusters (and bulk copies) are sm_90 features"
    assert compiler.pdl_missing() is None, "cuda-core >= 1.2 launches with programmatic stream serialization"
    monkeypatch.delenv(native.PDL_ENV, raising=False)
    assert native.use_pdl(0)


def test_every_cuda_lowering_runs_on_sm90(sm90):
    refused = {low.name: why for low in LOWERINGS if "cuda" in low.device_types
               and (why := low.device_refusal(torch.device("cuda", 0))) is not None}
    assert not refused, refused
    block = LOWERINGS_BY_NAME["scaled_mm_fp8"].block_scaling
    assert block is not None and block.device_refusal(sm90) is None


def test_this_gpus_plan_table_is_found():
    name = torch.cuda.get_device_name(0)
    if name not in MEASURED:
        pytest.skip(f"plan tables are measured on {', '.join(MEASURED)}; cuda:0 is {name}")
    table = native.plan_tables().get(name)
    assert table is not None and table["plans"], sorted(native.plan_tables())
    assert table["sms"] == native._device_facts(0)[0], (table["sms"], native._device_facts(0))
