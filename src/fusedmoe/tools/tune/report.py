"""What a tuning run found: per-step and per-combo results, the JSON files the runtime reads
(``kernels.tuned_configs``), and the markdown summary."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...kernels.launch_config import LaunchConfig
from ...kernels.tuned_configs import clear_cache, config_path
from .operands import Combo
from .space import MIN_CANDIDATES, fmt_config


@dataclass
class StepResult:
    """One GEMM at one token count: the winner and the heuristic config, timed in the same run."""

    gemm: str
    t: int
    pairs: int
    cfg: LaunchConfig
    ms: float
    heuristic: LaunchConfig
    heuristic_ms: float
    planned: int  # candidates in the space
    kept: int  # after the budget cut
    screened: int = 0
    rejected: list = field(default_factory=list)  # (cfg, rel. error)
    failed: int = 0  # did not compile or run (shared memory, registers)
    late: int = 0  # not warm by the step's deadline
    cold: int = 0  # compiled in the main process after all (first run > 0.5 s on a GPU)
    key_checked: int = 0
    key_mismatch: int = 0
    shipped: LaunchConfig | None = None  # the table's entry the layer ran before this run (re-timed)
    shipped_ms: float = 0.0

    @property
    def speedup(self) -> float:
        return _ratio(self.heuristic_ms, self.ms)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


@dataclass
class ComboResult:
    combo: Combo
    e: int = 0
    shapes: dict = field(default_factory=dict)  # gemm -> (N, K, scheme key)
    steps: dict = field(default_factory=dict)  # (gemm, t) -> StepResult
    files: list = field(default_factory=list)
    error: str | None = None

    def finished_tokens(self) -> list[int]:
        """Token counts whose two GEMMs both finished: the entries written."""
        return sorted(t for g, t in self.steps if g == "w13" and ("w2", t) in self.steps)


@dataclass
class TuneReport:
    """What ``tune_many`` did; ``markdown()`` is the summary."""

    gpu: str
    space: str
    tokens: list
    budget_s: float | None
    workers: int
    combos: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # steps never finished
    unsupported: list = field(default_factory=list)  # combos whose scheme cannot store the shape
    fractions: list = field(default_factory=list)  # budget fraction kept, per step
    stopped: str | None = None
    wall_s: float = 0.0
    jobs: int = 0
    job_s: float = 0.0

    @property
    def files(self) -> list[Path]:
        return [p for c in self.combos for p in c.files]

    def total(self, attr: str) -> int:
        return sum(getattr(s, attr) for c in self.combos for s in c.steps.values())

    def markdown(self) -> str:
        return _summary(self)


def _write_json(path: Path, data: dict) -> None:
    """Write by rename: a reader (or a killed run) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _kept_entries(path: Path, head: dict) -> dict:
    """The per-pair-count entries of an existing file for the same GPU, scheme and shape (a run
    that tunes some token counts keeps the others); nothing if there is none or it differs."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if any(old.get(f) != head[f] for f in ("gpu", "scheme", "E", "N", "K")):
        return {}
    return {f: dict(old.get(f) or {}) for f in ("configs", "ms", "heuristic_ms")}


def write_combo(cr: ComboResult, out_dir: Path | str, gpu: str, space: str = "quick") -> list[Path]:
    """One JSON per GEMM of the combo, with the token counts whose two GEMMs finished, merged
    into the entries of other token counts an existing file for the same shape holds (both
    GEMMs' files get the same counts replaced, so GEMM2 stays tuned under GEMM1's BM)."""
    import triton

    tokens = cr.finished_tokens()
    paths = []
    for gemm in ("w13", "w2") if tokens else ():
        n, k, key = cr.shapes[gemm]
        rs = [cr.steps[(gemm, t)] for t in tokens]
        path = config_path(out_dir, gpu, key, cr.e, n, k)
        head = {"gpu": gpu, "scheme": key, "E": cr.e, "N": n, "K": k}
        data = {
            **head,
            "triton": triton.__version__,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "space": space,
            "configs": {str(r.pairs): asdict(r.cfg) for r in rs},
            "ms": {str(r.pairs): round(r.ms, 5) for r in rs},
            "heuristic_ms": {str(r.pairs): round(r.heuristic_ms, 5) for r in rs},
        }
        for f, entries in _kept_entries(path, head).items():
            data[f] = dict(sorted({**entries, **data[f]}.items(), key=lambda kv: int(kv[0])))
        _write_json(path, data)
        paths.append(path)
    clear_cache()
    return paths


def _summary(rep: TuneReport) -> str:
    lines = [
        f"# fusedmoe tune on {rep.gpu}",
        "",
        f"{time.strftime('%Y-%m-%d')}, space `{rep.space}`, tokens {','.join(map(str, rep.tokens))}, budget "
        f"{'none' if rep.budget_s is None else f'{rep.budget_s:.0f} s'}, wall {rep.wall_s:.0f} s"
        + (f", stopped: {rep.stopped}" if rep.stopped else "")
        + f". {rep.workers} compile workers: {rep.jobs} compiles, {rep.job_s / max(1, rep.jobs):.2f} s each; "
        f"warm keys checked {rep.total('key_checked')}, mismatched {rep.total('key_mismatch')}; compiled in the "
        f"main process (cold) {rep.total('cold')}; smallest budget fraction {min(rep.fractions, default=1):.2f} "
        f"(a step keeps at least {MIN_CANDIDATES + 1} candidates).",
        "",
    ]
    for cr in rep.combos:
        names = [f"{g} `{p.relative_to(p.parents[2])}`" for g, p in zip(("GEMM1", "GEMM2"), cr.files, strict=False)]
        names = names or ["(nothing written)"]
        lines += [f"## {cr.combo.name}" + (f" (error: {cr.error})" if cr.error else ""), "", ", ".join(names), ""]
        lines += [
            "| T | GEMM1 config | ms | heuristic ms | x | GEMM2 config | ms | heuristic ms | x | both x |"
            " screened/kept/space | rejected failed late | x shipped |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in sorted({t for _, t in cr.steps}):
            a, b = cr.steps.get(("w13", t)), cr.steps.get(("w2", t))
            cells = [str(t)]
            for r in (a, b):
                cells += (
                    [fmt_config(r.cfg), f"{r.ms:.4f}", f"{r.heuristic_ms:.4f}", f"{r.speedup:.2f}"] if r else ["-"] * 4
                )
            rs = [r for r in (a, b) if r]
            cells += [
                f"{_ratio(a.heuristic_ms + b.heuristic_ms, a.ms + b.ms):.2f}" if a and b else "-",
                ", ".join(f"{r.screened}/{r.kept}/{r.planned}" for r in rs),
                ", ".join(f"{len(r.rejected)} {r.failed} {r.late}" for r in rs),
                ", ".join(f"{_ratio(r.shipped_ms, r.ms):.2f}" if r.shipped else "-" for r in rs),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if rep.skipped:
        lines += [f"Not tuned ({rep.stopped or 'failed'}): " + "; ".join(rep.skipped), ""]
    if rep.unsupported:
        lines += ["Not tunable (the scheme cannot store the shape): " + "; ".join(rep.unsupported), ""]
    lines.append(
        "Config: BM,BN,BK,GROUP_M,warps,stages. x: heuristic ms / tuned ms (same run, CUDA-graph replays); x shipped:"
        " the table entry the layer ran before this run / tuned (re-timed in the run; '-': no entry, or it failed"
        " the screen)."
    )
    return "\n".join(lines)
