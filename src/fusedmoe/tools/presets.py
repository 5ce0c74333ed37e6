"""Layer shapes of well-known MoE models (per layer, no tensor parallelism)."""

from __future__ import annotations

from ..config import MoEConfig
from ..errors import expect

PRESETS: dict[str, dict] = {
    # E experts, K top-k, H hidden, I intermediate (per expert)
    "mixtral-8x7b": dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
    "deepseek-v3": dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048),
    "gpt-oss-20b": dict(
        num_experts=32,
        top_k=4,
        hidden_size=2880,
        intermediate_size=2880,
        activation="swigluoai",
        has_bias=True,
        gate_up_interleaved=True,
    ),
    # small enough for a 2-core CPU in well under a second per forward
    "small": dict(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256),
}


def preset_config(name: str, **overrides) -> MoEConfig:
    expect(name in PRESETS, "preset", f"one of {sorted(PRESETS)}", name)
    return MoEConfig(**{**PRESETS[name], **overrides})


def preset_router(name: str):
    """The router of a preset's model (``RouterConfig`` and whether it takes a correction bias)."""
    from ..routing import RouterConfig

    c = preset_config(name)
    if name == "deepseek-v3":
        # sigmoid scores, 8 groups of which 4 are kept, e_score_correction_bias, scaling 2.5
        return RouterConfig(
            c.num_experts,
            c.top_k,
            scoring="sigmoid",
            renormalize=True,
            num_expert_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        ), True
    # Mixtral, Qwen3 (norm_topk_prob), gpt-oss (softmax over the K chosen logits): renormalized softmax
    return RouterConfig(c.num_experts, c.top_k, renormalize=True), False
