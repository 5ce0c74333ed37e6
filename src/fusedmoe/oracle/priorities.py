"""Ordered backend candidates per scheme family, platform and token layout.

The first candidate that accepts a configuration wins, so each list puts the
fastest measured backend first and the always-correct fallbacks last.
"""

from __future__ import annotations

from ..experts.base import TokenLayout
from ..platform import Platform
from ..quant import QuantScheme
from ..registry import experts_backends


def candidates(scheme: QuantScheme, platform: Platform, layout: TokenLayout) -> list[str]:
    """Backend names to try, best first; every registered backend of the layout appears once."""
    gpu = {
        TokenLayout.STANDARD: ["triton", "cpu", "reference"],
        TokenLayout.BATCHED: ["triton_batched", "reference_batched"],
    }
    cpu = {
        TokenLayout.STANDARD: ["cpu", "triton", "reference"],
        TokenLayout.BATCHED: ["reference_batched", "triton_batched"],
    }
    order = (gpu if platform.is_gpu else cpu)[layout]
    known = experts_backends()
    out = [n for n in order if n in known]
    out += sorted(n for n, c in known.items() if c.layout is layout and n not in out)
    return out
