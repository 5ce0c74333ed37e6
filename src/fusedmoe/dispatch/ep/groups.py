"""Expert-parallel set-up over ``torch.distributed``: process groups, placement, agreement.

- ``init_ep``: ``init_process_group`` with a timeout (NCCL on GPUs, gloo on
  CPUs), so a rank that never arrives makes the others fail after
  ``timeout_s`` instead of waiting forever. ``barrier`` is a monitored barrier
  on gloo (it names the rank that did not arrive).
- ``ep_group(parallel, group)``: the EP process group (WORLD unless given),
  checked against ``ParallelConfig`` (group size == ep_size, rank == ep_rank).
- ``ExpertPlacement``: global expert -> (owning rank, local id), linear or
  round robin, uneven splits exactly as ``ParallelConfig.local_experts``.
- ``check_layer_agreement``: one all-gather of a 64-bit fingerprint per rank
  (MoEConfig fields, QuantScheme operands, ParallelConfig sizes, dispatcher
  name and options). On a mismatch every rank also all-gathers the fields
  themselves and raises the same ``FusedMoEError`` naming each field that
  differs and its value on each rank; since all ranks raise together, none is
  left waiting in the next collective with a buffer of the wrong size.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...config import MoEConfig, ParallelConfig
from ...errors import FusedMoEError, expect
from ...quant import QTensor, QuantScheme

DEFAULT_TIMEOUT_S = 300.0


# ---- process groups --------------------------------------------------------
def init_ep(
    backend: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Initialise the default process group (from torchrun's environment unless given); returns (rank, world).

    backend: 'nccl' when CUDA is available, else 'gloo'. With NCCL the current
    CUDA device is set to LOCAL_RANK first. Does nothing if already initialised.
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kw = {}
        if rank is not None:
            kw.update(rank=rank, world_size=world_size)
        dist.init_process_group(backend, init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()


def ep_group(parallel: ParallelConfig, group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The process group of the EP ranks (``group`` or WORLD), checked against ``parallel``."""
    expect(
        dist.is_available() and dist.is_initialized(),
        "torch.distributed",
        "an initialised process group (call fusedmoe.distributed.init_ep or torch.distributed.init_process_group)",
        "not initialised",
    )
    group = group or dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    expect(size == parallel.ep_size, "ParallelConfig.ep_size", f"the EP process group size ({size})", parallel.ep_size)
    expect(
        rank == parallel.ep_rank,
        "ParallelConfig.ep_rank",
        f"this process's rank in the EP group ({rank})",
        parallel.ep_rank,
    )
    return group


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors handed to ``group``'s collectives must live (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group: dist.ProcessGroup | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A barrier that fails after ``timeout_s``: monitored on gloo (names the missing rank);
    on NCCL a plain barrier, bounded by the process group's timeout (``init_ep``)."""
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier(group)


# The ``*_single`` names replace the ``*_tensor`` ones in torch 2.13 (the old names warn there);
# torch 2.11 may have only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a 0-row ``t`` a 0-row view of a 1-row allocation: NCCL is then never handed a
    null buffer (a rank with no token still joins every exchange)."""
    if t.shape[0]:
        return t
    return torch.empty((1, *t.shape[1:]), dtype=t.dtype, device=t.device)[:0]


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """out [W * N, ...] = concatenation of every rank's inp [N, ...]."""
    _all_gather(out, inp, group=group)


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """out [N, ...] = sum over ranks of this rank's block of inp [W * N, ...]."""
    _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group)


def all_to_all_rows(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, splits: tuple[list, list] | None = None
) -> None:
    """Block r of inp goes to rank r; out = the blocks every rank sent here, in rank order.
    ``splits``: (rows sent to, rows received from) each rank; None: W equal blocks."""
    sent, got = (None, None) if splits is None else splits
    dist.all_to_all_single(out, inp, output_split_sizes=got, input_split_sizes=sent, group=group)


# ---- expert placement --------------------------------------------------------
@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns each global expert, and its local id there.

    owner:        [E] owning rank of each global expert.
    local_id:     [E] index of the expert among its owner's experts.
    local_counts: [W] experts per rank (uneven splits: the first ranks get one more).
    """

    num_experts: int
    ep_size: int
    placement: str
    owner: tuple[int, ...]
    local_id: tuple[int, ...]
    local_counts: tuple[int, ...]

    @classmethod
    def of(cls, num_experts: int, parallel: ParallelConfig) -> ExpertPlacement:
        owner = [-1] * num_experts
        local_id = [-1] * num_experts
        counts = []
        for r in range(parallel.ep_size):
            mine = dataclasses.replace(parallel, ep_rank=r).local_experts(num_experts)
            counts.append(len(mine))
            for i, e in enumerate(mine):
                owner[e], local_id[e] = r, i
        return cls(num_experts, parallel.ep_size, parallel.placement, tuple(owner), tuple(local_id), tuple(counts))

    def experts_of(self, rank: int) -> list[int]:
        """Global ids owned by ``rank``, in local-id order."""
        mine = [e for e in range(self.num_experts) if self.owner[e] == rank]
        return sorted(mine, key=lambda e: self.local_id[e])


def shard_experts(weights, experts: Sequence[int]):
    """The slice of full ``ExpertWeights`` [E, ...] holding ``experts`` (global ids, in local order).

    Per-expert tensors (leading dim E) are indexed; shared ones (static activation
    scales, a tensor-wide scale of size 1) pass through.
    """
    e_all = weights.num_experts
    idx = torch.tensor(list(experts), dtype=torch.long, device=weights.device)

    def pick(t):
        if t is None or t.dim() == 0 or t.shape[0] != e_all:
            return t
        return t.index_select(0, idx)

    def pick_q(q: QTensor) -> QTensor:
        return QTensor(
            pick(q.data),
            (len(experts), *q.shape[1:]),
            scale=pick(q.scale),
            zero=pick(q.zero),
            global_scale=pick(q.global_scale),
            g_idx=pick(q.g_idx),
        )

    return dataclasses.replace(
        weights, w13=pick_q(weights.w13), w2=pick_q(weights.w2), b13=pick(weights.b13), b2=pick(weights.b2)
    )


# ---- set-up agreement check --------------------------------------------------
def layer_fingerprint(
    config: MoEConfig, scheme: QuantScheme, parallel: ParallelConfig, dispatcher: str, options: dict | None = None
) -> dict[str, str]:
    """The fields every EP rank must agree on, by name (rank-specific fields left out)."""
    fp = {f"MoEConfig.{f.name}": repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    fp.update({f"QuantScheme.{f.name}": repr(getattr(scheme, f.name)) for f in dataclasses.fields(scheme)})
    for f in ("tp_size", "ep_size", "dp_size", "placement"):
        fp[f"ParallelConfig.{f}"] = repr(getattr(parallel, f))
    fp["dispatcher"] = repr(dispatcher)
    for k, v in sorted((options or {}).items()):
        fp[f"dispatcher.{k}"] = repr(v)
    return fp


def _digest(fp: dict[str, str]) -> int:
    text = "\n".join(f"{k}={v}" for k, v in sorted(fp.items()))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_layer_agreement(
    config: MoEConfig,
    scheme: QuantScheme,
    parallel: ParallelConfig,
    dispatcher: str,
    group: dist.ProcessGroup,
    options: dict | None = None,
) -> None:
    """Raise ``FusedMoEError`` on every rank unless all ranks of ``group`` built the same layer.

    One all-gather of int64 [W] (a host sync; run once at set-up). On a mismatch,
    a second all-gather of the fields builds a message naming what differs.
    """
    fp = layer_fingerprint(config, scheme, parallel, dispatcher, options)
    dev = comm_device(group)
    world = dist.get_world_size(group)
    mine = torch.tensor([_digest(fp)], dtype=torch.int64, device=dev)
    every = torch.empty(world, dtype=torch.int64, device=dev)
    all_gather_rows(every, mine, group)
    if len(set(every.tolist())) == 1:
        return
    fps: list = [None] * world
    dist.all_gather_object(fps, fp, group=group)
    keys = sorted(set().union(*(f.keys() for f in fps)))
    diffs = []
    for k in keys:
        vals = [f.get(k, "<missing>") for f in fps]
        if len(set(vals)) > 1:
            diffs.append(f"{k}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(vals)))
    raise FusedMoEError(
        f"EP ranks: expected the same layer on all {world} ranks, but the layer configuration differs between "
        f"them ({'; '.join(diffs)}); every rank must build the layer with the same MoEConfig, QuantScheme, "
        "ParallelConfig sizes and dispatcher"
    )
