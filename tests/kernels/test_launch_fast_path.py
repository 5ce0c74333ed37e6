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

from fusedmoe.errors import FusedMoEError
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


class _PdlKernel(_Kernel):
    params = [*_Kernel.params, _Param("PDL", True)]


PDL_CASES = [  # (label, GPU takes PDL, FUSEDMOE_PDL, the caller's PDL, expected PDL)
    ("no sm_90 GPU, or the interpreter", False, None, None, False),
    ("sm_90, default", True, None, None, True),
    ("sm_90, FUSEDMOE_PDL=0", True, "0", None, False),
    ("sm_90, FUSEDMOE_PDL=on", True, "on", None, True),
    ("sm_90, the caller's PDL=False kept", True, None, False, False),
]


@pytest.mark.parametrize("label, hw, var, given, want", PDL_CASES, ids=[c[0] for c in PDL_CASES])
def test_kernels_taking_pdl_get_it_with_the_launch_attribute(fast, monkeypatch, label, hw, var, given, want):
    monkeypatch.setattr(L, "_PDL_HW", [hw])
    if var is None:
        monkeypatch.delenv("FUSEDMOE_PDL", raising=False)
    else:
        monkeypatch.setenv("FUSEDMOE_PDL", var)
    k, x = _PdlKernel(), torch.zeros(64)
    extra = {} if given is None else {"PDL": given}
    for _ in range(2):
        L.launch(k, (1,), x, 7, BLOCK=16, MODE="a", **extra)
    slow, fast_ = k.log
    assert slow[3]["PDL"] is want and slow[3].get("launch_pdl", False) is want
    assert fast_[0] == "fast" and fast_[1][-3:] == (16, "a", want)  # the constexpr is part of the key


def test_pdl_is_part_of_the_key_and_kernels_without_it_never_get_it(fast, monkeypatch):
    monkeypatch.setattr(L, "_PDL_HW", [True])
    k, plain, x = _PdlKernel(), _Kernel(), torch.zeros(64)
    for var in ("1", "0", "1"):
        monkeypatch.setenv("FUSEDMOE_PDL", var)
        L.launch(k, (1,), x, 7, BLOCK=16, MODE="a")
        L.launch(plain, (1,), x, 7, BLOCK=16, MODE="a")
    assert [e[0] for e in k.log] == ["slow", "slow", "fast"]
    assert [e[0] for e in plain.log] == ["slow", "fast", "fast"] and "launch_pdl" not in plain.log[0][3]


def test_a_bad_pdl_variable_is_an_error_naming_it(fast, monkeypatch):
    monkeypatch.setattr(L, "_PDL_HW", [True])
    monkeypatch.setenv("FUSEDMOE_PDL", "sometimes")
    with pytest.raises(FusedMoEError, match="FUSEDMOE_PDL: expected one of"):
        L.launch(_PdlKernel(), (1,), torch.zeros(64), 7, BLOCK=16, MODE="a")
