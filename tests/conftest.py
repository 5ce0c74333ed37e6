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
