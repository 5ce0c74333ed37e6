"""Test helpers that ship with the library, so tests, benchmarks and users share them.

``problems``: random MoE problems with their float64 reference, output poisoning, labelled
edge cases and the one tolerance table. ``ep_check``: the expert-parallel correctness
harness (gloo in CI, NCCL on GPUs).
"""

from .problems import (
    EDGE_CASES,
    ODD_CASES,
    Case,
    Problem,
    all_written,
    make_problem,
    poison_,
    random_topk,
    rel_error,
    tolerance,
)

__all__ = [
    "EDGE_CASES",
    "ODD_CASES",
    "Case",
    "Problem",
    "all_written",
    "make_problem",
    "poison_",
    "random_topk",
    "rel_error",
    "tolerance",
]
