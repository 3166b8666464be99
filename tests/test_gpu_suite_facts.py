"""Facts about an H200 that tests/gpu relies on to check what it claims, computed on the CPU with the
project's own planners and an H200's numbers (132 SMs, thread-block clusters, 227 KiB of opt-in
shared memory), so a planner change that would make a GPU test compare a path with itself fails here
first (no GPU needed)."""
from __future__ import annotations

import pytest

from qops.native import int_weight as native
from tests.int_weight_cases import CLUSTER_COMPARE_M, RULE_CLUSTER_M, native_cluster_pairs

H200_SMS = 132
H200_SMEM_OPTIN = 227 * 1024 - native.STATIC_SHMEM_BYTES  # what native.smem_optin_bytes gives there


@pytest.mark.parametrize("shape", sorted(RULE_CLUSTER_M), ids=str)
def test_cluster_comparison_takes_a_cluster_at_every_m_on_an_h200(shape):
    """tests/gpu/test_gpu_native_int_weight.py::test_cluster_and_workspace_reductions_agree_bitwise:
    at every M it forces a cluster plan and its workspace twin (both within the kernel's limits on an
    H200), over cluster sizes 2, 4 and 8 and tile heights MT = 1..4, and at RULE_CLUSTER_M the
    cluster plan is the rule's own."""
    n, k = shape
    pairs = native_cluster_pairs(n, k, H200_SMS, H200_SMEM_OPTIN)
    assert [m for m, *_ in pairs] == list(CLUSTER_COMPARE_M)
    for m, rule, cl, ws in pairs:
        assert cl.cluster and not ws.cluster and cl.splits == ws.splits and cl.splits in (2, 4, 8), (m, cl)
        assert ws.workspace == cl.splits * m * n * 4 and cl.workspace == 0
        assert (cl.nwn, cl.mt, cl.xfull) == (rule.nwn, rule.mt, rule.xfull)
    assert [m for m, rule, cl, _ in pairs if rule == cl] == list(RULE_CLUSTER_M[shape])


def test_cluster_comparisons_cover_every_cluster_size_and_tile_height():
    seen = {(cl.splits, cl.mt) for shape in RULE_CLUSTER_M for _, _, cl, _ in native_cluster_pairs(*shape, H200_SMS, H200_SMEM_OPTIN)}
    assert {s for s, _ in seen} == {2, 4, 8} and {mt for _, mt in seen} == {1, 2, 3, 4}, sorted(seen)


def _tiny_model_pairs():
    from qops.models.testing import scheme_lowerings

    return scheme_lowerings("cuda")


@pytest.mark.parametrize("scheme,lowering", _tiny_model_pairs(), ids=[f"{s}-{low}" for s, low in _tiny_model_pairs()])
def test_only_the_device_refuses_the_tiny_models_pairs(scheme, lowering):
    """tests/gpu/test_gpu_model.py fails (no longer skips) where the chooser refuses a forced pair
    other than for the GPU's compute capability: the tiny model's layers are within every pair's
    static limits, so on the CPU the forced lowering's only refusal is the device (for W8A8, the fp8
    GEMM's, named in the W8A16 fallback's reasons) and the reference lowerings serve them."""
    import torch

    from qops.models import LlamaConfig, LlamaForCausalLM, quantize_tensors, random_tensors
    from qops.models.checkpoint import get_scheme
    from qops.models.testing import forced_lowering

    config = LlamaConfig.tiny()
    sch = get_scheme(scheme)
    tensors = quantize_tensors(random_tensors(config, seed=5), config.linear_prefixes(head=False), sch)
    with forced_lowering(scheme, lowering):
        model = LlamaForCausalLM.from_tensors(config, tensors, sch.quantization_config(head=False), device="cpu",
                                              dtype=torch.bfloat16, max_batch=8, max_seq=16, process_group=None)
    from qops.lowerings import LOWERINGS_BY_NAME

    device_only = f"{lowering}: runs on ['cuda'], not cpu"
    on_cpu = "cpu" in LOWERINGS_BY_NAME[lowering].device_types  # the reference lowerings: served here
    for m in model.quantized_linears():
        why = m.choice.explain()
        if on_cpu:
            assert m.choice.lowering.name == lowering, why
            continue
        assert m.choice.lowering.name != lowering and device_only in why, why
        assert [line for line in why.splitlines() if lowering in line and "compute capability" in line] == [], why


def _gpu_module(name):
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_facts_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _fits(make) -> bool:
    try:
        make()
    except ValueError:
        return False
    return True


def test_plan_sweeps_run_what_their_guards_ask_for_on_an_h200(monkeypatch):
    """The "ran" guards of tests/gpu/test_gpu_native_int_weight.py's forced-plan sweeps hold on an
    H200's shared memory: every PLAN_VARIANT fits >= 3 (shape, M) cases, every WGMMA_PLAN >= 20,
    every GLU_PLAN all four M, every PDL_PLAN both matmuls at M = 1."""
    monkeypatch.setattr(native, "smem_optin_bytes", lambda index: H200_SMEM_OPTIN)
    T = _gpu_module("test_gpu_native_int_weight")
    lim = H200_SMEM_OPTIN
    for v in T.PLAN_VARIANTS:
        nwn, splits, cluster, xfull, ring, minb, fold, prefetch = v[:8]
        sr = v[8] if len(v) > 8 else 0
        ran = sum(_fits(lambda m=m, n=n, k=k: native.make_plan(m, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull, ring=ring,
                                                                   minb=minb, fold=fold, prefetch=prefetch, smem_ring=sr, smem_limit=lim))
                  for n, k in ((1000, 777), (512, 2048), (640, 1280)) for m in (1, 7, 16, 17, 24, 32))
        assert ran >= 3, (v, ran)
    for v in T.WGMMA_PLANS:
        ran = sum(_fits(lambda m=m, n=n, k=k: T._wgmma_plan(m, n, k, *v))
                  for n, k in ((1000, 777), (512, 2048), (640, 1280), (1024, 2048)) for m in (1, 7, 9, 16, 17, 24, 32))
        assert ran >= 20, (v, ran)
    for nwn, splits, cluster, xfull in T.GLU_PLANS:
        assert all(_fits(lambda m=m: native.make_plan(m, 2048, 1536, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull,
                                                      minb=1 if m > 16 else 2, smem_limit=lim)) for m in (1, 8, 16, 24))
    for v in T.PDL_PLANS:
        nwn, splits, cluster, xfull = v[:4]
        sr = v[4] if len(v) > 4 else 0
        assert all(_fits(lambda n=n, k=k: native.make_plan(1, n, k, nwn=nwn, splits=splits, cluster=cluster, xfull=xfull, smem_ring=sr,
                                                           smem_limit=lim)) for n, k in ((1024, 2048), (512, 1024))), v
