"""Every cell a backend claims runs and matches the reference; every refusal names its reason.

The cells come from the capability declarations (the same ones ``fusedmoe
features`` prints), so a claim cannot be added without being tested here.
Every backend gets the full product (dispatcher x experts x scheme x
activation); the Triton ones run under the interpreter at about a second a cell.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.api import fused_moe
from fusedmoe.config import Activation, MoEConfig
from fusedmoe.errors import UnsupportedError
from fusedmoe.oracle.registry import dispatchers, experts_backends
from fusedmoe.platform import current_platform
from fusedmoe.quant import all_schemes
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

PLATFORM = current_platform()
SCHEMES = {s.name: s for s in all_schemes()}


def _config(act: Activation) -> MoEConfig:
    # H, I multiples of 128 so every group/block scheme applies; E prime, T*K odd.
    return MoEConfig(
        5,
        2,
        128,
        128,
        activation=act,
        has_bias=act is Activation.SWIGLUOAI,
        gate_up_interleaved=act is Activation.SWIGLUOAI,
    )


def _cells():
    cells, refusals = [], []
    for dname, dcls in sorted(dispatchers().items()):
        if dcls.why_not(PLATFORM) is not None or dcls.distributed:
            continue
        for ename, ecls in sorted(experts_backends().items()):
            if ecls.layout is not dcls.layout:
                continue
            for sname, scheme in SCHEMES.items():
                for act in Activation:
                    why = ecls.why_not(_config(act), scheme, PLATFORM, layout=dcls.layout)
                    cell = (dname, ename, sname, act.value)
                    (cells if why is None else refusals).append((cell, why))
    return [c for c, _ in cells], refusals


CELLS, REFUSALS = _cells()


def test_claimed_cells_exist():
    # the CPU platform always has the reference and cpu backends on both layouts
    names = {(d, e) for d, e, _, _ in CELLS}
    assert ("local", "reference") in names and ("local", "cpu") in names
    assert ("local_batched", "reference_batched") in names


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_claimed_cell_matches_reference(cell):
    dname, ename, sname, act = cell
    scheme = SCHEMES[sname]
    config = _config(Activation(act))
    seed = hash(cell) % 1000  # fresh inputs per run (str hashes are salted per process)
    prob = make_problem(config, scheme, 7, seed=seed)
    ref = prob.reference()
    out = fused_moe(
        prob.x, (prob.topk_ids, prob.topk_weights), prob.weights, config, scheme, backend=ename, dispatcher=dname
    )
    err = rel_error(out, ref)
    assert err <= tolerance(scheme, config.dtype), f"{cell} seed {seed}: rel. error {err:.3e}"


# one refusal per (experts, reason) is enough to show the message; all are listed
_SEEN = {}
for _cell, _why in REFUSALS:
    _SEEN.setdefault((_cell[1], _why), _cell)
REFUSAL_CASES = [(c, w) for (_, w), c in _SEEN.items()]


@pytest.mark.parametrize("cell,why", REFUSAL_CASES, ids=[f"{c[1]}-{c[2]}-{c[3]}" for c, _ in REFUSAL_CASES])
def test_unclaimed_cell_is_refused_with_reason(cell, why):
    dname, ename, sname, act = cell
    scheme = SCHEMES[sname]
    config = _config(Activation(act))
    x = torch.randn(3, config.hidden_size).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [3, 4]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    with pytest.raises(UnsupportedError) as e:
        fused_moe(x, (ids, w), None, config, scheme, backend=ename, dispatcher=dname)
    assert why in str(e.value) and ename in str(e.value)


def test_poisoned_output_is_fully_written():
    """The kernel writes every element of its output (never returns a stale buffer)."""
    from fusedmoe.dispatch.local import LocalDispatcher
    from fusedmoe.experts.cpu import CpuExperts
    from fusedmoe.metadata import TopK
    from fusedmoe.quant import QTensor

    config = _config(Activation.SILU)
    scheme = SCHEMES["bf16"]
    prob = make_problem(config, scheme, 9, seed=5)
    d = LocalDispatcher(config, scheme).dispatch(prob.x, TopK(prob.topk_ids, prob.topk_weights), prob.weights)
    out = poison_(torch.empty(9, config.hidden_size, dtype=config.dtype))
    CpuExperts(config, scheme).apply(QTensor(d.a.data, d.a.shape), d.topk, prob.weights, out)
    assert torch.isfinite(out).all()
