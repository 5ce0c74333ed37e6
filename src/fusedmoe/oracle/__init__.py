"""The backend oracle: which Experts backend runs a (config, scheme) on a platform, and why.

One oracle per scheme family (unquantized, fp8, int8, wna16, mxfp4, nvfp4),
each an ordered list of candidates per platform class and token layout
(``priorities``, data) plus the family's rules:

- an explicit request is honored or refused with its reason, never silently
  replaced: the ``backend`` argument first, then ``FUSEDMOE_<FAMILY>_BACKEND``
  (e.g. ``FUSEDMOE_MXFP4_BACKEND=marlin``), then ``FUSEDMOE_BACKEND``; the one
  exception: a standard backend asked for under a batched dispatcher becomes
  its batched twin;
- otherwise the walk takes the first candidate whose ``why_not`` is None,
  leaving out those named in ``FUSEDMOE_SKIP_BACKENDS`` (comma-separated) and,
  on a GPU, the float32 reference and the loop baseline (asked for by name
  they still run);
- unquantized and fp8: ``triton`` and ``grouped_mm`` are ordered by the shape
  rule of ``thresholds`` (tokens per expert, measured per GPU);
- a backend fixes the activation precision it runs the weights with
  (``Experts.activation_scheme``: MXFP4 weights run with MXFP8 activations on
  TRT-LLM, NVFP4 weights with bf16 activations on Marlin), so the ``Choice``
  carries the effective scheme, and the sizes it needs rounded up
  (``Experts.alignment``; ``padding.pad_weights`` pads once);
- when nothing fits: ``UnsupportedError`` listing every candidate and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import env
from ..config import MoEConfig
from ..contract import TokenLayout
from ..errors import UnsupportedError, expect
from ..experts.thresholds import grouped_mm_first, w4_dequant_note
from ..kernels.grouped_gemm_w4 import supports as w4_supports
from ..platform import Platform, current_platform
from ..quant import QuantScheme
from ..quant.w4_layout import W4_FORMATS
from .padding import padded_sizes
from .priorities import candidates, explicit_only, family_variant, platform_class
from .registry import experts_backends

_SHAPE_RULE_FAMILIES = ("unquantized", "fp8")


def _activations(scheme: QuantScheme) -> str:
    def one(tq):
        return "model dtype" if tq is None else tq.short

    a1, a2 = one(scheme.a1), one(scheme.a2)
    return f"a1/a2 {a1}" if a1 == a2 else f"a1 {a1}, a2 {a2}"


@dataclass(frozen=True)
class Verdict:
    """One candidate: its reason to refuse (None: accepts), the scheme it would compute, its round-up."""

    name: str
    reason: str | None
    scheme: QuantScheme
    align: tuple[int, int]

    def line(self, asked: QuantScheme, chosen: bool) -> str:
        tags = []
        if self.scheme != asked:
            tags.append(f"runs as {self.scheme.name}: {_activations(self.scheme)}")
        if self.align != (1, 1):
            tags.append(f"pads H, I to multiples of {self.align[0]}, {self.align[1]}")
        tag = f" [{'; '.join(tags)}]" if tags else ""
        verdict = "accepted" if self.reason is None else self.reason
        return f"  {'ok' if self.reason is None else 'no'} {self.name}{tag}: {verdict}" + (
            "  <- chosen" if chosen else ""
        )


@dataclass
class Choice:
    """The oracle's answer: the chosen backend, what it implies, and every candidate's verdict."""

    backend: str | None
    layout: TokenLayout
    platform: Platform
    scheme: QuantScheme  # as asked for (the checkpoint's)
    requested: str | None = None
    config: MoEConfig | None = None
    source: str | None = None  # 'argument' or the environment variable the request came from
    effective_scheme: QuantScheme | None = None  # the scheme the chosen backend computes
    align: tuple[int, int] = (1, 1)  # (H multiple, I multiple) the chosen backend needs
    notes: list[str] = field(default_factory=list)
    candidates: list[Verdict] = field(default_factory=list)

    @property
    def verdicts(self) -> list[tuple[str, str | None]]:
        """(name, reason or None) per candidate, in the order tried."""
        return [(v.name, v.reason) for v in self.candidates]

    @property
    def padded(self) -> tuple[int, int] | None:
        """(Hp, Ip) the layer pads the weights to; None without a config."""
        return None if self.config is None else padded_sizes(self.config, self.align)

    def explain(self) -> str:
        p = self.platform
        pk = f", packages {', '.join(sorted(p.packages))}" if p.packages else ""
        lines = [
            f"scheme {self.scheme.name} (family {self.scheme.family}, table {family_variant(self.scheme)}), "
            f"layout {self.layout.value}, platform {p.label} ({p.name}; class {platform_class(p)}{pk})"
        ]
        c = self.config
        if c is not None:
            lines.append(
                f"layer: E={c.num_experts} K={c.top_k} H={c.hidden_size} I={c.intermediate_size} "
                f"{c.activation.value}{' +bias' if c.has_bias else ''} {str(c.dtype).replace('torch.', '')}"
            )
        lines.append(f"requested: {self.requested} ({self.source})" if self.requested else "requested: auto")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("candidates, best first:" if not self.requested else "candidate:")
        lines += [v.line(self.scheme, v.name == self.backend) for v in self.candidates]
        if self.backend is None:
            lines.append("nothing fits")
            return "\n".join(lines)
        eff = self.effective_scheme or self.scheme
        changed = "" if eff == self.scheme else f" (scheme {self.scheme.name} runs as {eff.name})"
        lines.append(f"chosen: {self.backend}")
        lines.append(f"  activations: {_activations(eff)}{changed}")
        if self.padded is not None and c is not None:
            hp, ip = self.padded
            if (hp, ip) == (c.hidden_size, c.intermediate_size):
                lines.append(f"  padding: none (H {hp}, I {ip})")
            else:
                lines.append(
                    f"  padding: H {c.hidden_size} -> {hp}, I {c.intermediate_size} -> {ip} "
                    f"(multiples of {self.align[0]}, {self.align[1]}; weights padded once after loading)"
                )
        return "\n".join(lines)


def _verdict(cls, config, scheme, platform, layout, expert_map) -> Verdict:
    eff = cls.activation_scheme(scheme, platform)
    why = cls.why_not(config, eff, platform, layout=layout, expert_map=expert_map)
    return Verdict(cls.name, why, eff, cls.alignment(eff, platform))


def _request(backend: str | None, scheme: QuantScheme) -> tuple[str | None, str | None]:
    """(requested backend or None for auto, where the request came from)."""
    if backend not in (None, "auto"):
        return backend, "argument"
    for var in (env.family_backend(scheme.family), env.BACKEND):
        value = env.raw(var)
        if value and value != "auto":
            return value, var
    return None, None


# the backends whose 4-bit weights (w4a16) take the per-call written-out rule (``experts.triton``)
_W4_RULE_BACKENDS = ("triton", "triton_batched", "triton_or_grouped_mm")


def _shape_rule(names: list[str], config, scheme, platform, num_tokens) -> tuple[list[str], str | None]:
    if not platform.is_gpu or scheme.family not in _SHAPE_RULE_FAMILIES:
        return names, None
    if "triton" not in names or "grouped_mm" not in names:
        return names, None
    first, note = grouped_mm_first(platform, scheme, config, num_tokens)
    if first and names.index("grouped_mm") > names.index("triton"):
        names = [n for n in names if n != "grouped_mm"]
        names.insert(names.index("triton"), "grouped_mm")
    return names, note


def select_experts(
    config: MoEConfig,
    scheme: QuantScheme,
    *,
    platform: Platform | None = None,
    layout: TokenLayout = TokenLayout.STANDARD,
    backend: str | None = "auto",
    expert_map: bool = False,
    num_tokens: int | None = None,
) -> Choice:
    """Choose an Experts backend (see the module docstring); raise UnsupportedError if none fits.

    num_tokens: the token count the layer expects per call (optional), for the shape rule.
    """
    platform = platform or current_platform()
    requested, source = _request(backend, scheme)
    choice = Choice(None, layout, platform, scheme, requested=requested, config=config, source=source)
    known = experts_backends()
    if requested:
        expect(requested in known, f"backend (from {source})", f"one of {sorted(known)}", requested)
        cls = known[requested]
        if cls.layout is not layout and layout is TokenLayout.BATCHED and cls.batched_twin:
            choice.notes.append(f"{requested} -> {cls.batched_twin}: its batched twin, for the batched token layout")
            cls = known[cls.batched_twin]
        v = _verdict(cls, config, scheme, platform, layout, expert_map)
        choice.candidates.append(v)
        if v.reason is not None:
            raise UnsupportedError(f"backend '{requested}' ({source}) cannot run this: {v.reason}\n{choice.explain()}")
        choice.backend, choice.effective_scheme, choice.align = v.name, v.scheme, v.align
        return choice
    names, note = _shape_rule(candidates(scheme, platform, layout), config, scheme, platform, num_tokens)
    if note:
        choice.notes.append(note)
    skip = set(env.names(env.SKIP_BACKENDS))
    unknown = sorted(skip - set(known))
    expect(not unknown, env.SKIP_BACKENDS, f"backend names from {sorted(known)}", ",".join(unknown))
    for name in names:
        v = _verdict(known[name], config, scheme, platform, layout, expert_map)
        if v.reason is None and name in skip:
            v = replace(v, reason=f"skipped ({env.SKIP_BACKENDS})")
        elif v.reason is None and explicit_only(name, platform):
            v = replace(v, reason=f"not taken automatically on {platform.label}: {explicit_only(name, platform)}")
        choice.candidates.append(v)
        if v.reason is None and choice.backend is None:
            choice.backend, choice.effective_scheme, choice.align = v.name, v.scheme, v.align
    if choice.backend is None:
        raise UnsupportedError("no backend can run this configuration:\n" + choice.explain())
    if choice.backend in _W4_RULE_BACKENDS and w4_supports(scheme.w1, scheme.a1, config.dtype) is None:
        choice.notes.append(w4_dequant_note(platform, W4_FORMATS[scheme.w1.dtype], config, num_tokens))
    return choice


__all__ = ["Choice", "Verdict", "select_experts"]
