"""``allgather_reducescatter``: the naive expert-parallel baseline (standard layout).

Every rank sees every token; its local experts compute their pairs; a
reduce-scatter sums the partial outputs back to the tokens' home ranks.
W ranks, rank r holds T_r tokens, every rank sends C rows::

    C         the token bound every rank shares (``EPDispatcher.token_bound``: the largest
              chunk agreed by MoEKernel.forward, or the workspace's capacity); without one,
              all_gather int64 [1] -> [W] token counts and C = max_r T_r (one host sync)
    dispatch  quantize x as scheme.a1            before the exchange (a per-tensor dynamic
                                                 scale: after, over all received rows)
              pack rows uint8 [C, B]             data (+ row scales) or x, wire ids int32 [K]
                                                 (1 + expert id), router weights fp32 [K];
                                                 rows T_r..C are zeros = padding (wire id 0)
              all_gather -> [W * C, B]           one collective, no host sync given C
    experts   [W * C, H] with the senders' top-k; padding rows get an expert of another rank
              (their experts skip them); the expert map skips other ranks' pairs
    combine   partial out [W * C, H] (model dtype)
              reduce_scatter (sum) -> [C, H] -> the first T_r rows are this rank's output

Bytes per rank: dispatch receives (W - 1) * C * B, combine moves W * C * H elements;
every rank computes on all W * C rows' local pairs. Nothing is compacted: padding rows
cost bytes but no expert work, and no kernel needs their positions.
"""

from __future__ import annotations

import torch

from ...contract import Dispatched, TokenLayout, Workspace, take
from .base import EPDispatcher
from .groups import all_gather_rows, reduce_scatter_rows


class AllGatherReduceScatterDispatcher(EPDispatcher):
    name = "allgather_reducescatter"
    layout = TokenLayout.STANDARD
    quantize_before_exchange = True
    seed_names = ("naive",)
    note = (
        "all-gather tokens, reduce-scatter outputs; torch.distributed (NCCL/gloo); no host sync given a token "
        "bound (MoEKernel), else one for the token counts"
    )

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        c = max(num_tokens, 1)
        b, h = self.declared_row_bytes(), self.config.hidden_size
        ws = super().workspace(num_tokens, num_local_experts)
        ws.shapes.update(
            send=((c, b), torch.uint8),
            recv=((self.world * c, b), torch.uint8),
            mine=((c, h), self.config.dtype),
        )
        return ws

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None, workspace=None) -> Dispatched:
        bound, fits, ws = self.start_dispatch(x, topk, weights, expert_map, workspace, need_map=True)
        dev, t, w, h = x.device, x.shape[0], self.world, self.config.hidden_size
        self.last_mode = "variable" if bound is None else "fixed"
        if bound is None:  # nothing shared: exchange the token counts (the host sync)
            counts = torch.empty(w, dtype=torch.int64, device=dev)
            all_gather_rows(counts, torch.full((1,), t, dtype=torch.int64, device=dev), self.group)
            bound = int(counts.max())
        c = max(bound, 1)
        before = self.quantizes_before()
        lay = self.row_layout(weights, dev)
        a = self.quantize_rows(x, topk, weights, a1_scale) if before else None
        send = take(ws, "send", (c, lay.row_bytes), torch.uint8, dev)
        send[t:].zero_()
        self.pack_rows(lay, send[:t], a, x, self.wire_ids(topk.ids), topk.weights, wire=True)
        recv = take(ws, "recv", (w * c, lay.row_bytes), torch.uint8, dev)
        all_gather_rows(recv, send, self.group)
        self.wire_bytes = (w * c * lay.row_bytes, w * c * h * x.element_size())
        a, tk = self.receive_rows(lay, recv, weights, a1_scale)
        return Dispatched(a=a, topk=tk, counts=None, num_tokens=w * c, ctx=(t, c, expert_map, ws))

    def combine(self, y, d, out, reduce):
        t, c, expert_map, ws = d.ctx
        part = self.local_pair_rows(y, d.topk, expert_map, reduce).to(out.dtype).contiguous()
        if t == c and out.is_contiguous():
            reduce_scatter_rows(out, part, self.group)  # straight into the output
            return
        mine = take(ws, "mine", (c, part.shape[1]), out.dtype, out.device)
        reduce_scatter_rows(mine, part, self.group)
        out.copy_(mine[:t])
