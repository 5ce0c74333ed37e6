"""Launch plans (``modular.replay``): an eager call at a known shape replays its launches.

Each case calls the kernel on fresh random inputs three times per shape (run, record, replay) and
then replays on more fresh inputs: every output equals the same call with plans off
(``FUSEDMOE_LAUNCH_PLANS=0``) bit for bit, and the float64 reference within the scheme's
tolerance. The memory the replayed output lands in is poisoned first (a freed NaN-filled block of
the same size, which the allocator hands out again), so an element the replay does not write shows.
On the CPU the plans replay through the Triton interpreter (tensor views for pointers); on a GPU
through the binaries (pointers as integers).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fusedmoe import FusedMoEError, fused_moe
from fusedmoe.config import MoEConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.cpu import CpuExperts
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, random_topk, rel_error, tolerance

# The CPU cases replay through the Triton interpreter: without TRITON_INTERPRET=1 (a GPU machine
# running the file as is) their CPU tensors meet no interpreter to record, and the gpu-marked
# cases below are the ones that cover the GPU's binaries.
on_cpu_replays = pytest.mark.skipif(not interpreting(), reason="CPU launch plans replay through TRITON_INTERPRET=1")

CONFIG = MoEConfig(num_experts=5, top_k=2, hidden_size=64, intermediate_size=32)

# (label, scheme, T): bf16 and 4-bit weights replay on the CPU (their paths launch Triton kernels only)
CPU_CASES = [
    ("bf16_T1", "bf16", 1),
    ("bf16_T7_odd", "bf16", 7),
    ("bf16_T40_over_a_tile", "bf16", 40),
    ("int4_g32_T3", "int4_g32", 3),
    ("mxfp4_T5", "mxfp4", 5),
]


def _kernel(scheme: QuantScheme, config: MoEConfig = CONFIG) -> MoEKernel:
    return MoEKernel(LocalDispatcher(config, scheme), TritonExperts(config, scheme))


def _fresh(config: MoEConfig, t: int, seed: int, device) -> tuple[torch.Tensor, TopK]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
    ids, w = random_topk(t, config.num_experts, config.top_k, g)
    return x, TopK(ids, w)


def _poison_next(like_shape, dtype, device) -> None:
    # a block of the output's size, filled with NaN and freed: the next allocation of that size reuses it
    torch.full(like_shape, float("nan"), dtype=dtype, device=device)


def _plain(kernel, x, topk, weights, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv("FUSEDMOE_LAUNCH_PLANS", "0")
        return kernel(x, topk, weights)


def _check_replays(kernel, problem, t, device, monkeypatch, calls: int = 5) -> None:
    weights = kernel.prepared(problem.weights)
    config, scheme = problem.config, problem.scheme
    for seed in range(calls):
        x, topk = _fresh(config, t, 100 + seed, device)
        _poison_next((t, config.hidden_size), config.dtype, device)
        out = kernel(x, topk, weights)
        assert torch.equal(out, _plain(kernel, x, topk, weights, monkeypatch)), f"call {seed} differs from plans off"
        problem.x, problem.topk_ids, problem.topk_weights = x, topk.ids, topk.weights
        err = rel_error(out, problem.reference())
        assert err <= tolerance(scheme, config.dtype), f"call {seed}: rel error {err:.2e}"
    assert kernel._plans.plans and not kernel._plans.refused, f"no plan: {kernel._plans.refused}"


@on_cpu_replays
@pytest.mark.parametrize("label,scheme,t", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_replay_equals_the_plain_call_and_the_reference(label, scheme, t, monkeypatch):
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(CONFIG, scheme, t, seed=1)
    _check_replays(_kernel(scheme), problem, t, "cpu", monkeypatch)


@on_cpu_replays
def test_each_shape_has_its_own_plan(monkeypatch):
    scheme = QuantScheme.unquantized()
    problem = make_problem(CONFIG, scheme, 4, seed=2)
    kernel = _kernel(scheme)
    for t in (4, 9):
        _check_replays(kernel, make_problem(CONFIG, scheme, t, seed=2), t, "cpu", monkeypatch, calls=3)
    assert len(kernel._plans.plans) == 2
    assert problem is not None


def test_new_weight_tensors_record_a_new_plan(monkeypatch):
    scheme = QuantScheme.unquantized()
    kernel = _kernel(scheme)
    first = make_problem(CONFIG, scheme, 3, seed=3)
    second = make_problem(CONFIG, scheme, 3, seed=4)
    x, topk = _fresh(CONFIG, 3, 5, "cpu")
    for _ in range(3):
        kernel(x, topk, first.weights)
    out = kernel(x, topk, second.weights)  # same shapes, other weights: must not replay the first plan
    assert torch.equal(out, _plain(kernel, x, topk, second.weights, monkeypatch))
    assert not torch.equal(out, kernel(x, topk, first.weights))


@on_cpu_replays
def test_an_unaligned_input_is_another_key(monkeypatch):
    # Triton specialises on 16-byte alignment: a row view one element in is not the aligned plan
    scheme = QuantScheme.unquantized()
    kernel = _kernel(scheme)
    problem = make_problem(CONFIG, scheme, 3, seed=6)
    x, topk = _fresh(CONFIG, 3, 7, "cpu")
    for _ in range(3):
        kernel(x, topk, problem.weights)
    flat = torch.randn(3 * CONFIG.hidden_size + 1).to(CONFIG.dtype)
    shifted = flat[1:].view(3, CONFIG.hidden_size)
    out = kernel(shifted, topk, problem.weights)
    assert torch.equal(out, _plain(kernel, shifted, topk, problem.weights, monkeypatch))
    assert len(kernel._plans.plans) == 1 and len(kernel._plans._seen) == 2


@on_cpu_replays
@pytest.mark.parametrize("t", [1, 6])
def test_transformers_routing_kinds_replay(t, monkeypatch):
    # transformers' routers give int64 ids and router weights in the model dtype: read as given
    # by the kernels, so the call is planned (no conversion op) and equals the plain call
    scheme = QuantScheme.unquantized()
    kernel = _kernel(scheme)
    problem = make_problem(CONFIG, scheme, t, seed=15)
    for seed in range(4):
        x, topk = _fresh(CONFIG, t, 60 + seed, "cpu")
        hf = TopK(topk.ids.long(), topk.weights.to(torch.bfloat16))
        out = kernel(x, hf, problem.weights)
        assert torch.equal(out, _plain(kernel, x, hf, problem.weights, monkeypatch))
        problem.x, problem.topk_ids, problem.topk_weights = x, hf.ids, hf.weights.float()
        assert rel_error(out, problem.reference()) <= tolerance(scheme, CONFIG.dtype)
    assert len(kernel._plans.plans) == 1 and not kernel._plans.refused, kernel._plans.refused


@on_cpu_replays
def test_a_call_with_host_side_torch_work_is_refused_with_the_op():
    # the CPU backend computes with PyTorch ops: never replayed, and the reason names the op
    scheme = QuantScheme.unquantized()
    kernel = MoEKernel(LocalDispatcher(CONFIG, scheme), CpuExperts(CONFIG, scheme))
    problem = make_problem(CONFIG, scheme, 2, seed=8)
    for _ in range(3):
        kernel(problem.x, TopK(problem.topk_ids, problem.topk_weights), problem.weights)
    assert not kernel._plans.plans
    (why,) = kernel._plans.refused.values()
    assert "aten." in why and "only allocations, fills, views and launches replay" in why


@on_cpu_replays
def test_plans_off_by_environment(monkeypatch):
    monkeypatch.setenv("FUSEDMOE_LAUNCH_PLANS", "0")
    scheme = QuantScheme.unquantized()
    kernel = _kernel(scheme)
    problem = make_problem(CONFIG, scheme, 2, seed=9)
    for _ in range(3):
        kernel(problem.x, TopK(problem.topk_ids, problem.topk_weights), problem.weights)
    assert not kernel._plans.plans and not kernel._plans._seen
    monkeypatch.setenv("FUSEDMOE_LAUNCH_PLANS", "maybe")
    with pytest.raises(FusedMoEError, match="FUSEDMOE_LAUNCH_PLANS"):
        kernel(problem.x, TopK(problem.topk_ids, problem.topk_weights), problem.weights)


@on_cpu_replays
def test_shared_experts_are_added_after_a_replay(monkeypatch):
    scheme = QuantScheme.unquantized()
    kernel = MoEKernel(LocalDispatcher(CONFIG, scheme), TritonExperts(CONFIG, scheme), shared_experts=lambda x: 2 * x)
    problem = make_problem(CONFIG, scheme, 3, seed=10)
    for seed in range(4):
        x, topk = _fresh(CONFIG, 3, 20 + seed, "cpu")
        assert torch.equal(kernel(x, topk, problem.weights), _plain(kernel, x, topk, problem.weights, monkeypatch))
    assert len(kernel._plans.plans) == 1


def test_fused_moe_replays_and_still_refuses_bad_input():
    scheme = QuantScheme.unquantized()
    problem = make_problem(CONFIG, scheme, 3, seed=11)
    topk = (problem.topk_ids, problem.topk_weights)
    outs = [fused_moe(problem.x, topk, problem.weights, CONFIG, scheme, backend="triton") for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    with pytest.raises(FusedMoEError, match="x"):
        fused_moe(problem.x.float(), topk, problem.weights, CONFIG, scheme, backend="triton")
    with pytest.raises(FusedMoEError, match="topk"):
        fused_moe(problem.x, (problem.topk_ids[:, :1], problem.topk_weights), problem.weights, CONFIG, scheme,
                  backend="triton")  # fmt: skip


# ---- GPU: every scheme's path at real sizes ---------------------------------------------------

GPU_SCHEMES = ["bf16", "fp8_tensor", "fp8_tensor_static", "fp8_block", "fp8_token", "int8_w8a8_channel", "int4_g128",
               "int4_g128_actorder", "mxfp4",
               "nvfp4_w4a16"]  # fmt: skip
GPU_CONFIG = MoEConfig(num_experts=16, top_k=4, hidden_size=1024, intermediate_size=768)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 300])
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_gpu_replay_equals_the_plain_call(scheme, t, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(GPU_CONFIG, scheme, t, seed=12, device="cuda")
    kernel = _kernel(scheme, GPU_CONFIG)
    _check_replays(kernel, problem, t, "cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", GPU_SCHEMES)
def test_gpu_replay_with_a_preallocated_workspace(scheme, monkeypatch):
    # the bench's and CUDA graphs' way: buffers held by the kernel (fills of them are replayed)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    scheme = QuantScheme.by_name(scheme)
    problem = make_problem(GPU_CONFIG, scheme, 16, seed=14, device="cuda")
    kernel = _kernel(scheme, GPU_CONFIG)
    kernel.allocate(64, "cuda")
    _check_replays(kernel, problem, 16, "cuda", monkeypatch)


def test_generated_replay_calls_each_binary_with_the_recorded_arguments(monkeypatch):
    # the GPU path of a replay (pointers as integers, one generated function): its calls checked
    # against what the recorded launches say, with a stand-in for Triton's launcher
    from fusedmoe.kernels.launch import DirectLaunch
    from fusedmoe.modular import replay as replay_module
    from fusedmoe.modular.replay import _compile

    calls = []
    # a kernel with global scratch (TMA descriptors): the replay installs the allocator first
    monkeypatch.setattr(replay_module, "ensure_allocator", lambda: calls.append("allocator"))
    held = torch.arange(4.0)

    def run(*a):
        calls.append(a)

    first = DirectLaunch(run, (3, 1, 1), 111, "meta1", (64, "silu"))
    second = DirectLaunch(run, (2, 5, 1), 222, "meta2", (), needs_allocator=True)
    bare = DirectLaunch(run, (1, 1, 1), 333, "meta3", ())  # a kernel without runtime arguments
    steps = [
        ("launch", first, [None, 7, 0.5, None, held, None], ((0, 0, 16), (3, 2, 0), (5, 1, 256))),
        ("launch", second, [None, True], ((0, 3, 8),)),
        ("launch", bare, [], ()),
    ]
    replay = _compile([(k, d, t, tuple((*f, torch.float32, (1,), (1,)) for f in fix)) for k, d, t, fix in steps])
    bases = [1000, 2000, 3000, 4000]
    replay(bases, None, 99)
    assert calls == [
        "allocator",
        (3, 1, 1, 99, 111, "meta1", None, None, None, 1016, 7, 0.5, 3000, held.data_ptr(), 2256, 64, "silu"),
        (2, 5, 1, 99, 222, "meta2", None, None, None, 4008, True),
        (1, 1, 1, 99, 333, "meta3", None, None, None),
    ]


@on_cpu_replays
def test_inputs_sharing_one_buffer_are_replayed_each_from_its_own_address(monkeypatch):
    # the routing packed in one int32 buffer (ids, then the weights' bits): recorded like that,
    # replayed on separate tensors, each pointer must follow its own input
    scheme = QuantScheme.unquantized()
    kernel = _kernel(scheme)
    problem = make_problem(CONFIG, scheme, 3, seed=13)
    n = 3 * CONFIG.top_k
    for seed in range(3):
        x, topk = _fresh(CONFIG, 3, 30 + seed, "cpu")
        packed = torch.cat([topk.ids.reshape(-1), topk.weights.reshape(-1).view(torch.int32)])
        shared = TopK(packed[:n].view(3, -1), packed[n:].view(torch.float32).view(3, -1))
        assert torch.equal(kernel(x, shared, problem.weights), _plain(kernel, x, topk, problem.weights, monkeypatch))
    assert len(kernel._plans.plans) == 1
    x, topk = _fresh(CONFIG, 3, 40, "cpu")
    weights = torch.empty(n + 2)[2:].view(3, -1)  # 8 bytes past a boundary, as the packed weights were
    weights.copy_(topk.weights)
    out = kernel(x, TopK(topk.ids, weights), problem.weights)
    assert len(kernel._plans.plans) == 1 and len(kernel._plans._seen) == 1  # the packed call's plan replayed
    assert torch.equal(out, _plain(kernel, x, topk, problem.weights, monkeypatch))


@on_cpu_replays
def test_the_router_replays_its_fused_kernel(monkeypatch):
    # fused=True: the routing kernel (the interpreter here); fresh logits each call, the replayed
    # routing equals the plans-off one bit for bit and PyTorch's within rounding
    from fusedmoe.routing import RouterConfig, _plans_of, _replayed

    router = RouterConfig(16, 4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    bias = torch.randn(16) * 0.1
    for seed in range(4):
        logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(50 + seed))
        got = router.route(logits, bias, fused=True)
        with monkeypatch.context() as m:
            m.setenv("FUSEDMOE_LAUNCH_PLANS", "0")
            plain = router.route(logits, bias, fused=True)
        ref = router.route(logits, bias, fused=False)
        assert torch.equal(got.ids, plain.ids) and torch.equal(got.weights, plain.weights)
        assert torch.equal(got.ids.sort(dim=1).values, ref.ids.sort(dim=1).values)
    plans = _plans_of(router, create=False)
    assert plans is not None and len(plans.plans) == 1 and not plans.refused
    assert _replayed(router, logits, bias) is not None
    with monkeypatch.context() as m:  # traced by torch.compile: never replayed (keys read addresses)
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert _replayed(router, logits, bias) is None


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, a + b, mask=mask)


@on_cpu_replays
def test_a_fill_of_a_buffer_that_lives_on_is_replayed():
    # a preallocated workspace zeroed by the call (as GEMM1's output before a per-tensor dynamic
    # scale): each replay zeroes it again, so a value left there by someone else never shows
    from fusedmoe.kernels.launch import launch
    from fusedmoe.modular.replay import LaunchPlans

    plans, ws = LaunchPlans(), torch.full((8,), 5.0)

    def call(x):
        ws.zero_()
        out = torch.empty_like(x)
        launch(_add_kernel, (1,), x, ws, out, x.numel(), BLOCK=8)
        return out

    for seed in range(4):
        x = torch.randn(8, generator=torch.Generator().manual_seed(seed))
        ws.fill_(5.0)  # what another user of the workspace left there
        out = plans.call(("key",), lambda x=x: call(x), (x,))
        assert torch.equal(out, x), f"call {seed}: the workspace was not zeroed"
    assert len(plans.plans) == 1 and not plans.refused


def test_refused_keys_are_bounded():
    # a server meets many prefill lengths; a key refused for each must not grow without end
    from fusedmoe.modular.replay import LaunchPlans

    plans = LaunchPlans(capacity=2)
    x = torch.ones(4)
    for n in range(40):
        for _ in range(2):  # the second call of a key records, and is refused (an add is not replayable)
            assert torch.equal(plans.call(("len", n), lambda: x + 1, (x,)), x + 1)
    assert 0 < len(plans.refused) <= 16 and not plans.plans
