#!/usr/bin/env python3
"""Prefill GEMMs on one H100: the persistent TMA kernel against the one-program-per-tile kernel.

    PYTHONPATH=src python3 scripts/kbench_prefill.py --out DIR [--quick] [--budget-s S]
    PYTHONPATH=src python3 scripts/kbench_prefill.py --selftest          (CPU, interpreter, tiny)

Per (model, GEMM, scheme, T): GEMM1 with its activation fused (silu; gpt-oss: interleaved
swigluoai with bias), output bf16; GEMM2 with the router weight (gpt-oss: bias), output bf16.
Schemes bf16, fp8_tensor (w tensor, a tensor), fp8_block (w 128x128, a 1x128 groups). Random
operands on the GPU, uniform random routing.

* old: ``grouped_gemm_launch`` with ``pick_launch_config``'s config (the shipped H100 tables),
  as the experts launch it;
* new: ``persistent_gemm_launch`` over <= 8 configs at T = 4096 (``candidates``: tiles, stages,
  flatten, warp_specialize, A by slot through TMA, and for fp8_block GEMM1 the fp8 + 1x128
  group-scale output), then the best two of those plus a BM-64 tile at the other T. The A by
  slot variants get a slot-ordered copy of A made before timing (what GEMM1's C_SORTED output
  or a gathering quantizer would hand over).

Each variant is checked before it is timed: rows of a few experts against the float64
reference (``grouped_gemm_batched_ref`` per expert), within ``fusedmoe.testing.tolerance``.
Time: ``FlushTimer().median_ms([fn], graph=True)`` (CUDA-graph replay, 512 MiB L2 flush
before each). TFLOP/s = 2 * T*K * N * K_dim / t (N: W rows, 2I for GEMM1). A variant that
fails to compile, run or check is printed in one line and recorded; a lost CUDA context ends
the run with what was measured. Past ``--budget-s`` the remaining cases are recorded as
skipped, so the run always ends with its tables: ``kbench_prefill.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK_TFLOPS = {"bf16": 787.0, "fp8": 1315.0}  # H100 matmul ceilings, peer_times_h100.md (2026-11-25)
FULL_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b")  # what the budget cuts last
QUICK_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
FULL_TOKENS = (4096, 1024, 16384, 256)  # the sweep's T first; the rest reuse its best configs
SCHEMES = ("bf16", "fp8_tensor", "fp8_block")
REF_EXPERTS, REF_ROWS = 4, 8  # checked rows: REF_ROWS pairs of each of REF_EXPERTS experts
TARGET_MS = 40.0  # timed span per variant (FlushTimer: at least 5 replays): ~0.2 s a variant with capture


@dataclass
class Row:
    model: str
    gemm: str
    scheme: str
    t: int
    variant: str
    cfg: str = ""
    ms: float | None = None
    tflops: float | None = None
    pct_peak: float | None = None
    speedup: float | None = None  # old ms / this ms
    err: float | None = None  # relative error vs the float64 reference on the checked rows
    tol: float | None = None
    status: str = "ok"  # ok | check failed | refused: ... | error: ... | skipped: ...


@dataclass
class Op:
    """One GEMM at T tokens, as the layer launches it."""

    gemm: str
    a: object
    a_scale: object
    w: object
    fmt: object
    w_quant: object
    a_quant: object
    bias: object
    route_weights: object
    act: object
    a_div: int
    ids: object  # [T, K] int32
    n: int  # C columns
    n_w: int  # W rows
    kd: int
    e: int
    scheme: object
    routes: dict = field(default_factory=dict)
    ref: tuple | None = None  # (pairs, float64 rows) once checked
    slot_a: dict = field(default_factory=dict)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / ".out"))
    p.add_argument("--quick", action="store_true", help="Qwen3 + Mixtral at T = 4096 only (< 2 min)")
    p.add_argument("--selftest", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting cases after this (default 280/110)")
    p.add_argument("--models", default=None, help="comma-separated preset names (default: by mode)")
    p.add_argument("--tokens", default=None, help="comma-separated T (default: by mode)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {','.join(SCHEMES)}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    if args.selftest:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates: before any import
    sys.path.insert(0, str(ROOT / "src"))
    bench = Bench(args)
    bench.run()
    return 0 if bench.healthy else 1


class Bench:
    def __init__(self, args) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.selftest = args.selftest
        if self.selftest:
            sys.path.insert(0, str(ROOT / "tests"))
            from interpreter_patches import apply  # the interpreter's bf16 dot and casts

            apply()
        self.dev = "cpu" if self.selftest else "cuda"
        self.budget = args.budget_s or (110.0 if args.quick else 280.0)
        self.t0 = time.time()
        self.rows: list[Row] = []
        self.healthy = True
        self.timer = None
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    # ---- plan ------------------------------------------------------------------------------

    def models(self) -> list:
        from fusedmoe.config import MoEConfig
        from fusedmoe.tools.presets import preset_config

        if self.selftest:
            tiny = {
                "tiny": MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128),
                "tiny-oss": MoEConfig(4, 2, 128, 64, activation="swigluoai", has_bias=True, gate_up_interleaved=True),
            }
            names = self.args.models.split(",") if self.args.models else list(tiny)
            return [(n, tiny[n]) for n in names]
        names = self.args.models.split(",") if self.args.models else (QUICK_MODELS if self.args.quick else FULL_MODELS)
        return [(n, preset_config(n)) for n in names]

    def tokens(self) -> tuple[int, ...]:
        if self.args.tokens:
            return tuple(int(t) for t in self.args.tokens.split(","))
        if self.selftest:
            return (16,)
        return (4096,) if self.args.quick else FULL_TOKENS

    # ---- run -------------------------------------------------------------------------------

    def run(self) -> None:
        torch = self.torch
        from fusedmoe.quant import QuantScheme
        from fusedmoe.tools.bench import bench_weights

        if not self.selftest:
            import triton

            from fusedmoe.tools.timing import FlushTimer

            self.timer = FlushTimer()
            self.log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
        self.log(f"models {[n for n, _ in self.models()]} T {self.tokens()} schemes {self.args.schemes}, "
                 f"budget {self.budget:.0f} s")  # fmt: skip
        every = {"bf16": QuantScheme.unquantized(), "fp8_tensor": QuantScheme.fp8_per_tensor(),
                 "fp8_block": QuantScheme.fp8_block()}  # fmt: skip
        schemes = {k: every[k] for k in self.args.schemes.split(",")}
        best: dict = {}  # (model, gemm, scheme) -> the sweep's configs, fastest first
        try:
            for name, config in self.models():
                for sname, scheme in schemes.items():
                    if self.over_budget():
                        self.skip(name, sname, "time budget")
                        continue
                    try:
                        weights = bench_weights(config, scheme, self.dev)
                    except Exception as exc:  # out of memory, say: this model and scheme are skipped
                        self.log(f"{name} {sname} weights: {type(exc).__name__}: {str(exc)[:200]}")
                        self.skip(name, sname, f"weights: {type(exc).__name__}")
                        self.sync()
                        continue
                    for t in self.tokens():
                        for gemm in ("gemm1", "gemm2"):
                            if self.over_budget():
                                self.rows.append(Row(name, gemm, sname, t, "-", status="skipped: time budget"))
                                continue
                            try:
                                self.case(name, config, sname, scheme, weights, gemm, t, best)
                            except _ContextLost:
                                raise
                            except Exception as exc:  # a bug of this script: recorded, the run goes on
                                self.note(Row(name, gemm, sname, t, "case"), exc)
                    del weights
                    if self.dev == "cuda":
                        torch.cuda.empty_cache()
        except _ContextLost as exc:
            self.healthy = False
            self.log(f"CUDA context lost, stopping: {exc}")
        self.write()

    def over_budget(self) -> bool:
        return time.time() - self.t0 > self.budget

    def skip(self, name: str, sname: str, why: str) -> None:
        for t in self.tokens():
            for gemm in ("gemm1", "gemm2"):
                self.rows.append(Row(name, gemm, sname, t, "-", status=f"skipped: {why}"))

    def case(self, name, config, sname, scheme, weights, gemm, t, best) -> None:
        try:
            op = self.operands(config, scheme, weights, gemm, t)
        except Exception as exc:  # operands that do not fit, say
            self.note(Row(name, gemm, sname, t, "operands"), exc)
            return
        old = self.variant(Row(name, gemm, sname, t, "old"), op, self.old_config(op, scheme), old=True)
        key = (name, gemm, sname)
        every = candidates(op, sname, self.selftest)
        if key not in best:  # the sweep
            cands = every
        else:  # its two fastest, the 64-row tiles, the fp8 + group-scale output
            extra = [c for c in every if c[0] in ("bm64", "bm64n128") or c[0].endswith("_g128")]
            cands = best[key][:2] + [c for c in extra if c not in best[key][:2]]
        timed = []
        for label, cfg in cands:
            row = self.variant(Row(name, gemm, sname, t, label), op, (label, cfg), old_ms=old.ms)
            if row.status == "ok" and row.ms is not None and not label.endswith("_g128"):
                timed.append((row.ms, label, cfg))
        if key not in best:
            best[key] = [(lb, c) for _, lb, c in sorted(timed, key=lambda x: x[0])] or cands
        del op

    # ---- operands and configs -------------------------------------------------------------

    def operands(self, config, scheme, weights, gemm, t) -> Op:
        torch = self.torch
        from fusedmoe.kernels.gemm_format import ActEpilogue, GemmFormat
        from fusedmoe.quant import quantize
        from fusedmoe.testing import random_topk

        g = torch.Generator(device=self.dev).manual_seed(t)
        k, e = config.top_k, config.num_experts
        ids, tw = random_topk(t, e, k, g)
        if gemm == "gemm1":
            rows, kd, a_div, tq, wq, w, bias = t, config.hidden_size, k, scheme.a1, scheme.w1, weights.w13, weights.b13
            act, rw = ActEpilogue.of(config), None
        else:
            rows, kd, a_div, tq, wq, w, bias = (
                t * k,
                config.intermediate_size,
                1,
                scheme.a2,
                scheme.w2,
                weights.w2,
                weights.b2,
            )
            act, rw = None, tw.reshape(-1).float()
        x = torch.randn(rows, kd, generator=g, device=self.dev, dtype=torch.bfloat16)
        a, a_scale = x, None
        if tq is not None:
            q = quantize(x, tq)
            a, a_scale = q.data, q.scale
        n_w = w.shape[1]
        n = n_w if act is None else act.out_cols(n_w)
        fmt = GemmFormat.of(wq, tq, n_w, kd)
        return Op(gemm, a, a_scale, w, fmt, wq, tq, bias, rw, act, a_div, ids.int(), n, n_w, kd, e, scheme)

    def old_config(self, op: Op, scheme):
        from fusedmoe.kernels.gemm_format import scheme_key
        from fusedmoe.kernels.launch_config import fit_launch_config, gated_act_config, pick_launch_config

        cfg = pick_launch_config(op.ids.numel(), op.e, op.n_w, op.kd, scheme_key(op.w_quant, op.a_quant))
        if op.act is not None and op.act.activation.is_gated:
            cfg = gated_act_config(cfg)
        return ("old", fit_launch_config(cfg, op.fmt.k_group, strict=op.fmt.native))

    def routing(self, op: Op, bm: int):
        from fusedmoe.kernels.align import moe_align

        if bm not in op.routes:
            op.routes[bm] = moe_align(op.ids, op.e, bm)
        return op.routes[bm]

    def by_slot(self, op: Op, r):
        """A (and its row scales) in slot order: what GEMM1's C_SORTED output / a gather gives."""
        if r.block_m not in op.slot_a:
            src = (r.sorted_ids.long() // op.a_div).clamp(max=op.a.shape[0] - 1)  # padding: any row
            s = op.a_scale
            op.slot_a[r.block_m] = (op.a[src].contiguous(), s if s is None or s.shape[0] == 1 else s[src].contiguous())
        return op.slot_a[r.block_m]

    # ---- one variant: launch, check, time -------------------------------------------------

    def variant(self, row: Row, op: Op, labelled, old: bool = False, old_ms: float | None = None) -> Row:
        label, cfg = labelled
        row.cfg = _short(cfg)
        self.rows.append(row)
        try:
            fn, read, group = self.launcher(op, cfg, label, old)
            if fn is None:
                row.status = f"refused: {read}"
                self.log(f"{_where(row)} {row.variant}: {row.status}")
                return row
            fn()
            self.sync()
            row.err, row.tol = self.check(op, read, group)
            if row.err > row.tol:
                row.status = "check failed"
            if self.timer is not None:
                row.ms = self.timer.median_ms([fn], graph=True, target_ms=TARGET_MS)[0]
                flops = 2.0 * op.ids.numel() * op.n_w * op.kd
                row.tflops = flops / (row.ms * 1e-3) / 1e12
                row.pct_peak = 100.0 * row.tflops / PEAK_TFLOPS["bf16" if row.scheme == "bf16" else "fp8"]
                if old_ms:
                    row.speedup = old_ms / row.ms
        except _ContextLost:
            raise
        except Exception as exc:
            self.note(row, exc)
            return row
        ms = "-" if row.ms is None else f"{row.ms:.4f} ms {row.tflops:.0f} TFLOP/s"
        sp = "" if row.speedup is None else f" x{row.speedup:.2f}"
        self.log(f"{_where(row)} {row.variant:>14} {row.cfg:<34} {ms}{sp} err {row.err:.2e} {row.status}")
        return row

    def note(self, row: Row, exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        row.status = f"error: {msg}"
        if row not in self.rows:
            self.rows.append(row)
        self.log(f"{_where(row)} {row.variant}: {msg}")
        self.sync()

    def sync(self) -> None:
        if self.dev == "cuda":
            try:
                self.torch.cuda.synchronize()
            except Exception as exc:  # an illegal access poisons the context for good
                raise _ContextLost(f"{type(exc).__name__}: {str(exc)[:200]}") from exc

    def launcher(self, op: Op, cfg, label: str, old: bool):
        """(fn, read, group): a launch of ``cfg`` into a fresh output, how to read its checked
        rows as values, whether they are fp8 group codes; (None, why, _) where the persistent
        kernel refuses."""
        torch = self.torch
        from fusedmoe.kernels.gemm_format import GemmCall
        from fusedmoe.kernels.grouped_gemm import grouped_gemm_launch
        from fusedmoe.kernels.grouped_gemm_persistent import (
            GroupQuantEpilogue,
            persistent_gemm_launch,
            supports,
        )
        from fusedmoe.quant import Granularity, Operand, QDtype, QTensor, TensorQuant

        r = self.routing(op, cfg.block_m)
        pairs = op.ids.numel()
        act, a, a_scale = op.act, op.a, op.a_scale
        group = label.endswith("_g128")  # a2 as fp8 codes + 1x128 scales from the epilogue
        if group:
            g128 = TensorQuant(QDtype.FP8, Granularity.group(128), dynamic=True)
            act = GroupQuantEpilogue(**{**asdict(op.act), "quant": g128})
        if label.startswith("sorted"):
            a, a_scale = self.by_slot(op, r)
        out = torch.empty(pairs, op.n, dtype=torch.float8_e4m3fn if group else torch.bfloat16, device=self.dev)
        scales = torch.empty(pairs, -(-op.n // 128), device=self.dev) if group else None
        call = GemmCall(r, a_div=op.a_div, bias=op.bias, route_weights=op.route_weights, act=act, act_scale=scales)
        a_op = Operand(QTensor(a, (*a.shape[:-1], op.kd), scale=a_scale), op.a_quant)
        w_op = Operand(op.w, op.w_quant)
        if old:
            launch = grouped_gemm_launch
        else:
            why = supports(op.fmt, act, a=a, w=op.w, c=out, cfg=cfg, routing=r)
            if why is not None:
                return None, why, group
            launch = persistent_gemm_launch

        def fn():
            launch(a_op, w_op, out, op.fmt, cfg, call)

        def read(p):
            if not group:
                return out[p].double()
            return out[p].double() * scales[p].double().repeat_interleave(128, dim=-1)[:, : op.n]

        return fn, read, group

    def reference(self, op: Op):
        """(pairs, float64 rows): REF_ROWS pairs of each of REF_EXPERTS experts, from the library's
        reference one expert at a time (a whole float64 W of DeepSeek-V3 would be 60 GB); once per op."""
        if op.ref is None:
            torch = self.torch
            from fusedmoe.kernels.grouped_gemm import grouped_gemm_batched_ref
            from fusedmoe.quant import Operand, QTensor

            flat = op.ids.reshape(-1).long()
            pairs, rows_ref = [], []
            for e in torch.unique(flat)[:REF_EXPERTS].tolist():
                p = (flat == e).nonzero().reshape(-1)[:REF_ROWS]
                rows = p // op.a_div
                s = op.a_scale
                s = s if s is None or s.shape[0] == 1 else s[rows][None]
                qa = QTensor(op.a[rows][None], (1, p.numel(), op.kd), scale=s)
                ref = grouped_gemm_batched_ref(
                    Operand(qa, op.a_quant), Operand(op.w.select(e), op.w_quant),
                    torch.tensor([p.numel()], dtype=torch.int32, device=self.dev), act=op.act,
                    bias=None if op.bias is None else op.bias[e : e + 1],
                    row_weights=None if op.route_weights is None else op.route_weights[p][None],
                )[0]  # fmt: skip
                pairs.append(p)
                rows_ref.append(ref)
            op.ref = (torch.cat(pairs), torch.cat(rows_ref))
        return op.ref

    def check(self, op: Op, read, group: bool) -> tuple[float, float]:
        """Relative error of ``read``'s checked rows against the reference (fp8 group codes: against
        the reference's own codes), and the scheme's tolerance."""
        from fusedmoe.quant import fake_quantize
        from fusedmoe.testing import rel_error, tolerance

        pairs, want = self.reference(op)
        if group:
            want = fake_quantize(want, _G128())
        return rel_error(read(pairs), want), tolerance(op.scheme, self.torch.bfloat16)  # inf where NaN/Inf

    # ---- results ---------------------------------------------------------------------------

    def write(self) -> None:
        data = {"meta": self.meta(), "rows": [asdict(r) for r in self.rows]}
        (self.out / "kbench_prefill.json").write_text(json.dumps(data, indent=1))
        md = self.markdown()
        (self.out / "kbench_prefill.md").write_text(md)
        self.log(f"wrote {self.out}/kbench_prefill.json and .md")
        print(md, flush=True)

    def meta(self) -> dict:
        meta = {"selftest": self.selftest, "wall_s": round(time.time() - self.t0, 1), "budget_s": self.budget}
        try:
            import triton

            meta.update(torch=self.torch.__version__, triton=triton.__version__)
            if self.dev == "cuda":
                meta["gpu"] = self.torch.cuda.get_device_name()
        except Exception:  # metadata only
            pass
        return meta

    def markdown(self) -> str:
        """One line per case: the old kernel, the fastest checked new variant, the speedup."""
        cases: dict = {}
        for r in self.rows:
            cases.setdefault((r.model, r.gemm, r.scheme, r.t), []).append(r)
        lines = [
            f"# kbench_prefill ({self.meta().get('gpu', 'CPU selftest')}, {self.meta()['wall_s']} s)",
            "",
            "| model | gemm | scheme | T | old ms | old TFLOP/s | new ms | new TFLOP/s | % peak | speedup | best new "
            "| err | fp8+g128 out ms | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (m, g, s, t), rs in cases.items():
            old = next((r for r in rs if r.variant == "old"), None)
            new = [r for r in rs if r.variant not in ("old", "-", "operands") and r.status == "ok"]
            g128 = next((r for r in new if r.variant.endswith("_g128")), None)  # fp8 out: not like for like
            new = [r for r in new if r is not g128]
            fast = min((r for r in new if r.ms is not None), key=lambda r: r.ms, default=new[0] if new else None)
            bad = [r.variant for r in rs if r.status not in ("ok",) and not r.status.startswith("refused")]
            lines.append(
                f"| {m} | {g} | {s} | {t} | {_f(old and old.ms, 3)} | {_f(old and old.tflops, 0)} | "
                f"{_f(fast and fast.ms, 3)} | {_f(fast and fast.tflops, 0)} | {_f(fast and fast.pct_peak, 0)} | "
                f"{_f(fast and fast.speedup, 2)} | {fast.variant + ' ' + fast.cfg if fast else '-'} | "
                f"{_f(fast and fast.err, 1, 'e')} | {_f(g128 and g128.ms, 3)} | {','.join(bad) or '-'} |"
            )
        failed = [r for r in self.rows if r.status.startswith(("error", "check"))]
        if failed:
            lines += ["", "Failures:", ""] + [f"- {_where(r)} {r.variant} {r.cfg}: {r.status}" for r in failed]
        return "\n".join(lines) + "\n"


class _ContextLost(RuntimeError):
    pass


def _G128():
    from fusedmoe.quant import Granularity, QDtype, TensorQuant

    return TensorQuant(QDtype.FP8, Granularity.group(128), dynamic=True)


# Base tile per scheme: (BM, accumulator columns, BK, warps, stages), from offline sm_90 compiles
# (tests/kernels/sm90_compile.py): bf16 128 x 256 took 207-255 registers and 144 KiB of shared memory;
# fp8 tensor 255 registers; fp8 block keeps a per-K partial product beside the accumulator, and
# 128 x 256 spilled 344-536 bytes where 128 x 128 spilled none.
_BASES = {"bf16": (128, 256, 64, 8, 3), "fp8_tensor": (128, 256, 128, 8, 3), "fp8_block": (128, 128, 128, 8, 4)}


def candidates(op: Op, sname: str, selftest: bool) -> list:
    """<= 8 persistent configs: the scheme's base tile; its other stage count; without the flattened
    loop; A by slot through TMA (warp specialization is declined: wrong results on an H100); half
    the columns; 64-row tiles for fewer rows per expert (last: the other T keep them; for fp8_block
    also 64 x 128, one weight block per step); for fp8_block GEMM1 the fp8 + 1x128 group-scale
    output (64 x 128 output columns: a piece must hold whole groups).
    Under a gated activation BN counts output columns, each reading a gate and an up W row."""
    from fusedmoe.kernels.launch_config import LaunchConfig, fit_launch_config

    bm, width, bk, warps, stages = _BASES[sname]
    gated = op.act is not None and op.act.activation.is_gated

    def cfg(bm_, width_, warps_, stages_, **kw):
        return LaunchConfig(bm_, width_ // 2 if gated else width_, bk, 8, warps_, stages_, persistent=True, **kw)

    base = cfg(bm, width, warps, stages)
    out = [
        ("big", base),
        (f"big_s{7 - stages}", replace(base, num_stages=7 - stages)),
        ("big_noflat", replace(base, flatten=False)),
        ("sorted", base),
        ("mid", cfg(128, width // 2, 8, 4)),
    ]
    if sname == "fp8_block":
        out.append(("bm64n128", cfg(64, 128, 4, 4)))  # one 128 x 128 weight block per tile and K step
    if sname == "fp8_block" and op.gemm == "gemm1":
        out.append(("bm64_g128", cfg(64, 256, 8, 4)))
    out.append(("bm64", cfg(64, 256, 4 if sname != "fp8_block" else 8, 4)))
    return [(lb, fit_launch_config(c, op.fmt.k_group, strict=op.fmt.native)) for lb, c in out]


def _short(cfg) -> str:
    s = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
    if cfg.persistent:  # p, then f: flattened loops (off under warp specialization), W: specialized, /2: subtiled
        flat = cfg.flatten and not cfg.warp_specialize
        s += f" p{'f' if flat else ''}{'W' if cfg.warp_specialize else ''}{'/2' if cfg.epilogue_subtile == 2 else ''}"
    return s


def _where(r: Row) -> str:
    return f"{r.model} {r.gemm} {r.scheme} T={r.t}"


def _f(v, digits: int, kind: str = "f") -> str:
    return "-" if v is None else f"{v:.{digits}{kind}}"


if __name__ == "__main__":
    sys.exit(main())
