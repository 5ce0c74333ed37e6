"""Expert-parallel dispatch and combine: latency and bandwidth of each dispatcher against raw NCCL.

    torchrun --standalone --nproc-per-node 4 -m fusedmoe.bench_ep --out $OUT

Per (scheme, tokens per rank, dispatcher), at the DeepSeek-V3 shape (H 7168,
K 8, E 256, uniform random routing, every rank with the same token count):

- dispatch and combine timed separately with CUDA events, each call preceded
  by a (host-blocking) barrier so all ranks start together; median over
  ``--iters`` calls, then the slowest rank. Eager mode: host syncs and launch
  gaps are part of the time, as a caller would see them.
- the bytes each rank hands to the collective (``Dispatcher.wire_bytes``,
  counted as an all-to-all input) and a raw ``all_to_all_single`` of the same
  bytes split evenly (uint8), timed the same way: the floor NCCL sets.
- all2all_low_latency runs with ``raise_on_overflow=False`` (no host read of
  the flag) and a capacity equal to the largest (expert, source rank) count of
  this routing (checked after timing), and also as CUDA graphs (dispatch and
  combine captured separately) where capture works.

Writes ``bench_ep_w{W}.md`` and ``bench_ep_w{W}.json`` under ``--out``, with
a final identity-experts check of the low-latency graph against eager. Without
CUDA it runs over gloo with host timers (``--preset tiny``: a smoke test of
this program, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .config import MoEConfig, ParallelConfig
from .dispatch.all2all import All2AllDispatcher
from .dispatch.allgather import AllGatherReduceScatterDispatcher
from .dispatch.low_latency import All2AllLowLatencyDispatcher
from .distributed import comm_device, init_ep
from .experts.base import TokenLayout, WeightedReduce
from .metadata import TopK
from .quant import QTensor, QuantScheme
from .testing import random_topk
from .weights import ExpertWeights

DISPATCHERS = (AllGatherReduceScatterDispatcher, All2AllDispatcher, All2AllLowLatencyDispatcher)
PRESETS = {
    "dsv3": MoEConfig(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048),
    "tiny": MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=64),
}


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


def time_us(fn, iters: int, warmup: int = 3) -> float:
    """Median microseconds of ``fn`` on this rank (CUDA events, or a host timer on the CPU; a barrier
    before each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _barrier()
        if _on_cuda():
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


_RAW: dict = {}


def raw_a2a_us(nbytes: int, iters: int) -> float:
    """A raw uint8 all_to_all_single of ``nbytes`` per rank (mean over ranks, so every rank runs it)."""
    w = dist.get_world_size()
    n = max(w, -(-int(mean_over_ranks(nbytes)) // w) * w)
    if n not in _RAW:
        src = torch.empty(n, dtype=torch.uint8, device=comm_device()).random_(0, 255)
        dst = torch.empty_like(src)
        _RAW[n] = slowest(time_us(lambda: dist.all_to_all_single(dst, src), iters))
    return _RAW[n]


def global_need(ids: torch.Tensor, num_experts: int) -> int:
    """The largest number of pairs any rank sends one expert (the capacity that avoids overflow)."""
    c = torch.bincount(ids.reshape(-1).long(), minlength=num_experts).max().reshape(1).to(torch.int64)
    c = c.to(comm_device())
    dist.all_reduce(c, op=dist.ReduceOp.MAX)
    return max(1, int(c.item()))


def make(cls, config, scheme, parallel, capacity):
    if cls is All2AllLowLatencyDispatcher:
        return cls(config, scheme, parallel, capacity=capacity, raise_on_overflow=False)
    return cls(config, scheme, parallel)


def bench_cell(cls, config, scheme, parallel, weights, x, topk, emap, capacity, iters) -> dict:
    disp = make(cls, config, scheme, parallel, capacity)
    reduce = WeightedReduce.NONE if cls.layout is TokenLayout.STANDARD else WeightedReduce.WEIGHT_AND_SUM
    em = emap if cls.layout is TokenLayout.STANDARD else None

    def dispatch():
        return disp.dispatch(x, topk, weights, expert_map=em)

    d = dispatch()
    y = torch.randn(disp.output_shape(d, reduce), device=x.device).to(x.dtype)
    out = torch.empty_like(x)
    t_d = slowest(time_us(dispatch, iters))
    t_c = slowest(time_us(lambda: disp.combine(y, d, out, reduce), iters))
    bd, bc = (mean_over_ranks(b) for b in disp.wire_bytes)
    row = {
        "dispatch_us": t_d,
        "combine_us": t_c,
        "dispatch_MB": bd / 1e6,
        "combine_MB": bc / 1e6,
        "raw_dispatch_us": raw_a2a_us(int(bd), iters),
        "raw_combine_us": raw_a2a_us(int(bc), iters),
    }
    if cls is All2AllLowLatencyDispatcher:
        row["capacity"] = capacity
        row["overflow"] = int(disp.needed.item()) > capacity
        if x.is_cuda:
            row.update(graph_times(disp, dispatch, y, out, reduce, iters))
    return row


def everyone(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so no rank replays a graph whose peers have none)."""
    return _reduce(1.0 if ok else 0.0, dist.ReduceOp.MIN) == 1.0


def capture(fn, warmup: int = 2):
    """(graph of ``fn``, error string): warm up on a side stream, then capture on this rank."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph, ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]


def graph_times(disp, dispatch, y, out, reduce, iters) -> dict:
    """Dispatch and combine captured as CUDA graphs and replayed (low latency only)."""
    held = {}

    def run_dispatch():
        held["d"] = dispatch()

    gd, err = capture(run_dispatch)
    gc = None
    if gd is not None:
        gc, err = capture(lambda: disp.combine(y, held["d"], out, reduce), warmup=0)
    if not everyone(gc is not None):
        return {"graph_error": err or "capture failed on another rank"}
    return {
        "graph_dispatch_us": slowest(time_us(gd.replay, iters)),
        "graph_combine_us": slowest(time_us(gc.replay, iters)),
    }


def graph_identity_check(parallel, device) -> str:
    """Low latency under CUDA graphs with identity experts (y = a): out must equal x * sum_k w (bf16)."""
    config = MoEConfig(16, 4, 256, 64)
    disp = All2AllLowLatencyDispatcher(config, QuantScheme.unquantized(), parallel, capacity=64)
    g = torch.Generator(device=device).manual_seed(7 + parallel.ep_rank)
    t = 40 + 3 * parallel.ep_rank
    x = torch.randn(t, config.hidden_size, generator=g, device=device).to(torch.bfloat16)
    ids, w = random_topk(t, config.num_experts, config.top_k, g)
    topk = TopK(ids, w)
    weights = stub_weights(config, disp.num_local_experts, device)
    d0 = disp.dispatch(x, topk, weights)
    y = torch.empty(disp.output_shape(d0, WeightedReduce.WEIGHT_AND_SUM), dtype=x.dtype, device=device)
    out = torch.empty_like(x)

    def step():
        d = disp.dispatch(x, topk, weights)
        y.copy_(d.a.data)
        disp.combine(y, d, out, WeightedReduce.WEIGHT_AND_SUM)

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


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# EP dispatch/combine, {meta['world']} x {meta['gpu']}, {meta['shape']}",
        "",
        f"torch {meta['torch']}, NCCL {meta['nccl']}; medians of {meta['iters']} calls, slowest rank; MB = bytes "
        "one rank hands to the collective; raw = NCCL all_to_all_single of the same bytes",
        "",
        "| dispatcher | scheme | tokens/rank | dispatch us | raw us | dispatch GB/s | combine us | raw us "
        "| combine GB/s | dispatch MB | combine MB | graph dispatch us | graph combine us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dispatcher']} | {r['scheme']} | {r['tokens']} | error: {r['error'][:80]} |")
            continue
        gbs_d = r["dispatch_MB"] * 1e6 / (r["dispatch_us"] * 1e-6) / 1e9
        gbs_c = r["combine_MB"] * 1e6 / (r["combine_us"] * 1e-6) / 1e9
        gd = f"{r['graph_dispatch_us']:.1f}" if "graph_dispatch_us" in r else r.get("graph_error", "")[:40]
        gc = f"{r['graph_combine_us']:.1f}" if "graph_combine_us" in r else ""
        lines.append(
            f"| {r['dispatcher']} | {r['scheme']} | {r['tokens']} | {r['dispatch_us']:.1f} | "
            f"{r['raw_dispatch_us']:.1f} | {gbs_d:.1f} | {r['combine_us']:.1f} | {r['raw_combine_us']:.1f} | "
            f"{gbs_c:.1f} | {r['dispatch_MB']:.2f} | {r['combine_MB']:.2f} | {gd} | {gc} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,16,128,1024,4096")
    ap.add_argument("--schemes", default="bf16,fp8_block")
    ap.add_argument("--dispatchers", default=",".join(c.name for c in DISPATCHERS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--preset", default="dsv3", choices=sorted(PRESETS))
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    rank, world = init_ep(timeout_s=args.timeout)
    device = comm_device()
    config = PRESETS[args.preset]
    parallel = ParallelConfig(ep_size=world, ep_rank=rank)
    emap = parallel.expert_map(config.num_experts, device)
    num_local = len(parallel.local_experts(config.num_experts))
    weights = stub_weights(config, num_local, device)
    wanted = set(args.dispatchers.split(","))
    cuda = device.type == "cuda"
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if cuda and hasattr(torch.cuda, "nccl") else "-"
    meta = {
        "world": world,
        "gpu": torch.cuda.get_device_name() if cuda else "CPU (gloo)",
        "shape": f"{args.preset}: H {config.hidden_size}, K {config.top_k}, E {config.num_experts}",
        "torch": torch.__version__,
        "nccl": nccl,
        "iters": args.iters,
        "command": "torchrun --standalone --nproc-per-node {} -m fusedmoe.bench_ep {}".format(
            world, " ".join(argv if argv is not None else sys.argv[1:])
        ),
    }
    rows = []
    t_start = time.time()
    for scheme_name in args.schemes.split(","):
        scheme = QuantScheme.by_name(scheme_name)
        for t in (int(v) for v in args.tokens.split(",")):
            g = torch.Generator(device=device).manual_seed(1000 + rank * 7919 + t)
            x = torch.randn(t, config.hidden_size, generator=g, device=device).to(config.dtype)
            ids, w = random_topk(t, config.num_experts, config.top_k, g)
            topk = TopK(ids, w)
            capacity = global_need(ids, config.num_experts)
            for cls in DISPATCHERS:
                if cls.name not in wanted:
                    continue
                row = {"dispatcher": cls.name, "scheme": scheme_name, "tokens": t}
                try:
                    row.update(bench_cell(cls, config, scheme, parallel, weights, x, topk, emap, capacity, args.iters))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    meta["seconds"] = time.time() - t_start
    if rank == 0:
        md = to_markdown(rows, meta)
        print(md)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_ep_w{world}.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, f"bench_ep_w{world}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    check = "not run (no CUDA)"
    if cuda:
        try:
            check = graph_identity_check(parallel, device)
        except Exception as e:
            check = f"failed: {type(e).__name__}: {e}"[:300]
    if rank == 0:
        print(f"low-latency CUDA-graph identity check: {check}", flush=True)
        with open(os.path.join(args.out, f"bench_ep_w{world}.json")) as f:
            data = json.load(f)
        data["graph_identity_check"] = check
        with open(os.path.join(args.out, f"bench_ep_w{world}.json"), "w") as f:
            json.dump(data, f, indent=1)
    _barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
