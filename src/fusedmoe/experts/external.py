"""Backends of other kernel libraries, declared so the oracle can say why (not).

Each class states what the library's kernel supports (from its published
feature tables) and which package and GPU it needs. Until an adapter's
``apply`` is written and checked against the reference on a GPU that has the
package, it is declared with ``implemented=False``: it shows in ``fusedmoe
features`` with that status and the oracle never picks it.
"""

from __future__ import annotations

from ..config import Activation
from .base import Capabilities, Experts, TokenLayout

STD = frozenset({TokenLayout.STANDARD})
BAT = frozenset({TokenLayout.BATCHED})
GATED = frozenset({Activation.SILU, Activation.GELU})
FP8_AT = frozenset({"fp8_tensor", "fp8_tensor_static", "fp8_token", "fp8_channel"})
FP8_BLOCK = frozenset({"fp8_block"})
WNA16 = frozenset({"int4_g128", "int4_g32", "int4_g64_zp", "int4_g128_zp", "int4_g128_actorder", "int8_w8a16"})
_PENDING = "adapter not implemented yet"


def _caps(layouts, schemes, activations, pkg, cap, platforms=("cuda",), seeds=(), **kw) -> Capabilities:
    return Capabilities(
        layouts=layouts,
        schemes=frozenset(schemes),
        activations=frozenset(activations),
        platforms=frozenset(platforms),
        min_capability=cap,
        packages=(pkg,) if pkg else (),
        implemented=False,
        note=kw.pop("note", _PENDING),
        seed_names=seeds,
        **kw,
    )


class DeepGemmExperts(Experts):
    name = "deep_gemm"
    layout = TokenLayout.STANDARD
    batched_twin = "deep_gemm_batched"
    capabilities = _caps(STD, FP8_BLOCK, GATED, "deep_gemm", (9, 0), seeds=("deep gemm",), bias=False)


class DeepGemmBatchedExperts(Experts):
    name = "deep_gemm_batched"
    layout = TokenLayout.BATCHED
    capabilities = _caps(BAT, FP8_BLOCK, GATED, "deep_gemm", (9, 0), seeds=("deep gemm (batched)",), bias=False)


class CutlassFp8Experts(Experts):
    name = "cutlass_fp8"
    layout = TokenLayout.STANDARD
    capabilities = _caps(STD | BAT, FP8_AT, GATED, "vllm", (9, 0), seeds=("cutlass_fp8",), bias=False)


class CutlassFp4Experts(Experts):
    name = "cutlass_fp4"
    layout = TokenLayout.STANDARD
    capabilities = _caps(STD | BAT, {"nvfp4"}, {Activation.SILU}, "vllm", (10, 0), seeds=("cutlass_fp4",), bias=False)


class FlashInferExperts(Experts):
    name = "flashinfer_cutlass"
    layout = TokenLayout.STANDARD
    capabilities = _caps(
        STD,
        {"bf16", "fp8_tensor", "fp8_block", "mxfp4", "nvfp4"},
        {Activation.SILU, Activation.SWIGLUOAI},
        "flashinfer",
        (9, 0),
        seeds=("flashinfer",),
        router_weight_on_input=False,
    )


class TrtLlmExperts(Experts):
    name = "trtllm"
    layout = TokenLayout.STANDARD
    capabilities = _caps(
        STD,
        {"mxfp4", "mxfp4_mxfp8", "nvfp4"},
        {Activation.SWIGLUOAI, Activation.SILU},
        "flashinfer",
        (10, 0),
        seeds=("trtllm",),
        router_weight_on_input=False,
    )


class OaiTritonExperts(Experts):
    name = "oai_triton"
    layout = TokenLayout.STANDARD
    capabilities = _caps(
        STD, {"bf16", "mxfp4"}, {Activation.SWIGLUOAI}, "triton_kernels", (9, 0), seeds=("gpt oss triton",)
    )


class MarlinExperts(Experts):
    name = "marlin"
    layout = TokenLayout.STANDARD
    batched_twin = "marlin_batched"
    capabilities = _caps(
        STD,
        WNA16 | {"mxfp4", "nvfp4_w4a16"},
        {Activation.SILU, Activation.SWIGLUOAI},
        "vllm",
        (8, 0),
        seeds=("marlin",),
    )


class MarlinBatchedExperts(Experts):
    name = "marlin_batched"
    layout = TokenLayout.BATCHED
    capabilities = _caps(
        BAT,
        WNA16 | {"mxfp4", "nvfp4_w4a16"},
        {Activation.SILU, Activation.SWIGLUOAI},
        "vllm",
        (8, 0),
        seeds=("marlin (batched)",),
    )


class AiterExperts(Experts):
    name = "aiter"
    layout = TokenLayout.STANDARD
    capabilities = _caps(
        STD, {"bf16"} | FP8_AT | FP8_BLOCK, GATED, "aiter", None, platforms=("rocm",), seeds=("rocm aiter moe",)
    )


class PallasExperts(Experts):
    name = "pallas"
    layout = TokenLayout.STANDARD
    capabilities = _caps(STD, {"bf16"}, {Activation.SILU}, "torch_xla", None, platforms=("tpu",), seeds=("pallas",))
