"""``fusedmoe::moe_forward``: one MoE layer as a torch.library custom op, for ``torch.compile``.

    MoEKernel.forward(x, topk, weights)
      eager:      the launchers, called directly (no dispatcher in between)
      compiling:  torch.ops.fusedmoe.moe_forward(name, x, topk_ids, topk_weights,
                                                 <weight tensors>, expert_map, ...)

Dynamo cannot trace the kernels (Triton launches, host-side planning), so while it
compiles, ``MoEKernel.forward`` emits this op instead; its fake implementation gives
the output's shape and strides, so ``torch.compile(fullgraph=True)`` sees the layer as
one node with no graph break. In eager mode the op is never called: going through the
dispatcher costs tens of microseconds, as long as a whole decode step of weight reads.

The op takes plain tensors only: x, the routing and every field of ``ExpertWeights``
(the ``QTensor`` fields of W13 and W2 flattened, None where absent) plus the logical
weight shapes. Everything else (dispatcher, experts backend, chunk size, workspace)
lives in the ``MoEKernel`` named by the string argument: each kernel registers itself
here under a unique name when it is built. The registry holds weak references, so a
kernel lives as long as its owner (a ``FusedMoE`` layer) and a compiled graph must not
outlive the module it was compiled from.
"""

import itertools
import weakref

import torch

from ..errors import expect
from ..metadata import TopK
from ..quant import QTensor
from ..quant.w4_layout import LAYOUT as W4_LAYOUT
from ..quant.w4_layout import as_w4
from ..weights import ExpertWeights

_KERNELS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


def register_kernel(kernel, name: str | None = None) -> str:
    """Register ``kernel`` (a ``MoEKernel``) under ``name`` (or a fresh unique one); returns the name."""
    if name is None:
        name = f"moe{next(_SERIAL)}_{kernel.experts.name}"
    expect(name not in _KERNELS, "MoEKernel name", "a name no live kernel uses", name)
    _KERNELS[name] = kernel
    return name


def registered_kernel(name: str):
    """The live ``MoEKernel`` registered as ``name``."""
    kernel = _KERNELS.get(name)
    expect(
        kernel is not None,
        "MoEKernel name",
        "the name of a live kernel (its layer, or fused_moe's kernel cache, still holds it)",
        name,
    )
    return kernel


@torch.library.custom_op("fusedmoe::moe_forward", mutates_args=())
def moe_forward(
    kernel: str,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w13_zero: torch.Tensor | None,
    w13_global_scale: torch.Tensor | None,
    w13_g_idx: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    w2_zero: torch.Tensor | None,
    w2_global_scale: torch.Tensor | None,
    w2_g_idx: torch.Tensor | None,
    w13_perm: torch.Tensor | None,
    w2_perm: torch.Tensor | None,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    a1_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    a1_global_scale: torch.Tensor | None,
    a2_global_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    w13_shape: list[int],
    w2_shape: list[int],
    layout: str,
) -> torch.Tensor:
    """The routed experts of the ``MoEKernel`` named ``kernel``: x [T, H] -> [T, H] in x's dtype.

    Shared experts are not part of the op: the compiled graph adds them (so Dynamo traces them).
    """
    k = registered_kernel(kernel)
    q13 = QTensor(w13, tuple(w13_shape), w13_scale, w13_zero, w13_global_scale, w13_g_idx)
    q2 = QTensor(w2, tuple(w2_shape), w2_scale, w2_zero, w2_global_scale, w2_g_idx)
    if layout == W4_LAYOUT:  # converted at load: the 4-bit kernel needs its layout's metadata back
        q13, q2 = as_w4(q13, k.scheme.w1, w13_perm), as_w4(q2, k.scheme.w2, w2_perm)
    weights = ExpertWeights(q13, q2, b13, b2, a1_scale, a2_scale, a1_global_scale, a2_global_scale, layout)
    return k.forward_eager(x, TopK(topk_ids, topk_weights), weights, expert_map=expert_map, shared=False)


@moe_forward.register_fake
def _moe_forward_fake(kernel, x, *args, **kwargs) -> torch.Tensor:
    # MoEKernel.forward returns torch.empty_like(x), filled: same shape, dtype and strides
    return torch.empty_like(x)


def moe_forward_args(
    name: str, x: torch.Tensor, topk: TopK, weights: ExpertWeights, expert_map: torch.Tensor | None
) -> tuple:
    """The arguments of ``torch.ops.fusedmoe.moe_forward`` for one ``MoEKernel`` call, in order."""
    return (
        name,
        x,
        topk.ids,
        topk.weights,
        *weight_tensors(weights),
        expert_map,
        list(weights.w13.shape),
        list(weights.w2.shape),
        weights.layout,
    )


def weight_tensors(weights: ExpertWeights) -> tuple:
    """Every tensor field of ``weights`` (None where absent), in ``moe_forward``'s order: the
    ``QTensor`` fields of W13, then W2's, the two 4-bit permutations, then the extras. Written out
    field by field: it runs on every eager call (``MoEKernel`` launch plans key on it)."""
    a, b, w = weights.w13, weights.w2, weights
    return (
        a.data, a.scale, a.zero, a.global_scale, a.g_idx,
        b.data, b.scale, b.zero, b.global_scale, b.g_idx,
        getattr(a, "perm", None), getattr(b, "perm", None),
        w.b13, w.b2, w.a1_scale, w.a2_scale, w.a1_global_scale, w.a2_global_scale,
    )  # fmt: skip


def call_moe_forward(
    name: str, x: torch.Tensor, topk: TopK, weights: ExpertWeights, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """``torch.ops.fusedmoe.moe_forward`` on a kernel call's arguments (what a compiled graph records)."""
    return torch.ops.fusedmoe.moe_forward(*moe_forward_args(name, x, topk, weights, expert_map))
