"""The capability table as data: the chooser's order, and warm-up when a weight is prepared."""
import dataclasses

import torch

import qops
from qops import lowerings
from qops.formats import FORMATS

WARMED = []


def record_warmup(weight) -> None:
    WARMED.append((weight.out_features, weight.in_features, int(weight.kernel)))


def test_every_lowering_entry_and_warmup_names_a_function():
    for low in lowerings.LOWERINGS:
        for path in filter(None, (low.entry, low.warmup)):
            module, _, fn = path.partition(":")
            assert module.startswith("qops.") and fn, f"{low.name}: bad entry {path!r}"


def test_names_and_kernel_ids_are_unique_per_family():
    names = [l.name for l in lowerings.LOWERINGS]
    assert len(names) == len(set(names))
    keys = [(l.family, l.kernel) for l in lowerings.LOWERINGS]
    assert len(keys) == len(set(keys))


def test_prepare_runs_the_chosen_lowerings_warmup_once(monkeypatch):
    ref = lowerings.LOWERINGS_BY_NAME["reference_int_weight"]
    warmed_ref = dataclasses.replace(ref, warmup=f"{__name__}:record_warmup")
    table = tuple(warmed_ref if l is ref else l for l in lowerings.LOWERINGS)
    monkeypatch.setattr(lowerings, "LOWERINGS", table)
    WARMED.clear()
    ckpt = FORMATS["gptq"].quantize(torch.randn(24, 72), bits=4, group_size=32, sym=False)
    w = FORMATS["gptq"].prepare(ckpt)
    assert w.choice.lowering is warmed_ref
    assert WARMED == [(24, 72, int(qops.Kernel.REFERENCE))]
    # Choosing later (pieces assembled first) warms up once too, and not before.
    WARMED.clear()
    raw = FORMATS["gptq"].prepare(ckpt, choose_lowering=False)
    assert WARMED == [] and raw.choice is None
    qops.ops.int_weight.with_lowering(raw, "gptq")
    assert WARMED == [(24, 72, int(qops.Kernel.REFERENCE))]
