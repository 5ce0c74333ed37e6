"""``torch.compile(fullgraph=True)`` of models using fusedmoe, and the ``fusedmoe::moe_forward`` op.

The eager and compiled paths run in the same parametrize (STYLE.md point 3): eager must
call the kernels directly (the op's body never runs), compiled must go through the op
in one graph. Inductor's first compile costs 14-20 s on a 2-core CPU, so it compiles
one graph; aot_eager (seconds) covers both backends and a second token count.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from fusedmoe import api
from fusedmoe.api import fused_moe
from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.errors import FusedMoEError
from fusedmoe.experts.cpu import CpuExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.layer import FusedMoE
from fusedmoe.metadata import TopK
from fusedmoe.modular import ops
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.routing import RouterConfig
from fusedmoe.testing import make_problem

E, K, H, I = 4, 2, 64, 32
EXPERTS = {"cpu": CpuExperts, "triton": TritonExperts}


def llama4_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A custom routing function (Llama-4 style): top-k of the logits, sigmoid of those."""
    vals, ids = torch.topk(logits, top_k, dim=1)
    return torch.sigmoid(vals.float()), ids


class TinyModel(torch.nn.Module):
    """Linear -> FusedMoE (grouped sigmoid routing with a correction bias, or ``custom_fn``) -> Linear."""

    def __init__(
        self, backend: str, device="cpu", dtype=torch.float32, h=H, i=I, e=E, k=K, custom_fn=None, scheme=None
    ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        config = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=dtype)
        router = RouterConfig(e, k, scoring="sigmoid", renormalize=True, num_expert_group=2, topk_group=2)
        self.inp = torch.nn.Linear(h, h, dtype=dtype)
        self.gate = torch.nn.Linear(h, e, bias=False, dtype=dtype)
        bias = torch.rand(e, generator=g) * 0.1
        if custom_fn is not None:
            router, bias = RouterConfig(e, k, custom_fn=custom_fn), None
        quant = dict(scheme=scheme, online_quant=True) if scheme is not None else {}
        self.moe = FusedMoE(config, router=router, backend=backend, correction_bias=bias, **quant)
        w13 = torch.randn(e, config.w13_rows, h, generator=g) * h**-0.5
        w2 = torch.randn(e, h, i, generator=g) * i**-0.5
        for x in range(e):
            self.moe.weight_loader("w13_weight", w13[x].to(dtype), x, "w13")
            self.moe.weight_loader("w2_weight", w2[x].to(dtype), x, "w2")
        self.moe.process_weights_after_loading()
        self.out = torch.nn.Linear(h, h, dtype=dtype)
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(self.moe(h, self.gate(h)))


@pytest.fixture
def op_calls(monkeypatch):
    """How many times the op's body ran (it looks the kernel up once per call)."""
    calls = []
    real = ops.registered_kernel

    def counting(name):
        calls.append(name)
        return real(name)

    monkeypatch.setattr(ops, "registered_kernel", counting)
    return calls


def _inputs(t: int, seed: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(device, dtype)


@pytest.mark.parametrize(
    "mode,backend",
    [
        ("eager", "cpu"),
        ("eager", "triton"),
        ("aot_eager", "cpu"),
        ("aot_eager", "triton"),
        ("inductor", "triton"),
    ],
)
def test_model_compiles_without_graph_break(mode, backend, op_calls):
    torch._dynamo.reset()
    model = TinyModel(backend).eval()
    # aot_eager runs the graph's own ops, so it must agree bit for bit; inductor fuses the
    # Linear/router math differently (a few ulp)
    tol = 0.0 if mode != "inductor" else 1e-5
    counter = None if mode == "eager" else CompileCounterWithBackend(mode)
    run = model if counter is None else torch.compile(model, fullgraph=True, backend=counter)
    sizes = (5,) if mode == "inductor" else (5, 9)
    with torch.no_grad():
        for t in sizes:
            x = _inputs(t, seed=t)
            ref = model(x)
            assert not op_calls, "eager mode dispatched through the custom op"
            got = run(x)
            assert got.shape == ref.shape and got.dtype == ref.dtype
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            if counter is not None:
                assert len(op_calls) == 1, "the compiled graph did not run the op"
                op_calls.clear()
    if counter is not None:
        # one graph per compile (a second token count may recompile), each holding the op
        assert counter.frame_count == len(counter.graphs) >= 1
        for g in counter.graphs:
            op = torch.ops.fusedmoe.moe_forward
            assert any(node.target in (op, op.default) for node in g.graph.nodes)


def test_compile_after_launch_plans(op_calls, monkeypatch):
    """Eager calls that recorded and replayed launch plans, then torch.compile of the same model:
    while compiling, the kernel's plans are not replayed (a key reads addresses, which dynamo
    cannot trace on a GPU: ``reduce-overhead`` failed there), and the compiled graph runs the op.
    The router's plans: ``test_launch_plans.test_the_router_replays_its_fused_kernel``."""
    torch._dynamo.reset()
    model = TinyModel("triton").eval()
    x = _inputs(5, seed=3)
    with torch.no_grad():
        ref = model(x)
        for _ in range(2):  # the second call records the plans, the third replays them
            torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
        moe, h = model.moe, model.inp(x)
        logits = model.gate(h)
        topk = moe.router.route(logits, moe.e_score_correction_bias)
        assert moe.kernel.replay(h, topk, moe.expert_weights) is not None, "no launch plan was recorded"
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert moe.kernel.replay(h, topk, moe.expert_weights) is None
        counter = CompileCounterWithBackend("aot_eager")
        got = torch.compile(model, fullgraph=True, backend=counter)(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert counter.frame_count == 1 and len(op_calls) == 1


@pytest.mark.parametrize("scheme", ["int4_g128_actorder", "mxfp4"])
def test_converted_4bit_weights_compile(scheme):
    """A layer whose 4-bit weights were converted at load (the w4 layout, with act-order's column
    permutation): the op gets tensors, not the layout's objects, and must rebuild them."""
    torch._dynamo.reset()
    model = TinyModel("triton", dtype=torch.bfloat16, h=128, i=128, scheme=QuantScheme.by_name(scheme)).eval()
    assert model.moe.expert_weights.layout != "reference"
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        torch.testing.assert_close(run(x), model(x), rtol=0.0, atol=0.0)


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_custom_routing_fn_compiles_without_graph_break(mode, op_calls):
    """A traceable ``RouterConfig.custom_fn``: its result's values are checked only with value
    checks on (a host sync), so by default the router is part of the one graph."""
    torch._dynamo.reset()
    model = TinyModel("cpu", custom_fn=llama4_routing).eval()
    counter = None if mode == "eager" else CompileCounterWithBackend(mode)
    run = model if counter is None else torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        x = _inputs(7, seed=2)
        ref = model(x)
        assert not op_calls, "eager mode dispatched through the custom op"
        got = run(x)
    tol = 0.0 if mode != "inductor" else 1e-5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    if counter is not None:
        assert len(op_calls) == 1 and counter.frame_count == len(counter.graphs) == 1
        op = torch.ops.fusedmoe.moe_forward
        assert any(node.target in (op, op.default) for node in counter.graphs[0].graph.nodes)


@pytest.mark.parametrize(
    "mode,backend,scheme",
    [
        ("eager", "cpu", "bf16"),
        ("aot_eager", "cpu", "bf16"),
        ("aot_eager", "triton", "fp8_block"),
        ("inductor", "cpu", "bf16"),
    ],
)
def test_fused_moe_compiles_without_graph_break(mode, backend, scheme, op_calls):
    """The functional API: Linear -> fused_moe (router logits, default router) -> Linear. The
    kernel comes from ``fused_moe``'s cache, so eager and compiled calls run the same one."""
    torch._dynamo.reset()
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=torch.float32)
    s = QuantScheme.by_name(scheme)
    prob = make_problem(config, s, 5, seed=3)
    g = torch.Generator().manual_seed(1)
    w_in, w_gate = torch.randn(H, H, generator=g) * H**-0.5, torch.randn(E, H, generator=g)

    def layer(x: torch.Tensor) -> torch.Tensor:
        h = x @ w_in.T
        return fused_moe(h, h @ w_gate.T, prob.weights, config, s, backend=backend) @ w_in

    counter = None if mode == "eager" else CompileCounterWithBackend(mode)
    run = layer if counter is None else torch.compile(layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        for t in (5, 9) if mode == "aot_eager" else (5,):
            x = _inputs(t, seed=t)
            ref = layer(x)
            assert not op_calls, "eager mode dispatched through the custom op"
            got = run(x)
            tol = 0.0 if mode != "inductor" else 1e-5
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            if counter is not None:
                assert len(op_calls) == 1, "the compiled graph did not run the op"
                # the graph runs the kernel the eager calls use (one per configuration)
                assert op_calls.pop() == api.cached_kernel(config, s, backend).name
    if counter is not None:
        assert counter.frame_count == len(counter.graphs) >= 1
        op = torch.ops.fusedmoe.moe_forward
        assert all(any(n.target in (op, op.default) for n in g.graph.nodes) for g in counter.graphs)


def test_fused_moe_kernel_cache(monkeypatch):
    """One kernel per configuration, reused; bounded; the environment knobs a kernel reads are keys."""
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    s = QuantScheme.unquantized()
    a = api.cached_kernel(config, s, "cpu")
    assert api.cached_kernel(config, s, "cpu") is a and api.cached_kernel(config, s, "reference") is not a
    assert api.cached_kernel(config, s, "cpu", chunk_size=3).chunk_size == 3
    monkeypatch.setenv("FUSEDMOE_DETERMINISTIC", "1")
    d = api.cached_kernel(config, s, "cpu")
    assert d is not a and d.deterministic and not a.deterministic
    monkeypatch.setattr(api, "KERNEL_CACHE_SIZE", 2)
    for c in (3, 4, 5):
        api.cached_kernel(config, s, "cpu", chunk_size=c)
    assert len(api._KERNELS) == 2


def _kernel(backend: str, scheme: QuantScheme, shared=None) -> tuple[MoEKernel, object]:
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    prob = make_problem(config, scheme, 6, seed=3)
    kernel = MoEKernel(LocalDispatcher(config, scheme), EXPERTS[backend](config, scheme), shared_experts=shared)
    return kernel, prob


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_kernel_with_shared_experts_and_static_scales(mode, op_calls):
    # fp8 with static per-tensor scales: optional weight fields set and None in one call
    torch._dynamo.reset()
    shared = torch.nn.Linear(H, H, dtype=torch.bfloat16)
    kernel, prob = _kernel("triton", QuantScheme.by_name("fp8_tensor_static"), shared=shared)

    def layer(x, ids, w):
        return kernel(x * 2.0, TopK(ids, w), prob.weights) - x

    run = layer if mode == "eager" else torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        ref = kernel(prob.x * 2.0, TopK(prob.topk_ids, prob.topk_weights), prob.weights) - prob.x
        op_calls.clear()
        got = run(prob.x, prob.topk_ids, prob.topk_weights)
    assert len(op_calls) == (0 if mode == "eager" else 1)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# opcheck's schema check compares inputs with ops that have no fp8 CPU kernel, so the
# quantized case uses a format stored as uint8 (MXFP4 data and e8m0 scales)
@pytest.mark.parametrize("backend,scheme", [("cpu", "mxfp4"), ("triton", "bf16")])
def test_opcheck(backend, scheme):
    kernel, prob = _kernel(backend, QuantScheme.by_name(scheme))
    args = ops.moe_forward_args(kernel.name, prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights, None)
    torch.library.opcheck(torch.ops.fusedmoe.moe_forward.default, args)


def test_kernel_registry_names():
    config = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    s = QuantScheme.unquantized()
    a = MoEKernel(LocalDispatcher(config, s), CpuExperts(config, s))
    b = MoEKernel(LocalDispatcher(config, s), CpuExperts(config, s), name="layer0.moe")
    assert a.name != b.name and b.name == "layer0.moe"
    assert ops.registered_kernel("layer0.moe") is b
    with pytest.raises(FusedMoEError, match="a name no live kernel uses"):
        MoEKernel(LocalDispatcher(config, s), CpuExperts(config, s), name="layer0.moe")
    del b
    gc.collect()
    # the registry does not keep a kernel alive: its name is free again
    with pytest.raises(FusedMoEError, match="live kernel"):
        ops.registered_kernel("layer0.moe")
    c = MoEKernel(LocalDispatcher(config, s), CpuExperts(config, s), name="layer0.moe")
    # a copy (deepcopy of a model) is a kernel of its own
    d = copy.deepcopy(c)
    assert d.name != c.name and ops.registered_kernel(d.name) is d and ops.registered_kernel(c.name) is c


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "inductor", "reduce-overhead"])
def test_model_compiles_on_gpu(mode, op_calls):
    """Inductor on the GPU, and reduce-overhead (CUDA graph trees around the op) over
    warm-up, recording and replays with new inputs."""
    torch._dynamo.reset()
    # float32: inductor's Linear/router rounding differs by ulps, which in bf16 could flip a near-tie
    # expert choice; the MoE kernels themselves are the same in both paths
    model = TinyModel("triton", device="cuda", dtype=torch.float32, h=1024, i=512, e=16, k=4).eval()
    run = model if mode == "eager" else torch.compile(model, fullgraph=True, mode=None if mode == "inductor" else mode)
    with torch.no_grad():
        for seed in range(4 if mode == "reduce-overhead" else 1):
            x = torch.randn(
                64, 1024, device="cuda", dtype=torch.float32, generator=torch.Generator("cuda").manual_seed(seed)
            )
            got = run(x).clone()
            ref = model(x)
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    if mode != "reduce-overhead":  # graph replays do not run the op's Python body
        assert len(op_calls) == (0 if mode == "eager" else 1)
