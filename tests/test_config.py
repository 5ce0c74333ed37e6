"""MoEConfig / ParallelConfig / QuantScheme: repr evaluates back; bad fields are named."""

from __future__ import annotations

import pytest
import torch  # noqa: F401  (the reprs name torch dtypes)

from fusedmoe.config import Activation, MoEConfig, ParallelConfig  # noqa: F401
from fusedmoe.errors import FusedMoEError
from fusedmoe.quant.scheme import Granularity, QDtype, QuantScheme, TensorQuant, all_schemes  # noqa: F401

CONFIGS = [
    MoEConfig(8, 2, 64, 32),
    MoEConfig(32, 4, 2880, 2880, activation="swigluoai", has_bias=True, gate_up_interleaved=True, dtype=torch.float16),
    MoEConfig(5, 1, 72, 40, activation=Activation.RELU2_NO_MUL, apply_router_weight_on_input=True),
    MoEConfig(6, 4, 64, 32, identity_experts=3, activation="silu_softcap", swiglu_alpha=25.0, swiglu_limit=4.0),
]


@pytest.mark.parametrize(
    "obj", CONFIGS + [ParallelConfig(ep_size=4, ep_rank=3, placement="round_robin")] + all_schemes(), ids=repr
)
def test_repr_evaluates_back(obj):
    assert eval(repr(obj)) == obj


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(num_experts=0, top_k=1, hidden_size=8, intermediate_size=8),
            "MoEConfig.num_experts: expected a positive",
        ),
        (
            dict(num_experts=4, top_k=5, hidden_size=8, intermediate_size=8),
            r"MoEConfig.top_k: expected <= num_experts \+ identity_experts \(4\)",
        ),
        (
            dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, activation="tanh"),
            "MoEConfig.activation: expected one of",
        ),
        (
            dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, apply_router_weight_on_input=True),
            "MoEConfig.apply_router_weight_on_input: expected top_k == 1",
        ),
        (dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, dtype=torch.int8), "MoEConfig.dtype"),
        (
            dict(
                num_experts=4,
                top_k=2,
                hidden_size=8,
                intermediate_size=8,
                activation="silu_no_mul",
                gate_up_interleaved=True,
            ),
            "MoEConfig.gate_up_interleaved: expected False",
        ),
        (
            dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, identity_experts=-1),
            "MoEConfig.identity_experts: expected an int >= 0",
        ),
        (
            dict(
                num_experts=4,
                top_k=1,
                hidden_size=8,
                intermediate_size=8,
                identity_experts=2,
                apply_router_weight_on_input=True,
            ),
            "MoEConfig.identity_experts: expected 0 with apply_router_weight_on_input",
        ),  # fmt: skip
        (
            dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, activation="silu_softcap", swiglu_alpha=0),
            "MoEConfig.swiglu_alpha: expected > 0",
        ),
    ],
)
def test_moe_config_names_the_bad_field(kwargs, match):
    with pytest.raises(FusedMoEError, match=match):
        MoEConfig(**kwargs)


def test_parallel_config_validation_and_expert_maps():
    with pytest.raises(FusedMoEError, match=r"ParallelConfig.ep_rank: expected in \[0, 2\)"):
        ParallelConfig(ep_size=2, ep_rank=2)
    with pytest.raises(FusedMoEError, match="ParallelConfig.placement"):
        ParallelConfig(placement="random")
    # uneven split: 7 experts on 3 ranks -> 3, 2, 2; every expert owned exactly once
    owned = [ParallelConfig(ep_size=3, ep_rank=r).local_experts(7) for r in range(3)]
    assert owned == [[0, 1, 2], [3, 4], [5, 6]]
    rr = [ParallelConfig(ep_size=3, ep_rank=r, placement="round_robin").local_experts(7) for r in range(3)]
    assert rr == [[0, 3, 6], [1, 4], [2, 5]]
    m = ParallelConfig(ep_size=3, ep_rank=1, placement="round_robin").expert_map(7)
    assert m.tolist() == [-1, 0, -1, -1, 1, -1, -1]
    assert ParallelConfig().expert_map(7) is None


def test_scheme_validation_names_the_field():
    with pytest.raises(FusedMoEError, match=r"TensorQuant.granularity: expected Granularity.group\(32\) for mxfp4"):
        TensorQuant(QDtype.MXFP4, Granularity.group(16))
    with pytest.raises(FusedMoEError, match="QuantScheme.w1/w2"):
        QuantScheme(name="x", w1=TensorQuant(QDtype.FP8, Granularity.tensor()))
    with pytest.raises(FusedMoEError, match="scheme: expected one of"):
        QuantScheme.by_name("fp7")
