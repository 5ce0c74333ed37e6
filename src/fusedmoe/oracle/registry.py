"""Every Experts backend and Dispatcher fusedmoe knows, by name.

Backends register by being listed in ``_MODULES``; a module whose optional
dependency is missing still registers its classes (declared capabilities
with ``implemented``/``packages`` saying why they cannot run).
"""

from __future__ import annotations

import importlib

from ..errors import expect

_EXPERT_MODULES = (
    "fusedmoe.experts.reference",
    "fusedmoe.experts.cpu",
    "fusedmoe.experts.triton",
    "fusedmoe.experts.grouped_mm",
    "fusedmoe.experts.triton_or_grouped_mm",
    "fusedmoe.experts.external",
)
_DISPATCH_MODULES = (
    "fusedmoe.dispatch.local",
    "fusedmoe.dispatch.ep.allgather",
    "fusedmoe.dispatch.ep.all2all",
    "fusedmoe.dispatch.ep.low_latency",
    "fusedmoe.dispatch.external",
)

_EXPERTS: dict[str, type] = {}
_DISPATCHERS: dict[str, type] = {}


def _load() -> None:
    if _EXPERTS:
        return
    from ..dispatch.base import Dispatcher
    from ..experts.base import Experts

    for mod_name, registry, base in (
        *((m, _EXPERTS, Experts) for m in _EXPERT_MODULES),
        *((m, _DISPATCHERS, Dispatcher) for m in _DISPATCH_MODULES),
    ):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(mod_name):
                continue  # that backend module does not exist in this build
            raise
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, base) and obj is not base and "name" in vars(obj):
                registry[obj.name] = obj


def experts_backends() -> dict[str, type]:
    _load()
    return dict(_EXPERTS)


def dispatchers() -> dict[str, type]:
    _load()
    return dict(_DISPATCHERS)


def get_experts(name: str) -> type:
    b = experts_backends()
    expect(name in b, "backend", f"one of {sorted(b)}", name)
    return b[name]


def get_dispatcher(name: str) -> type:
    d = dispatchers()
    expect(name in d, "dispatcher", f"one of {sorted(d)}", name)
    return d[name]
