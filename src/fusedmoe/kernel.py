"""``MoEKernel``: a Dispatcher composed with an Experts backend.

    out = combine(experts(dispatch(x)))   [+ shared_experts(x)]

Long inputs run in chunks of ``chunk_size`` tokens (default 16384, or
``FUSEDMOE_CHUNK_SIZE``) so the experts' workspace, which grows with T*K,
stays bounded. A per-tensor dynamic a1 scale is computed once over the whole
input and pinned for every chunk, so chunking does not change a1's
quantization; a per-tensor dynamic a2 scale is taken per chunk.

The weighted reduce happens where the experts say (``Experts.reduce``): inside
them, or in the dispatcher's combine. The shared-experts hook runs after the
experts and before combine, where a distributed dispatcher's communication
can overlap it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .errors import UnsupportedError, expect
from .experts.base import Experts, TokenLayout
from .metadata import TopK
from .quant import FORMATS
from .weights import ExpertWeights

DEFAULT_CHUNK_SIZE = 16384


class MoEKernel:
    def __init__(
        self,
        dispatcher,
        experts: Experts,
        *,
        chunk_size: int | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if dispatcher.layout is not experts.layout:
            raise UnsupportedError(
                f"dispatcher '{dispatcher.name}' produces the {dispatcher.layout.value} token layout "
                f"but experts '{experts.name}' take {experts.layout.value}"
            )
        self.dispatcher = dispatcher
        self.experts = experts
        self.config = experts.config
        self.scheme = experts.scheme
        env = os.environ.get("FUSEDMOE_CHUNK_SIZE")
        size = chunk_size or (int(env) if env else DEFAULT_CHUNK_SIZE)
        expect(size > 0, "chunk_size", "a positive number of tokens", size)
        self.chunk_size = size if experts.capabilities.chunking else None
        self.shared_experts = shared_experts

    def _pinned_a1_scale(self, x: torch.Tensor, t: int) -> torch.Tensor | None:
        tq = self.scheme.a1
        if tq is None or not tq.dynamic or tq.granularity.kind != "tensor":
            return None
        if self.chunk_size is None or t <= self.chunk_size:
            return None
        return FORMATS[tq.dtype].scale_for(x, tq)

    def forward(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        *,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H] routed by ``topk`` -> [T, H] in x's dtype."""
        t = x.shape[0]
        out = torch.empty_like(x)
        distributed = self.dispatcher.distributed
        if t == 0 and not distributed:
            return out
        step = self.chunk_size or max(t, 1)
        n_chunks = -(-t // step)
        if distributed:
            # every rank must join every collective: a rank with fewer (or no) tokens
            # runs empty chunks until the rank with the most tokens is done
            n_chunks = self.dispatcher.agree_num_chunks(max(n_chunks, 1))
        a1_scale = self._pinned_a1_scale(x, t)
        for c in range(n_chunks):
            s = min(c * step, t)
            e = min(t, s + step)
            xc = x[s:e]
            tk = TopK(topk.ids[s:e], topk.weights[s:e])
            d = self.dispatcher.dispatch(xc, tk, weights, expert_map=expert_map, a1_scale=a1_scale)
            y = torch.empty(self.dispatcher.output_shape(d, self.experts.reduce), dtype=x.dtype, device=x.device)
            if self.experts.layout is TokenLayout.STANDARD:
                self.experts.apply(d.a, d.topk, weights, y, expert_map=expert_map)
            else:
                self.experts.apply_batched(d.a, d.counts, weights, y)
            shared = self.shared_experts(xc) if self.shared_experts is not None else None
            self.dispatcher.combine(y, d, out[s:e], self.experts.reduce)
            if shared is not None:
                out[s:e] += shared
        return out

    __call__ = forward
