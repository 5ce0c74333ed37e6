"""Hypothesis fuzzing of ``fused_moe`` against ``moe_reference``: random valid layers, every scheme.

Each example draws a layer (E, K, H, I, activation, bias, router weight on input,
gate/up interleaving, dtype), a scheme from ``quant.all_schemes()``, T tokens, a
dispatcher and a backend from the registry, optionally an expert map (expert
parallelism) and int64 top-k ids. Mostly the backend is one that accepts the call
(``Experts.why_not``, after the oracle's activation-precision rule) and its output
must be within ``fusedmoe.testing.tolerance`` of the float64 reference; one example
in ``refusal_share`` takes any backend, and a refused one must raise
``UnsupportedError`` (never compute). H and I are multiples of 32 or, one time in
four, any size from 8 (which packed and microscaled formats refuse).

Examples are derandomized (CI is reproducible); counts per backend and outcome are
printed at the end of the module (``pytest -s``) and written to
``$TMPDIR/fusedmoe_fuzz_counts.json``. The CPU test leaves Triton out (the
interpreter makes it ~10x slower); a smaller Triton test and a GPU test at sizes up
to H = I = 2048 (``-m gpu``, on the device) follow.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fusedmoe.api import fused_moe
from fusedmoe.config import Activation, MoEConfig
from fusedmoe.errors import UnsupportedError
from fusedmoe.experts.reference import moe_reference
from fusedmoe.oracle.registry import experts_backends, get_dispatcher
from fusedmoe.platform import current_platform
from fusedmoe.quant import all_schemes
from fusedmoe.testing import make_problem, rel_error, tolerance

SCHEMES = all_schemes()
DISPATCHERS = ("local", "local", "local_batched")  # the standard layout has more backends
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRITON = frozenset({"triton", "triton_batched"})
COUNTS: Counter = Counter()  # (test, backend, outcome) -> examples


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_counts():
    """One torch thread: the examples are tiny, and two threads on two busy cores (pytest -n 2)
    spin-wait on each other (measured: 66 s instead of 10 s for the CPU test on a loaded machine).
    At the end, the counts (one JSON per xdist worker, whose output pytest does not show)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    rows = sorted(COUNTS.items())
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = os.path.join(tempfile.gettempdir(), f"fusedmoe_fuzz_counts{'_' + worker if worker else ''}.json")
    with open(path, "w") as f:
        json.dump([{"test": t, "backend": b, "outcome": o, "examples": n} for (t, b, o), n in rows], f, indent=1)
    print(f"\nfuzz examples per backend (also in {path}):")
    for (t, b, o), n in rows:
        print(f"  {t:12s} {b:20s} {o:9s} {n}")


def _layout_backends(dispatcher: str, exclude=frozenset(), only=None) -> list[str]:
    layout = get_dispatcher(dispatcher).layout
    names = [n for n, cls in experts_backends().items() if cls.layout is layout and n not in exclude]
    return [n for n in names if only is None or n in only]


def _verdict(name: str, config: MoEConfig, scheme, dispatcher: str, expert_map: bool, platform):
    """(why the backend refuses or None, the scheme it computes) as the oracle would judge an explicit request."""
    disp = get_dispatcher(dispatcher)
    cls = experts_backends()[name]
    eff = cls.activation_scheme(scheme, platform)
    why = disp.why_not(platform) or cls.why_not(config, eff, platform, layout=disp.layout, expert_map=expert_map)
    return why, eff


@st.composite
def layers(
    draw, *, max_e=9, sizes=(32, 64, 96, 128), max_odd=130, max_t=17, only=None, exclude=TRITON, refusal_share=8
):
    """A random layer and call; the backend comes from the registry (``only`` those, less ``exclude``)."""
    e = draw(st.integers(1, max_e))
    k = draw(st.integers(1, min(e, 4)))
    scheme = draw(st.sampled_from(SCHEMES))
    # mostly multiples of 32 (every format can store them), sometimes any size (refused by packed formats);
    # at least 8: the error is norm-wise, and a row of fewer elements can be one sum that cancels to ~0
    odd = draw(st.integers(0, 3)) == 0
    size = st.integers(8, max_odd) if odd else st.sampled_from(sizes)
    h, i = draw(size), draw(size)
    act = draw(st.sampled_from(list(Activation)))
    config = MoEConfig(
        num_experts=e,
        top_k=k,
        hidden_size=h,
        intermediate_size=i,
        activation=act,
        has_bias=draw(st.booleans()),
        apply_router_weight_on_input=k == 1 and draw(st.booleans()),
        gate_up_interleaved=act.is_gated and draw(st.integers(0, 3)) == 0,
        dtype=draw(st.sampled_from(DTYPES)),
    )
    t = draw(st.integers(0, max_t))
    dispatcher = draw(st.sampled_from(DISPATCHERS))
    expert_map = None
    num_local = None
    if e > 1 and draw(st.integers(0, 3)) == 0:
        order = draw(st.permutations(range(e)))
        num_local = draw(st.integers(1, e))
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[torch.tensor(order[:num_local])] = torch.arange(num_local, dtype=torch.int32)
    platform = current_platform()
    pool = _layout_backends(dispatcher, exclude, only)
    has_map = expert_map is not None
    accepting = [n for n in pool if _verdict(n, config, scheme, dispatcher, has_map, platform)[0] is None]
    # mostly a backend that accepts the call; one in ``refusal_share`` from the whole pool (refusals checked)
    if accepting and draw(st.integers(0, refusal_share - 1)) != 0:
        backend = draw(st.sampled_from(accepting))
    else:
        backend = draw(st.sampled_from(pool))
    return dict(
        config=config,
        scheme=scheme,
        t=t,
        dispatcher=dispatcher,
        backend=backend,
        expert_map=expert_map,
        num_local=num_local,
        ids_int64=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def check_case(case: dict, test: str, device: str = "cpu") -> None:
    """Run one drawn call: refused -> UnsupportedError; accepted -> close to the reference."""
    config, scheme, t, backend = case["config"], case["scheme"], case["t"], case["backend"]
    emap = case["expert_map"]
    why, eff = _verdict(backend, config, scheme, case["dispatcher"], emap is not None, current_platform())
    event(f"{backend}: {'refused' if why else 'compared'}")
    if why is not None:
        COUNTS[(test, backend, "refused")] += 1
        x = torch.zeros(t, config.hidden_size, dtype=config.dtype, device=device)
        ids = torch.zeros(t, config.top_k, dtype=torch.int32, device=device)
        w = torch.ones(t, config.top_k, device=device)
        with pytest.raises(UnsupportedError):
            fused_moe(
                x,
                (ids, w),
                None,
                config,
                scheme,
                backend=backend,
                dispatcher=case["dispatcher"],
                expert_map=None if emap is None else emap.to(device),
            )
        return
    COUNTS[(test, backend, "compared")] += 1
    p = make_problem(
        config, scheme, t, seed=case["seed"], device=device, expert_map=emap, num_local_experts=case["num_local"]
    )
    ids = p.topk_ids.long() if case["ids_int64"] else p.topk_ids
    out = fused_moe(
        p.x,
        (ids, p.topk_weights),
        p.weights,
        config,
        scheme,
        backend=backend,
        dispatcher=case["dispatcher"],
        expert_map=p.expert_map,
    )
    assert out.shape == (t, config.hidden_size) and out.dtype == config.dtype and out.device == p.x.device
    ref = moe_reference(p.x, p.topk_ids, p.topk_weights, p.weights, config, eff, expert_map=p.expert_map)
    err = rel_error(out, ref)
    assert err <= tolerance(eff, config.dtype), f"rel. error {err:.3e} > {tolerance(eff, config.dtype):.1e}"


FUZZ = dict(derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=1000, **FUZZ)
@given(case=layers())
def test_fuzz_cpu_backends(case):
    check_case(case, "cpu")


@settings(max_examples=100, **FUZZ)
@given(case=layers(max_e=5, sizes=(32, 64), max_odd=70, max_t=9, only=TRITON, exclude=frozenset(), refusal_share=12))
def test_fuzz_triton_interpreter(case):
    check_case(case, "triton")


@pytest.mark.gpu
@settings(max_examples=100, **FUZZ)
@given(
    case=layers(
        max_e=32,
        sizes=(32, 96, 128, 256, 384, 512, 768, 1024, 1536, 2048),
        max_odd=2100,
        max_t=300,
        exclude=frozenset(),
        refusal_share=10,
    )
)
def test_fuzz_gpu(case):
    """Every backend of the registry on the GPU (declared-only adapters must refuse), H and I up to 2048."""
    check_case(case, "gpu", device="cuda")
