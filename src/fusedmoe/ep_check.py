"""Expert-parallel checks: each EP dispatcher x experts x scheme against the single-rank float64 reference.

Shared by ``tests/test_ep.py`` (gloo on the CPU, forked processes) and
``scripts/ep_suite.sh`` (NCCL, one GPU per rank)::

    torchrun --standalone --nproc-per-node 4 -m fusedmoe.ep_check --out $OUT

Every rank builds the *full* problem from the same seed (all ranks' tokens,
all E experts), keeps its own slice of tokens (``tokens[r]`` rows, possibly
none) and its local experts' weights (``shard_experts``), runs dispatch ->
experts -> combine, and compares its rows with the same rows of
``moe_reference`` of the full problem (relative error, the ``tolerance`` table).
Checked exactly on the way: the rows each dispatcher hands the experts
(all-gather: every token; all2all: one row per (token, rank owning one of its
experts); low latency: per-expert counts = the pairs routed to each local
expert), and that the output is fully written (the experts' buffer is
poisoned, so combine reading a row the experts never wrote shows as NaN).
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

from .config import MoEConfig, ParallelConfig
from .dispatch.all2all import All2AllDispatcher
from .dispatch.allgather import AllGatherReduceScatterDispatcher
from .dispatch.low_latency import All2AllLowLatencyDispatcher
from .distributed import ExpertPlacement, init_ep, shard_experts
from .errors import FusedMoEError
from .experts.base import TokenLayout
from .kernel import MoEKernel
from .metadata import TopK
from .quant import QuantScheme
from .registry import get_experts
from .testing import all_written, make_problem, poison_, rel_error, tolerance

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


def ep_forward(dispatcher, experts, x, topk, weights, expert_map):
    """dispatch -> experts -> combine on every rank, with the experts' buffer poisoned.

    Unlike ``MoEKernel.forward`` this does not chunk and does not return early
    on T == 0: a rank without tokens must still join the collectives.
    Returns (out [T, H], the Dispatched bundle).
    """
    d = dispatcher.dispatch(x, topk, weights, expert_map=expert_map)
    y = poison_(torch.empty(dispatcher.output_shape(d, experts.reduce), dtype=x.dtype, device=x.device))
    if experts.layout is TokenLayout.STANDARD:
        experts.apply(d.a, d.topk, weights, y, expert_map=expert_map)
    else:
        experts.apply_batched(d.a, d.counts, weights, y)
    out = poison_(torch.empty_like(x))
    dispatcher.combine(y, d, out, experts.reduce)
    return out, d


def _expected_rows(case: EPCase, prob, placement: ExpertPlacement, rank: int, d) -> str:
    """'' if the dispatched rows are exactly what the protocol says, else what differs."""
    ids = prob.topk_ids.long().cpu()
    owner = torch.tensor(placement.owner)[ids]
    if case.dispatcher == "allgather_reducescatter":
        want, got = ids.shape[0], d.num_tokens
    elif case.dispatcher == "all2all":
        want, got = int((owner == rank).any(dim=1).sum()), d.num_tokens
    else:
        mine = placement.experts_of(rank)
        want = [int((ids == e).sum()) for e in mine]
        got = d.counts.cpu().tolist()
        if d.counts.dtype != torch.int32:
            return f"counts dtype {d.counts.dtype}, expected int32"
    return "" if want == got else f"dispatched rows {got}, expected {want}"


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
    t0 = time.perf_counter()
    out, d = ep_forward(disp, experts, x, topk, weights, emap)
    if out.is_cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    err = rel_error(out, ref[lo:hi])
    tol = tolerance(scheme, config.dtype)
    problems = []
    if out.shape != x.shape or out.dtype != x.dtype:
        problems.append(f"out {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {x.dtype}")
    if not all_written(out):
        problems.append("out has unwritten (NaN) elements")
    rows = _expected_rows(case, prob, placement, rank, d)
    if rows:
        problems.append(rows)
    if not err <= tol:
        problems.append(f"relative error {err:.3e} > {tol:.1e}")
    # the same through MoEKernel in chunks of 2 tokens: ranks with fewer (or no) tokens
    # must join every chunk's collectives
    chunked = MoEKernel(disp, experts, chunk_size=2)(x, topk, weights, expert_map=emap)
    cerr = rel_error(chunked, ref[lo:hi])
    if not cerr <= tol:
        problems.append(f"chunked MoEKernel: relative error {cerr:.3e} > {tol:.1e}")
    extra = {"quantized_before_exchange": disp.quantizes_before()}
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
    cases = []
    shape = dict(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter,
        placement=placement,
        seed=seed,
        capacity=capacity,
    )
    for scheme in schemes:
        for dname in ("allgather_reducescatter", "all2all"):
            for ename in experts_std:
                cases.append(EPCase(dname, ename, scheme, tokens, **shape))
        for ename in experts_batched:
            cases.append(EPCase("all2all_low_latency", ename, scheme, tokens, **shape))
    return cases


def cpu_cases(world: int) -> list[EPCase]:
    """What tests/test_ep.py runs per world: uneven tokens (a rank with none), 7 experts (uneven), both
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
    from .platform import Platform

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
    extra = {"mismatch": _gather(check_mismatch(device)), "overflow": _gather(check_overflow(device))}
    ok_extra = all(
        "MoEConfig.hidden_size" in m["hidden_size"]
        and "dispatcher.capacity" in m["capacity"]
        and "ParallelConfig.ep_size" in m["ep_size"]
        for m in extra["mismatch"]
    ) and all(
        "capacity=2" in o["eager"] and o["flag"] > 2 and "capacity=2" in o["check"] and o["fits"]["ok"]
        for o in extra["overflow"]
    )
    if rank == 0:
        print(f"config mismatch and capacity overflow checks: {'ok' if ok_extra else 'FAIL'}")
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
