"""Error types and the one helper every validation goes through.

Every message names the argument (or field) and what was expected, so a user
can fix the call without reading the source.
"""

from __future__ import annotations


class FusedMoEError(ValueError):
    """Bad input or an unsupported request to fusedmoe."""


class UnsupportedError(FusedMoEError):
    """No backend (or the requested one) can run the requested configuration."""


def expect(cond: bool, name: str, expected: str, got: object = None) -> None:
    """Raise ``FusedMoEError`` naming ``name`` unless ``cond`` holds."""
    if not cond:
        msg = f"{name}: expected {expected}"
        if got is not None:
            msg += f", got {got!r}"
        raise FusedMoEError(msg)
