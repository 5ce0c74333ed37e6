"""What a model's MoE layers compute, read from config.json (``model_type``).

For each supported family: which decoder layers are MoE, the shapes and
activation, the routing semantics (the same ones ``integrations.hf_blocks``
reads from live transformers modules: softmax or sigmoid, renormalization,
groups, DeepSeek-V3's correction bias) and the shared experts' module names
under the block. Where the expert tensors are is not kept here: ``layout``
finds them from the checkpoint's own tensor names, which differ between the
tools that write them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Activation, MoEConfig
from ..errors import expect
from ..routing import RouterConfig

_ACT = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}
_ACT.update({"gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_new": Activation.GELU_TANH})


@dataclass(frozen=True)
class MoEArch:
    """How one model family lays out its MoE blocks (``describe(config)`` builds it)."""

    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    config: MoEConfig  # full (unsharded) intermediate size
    router: RouterConfig
    router_fp32: bool = False  # DeepSeek computes router logits in float32
    correction_bias: bool = False
    shared_expert: str | None = None  # module path under the block
    shared_gate: str | None = None  # Qwen2-MoE: sigmoid gate of the shared expert


def _get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is None:
        expect(False, f"config.json {names[0]}", "present for this model_type")
    return default


def _activation(cfg: dict) -> Activation:
    act = str(cfg.get("hidden_act", "silu"))
    expect(act in _ACT, "config.json hidden_act", f"one of {sorted(_ACT)}", act)
    return _ACT[act]


def describe(cfg: dict, dtype: torch.dtype | None = None) -> MoEArch:
    """The MoE layout of a model from its config.json (one of the supported model types)."""
    # 81 lines: one rule per supported model type, read top to bottom as a table; split, the per-type rules would
    # scatter.
    mt = cfg.get("model_type")
    n = int(_get(cfg, "num_hidden_layers"))
    h = int(_get(cfg, "hidden_size"))
    dt = dtype or {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(cfg.get("torch_dtype", cfg.get("dtype", "float32"))), torch.float32
    )
    if mt == "mixtral":
        e, k, i = _get(cfg, "num_local_experts"), _get(cfg, "num_experts_per_tok"), _get(cfg, "intermediate_size")
        return MoEArch(
            mt,
            n,
            tuple(range(n)),
            MoEConfig(e, k, h, i, activation=_activation(cfg), dtype=dt),
            RouterConfig(e, k, renormalize=True),
        )
    if mt in ("qwen2_moe", "qwen3_moe", "olmoe"):
        e, k = _get(cfg, "num_experts", "num_local_experts"), _get(cfg, "num_experts_per_tok")
        i = _get(cfg, "moe_intermediate_size") if mt != "olmoe" else _get(cfg, "intermediate_size")
        step, only = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
        layers = tuple(L for L in range(n) if L not in only and (L + 1) % step == 0)
        shared = mt == "qwen2_moe" and int(cfg.get("shared_expert_intermediate_size", 0) or 0) > 0
        return MoEArch(
            mt,
            n,
            layers,
            MoEConfig(e, k, h, i, activation=_activation(cfg), dtype=dt),
            RouterConfig(e, k, renormalize=bool(cfg.get("norm_topk_prob", False))),
            shared_expert="shared_expert" if shared else None,
            shared_gate="shared_expert_gate" if shared else None,
        )
    if mt in ("deepseek_v2", "deepseek_v3"):
        e, k, i = _get(cfg, "n_routed_experts"), _get(cfg, "num_experts_per_tok"), _get(cfg, "moe_intermediate_size")
        first, freq = int(cfg.get("first_k_dense_replace", 0)), int(cfg.get("moe_layer_freq", 1) or 1)
        layers = tuple(L for L in range(n) if L >= first and L % freq == 0)
        v3 = mt == "deepseek_v3"
        grouped = v3 or cfg.get("topk_method", "greedy") == "group_limited_greedy"
        router = RouterConfig(
            e,
            k,
            scoring="sigmoid" if v3 else "softmax",
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            num_expert_group=int(_get(cfg, "n_group")) if grouped else None,
            topk_group=int(_get(cfg, "topk_group")) if grouped else None,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )
        shared = int(cfg.get("n_shared_experts", 0) or 0) > 0
        return MoEArch(
            mt,
            n,
            layers,
            MoEConfig(e, k, h, i, activation=_activation(cfg), dtype=dt),
            router,
            router_fp32=True,
            correction_bias=v3,
            shared_expert="shared_experts" if shared else None,
        )
    if mt == "gpt_oss":
        e, k = _get(cfg, "num_local_experts"), _get(cfg, "num_experts_per_tok", "experts_per_token")
        config = MoEConfig(
            e,
            k,
            h,
            _get(cfg, "intermediate_size"),
            activation=Activation.SWIGLUOAI,
            has_bias=True,
            gate_up_interleaved=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            dtype=dt,
        )
        return MoEArch(
            mt,
            n,
            tuple(range(n)),
            config,
            RouterConfig(e, k, renormalize=True),
        )
    supported = ["deepseek_v2", "deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
    expect(False, "config.json model_type", f"one of {supported}", mt)
    raise AssertionError  # unreachable
