"""Round H and I up to what a backend needs, once, with zeros that leave the output unchanged.

A backend declares ``align = (h_multiple, i_multiple)`` (``Experts.alignment``);
the oracle's ``Choice`` carries the padded sizes. The layer then, once after
loading (never per call):

    weights = pad_weights(weights, config, scheme, choice.align)   # reference layout
    config  = padded_config(config, choice.align)
    weights = experts.prepare_weights(weights)                     # backend layout

and per call pads x [T, H] -> [T, Hp] with zeros (``pad_hidden``) and keeps
out[:, :H].

Why the output is unchanged (tested exactly against the float64 reference):
the new input columns of W13 meet zero columns of x; the new gate and up rows
of W13 (and their biases) are zero, so their activation is act(0, 0) = 0 for
every activation fusedmoe has (silu(0)*0, gelu(0)*0, (0+1)*0*sigmoid(0), the
clamped and capped SiLU gates' 0, silu(0), gelu(0), relu(0), relu(0)^2); the new columns of W2 are zero anyway; the new
output rows of W2 (and of b2) are zero and are cut off. Zeros never change an
abs-max, so dynamic activation scales (tensor, token, group) stay the same.

Quantized weights are padded in their stored form, with the codes, scales and
zero points that quantizing zeros gives (fp8/int8/e2m1 code 0, int4 code 8 with
zero point 8): no weight is requantized. Gate and up rows of W13 [gate; up] move
apart (up rows to Ip..Ip+I-1); with block scales that works only when I is a
multiple of the block's rows, which real block-fp8 checkpoints are (else an
error says so). Interleaved (gpt-oss) and non-gated W13 keep every row in place.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from ..errors import expect
from ..quant import Granularity, QTensor, QuantScheme, TensorQuant, quantize
from ..weights import ExpertWeights


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_sizes(config: MoEConfig, align: tuple[int, int]) -> tuple[int, int]:
    """(Hp, Ip): H and I rounded up to ``align`` = (h_multiple, i_multiple)."""
    return round_up(config.hidden_size, align[0]), round_up(config.intermediate_size, align[1])


def padded_config(config: MoEConfig, align: tuple[int, int]) -> MoEConfig:
    hp, ip = padded_sizes(config, align)
    return config.replace(hidden_size=hp, intermediate_size=ip)


def pad_hidden(x: torch.Tensor, hidden_padded: int) -> torch.Tensor:
    """x [..., H] -> [..., Hp] with zero columns (x itself when H == Hp)."""
    extra = hidden_padded - x.shape[-1]
    return x if extra == 0 else F.pad(x, (0, extra))


def _w13_rows(config: MoEConfig, ip: int) -> torch.Tensor:
    """Where each W13 row goes when I becomes ``ip``: up rows move to ip.., others stay."""
    i = config.intermediate_size
    r = torch.arange(config.w13_rows)
    if config.activation.is_gated and not config.gate_up_interleaved:
        return torch.where(r < i, r, r + (ip - i))
    return r


def _bits(t: torch.Tensor) -> torch.Tensor:
    # index_put / full are not implemented for float8 on every device: move bytes instead
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _place(t: torch.Tensor, dim: int, dst: torch.Tensor, size: int, fill: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` with ``size`` entries along ``dim``: ``fill`` everywhere, ``t`` at ``dst``."""
    src = _bits(t)
    shape = list(src.shape)
    shape[dim] = size
    out = _bits(fill.to(t.device)).reshape([1] * len(shape)).expand(shape).clone()
    out.index_copy_(dim, dst.to(t.device), src)
    return out.view(t.dtype) if out.dtype != t.dtype else out


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    src = _bits(t)
    out = src.index_select(dim, idx.to(t.device))
    return out.view(t.dtype) if out.dtype != t.dtype else out


def _fills(tq: TensorQuant, device) -> dict[str, torch.Tensor]:
    """Stored values of a quantized zero: data byte, scale, zero point (what padding writes)."""
    g = tq.granularity
    rows = g.block_n if g.kind == "block" else 1
    cols = max(32, g.group_size, g.block_k)
    x = torch.zeros(1, rows, cols)
    gi = (torch.arange(cols) // g.group_size).to(torch.int32).reshape(1, -1) if tq.act_order else None
    q = quantize(x, tq, g_idx=gi)
    out = {"data": q.data.reshape(-1)[0]}
    if q.scale is not None:
        out["scale"] = q.scale.reshape(-1)[0]
    if q.zero is not None:
        out["zero"] = q.zero.reshape(-1)[0]
    return {k: v.to(device) for k, v in out.items()}


def _block_rows(dst: torch.Tensor, bn: int, what: str) -> torch.Tensor:
    """Destination block of each source block of ``bn`` rows; rows must move in whole blocks."""
    src = torch.arange(dst.numel())
    blocks = dst[::bn] // bn
    ok = bool(((dst // bn) == blocks[src // bn]).all() and ((dst % bn) == (src % bn)).all())
    expect(ok, what, f"rows that move in whole blocks of {bn} (block scales move with them)", None)
    return blocks


def _map_scales(q: QTensor, g: Granularity, move) -> dict[str, torch.Tensor | None]:
    """{'scale', 'zero'} of ``q``: ``move(name, s)`` of each grouped one; absent and per-tensor
    ones (nothing to move with the rows) as they are."""
    out = {}
    for name in ("scale", "zero"):
        s = getattr(q, name)
        out[name] = s if s is None or g.kind == "tensor" else move(name, s)
    return out


def _pad_q(q: QTensor, tq: TensorQuant | None, dst: torch.Tensor, n_new: int, k_new: int, what: str) -> QTensor:
    """Place rows of ``q`` [E, N, K] at ``dst`` of n_new rows and widen K to k_new, in stored form."""
    e, n, k = q.shape
    if tq is None:
        zero = torch.zeros((), dtype=q.data.dtype)
        data = _place(q.data, 1, dst, n_new, zero)
        return QTensor(F.pad(data, (0, k_new - k)), (e, n_new, k_new))
    fills = _fills(tq, q.data.device)
    per_byte = k // q.data.shape[-1]  # 2 for packed 4-bit formats
    data = _place(q.data, 1, dst, n_new, fills["data"])
    data = _place(data, 2, torch.arange(q.data.shape[-1]), k_new // per_byte, fills["data"])
    g = tq.granularity

    def move(name, s):
        if g.kind == "block":
            s = _place(s, 1, _block_rows(dst, g.block_n, what), -(-n_new // g.block_n), fills[name])
        else:
            s = _place(s, 1, dst, n_new, fills[name])
        cols = {"group": -(-k_new // max(g.group_size, 1)), "block": -(-k_new // max(g.block_k, 1))}.get(g.kind, 1)
        return _place(s, 2, torch.arange(s.shape[-1]), cols, fills[name])

    extra = _map_scales(q, g, move)
    if q.zero is not None and k_new > k:
        expect(k % g.group_size == 0, what, "zero points only with whole new groups (K a multiple of the group)", k)
    g_idx = q.g_idx
    if g_idx is not None and k_new > k:
        new = k // g.group_size + torch.arange(k_new - k, device=g_idx.device) // g.group_size
        g_idx = torch.cat([g_idx, new.to(g_idx.dtype).expand(e, -1)], dim=-1)
    return QTensor(data, (e, n_new, k_new), extra["scale"], extra["zero"], q.global_scale, g_idx)


def _unpad_q(q: QTensor, tq: TensorQuant | None, rows: torch.Tensor, k: int) -> QTensor:
    e, n_pad, k_pad = q.shape
    n = rows.numel()
    per_byte = k_pad // q.data.shape[-1]
    data = _take(q.data, 1, rows)[..., : k // per_byte]
    if tq is None:
        return QTensor(data.contiguous(), (e, n, k))
    g = tq.granularity

    def move(name, s):
        if g.kind == "block":
            return _take(s, 1, rows[:: g.block_n] // g.block_n)[..., : -(-k // g.block_k)].contiguous()
        s = _take(s, 1, rows)
        return (s[..., : -(-k // g.group_size)] if g.kind == "group" else s).contiguous()

    extra = _map_scales(q, g, move)
    g_idx = None if q.g_idx is None else q.g_idx[..., :k].contiguous()
    return QTensor(data.contiguous(), (e, n, k), extra["scale"], extra["zero"], q.global_scale, g_idx)


def pad_weights(
    weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme, align: tuple[int, int]
) -> ExpertWeights:
    """Weights of ``config`` padded to ``padded_config(config, align)`` (the same object if no padding)."""
    expect(weights.layout == "reference", "weights.layout", "'reference' (pad before converting)", weights.layout)
    h, i = config.hidden_size, config.intermediate_size
    hp, ip = padded_sizes(config, align)
    if (hp, ip) == (h, i):
        return weights
    rows13 = _w13_rows(config, ip)
    n13 = padded_config(config, align).w13_rows
    w13 = _pad_q(weights.w13, scheme.w1, rows13, n13, hp, "weights.w13")
    w2 = _pad_q(weights.w2, scheme.w2, torch.arange(h), hp, ip, "weights.w2")
    b13 = b2 = None
    if weights.b13 is not None:
        b13 = _place(weights.b13, 1, rows13, n13, torch.zeros((), dtype=weights.b13.dtype))
        b2 = F.pad(weights.b2, (0, hp - h))
    return replace(weights, w13=w13, w2=w2, b13=b13, b2=b2)


def unpad_weights(weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme) -> ExpertWeights:
    """The inverse of ``pad_weights``: back to ``config``'s (unpadded) sizes, exactly."""
    h, i = config.hidden_size, config.intermediate_size
    hp, ip = weights.w13.shape[-1], weights.w2.shape[-1]
    if (hp, ip) == (h, i):
        return weights
    rows13 = _w13_rows(config, ip)
    w13 = _unpad_q(weights.w13, scheme.w1, rows13, h)
    w2 = _unpad_q(weights.w2, scheme.w2, torch.arange(h), i)
    b13 = b2 = None
    if weights.b13 is not None:
        b13 = _take(weights.b13, 1, rows13).contiguous()
        b2 = weights.b2[..., :h].contiguous()
    return replace(weights, w13=w13, w2=w2, b13=b13, b2=b2)
