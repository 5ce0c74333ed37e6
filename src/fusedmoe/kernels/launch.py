"""``launch``: a jit kernel launched for the price of its driver call, once it has run.

    launch(kernel, grid, *args, num_warps=4, num_stages=3, **constexprs)
      ==  kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)

Why: ``JITFunction.run`` spends its time before the launch: it binds every argument into a
dict, specialises each, builds a cache key (``str`` of the options dict), looks the binary up,
checks the globals the kernel reads, and asks for launch metadata. On the H100 host this was
~40 us per launch under cProfile for the grouped GEMM's ~70 arguments (2,500 launches: 0.228 s
in ``JITFunction.run``; 2026-11-25), against ~10 us in the driver call itself. An eager MoE layer
launches 4-9 kernels, so this was the largest part of a decode call's host time.

How: the first launch of a *key* goes through ``kernel[grid]`` (which compiles or loads the binary
and returns it); later launches of the same key call the binary's launcher directly. The key holds
everything Triton specialises on: the constexpr values, num_warps/num_stages, the device, and for
each runtime argument what Triton's specialisation distinguishes (a tensor's dtype and whether its
address is 16-byte aligned; an int equal to 1, divisible by 16, and its width; floats, bools and
None by type). The key is as fine as Triton's or finer, so a hit always reuses the binary Triton
itself would have chosen.

A kernel with a ``PDL`` constexpr (it starts with ``_common.pdl_wait``) is launched with
programmatic dependent launch where ``pdl_enabled()``: ``PDL=True`` and Triton's ``launch_pdl``
option, both part of the key, so a binary is built for each.

Falls back to ``kernel[grid]`` under the interpreter, while a launch hook is set (profilers), and
for an argument type it does not know. ``FUSEDMOE_FAST_LAUNCH=0`` turns the fast path off.
Interceptors (``intercept_launches``) see every launch, fast or not (the tuner records what it
would compile). A launch plan being recorded (``launches_recorded``, per thread) is told how to make
each launch again (``DirectLaunch``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
from triton import knobs

from .. import env
from ..platform import current_platform
from ._common import interpreting
from .launch_config import scoped_override

_I32 = (-(2**31), 2**31 - 1)
_CACHE: dict[tuple, tuple] = {}
_ORDER: dict[object, tuple] = {}  # kernel -> (constexpr names in signature order, #runtime args)
_INTERCEPTORS: list[Callable] = []
_TLS = threading.local()  # .recorder: the launch plan this thread is recording (``modular.replay``)


def _spec(v) -> object:
    """What Triton's specialisation distinguishes about one runtime argument (or a sentinel that
    makes the launch take the slow path)."""
    t = type(v)
    if t is int:
        if v == 1:
            return 1
        return (v % 16 == 0, 0 if _I32[0] <= v <= _I32[1] else (1 if v < 2**63 else 2))
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (v.dtype, v.data_ptr() % 16 == 0)
    if v is None:
        return None
    if t is float:
        return "f"
    if t is bool:
        return ("b", v)
    raise _Unknown


class _Unknown(Exception):
    pass


def _order(kernel) -> tuple:
    """(constexpr parameter names in signature order, number of leading runtime parameters), or
    None when constexprs and runtime parameters interleave (the fast path then never applies)."""
    got = _ORDER.get(kernel)
    if got is None:
        params = kernel.params
        n_rt = sum(1 for p in params if not p.is_constexpr)
        tail_ok = all(p.is_constexpr for p in params[n_rt:])
        got = (tuple(p.name for p in params[n_rt:]), n_rt) if tail_ok else ((), -1)
        _ORDER[kernel] = got
    return got


@contextlib.contextmanager
def intercept_launches(fn: Callable) -> Iterator[Callable]:
    """While active, every ``launch`` calls ``fn(kernel, grid, args, kwargs)`` instead of launching
    (``fn`` may launch itself with ``kernel[grid](*args, **kwargs)``). For tools (the tuner records
    and pre-compiles what a launch would compile); nested interceptors: the innermost wins."""
    _INTERCEPTORS.append(fn)
    try:
        yield fn
    finally:
        _INTERCEPTORS.pop()


@contextlib.contextmanager
def launches_recorded(recorder) -> Iterator:
    """While active, every ``launch`` launches as usual and then tells ``recorder.launched(args,
    launcher)`` how to make the same launch again with other arguments of the same kinds:
    ``launcher`` is a ``DirectLaunch`` (the binary, called with pointers as ints) on CUDA, or a
    callable ``f(args)`` under the interpreter (tensors for pointers). A launch that cannot be made
    so calls ``recorder.refuse(why)``. The launch itself runs inside ``recorder.launching()``. For
    launch plans (``modular.replay``)."""
    outer = getattr(_TLS, "recorder", None)
    _TLS.recorder = recorder
    try:
        yield recorder
    finally:
        _TLS.recorder = outer


@dataclass(frozen=True)
class DirectLaunch:
    """A compiled kernel and how to call it: ``run(*grid, stream, function, packed, None, None,
    None, *args, *constexprs)`` launches it on ``stream`` (Triton 3.6's launcher signature)."""

    run: Callable
    grid: tuple[int, int, int]
    function: int
    packed: object
    constexprs: tuple
    needs_allocator: bool = False  # global scratch (device-side tensor descriptors): ``ensure_allocator`` first


def plannable() -> bool:
    """Whether launch plans may record or replay now: no interceptor (the tuner), no scoped launch
    config (``override_launch_config``: a plan would replay the configs it recorded), no launch
    hook (a profiler sees Triton's own launches), and ``FUSEDMOE_LAUNCH_PLANS`` on."""
    return not _INTERCEPTORS and not scoped_override() and env.launch_plans() and (interpreting() or not _hooked())


def _alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (Triton asks at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def ensure_allocator() -> None:
    """Install ``_alloc`` unless the caller set an allocator. Triton keeps it in a ContextVar,
    so a thread that never set one (a new thread starts with Triton's null allocator) gets it
    at its first launch."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # another Triton layout: set ours
        pass
    triton.set_allocator(_alloc)


def _record(rec, kernel, grid: tuple, args: tuple, opts: dict, constexprs: dict) -> None:
    kw = dict(constexprs, **opts)
    with rec.launching():
        compiled = kernel[grid](*args, **kw)
    if interpreting():
        rec.launched(args, lambda a: kernel[grid](*a, **kw))
        return
    names, n_rt = _order(kernel)
    if n_rt != len(args) or len(names) != len(constexprs) or not hasattr(compiled, "packed_metadata"):
        rec.refuse(f"kernel {getattr(kernel, '__name__', kernel)} has no binary to launch directly")
        return
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    cvals = tuple(constexprs[n] for n in names)
    scratch = getattr(compiled.run, "global_scratch_size", 0) > 0
    rec.launched(args, DirectLaunch(compiled.run, g, compiled.function, compiled.packed_metadata, cvals, scratch))


_PDL_TAKERS: dict[object, bool] = {}
_PDL_HW: list[bool] = []  # [whether the GPU takes PDL], found at the first launch that asks


def pdl_enabled() -> bool:
    """Whether kernels that take ``PDL`` get it: a CUDA GPU of compute capability 9.0+ (the PTX
    ``griddepcontrol`` instructions), not the interpreter, and ``FUSEDMOE_PDL`` on."""
    if not _PDL_HW:
        _PDL_HW.append(not interpreting() and current_platform().at_least(9, 0))
    return _PDL_HW[0] and env.pdl()


def _takes_pdl(kernel) -> bool:
    """Whether the kernel has a ``PDL`` parameter (jit and interpreted functions both name theirs
    in ``arg_names``)."""
    got = _PDL_TAKERS.get(kernel)
    if got is None:
        names = getattr(kernel, "arg_names", None) or [p.name for p in getattr(kernel, "params", ())]
        got = _PDL_TAKERS[kernel] = "PDL" in names
    return got


def launch(kernel, grid: tuple, *args, num_warps: int = 4, num_stages: int = 3, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=..., num_stages=..., **constexprs)`` (module docstring)."""
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if _takes_pdl(kernel) and constexprs.setdefault("PDL", pdl_enabled()):
        opts["launch_pdl"] = True
    if _INTERCEPTORS:
        _INTERCEPTORS[-1](kernel, grid, args, dict(constexprs, **opts))
        return
    rec = getattr(_TLS, "recorder", None)
    if rec is not None:
        _record(rec, kernel, grid, args, opts, constexprs)
        return
    if interpreting() or not env.fast_launch():
        kernel[grid](*args, **opts, **constexprs)
        return
    names, n_rt = _order(kernel)
    try:
        if n_rt != len(args) or len(names) != len(constexprs):
            raise _Unknown
        cvals = tuple(constexprs[n] for n in names)
        device = torch.cuda.current_device()
        key = (kernel, device, num_warps, num_stages, cvals, tuple(map(_spec, args)))
    except (_Unknown, KeyError):
        kernel[grid](*args, **opts, **constexprs)
        return
    hit = _CACHE.get(key)
    if hit is None or _hooked():
        compiled = kernel[grid](*args, **opts, **constexprs)
        if compiled is not None and hasattr(compiled, "packed_metadata"):
            _CACHE[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        return
    run, function, packed = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, raw_stream(device), function, packed, None, None, None, *args, *cvals)


raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def _hooked() -> bool:
    """A launch hook (a profiler) is set: launches keep Triton's path, which calls it. Triton 3.6
    keeps its hooks in chains that always exist (``knobs.HookChain``): a hook is set when one
    holds a call."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def clear_cache() -> None:
    """Forget the binaries found so far (tests)."""
    _CACHE.clear()
