"""Test set-up: the Triton interpreter on CPU machines, GPU skips that say why."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Test files share helpers across folders (test_kernels_gemm's operands, test_hf_models' tiny
# models): every test folder is importable by module name, whichever file pytest collects first.
for _d in sorted(Path(__file__).parent.iterdir()):
    if _d.is_dir() and not _d.name.startswith((".", "_")) and _d.name != "fixtures" and str(_d) not in sys.path:
        sys.path.append(str(_d))

HAS_CUDA = torch.cuda.is_available()

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_patches import apply

    apply()
elif not HAS_CUDA:
    raise RuntimeError(
        "no CUDA GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run. "
        "Use `make test` (it sets TRITON_INTERPRET=1 before Python starts)."
    )


# ---- the robustness suite's totals (tests/robustness): cases per class and what each expects ----
# Each case carries ("robust", "<class>:<error|reference>") in its user_properties (set by
# tests/robustness/conftest.py), which reach this controller process under xdist too.
_ROBUST: dict[tuple[str, str], list[int]] = {}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "robust(cls, kind): a case of the robustness suite: issue class, 'error' or 'reference'"
    )


def pytest_runtest_logreport(report):
    tag = dict(report.user_properties).get("robust")
    if tag is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    cls, kind = tag.split(":")
    counts = _ROBUST.setdefault((cls, kind), [0, 0])
    counts[0 if report.passed else 1] += 1


def pytest_terminal_summary(terminalreporter):
    if not _ROBUST:
        return
    tr = terminalreporter
    tr.section("robustness suite (tests/robustness): cases per issue class")
    tr.line(f"{'class':>8} {'clear error':>12} {'= reference':>12} {'not passed':>11}")
    total = [0, 0, 0]
    for cls in sorted({c for c, _ in _ROBUST}, key=lambda c: (len(c), c)):
        err, ref = _ROBUST.get((cls, "error"), [0, 0]), _ROBUST.get((cls, "reference"), [0, 0])
        row = [err[0], ref[0], err[1] + ref[1]]
        total = [a + b for a, b in zip(total, row, strict=True)]
        tr.line(f"{cls:>8} {row[0]:>12} {row[1]:>12} {row[2]:>11}")
    tr.line(f"{'total':>8} {total[0]:>12} {total[1]:>12} {total[2]:>11}   ({sum(total)} cases)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in scripts/gpu_suite.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
