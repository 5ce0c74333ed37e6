"""``MoEKernel``: a Dispatcher composed with an Experts backend.

    out = combine(experts(dispatch(x)))   [+ shared_experts(x)]

Long inputs run in chunks of ``chunk_size`` tokens (default 16384, or
``FUSEDMOE_CHUNK_SIZE``) so the experts' workspace, which grows with T*K,
stays bounded. A per-tensor dynamic a1 scale is computed once over the whole
input and pinned for every chunk, so chunking does not change a1's
quantization; a per-tensor dynamic a2 scale is taken per chunk.

Identity experts (``MoEConfig.identity_experts``, ids E..E+Z-1) are taken out before the
dispatch: their pairs go to expert 0 with weight 0 and w * x is added to the output, so no
backend sees an id >= E (a zero-weight pair adds exactly 0 while its expert's output is finite).

The weighted reduce happens where the experts say (``Experts.reduce``): inside
them, or in the dispatcher's combine. The shared-experts hook runs after the
experts and before combine, where a distributed dispatcher's communication
can overlap it.

Three modes of running:

- eager: ``forward`` calls the dispatcher and the experts directly;
- under ``torch.compile``: ``forward`` emits the custom op ``fusedmoe::moe_forward``
  (``fusedmoe.modular.ops``) naming this kernel, and adds the shared experts in the graph;
- CUDA graphs: ``allocate(max_tokens, device)`` creates every declared buffer once
  (``workspace``: the dispatcher's, the experts', the experts' output); calls of up to
  ``max_tokens`` tokens then reuse them, so a captured graph's addresses stay valid.
  What is still allocated per call is small: the quantized input [T, H], the output,
  the routing metadata of ``moe_align`` and the local_batched combine's index.

Deterministic mode (``deterministic=True`` or ``FUSEDMOE_DETERMINISTIC=1``) asks the
experts for results that do not depend on the batch: each token's output is bitwise
the same alone, in any batch, and run to run (see ``experts.triton``). Tokens still
interact through a per-tensor *dynamic* activation scale (an amax over the batch), which
no mode can avoid; schemes with token, group or static scales are batch-invariant.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .. import env
from ..contract import TokenLayout, WeightedReduce, Workspace, take
from ..errors import UnsupportedError, expect
from ..experts.base import Experts
from ..kernels._common import interpreting
from ..metadata import TopK
from ..quant import FORMATS
from ..weights import ExpertWeights
from .ops import call_moe_forward, register_kernel, weight_tensors
from .replay import LaunchPlans, logits_plan_key

DEFAULT_CHUNK_SIZE = 16384


class MoEKernel:
    """Dispatcher x Experts (see the module docstring).

    chunk_size:     tokens per chunk (None: ``FUSEDMOE_CHUNK_SIZE`` or 16384).
    shared_experts: ``f(x [T, H]) -> [T, H]`` added to the routed output.
    deterministic:  batch-invariant, run-to-run identical results (None: ``FUSEDMOE_DETERMINISTIC``,
                    or what the experts were built with).
    name:           the key of this kernel in the ``fusedmoe::moe_forward`` registry (unique;
                    generated when None).
    """

    def __init__(
        self,
        dispatcher,
        experts: Experts,
        *,
        chunk_size: int | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
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
        size = chunk_size or env.chunk_size() or DEFAULT_CHUNK_SIZE
        expect(size > 0, "chunk_size", "a positive number of tokens", size)
        self.chunk_size = size if experts.capabilities.chunking else None
        self.shared_experts = shared_experts
        if deterministic is None:
            deterministic = bool(getattr(experts, "deterministic", False)) or env.deterministic()
        self.deterministic = deterministic
        # the experts choose their launch configs; backends without such choices ignore it
        experts.deterministic = deterministic
        self._buffers: dict[str, dict[str, torch.Tensor]] | None = None
        self.choice = None  # the oracle's Choice when built by ``oracle.build_kernel``
        self._prepared: dict[int, tuple] = {}
        # eager calls at a shape seen before replay their launches (``modular.replay``); one GPU only
        self._plans = None if dispatcher.distributed else LaunchPlans()
        self.name = register_kernel(self, name)

    def prepared(self, weights: ExpertWeights) -> ExpertWeights:
        """``weights`` in the experts' layout (``Experts.prepare_weights``): converted once per weights
        object and kept while that object lives, so a functional caller (``fused_moe``) that passes
        reference-layout weights pays the conversion once, not per call. The copy costs the
        memory of the converted weights (4-bit: about the same as the originals); the ``FusedMoE``
        layer converts in place instead."""
        hit = self._prepared.get(id(weights))
        if hit is not None and hit[0]() is weights:
            return hit[1]
        converted = self.experts.prepare_weights(weights)
        if converted is not weights:
            key = id(weights)
            self._prepared[key] = (weakref.ref(weights, lambda _: self._prepared.pop(key, None)), converted)
        return converted

    # A copy (deepcopy of a model, unpickling) is a new kernel: it registers under a fresh
    # name, or compiled graphs of the copy would call the original. Buffers are not copied
    # (a CUDA graph captured the original's addresses); ``allocate`` again.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buffers": None, "name": None, "_prepared": {}, "_plans": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._plans = None if self.dispatcher.distributed else LaunchPlans()
        self.name = register_kernel(self)

    # ---- workspace ---------------------------------------------------------------------
    def _num_local_experts(self) -> int:
        return len(self.dispatcher.parallel.local_experts(self.config.num_experts))

    def _step(self, num_tokens: int) -> int:
        return max(1, min(num_tokens, self.chunk_size) if self.chunk_size else num_tokens)

    def _workspace_parts(self, num_tokens: int, num_local_experts: int | None) -> dict[str, Workspace]:
        c = self.config
        step = self._step(num_tokens)
        e_l = num_local_experts or self._num_local_experts()
        if self.experts.layout is TokenLayout.STANDARD:
            rows = step
            k = 1 if self.experts.reduce is WeightedReduce.NONE else c.top_k
            y_rows = step * k
        else:
            rows = self.dispatcher.max_tokens_per_rank(step)  # M, rows per expert
            y_rows = e_l * rows
        parts = {"experts": self.experts.workspace(rows, e_l)}
        if not self.dispatcher.writes_output(self.experts.reduce):
            parts["kernel"] = Workspace({"y": ((y_rows, c.hidden_size), c.dtype)})
        plan = getattr(self.dispatcher, "workspace", None)
        if plan is not None:
            parts["dispatch"] = plan(step, e_l)
        return parts

    def workspace(self, num_tokens: int, num_local_experts: int | None = None) -> Workspace:
        """Every buffer a call of ``num_tokens`` tokens needs, declared (one chunk's worth: the
        bytes stop growing at ``chunk_size``). Names are ``part.buffer``, part one of
        'dispatch', 'experts', 'kernel'."""
        shapes = {}
        for part, ws in self._workspace_parts(num_tokens, num_local_experts).items():
            shapes.update({f"{part}.{k}": v for k, v in ws.shapes.items()})
        return Workspace(shapes)

    def allocate(
        self, max_tokens: int, device: torch.device | str, *, num_local_experts: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Allocate the workspace for calls of up to ``max_tokens`` tokens on ``device``, once.

        Later calls on that device take their buffers from it (a larger call allocates its own,
        as without ``allocate``). Needed before capturing a CUDA graph, so that replays write
        where the capture did. Returns the buffers by ``workspace`` name.
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        parts = self._workspace_parts(max_tokens, num_local_experts)
        self._buffers = {part: ws.allocate(dev) for part, ws in parts.items()}
        self._device = dev
        if self._plans is not None:  # calls now take these buffers: record again
            self._plans.clear()
        return self.buffers

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers ``allocate`` created, by ``workspace`` name (empty before it is called)."""
        return {f"{p}.{k}": t for p, bufs in (self._buffers or {}).items() for k, t in bufs.items()}

    def _buffers_for(self, x: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        if self._buffers is None or self._device != x.device:
            return {}
        return self._buffers

    # ---- running -----------------------------------------------------------------------
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
        if torch.compiler.is_compiling():
            out = call_moe_forward(self.name, x, topk, weights, expert_map)
            if self.shared_experts is not None:
                # computed in the promoted dtype and rounded once, as the eager in-place add does
                out = (out + self.shared_experts(x)).to(out.dtype)
            return out
        return self.forward_eager(x, topk, weights, expert_map=expert_map)

    __call__ = forward

    def _plan(self, x: torch.Tensor, topk: TopK, weights: ExpertWeights, expert_map) -> tuple | None:
        """(key, inputs) of a call that a launch plan may serve, or None. The key holds what the
        recorded launches depend on besides addresses: the kinds of x, the routing and the expert
        map (shape, strides, dtype, device, 16-byte alignment) and the identity and address of
        every weight tensor."""
        if not self._plannable(x):
            return None
        ids, tw = topk.ids, topk.weights
        kinds, wts = self._kinds(x, weights, expert_map)
        key = (*kinds, ids.shape, ids.stride(), ids.dtype, ids.get_device(), ids.data_ptr() & 15,
               tw.shape, tw.stride(), tw.dtype, tw.get_device(), tw.data_ptr() & 15)  # fmt: skip
        return key, (x, ids, tw, expert_map, *wts)

    def _plannable(self, x: torch.Tensor) -> bool:
        """Whether a launch plan may serve a call on ``x``: one GPU (or the interpreter), tokens,
        one chunk, no identity experts."""
        t = x.shape[0]
        if self._plans is None or t == 0 or self.config.identity_experts or (self.chunk_size and t > self.chunk_size):
            return False
        # no kernel launches on the CPU but the interpreter's, none at all on "meta": nothing to replay
        return x.is_cuda or (x.is_cpu and interpreting())

    @staticmethod
    def _kinds(x: torch.Tensor, weights: ExpertWeights, expert_map) -> tuple[tuple, list]:
        """(the key's part for x, the expert map and the weights; the weight tensors). Devices are
        in it (a tensor on another device has other addresses), and the weights' own addresses."""
        wts = weight_tensors(weights)
        emap = None
        if expert_map is not None:
            m = expert_map
            emap = (m.shape, m.stride(), m.dtype, m.get_device(), m.data_ptr() & 15)
        kinds = (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, emap, weights.layout,
                 *[None if w is None else (id(w), w.data_ptr()) for w in wts])  # fmt: skip
        return kinds, wts

    def route_and_run(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        router,
        correction_bias: torch.Tensor | None,
        weights: ExpertWeights,
        plain: Callable[[], torch.Tensor],
        *,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x routed from ``logits`` by ``router`` (a ``RouterConfig``) and run through the experts,
        the routing launch and the experts' launches in one launch plan: one key, one set of
        checks, one scratch buffer (the routing's ids and weights live in it) where routing and
        experts each replaying their own plan cost two of each: ~15-25 us less host time per
        eager call (H200 host, Qwen3-30B-A3B T = 1, 0.77-0.87x of the two plans' time). ``plain()``:
        the caller's own path (routing, checks, the call), run where no plan serves and in a
        key's first call; the second records. The key holds the router by value and the
        correction bias by identity, with the kinds ``_plan`` keys on. Where the dispatcher can
        quantize x without the routing (``Dispatcher.input_quantization``), the plan's routing launch
        makes x's codes too: no quantization launch before GEMM1."""
        if self.shared_experts is not None or env.check_values() or torch.compiler.is_compiling():
            return plain()
        try:
            if not self._plannable(x):
                return plain()
            kinds, wts = self._kinds(x, weights, expert_map)
            key = ("logits", router, *kinds, *logits_plan_key(logits, correction_bias))
        except (AttributeError, TypeError, IndexError):  # not the kinds of inputs a plan is made for
            return plain()

        def fn() -> torch.Tensor:
            # x's quantization, where it needs no routing, rides in the routing launch (one launch fewer)
            q = self.dispatcher.input_quantization(x, weights)
            topk = router.route(logits, correction_bias, replay=False, quantize=q)
            return self._routed(x, topk, weights, expert_map, quantized=None if q is None else q.result)

        return self._plans.call(key, fn, (x, logits, correction_bias, expert_map, *wts), plain=plain)

    def replay(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        *,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The call's output from the launch plan recorded for its key (``modular.replay``), or
        None when there is none yet. A plan exists only for inputs of the same shapes, dtypes and
        weight tensors as a call that was validated and run, so callers skip validation on a hit."""
        # under torch.compile the op is traced, not replayed (a key reads addresses)
        if self._plans is None or not self._plans.plans or env.check_values() or torch.compiler.is_compiling():
            return None
        try:
            plan = self._plan(x, topk, weights, expert_map)
        except (AttributeError, TypeError, IndexError):  # not the kinds of inputs a plan was made for
            return None
        if plan is None:
            return None
        out = self._plans.replay(*plan)
        if out is not None and self.shared_experts is not None:
            out += self.shared_experts(x)
        return out

    def forward_eager(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        *,
        expert_map: torch.Tensor | None = None,
        shared: bool = True,
    ) -> torch.Tensor:
        """``forward`` without the compile switch; ``shared=False`` leaves out the shared experts
        (the custom op's body: the compiled graph adds them)."""
        plan = self._plan(x, topk, weights, expert_map)
        if plan is not None:
            key, inputs = plan
            out = self._plans.call(key, lambda: self._routed(x, topk, weights, expert_map), inputs)
            if shared and self.shared_experts is not None:
                out += self.shared_experts(x)
            return out
        return self._routed(x, topk, weights, expert_map, self.shared_experts if shared else None)

    def _routed(
        self,
        x: torch.Tensor,
        topk: TopK,
        weights: ExpertWeights,
        expert_map: torch.Tensor | None,
        shared_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        quantized=None,
    ) -> torch.Tensor:
        """The layer chunk by chunk: dispatch, experts, ``shared_fn`` of the chunk, combine.
        ``quantized``: x already quantized (``Dispatcher.input_quantization``; one chunk only)."""
        t = x.shape[0]
        out = torch.empty_like(x)
        distributed = self.dispatcher.distributed
        if t == 0 and not distributed:
            return out
        identity = None
        if self.config.identity_experts:
            expect(
                not distributed and expert_map is None,
                "MoEConfig.identity_experts",
                "0 under expert parallelism (each rank would add the identity experts' share)",
                self.config.identity_experts,
            )
            topk, identity = split_identity_experts(x, topk, self.config.num_experts)
        step = self.chunk_size or max(t, 1)
        n_chunks = -(-t // step)
        if distributed:
            # every rank must join every collective: a rank with fewer (or no) tokens
            # runs empty chunks until the rank with the most tokens is done
            n_chunks = self.dispatcher.agree_num_chunks(max(n_chunks, 1), num_tokens=min(t, step))
        a1_scale = self._pinned_a1_scale(x, t)
        bufs = self._buffers_for(x)
        direct = self.dispatcher.writes_output(self.experts.reduce)
        for c in range(n_chunks):
            s = min(c * step, t)
            e = min(t, s + step)
            xc = x[s:e]
            tk = TopK(topk.ids[s:e], topk.weights[s:e])
            kw = {"workspace": bufs["dispatch"]} if "dispatch" in bufs else {}
            if quantized is not None:
                expect(n_chunks == 1, "quantized", "given for a call of one chunk")
                kw["quantized"] = quantized
            d = self.dispatcher.dispatch(xc, tk, weights, expert_map=expert_map, a1_scale=a1_scale, **kw)
            if direct:
                y = out[s:e]
            else:
                y_shape = self.dispatcher.output_shape(d, self.experts.reduce)
                y = take(bufs.get("kernel"), "y", y_shape, x.dtype, x.device)
            if self.experts.layout is TokenLayout.STANDARD:
                self.experts.apply(d.a, d.topk, weights, y, expert_map=expert_map, workspace=bufs.get("experts"))
            else:
                self.experts.apply_batched(d.a, d.counts, weights, y, workspace=bufs.get("experts"))
            sh = shared_fn(xc) if shared_fn is not None else None
            if not direct:
                self.dispatcher.combine(y, d, out[s:e], self.experts.reduce)
            if sh is not None:
                out[s:e] += sh
        if identity is not None:
            out += identity
        return out


def split_identity_experts(x: torch.Tensor, topk: TopK, num_experts: int) -> tuple[TopK, torch.Tensor]:
    """(``topk`` with the identity experts' pairs sent to expert 0 with weight 0, their share
    sum_k w * x [T, H] in x's dtype)."""
    is_identity = topk.ids >= num_experts
    share = (topk.weights.float() * is_identity).sum(dim=1, keepdim=True)
    routed = TopK(topk.ids.masked_fill(is_identity, 0), topk.weights.masked_fill(is_identity, 0))
    return routed, (x.float() * share).to(x.dtype)
