"""Build ``FusedMoE`` layers from a checkpoint folder, and ``run_checkpoint`` for ``fusedmoe run``.

A folder holds config.json (``model_type`` says where the MoE blocks are,
``quantization_config`` how they are stored; see ``models`` and ``detect``) and
``*.safetensors`` files read lazily: only the tensors of the requested layers
and of this rank's experts are read. Each layer is loaded the way a serving
engine does: create -> ``weight_loader`` per checkpoint tensor (with TP/EP
sharding) -> ``process_weights_after_loading``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..config import ParallelConfig
from ..errors import expect
from ..experts.reference import moe_reference
from ..integrations.hf_blocks import SharedExpert
from ..layer import FusedMoE
from ..platform import Platform
from ..testing import rel_error, tolerance
from .base import CheckpointFormat, CheckpointReader, read_config
from .detect import detect
from .models import MoEArch, describe

__all__ = ["load_checkpoint", "load_layer", "run_checkpoint"]

_PREFIX = {"w1": "w13", "w3": "w13", "w13": "w13", "w2": "w2"}


class _Shared:
    """The shared-experts hook: a ``SharedExpert`` computed in the activations' dtype."""

    def __init__(self, expert: SharedExpert) -> None:
        self.expert = expert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(x, x.dtype)


def _shared(reader: CheckpointReader, fmt: CheckpointFormat, arch: MoEArch, block: str, dtype) -> _Shared | None:
    if arch.shared_expert is None:
        return None
    path = f"{block}.{arch.shared_expert}"
    w = {p: fmt.dense(reader, f"{path}.{p}", dtype) for p in ("gate_proj", "up_proj", "down_proj")}
    gate = None
    if arch.shared_gate is not None:
        gate = fmt.dense(reader, f"{block}.{arch.shared_gate}", dtype)
    return _Shared(SharedExpert(w["gate_proj"], w["up_proj"], w["down_proj"], arch.config.activation, gate))


def _load_experts(moe: FusedMoE, reader: CheckpointReader, fmt: CheckpointFormat, arch: MoEArch, block: str) -> None:
    e_all = arch.config.num_experts
    if arch.fused_experts:
        for proj, shard in (("gate_up_proj", "w13"), ("down_proj", "w2")):
            with reader.naming(f"{block}.experts.{proj}"):
                pieces = fmt.fused(reader, f"{block}.experts", proj)
                for key, t in pieces.items():
                    what = f"checkpoint tensor '{block}.experts.{proj}' ({key})"
                    expect(t.shape[0] == e_all, what, f"{e_all} experts in dim 0 (config.json)", tuple(t.shape))
                for e in moe.local_experts:
                    for key, t in pieces.items():
                        moe.weight_loader(f"{_PREFIX[shard]}_{key}", t[e], e, shard)
        return
    reader.check_expert_count(f"{block}.experts", e_all)
    for e in moe.local_experts:
        for shard, name in arch.expert_names:
            with reader.naming(f"{block}.experts.{e}.{name}"):
                pieces = fmt.linear(reader, f"{block}.experts.{e}.{name}")
                for key, t in pieces.items():
                    moe.weight_loader(f"{_PREFIX[shard]}_{key}", t, e, shard)


def _build(
    reader: CheckpointReader,
    fmt: CheckpointFormat,
    arch: MoEArch,
    layer: int,
    *,
    backend: str,
    parallel: ParallelConfig | None,
    device,
    platform: Platform | None,
    keep_reference: bool,
) -> FusedMoE:
    expect(layer in arch.moe_layers, "layer", f"one of the MoE layers {list(arch.moe_layers)}", layer)
    parallel = parallel or ParallelConfig()
    full = arch.config
    expect(
        full.intermediate_size % parallel.tp_size == 0,
        "ParallelConfig.tp_size",
        f"a divisor of the intermediate size {full.intermediate_size}",
        parallel.tp_size,
    )
    config = full.replace(intermediate_size=full.intermediate_size // parallel.tp_size)
    block = arch.block_path(layer)
    corr = None
    if arch.correction_bias:
        corr = reader.get(f"{block}.{arch.router_name}.e_score_correction_bias", "DeepSeek-V3 routing")
    moe = FusedMoE(
        config,
        fmt.layer_scheme(config.hidden_size, config.intermediate_size),
        arch.router,
        parallel,
        backend=backend,
        correction_bias=corr,
        shared_experts=_shared(reader, fmt, arch, block, config.dtype),
        online_quant=fmt.online,
        platform=platform,
        device=device,
    )
    _load_experts(moe, reader, fmt, arch, block)
    moe.process_weights_after_loading(keep_reference=keep_reference)
    return moe


def _open(path: str, dtype, online, device):

    cfg = read_config(path)
    return CheckpointReader(path, device), detect(cfg, online=online), describe(cfg, dtype)


def load_layer(
    path: str,
    layer: int | None = None,
    *,
    backend: str = "auto",
    parallel: ParallelConfig | None = None,
    dtype: torch.dtype | None = None,
    online: str | None = None,
    device: str | torch.device = "cpu",
    platform: Platform | None = None,
    keep_reference: bool = False,
) -> FusedMoE:
    """One MoE layer (default: the first) of the checkpoint at ``path``."""
    reader, fmt, arch = _open(path, dtype, online, device)
    layer = arch.moe_layers[0] if layer is None else layer
    kw = dict(backend=backend, parallel=parallel, device=device, platform=platform, keep_reference=keep_reference)
    return _build(reader, fmt, arch, layer, **kw)


def load_checkpoint(
    path: str,
    *,
    layers: list[int] | None = None,
    backend: str = "auto",
    parallel: ParallelConfig | None = None,
    dtype: torch.dtype | None = None,
    online: str | None = None,
    device: str | torch.device = "cpu",
    platform: Platform | None = None,
) -> list[FusedMoE]:
    """Every MoE layer of the checkpoint at ``path`` (or those in ``layers``), loaded and converted."""
    reader, fmt, arch = _open(path, dtype, online, device)
    kw = dict(backend=backend, parallel=parallel, device=device, platform=platform, keep_reference=False)
    return [_build(reader, fmt, arch, L, **kw) for L in (layers or arch.moe_layers)]


def router_logits(
    reader: CheckpointReader, fmt: CheckpointFormat, arch: MoEArch, layer: int, x: torch.Tensor
) -> torch.Tensor:
    """The checkpoint router's logits for ``x`` [T, H] (float32 for DeepSeek, as transformers does)."""
    path = f"{arch.block_path(layer)}.{arch.router_name}"
    dt = torch.float32 if arch.router_fp32 else x.dtype
    w = fmt.dense(reader, path, dt)
    b = reader.get(f"{path}.bias", "the router bias").to(dt) if arch.router_bias else None
    return F.linear(x.to(dt), w, b)


def run_checkpoint(
    path: str,
    backend: str = "auto",
    tokens: int = 16,
    *,
    layer: int | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    online: str | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Build one MoE layer of a checkpoint, run it on random tokens, compare with the reference.

    Routing comes from the checkpoint's own router; the reference is
    ``moe_reference`` in float64 on the same (reference-layout) weights, plus the
    shared experts in float64. Returns a dict of what happened (JSON-friendly
    apart from nothing: every value is a str, int, float or bool).
    """
    t0 = time.perf_counter()
    reader, fmt, arch = _open(path, dtype, online, device)
    layer = arch.moe_layers[0] if layer is None else layer
    kw = dict(backend=backend, parallel=None, device=device, platform=None, keep_reference=True)
    moe = _build(reader, fmt, arch, layer, **kw)
    load_s = time.perf_counter() - t0
    cfg = moe.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(device=device, dtype=cfg.dtype)
    logits = router_logits(reader, fmt, arch, layer, x)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = moe(x, logits)
    if out.is_cuda:
        torch.cuda.synchronize()
    forward_ms = (time.perf_counter() - t1) * 1e3
    topk = moe.router.route(logits, moe.e_score_correction_bias)
    ref = moe_reference(
        x,
        topk.ids,
        topk.weights,
        moe.reference_weights,
        cfg,
        moe.compute_scheme,
        expert_map=moe.expert_map,
        dtype=torch.float64,
    )
    if moe.shared_experts is not None:
        ref = ref + moe.shared_experts.expert(x, torch.float64)
    err, tol = rel_error(out, ref), tolerance(moe.compute_scheme, cfg.dtype)
    return {
        "checkpoint": path,
        "model_type": arch.model_type,
        "format": fmt.name,
        "scheme": moe.scheme.name,
        "compute_scheme": moe.compute_scheme.name,
        "layer": layer,
        "backend": moe.choice.backend,
        "explain": moe.choice.explain(),
        "config": repr(cfg),
        "tokens": tokens,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "rel_error": err,
        "tolerance": tol,
        "passed": err <= tol,
        "load_s": load_s,
        "forward_ms": forward_ms,
    }
