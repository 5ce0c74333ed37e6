"""Single-rank dispatchers: ``local`` (standard layout) and ``local_batched``.

``local`` only quantizes: the tokens already sit where the experts are.
``local_batched`` also regroups the (token, k) pairs into the batched layout
[E_l, M, H], M = the largest number of pairs any local expert receives (or a
fixed ``capacity`` for CUDA graphs, where an overflow raises instead of
dropping tokens).
"""

from __future__ import annotations

import torch

from ..errors import FusedMoEError
from ..experts.base import TokenLayout, WeightedReduce
from ..metadata import TopK
from ..quant import QTensor
from .base import Dispatched, Dispatcher


def reduce_topk(y: torch.Tensor, topk: TopK, reduce: WeightedReduce, on_input: bool) -> torch.Tensor:
    """[T, K, H] -> [T, H] in float32: the weighted (or plain) sum over K."""
    if reduce is WeightedReduce.WEIGHT_AND_SUM and not on_input:
        return torch.einsum("tkh,tk->th", y.float(), topk.weights.float())
    return y.float().sum(dim=1)


class LocalDispatcher(Dispatcher):
    name = "local"
    layout = TokenLayout.STANDARD
    note = "one rank: quantize only"

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None) -> Dispatched:
        a = self.quantize_input(x, topk, weights, a1_scale)
        return Dispatched(a=a, topk=topk, counts=None, num_tokens=x.shape[0])

    def output_shape(self, d, reduce):
        t, h = d.num_tokens, self.config.hidden_size
        return (t, h) if reduce is WeightedReduce.NONE else (t, d.topk.top_k, h)

    def combine(self, y, d, out, reduce):
        if reduce is WeightedReduce.NONE:
            out.copy_(y)
        else:
            out.copy_(reduce_topk(y, d.topk, reduce, self.config.apply_router_weight_on_input))


class LocalBatchedDispatcher(Dispatcher):
    name = "local_batched"
    layout = TokenLayout.BATCHED
    note = "one rank: quantize and regroup into [E, M, H]"

    def __init__(self, config, scheme, parallel=None, capacity: int | None = None):
        super().__init__(config, scheme, parallel)
        self.capacity = capacity

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None) -> Dispatched:
        t, k = topk.ids.shape
        a = self.quantize_input(x, topk, weights, a1_scale)
        e_local = weights.num_experts
        ids = topk.ids.long().reshape(-1)
        local = expert_map.long()[ids] if expert_map is not None else ids
        keep = (local >= 0).nonzero(as_tuple=True)[0]
        counts = torch.bincount(local[keep], minlength=e_local).to(torch.int32)
        need = int(counts.max()) if keep.numel() else 0
        cap = self.capacity if self.capacity is not None else max(need, 1)
        if need > cap:
            raise FusedMoEError(
                f"local_batched capacity: expected at most {cap} tokens per expert, "
                f"got {need}; raise the capacity (max_tokens_per_expert)"
            )
        # stable sort keeps each expert's pairs in token order (deterministic slots)
        order = keep[torch.sort(local[keep], stable=True).indices]
        exp_of = local[order]
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(order.numel(), device=x.device) - starts.long()[exp_of]
        tok = order // k
        pair_token = torch.full((e_local, cap), -1, dtype=torch.long, device=x.device)
        pair_flat = torch.full((e_local, cap), -1, dtype=torch.long, device=x.device)
        pair_token[exp_of, slot] = tok
        pair_flat[exp_of, slot] = order
        rows = pair_token.clamp(min=0).reshape(-1)
        data = a.data[rows].reshape(e_local, cap, *a.data.shape[1:])
        scale = None
        if a.scale is not None:
            # a per-tensor scale is shared; row-wise (token, group) scales travel with their rows
            shared = self.scheme.a1.granularity.kind == "tensor"
            scale = a.scale if shared else a.scale[rows].reshape(e_local, cap, -1)
        ab = QTensor(data, (e_local, cap, x.shape[1]), scale=scale, global_scale=a.global_scale)
        return Dispatched(a=ab, topk=topk, counts=counts, num_tokens=t, ctx=(pair_token, pair_flat))

    def output_shape(self, d, reduce):
        return (d.a.shape[0], d.a.shape[1], self.config.hidden_size)

    def combine(self, y, d, out, reduce):
        pair_token, pair_flat = d.ctx
        valid = (pair_token >= 0).reshape(-1).nonzero(as_tuple=True)[0]
        rows = y.reshape(-1, y.shape[-1])[valid].float()
        if reduce is WeightedReduce.WEIGHT_AND_SUM and not self.config.apply_router_weight_on_input:
            w = d.topk.weights.reshape(-1)[pair_flat.reshape(-1)[valid]].float()
            rows = rows * w.unsqueeze(1)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        acc.index_add_(0, pair_token.reshape(-1)[valid], rows)
        out.copy_(acc)
