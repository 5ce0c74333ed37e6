"""Where one MoE layer's expert tensors are, found from the tensor names a checkpoint holds.

No model family's names are assumed: the names are grouped by decoder layer,
MoE block and expert, and each expert module's name says its role::

    {block}.experts.{e}.{proj}.{tensor}     one Linear per expert and projection
    {block}.experts.{proj}{_suffix}         all experts of a projection in one tensor (gpt-oss)

    proj                              role (``FusedMoE`` shard)
    gate_proj, w1                     gate rows of W13 (w1)
    up_proj, w3                       up rows of W13 (w3)
    gate_up_proj                      gate then up rows (w13)
    down_proj, w2                     W2 (w2)

``{block}`` is whatever precedes ``.experts.`` in a name of ``layers.{L}.``:
``model.layers.0.block_sparse_moe`` (transformers' Mixtral save),
``model.layers.0.mlp`` (GPTQModel, llm-compressor, every other family). The
tensors of a Linear (``weight``, ``qweight``, ``weight_packed``,
``weight_scale``, ...) are the format's business (``CheckpointFormat.linear``).
The router is ``{block}.gate`` or ``{block}.router`` with a ``weight``.

A layer whose experts cannot be mapped is an error that names the tensors
found (as patterns, expert ids collapsed to ``{e}``) and the roles it could
not fill, never a "missing key" for one guessed name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import FusedMoEError

__all__ = ["ExpertLayout", "expert_of", "find_experts"]

_ROLE = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_ROLE["gate_up_proj"] = "w13"
_WORDS = {"w1": "gate (gate_proj / w1)", "w3": "up (up_proj / w3)", "w2": "down (down_proj / w2)"}
_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<tensor>\w+)$")
_FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>_\w+)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SHOWN = 16  # patterns listed in an error: enough for every tensor kind of three projections


@dataclass(frozen=True)
class ExpertLayout:
    """The expert tensors of one MoE layer.

    block:      module path of the MoE block (router and shared experts hang under it).
    linears:    per global expert id, ``(shard, module path)`` of each expert Linear
                (shard 'w1', 'w3', 'w13' or 'w2', as ``FusedMoE.weight_loader`` takes it).
    fused:      ``(shard, proj)`` of all-experts tensors ``{block}.experts.{proj}*``;
                empty when the experts are per-expert Linears.
    router:     module path of the router Linear (None when the checkpoint has none).
    """

    block: str
    linears: dict[int, tuple[tuple[str, str], ...]]
    fused: tuple[tuple[str, str], ...]
    router: str | None

    @property
    def experts_path(self) -> str:
        return f"{self.block}.experts"


def expert_of(path: str) -> tuple[str, int, str] | None:
    """``{block}.experts.{e}.{proj}`` -> ('{block}.experts', e, shard), or None for another module."""
    m = re.match(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$", path)
    if m is None or m["proj"] not in _ROLE:
        return None
    return m["experts"], int(m["e"]), _ROLE[m["proj"]]


def _layer_of(block: str) -> int | None:
    m = _LAYER.search(block + ".")
    return int(m.group(1)) if m else None


def _pattern(name: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)


def _describe(names: Iterable[str]) -> str:
    pats = sorted({_pattern(n) for n in names})
    shown = ", ".join(pats[:_SHOWN]) + (f", ... ({len(pats) - _SHOWN} more)" if len(pats) > _SHOWN else "")
    return shown or "none"


def _group(keys: Iterable[str], layer: int) -> tuple[dict[str, dict[int, dict[str, set[str]]]], dict[str, set[str]]]:
    """Per block of ``layer``: expert -> proj -> its tensor names; and the blocks' fused tensors."""
    per: dict[str, dict[int, dict[str, set[str]]]] = {}
    fused: dict[str, set[str]] = {}
    for k in keys:
        m = _PER_EXPERT.match(k)
        if m and _layer_of(m["block"]) == layer:
            per.setdefault(m["block"], {}).setdefault(int(m["e"]), {}).setdefault(m["proj"], set()).add(k)
            continue
        m = _FUSED.match(k)
        if m and _layer_of(m["block"]) == layer:
            fused.setdefault(m["block"], set()).add(m["proj"])
    return per, fused


def _expert_roles(e: int, projs: dict[str, set[str]], problems: list[str]) -> tuple[tuple[str, str], ...] | None:
    roles: dict[str, str] = {}
    for proj in sorted(projs):
        role = _ROLE.get(proj)
        if role is None:
            continue  # not an expert projection (an adapter, a norm): listed if nothing maps
        if role in roles:
            problems.append(f"expert {e}: both '{roles[role]}' and '{proj}' for {_WORDS.get(role, role)}")
            return None
        roles[role] = proj
    need = [("w13",) if "w13" in roles else ("w1", "w3"), ("w2",)]
    missing = [r for group in need for r in group if r not in roles]
    if "w13" in roles and ("w1" in roles or "w3" in roles):
        problems.append(f"expert {e}: 'gate_up_proj' and separate gate/up projections")
        return None
    if missing:
        problems.append(f"expert {e}: no {' or '.join(_WORDS[r] for r in missing)}")
        return None
    return tuple((r, proj) for r, proj in roles.items())


def _router(keys: set[str], block: str) -> str | None:
    for name in ("gate", "router"):
        if f"{block}.{name}.weight" in keys or f"{block}.{name}.qweight" in keys:
            return f"{block}.{name}"
    return None


def find_experts(keys: Iterable[str], layer: int, num_experts: int) -> ExpertLayout:
    """The expert tensors of decoder layer ``layer`` among ``keys`` (all tensor names of the checkpoint).

    num_experts: E from the model's config; every expert 0..E-1 must have all its roles.
    """
    keys = set(keys)
    per, fused = _group(keys, layer)
    blocks = sorted(set(per) | set(fused))
    where = f"checkpoint layer {layer}"
    if len(blocks) != 1:
        found = _describe(k for k in keys if _layer_of(k) == layer and ".experts." in k)
        want = "expert tensors under one MoE block (*.layers.{L}.*.experts.*)"
        got = f"{len(blocks)} blocks {blocks}" if blocks else "none"
        raise FusedMoEError(f"{where}: expected {want}, found {got}; tensors: {found}")
    block = blocks[0]
    router = _router(keys, block)
    if block in fused and block not in per:
        projs = fused[block]
        missing = [p for p in ("gate_up_proj", "down_proj") if p not in projs]
        if missing:
            names = _describe(k for k in keys if k.startswith(f"{block}.experts."))
            raise FusedMoEError(f"{where}: fused experts without {missing} under '{block}.experts'; tensors: {names}")
        return ExpertLayout(block, {}, (("w13", "gate_up_proj"), ("w2", "down_proj")), router)
    experts, problems = per[block], []
    ids = sorted(experts)
    if ids != list(range(num_experts)):
        extra = sorted(set(ids) - set(range(num_experts)))
        lost = sorted(set(range(num_experts)) - set(ids))
        if lost:  # name a tensor config.json asks for that no file holds (as expert ids[0] names its own)
            first = sorted(k for names in experts[ids[0]].values() for k in names)[0] if ids else f"{block}.experts.0"
            want = first.replace(f"{block}.experts.{ids[0]}.", f"{block}.experts.{lost[0]}.", 1)
            problems.append(f"experts {lost} missing: expected '{want}' (config.json: {num_experts} experts)")
        else:  # and one the files hold that config.json does not know
            problems.append(
                f"experts {extra}: expected {num_experts} experts (config.json), the files also hold "
                f"'{block}.experts.{extra[0]}.*'"
            )
    linears = {}
    for e in ids:
        roles = _expert_roles(e, experts[e], problems)
        if roles is not None:
            linears[e] = tuple((r, f"{block}.experts.{e}.{p}") for r, p in roles)
    if problems:
        names = _describe(k for k in keys if k.startswith(f"{block}.experts."))
        shown = "; ".join(problems[:4]) + (f"; ... ({len(problems) - 4} more)" if len(problems) > 4 else "")
        raise FusedMoEError(
            f"{where} ('{block}.experts', {num_experts} experts in config.json): {shown}; tensors: {names}"
        )
    return ExpertLayout(block, linears, (), router)
