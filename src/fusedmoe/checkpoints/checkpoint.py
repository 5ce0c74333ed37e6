"""Build ``FusedMoE`` layers from a checkpoint folder.

A folder holds config.json (``model_type`` says what the MoE layers compute,
``quantization_config`` how they are stored; see ``models`` and ``detect``) and
``*.safetensors`` files. Where the experts are comes from the tensor names
(``layout.find_experts``, from the safetensors headers only). Each layer is
loaded the way a serving engine does: create -> ``weight_loader`` per
checkpoint tensor (with TP/EP sharding) -> ``process_weights_after_loading``.

Loading streams: the files are memory-mapped (``safetensors.safe_open``) and a
tensor is read when its Linear is loaded, then dropped once copied into the
layer, so one layer of a checkpoint of any size reads that layer's tensors
and nothing else (the names come from the headers alone). Measured peak
memory (``load_layer``'s docstring, tests/checkpoints/test_peak_memory.py):
the layer's own data plus an index of the checkpoint's tensor names, about
0.3 KiB per tensor, whatever the checkpoint's size in bytes.
"""

from __future__ import annotations

import torch

from ..config import ParallelConfig
from ..errors import expect
from ..integrations.hf_blocks import SharedExpert
from ..layer import FusedMoE
from ..platform import Platform
from .base import CheckpointFormat, CheckpointReader, read_config
from .detect import detect
from .layout import ExpertLayout, find_experts
from .models import MoEArch, describe

__all__ = ["build_layer", "load_checkpoint", "load_layer", "open_checkpoint"]

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


def _load_experts(moe: FusedMoE, reader: CheckpointReader, fmt: CheckpointFormat, where: ExpertLayout) -> None:
    e_all = moe.config.num_experts
    for shard, proj in where.fused:
        with reader.naming(f"{where.experts_path}.{proj}"):
            pieces = fmt.fused(reader, where.experts_path, proj)
            for key, t in pieces.items():
                what = f"checkpoint tensor '{where.experts_path}.{proj}' ({key})"
                expect(t.shape[0] == e_all, what, f"{e_all} experts in dim 0 (config.json)", tuple(t.shape))
            for e in moe.local_experts:
                for key, t in pieces.items():
                    moe.weight_loader(f"{_PREFIX[shard]}_{key}", t[e], e, shard)
    if where.linears:
        reader.check_expert_count(where.experts_path, e_all)
    for e in moe.local_experts if where.linears else ():
        for shard, path in where.linears[e]:
            with reader.naming(path):
                pieces = fmt.linear(reader, path)
                if "bias" not in pieces and reader.has(f"{path}.bias"):  # gpt-oss experts as Linears keep biases
                    pieces["bias"] = reader.get(f"{path}.bias")
                for key, t in pieces.items():
                    moe.weight_loader(f"{_PREFIX[shard]}_{key}", t, e, shard)


def build_layer(
    reader: CheckpointReader,
    fmt: CheckpointFormat,
    arch: MoEArch,
    layer: int,
    *,
    backend: str = "auto",
    parallel: ParallelConfig | None = None,
    device: str | torch.device = "cpu",
    platform: Platform | None = None,
    keep_reference: bool = False,
) -> FusedMoE:
    """MoE layer ``layer`` of an opened checkpoint (``open_checkpoint``), loaded and converted."""
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
    where = find_experts(reader.keys(), layer, full.num_experts)
    fmt = fmt.for_layer(where, full.hidden_size, full.intermediate_size)
    block = where.block
    corr = None
    if arch.correction_bias:
        expect(where.router is not None, f"checkpoint layer {layer}", f"a router ('{block}.gate.weight')")
        corr = reader.get(f"{where.router}.e_score_correction_bias", "DeepSeek-V3 routing")
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
    _load_experts(moe, reader, fmt, where)
    moe.process_weights_after_loading(keep_reference=keep_reference)
    return moe


def open_checkpoint(path: str, dtype=None, online: str | None = None, device="cpu"):
    """(reader, format, arch) of the checkpoint folder ``path``: headers and config only, no tensor read."""
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
    """One MoE layer (default: the first) of the checkpoint at ``path``.

    Reads the safetensors headers of every file and then only this layer's expert tensors (and its
    router's correction bias and shared experts where the model has them), so a layer of a 100 GB
    checkpoint is loaded without reading the rest: the peak memory is the layer plus an index of
    the tensor names, and grows with the number of tensors, not with the checkpoint's bytes.

    Measured (2-core CPU, torch 2.13, ``cpu`` backend; tests/checkpoints/test_peak_memory.py with
    ``FUSEDMOE_PEAK_MEMORY_GB=8``): the last layer (16 experts, 6.0 MiB of fp8 weights) of an
    8.1 GiB compressed-tensors FP8 checkpoint of 1365 MoE layers (132,405 tensors in 171 files)
    raised the peak resident memory by 56 MiB (55.1 and 55.6 MiB in two runs, 1.5-3 s). Of that,
    43 MiB is opening the 171 files and indexing their 132,405 tensor names (about 0.3 KiB a
    tensor; measured alone on a checkpoint of the same names with tiny tensors) and the rest is the
    layer. The same layer of a 0.24 GiB checkpoint (40 layers, 5 files): 13 MiB. 100 GB was not
    written here (the disk is smaller); by the above, its index costs ~0.3 KiB per tensor it holds.
    """
    reader, fmt, arch = open_checkpoint(path, dtype, online, device)
    layer = arch.moe_layers[0] if layer is None else layer
    kw = dict(backend=backend, parallel=parallel, device=device, platform=platform, keep_reference=keep_reference)
    return build_layer(reader, fmt, arch, layer, **kw)


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
    reader, fmt, arch = open_checkpoint(path, dtype, online, device)
    kw = dict(backend=backend, parallel=parallel, device=device, platform=platform, keep_reference=False)
    return [build_layer(reader, fmt, arch, L, **kw) for L in (layers or arch.moe_layers)]
