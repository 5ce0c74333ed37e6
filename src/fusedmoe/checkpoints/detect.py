"""Which checkpoint format a model's ``quantization_config`` names (``detect``)."""

from __future__ import annotations

from ..errors import UnsupportedError
from .awq import AwqFormat
from .base import CheckpointFormat
from .compressed_tensors import CompressedTensorsFormat
from .fp8 import Fp8Format
from .gptq import GptqFormat
from .hf import UnquantizedFormat
from .modelopt import ModelOptFormat
from .mxfp4 import GptOssMxfp4Format

CHECKPOINT_FORMATS: tuple[type[CheckpointFormat], ...] = (
    Fp8Format,
    CompressedTensorsFormat,
    GptqFormat,
    AwqFormat,
    GptOssMxfp4Format,
    ModelOptFormat,
)


def detect(config_json: dict, *, online: str | None = None) -> CheckpointFormat:
    """The CheckpointFormat of a checkpoint from its config.json (the whole dict, or its quantization_config).

    online: quantize an unquantized checkpoint after loading ('fp8' per-tensor or 'fp8_block').
    """
    qc = config_json.get("quantization_config", config_json if "quant_method" in config_json else None)
    if qc is None:
        return UnquantizedFormat(online)
    if online is not None:
        raise UnsupportedError(f"online={online!r}: the checkpoint is already quantized ({qc.get('quant_method')})")
    method = str(qc.get("quant_method", "")).lower()
    for cls in CHECKPOINT_FORMATS:
        if method in cls.quant_methods:
            return cls.from_config(qc)
    known = sorted(m for cls in CHECKPOINT_FORMATS for m in cls.quant_methods)
    raise UnsupportedError(f"quantization_config.quant_method: expected one of {known}, got {method!r}")
