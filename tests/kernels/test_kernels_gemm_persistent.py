"""The persistent TMA-fed grouped GEMM against the float64 reference, for every format it serves.

Operands, reference, poison check and tolerances are ``test_kernels_gemm.py``'s: outputs are
poisoned with NaN (int8 codes with a sentinel) first, every row of a local pair must be
written and every other row (and slot) must stay untouched. Under the interpreter the dot
runs in fp32 on exactly dequantized operands, so an fp32 C matches the reference to ~1e-7.

Cases, sized for the interpreter (~5 ms per tile and K step, and the persistent grid runs
3 programs there, so tiles wrap around unevenly):

* every served scheme, GEMM1 and GEMM2 shapes (two N tiles, two K steps);
* the labelled edge cases (T = 0, T = 1, T below a tile, K = 1, K = E, prime E, an expert
  with no token, all rows on one expert, T*K not a multiple of BM) in bf16 and fp8-block;
  odd N; K not a multiple of BK; odd K is refused (TMA rows must be 16-byte aligned);
* the fused activation epilogue: every activation, split and interleaved gate/up, bias,
  router weight, C in fp32 / bf16 / static fp8 / static int8 codes / dynamic fp8 1 x g
  groups (codes and scales bit for bit against ``fusedmoe.quant.quantize`` of the kernel's
  own fp32 output);
* slot-ordered A (with NaN and garbage in the padding slots) and C; the batched layout
  with and without a descriptor for A; an expert map (non-local pairs untouched);
* the config knobs (flatten, epilogue subtile, GROUP_M, BM 32); warp_specialize declined;
* ``supports``' refusals, and ``grouped_gemm`` dispatching here (or to the old kernel)
  when the launch config says ``persistent``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels_gemm import BY_NAME, DEVICE, HAS_CUDA, _static_scale, _tol, check, check_act, make_operands

from fusedmoe.config import Activation
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align_ref
from fusedmoe.kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat, block_uniform
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched_ref, grouped_gemm_launch, grouped_gemm_ref
from fusedmoe.kernels.grouped_gemm_persistent import GroupQuantEpilogue, halves, persistent_gemm_launch, supports
from fusedmoe.kernels.launch_config import LaunchConfig, fit_launch_config
from fusedmoe.quant import Granularity, Operand, QDtype, QTensor, QuantScheme, TensorQuant, fake_quantize, quantize
from fusedmoe.testing import EDGE_CASES, poison_, random_topk

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")

# 16-row tiles (the align block), 32-wide N tiles, 64-deep K steps, 2 row blocks per group.
CFG = LaunchConfig(16, 32, 64, 2, 4, 2, persistent=True)

SERVED = [
    "bf16",
    "fp8_tensor",
    "fp8_token",
    "fp8_channel",
    "fp8_block",
    "fp8_block64x64",
    "fp8_block16x64",
    "fp8_token_wgroup32",
    "int8_w8a8_tensor",
    "int8_w8a8_channel",
    "int8_w8a8_block",
    "int8_block32x32",
    "int8_w8a16",
]
_FP8_W = TensorQuant(QDtype.FP8, Granularity.channel())
_FP8_W_ONLY = QuantScheme(name="fp8_w_only", w1=_FP8_W, w2=_FP8_W)
SCHEMES = {**{s: BY_NAME[s] for s in SERVED}, "fp8_w_only": _FP8_W_ONLY}
_G128 = TensorQuant(QDtype.FP8, Granularity.group(128), dynamic=True)
_G64 = TensorQuant(QDtype.FP8, Granularity.group(64), dynamic=True)
_INT8_STATIC = TensorQuant(QDtype.INT8, Granularity.tensor())
_FP8_STATIC = QuantScheme.fp8_per_tensor(static_activations=True).a2


@dataclasses.dataclass
class Run:
    """One problem: ``gemm`` 'gemm1' (A = x, a_div = K) or 'gemm2' (A per pair); ``counts``
    for the batched layout (then t, k, routing are unused); ``act`` with ``act.quant``."""

    scheme: QuantScheme
    t: int = 9
    e: int = 4
    k: int = 2
    n: int = 64  # W rows (2I under a gated act)
    kd: int = 128
    gemm: str = "gemm2"
    routing: str = "random"
    counts: tuple[int, ...] | None = None
    act: ActEpilogue | None = None
    a_sorted: bool = False
    c_sorted: bool = False
    bias: bool = True
    weighted: bool = True
    out_dtype: torch.dtype = torch.float32
    expert_map: tuple[int, ...] | None = None
    cfg: LaunchConfig = CFG
    dtype: torch.dtype = torch.bfloat16  # the model dtype (activations; float weights)
    seed: int = 0


def _garbage(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """What an unwritten padding slot may hold: NaN (floats; 0x7F is e4m3's NaN), any int8."""
    if like.dtype == torch.int8:
        return torch.randint(-128, 128, like.shape, generator=gen, dtype=torch.int8).to(like.device)
    return torch.full_like(like, float("nan"))


def _by_slot(x: torch.Tensor | None, src_rows: torch.Tensor, real: torch.Tensor, gen) -> torch.Tensor | None:
    """Rows ``src_rows`` of ``x`` in slot order, garbage in the padding slots; per-tensor scales as they are."""
    if x is None or x.shape[0] == 1:
        return x
    out = _garbage(x.new_empty(real.numel(), *x.shape[1:]), gen)
    out[real] = x[src_rows[real]]
    return out


def _ref_by_slot(ref: torch.Tensor, r, real: torch.Tensor) -> torch.Tensor:
    out = torch.full((r.sorted_ids.numel(), ref.shape[1]), float("nan"), dtype=ref.dtype, device=ref.device)
    out[real] = ref[r.sorted_ids.long()[real]]
    return out


def _group_ref(ref: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """Written rows of ``ref`` as the values of their dynamic group codes."""
    written = ~ref.isnan().all(dim=-1)
    out = ref.clone()
    out[written] = fake_quantize(ref[written], tq)
    return out


def _operand(data: torch.Tensor, scale: torch.Tensor | None, like: Operand) -> Operand:
    """``like``'s operand with other stored rows (a slot-ordered or sliced copy of its data)."""
    return Operand(
        QTensor(data, (*data.shape[:-1], like.shape[-1]), scale=scale, global_scale=like.global_scale), like.quant
    )


def run(p: Run) -> None:
    """Launch the persistent kernel on ``p`` and check it against the float64 reference."""
    gen = torch.Generator().manual_seed(p.seed)
    sch, ep = p.scheme, p.act
    batched = p.counts is not None
    e_l = p.e if p.expert_map is None else sum(x >= 0 for x in p.expert_map)
    if batched:
        e_l, m_max = len(p.counts), 20
        ops = make_operands(sch, m_max, e_l, p.n, p.kd, gen, p.dtype, batch=(e_l,))
    else:
        ids, tw = random_topk(p.t, p.e, p.k, gen, p.routing)
        emap = None if p.expert_map is None else torch.tensor(p.expert_map, dtype=torch.int32, device=DEVICE)
        r = moe_align_ref(ids.to(DEVICE), e_l, p.cfg.block_m, expert_map=emap)
        a_div = p.k if p.gemm == "gemm1" else 1
        ops = make_operands(sch, p.t if p.gemm == "gemm1" else p.t * p.k, e_l, p.n, p.kd, gen, p.dtype)
    fmt = GemmFormat.of(ops.w.quant, ops.a.quant, p.n, p.kd)
    cfg = fit_launch_config(p.cfg, fmt.k_group, strict=fmt.native)
    bias = (torch.randn(e_l, p.n, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if p.bias else None
    if batched:
        cnt = torch.tensor(p.counts, dtype=torch.int32, device=DEVICE)
        rw = torch.rand(e_l, m_max, generator=gen).to(DEVICE) if p.weighted else None
        layout = dict(counts=cnt)
        ref_kw = dict(bias=bias, row_weights=rw)

        def ref_fn(act, scale=None):
            return grouped_gemm_batched_ref(ops.a, ops.w, cnt, act=act, act_scale=scale, **ref_kw)

    else:
        rw = tw.reshape(-1).float().to(DEVICE) if p.weighted else None
        layout = dict(routing=r, a_div=a_div)
        ref_kw = dict(bias=bias, topk_weights=rw, a_div=a_div)

        def ref_fn(act, scale=None):
            return grouped_gemm_ref(ops.a, ops.w, r, act=act, act_scale=scale, **ref_kw)

    # the activation's output: plain, static per-tensor codes, or dynamic group codes
    plain = None if ep is None else dataclasses.replace(ep, quant=None)
    ref = ref_fn(plain)
    group = ep is not None and ep.quant is not None and ep.quant.granularity.kind == "group"
    scale = None
    if ep is not None and ep.quant is not None and not group:
        scale = _static_scale(ref, ep)
        ref = ref_fn(ep, scale)
    elif group:
        ref = _group_ref(ref, ep.quant)
    a, a_scale = ops.a.data, ops.a.scale
    if p.a_sorted or p.c_sorted:
        slots = r.sorted_ids.long()
        real = slots < r.num_pairs
        real &= r.block_expert.long().repeat_interleave(r.block_m) >= 0
        if p.a_sorted:
            a, a_scale = _by_slot(a, slots // a_div, real, gen), _by_slot(a_scale, slots // a_div, real, gen)
        if p.c_sorted:
            ref = _ref_by_slot(ref, r, real)
    c_dtype = p.out_dtype if ep is None else ep.out_dtype(p.out_dtype)
    out = poison_(torch.empty(*ref.shape, dtype=c_dtype, device=DEVICE))
    poison = out.reshape(-1)[:1].clone()  # int8 codes: the sentinel (no NaN)
    out_scale = None
    if group:
        g = ep.quant.granularity.group_size
        out_scale = poison_(torch.empty(*ref.shape[:-1], -(-ref.shape[-1] // g), device=DEVICE))
        scale = out_scale
    call = GemmCall(bias=bias, route_weights=rw, act=ep, act_scale=scale, **layout)
    launch = persistent_gemm_launch if cfg.persistent else grouped_gemm_launch  # (the plain kernel: W_UNIFORM)
    launch(_operand(a, a_scale, ops.a), ops.w, out, fmt, cfg, call)
    if group:
        g = ep.quant.granularity.group_size
        written = ~ref.isnan().all(dim=-1)
        assert torch.equal(~out_scale.isnan().any(dim=-1), written), "group scales of unwritten rows"
        values = out.double() * out_scale.double().repeat_interleave(g, dim=-1)[..., : ref.shape[-1]]
        check(values, ref, 0.08)  # a code step of e4m3 is up to 1/8 of a value; flips are rare
    elif ep is not None and ep.quant is not None:
        check_act(out, ref, ep, scale, poison, 0.08)
    else:
        check(out, ref, _tol(sch, p.out_dtype))


# ---- every served scheme, both GEMMs -------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("gemm", ["gemm1", "gemm1_silu", "gemm2"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme(scheme, gemm):
    """GEMM1 (A = x, a_div = K) plain and with silu fused (I = 32), GEMM2 (A per pair)."""
    act = _ep(Activation.SILU, False) if gemm == "gemm1_silu" else None
    run(Run(SCHEMES[scheme], gemm=gemm[:5], act=act))


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.label for c in EDGE_CASES])
def test_edge_cases(case, scheme):
    run(Run(SCHEMES[scheme], case.t, case.e, case.k, n=2 * case.i, kd=case.h, routing=case.routing))


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "int8_w8a8_channel", "fp8_block16x64"])
def test_ragged_n_and_k(scheme):
    """N = 71 (odd) and Kd = 80: a partial N tile and a partial K step (Kd 16-byte aligned)."""
    run(Run(SCHEMES[scheme], t=7, e=5, n=71, kd=80))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_model_dtype_output(dtype):
    """A, W and C in bf16 or fp16: the store rounds once, within the dtype's tolerance."""
    run(Run(SCHEMES["bf16"], dtype=dtype, out_dtype=dtype))


@needs_triton
def test_expert_map():
    """Pairs of non-local experts are never written (their rows stay poisoned)."""
    run(Run(SCHEMES["fp8_channel"], t=9, e=8, k=3, expert_map=(-1, 0, -1, 1, 2, -1, -1, 3)))


# ---- the activation epilogue ---------------------------------------------------------------


def _ep(act: Activation, interleaved: bool, quant=None) -> ActEpilogue:
    return GroupQuantEpilogue(act, gate_up_interleaved=interleaved, swiglu_limit=1.0, quant=quant)


_ACT_CASES = [(a, a.is_gated and a in (Activation.SWIGLUOAI, Activation.GELU)) for a in Activation]


@needs_triton
@pytest.mark.parametrize("act,interleaved", _ACT_CASES, ids=[f"{a.value}{'_il' if il else ''}" for a, il in _ACT_CASES])
def test_act_epilogue(act, interleaved):
    """Every activation, GEMM1 shape (I = 48: a partial N tile), bias and router weight."""
    n = 96 if act.is_gated else 48
    run(Run(SCHEMES["bf16"], gemm="gemm1", n=n, kd=64, act=_ep(act, interleaved)))


# One weight scale per K step where a tile's W rows lie in one block (``block_uniform``), else a
# scale per column: (scheme, W rows, gated act, interleaved, BN, uniform), both kernels run each.
_UNIFORM_CASES = {
    "plain_bn32_in_128": ("fp8_block", 64, False, False, 32, True),
    "plain_bn32_over_16": ("fp8_block16x64", 64, False, False, 32, False),
    "split_i64_bn32": ("fp8_block64x64", 128, True, False, 32, True),
    "split_i48_bn32": ("fp8_block64x64", 96, True, False, 32, False),  # up rows start mid-tile
    "interleaved_span64_in_64": ("fp8_block64x64", 128, True, True, 32, True),
    "interleaved_span128_over_64": ("fp8_block64x64", 128, True, True, 64, False),
    "int8_blocks_split": ("int8_w8a8_block", 128, True, False, 32, True),
}


@needs_triton
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "plain"])
@pytest.mark.parametrize("case", list(_UNIFORM_CASES))
def test_block_uniform_scales(case, persistent):
    """Block-scaled w8a8 with one scalar weight scale per step where the tile allows it, and the
    per-column form where it does not (the flag is checked, then the result against float64)."""
    scheme, n, gated, il, bn, want = _UNIFORM_CASES[case]
    sch = SCHEMES[scheme]
    act = _ep(Activation.SILU, il) if gated else None
    out_cols = n // 2 if gated else n
    fmt = GemmFormat.of(sch.w1, sch.a1, n, 128)
    assert block_uniform(fmt, bn, out_cols, act) is want
    cfg = dataclasses.replace(CFG, block_n=bn, persistent=persistent)
    run(Run(sch, gemm="gemm1" if gated else "gemm2", n=n, kd=128, act=act, cfg=cfg))


# A tile of two weight blocks' rows as two halves, one scale a step each (``halves``): (scheme, W rows,
# gated act, BN, halves, batched counts or None). W rows 96 and 160 leave the last tile's second half partly or
# wholly past N (its scale load clamped, its columns masked).
_HALVES_CASES = {
    "two_blocks_n128": ("fp8_block64x64", 128, False, 128, 2, None),
    "second_half_partly_past_n": ("fp8_block64x64", 96, False, 128, 2, None),
    "second_half_wholly_past_n": ("fp8_block64x64", 160, False, 128, 2, None),
    "int8_blocks": ("int8_block32x32", 96, False, 64, 2, None),
    "batched": ("fp8_block64x64", 160, False, 128, 2, (5, 0, 9, 3)),
    "gated_keeps_its_split": ("fp8_block64x64", 256, True, 128, 1, None),
    "one_block_wide": ("fp8_block64x64", 128, False, 64, 1, None),
    "g128_output_wider_than_a_half": ("fp8_block64x64", 128, "relu2_g128", 128, 1, None),
}


@needs_triton
@pytest.mark.parametrize("case", list(_HALVES_CASES))
def test_block_halves(case):
    """The halves flag for each tile, then the result against float64 (the interpreter runs the
    persistent kernel's two-half path exactly as compiled: two descriptors, two accumulators)."""
    scheme, n, gated, bn, want, counts = _HALVES_CASES[case]
    sch = SCHEMES[scheme]
    act = _ep(Activation.SILU, False) if gated else None
    if gated == "relu2_g128":  # not gated, but fp8 1 x 128 output groups: a 64-column half cannot hold one
        act = _ep(Activation.RELU2_NO_MUL, False, _G128)
    cfg = dataclasses.replace(CFG, block_n=bn)
    assert halves(GemmFormat.of(sch.w1, sch.a1, n, 128), cfg, act) == want
    run(Run(sch, gemm="gemm1" if gated else "gemm2", n=n, kd=128, act=act, cfg=cfg, counts=counts))


_OUT_CASES = {  # (scheme, output quant, interleaved)
    "bf16_int8_static": ("bf16", _INT8_STATIC, True),
    "fp8_tensor_fp8_static": ("fp8_tensor", _FP8_STATIC, False),
    "int8_channel_int8_static": ("int8_w8a8_channel", _INT8_STATIC, True),
    "fp8_block_g64": ("fp8_block64x64", _G64, False),
    "bf16_g64_interleaved": ("bf16", _G64, True),
}


@needs_triton
@pytest.mark.parametrize("case", list(_OUT_CASES))
@pytest.mark.parametrize("batched", [False, True], ids=["standard", "batched"])
def test_act_epilogue_quantized(case, batched):
    """Static per-tensor fp8/int8 codes and dynamic 1 x 64 fp8 groups (BN 64), I = 96: two N tiles,
    the second partial (its last group holds 32 columns)."""
    scheme, quant, il = _OUT_CASES[case]
    cfg = dataclasses.replace(CFG, block_n=64)
    counts = (5, 0, 20) if batched else None
    run(Run(SCHEMES[scheme], gemm="gemm1", n=192, kd=64, act=_ep(Activation.SILU, il, quant), counts=counts, cfg=cfg))


# GEMM1 raising the abs-max of its model-dtype output (``ActEpilogue.track_amax``, the per-tensor
# dynamic a2): (scheme, batched counts or None, expert map or None, the buffer's value before,
# epilogue pieces of the persistent kernel)
_AMAX_CASES = {
    "fp8_tensor_from_zero": ("fp8_tensor", None, None, 0.0, 1),
    "fp8_tensor_two_pieces": ("fp8_tensor", None, None, 0.0, 2),
    "bf16_start_above_stays": ("bf16", None, None, 1e30, 1),
    "fp8_tensor_expert_map": ("fp8_tensor", None, (-1, 0, -1, 1, 2, -1, -1, 3), 0.0, 2),
    "fp8_tensor_batched_empty_expert": ("fp8_tensor", (5, 0, 20), None, 0.0, 1),
}


@needs_triton
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "plain"])
@pytest.mark.parametrize("case", list(_AMAX_CASES))
def test_act_epilogue_tracks_amax(case, persistent):
    """C is the same bytes as without tracking, and the buffer ends at max(its value, the abs-max
    of the values stored): rows GEMM1 does not write (NaN-poisoned: another rank's pairs, a
    batched expert's rows past its count, padding) never reach it. Two N tiles (I = 96 at BN 64),
    the second partial, so several programs race on the atomic."""
    scheme, counts, emap, start, pieces = _AMAX_CASES[case]
    sch, gen = SCHEMES[scheme], torch.Generator().manual_seed(5)
    n, kd, e, k, t = 192, 64, 8, 2, 9
    cfg = dataclasses.replace(CFG, block_n=64, persistent=persistent, epilogue_subtile=pieces)
    if counts is not None:
        e, m_max = len(counts), 20
        ops = make_operands(sch, m_max, e, n, kd, gen, batch=(e,))
        layout = dict(counts=torch.tensor(counts, dtype=torch.int32, device=DEVICE))
        shape = (e, m_max, n // 2)
    else:
        ids = random_topk(t, e, k, gen)[0].to(DEVICE)
        e_map = None if emap is None else torch.tensor(emap, dtype=torch.int32, device=DEVICE)
        e_l = e if emap is None else sum(x >= 0 for x in emap)
        ops = make_operands(sch, t, e_l, n, kd, gen)
        layout = dict(routing=moe_align_ref(ids, e_l, cfg.block_m, expert_map=e_map), a_div=k)
        shape = (t * k, n // 2)
    fmt = GemmFormat.of(ops.w.quant, ops.a.quant, n, kd)
    launch = persistent_gemm_launch if persistent else grouped_gemm_launch
    outs = []
    for track in (False, True):
        ep = dataclasses.replace(_ep(Activation.SILU, False), track_amax=track)
        amax = torch.full((1,), start, dtype=torch.float32, device=DEVICE)
        out = poison_(torch.empty(shape, dtype=torch.bfloat16, device=DEVICE))
        launch(ops.a, ops.w, out, fmt, cfg, GemmCall(act=ep, act_scale=amax if track else None, **layout))
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "C changed by tracking"
    written = ~outs[1].isnan().all(dim=-1)
    assert 0 < int(written.sum()) and (emap is None and counts is None or not bool(written.all()))
    want = max(torch.tensor(start, dtype=torch.float32).item(), outs[1][written].float().abs().max().item())
    assert amax.item() == want


@needs_triton
@pytest.mark.parametrize("subtile", [1, 2])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block"])
def test_group_quant_bit_exact(scheme, subtile):
    """Dynamic 1 x 128 fp8 codes and scales equal ``quantize`` of the same kernel's fp32 output
    bit for bit (I = 200: the second group of a row is partial; BN 256, subtile 2 = 2 pieces)."""
    gen = torch.Generator().manual_seed(11)
    sch = SCHEMES[scheme]
    i, h, t, e, k = 200, 128, 6, 3, 2
    ids, tw = random_topk(t, e, k, gen)
    cfg = fit_launch_config(LaunchConfig(16, 128 * subtile, 64, 2, 4, 2, persistent=True, epilogue_subtile=subtile), 64)
    r = moe_align_ref(ids.to(DEVICE), e, 16)
    ops = make_operands(sch, t, e, 2 * i, h, gen)
    fmt = GemmFormat.of(ops.w.quant, ops.a.quant, 2 * i, h)
    args = dict(routing=r, a_div=k, route_weights=tw.reshape(-1).to(DEVICE))
    h32 = poison_(torch.empty(t * k, i, device=DEVICE))
    persistent_gemm_launch(ops.a, ops.w, h32, fmt, cfg, GemmCall(act=_ep(Activation.SILU, False), **args))
    codes = poison_(torch.empty(t * k, i, dtype=torch.float8_e4m3fn, device=DEVICE))
    scales = poison_(torch.empty(t * k, 2, device=DEVICE))
    call = GemmCall(act=_ep(Activation.SILU, False, _G128), act_scale=scales, **args)
    persistent_gemm_launch(ops.a, ops.w, codes, fmt, cfg, call)
    q = quantize(h32, _G128)
    assert torch.equal(codes.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(scales, q.scale)


# ---- row orders and layouts ----------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("sorted_", ["a", "c", "ac"])
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int8_w8a8_channel"])
def test_sorted_rows(scheme, gemm, sorted_):
    """A by slot (NaN / garbage in padding slots, scales by slot too) and C by slot."""
    run(Run(SCHEMES[scheme], t=11, e=6, k=3, gemm=gemm, a_sorted="a" in sorted_, c_sorted="c" in sorted_))


@needs_triton
def test_sorted_rows_group_output():
    """GEMM1 writing a2 by slot with its 1 x 64 group scales by slot: what GEMM2's A_SORTED reads."""
    cfg = dataclasses.replace(CFG, block_n=64)
    run(Run(SCHEMES["fp8_block64x64"], gemm="gemm1", n=128, kd=64, act=_ep(Activation.SILU, False, _G64),
            c_sorted=True, cfg=cfg))  # fmt: skip


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int8_w8a8_tensor"])
def test_batched(scheme):
    """counts: a partial tile, an empty expert, a full slab (M_max = 20); A by descriptor."""
    run(Run(SCHEMES[scheme], counts=(5, 0, 20)))


@needs_triton
@pytest.mark.parametrize("scheme", ["bf16", "fp8_token"])
def test_batched_a_by_pointer(scheme):
    """A [E, M_max, K] cut from a taller buffer is not one [E * M_max, K] matrix, so its rows are
    gathered by pointer; Kd = 80 is a partial K step."""
    gen = torch.Generator().manual_seed(3)
    sch = SCHEMES[scheme]
    ops = make_operands(sch, 24, 3, 64, 80, gen, batch=(3,))
    a = ops.a.data[:, :20]
    a_scale = ops.a.scale
    a_scale = a_scale[:, :20] if a_scale is not None else None
    fmt = GemmFormat.of(ops.w.quant, ops.a.quant, 64, 80)
    cnt = torch.tensor([5, 0, 20], dtype=torch.int32, device=DEVICE)
    out = poison_(torch.empty(3, 20, 64, device=DEVICE))
    a = _operand(a, a_scale, ops.a)
    persistent_gemm_launch(a, ops.w, out, fmt, CFG, GemmCall(counts=cnt))
    check(out, grouped_gemm_batched_ref(a, ops.w, cnt), _tol(sch, torch.float32))


# ---- config knobs --------------------------------------------------------------------------

_KNOBS = {
    "no_flatten": dict(flatten=False),
    "subtile2": dict(epilogue_subtile=2),
    "group_m1": dict(group_m=1),
    "bm32_bn64": dict(block_m=32, block_n=64, group_m=4),
    "two_per_sm": dict(programs_per_sm=2),  # twice the programs: each walks fewer tiles
}


@needs_triton
@pytest.mark.parametrize("knob", list(_KNOBS))
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block"])
def test_config_knobs(scheme, knob):
    cfg = dataclasses.replace(CFG, **_KNOBS[knob])
    run(Run(SCHEMES[scheme], t=13, e=5, gemm="gemm1", n=128, kd=128, act=_ep(Activation.SILU, knob == "subtile2"),
            cfg=cfg))  # fmt: skip


# ---- what it refuses, and the dispatch from grouped_gemm -------------------------------------


def test_supports():
    def fmt(name):
        s = QuantScheme.by_name(name) if name not in SCHEMES else SCHEMES[name]
        return GemmFormat.of(s.w1, s.a1, 256, 256)

    for name in SERVED:
        f = fmt(name)
        assert supports(f, cfg=fit_launch_config(CFG, f.k_group, strict=f.native)) is None, name
    for name in ("int4_g128", "mxfp4", "nvfp4", "mxfp4_mxfp8", "int4_g64_zp", "int4_g128_actorder"):
        assert supports(fmt(name)) is not None, name
    w_only_block = GemmFormat.of(TensorQuant(QDtype.INT8, Granularity.block(32, 96)), None, 64, 64)
    assert "block" in supports(w_only_block)
    assert "BM" in supports(GemmFormat(), cfg=dataclasses.replace(CFG, block_m=8))
    il = ActEpilogue(Activation.SWIGLUOAI, gate_up_interleaved=True)
    assert "TMA box" in supports(GemmFormat(), il, cfg=dataclasses.replace(CFG, block_n=256))
    g128 = _ep(Activation.SILU, False, _G128)
    assert "whole groups" in supports(GemmFormat(), g128, cfg=dataclasses.replace(CFG, block_n=128, epilogue_subtile=2))
    assert supports(GemmFormat(), g128, cfg=dataclasses.replace(CFG, block_n=256, epilogue_subtile=2)) is None
    assert "8-bit" in supports(fmt("fp8_tensor"), cfg=dataclasses.replace(CFG, block_k=16))
    # warp specialization: declined (wrong results on an H100), whatever else the call is
    ws = dataclasses.replace(CFG, warp_specialize=True, block_m=64)
    assert "wrong results" in supports(GemmFormat(), cfg=ws)
    odd_k = make_operands(SCHEMES["bf16"], 4, 2, 32, 37, torch.Generator().manual_seed(0))
    assert "aligned" in supports(GemmFormat(), w=odd_k.w.q)
    assert "float32" in supports(GemmFormat(), a=odd_k.a.data.float())
    with pytest.raises(ValueError, match="group"):
        ActEpilogue(Activation.SILU, quant=_G128)  # the old kernel's epilogue refuses dynamic groups
    assert GroupQuantEpilogue(Activation.SILU, quant=_G128).out_dtype(torch.bfloat16) == torch.float8_e4m3fn


def test_launch_config_fields():
    text = "128,256,64,8,8,3,persistent=1,warp_specialize=1,flatten=0,epilogue_subtile=2,programs_per_sm=2"
    cfg = LaunchConfig.parse(text)
    assert cfg == LaunchConfig(128, 256, 64, 8, 8, 3, persistent=True, warp_specialize=True, flatten=False,
                               epilogue_subtile=2, programs_per_sm=2)  # fmt: skip
    assert eval(repr(cfg)) == cfg
    assert LaunchConfig.parse("64,128,64,8,4,3") == LaunchConfig(64, 128, 64, 8, 4, 3)
    assert not LaunchConfig().persistent
    with pytest.raises(ValueError):
        LaunchConfig(epilogue_subtile=3)
    with pytest.raises(ValueError, match="programs_per_sm"):
        LaunchConfig(programs_per_sm=3)
    n_fields = len(dataclasses.fields(LaunchConfig))
    assert LaunchConfig.parse("64,128,64,8,4,3" + ",1" * (n_fields - 6)).scale_loads == 1  # every field
    with pytest.raises(ValueError):
        LaunchConfig.parse("64,128,64,8,4,3" + ",1" * (n_fields - 5))  # one more than the fields


@needs_triton
@pytest.mark.parametrize("scheme", ["fp8_block", "int4_g32"])
def test_grouped_gemm_dispatch(scheme):
    """``grouped_gemm`` with a persistent config: served schemes run here, others on the old kernel;
    the output is right either way."""
    gen = torch.Generator().manual_seed(4)
    sch = BY_NAME[scheme]
    ids, tw = random_topk(7, 4, 2, gen)
    r = moe_align_ref(ids.to(DEVICE), 4, 16)
    ops = make_operands(sch, 7, 4, 64, 128, gen)
    out = poison_(torch.empty(14, 64, device=DEVICE))
    kw = dict(a_div=2, topk_weights=tw.to(DEVICE))
    grouped_gemm(ops.a, ops.w, r, out=out, config=CFG, **kw)
    check(out, grouped_gemm_ref(ops.a, ops.w, r, **kw), _tol(sch, torch.float32))


def test_compiles_for_sm90():
    """The GPU path compiles for Hopper with no GPU here (``tests/kernels/sm90_compile.py``, in a
    subprocess without the interpreter): wgmma and TMA loads in every case's SASS, shared
    memory within an H100's, no spilled registers."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run_ = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "sm90_compile.py"), "--json"], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run_.stdout.strip(), run_.stderr[-2000:]
    results = json.loads(run_.stdout.strip().splitlines()[-1])
    assert len(results) >= 10
    bad = {r["case"]: r["problems"] for r in results if r["problems"]}
    assert not bad, bad


@needs_triton
def test_bench_script_selftest(tmp_path):
    """``scripts/kbench_prefill.py --selftest`` end to end (tiny, interpreter, no timing): every
    variant of the sweep and of the next T, checked, and its tables written."""
    if HAS_CUDA:
        pytest.skip("the selftest runs under the interpreter; the GPU runs the script itself")
    args = ["--selftest", "--models", "tiny-oss", "--schemes", "fp8_block", "--tokens", "16,8", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run_ = subprocess.run([sys.executable, str(ROOT / "scripts" / "kbench_prefill.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run_.returncode == 0, (run_.stdout + run_.stderr)[-3000:]
    rows = json.loads((tmp_path / "kbench_prefill.json").read_text())["rows"]
    assert {r["t"] for r in rows} == {16, 8} and len(rows) >= 20
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    assert "| tiny-oss | gemm1 | fp8_block | 8 |" in (tmp_path / "kbench_prefill.md").read_text()


# ---- real shapes (GPU) ---------------------------------------------------------------------

REAL = [  # (E, H, I, T, K): Qwen3-30B-A3B's H and I at 256 rows per expert; Mixtral-like at 1/8 of I
    (32, 2048, 768, 1024, 8),
    (8, 4096, 1792, 512, 2),
]
_REAL_CFGS = [
    LaunchConfig(64, 128, 64, 8, 4, 3, persistent=True),
    LaunchConfig(128, 128, 128, 8, 8, 3, persistent=True, epilogue_subtile=2),
    LaunchConfig(128, 256, 128, 8, 8, 3, persistent=True),  # fp8 blocks: two halves (``halves``)
    LaunchConfig(64, 128, 128, 8, 4, 3, persistent=True, programs_per_sm=2),  # two programs per SM
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _REAL_CFGS, ids=["bm64", "bm128", "bm128_bn256", "bm64_two_per_sm"])
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_block"])
def test_real_shapes(scheme, shape, gemm, cfg):
    e, h, i, t, k = shape
    if scheme == "bf16" and cfg.block_n * cfg.block_k > 128 * 128:
        # 128 x 256 x 128 bf16 tiles need 288 KiB of shared memory at 3 stages (228 on an H100/H200)
        cfg = dataclasses.replace(cfg, block_k=64)
    n, kd = (2 * i, h) if gemm == "gemm1" else (h, i)
    run(Run(SCHEMES[scheme], t, e, k, n=n, kd=kd, gemm=gemm, out_dtype=torch.bfloat16, cfg=cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("sorted_", ["", "a", "ac"])
def test_real_shapes_fused_group_quant(sorted_):
    """Qwen3 GEMM1 with silu and the fp8-block a2 (1 x 128 groups) in the epilogue, by slot or not."""
    e, h, i, t, k = REAL[0]
    cfg = LaunchConfig(64, 128, 128, 8, 4, 3, persistent=True)
    run(Run(SCHEMES["fp8_block"], t, e, k, n=2 * i, kd=h, gemm="gemm1", act=_ep(Activation.SILU, False, _G128),
            a_sorted="a" in sorted_, c_sorted="c" in sorted_, cfg=cfg))  # fmt: skip
