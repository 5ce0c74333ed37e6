"""What the compile workers compile: Triton specialisation keys of grouped-GEMM launches.

A worker compiles exactly what the main process will load when its operands give every kernel
argument the same *specialisation*. Triton (3.x) keys a binary on the source (same files), the
target and options (same GPU, num_warps/num_stages, the environment, inherited by spawn), the
constexprs (BM, BN, BK, GROUP_M, formats, DOT_DTYPE: the config and the scheme) and, for every
other argument, its type and attributes: a pointer's dtype and whether it is 16-byte aligned
(every fresh allocation is), an int's width and whether it is 1 (then a constant) or divisible
by 16. E is no kernel argument: it only sizes W, whose strides (N*K, K, 1) do not depend on it.

So a worker keeps T, top-k, N, K and the scheme and shrinks what is large (DeepSeek-V3's bf16
experts are 22 GB): W holds min(E, 2) experts (2 keeps the size-1 broadcast strides of
per-expert scales apart from E = 1), every pair goes to one of them, and the pairs are still
aligned over the layer's E experts, so ``num_m_blocks`` = max_padded(T*K, E, BM) / BM is the
same number, not only the same class (``operands.worker_operands``).

``spec_key`` computes the key with Triton's own ``native_specialize_impl`` (no GPU needed); the
main process computes it on worker operands to plan the jobs, compares it with the key of its
own launch for every candidate and counts mismatches in the summary (the tests check them on
the CPU). Launches are seen through ``kernels.launch.intercept_launches`` (``probing``).
A worker only compiles (``run(warmup=True)``: no launch, so the main process's timings share
the GPU with nothing but the workers' small operand set-up, aligned by ``moe_align_ref``) and
loads the module, which raises OutOfResources for tiles over the shared-memory limit: those
are dropped unrun.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass

from ...kernels._common import interpreting
from ...kernels.launch import intercept_launches
from ...kernels.launch_config import LaunchConfig
from .operands import Combo, launch, worker_operands

_SIGNATURES: dict = {}


def spec_key(kernel, args, kwargs) -> tuple:
    """Triton's specialisation of one launch: per argument ('constexpr', value) or (type, attr)."""
    from triton.runtime.jit import KernelParam, native_specialize_impl

    try:
        from triton.backends.nvidia.compiler import CUDABackend as backend
    except ImportError:  # pragma: no cover
        from triton.backends.compiler import BaseBackend as backend
    if kernel.fn not in _SIGNATURES:
        sig = inspect.signature(kernel.fn)
        params = getattr(kernel, "params", None)  # a JITFunction's, with its do_not_specialize
        if params is None:  # the interpreter's function keeps the jit options in .kwargs
            opts = getattr(kernel, "kwargs", {})
            plain, no_align = opts.get("do_not_specialize") or (), opts.get("do_not_specialize_on_alignment") or ()
            params = [
                KernelParam(i, p, i in plain or p.name in plain, i in no_align or p.name in no_align)
                for i, p in enumerate(sig.parameters.values())
            ]
        _SIGNATURES[kernel.fn] = (sig, params)
    sig, params = _SIGNATURES[kernel.fn]
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters}).arguments
    out = [kernel.fn.__name__]
    for kp in params:
        v = bound.get(kp.name, kp.default)
        if kp.is_constexpr:
            out.append((kp.name, "constexpr", v if isinstance(v, (int, float, str, type(None))) else str(v)))
        else:
            spec = native_specialize_impl(
                backend, v, kp.is_const, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
            )
            out.append((kp.name, *spec))
    return tuple(out), tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))


@contextlib.contextmanager
def probing(mode: str):
    """Every grouped-GEMM jit launch inside the block records its specialisation, then is
    launched ('run'), compiled and loaded ('compile') or dropped ('record'); yields the specs."""
    specs: list = []

    def probe(kernel, grid, args, kwargs):
        try:
            specs.append(spec_key(kernel, args, kwargs))
        except Exception as exc:  # another Triton's internals: no check, and the launch goes on
            specs.append(("no key", f"{type(exc).__name__}: {exc}"))
        if mode == "run":
            return kernel[grid](*args, **kwargs)
        if mode == "compile" and not interpreting():  # the interpreter compiles nothing
            kernel.run(*args, grid=grid, warmup=True, **kwargs)._init_handles()
        return None

    with intercept_launches(probe):
        yield specs


@dataclass(frozen=True)
class Job:
    """One candidate of one step, as a worker compiles it (picklable)."""

    combo: Combo
    gemm: str
    t: int
    cfg: LaunchConfig
    device: str


@dataclass(frozen=True)
class Warmed:
    """A worker's answer to a job."""

    key: tuple  # the specialisation the job was planned for
    spec: tuple | None  # the one the worker compiled (None: it failed before)
    seconds: float
    error: str | None = None  # the compile failed (the candidate is dropped)
    lost: bool = False  # no answer (worker died, job not queued): the main process tries itself


def job_spec(job: Job, mode: str = "record") -> tuple:
    """The job's specialisation; ("unkeyed", job) where none is seen (a CPU without the
    interpreter launches no kernel: not even tried, since the op would compute its float
    reference at full size instead, minutes for a ``--dry-run`` of the shipped presets; a Triton
    whose internals ``spec_key`` cannot read gives "no key"), so jobs never merge then."""
    if job.device == "cpu" and not interpreting():
        return ("unkeyed", job)
    op = worker_operands(job.combo, job.gemm, job.t, job.device)
    with probing(mode) as specs:
        launch(op, job.cfg, op.routing(job.cfg.block_m))
    return tuple(specs) if specs and all(s[0] != "no key" for s in specs) else ("unkeyed", job)


def warm(job: Job, key: tuple) -> Warmed:
    """Worker: compile (and load) one candidate into Triton's cache; never raises."""
    t0 = time.perf_counter()
    try:
        return Warmed(key, job_spec(job, "compile"), time.perf_counter() - t0)
    except Exception as exc:
        return Warmed(key, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:400])
