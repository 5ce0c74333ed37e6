"""Kernel benchmark of the w4 grouped GEMM (``kernels/grouped_gemm_w4.py``) against the reference kernel.

    python3 scripts/kbench_w4.py --out DIR [--quick] [--selftest] [--budget-s S]

Per cell (preset x scheme x GEMM x T): random weights quantized with ``fusedmoe.quant.quantize``
(the reference layout, then ``to_w4``), uniform random top-k routing, bf16 activations;

- ``old``: the reference kernel with the config the layer picks (``pick_launch_config``: the
  shipped tuned JSON, BN halved for the fused activation), as ``experts/triton.py`` calls it;
- ``new:<name>``: the w4 kernel, up to 8 launch configs (tile, ``w_major``, ``split_k``);
- GEMM1 = W13 with the fused activation (silu; gpt-oss swigluoai, interleaved, biases),
  GEMM2 = W2 with the router weight, *plus moe_sum* (a split-K GEMM2 hands its partials to
  moe_sum, so both sides include the sum over top-k);
- correctness: every variant's rows of up to 3 experts against the float64 reference (from
  the reference-layout weights), relative error vs ``fusedmoe.testing.tolerance``;
- time: ``FlushTimer().median_ms([fn], graph=True)`` (CUDA-graph replays, L2 flushed before
  each); GB/s of the weight bytes of the experts hit, TFLOP/s, speedup vs ``old``.

Every compile or run failure is caught and recorded (one line) and the run goes on. Writes
``kbench_w4.json`` and ``kbench_w4.md`` under DIR; the compact table is printed last.
``--selftest``: the whole script at a tiny shape on the CPU under the Triton interpreter
(correctness only, no timing), to catch mistakes before a GPU run. ``--variants`` times named
configs (``parse_variants``: explicit, or the cell's default with fields replaced, each with
environment variables set around its launch) instead of the built-in ones; ``--skip-old`` leaves
the reference kernel out and ``--gemms`` picks GEMMs: one device call then A/B-tests a lab switch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

if "--selftest" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates: before fusedmoe imports
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from fusedmoe.config import Activation  # noqa: E402
from fusedmoe.kernels._grouped_gemm_w4 import _w4_gemm_kernel  # noqa: E402
from fusedmoe.kernels.align import moe_align  # noqa: E402
from fusedmoe.kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat, scheme_key
from fusedmoe.kernels.grouped_gemm import grouped_gemm
from fusedmoe.kernels.grouped_gemm_w4 import fit_w4_config, w4_gemm_launch, w4_launch_config  # noqa: E402
from fusedmoe.kernels.launch_config import LaunchConfig, gated_act_config, pick_launch_config  # noqa: E402
from fusedmoe.kernels.moe_sum import moe_sum  # noqa: E402
from fusedmoe.quant import Operand, QuantScheme, dequantize, quantize  # noqa: E402
from fusedmoe.quant.scheme import shape_supported  # noqa: E402
from fusedmoe.quant.w4_layout import to_w4  # noqa: E402
from fusedmoe.testing import random_topk, rel_error, tolerance  # noqa: E402
from fusedmoe.weights import random_g_idx  # noqa: E402

# E, top-k, H, I, activation, interleaved gate/up, biases
PRESETS = {
    "mixtral": (8, 2, 4096, 14336, Activation.SILU, False, False),
    "qwen3": (128, 8, 2048, 768, Activation.SILU, False, False),
    "gptoss": (32, 4, 2880, 2880, Activation.SWIGLUOAI, True, True),
    "tiny": (5, 2, 128, 128, Activation.SILU, False, True),  # --selftest
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
MAIN_SCHEMES = ("int4_g128", "mxfp4")
EXTRA_SCHEMES = ("nvfp4_w4a16", "int4_g128_zp", "int4_g128_actorder")  # the 1.1x / 1.15x targets


@dataclass
class Result:
    preset: str
    scheme: str
    gemm: str
    tokens: int
    variant: str
    config: str
    us: float | None
    err: float | None
    tol: float
    gbs: float | None
    tflops: float | None
    speedup: float | None
    note: str = ""


def cfg_str(c: LaunchConfig) -> str:
    return f"{c.block_m},{c.block_n},{c.block_k},{c.group_m},{c.num_warps},{c.num_stages},{c.split_k},{c.w_major}"


def variants(gemm: str, rows: float, dflt: LaunchConfig, w_fmt: str) -> list[tuple[str, LaunchConfig, bool, bool]]:
    """Named w4 configs for a GEMM at ``rows`` routed rows per expert: the heuristic's pick
    (``dflt``) and up to 4 alternatives measured close to it on an H100, plus, for the e2m1
    formats, the pick on the layout with twice the default pack block (``alt`` True: halves of
    more scale groups, fewer and longer dots and FMA steps). BN counts C's columns (a gated
    GEMM1's BN 64 reads as many W rows as GEMM2's BN 128). Each entry: (name, config, alt,
    portable); ``portable``: the pick again with ``FUSEDMOE_W4_PTX=0`` (the fp32 unpack), to
    measure the PTX unpack (``kernels/_w4_unpack.py``) against it in the same run."""
    L = LaunchConfig
    g1 = gemm == "gemm1"
    if rows <= 0.5:  # decode: one row per expert hit
        alts = [("fma1_nb1", replace(dflt, block_k=64)), ("fma1_bn16", L(1, 16, 256, 1, 4, 4, 1, 1))]
        alts += [("fma1_bn64", L(1, 64, 256, 1, 4, 4, 1, 1))]
        alts += [("dot16_bn32", L(16, 32, 128, 1, 4, 4, 1, 0))] if g1 else [("fma1_bn32", L(1, 32, 256, 1, 4, 4, 1, 1))]
        if not g1:
            alts += [("fma1_bn32_s2", L(1, 32, 256, 1, 4, 4, 2, 1)), ("fma1_bn64_s4", L(1, 64, 256, 1, 4, 4, 4, 1))]
    elif rows <= 16:
        alts = [("swap16_bn64", L(16, 64, 128, 1, 4, 4, 1, 1)), ("dot16_bn64", L(16, 64, 128, 1, 4, 4, 1, 0))]
        alts += [("dot16_bn32", L(16, 32, 128, 1, 4, 4, 1, 0)), ("dot32_bn64", L(32, 64, 128, 1, 4, 4, 1, 0))]
    elif rows <= 160:
        alts = [("swap64_bn64", L(64, 64, 128, 8, 4, 4, 1, 1)), ("swap32_bn64", L(32, 64, 128, 4, 4, 4, 1, 1))]
        alts += [("dot32_bn64", L(32, 64, 128, 4, 4, 4, 1, 0)), ("swap64_bn128", L(64, 128, 128, 8, 8, 3, 1, 1))]
    elif g1:
        alts = [("swap128_bn128", L(128, 128, 128, 8, 8, 3, 1, 1)), ("swap128_bn64_w4", L(128, 64, 128, 8, 4, 3, 1, 1))]
        alts += [("swap64_bn64_w4", L(64, 64, 128, 8, 4, 3, 1, 1))]
    else:
        alts = [("swap256_bn128", L(256, 128, 128, 8, 8, 3, 1, 1)), ("swap128_bn128", L(128, 128, 128, 8, 8, 3, 1, 1))]
        alts += [("swap256_bn128_g16", L(256, 128, 128, 16, 8, 3, 1, 1))]
    out = [("default", dflt, False, False)] + [(n, c, False, False) for n, c in alts if cfg_str(c) != cfg_str(dflt)][:4]
    if dflt.block_m >= 16:
        out.append(("portable_default", dflt, False, True))
    if w_fmt in ("mxfp4", "nvfp4"):
        out.append(("pk2x_default", dflt, True, False))
    return out


def _with_env(fn, env: dict[str, str]):
    """``fn`` launching with the variables ``env`` set (the w4 launch reads them when it launches:
    graph capture records what they chose), restored after."""

    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fn()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    return run


def parse_variants(text: str) -> list[tuple[str, LaunchConfig | dict, dict[str, str]]]:
    """``--variants``: ``name=BM,BN,BK,GM,W,S,SK,WM[+VAR=V...]`` entries separated by ``;``;
    ``default[:field=v...]`` in place of the numbers is the cell's default config with those
    LaunchConfig fields replaced (a dict of them)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            name, spec = item.split("=", 1)
            cfg_text, *envs = spec.split("+")
            if cfg_text.startswith("default"):
                cfg = {k: int(v) for k, v in (f.split("=") for f in cfg_text.split(":")[1:])}
                replace(LaunchConfig(16, 64, 128, 1, 4, 3), **cfg)  # unknown fields fail here
            else:
                bm, bn, bk, gm, nw, ns, sk, wm = (int(v) for v in cfg_text.split(","))
                cfg = replace(LaunchConfig(bm, bn, bk, gm, nw, ns), split_k=sk, w_major=wm)
            env = dict(e.split("=", 1) for e in envs)
        except (ValueError, TypeError) as ex:
            want = "NAME=BM,BN,BK,GM,W,S,SK,WM[+VAR=V...] or NAME=default[:field=v...][+VAR=V...]"
            raise SystemExit(f"--variants: expected {want}, got {item!r} ({ex})") from None
        out.append((name, cfg, env))
    return out


class Weights:
    """One GEMM's weights of a (preset, scheme): the reference layout, the w4 layout, biases."""

    def __init__(self, preset: str, scheme: QuantScheme, gemm: str, dev: str, gen: torch.Generator):
        e, k, h, i, act, inter, has_bias = PRESETS[preset]
        self.preset, self.e, self.k, self.h, self.i, self.gemm, self.scheme = preset, e, k, h, i, gemm, scheme
        tq = scheme.w1
        self.n_w, self.kd = (2 * i, h) if gemm == "gemm1" else (h, i)
        self.n_out = i if gemm == "gemm1" else h
        w = torch.randn(e, self.n_w, self.kd, device=dev, generator=gen) * self.kd**-0.5
        g_idx = random_g_idx(e, self.kd, tq.granularity.group_size, dev) if tq.act_order else None
        self.q = quantize(w, tq, g_idx=g_idx)
        del w
        self.w4 = to_w4(self.q, tq)
        self.w4_alt = None  # e2m1: twice the default pack block (halves of more scale groups)
        if tq.dtype.value in ("mxfp4", "nvfp4"):
            self.w4_alt = to_w4(self.q, tq, 2 * self.w4.pack_block)
        self.bias = None
        if has_bias:
            self.bias = (torch.randn(e, self.n_w, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
        self.ep = ActEpilogue(act, gate_up_interleaved=inter) if gemm == "gemm1" else None
        self.fmt = GemmFormat.of(tq, None, self.n_w, self.kd, self.q.zero is not None)


class Cell:
    """One T of a GEMM: inputs, routing (per BM), the old and new launches, the reference rows."""

    def __init__(self, wts: Weights, t: int, dev: str, gen: torch.Generator):
        self.__dict__.update({k: getattr(wts, k) for k in ("e", "k", "h", "i", "gemm", "scheme", "n_w", "kd")})
        self.__dict__.update({k: getattr(wts, k) for k in ("n_out", "q", "w4", "w4_alt", "bias", "ep", "fmt")})
        self.t, self.dev = t, dev
        self.ids, self.tw = random_topk(t, self.e, self.k, gen)
        self.ids, self.tw = self.ids.to(dev), self.tw.to(dev)
        rows = t if self.gemm == "gemm1" else t * self.k
        self.x = torch.randn(rows, self.kd, device=dev, generator=gen).to(torch.bfloat16)
        self._routing: dict[int, object] = {}
        self.hit = int(torch.unique(self.ids).numel())
        self.weight_bytes = self.w4.nbytes / self.e * self.hit
        self.flops = 2.0 * t * self.k * self.n_w * self.kd

    def routing(self, bm: int):
        if bm not in self._routing:
            self._routing[bm] = moe_align(self.ids, self.e, bm)
        return self._routing[bm]

    def old_config(self) -> LaunchConfig:
        """What experts/triton.py picks: GEMM1's config drives moe_align's BM for both GEMMs."""
        key = scheme_key(self.scheme.w1, None)
        pairs = self.t * self.k
        c1 = pick_launch_config(pairs, self.e, 2 * self.i, self.h, key)
        if self.gemm == "gemm1":
            return gated_act_config(c1)
        c2 = pick_launch_config(pairs, self.e, self.n_w, self.kd, key)
        return replace(c2, block_m=c1.block_m)

    def run_old(self, out: torch.Tensor, y_sum: torch.Tensor):
        cfg = self.old_config()
        r = self.routing(cfg.block_m)
        a, w, kw = Operand.of(self.x), Operand(self.q, self.scheme.w1), dict(bias=self.bias, config=cfg)
        if self.gemm == "gemm1":
            return lambda: grouped_gemm(a, w, r, a_div=self.k, act=self.ep, out=out, **kw)

        def fn():
            grouped_gemm(a, w, r, topk_weights=self.tw, out=out, **kw)
            moe_sum(out.view(self.t, self.k, -1), y_sum)

        return fn

    def run_new(self, cfg: LaunchConfig, out: torch.Tensor, y_sum: torch.Tensor, partials, alt: bool = False):
        r = self.routing(cfg.block_m)
        w4 = Operand(self.w4_alt if alt else self.w4, self.scheme.w1)
        x = Operand.of(self.x)
        if self.gemm == "gemm1":
            call = GemmCall(r, a_div=self.k, bias=self.bias, act=self.ep)
            return lambda: w4_gemm_launch(x, w4, out, self.fmt, cfg, call, partials=partials)
        call = GemmCall(r, bias=self.bias, route_weights=self.tw.reshape(-1))

        def fn():
            p = w4_gemm_launch(x, w4, out, self.fmt, cfg, call, partials=partials, reduce=False)
            moe_sum(out.view(self.t, self.k, -1) if p is None else p.view(-1, self.t, self.k, self.n_w), y_sum)

        return fn

    def reference_rows(self, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pair ids, float64 rows of C) for the pairs of up to 3 experts hit, <= 16 pairs each."""
        flat = self.ids.reshape(-1).long()
        rows, refs = [], []
        for e in torch.unique(flat)[:3].tolist():
            pairs = (flat == e).nonzero().reshape(-1)[:16]
            wd = dequantize(self.q.select(e), self.scheme.w1, torch.float64)[0]
            a = self.x.double()[pairs // (self.k if self.gemm == "gemm1" else 1)]
            y = a @ wd.T
            if self.bias is not None:
                y = y + self.bias[e].double()
            if self.ep is not None:
                from fusedmoe.activations import apply_activation

                y = apply_activation(y, self.ep)
            else:
                y = y * self.tw.reshape(-1)[pairs].double()[:, None]
            rows.append(pairs)
            refs.append(y)
        return torch.cat(rows), torch.cat(refs)


def _compiled() -> dict[int, object]:
    """The w4 kernel's compiled variants so far (Triton's per-device cache; best effort)."""
    out = {}
    try:
        for caches in _w4_gemm_kernel.device_caches.values():
            out.update({id(k): k for k in caches[0].values()})
    except Exception:
        pass
    return out


def _ir(kernels: list) -> str:
    """Registers, spills and a few TTGIR op counts of newly compiled kernels: whether loads are
    pipelined (async copies), which MMA is used, how many layout conversions remain."""
    parts = []
    for k in kernels:
        try:
            ir = k.asm.get("ttgir", "")
            ops = {"async": "async_copy_global_to_local", "wgmma": "warp_group_dot", "mma2": "tt.dot "}
            ops["cvt"] = "convert_layout"
            counts = " ".join(f"{n}={ir.count(pat)}" for n, pat in ops.items())
            parts.append(f"regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} {counts}")
        except Exception as ex:
            parts.append(f"ir? {type(ex).__name__}")
    return "; ".join(parts)


def measure(fn, timer, selftest: bool) -> float | None:
    if selftest:
        fn()
        return None
    ms, _ = timer.median_ms([fn], graph=True, target_ms=40.0, max_reps=200)
    return ms * 1e3


def bench_cell(
    cell: Cell,
    preset: str,
    timer,
    selftest: bool,
    failures: list[str],
    custom: list | None = None,
    skip_old: bool = False,
) -> list[Result]:
    """Time the old kernel and the w4 variants of one cell; check each against the reference."""
    res: list[Result] = []
    dev, t, k = cell.dev, cell.t, cell.k
    out = torch.empty(t * k, cell.n_out, dtype=torch.bfloat16, device=dev)
    y_sum = torch.empty(t, cell.n_out, dtype=torch.bfloat16, device=dev)
    pairs_ref, ref = cell.reference_rows(1)
    tol = tolerance(cell.scheme, torch.bfloat16)
    rows = t * k / cell.e
    gated = cell.gemm == "gemm1"
    dflt = w4_launch_config(t * k, cell.e, cell.n_w, cell.kd, cell.w4, gated=gated)
    if gated:
        dflt = gated_act_config(dflt)
    jobs = [] if skip_old else [("old", cell.old_config(), None, False, {})]
    if custom:
        for n, c, env in custom:
            c = fit_w4_config(replace(dflt, **c) if isinstance(c, dict) else c, cell.w4)
            jobs.append((f"new:{n}", c, c, False, env))
    else:
        for n, c, alt, portable in variants(cell.gemm, rows, dflt, cell.w4.w_fmt):
            c = fit_w4_config(c, cell.w4_alt if alt else cell.w4)
            jobs.append((f"new:{n}", c, c, alt, {"FUSEDMOE_W4_PTX": "0"} if portable else {}))
    base_us = None
    for name, cfg, new_cfg, alt, env in jobs:
        tag = f"{preset} {cell.scheme.name} {cell.gemm} T={t} {name} [{cfg_str(cfg)}]"
        try:
            partials = None
            if new_cfg is not None and new_cfg.split_k > 1:
                partials = torch.empty(new_cfg.split_k * t * k * cell.n_w, dtype=torch.float32, device=dev)
            fn = cell.run_old(out, y_sum) if new_cfg is None else cell.run_new(new_cfg, out, y_sum, partials, alt)
            fn = _with_env(fn, env) if env else fn
            out.fill_(float("nan"))
            seen = _compiled()
            fn()
            ir = _ir([k for i, k in _compiled().items() if i not in seen])
            got = _result_rows(cell, out, partials, new_cfg, pairs_ref)
            err = rel_error(got, ref)
            us = measure(fn, timer, selftest)
        except Exception as ex:  # a compile or run failure: recorded, the run goes on
            line = f"{tag}: {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"[:300]
            failures.append(line)
            print("  FAIL", line, flush=True)
            if os.environ.get("KBENCH_TRACE"):
                traceback.print_exc()
            continue
        if name == "old":
            base_us = us
        note = ("" if err <= tol else "ERR>tol") + (f" [{ir}]" if ir else "")
        r = Result(
            preset, cell.scheme.name, cell.gemm, t, name, cfg_str(cfg), us, err, tol,
            None if us is None else cell.weight_bytes / us / 1e3,
            None if us is None else cell.flops / us / 1e6,
            None if (us is None or base_us is None) else base_us / us,
            note,
        )  # fmt: skip
        res.append(r)
        print(f"  {tag}: {'-' if us is None else f'{us:.1f} us'} err {err:.2e} {note}", flush=True)
    return res


def _result_rows(cell: Cell, out, partials, cfg, pairs) -> torch.Tensor:
    """The checked rows of C: ``out``, or for a split GEMM2 the sum of its partials."""
    if cell.gemm == "gemm2" and cfg is not None and cfg.split_k > 1:
        p = partials[: cfg.split_k * cell.t * cell.k * cell.n_w].view(cfg.split_k, -1, cell.n_w)
        return p.double().sum(0)[pairs]
    return out.double()[pairs]


def plan(quick: bool, selftest: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(preset, scheme, token counts) in the order they run: the T = 1 and 4096 cells first
    within each, the targets' extra schemes right after their preset's main ones."""
    if selftest:  # every regime of ``variants`` (decode, <= 16, <= 160 and more rows per expert)
        return [("tiny", s, (1, 12, 100, 300)) for s in MAIN_SCHEMES] + [("tiny", s, (1,)) for s in EXTRA_SCHEMES]
    tokens = (1, 4096) if quick else (1, 4096, 16, 256, 64, 1024)
    out = []
    for p in ("mixtral", "qwen3") if quick else ("mixtral", "qwen3", "gptoss"):
        e, k, h, i, *_ = PRESETS[p]
        out += [(p, s, tokens) for s in MAIN_SCHEMES if shape_supported(QuantScheme.by_name(s), h, i) is None]
        if p == "qwen3" and not quick:
            out += [(p, s, (1, 4096)) for s in EXTRA_SCHEMES]
    return out


def write(out_dir: str, results: list[Result], failures: list[str], meta: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kbench_w4.json"), "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results], "failures": failures}, f, indent=1)
    lines = [f"# w4 kernel bench ({meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')})", ""]
    lines += ["Best new variant per cell vs the reference kernel (old), GEMM2 includes moe_sum.", ""]
    lines += ["| preset | scheme | gemm | T | old us | best new | config | us | GB/s | TFLOP/s | speedup | err |"]
    lines += ["|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple, list[Result]] = {}
    for r in results:
        cells.setdefault((r.preset, r.scheme, r.gemm, r.tokens), []).append(r)
    for key, rs in cells.items():
        old = next((r for r in rs if r.variant == "old"), None)
        new = [r for r in rs if r.variant != "old" and "ERR" not in r.note]
        best = min(new, key=lambda r: r.us if r.us is not None else 0.0, default=None)
        o = "-" if old is None or old.us is None else f"{old.us:.1f}"
        if best is None:
            lines.append(f"| {' | '.join(map(str, key))} | {o} | (none) | | | | | | |")
            continue
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(
            f"| {' | '.join(map(str, key))} | {o} | {best.variant[4:]} | {best.config} | {f(best.us, '.1f')} | "
            f"{f(best.gbs, '.0f')} | {f(best.tflops, '.1f')} | {f(best.speedup, '.2f')} | {best.err:.1e} |"
        )
    lines += ["", f"Failures ({len(failures)}):", ""] + [f"- {x}" for x in failures]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "kbench_w4.md"), "w") as f:
        f.write(text)
        f.write("\n## Every variant\n\n| preset | scheme | gemm | T | variant | config | us | err | speedup |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in results:
            us = "-" if r.us is None else f"{r.us:.1f}"
            sp = "-" if r.speedup is None else f"{r.speedup:.2f}"
            f.write(f"| {r.preset} | {r.scheme} | {r.gemm} | {r.tokens} | {r.variant} | {r.config} | {us} | ")
            f.write(f"{r.err:.1e} {r.note} | {sp} |\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="Mixtral + Qwen3 at T 1 and 4096")
    ap.add_argument("--selftest", action="store_true", help="tiny shapes on the CPU, interpreter, no timing")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting cells after this many seconds")
    ap.add_argument("--only", default="", help="comma-separated presets to keep (debugging)")
    ap.add_argument("--schemes", default="", help="comma-separated schemes to keep")
    ap.add_argument("--tokens", default="", help="comma-separated token counts to keep")
    ap.add_argument("--variants", default="", help="w4 configs to time instead of the built-in ones (parse_variants)")
    ap.add_argument("--skip-old", action="store_true", help="do not time the reference kernel")
    ap.add_argument("--gemms", default="gemm1,gemm2", help="comma-separated GEMMs to run")
    args = ap.parse_args()
    selftest = args.selftest
    dev = "cpu" if selftest else "cuda"
    budget = args.budget_s or (1e9 if selftest else (100.0 if args.quick else 280.0))
    import triton

    meta = {
        "device": "cpu (interpreter)" if selftest else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "args": sys.argv[1:],
    }
    print(meta, flush=True)
    timer = None
    if not selftest:
        try:
            from fusedmoe.tools.timing import FlushTimer
        except ImportError:  # moved in the package's reorganisation
            from fusedmoe.tools.timing import FlushTimer

        timer = FlushTimer()
    results: list[Result] = []
    failures: list[str] = []
    start = time.time()
    gen = torch.Generator(device=dev).manual_seed(0)
    cells = plan(args.quick, selftest)
    if args.only:
        cells = [c for c in cells if c[0] in args.only.split(",")]
    if args.schemes:
        cells = [c for c in cells if c[1] in args.schemes.split(",")]
    if args.tokens:
        keep = {int(t) for t in args.tokens.split(",")}
        cells = [(p, s, tuple(t for t in ts if t in keep)) for p, s, ts in cells if keep & set(ts)]
    custom = parse_variants(args.variants)
    for preset, sname, tokens in cells:
        scheme = QuantScheme.by_name(sname)
        for gemm in args.gemms.split(","):
            if time.time() - start > budget:
                failures.append(f"budget: {preset} {sname} {gemm} T={tokens} not run ({budget:.0f} s spent)")
                continue
            try:
                wts = Weights(preset, scheme, gemm, dev, gen)
            except Exception as ex:
                failures.append(f"{preset} {sname} {gemm} setup: {type(ex).__name__}: {ex}"[:300])
                continue
            for t in tokens:
                if time.time() - start > budget:
                    failures.append(f"budget: {preset} {sname} {gemm} T={t} not run")
                    continue
                cell = Cell(wts, t, dev, gen)
                results += bench_cell(cell, preset, timer, selftest, failures, custom, args.skip_old)
            del wts
            if not selftest:
                torch.cuda.empty_cache()
    meta["seconds"] = round(time.time() - start, 1)
    text = write(args.out, results, failures, meta)
    print(text)
    bad = [r for r in results if "ERR" in r.note]
    print(f"{len(results)} results, {len(bad)} over tolerance, {len(failures)} failures, {meta['seconds']} s")
    if selftest and (bad or failures):
        sys.exit(1)


if __name__ == "__main__":
    main()
