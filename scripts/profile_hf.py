"""Where the time of a transformers decode step goes, per experts implementation.

    PYTHONPATH=src python scripts/profile_hf.py [--model qwen3-30b-a3b/4L] [--batch 1] [--out DIR]

For the model of ``hf_generate_bench.MODELS`` and each of "grouped_mm" and "fusedmoe":

- one decode step of ``generate`` (eager transformers, KV cache), as hf_generate_bench measures it;
- one experts module alone on that step's shapes (``layers[0].mlp.experts(x, ids, weights)``,
  routing as transformers makes it): host time per call without synchronisation (what the
  Python and launches cost) and wall time with it;
- a prefill (``generate`` of one new token) per variant;
- a cProfile of 8 decode steps with "fusedmoe" (``--profile prefill``: of one prefill), the top
  frames by cumulative and own time.

Writes ``profile_hf.txt`` to DIR (default: print only). A GPU run; on the CPU it runs the
cpu backend and says little about launches.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hf_generate_bench import MODELS, TINY, build, set_variant  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _generate_ms(model, ids, device: str, n: int) -> float:
    _sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _step_ms(model, ids, device: str, new: int = 16) -> float:
    """Milliseconds per decode step: (t(new tokens) - t(1)) / (new - 1)."""
    _generate_ms(model, ids, device, 2)
    return (_generate_ms(model, ids, device, new) - _generate_ms(model, ids, device, 1)) / (new - 1)


def _experts_us(model, batch: int, device: str, calls: int = 200) -> tuple[float, float]:
    """(host us, wall us) per call of layer 0's experts module on ``batch`` tokens."""
    layer = model.model.layers[0].mlp
    h = model.config.hidden_size
    x = torch.randn(batch, h, device=device, dtype=model.dtype)
    k = model.config.num_experts_per_tok
    e = getattr(model.config, "num_experts", None) or model.config.num_local_experts
    logits = torch.randn(batch, e, device=device)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(model.dtype)
    fn = lambda: layer.experts(x, ids, w)  # noqa: E731
    for _ in range(5):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls // 4):
        fn()
        _sync(device)
    return host, (time.perf_counter() - t0) / (calls // 4) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b/4L", help=f"of {list(MODELS) + list(TINY)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--profile", choices=("decode", "prefill"), default="decode")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = {**MODELS, **TINY}[args.model]
    model = build(spec, device, torch.bfloat16)
    ids = torch.randint(1, 200, (args.batch, args.prompt), device=device)
    lines = [f"{args.model} batch {args.batch} prompt {args.prompt} on {device}"]
    with torch.inference_mode():
        for variant in ("grouped_mm", "fusedmoe"):
            set_variant(model, variant, "auto")
            step = _step_ms(model, ids, device)
            prefill = min(_generate_ms(model, ids, device, 1) for _ in range(3))
            host, wall = _experts_us(model, args.batch, device)
            lines.append(f"{variant:10s} step {step:.3f} ms, prefill {prefill:.3f} ms")
            lines.append(f"{'':10s} experts call at the decode shape: host {host:.1f} us, wall {wall:.1f} us")
        new = 9 if args.profile == "decode" else 1
        prof = cProfile.Profile()
        prof.enable()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        _sync(device)
        prof.disable()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
        lines += [f"---- cProfile of generate (fusedmoe, {new} new tokens), by {key}", s.getvalue()]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_hf.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
