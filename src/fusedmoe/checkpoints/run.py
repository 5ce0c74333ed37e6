"""``run_checkpoint``: one MoE layer of a checkpoint, run and checked against an outside truth.

The truth is the model's own MoE block as transformers builds it from the
same checkpoint (its loader, its dequantization, its forward), so a loader
bug here (gate and up swapped, a scale read from the wrong tensor) shows. It
is used when transformers is installed (``fusedmoe[hf]``), can load the
checkpoint on this machine (GPTQ/AWQ need their own kernels; FP8 block
checkpoints need a GPU in transformers 5.24) and the checkpoint is at most
``TRUTH_MAX_BYTES`` (transformers reads the whole model). Otherwise the truth
is ``moe_reference`` in float64 on the weights this loader produced, and the
result says so and why.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
import torch.nn.functional as F

from ..errors import FusedMoEError
from ..experts.reference import moe_reference
from ..integrations.hf_moe import is_experts_module
from ..layer import FusedMoE
from ..quant import QDtype
from ..testing import rel_error, tolerance
from .base import INSTALLED, CheckpointFormat, CheckpointReader
from .checkpoint import build_layer, open_checkpoint
from .layout import find_experts
from .models import MoEArch

__all__ = ["TRUTH_MAX_BYTES", "router_logits", "run_checkpoint", "transformers_block", "truth_tolerance"]

# transformers materialises every layer: 2 GB of safetensors is about 8 GB of float32 on the CPU
TRUTH_MAX_BYTES = 2 * 1024**3


def router_logits(
    reader: CheckpointReader, fmt: CheckpointFormat, arch: MoEArch, layer: int, x: torch.Tensor
) -> torch.Tensor:
    """The checkpoint router's logits for ``x`` [T, H] (float32 for DeepSeek, as transformers does)."""
    where = find_experts(reader.keys(), layer, arch.config.num_experts)
    path = where.router
    if path is None:
        raise FusedMoEError(f"checkpoint layer {layer}: no router ('{where.block}.gate.weight' or '.router.weight')")
    dt = torch.float32 if arch.router_fp32 else x.dtype
    w = fmt.dense(reader, path, dt)
    b = reader.get_optional(f"{path}.bias")
    return F.linear(x.to(dt), w, None if b is None else b.to(dt))


def transformers_block(path: str, layer: int) -> tuple[torch.nn.Module | None, str]:
    """(the MoE block of decoder layer ``layer`` as transformers loads it in float32, its name) or
    (None, why transformers cannot be the truth here)."""
    if not INSTALLED["transformers"]:
        return None, "transformers is not installed (pip install 'fusedmoe[hf]')"
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    if size > TRUTH_MAX_BYTES:
        return None, f"the checkpoint is {size / 1e9:.1f} GB and transformers would load all of it"
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, output_loading_info=True
            )
    except Exception as e:  # any failure of an outside loader only means: no outside truth
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"transformers could not load the checkpoint ({type(e).__name__}: {first})"
    # transformers loads names it does not map as "unexpected" and leaves the module's own
    # parameters random ("missing"): such a block is no truth (seen with llm-compressor's Mixtral)
    off = [k for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(kind, ())]
    off = sorted(str(k if isinstance(k, str) else k[0]) for k in off if f"layers.{layer}." in str(k))
    if off:
        return None, f"transformers did not load layer {layer} from its tensors ({len(off)} keys, e.g. {off[0]})"
    decoder = model.model.layers[layer]
    for name, child in decoder.named_children():
        experts = getattr(child, "experts", None)
        if experts is None or not is_experts_module(experts):  # not an MoE block with an experts module
            continue
        w = getattr(experts, "gate_up_proj", None)
        if w is not None and not (torch.is_tensor(w) and w.dtype.itemsize > 1):
            # compressed-tensors NVFP4 stays packed in transformers 5.24 on the CPU, its forward gives zeros
            return None, f"transformers keeps layer {layer}'s experts quantized ({getattr(w, 'dtype', type(w))})"
        return (
            child.eval(),
            f"transformers {transformers.__version__} {type(child).__name__} (layer {layer}.{name})",
        )
    return None, f"transformers built no MoE block fusedmoe knows in layer {layer}"


def truth_tolerance(moe: FusedMoE, online: bool = False) -> float:
    """How far the layer may be from the transformers block of the same checkpoint.

    ``tolerance`` bounds a backend against the reference of its own scheme; the
    transformers block quantizes no activations (compressed-tensors decompresses
    the weights on the CPU), so add what activation quantization costs: about half
    an e4m3 / int8 step in relative terms (measured <= 0.015 on the fixtures:
    0.02), e2m1 steps for NVFP4 (measured <= 0.04: 0.05). Online FP8 quantizes
    weights transformers keeps in bf16 (0.05), and per-tensor W1/W3 scales that
    differ are requantized to the larger one (0.02).
    """
    s = moe.compute_scheme
    tol = tolerance(s, torch.bfloat16 if online else moe.config.dtype) + (0.05 if online else 0.0)
    if s.a1 is not None:
        tol += 0.05 if s.a1.dtype is QDtype.NVFP4 else 0.02
    if s.w1 is not None and s.w1.granularity.kind == "tensor":
        tol += 0.02
    return tol


def _truth(path: str, layer: int, moe: FusedMoE, x: torch.Tensor, ref: torch.Tensor, truth: str, online: bool):
    """(truth output, its name, tolerance)."""
    why = "asked for the reference"
    if truth != "reference":
        block, why = transformers_block(path, layer)
        if block is not None:
            try:
                with torch.no_grad():
                    out = block(x[None].float().cpu())
                out = (out[0] if isinstance(out, tuple) else out)[0]
                return out, why, truth_tolerance(moe, online)
            except Exception as e:  # transformers' forward of a quantized block may not run on this machine
                why = f"transformers' block did not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
                block = None
        if truth == "transformers":
            raise FusedMoEError(f"truth 'transformers': {why}")
    name = f"float64 reference on the weights this loader produced ({why})"
    return ref, name, tolerance(moe.compute_scheme, moe.config.dtype)


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
    truth: str = "auto",
) -> dict:
    """Build one MoE layer of a checkpoint, run it on random tokens, compare with the truth.

    truth: 'auto' (transformers' block when it can load the checkpoint, else the
    float64 reference), 'transformers' (an error when it cannot), 'reference'.
    Routing comes from the checkpoint's own router. The layer is always also
    checked against ``moe_reference`` on its own weights (``reference_error``).
    Returns a dict of str / int / float / bool values.
    """
    t0 = time.perf_counter()
    reader, fmt, arch = open_checkpoint(path, dtype, online, device)
    layer = arch.moe_layers[0] if layer is None else layer
    moe = build_layer(reader, fmt, arch, layer, backend=backend, device=device, keep_reference=True)
    load_s = time.perf_counter() - t0
    cfg = moe.config
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(device, cfg.dtype)
    logits = router_logits(reader, fmt, arch, layer, x)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = moe(x, logits)
    if out.is_cuda:
        torch.cuda.synchronize()
    forward_ms = (time.perf_counter() - t1) * 1e3
    topk = moe.router.route(logits, moe.e_score_correction_bias)
    w, s = moe.reference_weights, moe.compute_scheme
    ref = moe_reference(x, topk.ids, topk.weights, w, cfg, s, expert_map=moe.expert_map, dtype=torch.float64)
    if moe.shared_experts is not None:
        ref = ref + moe.shared_experts.expert(x, torch.float64)
    ref_err, ref_tol = rel_error(out, ref), tolerance(s, cfg.dtype)
    want, truth_name, tol = _truth(path, layer, moe, x, ref, truth, online is not None)
    err = rel_error(out, want.to(out.device))
    return {
        "checkpoint": path,
        "model_type": arch.model_type,
        "format": fmt.name,
        "scheme": moe.scheme.name,
        "compute_scheme": s.name,
        "layer": layer,
        "backend": moe.choice.backend,
        "explain": moe.choice.explain(),
        "config": repr(cfg),
        "tokens": tokens,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "truth": truth_name,
        "rel_error": err,
        "tolerance": tol,
        "reference_error": ref_err,
        "reference_tolerance": ref_tol,
        "passed": err <= tol and ref_err <= ref_tol,
        "load_s": load_s,
        "forward_ms": forward_ms,
    }
