"""The results of ``fusedmoe bench``: ``bench.json``, ``bench.md`` (every row, the bar, the
w4a16 speedups, the eager figures beside the recorded peers, where the time goes) and
``bench.png``. Rows are ``bench.Row``s; nothing here needs a GPU."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .peers import ratio_summary


@dataclass
class Row:
    preset: str
    scheme: str
    tokens: int
    provider: str
    mode: str  # 'graph' (CUDA-graph replays) or 'eager'
    ms: float
    floor_ms: float
    pct_of_floor: float
    bound: str  # what sets the floor: 'memory' or 'compute'
    tb_s: float
    tflop_s: float
    experts_hit: float
    command: str
    launches: float | None = None
    kernels: list = field(default_factory=list)  # [(name, calls, us)] per call, fusedmoe only
    # fusedmoe only, on the cell's first row (``_eager_figures``); us per call
    eager_host_us: float | None = None  # host enqueue time, no synchronisation between calls
    eager_wall_us: float | None = None  # eager call + synchronize, median
    fused_moe_us: float | None = None  # the same through ``api.fused_moe()``
    # the recorded peers (``peers.attach_peers``)
    peer_us: float | None = None  # the best peer's time (graph), and who
    peer_who: str | None = None
    peer_ratio: float | None = None  # ours / best (graph rows)
    peer_ratio_recorded: float | None = None  # ours / best when the peers were measured
    peer_eager_us: float | None = None  # vLLM fused_experts, eager call + synchronize
    eager_ratio: float | None = None  # eager_wall_us / peer_eager_us
    errors: list = field(default_factory=list)  # "what: why" of this row's measurements that failed


# ---- ceilings and floors -------------------------------------------------------------------


# the bar of the performance issue
MEMORY_BAR, COMPUTE_BAR, DECODE_BAR, W4_SPEEDUP_BAR = 85.0, 75.0, 100 / 1.2, 3.0


def write_results(out_dir: str, rows: list[Row], ceil: dict) -> None:
    """bench.json, bench.md and bench.png with the rows so far (rewritten after each scheme)."""
    import os

    import triton

    os.makedirs(out_dir, exist_ok=True)
    meta = {**ceil, "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(to_markdown(rows, meta))
    plot(rows, meta, os.path.join(out_dir, "bench.png"))


def bar_verdicts(rows: list[Row]) -> list[dict]:
    """The performance bar per (preset, scheme, T) cell of ``fusedmoe`` (graph timing)."""
    by_cell: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.mode == "graph" or r.provider not in by_cell.get((r.preset, r.scheme, r.tokens), {}):
            by_cell.setdefault((r.preset, r.scheme, r.tokens), {})[r.provider] = r
    out = []
    for (preset, scheme, t), cell in by_cell.items():
        ours = cell.get("fusedmoe")
        if ours is None or ours.mode != "graph":
            continue
        need = DECODE_BAR if t == 1 else (MEMORY_BAR if ours.bound == "memory" else COMPUTE_BAR)
        torch_row = cell.get("torch_grouped_mm")
        misses = []
        if ours.pct_of_floor < need:
            misses.append(f"{ours.pct_of_floor:.0f}% of floor < {need:.0f}%")
        if torch_row is not None and torch_row.ms <= ours.ms:
            misses.append(f"torch {torch_row.ms:.4f} ms <= ours")
        out.append(
            dict(
                preset=preset,
                scheme=scheme,
                tokens=t,
                ms=ours.ms,
                pct=ours.pct_of_floor,
                need=need,
                torch_ms=None if torch_row is None else torch_row.ms,
                misses=misses,
            )
        )
    return out


def w4a16_speedups(rows: list[Row], schemes=("int4_g128", "mxfp4")) -> list[dict]:
    """Our bf16 layer's time over our w4a16 layer's at T = 1, per preset (bar: >= 3x)."""
    ours = {(r.preset, r.scheme, r.tokens): r.ms for r in rows if r.provider == "fusedmoe" and r.mode == "graph"}
    out = []
    for (preset, scheme, t), ms in sorted(ours.items()):
        if t == 1 and scheme in schemes and (preset, "bf16", 1) in ours:
            out.append(
                dict(
                    preset=preset,
                    scheme=scheme,
                    bf16_ms=ours[(preset, "bf16", 1)],
                    ms=ms,
                    speedup=ours[(preset, "bf16", 1)] / ms,
                )
            )
    return out


def to_markdown(rows: list[Row], meta: dict) -> str:
    """bench.md: the header, every row, the bar, the w4a16 speedups, the eager figures and the
    peers, where the time goes."""
    lines = _header_and_rows(rows, meta)
    for section in (
        _bar_section(rows),
        _w4a16_section(rows),
        _eager_and_peers_section(rows, meta),
        _parts_section(rows),
    ):
        lines += section
    return "\n".join(lines) + "\n"


def _header_and_rows(rows: list[Row], meta: dict) -> list[str]:
    lines = [
        f"# fusedmoe bench on {meta['gpu']} ({meta['date']}; torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Ceilings measured in the same run: copy {meta['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {meta['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, "
        f"fp8 matmul {meta.get('fp8_flop_per_s', 0) / 1e12:.0f} TFLOP/s. Times: median of CUDA-graph "
        "replays (mode graph) or eager calls, inputs rotated, L2 flushed before each; the whole layer "
        "from router logits.",
        "",
    ]
    if meta.get("not_run"):
        lines += ["Not run (the scheme cannot store the preset's weights): " + "; ".join(meta["not_run"]), ""]
    if meta.get("failed"):
        lines += ["Failed (the run went on): " + "; ".join(meta["failed"]), ""]
    lines += [
        "| preset | scheme | T | provider | mode | ms | floor ms | bound | % of floor | TB/s | TFLOP/s "
        "| experts hit | launches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        launches = "" if r.launches is None else f"{r.launches:.0f}"
        lines.append(
            f"| {r.preset} | {r.scheme} | {r.tokens} | {r.provider} | {r.mode} | {r.ms:.4f} | {r.floor_ms:.4f} "
            f"| {r.bound} | {r.pct_of_floor:.1f} | {r.tb_s:.2f} | {r.tflop_s:.1f} | {r.experts_hit:g} | {launches} |"
        )
    return lines


def _table(heading: str, notes: list[str], columns: str, body: list[str]) -> list[str]:
    """A '## heading' section: note paragraphs, then a table of ``columns`` ('a | b | c') and
    ``body`` (its rows, already formatted)."""
    head = ["", f"## {heading}"] if heading else []
    paragraphs = [x for note in notes for x in ("", note)]
    n = columns.count("|") + 1
    return [*head, *paragraphs, "", f"| {columns} |", "|" + "---|" * n, *body]


def _bar_section(rows: list[Row]) -> list[str]:
    body = []
    for v in bar_verdicts(rows):
        tms = "" if v["torch_ms"] is None else f"{v['torch_ms']:.4f}"
        verdict = "meets" if not v["misses"] else "misses: " + "; ".join(v["misses"])
        body.append(
            f"| {v['preset']} | {v['scheme']} | {v['tokens']} | {v['ms']:.4f} | {v['pct']:.1f} "
            f"| {v['need']:.0f} | {tms} | {verdict} |"
        )
    if not body:
        return []
    note = (
        f">= {MEMORY_BAR:.0f}% of a memory floor, >= {COMPUTE_BAR:.0f}% of a compute floor, T = 1 within "
        "1.2x of the floor, faster than torch grouped GEMM."
    )
    columns = "preset | scheme | T | ms | % of floor | needed | torch ms | verdict"
    return _table("The bar (fusedmoe, graph timing)", [note], columns, body)


def _w4a16_section(rows: list[Row]) -> list[str]:
    body = [
        f"| {s['preset']} | {s['scheme']} | {s['bf16_ms']:.4f} | {s['ms']:.4f} | {s['speedup']:.2f}x |"
        for s in w4a16_speedups(rows)
    ]
    columns = "preset | scheme | bf16 ms | ms | speedup"
    return _table("w4a16 at T = 1 against our bf16 (bar: >= 3x)", [], columns, body) if body else []


def _num(v: float | None, spec: str = ".1f") -> str:
    return "" if v is None else format(v, spec)


def _peer_notes(meta: dict) -> list[str]:
    """Where the peer times come from, and what makes a ratio compare unlike things."""
    peers = meta.get("peers") or {}
    if not peers:
        return []
    name = Path(peers.get("path") or "?").name
    out = [f"- peers: {peers.get('title', '')} ({peers.get('gpu', '?')}, {peers.get('date', '?')}), `{name}`"]
    if peers.get("gpu") and peers["gpu"].split()[0] not in meta.get("gpu", ""):
        out.append(f"- this run is on {meta.get('gpu')}, the peers were timed on {peers['gpu']}: ratios compare GPUs")
    for p, why in (meta.get("peer_layer_differs") or {}).items():
        out.append(f"- {p}: the bench's layer has {why}; the peers ran softmax top-k, SiLU, no bias")
    return ["\n".join(out)]


def _eager_and_peers_section(rows: list[Row], meta: dict) -> list[str]:
    """Per fusedmoe cell: graph time, the best recorded peer and ratio, the eager figures and
    vLLM's recorded eager time; then the geometric means per scheme."""
    cells = [r for r in rows if r.provider == "fusedmoe" and (r.eager_wall_us or r.peer_us or r.errors)]
    if not cells:
        return []
    calls = meta.get("eager_calls") or {}
    method = (
        f"eager host: {calls.get('host', '?')} calls without synchronisation, wall time / {calls.get('host', '?')};"
        f" eager wall and fused_moe(): one call + synchronize, median of {calls.get('wall', '?')}. ratio = ours / "
        "best peer (graph; above 1: slower); eager ratio = eager wall / vLLM fused_experts (eager wall)."
    )
    body = []
    for r in cells:
        graph = f"{r.ms * 1e3:.1f}" if r.mode == "graph" else ""
        body.append(
            f"| {r.preset} | {r.scheme} | {r.tokens} | {graph} | {_num(r.peer_us)} | {r.peer_who or ''} "
            f"| {_num(r.peer_ratio, '.2f')} | {_num(r.eager_host_us)} | {_num(r.eager_wall_us)} "
            f"| {_num(r.fused_moe_us)} | {_num(r.peer_eager_us)} | {_num(r.eager_ratio, '.2f')} "
            f"| {'; '.join(r.errors)} |"
        )
    columns = (
        "preset | scheme | T | graph | peer best | who | ratio | eager host | eager wall | fused_moe() "
        "| vLLM eager | eager ratio | failed"
    )
    heading = "fusedmoe per call: CUDA graph, eager, fused_moe() and the recorded peers (us)"
    return _table(heading, [method, *_peer_notes(meta)], columns, body) + _ratio_summary_lines(rows)


def _ratio_summary_lines(rows: list[Row]) -> list[str]:
    body = [
        f"| {s['scheme']} | {s['cells']} | {_num(s['geomean'], '.3f')} | {_num(s['recorded'], '.3f')} "
        f"| {s['eager_cells']} | {_num(s['eager_geomean'], '.3f')} |"
        for s in ratio_summary(rows)
    ]
    note = (
        "Geometric mean of ours / best peer per scheme (recorded: our ratio when the peers were measured, same cells):"
    )
    columns = "scheme | cells | ratio | recorded | eager cells | eager ratio"
    return _table("", [note], columns, body) if body else []


def _parts_section(rows: list[Row]) -> list[str]:
    parts = [r for r in rows if r.kernels]
    if not parts:
        return []
    lines = ["", "## Where the time goes (fusedmoe: kernels per call, profiler, eager, no flush)", ""]
    for r in parts:
        ks = "; ".join(f"{name} x{calls:g} {us:.1f} us" for name, calls, us in r.kernels[:10])
        lines.append(f"- {r.preset} {r.scheme} T={r.tokens}: {r.launches:.0f} launches: {ks}")
    return lines


def plot(rows: list[Row], meta: dict, path: str) -> bool:
    """% of the floor against T: a panel per (scheme, preset), a colour per provider, dashed =
    eager. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install fusedmoe[bench])")
        return False
    presets = list(dict.fromkeys(r.preset for r in rows))
    schemes = list(dict.fromkeys(r.scheme for r in rows))
    if not presets:
        return False
    colours = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r.provider for r in rows))}
    fig, axes = plt.subplots(
        len(schemes), len(presets), figsize=(4 * len(presets), 3 * len(schemes)), squeeze=False, sharey=True
    )
    for (si, scheme), (pi, preset) in itertools.product(enumerate(schemes), enumerate(presets)):
        ax = axes[si][pi]
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r.preset == preset and r.scheme == scheme:
                series.setdefault((r.provider, r.mode), []).append((r.tokens, r.pct_of_floor))
        for (provider, mode), pts in series.items():
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                ms=3,
                color=colours.get(provider, "k"),
                ls="--" if mode == "eager" else "-",
                label=f"{provider} ({mode})",
            )
        ax.set_xscale("log", base=2)
        ax.axhline(MEMORY_BAR, color="gray", lw=0.8, ls=":")
        ax.set_title(f"{preset} {scheme}", fontsize=9)
        ax.grid(alpha=0.3)
        if si == len(schemes) - 1:
            ax.set_xlabel("tokens")
        if pi == 0:
            ax.set_ylabel("% of roofline floor")
        if ax.lines:
            ax.legend(fontsize=6, loc="best")
    fig.suptitle(f"fusedmoe bench, {meta['gpu']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
