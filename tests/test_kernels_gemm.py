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

from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align, moe_align_ref
from fusedmoe.kernels.grouped_gemm import (
    GemmFormat,
    grouped_gemm,
    grouped_gemm_batched,
    grouped_gemm_batched_ref,
    grouped_gemm_ref,
    scheme_key,
)
from fusedmoe.kernels.launch_config import (
    ENV_VAR,
    LaunchConfig,
    default_launch_config,
    fit_launch_config,
    override_launch_config,
    pick_launch_config,
)
from fusedmoe.quant import (
    Granularity,
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
    a: torch.Tensor
    w: QTensor
    kw: dict  # w_quant, a_quant, a_scale, a_global_scale


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
    """Activations [*batch, m, kd] quantized as scheme.a1 and weights [e, n, kd] as scheme.w1."""
    x = torch.randn(*batch, m, kd, generator=gen).to(dtype)
    w = torch.randn(e, n, kd, generator=gen) * kd**-0.5
    if scheme.w1 is None:
        wq = QTensor(w.to(dtype), (e, n, kd))
    else:
        g_idx = random_g_idx(e, kd, scheme.w1.granularity.group_size) if scheme.w1.act_order else None
        wq = quantize(w, scheme.w1, g_idx=g_idx)
    kw = {"w_quant": scheme.w1}
    if scheme.a1 is None:
        a = x
    else:
        static = {}
        if scheme.a1.has_global_scale:  # static, as a checkpoint stores it (calibrated amax 4)
            static["global_scale"] = nvfp4_global_scale(torch.tensor(4.0)).reshape(1, 1)
        qa = quantize(x.float(), scheme.a1, **static)
        a = qa.data
        kw.update(a_quant=scheme.a1, a_scale=qa.scale, a_global_scale=qa.global_scale)
    dev = DEVICE
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return Operands(a.to(dev), wq.to(dev), kw)


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
    grouped_gemm(ops.a, ops.w, r, out=out, config=config, **ops.kw, **extra)
    ref = grouped_gemm_ref(ops.a, ops.w, r, **ops.kw, **extra)
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
    grouped_gemm(ops.a, ops.w, r, out=out, a_div=2, config=TINY, **ops.kw)
    check(out, grouped_gemm_ref(ops.a, ops.w, r, a_div=2, **ops.kw), 4e-3)


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


def run_batched(scheme, counts, m_max, n, kd, *, bias=True, weighted=True, out_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    ops = make_operands(scheme, m_max, e, n, kd, gen, batch=(e,))
    cnt = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    b = (torch.randn(e, n, generator=gen) * 0.1).to(DEVICE) if bias else None
    rw = torch.rand(e, m_max, generator=gen).to(DEVICE) if weighted else None
    out = poison_(torch.empty(e, m_max, n, dtype=out_dtype, device=DEVICE))
    grouped_gemm_batched(ops.a, ops.w, cnt, out=out, bias=b, row_weights=rw, config=TINY, **ops.kw)
    ref = grouped_gemm_batched_ref(ops.a, ops.w, cnt, bias=b, row_weights=rw, **ops.kw)
    check(out, ref, _tol(scheme, out_dtype))


@needs_triton
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_batched_scheme(scheme):
    """counts: a partial tile, an empty expert, a full slab (M_max = 20 is not a tile multiple)."""
    run_batched(scheme, [5, 0, 20], m_max=20, n=64, kd=128)


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
            # bf16 A and B tiles of every pipeline stage fit in an H100's 227 KiB of shared memory
            assert (c.block_m + c.block_n) * c.block_k * 2 * c.num_stages <= 227 * 1024


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
    grouped_gemm(ops.a, ops.w, r, out=out, a_div=2, topk_weights=tw, **ops.kw)
    check(out, grouped_gemm_ref(ops.a, ops.w, r, a_div=2, topk_weights=tw, **ops.kw), 1e-5)


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
