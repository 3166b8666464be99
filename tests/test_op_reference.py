"""docs/OPS.md is the public reference of the ops: every registered op must be there, schema exact."""
import pathlib
import re

import torch

import qops  # noqa: F401

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "OPS.md"


def registered_schemas() -> dict[str, str]:
    out = {}
    for name in dir(torch.ops.qops):
        packet = getattr(torch.ops.qops, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            for overload in packet.overloads():
                out[f"{name}.{overload}"] = str(getattr(packet, overload)._schema)
    return out


def documented_schemas() -> set[str]:
    return set(re.findall(r"^(qops::\w+\(.*\) -> .*)$", DOC.read_text(), flags=re.M))


def test_every_registered_op_is_documented_with_its_exact_schema():
    documented = documented_schemas()
    missing = {k: v for k, v in registered_schemas().items() if v not in documented}
    assert not missing, f"ops missing from docs/OPS.md or with a different schema: {missing}"


def test_every_documented_op_is_registered():
    registered = set(registered_schemas().values())
    stale = documented_schemas() - registered
    assert not stale, f"docs/OPS.md documents schemas no op has: {stale}"
    assert registered, "no qops op is registered"
