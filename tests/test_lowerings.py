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


def test_warm_up_builds_for_the_activation_dtype_the_weight_was_prepared_for(monkeypatch):
    """A GPTQ checkpoint keeps its fp16 scales when prepared for bf16 activations: the chooser is asked
    about bf16, so the warm-ups (with_lowering's, and a layer's gated one) must build the bf16 kernels
    (QOPS_DT=1) a call will load, not the scales' dtype's. The native lowering is chosen as on an H200
    (benchmarks/record_native_builds.py fakes its device facts and records the builds instead of
    compiling them); its warm-up sees the weight on cuda:0."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from qops.layers.int_weight import IntWeightLinear
    from qops.native import int_weight as niw
    from qops.ops import int_weight as iw

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    sys.modules.pop("record_native_builds", None)
    import record_native_builds

    native = lowerings.LOWERINGS_BY_NAME["native_w4a16"]

    def warm_up_on_cuda(warm_up, lowering, weight):
        warm_up(lowering, dataclasses.replace(weight, qweight=SimpleNamespace(device=torch.device("cuda", 0))))

    monkeypatch.setattr(iw, "choose", lambda spec: lowerings.Choice(native, ()))
    monkeypatch.setattr(iw, "warm_up", lambda low, w: warm_up_on_cuda(lowerings.warm_up, low, w))
    ckpt = FORMATS["gptq"].quantize(torch.randn(256, 256), bits=4, group_size=128, sym=False)
    with record_native_builds.pretend_device() as records:
        w = FORMATS["gptq"].prepare(ckpt, dtype=torch.bfloat16)
        assert w.scales.dtype == torch.float16 and w.act_dtype == torch.bfloat16
        assert records and {r["defines"]["QOPS_DT"] for r in records} == {niw._DT[torch.bfloat16]}
        records.clear()
        monkeypatch.setattr("qops.layers.int_weight.warm_up_swiglu", lambda low, w: warm_up_on_cuda(lowerings.warm_up_swiglu, low, w))
        IntWeightLinear(w).prepare_swiglu()
        gated = [r for r in records if r["defines"].get("QOPS_GLU") == 1]
        assert gated and {r["defines"]["QOPS_DT"] for r in records} == {niw._DT[torch.bfloat16]}


def test_native_lowerings_need_triton_for_the_calls_they_hand_on(monkeypatch):
    """The native lowerings delegate the calls they do not serve (rows past theirs, tensors refused at call
    time) to triton: where triton is not importable the chooser refuses them with that reason, and picks a
    lowering that serves every call."""
    import sys

    monkeypatch.delenv(lowerings.DISABLE_ENV, raising=False)
    monkeypatch.setattr(lowerings, "_cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(lowerings, "_native_missing", lambda: None)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    for family, fmt, group_size, native in (("int_weight", "gptq", 128, "native_w4a16"),
                                            ("blockwise4", "bitsandbytes-nf4", 64, "native_blockwise4")):
        spec = lowerings.WeightSpec(family=family, format=fmt, bits=4, group_size=group_size, n=4096, k=4096, act_order=False,
                                    symmetric=True, device=torch.device("cuda", 0), act_dtype=torch.float16)
        choice = lowerings.choose(spec)
        assert choice.lowering.kernel == qops.Kernel.REFERENCE, choice.explain()
        assert dict(choice.refusals)[native].startswith("it delegates the calls it does not serve to triton: triton is not importable")


def test_an_implementation_runs_with_its_inputs_cuda_device_current(monkeypatch):
    """Triton and the native launches take the current CUDA device and its stream: ``implementation`` /
    ``swiglu_implementation`` hand back the entry itself where the inputs' device is current (or not CUDA), and
    otherwise the entry called inside ``torch.cuda.device`` of the inputs' device (recorded here, without a GPU)."""
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))
            return False

    seen = []
    monkeypatch.setattr(lowerings, "_entry", lambda path: lambda *a, **k: seen.append((path, a, k)) or torch.ones(2, 4))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Recorder)
    fam, kernel = "int_weight", int(lowerings.Kernel.TRITON)
    monkeypatch.setattr(lowerings, "lowering_for", lambda *a, **k: lowerings.LOWERINGS_BY_KERNEL[(fam, lowerings.Kernel(kernel))])
    for device in (torch.device("cpu"), torch.device("meta"), torch.device("cuda", 0)):
        fn = lowerings.implementation(fam, kernel, device, "t")
        assert fn(1, w=2).shape == (2, 4) and not entered, device
    far = torch.device("cuda", 1)
    for get in (lowerings.implementation, lowerings.swiglu_implementation):
        entered.clear()
        assert get(fam, kernel, far, "t")(3, workspace=None).shape[0] == 2
        assert entered == [("enter", far), ("exit", far)], get
    assert seen[-1][1][0] == 3  # the arguments reach the entry
