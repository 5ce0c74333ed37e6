"""The feature matrix, generated from the capability declarations alone.

``feature_matrix(platform)`` returns plain data (JSON-ready); ``to_markdown``
renders it. Nothing here is typed by hand: every cell comes from an Experts
or Dispatcher class, and every row of the reference feature tables appears
through the ``seed_names`` the classes declare.
"""

from __future__ import annotations

from ..config import MoEConfig
from ..platform import Platform, current_platform
from ..quant import QuantScheme, all_schemes
from .registry import dispatchers, experts_backends

# Rows of the reference feature tables (experts kernels, then all-to-all backends).
SEED_EXPERTS = (
    "triton",
    "triton (batched)",
    "deep gemm",
    "deep gemm (batched)",
    "cutlass_fp4",
    "cutlass_fp8",
    "flashinfer",
    "gpt oss triton",
    "deep gemm+triton",
    "marlin",
    "marlin (batched)",
    "trtllm",
    "pallas",
    "iterative",
    "rocm aiter moe",
    "cpu_fused_moe",
    "naive batched",
)
SEED_DISPATCHERS = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep low_latency",
    "flashinfer_all2allv",
    "flashinfer",
)
# Seed rows served by the oracle's choice rather than one backend class.
_SEED_ORACLE = {"deep gemm+triton": "auto (oracle: triton / deep_gemm by scheme and shape)"}


def _status(cls, platform: Platform) -> str:
    caps = cls.capabilities
    scheme = next(s for s in all_schemes() if s.name in caps.schemes)
    act = next(iter(sorted(caps.activations, key=lambda a: a.value)))
    cfg = MoEConfig(8, 2, 256, 128, activation=act)
    why = cls.why_not(cfg, scheme, platform)
    return "available" if why is None else why


def feature_matrix(platform: Platform | None = None) -> dict:
    platform = platform or current_platform()
    experts = []
    for name, cls in sorted(experts_backends().items()):
        c = cls.capabilities
        experts.append(
            {
                "name": name,
                "layouts": sorted(x.value for x in c.layouts),
                "quant_types": c.quant_types,
                "granularities": c.granularities,
                "schemes": [s.name for s in all_schemes() if s.name in c.schemes],
                "activations": sorted(a.value for a in c.activations),
                "router_weight_on_input": c.router_weight_on_input,
                "bias": c.bias,
                "expert_map": c.expert_map,
                "chunking": c.chunking,
                "platforms": sorted(c.platforms),
                "min_capability": f"sm{c.min_capability[0]}{c.min_capability[1]}" if c.min_capability else None,
                "packages": list(c.packages),
                "implemented": c.implemented,
                "reduce": cls.reduce.value,
                "seed_rows": list(c.seed_names),
                "status": _status(cls, platform),
            }
        )
    disp = []
    for name, cls in sorted(dispatchers().items()):
        why = cls.why_not(platform)
        disp.append(
            {
                "name": name,
                "layout": cls.layout.value,
                "quantize": "before exchange" if cls.quantize_before_exchange else "after exchange",
                "distributed": cls.distributed,
                "packages": list(cls.packages),
                "implemented": cls.implemented,
                "seed_rows": list(cls.seed_names),
                "status": "available" if why is None else why,
            }
        )
    compat = {
        d["name"]: {
            e["name"]: ("yes" if d["layout"] in e["layouts"] else f"no ({d['layout']} vs {'/'.join(e['layouts'])})")
            for e in experts
        }
        for d in disp
    }
    seeds = []
    for row in SEED_EXPERTS:
        hit = [e for e in experts if row in e["seed_rows"]]
        if hit:
            seeds.append({"seed_row": row, "kind": "experts", "fusedmoe": hit[0]["name"], "status": hit[0]["status"]})
        else:
            seeds.append(
                {"seed_row": row, "kind": "experts", "fusedmoe": _SEED_ORACLE.get(row, "missing"), "status": "oracle"}
            )
    for row in SEED_DISPATCHERS:
        hit = [d for d in disp if row in d["seed_rows"]]
        seeds.append(
            {
                "seed_row": row,
                "kind": "dispatcher",
                "fusedmoe": hit[0]["name"] if hit else "missing",
                "status": hit[0]["status"] if hit else "missing",
            }
        )
    return {
        "platform": {"label": platform.label, "name": platform.name, "packages": sorted(platform.packages)},
        "schemes": [_scheme_row(s) for s in all_schemes()],
        "experts": experts,
        "dispatchers": disp,
        "compatibility": compat,
        "seed_rows": seeds,
    }


def _scheme_row(s: QuantScheme) -> dict:
    def d(tq):
        return tq.short if tq is not None else "-"

    import torch

    from ..testing import tolerance

    return {
        "name": s.name,
        "family": s.family,
        "a1": d(s.a1),
        "w1": d(s.w1),
        "a2": d(s.a2),
        "w2": d(s.w2),
        "tolerance_bf16": tolerance(s, torch.bfloat16),
    }


def _table(rows: list[list[str]], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _yn(b: bool) -> str:
    return "Y" if b else "N"


def _built(item: dict) -> str:
    """'yes', or 'declared' for an adapter the oracle knows about but fusedmoe does not ship yet."""
    return "yes" if item["implemented"] else "declared"


def _experts_table(m: dict) -> str:
    head = ["backend", "implemented", "layout", "quant types", "weight granularity", "activations"]
    head += ["router w. on input", "expert map", "chunking", "bias", "platform", "packages", "status here"]
    rows = [
        [
            e["name"],
            _built(e),
            "/".join(e["layouts"]),
            ", ".join(e["quant_types"]),
            ", ".join(e["granularities"]) or "-",
            ", ".join(e["activations"]),
            _yn(e["router_weight_on_input"]),
            _yn(e["expert_map"]),
            _yn(e["chunking"]),
            _yn(e["bias"]),
            "/".join(e["platforms"]) + (f" {e['min_capability']}+" if e["min_capability"] else ""),
            ", ".join(e["packages"]) or "-",
            e["status"],
        ]
        for e in m["experts"]
    ]
    return _table(rows, head)


def _dispatchers_table(m: dict) -> str:
    rows = [
        [d["name"], _built(d), d["layout"], d["quantize"], _yn(d["distributed"]), ", ".join(d["packages"]) or "-",
         d["status"]]
        for d in m["dispatchers"]
    ]  # fmt: skip
    head = ["dispatcher", "implemented", "layout", "quantization", "distributed", "packages", "status here"]
    return _table(rows, head)


def to_markdown(m: dict) -> str:
    p = m["platform"]
    ne = sum(e["implemented"] for e in m["experts"])
    nd = sum(d["implemented"] for d in m["dispatchers"])
    parts = [f"# fusedmoe features on {p['label']} ({p['name']})", ""]
    parts += [
        f"Implemented: {ne} of {len(m['experts'])} experts backends and {nd} of {len(m['dispatchers'])} dispatchers; "
        "the others are declared (capabilities, packages, platforms) so that the oracle can say why it does not "
        "take them, and run only once their adapter is written.",
        "",
        "## Experts backends",
        "",
        _experts_table(m),
        "",
        "## Dispatchers",
        "",
        _dispatchers_table(m),
    ]
    names = [e["name"] for e in m["experts"]]
    parts += ["", "## Dispatcher x experts (token layouts must match)", ""]
    parts.append(
        _table(
            [[d] + ["Y" if m["compatibility"][d][e] == "yes" else "-" for e in names] for d in m["compatibility"]],
            ["dispatcher"] + names,
        )
    )
    parts += ["", "## Schemes", ""]
    parts.append(
        _table(
            [
                [s["name"], s["family"], s["a1"], s["w1"], s["a2"], s["w2"], f"{s['tolerance_bf16']:.0e}"]
                for s in m["schemes"]
            ],
            ["scheme", "family", "a1", "w1", "a2", "w2", "tolerance (bf16)"],
        )
    )
    parts += ["", "## Rows of the reference tables", ""]
    parts.append(
        _table(
            [[s["seed_row"], s["kind"], s["fusedmoe"], s["status"]] for s in m["seed_rows"]],
            ["reference row", "kind", "fusedmoe", "status here"],
        )
    )
    parts += ["", "Granularity: T per tensor, A per token, C per channel, G(g) groups of g, B(n,k) blocks."]
    return "\n".join(parts) + "\n"


__all__ = ["feature_matrix", "to_markdown"]
