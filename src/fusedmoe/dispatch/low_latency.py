"""``all2all_low_latency``: fixed-capacity expert parallelism (batched layout, CUDA-graph capturable).

Every buffer size follows from the layer and ``capacity`` C (rows per local
expert per source rank), so nothing waits for the host: no split-size
exchange, no ``.item()``, no shape that depends on the routing. W ranks,
E_r experts on rank r, E_l on this one, T tokens here, K top-k::

    dispatch  quantize x as scheme.a1 at the source (before the exchange; fp8 per
              token or 1x128 blocks send ~H bytes + scales instead of 2H; a per-tensor
              dynamic scale is instead taken after, over the rows each rank receives)
              slot of each (token, k) pair = its rank among this rank's pairs for that
              expert (stable sort); slot >= C overflows (not sent; see below)
              send uint8 [sum_r E_r * C, B]: the chunk for rank r is E_r buckets of C rows;
              row = quantized data (+ row scales) | int32 header (bucket count, need)
              all_to_all_single, fixed splits [E_r * C] -> recv [W, E_l, C, B]
              compact each local expert's rows from all sources (device-side index):
              a [E_l, W * C, H] with counts int32 [E_l]
    experts   batched layout; output [E_l, W * C, H], unweighted
    combine   gather each received slot's output row, all_to_all_single back (fixed
              splits, model dtype), out[t] = sum_k w[t, k] * row(t, k) in fp32
              (WeightedReduce.WEIGHT_AND_SUM: the router weight is applied here)

Overflow: each row's header carries its sender's largest bucket (``need``), so
after the exchange every rank knows the largest count any (expert, source rank)
needed. ``needed`` (int32 [1], on the device) keeps the maximum seen; with
``raise_on_overflow`` (default) an eager dispatch reads it (one host sync) and
every rank raises the same ``FusedMoEError`` naming the capacity and the count
needed; under CUDA-graph capture nothing is read and ``check_capacity()``
raises after a replay. Pairs past the capacity are never silently lost: they
are either reported this way or the caller has opted out and checks the flag.

Memory: send and receive buffers of E * C and W * E_l * C rows of B bytes
(DeepSeek-V3, E 256, C 128: B = 7408 with fp8 1x128 blocks, 230 MiB each; 14352
in bf16, 450 MiB each); a bound T <= C on the tokens per rank guarantees no
overflow (a token picks an expert at most once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import EPDispatcher, RowLayout, _capturing
from ..errors import FusedMoEError, expect
from ..experts.base import TokenLayout, WeightedReduce
from ..metadata import TopK
from ..quant import QTensor
from .base import Dispatched

DEFAULT_CAPACITY = 128


class All2AllLowLatencyDispatcher(EPDispatcher):
    name = "all2all_low_latency"
    layout = TokenLayout.BATCHED
    quantize_before_exchange = True
    note = (
        "fixed capacity per (expert, source rank), all_to_all_single of fixed chunks, no host sync "
        "(CUDA-graph capturable); quantized before the exchange; overflow raises"
    )

    def __init__(
        self,
        config,
        scheme,
        parallel=None,
        *,
        group=None,
        capacity: int = DEFAULT_CAPACITY,
        raise_on_overflow: bool = True,
        verify: bool = True,
    ) -> None:
        expect(
            isinstance(capacity, int) and capacity > 0,
            "capacity",
            "a positive number of rows per (local expert, source rank)",
            capacity,
        )
        self.capacity = capacity
        self.raise_on_overflow = raise_on_overflow
        super().__init__(config, scheme, parallel, group=group, verify=verify)
        self.needed = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._tables: dict = {}

    def options(self) -> dict:
        return {"capacity": self.capacity}

    def max_tokens_per_rank(self, num_tokens: int) -> int:
        return self.world * self.capacity

    # ---- static tables -------------------------------------------------------
    def _static(self, device):
        """Device tables that depend only on the placement and the capacity (built once per device)."""
        if device not in self._tables:
            c, p = self.capacity, self.placement
            first = [sum(p.local_counts[:r]) for r in range(self.world)]  # first bucket of each rank
            bucket = [first[p.owner[e]] + p.local_id[e] for e in range(p.num_experts)]
            bucket_expert = sorted(range(p.num_experts), key=lambda e: bucket[e])
            base = torch.tensor(bucket, dtype=torch.long, device=device) * c
            row_expert = torch.tensor(bucket_expert, dtype=torch.long, device=device).repeat_interleave(c)
            e_l = self.num_local_experts
            loc = torch.arange(e_l, device=device).view(1, e_l, 1)
            slot = torch.arange(c, device=device).view(1, 1, c)
            self._tables[device] = (base, row_expert, loc, slot)
        return self._tables[device]

    def _layout(self, weights, device) -> RowLayout:
        fields, _, _ = self._template(weights, device)
        return RowLayout([*fields, ("hdr", torch.int32, (2,))])

    # ---- dispatch -----------------------------------------------------------
    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None) -> Dispatched:
        self.check_inputs(x, topk, weights, expert_map, need_map=False)
        dev = x.device
        t, k = topk.ids.shape
        c, w, e_l, e = self.capacity, self.world, self.num_local_experts, self.config.num_experts
        base, row_expert, loc, slot_r = self._static(dev)
        n_send, n_recv, m = e * c, w * e_l * c, w * c
        lay = self._layout(weights, dev)
        before = self.quantizes_before()

        # (token, k) pairs -> send rows; overflowing pairs go to the dump row n_send
        pe = topk.ids.reshape(-1).long()
        counts = torch.zeros(e, dtype=torch.long, device=dev).scatter_add_(0, pe, torch.ones_like(pe))
        order = torch.sort(pe, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(pe).scatter_(0, order, torch.arange(pe.numel(), device=dev) - starts[pe[order]])
        row = torch.where(slot < c, base[pe] + slot, n_send)
        need = counts.max()

        x_send = x
        if not before and self.config.apply_router_weight_on_input:
            x_send = (x.float() * topk.weights.reshape(-1, 1)).to(x.dtype)  # K == 1
        a = self.quantize_rows(x, topk, weights, a1_scale) if before else None
        tok_rows = lay.pack(lay.empty(t, dev), **self.wire_tensors(a, x_send))
        send = lay.empty(n_send + 1, dev)
        send[row] = tok_rows[torch.arange(t * k, device=dev) // k]
        send = send[:n_send]
        hdr = lay.view(send, "hdr")
        hdr[:, 0] = counts.clamp(max=c)[row_expert].to(torch.int32)
        hdr[:, 1] = need.to(torch.int32)
        self.wire_bytes = (n_send * lay.row_bytes, n_recv * self.config.hidden_size * x.element_size())
        recv = lay.empty(n_recv, dev)
        splits_in = [n * c for n in self.placement.local_counts]
        dist.all_to_all_single(
            recv, send, output_split_sizes=[e_l * c] * w, input_split_sizes=splits_in, group=self.group
        )

        # compact: (source, local expert, slot) -> row of the batched layout, or the dump row e_l * m
        rh = lay.view(recv, "hdr").view(w, e_l, c, 2)
        n_se = rh[:, :, 0, 0].long()
        need_all = rh[:, :, 0, 1].max().to(torch.int32).reshape(1)
        torch.maximum(self.needed, need_all, out=self.needed)
        if self.raise_on_overflow and not _capturing(dev):
            self.check_capacity(need_all)
        off = torch.cumsum(n_se, 0) - n_se
        dest = torch.where(slot_r < n_se.unsqueeze(-1), loc * m + off.unsqueeze(-1) + slot_r, e_l * m).reshape(-1)
        parts = {}
        for f in lay.fields.values():
            if f.name == "hdr":
                continue
            buf = torch.zeros(e_l * m + 1, f.nbytes, dtype=torch.uint8, device=dev)
            buf[dest] = lay.raw(recv, f.name)  # moved as bytes: index_put has no fp8 kernels everywhere
            parts[f.name] = buf[: e_l * m].view(f.dtype).view(e_l, m, *f.shape)
        h = self.config.hidden_size
        if before:
            a = self.received(parts, weights, (e_l, m, h))
        else:
            rows = e_l * m  # the router weight was applied at the source: quantize with weight 1
            plain = TopK(torch.zeros(rows, k, dtype=torch.int32, device=dev), torch.ones(rows, k, device=dev))
            q = self.quantize_rows(parts["x"].view(rows, h), plain, weights, a1_scale)
            scale = q.scale.view(e_l, m, -1) if q.scale is not None and self._row_scales() else q.scale
            a = QTensor(q.data.view(e_l, m, *q.data.shape[1:]), (e_l, m, h), scale=scale, global_scale=q.global_scale)
        counts_local = n_se.sum(dim=0).to(torch.int32)
        return Dispatched(a=a, topk=topk, counts=counts_local, num_tokens=t, ctx=(row.view(t, k), dest))

    def check_capacity(self, needed: torch.Tensor | None = None) -> None:
        """Raise if any (expert, source rank) needed more rows than the capacity (reads the flag: a host sync)."""
        got = int((self.needed if needed is None else needed).max())
        if got > self.capacity:
            raise FusedMoEError(
                f"all2all_low_latency capacity: expected at most capacity={self.capacity} pairs per (expert, source "
                f"rank), but one needed {got}; pairs past the capacity were not sent. Construct the dispatcher with "
                f"capacity >= {got} (capacity >= tokens per rank always suffices)"
            )

    def output_shape(self, d, reduce):
        return (d.a.shape[0], d.a.shape[1], self.config.hidden_size)

    # ---- combine -----------------------------------------------------------------
    def combine(self, y, d, out, reduce):
        row, dest = d.ctx
        e_l, m, h = y.shape
        n_send = self.config.num_experts * self.capacity
        back_send = y.reshape(e_l * m, h).index_select(0, dest.clamp(max=e_l * m - 1))
        back = torch.empty(n_send + 1, h, dtype=y.dtype, device=y.device)
        back[n_send].zero_()
        splits = [n * self.capacity for n in self.placement.local_counts]
        dist.all_to_all_single(
            back[:n_send],
            back_send,
            output_split_sizes=splits,
            input_split_sizes=[e_l * self.capacity] * self.world,
            group=self.group,
        )
        weighted = reduce is WeightedReduce.WEIGHT_AND_SUM and not self.config.apply_router_weight_on_input
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for j in range(row.shape[1]):
            part = back.index_select(0, row[:, j]).float()
            acc += part * d.topk.weights[:, j : j + 1].float() if weighted else part
        out.copy_(acc)
