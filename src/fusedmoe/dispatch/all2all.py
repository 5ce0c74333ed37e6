"""``all2all``: routed expert parallelism with variable sizes (standard layout, high throughput).

Each token travels only to the ranks that own at least one of its K experts,
once per rank, with its whole top-k row (the experts there skip the pairs of
other ranks through the expert map). W ranks, rank r holds T tokens::

    dispatch  hit [T, W] bool = rank owns one of the token's experts
              all_to_all_single int64 [W] -> [W]     rows to send / to receive per rank
                                                     (host sync: the split sizes, one .tolist())
              pack rows uint8 [S, B], S = hit.sum()  grouped by destination rank, tokens in order:
                                                     x in the model dtype (quantized after the
                                                     exchange, the default), or data + row scales
                                                     for group/block-quantized a1 (quantized before:
                                                     about half the bytes), + topk ids int32 [K]
                                                     + topk weights fp32 [K]
              all_to_all_single, uneven splits -> uint8 [R, B]
    experts   [R, H] with the senders' topk; expert map = this rank's experts
    combine   partial out [R, H] (model dtype, summed over this rank's pairs)
              all_to_all_single with the splits swapped -> [S, H]
              out[t] = sum over the ranks t went to (fp32 index_add, one rounding)

Quantizing after the exchange: a per-token scale is the same either way; a
per-tensor dynamic scale is taken over the rows each rank receives (not over
all tokens, as the single-rank reference does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import EPDispatcher, RowLayout, nonempty
from ..experts.base import TokenLayout, WeightedReduce
from ..metadata import TopK
from .base import Dispatched


class All2AllDispatcher(EPDispatcher):
    name = "all2all"
    layout = TokenLayout.STANDARD
    quantize_before_exchange = False
    note = (
        "routed all_to_all_single with uneven splits over torch.distributed; a1 quantized after the exchange, "
        "before it for group/block scales; syncs the host for the split sizes"
    )

    def quantizes_before(self) -> bool:
        tq = self.scheme.a1
        return tq is not None and tq.granularity.kind in ("group", "block")

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None) -> Dispatched:
        self.check_inputs(x, topk, weights, expert_map, need_map=True)
        dev, t, w = x.device, x.shape[0], self.world
        owner = self.placement.owner_tensor(dev)[topk.ids.long()]
        hit = torch.zeros(t, w, dtype=torch.bool, device=dev)
        hit.scatter_(1, owner, True)
        send_counts = hit.sum(dim=0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = torch.stack([send_counts, recv_counts]).tolist()
        tok = hit.t().nonzero(as_tuple=True)[1]
        before = self.quantizes_before()
        fields, _, _ = self._template(weights, dev)
        k = self.config.top_k
        lay = RowLayout([*fields, ("ids", torch.int32, (k,)), ("w", torch.float32, (k,))])
        a = self.quantize_rows(x, topk, weights, a1_scale) if before else None
        rows = lay.pack(
            lay.empty(t, dev), ids=topk.ids.to(torch.int32), w=topk.weights.float(), **self.wire_tensors(a, x)
        )
        send = lay.empty(tok.numel(), dev)
        torch.index_select(rows, 0, tok, out=send)  # as bytes: index_select has no fp8 kernels everywhere
        self.wire_bytes = (sum(sc) * lay.row_bytes, sum(rc) * self.config.hidden_size * x.element_size())
        recv = lay.empty(sum(rc), dev)
        dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc, group=self.group)
        names = [n for n in lay.fields if n not in ("ids", "w")]
        parts = dict(zip(names, lay.unpack(recv, *names), strict=True))
        tk = TopK(*lay.unpack(recv, "ids", "w"))
        n = recv.shape[0]
        if before:
            a = self.received(parts, weights, (n, self.config.hidden_size))
        else:
            a = self.quantize_rows(parts["x"], tk, weights, a1_scale)
        return Dispatched(a=a, topk=tk, counts=None, num_tokens=n, ctx=(tok, sc, rc, t, expert_map))

    def output_shape(self, d, reduce):
        h = self.config.hidden_size
        return (d.num_tokens, h) if reduce is WeightedReduce.NONE else (d.num_tokens, self.config.top_k, h)

    def combine(self, y, d, out, reduce):
        tok, sc, rc, t, expert_map = d.ctx
        part = nonempty(self.local_pair_rows(y, d.topk, expert_map, reduce).contiguous())
        back = nonempty(torch.empty(sum(sc), part.shape[1], dtype=part.dtype, device=part.device))
        dist.all_to_all_single(back, part, output_split_sizes=sc, input_split_sizes=rc, group=self.group)
        acc = torch.zeros(t, part.shape[1], dtype=torch.float32, device=out.device)
        acc.index_add_(0, tok, back.float())
        out.copy_(acc)
