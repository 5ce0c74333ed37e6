"""``integrations.transformers.patch``: a transformers model with its MoE blocks on fusedmoe.

For each family (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE,
OLMoE, DeepSeek-V2 group-limited greedy, DeepSeek-V3 sigmoid grouped top-k
with correction bias, gpt-oss with biases and interleaved swigluoai) a tiny
random float32 model is run before and after ``patch``: greedy generation
(8 new tokens) must give the same tokens, and the logits must agree within
``fusedmoe.testing.tolerance`` (measured: 1e-7 or exactly equal). Router
weights, biases and the correction bias are re-drawn so that none is zero.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe import FusedMoEError, QuantScheme
from fusedmoe.integrations.transformers import FusedMoEBlock, patch
from fusedmoe.testing import rel_error, tolerance

tf = pytest.importorskip("transformers")

from test_hf_models import MODELS, _config  # noqa: E402  (the shared tiny-model recipes)

H = 64


def _model(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(name)).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else H**-0.5))
        for bname, b in model.model.layers[0].mlp.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.to(dtype)


def _prompt():
    return torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(4))


def _run(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
    return logits, tokens


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", MODELS)
def test_patched_model_generates_the_same(name, backend):
    model = _model(name)
    ids = _prompt()
    logits, tokens = _run(model, ids)
    patched = patch(model, backend=backend)
    assert patched == ["model.layers.0.mlp"]
    block = model.model.layers[0].mlp
    assert isinstance(block, FusedMoEBlock) and block.moe.choice.backend == backend
    logits2, tokens2 = _run(model, ids)
    err = rel_error(logits2, logits)
    print(f"\n[patch] {name:12s} {backend:9s} logits rel_error={err:.2e} same_tokens={torch.equal(tokens, tokens2)}")
    assert torch.equal(tokens, tokens2), (name, tokens, tokens2)
    assert err < tolerance(QuantScheme.unquantized(), torch.float32), (name, err)
    block.moe.w2_weight.data.zero_()  # the logits do come through the fused layer
    assert rel_error(_run(model, ids)[0], logits) > 1e-4


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_patched_bf16_model_is_within_tolerance(name):
    model = _model(name, torch.bfloat16)
    ids = _prompt()
    with torch.no_grad():
        ref = model(ids).logits
        patch(model, backend="cpu")
        err = rel_error(model(ids).logits, ref)
    assert err < tolerance(QuantScheme.unquantized(), torch.bfloat16), (name, err)


def test_patch_with_online_quantization():
    model = _model("qwen3_moe")
    ids = _prompt()
    with torch.no_grad():
        ref = model(ids).logits
        patch(model, backend="cpu", quantize=QuantScheme.fp8_per_tensor())
        out = model(ids).logits
    block = model.model.layers[0].mlp
    assert block.moe.scheme.name == "fp8_tensor" and block.moe.w13_weight.dtype == torch.float8_e4m3fn
    assert rel_error(out, ref) < 0.1


def test_patch_needs_a_moe_block():
    with pytest.raises(FusedMoEError, match="model: expected at least one MoE block"):
        patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))
