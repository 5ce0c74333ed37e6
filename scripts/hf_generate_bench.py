"""End-to-end transformers ``generate`` on fusedmoe: tokens/s per experts implementation.

    PYTHONPATH=src python scripts/hf_generate_bench.py --out DIR       # a GPU (an H100: ~5 minutes)
    PYTHONPATH=src python scripts/hf_generate_bench.py --selftest --out DIR   # tiny, on the CPU

Models: random bf16 weights at real sizes, cut in depth so that one GPU holds them and the
run stays short: a Qwen3-30B-A3B-shaped model (H 2048, 128 experts of I 768, top-8) cut to 4
layers, and a Mixtral-8x7B-shaped one (H 4096, 8 experts of I 14336, top-2) cut to 2. Each
runs greedy ``generate`` (eager transformers, sdpa attention, KV cache) with a 512-token
prompt at batch 1 and 32, through four variants:

    eager       experts_implementation="eager"       transformers' per-expert loop
    grouped_mm  experts_implementation="grouped_mm"  transformers' default (torch grouped GEMM)
    fusedmoe    experts_implementation="fusedmoe"    fusedmoe's registry (routing in transformers)
    patch       fusedmoe.integrations.transformers.patch(model)  (routing in fusedmoe too)

Per (model, batch, variant), after one warm-up ``generate`` of a few tokens: the prefill time
is the median of ``--repeats`` (5) ``generate`` calls of 1 new token; a decode step is
(t(N new tokens) - t(1)) / (N - 1) with N = 128, t(N) the median of ``--decode-repeats`` (3)
calls. Batch 1 is host-bound and the host may be shared: single timings of one prefill
differed by ~2x between two scripts on the same H200 (2026-11-29), so one call is not a
measurement. Reported: prefill tokens/s (batch x prompt / prefill), decode tokens/s (batch / step),
the decode and prefill speedups over grouped_mm, and the share of the N generated tokens equal
to grouped_mm's (random weights in bf16: near ties may flip a few; a broken variant is near 0).
A variant that fails is recorded with its error and the others go on. The markdown table is
printed last and written, with the JSON, to DIR (hf_generate.md, hf_generate.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import platform
import statistics
import time
import traceback

import torch

VARIANTS = ("eager", "grouped_mm", "fusedmoe", "patch")
BASELINE = "grouped_mm"

# Shapes of the public checkpoints' config.json, cut to `layers` layers.
MODELS = {
    "qwen3-30b-a3b/4L": dict(
        family="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_hidden_layers=4, max_position_embeddings=4096, rope_theta=1e6,
    ),
    "mixtral-8x7b/2L": dict(
        family="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_hidden_layers=2,
        max_position_embeddings=4096, rope_theta=1e6,
    ),
}  # fmt: skip
# --selftest: the same families, tiny, on the CPU (the cpu backend), to catch mistakes here.
TINY = {
    "qwen3-tiny": dict(
        family="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
    ),
    "mixtral-tiny": dict(
        family="mixtral", hidden_size=64, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_hidden_layers=2, max_position_embeddings=256,
    ),
}  # fmt: skip


def build(spec: dict, device: str, dtype: torch.dtype):
    """A random-weight ``*ForCausalLM`` of ``spec`` on ``device`` (initialised there: fast)."""
    import transformers

    spec = dict(spec)
    family = spec.pop("family")
    theta = spec.pop("rope_theta", None)
    cfg_cls = transformers.AutoConfig.for_model(family).__class__
    config = cfg_cls(**spec, **({"rope_parameters": {"rope_type": "default", "rope_theta": theta}} if theta else {}))
    config.use_cache = True
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # always N new tokens
    model.generation_config.pad_token_id = 0
    return model


def set_variant(model, variant: str, backend: str) -> str:
    """Switch ``model`` to ``variant``; returns how its MoE blocks are served."""
    from fusedmoe.integrations import transformers as fmt

    if variant == "patch":
        modes = [p.mode for p in fmt.plan(model)]
        fmt.patch(model, backend=backend)
        return ", ".join(f"{modes.count(m)} {m}" for m in sorted(set(modes)))
    if variant == "fusedmoe":
        fmt.register(backend=backend)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(variant)
    else:  # an older transformers 5: the decorated experts read it from their config
        model.config._experts_implementation = variant
    return model.config._experts_implementation


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model, ids, new_tokens: int, device: str) -> tuple[float, torch.Tensor]:
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1] :]


def measure(model, batch: int, args, device: str) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, model.config.vocab_size, (batch, args.prompt), generator=g).to(device)
    timed_generate(model, ids, min(4, args.new_tokens), device)  # warm-up: kernels compiled, caches made
    t1 = statistics.median(timed_generate(model, ids, 1, device)[0] for _ in range(args.repeats))
    runs = [timed_generate(model, ids, args.new_tokens, device) for _ in range(args.decode_repeats)]
    tn, tokens = statistics.median(r[0] for r in runs), runs[0][1]
    step = (tn - t1) / (args.new_tokens - 1)
    return {
        "prefill_s": t1,
        "decode_step_ms": 1e3 * step,
        "prefill_tok_s": batch * args.prompt / t1,
        "decode_tok_s": batch / step if step > 0 else float("nan"),
        "tokens": tokens.cpu(),
    }


def run_model(name: str, spec: dict, args, device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    model = None
    try:
        model = build(spec, device, dtype)
    except Exception as e:  # the model itself: every variant of it fails the same way
        return [dict(model=name, variant=v, batch=b, error=f"build: {e!r}") for v in args.variants for b in args.batch]
    # patch changes the model for good: it runs last
    for variant in sorted(args.variants, key=lambda v: v == "patch"):
        try:
            served = set_variant(model, variant, args.backend)
        except Exception as e:
            rows += [dict(model=name, variant=variant, batch=b, error=f"setup: {e!r}") for b in args.batch]
            continue
        for batch in args.batch:
            row = dict(model=name, variant=variant, batch=batch, served=served)
            try:
                row.update(measure(model, batch, args, device))
            except Exception as e:
                row["error"] = repr(e)
                traceback.print_exc()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            print(_line(row), flush=True)
            rows.append(row)
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:18s} {row['variant']:10s} b={row['batch']:<3d} FAILED {row['error'][:200]}"
    return (
        f"{row['model']:18s} {row['variant']:10s} b={row['batch']:<3d} prefill {row['prefill_s'] * 1e3:8.1f} ms "
        f"decode {row['decode_step_ms']:7.2f} ms/step ({row['decode_tok_s']:8.1f} tok/s)  [{row['served']}]"
    )


def add_ratios(rows: list[dict]) -> None:
    """Speedups over grouped_mm and the share of its generated tokens each variant reproduces."""
    base = {(r["model"], r["batch"]): r for r in rows if r["variant"] == BASELINE and "error" not in r}
    for r in rows:
        b = base.get((r["model"], r["batch"]))
        if "error" in r or b is None:
            continue
        r["decode_speedup"] = b["decode_step_ms"] / r["decode_step_ms"]
        r["prefill_speedup"] = b["prefill_s"] / r["prefill_s"]
        r["same_tokens"] = float((r["tokens"] == b["tokens"]).float().mean())
    for r in rows:
        r.pop("tokens", None)


def markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| model | batch | variant | prefill tok/s | decode tok/s | decode ms/step | decode vs grouped_mm "
        "| prefill vs grouped_mm | same tokens | served as |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        dec, pre = (f"{r[k]:.2f}x" if k in r else "-" for k in ("decode_speedup", "prefill_speedup"))
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['variant']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} "
            f"| {r['decode_step_ms']:.2f} | {dec} | {pre} | {r.get('same_tokens', float('nan')):.2f} "
            f"| {r.get('served', '')} |"
        )
    info = ", ".join(f"{k} {v}" for k, v in meta.items())
    return f"{info}\n\n{head}" + "\n".join(lines) + "\n"


def _meta(args, device: str) -> dict:
    import transformers

    import fusedmoe

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": gpu,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fusedmoe": getattr(fusedmoe, "__version__", "-"),
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "backend": args.backend,
        "command": "PYTHONPATH=src python scripts/hf_generate_bench.py " + " ".join(args.argv),
    }


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=pathlib.Path, help="folder for hf_generate.{json,md}")
    p.add_argument("--models", nargs="+", default=None, help=f"of {list(MODELS)} (default: all)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="prefill timings per cell (median)")
    p.add_argument("--decode-repeats", type=int, default=3, help="timings of the N-token generate per cell (median)")
    p.add_argument("--backend", default="auto", help="fusedmoe backend (auto: the oracle's choice)")
    p.add_argument("--selftest", action="store_true", help="tiny models on the CPU: checks the script, not speed")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.repeats < 1 or args.decode_repeats < 1 or args.new_tokens < 2:
        p.error("--repeats and --decode-repeats must be at least 1, --new-tokens at least 2 (a decode step)")
    if args.selftest:
        device, dtype, table = "cpu", torch.float32, TINY
        args.prompt, args.new_tokens, args.batch = min(args.prompt, 16), min(args.new_tokens, 6), [1, 2]
        args.backend = "cpu" if args.backend == "auto" else args.backend
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: use --selftest on a CPU")
        device, dtype, table = "cuda", torch.bfloat16, MODELS
    names = args.models or list(table)
    rows = []
    t0 = time.perf_counter()
    for name in names:
        rows += run_model(name, table[name], args, device, dtype)
    add_ratios(rows)
    meta = {**_meta(args, device), "wall_s": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_generate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = markdown(rows, meta)
    (args.out / "hf_generate.md").write_text(md)
    print("\n" + md)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
