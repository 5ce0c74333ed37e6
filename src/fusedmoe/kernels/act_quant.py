"""Dynamic activation quantization, alone or fused with the activation between the GEMMs.

    quantize_activations(x [M, K], tq)         -> QTensor   (the GEMM1 input)
    act_and_quantize(h [M, 2I], config, tq)    -> QTensor   (the GEMM2 input)
                                               -> [M, I] in the model dtype when tq is None

Formats (as ``fusedmoe.quant`` stores them; the kernels produce the same bytes on a GPU):

    fp8 / int8, tensor (dynamic, or static with a given scale), token, group(g)
    mxfp8   e4m3 [M, K] + e8m0 uint8 [M, K/32]
    nvfp4   packed e2m1 uint8 [M, K/2] + e4m3 [M, K/16], over a *given* fp32 global scale

Fusing the activation saves writing and re-reading the [M, I] intermediate in the
model dtype (2 bytes per element each way) and one launch. The references are
``fusedmoe.quant.quantize`` and ``fusedmoe.activations.apply_activation`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..activations import apply_activation
from ..config import Activation, MoEConfig
from ..errors import expect
from ..quant import QDtype, QTensor, TensorQuant, quantize
from ..quant.linear import FP8_MAX, INT8_MAX
from ._act_quant import _act_quant_kernel
from ._common import cdiv, interpreting, next_power_of_2
from .launch import launch

_QUANT = {QDtype.FP8: "fp8", QDtype.INT8: "int8", QDtype.MXFP8: "mxfp8", QDtype.NVFP4: "nvfp4"}
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Per-tensor dynamic scales of a tensor that one tile of at most this many values holds take one
# program and one launch (PASS 0) instead of a memset and two launches over a grid. One tile, so
# that nothing loops: with [8, 512] tiles looping (x [1, 7168] took 14 serial loads a
# sweep, ~1.3 us each) the fp8 per-tensor layer at T = 1 measured slower on an H100
# (2026-11-28: Qwen3-30B-A3B 56.6 -> 65.5 us, Mixtral 176.6 -> 205.2, DeepSeek-V3 179.2 ->
# 227.5, CUDA graphs). At T = 1: Qwen3-30B-A3B's x [1, 2048] and a2 [8, 768] (tile [8, 1024]),
# Mixtral's x [1, 4096], DeepSeek-V3's x [1, 7168] (tile [1, 8192]).
_ONE_PROGRAM_MAX = 8192


def _one_program_tile(m: int, cols: int) -> tuple[int, int] | None:
    """(BM, BK) of the one tile that holds [m, cols], or None when it exceeds ``_ONE_PROGRAM_MAX``."""
    bm, bk = next_power_of_2(m), next_power_of_2(cols)
    return (bm, bk) if bm * bk <= _ONE_PROGRAM_MAX else None


def _tiles(scale_kind: str, group: int, m: int) -> tuple[int, int]:
    """(BM, BK). Memory-bound: a GPU program moves 8 x 256 values (4 KiB of bf16 in), or
    with fewer rows (decode: x at T = 1) a row of 512, not a tile of padding rows; the
    interpreter pays ~5 ms per program, so it takes whole tiny problems at once."""
    if interpreting():
        bm, bk = 32, 128
    else:
        bm, bk = (4, 512) if scale_kind == "token" else (8, 256)
        rows = next_power_of_2(max(m, 1))
        if rows < bm:
            bm, bk = rows, 512
    if group:
        bk = max(bk, group)
    return bm, bk


def one_pass(rows: int, cols: int, tq: TensorQuant | None, scale: torch.Tensor | None = None) -> bool:
    """Whether quantizing [rows, cols] as ``tq`` takes at most one launch (``plan_act_quant``'s
    passes), known before anything is allocated: all but a per-tensor dynamic scale of more than
    one tile (``_one_program_tile``)."""
    return _kind(tq, scale)[1] != "tensor_dyn" or _one_program_tile(rows, cols) is not None


def _kind(tq: TensorQuant | None, scale: torch.Tensor | None) -> tuple[str, str, int]:
    """(quant, scale kind, group) of the kernel for ``tq``."""
    if tq is None:
        return "none", "none", 0
    expect(tq.dtype in _QUANT, "tq.dtype", f"one of {list(_QUANT)} for activations", tq.dtype)
    quant = _QUANT[tq.dtype]
    g = tq.granularity
    if quant in ("mxfp8", "nvfp4"):
        return quant, "group", g.group_size
    if g.kind == "tensor":
        if not tq.dynamic:
            expect(scale is not None, "scale", f"a static scale for {tq.short}")
            return quant, "tensor_static", 0
        return quant, "tensor_dyn", 0
    if g.kind == "token":
        return quant, "token", 0
    expect(g.kind == "group", "tq.granularity", "tensor, token or group for activations", g)
    gs = g.group_size
    expect(gs >= 2 and gs & (gs - 1) == 0, "group size", "a power of 2 for the kernel", gs)
    return quant, "group", gs


@dataclass(frozen=True)
class ActQuantLaunch:
    """What ``act_quant_launch`` launches, worked out and allocated but not launched: the grid, the
    kernel's arguments and constexprs, the passes (``PASS``: (0,) one program, (1, 2) abs-max then
    codes, (2,) codes; () nothing to launch) and the result the launches fill. ``launch()`` runs them;
    the routing launch can run a one-pass one beside its own programs (``route.route_launch``)."""

    grid: tuple[int, int]
    args: tuple
    meta: dict
    passes: tuple[int, ...]
    result: QTensor | torch.Tensor

    def launch(self) -> QTensor | torch.Tensor:
        for p in self.passes:
            launch(_act_quant_kernel, self.grid, *self.args, PASS=p, **self.meta)
        return self.result

    def warps_for(self, values_per_thread: int) -> int:
        """The fewest warps (a power of 2) that hold a program's tile at ``values_per_thread``."""
        values = self.meta["BLOCK_M"] * self.meta["BLOCK_K"]
        return next_power_of_2(max(1, cdiv(values, 32 * values_per_thread)))


def act_quant_launch(x: torch.Tensor, tq: TensorQuant | None, **kwargs) -> QTensor | torch.Tensor:
    """``plan_act_quant(x, tq, ...).launch()``: quantize now (the keyword arguments are ``plan_act_quant``'s)."""
    return plan_act_quant(x, tq, **kwargs).launch()


def plan_act_quant(
    x: torch.Tensor,
    tq: TensorQuant | None,
    *,
    activation: str = "none",
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: QTensor | torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> ActQuantLaunch:
    """The launches of ``_act_quant_kernel`` that quantize ``x`` (``ActQuantLaunch``; its result
    allocated unless ``out`` is given): two for per-tensor dynamic scales, or one, one program,
    where one tile holds the tensor (``_one_program_tile``); one over the grid where ``amax`` is
    given, and for every other kind.

    ``activation`` is an ``Activation`` value or "none" (plain quantization of ``x``).
    ``out``: buffers to write (what this function returns; allocated when None).
    ``row_mask``: bool [M], the rows to compute; the others are neither read nor written
    (their output rows keep whatever they held) and a per-tensor dynamic scale covers only
    the rows computed.
    ``amax``: a per-tensor dynamic scale's abs-max of ``x``, already there (fp32 [1], as the first
    pass leaves it; raised by GEMM1's epilogue, ``ActEpilogue.track_amax``, or its int32 per-program
    slots, ``amax_slots``): only the codes pass runs.
    """
    # 97 lines: maps every tensor to the kernel's pointers, strides and constexprs in its argument order; split, that
    # order would be spread over several functions.
    expect(x.dim() == 2, "x", "a [M, K] tensor", tuple(x.shape))
    expect(x.dtype in _NATIVE_DTYPES, "x", f"one of {_NATIVE_DTYPES}", x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gated = activation != "none" and Activation(activation).is_gated
    m, cols = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    if gated:
        expect(x.shape[1] % 2 == 0, "x", "an even number of columns [M, 2I] for a gated activation", x.shape)
    if row_mask is not None:
        expect(tuple(row_mask.shape) == (m,) and row_mask.dtype == torch.bool, "row_mask", f"bool [{m}]", row_mask)
    quant, kind, group = _kind(tq, scale)
    if amax is not None:
        expect(kind == "tensor_dyn", "amax", "given only for a per-tensor dynamic scale", tq)
        amax = known_amax(amax)
    dev = x.device
    data_dtype = {"none": out_dtype or x.dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
    data_dtype.update(mxfp8=torch.float8_e4m3fn, nvfp4=torch.uint8)
    if quant in ("mxfp8", "nvfp4"):
        expect(cols % group == 0, "x", f"a multiple of {group} columns for {quant}", cols)
    data_shape = (m, cols // 2 if quant == "nvfp4" else cols)
    data = torch.empty(data_shape, dtype=data_dtype[quant], device=dev) if out is None else _data(out)
    expect(
        tuple(data.shape) == data_shape and data.dtype == data_dtype[quant],
        "out",
        f"{data_shape} {data_dtype[quant]}",
        data,
    )
    gscale = None
    if quant == "nvfp4":
        expect(global_scale is not None, "global_scale", "the static fp32 global scale of nvfp4 activations")
        gscale = global_scale.reshape(1).float().contiguous()
    if quant == "none":
        s_out = None
    elif kind == "tensor_static":
        s_out = scale.reshape(1, 1).float().contiguous()  # read, not written
    else:
        s_dtype = {"mxfp8": torch.uint8, "nvfp4": torch.float8_e4m3fn}.get(quant, torch.float32)
        s_shape = {"tensor_dyn": (1, 1), "token": (m, 1)}.get(kind, (m, cdiv(cols, max(group, 1))))
        s_out = torch.empty(s_shape, dtype=s_dtype, device=dev) if out is None else out.scale
        expect(tuple(s_out.shape) == s_shape and s_out.dtype == s_dtype, "out.scale", f"{s_shape} {s_dtype}", s_out)
    if (m == 0 or cols == 0) and kind == "tensor_dyn":
        # no launch writes the scale: the amax of nothing is 0, whose scale is 1 (quant.linear),
        # or the one given
        if amax is None:
            s_out.fill_(1.0)
        else:
            s_out.copy_(scale_of_amax(amax, tq))
    grid, args, meta, passes = (1, 1), (), {}, ()
    if m > 0 and cols > 0:
        known = amax is not None
        tile = _one_program_tile(m, cols) if kind == "tensor_dyn" and not known else None
        one = tile is not None
        bm, bk = tile if one else _tiles(kind, group, m)
        grid = (1, 1) if one else (cdiv(m, bm), 1 if kind == "token" else cdiv(cols, bk))
        if not known:
            amax = torch.zeros(1, dtype=torch.float32, device=dev) if kind == "tensor_dyn" and not one else data
        s_arg = data if s_out is None else s_out.view(torch.uint8) if s_out.dtype == torch.float8_e4m3fn else s_out
        q_arg = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
        args = (
            x,
            q_arg,
            s_arg,
            data if gscale is None else gscale,
            amax,
            data if row_mask is None else row_mask.view(torch.uint8),
            m,
            cols,
            x.stride(0),
            q_arg.stride(0),
            0 if s_out is None or s_out.shape[0] == 1 else s_out.stride(0),
            amax.numel() if known else 1,
            alpha,
            limit,
        )
        meta = dict(
            ACT=activation,
            INTERLEAVED=interleaved,
            QUANT=quant,
            SCALE=kind,
            GROUP=group,
            ROW_MASK=row_mask is not None,
            EXACT_CAST=interpreting(),
            BLOCK_M=bm,
            BLOCK_K=bk,
            num_warps=8 if bm * bk > 4096 else 4,  # a one-program tile: <= 32 values a thread
        )
        passes = (0,) if one else (1, 2) if kind == "tensor_dyn" and not known else (2,)
    if quant == "none":
        result = data
    else:
        gs = None if gscale is None else gscale.reshape(1, 1)
        result = QTensor(data=data, shape=(m, cols), scale=s_out, global_scale=gs)
    return ActQuantLaunch(grid, args, meta, passes, result)


def _data(out: QTensor | torch.Tensor) -> torch.Tensor:
    return out.data if isinstance(out, QTensor) else out


def _fill(out: QTensor | torch.Tensor | None, res: QTensor | torch.Tensor) -> QTensor | torch.Tensor:
    """Copy a reference result into caller-given buffers (the CPU path honours ``out``)."""
    if out is None:
        return res
    if isinstance(res, torch.Tensor):
        return out.copy_(res)
    out.data.copy_(res.data)
    if out.scale is not None and out.scale.shape == res.scale.shape:
        out.scale.copy_(res.scale)
        return QTensor(out.data, res.shape, scale=out.scale, global_scale=res.global_scale)
    return QTensor(out.data, res.shape, scale=res.scale, global_scale=res.global_scale)


def known_amax(amax: torch.Tensor | None, name: str = "amax") -> torch.Tensor:
    """A known abs-max as the kernels read it, int32 |bits| (checked and viewed, not copied): the
    fp32 [1] that a first pass or GEMM1's "amax" epilogue raised, or the int32 [n] slots of an
    "amax_slots" one (``gemm_format.ActEpilogue``)."""
    ok = amax is not None and amax.dim() == 1 and amax.is_contiguous() and amax.numel() >= 1
    ok = ok and (amax.dtype == torch.int32 or (amax.dtype == torch.float32 and amax.numel() == 1))
    expect(ok, name, "an fp32 [1] abs-max or int32 [n] abs-max slots (ActEpilogue.amax_slots)", amax)
    return amax.view(torch.int32)


def amax_value(amax: torch.Tensor) -> torch.Tensor:
    """A known abs-max as fp32 [1]: the fp32 [1] itself, or the max of int32 |bits| slots."""
    if amax.dtype == torch.int32:
        return amax.reshape(-1).max().reshape(1).view(torch.float32)
    return amax.reshape(1).float()


def scale_of_amax(amax: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """The [1, 1] per-tensor scale a known abs-max (``amax_value``) gives, as the kernels make it
    (quant.linear's rule: amax / qmax, 1 for 0, NaN kept)."""
    a = amax_value(amax).reshape(1, 1)
    s = a / (FP8_MAX if tq.dtype is QDtype.FP8 else INT8_MAX)
    return torch.where(a > 0, s, torch.where(a.isnan(), a, torch.ones_like(a)))


def _use_kernel(x: torch.Tensor) -> bool:
    return x.device.type != "cpu" or interpreting()


def quantize_activations(
    x: torch.Tensor,
    tq: TensorQuant,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    out: QTensor | None = None,
    row_mask: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> QTensor:
    """Quantize rows ``x`` [M, K] as ``tq`` says (dynamic scales computed on the device).

    ``scale``: the static per-tensor scale when ``tq`` is not dynamic; ``global_scale``:
    the NVFP4 global scale (required for nvfp4); ``out``: buffers to fill; ``row_mask``
    (bool [M]): only these rows are read and written; ``amax``: a per-tensor dynamic
    scale's abs-max, already known (``act_quant_launch``). On the CPU without the
    interpreter this is ``quantize_activations_ref``.
    """
    if not _use_kernel(x):
        if amax is not None:  # act_quant_launch checks it on the kernel path
            scale, tq = scale_of_amax(known_amax(amax), tq), replace(tq, dynamic=False)
        ref = quantize_activations_ref(_zero_masked(x, row_mask), tq, scale=scale, global_scale=global_scale)
        return _fill(out, ref)
    return act_quant_launch(x, tq, scale=scale, global_scale=global_scale, out=out, row_mask=row_mask, amax=amax)


def _zero_masked(x: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    """The reference's stand-in for a row mask: zeros leave a per-tensor abs-max as the kernel's
    skipped rows do (the masked rows of the result are not to be read)."""
    return x if row_mask is None else x.masked_fill(~row_mask.unsqueeze(1), 0)


def quantize_activations_ref(
    x: torch.Tensor,
    tq: TensorQuant,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> QTensor:
    """``fusedmoe.quant.quantize`` with the scales a kernel would use."""
    static = {}
    if scale is not None and not tq.dynamic:
        static["scale"] = scale
    if global_scale is not None:
        static["global_scale"] = global_scale
    return quantize(x, tq, **static)


def act_and_quantize(
    h: torch.Tensor,
    config: MoEConfig,
    tq: TensorQuant | None,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    out: QTensor | torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
) -> QTensor | torch.Tensor:
    """``config.activation`` of GEMM1's output ``h`` [M, 2I] (or [M, I] for *_no_mul), then
    quantized as ``tq`` (the scheme's a2) says; with ``tq`` None, [M, I] in ``config.dtype``.

    The activation runs in fp32 and is quantized without an intermediate rounding to
    the model dtype. ``row_mask`` (bool [M]): only these rows are computed (``act_quant_launch``).
    """
    if not _use_kernel(h):
        return _fill(
            out, act_and_quantize_ref(_zero_masked(h, row_mask), config, tq, scale=scale, global_scale=global_scale)
        )
    return act_quant_launch(
        h,
        tq,
        activation=config.activation.value,
        interleaved=config.gate_up_interleaved,
        alpha=config.swiglu_alpha,
        limit=config.swiglu_limit,
        scale=scale,
        global_scale=global_scale,
        out_dtype=config.dtype,
        out=out,
        row_mask=row_mask,
    )


def act_and_quantize_ref(
    h: torch.Tensor,
    config: MoEConfig,
    tq: TensorQuant | None,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> QTensor | torch.Tensor:
    """``apply_activation`` in fp32, then ``quantize_activations_ref`` (or a cast to the model dtype)."""
    a = apply_activation(h.float(), config)
    if tq is None:
        return a.to(config.dtype)
    return quantize_activations_ref(a, tq, scale=scale, global_scale=global_scale)
