"""Single-rank dispatchers: ``local`` (standard layout) and ``local_batched``.

``local`` only quantizes: the tokens already sit where the experts are.
``local_batched`` also regroups the (token, k) pairs into the batched layout
[E_l, M, H], M = the largest number of pairs any local expert receives (one
host sync to read it), or a fixed ``capacity`` for CUDA graphs: then no shape
depends on the routing and nothing waits for the host except the overflow check
of an eager call (an overflow raises; under capture, see ``check_capacity``).
Given a workspace (``MoEKernel.allocate``), the slot tables and the batched
activations are written into it.
"""

from __future__ import annotations

import torch

from ..contract import Dispatched, TokenLayout, WeightedReduce, Workspace, quantized_layout, take
from ..errors import FusedMoEError, expect
from ..kernels._common import interpreting
from ..metadata import TopK, local_expert_ids
from ..quant import QTensor
from .base import Dispatcher


def reduce_topk(y: torch.Tensor, topk: TopK, reduce: WeightedReduce, on_input: bool) -> torch.Tensor:
    """[T, K, H] -> [T, H] in float32: the weighted (or plain) sum over K."""
    if reduce is WeightedReduce.WEIGHT_AND_SUM and not on_input:
        return torch.einsum("tkh,tk->th", y.float(), topk.weights.float())
    return y.float().sum(dim=1)


class LocalDispatcher(Dispatcher):
    name = "local"
    layout = TokenLayout.STANDARD
    note = "one rank: quantize only"

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None, quantized=None) -> Dispatched:
        """``quantized``: x as ``input_quantization``'s launch made it (not made again here)."""
        a = self.quantize_input(x, topk, weights, a1_scale) if quantized is None else quantized
        return Dispatched(a=a, topk=topk, counts=None, num_tokens=x.shape[0])

    def input_quantization(self, x, weights):
        """One pass over x on a GPU (or the interpreter) that needs no routing: not with the router
        weight applied on the input, nor a per-tensor dynamic scale of more than one tile
        (``act_quant.plan_act_quant``: an abs-max pass first); x's scheme unquantized: nothing."""
        tq = self.scheme.a1
        if tq is None or self.config.apply_router_weight_on_input or not (x.is_cuda or interpreting()):
            return None
        from ..kernels.act_quant import one_pass, plan_act_quant

        static = weights.act_scales("a1", tq)
        if x.dim() != 2 or not one_pass(x.shape[0], x.shape[1], tq, static.get("scale")):
            return None  # decided before plan_act_quant allocates (a declined plan's buffers would be recorded)
        return plan_act_quant(x, tq, **static)

    def writes_output(self, reduce):
        # one rank, experts that weight and sum: their [T, H] output is the answer. Without this
        # the combine copied it (one launch at T=1; 151 us at T=16384, DeepSeek-V3 bf16, H100)
        return reduce is WeightedReduce.NONE

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

    def __init__(self, config, scheme, parallel=None, capacity: int | None = None, *, raise_on_overflow: bool = True):
        super().__init__(config, scheme, parallel)
        expect(capacity is None or capacity > 0, "capacity", "None or a positive number of rows per expert", capacity)
        self.capacity = capacity
        self.raise_on_overflow = raise_on_overflow
        # the largest count any expert needed (fixed capacity only), kept on the device
        self.needed: torch.Tensor | None = None

    def max_tokens_per_rank(self, num_tokens: int) -> int:
        return self.capacity if self.capacity is not None else num_tokens

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        """Buffers of one dispatch of ``num_tokens`` tokens: the slot tables and the batched
        activations for M = ``capacity`` (or ``num_tokens``) rows per expert."""
        rows = num_local_experts * self.max_tokens_per_rank(num_tokens)
        shapes = {
            "pair_token": ((rows + 1,), torch.long),
            "pair_flat": ((rows + 1,), torch.long),
        }
        tq = self.scheme.a1
        a = quantized_layout("a", tq, rows, self.config.hidden_size, self.config.dtype)
        if tq is not None and tq.granularity.kind == "tensor":
            a.pop("a_scale", None)  # one scale for every row: shared, not gathered
        shapes.update(a)
        return Workspace(shapes)

    def dispatch(self, x, topk, weights, *, expert_map=None, a1_scale=None, workspace=None) -> Dispatched:
        t, k = topk.ids.shape
        dev = x.device
        a = self.quantize_input(x, topk, weights, a1_scale)
        e_local = weights.num_experts
        local = local_expert_ids(topk.ids.reshape(-1), expert_map, e_local)
        # pairs that contribute nothing (other ranks' experts, ids outside [0, E)) go to an extra
        # bin: every shape below is known on the host
        local = torch.where(local >= 0, local, e_local)
        counts_all = torch.zeros(e_local + 1, dtype=torch.long, device=dev).scatter_add_(
            0, local, torch.ones_like(local)
        )
        counts = counts_all[:e_local].to(torch.int32)
        cap = self._capacity(counts, dev)
        # stable sort keeps each expert's pairs in token order (deterministic slots)
        order = torch.sort(local, stable=True).indices
        exp_of = local[order]
        starts = torch.cumsum(counts_all, 0) - counts_all
        slot = torch.arange(order.numel(), device=dev) - starts[exp_of]
        rows = e_local * cap
        # pairs that are not local or past the capacity land in the dump slot ``rows``
        dest = torch.where((exp_of < e_local) & (slot < cap), exp_of * cap + slot, rows)
        pair_token = take(workspace, "pair_token", (rows + 1,), torch.long, dev).fill_(-1)
        pair_flat = take(workspace, "pair_flat", (rows + 1,), torch.long, dev).fill_(-1)
        pair_token.scatter_(0, dest, order // k)
        pair_flat.scatter_(0, dest, order)
        pair_token, pair_flat = pair_token[:rows].view(e_local, cap), pair_flat[:rows].view(e_local, cap)
        src = pair_token.clamp(min=0).reshape(-1)
        data = _gather_rows(a.data, src, take(workspace, "a", (rows, *a.data.shape[1:]), a.data.dtype, dev))
        scale = None
        if a.scale is not None:
            # a per-tensor scale is shared; row-wise (token, group) scales travel with their rows
            shared = self.scheme.a1.granularity.kind == "tensor"
            if shared:
                scale = a.scale
            else:
                buf = take(workspace, "a_scale", (rows, *a.scale.shape[1:]), a.scale.dtype, dev)
                scale = _gather_rows(a.scale, src, buf).view(e_local, cap, -1)
        ab = QTensor(
            data.view(e_local, cap, *a.data.shape[1:]),
            (e_local, cap, x.shape[1]),
            scale=scale,
            global_scale=a.global_scale,
        )
        return Dispatched(a=ab, topk=topk, counts=counts, num_tokens=t, ctx=(pair_token, pair_flat))

    def _capacity(self, counts: torch.Tensor, dev) -> int:
        """M: the fixed capacity (checked when the host may wait), else the largest count (a host sync)."""
        if self.capacity is None:
            return max(int(counts.max()), 1) if counts.numel() else 1
        if self.needed is None or self.needed.device != dev:
            self.needed = torch.zeros(1, dtype=torch.int32, device=dev)
        if counts.numel():
            need = counts.max()
            torch.maximum(self.needed, need.reshape(1), out=self.needed)
            if self.raise_on_overflow and not _capturing(dev):
                self.check_capacity(need)
        return self.capacity

    def check_capacity(self, needed: torch.Tensor | None = None) -> None:
        """Raise if an expert needed more rows than the capacity (reads the device flag: a host sync).

        Under CUDA-graph capture nothing is read: pairs past the capacity are left out of the
        result, and a replay records what it needed in ``needed`` for this check.
        """
        if self.capacity is None or (needed is None and self.needed is None):
            return
        got = int(self.needed.max() if needed is None else needed)
        if got > self.capacity:
            raise FusedMoEError(
                f"local_batched capacity: expected at most {self.capacity} tokens per expert, "
                f"got {got}; raise the capacity (max_tokens_per_expert)"
            )

    def output_shape(self, d, reduce):
        return (d.a.shape[0], d.a.shape[1], self.config.hidden_size)

    def combine(self, y, d, out, reduce):
        """out[t] = sum over k of (w[t, k] *) y[slot of (t, k)], in fp32, k in order (no atomics:
        a token's sum does not depend on its batch); pairs without a slot add nothing."""
        pair_token, pair_flat = d.ctx
        t, k = d.topk.ids.shape
        rows = y.reshape(-1, y.shape[-1])
        n = rows.shape[0]
        flat = pair_flat.reshape(-1)
        slot_of = torch.full((t * k + 1,), n, dtype=torch.long, device=y.device)
        slot_of.scatter_(0, torch.where(flat >= 0, flat, t * k), torch.arange(n, device=y.device))
        slot_of = slot_of[: t * k].view(t, k)
        weighted = reduce is WeightedReduce.WEIGHT_AND_SUM and not self.config.apply_router_weight_on_input
        acc = None
        for j in range(k):
            s = slot_of[:, j]
            ok = (s < n).unsqueeze(1)
            # rows past an expert's count hold stale values (even NaN): select, never multiply by 0
            v = torch.where(ok, rows.index_select(0, s.clamp(max=n - 1)).float(), 0.0)
            if weighted:
                v = v * d.topk.weights[:, j].float().unsqueeze(1)
            acc = v if acc is None else acc + v
        out.copy_(acc)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[index[i]], written into ``out``; 1-byte formats move as uint8 (index_select
    has no fp8 kernel on every device)."""
    if src.element_size() == 1 and src.dtype != torch.uint8:
        torch.index_select(src.view(torch.uint8), 0, index, out=out.view(torch.uint8))
    else:
        torch.index_select(src, 0, index, out=out)
    return out
