"""What dispatchers, experts and the composer agree on.

    x [T, H] --Dispatcher.dispatch--> Dispatched --Experts.apply--> y --Dispatcher.combine--> out

- ``TokenLayout``: the token layout a dispatcher produces and an Experts backend takes
  (standard [T, H] + top-k ids, or batched [E_local, M, H] + counts).
- ``WeightedReduce``: where the top-k weighting and the sum over K happen (inside the experts,
  or in the combine).
- ``Dispatched``: what the experts receive.
- ``Workspace``: the buffers a stage declares up front from the shapes, so that
  ``MoEKernel.allocate`` can create them once (CUDA graphs replay on fixed addresses).
- ``take``: a stage's view of a declared buffer, or a fresh tensor when there is none.
- ``quantized_layout``: the workspace shapes of a quantized activation.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .metadata import TopK
from .quant import QTensor, TensorQuant, quantize


class TokenLayout(str, enum.Enum):
    STANDARD = "standard"  # [T, H] + topk ids
    BATCHED = "batched"  # [E_local, max_tokens, H] + counts

    def __repr__(self) -> str:
        return f"TokenLayout.{self.name}"


class WeightedReduce(str, enum.Enum):
    """Where the top-k weighting and the sum over K happen."""

    NONE = "none"  # inside the experts: their output is already [T, H]
    SUM = "sum"  # experts applied the router weight (GEMM2 epilogue); combine sums over K
    WEIGHT_AND_SUM = "weight_and_sum"  # combine multiplies by the router weight and sums


@dataclass
class Workspace:
    """Buffers an Experts run needs, declared up front from the shapes."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
        return total

    def allocate(self, device) -> dict[str, torch.Tensor]:
        return {k: torch.empty(s, dtype=d, device=device) for k, (s, d) in self.shapes.items()}


@dataclass
class Dispatched:
    """What the experts receive.

    a:        activations (QTensor: quantized as scheme.a1, or model dtype in ``data``);
              [T', H] for the standard layout, [E_l, M, H] for the batched one.
    topk:     routing of the rows of ``a`` (standard layout).
    counts:   int32 [E_l] valid rows per expert (batched layout).
    ctx:      whatever combine needs to bring results home.
    """

    a: QTensor
    topk: TopK | None
    counts: torch.Tensor | None
    num_tokens: int
    ctx: Any = None


def take(
    buffers: dict[str, torch.Tensor] | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    """A contiguous ``shape`` view of the front of ``buffers[name]``; a new tensor when there is no
    such buffer or it is too small (more tokens than allocated for) or of another dtype or device."""
    n = math.prod(shape)
    buf = None if buffers is None else buffers.get(name)
    if buf is not None and buf.dtype == dtype and buf.device == device and buf.numel() >= n:
        return buf.view(-1)[:n].view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def quantized_layout(
    name: str, tq: TensorQuant | None, rows: int, cols: int, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Workspace shapes of ``rows`` rows of ``cols`` values quantized as ``tq`` (the model dtype when
    None): ``name`` for the data and, for scales computed per call, ``name_scale`` ([1, 1] for a
    per-tensor one). Read off one quantized row, so they are what the quantizers produce."""
    if tq is None:
        return {name: ((rows, cols), dtype)}
    one = torch.ones(1, 1)
    q = quantize(
        torch.zeros(1, cols, dtype=dtype),
        tq,
        scale=None if tq.dynamic else one,
        global_scale=one if tq.has_global_scale else None,
    )
    out = {name: ((rows, *q.data.shape[1:]), q.data.dtype)}
    if tq.dynamic:
        per_tensor = tq.granularity.kind == "tensor"
        out[f"{name}_scale"] = ((1, 1) if per_tensor else (rows, *q.scale.shape[1:]), q.scale.dtype)
    return out
