"""What is quantized, how, and with which scales: ``QuantScheme``.

A scheme holds four ``TensorQuant`` descriptions, one per operand of the two
expert GEMMs::

    a1: activations into GEMM1    w1: W13 [E, 2I, H]
    a2: activations into GEMM2    w2: W2  [E, H, I]

``None`` means "not quantized" (the operand stays in the model dtype).

Scale convention, everywhere in fusedmoe: a scale is a *dequantization
multiplier*, ``x ~= q * scale`` (times ``global_scale`` where there is one).
Scale shapes keep every dim so they broadcast against the grouped tensor; for
a tensor ``[*B, N, K]`` (``B`` = experts for weights, nothing for activations)::

    tensor       [*B, 1, 1]
    token/channel[*B, N, 1]            one scale per row
    group(g)     [*B, N, ceil(K/g)]    one scale per g consecutive columns
    block(bn,bk) [*B, ceil(N/bn), ceil(K/bk)]

"token" and "channel" are the same shape rule; the names say whether the rows
are tokens (activations) or output channels (weights).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import expect


class QDtype(str, enum.Enum):
    """Storage format of a quantized operand."""

    FP8 = "fp8_e4m3"  # torch.float8_e4m3fn, max 448
    INT8 = "int8"  # symmetric, [-128, 127]
    INT4 = "int4"  # 4-bit integers, packed two per uint8 (GPTQ/AWQ packers in quant.int4)
    MXFP4 = "mxfp4"  # e2m1 packed two per uint8, e8m0 scale per 32 (OCP MX)
    NVFP4 = "nvfp4"  # e2m1 packed two per uint8, e4m3 scale per 16, fp32 global scale
    MXFP8 = "mxfp8"  # e4m3 with an e8m0 scale per 32 (OCP MX)

    def __repr__(self) -> str:
        return f"QDtype.{self.name}"

    @property
    def bits(self) -> int:
        return {"fp8_e4m3": 8, "int8": 8, "int4": 4, "mxfp4": 4, "nvfp4": 4, "mxfp8": 8}[self.value]

    @property
    def fixed_group(self) -> int | None:
        """Microscaling formats fix their group size."""
        return {"mxfp4": 32, "mxfp8": 32, "nvfp4": 16}.get(self.value)


_KINDS = ("tensor", "token", "channel", "group", "block")


@dataclass(frozen=True)
class Granularity:
    """How many elements share one scale. Build with the class methods."""

    kind: str
    group_size: int = 0
    block_n: int = 0
    block_k: int = 0

    def __post_init__(self) -> None:
        expect(self.kind in _KINDS, "Granularity.kind", f"one of {_KINDS}", self.kind)
        if self.kind == "group":
            expect(self.group_size > 0, "Granularity.group_size", "> 0 for group", self.group_size)
        if self.kind == "block":
            expect(
                self.block_n > 0 and self.block_k > 0,
                "Granularity.block_n/block_k",
                "both > 0 for block",
                (self.block_n, self.block_k),
            )

    @classmethod
    def tensor(cls) -> Granularity:
        return cls("tensor")

    @classmethod
    def token(cls) -> Granularity:
        return cls("token")

    @classmethod
    def channel(cls) -> Granularity:
        return cls("channel")

    @classmethod
    def group(cls, g: int) -> Granularity:
        return cls("group", group_size=g)

    @classmethod
    def block(cls, n: int, k: int) -> Granularity:
        return cls("block", block_n=n, block_k=k)

    def __repr__(self) -> str:
        if self.kind == "group":
            return f"Granularity.group({self.group_size})"
        if self.kind == "block":
            return f"Granularity.block({self.block_n}, {self.block_k})"
        return f"Granularity.{self.kind}()"

    @property
    def short(self) -> str:
        """Symbol used in feature tables: T, A (per token), C, G(g), B(n,k)."""
        return {
            "tensor": "T",
            "token": "A",
            "channel": "C",
            "group": f"G({self.group_size})",
            "block": f"B({self.block_n},{self.block_k})",
        }[self.kind]

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """Trailing two dims of the scale for an [N, K] operand."""
        if self.kind == "tensor":
            return (1, 1)
        if self.kind in ("token", "channel"):
            return (n, 1)
        if self.kind == "group":
            return (n, -(-k // self.group_size))
        return (-(-n // self.block_n), -(-k // self.block_k))


@dataclass(frozen=True)
class TensorQuant:
    """How one operand is quantized.

    dynamic: scales computed from the data at run time (activations); static
    scales come from the checkpoint. symmetric=False adds zero points (int4
    AWQ style). act_order: int4 groups follow a g_idx permutation (GPTQ).
    """

    dtype: QDtype
    granularity: Granularity
    dynamic: bool = False
    symmetric: bool = True
    act_order: bool = False

    def __post_init__(self) -> None:
        expect(isinstance(self.dtype, QDtype), "TensorQuant.dtype", "a QDtype", self.dtype)
        g = self.dtype.fixed_group
        if g is not None:
            expect(
                self.granularity == Granularity.group(g),
                "TensorQuant.granularity",
                f"Granularity.group({g}) for {self.dtype.value}",
                self.granularity,
            )
        if not self.symmetric:
            expect(
                self.dtype in (QDtype.INT4, QDtype.INT8),
                "TensorQuant.symmetric",
                "True except for int4/int8 with zero points",
                self.symmetric,
            )
        if self.act_order:
            expect(
                self.dtype is QDtype.INT4 and self.granularity.kind == "group",
                "TensorQuant.act_order",
                "only for int4 with group granularity",
                (self.dtype, self.granularity),
            )

    @property
    def has_global_scale(self) -> bool:
        return self.dtype is QDtype.NVFP4

    @property
    def short(self) -> str:
        extra = "" if self.symmetric else "+zp"
        extra += "+act_order" if self.act_order else ""
        mode = "dyn" if self.dynamic else "static"
        return f"{self.dtype.value}:{self.granularity.short}{extra}:{mode}"


@dataclass(frozen=True)
class QuantScheme:
    """The four operand descriptions of one MoE layer; None = not quantized."""

    name: str = "bf16"
    a1: TensorQuant | None = None
    w1: TensorQuant | None = None
    a2: TensorQuant | None = None
    w2: TensorQuant | None = None

    def __post_init__(self) -> None:
        expect(
            (self.w1 is None) == (self.w2 is None),
            "QuantScheme.w1/w2",
            "both quantized or both not",
            (self.w1, self.w2),
        )
        if self.w1 is None:
            expect(
                self.a1 is None and self.a2 is None,
                "QuantScheme.a1/a2",
                "None when weights are not quantized",
                (self.a1, self.a2),
            )

    # ---- families (what the oracle groups backends by) -----------------
    @property
    def family(self) -> str:
        """unquantized | fp8 | int8 | wna16 | mxfp4 | nvfp4."""
        if self.w1 is None:
            return "unquantized"
        d = self.w1.dtype
        if d is QDtype.FP8:
            return "fp8"
        if d is QDtype.INT8:
            return "int8" if self.a1 is not None else "wna16"
        if d is QDtype.INT4:
            return "wna16"
        if d is QDtype.MXFP4:
            return "mxfp4"
        if d is QDtype.NVFP4:
            return "nvfp4"
        return d.value

    @property
    def kind(self) -> tuple:
        """Structure without sizes: per operand (dtype, granularity kind, dynamic, symmetric,
        act_order). Backends claim kinds, so fp8 blocks of 64x64 or int4 groups of 32 are
        covered by a claim of their 128-sized sibling (size limits go in extra checks)."""

        def k(tq):
            if tq is None:
                return None
            return (tq.dtype.value, tq.granularity.kind, tq.dynamic, tq.symmetric, tq.act_order)

        return (k(self.a1), k(self.w1), k(self.a2), k(self.w2))

    @property
    def quant_types(self) -> str:
        return "none" if self.w1 is None else self.w1.dtype.value

    # ---- named constructors -------------------------------------------
    @classmethod
    def unquantized(cls) -> QuantScheme:
        return cls(name="bf16")

    @classmethod
    def fp8_per_tensor(cls, static_activations: bool = False) -> QuantScheme:
        """fp8 w8a8, one scale per expert weight and per activation tensor."""
        a = TensorQuant(QDtype.FP8, Granularity.tensor(), dynamic=not static_activations)
        w = TensorQuant(QDtype.FP8, Granularity.tensor())
        name = "fp8_tensor_static" if static_activations else "fp8_tensor"
        return cls(name=name, a1=a, w1=w, a2=a, w2=w)

    @classmethod
    def fp8_per_token(cls) -> QuantScheme:
        """fp8 w8a8, dynamic per-token activations, per-tensor weights."""
        a = TensorQuant(QDtype.FP8, Granularity.token(), dynamic=True)
        w = TensorQuant(QDtype.FP8, Granularity.tensor())
        return cls(name="fp8_token", a1=a, w1=w, a2=a, w2=w)

    @classmethod
    def fp8_per_channel(cls) -> QuantScheme:
        """fp8 w8a8, dynamic per-token activations, per-output-channel weights."""
        a = TensorQuant(QDtype.FP8, Granularity.token(), dynamic=True)
        w = TensorQuant(QDtype.FP8, Granularity.channel())
        return cls(name="fp8_channel", a1=a, w1=w, a2=a, w2=w)

    @classmethod
    def fp8_block(cls, block_n: int = 128, block_k: int = 128) -> QuantScheme:
        """fp8 w8a8 with block weights and 1 x block_k activation groups (DeepSeek-V3)."""
        a = TensorQuant(QDtype.FP8, Granularity.group(block_k), dynamic=True)
        w = TensorQuant(QDtype.FP8, Granularity.block(block_n, block_k))
        name = "fp8_block" if (block_n, block_k) == (128, 128) else f"fp8_block{block_n}x{block_k}"
        return cls(name=name, a1=a, w1=w, a2=a, w2=w)

    @classmethod
    def int8_w8a8(cls, granularity: str = "channel") -> QuantScheme:
        """int8 w8a8: 'tensor', 'channel' (per-token activations) or 'block'."""
        if granularity == "tensor":
            a, wg = TensorQuant(QDtype.INT8, Granularity.tensor(), dynamic=True), Granularity.tensor()
        elif granularity == "channel":
            a, wg = TensorQuant(QDtype.INT8, Granularity.token(), dynamic=True), Granularity.channel()
        elif granularity == "block":
            a = TensorQuant(QDtype.INT8, Granularity.group(128), dynamic=True)
            wg = Granularity.block(128, 128)
        else:
            expect(False, "granularity", "'tensor', 'channel' or 'block'", granularity)
        w = TensorQuant(QDtype.INT8, wg)
        return cls(name=f"int8_w8a8_{granularity}", a1=a, w1=w, a2=a, w2=w)

    @classmethod
    def int8_w8a16(cls) -> QuantScheme:
        """int8 weights with per-channel scales, activations in the model dtype."""
        w = TensorQuant(QDtype.INT8, Granularity.channel())
        return cls(name="int8_w8a16", w1=w, w2=w)

    @classmethod
    def int4_w4a16(cls, group_size: int = 128, zero_points: bool = False, act_order: bool = False) -> QuantScheme:
        """int4 weight-only: GPTQ (symmetric, optional act-order) or AWQ (zero points)."""
        w = TensorQuant(QDtype.INT4, Granularity.group(group_size), symmetric=not zero_points, act_order=act_order)
        name = f"int4_g{group_size}" + ("_zp" if zero_points else "") + ("_actorder" if act_order else "")
        return cls(name=name, w1=w, w2=w)

    @classmethod
    def _microscaled(cls, name: str, w: QDtype, a: QDtype | None = None) -> QuantScheme:
        """Weights in the microscaling format ``w`` (its fixed group along K); activations in the
        model dtype, or quantized dynamically as ``a`` with the same group."""
        g = Granularity.group(w.fixed_group)
        act = None if a is None else TensorQuant(a, g, dynamic=True)
        wq = TensorQuant(w, g)
        return cls(name=name, a1=act, w1=wq, a2=act, w2=wq)

    @classmethod
    def mxfp4_w4a16(cls) -> QuantScheme:
        """MXFP4 weights, activations in the model dtype (gpt-oss)."""
        return cls._microscaled("mxfp4", QDtype.MXFP4)

    @classmethod
    def mxfp4_mxfp8(cls) -> QuantScheme:
        """MXFP4 weights with MXFP8 activations (dynamic e8m0 scale per 32)."""
        return cls._microscaled("mxfp4_mxfp8", QDtype.MXFP4, QDtype.MXFP8)

    @classmethod
    def nvfp4_w4a16(cls) -> QuantScheme:
        """NVFP4 weights, activations in the model dtype."""
        return cls._microscaled("nvfp4_w4a16", QDtype.NVFP4)

    @classmethod
    def nvfp4(cls) -> QuantScheme:
        """NVFP4 w4a4: activations quantized per 16 with a static fp32 global scale."""
        return cls._microscaled("nvfp4", QDtype.NVFP4, QDtype.NVFP4)

    @classmethod
    def by_name(cls, name: str) -> QuantScheme:
        """Look a scheme up by its ``name`` (as printed by ``fusedmoe features``)."""
        for s in all_schemes():
            if s.name == name:
                return s
        names = ", ".join(s.name for s in all_schemes())
        expect(False, "scheme", f"one of {names}", name)
        raise AssertionError  # unreachable


def all_schemes() -> list[QuantScheme]:
    """Every named scheme; tests and the feature matrix iterate over this list."""
    S = QuantScheme
    return [
        S.unquantized(),
        S.fp8_per_tensor(),
        S.fp8_per_tensor(static_activations=True),
        S.fp8_per_token(),
        S.fp8_per_channel(),
        S.fp8_block(),
        S.fp8_block(64, 64),
        S.int8_w8a8("tensor"),
        S.int8_w8a8("channel"),
        S.int8_w8a8("block"),
        S.int8_w8a16(),
        S.int4_w4a16(128),
        S.int4_w4a16(32),
        S.int4_w4a16(64, zero_points=True),
        S.int4_w4a16(128, zero_points=True),
        S.int4_w4a16(128, act_order=True),
        S.mxfp4_w4a16(),
        S.mxfp4_mxfp8(),
        S.nvfp4_w4a16(),
        S.nvfp4(),
    ]


def shape_supported(scheme: QuantScheme, hidden_size: int, intermediate_size: int) -> str | None:
    """None if the scheme's formats can store W13 [., ., H] and W2 [., ., I]; else why not.

    Packed and microscaled formats need the reduction dim (H for W13, I for W2)
    to be a whole number of groups; fp8/int8 groups and blocks may be partial.
    """
    if scheme.w1 is None:
        return None
    for name, k, tq in (("hidden_size", hidden_size, scheme.w1), ("intermediate_size", intermediate_size, scheme.w2)):
        if tq.dtype in (QDtype.INT4, QDtype.MXFP4, QDtype.NVFP4, QDtype.MXFP8):
            g = tq.granularity.group_size
            if k % g:
                return f"{name}={k} is not a multiple of the {tq.dtype.value} group size {g}"
    return None
