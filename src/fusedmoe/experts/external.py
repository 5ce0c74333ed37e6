"""Backends of other kernel libraries, declared so the oracle can say why (not).

Each class states what the library's kernel supports (from its published
feature tables and vLLM's integration of it), which package and GPU it needs,
the activation precision it runs a weight format with (``implied_activations``)
and the sizes it needs rounded up (``align``). Until an adapter's ``apply`` is
written and checked against the reference on a GPU that has the package, it is
declared with ``implemented=False``: it shows in ``fusedmoe features`` with that
status and the oracle never picks it. The lent GPUs have no network and none of
these packages, so all of them are declared only today.

A declared-only adapter refuses with the most permanent reason first: the
platform and GPU, then what its kernel could never run (scheme, activation,
sizes), then a missing package, and only then "declared only": an explanation
never blames a missing package for something the package would refuse anyway.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from ..config import Activation
from ..contract import TokenLayout
from ..platform import OPTIONAL_PACKAGES
from ..quant import QuantScheme
from .base import Capabilities, Experts

STD = frozenset({TokenLayout.STANDARD})
BAT = frozenset({TokenLayout.BATCHED})
GATED = frozenset({Activation.SILU, Activation.GELU})
FP8_AT = frozenset({"fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_channel"})
FP8_BLOCK = frozenset({"fp8_block"})
WNA16 = frozenset({"int4_g128", "int4_g32", "int4_g64_zp", "int4_g128_zp", "int4_g128_actorder", "int8_w8a16"})
_NOTE = "adapter not written yet; it needs a GPU with '{pkg}' installed to be checked against the reference"


def _caps(schemes, activations, pkg, cap, layouts=STD, platforms=("cuda",), seeds=(), **kw) -> Capabilities:
    return Capabilities(
        layouts=layouts,
        schemes=frozenset(schemes),
        activations=frozenset(activations),
        platforms=frozenset(platforms),
        min_capability=cap,
        packages=(pkg,) if pkg else (),
        implemented=False,
        note=kw.pop("note", _NOTE.format(pkg=pkg)),
        seed_names=seeds,
        **kw,
    )


def _batched_twin(caps: Capabilities, seed: str) -> Capabilities:
    """A standard adapter's batched twin: the same kernels and limits on the batched layout."""
    return replace(caps, layouts=BAT, seed_names=(seed,))


class _BatchedTwin:
    """Mixed in before a standard adapter: its batched twin, the same kernels on the batched layout
    (``capabilities`` from ``_batched_twin``)."""

    layout = TokenLayout.BATCHED
    batched_twin = None


_WRITTEN: dict[type, type] = {}


def _as_written(cls: type) -> type:
    """The same declaration with ``implemented=True``: what would it refuse once written?"""
    if cls not in _WRITTEN:
        caps = replace(cls.capabilities, implemented=True)
        _WRITTEN[cls] = type(cls.__name__, (cls,), {"capabilities": caps, "__module__": __name__})
    return _WRITTEN[cls]


def _block_128(scheme: QuantScheme, who: str) -> str | None:
    g = scheme.w1.granularity if scheme.w1 is not None else None
    if g is not None and g.kind == "block" and (g.block_n, g.block_k) != (128, 128):
        return f"{who} takes 128x128 weight blocks only, scheme {scheme.name} has {g.block_n}x{g.block_k}"
    return None


class _Adapter(Experts):
    """Base of the external adapters: the refusal order of the module docstring. An adapter takes
    the standard layout unless it says otherwise (the batched twins)."""

    layout = TokenLayout.STANDARD
    # (H multiple, I multiple) the kernel needs for MXFP4 weights (None: the capabilities' align)
    mxfp4_align: ClassVar[tuple[int, int] | None] = None

    @classmethod
    def alignment(cls, scheme, platform):
        if scheme.family == "mxfp4" and cls.mxfp4_align is not None:
            return cls.mxfp4_align
        return cls.capabilities.align

    @classmethod
    def why_not(cls, config, scheme, platform, **kw) -> str | None:
        caps = cls.capabilities
        if caps.implemented:
            return super().why_not(config, scheme, platform, **kw)
        with_pkgs = platform.with_packages(*caps.packages)
        why = super(_Adapter, _as_written(cls)).why_not(config, scheme, with_pkgs, **kw)
        if why is not None:
            return why
        for p in caps.packages:
            if not platform.has(p):
                return f"package '{p}' is not installed ({OPTIONAL_PACKAGES.get(p, p)})"
        return f"declared only: {caps.note}"


class DeepGemmExperts(_Adapter):
    name = "deep_gemm"
    batched_twin = "deep_gemm_batched"
    capabilities = _caps(FP8_BLOCK, GATED, "deep_gemm", (9, 0), seeds=("deep gemm",), bias=False)

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        # DeepGEMM tiles N and K of its grouped GEMMs by 128 and vLLM falls back rather than
        # pad (block scales cannot move with padded gate/up rows unless I % 128 == 0 anyway)
        h, i = config.hidden_size, config.intermediate_size
        if h % 128 or i % 128:
            return f"DeepGEMM needs H and I multiples of 128 (its tiles), got H={h}, I={i}"
        return _block_128(scheme, "DeepGEMM")


class DeepGemmBatchedExperts(_BatchedTwin, DeepGemmExperts):
    name = "deep_gemm_batched"
    capabilities = _batched_twin(DeepGemmExperts.capabilities, "deep gemm (batched)")


class CutlassFp8Experts(_Adapter):
    name = "cutlass_fp8"
    capabilities = _caps(FP8_AT, GATED, "vllm", (9, 0), layouts=STD | BAT, seeds=("cutlass_fp8",), bias=False)


class CutlassFp4Experts(_Adapter):
    name = "cutlass_fp4"
    capabilities = _caps(
        {"nvfp4"}, {Activation.SILU}, "vllm", (10, 0), layouts=STD | BAT, seeds=("cutlass_fp4",), bias=False
    )


class FlashInferExperts(_Adapter):
    """FlashInfer's CUTLASS fused MoE. MXFP4 runs with MXFP8 activations on sm100 (FP4 tensor
    cores take fp8-class A operands) and bf16 activations on sm90 (no FP4 tensor cores)."""

    name = "flashinfer_cutlass"
    capabilities = _caps(
        {"bf16", "fp8_tensor", "fp8_block", "mxfp4", "mxfp4_mxfp8", "nvfp4"},
        {Activation.SILU, Activation.SWIGLUOAI},
        "flashinfer",
        (9, 0),
        seeds=("flashinfer",),
        router_weight_on_input=False,
    )
    mxfp4_align = (128, 128)  # vLLM rounds H and I up to 128 for both FlashInfer CUTLASS MXFP4 variants

    @classmethod
    def activation_scheme(cls, scheme, platform):
        if scheme.family == "mxfp4":
            return QuantScheme.by_name("mxfp4_mxfp8" if platform.has_fp4 else "mxfp4")
        return scheme

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if scheme.family == "nvfp4" and not platform.has_fp4:
            return f"NVFP4 on FlashInfer CUTLASS needs FP4 tensor cores (sm100+), platform is {platform.label}"
        return _block_128(scheme, "FlashInfer CUTLASS")


class TrtLlmExperts(_Adapter):
    """FlashInfer's TensorRT-LLM MoE kernels (sm100): MXFP4 weights with MXFP8 activations."""

    name = "trtllm"
    implied_activations = {"mxfp4": "mxfp4_mxfp8"}
    capabilities = _caps(
        {"mxfp4", "mxfp4_mxfp8", "nvfp4", "fp8_block", "fp8_tensor_static"},
        {Activation.SWIGLUOAI, Activation.SILU},
        "flashinfer",
        (10, 0),
        seeds=("trtllm",),
        router_weight_on_input=False,
    )
    mxfp4_align = (256, 256)  # vLLM rounds H and I up to 256 for the TRT-LLM MXFP4 kernels (weight shuffle)

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        return _block_128(scheme, "TRT-LLM")


class OaiTritonExperts(_Adapter):
    """OpenAI triton_kernels (matmul_ogs): gpt-oss MXFP4 with bf16 activations, sm90 and sm100."""

    name = "oai_triton"
    implied_activations = {"mxfp4_mxfp8": "mxfp4"}
    capabilities = _caps(
        {"bf16", "mxfp4"},
        {Activation.SWIGLUOAI},
        "triton_kernels",
        (9, 0),
        seeds=("gpt oss triton",),
    )
    mxfp4_align = (1, 64)  # vLLM rounds I up to 64 for the triton_kernels MXFP4 path (H is kept)

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if platform.kind == "cuda" and (platform.capability or (0, 0)) >= (11, 0):
            return f"triton_kernels' MXFP4 layouts cover sm90 to sm100 only, platform is {platform.label}"
        return None


class MarlinExperts(_Adapter):
    """Marlin weight-only kernels (vLLM custom ops): int4/int8 and FP4 weights, bf16 activations.

    FP4 checkpoints run weight-only here (NVFP4 and MXFP8 activations become bf16), which is
    how GPUs without FP4 tensor cores serve them."""

    name = "marlin"
    batched_twin = "marlin_batched"
    implied_activations = {"nvfp4": "nvfp4_w4a16", "mxfp4_mxfp8": "mxfp4"}
    capabilities = _caps(
        WNA16 | {"mxfp4", "nvfp4_w4a16"},
        {Activation.SILU, Activation.SWIGLUOAI},
        "vllm",
        (8, 0),
        seeds=("marlin",),
    )
    mxfp4_align = (256, 128)  # vLLM rounds MXFP4 H up to 256 and I up to 128 for Marlin's tiles

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if scheme.family != "wna16":
            return None
        # vLLM's check_moe_marlin_supports_layer: these are refused, not padded
        g = scheme.w1.granularity.group_size if scheme.w1.granularity.kind == "group" else 0
        h, i = config.hidden_size, config.intermediate_size
        if h % 128 or i % max(64, g):
            return f"Marlin MoE needs H % 128 == 0 and I % {max(64, g)} == 0, got H={h}, I={i}"
        return None


class MarlinBatchedExperts(_BatchedTwin, MarlinExperts):
    name = "marlin_batched"
    capabilities = _batched_twin(MarlinExperts.capabilities, "marlin (batched)")


class AiterExperts(_Adapter):
    """AMD AITER fused MoE (ROCm): bf16, fp8, and MXFP4 through CK on gfx950 only."""

    name = "aiter"
    capabilities = _caps(
        {"bf16", "mxfp4"} | FP8_AT | FP8_BLOCK,
        GATED | {Activation.SWIGLUOAI},
        "aiter",
        None,
        platforms=("rocm",),
        seeds=("rocm aiter moe",),
    )
    # vLLM pads MXFP4 sizes on ROCm (VLLM_ROCM_MOE_PADDING); 256 as for TRT-LLM, to be
    # confirmed on a gfx950
    mxfp4_align = (256, 256)

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if scheme.family == "mxfp4" and platform.arch != "gfx950":
            return f"AITER's MXFP4 MoE (CK) needs gfx950 (MI355), platform is {platform.arch}"
        if scheme.family != "mxfp4" and config.activation is Activation.SWIGLUOAI:
            return "AITER takes swigluoai with MXFP4 weights only"
        return _block_128(scheme, "AITER")


class PallasExperts(_Adapter):
    name = "pallas"
    capabilities = _caps({"bf16"}, {Activation.SILU}, "torch_xla", None, platforms=("tpu",), seeds=("pallas",))
