"""Expert-parallel benchmark: dispatch/combine against raw NCCL, and the whole layer under EP against one GPU.

    torchrun --standalone --nproc-per-node 4 -m fusedmoe.tools.bench_ep --out $OUT
    fusedmoe bench --ep --out $OUT          (the same, on every GPU of this machine)

At the DeepSeek-V3 shape (H 7168, K 8, E 256, uniform random routing, every rank
with the same token count T), per scheme and T:

1. Exchange, per dispatcher and mode:
   - ``variable``: no token bound, sizes exchanged first (one host sync; not capturable);
     ``fixed``: the workspace ``MoEKernel.allocate(T)`` gives, fixed blocks, no host sync.
     all2all_low_latency is always fixed: capacity = the busiest (expert, source rank)
     count of this routing (nothing overflows), ``raise_on_overflow=False``.
   - dispatch and combine timed separately, eagerly (CUDA events around the host call,
     host syncs and launch gaps included, as a caller sees them) and, for fixed modes, as
     CUDA graphs (dispatch and combine captured separately, replays timed the same way);
     a barrier before each call so every rank starts together; median over ``--iters``
     calls, then the slowest rank.
   - raw: ``all_to_all_single`` of the same bytes (``Dispatcher.wire_bytes``, mean over
     ranks, uint8, even splits), eager and graph-captured, timed the same way: the floor
     NCCL sets. ratio = (dispatch + combine) / (raw dispatch + raw combine), eager over
     eager and graph over graph. The bar: ratio <= 1.5 at 128 tokens per rank.
2. Layer (``--layer-tokens``): MoEKernel with the oracle's experts, routing given,
   eager and as a CUDA graph: on one GPU (rank 0) with all E experts and all W * T tokens
   through the local dispatcher, and under EP with E / W experts and T tokens per rank
   through each fixed-mode dispatcher (after ``allocate(T)``). speedup = one GPU / EP.
3. A check under CUDA graphs: identity experts (y = x), out must equal x * sum_k w, graph
   replay == eager, for each fixed mode.

Writes ``bench_ep_w{W}.md`` and ``bench_ep_w{W}.json`` under ``--out``. Without CUDA it
runs over gloo with host timers (``--preset tiny``: a smoke test of this program).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ..config import MoEConfig, ParallelConfig
from ..contract import TokenLayout, WeightedReduce
from ..dispatch.ep.all2all import All2AllDispatcher
from ..dispatch.ep.allgather import AllGatherReduceScatterDispatcher
from ..dispatch.ep.groups import comm_device, init_ep
from ..dispatch.ep.low_latency import All2AllLowLatencyDispatcher
from ..metadata import TopK
from ..quant import QTensor, QuantScheme
from ..testing import random_topk
from ..weights import ExpertWeights
from .timing import capture_graph

DISPATCHERS = {c.name: c for c in (AllGatherReduceScatterDispatcher, All2AllDispatcher, All2AllLowLatencyDispatcher)}
# (dispatcher, mode) rows of the exchange table, in order
MODES = (
    ("allgather_reducescatter", "variable"),
    ("allgather_reducescatter", "fixed"),
    ("all2all", "variable"),
    ("all2all", "fixed"),
    ("all2all_low_latency", "fixed"),
)
PRESETS = {
    "dsv3": MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048),
    "tiny": MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=64),
}
BAR, BAR_TOKENS = 1.5, 128


def stub_weights(config: MoEConfig, num_local: int, device) -> ExpertWeights:
    """Shapes only: dispatch reads the number of local experts and static activation scales (none here)."""
    w13 = QTensor(torch.empty(num_local, 0, device=device), (num_local, config.w13_rows, config.hidden_size))
    w2 = QTensor(torch.empty(num_local, 0, device=device), (num_local, config.hidden_size, config.intermediate_size))
    return ExpertWeights(w13=w13, w2=w2)


def _on_cuda() -> bool:
    return comm_device().type == "cuda"


def _barrier() -> None:
    if _on_cuda():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


# ---- timing -------------------------------------------------------------------------------
def time_us(fn, iters: int, warmup: int = 3, collective: bool = True) -> float:
    """Median microseconds of ``fn`` on this rank: CUDA events around the host call (or a host
    timer on the CPU), a barrier before each call when ``collective``."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = _on_cuda()
    for _ in range(iters):
        if collective:
            _barrier()
        elif cuda:
            torch.cuda.synchronize()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _reduce(v: float, op) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=op)
    return float(t.item())


def slowest(v: float) -> float:
    return _reduce(v, dist.ReduceOp.MAX)


def mean_over_ranks(v: float) -> float:
    return _reduce(v, dist.ReduceOp.SUM) / dist.get_world_size()


def everyone(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so no rank replays a graph whose peers have none)."""
    return _reduce(1.0 if ok else 0.0, dist.ReduceOp.MIN) == 1.0


def capture(fn, warmup: int = 2):
    """(graph of ``fn``, error string): warm up on a side stream, then capture on this rank."""
    try:
        return capture_graph(fn, warmup), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]


def graph_us(fn, iters: int, warmup: int = 2) -> tuple[float | None, str]:
    """(slowest rank's median replay time of ``fn`` captured as a CUDA graph, error); every rank calls it."""
    g, err = capture(fn, warmup)
    if not everyone(g is not None):
        return None, err or "capture failed on another rank"
    return slowest(time_us(g.replay, iters)), ""


_RAW: dict = {}


def raw_a2a(nbytes: int, iters: int) -> dict:
    """A raw uint8 all_to_all_single of ``nbytes`` per rank (the mean over ranks, so every rank
    runs the same), eager and graph-captured: {'eager': us, 'graph': us or None}."""
    w = dist.get_world_size()
    n = max(w, -(-int(mean_over_ranks(nbytes)) // w) * w)
    if n not in _RAW:
        src = torch.empty(n, dtype=torch.uint8, device=comm_device()).random_(0, 255)
        dst = torch.empty_like(src)

        def a2a():
            dist.all_to_all_single(dst, src)

        got = {"eager": slowest(time_us(a2a, iters)), "graph": None}
        if _on_cuda():
            got["graph"] = graph_us(a2a, iters)[0]
        _RAW[n] = got
    return _RAW[n]


# ---- 1. the exchange -------------------------------------------------------------------------
def global_need(ids: torch.Tensor, num_experts: int) -> int:
    """The largest number of pairs any rank sends one expert (the capacity that avoids overflow)."""
    c = torch.bincount(ids.reshape(-1).long(), minlength=num_experts).max().reshape(1).to(torch.int64)
    c = c.to(comm_device())
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    return max(1, int(c.item()))


def make(name: str, config, scheme, parallel, capacity: int):
    cls = DISPATCHERS[name]
    if cls is All2AllLowLatencyDispatcher:
        return cls(config, scheme, parallel, capacity=capacity, raise_on_overflow=False)
    return cls(config, scheme, parallel)


def _ratio(d, c, rd, rc) -> float | None:
    if None in (d, c, rd, rc) or rd + rc <= 0:
        return None
    return (d + c) / (rd + rc)


def exchange_cell(name, mode, config, scheme, parallel, weights, x, topk, emap, capacity, iters) -> dict:
    disp = make(name, config, scheme, parallel, capacity)
    standard = disp.layout is TokenLayout.STANDARD
    reduce = WeightedReduce.NONE if standard else WeightedReduce.WEIGHT_AND_SUM
    kw = {"expert_map": emap if standard else None}
    if mode == "fixed":
        kw["workspace"] = disp.workspace(x.shape[0], disp.num_local_experts).allocate(x.device)

    def dispatch():
        return disp.dispatch(x, topk, weights, **kw)

    d = dispatch()
    if disp.last_mode != mode:
        raise RuntimeError(f"{name} exchanged '{disp.last_mode}', expected '{mode}'")
    y = torch.randn(disp.output_shape(d, reduce), device=x.device).to(x.dtype)
    out = torch.empty_like(x)
    row = {
        "dispatch_us": slowest(time_us(dispatch, iters)),
        "combine_us": slowest(time_us(lambda: disp.combine(y, d, out, reduce), iters)),
    }
    bd, bc = (mean_over_ranks(b) for b in disp.wire_bytes)
    raw_d, raw_c = raw_a2a(int(bd), iters), raw_a2a(int(bc), iters)
    row.update(
        dispatch_MB=bd / 1e6,
        combine_MB=bc / 1e6,
        raw_dispatch_us=raw_d["eager"],
        raw_combine_us=raw_c["eager"],
        raw_graph_dispatch_us=raw_d["graph"],
        raw_graph_combine_us=raw_c["graph"],
    )
    if isinstance(disp, All2AllLowLatencyDispatcher):
        row["capacity"] = capacity
        row["overflow"] = int(disp.needed.item()) > capacity
    if x.is_cuda and mode == "fixed":
        held = {}

        def run_dispatch():
            held["d"] = dispatch()

        row["graph_dispatch_us"], err = graph_us(run_dispatch, iters)
        if row["graph_dispatch_us"] is not None:
            row["graph_combine_us"], err = graph_us(lambda: disp.combine(y, held["d"], out, reduce), iters, warmup=0)
        if err:
            row["graph_error"] = err
    row["ratio_eager"] = _ratio(row["dispatch_us"], row["combine_us"], raw_d["eager"], raw_c["eager"])
    row["ratio_graph"] = _ratio(
        row.get("graph_dispatch_us"), row.get("graph_combine_us"), raw_d["graph"], raw_c["graph"]
    )
    return row


# ---- 2. the layer ------------------------------------------------------------------------------
def _kernel(config, scheme, num_tokens, *, dispatcher="local", parallel=None, options=None):
    """The layer's kernel as the library builds it; the ranks' device decides the platform
    (gloo runs on the CPU even where a GPU is present)."""
    from ..oracle.build import build_kernel
    from ..platform import Platform, current_platform

    plat = current_platform() if _on_cuda() else Platform("cpu")
    return build_kernel(
        config, scheme, dispatcher=dispatcher, parallel=parallel, platform=plat, expert_map=True,
        num_tokens=num_tokens, dispatcher_options=options,
    )  # fmt: skip


def _layer_weights(config, scheme, num_experts: int, device):
    from .bench import bench_weights

    return bench_weights(dataclasses.replace(config, num_experts=num_experts), scheme, str(device))


def _time_layer(kern, x, topk, weights, emap, iters, collective: bool) -> dict:
    def fwd():
        return kern(x, topk, weights, expert_map=emap)

    eager = time_us(fwd, iters, collective=collective)
    got = {"eager_us": slowest(eager) if collective else eager}
    if x.is_cuda:
        if collective:
            got["graph_us"], err = graph_us(fwd, iters)
        else:
            g, err = capture(fwd)
            got["graph_us"] = time_us(g.replay, iters, collective=False) if g is not None else None
        if err:
            got["graph_error"] = err
    return got


def _one_gpu_cells(config, scheme, scheme_name, tokens, world, device, iters) -> list[dict]:
    rows = []
    first = _kernel(config, scheme, world * max(tokens))
    full = first.experts.prepare_weights(_layer_weights(config, first.scheme, config.num_experts, device))
    for t in tokens:
        g = torch.Generator(device=device).manual_seed(7 + t)
        x = torch.randn(world * t, config.hidden_size, generator=g, device=device).to(config.dtype)
        topk = TopK(*random_topk(world * t, config.num_experts, config.top_k, g))
        kern = _kernel(config, scheme, world * max(tokens))
        kern.allocate(world * t, device)
        row = {"scheme": scheme_name, "tokens": t, "setup": "1 GPU", "experts": kern.experts.name}
        try:
            row.update(_time_layer(kern, x, topk, full, None, iters, collective=False))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


def layer_cells(config, scheme_name, tokens, parallel, device, iters, capacity_of) -> list[dict]:
    """One GPU (rank 0) against EP, per T in ``tokens`` (see the module docstring)."""
    rank, world = parallel.ep_rank, parallel.ep_size
    scheme = QuantScheme.by_name(scheme_name)
    rows = []
    # one GPU: every expert, every rank's tokens (rank 0; a failure there stays there)
    if rank == 0:
        try:
            rows += _one_gpu_cells(config, scheme, scheme_name, tokens, world, device, iters)
        except Exception as e:
            rows.append({"scheme": scheme_name, "tokens": tokens[0], "setup": "1 GPU", "error": f"{e}"[:300]})
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _barrier()
    e_l = len(parallel.local_experts(config.num_experts))
    emap = parallel.expert_map(config.num_experts, device)
    cache: dict = {}
    for t in tokens:
        g = torch.Generator(device=device).manual_seed(1000 + rank * 7919 + t)
        x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
        topk = TopK(*random_topk(t, config.num_experts, config.top_k, g))
        capacity = capacity_of(topk.ids)
        for name, mode in MODES:
            if mode != "fixed":
                continue
            cls = DISPATCHERS[name]
            row = {"scheme": scheme_name, "tokens": t, "setup": f"EP{world} {name}"}
            try:
                opts = {"capacity": capacity, "raise_on_overflow": False} if cls is All2AllLowLatencyDispatcher else {}
                kern = _kernel(config, scheme, t, dispatcher=name, parallel=parallel, options=opts)
                key = (kern.experts.name, kern.scheme.name)
                if key not in cache:
                    cache[key] = kern.experts.prepare_weights(_layer_weights(config, kern.scheme, e_l, device))
                kern.allocate(t, device)
                row["experts"] = kern.experts.name
                em = emap if cls.layout is TokenLayout.STANDARD else None
                row.update(_time_layer(kern, x, topk, cache[key], em, iters, collective=True))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            rows.append(row)
    ref = {(r["scheme"], r["tokens"]): r for r in _gather_rows(rows) if r["setup"] == "1 GPU"}
    for r in rows:
        if r["setup"] == "1 GPU":
            continue
        one = ref.get((r["scheme"], r["tokens"]), {})
        for k in ("eager_us", "graph_us"):
            if r.get(k) and one.get(k):
                r[f"speedup_{k[:-3]}"] = one[k] / r[k]
    return rows


def _gather_rows(rows: list[dict]) -> list[dict]:
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    return [r for part in every for r in part]


# ---- 3. identity experts under CUDA graphs --------------------------------------------------
def graph_identity_check(name: str, parallel, device) -> str:
    """Identity experts (y = a, weighted over this rank's pairs for the standard layout): out must
    equal x * sum_k w; the graph's replay must equal the eager call."""
    config = MoEConfig(16, 4, 256, 64)
    cls = DISPATCHERS[name]
    kw = {"capacity": 64} if cls is All2AllLowLatencyDispatcher else {}
    disp = cls(config, QuantScheme.unquantized(), parallel, **kw)
    g = torch.Generator(device=device).manual_seed(7 + parallel.ep_rank)
    t = 40 + 3 * parallel.ep_rank
    x = torch.randn(t, config.hidden_size, generator=g, device=device).to(torch.bfloat16)
    ids, w = random_topk(t, config.num_experts, config.top_k, g)
    topk = TopK(ids, w)
    weights = stub_weights(config, disp.num_local_experts, device)
    emap = parallel.expert_map(config.num_experts, device)
    ws = disp.workspace(64, disp.num_local_experts).allocate(device)
    standard = cls.layout is TokenLayout.STANDARD
    reduce = WeightedReduce.NONE if standard else WeightedReduce.WEIGHT_AND_SUM
    d0 = disp.dispatch(x, topk, weights, expert_map=emap if standard else None, workspace=ws)
    y = torch.empty(disp.output_shape(d0, reduce), dtype=x.dtype, device=device)
    out = torch.empty_like(x)

    def step():
        d = disp.dispatch(x, topk, weights, expert_map=emap if standard else None, workspace=ws)
        if standard:
            mine = (emap[d.topk.ids.long()] >= 0).float()
            y.copy_(d.a.data.float() * (d.topk.weights * mine).sum(dim=1, keepdim=True))
        else:
            y.copy_(d.a.data)
        disp.combine(y, d, out, reduce)

    step()
    eager = out.clone()
    graph, err = capture(step)
    if not everyone(graph is not None):
        return f"capture failed: {err or 'on another rank'}"
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = x.float() * w.sum(dim=1, keepdim=True)
    rel = ((out.float() - want).norm() / want.norm()).item()
    return f"graph==eager: {torch.equal(out, eager)}; rel err vs x*sum(w): {rel:.2e}"


# ---- output ------------------------------------------------------------------------------------
def _f(v, spec=".1f") -> str:
    return "" if v is None else format(v, spec)


def _pair(a, b) -> str:
    return "" if a is None and b is None else f"{_f(a)} / {_f(b)}"


def _table_rows(rows: list[dict], head, cells) -> list[str]:
    """A table's lines: ``head(r)`` (the row's key cells), then ``cells(r)`` or the row's error."""
    return [f"{head(r)} error: {r['error'][:100]} |" if "error" in r else f"{head(r)} {cells(r)}" for r in rows]


def _exchange_cells(r: dict) -> str:
    g = r.get("graph_error", "")[:60]
    return (
        f"{r['dispatch_MB']:.2f} | {r['combine_MB']:.2f} | {r['dispatch_us']:.1f} | "
        f"{r['combine_us']:.1f} | {r['raw_dispatch_us']:.1f} / {r['raw_combine_us']:.1f} | "
        f"{_f(r.get('ratio_eager'), '.2f')} | {_f(r.get('graph_dispatch_us')) or g} | "
        f"{_f(r.get('graph_combine_us'))} | {_pair(r.get('raw_graph_dispatch_us'), r.get('raw_graph_combine_us'))}"
        f" | {_f(r.get('ratio_graph'), '.2f')} |"
    )


def _layer_cells(r: dict) -> str:
    return (
        f"{_f(r.get('eager_us'))} | {_f(r.get('graph_us')) or r.get('graph_error', '')[:40]} | "
        f"{_f(r.get('speedup_eager'), '.2f')} | {_f(r.get('speedup_graph'), '.2f')} |"
    )


def to_markdown(rows: list[dict], layer: list[dict], meta: dict) -> str:
    lines = [
        f"# Expert parallelism, {meta['world']} x {meta['gpu']}, {meta['shape']}",
        "",
        f"torch {meta['torch']}, NCCL {meta['nccl']}; medians of {meta['iters']} calls, slowest rank. MB = bytes "
        "one rank hands to the collective (counted as an all-to-all input). raw = NCCL all_to_all_single of the "
        "same bytes, timed the same way (eager, or replayed as a CUDA graph). ratio = (dispatch + combine) / "
        "(raw dispatch + raw combine). variable = sizes exchanged first (one host sync); fixed = blocks of the "
        "token bound (MoEKernel.allocate), no host sync.",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"## The bar: dispatch + combine <= {BAR}x raw at {BAR_TOKENS} tokens per rank",
        "",
        "| dispatcher | mode | scheme | eager ratio | graph ratio | verdict |",
        "|---|---|---|---|---|---|",
    ]
    if not any(r["tokens"] == BAR_TOKENS for r in rows):
        lines.append(f"| (no row at {BAR_TOKENS} tokens per rank) | | | | | |")
    for r in rows:
        if r["tokens"] != BAR_TOKENS or "error" in r:
            continue
        verdict = ", ".join(
            f"{kind} {'meets' if v <= BAR else 'misses'}"
            for kind, v in (("eager", r.get("ratio_eager")), ("graph", r.get("ratio_graph")))
            if v is not None
        )
        lines.append(
            f"| {r['dispatcher']} | {r['mode']} | {r['scheme']} | {_f(r.get('ratio_eager'), '.2f')} | "
            f"{_f(r.get('ratio_graph'), '.2f')} | {verdict} |"
        )
    lines += [
        "",
        "## Dispatch and combine (us)",
        "",
        "| dispatcher | mode | scheme | tokens/rank | dispatch MB | combine MB | dispatch | combine | raw d / c "
        "| ratio | graph dispatch | graph combine | graph raw d / c | graph ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += _table_rows(
        rows, lambda r: f"| {r['dispatcher']} | {r['mode']} | {r['scheme']} | {r['tokens']} |", _exchange_cells
    )
    if layer:
        lines += [
            "",
            "## The layer: one GPU (every expert, W x T tokens) against EP (T tokens per rank)",
            "",
            "MoEKernel with the oracle's experts, routing given; eager and CUDA-graph medians (us), slowest rank "
            "under EP; speedup = one GPU / EP.",
            "",
            "| scheme | tokens/rank | setup | experts | eager | graph | speedup eager | speedup graph |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += _table_rows(
            layer, lambda r: f"| {r['scheme']} | {r['tokens']} | {r['setup']} | {r.get('experts', '')} |", _layer_cells
        )
    if meta.get("graph_identity_check"):
        lines += ["", "## Identity experts under CUDA graphs", ""]
        lines += [f"- {k}: {v}" for k, v in meta["graph_identity_check"].items()]
    return "\n".join(lines) + "\n"


def write_results(out: str, world: int, rows: list[dict], layer: list[dict], meta: dict) -> str:
    """bench_ep_w{W}.md and .json under ``out``; returns the markdown."""
    md = to_markdown(rows, layer, meta)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"bench_ep_w{world}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, f"bench_ep_w{world}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "layer": layer}, f, indent=1)
    return md


# ---- entry points --------------------------------------------------------------------------------
def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,16,128,1024,4096")
    ap.add_argument("--schemes", default="bf16,fp8_block")
    ap.add_argument("--dispatchers", default=",".join(DISPATCHERS))
    ap.add_argument("--layer-tokens", default="128", help="tokens per rank of the layer part ('' to skip)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--preset", default="dsv3", choices=sorted(PRESETS))
    ap.add_argument("--timeout", type=float, default=300.0)
    return ap.parse_args(argv)


def _meta(args, argv, world: int, config: MoEConfig, cuda: bool) -> dict:
    """The run's header: GPU, shape, versions and the command that reproduces it."""
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if cuda and hasattr(torch.cuda, "nccl") else "-"
    return {
        "world": world,
        "gpu": torch.cuda.get_device_name() if cuda else "CPU (gloo)",
        "shape": f"{args.preset}: H {config.hidden_size}, K {config.top_k}, E {config.num_experts}",
        "torch": torch.__version__,
        "nccl": nccl,
        "iters": args.iters,
        "command": "torchrun --standalone --nproc-per-node {} -m fusedmoe.tools.bench_ep {}".format(
            world, " ".join(argv if argv is not None else sys.argv[1:])
        ),
    }


def _exchange_rows(args, config: MoEConfig, parallel: ParallelConfig, device) -> list[dict]:
    """Part 1: a row per (scheme, T, dispatcher, mode); a failure is the row's ``error``."""
    rank = parallel.ep_rank
    emap = parallel.expert_map(config.num_experts, device)
    weights = stub_weights(config, len(parallel.local_experts(config.num_experts)), device)
    wanted = set(args.dispatchers.split(","))
    rows = []
    for scheme_name in args.schemes.split(","):
        scheme = QuantScheme.by_name(scheme_name)
        for t in (int(v) for v in args.tokens.split(",")):
            g = torch.Generator(device=device).manual_seed(1000 + rank * 7919 + t)
            x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
            topk = TopK(*random_topk(t, config.num_experts, config.top_k, g))
            capacity = global_need(topk.ids, config.num_experts)
            for name, mode in (m for m in MODES if m[0] in wanted):
                row = {"dispatcher": name, "mode": mode, "scheme": scheme_name, "tokens": t}
                try:
                    cell = exchange_cell(
                        name, mode, config, scheme, parallel, weights, x, topk, emap, capacity, args.iters
                    )
                    row.update(cell)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _graph_checks(parallel: ParallelConfig, device) -> dict:
    """Part 3, per dispatcher: the CUDA-graph identity check's verdict (or why it failed)."""
    if device.type != "cuda":
        return {"-": "not run (no CUDA)"}
    checks = {}
    for name in DISPATCHERS:
        try:
            checks[name] = graph_identity_check(name, parallel, device)
        except Exception as e:
            checks[name] = f"failed: {type(e).__name__}: {e}"[:300]
    return checks


def _layer_rows(args, config: MoEConfig, parallel: ParallelConfig, device) -> list[dict]:
    """Part 2: one GPU against EP per scheme at ``--layer-tokens``; rank 0's one-GPU rows first."""
    layer_tokens = [int(v) for v in args.layer_tokens.split(",") if v]
    if not layer_tokens:
        return []
    layer = []
    for scheme_name in args.schemes.split(","):
        try:
            layer += layer_cells(
                config, scheme_name, layer_tokens, parallel, device, args.iters,
                lambda ids: global_need(ids, config.num_experts),
            )  # fmt: skip
        except Exception as e:  # the same failure on every rank (e.g. out of memory): report, go on
            layer.append({"scheme": scheme_name, "tokens": 0, "setup": "-", "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    one_gpu = [r for r in _gather_rows(layer) if r.get("setup") == "1 GPU"]
    return one_gpu + [r for r in layer if r.get("setup") != "1 GPU"]


def main(argv=None) -> int:
    args = _parse_args(argv)
    rank, world = init_ep(timeout_s=args.timeout)
    device = comm_device()
    config = PRESETS[args.preset]
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    meta = _meta(args, argv, world, config, device.type == "cuda")
    t_start = time.time()
    rows = _exchange_rows(args, config, parallel, device)
    meta["exchange_seconds"] = time.time() - t_start
    meta["graph_identity_check"] = _graph_checks(parallel, device)
    if rank == 0:  # written now and again after the layer part (a timeout there keeps these)
        write_results(args.out, world, rows, [], meta)
    layer = _layer_rows(args, config, parallel, device)
    meta["seconds"] = time.time() - t_start
    if rank == 0:
        print(write_results(args.out, world, rows, layer, meta), flush=True)
    _barrier()
    dist.destroy_process_group()
    return 0


def launch(out: str | None, options: str = "", nproc: int | None = None) -> int:
    """``fusedmoe bench --ep``: this program under torchrun on every GPU of this machine (two gloo
    processes without one), or directly when torchrun already started this process.
    ``options``: more of this program's options, as one string ("--tokens 128 --iters 50")."""
    import shlex
    import subprocess

    argv = (["--out", out] if out else []) + shlex.split(options or "")
    if "WORLD_SIZE" in os.environ:
        return main(argv)
    n = nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if n < 2:
        print(f"fusedmoe bench --ep: expert parallelism needs at least 2 ranks, this machine has {n} GPU")
        return 1
    env = dict(os.environ)
    # NVLink multicast stays off on the lent machines (notes/gpu_facts.md)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    return subprocess.call([*cmd, "-m", "fusedmoe.tools.bench_ep", *argv], env=env)


if __name__ == "__main__":
    sys.exit(main())
