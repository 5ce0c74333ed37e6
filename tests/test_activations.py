"""``fusedmoe.activations``: the bounded SiLU gates and relu, by hand (the kernels are checked
against ``apply_activation`` for every ``Activation`` in tests/kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from fusedmoe.activations import apply_activation
from fusedmoe.config import Activation, MoEConfig


def _silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def _cap(v: float, c: float) -> float:
    return c * math.tanh(v / c)


GATE = [-9.0, -1.0, 0.5, 3.0, 9.0]
UP = [9.0, -0.25, 2.0, -9.0, 1.0]
L, A = 2.0, 5.0

BY_HAND = {
    Activation.SILU_CLAMP: lambda g, u: _silu(min(g, L)) * max(-L, min(u, L)),
    Activation.SILU_CLAMP_POST: lambda g, u: min(_silu(g), L) * max(-L, min(u, L)),
    Activation.SILU_SOFTCAP: lambda g, u: _cap(g, L) / (1 + math.exp(-g)) * _cap(u, A),
}


@pytest.mark.parametrize("act", list(BY_HAND), ids=lambda a: a.value)
def test_bounded_silu_gates_by_hand(act):
    config = MoEConfig(1, 1, 8, len(GATE), activation=act, swiglu_limit=L, swiglu_alpha=A)
    h = torch.tensor([GATE + UP], dtype=torch.float64)
    want = torch.tensor([[BY_HAND[act](g, u) for g, u in zip(GATE, UP, strict=True)]], dtype=torch.float64)
    torch.testing.assert_close(apply_activation(h, config), want, rtol=1e-12, atol=1e-12)


def test_relu_no_mul_by_hand():
    config = MoEConfig(1, 1, 8, 3, activation=Activation.RELU_NO_MUL)
    h = torch.tensor([[-1.0, 0.0, 2.5]])
    assert torch.equal(apply_activation(h, config), torch.tensor([[0.0, 0.0, 2.5]]))
    assert torch.isnan(apply_activation(torch.tensor([[float("nan")] * 3]), config)).all()  # NaN stays NaN
