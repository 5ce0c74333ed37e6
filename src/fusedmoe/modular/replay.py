"""Launch plans: an eager call at a shape seen before, replayed as its recorded kernel launches.

    plans = LaunchPlans()
    out = plans.call(key, fn, inputs)    # fn() -> a tensor; inputs: every tensor fn reads from outside

Why: an eager MoE call spends most of its host time deciding what to launch, not launching. At a
shape it has seen, every decision is the same: the launch configs, grids, strides, workspace sizes,
the binaries Triton picked. Only the addresses of the inputs, the output and the scratch buffers
change. On the H100 host (2026-11-25) a Qwen3-30B-A3B bf16 call at T = 1 took 386-635 us to
enqueue 5 launches whose binaries cost ~10 us each to call.

How: the second call with a key runs ``fn`` under a recorder. The recorder sees every aten op
(a ``TorchDispatchMode``) and every launch made through ``kernels.launch``. It keeps:

- the launches, each as its binary, grid and argument list, with every tensor argument replaced by
  (base, byte offset): an input, the output, a scratch region, or a tensor that lives on (held);
- the allocations made during the call (``empty``, ``zeros``, ...): each becomes a region of one
  scratch buffer (256-byte aligned, so Triton's 16-byte specialisation holds), except the one the
  result lives in, which is allocated per call and returned;
- fills (``zero_``, ``zeros``, ``full``) of those regions or of a tensor that lives on (a
  preallocated workspace), replayed as fills.

Any other op (arithmetic, a copy, a read of a value on the host) makes the key ineligible: the call
runs as it always does, with the reason kept in ``LaunchPlans.refused``. Later calls with the key
replay the plan: one allocation for the output, one for the scratch, the pointers filled in, the
binaries called in order on the current stream. Results are bitwise those of the recorded path
(same binaries, same arguments, same order).

The key must hold everything the recorded decisions depend on besides addresses: the caller's
shapes, strides, dtypes and devices of the inputs, their 16-byte alignment (Triton specialises on
it), and the identity of long-lived tensors (weights) passed as inputs. Environment variables are
read when the plan is recorded: ``FUSEDMOE_LAUNCH_PLANS=0`` turns plans off (read per call).
Plans are skipped while a launch hook (profilers) or interceptor (the tuner) is set, and under the
Triton interpreter they replay through ``kernel[grid]`` with tensor views (how CI checks them).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels.launch import ensure_allocator, launches_recorded, plannable
from ..kernels.launch import raw_stream as _raw_stream

_ALIGN = 256  # scratch regions start at multiples of this (caching-allocator blocks: 512)
_ALLOC = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
# creation with a value: (op, value of the fill or None: read from the op's arguments)
_CREATE_FILLED = {
    torch.ops.aten.zeros.default: 0,
    torch.ops.aten.zeros_like.default: 0,
    torch.ops.aten.new_zeros.default: 0,
    torch.ops.aten.ones_like.default: 1,
    torch.ops.aten.full.default: None,
    torch.ops.aten.full_like.default: None,
    torch.ops.aten.new_full.default: None,
}
_FILL_IN_PLACE = {torch.ops.aten.zero_.default: 0, torch.ops.aten.fill_.Scalar: None}


class _Refused(Exception):
    pass


def _is_view(func) -> bool:
    """An op whose result aliases its input without writing (view, slice, detach, view.dtype)."""
    schema = func._schema
    return (
        not schema.is_mutable
        and len(schema.returns) == 1
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
    )


class _Recorder(TorchDispatchMode):
    """Watches one call: its allocations, fills and launches (module docstring)."""

    def __init__(self, inputs: Sequence[torch.Tensor | None]) -> None:
        super().__init__()
        self.inputs = list(inputs)
        self.input_at: dict[int, list[int]] = {}  # storage address -> the inputs in that storage
        for i, t in enumerate(self.inputs):
            if t is not None:
                self.input_at.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        self.allocs: list[tuple[int, int]] = []  # (storage address, bytes) per allocation
        self.alloc_at: dict[int, int] = {}  # storage address -> the latest allocation there
        self.steps: list[tuple] = []  # ("fill", ref, dtype, numel, value) | ("launch", ...)
        self.held: list[torch.Tensor] = []  # tensors the plan points at that live on
        self.refused: str | None = None
        self.quiet = False  # inside a launch: the ops Triton runs there are its own

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """The launch itself: its own ops (the interpreter's copies, Triton's scratch) are not the call's."""
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    # ---- aten ops ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet or self.refused is not None or _is_view(func):
            return out
        if func in _ALLOC:
            self._allocated(out)
        elif func in _CREATE_FILLED:
            value = _CREATE_FILLED[func]
            self._allocated(out)
            self._fill(out, value if value is not None else _fill_value(func, args, kwargs))
        elif func in _FILL_IN_PLACE:
            value = _FILL_IN_PLACE[func]
            self._fill(args[0], value if value is not None else args[1])
        else:
            self.refused = f"the call runs {func} (only allocations, fills, views and launches replay)"
        return out

    def _allocated(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self.alloc_at[s.data_ptr()] = len(self.allocs)
        self.allocs.append((s.data_ptr(), s.nbytes()))

    def _fill(self, t: torch.Tensor, value) -> None:
        if not t.is_contiguous():
            self.refused = "a fill of a strided view"
            return
        try:
            ref = self.ref(t)
        except _Refused as e:
            self.refused = str(e)
            return
        if ref[0] == "held":  # a buffer that lives on (a workspace): the same tensor is filled again
            self.steps.append(("fill_held", t, value))
        elif not isinstance(ref[0], tuple):
            self.refused = "a fill of an input"
        else:
            self.steps.append(("fill", ref, t.dtype, t.numel(), value))

    # ---- launches ---------------------------------------------------------------------
    def ref(self, t: torch.Tensor) -> tuple:
        """Where tensor ``t`` points: (input index, byte offset from that input's address), or
        (('alloc', j), byte offset in allocation j), or ('held', the tensor)."""
        sp = t.untyped_storage().data_ptr()
        j = self.alloc_at.get(sp)
        if j is not None:
            return (("alloc", j), t.data_ptr() - self.allocs[j][0])
        inputs = self.input_at.get(sp)
        if inputs is not None:
            return _within(t.data_ptr(), inputs, self.inputs)
        self.held.append(t)
        return ("held", t)

    def launched(self, args: tuple, launcher) -> None:
        """One launch through ``kernels.launch``: ``launcher`` makes it again (``launches_recorded``)."""
        if self.refused is not None:
            return
        template, fixups = [], []
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                try:
                    ref = self.ref(a)
                except _Refused as e:
                    self.refused = str(e)
                    return
                if ref[0] == "held":
                    template.append(ref[1])
                else:
                    template.append(None)
                    fixups.append((pos, ref, a.dtype, tuple(a.shape), a.stride()))
            else:
                template.append(a)
        self.steps.append(("launch", launcher, template, tuple(fixups)))

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why


def _within(ptr: int, candidates: list[int], inputs) -> tuple[int, int]:
    """(input index, byte offset) of address ``ptr`` in the one input of ``candidates`` (inputs that
    share a storage) whose memory holds it: the offset is then valid for that input alone, whatever
    lies around it in a later call (the plan's key fixes each input's shape and strides, not where
    inputs sit relative to each other)."""
    exact = [i for i in candidates if inputs[i].data_ptr() == ptr]
    if len(exact) == 1:
        return exact[0], 0
    holding = [i for i in candidates if inputs[i].data_ptr() <= ptr < inputs[i].data_ptr() + _span(inputs[i])]
    if len(exact) > 1 or len(holding) != 1:
        raise _Refused("a tensor argument in memory that two inputs (or none of them) cover")
    i = holding[0]
    return i, ptr - inputs[i].data_ptr()


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _fill_value(func, args, kwargs):
    if func is torch.ops.aten.full.default:
        return args[1]
    return args[1] if len(args) > 1 else kwargs["fill_value"]


class LaunchPlan:
    """The recorded launches of one call (module docstring); ``replay(inputs)`` runs them again."""

    def __init__(self, rec: _Recorder, result: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        self.single = isinstance(result, torch.Tensor)
        results = (result,) if self.single else tuple(result)
        outs = {}  # allocation -> result index
        for r in results:
            j = rec.alloc_at.get(r.untyped_storage().data_ptr()) if isinstance(r, torch.Tensor) else None
            if j is None or j in outs or r.data_ptr() != rec.allocs[j][0] or not r.is_contiguous():
                raise _Refused("a result is not a fresh contiguous tensor of the call")
            if rec.allocs[j][1] != r.numel() * r.element_size():
                raise _Refused("a result is a view of a larger allocation")
            outs[j] = len(outs)
        self.outs = tuple((tuple(r.shape), r.dtype) for r in results)
        self.device = results[0].device
        n_in = len(rec.inputs)
        # bases of the pointers: the inputs, then the scratch buffer, then the results. Scratch holds
        # every allocation but the results', each at a 256-byte boundary.
        offsets, size = {}, 0
        for j, (_, nbytes) in enumerate(rec.allocs):
            if j not in outs:
                offsets[j] = size
                size += -(-nbytes // _ALIGN) * _ALIGN
        self.scratch_bytes = size

        def base(ref) -> tuple[int, int]:
            where, off = ref
            if isinstance(where, tuple):  # an allocation of the call
                j = where[1]
                return (n_in + 1 + outs[j], off) if j in outs else (n_in, offsets[j] + off)
            return (where, off)

        self.steps = []
        for step in rec.steps:
            if step[0] == "fill":
                _, ref, dtype, numel, value = step
                self.steps.append(("fill", *base(ref), dtype, numel, value))
            elif step[0] == "fill_held":
                self.steps.append(step)
            else:
                _, launcher, template, fixups = step
                fix = tuple((pos, *base(ref), dtype, shape, stride) for pos, ref, dtype, shape, stride in fixups)
                self.steps.append(("launch", launcher, template, fix))
        self.held = rec.held
        self.interpreted = self.device.type != "cuda"
        self._run = None if self.interpreted else _compile(self.steps)

    def replay(self, inputs: Sequence[torch.Tensor | None]):
        """The recorded call on ``inputs`` (tensors of the recorded kinds, in the recorded order)."""
        dev = self.device
        outs = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in self.outs]
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=dev) if self.scratch_bytes else None
        tensors = (*inputs, scratch, *outs)
        if self.interpreted:
            self._replay_views(tensors)
        else:
            bases = [0 if t is None else t.data_ptr() for t in tensors]
            self._run(bases, tensors, _raw_stream(dev.index))
        return outs[0] if self.single else tuple(outs)

    def _replay_views(self, tensors) -> None:
        """The steps with tensor views at the recorded offsets (the interpreter takes tensors)."""
        for step in self.steps:
            if step[0] == "launch":
                _, launcher, template, fix = step
                args = list(template)
                for pos, b, off, dtype, shape, stride in fix:
                    args[pos] = _view(tensors[b], off, dtype, shape, stride)
                launcher(args)
            elif step[0] == "fill_held":
                step[1].fill_(step[2])
            else:
                _fill(tensors, *step[1:])


def _fill(tensors, b: int, off: int, dtype: torch.dtype, numel: int, value) -> None:
    _view(tensors[b], off, dtype, (numel,), (1,)).fill_(value)


def _compile(steps: list[tuple]) -> Callable:
    """The steps as one generated function ``f(bases, tensors, stream)``: each launch a direct call
    of its binary with the constants bound and each pointer ``bases[i] + offset``, so a replay costs
    the binaries' own calls plus ~1 us of Python per launch (a loop over templates cost ~10 us)."""
    names: dict[str, object] = {"_fill": _fill, "_ensure_allocator": ensure_allocator}
    lines = ["def replay(bases, tensors, stream):"]
    if any(s[0] == "launch" and s[1].needs_allocator for s in steps):  # this thread may not have one yet
        lines.append("    _ensure_allocator()")
    for i, step in enumerate(steps):
        if step[0] == "fill":
            names[f"F{i}"] = step[1:]
            lines.append(f"    _fill(tensors, *F{i})")
            continue
        if step[0] == "fill_held":
            names[f"H{i}"], names[f"V{i}"] = step[1:]
            lines.append(f"    H{i}.fill_(V{i})")
            continue
        _, d, template, fix = step
        args = []
        fixed = {pos: (b, off) for pos, b, off, *_ in fix}
        for pos, v in enumerate(template):
            if pos in fixed:
                b, off = fixed[pos]
                args.append(f"bases[{b}] + {off}")
            else:
                if isinstance(v, torch.Tensor):  # lives on (held by the plan): its address is constant
                    v = v.data_ptr()
                names[f"C{i}_{pos}"] = v
                args.append(f"C{i}_{pos}")
        names.update({f"R{i}": d.run, f"N{i}": d.function, f"P{i}": d.packed, f"T{i}": d.constexprs})
        call = [*map(str, d.grid), "stream", f"N{i}", f"P{i}", "None", "None", "None", *args, f"*T{i}"]
        lines.append(f"    R{i}({', '.join(call)})")
    if len(lines) == 1:
        lines.append("    pass")
    exec(compile("\n".join(lines), "<fusedmoe launch plan>", "exec"), names)  # noqa: S102 - generated above
    return names["replay"]


def _view(base: torch.Tensor, off: int, dtype: torch.dtype, shape, stride) -> torch.Tensor:
    """A ``dtype`` view ``off`` bytes past ``base``'s first element."""
    storage = base.untyped_storage()
    start = base.data_ptr() - storage.data_ptr() + off
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=base.device).set_(storage, start // size, shape, stride)


def record(fn: Callable, inputs: Sequence[torch.Tensor | None]):
    """Run ``fn()`` once, watched: (its result, a ``LaunchPlan`` or the reason there is none).
    ``fn`` returns a tensor or a tuple of tensors, each allocated by the call."""
    rec = _Recorder(inputs)
    with launches_recorded(rec), rec:
        result = fn()
    if rec.refused is not None:
        return result, rec.refused
    try:
        return result, LaunchPlan(rec, result)
    except _Refused as e:
        return result, str(e)


def logits_plan_key(logits: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What a routing launch depends on besides addresses: the logits' kind (shape, strides, dtype,
    device, 16-byte alignment) and which bias tensor (the router's plans, and ``MoEKernel``'s
    joint plans of routing and experts)."""
    b = None if bias is None else (id(bias), bias.data_ptr())
    return (logits.shape, logits.stride(), logits.dtype, logits.get_device(), logits.data_ptr() & 15, b)


class LaunchPlans:
    """Plans by key, at most ``capacity`` of them (least recently used dropped first).

    ``call(key, fn, inputs)``: the first call with a key runs ``fn``; the second records it; later
    calls replay the plan (module docstring). ``refused`` maps a key to why it has no plan.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self.plans: OrderedDict[tuple, LaunchPlan] = OrderedDict()
        self.refused: dict[tuple, str] = {}
        self._seen: set[tuple] = set()

    def replay(self, key: tuple, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The plan's result for ``key``, or None when there is none (or plans are off now)."""
        plan = self.plans.get(key)
        if plan is None or not plannable():
            return None
        return plan.replay(inputs)

    def call(
        self,
        key: tuple,
        fn: Callable[[], torch.Tensor],
        inputs: Sequence[torch.Tensor | None],
        plain: Callable[[], torch.Tensor] | None = None,
    ):
        """``fn()``, or its plan's replay (class docstring). ``plain``: what runs in its place in
        the calls that neither record nor replay (the first with a key, a refused key, plans
        off), where it computes what ``fn`` does by other means (its own checks, other plans)."""
        plan = self.plans.get(key)
        plain = plain or fn
        if not plannable():
            return plain()
        if plan is not None:
            self.plans.move_to_end(key)
            return plan.replay(inputs)
        if key in self.refused:
            return plain()
        if key not in self._seen:
            result = plain()  # seen once it has run: a call that raised (bad input) is not recorded next
            if len(self._seen) > 8 * self.capacity:
                self._seen.clear()
            self._seen.add(key)
            return result
        result, got = record(fn, inputs)
        if isinstance(got, LaunchPlan):
            self.plans[key] = got
            while len(self.plans) > self.capacity:
                self.plans.popitem(last=False)
        else:
            if len(self.refused) >= 8 * self.capacity:  # bounded, as ``_seen`` (prefill lengths vary)
                self.refused.clear()
            self.refused[key] = got
        return result

    def clear(self) -> None:
        self.plans.clear()
        self.refused.clear()
        self._seen.clear()
