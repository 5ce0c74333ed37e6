"""Tiny random models of every Mixture-of-Experts architecture the installed transformers ships.

``architectures()`` enumerates them from transformers itself: every config class that
declares experts (a ``num_experts``-like field, in it or a sub-config), and for each
modeling module one model class of such a config (a text-only one where there is a
choice, since the MoE blocks are the same). ``build(arch, dtype)`` makes the model
tiny (hidden 64, 2 layers, 8 experts, top-2) with random weights of random sign
everywhere, biases and norm scales included. ``OVERRIDES`` holds what a config needs
beyond the common shrinking to build and run on text alone.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import torch

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_top_k")
NUM_EXPERTS = 8
TOP_K = 2
H = 64
VOCAB = 96

# Common shrinking: applied to every config (and sub-config) that has the field.
SIZES = dict(
    hidden_size=H, d_model=H, intermediate_size=96, d_ff=96, moe_intermediate_size=32,
    expert_ffn_hidden_size=32, ffn_hidden_size=32, shared_expert_intermediate_size=48,
    moe_shared_expert_intermediate_size=48, share_expert_dim=48, shared_intermediate_size=48,
    moe_hidden_size=48, num_hidden_layers=2, num_layers=2, n_layers=2, num_decoder_layers=2,
    num_attention_heads=4, n_heads=4, num_heads=4, num_key_value_heads=4, head_dim=16,
    vocab_size=VOCAB, max_position_embeddings=256, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
    first_k_dense_replace=0, n_group=4, topk_group=2, bos_token_id=0, eos_token_id=1,
    pad_token_id=0, unpadded_vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
    linear_num_heads=2, linear_head_dim=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=96,
    decoder_ffn_dim=96,
)  # fmt: skip

# What some configs need beyond SIZES, by model type.
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
OVERRIDES: dict[str, dict] = {
    "bailing_hybrid": _HYBRID,
    "kimi_linear": _HYBRID,
    "qwen3_next": _HYBRID,
    "qwen3_5_moe_text": _HYBRID,
    "qwen4_exp_text": {
        **_HYBRID,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "deepseek_ocr2_text": {"mlp_layer_types": ["sparse", "sparse"]},
    "ernie4_5_vl_moe_text": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    },
    "glm4v_moe_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}},
    "hy_v4_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
    "mimo_v2_flash": {"head_dim": 16, "v_head_dim": 16, "sliding_window": 16, "num_key_value_heads": 2},
    "longcat_flash": {"head_dim": 8, "qk_head_dim": 16, "zero_expert_num": 2},
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares
    "dbrx": {"_after": lambda c: c.attn_config.__dict__.update(rope_theta=10000.0, clip_qkv=8.0)},
    "vitpose_backbone": {"part_features": 32},
    "zaya": {"num_experts_per_tok": 1},
    # the MoE block where the defaults leave 2 layers dense, or off
    "beam": {"mlp_layer_types": ["sparse", "sparse"]},
    "glm5_next_text": {
        "qk_rope_head_dim": 0,
        "layer_types": ["linear_attention", "indexed_attention"],
        "mlp_layer_types": ["sparse", "sparse"],
    },  # fmt: skip
    "flint": {"mlp_only_layers": []},
    "step3p5": {"sliding_window": 16, "mlp_layer_types": ["sparse", "sparse"], "swiglu_limits": [None, 1.5]},
    "gemma4_text": {"enable_moe_block": True},
    "doge": {"is_moe": True, "num_experts": 4},  # product keys: E = (floor sqrt E)^2
    # every encoder layer sparse; capacity 2 of 8 tokens per sequence, so some tokens are dropped
    "switch_transformers": {"num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2, "expert_capacity": 2},
    "llama4_text": {"num_experts_per_tok": 1},  # the router weight scales the expert input: top-1
    "nllb-moe": {"encoder_sparse_step": 1, "decoder_sparse_step": 1},
}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _declares_experts(cfg_cls, depth: int = 0) -> bool:
    if _fields(cfg_cls) & set(EXPERT_KEYS):
        return True
    subs = getattr(cfg_cls, "sub_configs", None) or {}
    return depth < 3 and any(_declares_experts(c, depth + 1) for c in subs.values() if isinstance(c, type))


def tiny_kwargs(cfg_cls) -> dict:
    f = _fields(cfg_cls)
    kw = {k: v for k, v in SIZES.items() if k in f}
    kw.update({k: NUM_EXPERTS for k in EXPERT_KEYS if k in f})
    kw.update({k: TOP_K for k in TOPK_KEYS if k in f})
    for name, sub in (getattr(cfg_cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type) and name in f and dataclasses.is_dataclass(sub) and sub.__name__ != "AutoConfig":
            kw[name] = sub(**tiny_kwargs(sub)).to_dict()
    kw.update(OVERRIDES.get(getattr(cfg_cls, "model_type", ""), {}))
    return {k: v for k, v in kw.items() if k in f}


def tiny_config(cfg_cls):
    config = cfg_cls(**tiny_kwargs(cfg_cls))
    after = OVERRIDES.get(getattr(cfg_cls, "model_type", ""), {}).get("_after")
    if after is not None:
        after(config)
    return config


def _model_classes(cfg_cls):
    """The PreTrainedModel classes of ``cfg_cls`` in its own modeling module."""
    pkg = cfg_cls.__module__.rsplit(".", 1)[0]
    name = pkg.rsplit(".", 1)[1]
    try:
        mod = importlib.import_module(f"{pkg}.modeling_{name}")
    except ImportError:
        return []
    return [c for c in vars(mod).values() if isinstance(c, type) and getattr(c, "config_class", None) is cfg_cls]


def _rank(cls) -> tuple:
    n = cls.__name__
    return ("PreTrained" in n, not n.endswith("ForCausalLM"), not n.endswith("Model"), "Text" not in n, n)


@functools.cache
def moe_configs() -> dict[str, list[type]]:
    """{package name: its config classes that declare experts}, from transformers' config registry."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    found: dict[str, list[type]] = {}
    for mt in sorted(CONFIG_MAPPING_NAMES):
        try:
            cfg_cls = CONFIG_MAPPING[mt]
        except (ImportError, KeyError):
            continue
        if _declares_experts(cfg_cls):
            found.setdefault(cfg_cls.__module__.split(".")[-2], []).append(cfg_cls)
    return found


@functools.cache
def architecture(arch: str) -> tuple[type, type] | None:
    """(config class, model class) of package ``arch``: the model class of one of its MoE
    configs defined in its own modeling module (a text-only one where there is a choice);
    None when the package has no modeling module of its own (a config reusing another's)."""
    pairs = [(c, m) for c in moe_configs()[arch] for m in _model_classes(c)]
    return min(pairs, key=lambda p: _rank(p[1])) if pairs else None


def architectures() -> dict[str, tuple[type, type]]:
    """{package name: (config class, model class)}, one per MoE architecture with its own model."""
    return {a: p for a in moe_configs() if (p := architecture(a)) is not None}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer redrawn with random sign: matrices ~ N(0, 1/fan_in),
    vectors (biases, norm scales, correction biases) ~ N(0, 0.5^2) around their mean 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or p.numel() == 0:
                continue
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "inv_freq" not in name and "scalar" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    """The tiny float32 model of ``arch``, in eval mode, randomized (``randomize``)."""
    cfg_cls, model_cls = architecture(arch)
    config = tiny_config(cfg_cls)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    return model


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype``, but for what transformers keeps in float32 when it loads a
    checkpoint in bf16/fp16 (``_keep_in_fp32_modules_strict``: routers, correction biases)."""
    keep = set()
    for m in model.modules():
        keep |= set(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
    model = model.to(dtype)
    pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, sorted(keep))) + r")($|\.)") if keep else None
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if pattern is not None and pattern.search(name) and t.is_floating_point():
                t.data = t.data.float()
    return model


def inputs(model: torch.nn.Module, seed: int = 0) -> dict:
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    kw = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = ids
    return kw
