"""Class 1 over expert parallelism (gloo, 2 forked CPU ranks), and faults that are cheap to provoke.

Before: an id of -1 became the last expert's owner's row in all2all (PyTorch's negative
index), an id >= E an IndexError or an out-of-bounds read of the owner table. Now every EP
dispatcher sends such pairs nowhere (wire id 0), so they contribute nothing, as on one rank.
Faults: both ranks passing another rank's expert map or the wrong number of local experts
(refused before any collective, so no rank waits), ranks that built different layers
(refused on every rank at set-up).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from robust_helpers import dropped_reference, equals_reference, raises_clearly, robust

from fusedmoe import FusedMoEError, MoEConfig, ParallelConfig, QuantScheme
from fusedmoe.dispatch.ep.groups import shard_experts
from fusedmoe.metadata import TopK
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.oracle.registry import get_experts
from fusedmoe.testing import ep_check, make_problem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dispatch"))
from test_ep import _run_world  # noqa: E402  (the forked gloo world of the EP tests)

CONFIG = MoEConfig(num_experts=5, top_k=2, hidden_size=64, intermediate_size=32)
TOKENS = (5, 3)
EXPERTS = {"allgather_reducescatter": "reference", "all2all": "cpu", "all2all_low_latency": "reference_batched"}


def _bad_ids(ids: torch.Tensor) -> torch.Tensor:
    ids = ids.clone()
    ids[0, 1], ids[2, 0], ids[6, :] = -1, CONFIG.num_experts, torch.tensor([-1, 2**20])
    return ids


def _job(dev) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    scheme = QuantScheme.unquantized()
    prob = make_problem(CONFIG, scheme, sum(TOKENS), seed=4)
    ids = _bad_ids(prob.topk_ids)
    ref = dropped_reference(prob, ids, prob.topk_weights)
    lo, hi = sum(TOKENS[:rank]), sum(TOKENS[: rank + 1])
    out: dict = {}
    for name, experts_name in EXPERTS.items():
        parallel = ParallelConfig(ep_size=world, ep_rank=rank, dispatcher=name)
        local = parallel.local_experts(CONFIG.num_experts)
        disp = ep_check.make_dispatcher(ep_check.EPCase(name, experts_name, "bf16", TOKENS, num_experts=5), CONFIG,
                                        scheme, parallel)  # fmt: skip
        experts = get_experts(experts_name)(CONFIG, scheme)
        weights = shard_experts(prob.weights, local)
        emap = parallel.expert_map(CONFIG.num_experts)
        kern = MoEKernel(disp, experts, chunk_size=2)
        y = kern(prob.x[lo:hi], TopK(ids[lo:hi], prob.topk_weights[lo:hi]), weights, expert_map=emap)
        try:  # plain values back through the queue (a tensor would travel as shared memory the exiting rank frees)
            equals_reference(y, ref[lo:hi], scheme, CONFIG.dtype)
            out[name] = "ok"
        except AssertionError as e:
            out[name] = str(e)
        other = ParallelConfig(ep_size=world, ep_rank=1 - rank).expert_map(CONFIG.num_experts)
        for fault, kw in (("foreign_map", dict(expert_map=other)), ("wrong_weights", dict(expert_map=emap))):
            w = weights if fault == "foreign_map" else shard_experts(prob.weights, list(range(CONFIG.num_experts)))
            try:
                kern(prob.x[lo:hi], TopK(ids[lo:hi], prob.topk_weights[lo:hi]), w, **kw)
                out[(name, fault)] = "no error"
            except FusedMoEError as e:
                out[(name, fault)] = FusedMoEError(str(e))
    try:
        mine = CONFIG.replace(hidden_size=64 + 32 * rank)
        ep_check.DISPATCHERS["all2all"](mine, scheme, ParallelConfig(ep_size=world, ep_rank=rank))
        out["mismatch"] = "no error"
    except FusedMoEError as e:
        out["mismatch"] = FusedMoEError(str(e))
    return out


@functools.cache
def _world() -> list[dict]:
    return _run_world(2, _job)


@robust(1, "reference")
@pytest.mark.parametrize("dispatcher", EXPERTS)
def test_ep_dispatchers_drop_pairs_outside_the_experts(dispatcher):
    assert [rank[dispatcher] for rank in _world()] == ["ok", "ok"]


def _reraise(err):
    def fn():
        if isinstance(err, BaseException):
            raise err

    return fn


@robust(11, "error")
@pytest.mark.parametrize("dispatcher", EXPERTS)
@pytest.mark.parametrize("fault,name", [("foreign_map", "expert_map"), ("wrong_weights", "weights")])
def test_ep_faults_are_refused_on_every_rank_before_any_exchange(dispatcher, fault, name):
    for rank in _world():
        raises_clearly(_reraise(rank[(dispatcher, fault)]), name)


@robust(11, "error")
def test_ranks_that_built_different_layers_are_refused_on_every_rank():
    for rank in _world():
        raises_clearly(_reraise(rank["mismatch"]), "hidden_size")
