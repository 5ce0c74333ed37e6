"""``triton_or_grouped_mm``: the per-call choice between triton and grouped_mm (CPU: triton under
the interpreter, grouped_mm's bf16 CPU path; the oracle's side is in test_oracle.py)."""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.experts import thresholds
from fusedmoe.experts.triton_or_grouped_mm import TritonOrGroupedMMExperts
from fusedmoe.metadata import TopK
from fusedmoe.platform import Platform
from fusedmoe.quant import QTensor, QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance

CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
SM90 = Platform.simulated("sm90")


def _arch_rule(monkeypatch, family: str, rule) -> None:
    """Make the sm90 row apply to the simulated sm90 platform (an H100 by name, whose own row
    would win over its arch's)."""
    monkeypatch.delitem(thresholds.GROUPED_MM_CROSSOVER, (Platform.simulated("sm90").name, family), raising=False)
    monkeypatch.setitem(thresholds.GROUPED_MM_CROSSOVER, ("sm90", family), rule)


@pytest.fixture
def rule(monkeypatch):
    # 8 tokens per expert: E=4, K=2 -> from T=16 on grouped_mm
    r = thresholds.Crossover(tokens_per_expert=8, min_intermediate_size=32)
    _arch_rule(monkeypatch, "unquantized", r)
    return r


def test_part_follows_the_crossover(rule):
    ex = TritonOrGroupedMMExperts(CONFIG, QuantScheme.unquantized(), platform=SM90)
    assert ex.part_for(15) is ex.triton
    assert ex.part_for(16) is ex.grouped_mm
    ex.deterministic = True  # grouped_mm's tiles depend on T: deterministic mode stays on triton
    assert ex.triton.deterministic and ex.part_for(10_000) is ex.triton


@pytest.mark.parametrize("t", [5, 16, 40])
def test_both_parts_compute_the_layer(rule, t):
    scheme = QuantScheme.unquantized()
    p = make_problem(CONFIG, scheme, t, seed=t)
    ex = TritonOrGroupedMMExperts(CONFIG, scheme, platform=SM90)
    out = poison_(torch.empty_like(p.x))
    ex.apply(QTensor(p.x, tuple(p.x.shape)), TopK(p.topk_ids, p.topk_weights), p.weights, out)
    assert rel_error(out, p.reference()) <= tolerance(scheme, CONFIG.dtype)


def test_refusals_name_the_part(rule):
    fp8_block = QuantScheme.by_name("fp8_block")
    why = TritonOrGroupedMMExperts.why_not(MoEConfig(4, 2, 256, 256), fp8_block, SM90)
    assert why == "quantization scheme fp8_block not supported"
    why = TritonOrGroupedMMExperts.why_not(MoEConfig(4, 2, 64, 16), QuantScheme.unquantized(), SM90)
    assert why.startswith("no triton/grouped_mm crossover for sm90 unquantized at I=16 (I=16 < 32 on sm90")
    assert "platform cpu" in TritonOrGroupedMMExperts.why_not(
        CONFIG, QuantScheme.unquantized(), Platform.simulated("cpu")
    )


@pytest.mark.parametrize(
    "gpu, who",
    [
        pytest.param("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", id="h100-own-row"),
        pytest.param("NVIDIA H200", "NVIDIA H200", id="h200-own-row"),
        pytest.param("NVIDIA H800", "sm90", id="other-sm90-arch-row"),
    ],
)
@pytest.mark.parametrize("sname", ["bf16", "fp8_tensor"])
def test_shipped_sm90_rows_keep_triton_first(gpu, who, sname):
    """Measured on an H100 and an H200 with the persistent kernel: triton first at every size,
    Mixtral's wide experts included (thresholds.py); other sm90 GPUs take the arch row."""
    import dataclasses

    wide = MoEConfig(8, 2, 4096, 14336)
    scheme = QuantScheme.by_name(sname)
    why = TritonOrGroupedMMExperts.why_not(wide, scheme, dataclasses.replace(SM90, name=gpu))
    assert f"triton was faster at every size measured on {who} {scheme.family}, up to 4096" in why


@pytest.mark.gpu
@pytest.mark.parametrize("sname", ["bf16", "fp8_tensor"])
def test_rule_on_gpu(monkeypatch, sname):
    """A crossover at a wide-expert shape: decode on triton, prefill on grouped_mm, both within
    the scheme's tolerance (the shipped sm90 rows keep triton first: a rule is set here)."""
    from fusedmoe.platform import current_platform

    plat = current_platform()
    for family in ("unquantized", "fp8"):
        rule = thresholds.Crossover(tokens_per_expert=64, min_intermediate_size=8192)
        for who in (plat.arch, plat.name):  # a GPU's own row wins over its arch's
            monkeypatch.setitem(thresholds.GROUPED_MM_CROSSOVER, (who, family), rule)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=8192)
    scheme = QuantScheme.by_name(sname)
    ex = TritonOrGroupedMMExperts(cfg, scheme, platform=plat)
    for t, part in ((16, ex.triton), (4096, ex.grouped_mm)):
        assert ex.part_for(t) is part
        p = make_problem(cfg, scheme, t, device="cuda")
        from fusedmoe.dispatch.local import LocalDispatcher
        from fusedmoe.modular.kernel import MoEKernel

        out = MoEKernel(LocalDispatcher(cfg, scheme), ex)(p.x, TopK(p.topk_ids, p.topk_weights), p.weights)
        err = rel_error(out, p.reference())
        print(f"MAXERR triton_or_grouped_mm {sname} T={t} ({part.name}): {err:.2e}")
        assert err <= tolerance(scheme, cfg.dtype)
