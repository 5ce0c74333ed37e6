"""``allgather_reducescatter``: the naive expert-parallel baseline (standard layout).

Every rank sees every token; its local experts compute their pairs; a
reduce-scatter sums the partial outputs back to the tokens' home ranks.
W ranks, rank r holds T_r tokens, T_max = max_r T_r, T_all = sum_r T_r::

    dispatch  all_gather int64 [1] -> [W]        token counts           (host sync: .tolist())
              quantize x as scheme.a1            before the exchange (a per-tensor dynamic
                                                 scale: after, over all T_all tokens)
              pack rows uint8 [T_max, B]         data (+ row scales) or x, topk ids int32 [K],
                                                 topk weights fp32 [K]; rows past T_r are padding
              all_gather -> [W * T_max, B]       drop the padding rows -> T_all rows
    experts   [T_all, H] with the global topk; the expert map skips other ranks' pairs
    combine   partial out [T_all, H] (model dtype), padded to [W * T_max, H] with zeros
              reduce_scatter (sum) -> [T_max, H] -> the first T_r rows are this rank's output

Bytes per rank: dispatch receives (W - 1) * T_max * B, combine moves W * T_max * H
elements; every rank computes on all T_all tokens' local pairs. Ranks whose T_max
is 0 skip both collectives together (they all know T_max).
"""

from __future__ import annotations

import torch

from ..distributed import EPDispatcher, RowLayout, all_gather_rows, reduce_scatter_rows
from ..experts.base import TokenLayout, WeightedReduce
from ..metadata import TopK
from .base import Dispatched


class AllGatherReduceScatterDispatcher(EPDispatcher):
    name = "allgather_reducescatter"
    layout = TokenLayout.STANDARD
    quantize_before_exchange = True
    seed_names = ("naive",)
    note = "all-gather tokens, reduce-scatter outputs; torch.distributed (NCCL/gloo); syncs the host once"

    def _layout(self, weights, device) -> RowLayout:
        fields, _, _ = self._template(weights, device)
        k = self.config.top_k
        return RowLayout([*fields, ("ids", torch.int32, (k,)), ("w", torch.float32, (k,))])

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None) -> Dispatched:
        self.check_inputs(x, topk, weights, expert_map, need_map=True)
        dev, t, w = x.device, x.shape[0], self.world
        counts = torch.empty(w, dtype=torch.int64, device=dev)
        all_gather_rows(counts, torch.tensor([t], dtype=torch.int64, device=dev), self.group)
        counts = counts.tolist()
        t_max = max(counts)
        before = self.quantizes_before()
        lay = self._layout(weights, dev)
        keep = None
        if any(c != t_max for c in counts):
            keep = torch.cat([torch.arange(r * t_max, r * t_max + c, device=dev) for r, c in enumerate(counts)])
        ctx = (counts, t_max, keep, expert_map)
        self.wire_bytes = (w * t_max * lay.row_bytes, w * t_max * self.config.hidden_size * x.element_size())
        if t_max == 0:
            a = self.quantize_rows(x, topk, weights, a1_scale)
            return Dispatched(a=a, topk=topk, counts=None, num_tokens=0, ctx=ctx)
        a = self.quantize_rows(x, topk, weights, a1_scale) if before else None
        send = lay.empty(t_max, dev)
        lay.pack(send[:t], ids=topk.ids.to(torch.int32), w=topk.weights.float(), **self.wire_tensors(a, x))
        recv = lay.empty(w * t_max, dev)
        all_gather_rows(recv, send, self.group)
        if keep is not None:
            recv = recv.index_select(0, keep)
        names = [n for n in lay.fields if n not in ("ids", "w")]
        parts = dict(zip(names, lay.unpack(recv, *names), strict=True))
        ids, tw = lay.unpack(recv, "ids", "w")
        tk = TopK(ids, tw)
        n = recv.shape[0]
        if before:
            a = self.received(parts, weights, (n, self.config.hidden_size))
        else:
            a = self.quantize_rows(parts["x"], tk, weights, a1_scale)
        return Dispatched(a=a, topk=tk, counts=None, num_tokens=n, ctx=ctx)

    def output_shape(self, d, reduce):
        h = self.config.hidden_size
        return (d.num_tokens, h) if reduce is WeightedReduce.NONE else (d.num_tokens, self.config.top_k, h)

    def combine(self, y, d, out, reduce):
        counts, t_max, keep, expert_map = d.ctx
        if t_max == 0:
            return
        part = self.local_pair_rows(y, d.topk, expert_map, reduce).to(out.dtype)
        if keep is not None:
            full = torch.zeros(self.world * t_max, part.shape[1], dtype=out.dtype, device=out.device)
            full.index_copy_(0, keep, part)
            part = full
        mine = torch.empty(t_max, part.shape[1], dtype=out.dtype, device=out.device)
        reduce_scatter_rows(mine, part.contiguous(), self.group)
        out.copy_(mine[: counts[self.rank]])
