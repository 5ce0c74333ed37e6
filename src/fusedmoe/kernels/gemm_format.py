"""What the grouped-GEMM kernels agree on: the operand formats (``GemmFormat``), GEMM1's
activation epilogue (``ActEpilogue``), the scheme key of the tuned-config tables, and what their
launchers share: the row blocks and per-row strides (``RowBlocks``), the constexprs both kernels
take (``shared_constexprs``), the stride and byte-view helpers. Every grouped-GEMM launcher
(``grouped_gemm``, ``grouped_gemm_persistent``) imports from here; this module imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from ..config import Activation, MoEConfig
from ..errors import expect
from ..metadata import AlignedRouting
from ..quant import QDtype, TensorQuant
from ._common import cdiv, interpreting
from .launch_config import LaunchConfig

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_A_FORMATS = {QDtype.FP8: "fp8", QDtype.INT8: "int8", QDtype.MXFP8: "mxfp8", QDtype.NVFP4: "nvfp4"}
_W_FORMATS = {
    QDtype.FP8: "fp8",
    QDtype.INT8: "int8",
    QDtype.INT4: "int4",
    QDtype.MXFP4: "mxfp4",
    QDtype.NVFP4: "nvfp4",
}


@dataclass(frozen=True)
class GemmFormat:
    """The kernel's view of its operands: formats and where their scales vary.

    a_group: 0 = one activation scale per row (tensor or token), else 1 x a_group groups.
    w_bn, w_bk: 0, 0 = one weight scale per output column (tensor or channel), else the
    block along N and K one scale covers (a group g is block (1, g)).
    native: w8a8, the stored bytes feed the tensor cores.
    a_on_load: A comes in the model dtype and the kernel quantizes it as a_fmt / a_group (dynamic
    scales) as it loads each tile (``grouped_gemm(quantize_a=...)``).
    """

    a_fmt: str = "float"
    a_group: int = 0
    w_fmt: str = "float"
    w_bn: int = 0
    w_bk: int = 0
    act_order: bool = False
    has_zero: bool = False
    a_on_load: bool = False

    @property
    def native(self) -> bool:
        return self.a_fmt in ("fp8", "int8") and self.w_fmt == self.a_fmt

    @property
    def k_group(self) -> int | None:
        """K extent BK should divide, or None.

        Native w8a8 applies one scale per K step, so BK must divide every group. The
        dequantizing path handles any BK, but a group that is not a power of 2 (say 96)
        would make it gather a scale per element ([BN, BK] fp32 loads, 64 KiB of shared
        memory per pipeline stage at 128 x 128); a BK dividing it avoids that.
        """
        groups = [g for g in (self.a_group, self.w_bk) if g and (self.native or g & (g - 1))]
        return math.gcd(*groups) if groups else None

    @classmethod
    def of(
        cls,
        w_quant: TensorQuant | None,
        a_quant: TensorQuant | None,
        n: int,
        k: int,
        has_zero: bool = False,
        a_on_load: bool = False,
    ) -> GemmFormat:
        a_fmt, a_group = "float", 0
        if a_quant is not None:
            expect(a_quant.dtype in _A_FORMATS, "a_quant.dtype", f"one of {list(_A_FORMATS)}", a_quant.dtype)
            a_fmt = _A_FORMATS[a_quant.dtype]
            g = a_quant.granularity
            expect(g.kind in ("tensor", "token", "group"), "a_quant.granularity", "tensor, token or group", g)
            a_group = g.group_size if g.kind == "group" else 0
        if w_quant is None:
            return cls(a_fmt=a_fmt, a_group=a_group, a_on_load=a_on_load)
        expect(w_quant.dtype in _W_FORMATS, "w_quant.dtype", f"one of {list(_W_FORMATS)}", w_quant.dtype)
        w_fmt = _W_FORMATS[w_quant.dtype]
        g = w_quant.granularity
        bn, bk = {"tensor": (0, 0), "channel": (0, 0), "token": (0, 0)}.get(g.kind, (0, 0))
        if g.kind == "group":
            bn, bk = 1, g.group_size
        elif g.kind == "block":
            bn, bk = g.block_n, g.block_k
        elif w_fmt == "int4":  # int4 subtracts its zero per element: always fold the scale
            bn, bk = (1 if g.kind == "channel" else n), k
        return cls(a_fmt, a_group, w_fmt, bn, bk, w_quant.act_order, has_zero, a_on_load)


_OUT_QUANT = {QDtype.FP8: ("fp8", torch.float8_e4m3fn), QDtype.INT8: ("int8", torch.int8)}


@dataclass(frozen=True)
class ActEpilogue:
    """The activation GEMM1 applies in its epilogue, and how it stores the result.

    Fields are named as in ``MoEConfig``, so ``apply_activation(h, epilogue)`` is its
    reference. A gated ``activation`` reads W13 [E, 2I, H] (gate rows then up rows, or
    interleaved) and writes C [M, I]; a ``*_no_mul`` one maps [E, I, H] to [M, I].
    ``quant``: None (C in the model dtype) or a static per-tensor fp8/int8 ``TensorQuant``
    whose scale comes as ``act_scale``: C = Q(act(h) (* router weight)).
    ``track_amax`` (C in the model dtype): the launch also raises ``act_scale`` (fp32 [1],
    zeroed before the call's first GEMM1 launch) to the abs-max of C's written values as
    stored (an atomic integer max of their |bits|, so a NaN is kept and the order of programs
    does not matter): what a per-tensor dynamic scale of C needs, without a pass over C.
    ``amax_slots`` (with ``track_amax``; the non-persistent kernel): instead each program writes
    its tile's abs-max |bits| to its own int32 slot of ``act_scale`` ([grid size],
    ``amax_slot_count``), 0 where it has no rows: no atomic and no buffer to zero first (one
    launch fewer at decode, where the grid is a few hundred programs); the abs-max is the max
    of the slots (``grouped_gemm(quantize_a=..., a_amax=slots)`` takes it so).
    """

    activation: Activation = Activation.SILU
    gate_up_interleaved: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quant: TensorQuant | None = None
    track_amax: bool = False
    amax_slots: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.activation, Activation):
            object.__setattr__(self, "activation", Activation(self.activation))
        expect(
            self.supports(self.quant),
            "ActEpilogue.quant",
            "None or a static per-tensor fp8/int8 scale (dynamic scales need the whole row or tensor)",
            self.quant,
        )
        expect(
            not (self.track_amax and self.quant is not None),
            "ActEpilogue.track_amax",
            "False when C is quantized (the abs-max is tracked for a C in the model dtype)",
            self.track_amax,
        )
        expect(
            self.track_amax or not self.amax_slots,
            "ActEpilogue.amax_slots",
            "False unless track_amax (the slots hold the tracked abs-max)",
            self.amax_slots,
        )
        expect(
            self.activation.is_gated or not self.gate_up_interleaved,
            "ActEpilogue.gate_up_interleaved",
            "False for a non-gated activation",
            self.gate_up_interleaved,
        )

    @staticmethod
    def supports(a2: TensorQuant | None) -> bool:
        """Whether the epilogue can produce GEMM2's input ``a2``: unquantized, or quantized with
        a scale known before the values are (static per-tensor fp8/int8)."""
        return a2 is None or (a2.dtype in _OUT_QUANT and a2.granularity.kind == "tensor" and not a2.dynamic)

    @classmethod
    def of(cls, config: MoEConfig, a2: TensorQuant | None = None) -> ActEpilogue:
        """The epilogue of ``config``'s layer producing ``a2`` (see ``supports``)."""
        return cls(config.activation, config.gate_up_interleaved, config.swiglu_alpha, config.swiglu_limit, quant=a2)

    def out_cols(self, n: int) -> int:
        """Columns of C for a W of ``n`` rows."""
        return n // 2 if self.activation.is_gated else n

    def out_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.quant is None else _OUT_QUANT[self.quant.dtype][1]


def out_quant(act: ActEpilogue | None) -> str:
    """The kernels' OUT_QUANT for GEMM1's epilogue: "none", "amax" / "amax_slots" (model dtype,
    abs-max tracked), or the static code format "fp8" / "int8" (the persistent kernel adds
    "fp8_group" for dynamic 1 x g groups itself)."""
    if act is None or act.quant is None:
        if act is None or not act.track_amax:
            return "none"
        return "amax_slots" if act.amax_slots else "amax"
    return _OUT_QUANT[act.quant.dtype][0]


def amax_buffer(act_scale: torch.Tensor | None, slots: int | None = None) -> torch.Tensor:
    """``act_scale`` as the abs-max a ``track_amax`` epilogue raises, checked, not copied: the
    fp32 [1] running max, or (``slots``) the int32 [slots] per-program slots (``amax_slots``)."""
    want = torch.float32 if slots is None else torch.int32
    n = 1 if slots is None else slots
    ok = act_scale is not None and act_scale.numel() == n and act_scale.dtype == want
    what = "the contiguous fp32 [1] abs-max buffer" if slots is None else f"int32 [{slots}] abs-max slots"
    expect(ok and act_scale.is_contiguous(), "act_scale", what, act_scale)
    return act_scale


def amax_slot_count(num_m_blocks: int, n: int, block_n: int) -> int:
    """Slots of an "amax_slots" epilogue: one per program of the non-persistent kernel's grid."""
    return num_m_blocks * cdiv(n, block_n)


def epilogue_scale(oq: str, act_scale: torch.Tensor | None, slots: int = 0) -> torch.Tensor | None:
    """What a kernel's ``c_scale_ptr`` gets for OUT_QUANT ``oq`` (``out_quant``): the abs-max
    buffer itself ("amax", raised in place, so never a copy; "amax_slots", ``slots`` of them),
    the static scale as fp32 [1] ("fp8" / "int8"), else None."""
    if oq == "amax":
        return amax_buffer(act_scale)
    if oq == "amax_slots":
        return amax_buffer(act_scale, slots)
    return act_scale.reshape(1).float().contiguous() if oq != "none" else None


def on_load_why(tq: TensorQuant | None) -> str | None:
    """Why a GEMM cannot quantize its A tile as it loads it as ``tq`` (``grouped_gemm(quantize_a=)``),
    or None: a dynamic fp8/int8 scale per tensor (from an abs-max GEMM1 raised) or per 1 x g
    group of a row (from the tile itself)."""
    if tq is None or tq.dtype not in (QDtype.FP8, QDtype.INT8):
        return "dynamic fp8 or int8 activations only"
    if not tq.dynamic:
        return f"{tq.short}: a static scale (the epilogue of GEMM1 quantizes with it)"
    if tq.granularity.kind not in ("tensor", "group"):
        return f"{tq.short}: per tensor or per 1 x g group only (a token scale needs the whole row first)"
    return None


@dataclass(frozen=True)
class GemmCall:
    """What one grouped-GEMM launch takes besides its operands, output, format and config: where
    A's rows come from (``routing`` and ``a_div`` in the standard layout, ``counts`` [E_l] in the
    batched one) and what the epilogue adds (``bias`` [E_l, N], one router weight per row of C,
    GEMM1's activation with its static output scale). Every launch function of the family
    (``grouped_gemm_launch``, ``persistent_gemm_launch``, ``w4_gemm_launch``) takes one."""

    routing: AlignedRouting | None = None
    counts: torch.Tensor | None = None
    a_div: int = 1
    bias: torch.Tensor | None = None
    route_weights: torch.Tensor | None = None
    act: ActEpilogue | None = None
    act_scale: torch.Tensor | None = None
    a_amax: torch.Tensor | None = None  # A quantized on load per tensor: its abs-max (``act_quant.known_amax``)

    def unpacked(self) -> tuple:
        """(routing, counts, a_div, bias, route_weights, act, act_scale)."""
        return self.routing, self.counts, self.a_div, self.bias, self.route_weights, self.act, self.act_scale


def scheme_key(w_quant: TensorQuant | None, a_quant: TensorQuant | None) -> str:
    """Short name of the kernel variant, the key of launch-config tables."""
    if w_quant is None:
        return "bf16"
    w = _W_FORMATS[w_quant.dtype]
    if a_quant is None:
        return "w8a16" if w == "int8" else w
    if w in ("fp8", "int8") and (w_quant.granularity.kind == "block" or a_quant.granularity.kind == "group"):
        return f"{w}_block"
    return w


def _strides(t: torch.Tensor | None, ndim: int) -> tuple[int, ...]:
    """Strides of ``t`` right-aligned to ``ndim`` dims; 0 where a dim has size 1 (broadcast), all 0
    without a tensor (an absent operand)."""
    if t is None:
        return (0,) * ndim
    shape = (1,) * (ndim - t.dim()) + tuple(t.shape)
    stride = (0,) * (ndim - t.dim()) + tuple(t.stride())
    return tuple(0 if s == 1 else st for s, st in zip(shape, stride, strict=True))


def _u8(t: torch.Tensor | None) -> torch.Tensor | None:
    """fp8 data and e8m0 codes go to kernels as uint8, so masked loads can fill zeros
    (the interpreter cannot cast ``other=0`` to fp8); the kernel bitcasts them back."""
    if t is not None and t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.view(torch.uint8)
    return t


def per_expert_scale(t: torch.Tensor | None) -> torch.Tensor | None:
    """A global scale (NVFP4's, [E, 1, 1] or one value) as the kernels read it: fp32 [E] contiguous
    (a view where it already is one: no copy launch), or None."""
    return None if t is None else t.reshape(-1).float().contiguous()


def optional_ptrs(dummy: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Pointer arguments of a launch: an absent operand (None) passes ``dummy`` instead, which
    the kernel never reads (its constexpr says the operand is absent)."""
    return tuple(dummy if t is None else t for t in tensors)


@dataclass(frozen=True)
class RowBlocks:
    """The row blocks a grouped-GEMM launch walks and how it addresses per-row operands.

    Batched layout (no routing): [E, M_max, .] operands, ``blocks_per_expert`` blocks of BM rows
    for each expert (BM = 1: one per row). Standard layout: the aligned blocks of ``routing``
    (``num_m_blocks`` is their count, an upper bound of those in use) over [rows, .] operands,
    addressed as [1, rows, .] with an expert stride of 0.
    """

    batched: bool
    m_max: int  # batched: rows per expert (standard: 0)
    blocks_per_expert: int  # batched (standard: 0)
    num_m_blocks: int
    num_pairs: int  # standard: T*K (batched: 0)

    @classmethod
    def of(cls, a: torch.Tensor, e_l: int, block_m: int, routing: AlignedRouting | None) -> RowBlocks:
        if routing is None:
            m_max = a.shape[1]
            per_expert = cdiv(m_max, block_m)
            return cls(True, m_max, per_expert, e_l * per_expert, 0)
        return cls(False, 0, 0, routing.block_expert.numel(), routing.num_pairs)

    def strides(self, t: torch.Tensor) -> tuple[int, ...]:
        """``t``'s strides, the expert's first (0 for a standard-layout [rows, .] tensor)."""
        return t.stride() if self.batched else (0, *t.stride())

    def scale_strides(self, scale: torch.Tensor | None) -> tuple[int, ...]:
        """(expert, row, group) strides of an activation scale ([1, 1], [rows, 1] or [rows, G];
        batched [E, M_max, .]): 0 where it broadcasts, all 0 without one."""
        s = _strides(scale, 3 if self.batched else 2)
        return s if self.batched else (0, *s)

    def route_weights(self, w: torch.Tensor | None) -> tuple[torch.Tensor | None, tuple[int, int]]:
        """(weights, (expert, row) strides) of the router weights: batched [E, M_max] (0 where they
        broadcast); standard one per pair, read flat ([T, K] or [T*K])."""
        if w is None:
            return None, (0, 0)
        if self.batched:
            return w, _strides(w, 2)
        w = w.reshape(-1)
        return w, (0, w.stride(0))


def block_uniform(fmt: GemmFormat, block_n: int, n: int, act: ActEpilogue | None) -> bool:
    """Whether every accumulator of a tile BN output columns wide reads W rows of one W_BN x W_BK
    block row (so a K step has one weight scale, ``_grouped_gemm._mac``). A tile starts at a
    multiple of its W-row span (BN, or 2BN for interleaved gate/up pairs), so it stays inside one
    block when the span divides W_BN; the split layout's up rows start N rows further, so N must
    be a multiple of BN too. Only native w8a8 with block scales uses it (DeepSeek-V3's 128 x 128:
    every tile of BN 32-128)."""
    if not (fmt.native and fmt.w_bn > 0 and fmt.w_bk > 0):
        return False
    gated = act is not None and act.activation.is_gated
    span = 2 * block_n if gated and act.gate_up_interleaved else block_n
    return fmt.w_bn % span == 0 and not (gated and not act.gate_up_interleaved and n % block_n)


def shared_constexprs(
    fmt: GemmFormat,
    cfg: LaunchConfig,
    act: ActEpilogue | None,
    batched: bool,
    bias: torch.Tensor | None,
    route_weights: torch.Tensor | None,
    out_quant: str,
    n: int,
) -> dict:
    """The constexprs and launch options that both grouped-GEMM kernels (``_grouped_gemm``,
    ``_grouped_gemm_persistent``) take under the same names, from the same sources (``bias``
    and ``route_weights``: the launch's, or None; ``n``: C's columns)."""
    return {
        "BATCHED": batched,
        "A_FMT": fmt.a_fmt,
        "A_GROUP": fmt.a_group,
        "W_FMT": fmt.w_fmt,
        "W_BN": fmt.w_bn,
        "W_BK": fmt.w_bk,
        "W_UNIFORM": block_uniform(fmt, cfg.block_n, n, act),
        "NATIVE": fmt.native,
        "HAS_BIAS": bias is not None,
        "MUL_ROUTED_WEIGHT": route_weights is not None,
        "ACT": "none" if act is None else act.activation.value,
        "GATED": act is not None and act.activation.is_gated,
        "INTERLEAVED": act is not None and act.gate_up_interleaved,
        "OUT_QUANT": out_quant,
        "EXACT_CAST": interpreting(),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
