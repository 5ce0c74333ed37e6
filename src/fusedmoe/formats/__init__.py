"""Checkpoint formats: a model's ``quantization_config`` -> ``Format`` (QuantScheme + tensor reading).

``detect(config_json)`` picks the family by ``quant_method``:

    (none)               unquantized bf16/fp16/fp32 (``hf``); ``online="fp8"`` quantizes after loading
    fp8                  serialized FP8, per-tensor or DeepSeek-V3 blocks (``fp8``)
    compressed-tensors   llm-compressor checkpoints (``compressed_tensors``)
    gptq / awq           int4 (``gptq``, ``awq``)
    mxfp4                gpt-oss (``mxfp4``)
    modelopt             NVIDIA ModelOpt FP8 / NVFP4 (``modelopt``)

``load_checkpoint(path)`` builds the ``FusedMoE`` layers of a folder with
config.json and ``*.safetensors``; ``run_checkpoint(path, backend, tokens)``
runs the first one against the reference (``fusedmoe run --checkpoint``).
"""

from __future__ import annotations

from ..errors import UnsupportedError
from .awq import AwqFormat
from .base import CheckpointReader, Format, read_config
from .compressed_tensors import CompressedTensorsFormat
from .fp8 import Fp8Format
from .gptq import GptqFormat
from .hf import UnquantizedFormat
from .modelopt import ModelOptFormat
from .mxfp4 import GptOssMxfp4Format

FORMATS: tuple[type[Format], ...] = (
    Fp8Format,
    CompressedTensorsFormat,
    GptqFormat,
    AwqFormat,
    GptOssMxfp4Format,
    ModelOptFormat,
)


def detect(config_json: dict, *, online: str | None = None) -> Format:
    """The Format of a checkpoint from its config.json (the whole dict, or its quantization_config).

    online: quantize an unquantized checkpoint after loading ('fp8' per-tensor or 'fp8_block').
    """
    qc = config_json.get("quantization_config", config_json if "quant_method" in config_json else None)
    if qc is None:
        return UnquantizedFormat(online)
    if online is not None:
        raise UnsupportedError(f"online={online!r}: the checkpoint is already quantized ({qc.get('quant_method')})")
    method = str(qc.get("quant_method", "")).lower()
    for cls in FORMATS:
        if method in cls.quant_methods:
            return cls.from_config(qc)
    known = sorted(m for cls in FORMATS for m in cls.quant_methods)
    raise UnsupportedError(f"quantization_config.quant_method: expected one of {known}, got {method!r}")


from .checkpoint import load_checkpoint, load_layer, run_checkpoint  # noqa: E402

__all__ = [
    "FORMATS",
    "CheckpointReader",
    "Format",
    "detect",
    "load_checkpoint",
    "load_layer",
    "read_config",
    "run_checkpoint",
]
