"""``fusedmoe tune``: search grouped-GEMM launch configs on this GPU and write them as JSON.

A *combo* is one (preset, scheme); a *step* is one GEMM of its layer at one token count T
(W13: N = 2I, K = H; W2: N = H, K = I), launched as the layer launches it (bias, router
weights on GEMM2, into a preallocated output). Per step:

    plan     the space's configs whose BM suits the rows per expert (``candidates``), fitted to
             the scheme's scale groups, ranked by distance from the heuristic config
    warm     worker processes compile them into Triton's on-disk cache, most urgent first, while
             the main process times earlier steps; a job is one Triton specialisation, so a
             binary that several steps share (same scheme, same size classes) compiles once:
             ~1560 compiles for the 4302 candidates of 4 presets x 3 schemes x 6 T (counted on
             a CPU under the interpreter), ~200 s on 12 workers at 1.5 s per compile
    check    the main process runs each warm candidate once; an output further than 1e-2 from
             the heuristic config's output is rejected
    screen   every survivor: a short timing (CUDA-graph replays, L2 flushed before each)
    re-time  the best ``top`` and the heuristic config: a longer timing; the fastest wins
    write    <dir>/<gpu>/<scheme>/E=..,N=..,K=...json (``kernels.tuned_configs``) per GEMM, by
             rename (never half written), with the token counts whose two GEMMs both finished

GEMM2 is tuned under the BM GEMM1 chose at the same T (``candidates``), so a combo's steps run
G1(T0), G1(T1), G2(T0), G1(T2), G2(T1), ...: the workers compile G2(Ti) during G1(Ti+1).
``extra_tokens`` are tuned after every combo's ``tokens``, with the time those leave.

Budget (``budget_s``): before each step the remaining cost is estimated at full size (compiles
left / workers x seconds per compile, candidates left x seconds per candidate, both measured as
the run goes) and every remaining step keeps that fraction of its ranked candidates (at least
5), the rest leave the compile queue; a step stops waiting and screening at three times its
share of the time left. A combo's files are written after each of its passes; on expiry or
Ctrl-C, with the token counts that finished. The token count picks the entry, never the file
(STYLE point 6).
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import json
import math
import multiprocessing
import os
import signal
import statistics
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..env import config_dir
from ..kernels import grouped_gemm as _gg
from ..kernels._common import interpreting
from ..kernels.align import moe_align, moe_align_ref
from ..kernels.grouped_gemm import GemmFormat, grouped_gemm, scheme_key
from ..kernels.launch_config import LaunchConfig, default_launch_config, fit_launch_config
from ..kernels.tuned_configs import clear_cache, config_path
from ..quant import Operand, QuantScheme, quantize
from ..quant.scheme import shape_supported
from ..testing import random_topk, rel_error
from .presets import preset_config
from .timing import FlushTimer

SPACES = {
    # 96 configs before the BM and GROUP_M filters: 12-24 per decode step, 60-96 per prefill step
    "quick": dict(
        block_m=(16, 32, 64, 128),
        block_n=(64, 128, 256),
        block_k=(64, 128),
        group_m=(1, 8),
        num_warps=(4, 8),
        num_stages=(3,),
    ),
    "full": dict(
        block_m=(16, 32, 64, 128),
        block_n=(32, 64, 128, 256),
        block_k=(32, 64, 128),
        group_m=(1, 8, 16),
        num_warps=(4, 8),
        num_stages=(2, 3, 4, 5),
    ),
    # for tests under the interpreter: two candidates
    "tiny": dict(block_m=(16,), block_n=(32, 64), block_k=(32,), group_m=(1,), num_warps=(4,), num_stages=(2,)),
}
# Steps with at most DECODE_ROWS rows per expert also try the FMA path (BM < 16: no tensor cores,
# the W tile reduced in fp32 as stored), 4-24 more candidates each; BM beyond twice the rows per
# expert only multiplies the FMA work, so those are left out.
DECODE_SPACE = dict(
    block_m=(1, 2, 4, 8),
    block_n=(32, 64, 128),
    block_k=(128, 256),
    group_m=(1,),
    num_warps=(4,),
    num_stages=(3, 4),
)
DECODE_ROWS = 8
ALL_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b")  # ``--preset all``
SCHEMES = ("bf16", "fp8_tensor", "fp8_block")  # ``--scheme all``
TOLERANCE = 1e-2  # a candidate's output vs the heuristic config's

# Cost-model priors until measured: a Triton compile of this kernel takes 1-2 s on one core; the
# main process spends ~40 ms per candidate (cache load, check, graph capture, an 8 ms screen).
COMPILE_S, CANDIDATE_S, SETUP_S = 1.5, 0.04, 5.0
MIN_CANDIDATES = 4  # kept per step (besides the heuristic) whatever the budget
WRITE_RESERVE_S = 5.0  # the budget's last seconds: files and the summary
MIN_STEP_S = 2.0


def candidates(space: str, m_pairs: int, num_experts: int, block_m: int | None = None) -> list[LaunchConfig]:
    """The space's configs whose BM suits the rows per expert (at most 4x the need, at least 16),
    and for decode steps (``DECODE_ROWS``) the FMA path's (BM < 16, at most twice the rows).

    ``block_m`` pins BM: the layer aligns the pairs once, with GEMM1's BM, and GEMM2 runs
    on that alignment, so GEMM2 is tuned under the BM GEMM1 chose (tuning it freely
    picked tiles the layer then ran with another BM: 2x slower fp8-block cells, H200).
    GROUP_M > 1 only where an expert has more than one BM tile on average: it orders the
    tiles so the M tiles of one expert share W[e] in L2; with one tile per expert every
    order reads the same bytes (this halves the decode steps' candidates).
    """
    rows = m_pairs / max(1, num_experts)
    grids = [dict(SPACES[space])]
    if space != "tiny" and rows <= DECODE_ROWS:
        grids.append(dict(DECODE_SPACE))
    need = max(16, 4 * m_pairs // max(1, num_experts))
    out = []
    for grid in grids:
        if block_m is not None:
            if (block_m < 16) != (grid["block_m"][0] < 16):
                continue
            grid["block_m"] = (block_m,)
        for vals in itertools.product(*grid.values()):
            cfg = LaunchConfig(**dict(zip(grid, vals, strict=True)))
            if cfg.block_m < 16:
                ok = block_m is not None or cfg.block_m <= max(1, 2 * math.ceil(rows))
            else:
                ok = cfg.block_m <= need or cfg.block_m == 16
            if ok and (cfg.group_m == 1 or rows > cfg.block_m):
                out.append(cfg)
    return out


def _rank(cfgs: list[LaunchConfig], ref: LaunchConfig) -> list[LaunchConfig]:
    """Unique ``cfgs``, nearest the heuristic ``ref`` first (log2 tile distance, then the other
    knobs; the space's order among equals): a budget cut keeps the heuristic's neighbourhood."""

    def dist(c: LaunchConfig) -> float:
        tiles = sum(abs(math.log2(getattr(c, f) / getattr(ref, f))) for f in ("block_m", "block_n", "block_k"))
        return tiles + (c.group_m != ref.group_m) + (c.num_warps != ref.num_warps) + abs(c.num_stages - ref.num_stages)

    return sorted(dict.fromkeys(cfgs), key=dist)


# ---- operands and the one grouped_gemm call ---------------------------------------------


@dataclass(frozen=True)
class Combo:
    """One (preset, scheme) to tune; picklable, so a worker process rebuilds its operands."""

    preset: str
    scheme: str
    overrides: tuple[tuple[str, object], ...] = ()

    def config(self):
        return preset_config(self.preset, **dict(self.overrides))

    @property
    def name(self) -> str:
        return f"{self.preset} {self.scheme}"


@dataclass
class _Operands:
    """One GEMM of the layer at T tokens: A (quantized as the scheme says), W, bias, router
    weights (GEMM2), the output buffer, the (token, expert) ids and their alignment per BM."""

    gemm: str
    e: int  # experts the pairs are aligned over (the layer's E_l)
    n: int
    kd: int
    key: str  # scheme_key: the tuned-config folder
    fmt: GemmFormat
    a: Operand
    w: Operand
    bias: torch.Tensor | None
    topk_weights: torch.Tensor | None
    a_div: int
    ids: torch.Tensor
    out: torch.Tensor
    ref_align: bool = False  # workers: moe_align_ref (no align kernels to compile, same shapes)
    routes: dict = field(default_factory=dict)

    @property
    def pairs(self) -> int:
        return self.ids.numel()

    def routing(self, bm: int):
        if bm not in self.routes:  # the reference is bit-identical, and quick on a CPU
            align = moe_align_ref if self.ref_align or self.ids.device.type == "cpu" else moe_align
            self.routes[bm] = align(self.ids, self.e, bm)
        return self.routes[bm]

    def fit(self, cfg: LaunchConfig) -> LaunchConfig:
        """The config as the launcher runs it (BK divides a w8a8 scale group)."""
        return fit_launch_config(cfg, self.fmt.k_group, strict=self.fmt.native)

    def heuristic(self) -> LaunchConfig:
        return self.fit(default_launch_config(self.pairs, self.e, self.n, self.kd, self.key))


def _launch(op: _Operands, cfg: LaunchConfig, routing) -> torch.Tensor:
    """The tuner's only grouped_gemm call (workers, planning, checks and timings all come here):
    the GEMM as the layer launches it; a launch option of the layer (GEMM1's fused activation)
    goes in here and in ``_Operands``."""
    return grouped_gemm(
        op.a, op.w, routing, bias=op.bias, topk_weights=op.topk_weights, a_div=op.a_div, out=op.out, config=cfg
    )


def _weights(config, scheme, device):
    if device == "cuda":
        from .bench import bench_weights

        return bench_weights(config, scheme, device)
    from ..weights import ExpertWeights

    g = torch.Generator().manual_seed(0)
    e, r, h, i = config.num_experts, config.w13_rows, config.hidden_size, config.intermediate_size
    w13, w2 = torch.randn(e, r, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    b13 = torch.randn(e, r, generator=g).to(config.dtype) if config.has_bias else None
    b2 = torch.randn(e, h, generator=g).to(config.dtype) if config.has_bias else None
    if scheme.w1 is None:
        w13, w2 = w13.to(config.dtype), w2.to(config.dtype)
    return ExpertWeights.from_float(w13, w2, scheme, b13=b13, b2=b2)


def _operands(config, scheme, weights, gemm: str, t: int, device, ids, route_w) -> _Operands:
    g = torch.Generator(device=device).manual_seed(t)
    k = config.top_k
    if gemm == "w13":
        rows, kd, a_div, rw = t, config.hidden_size, k, None
        aq_t, wq_t, w, bias = scheme.a1, scheme.w1, weights.w13, weights.b13
    else:
        rows, kd, a_div = t * k, config.intermediate_size, 1
        aq_t, wq_t, w, bias = scheme.a2, scheme.w2, weights.w2, weights.b2
        rw = None if config.apply_router_weight_on_input else route_w
    a = torch.randn(rows, kd, generator=g, device=device).to(config.dtype)
    aq = quantize(a, aq_t) if aq_t is not None else None
    n = w.shape[1]
    return _Operands(
        gemm=gemm,
        e=config.num_experts,
        n=n,
        kd=kd,
        key=scheme_key(wq_t, aq_t),
        fmt=GemmFormat.of(wq_t, aq_t, n, kd, w.zero is not None),
        a=Operand.of(a if aq is None else aq, aq_t),
        w=Operand(w, wq_t),
        bias=bias,
        topk_weights=rw,
        a_div=a_div,
        ids=ids,
        out=torch.empty(t * k, n, dtype=config.dtype, device=device),
    )


# ---- what the workers compile -------------------------------------------------------------
#
# A worker compiles exactly what the main process will load when its operands give every kernel
# argument the same *specialisation*. Triton (3.x) keys a binary on the source (same files), the
# target and options (same GPU, num_warps/num_stages, the environment, inherited by spawn), the
# constexprs (BM, BN, BK, GROUP_M, formats, DOT_DTYPE: the config and the scheme) and, for every
# other argument, its type and attributes: a pointer's dtype and whether it is 16-byte aligned
# (every fresh allocation is), an int's width and whether it is 1 (then a constant) or divisible
# by 16. E is no kernel argument: it only sizes W, whose strides (N*K, K, 1) do not depend on it.
# So a worker keeps T, top-k, N, K and the scheme and shrinks what is large (DeepSeek-V3's bf16
# experts are 22 GB): W holds min(E, 2) experts (2 keeps the size-1 broadcast strides of
# per-expert scales apart from E = 1), every pair goes to one of them, and the pairs are still
# aligned over the layer's E experts, so ``num_m_blocks`` = max_padded(T*K, E, BM) / BM is the
# same number, not only the same class. ``_spec_key`` computes the key with Triton's own
# ``native_specialize_impl`` (no GPU needed); the main process computes it on worker operands to
# plan the jobs, compares it with the key of its own launch for every candidate and counts
# mismatches in the summary (the tests check them on the CPU). A worker only compiles (``run(
# warmup=True)``: no launch, so the main process's timings share the GPU with nothing but the
# workers' small operand set-up, aligned by ``moe_align_ref``) and loads the module, which raises
# OutOfResources for tiles over the shared-memory limit: those are dropped unrun.

_SIGNATURES: dict = {}


def _spec_key(kernel, args, kwargs) -> tuple:
    """Triton's specialisation of one launch: per argument ('constexpr', value) or (type, attr)."""
    from triton.runtime.jit import KernelParam, native_specialize_impl

    try:
        from triton.backends.nvidia.compiler import CUDABackend as backend
    except ImportError:  # pragma: no cover
        from triton.backends.compiler import BaseBackend as backend
    if kernel.fn not in _SIGNATURES:
        sig = inspect.signature(kernel.fn)
        params = getattr(kernel, "params", None)  # a JITFunction's, with its do_not_specialize
        _SIGNATURES[kernel.fn] = (
            sig,
            params or [KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())],
        )
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


class _Probe:
    """Stands in for a jit kernel of ``kernels.grouped_gemm``: records each launch's
    specialisation, then launches it ('run'), compiles and loads it ('compile') or stops ('record')."""

    def __init__(self, kernel, mode: str, specs: list) -> None:
        self.kernel, self.mode, self.specs = kernel, mode, specs

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            try:
                self.specs.append(_spec_key(self.kernel, args, kwargs))
            except Exception as exc:  # another Triton's internals: no check, and the launch goes on
                self.specs.append(("no key", f"{type(exc).__name__}: {exc}"))
            if self.mode == "run":
                return self.kernel[grid](*args, **kwargs)
            if self.mode == "compile" and not interpreting():  # the interpreter compiles nothing
                self.kernel.run(*args, grid=grid, warmup=True, **kwargs)._init_handles()

        return launch


@contextlib.contextmanager
def _probing(mode: str):
    """Every jit kernel the grouped_gemm module launches goes through a ``_Probe``; yields the specs."""
    from triton.runtime.jit import KernelInterface

    specs: list = []
    saved = {k: v for k, v in vars(_gg).items() if isinstance(v, KernelInterface)}
    for name, kernel in saved.items():
        setattr(_gg, name, _Probe(kernel, mode, specs))
    try:
        yield specs
    finally:
        for name, kernel in saved.items():
            setattr(_gg, name, kernel)


@dataclass(frozen=True)
class _Job:
    combo: Combo
    gemm: str
    t: int
    cfg: LaunchConfig
    device: str


@dataclass(frozen=True)
class _Warmed:
    key: tuple  # the specialisation the job was planned for
    spec: tuple | None  # the one the worker compiled (None: it failed before)
    seconds: float
    error: str | None = None  # the compile failed (the candidate is dropped)
    lost: bool = False  # no answer (worker died, job not queued): the main process tries itself


_WORKER_CACHE: dict = {}  # one combo's small weights and one step's operands per process


def _worker_operands(combo: Combo, gemm: str, t: int, device: str) -> _Operands:
    """Operands with the main process's specialisation and min(E, 2) experts' weights."""
    c = _WORKER_CACHE
    if c.get("combo") != combo:
        c.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        config, scheme = combo.config(), QuantScheme.by_name(combo.scheme)
        e_w = min(config.num_experts, 2)
        small = _weights(config.replace(num_experts=e_w, top_k=min(config.top_k, e_w)), scheme, device)
        c.update(combo=combo, config=config, scheme=scheme, e_w=e_w, weights=small)
    if c.get("step") != (gemm, t):
        c.pop("ops", None)
        k = c["config"].top_k
        ids = (torch.arange(t * k, device=device, dtype=torch.int32) % c["e_w"]).view(t, k)
        rw = torch.ones(t, k, device=device)
        ops = _operands(c["config"], c["scheme"], c["weights"], gemm, t, device, ids, rw)
        c.update(step=(gemm, t), ops=replace(ops, ref_align=True))
    return c["ops"]


def _job_spec(job: _Job, mode: str = "record") -> tuple:
    """The job's specialisation; ("unkeyed", job) where none was seen (a CPU without the
    interpreter launches nothing; another Triton may not be probed), so jobs never merge then."""
    op = _worker_operands(job.combo, job.gemm, job.t, job.device)
    with _probing(mode) as specs:
        _launch(op, job.cfg, op.routing(job.cfg.block_m))
    return tuple(specs) if specs and all(s[0] != "no key" for s in specs) else ("unkeyed", job)


def _warm(job: _Job, key: tuple) -> _Warmed:
    """Worker: compile (and load) one candidate into Triton's cache; never raises."""
    t0 = time.perf_counter()
    try:
        return _Warmed(key, _job_spec(job, "compile"), time.perf_counter() - t0)
    except Exception as exc:
        return _Warmed(key, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:400])


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (or the suite's timeout) is the main process's to handle
    torch.set_num_threads(1)


class _WarmPool:
    """Compile jobs keyed by specialisation, lowest priority tuple first, in spawned processes.

    ``sync`` sets the whole queue (jobs started or done stay); at most ``workers`` jobs are
    handed to the pool and the next is picked when one finishes (in the pool's result thread),
    so later, more urgent jobs overtake and withdrawn ones never start. ``workers=0`` runs a
    job in the calling process when it is waited for (no compile under the interpreter; the
    specialisation is still checked).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._cv = threading.Condition()
        self._queued: dict = {}  # key -> (priority, job)
        self._heap: list = []
        self._state: dict = {}  # key -> "running" | _Warmed
        self._running = 0
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        self._pool = ctx.Pool(workers, initializer=_worker_init) if workers > 0 else None

    def sync(self, want: dict) -> None:
        """Queue exactly ``want`` ({key: (priority, job)}) besides what started already."""
        with self._cv:
            self._queued = {k: pj for k, pj in want.items() if k not in self._state}
            self._heap = [(p, i, k) for i, (k, (p, _)) in enumerate(self._queued.items())]
            heapq.heapify(self._heap)
            self._dispatch()

    def _dispatch(self) -> None:
        while self._pool is not None and not self._closing and self._heap and self._running < self.workers:
            _, _, key = heapq.heappop(self._heap)
            if key in self._queued:
                self._state[key] = "running"
                self._running += 1
                job = self._queued.pop(key)[1]
                self._pool.apply_async(
                    _warm, (job, key), callback=self._done, error_callback=lambda e, k=key: self._lost(k, e)
                )

    def _done(self, res: _Warmed) -> None:
        with self._cv:
            self._state[res.key] = res
            self._running -= 1
            self._dispatch()
            self._cv.notify_all()

    def _lost(self, key, exc) -> None:
        self._done(_Warmed(key, None, 0.0, f"worker: {type(exc).__name__}: {exc}"[:400], lost=True))

    def result(self, key) -> _Warmed | None:
        r = self._state.get(key)
        return r if isinstance(r, _Warmed) else None

    def wait_any(self, keys: list, timeout: float):
        """The first of ``keys`` (in order) that is warm, waiting up to ``timeout`` s; None if none."""
        if self._pool is None:
            for k in keys[:1]:
                if self.result(k) is None:
                    job = self._queued.pop(k, (None, None))[1]
                    self._state[k] = _warm(job, k) if job else _Warmed(k, None, 0.0, "not queued", lost=True)
                return k
            return None
        end = time.monotonic() + max(0.0, timeout)
        with self._cv:
            while True:
                for k in keys:
                    if self.result(k) is not None:
                        return k
                if time.monotonic() >= end:
                    return None
                self._cv.wait(min(end - time.monotonic(), 30.0))  # Condition.wait overflows on inf

    def stats(self) -> tuple[int, float]:
        """(jobs finished, their total worker seconds)."""
        done = [r for r in list(self._state.values()) if isinstance(r, _Warmed)]
        return len(done), sum(r.seconds for r in done)

    def close(self) -> None:
        with self._cv:
            self._closing = True
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


# ---- timing -------------------------------------------------------------------------------


class _GraphTimer:
    """Median ms of CUDA-graph replays of one launch (no host overhead: the compile workers keep
    the CPUs busy), after a 256 MiB write outside the timed span so that W comes from HBM.
    A launch that cannot be captured is timed eagerly."""

    def __init__(self) -> None:
        self.timer = FlushTimer(flush_mb=256)

    def __call__(self, cfg, fn, target_ms: float) -> float:
        return self.timer.median_ms([fn], target_ms=target_ms, max_reps=2000, warmup=1)[0]


def _no_timer(cfg, fn, target_ms: float) -> float:
    """The CPU (interpreter): nothing worth timing; survivors tie and the heuristic wins."""
    return 0.0


# ---- results ------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One GEMM at one token count: the winner and the heuristic config, timed in the same run."""

    gemm: str
    t: int
    pairs: int
    cfg: LaunchConfig
    ms: float
    heuristic: LaunchConfig
    heuristic_ms: float
    planned: int  # candidates in the space
    kept: int  # after the budget cut
    screened: int = 0
    rejected: list = field(default_factory=list)  # (cfg, rel. error)
    failed: int = 0  # did not compile or run (shared memory, registers)
    late: int = 0  # not warm by the step's deadline
    cold: int = 0  # compiled in the main process after all (first run > 0.5 s on a GPU)
    key_checked: int = 0
    key_mismatch: int = 0

    @property
    def speedup(self) -> float:
        return _ratio(self.heuristic_ms, self.ms)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


@dataclass
class ComboResult:
    combo: Combo
    e: int = 0
    shapes: dict = field(default_factory=dict)  # gemm -> (N, K, scheme key)
    steps: dict = field(default_factory=dict)  # (gemm, t) -> StepResult
    files: list = field(default_factory=list)
    error: str | None = None

    def finished_tokens(self) -> list[int]:
        """Token counts whose two GEMMs both finished: the entries written."""
        return sorted(t for g, t in self.steps if g == "w13" and ("w2", t) in self.steps)


@dataclass
class TuneReport:
    """What ``tune_many`` did; ``markdown()`` is the summary."""

    gpu: str
    space: str
    tokens: list
    budget_s: float | None
    workers: int
    combos: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # steps never finished
    unsupported: list = field(default_factory=list)  # combos whose scheme cannot store the shape
    fractions: list = field(default_factory=list)  # budget fraction kept, per step
    stopped: str | None = None
    wall_s: float = 0.0
    jobs: int = 0
    job_s: float = 0.0

    @property
    def files(self) -> list[Path]:
        return [p for c in self.combos for p in c.files]

    def total(self, attr: str) -> int:
        return sum(getattr(s, attr) for c in self.combos for s in c.steps.values())

    def markdown(self) -> str:
        return _summary(self)


# ---- the run ------------------------------------------------------------------------------


def _steps(tokens: list[int]) -> list[tuple[str, int]]:
    """G1(T0), G1(T1), G2(T0), G1(T2), G2(T1), ..., G2(Tlast): G2(Ti) compiles during G1(Ti+1)."""
    out = []
    for i, t in enumerate(tokens):
        out += [("w13", t)] + ([("w2", tokens[i - 1])] if i else [])
    return out + [("w2", tokens[-1])] if tokens else out


class _Run:
    """One ``tune_many`` call: the plan, the budget, and the steps of every pass in order.

    A pass is one combo at a set of token counts; phase 0 passes (``tokens``, every combo) come
    before phase 1 passes (``extra_tokens``), and a phase 0 step's budget ignores phase 1, so the
    extra token counts get the time the others leave. Steps are keyed (pass, gemm, T).
    """

    def __init__(self, combos, tokens, extra, *, space, device, out_dir, gpu, budget_s, pool, timer, clock, knobs):
        self.combos, self.space, self.device = combos, space, device
        self.out_dir, self.gpu, self.pool, self.timer, self.clock = out_dir, gpu, pool, timer, clock
        self.screen_ms, self.retime_ms, self.top = knobs
        self.passes = [(ci, toks, ph) for ph, toks in enumerate((tokens, extra)) if toks for ci in range(len(combos))]
        self.orders = [{s: i for i, s in enumerate(_steps(toks))} for _, toks, _ in self.passes]
        self.t0 = clock()
        self.end = math.inf if budget_s is None else self.t0 + budget_s - WRITE_RESERVE_S
        self.plan: dict = {}  # step -> ranked [(cfg, key)]; GEMM2: the count until GEMM1 ran
        self.extra: dict = {}  # key -> (priority, job): heuristic configs outside the ranked lists
        self.done: set = set()
        self.cand_s: list[float] = []  # main-process seconds per screened candidate
        self.trust_errors = True  # a worker's compile error drops the candidate
        self.notes: set = set()
        self.report = TuneReport(gpu, space, list(tokens) + list(extra), budget_s, pool.workers)

    def log(self, msg: str) -> None:
        print(f"[{self.clock() - self.t0:6.1f}s] {msg}", flush=True)

    def note(self, msg: str) -> None:
        """Log a message once (the same compile error would repeat for every token count)."""
        if msg[:120] not in self.notes:
            self.notes.add(msg[:120])
            self.log(msg)

    def job(self, pi: int, gemm: str, t: int, cfg: LaunchConfig) -> _Job:
        return _Job(self.combos[self.passes[pi][0]], gemm, t, cfg, self.device)

    def priority(self, pi: int, gemm: str, t: int, rank: int) -> tuple:
        return (pi, self.orders[pi][(gemm, t)], rank)

    # -- plan and budget
    def planned(self, pi: int, gemm: str, t: int, ranked: list[LaunchConfig]) -> list:
        return [(c, _job_spec(self.job(pi, gemm, t, c))) for c in ranked]

    def plan_all(self) -> None:
        """Rank every pass's GEMM1 candidates and queue their compiles, a pass at a time."""
        for pi, (ci, toks, _) in enumerate(self.passes):
            for t in toks:
                op = _worker_operands(self.combos[ci], "w13", t, self.device)
                heur = op.heuristic()
                ranked = _rank([heur] + [op.fit(c) for c in candidates(self.space, op.pairs, op.e)], heur)
                self.plan[(pi, "w13", t)] = self.planned(pi, "w13", t, ranked)
                self.plan[(pi, "w2", t)] = len(candidates(self.space, op.pairs, op.e, heur.block_m))
            self.resubmit(self.fraction(0))

    def plan_w2(self, pi: int, t: int, bm: int) -> None:
        """GEMM2's candidates at the BM GEMM1 chose, and its heuristic (the layer's untuned BM)."""
        op = _worker_operands(self.combos[self.passes[pi][0]], "w2", t, self.device)
        heur, pinned = op.heuristic(), op.fit(replace(op.heuristic(), block_m=bm))
        ranked = _rank([pinned] + [op.fit(c) for c in candidates(self.space, op.pairs, op.e, bm)], pinned)
        self.plan[(pi, "w2", t)] = self.planned(pi, "w2", t, ranked)
        self.heuristic_job(pi, "w2", t, heur)
        self.resubmit(self.fraction(pi))

    def heuristic_job(self, pi: int, gemm: str, t: int, heur: LaunchConfig) -> tuple:
        job = self.job(pi, gemm, t, heur)
        key = _job_spec(job)
        self.extra[key] = (self.priority(pi, gemm, t, -1), job)
        return key

    def remaining(self, pi: int) -> list:
        """Steps not done in passes of ``pi``'s phase or an earlier one."""
        phase = self.passes[pi][2]
        return [k for k in self.plan if k not in self.done and self.passes[k[0]][2] <= phase]

    def fraction(self, pi: int) -> float:
        """The share of each remaining step's ranked candidates that the time left affords."""
        left = self.end - self.clock()
        if math.isinf(left):
            return 1.0
        rest = self.remaining(pi)
        n_cands = sum(len(v) if isinstance(v, list) else v for v in (self.plan[k] for k in rest))
        keys = {key for k in rest if isinstance(self.plan[k], list) for _, key in self.plan[k]}
        known = [key for v in self.plan.values() if isinstance(v, list) for _, key in v]
        unique = len(set(known)) / max(1, len(known))  # GEMM2 lists not planned yet share as much
        unplanned = sum(self.plan[k] for k in rest if isinstance(self.plan[k], int))
        n_jobs = sum(self.pool.result(k) is None for k in keys) + unique * unplanned
        jobs, job_s = self.pool.stats()
        per_job = job_s / jobs if jobs >= 8 else COMPILE_S
        per_cand = statistics.mean(self.cand_s) if len(self.cand_s) >= 8 else CANDIDATE_S
        fixed = len(rest) * (self.top + 1) * (self.retime_ms / 1e3 + 0.01) + len({k[0] for k in rest}) * SETUP_S
        need = max(n_cands * per_cand, n_jobs * per_job / max(1, self.pool.workers))
        return max(0.0, min(1.0, (left - fixed) / need)) if need > 0 else 1.0

    def deadline(self, pi: int, n: int) -> float:
        """When a step of ``n`` candidates stops waiting and screening: three times its share (by
        candidates) of the time left, plus the workers' start-up (~10 s: spawn, import torch) while
        none has answered; without a budget, a generous cap against a hung compile."""
        left = self.end - self.clock()
        if math.isinf(left):
            return self.clock() + 60 + 10 * n
        total = sum(len(v) if isinstance(v, list) else v for v in (self.plan[k] for k in self.remaining(pi)))
        boot = 30.0 if self.pool.workers and not self.pool.stats()[0] else 0.0
        return min(self.end, self.clock() + boot + max(MIN_STEP_S, 3 * left * n / max(1, total)))

    def keep(self, n: int, f: float) -> int:
        return min(n, max(MIN_CANDIDATES + 1, math.ceil(n * f)))

    def resubmit(self, f: float) -> None:
        """Queue the kept head of every remaining step's ranked list (an earlier pass's jobs first,
        whatever the phase); the tails leave the queue."""
        want = dict(self.extra)
        for step in (k for k in self.plan if k not in self.done):
            ranked = self.plan[step]
            if not isinstance(ranked, list):
                continue
            for rank, (cfg, key) in enumerate(ranked[: self.keep(len(ranked), f)]):
                prio = self.priority(step[0], step[1], step[2], rank)
                if key not in want or prio < want[key][0]:
                    want[key] = (prio, self.job(step[0], step[1], step[2], cfg))
        self.pool.sync(want)

    # -- one step
    def step(self, pi: int, op: _Operands, t: int, bm: int | None) -> StepResult:
        gemm = op.gemm
        heur = op.heuristic()  # GEMM2's too: the untuned layer runs it with the heuristic BM
        ranked = self.plan[(pi, gemm, t)]
        hkey = next((k for c, k in ranked if c == heur), None) or self.heuristic_job(pi, gemm, t, heur)
        f = self.fraction(pi)
        self.report.fractions.append(f)
        self.resubmit(f)
        kept = ranked[: self.keep(len(ranked), f)]
        deadline = self.deadline(pi, len(kept))
        res = StepResult(gemm, t, op.pairs, heur, 0.0, heur, 0.0, planned=len(ranked), kept=len(kept))

        # the heuristic first: the reference output (after its warm job, or without it at the deadline)
        self.pool.wait_any([hkey], deadline - self.clock())
        ref = self.check(op, heur, res, hkey)
        if ref is None:
            raise RuntimeError(f"the heuristic config {heur} does not run")
        ref = ref.float().clone()
        screened: dict = {}
        pending = [(c, k) for c, k in kept if c != heur]
        while pending and self.clock() < deadline:
            key = self.pool.wait_any([k for _, k in pending], deadline - self.clock())
            if key is None:
                break
            for cfg, k in [p for p in pending if p[1] == key]:
                pending.remove((cfg, k))
                self.screen(op, cfg, key, ref, res, screened)
        res.late, res.screened = len(pending), len(screened)

        # re-time the best few and the heuristic (the baseline; a candidate where its BM is allowed)
        order = [c for c, _ in ranked]
        final = sorted(screened, key=lambda c: (screened[c], order.index(c)))[: self.top]
        res.heuristic_ms = self.timer(heur, self.bound(op, heur), self.retime_ms)
        timed = {c: self.timer(c, self.bound(op, c), self.retime_ms) for c in final}
        if gemm == "w13" or heur.block_m == bm:
            timed[heur] = res.heuristic_ms
        res.cfg = min(timed, key=lambda c: (timed[c], order.index(c) if c in order else -1))
        res.ms = timed[res.cfg]
        self.extra.pop(hkey, None)
        return res

    def screen(self, op: _Operands, cfg: LaunchConfig, key, ref: torch.Tensor, res: StepResult, screened: dict):
        warmed = self.pool.result(key)
        if warmed and warmed.error and not warmed.lost and self.trust_errors:
            res.failed += 1
            if "OutOfResources" not in warmed.error:
                self.note(f"  {_fmt(cfg)} did not compile: {warmed.error}")
            return
        c0 = self.clock()
        out = self.check(op, cfg, res, key)
        if out is None:
            return
        err = rel_error(out, ref)
        if err > TOLERANCE:
            res.rejected.append((cfg, err))
            self.log(f"  rejected {_fmt(cfg)}: output differs from the heuristic's by {err:.2e}")
            return
        screened[cfg] = self.timer(cfg, self.bound(op, cfg), self.screen_ms)
        self.cand_s.append(self.clock() - c0)

    def bound(self, op: _Operands, cfg: LaunchConfig):
        routing = op.routing(cfg.block_m)
        return lambda: _launch(op, cfg, routing)

    def check(self, op: _Operands, cfg: LaunchConfig, res: StepResult, key) -> torch.Tensor | None:
        """Run ``cfg`` once, its specialisation compared with the worker's; None if it cannot run."""
        routing = op.routing(cfg.block_m)
        c0 = time.perf_counter()
        try:
            with _probing("run") as specs:
                out = _launch(op, cfg, routing)
            if self.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:
            if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                self.log(f"  {_fmt(cfg)} failed: {type(exc).__name__}: {str(exc)[:200]}")
            res.failed += 1
            return None
        res.cold += self.device == "cuda" and time.perf_counter() - c0 > 0.5
        warmed = self.pool.result(key)
        if warmed is not None and warmed.error and not warmed.lost and self.trust_errors:
            self.trust_errors = False  # it failed there and runs here: do not drop candidates on their word
            self.log(f"  the workers failed a config the main process runs ({warmed.error}); trying every one here")
        if warmed is not None and warmed.spec is not None and warmed.spec[0] != "unkeyed":
            res.key_checked += 1
            if warmed.spec != tuple(specs):
                res.key_mismatch += 1
                diff = [(a, b) for a, b in zip(warmed.spec[0][0], specs[0][0], strict=False) if a != b]
                self.log(f"  {_fmt(cfg)}: the worker compiled another specialisation (worker, main): {diff[:3]}")
        return out

    # -- one pass
    def run_pass(self, pi: int, cr: ComboResult) -> None:
        """Add the pass's steps to ``cr`` one by one (an interruption keeps what finished)."""
        ci, toks, _ = self.passes[pi]
        combo = self.combos[ci]
        config, scheme = combo.config(), QuantScheme.by_name(combo.scheme)
        cr.e = config.num_experts
        self.log(f"{combo.name} T={','.join(map(str, toks))}: E={cr.e} H={config.hidden_size} "
                 f"I={config.intermediate_size} K={config.top_k}")  # fmt: skip
        weights = _weights(config, scheme, self.device)
        try:
            for gemm, t in _steps(toks):
                if self.clock() >= self.end:
                    self.report.stopped = "budget"
                    return
                if gemm == "w2" and ("w13", t) not in cr.steps:
                    continue  # its GEMM1 step failed
                g = torch.Generator(device=self.device).manual_seed(t)
                ids, rw = random_topk(t, config.num_experts, config.top_k, g)
                op = _operands(config, scheme, weights, gemm, t, self.device, ids, rw)
                cr.shapes[gemm] = (op.n, op.kd, op.key)
                bm = cr.steps[("w13", t)].cfg.block_m if gemm == "w2" else None
                try:
                    r = cr.steps[(gemm, t)] = self.step(pi, op, t, bm)
                except Exception as exc:  # one step's failure must not lose the others
                    self.log(f"{combo.name} {gemm} T={t} failed: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                    continue
                finally:
                    self.done.add((pi, gemm, t))
                    del op
                if gemm == "w13":
                    self.plan_w2(pi, t, r.cfg.block_m)
                self.log(
                    f"{combo.name} {gemm} T={t} pairs={r.pairs}: {_fmt(r.cfg)} {r.ms:.4f} ms, heuristic "
                    f"{_fmt(r.heuristic)} {r.heuristic_ms:.4f} ms ({r.speedup:.2f}x); screened {r.screened}/{r.kept} "
                    f"of {r.planned}; rejected {len(r.rejected)}, failed {r.failed}, late {r.late}, cold {r.cold}"
                )
        finally:
            self.done.update(k for k in self.plan if k[0] == pi)
            del weights
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def execute(self) -> TuneReport:
        rep, results = self.report, {}
        try:
            self.plan_all()
            for pi, (ci, _, _) in enumerate(self.passes):
                if self.clock() >= self.end:
                    rep.stopped = "budget"
                    break
                if ci not in results:
                    results[ci] = ComboResult(self.combos[ci])
                    rep.combos.append(results[ci])
                cr = results[ci]
                try:
                    self.run_pass(pi, cr)
                except Exception as exc:
                    cr.error = f"{type(exc).__name__}: {exc}"
                    self.log(f"{cr.combo.name} failed: {cr.error}")
                    traceback.print_exc()
                finally:  # also on Ctrl-C: what finished is written (the combo's passes so far)
                    cr.files = write_combo(cr, self.out_dir, self.gpu, self.space)
                    for p in cr.files:
                        self.log(f"wrote {p}")
        except KeyboardInterrupt:
            rep.stopped = "interrupted"
        rep.jobs, rep.job_s = self.pool.stats()
        done = {(c.combo, g, t) for c in rep.combos for g, t in c.steps}
        rep.skipped = [
            f"{self.combos[ci].name} {g} T={t}"
            for ci, toks, _ in self.passes
            for g, t in _steps(toks)
            if (self.combos[ci], g, t) not in done
        ]
        rep.wall_s = self.clock() - self.t0
        return rep


# ---- files and the summary ----------------------------------------------------------------


def _fmt(c: LaunchConfig) -> str:
    return ",".join(str(v) for v in asdict(c).values())


def _write_json(path: Path, data: dict) -> None:
    """Write by rename: a reader (or a killed run) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _kept_entries(path: Path, head: dict) -> dict:
    """The per-pair-count entries of an existing file for the same GPU, scheme and shape (a run
    that tunes some token counts keeps the others); nothing if there is none or it differs."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if any(old.get(f) != head[f] for f in ("gpu", "scheme", "E", "N", "K")):
        return {}
    return {f: dict(old.get(f) or {}) for f in ("configs", "ms", "heuristic_ms")}


def write_combo(cr: ComboResult, out_dir: Path | str, gpu: str, space: str = "quick") -> list[Path]:
    """One JSON per GEMM of the combo, with the token counts whose two GEMMs finished, merged
    into the entries of other token counts an existing file for the same shape holds (both
    GEMMs' files get the same counts replaced, so GEMM2 stays tuned under GEMM1's BM)."""
    import triton

    tokens = cr.finished_tokens()
    paths = []
    for gemm in ("w13", "w2") if tokens else ():
        n, k, key = cr.shapes[gemm]
        rs = [cr.steps[(gemm, t)] for t in tokens]
        path = config_path(out_dir, gpu, key, cr.e, n, k)
        head = {"gpu": gpu, "scheme": key, "E": cr.e, "N": n, "K": k}
        data = {
            **head,
            "triton": triton.__version__,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "space": space,
            "configs": {str(r.pairs): asdict(r.cfg) for r in rs},
            "ms": {str(r.pairs): round(r.ms, 5) for r in rs},
            "heuristic_ms": {str(r.pairs): round(r.heuristic_ms, 5) for r in rs},
        }
        for f, entries in _kept_entries(path, head).items():
            data[f] = dict(sorted({**entries, **data[f]}.items(), key=lambda kv: int(kv[0])))
        _write_json(path, data)
        paths.append(path)
    clear_cache()
    return paths


def _summary(rep: TuneReport) -> str:
    lines = [
        f"# fusedmoe tune on {rep.gpu}",
        "",
        f"{time.strftime('%Y-%m-%d')}, space `{rep.space}`, tokens {','.join(map(str, rep.tokens))}, budget "
        f"{'none' if rep.budget_s is None else f'{rep.budget_s:.0f} s'}, wall {rep.wall_s:.0f} s"
        + (f", stopped: {rep.stopped}" if rep.stopped else "")
        + f". {rep.workers} compile workers: {rep.jobs} compiles, {rep.job_s / max(1, rep.jobs):.2f} s each; "
        f"warm keys checked {rep.total('key_checked')}, mismatched {rep.total('key_mismatch')}; compiled in the "
        f"main process (cold) {rep.total('cold')}; smallest budget fraction {min(rep.fractions, default=1):.2f} "
        f"(a step keeps at least {MIN_CANDIDATES + 1} candidates).",
        "",
    ]
    for cr in rep.combos:
        names = [f"{g} `{p.relative_to(p.parents[2])}`" for g, p in zip(("GEMM1", "GEMM2"), cr.files, strict=False)]
        names = names or ["(nothing written)"]
        lines += [f"## {cr.combo.name}" + (f" (error: {cr.error})" if cr.error else ""), "", ", ".join(names), ""]
        lines += [
            "| T | GEMM1 config | ms | heuristic ms | x | GEMM2 config | ms | heuristic ms | x | both x |"
            " screened/kept/space | rejected failed late |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in sorted({t for _, t in cr.steps}):
            a, b = cr.steps.get(("w13", t)), cr.steps.get(("w2", t))
            cells = [str(t)]
            for r in (a, b):
                cells += [_fmt(r.cfg), f"{r.ms:.4f}", f"{r.heuristic_ms:.4f}", f"{r.speedup:.2f}"] if r else ["-"] * 4
            rs = [r for r in (a, b) if r]
            cells += [
                f"{_ratio(a.heuristic_ms + b.heuristic_ms, a.ms + b.ms):.2f}" if a and b else "-",
                ", ".join(f"{r.screened}/{r.kept}/{r.planned}" for r in rs),
                ", ".join(f"{len(r.rejected)} {r.failed} {r.late}" for r in rs),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if rep.skipped:
        lines += [f"Not tuned ({rep.stopped or 'failed'}): " + "; ".join(rep.skipped), ""]
    if rep.unsupported:
        lines += ["Not tunable (the scheme cannot store the shape): " + "; ".join(rep.unsupported), ""]
    lines.append("Config: BM,BN,BK,GROUP_M,warps,stages. x: heuristic ms / tuned ms (same run, CUDA-graph replays).")
    return "\n".join(lines)


# ---- entry points -------------------------------------------------------------------------


def parse_presets(text: str) -> list[str]:
    """'all' -> the four shipped presets; else a comma list."""
    return list(ALL_PRESETS) if text == "all" else [p for p in text.split(",") if p]


def _storable(combos: list[Combo]) -> tuple[list[Combo], list[str]]:
    """(combos whose scheme can store the preset's weights, "<combo>: why not" for the others),
    e.g. gpt-oss-20b's H = I = 2880 is no whole number of int4 groups of 128. A typo in a preset
    or scheme name fails here, before any work."""
    kept, refused = [], []
    for c in combos:
        config = c.config()
        why = shape_supported(QuantScheme.by_name(c.scheme), config.hidden_size, config.intermediate_size)
        if why:
            refused.append(f"{c.name}: {why}")
        else:
            kept.append(c)
    return kept, refused


def tune_many(
    presets,
    schemes,
    tokens,
    *,
    extra_tokens=(),
    out_dir=None,
    space: str = "quick",
    device: str = "cuda",
    budget_s: float | None = None,
    workers: int | None = None,
    screen_ms: float = 8.0,
    retime_ms: float = 60.0,
    top: int = 3,
    timer=None,
    clock=time.monotonic,
    **overrides,
) -> TuneReport:
    """Tune both GEMMs of every (preset, scheme) at ``tokens``, then at ``extra_tokens`` with the
    budget left; files go under ``out_dir`` (default: ``env.config_dir()``, the user's folder). ``workers``:
    compile processes (default: on a GPU min(12, CPUs - 2), else 0). ``timer(cfg, fn, target_ms)
    -> ms`` replaces the GPU timer and ``clock`` the wall clock (tests). ``overrides`` change
    every preset's shape."""
    tokens = sorted({int(t) for t in tokens})
    extra = sorted({int(t) for t in extra_tokens} - set(tokens))
    combos, refused = _storable([Combo(p, s, tuple(sorted(overrides.items()))) for p in presets for s in schemes])
    if workers is None:
        workers = min(12, max(1, (os.cpu_count() or 4) - 2)) if device == "cuda" else 0
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
    timer = timer or (_GraphTimer() if device == "cuda" else _no_timer)
    pool = _WarmPool(workers)
    try:
        knobs = (screen_ms, retime_ms, top)
        run = _Run(combos, tokens, extra, space=space, device=device, out_dir=Path(out_dir or config_dir()), gpu=gpu,
                   budget_s=budget_s, pool=pool, timer=timer, clock=clock, knobs=knobs)  # fmt: skip
        run.log(f"tuning {len(combos)} combos at T={tokens} then T={extra} on {gpu}, {workers} compile workers")
        for r in refused:
            run.log(f"not tuned: {r}")
        rep = run.execute()
        rep.unsupported = refused
        return rep
    finally:
        pool.close()


def tune(preset: str, scheme_name: str, tokens, *, out_dir=None, space="quick", device="cuda", **kw) -> list[Path]:
    """Tune both GEMMs of one preset layer for ``scheme_name``; returns the JSON files written."""
    return tune_many([preset], [scheme_name], tokens, out_dir=out_dir, space=space, device=device, **kw).files


def plan_summary(presets, schemes, tokens, space="quick", workers=12, top=3, retime_ms=60.0) -> str:
    """Candidates per combo at full size (GEMM2 at the heuristic's BM), the distinct compiles, and
    the cost model's wall time: what ``--dry-run`` prints before any GPU time is spent."""
    combos, refused = _storable([Combo(p, s) for p in presets for s in schemes])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = _Run(combos, sorted(set(tokens)), (), space=space, device=device, out_dir=None, gpu="", budget_s=None,
               pool=_WarmPool(0), timer=_no_timer, clock=time.monotonic, knobs=(8.0, retime_ms, top))  # fmt: skip
    run.plan_all()
    lines, n = [f"not tunable: {r}" for r in refused], 0
    for ci, c in enumerate(combos):
        m = sum(len(v) if isinstance(v, list) else v for k, v in run.plan.items() if k[0] == ci)
        lines.append(f"{c.name}: {m} candidates")
        n += m
    known = [key for v in run.plan.values() if isinstance(v, list) for _, key in v]
    jobs = round(n * len(set(known)) / max(1, len(known)))
    steps = len(run.plan)
    compile_s = jobs * COMPILE_S / max(1, workers)
    main_s = n * CANDIDATE_S + steps * (top + 1) * (retime_ms / 1e3 + 0.01) + len(combos) * SETUP_S
    if device == "cpu" and not interpreting():
        lines.append("(no kernel launches on a CPU without TRITON_INTERPRET=1: every candidate counts as a compile)")
    lines.append(
        f"total {n} candidates in {steps} steps, ~{jobs} distinct compiles. Compile: {jobs} x {COMPILE_S} s / "
        f"{workers} workers = {compile_s:.0f} s. Main process: {n} x {CANDIDATE_S} s + {steps} x {top + 1} re-timings "
        f"x {retime_ms / 1e3 + 0.01:.2f} s + {len(combos)} x {SETUP_S:.0f} s = {main_s:.0f} s. Overlapped: about "
        f"{max(compile_s, main_s):.0f} s."
    )
    return "\n".join(lines)


__all__ = ["tune", "tune_many", "candidates", "plan_summary", "parse_presets", "SPACES", "SCHEMES", "ALL_PRESETS"]
