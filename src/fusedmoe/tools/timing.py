"""GPU timing shared by the benchmarks and the tuner: CUDA-graph capture, and medians of calls
with L2 flushed before each (outside the timed span), so weights come from HBM."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def capture_graph(fn: Callable[[], object], warmup: int = 2):
    """A ``torch.cuda.CUDAGraph`` of ``fn``, warmed up (compiled) on a side stream first, as
    PyTorch advises. Raises what the capture raises (e.g. a host synchronisation inside)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class FlushTimer:
    """Median ms of calls rotating through ``fns`` (one per input set), each after a write of
    ``flush_mb`` MiB; CUDA-graph replays, or eager calls when asked or when capture fails."""

    def __init__(self, flush_mb: int = 512) -> None:
        import torch

        self.flush = torch.empty(flush_mb << 20, dtype=torch.int8, device="cuda")

    def spans(self, runs: list[Callable[[], object]], n: int) -> list[float]:
        import torch

        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for i, (s, e) in enumerate(ev):
            self.flush.zero_()
            s.record()
            runs[i % len(runs)]()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]

    def median_ms(
        self,
        fns: list[Callable[[], object]],
        *,
        graph: bool = True,
        target_ms: float = 200.0,
        max_reps: int = 500,
        warmup: int = 2,
    ) -> tuple[float, str]:
        """(median ms, mode): mode 'graph', or 'eager' when asked or when capture failed (said)."""
        import torch

        runs, mode, graphs = list(fns), "eager", []
        if graph:
            try:
                graphs = [capture_graph(f, warmup) for f in fns]
                runs, mode = [g.replay for g in graphs], "graph"
            except Exception as e:  # host synchronisation inside: timed eagerly, and said so
                torch.cuda.synchronize()
                print(f"  capture failed, timing eagerly: {type(e).__name__}: {e}"[:240])
                graphs = []
        for r in runs:  # warm (compiles in eager mode)
            r()
        est = statistics.median(self.spans(runs, 3 * len(runs)))
        # the flush takes ~0.1-0.15 ms per rep outside the span; every input set at least 5 times
        n = int(min(max_reps, max(5 * len(runs), target_ms / max(est + 0.15, 1e-3))))
        ms = statistics.median(self.spans(runs, n))
        del graphs
        return ms, mode
