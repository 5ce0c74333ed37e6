"""Programmatic dependent launch (PDL): every kernel the library launches takes it, waits first.

On sm_90+ ``kernels.launch`` launches a kernel that has a ``PDL`` constexpr with the launch
attribute, so it may start before the kernel ahead of it in the stream has finished; it is then
correct only if nothing reads global memory before ``_common.pdl_wait`` (``griddepcontrol.wait``).
On the CPU: each kernel's signature and first statement (a kernel added without them fails here;
``tests/kernels/sm90_compile.py`` checks that the sm_90 binaries hold the wait). On a GPU: a layer
gives the same bytes with PDL on and off, eager, replayed and in a CUDA graph.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch

import fusedmoe.kernels as kernels_pkg
from fusedmoe.config import MoEConfig
from fusedmoe.contract import TopK
from fusedmoe.dispatch.local import LocalDispatcher
from fusedmoe.experts.triton import TritonExperts
from fusedmoe.modular.kernel import MoEKernel
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem

HAS_CUDA = torch.cuda.is_available()


def _launched_kernels() -> dict:
    """Every jit function named ``*_kernel`` in ``fusedmoe.kernels`` (the launched ones; helpers
    have other names). Under the interpreter ``triton.jit`` makes another class: both have
    ``fn`` and ``arg_names``."""
    found = {}
    for mod in pkgutil.iter_modules(kernels_pkg.__path__):
        m = importlib.import_module(f"fusedmoe.kernels.{mod.name}")
        for name, obj in vars(m).items():
            jit = hasattr(obj, "arg_names") and hasattr(obj, "fn")
            if jit and name.endswith("_kernel") and obj.fn.__module__ == m.__name__:
                found[f"{m.__name__}.{name}"] = obj
    return found


KERNELS = _launched_kernels()


def test_the_kernels_are_found():
    names = {n.rsplit(".", 1)[1] for n in KERNELS}
    assert {"_grouped_gemm_kernel", "_persistent_gemm_kernel", "_w4_gemm_kernel", "_route_kernel"} <= names
    assert len(KERNELS) >= 14


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_takes_pdl_and_waits_before_anything_else(name):
    """``pdl_wait`` first (after constexpr declarations, which read nothing)."""
    k = KERNELS[name]
    fn = ast.parse(textwrap.dedent(inspect.getsource(k.fn))).body[0]
    pdl = [a for a in fn.args.args if a.arg == "PDL"]
    assert pdl and ast.unparse(pdl[0].annotation) == "tl.constexpr", f"{name}: no PDL constexpr"
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    # constexpr declarations (NAME: tl.constexpr = ...) read no memory: they may come first
    code = [s for s in body if not (isinstance(s, ast.AnnAssign) and "constexpr" in ast.unparse(s.annotation))]
    assert ast.unparse(code[0]) == "pdl_wait(PDL)", f"{name} starts with {ast.unparse(code[0])!r}"


SCHEMES = ["bf16", "fp8_tensor", "fp8_block", "mxfp4", "int4_g128"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 5, 64, 512])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_layer_gives_the_same_bytes_with_and_without_pdl(monkeypatch, scheme, t):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+ (launches elsewhere never take it)")
    config = MoEConfig(64, 4, 1024, 768)
    prob = make_problem(config, QuantScheme.by_name(scheme), t, device="cuda", seed=t)
    topk = TopK(prob.topk_ids, prob.topk_weights)
    got = {}
    for var in ("0", "1"):
        monkeypatch.setenv("FUSEDMOE_PDL", var)
        kernel = MoEKernel(LocalDispatcher(config, prob.scheme), TritonExperts(config, prob.scheme))
        eager = [kernel(prob.x, topk, prob.weights).clone() for _ in range(3)]  # run, record, replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernel(prob.x, topk, prob.weights)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got[var] = [*eager, out.clone()]
    for a in got["0"] + got["1"]:
        assert torch.equal(a, got["0"][0]), f"{scheme} T={t}: outputs differ"
    assert not got["1"][0].isnan().any()
