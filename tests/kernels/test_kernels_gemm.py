"""The fused grouped GEMM against its float64 reference, for every quant scheme.

Tiny shapes run under the Triton interpreter (a few tiles each); the same tests at
real shapes are marked ``gpu``. Outputs are poisoned with NaN first: rows of local
pairs must all be written, every other row must stay untouched.

Under the interpreter the dot runs in fp32 on exactly dequantized operands, so with
an fp32 output the kernel matches the float64 reference to ~1e-7; on a GPU the
operands meet the tensor cores in bf16/fp8/int8 and the scheme tolerance applies.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusedmoe.config import Activation, MoEConfig
from fusedmoe.env import LAUNCH_CONFIG as ENV_VAR
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.act_quant import act_and_quantize
from fusedmoe.kernels.align import moe_align, moe_align_ref
from fusedmoe.kernels.gemm_format import ActEpilogue, GemmFormat, scheme_key
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched, grouped_gemm_batched_ref, grouped_gemm_ref
from fusedmoe.kernels.launch_config import (
    LaunchConfig,
    default_launch_config,
    fit_launch_config,
    gated_act_config,
    override_launch_config,
    pick_launch_config,
)
from fusedmoe.quant import (
    Granularity,
    Operand,
    QDtype,
    QTensor,
    QuantScheme,
    TensorQuant,
    all_schemes,
    quantize,
)
from fusedmoe.quant.fp4 import nvfp4_global_scale
from fusedmoe.testing import EDGE_CASES, poison_, random_topk, rel_error, tolerance
from fusedmoe.weights import random_g_idx

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# 16-row tiles (the align block), one 64-wide N tile, two 64-deep K steps at Kd = 128.
TINY = LaunchConfig(block_m=16, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=2)


def _w8a8(dtype: QDtype, a_gran: Granularity, w_gran: Granularity, name: str) -> QuantScheme:
    a = TensorQuant(dtype, a_gran, dynamic=True)
    w = TensorQuant(dtype, w_gran)
    return QuantScheme(name=name, a1=a, w1=w, a2=a, w2=w)


# Beyond the named schemes: general blocks (bn != bk, bn < BN, bk > BK), int8 blocks at a
# tiny size, fp8 activations with MXFP4 weights (dequantized path with per-row scales),
# weight-only int8 blocks of 96 and 100 along K and channel-wise int4.
EXTRA_SCHEMES = [
    _w8a8(QDtype.FP8, Granularity.group(64), Granularity.block(16, 64), "fp8_block16x64"),
    _w8a8(QDtype.INT8, Granularity.group(32), Granularity.block(32, 32), "int8_block32x32"),
    _w8a8(QDtype.FP8, Granularity.token(), Granularity.group(32), "fp8_token_wgroup32"),
    QuantScheme(
        name="mxfp4_fp8_token",
        a1=TensorQuant(QDtype.FP8, Granularity.token(), dynamic=True),
        w1=QuantScheme.mxfp4_w4a16().w1,
        a2=TensorQuant(QDtype.FP8, Granularity.token(), dynamic=True),
        w2=QuantScheme.mxfp4_w4a16().w2,
    ),
]
for _w in (
    TensorQuant(QDtype.INT8, Granularity.block(32, 96)),  # BK shrinks to 32
    TensorQuant(QDtype.INT8, Granularity.block(32, 100)),  # groups straddle K steps: gathered
    TensorQuant(QDtype.INT4, Granularity.channel()),
):
    EXTRA_SCHEMES.append(QuantScheme(name=f"{_w.dtype.value}_w_only_{_w.granularity.short}", w1=_w, w2=_w))
SCHEMES = all_schemes() + EXTRA_SCHEMES
SCHEME_IDS = [s.name for s in SCHEMES]
BY_NAME = {s.name: s for s in SCHEMES}


@dataclasses.dataclass
class Operands:
    a: Operand  # activations quantized as scheme.a1 (or plain)
    w: Operand  # weights quantized as scheme.w1


def make_operands(
    scheme: QuantScheme,
    m: int,
    e: int,
    n: int,
    kd: int,
    gen: torch.Generator,
    dtype=torch.bfloat16,
    batch: tuple[int, ...] = (),
) -> Operands:
    """Activations [*batch, m, kd] quantized as scheme.a1 and weights [e, n, kd] as scheme.w1.

    On a GPU the weights are drawn and quantized there, 16 experts at a time (seeded from
    ``gen``): DeepSeek-V3's W13 is 7.5G values, ~30 s to draw on the host, 30 GB per fp32 copy."""
    x = torch.randn(*batch, m, kd, generator=gen).to(dtype)
    g_idx = None
    if scheme.w1 is not None and scheme.w1.act_order:
        g_idx = random_g_idx(e, kd, scheme.w1.granularity.group_size)
    chunk, wgen = max(e, 1), gen
    if DEVICE != "cpu":
        chunk, wgen = 16, torch.Generator(DEVICE).manual_seed(int(torch.randint(1 << 62, (1,), generator=gen)))
    parts = []
    for e0 in range(0, max(e, 1), chunk):
        w = torch.randn(min(chunk, e - e0), n, kd, generator=wgen, device=DEVICE) * kd**-0.5
        gi = None if g_idx is None else g_idx[e0 : e0 + w.shape[0]].to(DEVICE)
        parts.append(QTensor(w.to(dtype), tuple(w.shape)) if scheme.w1 is None else quantize(w, scheme.w1, g_idx=gi))
    wq = QTensor.cat(parts)
    if scheme.a1 is None:
        qa = QTensor(x, tuple(x.shape))
    else:
        static = {}
        if scheme.a1.has_global_scale:  # static, as a checkpoint stores it (calibrated amax 4)
            static["global_scale"] = nvfp4_global_scale(torch.tensor(4.0)).reshape(1, 1)
        qa = quantize(x.float(), scheme.a1, **static)
    return Operands(Operand(qa.to(DEVICE), scheme.a1), Operand(wq.to(DEVICE), scheme.w1))


def _tol(scheme: QuantScheme, out_dtype: torch.dtype) -> float:
    if interpreting() and out_dtype == torch.float32:
        return 1e-5
    return tolerance(scheme, torch.bfloat16 if out_dtype == torch.float32 else out_dtype)


def check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Rows the reference writes are finite in ``out``; the others are still poisoned."""
    written = ~ref.isnan()
    assert torch.equal(~out.isnan(), written), "unwritten or wrongly written elements"
    if written.any():
        err = rel_error(out[written], ref[written])
        assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def run_standard(
    scheme,
    t,
    e,
    k,
    n,
    kd,
    *,
    gemm="gemm1",
    routing="random",
    bias=True,
    weighted=True,
    out_dtype=torch.float32,
    expert_map=None,
    e_l=None,
    block_m=16,
    config=TINY,
    seed=0,
    use_kernel_align=False,
):
    gen = torch.Generator().manual_seed(seed)
    e_l = e_l or e
    ids, tw = random_topk(t, e, k, gen, routing)
    ids, tw = ids.to(DEVICE), tw.to(DEVICE)
    emap = None if expert_map is None else expert_map.to(DEVICE)
    align = moe_align if use_kernel_align else moe_align_ref
    r = align(ids, e_l, block_m, expert_map=emap)
    a_div = k if gemm == "gemm1" else 1
    ops = make_operands(scheme, t if gemm == "gemm1" else t * k, e_l, n, kd, gen)
    b = (torch.randn(e_l, n, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if bias else None
    extra = dict(bias=b, topk_weights=tw if weighted else None, a_div=a_div)
    out = poison_(torch.empty(t * k, n, dtype=out_dtype, device=DEVICE))
    grouped_gemm(ops.a, ops.w, r, out=out, config=config, **extra)
    ref = grouped_gemm_ref(ops.a, ops.w, r, **extra)
    check(out, ref, _tol(scheme, out_dtype))


# ---- every scheme, both GEMMs ------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_gemm_scheme(scheme, gemm):
    run_standard(scheme, t=8, e=4, k=2, n=64, kd=128, gemm=gemm)


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int8_w8a8_channel", "int4_g64_zp", "nvfp4"])
def test_gemm_bf16_output(scheme):
    """C in the model dtype: the store rounds once, within the scheme's tolerance."""
    run_standard(BY_NAME[scheme], t=8, e=4, k=2, n=64, kd=128, out_dtype=torch.bfloat16)


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block16x64", "int8_w8a8_tensor"])
def test_gemm_ragged_tiles(scheme):
    """N and Kd not multiples of the tile (nor of fp8/int8 blocks and groups)."""
    run_standard(BY_NAME[scheme], t=7, e=5, k=2, n=40, kd=80)


@needs_triton
@pytest.mark.parametrize("bias,weighted", [(False, False), (True, False), (False, True)])
def test_gemm_bias_and_router_weight(bias, weighted):
    run_standard(BY_NAME["fp8_channel"], t=6, e=3, k=2, n=64, kd=64, bias=bias, weighted=weighted)


@needs_triton
def test_gemm_fp16_activations():
    gen = torch.Generator().manual_seed(5)
    ids, tw = random_topk(6, 4, 2, gen)
    r = moe_align_ref(ids.to(DEVICE), 4, 16)
    ops = make_operands(QuantScheme.unquantized(), 6, 4, 32, 64, gen, dtype=torch.float16)
    out = poison_(torch.empty(12, 32, dtype=torch.float16, device=DEVICE))
    grouped_gemm(ops.a, ops.w, r, out=out, a_div=2, config=TINY)
    check(out, grouped_gemm_ref(ops.a, ops.w, r, a_div=2), 4e-3)


# ---- labelled edge cases -----------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int4_g32", "nvfp4"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_gemm_edge_cases(case, scheme):
    run_standard(BY_NAME[scheme], case.t, case.e, case.k, n=2 * case.i, kd=case.h, routing=case.routing)


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_channel", "mxfp4"])
def test_gemm_expert_map(scheme):
    """Pairs of non-local experts are never written (their rows stay poisoned)."""
    scheme = BY_NAME[scheme]
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32)
    run_standard(scheme, t=9, e=8, k=3, n=64, kd=64, expert_map=emap, e_l=4)


@needs_triton
def test_gemm_with_kernel_alignment():
    run_standard(BY_NAME["fp8_block"], t=11, e=6, k=3, n=64, kd=128, use_kernel_align=True, seed=7)


# ---- batched layout ----------------------------------------------------------------


def run_batched(
    scheme, counts, m_max, n, kd, *, bias=True, weighted=True, out_dtype=torch.float32, seed=0, strided=False
):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    ops = make_operands(scheme, m_max, e, n, kd, gen, batch=(e,))
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    if strided:  # a column of a [E, 3] table, as the low-latency dispatcher's running counts give
        cnt = torch.stack([cnt + 7, cnt, cnt - 7], dim=1)[:, 1]
    b = (torch.randn(e, n, generator=gen) * 0.1).to(DEVICE) if bias else None
    rw = torch.rand(e, m_max, generator=gen).to(DEVICE) if weighted else None
    out = poison_(torch.empty(e, m_max, n, dtype=out_dtype, device=DEVICE))
    grouped_gemm_batched(ops.a, ops.w, cnt, out=out, bias=b, row_weights=rw, config=TINY)
    ref = grouped_gemm_batched_ref(ops.a, ops.w, cnt, bias=b, row_weights=rw)
    check(out, ref, _tol(scheme, out_dtype))


@needs_triton
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_batched_scheme(scheme):
    """counts: a partial tile, an empty expert, a full slab (M_max = 20 is not a tile multiple)."""
    run_batched(scheme, [5, 0, 20], m_max=20, n=64, kd=128)


@needs_triton
def test_batched_counts_may_be_a_strided_view():
    """The EP low-latency dispatcher handed a [E] column view of a [E, N] table: the kernel read
    counts[e] at counts + e (4-GPU NCCL check, unwritten rows); the launcher makes it contiguous."""
    run_batched(QuantScheme.by_name("bf16"), [5, 0, 20], m_max=20, n=64, kd=128, strided=True)


# ---- launch configs ----------------------------------------------------------------


def test_launch_config_parse_and_env(monkeypatch):
    cfg = LaunchConfig.parse("64,128,64,8,4,3")
    assert cfg == LaunchConfig(64, 128, 64, 8, 4, 3)
    assert eval(repr(cfg)) == cfg
    monkeypatch.setenv(ENV_VAR, "32,64,32,1,4,2")
    assert pick_launch_config(100, 8, 256, 256, "bf16") == LaunchConfig(32, 64, 32, 1, 4, 2)
    with override_launch_config(TINY):
        assert pick_launch_config(100, 8, 256, 256, "bf16") == TINY
    monkeypatch.delenv(ENV_VAR)
    assert pick_launch_config(100, 8, 256, 256, "bf16") == default_launch_config(100, 8, 256, 256, "bf16")
    with pytest.raises(ValueError):
        LaunchConfig.parse("64,128,64")
    with pytest.raises(ValueError):
        LaunchConfig(block_m=24)


def test_launch_config_fit_and_keys():
    cfg = LaunchConfig(64, 128, 128, 8, 4, 3)
    assert fit_launch_config(cfg, 64).block_k == 64
    assert fit_launch_config(cfg, None) == cfg
    assert fit_launch_config(cfg, 96, strict=False).block_k == 32  # weight-only groups of 96
    assert fit_launch_config(cfg, 100, strict=False) == LaunchConfig(64, 128, 64, 8, 4, 2)
    with pytest.raises(ValueError):
        fit_launch_config(cfg, 100)
    fmt = GemmFormat.of(QuantScheme.fp8_block(128, 64).w1, QuantScheme.fp8_block(128, 64).a1, 256, 256)
    assert fmt.native and fmt.k_group == 64 and (fmt.w_bn, fmt.w_bk) == (128, 64)
    assert scheme_key(None, None) == "bf16"
    assert scheme_key(QuantScheme.fp8_block().w1, QuantScheme.fp8_block().a1) == "fp8_block"
    assert scheme_key(QuantScheme.int8_w8a16().w1, None) == "w8a16"
    for m, e in ((1, 8), (512 * 8, 64), (4096 * 8, 8)):
        for key in ("bf16", "fp8", "int4", "nvfp4"):
            c = default_launch_config(m, e, 4096, 2048, key)
            # the A and B tiles of every pipeline stage fit in an H100's 227 KiB of shared memory
            # (bf16, or a dequantized bf16 W tile; the persistent kernel keeps fp8 tiles as bytes)
            size = 1 if c.persistent and key.startswith("fp8") else 2
            assert (c.block_m + c.block_n) * c.block_k * size * c.num_stages <= 227 * 1024


def test_cpu_path_is_ref(monkeypatch):
    """Without a GPU or the interpreter the public op computes the reference in fp32."""
    if DEVICE != "cpu":
        pytest.skip("tests the CPU path")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(6)
    ids, tw = random_topk(5, 4, 2, gen)
    r = moe_align_ref(ids, 4, 16)
    ops = make_operands(BY_NAME["int4_g32"], 5, 4, 32, 64, gen)
    out = poison_(torch.empty(10, 32))
    grouped_gemm(ops.a, ops.w, r, out=out, a_div=2, topk_weights=tw)
    check(out, grouped_gemm_ref(ops.a, ops.w, r, a_div=2, topk_weights=tw), 1e-5)


# ---- real shapes (GPU) ---------------------------------------------------------------

REAL = [  # (E, H, I, T, K)
    (8, 4096, 1536, 1, 2),
    (64, 2048, 768, 512, 8),
    (8, 2048, 1536, 37, 2),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL])
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_gemm_real_shapes(scheme, shape, gemm):
    e, h, i, t, k = shape
    n, kd = (2 * i, h) if gemm == "gemm1" else (h, i)
    run_standard(scheme, t, e, k, n=n, kd=kd, gemm=gemm, out_dtype=torch.bfloat16, config=None, block_m=_bm(t, k, e))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_batched_real_shapes(scheme):
    run_batched(scheme, [0, 1, 17, 64, 128, 3, 0, 100], m_max=128, n=2048, kd=1536, out_dtype=torch.bfloat16)


def _bm(t, k, e):
    return default_launch_config(t * k, e, 1, 1, "bf16").block_m


# ---- GEMM1 with the activation in its epilogue ----------------------------------------
#
# The fused kernel (act=ActEpilogue) against the float64 reference and against the unfused
# path (GEMM1 into an fp32 h, then act_and_quantize): under the interpreter both compute the
# same fp32 values, so they agree to ~1e-7 (quantized outputs: up to a code step where an
# ulp moves a value across a rounding boundary).

# Weight formats whose a2 the epilogue can produce; "int8_static" (a static per-tensor int8
# a2) is no named scheme, the epilogue supports it all the same.
_INT8_STATIC = TensorQuant(QDtype.INT8, Granularity.tensor())
ACT_SCHEMES = {
    "bf16": QuantScheme.unquantized(),
    "int4_gptq": QuantScheme.int4_w4a16(32, act_order=True),
    "int4_awq": QuantScheme.int4_w4a16(32, zero_points=True),
    "mxfp4": QuantScheme.mxfp4_w4a16(),
    "fp8_static": QuantScheme.fp8_per_tensor(static_activations=True),
    "int8_w8a16": QuantScheme.int8_w8a16(),
    "int8_static": QuantScheme(
        name="int8_static",
        a1=_INT8_STATIC,
        w1=TensorQuant(QDtype.INT8, Granularity.channel()),
        a2=_INT8_STATIC,
        w2=TensorQuant(QDtype.INT8, Granularity.channel()),
    ),  # fmt: skip
}
ACTS = list(Activation)
_QMAX = {QDtype.FP8: 448.0, QDtype.INT8: 127.0}


def _epilogue(act: Activation, scheme: QuantScheme) -> ActEpilogue:
    # interleaved gate/up for two activations; a swigluoai limit that clamps unit-size values
    return ActEpilogue(
        act, gate_up_interleaved=act in (Activation.SWIGLUOAI, Activation.GELU), swiglu_limit=1.0, quant=scheme.a2
    )


def _moe_config(ep: ActEpilogue, e: int, k: int, h: int, i: int, dtype) -> MoEConfig:
    return MoEConfig(
        e, k, h, i, activation=ep.activation, gate_up_interleaved=ep.gate_up_interleaved,
        swiglu_alpha=ep.swiglu_alpha, swiglu_limit=ep.swiglu_limit, dtype=dtype,
    )  # fmt: skip


def _values(out: torch.Tensor, ep: ActEpilogue, scale) -> torch.Tensor:
    """C as real numbers (codes times the static scale); NaN where C was poisoned and kept."""
    if ep.quant is None:
        return out.double()
    return out.double() * scale.double()


def check_act(out, ref, ep, scale, poison, tol) -> None:
    """``check`` on C's values; int8 codes have no NaN, so unwritten rows must still hold
    the poison code and written ones are compared."""
    if ep.quant is None or ep.quant.dtype is QDtype.FP8:
        check(_values(out, ep, scale), ref, tol)
        return
    written = ~ref.isnan().all(dim=-1)
    assert torch.all(out[~written] == poison), "rows of no local pair were written"
    assert rel_error(_values(out[written], ep, scale), ref[written]) <= tol


def _static_scale(ref_unq: torch.Tensor, ep: ActEpilogue) -> torch.Tensor | None:
    """A checkpoint-like static scale that saturates the largest ~10% of |C|."""
    if ep.quant is None:
        return None
    amax = ref_unq[~ref_unq.isnan()].abs().max().float()
    return (0.8 * amax / _QMAX[ep.quant.dtype]).reshape(1, 1).to(DEVICE)


def _act_tol(scheme, ep, out_dtype) -> float:
    if ep.quant is not None:
        return tolerance(scheme, torch.bfloat16)  # the code steps of a2; flips cost 4e-2 of a value
    return _tol(scheme, out_dtype)


def run_act(scheme, act, *, batched=False, weighted=False, out_dtype=torch.float32, t=9, i=48, h=64, seed=0):
    """Fused GEMM1 + activation vs the reference (and, unweighted, vs the unfused path).

    Standard: E 8 of which 4 are local (expert map), K 3, T*K not a multiple of the tile.
    Batched: counts of a partial tile, an empty expert and a full slab of M_max = 20.
    I = 48: a partial BN tile, and gate/up columns that straddle tiles in the split layout.
    """
    gen = torch.Generator().manual_seed(seed)
    ep = _epilogue(act, scheme)
    n_w = 2 * i if act.is_gated else i
    cfg = gated_act_config(TINY) if act.is_gated else TINY
    if batched:
        counts = [5, 0, 20]
        e_l = len(counts)
        ops = make_operands(scheme, 20, e_l, n_w, h, gen, batch=(e_l,))
        cnt = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
        rw = torch.rand(e_l, 20, generator=gen).to(DEVICE) if weighted else None
        extra = dict(counts=cnt, row_weights=rw)
        gemm, gemm_ref, rows = grouped_gemm_batched, grouped_gemm_batched_ref, (e_l, 20)
    else:
        k, e, e_l = 3, 8, 4
        emap = torch.tensor([-1, 0, -1, 1, 2, -1, -1, 3], dtype=torch.int32, device=DEVICE)
        ids, tw = random_topk(t, e, k, gen)
        r = moe_align_ref(ids.to(DEVICE), e_l, 16, expert_map=emap)
        ops = make_operands(scheme, t, e_l, n_w, h, gen)
        extra = dict(routing=r, a_div=k, topk_weights=tw.to(DEVICE) if weighted else None)
        gemm, gemm_ref, rows = grouped_gemm, grouped_gemm_ref, (t * k,)
    bias = (torch.randn(e_l, n_w, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    plain = dataclasses.replace(ep, quant=None)
    scale = _static_scale(gemm_ref(ops.a, ops.w, bias=bias, act=plain, **extra), ep)
    ref = gemm_ref(ops.a, ops.w, bias=bias, act=ep, act_scale=scale, **extra)

    c_dtype = ep.out_dtype(out_dtype)
    out = poison_(torch.empty(*rows, i, dtype=c_dtype, device=DEVICE))
    poison = out.reshape(-1)[0].clone()
    gemm(ops.a, ops.w, bias=bias, act=ep, act_scale=scale, out=out, config=cfg, **extra)
    check_act(out, ref, ep, scale, poison, _act_tol(scheme, ep, out_dtype))
    if weighted:
        return
    # the unfused path: GEMM1 into h (fp32), then the activation kernel
    h_out = poison_(torch.empty(*rows, n_w, device=DEVICE))
    gemm(ops.a, ops.w, bias=bias, out=h_out, config=TINY, **extra)
    written = ~h_out.isnan().all(dim=-1)
    moe = _moe_config(ep, 8, 3, h, i, out_dtype)
    a2 = act_and_quantize(h_out.nan_to_num(0.0).reshape(-1, n_w), moe, ep.quant, scale=scale)
    a2 = (a2.data if ep.quant is not None else a2).reshape(*rows, i)
    got, want = _values(out[written], ep, scale), _values(a2[written], ep, scale)
    same = 1e-5 if interpreting() and ep.quant is None else _act_tol(scheme, ep, out_dtype)
    if ep.quant is not None:
        # codes: identical but where an ulp of fp32 moves a value across a rounding boundary
        assert (got != want).float().mean() <= 0.02, "fused and unfused codes differ too often"
    assert rel_error(got, want) <= same


@needs_triton
@pytest.mark.parametrize("batched", [False, True], ids=["standard", "batched"])
@pytest.mark.parametrize("act", ACTS, ids=[a.value for a in ACTS])
@pytest.mark.parametrize("scheme", list(ACT_SCHEMES), ids=list(ACT_SCHEMES))
def test_gemm1_act_epilogue(scheme, act, batched):
    run_act(ACT_SCHEMES[scheme], act, batched=batched)


@needs_triton
@pytest.mark.parametrize("batched", [False, True], ids=["standard", "batched"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_static", "int8_static"])
def test_gemm1_act_epilogue_router_weight(scheme, batched):
    """The router weight multiplies the activation's output (before a static quantization)."""
    run_act(ACT_SCHEMES[scheme], Activation.SWIGLUOAI, batched=batched, weighted=True)


@needs_triton
@pytest.mark.parametrize("act", [Activation.SILU, Activation.RELU2_NO_MUL], ids=lambda a: a.value)
def test_gemm1_act_epilogue_bf16_output(act):
    """C in the model dtype: one rounding, after the activation."""
    run_act(ACT_SCHEMES["bf16"], act, out_dtype=torch.bfloat16)


@needs_triton
def test_gemm1_act_epilogue_default_config():
    """config=None: GEMM1's picked config with BN halved; T=1 and T=0."""
    scheme = ACT_SCHEMES["mxfp4"]
    gen = torch.Generator().manual_seed(3)
    ep = _epilogue(Activation.SILU, scheme)
    for t in (1, 0):
        ids, _ = random_topk(t, 4, 2, gen)
        r = moe_align_ref(ids.to(DEVICE), 4, 16)
        ops = make_operands(scheme, t, 4, 64, 64, gen)
        out = poison_(torch.empty(t * 2, 32, device=DEVICE))
        grouped_gemm(ops.a, ops.w, r, a_div=2, act=ep, out=out)
        check(out, grouped_gemm_ref(ops.a, ops.w, r, a_div=2, act=ep), _tol(scheme, torch.float32))


def test_act_epilogue_contract():
    """What the epilogue accepts: a2 unquantized or static per-tensor fp8/int8."""
    assert ActEpilogue.supports(None)
    assert ActEpilogue.supports(QuantScheme.fp8_per_tensor(static_activations=True).a2)
    assert ActEpilogue.supports(_INT8_STATIC)
    for name in ("fp8_tensor", "fp8_token", "fp8_block", "int8_w8a8_channel", "mxfp4_mxfp8", "nvfp4"):
        assert not ActEpilogue.supports(QuantScheme.by_name(name).a2), name
    with pytest.raises(ValueError):
        ActEpilogue(Activation.SILU, quant=QuantScheme.fp8_per_token().a2)
    ep = ActEpilogue("swigluoai", gate_up_interleaved=True)
    assert ep.activation is Activation.SWIGLUOAI and ep.out_cols(96) == 48
    assert ActEpilogue(Activation.GELU_NO_MUL).out_cols(48) == 48
    assert eval(repr(ep)) == ep
    assert gated_act_config(LaunchConfig(16, 64, 64)).block_n == 32
    assert gated_act_config(LaunchConfig(16, 16, 64)).block_n == 16


def test_act_epilogue_cpu_path(monkeypatch):
    """Without a GPU or the interpreter the fused op is the reference (codes quantized)."""
    if DEVICE != "cpu":
        pytest.skip("tests the CPU path")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(8)
    scheme = ACT_SCHEMES["fp8_static"]
    ep = _epilogue(Activation.SILU, scheme)
    ids, _ = random_topk(5, 4, 2, gen)
    r = moe_align_ref(ids, 4, 16)
    ops = make_operands(scheme, 5, 4, 64, 64, gen)
    scale = torch.full((1, 1), 0.01)
    out = poison_(torch.empty(10, 32, dtype=torch.float8_e4m3fn))
    grouped_gemm(ops.a, ops.w, r, a_div=2, act=ep, act_scale=scale, out=out)
    ref = grouped_gemm_ref(ops.a, ops.w, r, a_div=2, act=ep, act_scale=scale)
    check(_values(out, ep, scale), ref, 1e-6)


REAL_ACT = [  # (E, H, I, T, K): DeepSeek-V3 and Qwen3-30B-A3B decode, a prefill-sized batch
    (256, 7168, 2048, 1, 8),
    (128, 2048, 768, 1, 8),
    (128, 2048, 768, 256, 8),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("act", [Activation.SILU, Activation.SWIGLUOAI], ids=lambda a: a.value)
@pytest.mark.parametrize("shape", REAL_ACT, ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL_ACT])
@pytest.mark.parametrize("scheme", ["bf16", "int4_gptq", "mxfp4", "fp8_static"])
def test_gemm1_act_epilogue_real_shapes(scheme, shape, act):
    """Fused vs unfused GEMM1 + activation at real shapes, bf16 output (the unfused path
    rounds h to bf16 first), both against the float64 reference."""
    e, h, i, t, k = shape
    scheme = ACT_SCHEMES[scheme]
    gen = torch.Generator().manual_seed(1)
    ep = _epilogue(act, scheme)
    ids, _ = random_topk(t, e, k, gen)
    r = moe_align(ids.to(DEVICE), e, _bm(t, k, e))
    ops = make_operands(scheme, t, e, 2 * i, h, gen)
    bias = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE)
    kw = dict(bias=bias, a_div=k)
    plain = dataclasses.replace(ep, quant=None)
    scale = _static_scale(grouped_gemm_ref(ops.a, ops.w, r, act=plain, **kw), ep)
    ref = grouped_gemm_ref(ops.a, ops.w, r, act=ep, act_scale=scale, **kw)
    out = poison_(torch.empty(t * k, i, dtype=ep.out_dtype(torch.bfloat16), device=DEVICE))
    grouped_gemm(ops.a, ops.w, r, act=ep, act_scale=scale, out=out, out_dtype=out.dtype, **kw)
    tol = _act_tol(scheme, ep, torch.bfloat16)
    check(_values(out, ep, scale), ref, tol)
    hb = grouped_gemm(ops.a, ops.w, r, out_dtype=torch.bfloat16, **kw)
    a2 = act_and_quantize(hb, _moe_config(ep, e, k, h, i, torch.bfloat16), ep.quant, scale=scale)
    unfused = _values(a2.data if ep.quant is not None else a2, ep, scale)
    check(unfused, ref, tol)
    assert rel_error(_values(out, ep, scale), unfused) <= tol
