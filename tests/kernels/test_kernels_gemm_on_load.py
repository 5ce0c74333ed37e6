"""A quantized as the GEMM loads it (``grouped_gemm(quantize_a=...)``) and GEMM1's abs-max slots.

GEMM2 at decode takes act(h) in the model dtype and quantizes each A tile itself: per tensor
from the abs-max GEMM1 left (an fp32 [1] or int32 per-program slots), per 1 x g group from the
tile. Each case runs on fresh random operands with the output poisoned (NaN) first, and is
checked three ways: every row of a local pair written and the others untouched; against the
float64 reference of the same scheme (``grouped_gemm_ref(quantize_a=...)``) within the
scheme's tolerance; and against the path it replaces (``quantize_activations``, then the GEMM
on the codes), which makes the same codes with the same scales: within 1e-5 (the FMA tiles fold
A's scale per element, the codes path at the end).

Then the epilogue that feeds it: ``ActEpilogue.amax_slots``, whose slots (poisoned first) must
all be written, 0 for a program without rows, with their max the abs-max of what it stored;
and the layer (``TritonExperts``) with ``quant_on_load`` forced and off: a launch fewer, the same
answer, the reference within tolerance, with an expert map too (the zeroed fp32 [1] path); its
default rule by shape; and the GPU at real shapes.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import Activation, MoEConfig
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.env import QUANT_ON_LOAD
from fusedmoe.errors import FusedMoEError
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.act_quant import quantize_activations
from fusedmoe.kernels.align import moe_align, pair_blocks
from fusedmoe.kernels.gemm_format import ActEpilogue, amax_slot_count
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref
from fusedmoe.kernels.launch import intercept_launches
from fusedmoe.kernels.launch_config import LaunchConfig
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import Operand, QuantScheme, quantize
from fusedmoe.testing import make_problem, poison_, random_topk, rel_error, tolerance

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

E, N, KD = 3, 96, 256  # N not a multiple of BN 64; KD two 128-groups

# (label, scheme, BM, routing, abs-max form, A rows per token): BM 16 is the tl.dot path, BM < 16
# the FMA path; one A row per pair (GEMM2's a2) or per token (a_div = K, as GEMM1 reads x)
CASES = [
    ("fp8 tensor, dot, pair blocks, fp32 abs-max", "fp8_tensor", 16, "pairs", "fp32", 2),
    ("fp8 tensor, FMA BM 4, aligned, slots", "fp8_tensor", 4, "aligned", "slots", 2),
    ("fp8 groups, dot, aligned", "fp8_block", 16, "aligned", None, 2),
    ("fp8 groups, FMA BM 1, pair blocks", "fp8_block", 1, "pairs", None, 2),
    # pair blocks on the dot path: a BM 16 tile of one real row; A read per token as GEMM1 reads x
    ("fp8 groups, dot, pair blocks", "fp8_block", 16, "pairs", None, 2),
    ("fp8 tensor, dot, pair blocks, a row per token (a_div = K)", "fp8_tensor", 16, "pairs", "slots", 1),
    ("int8 groups, dot, pair blocks, a row per token (a_div = K)", "int8_w8a8_block", 16, "pairs", None, 1),
    ("fp8 groups, dot, a row per token (a_div = K)", "fp8_block", 16, "aligned", None, 1),
    ("int8 tensor, dot, aligned, slots", "int8_w8a8_tensor", 16, "aligned", "slots", 2),
    ("int8 groups, FMA BM 2, aligned", "int8_w8a8_block", 2, "aligned", None, 2),
]


def _operands(name: str, t: int, k: int, seed: int, rows_per_token: int | None = None):
    scheme = QuantScheme.by_name(name)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    a = (torch.randn(t * (rows_per_token or k), KD, generator=g, device=DEVICE) * 3).to(torch.bfloat16)
    a[0, 5] = 40.0  # one large value: the per-tensor scale is not every row's own
    w = torch.randn(E, N, KD, generator=g, device=DEVICE) * KD**-0.5
    ids, tw = random_topk(t, E, k, g)
    return scheme, a, Operand(quantize(w.to(torch.bfloat16), scheme.w2), scheme.w2), ids, tw


def _routing(ids: torch.Tensor, bm: int, kind: str):
    return pair_blocks(ids, bm) if kind == "pairs" else moe_align(ids, E, bm)


def _amax(a: torch.Tensor, form: str | None) -> torch.Tensor | None:
    """A's abs-max as GEMM1 leaves it: fp32 [1], or int32 slots whose max it is."""
    if form is None:
        return None
    amax = a.float().abs().amax().reshape(1)
    if form == "fp32":
        return amax
    slots = torch.zeros(5, dtype=torch.int32, device=a.device)
    slots[3] = amax.view(torch.int32)[0]
    slots[1] = (amax / 2).view(torch.int32)[0]
    return slots


@needs_triton
@pytest.mark.parametrize("label, name, bm, kind, form, per_token", CASES, ids=[c[0] for c in CASES])
def test_on_load_matches_codes_path_and_reference(label, name, bm, kind, form, per_token):
    t, k = 5, 2
    scheme, a, w, ids, tw = _operands(name, t, k, seed=bm, rows_per_token=per_token)
    routing = _routing(ids, bm, kind)
    cfg = LaunchConfig(block_m=bm, block_n=64, block_k=128, group_m=2, num_warps=4, num_stages=2)
    amax = _amax(a, form)
    kw = dict(topk_weights=tw, config=cfg, a_div=k // per_token)
    out = poison_(torch.empty(t * k, N, dtype=torch.bfloat16, device=DEVICE))
    grouped_gemm(Operand.of(a), w, routing, out=out, quantize_a=scheme.a2, a_amax=amax, **kw)
    codes = quantize_activations(a, scheme.a2)
    via_codes = grouped_gemm(Operand(codes, scheme.a2), w, routing, **kw)
    kw.pop("config")
    ref = grouped_gemm_ref(Operand.of(a), w, routing, quantize_a=scheme.a2, a_amax=amax, **kw)
    assert not out.isnan().any(), "every pair's row written"
    tol = tolerance(scheme, torch.bfloat16)
    assert rel_error(out, ref) <= tol, f"{label}: {rel_error(out, ref):.3g} > {tol:.2g}"
    assert rel_error(out, via_codes.double()) <= 1e-5, label


@needs_triton
def test_on_load_reads_only_the_rows_of_pairs():
    """Rows of A that no pair reads (another rank's) may hold anything: NaN there changes nothing."""
    scheme, a, w, ids, tw = _operands("fp8_block", 4, 2, seed=7)
    ids[1, 0] = 50  # out of range: no pair reads row 2 (pair 1 * 2 + 0)
    a[2] = float("nan")
    routing = moe_align(ids, E, 16)
    out = poison_(torch.empty(8, N, dtype=torch.bfloat16, device=DEVICE))
    grouped_gemm(Operand.of(a), w, routing, out=out, quantize_a=scheme.a2)
    written = torch.ones(8, dtype=torch.bool, device=DEVICE)
    written[2] = False
    assert not out[written].isnan().any() and out[2].isnan().all(), "row 2 untouched, the others finite"


@needs_triton
@pytest.mark.parametrize("kind", ["pairs", "aligned"])
def test_amax_slots_cover_every_program(kind):
    """GEMM1 with the abs-max in per-program slots: every slot written (poisoned first), a
    program without rows (an id out of range, a padding block) writes 0, and the slots' max is
    the abs-max of the stored act(h), the value the fp32 atomic form raises to."""
    t, k = 3, 2
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(t, KD, generator=g, device=DEVICE).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * N, KD, generator=g, device=DEVICE) * KD**-0.5).to(torch.bfloat16)
    ids, _ = random_topk(t, E, k, g)
    ids[2, 1] = -1  # a pair that contributes nothing: its program has no rows
    routing = _routing(ids, 16, kind)
    cfg = LaunchConfig(block_m=16, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=2)
    ep = ActEpilogue(Activation.SILU, track_amax=True)
    slots = torch.full((amax_slot_count(routing.block_expert.numel(), N, 32),), -7, dtype=torch.int32, device=DEVICE)
    h = torch.zeros(t * k, N, dtype=torch.bfloat16, device=DEVICE)
    grouped_gemm(Operand.of(x), Operand.of(w13), routing, a_div=k, out=h, config=cfg,
                 act=ActEpilogue(Activation.SILU, track_amax=True, amax_slots=True), act_scale=slots)  # fmt: skip
    one = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    grouped_gemm(Operand.of(x), Operand.of(w13), routing, a_div=k, config=cfg, act=ep, act_scale=one)
    assert (slots >= 0).all(), "every program wrote its slot"
    assert (slots == 0).any(), "the programs without rows wrote 0"
    assert slots.max().view(torch.float32) == h.float().abs().amax() == one[0]


@needs_triton
def test_on_load_refuses_what_it_cannot_do():
    scheme, a, w, ids, _ = _operands("fp8_tensor", 2, 2, seed=1)
    routing = pair_blocks(ids, 16)
    with pytest.raises(FusedMoEError, match="a_amax"):
        grouped_gemm(Operand.of(a), w, routing, quantize_a=scheme.a2)  # no abs-max
    with pytest.raises(FusedMoEError, match="quantize_a"):
        grouped_gemm(Operand.of(a), w, routing, quantize_a=QuantScheme.by_name("fp8_token").a2)
    with pytest.raises(FusedMoEError, match="quantize_a"):
        grouped_gemm(Operand.of(a), w, routing, quantize_a=QuantScheme.by_name("fp8_tensor_static").a2)
    codes = quantize_activations(a, scheme.a2)
    with pytest.raises(FusedMoEError, match="^a: "):
        grouped_gemm(Operand(codes, scheme.a2), w, routing, quantize_a=scheme.a2, a_amax=_amax(a, "fp32"))
    bf16_w = Operand.of(torch.zeros(E, N, KD, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(FusedMoEError, match="^w: "):
        grouped_gemm(Operand.of(a), bf16_w, routing, quantize_a=scheme.a2, a_amax=_amax(a, "fp32"))
    with pytest.raises(FusedMoEError, match="^a_amax: "):  # two fp32 values: neither form
        grouped_gemm(Operand.of(a), w, routing, quantize_a=scheme.a2, a_amax=torch.ones(2, device=DEVICE))
    with pytest.raises(FusedMoEError, match="^amax: "):
        quantize_activations(a, scheme.a2, amax=torch.ones(1, dtype=torch.float64, device=DEVICE))
    with pytest.raises(FusedMoEError, match="amax_slots"):
        ActEpilogue(Activation.SILU, amax_slots=True)
    ep = ActEpilogue(Activation.SILU, track_amax=True, amax_slots=True)
    x, w13 = a[:2], Operand.of(torch.zeros(E, 2 * N, KD, dtype=torch.bfloat16, device=DEVICE))
    few = torch.zeros(2, dtype=torch.int32, device=DEVICE)  # fewer slots than programs
    with pytest.raises(FusedMoEError, match="act_scale"):
        grouped_gemm(Operand.of(x), w13, routing, a_div=2, act=ep, act_scale=few)


# ---- the layer --------------------------------------------------------------------------


def _layer(prob, on_load: int):
    """(output, Triton kernels launched) of one call, the workspace poisoned first."""
    c, s = prob.config, prob.scheme
    experts = TritonExperts(c, s)
    experts.quant_on_load = on_load
    kernel = MoEKernel(LocalDispatcher(c, s), experts)
    n_local = None if prob.expert_map is None else prob.weights.num_experts
    for buf in kernel.allocate(prob.x.shape[0], prob.x.device, num_local_experts=n_local).values():
        poison_(buf)
    names = []

    def record(k, grid, args, kwargs):
        names.append(k.fn.__name__)
        k[grid](*args, **kwargs)

    with intercept_launches(record):
        out = kernel(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights, expert_map=prob.expert_map)
    return out, names


LAYER = [  # (label, scheme, T, expert map)
    ("fp8 tensor, T 1: pair blocks, abs-max slots", "fp8_tensor", 1, False),
    ("fp8 tensor, T 3: aligned, fp32 abs-max", "fp8_tensor", 3, False),
    ("fp8 groups, T 1", "fp8_block", 1, False),
    ("int8 tensor, T 2, expert map", "int8_w8a8_tensor", 2, True),
    ("int8 groups, T 3, expert map", "int8_w8a8_block", 3, True),
]


@needs_triton
@pytest.mark.parametrize("label, name, t, emap", LAYER, ids=[c[0] for c in LAYER])
def test_layer_quantizes_a2_on_load(label, name, t, emap):
    config = MoEConfig(4, 2, 256, 256, activation=Activation.SILU, has_bias=True)
    kw = {}
    if emap:  # this rank holds experts 1 and 2 of 4
        kw = dict(expert_map=torch.tensor([-1, 0, 1, -1], dtype=torch.int32), num_local_experts=2)
    prob = make_problem(config, QuantScheme.by_name(name), t, seed=t, device=DEVICE, **kw)
    on, on_names = _layer(prob, 16)
    off, off_names = _layer(prob, 0)
    assert "_act_quant_kernel" in off_names and "_act_quant_kernel" not in on_names[1:], on_names
    assert len(on_names) == len(off_names) - 1, (on_names, off_names)
    tol = tolerance(prob.scheme, config.dtype)
    ref = prob.reference()
    errs = {"on load": rel_error(on, ref), "codes pass": rel_error(off, ref), "between": rel_error(on, off.double())}
    assert all(v <= tol for v in errs.values()), f"{label}: {errs} > {tol:.2g}"


def test_layer_rule_and_env(monkeypatch):
    """By default (``quant_on_load`` None) a per-tensor a2 at pair blocks, where GEMM2 runs at most
    32 K steps an SM: Qwen3-30B-A3B's T = 1 (8 pairs x 32 column tiles x 6 steps), not Mixtral's
    (2 x 64 x 112), nor aligned calls, nor groups; a number forces it up to that many pairs."""
    qwen = MoEConfig(128, 8, 2048, 768)
    mixtral = MoEConfig(8, 2, 4096, 14336)
    tensor, block = QuantScheme.by_name("fp8_tensor"), QuantScheme.by_name("fp8_block")

    def on(config, scheme, rows, by_pair=True, **attrs):
        experts = TritonExperts(config, scheme)
        for k, v in attrs.items():
            setattr(experts, k, v)
        return experts._plan(rows, config.num_experts, None, None, by_pair).a2_on_load

    assert TritonExperts(qwen, tensor).quant_on_load is None
    assert on(qwen, tensor, 8) and not on(mixtral, tensor, 2)
    assert not on(qwen, tensor, 8, by_pair=False) and not on(qwen, block, 8)
    assert on(qwen, block, 16, quant_on_load=16) and on(mixtral, tensor, 2, by_pair=False, quant_on_load=2)
    assert not on(qwen, block, 18, quant_on_load=16)
    assert not on(qwen, tensor, 8, quant_on_load=0)
    # deterministic mode: the a2 path would depend on the batch size; unfused: no act(h) to load
    assert not on(qwen, tensor, 8, deterministic=True) and not on(qwen, tensor, 8, fuse_act=False)
    assert not on(qwen, QuantScheme.by_name("fp8_token"), 8, quant_on_load=16)  # a token scale: whole rows first
    for value, want in (("0", 0), ("24", 24), ("auto", None), ("AUTO", None)):
        monkeypatch.setenv(QUANT_ON_LOAD, value)
        assert TritonExperts(qwen, block).quant_on_load == want
    monkeypatch.setenv(QUANT_ON_LOAD, "some")
    with pytest.raises(FusedMoEError, match=f"{QUANT_ON_LOAD}: expected auto or an integer"):
        TritonExperts(qwen, block)


# ---- real shapes (GPU) ------------------------------------------------------------------

REAL = [  # (E, K, H, I): Qwen3-30B-A3B; DeepSeek-V3's H and I with 32 of its 256 experts; Mixtral
    (128, 8, 2048, 768),
    (32, 8, 7168, 2048),
    (8, 2, 4096, 14336),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[2]}_I{s[3]}" for s in REAL])
@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_block", "int8_w8a8_tensor"])
def test_layer_on_load_real_shapes(name, shape, t):
    e, k, h, i = shape
    config = MoEConfig(e, k, h, i, activation=Activation.SILU)
    prob = make_problem(config, QuantScheme.by_name(name), t, seed=2, device="cuda")
    on, _ = _layer(prob, 16)
    off, _ = _layer(prob, 0)
    auto, _ = _layer(prob, None)
    tol = tolerance(prob.scheme, config.dtype)
    ref = prob.reference()
    errs = {"on load": rel_error(on, ref), "codes pass": rel_error(off, ref), "between": rel_error(on, off.double())}
    errs["default rule"] = rel_error(auto, ref)
    assert all(v <= tol for v in errs.values()), f"{errs} > {tol:.2g}"
