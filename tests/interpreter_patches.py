"""Fixes for Triton-interpreter bugs, applied by conftest.py when TRITON_INTERPRET=1.

Measured on triton 3.6-3.9 (see the project notes on the interpreter):
- bf16 ``tl.dot`` multiplies the raw uint16 bit patterns (errors of 1e11);
  we widen bf16 operands to fp32 first.
- fp32 -> bf16 casts truncate and fp32 -> fp8 casts drop mantissa carries
  (31.6 -> 16); we route float downcasts through torch (round to nearest
  even, fp8 saturating at the format's max, like the GPU's cvt.rn.satfinite).
- ``@triton.autotune`` with several configs asks for a GPU benchmarker; we run
  each config once instead (which also checks every config).
- float ``tl.maximum``/``tl.minimum`` without ``propagate_nan`` (maxnum/minnum) propagate
  NaN here (np.maximum; seen on 3.6), where the GPU returns the other operand (PTX max.f32/min.f32);
  we use np.fmax/np.fmin, so a kernel that loses a NaN on the GPU loses it here too.
- e4m3fn -> wider casts read the NaN codes 0x7F/0xFF as +-480 (e4m3fn has no Inf; the
  generic converter assumes IEEE specials); we route them through torch too.
Nothing here changes what a kernel computes on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner as at
from triton.runtime import interpreter as ip

_TORCH = {
    tl.bfloat16: (torch.bfloat16, torch.uint16, None),
    tl.float16: (torch.float16, torch.uint16, None),
    tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, 448.0),
    tl.float8e5: (torch.float8_e5m2, torch.uint8, 57344.0),
}

_orig_convert = ip._convert_float
_orig_dot = ip.InterpreterBuilder.create_dot


def _to_f32(data, dtype):
    if dtype == tl.float32:
        return np.asarray(data, dtype=np.float32)
    if dtype == tl.float16:
        return np.asarray(data).view(np.float16).astype(np.float32)
    return _orig_convert(data, dtype, tl.float32, None).view(np.float32)


_INT = {16: (torch.int16, np.uint16), 32: (torch.int32, np.uint32), 64: (torch.int64, np.uint64)}
_FLOAT = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16, tl.float32: torch.float32, tl.float64: torch.float64}


def _convert_float(input, input_dtype, output_dtype, rounding_mode):
    if input_dtype == tl.float8e4nv and output_dtype in _FLOAT:
        t = torch.from_numpy(np.ascontiguousarray(input).view(np.uint8)).view(torch.float8_e4m3fn)
        tint, npint = _INT[output_dtype.primitive_bitwidth]
        return t.to(_FLOAT[output_dtype]).view(tint).numpy().view(npint)
    down = output_dtype.primitive_bitwidth < input_dtype.primitive_bitwidth
    if not down or output_dtype not in _TORCH:
        return _orig_convert(input, input_dtype, output_dtype, rounding_mode)
    tdtype, store, sat = _TORCH[output_dtype]
    t = torch.from_numpy(np.ascontiguousarray(_to_f32(input, input_dtype)))
    if sat is not None:
        t = torch.where(torch.isnan(t), t, t.clamp(-sat, sat))
    return t.to(tdtype).view(store).numpy().view(getattr(np, f"uint{output_dtype.primitive_bitwidth}"))


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            data = (np.asarray(h.data).astype(np.uint32) << 16).view(np.float32)
            return ip.TensorHandle(data, tl.float32)
        return h

    return _orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)


def _do_bench(self):
    def run_once(fn, quantiles=None, **kwargs):
        fn()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    return run_once


def apply() -> None:
    ip._convert_float = _convert_float
    ip.InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    ip.InterpreterBuilder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    ip.InterpreterBuilder.create_dot = _create_dot
    at.Autotuner.do_bench = property(_do_bench)
