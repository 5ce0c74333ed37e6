"""``integrations.transformers``: ``patch(model)``, the "fusedmoe" experts implementation, ``plan``.

End to end (the tiny random models of ``test_hf_models``): greedy generation gives the same
tokens and logits within ``fusedmoe.testing.tolerance`` after ``patch`` and through the
registry (``from_pretrained(..., experts_implementation="fusedmoe")`` too). Then what the
registry promises per module: the weights are views and the kernel is built once, reused
call after call, rebuilt when a parameter moves or is replaced; quantization on the fly;
refusals that name the block, the attribute and why. ``test_hf_zoo`` holds every other
architecture to transformers.
"""

from __future__ import annotations

import pytest
import torch

import fusedmoe.integrations.hf_experts as hf_experts
from fusedmoe import FusedMoEError, QuantScheme
from fusedmoe.integrations.transformers import FusedMoEBlock, experts_forward, patch, plan, register
from fusedmoe.testing import rel_error, tolerance

tf = pytest.importorskip("transformers", minversion="5")

from test_hf_models import MODELS, _config  # noqa: E402  (the shared tiny-model recipes)

H = 64
FP32 = tolerance(QuantScheme.unquantized(), torch.float32)


@pytest.fixture(autouse=True)
def _registry_on_cpu():
    register(backend="cpu")
    yield
    register()


def _model(name: str, dtype: torch.dtype = torch.float32, experts_implementation: str | None = None):
    torch.manual_seed(0)
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = tf.AutoModelForCausalLM.from_config(_config(name), **kw).eval()
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
    assert patch(model, backend=backend) == ["model.layers.0.mlp"]
    block = model.model.layers[0].mlp
    assert isinstance(block, FusedMoEBlock) and block.runner.kernel.choice.backend == backend
    logits2, tokens2 = _run(model, ids)
    err = rel_error(logits2, logits)
    print(f"\n[patch] {name:12s} {backend:9s} logits rel_error={err:.2e} same_tokens={torch.equal(tokens, tokens2)}")
    assert torch.equal(tokens, tokens2), (name, tokens, tokens2)
    assert err < FP32, (name, err)
    block.experts.down_proj.data.zero_()  # the logits do come through the fused experts (views)
    assert rel_error(_run(model, ids)[0], logits) > 1e-4


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_registry_generates_the_same(name):
    model = _model(name)
    ids = _prompt()
    logits, tokens = _run(model, ids)
    model.set_experts_implementation("fusedmoe")
    logits2, tokens2 = _run(model, ids)
    assert torch.equal(tokens, tokens2) and rel_error(logits2, logits) < FP32, (name, rel_error(logits2, logits))
    experts = model.model.layers[0].mlp.experts
    assert experts.__dict__["_fusedmoe_runner"].kernel.choice.backend == "cpu"
    model.set_experts_implementation("eager")  # and back: transformers' own loop again
    assert rel_error(_run(model, ids)[0], logits) < FP32


def test_from_pretrained_takes_fusedmoe(tmp_path):
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    ids = _prompt()
    with torch.no_grad():
        ref = model(ids).logits
        loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="fusedmoe").eval()
        out = loaded(ids).logits
    assert loaded.config._experts_implementation == "fusedmoe"
    assert "_fusedmoe_runner" in loaded.model.layers[0].mlp.experts.__dict__
    assert rel_error(out, ref) < FP32


def test_the_kernel_is_built_once_per_module_and_the_weights_are_views(monkeypatch):
    model = _model("mixtral", experts_implementation="fusedmoe")
    experts = model.model.layers[0].mlp.experts
    built = []
    real = hf_experts.build_kernel
    monkeypatch.setattr(hf_experts, "build_kernel", lambda *a, **k: built.append(1) or real(*a, **k))
    ids = _prompt()
    with torch.no_grad():
        for _ in range(3):
            model(ids)
    assert len(built) == 1
    runner = experts.__dict__["_fusedmoe_runner"]
    assert runner.weights.w13.data.data_ptr() == experts.gate_up_proj.data_ptr()  # a view, not a copy
    with torch.no_grad():
        experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach() * 2)  # a new parameter
        model(ids)
    assert len(built) == 2 and experts.__dict__["_fusedmoe_runner"] is not runner
    model.to(torch.bfloat16)  # moved and cast: rebuilt for the new dtype
    with torch.no_grad():
        model(ids)
    assert len(built) == 3 and experts.__dict__["_fusedmoe_runner"].dtype == torch.bfloat16


def test_transposed_interleaved_biased_experts_are_views():
    model = _model("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 0], [7, 2]])
    w = torch.rand(6, 2)
    with torch.no_grad():
        want = experts(x, ids, w)
        got = experts_forward(experts, x, ids, w)
    runner = experts.__dict__["_fusedmoe_runner"]
    assert runner.kernel.config.gate_up_interleaved and runner.kernel.config.has_bias
    assert runner.weights.w13.data.data_ptr() == experts.gate_up_proj.data_ptr()
    assert rel_error(got, want) < FP32


def test_patch_with_online_quantization():
    model = _model("qwen3_moe")
    ids = _prompt()
    with torch.no_grad():
        ref = model(ids).logits
        patch(model, backend="cpu", quantize=QuantScheme.fp8_per_tensor())
        out = model(ids).logits
    runner = model.model.layers[0].mlp.runner
    assert runner.kernel.scheme.name == "fp8_tensor" and runner.weights.w13.data.dtype == torch.float8_e4m3fn
    assert rel_error(out, ref) < 0.1


def test_registry_with_online_quantization():
    register(backend="cpu", quantize=QuantScheme.fp8_per_tensor())
    model = _model("mixtral", experts_implementation="fusedmoe")
    with torch.no_grad():
        model(_prompt())
    runner = model.model.layers[0].mlp.experts.__dict__["_fusedmoe_runner"]
    assert runner.weights.w13.data.dtype == torch.float8_e4m3fn


def test_patched_bf16_model_is_within_tolerance():
    model = _model("deepseek_v3", torch.bfloat16)
    ids = _prompt()
    with torch.no_grad():
        ref = model(ids).logits
        patch(model, backend="cpu")
        err = rel_error(model(ids).logits, ref)
    assert err < tolerance(QuantScheme.unquantized(), torch.bfloat16), err


def test_plan_says_how_each_block_is_served():
    p = plan(_model("qwen2_moe"))
    assert [(x.name, x.mode, x.kind) for x in p] == [("model.layers.0.mlp", "block", "Qwen2MoeSparseMoeBlock")]


class _UnknownBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])


def test_refusals_name_the_block_the_attribute_and_why():
    model = torch.nn.Sequential(_UnknownBlock())
    with pytest.raises(FusedMoEError, match=r"_UnknownBlock\.experts: ModuleList is not a transformers 5 experts"):
        patch(model)
    with pytest.raises(FusedMoEError, match="model: expected at least one MoE block"):
        patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_training_mode_router_jitter_is_refused():
    model = _model("mixtral").train()
    model.model.layers[0].mlp.jitter_noise = 0.1
    (p,) = plan(model)
    assert p.mode == "experts" and "jitter_noise" in p.reason  # routing stays with transformers


def test_expert_parallel_modules_are_refused():
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(FusedMoEError, match="_is_expert_parallel"):
        experts_forward(experts, torch.randn(2, H), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
