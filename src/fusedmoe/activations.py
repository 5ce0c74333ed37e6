"""The activation between the two expert GEMMs, in PyTorch.

``apply_activation(h, config)`` maps GEMM1's output h [M, 2I] (gated) or
[M, I] (no_mul) to [M, I]. It is the one definition that the reference, the
cpu backend and the kernel tests share.

swigluoai (gpt-oss), with alpha = 1.702 and limit = 7.0 by default::

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

The other bounded SiLU gates (``MoEConfig.swiglu_limit`` = L, ``swiglu_alpha`` = A)::

    silu_clamp       silu(min(gate, L)) * clamp(up, -L, L)
    silu_clamp_post  min(silu(gate), L) * clamp(up, -L, L)
    silu_softcap     L tanh(gate / L) * sigmoid(gate) * A tanh(up / A)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Activation, MoEConfig


def split_gate_up(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, 2I] -> (gate [M, I], up [M, I])."""
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    i = h.shape[-1] // 2
    return h[..., :i], h[..., i:]


def apply_activation(h: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    act = config.activation
    if not act.is_gated:
        if act is Activation.SILU_NO_MUL:
            return F.silu(h)
        if act is Activation.GELU_NO_MUL:
            return F.gelu(h)
        if act is Activation.RELU_NO_MUL:
            return F.relu(h)
        return torch.square(F.relu(h))  # RELU2_NO_MUL
    gate, up = split_gate_up(h, config.gate_up_interleaved)
    if act is Activation.SILU:
        return F.silu(gate) * up
    if act is Activation.GELU:
        return F.gelu(gate) * up
    if act is Activation.GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    lim = config.swiglu_limit
    if act is Activation.SILU_CLAMP:
        return F.silu(gate.clamp(max=lim)) * up.clamp(-lim, lim)
    if act is Activation.SILU_CLAMP_POST:
        return F.silu(gate).clamp(max=lim) * up.clamp(-lim, lim)
    if act is Activation.SILU_SOFTCAP:
        cap = config.swiglu_alpha
        return lim * torch.tanh(gate / lim) * torch.sigmoid(gate) * (cap * torch.tanh(up / cap))
    # SWIGLUOAI
    gate = gate.clamp(max=lim)
    up = up.clamp(-lim, lim)
    return (up + 1) * gate * torch.sigmoid(config.swiglu_alpha * gate)
