"""The persistent, TMA-fed grouped GEMM for prefill on Hopper: ``persistent_gemm_launch``.

Same contract as ``grouped_gemm_launch`` (standard layout with ``AlignedRouting``, batched
layout with counts; see ``grouped_gemm.py``), which dispatches here when the launch config
says ``persistent`` and ``supports`` has no objection. The kernel is in
``_grouped_gemm_persistent.py``; what it does differently, and why, is in its docstring.

Served (everything else: ``supports`` says why, and the one-program-per-tile kernel runs):

    activations   bf16 / fp16;  fp8 e4m3 or int8 with tensor, token or 1 x g group scales
    weights       bf16 / fp16 (same dtype), optionally with an fp32 scale per expert on the
                  accumulator (written-out NVFP4: ``w.global_scale``);  fp8 / int8 with tensor, channel or bn x bk block
                  scales (w8a8 natively: the stored bytes in tl.dot); fp8 / int8 under bf16 /
                  fp16 activations with tensor or channel scales
    epilogue      bias, any ``ActEpilogue`` activation, router weight; C in the model dtype,
                  static per-tensor fp8/int8 codes, or (``GroupQuantEpilogue``) fp8 codes with
                  dynamic 1 x g group scales computed from the tile (g = 128 for the fp8-block
                  scheme's a2): one launch and one [M, I] round trip fewer than act_quant

Two row orders besides the old kernel's, chosen by the shapes of ``a`` and ``c`` (standard
layout, P = ``routing.sorted_ids.numel()`` slots; BM >= 16 makes P > T*K, so the shapes
cannot be confused):

    a [P, K]   A_SORTED: row s is the A row of slot s (``a_div`` unused), read by TMA; its
               scales (token or group) are [P, .] too. Padding slots may hold anything.
    c [P, N]   C_SORTED: C (and group scales [P, G]) written by slot; padding slots untouched.

So GEMM1 can write a2 by slot (C_SORTED, with its 1 x 128 group scales) and GEMM2 read it
with TMA (A_SORTED) while still writing y by pair for ``moe_sum``. The batched layout is by
slot already: its A [E, M_max, K] is read by TMA whenever it is one [E * M_max, K] matrix with
16-byte aligned rows (else gathered by pointer).

Tensor descriptors are built on the device, so Triton needs a global-memory allocator for
them: the launcher installs one (``torch.empty`` bytes) unless one is set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ..errors import expect
from ..metadata import AlignedRouting
from ..platform import current_platform
from ..quant import Operand, QDtype, QTensor, TensorQuant
from ._common import cdiv, interpreting
from ._grouped_gemm_persistent import _persistent_gemm_kernel
from .gemm_format import (
    ActEpilogue,
    GemmCall,
    GemmFormat,
    RowBlocks,
    _strides,
    _u8,
    epilogue_scale,
    optional_ptrs,
    out_quant,
    per_expert_scale,
    shared_constexprs,
)
from .launch import ensure_allocator, launch
from .launch_config import LaunchConfig

_FLOAT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TMA_BOX = 256  # the most elements a TMA box spans in one dimension
_TMA_ALIGN = 16  # bytes: descriptor base and row strides
_INTERPRETER_PROGRAMS = 3  # persistent programs under the interpreter: a few tiles each, unevenly


def _dynamic_group_fp8(q: TensorQuant | None) -> bool:
    return q is not None and q.dtype is QDtype.FP8 and q.granularity.kind == "group" and q.dynamic


@dataclass(frozen=True)
class GroupQuantEpilogue(ActEpilogue):
    """``ActEpilogue`` whose ``quant`` may also be dynamic fp8 with 1 x g group scales (the
    fp8-block scheme's a2, g = 128). The persistent kernel computes each group's scale from
    the tile it holds (BN / ``epilogue_subtile`` a multiple of g) and writes it into
    ``act_scale``, then [rows of C, ceil(I / g)] fp32, instead of reading a static scale."""

    @staticmethod
    def supports(a2: TensorQuant | None) -> bool:
        return ActEpilogue.supports(a2) or _dynamic_group_fp8(a2)


def sorted_layout(a: torch.Tensor, c: torch.Tensor, routing: AlignedRouting | None) -> tuple[bool, bool]:
    """(A_SORTED, C_SORTED): whether ``a`` / ``c`` hold one row per slot (module docstring)."""
    if routing is None or routing.pair_blocks:
        return False, False
    slots = routing.sorted_ids.numel()
    return a.shape[0] == slots, c.shape[0] == slots


def _tma_ok(t: torch.Tensor, rows_stride: int) -> bool:
    """A 2-D descriptor over ``t``'s rows is legal: contiguous last dim, 16-byte aligned base and row stride."""
    el = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % _TMA_ALIGN == 0 and (rows_stride * el) % _TMA_ALIGN == 0


def _w_view_ok(w: torch.Tensor) -> bool:
    """W [E, N_w, K] is one [E * N_w, K] matrix for the descriptor (see the kernel docstring)."""
    e, n_w, _ = w.shape
    return (e == 1 or w.stride(0) == n_w * w.stride(1)) and _tma_ok(w, w.stride(1))


def _batched_a_desc(a: torch.Tensor) -> bool:
    """Batched A [E, M_max, K] read through a [E * M_max, K] descriptor."""
    return a.dim() == 3 and (a.shape[0] == 1 or a.stride(0) == a.shape[1] * a.stride(1)) and _tma_ok(a, a.stride(1))


def supports(
    fmt: GemmFormat,
    act: ActEpilogue | None = None,
    *,
    a: torch.Tensor | None = None,
    w: QTensor | None = None,
    c: torch.Tensor | None = None,
    cfg: LaunchConfig | None = None,
    routing: AlignedRouting | None = None,
) -> str | None:
    """Why the persistent kernel cannot serve this call, or None. Checks what it is given."""
    if routing is not None and routing.pair_blocks:
        return "pair blocks (decode without moe_align): the persistent kernel walks aligned blocks"
    if fmt.w_fmt not in ("float", "fp8", "int8"):
        return f"{fmt.w_fmt} weights: the 4-bit formats have their own kernels"
    if fmt.a_fmt not in ("float", "fp8", "int8"):
        return f"{fmt.a_fmt} activations are not served"
    if fmt.act_order or fmt.has_zero:
        return "act-order and zero points are not served"
    if fmt.a_on_load:
        return "A quantized as it is loaded: the non-persistent kernel's (decode) feature"
    if act is not None and act.amax_slots:
        return "per-program abs-max slots: the non-persistent kernel's grid"
    if fmt.a_fmt != "float" and not fmt.native:
        return f"{fmt.a_fmt} activations need {fmt.a_fmt} weights (native w8a8)"
    if fmt.a_fmt == "float" and fmt.w_fmt != "float" and fmt.w_bk:
        return "weight-only 8-bit with block scales: the old kernel folds them per K step"
    if (
        act is not None
        and act.quant is not None
        and not (ActEpilogue.supports(act.quant) or _dynamic_group_fp8(act.quant))
    ):
        return f"output quantization {act.quant.short}: static per-tensor fp8/int8 or dynamic fp8 groups only"
    plat = current_platform()
    if not interpreting() and not plat.at_least(9, 0):
        return f"TMA needs sm90+, platform is {plat.label}"
    if cfg is not None:
        why = _config_why(fmt, act, cfg)
        if why:
            return why
    if a is not None and fmt.a_fmt == "float" and a.dtype not in _FLOAT:
        return f"{a.dtype} activations: bf16/fp16 only (fp32 runs on the old kernel)"
    if a is not None and fmt.a_fmt == "float" and w is not None and fmt.w_fmt == "float" and w.data.dtype != a.dtype:
        return f"weights {w.data.dtype} with activations {a.dtype}"
    if w is not None and not _w_view_ok(_u8(w.data)):
        return "W must be [E, N, K] with K contiguous, rows 16-byte aligned and experts back to back (TMA)"
    a_tma = False
    if a is not None and c is not None and routing is not None:
        a_tma = sorted_layout(a, c, routing)[0]
        if a_tma and not _tma_ok(_u8(a), a.stride(0)):
            return "slot-ordered A must have 16-byte aligned rows with K contiguous (TMA)"
    elif a is not None and routing is None:
        a_tma = _batched_a_desc(_u8(a))
    return None


def _config_why(fmt: GemmFormat, act: ActEpilogue | None, cfg: LaunchConfig) -> str | None:
    if cfg.block_m < 16:
        return f"BM {cfg.block_m} < 16 (decode): the old kernel's FMA path"
    rows = 2 * cfg.block_n if act is not None and act.activation.is_gated and act.gate_up_interleaved else cfg.block_n
    if max(rows, cfg.block_k, cfg.block_m) > _TMA_BOX:
        return f"a TMA box spans at most {_TMA_BOX} rows (W rows {rows}, BK {cfg.block_k}, BM {cfg.block_m})"
    if fmt.w_fmt != "float" and cfg.block_k < 32:
        return f"8-bit tl.dot on Hopper needs BK >= 32, got {cfg.block_k}"
    if fmt.native and fmt.k_group and fmt.k_group % cfg.block_k:
        return f"BK {cfg.block_k} must divide the K extent {fmt.k_group} of one scale (fit_launch_config)"
    if cfg.warp_specialize:
        why = _ws_why(act, cfg, rows)
        if why:
            return why
    if act is not None and _dynamic_group_fp8(act.quant):
        g = act.quant.granularity.group_size
        piece = cfg.block_n // cfg.epilogue_subtile
        if piece % g:
            return f"dynamic 1 x {g} output groups need BN / epilogue_subtile ({piece}) to hold whole groups"
    return None


def _ws_why(act: ActEpilogue | None, cfg: LaunchConfig, w_rows: int) -> str | None:
    """Why ``warp_specialize`` is declined. Triton 3.6's Hopper warp specialization
    (``tl.range(..., warp_specialize=True)``) does specialize this kernel in offline sm_90 compiles
    (4 warps, A through TMA, BM >= 64: one producer and two consumer warpgroups, 12 warps of 168
    registers; it leaves 8-warp programs and BM < 64 as they are, and its pass fails on gathered
    A, on interleaved gate/up at BM 128 and on BM 64 with 256 W rows). But on an H100 the
    specialized kernel computed wrong results in every case the kernel bench ran (bf16, fp8
    per-tensor, fp8 block; Qwen3-30B-A3B and Mixtral at T = 4096: relative error 0.6 against the
    float64 reference, ``benchmarks/results/kbench_prefill_h100_2026-11-25``), where the same tiles
    unspecialized were right; the interpreter runs no specialization and cannot show it. So the
    option is declined, with this reason, until that is understood."""
    return "warp_specialize: gave wrong results on an H100 (relative error 0.6, kbench 2026-11-25); declined"


def _num_programs(tiles: int, per_sm: int = 1) -> int:
    sms = current_platform().sm_count if not interpreting() else _INTERPRETER_PROGRAMS
    return max(1, min((sms or _INTERPRETER_PROGRAMS) * per_sm, tiles))


def _dot_dtype(fmt: GemmFormat, a: torch.Tensor):
    """The dot's operand dtype where operands are converted (not native w8a8)."""
    if interpreting():
        return tl.float32  # the interpreter's bf16/fp16 dot multiplies raw bits
    return _FLOAT.get(a.dtype, tl.bfloat16)


def _out_quant(act: ActEpilogue | None) -> tuple[str, int]:
    if act is not None and act.quant is not None and _dynamic_group_fp8(act.quant):
        return "fp8_group", act.quant.granularity.group_size
    return out_quant(act), 0


def persistent_gemm_launch(
    a: Operand, w: Operand, c: torch.Tensor, fmt: GemmFormat, cfg: LaunchConfig, call: GemmCall
) -> None:
    """Launch the persistent kernel into ``c``; arguments as ``grouped_gemm_launch``'s.

    Besides: ``a`` / ``c`` may be slot-ordered (module docstring); with a
    ``GroupQuantEpilogue`` of dynamic fp8 groups, ``c`` is fp8 and ``act_scale`` is the fp32
    [rows of C, ceil(N / g)] (batched: [E, M_max, ceil(N / g)]) group-scale output.
    Raises ``FusedMoEError`` with ``supports``'s reason where it cannot serve the call.
    """
    # 101 lines: builds the tensor descriptors and maps every operand to the kernel's arguments in their order; split,
    # that order would be spread over several functions.
    routing, counts, a_div, bias, route_weights, act, act_scale = call.unpacked()
    a_scale, a_global_scale = a.scale, a.global_scale
    a, w = a.data, w.q
    why = supports(fmt, act, a=a, w=w, c=c, cfg=cfg, routing=routing)
    expect(why is None, "persistent grouped GEMM", "a call it serves", why)
    expect(a_global_scale is None, "a_global_scale", "None (NVFP4 is not served)", "a tensor")
    # a scale per expert on the accumulator: written-out NVFP4 weights (``kernels.w4_dequant``)
    wg = per_expert_scale(w.global_scale)
    e_l, n_w, kd = w.shape
    n = n_w if act is None else act.out_cols(n_w)
    rows = RowBlocks.of(a, e_l, cfg.block_m, routing)
    batched = rows.batched
    a_sorted, c_sorted = sorted_layout(a, c, routing)
    if batched:
        counts = counts.contiguous()  # read at counts + e
        a_sorted = _batched_a_desc(_u8(a))  # already by slot: TMA where the layout allows
        a_rows_total = e_l * rows.m_max
    else:
        num_pairs, slots = routing.num_pairs, routing.sorted_ids.numel()
        ok_a = a_sorted or a.shape[0] * a_div == num_pairs
        expect(ok_a, "a", f"{num_pairs // max(a_div, 1)} rows (by pair) or {slots} (by slot)", tuple(a.shape))
        expect(c_sorted or c.shape[0] == num_pairs, "c", f"{num_pairs} rows (by pair) or {slots} (by slot)", c.shape)
        expect(routing.block_m == cfg.block_m, "cfg.block_m", f"routing.block_m = {routing.block_m}", cfg.block_m)
        a_rows_total = a.shape[0]
    if rows.num_m_blocks == 0 or n == 0 or c.numel() == 0:  # standard: an upper bound, the kernel reads num_padded
        return
    oq, out_group = _out_quant(act)
    a_scale = _u8(a_scale)
    route_weights, rw_str = rows.route_weights(route_weights)
    num_groups, cs_str, c_scale = 0, (0, 0, 0), None
    if oq == "fp8_group":
        num_groups = cdiv(n, out_group)
        want = (*c.shape[:-1], num_groups)
        ok = act_scale is not None and tuple(act_scale.shape) == want and act_scale.dtype == torch.float32
        expect(ok, "act_scale", f"the fp32 {want} group-scale output", None if act_scale is None else act_scale.shape)
        c_scale = act_scale
        cs_str = rows.strides(act_scale)
    else:
        c_scale = epilogue_scale(oq, act_scale)
    c_arg = _u8(c)
    dummy = c_arg
    routing_ptrs = (None, None, None) if batched else (routing.sorted_ids, routing.block_expert, routing.num_padded)
    ensure_allocator()
    grid = (_num_programs(rows.num_m_blocks * cdiv(n, cfg.block_n), cfg.programs_per_sm),)
    launch(
        _persistent_gemm_kernel,
        grid,
        a if a_sorted else _u8(a),  # descriptors typed (kernel docstring), pointer loads uint8
        *optional_ptrs(dummy, a_scale, w.data, w.scale, wg, bias, route_weights, c_arg, c_scale),
        *optional_ptrs(dummy, *routing_ptrs, counts if batched else None),
        n,
        n_w,
        kd,
        rows.num_pairs,
        a_div,
        rows.m_max,
        rows.blocks_per_expert,
        rows.num_m_blocks,
        a_rows_total,
        e_l * n_w,
        num_groups,
        1.702 if act is None else act.swiglu_alpha,
        7.0 if act is None else act.swiglu_limit,
        *rows.strides(a),
        *rows.scale_strides(a_scale),
        w.data.stride(1),
        *_strides(w.scale, 3),
        *(bias.stride() if bias is not None else (0, 0)),
        *rw_str,
        *rows.strides(c),
        *cs_str,
        A_SORTED=a_sorted,
        C_SORTED=c_sorted,
        HAS_W_GSCALE=wg is not None,
        DOT_DTYPE=_dot_dtype(fmt, a),
        OUT_GROUP=max(out_group, 1),
        SUBTILE=cfg.epilogue_subtile,
        FLATTEN=cfg.flatten and not cfg.warp_specialize,  # fused loops are not specialized
        WARP_SPECIALIZE=cfg.warp_specialize,
        **_constexprs(fmt, cfg, act, batched, bias, route_weights, oq, n),
    )


def halves(fmt: GemmFormat, cfg: LaunchConfig, act: ActEpilogue | None) -> int:
    """2 where a tile of two weight blocks' rows (BN = 2 W_BN, not gated) runs as two halves, each
    with one weight scale a K step (``_mac``'s W_UNIFORM), else 1. As one accumulator such a tile
    needed a [BN] scale vector a step and, at 128 x 256, spilled (344-536 bytes); as halves it
    holds two [BM, BN / 2] accumulators and one partial product."""
    gated = act is not None and act.activation.is_gated
    block = fmt.native and fmt.w_bn > 0 and fmt.w_bk > 0
    # the epilogue then works a half at a time: dynamic output groups must fit in one
    groups = act is not None and _dynamic_group_fp8(act.quant) and (cfg.block_n // 2) % act.quant.granularity.group_size
    return 2 if block and not gated and not groups and cfg.block_n == 2 * fmt.w_bn else 1


def _constexprs(fmt, cfg, act, batched, bias, route_weights, oq, n) -> dict:
    """``shared_constexprs`` with HALVES (each half is one weight block: W_UNIFORM)."""
    out = shared_constexprs(fmt, cfg, act, batched, bias, route_weights, oq, n)
    out["HALVES"] = halves(fmt, cfg, act)
    out["W_UNIFORM"] = out["W_UNIFORM"] or out["HALVES"] == 2
    return out
