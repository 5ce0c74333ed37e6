"""The base of the expert-parallel dispatchers, and the packed-row layout they exchange.

- ``RowLayout``: several per-row tensors (activations, their scales, top-k ids
  and weights, headers) packed into one uint8 [N, B] buffer, so each exchange
  is one collective of plain bytes. fp8 and e8m0 values travel as bytes (gloo
  rejects fp8 dtypes: "Invalid scalar type").
- ``EPDispatcher``: the base of ``allgather``, ``all2all`` and ``low_latency``. Per call it
  finds the *token bound*: a size every rank computes alike without exchanging counts, so
  the exchange can be fixed blocks (no host sync, CUDA-graph capturable). Eager calls
  through ``MoEKernel.forward`` get it from ``agree_num_chunks`` (the one all-reduce per
  forward, which also carries each rank's largest chunk); direct calls and captured graphs
  from the workspace of ``MoEKernel.allocate(max_tokens)`` (checked equal on every rank
  once). ``route`` gives each token its send row for every rank it goes to (4 small
  kernels, no sync); ``kernels/rows.py`` moves the rows (one scatter launch to pack, one
  gather-sum to combine).

Why: at 128 tokens per rank on 4 H200 an eager all2all took 598 us to dispatch against a
78 us all_to_all of the same bytes; the split-size exchange and its .tolist() alone cost
~60 us, and ~30 small ops and three host syncs the rest
(benchmarks/results/ep_4xh200_2026-11-21.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...config import MoEConfig, ParallelConfig
from ...contract import WeightedReduce, Workspace, quantized_layout
from ...errors import FusedMoEError, expect
from ...kernels.rows import rank_rows
from ...metadata import TopK
from ...quant import QTensor, QuantScheme
from ..base import Dispatcher
from .groups import ExpertPlacement, check_layer_agreement, comm_device, ep_group

# ---- packed rows ---------------------------------------------------------------
_ALIGN = 16


@dataclass(frozen=True)
class RowField:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per row
    offset: int  # bytes from the start of the row
    nbytes: int


class RowLayout:
    """Byte layout of one row of a packed exchange buffer (uint8 [N, row_bytes]).

    Each field starts at a multiple of 16 bytes and the row is padded to 16, so
    typed views of a field are plain strided views (no copy).
    """

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        out, off = [], 0
        for name, dtype, shape in fields:
            n = 1
            for d in shape:
                n *= d
            nb = n * dtype.itemsize
            out.append(RowField(name, dtype, tuple(shape), off, nb))
            off += -(-nb // _ALIGN) * _ALIGN
        self.fields = {f.name: f for f in out}
        self.row_bytes = max(off, _ALIGN)

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def empty(self, n: int, device) -> torch.Tensor:
        """uint8 [n, row_bytes] (a view of one row when n is 0: see ``nonempty``)."""
        return torch.empty(max(n, 1), self.row_bytes, dtype=torch.uint8, device=device)[:n]

    def raw(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of every row of ``buf`` as uint8 [N, nbytes]."""
        f = self.fields[name]
        return buf[:, f.offset : f.offset + f.nbytes]

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of every row of ``buf`` as a typed [N, *shape] view."""
        f = self.fields[name]
        v = buf[:, f.offset : f.offset + f.nbytes].view(f.dtype)
        return v.view(buf.shape[0], *f.shape)

    def pack(self, buf: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
        """Copy each named [N, *shape] tensor into its field of ``buf``; returns ``buf``."""
        for name, t in tensors.items():
            self.view(buf, name).copy_(t.reshape(t.shape[0], *self.fields[name].shape))
        return buf

    def unpack(self, buf: torch.Tensor, *names: str) -> list[torch.Tensor]:
        """Contiguous copies of the named fields of ``buf``."""
        return [self.view(buf, n).contiguous() for n in names]


# ---- the base of the EP dispatchers ---------------------------------------------
def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class EPDispatcher(Dispatcher):
    """What the EP dispatchers share: the group, the expert placement, the set-up check,
    the per-call token bound, the wire format of the (quantized) activations, the routing
    of tokens to ranks, and input checks.

    Construction is collective: every rank of the group must construct the same
    dispatcher (``verify=True`` runs ``check_layer_agreement`` there, once).

    The token bound of a call (``token_bound``) is what lets a dispatcher send fixed-size
    blocks (no exchange of counts, no host sync): every rank must compute the same bound.
    It comes from ``agree_num_chunks`` (MoEKernel's one all-reduce per forward, eager),
    or else from the workspace (``MoEKernel.allocate(max_tokens)``: checked equal on every
    rank once, the first time it is seen; then every call must stay within it).
    """

    distributed = True
    topk_id_dtype = torch.int32

    def __init__(
        self,
        config: MoEConfig,
        scheme: QuantScheme,
        parallel: ParallelConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        verify: bool = True,
    ) -> None:
        super().__init__(config, scheme, parallel)
        self.group = ep_group(self.parallel, group)
        self.world = self.parallel.ep_size
        self.rank = self.parallel.ep_rank
        self.placement = ExpertPlacement.of(config.num_experts, self.parallel)
        self.num_local_experts = self.placement.local_counts[self.rank]
        self.device = comm_device(self.group)
        self._templates: dict = {}
        self._tables: dict = {}
        self._checked_map = None
        self._agreed: list[int] | None = None  # [largest chunk over ranks, dispatches left]
        self._verified: set[int] = set()  # workspace capacities checked equal on every rank
        # bytes this rank hands to the last dispatch's and combine's collectives, counted as the
        # input of an all-to-all (an all-gather of n bytes = W * n); host ints, known without a sync
        self.wire_bytes: tuple[int, int] = (0, 0)
        # how the last dispatch exchanged: 'fixed' (blocks of the token bound, no host sync) or
        # 'variable' (sizes exchanged first, one host sync)
        self.last_mode = ""
        if verify:
            check_layer_agreement(config, scheme, self.parallel, self.name, self.group, self.options())

    def agree_num_chunks(self, n: int, num_tokens: int | None = None) -> int:
        """Max of ``n`` over the EP group: one small all-reduce (syncs the host) that also
        carries ``num_tokens``, this rank's largest chunk, so the next ``n`` dispatches know
        the largest chunk of any rank and send fixed blocks of that size (see ``token_bound``).

        Under CUDA-graph capture nothing is exchanged and ``n`` is returned: every rank must
        capture the same number of chunks, each within its workspace (``MoEKernel.allocate``).
        """
        self._agreed = None
        if _capturing(self.device):
            return n
        unknown = num_tokens is None
        v = torch.tensor([n, 0 if unknown else num_tokens, int(unknown)], dtype=torch.int64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
        n_all, tokens, any_unknown = v.tolist()
        if not any_unknown:
            self._agreed = [tokens, n_all]
        return n_all

    def options(self) -> dict:
        """Constructor options every rank must agree on (part of the set-up check)."""
        return {}

    # ---- the per-call token bound ---------------------------------------------
    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        """Buffers of the fixed-size exchange for ``num_tokens`` tokens per rank (what
        ``MoEKernel.allocate`` creates; their size is the capacity ``token_bound`` reads)."""
        return Workspace({"dest": ((num_tokens, self.world), torch.int64)})

    @staticmethod
    def _workspace_tokens(workspace: dict | None) -> int | None:
        buf = None if workspace is None else workspace.get("dest")
        return None if buf is None else buf.shape[0]

    def token_bound(self, t: int, workspace: dict | None) -> tuple[int | None, bool]:
        """(B, fits): B bounds the tokens of every rank in this call and is the same on every
        rank (None: unknown, sizes must be exchanged); fits: the workspace holds B tokens.

        B is the largest chunk agreed by ``agree_num_chunks`` for this call (MoEKernel, eager);
        else the workspace's capacity (checked equal on every rank once); this rank holding
        more than that is an error here (the other ranks then wait in the exchange until the
        process group's timeout: a direct call or a captured graph must stay within it).
        """
        ws = self._workspace_tokens(workspace)
        if ws is not None:
            self._verify_capacity(ws)
        a = self._agreed
        if a is not None:
            a[1] -= 1
            if a[1] <= 0:
                self._agreed = None
            return a[0], ws is not None and a[0] <= ws
        if ws is None:
            return None, False
        if t > ws:
            raise FusedMoEError(
                f"{self.name}: this rank (EP rank {self.rank}) has {t} tokens, but the workspace holds "
                f"{ws} per rank (MoEKernel.allocate(max_tokens)); call MoEKernel.forward (its ranks agree on "
                "sizes first) or allocate for more tokens. The other ranks wait in the exchange until the "
                "process group's timeout"
            )
        return ws, True

    def start_dispatch(
        self, x: torch.Tensor, topk: TopK, weights, expert_map, workspace: dict | None, *, need_map: bool
    ) -> tuple[int | None, bool, dict | None]:
        """Every EP dispatch's start: ``check_inputs``, then (B, fits) of ``token_bound`` and the
        workspace buffers are taken from (None when it does not hold B tokens: fresh ones)."""
        self.check_inputs(x, topk, weights, expert_map, need_map=need_map)
        bound, fits = self.token_bound(x.shape[0], workspace)
        return bound, fits, workspace if fits else None

    def _verify_capacity(self, tokens: int) -> None:
        """Every rank's workspace must hold the same number of tokens: one all-reduce the first
        time a capacity is seen (eager); all ranks raise together if they differ."""
        if tokens in self._verified or _capturing(self.device):
            return
        v = torch.tensor([tokens, -tokens], dtype=torch.int64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
        hi, neg_lo = v.tolist()
        lo = -neg_lo
        if hi != lo:
            raise FusedMoEError(
                f"{self.name}: the EP ranks' workspaces hold from {lo} to {hi} tokens per rank; every rank "
                "must call MoEKernel.allocate with the same max_tokens (fixed-size exchanges need one size)"
            )
        self._verified.add(tokens)

    # ---- routing tokens to ranks ---------------------------------------------------
    def _table(self, name: str, device) -> torch.Tensor:
        """Small device tables built once per device from the placement (a host-to-device copy:
        the first call must be eager, as the warm-up before a CUDA-graph capture is)."""
        key = (name, device)
        if key not in self._tables:
            p, r = self.placement, self.rank
            e = p.num_experts
            if name == "owner":  # expert -> rank
                val = torch.tensor(p.owner, dtype=torch.int32)
            elif name == "remap":  # wire id -> global id the experts see; 0 -> an expert of another rank
                # (a rank owning every expert, E < W, gets expert 0: its zero padding rows are computed,
                # and their outputs are dropped by combine)
                foreign = next((g for g in range(e) if p.owner[g] != r), 0)
                val = torch.tensor([foreign, *range(e)], dtype=torch.int32)
            elif name == "to_local":  # wire id -> local expert id, or E_l for none / another rank's
                e_l = self.num_local_experts
                val = torch.tensor([e_l] + [p.local_id[g] if p.owner[g] == r else e_l for g in range(e)])
            else:
                raise KeyError(name)
            self._tables[key] = val.to(device)
        return self._tables[key]

    def wire_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """int32 [T, K] wire ids of the top-k ``ids``: 1 + expert id, and 0 (not sent) for a pair
        that contributes nothing (an id outside [0, E): ``metadata.TopK``), so no table lookup or
        kernel downstream indexes with it."""
        e = self.config.num_experts
        return torch.where((ids >= 0) & (ids < e), ids + 1, 0).to(torch.int32)

    def route(self, ids: torch.Tensor, rows: int | None, *, wire: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(dest, counts) of ``dispatch.rows.route`` for this placement: dest int64 [T, W] = the
        send row of token t's copy for rank r, or -1; counts int64 [W] = rows for each rank.
        Blocks of ``rows`` rows (fixed) or (None) packed one after another (variable)."""
        return rank_rows(ids, self._table("owner", ids.device), self.world, rows, wire=wire)

    def received_topk(self, lay: RowLayout, recv: torch.Tensor) -> TopK:
        """The routing of received rows: padding rows (wire id 0) get an expert of another rank,
        which this rank's experts skip (their zero rows are computed by nobody)."""
        ids = self._table("remap", recv.device)[lay.view(recv, "ids")]
        return TopK(ids, lay.view(recv, "w").contiguous())

    def row_layout(self, weights, device, extra: Sequence = ()) -> RowLayout:
        """Wire row: activations (x, or quantized data + row scales), wire ids int32 [K]
        (1 + expert, 0 = none), router weights fp32 [K], then ``extra`` fields (built once)."""
        key = ("layout", device, self.quantizes_before(), tuple(extra))
        if key not in self._tables:
            fields, _, _ = self._template(weights, device)
            k = self.config.top_k
            self._tables[key] = RowLayout([*fields, ("ids", torch.int32, (k,)), ("w", torch.float32, (k,)), *extra])
        return self._tables[key]

    def declared_row_bytes(self, extra: Sequence = ()) -> int:
        """``row_layout``'s row size without weights (for ``workspace``: shapes only)."""
        h, k = self.config.hidden_size, self.config.top_k
        if self.quantizes_before():
            q = quantized_layout("a", self.scheme.a1, 1, h, self.config.dtype)
            fields = [("data", q["a"][1], q["a"][0][1:])]
            if self._row_scales() and "a_scale" in q:
                fields.append(("scale", q["a_scale"][1], q["a_scale"][0][1:]))
        else:
            fields = [("x", self.config.dtype, (h,))]
        return RowLayout([*fields, ("ids", torch.int32, (k,)), ("w", torch.float32, (k,)), *extra]).row_bytes

    def pack_rows(self, lay: RowLayout, rows: torch.Tensor, a: QTensor | None, x, ids, topk_w, *, wire=False):
        """Write each token's wire row into ``rows`` uint8 [T, B] (one kernel per field); ``ids``
        are expert ids (written + 1) or, with ``wire``, wire ids already."""
        if wire:
            lay.view(rows, "ids").copy_(ids)
        else:
            torch.add(ids, 1, out=lay.view(rows, "ids"))
        return lay.pack(rows, w=topk_w, **self.wire_tensors(a, x))

    # ---- quantization around the exchange ---------------------------------
    def quantizes_before(self) -> bool:
        """Whether this instance sends quantized activations (class default, refined per scheme).

        A per-tensor *dynamic* a1 scale is never computed before the exchange: rows of
        different ranks would carry different scales, which one tensor scale cannot hold.
        """
        tq = self.scheme.a1
        if tq is None:
            return False
        if tq.granularity.kind == "tensor" and tq.dynamic:
            return False
        return self.quantize_before_exchange

    def _row_scales(self) -> bool:
        tq = self.scheme.a1
        return tq is not None and tq.granularity.kind != "tensor"

    def _template(self, weights, device) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
        """(wire fields of one quantized row, the shared scale, the global scale), from one probe row."""
        key = (device, self.quantizes_before())
        if key not in self._templates:
            h, k = self.config.hidden_size, self.config.top_k
            if self.quantizes_before():
                probe = self.quantize_input(
                    torch.ones(1, h, dtype=self.config.dtype, device=device),
                    TopK(
                        torch.zeros(1, k, dtype=torch.int32, device=device),
                        torch.ones(1, k, dtype=torch.float32, device=device),
                    ),
                    weights,
                )
                fields = [("data", probe.data.dtype, tuple(probe.data.shape[1:]))]
                shared = None
                if self._row_scales():
                    fields.append(("scale", probe.scale.dtype, tuple(probe.scale.shape[1:])))
                else:
                    shared = probe.scale
                self._templates[key] = (fields, shared, probe.global_scale)
            else:
                self._templates[key] = ([("x", self.config.dtype, (h,))], None, None)
        return self._templates[key]

    def quantize_rows(self, x: torch.Tensor, topk: TopK, weights, a1_scale=None) -> QTensor:
        """``quantize_input`` (every format quantizes zero rows too: a rank may hold or
        receive no token, and its experts still get correctly shaped, empty scales)."""
        return self.quantize_input(x, topk, weights, a1_scale)

    def wire_tensors(self, a: QTensor | None, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The activation fields a row carries: quantized data (+ row scales), or x itself."""
        if not self.quantizes_before():
            return {"x": x}
        out = {"data": a.data}
        if self._row_scales():
            out["scale"] = a.scale
        return out

    def received(self, parts: dict[str, torch.Tensor], weights, shape: tuple[int, ...]) -> QTensor:
        """QTensor of logical ``shape`` from received fields ('data' [+ 'scale'] when quantized before)."""
        _, shared, gscale = self._template(weights, parts[next(iter(parts))].device)
        if "data" in parts:
            return QTensor(parts["data"], shape, scale=parts.get("scale", shared), global_scale=gscale)
        return QTensor(parts["x"], shape)

    def receive_rows(self, lay: RowLayout, recv: torch.Tensor, weights, a1_scale=None) -> tuple[QTensor, TopK]:
        """Standard layout: (activations [N, H], routing) of the N wire rows received in ``recv``:
        the senders' quantized fields (``quantizes_before``), else x quantized here as scheme.a1."""
        tk = self.received_topk(lay, recv)
        if self.quantizes_before():
            parts = {f: lay.view(recv, f).contiguous() for f in lay.fields if f not in ("ids", "w")}
            return self.received(parts, weights, (recv.shape[0], self.config.hidden_size)), tk
        xr = lay.view(recv, "x")  # the quantizers read strided rows; the experts get contiguous ones
        return self.quantize_rows(xr if self.scheme.a1 is not None else xr.contiguous(), tk, weights, a1_scale), tk

    def output_shape(self, d, reduce):
        """Standard layout: [N, H], or [N, K, H] when combine does the weighted sum."""
        h = self.config.hidden_size
        return (d.num_tokens, h) if reduce is WeightedReduce.NONE else (d.num_tokens, self.config.top_k, h)

    # ---- checks ------------------------------------------------------------------
    def check_inputs(
        self, x: torch.Tensor, topk: TopK, weights, expert_map: torch.Tensor | None, *, need_map: bool
    ) -> None:
        """Host-side shape checks, and (once per expert_map tensor, off CUDA-graph capture) its values."""
        h, k = self.config.hidden_size, self.config.top_k
        expect(x.dim() == 2 and x.shape[1] == h, "x", f"[T, {h}]", tuple(x.shape))
        expect(tuple(topk.ids.shape) == (x.shape[0], k), "topk.ids", f"[{x.shape[0]}, {k}]", tuple(topk.ids.shape))
        if x.device.type != self.device.type:
            expect(
                False, "x.device", f"a {self.device.type} tensor for the {dist.get_backend(self.group)} group", x.device
            )
        expect(
            weights.num_experts == self.num_local_experts,
            "weights",
            f"the {self.num_local_experts} local experts of EP rank {self.rank} "
            f"({self.parallel.placement} placement; see fusedmoe.distributed.shard_experts)",
            weights.num_experts,
        )
        if expert_map is None:
            expect(
                not need_map,
                "expert_map",
                "parallel.expert_map(num_experts): the experts must skip pairs of other ranks",
                None,
            )
            return
        if expert_map is self._checked_map or _capturing(expert_map.device):
            return
        want = self.parallel.expert_map(self.config.num_experts, expert_map.device)
        if not torch.equal(expert_map.to(want.dtype), want):
            where = f"ParallelConfig.expert_map(...) of EP rank {self.rank} ({self.parallel.placement} placement)"
            expect(False, "expert_map", where, expert_map.tolist())
        self._checked_map = expert_map

    def local_pair_rows(
        self, y: torch.Tensor, topk: TopK, expert_map: torch.Tensor, reduce: WeightedReduce
    ) -> torch.Tensor:
        """Standard layout: the experts' output -> [N, H] summed over this rank's pairs, in y's dtype.

        With ``WeightedReduce.NONE`` the experts already did it; otherwise y is
        [N, K, H] and pairs of other ranks' experts are masked out before the sum.
        """
        if reduce is WeightedReduce.NONE:
            return y
        mine = expert_map.long()[topk.ids.long()] >= 0
        yf = torch.where(mine.unsqueeze(-1), y.float(), 0.0)
        if reduce is WeightedReduce.WEIGHT_AND_SUM and not self.config.apply_router_weight_on_input:
            yf = yf * topk.weights.float().unsqueeze(-1)
        return yf.sum(dim=1).to(y.dtype)
