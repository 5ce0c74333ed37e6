"""The ``fusedmoe`` command: run, features, explain (bench and tune come with the benchmarks).

A user's mistake (a bad option value, a preset or scheme that does not exist, a checkpoint
that cannot be read, a GPU command on a machine without one, a problem too large for the
memory) ends in one line on stderr and exit status 2; ``--debug`` shows the traceback
instead. A run whose result is outside tolerance exits 1; an internal error keeps its
traceback (it is a bug to report).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .errors import FusedMoEError

# Share of the available host memory ``run`` may plan to use on a CPU: the rest is left to the
# allocator's slack and to whatever else runs (measured peaks stay within ``problem_bytes``).
_MEMORY_SHARE = 0.9


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` and exit status 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(minimum: int):
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


def _int_list(minimum: int):
    """An argparse type: comma-separated ints >= ``minimum`` (empty entries dropped)."""
    one = _count(minimum)

    def parse(text: str) -> list[int]:
        return [one(t) for t in text.split(",") if t.strip()]

    return parse


def _needs_gpu(command: str) -> None:
    """Refuse a GPU-only command on a machine without a CUDA GPU (the Triton interpreter,
    ``TRITON_INTERPRET=1``, runs it on the CPU for tests)."""
    from .kernels._common import interpreting

    if not torch.cuda.is_available() and not interpreting():
        raise FusedMoEError(
            f"device: expected a CUDA GPU (fusedmoe {command} times kernels on one), found none on this machine"
        )


def _check_host_memory(config, scheme, tokens: int, preset: str) -> None:
    """Refuse a CPU run that cannot fit in the available memory, saying how much it needs."""
    from .platform import host_memory_available
    from .testing.problems import problem_bytes

    need, avail = problem_bytes(config, scheme, tokens), host_memory_available()
    if avail is not None and need > _MEMORY_SHARE * avail:
        gb = 1 << 30
        raise FusedMoEError(
            f"--preset {preset}: expected to fit in host memory; a CPU run of {scheme.name} needs about "
            f"{need / gb:.1f} GiB (weights, their quantized copy, the reference's working set), "
            f"{avail / gb:.1f} GiB available; use a smaller preset (small) or a GPU"
        )


def _cmd_run(args) -> int:
    from .api import fused_moe
    from .oracle import select_experts
    from .quant import QuantScheme
    from .testing import make_problem, rel_error, tolerance
    from .tools.presets import preset_config

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if args.checkpoint:
        return _run_checkpoint(args, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = preset_config(args.preset, dtype=dtype)
    scheme = QuantScheme.by_name(args.scheme)
    print(f"fusedmoe run: preset {args.preset} {config!r}")
    print(f"scheme {scheme.name}, tokens {args.tokens}, device {device}")
    choice = select_experts(config, scheme, backend=args.backend)
    print("oracle:\n" + choice.explain())
    if device == "cpu":
        _check_host_memory(config, scheme, args.tokens, args.preset)
    prob = make_problem(config, scheme, args.tokens, seed=args.seed, device=device)
    routing = (prob.topk_ids, prob.topk_weights)
    out = fused_moe(prob.x, routing, prob.weights, config, scheme, backend=choice.backend)
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        out = fused_moe(prob.x, routing, prob.weights, config, scheme, backend=choice.backend)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ref = prob.reference(torch.float64 if device == "cpu" else torch.float32)
    err, tol = rel_error(out, ref), tolerance(scheme, dtype)
    med = sorted(times)[len(times) // 2]
    print(f"output {tuple(out.shape)} {out.dtype}; rel. error vs reference {err:.2e} (tolerance {tol:.0e})")
    print(f"time per forward (median of {args.iters}, backend {choice.backend}): {med * 1e3:.3f} ms")
    ok = err <= tol
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _run_checkpoint(args, device: str) -> int:
    """``run --checkpoint``: a bad checkpoint is one line on stderr and status 2 (``--debug``: the traceback)."""
    from .checkpoints import run_checkpoint
    from .errors import FusedMoEError

    dtype = (
        {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype] if args.dtype_set else None
    )
    kw = dict(layer=args.layer, seed=args.seed, dtype=dtype, online=args.online, device=device, truth=args.truth)
    try:
        r = run_checkpoint(args.checkpoint, args.backend, args.tokens, **kw)
    except (FusedMoEError, OSError) as e:  # what a checkpoint can be wrong about: its files, names, shapes
        if getattr(args, "debug", False):
            raise
        print(f"fusedmoe run: checkpoint {args.checkpoint}: {e}", file=sys.stderr)
        return 2
    print(f"fusedmoe run: checkpoint {args.checkpoint} ({r['model_type']}, format {r['format']})")
    print(f"scheme {r['scheme']} (computed as {r['compute_scheme']}), tokens {args.tokens}, device {device}")
    print("oracle:\n" + r["explain"])
    print(f"loaded in {r['load_s']:.2f} s; forward {r['forward_ms']:.3f} ms (backend {r['backend']})")
    print(f"truth: {r['truth']}")
    print(f"rel. error vs truth {r['rel_error']:.2e} (tolerance {r['tolerance']:.0e})")
    print(f"rel. error vs reference {r['reference_error']:.2e} (tolerance {r['reference_tolerance']:.0e})")
    print("PASS" if r["passed"] else "FAIL")
    return 0 if r["passed"] else 1


def _cmd_features(args) -> int:
    from .oracle.features import feature_matrix, to_markdown
    from .platform import Platform

    plat = Platform.simulated(args.platform) if args.platform else None
    m = feature_matrix(plat)
    print(json.dumps(m, indent=2) if args.json else to_markdown(m))
    return 0


def _cmd_explain(args) -> int:
    from .contract import TokenLayout
    from .errors import UnsupportedError
    from .oracle import select_experts
    from .platform import Platform, current_platform
    from .quant import QuantScheme
    from .tools.presets import preset_config

    plat = Platform.simulated(args.platform) if args.platform else current_platform()
    plat = plat.with_packages(*args.packages)
    config = preset_config(args.preset)
    scheme = QuantScheme.by_name(args.scheme)
    layout = TokenLayout(args.layout)
    try:
        choice = select_experts(
            config, scheme, platform=plat, layout=layout, backend=args.backend, num_tokens=args.tokens
        )
    except UnsupportedError as e:
        print(str(e))
        return 1
    print(choice.explain())
    return 0


def _cmd_bench(args) -> int:
    _needs_gpu("bench")
    if args.ep:  # expert parallelism: its own program under torchrun, with its own options
        from .tools.bench_ep import launch

        return launch(args.out, args.ep_args, args.nproc)
    from .tools.bench import run_bench
    from .tools.peers import load_peers

    run_bench(
        args.preset.split(","),
        args.scheme.split(","),
        args.tokens,
        out_dir=args.out,
        providers=tuple(args.providers.split(",")),
        graph=not args.eager,
        parts=not args.no_parts,
        peers=load_peers(args.peers),
    )
    return 0


def _cmd_tune(args) -> int:
    from .env import config_dir
    from .tools.tune import SCHEMES, parse_presets, plan_summary, tune_many

    presets = parse_presets(args.preset)
    schemes = list(SCHEMES) if args.scheme == "all" else [s for s in args.scheme.split(",") if s]
    tokens, extra = args.tokens, args.extra_tokens
    if args.dry_run:
        print(plan_summary(presets, schemes, tokens + extra, args.space, args.workers or 12))
        return 0
    _needs_gpu("tune")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = tune_many(
        presets,
        schemes,
        tokens,
        extra_tokens=extra,
        out_dir=args.out,
        space=args.space,
        device=device,
        budget_s=args.budget_s,
        workers=args.workers,
        screen_ms=args.screen_ms,
        retime_ms=args.retime_ms,
        top=args.top,
    )
    text = report.markdown()
    print(text)
    print(f"tuned configs written under {args.out or config_dir()}", file=sys.stderr)
    if args.summary:
        from pathlib import Path

        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(text + "\n")
    failed = [c for c in report.combos if c.error]
    return 1 if failed or not report.files else 0


def main(argv: list[str] | None = None) -> int:
    # 101 lines: the argparse tree of every subcommand, declarations only; one place lists every flag.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    p = _Parser(prog="fusedmoe", description="Fused Mixture-of-Experts kernels.", parents=[debug])
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name: str, **kw):
        return sub.add_parser(name, parents=[debug], **kw)

    r = command("run", help="build a layer, run it, check it against the reference, time it")
    r.add_argument("--checkpoint", help="a model folder (config.json + *.safetensors): run its first MoE layer")
    r.add_argument("--layer", type=_count(0), default=None, help="with --checkpoint: which layer")
    r.add_argument("--online", default=None, help="with --checkpoint: quantize a bf16 checkpoint at load (scheme)")
    r.add_argument(
        "--truth",
        default="auto",
        choices=["auto", "transformers", "reference"],
        help="with --checkpoint: compare with transformers' own block of the checkpoint (auto: when it loads) "
        "or the float64 reference on the loaded weights",
    )
    r.add_argument("--preset", default="small")
    r.add_argument("--scheme", default="bf16")
    r.add_argument("--tokens", type=_count(1), default=64)
    r.add_argument("--backend", default="auto")
    r.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    r.add_argument("--iters", type=_count(1), default=10)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is present")
    r.set_defaults(fn=_cmd_run)

    f = command("features", help="the feature matrix, from the backends' declarations")
    f.add_argument("--json", action="store_true")
    f.add_argument("--platform", help="simulate a platform: cpu, sm80, sm89, sm90, sm100, gfx942, ...")
    f.set_defaults(fn=_cmd_features)

    e = command(
        "explain",
        help="every backend candidate for a preset and scheme: accepted or refused and why, the choice, "
        "the activation precision it implies and the padding it needs",
    )
    e.add_argument("--preset", default="small")
    e.add_argument("--scheme", default="bf16")
    e.add_argument("--layout", default="standard", choices=["standard", "batched"])
    e.add_argument("--backend", default="auto", help="ask for one backend (honored or refused with the reason)")
    e.add_argument("--platform", help="simulate a platform: cpu, sm80, sm89, sm90, sm100, gfx942, gfx950, tpu")
    e.add_argument("--packages", nargs="*", default=[], help="simulate installed packages: flashinfer deep_gemm ...")
    e.add_argument(
        "--tokens", type=_count(1), default=None, help="tokens per call, for the triton/grouped_mm shape rule"
    )
    e.set_defaults(fn=_cmd_explain)

    b = command("bench", help="time the layer against PyTorch grouped GEMM and the roofline (GPU)")
    b.add_argument("--preset", default="mixtral-8x7b,qwen3-30b-a3b,deepseek-v3,gpt-oss-20b")
    b.add_argument("--scheme", default="bf16,fp8_tensor,fp8_block")
    b.add_argument("--tokens", type=_int_list(1), default="1,16,64,256,1024,4096,16384")
    b.add_argument("--providers", default="fusedmoe,grouped_mm,torch_grouped_mm,loop")
    b.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    b.add_argument("--no-parts", action="store_true", help="skip the per-kernel breakdown")
    b.add_argument("--peers", help="peer times JSON (default: the repo's benchmarks/peers/ one; 'none': no peers)")
    b.add_argument("--out", default=None)
    b.add_argument("--ep", action="store_true", help="expert parallelism on every GPU here (fusedmoe.tools.bench_ep)")
    b.add_argument("--ep-args", default="", help='with --ep: options of fusedmoe.tools.bench_ep, e.g. "--tokens 128"')
    b.add_argument("--nproc", type=_count(1), default=None, help="with --ep: ranks (default: every GPU)")
    b.set_defaults(fn=_cmd_bench)

    tn = command("tune", help="search launch configs for a preset on this GPU; write the JSON the runtime reads")
    tn.add_argument("--preset", default="qwen3-30b-a3b", help="comma list, or 'all' (the four shipped presets)")
    tn.add_argument("--scheme", default="bf16", help="comma list (bf16,fp8_tensor,fp8_block), or 'all'")
    tn.add_argument("--tokens", type=_int_list(1), default="1,16,64,256,1024,4096")
    tn.add_argument(
        "--extra-tokens", type=_int_list(1), default="", help="token counts tuned after the others, as budget allows"
    )
    tn.add_argument("--space", default="quick", choices=["quick", "full", "tiny"])
    tn.add_argument(
        "--out", default=None, help="folder (default: FUSEDMOE_CONFIG_DIR, else ~/.config/fusedmoe/configs)"
    )
    tn.add_argument("--budget-s", type=float, default=None, help="wall-clock budget: fewer candidates, then stop")
    tn.add_argument(
        "--workers", type=_count(1), default=None, help="compile processes (default min(12, CPUs - 2) on a GPU)"
    )
    tn.add_argument("--screen-ms", type=float, default=8.0, help="timing per candidate, first pass")
    tn.add_argument("--retime-ms", type=float, default=60.0, help="timing per finalist and the heuristic")
    tn.add_argument("--top", type=_count(1), default=3, help="finalists re-timed per step")
    tn.add_argument("--summary", default=None, help="also write the summary (markdown) here")
    tn.add_argument("--dry-run", action="store_true", help="print candidate counts and the time estimate only")
    tn.set_defaults(fn=_cmd_tune)

    args = p.parse_args(argv)
    if getattr(args, "cmd", None) == "run":
        args.dtype_set = args.dtype is not None
        args.dtype = args.dtype or "bf16"
    if getattr(args, "debug", False):
        return args.fn(args)
    try:
        return args.fn(args)
    except (FusedMoEError, OSError, MemoryError) as err:
        # a user's mistake (or a machine that cannot run the request): one line, exit status 2
        what = str(err).splitlines()[0] if str(err) else type(err).__name__
        more = " (--debug for the full message)" if "\n" in str(err) else ""
        print(f"fusedmoe {args.cmd}: error: {what}{more}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
