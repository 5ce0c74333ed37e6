"""``kernels.launch``: which launches take the binary's launcher, and with what arguments.

A stand-in kernel (Triton's ``params`` and ``kernel[grid](...)`` returning a compiled object)
records every launch, so the logic runs on a CPU: the first launch of a specialisation goes
through ``kernel[grid]``, the next ones through the compiled launcher with the runtime arguments
then the constexpr values in signature order; anything Triton would specialise differently (an
int that is 1 or divisible by 16, a tensor's 16-byte alignment, a constexpr) is another key; a
set launch hook keeps Triton's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton import knobs

from fusedmoe.kernels import launch as L


@dataclass
class _Param:
    name: str
    is_constexpr: bool


class _Compiled:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn", "meta", log

    @property
    def run(self):
        return lambda *a: self.log.append(("fast", a))


class _Kernel:
    params = [_Param("x", False), _Param("n", False), _Param("BLOCK", True), _Param("MODE", True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def slow(*args, **kwargs):
            self.log.append(("slow", grid, args, kwargs))
            return _Compiled(self.log)

        return slow


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "raw_stream", lambda device: 1234)
    L.clear_cache()
    yield
    L.clear_cache()


def test_second_launch_of_a_key_takes_the_launcher(fast):
    k, x = _Kernel(), torch.zeros(64)
    L.launch(k, (3,), x, 7, BLOCK=16, MODE="a", num_warps=4, num_stages=2)
    L.launch(k, (5, 2), x, 7, BLOCK=16, MODE="a", num_warps=4, num_stages=2)
    assert [e[0] for e in k.log] == ["slow", "fast"]
    # grid, stream, function, metadata, no launch metadata or hooks, then args and constexprs in order
    assert k.log[1][1] == (5, 2, 1, 1234, "fn", "meta", None, None, None, x, 7, 16, "a")


@pytest.mark.parametrize(
    "change",
    [
        dict(n=1),  # Triton bakes a 1 into the binary
        dict(n=32),  # divisible by 16
        dict(n=2**40),  # a 64-bit int
        dict(block=32),  # a constexpr
        dict(warps=8),
        dict(offset=1),  # a tensor no longer 16-byte aligned
    ],
)
def test_anything_triton_specialises_on_is_another_key(fast, change):
    k, x = _Kernel(), torch.zeros(64)
    L.launch(k, (1,), x, 7, BLOCK=16, MODE="a", num_warps=4, num_stages=2)
    arg = x[change.get("offset", 0) :]
    L.launch(k, (1,), arg, change.get("n", 7), BLOCK=change.get("block", 16), MODE="a",
             num_warps=change.get("warps", 4), num_stages=2)  # fmt: skip
    assert [e[0] for e in k.log] == ["slow", "slow"]


def test_a_set_launch_hook_keeps_tritons_path(fast):
    k, x = _Kernel(), torch.zeros(64)
    L.launch(k, (1,), x, 7, BLOCK=16, MODE="a")
    hook = lambda *_: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        L.launch(k, (1,), x, 7, BLOCK=16, MODE="a")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    L.launch(k, (1,), x, 7, BLOCK=16, MODE="a")
    assert [e[0] for e in k.log] == ["slow", "slow", "fast"]


def test_unknown_argument_types_and_keyword_runtime_args_keep_tritons_path(fast):
    k = _Kernel()
    L.launch(k, (1,), object(), 7, BLOCK=16, MODE="a")
    L.launch(k, (1,), object(), 7, BLOCK=16, MODE="a")
    L.launch(k, (1,), torch.zeros(4), BLOCK=16, MODE="a", n=7)
    assert [e[0] for e in k.log] == ["slow", "slow", "slow"]


def test_switched_off_by_the_environment(fast, monkeypatch):
    monkeypatch.setenv("FUSEDMOE_FAST_LAUNCH", "0")
    k, x = _Kernel(), torch.zeros(64)
    for _ in range(2):
        L.launch(k, (1,), x, 7, BLOCK=16, MODE="a")
    assert [e[0] for e in k.log] == ["slow", "slow"]
