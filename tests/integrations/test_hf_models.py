"""Outside truth: transformers' own MoE blocks against ``extract`` + ``moe_forward``.

Each model is a tiny random transformers model (H=64, I=32, 8 experts, top-2,
one layer) whose MoE block gets non-trivial random weights, biases and
DeepSeek-V3 correction bias (the default init leaves some at zero). The block
runs on random hidden states; ours runs in float64 from the same weights.

- fp32: ``rel_error(hf_fp32, ours_fp64) < 1e-5`` (fp32 arithmetic over H=64
  sums gives ~1e-7..1e-6; a wrong weight or routing detail gives > 1e-2, see
  ``test_a_broken_extraction_is_caught``).
- bf16: the bf16 block and ours (float64 from the same bf16 weights) rounded
  to bf16 are both compared with ours in float64: both below the bf16 row of
  ``fusedmoe.testing.tolerance`` (2e-2), and the block's error at most
  ``_BF16_RATIO`` times the error of one rounding to bf16.

Tokens whose routing is within rounding of a tie are redrawn (``_tokens``):
a flipped choice between two near-equal experts is a legitimate difference
of a bf16 router, not an extraction error. Run with ``-s`` to see the errors.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from fusedmoe import FusedMoEError, QuantScheme
from fusedmoe.integrations.hf_blocks import HFMoE, extract, moe_forward
from fusedmoe.testing import rel_error, tolerance

tf = pytest.importorskip("transformers")

H = 64
T = 32  # tokens per test, as [2, 16, H]
FP32_TOL = 1e-5
BF16_TOL = tolerance(QuantScheme.unquantized(), torch.bfloat16)
_BF16_RATIO = 8.0  # measured 2.5-3.3: the block rounds h, the activation, each output and the sum

_COMMON = dict(
    hidden_size=H,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=16,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)


def _config(name: str):
    """A fresh tiny config (transformers writes the experts implementation into it)."""
    c = _COMMON
    if name == "mixtral":
        return tf.MixtralConfig(**c, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    if name == "qwen2_moe":  # norm_topk_prob False (its default), gated shared expert
        return tf.Qwen2MoeConfig(
            **c,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **c,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=32,
        )
    if name == "olmoe":
        return tf.OlmoeConfig(**c, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if name == "deepseek_v2":  # one group of two kept: the grouping decides most choices
        return tf.DeepseekV2Config(
            **{**c, **_MLA},
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=0,
            q_lora_rank=None,
        )
    if name == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**c, **_MLA},
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=0,
            q_lora_rank=16,
        )
    assert name == "gpt_oss"
    return tf.GptOssConfig(
        **c,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=32,
        layer_types=["full_attention"],
    )


MODELS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]


@functools.cache
def _block(name: str, impl: str) -> torch.nn.Module:
    """The float32 MoE block of a fresh tiny model, with random weights. Never mutated."""
    model = tf.AutoModel.from_config(_config(name), experts_implementation=impl).eval()
    block = model.layers[0].mlp
    g = torch.Generator().manual_seed(MODELS.index(name))
    # gpt-oss: larger expert weights so |gate|, |up| pass the swiglu limit 7 on some elements
    expert_std = 4.0 if name == "gpt_oss" else 1.0
    with torch.no_grad():
        for pname, p in block.named_parameters():
            std = 0.5 if p.dim() == 1 or pname.endswith("bias") else H**-0.5
            if pname.startswith("experts.") and p.dim() == 3:
                std *= expert_std
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for bname, b in block.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return block


def _bf16(block: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(block).to(torch.bfloat16)


def _tokens(hf: HFMoE, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[2, 16, H] hidden states whose routing is 1% away from any tie.

    A token is kept when its chosen set stays the same under 8 random relative
    perturbations of its logits of size 1e-2 (bf16 rounds logits by 4e-3).
    """
    g = torch.Generator().manual_seed(1000 + seed)
    pool = torch.randn(4 * T, H, generator=g).to(dtype)
    logits = hf.router_logits(pool)
    base = hf.router.route(logits, hf.correction_bias).ids.sort(dim=1).values
    stable = torch.ones(pool.shape[0], dtype=torch.bool)
    for _ in range(8):
        noisy = logits * (1 + 1e-2 * torch.randn(logits.shape, generator=g, dtype=logits.dtype))
        ids = hf.router.route(noisy, hf.correction_bias).ids.sort(dim=1).values
        stable &= (ids == base).all(dim=1)
    keep = stable.nonzero(as_tuple=True)[0]
    assert keep.numel() >= T, f"only {keep.numel()} tokens away from routing ties"
    return pool[keep[:T]].reshape(2, T // 2, H)


def _run(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x)
    return out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (hidden, router_scores)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_transformers(name, impl):
    block = _block(name, impl)
    hf = extract(block)
    x = _tokens(hf, torch.float32)
    err = rel_error(_run(block, x), moe_forward(hf, x))
    print(f"\n[hf fp32] {name:12s} {impl:10s} rel_error={err:.2e}")
    assert err < FP32_TOL, (name, impl, err)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_matches_transformers(name):
    block = _bf16(_block(name, "grouped_mm"))
    hf = extract(block)
    assert hf.config.dtype == torch.bfloat16
    x = _tokens(hf, torch.bfloat16)
    ref = moe_forward(hf, x)
    err_hf = rel_error(_run(block, x), ref)
    err_ours = rel_error(ref.to(torch.bfloat16), ref)
    print(f"\n[hf bf16] {name:12s} transformers={err_hf:.2e} ours_rounded={err_ours:.2e}")
    assert err_hf < BF16_TOL and err_ours < BF16_TOL, (name, err_hf, err_ours)
    assert err_hf < _BF16_RATIO * err_ours, (name, err_hf, err_ours)


def _swap_gate_up(hf: HFMoE) -> HFMoE:
    w13 = hf.weights.w13.data
    i = hf.config.intermediate_size
    if hf.config.gate_up_interleaved:
        perm = torch.arange(2 * i).reshape(i, 2).flip(1).reshape(-1)
    else:
        perm = torch.cat([torch.arange(i, 2 * i), torch.arange(i)])
    w = dataclasses.replace(
        hf.weights,
        w13=dataclasses.replace(hf.weights.w13, data=w13[:, perm]),
        b13=None if hf.weights.b13 is None else hf.weights.b13[:, perm],
    )
    return dataclasses.replace(hf, weights=w)


def _router(**changes):
    return lambda hf: dataclasses.replace(hf, router=dataclasses.replace(hf.router, **changes))


def _flip_renormalize(hf: HFMoE) -> HFMoE:
    return _router(renormalize=not hf.router.renormalize)(hf)


def _config_change(**changes):
    return lambda hf: dataclasses.replace(hf, config=hf.config.replace(**changes))


def _no_shared_gate(hf: HFMoE) -> HFMoE:
    return dataclasses.replace(hf, shared_expert=dataclasses.replace(hf.shared_expert, gate_weight=None))


def _no_expert_bias(hf: HFMoE) -> HFMoE:
    w = dataclasses.replace(hf.weights, b13=None, b2=None)
    return dataclasses.replace(hf, weights=w, config=hf.config.replace(has_bias=False))


_ALL = {"swap_gate_up": _swap_gate_up, "flip_renormalize": _flip_renormalize}
_SHARED = {"drop_shared_expert": lambda hf: dataclasses.replace(hf, shared_expert=None)}
_DEEPSEEK = {
    "no_grouping": _router(num_expert_group=None, topk_group=None),
    "no_scaling": _router(routed_scaling_factor=1.0),
    **_SHARED,
}
MUTATIONS = {
    "mixtral": _ALL,
    "qwen2_moe": {**_ALL, **_SHARED, "drop_shared_gate": _no_shared_gate},
    "qwen3_moe": _ALL,
    "olmoe": _ALL,
    "deepseek_v2": {**_ALL, **_DEEPSEEK},
    "deepseek_v3": {
        **_ALL,
        **_DEEPSEEK,
        "drop_correction_bias": lambda hf: dataclasses.replace(hf, correction_bias=None),
        "softmax_scoring": _router(scoring="softmax"),
    },
    "gpt_oss": {
        **_ALL,
        "drop_router_bias": lambda hf: dataclasses.replace(hf, router_bias=None),
        "drop_expert_bias": _no_expert_bias,
        "not_interleaved": _config_change(gate_up_interleaved=False),
        "no_swiglu_clamp": _config_change(swiglu_limit=1e9),
        "silu_activation": _config_change(activation="silu"),
    },
}


@pytest.mark.parametrize("name,mutation", [(n, m) for n in MODELS for m in MUTATIONS[n]], ids=lambda v: str(v))
def test_a_broken_extraction_is_caught(name, mutation):
    """Each detail that extract reads matters: getting it wrong fails the fp32 test by far."""
    block = _block(name, "grouped_mm")
    hf = extract(block)
    x = _tokens(hf, torch.float32)
    err = rel_error(_run(block, x), moe_forward(MUTATIONS[name][mutation](hf), x))
    assert err > 100 * FP32_TOL, (name, mutation, err)


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss"])
def test_moe_forward_takes_flat_tokens(name):
    hf = extract(_block(name, "grouped_mm"))
    x = _tokens(hf, torch.float32)
    flat = moe_forward(hf, x.reshape(-1, H))
    assert flat.shape == (T, H)
    assert torch.equal(flat, moe_forward(hf, x).reshape(T, H))
    assert moe_forward(hf, x[0, :0]).shape == (0, H)


def test_extract_names_unsupported_blocks():
    with pytest.raises(FusedMoEError, match="block: expected a MoE block whose code fusedmoe maps"):
        extract(torch.nn.Linear(4, 4))
