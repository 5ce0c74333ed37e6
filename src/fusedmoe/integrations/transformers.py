"""Run a loaded transformers model's MoE blocks on fusedmoe: ``patch(model)``.

Every block ``hf_blocks.extract`` knows (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V2/V3, gpt-oss) is replaced by a ``FusedMoEBlock``: the block's
router Linear computes logits (in float32 for DeepSeek, as transformers
does), a ``FusedMoE`` routes them with the block's own semantics (softmax or
sigmoid, renormalization, grouped top-k with the correction bias, scaling
factor) and runs the experts (biases, gpt-oss's interleaved swigluoai), and
the shared expert (gated for Qwen2-MoE) is added through MoEKernel's hook.
The experts are loaded through ``FusedMoE.weight_loader`` with the fused
'w13' shard, as a checkpoint loader would, and converted once for the chosen
backend.

``quantize=`` quantizes the experts on the fly (FP8 online and friends: any
scheme with dynamic activation scales), so a bf16 model can be tried with a
quantized backend without a quantized checkpoint.

gpt-oss's block returns ``(hidden_states, router_scores)``; the decoder layer
discards the scores, and the replacement returns ``(hidden_states, None)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import expect
from ..layer import FusedMoE
from ..platform import Platform
from ..quant import QuantScheme
from .hf_blocks import SUPPORTED_BLOCKS, HFMoE, SharedExpert, extract

__all__ = ["FusedMoEBlock", "patch"]

_FP32_ROUTER = ("DeepseekV2Moe", "DeepseekV3MoE")


class _SharedHook:
    def __init__(self, expert: SharedExpert) -> None:
        self.expert = expert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(x, x.dtype)


class FusedMoEBlock(torch.nn.Module):
    """A transformers MoE block computed by a ``FusedMoE`` layer (see the module docstring)."""

    def __init__(
        self,
        hf: HFMoE,
        *,
        backend: str = "auto",
        quantize: QuantScheme | None = None,
        platform: Platform | None = None,
    ) -> None:
        super().__init__()
        self.kind = hf.kind
        self.returns_router_scores = hf.kind == "GptOssMLP"
        self.router_fp32 = hf.kind in _FP32_ROUTER
        self.register_buffer("router_weight", hf.router_weight.detach().clone())
        bias = None if hf.router_bias is None else hf.router_bias.detach().clone()
        self.register_buffer("router_bias", bias)
        shared = None if hf.shared_expert is None else _SharedHook(hf.shared_expert)
        device = hf.router_weight.device
        self.moe = FusedMoE(
            hf.config,
            quantize or QuantScheme.unquantized(),
            hf.router,
            backend=backend,
            correction_bias=hf.correction_bias,
            shared_experts=shared,
            online_quant=quantize is not None and quantize.w1 is not None,
            platform=platform,
            device=device,
        )
        w = hf.weights
        for e in range(hf.config.num_experts):
            self.moe.weight_loader("w13_weight", w.w13.data[e], e, "w13")
            self.moe.weight_loader("w2_weight", w.w2.data[e], e, "w2")
            if w.b13 is not None:
                self.moe.weight_loader("w13_bias", w.b13[e], e, "w13")
                self.moe.weight_loader("w2_bias", w.b2[e], e, "w2")
        self.moe.process_weights_after_loading()

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.float32 if self.router_fp32 else x.dtype
        b = None if self.router_bias is None else self.router_bias.to(dt)
        return F.linear(x.to(dt), self.router_weight.to(dt), b)

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        out = self.moe(x, self.router_logits(x)).reshape(shape)
        return (out, None) if self.returns_router_scores else out

    def extra_repr(self) -> str:
        return f"kind={self.kind}"


def patch(
    model: torch.nn.Module,
    *,
    backend: str = "auto",
    quantize: QuantScheme | None = None,
    platform: Platform | None = None,
) -> list[str]:
    """Replace every supported MoE block of ``model`` in place; returns the names of those replaced.

    The model should be in eval mode (router jitter is random in training).
    """
    found = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in SUPPORTED_BLOCKS]
    expect(bool(found), "model", f"at least one MoE block of {sorted(SUPPORTED_BLOCKS)}", type(model).__name__)
    for name, block in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            new = FusedMoEBlock(extract(block), backend=backend, quantize=quantize, platform=platform)
        setattr(parent, attr, new)
    return [name for name, _ in found]
