"""Ordered backend candidates per scheme family, platform class and token layout: data.

The oracle walks a list and takes the first backend whose Experts class accepts
the configuration, so each list puts the fastest backend first and the
always-correct fallbacks last. Every registered backend of the layout that a
list leaves out is appended (alphabetically), so an explanation names every
candidate with its reason, and a new backend shows up before it is ranked.

Where the order comes from (the per-family orders inference engines ship, and the MXFP4
rules: an explicit request is honoured or refused, a backend's activation precision comes
with it, weights are padded and converted once):

- vendor kernels first where they exist: TRT-LLM and FlashInfer on sm100,
  DeepGEMM for 128x128-block fp8 on sm90, Marlin for weight-only int4/FP4 on
  GPUs without FP4 tensor cores, AITER on ROCm;
- then ours: ``triton_or_grouped_mm`` (per call, by the measured crossover of
  ``thresholds.py``; refused where none is measured), ``triton`` (every
  scheme), ``grouped_mm`` (PyTorch's CUTLASS grouped GEMM, bf16 and fp8
  row-wise on sm90) whose place against triton, for a known token count, is
  the same shape rule;
- FlashInfer's bf16 MoE after ours: vLLM keeps it opt-in
  (VLLM_USE_FLASHINFER_MOE_FP16=0 by default);
- on the CPU: ``cpu``, then ``grouped_mm`` (torch's CPU grouped GEMM is a loop
  over experts too), the reference, and triton last (it runs there only under
  the interpreter, a test tool at milliseconds per program).
"""

from __future__ import annotations

from ..contract import TokenLayout
from ..platform import Platform
from ..quant import QuantScheme
from .registry import experts_backends

STD, BAT = TokenLayout.STANDARD, TokenLayout.BATCHED

_CPU = ("cpu", "reference", "triton")
# the two ROCm columns, the same in every family (AITER refuses MXFP4 off gfx950 itself)
_ROCM_AITER = {"gfx950": ("aiter", "triton"), "gfx942": ("aiter", "triton")}
_ROCM_TRITON = {"gfx950": ("triton",), "gfx942": ("triton",)}

# family variant -> platform class -> standard-layout candidates, best first
STANDARD: dict[str, dict[str, tuple[str, ...]]] = {
    "unquantized": {
        "sm100": ("triton_or_grouped_mm", "triton", "grouped_mm", "flashinfer_cutlass", "oai_triton"),
        "sm90": ("triton_or_grouped_mm", "triton", "grouped_mm", "flashinfer_cutlass", "oai_triton"),
        "sm89": ("triton", "grouped_mm"),
        "sm80": ("triton", "grouped_mm"),
        **_ROCM_AITER,
        "cpu": ("cpu", "grouped_mm", "reference", "triton"),
        "tpu": ("pallas",),
    },
    # fp8 with tensor / token / channel scales
    "fp8": {
        "sm100": ("trtllm", "flashinfer_cutlass", "cutlass_fp8", "triton_or_grouped_mm", "triton", "grouped_mm"),
        "sm90": ("flashinfer_cutlass", "cutlass_fp8", "triton_or_grouped_mm", "triton", "grouped_mm"),
        "sm89": ("triton", "cutlass_fp8"),
        "sm80": ("triton", "marlin"),
        **_ROCM_AITER,
        "cpu": _CPU,
    },
    # fp8 with block weight scales (DeepSeek-V3): no PyTorch grouped GEMM takes block scales
    "fp8_block": {
        "sm100": ("trtllm", "deep_gemm", "flashinfer_cutlass", "triton"),
        "sm90": ("deep_gemm", "flashinfer_cutlass", "triton"),
        "sm89": ("triton",),
        "sm80": ("triton",),
        **_ROCM_AITER,
        "cpu": _CPU,
    },
    "int8": {
        "sm100": ("triton",),
        "sm90": ("triton",),
        "sm89": ("triton",),
        "sm80": ("triton",),
        **_ROCM_TRITON,
        "cpu": _CPU,
    },
    # int4 / int8 weight-only (GPTQ, AWQ): Marlin on NVIDIA; vLLM has no Marlin MoE on ROCm
    "wna16": {
        "sm100": ("marlin", "triton"),
        "sm90": ("marlin", "triton"),
        "sm89": ("marlin", "triton"),
        "sm80": ("marlin", "triton"),
        **_ROCM_TRITON,
        "cpu": _CPU,
    },
    # MXFP4 weights (gpt-oss); the backend fixes the activations (bf16, or MXFP8 on sm100)
    "mxfp4": {
        "sm100": ("trtllm", "flashinfer_cutlass", "oai_triton", "triton", "marlin"),
        "sm90": ("flashinfer_cutlass", "oai_triton", "triton", "marlin"),
        "sm89": ("marlin", "triton"),
        "sm80": ("marlin", "triton"),
        **_ROCM_AITER,
        "cpu": _CPU,
    },
    # NVFP4: FP4 tensor cores on sm100; elsewhere Marlin runs the weights with bf16 activations
    "nvfp4": {
        "sm100": ("trtllm", "flashinfer_cutlass", "cutlass_fp4", "triton", "marlin"),
        "sm90": ("marlin", "triton"),
        "sm89": ("marlin", "triton"),
        "sm80": ("marlin", "triton"),
        **_ROCM_TRITON,
        "cpu": _CPU,
    },
}

# batched layout: the batched twins, same reasoning; families not listed use _BATCHED_DEFAULT
BATCHED: dict[str, dict[str, tuple[str, ...]]] = {
    "fp8_block": {
        "sm100": ("deep_gemm_batched", "triton_batched"),
        "sm90": ("deep_gemm_batched", "triton_batched"),
    },
    "wna16": {c: ("marlin_batched", "triton_batched") for c in ("sm100", "sm90", "sm89", "sm80")},
    "mxfp4": {c: ("marlin_batched", "triton_batched") for c in ("sm89", "sm80")},
    "nvfp4": {c: ("marlin_batched", "triton_batched") for c in ("sm90", "sm89", "sm80")},
}
_BATCHED_DEFAULT = {"cpu": ("reference_batched", "triton_batched")}
_BATCHED_GPU = ("triton_batched",)

# Taken only when asked for by name on a GPU (never by the auto walk): the reference
# dequantizes every expert to float32 (4 bytes a weight: 45 GB for one DeepSeek-V3 layer);
# the loop visits every expert on every call. On the CPU the reference is a real fallback.
EXPLICIT_ONLY_ON_GPU = {
    "reference": "the float32 reference (every expert dequantized): ask for it by name",
    "reference_batched": "the float32 reference (every expert dequantized): ask for it by name",
    "loop": "the per-expert loop baseline: ask for it by name",
}
EXPLICIT_ONLY = {"loop": "the per-expert loop baseline: ask for it by name"}


def platform_class(platform: Platform) -> str:
    """The column of the tables for ``platform``: sm100, sm90, sm89, sm80, gfx950, gfx942, cpu, tpu, xpu."""
    if platform.kind == "cuda":
        cap = platform.capability or (0, 0)
        if cap >= (10, 0):
            return "sm100"
        if cap >= (9, 0):
            return "sm90"
        return "sm89" if cap >= (8, 9) else "sm80"
    if platform.kind == "rocm":
        return "gfx950" if platform.arch == "gfx950" else "gfx942"
    return platform.kind


def family_variant(scheme: QuantScheme) -> str:
    """The table row of ``scheme``: its family, with block-scaled fp8 apart (other kernels serve it)."""
    if scheme.family == "fp8" and scheme.w1.granularity.kind == "block":
        return "fp8_block"
    return scheme.family


def ranked(scheme: QuantScheme, platform: Platform, layout: TokenLayout) -> tuple[str, ...]:
    """The table's list for (scheme, platform, layout), before unlisted backends are appended."""
    cls = platform_class(platform)
    fam = family_variant(scheme)
    if layout is STD:
        return STANDARD.get(fam, {}).get(cls, ())
    listed = BATCHED.get(fam, {}).get(cls) or _BATCHED_DEFAULT.get(cls)
    if listed is None:
        listed = _BATCHED_GPU if platform.is_gpu else ()
    return listed


def candidates(scheme: QuantScheme, platform: Platform, layout: TokenLayout) -> list[str]:
    """Backend names to try, best first; every registered backend of the layout appears once."""
    known = experts_backends()
    out = [n for n in ranked(scheme, platform, layout) if n in known]
    out += sorted(n for n, c in known.items() if c.layout is layout and n not in out)
    return out


def explicit_only(name: str, platform: Platform) -> str | None:
    """Why the auto walk skips ``name`` on ``platform`` (None: it may take it)."""
    table = EXPLICIT_ONLY_ON_GPU if platform.is_gpu else EXPLICIT_ONLY
    return table.get(name)
