"""The run: planning, timing, checking and the budget of one ``tune_many`` call.

Budget (``budget_s``): before each step the remaining cost is estimated at full size (compiles
left / workers x seconds per compile, candidates left x seconds per candidate, both measured as
the run goes) and every remaining step keeps that fraction of its ranked candidates (at least
``MIN_CANDIDATES`` + 1), the rest leave the compile queue; a step stops waiting and screening at
three times its share of the time left. A combo's files are written after each of its passes;
on expiry or Ctrl-C, with the token counts that finished.
"""

from __future__ import annotations

import math
import os
import statistics
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from ...env import config_dir
from ...kernels import tuned_configs
from ...kernels._common import interpreting
from ...kernels.launch_config import LaunchConfig
from ...quant import QuantScheme
from ...testing import random_topk, rel_error
from ..timing import FlushTimer
from .operands import Combo, StepOperands, launch, layer_weights, step_operands, storable, worker_operands
from .pool import WarmPool
from .probe import Job, job_spec, probing
from .report import ComboResult, StepResult, TuneReport, write_combo
from .space import MIN_CANDIDATES, by_distance, candidates, families_first, fmt_config, knob_variants, w4_candidates

TOLERANCE = 1e-2  # a candidate's output vs the heuristic config's
# Cost-model priors until measured: a Triton compile of this kernel takes 1-2 s on one core; the
# main process spends ~40 ms per candidate (cache load, check, graph capture, an 8 ms screen).
COMPILE_S, CANDIDATE_S, SETUP_S = 1.5, 0.04, 5.0
WRITE_RESERVE_S = 5.0  # the budget's last seconds: files and the summary
MIN_STEP_S = 2.0


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
        self.shipped_cfg: dict = {}  # step -> the table's entry before this run (``ranked``), or None
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

    def job(self, pi: int, gemm: str, t: int, cfg: LaunchConfig) -> Job:
        return Job(self.combos[self.passes[pi][0]], gemm, t, cfg, self.device)

    def priority(self, pi: int, gemm: str, t: int, rank: int) -> tuple:
        return (pi, self.orders[pi][(gemm, t)], rank)

    # -- plan and budget
    def planned(self, pi: int, gemm: str, t: int, ranked: list[LaunchConfig]) -> list:
        return [(c, job_spec(self.job(pi, gemm, t, c))) for c in ranked]

    def plan_all(self) -> None:
        """Rank every pass's GEMM1 candidates and queue their compiles, a pass at a time."""
        for pi, (ci, toks, _) in enumerate(self.passes):
            for t in toks:
                op = worker_operands(self.combos[ci], "w13", t, self.device)
                heur = op.heuristic()
                ranked = self.ranked(pi, op, t, heur, self.candidates(op))
                self.plan[(pi, "w13", t)] = self.planned(pi, "w13", t, ranked)
                self.plan[(pi, "w2", t)] = len(self.candidates(op, heur.block_m))
            self.resubmit(self.fraction(0))

    def candidates(self, op: StepOperands, block_m: int | None = None) -> list[LaunchConfig]:
        """The step's space: the w4 kernel's (GEMM2's BM free) or the others' (GEMM2 under ``block_m``)."""
        if op.w4:
            return w4_candidates(self.space, op.pairs, op.e)
        return candidates(self.space, op.pairs, op.e, block_m, op.operand_bytes)

    def plan_w2(self, pi: int, t: int, bm: int) -> None:
        """GEMM2's candidates at the BM GEMM1 chose (the w4 kernel's: at any BM), and its
        heuristic (the layer's untuned BM)."""
        op = worker_operands(self.combos[self.passes[pi][0]], "w2", t, self.device)
        heur = op.heuristic()
        pinned = heur if op.w4 else op.fit(replace(heur, block_m=bm))
        ranked = self.ranked(pi, op, t, pinned, self.candidates(op, bm), None if op.w4 else bm)
        self.plan[(pi, "w2", t)] = self.planned(pi, "w2", t, ranked)
        self.heuristic_job(pi, "w2", t, heur)
        self.resubmit(self.fraction(pi))

    def ranked(self, pi, op: StepOperands, t: int, first: LaunchConfig, cands, bm: int | None = None) -> list:
        """The step's candidates nearest ``first`` first, with the entry the shipped or user table
        gives this step today second (``shipped``), so that no budget cut leaves it unscreened:
        a re-tune that screened only the heuristic's neighbourhood once replaced a 64 x 256
        persistent tile with a 1.36x slower one (H200, DeepSeek-V3 fp8 blocks, PERF_LOG). Then the
        nearest config of each kernel path not yet there (``families_first``), then the rest."""
        ranked = by_distance([first] + [op.fit(c) for c in cands], first)
        shipped = self.shipped(op, bm)
        self.shipped_cfg[(pi, op.gemm, t)] = shipped
        if shipped is None or shipped == first:
            return families_first(ranked, 1)
        return families_first([first, shipped] + [c for c in ranked[1:] if c != shipped], 2)

    def shipped(self, op: StepOperands, bm: int | None) -> LaunchConfig | None:
        """The tuned entry nearest the step's pair count for this GPU (what the layer runs before
        this run's files exist), under GEMM2's pinned BM; None where there is none."""
        fields = tuned_configs.lookup(op.pairs, op.e, op.n, op.kd, op.key, gpu=self.gpu)
        if fields is None:
            return None
        cfg = LaunchConfig(**fields)
        return op.fit(cfg if bm is None else replace(cfg, block_m=bm))

    def heuristic_job(self, pi: int, gemm: str, t: int, heur: LaunchConfig) -> tuple:
        job = self.job(pi, gemm, t, heur)
        key = job_spec(job)
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
    def step(self, pi: int, op: StepOperands, t: int, bm: int | None) -> StepResult:
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
        shipped = self.shipped_cfg.get((pi, gemm, t))
        res.heuristic_ms = self.timer(heur, self.bound(op, heur), self.retime_ms)
        timed = {c: self.timer(c, self.bound(op, c), self.retime_ms) for c in final}
        if bm is None or heur.block_m == bm:
            timed[heur] = res.heuristic_ms
        if shipped is not None and shipped not in timed:
            self.time_extra(op, shipped, screened, ref, res, timed)
        if shipped in timed:
            res.shipped, res.shipped_ms = shipped, timed[shipped]
        for c in knob_variants(min(timed, key=timed.get), op.w4):  # knobs the space does not sweep
            if op.fit(c) not in timed:
                self.time_extra(op, op.fit(c), screened, ref, res, timed)
        res.cfg = min(timed, key=lambda c: (timed[c], order.index(c) if c in order else -1))
        res.ms = timed[res.cfg]
        self.extra.pop(hkey, None)
        return res

    def time_extra(self, op, cfg: LaunchConfig, screened: dict, ref, res: StepResult, timed: dict) -> None:
        """Time ``cfg`` beside the finalists: the shipped entry, so the winner must beat it there,
        also where its compile came too late to screen it (a run once wrote the heuristic's tile
        over a 1.12x faster shipped one so: H200, Qwen3 fp8 blocks GEMM2 at 131,072 pairs); and
        the best finalist with a knob flipped (``space.knob_variants``). Compiled here if need be;
        one that fails or differs from the heuristic's output is left out, as screening would
        have left it."""
        if cfg not in screened:
            out = self.check(op, cfg, res, None)
            if out is None or rel_error(out, ref) > TOLERANCE:
                return
        timed[cfg] = self.timer(cfg, self.bound(op, cfg), self.retime_ms)

    def screen(self, op: StepOperands, cfg: LaunchConfig, key, ref: torch.Tensor, res: StepResult, screened: dict):
        warmed = self.pool.result(key)
        if warmed and warmed.error and not warmed.lost and self.trust_errors:
            res.failed += 1
            if "OutOfResources" not in warmed.error:
                self.note(f"  {fmt_config(cfg)} did not compile: {warmed.error}")
            return
        c0 = self.clock()
        out = self.check(op, cfg, res, key)
        if out is None:
            return
        err = rel_error(out, ref)
        if err > TOLERANCE:
            res.rejected.append((cfg, err))
            self.log(f"  rejected {fmt_config(cfg)}: output differs from the heuristic's by {err:.2e}")
            return
        screened[cfg] = self.timer(cfg, self.bound(op, cfg), self.screen_ms)
        self.cand_s.append(self.clock() - c0)

    def bound(self, op: StepOperands, cfg: LaunchConfig):
        routing = op.routing(cfg.block_m)
        return lambda: launch(op, cfg, routing)

    def check(self, op: StepOperands, cfg: LaunchConfig, res: StepResult, key) -> torch.Tensor | None:
        """Run ``cfg`` once, its specialisation compared with the worker's; None if it cannot run."""
        routing = op.routing(cfg.block_m)
        c0 = time.perf_counter()
        try:
            with probing("run") as specs:
                out = launch(op, cfg, routing)
            if self.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:
            if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                self.log(f"  {fmt_config(cfg)} failed: {type(exc).__name__}: {str(exc)[:200]}")
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
                self.log(f"  {fmt_config(cfg)}: the worker compiled another specialisation (worker, main): {diff[:3]}")
        return op.value(out)

    # -- one pass
    def run_pass(self, pi: int, cr: ComboResult) -> None:
        """Add the pass's steps to ``cr`` one by one (an interruption keeps what finished)."""
        ci, toks, _ = self.passes[pi]
        combo = self.combos[ci]
        config, scheme = combo.config(), QuantScheme.by_name(combo.scheme)
        cr.e = config.num_experts
        self.log(f"{combo.name} T={','.join(map(str, toks))}: E={cr.e} H={config.hidden_size} "
                 f"I={config.intermediate_size} K={config.top_k}")  # fmt: skip
        weights = layer_weights(config, scheme, self.device)
        try:
            for gemm, t in _steps(toks):
                if self.clock() >= self.end:
                    self.report.stopped = "budget"
                    return
                if gemm == "w2" and ("w13", t) not in cr.steps:
                    continue  # its GEMM1 step failed
                g = torch.Generator(device=self.device).manual_seed(t)
                ids, rw = random_topk(t, config.num_experts, config.top_k, g)
                op = step_operands(config, scheme, weights, gemm, t, self.device, ids, rw)
                cr.shapes[gemm] = (op.n, op.kd, op.key)
                bm = cr.steps[("w13", t)].cfg.block_m if gemm == "w2" and not op.w4 else None
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
                    f"{combo.name} {gemm} T={t} pairs={r.pairs}: {fmt_config(r.cfg)} {r.ms:.4f} ms, heuristic "
                    f"{fmt_config(r.heuristic)} {r.heuristic_ms:.4f} ms ({r.speedup:.2f}x); screened "
                    f"{r.screened}/{r.kept} of {r.planned}; rejected {len(r.rejected)}, failed {r.failed}, "
                    f"late {r.late}, cold {r.cold}"
                    + (f"; shipped {fmt_config(r.shipped)} {r.shipped_ms:.4f} ms" if r.shipped else "")
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
    budget left; files go under ``out_dir`` (default: ``env.config_dir()``, the user's). ``workers``:
    compile processes (default: on a GPU min(12, CPUs - 2), else 0). ``timer(cfg, fn, target_ms)
    -> ms`` replaces the GPU timer and ``clock`` the wall clock (tests). ``overrides`` change
    every preset's shape."""
    tokens = sorted({int(t) for t in tokens})
    extra = sorted({int(t) for t in extra_tokens} - set(tokens))
    combos, refused = storable([Combo(p, s, tuple(sorted(overrides.items()))) for p in presets for s in schemes])
    if workers is None:
        workers = min(12, max(1, (os.cpu_count() or 4) - 2)) if device == "cuda" else 0
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
    timer = timer or (_GraphTimer() if device == "cuda" else _no_timer)
    pool = WarmPool(workers)
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
    combos, refused = storable([Combo(p, s) for p in presets for s in schemes])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = _Run(combos, sorted(set(tokens)), (), space=space, device=device, out_dir=None, gpu="", budget_s=None,
               pool=WarmPool(0), timer=_no_timer, clock=time.monotonic, knobs=(8.0, retime_ms, top))  # fmt: skip
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
