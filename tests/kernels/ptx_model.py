"""A model of the few PTX instructions ``kernels/_w4_unpack.py`` uses, to run its exact instruction
strings on the CPU (the interpreter runs no PTX; a GPU run is the only other check).

Registers are numpy uint32 arrays (one lane of work per element); ``run(ptx, inputs, n_out)``
binds ``$0..`` (outputs first, then inputs, as ``tl.inline_asm_elementwise`` numbers them) and
returns the outputs. Floats follow PTX: ``fma.rn`` computes a*b + c exactly and rounds once to
nearest even; subnormals are kept (PTX's bf16x2/f16x2 fma does not flush them).
"""

from __future__ import annotations

import re

import numpy as np


def _bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, to bf16's 8 significant bits (subnormals: multiples of 2^-133)."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    e = np.maximum(e, -125)  # below 2^-126 the spacing stays 2^-133
    q = np.round(np.ldexp(x, 8 - e))  # np.round: half to even
    y = np.ldexp(q, e - 8).astype(np.float32)  # exact: 8 bits fit float32
    return (y.view(np.uint32) >> 16).astype(np.uint32)


def _f16_to_f64(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def _f64_to_f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)


_FLOAT = {"bf16x2": (_bf16_to_f64, _f64_to_bf16), "f16x2": (_f16_to_f64, _f64_to_f16)}


def _fma(kind: str, a, b, c):
    dec, enc = _FLOAT[kind]
    out = np.zeros_like(a)
    for shift in (0, 16):
        la, lb, lc = ((v >> shift) & 0xFFFF for v in (a, b, c))
        r = enc(dec(la) * dec(lb) + dec(lc))
        out |= (r & 0xFFFF) << shift
    return out


def _prmt(a, b, sel):
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        out |= pool[(sel >> (4 * i)) & 7] << (8 * i)  # the sign-replicate bit (8) is not used
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(8):  # the LUT's bit (a<<2 | b<<1 | c) of the inputs' bits, per position
        ia, ib, ic = (bit >> 2) & 1, (bit >> 1) & 1, bit & 1
        if (lut >> (ia * 4 + ib * 2 + ic)) & 1:
            sel = (a if ia else ~a) & (b if ib else ~b) & (c if ic else ~c)
            out |= sel
    return out & 0xFFFFFFFF


def run(ptx: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """Execute ``ptx`` (one ``{ ... }`` block of the supported instructions) on uint32 arrays."""
    n = len(inputs[0])
    regs: dict[str, np.ndarray] = {f"${i}": np.zeros(n, dtype=np.uint32) for i in range(n_out)}
    regs.update({f"${n_out + i}": np.asarray(v, dtype=np.uint32) for i, v in enumerate(inputs)})

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return np.full(n, int(tok, 0), dtype=np.uint32)
        raise KeyError(f"register {tok!r} read before it is written")

    for stmt in ptx.replace("\n", " ").split(";"):
        stmt = stmt.strip(" {}")
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        dst, srcs = args[0], args[1:]
        if op == "mov.b32":
            r = val(srcs[0])
        elif op == "prmt.b32":
            r = _prmt(val(srcs[0]), val(srcs[1]), int(srcs[2], 0))
        elif op == "shr.u32":
            r = val(srcs[0]) >> int(srcs[1], 0)
        elif op == "shl.b32":
            r = (val(srcs[0]) << int(srcs[1], 0)) & 0xFFFFFFFF
        elif op == "and.b32":
            r = val(srcs[0]) & val(srcs[1])
        elif op == "lop3.b32":
            r = _lop3(val(srcs[0]), val(srcs[1]), val(srcs[2]), int(srcs[3], 0))
        elif op.startswith("fma.rn."):
            kind = op.split(".")[-1]
            for s in srcs:  # PTX takes float operands of fma from registers only
                assert not re.fullmatch(r"0x[0-9a-fA-F]+|\d+", s), f"immediate float operand in {stmt!r}"
            r = _fma(kind, val(srcs[0]), val(srcs[1]), val(srcs[2]))
        else:
            raise NotImplementedError(f"no model of {op!r}")
        regs[dst] = r.astype(np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]
