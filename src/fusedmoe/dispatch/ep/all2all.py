"""``all2all``: routed expert parallelism (standard layout, high throughput).

Each token travels only to the ranks that own at least one of its K experts,
once per rank, with its whole top-k row (the experts there skip the pairs of
other ranks through the expert map). W ranks, rank r holds T tokens; a wire
row is uint8 [B] = x in the model dtype (quantized after the exchange, the
default) or data + row scales for group/block-quantized a1 (quantized before:
about half the bytes), + wire ids int32 [K] (1 + expert id; 0 = padding) +
router weights fp32 [K]::

    dispatch  route: dest int64 [T, W] = the send row of token t for rank r, or -1
                     (hit, cumsum over tokens, + each rank's block start: 4 kernels)
              pack the T wire rows, scatter_rows into the send buffer (one kernel)
              fixed blocks (a token bound C is known, see below): send uint8 [W * C, B],
                     zeroed first, so unused rows are padding (wire ids 0, x 0);
                     one all_to_all_single, equal splits; no host sync, graph-capturable
              variable blocks (no bound): all_to_all_single of the counts int64 [W],
                     then one read of them to the host (the sync), then the rows
                     (uneven splits; the packing is issued before the sync, so it overlaps)
              -> recv [R, B]: R = W * C (fixed) or the rows sent here (variable)
    experts   [R, H] with the senders' top-k; padding rows get an expert of another rank,
              so the experts skip them; the expert map = this rank's experts
    combine   partial out [R, H] (model dtype, summed over this rank's pairs)
              all_to_all_single back (the same splits swapped) -> back [rows sent, H]
              out[t] = sum over r of back[dest[t, r]] (gather_sum: fp32, ranks in order,
              one rounding; one kernel)

The token bound C is ``EPDispatcher.token_bound``: under ``MoEKernel.forward`` the
largest chunk of any rank (agreed in its one all-reduce per forward) when the workspace
of ``MoEKernel.allocate(max_tokens)`` holds it, else the workspace's capacity (a direct
call or a CUDA graph: each rank must stay within it). Without a workspace the exchange
is variable: fixed blocks move W * C rows where variable ones move only the hits (at
EP4 with 64 of 256 experts per rank and K 8, a token reaches 3.6 ranks on average, so
the padding costs ~10%; with sparse routing it could cost W times the bytes).

Quantizing after the exchange: a per-token scale is the same either way; a
per-tensor dynamic scale is taken over the rows each rank receives (not over
all tokens, as the single-rank reference does); padding rows are zeros, so they
do not change it.
"""

from __future__ import annotations

import torch

from ...contract import Dispatched, TokenLayout, Workspace, take
from ...errors import expect
from ...kernels.rows import as_words, gather_sum, scatter_rows
from .base import EPDispatcher, _capturing
from .groups import all_to_all_rows, nonempty


class All2AllDispatcher(EPDispatcher):
    name = "all2all"
    layout = TokenLayout.STANDARD
    quantize_before_exchange = False
    note = (
        "routed all_to_all_single over torch.distributed; a1 quantized after the exchange, before it for "
        "group/block scales; fixed blocks without a host sync given a token bound (MoEKernel.allocate), "
        "else uneven splits after a count exchange (one host sync)"
    )

    def quantizes_before(self) -> bool:
        tq = self.scheme.a1
        return tq is not None and tq.granularity.kind in ("group", "block")

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        n = self.world * max(num_tokens, 1)
        b, h = self.declared_row_bytes(), self.config.hidden_size
        ws = super().workspace(num_tokens, num_local_experts)
        ws.shapes.update(
            rows=((num_tokens, b), torch.uint8),
            send=((n, b), torch.uint8),
            recv=((n, b), torch.uint8),
            back=((n, h), self.config.dtype),
        )
        return ws

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None, workspace=None) -> Dispatched:
        bound, fits, ws = self.start_dispatch(x, topk, weights, expert_map, workspace, need_map=True)
        dev, t, w, h = x.device, x.shape[0], self.world, self.config.hidden_size
        before = self.quantizes_before()
        lay = self.row_layout(weights, dev)
        a = self.quantize_rows(x, topk, weights, a1_scale) if before else None
        ids = self.wire_ids(topk.ids)
        if fits:
            c = max(bound, 1)
            dest, _ = self.route(ids, c, wire=True)
            n_send = n_recv = w * c
            send = take(ws, "send", (n_send, lay.row_bytes), torch.uint8, dev).zero_()
            splits = None
        else:
            expect(
                not _capturing(dev),
                "workspace",
                "MoEKernel.allocate(max_tokens) before capturing all2all in a CUDA graph (fixed-size exchange)",
                None,
            )
            dest, counts = self.route(ids, None, wire=True)
            recv_counts = torch.empty_like(counts)
            all_to_all_rows(recv_counts, counts, self.group)
            send = lay.empty(t * w, dev)  # an upper bound: packed before the counts reach the host
        rows = take(ws, "rows", (t, lay.row_bytes), torch.uint8, dev)
        rows = self.pack_rows(lay, rows, a, x, ids, topk.weights, wire=True)
        scatter_rows(as_words(rows), dest, as_words(send))
        if not fits:
            sc, rc = torch.stack([counts, recv_counts]).tolist()  # the host sync of the variable path
            n_send, n_recv, splits = sum(sc), sum(rc), (sc, rc)
            send = nonempty(send[:n_send])
        recv = nonempty(take(ws, "recv", (n_recv, lay.row_bytes), torch.uint8, dev))
        all_to_all_rows(recv, send, self.group, splits)
        self.last_mode = "fixed" if fits else "variable"
        self.wire_bytes = (n_send * lay.row_bytes, n_recv * h * x.element_size())
        a, tk = self.receive_rows(lay, recv, weights, a1_scale)
        ctx = (dest, splits, n_send, expert_map, ws)
        return Dispatched(a=a, topk=tk, counts=None, num_tokens=n_recv, ctx=ctx)

    def combine(self, y, d, out, reduce):
        dest, splits, n_send, expert_map, ws = d.ctx
        part = nonempty(self.local_pair_rows(y, d.topk, expert_map, reduce).contiguous())
        back = nonempty(take(ws, "back", (n_send, part.shape[1]), part.dtype, part.device))
        all_to_all_rows(back, part, self.group, None if splits is None else splits[::-1])  # the way back
        gather_sum(back, dest, out)
