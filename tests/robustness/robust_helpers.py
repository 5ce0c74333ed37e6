"""What the robustness cases share: the labels, the two verdicts, the dropped-pair reference.

A case ends in one of two verdicts, nothing else:

- ``raises_clearly``: a ``FusedMoEError`` (or subclass) whose message names the argument (or
  checkpoint key, file, variable) and says what was expected;
- ``equals_reference``: a finite result within ``fusedmoe.testing.tolerance`` of the float64
  reference (``moe_reference``).

``dropped_reference`` builds the reference of a routing with pairs that contribute nothing
(ids outside [0, E), experts mapped outside [0, E_local)) without the code that drops them:
each such pair is replaced by a valid expert with router weight 0, whose contribution is 0.
"""

from __future__ import annotations

import re

import pytest
import torch

from fusedmoe import FusedMoEError, MoEConfig, QuantScheme
from fusedmoe.experts.reference import moe_reference
from fusedmoe.testing import make_problem, rel_error, tolerance

# E=4, K=2, H=64, I=32: every format stores it (groups of 32), and under the Triton
# interpreter one GEMM is a handful of programs.
CFG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
T = 6


def robust(cls: int | str, kind: str):
    """The label of a case: the issue class it covers and its verdict ('error' or 'reference')."""
    return pytest.mark.robust(str(cls), kind)


def raises_clearly(fn, *names: str, exc: type[BaseException] = FusedMoEError) -> str:
    """Run ``fn``; it must raise ``exc`` whose message names each of ``names`` and says 'expected'."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for n in names:
        assert n in msg, f"message does not name {n!r}: {msg}"
    assert re.search(r"expected", msg), f"message does not say what was expected: {msg}"
    return msg


def equals_reference(out: torch.Tensor, ref: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    err, tol = rel_error(out, ref), tolerance(scheme, dtype)
    assert err <= tol, f"relative error {err:.3e} > tolerance {tol:.1e}"


def problem(scheme: QuantScheme | str = "bf16", config: MoEConfig = CFG, t: int = T, **kw):
    scheme = QuantScheme.by_name(scheme) if isinstance(scheme, str) else scheme
    return make_problem(config, scheme, t, seed=3, **kw)


def dropped_reference(prob, ids, weights, expert_map=None, num_local=None) -> torch.Tensor:
    """float64 reference of routing (``ids``, ``weights``) where pairs outside [0, E) or mapped
    outside [0, num_local) count nothing: each is replaced by a valid expert with weight 0."""
    e = prob.config.num_experts
    ids = ids.long()
    valid = (ids >= 0) & (ids < e)
    fill = 0
    if expert_map is not None:
        local = expert_map.long()[ids.clamp(0, e - 1)]
        valid &= (local >= 0) & (local < num_local)
        fill = int(((expert_map >= 0) & (expert_map < num_local)).nonzero()[0, 0])
    ids_ok = torch.where(valid, ids, fill).to(torch.int32)
    w_ok = torch.where(valid, weights, torch.zeros_like(weights))
    return moe_reference(prob.x, ids_ok, w_ok, prob.weights, prob.config, prob.scheme, expert_map=expert_map)
