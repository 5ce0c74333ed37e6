"""The robustness suite: every case is labelled with the issue class it covers and what it
expects (a clear ``FusedMoEError`` naming the argument, or the float64 reference), and runs
under a time limit. tests/conftest.py prints the totals per class at the end of the session.
"""

from __future__ import annotations

import pytest

# Seconds per case: the slowest (a Triton GEMM under the interpreter, a two-rank gloo world,
# a CLI subprocess importing torch) take 2-15 s on a busy 2-core machine.
CASE_TIMEOUT_S = 120


def pytest_collection_modifyitems(config, items):
    for item in items:
        m = item.get_closest_marker("robust")
        if m is None:
            continue
        cls, kind = m.args
        assert kind in ("error", "reference"), f"{item.nodeid}: robust kind {kind!r}"
        item.user_properties.append(("robust", f"{cls}:{kind}"))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CASE_TIMEOUT_S))
