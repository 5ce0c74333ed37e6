"""The grouped GEMM's FMA path (BM < 16, for decode) against the float64 reference and the dot path.

BM in {1, 2, 4, 8} comes from ``override_launch_config`` with ``config=None``, as the layer
calls the GEMM (so the fused activation's BN halving applies), and ``moe_align_ref`` pads
each expert's run to BM. Every case also runs with BM = 16 (the ``tl.dot`` path) on the same
operands; both outputs are poisoned with NaN first and checked against the float64 reference
(rows of local pairs all written, the others untouched), then against each other, all
within the scheme's tolerance. Operands, reference and tolerances are the ones of
``test_kernels_gemm.py``. Under the interpreter both paths compute fp32 sums of exactly
dequantized operands, so they match the reference to ~1e-7 (fp32 output).

Which cases: the interpreter costs ~5 ms per program and K step, and BM = 1 launches one
program per routed pair, so the cross product of schemes x BM x layouts x activations is
too slow for 2 CPU cores. The FMA code that depends on the scheme (dequantizing A and W,
per-K scales) does not depend on BM, and the code that depends on BM (the row loop, BM = 1
its own branch; padding; blocks per expert) does not depend on the scheme. So:

* every scheme in both layouts, BM rotating along the scheme list (each scheme meets two
  BMs, each BM about seven schemes per layout); N = 40 and Kd = 96 are not multiples of
  BN = 32 and BK = 64 (Kd = 128 where an int4 group of 64 or 128 needs it);
* every BM on the labelled edge cases (T = 0, T = 1, T below a tile, all rows on one expert,
  an expert with no token, odd H and I), a 4-bit or 8-bit scheme per BM;
* every BM with gated activations (silu, interleaved swigluoai with its alpha and limit,
  interleaved gelu) and a *_no_mul one, biases, router weights and static fp8/int8 output
  quantization, over the epilogue's schemes, in both layouts;
* the layer (``MoEKernel``) with the router weight applied on the input, both layouts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fused_act import _compare as compare_layer
from test_fused_act import _config as layer_config
from test_kernels_gemm import (
    ACT_SCHEMES,
    BY_NAME,
    DEVICE,
    SCHEMES,
    _act_tol,
    _epilogue,
    _static_scale,
    _tol,
    _values,
    check,
    check_act,
    make_operands,
    needs_cuda,
    needs_triton,
)
from triton.runtime import interpreter
from triton.runtime.errors import InterpreterError

from fusedmoe.config import Activation
from fusedmoe.env import LAUNCH_CONFIG as ENV_VAR
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align_ref
from fusedmoe.kernels.gemm_format import ActEpilogue
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched, grouped_gemm_batched_ref, grouped_gemm_ref
from fusedmoe.kernels.launch_config import (
    LaunchConfig,
    default_launch_config,
    fit_launch_config,
    gated_act_config,
    override_launch_config,
    pick_launch_config,
)
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import EDGE_CASES, ODD_CASES, make_problem, poison_, random_topk, rel_error

FMA_BMS = [1, 2, 4, 8]
DOT_BM = 16


def _cfg(bm: int) -> LaunchConfig:
    """Tiles of the tests: BN 64 and BK 64 (a gated activation halves BN to 32)."""
    return LaunchConfig(block_m=bm, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=2)


def run(
    scheme: QuantScheme,
    bm: int,
    *,
    layout: str = "standard",
    act: Activation | None = None,
    t: int = 5,
    e: int = 4,
    k: int = 2,
    n: int = 40,
    kd: int = 96,
    gemm: str = "gemm1",
    routing: str = "random",
    expert_map: torch.Tensor | None = None,
    counts: tuple[int, ...] = (3, 0, 7),
    weighted: bool = True,
    bias: bool = True,
    out_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """One problem through the FMA path (BM ``bm``) and the dot path (BM 16).

    Standard layout: T tokens, top-K of E experts (those of ``expert_map`` local), A the
    [T, Kd] input (gemm1, a_div K) or the [T*K, Kd] intermediate (gemm2). Batched: one
    expert per entry of ``counts``, M_max = max(counts) + 1. C has ``n`` columns; W has 2n
    rows under a gated ``act``.
    """
    gen = torch.Generator().manual_seed(seed)
    ep = None if act is None else _epilogue(act, scheme)
    n_w = 2 * n if ep is not None and ep.activation.is_gated else n
    if layout == "standard":
        emap = None if expert_map is None else expert_map.to(DEVICE)
        e_l = e if expert_map is None else int((expert_map >= 0).sum())
        ids, tw = random_topk(t, e, k, gen, routing)
        ops = make_operands(scheme, t if gemm == "gemm1" else t * k, e_l, n_w, kd, gen)
        extra = dict(a_div=k if gemm == "gemm1" else 1, topk_weights=tw.to(DEVICE) if weighted else None)
        gemm_fn, ref_fn, rows = grouped_gemm, grouped_gemm_ref, (t * k,)

        def per_bm(m):
            return dict(routing=moe_align_ref(ids.to(DEVICE), e_l, m, expert_map=emap))
    else:
        e_l, m_max = len(counts), max(counts) + 1
        ops = make_operands(scheme, m_max, e_l, n_w, kd, gen, batch=(e_l,))
        cnt = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        rw = torch.rand(e_l, m_max, generator=gen).to(DEVICE) if weighted else None
        extra = dict(counts=cnt, row_weights=rw)
        gemm_fn, ref_fn, rows = grouped_gemm_batched, grouped_gemm_batched_ref, (e_l, m_max)

        def per_bm(m):
            return {}

    b = (torch.randn(e_l, n_w, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if bias else None
    kw = dict(bias=b, **extra)
    scale = None
    if ep is not None and ep.quant is not None:
        scale = _static_scale(ref_fn(ops.a, ops.w, **per_bm(bm), act=dataclasses.replace(ep, quant=None), **kw), ep)
    ref = ref_fn(ops.a, ops.w, **per_bm(bm), act=ep, act_scale=scale, **kw)
    tol = _tol(scheme, out_dtype) if ep is None else _act_tol(scheme, ep, out_dtype)

    outs = []
    for m in (bm, DOT_BM):
        c_dtype = out_dtype if ep is None else ep.out_dtype(out_dtype)
        out = poison_(torch.empty(*rows, n, dtype=c_dtype, device=DEVICE))
        poison = out.reshape(-1)[:1].clone()
        with override_launch_config(_cfg(m)):
            gemm_fn(ops.a, ops.w, **per_bm(m), out=out, act=ep, act_scale=scale, **kw)
        if ep is None:
            check(out, ref, tol)
        else:
            check_act(out, ref, ep, scale, poison, tol)
        outs.append(out)
    fma, dot = outs
    written = ~ref.isnan().all(dim=-1)
    if ep is None:
        got, want = fma[written].double(), dot[written].double()
    else:
        got, want = _values(fma[written], ep, scale), _values(dot[written], ep, scale)
    assert rel_error(got, want) <= tol, "the FMA and dot paths disagree"
    if ep is not None and ep.quant is not None:
        # codes: equal but where an ulp of fp32 moves a value across a rounding boundary
        assert (fma[written] != dot[written]).float().mean() <= 0.02, "FMA and dot codes differ too often"


def _kd(scheme: QuantScheme) -> int:
    """96 (a partial second K step) where the scheme's K groups divide it, else 128."""
    g = scheme.w1.granularity.group_size if scheme.w1 is not None else None
    return 128 if g and 96 % g else 96


# ---- every scheme, both layouts --------------------------------------------------------------

SCHEME_CASES = [
    pytest.param(s, layout, FMA_BMS[(i + 2 * j) % 4], id=f"{s.name}-{layout}-BM{FMA_BMS[(i + 2 * j) % 4]}")
    for i, s in enumerate(SCHEMES)
    for j, layout in enumerate(["standard", "batched"])
]


@needs_triton
@pytest.mark.parametrize("scheme,layout,bm", SCHEME_CASES)
def test_fma_scheme(scheme, layout, bm):
    """Standard layout alternates GEMM1 (a_div = K) and GEMM2 (a_div = 1) along the list."""
    gemm = "gemm1" if SCHEMES.index(scheme) % 2 == 0 else "gemm2"
    run(scheme, bm, layout=layout, kd=_kd(scheme), gemm=gemm)


# ---- labelled edge cases, every BM --------------------------------------------------------------

_EDGE = {c.label: c for c in EDGE_CASES + ODD_CASES}
EDGE_LABELS = ["T0", "T1", "T_lt_tile", "one_expert", "empty_expert", "odd_H_I"]
# a 4-bit or 8-bit scheme per BM; odd H and I need a format without K groups (bf16)
EDGE_SCHEMES = {1: "int4_g32", 2: "mxfp4", 4: "nvfp4", 8: "fp8_block"}


@needs_triton
@pytest.mark.parametrize("label", EDGE_LABELS)
@pytest.mark.parametrize("bm", FMA_BMS, ids=lambda b: f"BM{b}")
def test_fma_edge_cases(bm, label):
    """one_expert: every token's pair on expert 0, so blocks of 2..BM rows and a padded last
    block; T_lt_tile: a few rows per expert; empty_expert: the last expert gets none."""
    c = _EDGE[label]
    scheme = BY_NAME["bf16" if label == "odd_H_I" else EDGE_SCHEMES[bm]]
    run(scheme, bm, t=c.t, e=c.e, k=c.k, n=2 * c.i, kd=c.h, routing=c.routing)


@needs_triton
@pytest.mark.parametrize("counts", [(0, 0, 0), (1, 0, 0), (0, 9, 2)], ids=["T0", "T1", "padded"])
@pytest.mark.parametrize("bm", FMA_BMS, ids=lambda b: f"BM{b}")
def test_fma_batched_counts(bm, counts):
    """Batched layout: no rows, one row, and a slab of 9 (blocks of BM, a partial last one)."""
    run(BY_NAME["int4_g128_actorder"], bm, layout="batched", counts=counts, kd=128)


@needs_triton
def test_fma_expert_map():
    """Pairs of non-local experts are never written (their rows stay poisoned)."""
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32)
    run(BY_NAME["mxfp4_mxfp8"], 2, t=9, e=8, k=3, n=32, kd=64, expert_map=emap)


@needs_triton
@pytest.mark.parametrize("bm", [1, 4], ids=lambda b: f"BM{b}")
def test_fma_bf16_output(bm):
    """C in the model dtype: one rounding at the store, as on the dot path."""
    run(BY_NAME["int4_g128_zp"], bm, kd=128, out_dtype=torch.bfloat16)


# ---- the activation epilogue ---------------------------------------------------------------

# (BM, activation, epilogue scheme, router weight): every BM meets every gated activation;
# the schemes cover int4 act-order and zero points, mxfp4, int8 w8a16, and fp8/int8 static
# output quantization (OUT_QUANT); swigluoai and gelu are interleaved (``_epilogue``).
_GATED = [Activation.SILU, Activation.SWIGLUOAI, Activation.GELU]
_ACT_SCHEME_NAMES = list(ACT_SCHEMES)
ACT_CASES = [
    (bm, act, _ACT_SCHEME_NAMES[(i * len(_GATED) + j) % len(_ACT_SCHEME_NAMES)], (i + j) % 2 == 0)
    for i, bm in enumerate(FMA_BMS)
    for j, act in enumerate(_GATED)
] + [(1, Activation.RELU2_NO_MUL, "fp8_static", True), (4, Activation.SILU_NO_MUL, "int4_gptq", False)]


@needs_triton
@pytest.mark.parametrize("layout", ["standard", "batched"])
@pytest.mark.parametrize(
    "bm,act,scheme,weighted", ACT_CASES, ids=[f"BM{c[0]}-{c[1].value}-{c[2]}-w{int(c[3])}" for c in ACT_CASES]
)
def test_fma_act_epilogue(bm, act, scheme, weighted, layout):
    """Fused GEMM1 + activation: I = 24 is a partial BN = 16 tile, T*K = 18 pairs over 4 experts."""
    run(ACT_SCHEMES[scheme], bm, layout=layout, act=act, t=9, k=2, n=24, kd=64, weighted=weighted)


# ---- the layer on the FMA path ------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("layout", ["standard", "batched"])
@pytest.mark.parametrize("bm,scheme", [(1, "int4_gptq"), (4, "mxfp4")], ids=["BM1-int4_gptq", "BM4-mxfp4"])
def test_fma_layer_router_weight_on_input(bm, scheme, layout):
    """K = 1, the router weight applied to x before GEMM1; both GEMMs (and moe_align) take
    BM from the override: fused and unfused activation vs the float64 layer reference."""
    config = layer_config(Activation.SWIGLUOAI, k=1, apply_router_weight_on_input=True)
    with override_launch_config(_cfg(bm)):
        compare_layer(make_problem(config, ACT_SCHEMES[scheme], 9, seed=4), layout)


# ---- the path is the FMA one -----------------------------------------------------------------


@needs_triton
def test_fma_path_never_calls_dot(monkeypatch):
    """BM < 16 multiplies without tl.dot (w8a8 included); BM 16 does call it."""
    if not interpreting():
        pytest.skip("counts the interpreter's dot calls")

    def no_dot(*args, **kwargs):
        raise AssertionError("tl.dot called")

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", no_dot)
    for name in ("int8_w8a8_tensor", "fp8_block", "int4_g32"):
        _one_call(BY_NAME[name], 4)
    with pytest.raises(InterpreterError, match="tl.dot called"):
        _one_call(BY_NAME["bf16"], DOT_BM)


def _one_call(scheme: QuantScheme, bm: int) -> None:
    gen = torch.Generator().manual_seed(1)
    ids, _ = random_topk(3, 4, 2, gen)
    r = moe_align_ref(ids.to(DEVICE), 4, bm)
    ops = make_operands(scheme, 3, 4, 32, 64, gen)
    with override_launch_config(_cfg(bm)):
        grouped_gemm(ops.a, ops.w, r, a_div=2)


# ---- launch configs with BM < 16 ------------------------------------------------------------


def test_launch_config_small_block_m(monkeypatch):
    for bm in (1, 2, 4, 8, 16, 256):
        assert LaunchConfig(block_m=bm).block_m == bm
    for bad in (0, 3, 12, 24):
        with pytest.raises(ValueError, match="power of 2"):
            LaunchConfig(block_m=bad)
    with pytest.raises(ValueError):
        LaunchConfig(block_n=8)
    cfg = LaunchConfig.parse("1,64,256,1,4,3")
    assert cfg == LaunchConfig(1, 64, 256, 1, 4, 3) and eval(repr(cfg)) == cfg
    monkeypatch.setenv(ENV_VAR, "2,32,128,1,4,2")
    assert pick_launch_config(2, 8, 256, 256, "int4") == LaunchConfig(2, 32, 128, 1, 4, 2)
    assert pick_launch_config(2, 8, 256, 256, "int4", deterministic=True).block_m == 2
    monkeypatch.delenv(ENV_VAR)
    with override_launch_config(_cfg(8)):
        assert pick_launch_config(1, 8, 256, 256, "mxfp4", deterministic=True) == _cfg(8)
    assert fit_launch_config(LaunchConfig(1, 64, 256), 128) == LaunchConfig(1, 64, 128)
    assert fit_launch_config(LaunchConfig(4, 64, 128), 100, strict=False).block_m == 4
    assert gated_act_config(LaunchConfig(1, 64, 256)) == LaunchConfig(1, 32, 256)
    # the heuristic: the FMA path for 4-bit weights at <= 0.5 rows per expert (measured on an
    # H100), tl.dot tiles for everything else
    for m, e in ((1, 8), (2, 8), (8, 64), (1, 256), (16, 8), (64, 64)):
        for key in ("bf16", "fp8", "int4", "mxfp4", "nvfp4"):
            fma = key in ("int4", "mxfp4", "nvfp4") and m / e <= 0.5
            assert (default_launch_config(m, e, 4096, 2048, key).block_m < 16) == fma, (m, e, key)
    assert default_launch_config(1, 8, 20, 24, "int4") == LaunchConfig(1, 32, 32, 1, 4, 4)  # tiles fit tiny N, K


# ---- real shapes (GPU) ----------------------------------------------------------------------

REAL = [  # (E, H, I, T, K): Mixtral-8x7B-like decode at T = 1 and T = 8, Qwen3-30B-A3B-like T = 4
    (8, 4096, 1536, 1, 2),
    (8, 4096, 1536, 8, 2),
    (128, 2048, 768, 4, 8),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bm", FMA_BMS, ids=lambda b: f"BM{b}")
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL])
@pytest.mark.parametrize("scheme", ["bf16", "int4_g128", "int4_g128_actorder", "mxfp4", "nvfp4", "fp8_block"])
def test_fma_real_shapes(scheme, shape, bm):
    """GEMM1 with the fused silu and GEMM2, bf16 output, FMA vs reference and vs the dot path."""
    e, h, i, t, k = shape
    s = BY_NAME[scheme]
    act = Activation.SILU if ActEpilogue.supports(s.a2) else None
    run(s, bm, act=act, t=t, e=e, k=k, n=i, kd=h, out_dtype=torch.bfloat16)
    run(s, bm, t=t, e=e, k=k, n=h, kd=i, gemm="gemm2", out_dtype=torch.bfloat16)
