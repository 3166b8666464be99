"""Model checkpoints in Hugging Face layout, in memory or on disk, quantized with qops' own quantizers.

A checkpoint here is what a hub directory holds: ``{name: tensor}`` under the model's tensor names
plus the ``quantization_config`` of ``config.json``. :data:`QUANT_SCHEMES` says, per scheme, how
one linear layer's dense ``(N, K)`` weight becomes the tensors a checkpoint in that layout stores
(the format's reference quantizer, then its on-disk tensor names) and which ``quantization_config``
goes with them; there is one scheme per :data:`qops.formats.FORMATS` entry, named after it.

:class:`TensorWeights` serves tensors in memory through the loader's ``Weights`` interface, so a
model built from random weights is sharded, converted and prepared by exactly the code that loads a
checkpoint from files (``qops.layers.Weights.from_pretrained``); :func:`save_pretrained` writes the
same tensors as a checkpoint directory.

Which layers a scheme quantizes is the caller's list of prefixes (:func:`quantize_tensors`), usually
``LlamaConfig.linear_prefixes()``: every linear of the decoder layers, with ``lm_head`` too when
``head=True``. Embeddings and norms stay dense, and by default ``lm_head`` too, as in most GPTQ/AWQ/
compressed-tensors releases (the loader reads a layer without the scheme's tensors as dense).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors.torch import save_file

from ..formats import FORMATS
from ..layers import Weights, WeightsError
from ..layers.loader import parse_quantization_config
from ..distributed import group_rank, group_size


@dataclass(frozen=True)
class QuantScheme:
    """One way to quantize a model's linear layers: a FORMATS entry with fixed options."""

    name: str  # the FORMATS name it writes
    describe: str
    config: dict  # quantization_config of config.json
    # dense (N, K) weight -> {suffix after the layer prefix: tensor as stored}
    write: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    # the dimensions every quantized layer's N and K must be multiples of (packing, tiles, groups)
    multiple: int = 1
    tags: tuple[str, ...] = field(default=())

    @property
    def format(self):
        return FORMATS[self.name]

    def quantization_config(self, head: bool = False) -> dict:
        """``config`` for a checkpoint of this scheme; ``head``: one whose ``lm_head`` is quantized
        too, so ``lm_head`` leaves the compressed-tensors ``ignore`` list (the loader would
        otherwise look for a dense head)."""
        if not head or "lm_head" not in self.config.get("ignore", ()):
            return self.config
        return {**self.config, "ignore": [name for name in self.config["ignore"] if name != "lm_head"]}

    @property
    def quant_method(self) -> str:
        return self.config["quant_method"]


def _gptq(w):
    c = FORMATS["gptq"].quantize(w, bits=4, group_size=128, sym=False, version="v2")
    return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales, "g_idx": c.g_idx}


def _awq(w):
    c = FORMATS["awq"].quantize(w, bits=4, group_size=128, sym=False)
    return {"qweight": c.qweight, "qzeros": c.qzeros, "scales": c.scales}


def _ct_int4(w):
    c = FORMATS["compressed-tensors"].quantize(w, bits=4, group_size=128, sym=True)
    return {"weight_packed": c.weight_packed, "weight_scale": c.weight_scale.to(torch.float16), "weight_shape": c.weight_shape}


def _fp8_channel(fmt):
    def write(w):
        c = FORMATS[fmt].quantize(w, granularity="channel")
        return {"weight": c.weight, "weight_scale": c.weight_scale}

    return write


def _fp8_block(w):
    c = FORMATS["fp8-block"].quantize(w, block_size=(128, 128))
    return {"weight": c.weight, "weight_scale_inv": c.weight_scale_inv}


def _eetq(w):
    c = FORMATS["eetq"].quantize(w)  # the ampere byte order transformers saves
    return FORMATS["eetq"].to_state_dict(c)


def _bnb_int8(w):
    return FORMATS["bitsandbytes-int8"].to_state_dict(FORMATS["bitsandbytes-int8"].quantize(w))


def _bnb_4bit(quant_type):
    def write(w):
        fmt = FORMATS[f"bitsandbytes-{quant_type}"]
        return fmt.to_state_dict(fmt.quantize(w, group_size=64, nested=True, dtype=torch.bfloat16))

    return write


def _ct_int_config():
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group", "group_size": 128, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"]}


def _ct_fp8_config():
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}


QUANT_SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("gptq", "GPTQ int4, group 128, asymmetric (v2 zeros)", {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False, "checkpoint_format": "gptq_v2"},
        _gptq, 128, ("int4",)),
    QuantScheme("awq", "AWQ int4 (GEMM), group 128", {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, _awq, 128, ("int4",)),
    QuantScheme("compressed-tensors", "compressed-tensors pack-quantized int4, group 128, symmetric", _ct_int_config(),
                _ct_int4, 128, ("int4",)),
    QuantScheme("fp8", "FP8 e4m3 weights, per-channel scales, dynamic activations", {
        "quant_method": "fp8", "activation_scheme": "dynamic"}, _fp8_channel("fp8"), 1, ("fp8",)),
    QuantScheme("compressed-tensors-fp8", "compressed-tensors float-quantized FP8, per-channel, dynamic per-token activations",
                _ct_fp8_config(), _fp8_channel("compressed-tensors-fp8"), 1, ("fp8",)),
    QuantScheme("fp8-block", "FP8 e4m3 weights, 128x128 block scales (DeepSeek layout)", {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        _fp8_block, 128, ("fp8",)),
    QuantScheme("eetq", "EETQ int8 per-channel (ampere byte order)", {"quant_method": "eetq", "weights": "int8"}, _eetq, 64, ("int8",)),
    QuantScheme("bitsandbytes-int8", "bitsandbytes LLM.int8 weights (row-wise absmax)", {
        "quant_method": "bitsandbytes", "load_in_8bit": True}, _bnb_int8, 1, ("int8",)),
    QuantScheme("bitsandbytes-nf4", "bitsandbytes NF4, blocksize 64, nested absmax", {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
        _bnb_4bit("nf4"), 64, ("nf4",)),
    QuantScheme("bitsandbytes-fp4", "bitsandbytes FP4, blocksize 64, nested absmax", {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": True},
        _bnb_4bit("fp4"), 64, ("fp4",)),
)}

DEFAULT_SCHEME = "gptq"


def get_scheme(name: str | None) -> QuantScheme | None:
    """The scheme called ``name``; None or "none" for an unquantized model."""
    if name is None or name == "none":
        return None
    try:
        return QUANT_SCHEMES[name]
    except KeyError:
        raise KeyError(f"unknown quantization scheme {name!r}; known: {['none', *QUANT_SCHEMES]}") from None


def quantize_tensors(tensors: dict[str, torch.Tensor], prefixes: list[str], scheme: QuantScheme | None, *,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` with each ``<prefix>.weight`` of ``prefixes`` replaced by ``scheme``'s tensors.

    The quantizers run in float32 on the tensors' device; other tensors are passed through.
    """
    if scheme is None:
        return dict(tensors)
    out = dict(tensors)
    for i, prefix in enumerate(prefixes):
        w = out.pop(f"{prefix}.weight")
        for suffix, t in scheme.write(w.float()).items():
            out[f"{prefix}.{suffix}"] = t.contiguous()
        if progress is not None:
            progress(i + 1, len(prefixes))
    return out


class TensorWeights(Weights):
    """``qops.layers.Weights`` over tensors in memory (full, unsharded tensors under their
    checkpoint names): the loader's sharding, dtype conversion and scheme detection, no files.

    Shards are copied out of the full tensors (so the full ones may be freed); tensors taken whole
    are returned as they are, moved to ``device``.
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float16,
        process_group=None,
        aliases: dict[str, list[str]] | None = None,
        quantization_config: dict | None = None,
        origin: str = "tensors in memory",
    ) -> None:
        # Weights.__init__ opens files; set the same attributes without them.
        self.tensors = dict(tensors)
        self.origin = origin
        self.filenames = []
        self.device = torch.device(device)
        self.dtype = dtype
        self.process_group = process_group
        self.rank, self.world_size = group_rank(process_group), group_size(process_group)
        self.aliases = aliases or {}
        self.config = parse_quantization_config(quantization_config)
        self.bytes_read = 0
        self.entries = {}

    def _resolve(self, name: str) -> str:
        if name in self.tensors:
            return name
        for alias in self.aliases.get(name, ()):
            if alias in self.tensors:
                return alias
        return name

    def has(self, name):
        return self._resolve(name) in self.tensors

    def _tensor(self, name: str) -> torch.Tensor:
        resolved = self._resolve(name)
        if resolved not in self.tensors:
            prefix = name.rsplit(".", 1)[0] if "." in name else ""
            near = self.names_under(prefix + "." if prefix else "")[:12]
            raise WeightsError(f"tensor {name!r} not found in {self.origin}; tensors under {prefix!r}: {near}")
        return self.tensors[resolved]

    def shape(self, name):
        return tuple(self._tensor(name).shape)

    def dtype_of(self, name):
        return self._tensor(name).dtype

    def where(self, name):
        return self.origin

    def names_under(self, prefix):
        return sorted(n for n in self.tensors if n.startswith(prefix))

    def read(self, name, index, dtype=None, view=None):
        t = self._tensor(name)
        if view is not None:
            t = t.contiguous().view(view[1]).reshape(view[0])
        part = t[index]
        if part.data_ptr() != t.data_ptr() or part.numel() != t.numel():
            part = part.clone()
        self.bytes_read += part.numel() * part.element_size()
        return part if dtype is None else part.to(dtype)


def save_pretrained(path: str, tensors: dict[str, torch.Tensor], config: dict, quantization_config: dict | None = None, *,
                    shard_bytes: int = 1 << 30) -> None:
    """Write ``tensors`` as a Hugging Face checkpoint directory: ``config.json`` (``config`` plus
    ``quantization_config``), safetensors shards of about ``shard_bytes`` and, when there is more
    than one shard, ``model.safetensors.index.json``."""
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, part in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = dict(config)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
