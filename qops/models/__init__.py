"""Whole models built from qops layers: compiled into CUDA graphs, with preallocated scratch.

- :mod:`qops.models.llama`: a Llama-style decoder (``LlamaConfig``, ``LlamaForCausalLM``,
  ``generate``) with a static KV cache, loadable from Hugging Face checkpoints in any format the
  layer registry serves, or built with random weights.
- :mod:`qops.models.layer_kernel`: ``qops::decode_layers``, every decoder layer of a batch-1 step in one
  op (experimental persistent kernel; ``LlamaForCausalLM.use_layer_kernel``).
- :mod:`qops.models.checkpoint`: quantization schemes (``QUANT_SCHEMES``, one per
  ``qops.formats.FORMATS`` entry), in-memory checkpoints (``TensorWeights``), ``save_pretrained``.
"""
from .checkpoint import DEFAULT_SCHEME, QUANT_SCHEMES, QuantScheme, TensorWeights, get_scheme, quantize_tensors, save_pretrained
from .llama import CapturedDecode, LlamaConfig, LlamaForCausalLM, compile_decode, default_process_group, generate, random_tensors, save_random_checkpoint

__all__ = [
    "CapturedDecode", "DEFAULT_SCHEME", "QUANT_SCHEMES", "LlamaConfig", "LlamaForCausalLM", "QuantScheme", "TensorWeights", "compile_decode", "default_process_group",
    "generate", "get_scheme", "quantize_tensors", "random_tensors", "save_pretrained", "save_random_checkpoint",
]
