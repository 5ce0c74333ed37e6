"""Checkpoint formats: a model's ``quantization_config`` -> ``CheckpointFormat`` (QuantScheme + tensor reading).

``detect(config_json)`` picks the family by ``quant_method``:

    (none)               unquantized bf16/fp16/fp32 (``hf``); ``online="fp8"`` quantizes after loading
    fp8                  serialized FP8, per-tensor or DeepSeek-V3 blocks (``fp8``)
    compressed-tensors   llm-compressor checkpoints (``compressed_tensors``)
    gptq / awq           int4 (``gptq``, ``awq``)
    mxfp4                gpt-oss (``mxfp4``)
    modelopt             NVIDIA ModelOpt FP8 / NVFP4 (``modelopt``)

``find_experts`` maps a layer's expert tensors by their names (``layout``).
``load_checkpoint(path)`` builds the ``FusedMoE`` layers of a folder with
config.json and ``*.safetensors``; ``run_checkpoint(path, backend, tokens)``
runs one against transformers' own block of the same checkpoint, or the
float64 reference (``fusedmoe run --checkpoint``).

Optional packages: safetensors and compressed-tensors come with
``fusedmoe[checkpoints]``, transformers (the outside truth) with ``fusedmoe[hf]``.
"""

from __future__ import annotations

from .base import CheckpointFormat, CheckpointReader, read_config
from .checkpoint import load_checkpoint, load_layer
from .detect import CHECKPOINT_FORMATS, detect
from .layout import ExpertLayout, find_experts
from .run import run_checkpoint

__all__ = [
    "CHECKPOINT_FORMATS",
    "CheckpointReader",
    "CheckpointFormat",
    "ExpertLayout",
    "detect",
    "find_experts",
    "load_checkpoint",
    "load_layer",
    "read_config",
    "run_checkpoint",
]
