"""Fixes for Triton-interpreter bugs, applied by conftest.py when TRITON_INTERPRET=1.

Measured on triton 3.6-3.9 (see the project notes on the interpreter):
- bf16 ``tl.dot`` multiplies the raw uint16 bit patterns (errors of 1e11);
  we widen bf16 operands to fp32 first.
- fp32 -> bf16 casts truncate and fp32 -> fp8 casts drop mantissa carries
  (31.6 -> 16); we route float downcasts through torch (round to nearest
  even, fp8 saturating at the format's max, like the GPU's cvt.rn.satfinite).
- ``@triton.autotune`` with several configs asks for a GPU benchmarker; we run
  each config once instead (which also checks every config).
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


def _convert_float(input, input_dtype, output_dtype, rounding_mode):
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
    ip.InterpreterBuilder.create_dot = _create_dot
    at.Autotuner.do_bench = property(_do_bench)
