"""Recorded peer times and our ratio to them.

The peers (vLLM's Triton fused MoE, Marlin MoE, OpenAI triton_kernels, Liger, torch
grouped GEMM) cannot run beside us in one process, so their layer times are measured once,
on one GPU, and kept as data: ``benchmarks/peers/peer_times_<gpu>.json``, written from the
measurement notes by ``scripts/peer_times_to_json.py`` (``parse_notes``). ``fusedmoe bench``
reads that file (``load_peers``) and puts beside each of its ``fusedmoe`` cells the best peer's
time, who it was, and ratio = ours / best (above 1: we are slower), with a geometric mean per
scheme (``ratio_summary``).

JSON layout, times in microseconds::

    {"source": {"title", "date", "gpu", "torch", "triton", "method", "peers", ...},
     "cells": [{"preset", "scheme", "tokens", "floor_us", "fusedmoe_us", "vllm_triton_us",
                "best_us", "best_who", "ratio"}, ...],      # CUDA-graph replays, L2 flushed
     "eager": [{"preset", "scheme", "tokens", "fused_moe_us", "moe_kernel_us",
                "vllm_fused_experts_us"}, ...]}             # eager call + synchronize, median of 25

``fusedmoe_us`` and ``ratio`` are ours at the time of the measurement: the summary shows them
beside today's, so a regression against our own past shows as well as one against the peers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Activation
from ..quant import QuantScheme
from .presets import PRESETS

# Scheme names of the notes -> ``QuantScheme.by_name`` names. The notes define fp8_tensor as
# per-tensor weights with a dynamic per-tensor activation scale (our fp8_tensor, not
# fp8_tensor_static), fp8_block as 128x128 weight blocks with 1x128 activation groups, int4_g128
# as symmetric GPTQ-style groups of 128 and mxfp4 as w4a16: the names coincide.
SCHEME_NAMES = {"bf16": "bf16", "fp8_tensor": "fp8_tensor", "fp8_block": "fp8_block",
                "int4_g128": "int4_g128", "mxfp4": "mxfp4"}  # fmt: skip

# table header in the notes -> JSON field
CELL_COLUMNS = {"T": "tokens", "floor": "floor_us", "fusedmoe": "fusedmoe_us", "vLLM Triton": "vllm_triton_us",
                "best peer": "best_us", "who": "best_who", "ratio": "ratio"}  # fmt: skip
EAGER_COLUMNS = {"preset": "preset", "scheme": "scheme", "T": "tokens", "fusedmoe fused_moe()": "fused_moe_us",
                 "fusedmoe MoEKernel (as the layer calls it)": "moe_kernel_us",
                 "vLLM fused_experts": "vllm_fused_experts_us"}  # fmt: skip
TEXT_FIELDS = ("preset", "scheme", "best_who")

REPO_JSON = Path(__file__).resolve().parents[3] / "benchmarks" / "peers" / "peer_times_h100.json"


# ---- the notes (markdown) -> JSON -------------------------------------------------------------


def _tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(the '## ' heading above it, header cells, body rows)] of every markdown table."""
    out, heading, table = [], "", None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("## "):
            heading = line[3:].strip()
        if not line.startswith("|"):
            table = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if table is None:
            table = (heading, cells, [])
            out.append(table)
        elif not all(set(c) <= set("-: ") for c in cells):  # the |---| line
            table[2].append(cells)
    return out


def _value(key: str, text: str):
    if key in TEXT_FIELDS:
        return text
    if key == "tokens":
        return int(text)
    return None if text.lower() in ("n/a", "-", "") else float(text)


def _records(header: list[str], rows: list[list[str]], columns: dict, where: str) -> list[dict]:
    unknown = [h for h in header if h not in columns]
    if unknown:
        raise ValueError(f"{where}: unknown columns {unknown} (known: {list(columns)})")
    return [{columns[h]: _value(columns[h], c) for h, c in zip(header, row, strict=True)} for row in rows]


def scheme_name(notes_name: str) -> str:
    """Our scheme name for a scheme of the notes (checked against ``QuantScheme.by_name``)."""
    if notes_name not in SCHEME_NAMES:
        raise ValueError(f"scheme {notes_name!r} of the notes has no mapping (known: {list(SCHEME_NAMES)})")
    return QuantScheme.by_name(SCHEME_NAMES[notes_name]).name


def _source(text: str) -> dict:
    """What the notes say about the measurement: title, date, GPU and versions, ceilings, peers."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.split("\n## ")[0])]
    src: dict = {"title": paragraphs[0].lstrip("# ").strip(), "units": "us"}
    if m := re.search(r"measured (\d{4}-\d\d-\d\d)", src["title"]):
        src["date"] = m.group(1)
    if m := re.search(r"(?m)^([^,\n]+), torch (\S+), triton ([\d.]+)", text):
        src.update(gpu=m.group(1).strip(), torch=m.group(2), triton=m.group(3))
    for key, pattern in (("copy_tb_s", r"copy ([\d.]+) TB/s"), ("bf16_tflop_s", r"bf16 matmul ([\d.]+) TFLOP/s"),
                         ("fp8_tflop_s", r"fp8 matmul ([\d.]+) TFLOP/s")):  # fmt: skip
        if m := re.search(pattern, text):
            src[key] = float(m.group(1))
    for p in paragraphs[1:]:
        if p.startswith("Peers:"):
            src["peers"] = p
        elif p.startswith("Facts for targets:"):
            src["method"] = p
        elif p.startswith("Schemes:"):
            src["schemes"] = p
    return src


def parse_notes(text: str) -> dict:
    """The JSON (see the module docstring) of a peer-times markdown: a '## <preset> <scheme>'
    table per cell group, and the '## Eager calls ...' table. Other tables are listed under
    ``skipped``; an unknown preset, scheme or column is an error (the notes changed shape)."""
    cells, eager, skipped = [], [], []
    for heading, header, rows in _tables(text):
        parts = heading.split()
        if heading.startswith("Eager calls"):
            for r in _records(header, rows, EAGER_COLUMNS, heading):
                eager.append({**r, "scheme": scheme_name(r["scheme"])})
        elif len(parts) == 2 and parts[0] in PRESETS:
            for r in _records(header, rows, CELL_COLUMNS, heading):
                cells.append({"preset": parts[0], "scheme": scheme_name(parts[1]), **r})
        else:
            skipped.append(heading)
    for r in eager:
        if r["preset"] not in PRESETS:
            raise ValueError(f"eager table: unknown preset {r['preset']!r}")
    return {"source": _source(text), "cells": cells, "eager": eager, "skipped": skipped}


# ---- the JSON -> lookups ------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerTimes:
    """Recorded times by (preset, scheme, T): ``cells`` (graph) and ``eager``."""

    source: dict
    cells: dict = field(default_factory=dict)
    eager: dict = field(default_factory=dict)
    path: str = ""

    @classmethod
    def from_json(cls, data: dict, path: str = "") -> PeerTimes:
        def index(rows):
            return {(r["preset"], r["scheme"], int(r["tokens"])): r for r in rows}

        return cls(data.get("source", {}), index(data.get("cells", [])), index(data.get("eager", [])), path)

    def cell(self, preset: str, scheme: str, tokens: int) -> dict | None:
        return self.cells.get((preset, scheme, tokens))

    def eager_cell(self, preset: str, scheme: str, tokens: int) -> dict | None:
        return self.eager.get((preset, scheme, tokens))


def load_peers(path: str | Path | None = None) -> PeerTimes | None:
    """The peer times at ``path``; None or '' -> the repository's JSON where this is a source
    checkout (else no peers); 'none' -> no peers."""
    if path is None or path == "":
        path = REPO_JSON if REPO_JSON.is_file() else None
    if path is None or str(path).lower() == "none":
        return None
    return PeerTimes.from_json(json.loads(Path(path).read_text()), str(path))


def differs_from_peers(config, router, biased: bool) -> str | None:
    """Why the bench's layer of a preset is not the layer the peers ran (softmax top-k
    renormalized routing, SiLU-gated experts, no bias: the notes' method), or None."""
    why = []
    if router.scoring != "softmax" or router.num_expert_group or biased or router.routed_scaling_factor != 1.0:
        groups = " in groups" if router.num_expert_group else ""
        bias = " with a correction bias" if biased else ""
        why.append(f"{router.scoring} routing{groups}{bias}")
    if config.activation is not Activation.SILU or config.gate_up_interleaved:
        why.append(f"{config.activation.value} activation")
    if config.has_bias:
        why.append("expert biases")
    return ", ".join(why) or None


# ---- ratios ----------------------------------------------------------------------------------


def geomean(values) -> float | None:
    """The geometric mean of the positive ``values``; None when there is none."""
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def attach_peers(rows, peers: PeerTimes | None) -> None:
    """Set the peer fields of each ``fusedmoe`` row of ``rows`` (bench ``Row``s): best peer, who
    and ratio = ours / best for graph rows; vLLM's eager time and the eager ratio where our eager
    wall time was measured."""
    if peers is None:
        return
    for r in rows:
        if r.provider != "fusedmoe":
            continue
        cell = peers.cell(r.preset, r.scheme, r.tokens)
        if cell and cell.get("best_us") and r.mode == "graph":
            r.peer_us, r.peer_who = cell["best_us"], cell.get("best_who")
            r.peer_ratio = r.ms * 1e3 / cell["best_us"]
            r.peer_ratio_recorded = cell.get("ratio")
        eager = peers.eager_cell(r.preset, r.scheme, r.tokens)
        if eager and eager.get("vllm_fused_experts_us") and r.eager_wall_us:
            r.peer_eager_us = eager["vllm_fused_experts_us"]
            r.eager_ratio = r.eager_wall_us / r.peer_eager_us


def ratio_summary(rows) -> list[dict]:
    """Per scheme, over our graph cells that have a peer time (``attach_peers``): the cell count,
    the geometric mean of ours / best today and of the same cells' ratio recorded with the
    peers; the eager geometric mean over the cells with an eager ratio."""
    by_scheme: dict[str, list] = {}
    for r in rows:
        if r.provider == "fusedmoe" and (r.peer_ratio or r.eager_ratio):
            by_scheme.setdefault(r.scheme, []).append(r)
    out = []
    for scheme, rs in by_scheme.items():
        graph = [r for r in rs if r.peer_ratio]
        out.append(
            dict(
                scheme=scheme,
                cells=len(graph),
                geomean=geomean(r.peer_ratio for r in graph),
                recorded=geomean(r.peer_ratio_recorded for r in graph),
                eager_cells=sum(1 for r in rs if r.eager_ratio),
                eager_geomean=geomean(r.eager_ratio for r in rs),
            )
        )
    return out


__all__ = [
    "PeerTimes",
    "attach_peers",
    "differs_from_peers",
    "geomean",
    "load_peers",
    "parse_notes",
    "ratio_summary",
    "scheme_name",
]
