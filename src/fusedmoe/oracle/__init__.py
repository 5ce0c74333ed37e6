"""The backend oracle: which Experts backend runs a (config, scheme) on a platform, and why.

For each scheme family there is an ordered list of candidates per platform
(``priorities``). The oracle walks it and takes the first backend whose
``why_not`` is None; the ``Choice`` records every candidate with its reason.
An explicit request (argument, or the ``FUSEDMOE_BACKEND`` environment
variable) is honored or refused with its reason, never silently replaced,
except that a standard backend asked for under a batched dispatcher becomes
its batched twin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..config import MoEConfig
from ..errors import UnsupportedError
from ..experts.base import TokenLayout
from ..platform import Platform, current_platform
from ..quant import QuantScheme
from ..registry import experts_backends, get_experts
from .priorities import candidates


@dataclass
class Choice:
    """The oracle's answer: the chosen backend and every candidate's verdict."""

    backend: str | None
    layout: TokenLayout
    platform: Platform
    scheme: QuantScheme
    requested: str | None = None
    verdicts: list[tuple[str, str | None]] = field(default_factory=list)  # (name, reason or None)

    def explain(self) -> str:
        lines = [
            f"scheme {self.scheme.name} (family {self.scheme.family}), layout {self.layout.value}, "
            f"platform {self.platform.label} ({self.platform.name})"
        ]
        if self.requested:
            lines.append(f"requested: {self.requested}")
        for name, why in self.verdicts:
            mark = "ok " if why is None else "no "
            chosen = "  <- chosen" if name == self.backend else ""
            lines.append(f"  {mark}{name}: {'accepted' if why is None else why}{chosen}")
        if self.backend is None:
            lines.append("  nothing fits")
        return "\n".join(lines)


def select_experts(
    config: MoEConfig,
    scheme: QuantScheme,
    *,
    platform: Platform | None = None,
    layout: TokenLayout = TokenLayout.STANDARD,
    backend: str | None = "auto",
    expert_map: bool = False,
) -> Choice:
    """Choose an Experts backend; raise UnsupportedError listing every candidate if none fits."""
    platform = platform or current_platform()
    env = os.environ.get("FUSEDMOE_BACKEND")
    requested = backend if backend not in (None, "auto") else env
    choice = Choice(None, layout, platform, scheme, requested=requested)
    if requested:
        cls = get_experts(requested)
        if cls.layout is not layout and layout is TokenLayout.BATCHED and cls.batched_twin:
            cls = get_experts(cls.batched_twin)
        why = cls.why_not(config, scheme, platform, layout=layout, expert_map=expert_map)
        choice.verdicts.append((cls.name, why))
        if why is not None:
            raise UnsupportedError(f"backend '{requested}' cannot run this: {why}\n{choice.explain()}")
        choice.backend = cls.name
        return choice
    backends = experts_backends()
    for name in candidates(scheme, platform, layout):
        why = backends[name].why_not(config, scheme, platform, layout=layout, expert_map=expert_map)
        choice.verdicts.append((name, why))
        if why is None and choice.backend is None:
            choice.backend = name
    if choice.backend is None:
        raise UnsupportedError("no backend can run this configuration:\n" + choice.explain())
    return choice
