"""Expert-parallel checks: each EP dispatcher x experts x scheme against the single-rank float64 reference.

Shared by ``tests/dispatch/test_ep.py`` (gloo on the CPU, forked processes) and
``scripts/ep_suite.sh`` (NCCL, one GPU per rank)::

    torchrun --standalone --nproc-per-node 4 -m fusedmoe.testing.ep_check --out $OUT

Every rank builds the *full* problem from the same seed (all ranks' tokens,
all E experts), keeps its own slice of tokens (``tokens[r]`` rows, possibly
none) and its local experts' weights (``shard_experts``), runs dispatch ->
experts -> combine, and compares its rows with the same rows of
``moe_reference`` of the full problem (relative error, the ``tolerance`` table).
Each case runs every way a dispatcher can size its exchange (``PATHS``):

    direct        dispatch/combine called directly, no workspace: sizes exchanged
                  (all-gather and all2all: 'variable'; low latency: no token bound,
                  so its overflow bookkeeping runs)
    workspace     directly with the workspace MoEKernel.allocate(max tokens) would give:
                  fixed blocks of that capacity, no host sync ('fixed')
    kernel        MoEKernel in chunks of 2, no workspace: the ranks agree on the largest
                  chunk once per forward (all-gather 'fixed'; all2all keeps 'variable')
    kernel+ws     the same after MoEKernel.allocate: every dispatcher 'fixed'

Checked exactly on the way: the rows each dispatcher hands the experts (all-gather: every
token; all2all: one row per (token, rank owning one of its experts), plus padding rows in
fixed blocks, which no local expert takes; low latency: per-expert counts = the pairs
routed to each local expert), the exchange mode, and that the output is fully written
(the experts' buffer is poisoned, so combine reading a row the experts never wrote shows
as NaN).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import MoEConfig, ParallelConfig
from ..contract import TokenLayout, WeightedReduce
from ..dispatch.ep.all2all import All2AllDispatcher
from ..dispatch.ep.allgather import AllGatherReduceScatterDispatcher
from ..dispatch.ep.groups import ExpertPlacement, init_ep, shard_experts
from ..dispatch.ep.low_latency import All2AllLowLatencyDispatcher
from ..errors import FusedMoEError
from ..metadata import TopK
from ..modular.kernel import MoEKernel
from ..oracle.registry import get_experts
from ..quant import QuantScheme
from . import all_written, make_problem, poison_, rel_error, tolerance

DISPATCHERS = {
    cls.name: cls for cls in (AllGatherReduceScatterDispatcher, All2AllDispatcher, All2AllLowLatencyDispatcher)
}
SCHEMES = ("bf16", "fp8_token", "fp8_block")


@dataclass(frozen=True)
class EPCase:
    """One layer run across the EP group. ``tokens[r]``: tokens held by rank r."""

    dispatcher: str
    experts: str
    scheme: str
    tokens: tuple[int, ...]
    num_experts: int = 7
    top_k: int = 2
    hidden_size: int = 160
    intermediate_size: int = 64
    placement: str = "linear"
    seed: int = 0
    capacity: int = 8  # all2all_low_latency only
    on_input: bool = False  # router weight applied on the input (top_k 1)
    routing: str = "random"

    @property
    def label(self) -> str:
        extra = ",on_input" if self.on_input else ""
        return (
            f"{self.dispatcher}+{self.experts}/{self.scheme}/W{len(self.tokens)} T={list(self.tokens)} "
            f"E{self.num_experts} K{self.top_k} {self.placement}{extra}"
        )

    def config(self) -> MoEConfig:
        return MoEConfig(
            self.num_experts,
            self.top_k,
            self.hidden_size,
            self.intermediate_size,
            apply_router_weight_on_input=self.on_input,
        )


@dataclass
class Result:
    label: str
    rank: int
    ok: bool
    rel_error: float
    tol: float
    rows: int
    detail: str = ""
    ms: float = 0.0
    extra: dict = field(default_factory=dict)


def make_dispatcher(case: EPCase, config, scheme, parallel, group=None, **kw):
    cls = DISPATCHERS[case.dispatcher]
    if cls is All2AllLowLatencyDispatcher:
        kw.setdefault("capacity", case.capacity)
    return cls(config, scheme, parallel, group=group, **kw)


def ep_forward(dispatcher, experts, x, topk, weights, expert_map, workspace=None):
    """dispatch -> experts -> combine on every rank, with the experts' buffer poisoned.

    Unlike ``MoEKernel.forward`` this does not chunk and does not return early
    on T == 0: a rank without tokens must still join the collectives.
    Returns (out [T, H], the Dispatched bundle).
    """
    kw = {} if workspace is None else {"workspace": workspace}
    d = dispatcher.dispatch(x, topk, weights, expert_map=expert_map, **kw)
    y = poison_(torch.empty(dispatcher.output_shape(d, experts.reduce), dtype=x.dtype, device=x.device))
    if experts.layout is TokenLayout.STANDARD:
        experts.apply(d.a, d.topk, weights, y, expert_map=expert_map)
    else:
        experts.apply_batched(d.a, d.counts, weights, y)
    out = poison_(torch.empty_like(x))
    dispatcher.combine(y, d, out, experts.reduce)
    return out, d


def _expected_rows(case: EPCase, prob, placement: ExpertPlacement, rank: int, d, emap, mode: str) -> str:
    """'' if the dispatched rows are exactly what the protocol says, else what differs."""
    ids = prob.topk_ids.long().cpu()
    owner = torch.tensor(placement.owner)[ids]
    if case.dispatcher in ("allgather_reducescatter", "all2all"):
        # rows a local expert takes = tokens (of any rank) with an expert here; padding rows take none
        want = int((owner == rank).any(dim=1).sum())
        got = int((emap.cpu()[d.topk.ids.long().cpu()] >= 0).any(dim=1).sum()) if d.num_tokens else 0
        if d.num_tokens % len(case.tokens) and (case.dispatcher == "allgather_reducescatter" or mode == "fixed"):
            return f"{d.num_tokens} rows in fixed blocks, not a multiple of {len(case.tokens)} ranks"
        if case.dispatcher == "all2all" and mode == "variable" and d.num_tokens != want:
            return f"all2all received {d.num_tokens} rows, expected exactly the {want} tokens with an expert here"
    else:
        mine = placement.experts_of(rank)
        want = [int((ids == e).sum()) for e in mine]
        got = d.counts.cpu().tolist()
        if d.counts.dtype != torch.int32:
            return f"counts dtype {d.counts.dtype}, expected int32"
    return "" if want == got else f"dispatched rows {got}, expected {want}"


# how each path must have exchanged, per dispatcher ('' = not checked)
PATHS = ("direct", "workspace", "kernel", "kernel+ws")
MODES = {
    "allgather_reducescatter": ("variable", "fixed", "fixed", "fixed"),
    "all2all": ("variable", "fixed", "variable", "fixed"),
    "all2all_low_latency": ("fixed", "fixed", "fixed", "fixed"),
}


_PROBLEMS: dict = {}


def _problem(case: EPCase, device):
    key = (case.config(), case.scheme, sum(case.tokens), case.seed, case.routing, str(device))
    if key not in _PROBLEMS:
        scheme = QuantScheme.by_name(case.scheme)
        prob = make_problem(
            case.config(), scheme, sum(case.tokens), seed=case.seed, routing=case.routing, device=device
        )
        _PROBLEMS.clear()
        _PROBLEMS[key] = (prob, prob.reference())
    return _PROBLEMS[key]


def run_case(case: EPCase, device, group=None) -> Result:
    """Run ``case`` on this rank (every rank of ``group`` must call it with the same case)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(case.tokens) != world:
        raise FusedMoEError(f"EPCase.tokens: expected {world} counts (one per rank), got {case.tokens}")
    config = case.config()
    prob, ref = _problem(case, device)
    scheme = prob.scheme
    parallel = ParallelConfig(ep_size=world, ep_rank=rank, placement=case.placement, dispatcher=case.dispatcher)
    placement = ExpertPlacement.of(config.num_experts, parallel)
    lo = sum(case.tokens[:rank])
    hi = lo + case.tokens[rank]
    experts = get_experts(case.experts)(config, scheme)
    weights = experts.prepare_weights(shard_experts(prob.weights, parallel.local_experts(config.num_experts)))
    emap = parallel.expert_map(config.num_experts, device)
    disp = make_dispatcher(case, config, scheme, parallel, group)
    x, topk = prob.x[lo:hi], TopK(prob.topk_ids[lo:hi], prob.topk_weights[lo:hi])
    tol = tolerance(scheme, config.dtype)
    problems, modes = [], []
    t0 = time.perf_counter()
    err = 0.0
    e_l = len(parallel.local_experts(config.num_experts))
    for path, want_mode in zip(PATHS, MODES[case.dispatcher], strict=True):
        d = None
        if path in ("direct", "workspace"):
            ws = disp.workspace(max(case.tokens), e_l).allocate(device) if path == "workspace" else None
            out, d = ep_forward(disp, experts, x, topk, weights, emap, ws)
        else:
            # MoEKernel in chunks of 2 tokens: ranks with fewer (or no) tokens join every chunk's collectives
            kern = MoEKernel(disp, experts, chunk_size=2)
            if path == "kernel+ws":
                kern.allocate(max(case.tokens), device)
            out = kern(x, topk, weights, expert_map=emap)
        modes.append(disp.last_mode)
        e = rel_error(out, ref[lo:hi])
        err = max(err, e)
        where = f"{path}: "
        if out.shape != x.shape or out.dtype != x.dtype:
            problems.append(f"{where}out {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {x.dtype}")
        if not all_written(out):
            problems.append(f"{where}out has unwritten (NaN) elements")
        if d is not None:
            rows = _expected_rows(case, prob, placement, rank, d, emap, disp.last_mode)
            if rows:
                problems.append(where + rows)
        if not e <= tol:
            problems.append(f"{where}relative error {e:.3e} > {tol:.1e}")
        if disp.last_mode != want_mode:
            problems.append(f"{where}exchange mode {disp.last_mode!r}, expected {want_mode!r}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    extra = {"quantized_before_exchange": disp.quantizes_before(), "modes": modes}
    return Result(case.label, rank, not problems, err, tol, case.tokens[rank], "; ".join(problems), ms, extra)


# ---- cases -----------------------------------------------------------------------
def standard_cases(
    world: int,
    experts_std: tuple[str, ...],
    experts_batched: tuple[str, ...],
    *,
    tokens: tuple[int, ...],
    placement: str,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    capacity: int,
    schemes=SCHEMES,
    seed: int = 0,
) -> list[EPCase]:
    """Every dispatcher x its layout's experts x scheme for one world."""
    assert len(tokens) == world
    pairs = [(d, e) for d in ("allgather_reducescatter", "all2all") for e in experts_std]
    pairs += [("all2all_low_latency", e) for e in experts_batched]
    # E, K, H, I positionally, in MoEConfig's order
    return [
        EPCase(
            d, e, scheme, tokens, num_experts, top_k, hidden, inter, placement=placement, seed=seed, capacity=capacity
        )
        for scheme in schemes
        for d, e in pairs
    ]


def cpu_cases(world: int) -> list[EPCase]:
    """What tests/dispatch/test_ep.py runs per world: uneven tokens (a rank with none), 7 experts (uneven), both
    placements across the two worlds, the router weight on the input for every dispatcher, and on 2
    ranks the other wire formats (static per-tensor scale, int8 groups, MX e8m0 scales, packed NVFP4
    with e4m3 scales and a global scale)."""
    if world == 2:
        tokens, placement, k = (5, 0), "linear", 3
    else:
        tokens, placement, k = (3, 0, 8, 1), "round_robin", 2
    shape = dict(tokens=tokens, placement=placement, num_experts=7, top_k=k, hidden=160, inter=64, capacity=8)
    cases = standard_cases(world, ("reference", "cpu"), ("reference_batched",), **shape)
    for dname, ename in (
        ("allgather_reducescatter", "cpu"),
        ("all2all", "cpu"),
        ("all2all_low_latency", "reference_batched"),
    ):
        cases.append(EPCase(dname, ename, "fp8_token", tokens, top_k=1, on_input=True, placement=placement, seed=1))
    if world == 2:
        more = ("fp8_tensor_static", "int8_w8a8_block", "mxfp4_mxfp8", "nvfp4")
        cases += standard_cases(world, ("reference",), ("reference_batched",), schemes=more, seed=2, **shape)
    return cases


def gpu_cases(world: int) -> list[EPCase]:
    """NCCL: the Triton experts where the platform takes them, the reference always; 15 experts (uneven
    on 2 and 4 ranks), a rank without tokens, both placements."""
    from ..platform import Platform

    plat = Platform.detect()
    std = ("reference",) + (
        ("triton",)
        if get_experts("triton").why_not(MoEConfig(15, 4, 512, 256), QuantScheme.fp8_block(), plat) is None
        else ()
    )
    bat = ("reference_batched",) + (("triton_batched",) if "triton" in std else ())
    base = [37, 0, 128, 5, 64, 1, 3, 17]
    tokens = tuple(base[i % len(base)] for i in range(world))
    cases = []
    for placement in ("linear", "round_robin"):
        cases += standard_cases(
            world,
            std,
            bat,
            tokens=tokens,
            placement=placement,
            num_experts=15,
            top_k=4,
            hidden=512,
            inter=256,
            capacity=128,
        )
    return cases


# ---- set-up and capacity checks -------------------------------------------------
def check_mismatch(device, group=None) -> dict:
    """Ranks that disagree on the layer: every rank must raise, naming what differs. Returns the messages."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    scheme = QuantScheme.fp8_per_token()
    got = {}
    config = MoEConfig(7, 2, 64 if rank == 0 else 96, 32)
    try:
        AllGatherReduceScatterDispatcher(config, scheme, parallel, group=group)
        got["hidden_size"] = "no error"
    except FusedMoEError as e:
        got["hidden_size"] = str(e)
    config = MoEConfig(7, 2, 64, 32)
    try:
        All2AllLowLatencyDispatcher(config, scheme, parallel, group=group, capacity=4 + rank)
        got["capacity"] = "no error"
    except FusedMoEError as e:
        got["capacity"] = str(e)
    try:
        All2AllDispatcher(config, scheme, ParallelConfig(ep_size=world + 1, ep_rank=rank), group=group)
        got["ep_size"] = "no error"
    except FusedMoEError as e:
        got["ep_size"] = str(e)
    All2AllDispatcher(config, scheme, parallel, group=group)  # the group is still in step afterwards
    got["agree"] = "ok"
    return got


def check_bounds(device, group=None) -> dict:
    """The edges of the token bound, each dispatcher against the reference:

    - ``MoEKernel.allocate(2)`` while rank 0 holds 5 tokens (one chunk): the agreed chunk
      exceeds the workspace, so every rank leaves it alone together (all2all: variable
      sizes; all-gather and low latency: fixed blocks of 5 rows);
    - workspaces of different sizes on different ranks (a direct call): every rank raises,
      naming both sizes, before any exchange of rows.

    Returns {dispatcher: (rel error, tol, mode)} and the error message under 'mismatch'."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = tuple(5 if r == 0 else r % 2 for r in range(world))  # rank 1 holds 1, rank 2 none
    got = {}
    for dname, ename in (
        ("allgather_reducescatter", "reference"),
        ("all2all", "reference"),
        ("all2all_low_latency", "reference_batched"),
    ):
        case = EPCase(dname, ename, "fp8_token", tokens, capacity=4, seed=3)
        config = case.config()
        prob, ref = _problem(case, device)
        parallel = ParallelConfig(ep_size=world, ep_rank=rank)
        experts = get_experts(ename)(config, prob.scheme)
        weights = experts.prepare_weights(shard_experts(prob.weights, parallel.local_experts(config.num_experts)))
        emap = parallel.expert_map(config.num_experts, device)
        disp = make_dispatcher(case, config, prob.scheme, parallel, group)
        lo = sum(tokens[:rank])
        hi = lo + tokens[rank]
        kern = MoEKernel(disp, experts)
        kern.allocate(2, device)
        out = kern(prob.x[lo:hi], TopK(prob.topk_ids[lo:hi], prob.topk_weights[lo:hi]), weights, expert_map=emap)
        got[dname] = (rel_error(out, ref[lo:hi]), tolerance(prob.scheme, config.dtype), disp.last_mode)
    config = MoEConfig(7, 2, 64, 32)
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    disp = AllGatherReduceScatterDispatcher(config, QuantScheme.unquantized(), parallel, group=group)
    prob = make_problem(config, QuantScheme.unquantized(), 2, seed=4, device=device)
    weights = shard_experts(prob.weights, parallel.local_experts(config.num_experts))
    ws = disp.workspace(3 + rank, disp.num_local_experts).allocate(device)
    experts = get_experts("reference")(config, prob.scheme)
    topk = TopK(prob.topk_ids, prob.topk_weights)
    try:
        ep_forward(disp, experts, prob.x, topk, weights, parallel.expert_map(7, device), ws)
        got["mismatch"] = "no error"
    except FusedMoEError as e:
        got["mismatch"] = str(e)
    return got


class HostSyncs(TorchDispatchMode):
    """Records what would make the host wait for a GPU: reading a value (``.item()``, ``.tolist()``,
    ``bool(t)``), ``nonzero``, and creating a tensor from host data (a host-to-device copy)."""

    NAMES = ("_local_scalar_dense", "nonzero", "lift_fresh")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.NAMES:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        seen, tolist = self.seen, self._tolist

        def spy(t):
            seen.append("tolist")
            return tolist(t)

        torch.Tensor.tolist = spy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def check_no_host_sync(device, group=None) -> dict:
    """Fixed blocks (a workspace) never make the host wait: dispatch + combine of every dispatcher
    (bf16; after one warm-up call, which builds the tables) record no host sync, while variable
    sizes record theirs. Returns {dispatcher/mode: ops seen}. (On the CPU the row movers run their
    PyTorch references, which are sync-free too; quantizers are left out: bf16.)"""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    config, scheme = MoEConfig(7, 2, 64, 32), QuantScheme.unquantized()
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    t = 3 if rank == 0 else rank - 1  # rank 1 holds none
    prob = make_problem(config, scheme, t, seed=5, device=device)
    topk = TopK(prob.topk_ids, prob.topk_weights)
    emap = parallel.expert_map(config.num_experts, device)
    got = {}
    for name, mode in (
        ("allgather_reducescatter", "fixed"),
        ("all2all", "fixed"),
        ("all2all_low_latency", "fixed"),
        ("allgather_reducescatter", "variable"),
        ("all2all", "variable"),
    ):
        disp = DISPATCHERS[name](config, scheme, parallel, group=group)
        weights = shard_experts(prob.weights, parallel.local_experts(config.num_experts))
        std = disp.layout is TokenLayout.STANDARD
        kw = {"expert_map": emap if std else None}
        if mode == "fixed":
            kw["workspace"] = disp.workspace(4, disp.num_local_experts).allocate(device)
        reduce = WeightedReduce.NONE if std else WeightedReduce.WEIGHT_AND_SUM
        disp.dispatch(prob.x, topk, weights, **kw)
        guard = HostSyncs()
        with guard:
            d = disp.dispatch(prob.x, topk, weights, **kw)
            y = torch.zeros(disp.output_shape(d, reduce), dtype=prob.x.dtype, device=device)
            disp.combine(y, d, torch.empty_like(prob.x), reduce)
        got[f"{name}/{mode}"] = guard.seen
    return got


def no_host_sync_ok(per_rank: list[dict]) -> bool:
    """What ``check_no_host_sync`` must give on every rank."""
    return all(
        all(not seen for k, seen in got.items() if k.endswith("/fixed"))
        and all(seen for k, seen in got.items() if k.endswith("/variable"))
        for got in per_rank
    )


def check_overflow(device, group=None) -> dict:
    """Low latency with capacity 2 while one expert needs more: every rank raises (eager), or the flag
    records the need (``raise_on_overflow=False``) and ``check_capacity`` raises. Then a run that fits."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = tuple(6 if r == 0 else 3 for r in range(world))
    case = EPCase(
        "all2all_low_latency",
        "reference_batched",
        "bf16",
        tokens,
        num_experts=5,
        top_k=2,
        hidden_size=64,
        intermediate_size=32,
        capacity=2,
        routing="one_expert",
    )
    config = case.config()
    prob, _ = _problem(case, device)
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    weights = shard_experts(prob.weights, parallel.local_experts(config.num_experts))
    lo = sum(tokens[:rank])
    x = prob.x[lo : lo + tokens[rank]]
    topk = TopK(prob.topk_ids[lo : lo + tokens[rank]], prob.topk_weights[lo : lo + tokens[rank]])
    got = {}
    disp = make_dispatcher(case, config, prob.scheme, parallel, group)
    try:
        disp.dispatch(x, topk, weights)
        got["eager"] = "no error"
    except FusedMoEError as e:
        got["eager"] = str(e)
    disp = make_dispatcher(case, config, prob.scheme, parallel, group, raise_on_overflow=False)
    disp.dispatch(x, topk, weights)
    got["flag"] = int(disp.needed.item())
    try:
        disp.check_capacity()
        got["check"] = "no error"
    except FusedMoEError as e:
        got["check"] = str(e)
    fits = run_case(
        EPCase(
            "all2all_low_latency",
            "reference_batched",
            "bf16",
            tokens,
            num_experts=5,
            hidden_size=64,
            intermediate_size=32,
            capacity=max(tokens),
            routing="one_expert",
        ),
        device,
        group,
    )
    got["fits"] = asdict(fits)
    return got


def bounds_ok(per_rank: list[dict]) -> bool:
    """What ``check_bounds`` must give on every rank."""
    want = {"allgather_reducescatter": "fixed", "all2all": "variable", "all2all_low_latency": "fixed"}
    return all(
        all(got[d][0] <= got[d][1] and got[d][2] == m for d, m in want.items())
        and "from 3 to " in got["mismatch"]
        and "MoEKernel.allocate" in got["mismatch"]
        for got in per_rank
    )


# ---- torchrun entry point ----------------------------------------------------------
def _gather(obj, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    args = ap.parse_args(argv)
    rank, world = init_ep(timeout_s=args.timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cases = gpu_cases(world) if device.type == "cuda" else cpu_cases(world)
    results, failures = [], 0
    for case in cases:
        try:
            r = run_case(case, device)
        except Exception as e:  # the same error on every rank keeps the group in step; report and go on
            r = Result(case.label, rank, False, float("nan"), 0.0, 0, f"{type(e).__name__}: {e}")
            traceback.print_exc()
        every = _gather(asdict(r))
        results += every
        bad = [x for x in every if not x["ok"]]
        failures += bool(bad)
        if rank == 0:
            worst = max(x["rel_error"] for x in every)
            status = "ok" if not bad else "FAIL " + " | ".join(f"rank {x['rank']}: {x['detail']}" for x in bad)
            print(f"{case.label:<90} max rel err {worst:.2e} (tol {every[0]['tol']:.0e}) {status}", flush=True)
    extra = {
        "mismatch": _gather(check_mismatch(device)),
        "overflow": _gather(check_overflow(device)),
        "bounds": _gather(check_bounds(device)),
        "host_syncs": _gather(check_no_host_sync(device)),
    }
    ok_extra = (
        bounds_ok(extra["bounds"])
        and no_host_sync_ok(extra["host_syncs"])
        and all(
            "MoEConfig.hidden_size" in m["hidden_size"]
            and "dispatcher.capacity" in m["capacity"]
            and "ParallelConfig.ep_size" in m["ep_size"]
            for m in extra["mismatch"]
        )
        and all(
            "capacity=2" in o["eager"] and o["flag"] > 2 and "capacity=2" in o["check"] and o["fits"]["ok"]
            for o in extra["overflow"]
        )
    )
    if rank == 0:
        print(f"config mismatch, capacity overflow, token bound, host sync checks: {'ok' if ok_extra else 'FAIL'}")
        print(json.dumps(extra["overflow"][0], default=str)[:400])
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"ep_check_w{world}.json")
        with open(path, "w") as f:
            json.dump(
                {"world": world, "device": str(device), "torch": torch.__version__, "results": results, "extra": extra},
                f,
                indent=1,
                default=str,
            )
        print(f"{len(cases)} cases, {failures} failed; wrote {path}")
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    dist.destroy_process_group()
    return 0 if failures == 0 and ok_extra else 1


if __name__ == "__main__":
    sys.exit(main())
