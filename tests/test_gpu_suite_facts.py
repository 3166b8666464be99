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
