"""Input validation at the public entry points (``fused_moe``, ``FusedMoE.forward``).

Two kinds of checks, with different costs:

- **Shape checks** (always on): types, shapes, dtypes, devices and strides of
  x, the top-k ids/weights, the weights and the expert map, and whether the
  scheme's formats can store the layer's sizes. They read tensor metadata
  only, never the data: no host synchronisation, no kernel launch (CUDA-graph
  safe). Measured on a 2-core CPU (timeit, 1 thread, E=8 H=I=128 T=1, cpu
  backend): 7 us (bf16) to 14 us (int4 act-order) per call, the weights'
  checks most of it; 0.4-1% of the whole ``fused_moe`` call (0.7-3.4 ms) and
  1/20 of the backend choice (``select_experts``, ~230 us) it makes.
- **Value checks** (``check_values=True`` or ``FUSEDMOE_CHECK_VALUES=1``):
  top-k ids in [0, E) and distinct within a row, expert-map entries in
  [-1, E_local), no NaN/Inf in x or the top-k weights. They read the data,
  which costs one host synchronisation per call (all conditions are reduced on
  the device and fetched together), so they are off by default (and must stay
  off while a CUDA graph is captured).

NaN/Inf policy: not checked by default. A non-finite value in one token's row
of x (or of its top-k weights) makes that token's output non-finite and leaves
every other token's output exactly as it would be without it: rows never mix,
except through a per-tensor *dynamic* activation scale (schemes
``fp8_tensor`` and ``int8_w8a8_tensor``), an abs-max over all tokens, where
one bad token may make every token NaN. With value checks on, a non-finite
input raises instead. tests/modular/test_validation.py checks this policy on the cpu
and reference backends for every activation format.

Every error is a ``FusedMoEError`` (``UnsupportedError`` for sizes a scheme's
formats cannot store) whose message names the argument and what was expected.
"""

from __future__ import annotations

import weakref

import torch

from .. import env
from ..config import MoEConfig
from ..errors import UnsupportedError, expect
from ..quant import QDtype, QuantScheme
from ..quant.scheme import shape_supported
from ..weights import ExpertWeights

__all__ = ["check_weights", "validate_call"]


_ID_DTYPES = (torch.int32, torch.int64)
# Stored dtype of a quantized weight's data, per format (what ``quantize`` and the layer's loader produce).
_DATA_DTYPE = {
    QDtype.FP8: torch.float8_e4m3fn,
    QDtype.INT8: torch.int8,
    QDtype.INT4: torch.uint8,
    QDtype.MXFP4: torch.uint8,
    QDtype.NVFP4: torch.uint8,
}
_PACKED = (QDtype.INT4, QDtype.MXFP4, QDtype.NVFP4)
_E8M0 = (torch.uint8, torch.float8_e8m0fnu)
# What a weight scale must be where the format fixes it (others: any floating dtype).
_SCALE_WANT = {
    QDtype.MXFP4: "e8m0 codes: dtype torch.uint8 or torch.float8_e8m0fnu",
    QDtype.NVFP4: "dtype torch.float8_e4m3fn (NVFP4)",
}


def validate_call(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: ExpertWeights | None,
    config: MoEConfig,
    scheme: QuantScheme,
    expert_map: torch.Tensor | None = None,
    *,
    check_values: bool = False,
    weights_checked: bool = False,
) -> None:
    """Raise ``FusedMoEError`` naming the first bad argument of one MoE call; see the module docstring.

    x:            [T, H] in ``config.dtype``, last-dim stride 1 (rows may be strided); T = 0 allowed.
    topk_ids:     [T, K] int32 or int64 global expert ids, on x's device (any strides).
    topk_weights: [T, K] floating, on x's device (any strides).
    weights:      the ``ExpertWeights`` of ``scheme``: E = config.num_experts experts, or
                  E_local <= E with ``expert_map``.
    expert_map:   [E] int32 global id -> local id in [0, E_local), or -1 for other ranks' experts.
    weights_checked: the weights' shapes and dtypes were checked already (``FusedMoE`` does it
                  once, after loading); only their device is compared with x's. ``weights``
                  may then be None.
    """
    # Hot path: every condition is evaluated once; messages are built only on failure.
    if not (isinstance(config, MoEConfig) and isinstance(scheme, QuantScheme)):
        expect(isinstance(config, MoEConfig), "config", "a MoEConfig", type(config))
        expect(False, "scheme", "a QuantScheme", type(scheme))
    if scheme.w1 is not None:
        why = shape_supported(scheme, config.hidden_size, config.intermediate_size)
        if why is not None:
            raise UnsupportedError(f"scheme {scheme.name}: its formats cannot store this layer: {why}")
    _check_x(x, config)
    device = x.device
    _check_topk(x, device, topk_ids, topk_weights, config)
    if weights is None:
        if not weights_checked:
            expect(False, "weights", "an ExpertWeights", "None")
        num_local = config.num_experts
    else:
        if not isinstance(weights, ExpertWeights):
            expect(False, "weights", "an ExpertWeights", type(weights))
        num_local = weights.num_experts
        if not weights_checked:
            check_weights(weights, config, scheme, has_map=expert_map is not None)
        _check_weights_device(weights, device)
    if expert_map is not None:
        _check_expert_map(expert_map, device, config)
    if env.check_values(check_values):
        _check_values(x, topk_ids, topk_weights, expert_map, config, num_local)


def _check_x(x, config: MoEConfig) -> None:
    h = config.hidden_size
    if not isinstance(x, torch.Tensor):
        expect(False, "x", f"a tensor [T, H={h}]", type(x))
    if x.dim() != 2:
        expect(False, "x", f"a 2-D tensor [T, H={h}]", tuple(x.shape))
    if x.shape[1] != h:
        expect(False, "x", f"shape [T, H] with H = hidden_size = {h}", tuple(x.shape))
    if x.dtype != config.dtype:
        expect(False, "x", f"dtype {config.dtype} (MoEConfig.dtype)", x.dtype)
    if x.stride(1) != 1 and h != 1:
        expect(False, "x", "last-dim stride 1 (each token's H values contiguous; call .contiguous())", x.stride())


def _check_topk(x: torch.Tensor, device: torch.device, ids, w, config: MoEConfig) -> None:
    t, k = x.shape[0], config.top_k
    if not isinstance(ids, torch.Tensor):
        expect(False, "topk_ids", f"a tensor [T, K] = [{t}, {k}]", type(ids))
    if ids.dim() != 2 or ids.shape[0] != t or ids.shape[1] != k:
        expect(False, "topk_ids", f"shape [T, K] = [{t}, {k}] (T from x, K = top_k)", tuple(ids.shape))
    if ids.dtype not in _ID_DTYPES:
        expect(False, "topk_ids", "dtype torch.int32 or torch.int64", ids.dtype)
    if ids.device != device:
        expect(False, "topk_ids", f"on x's device ({device})", ids.device)
    if not isinstance(w, torch.Tensor):
        expect(False, "topk_weights", f"a tensor [T, K] = [{t}, {k}]", type(w))
    if w.dim() != 2 or w.shape[0] != t or w.shape[1] != k:
        expect(False, "topk_weights", f"shape [T, K] = [{t}, {k}] (T from x, K = top_k)", tuple(w.shape))
    if not w.is_floating_point():
        expect(False, "topk_weights", "a floating dtype", w.dtype)
    if w.device != device:
        expect(False, "topk_weights", f"on x's device ({device})", w.device)


def check_weights(
    weights: ExpertWeights,
    config: MoEConfig,
    scheme: QuantScheme,
    *,
    num_local: int | None = None,
    has_map: bool = False,
) -> None:
    """Raise ``FusedMoEError`` naming the first rule of ``_weight_rules`` that ``weights`` breaks.

    num_local: the local expert count the weights must have (a layer's); None: E experts, or
    1..E with an expert map (``has_map``). Metadata only (shapes, dtypes, presence): no host
    sync. A weights object that passed is remembered (by identity, with the identities of its
    tensors), so ``fused_moe`` called again with the same weights does not re-check them.
    """
    sig = (config, scheme, num_local, has_map, weights.layout, tuple(map(id, _tensors(weights))))
    seen = _CHECKED.get(id(weights))
    if seen is not None and seen[0]() is weights and seen[1] == sig:
        return
    for ok, name, expected, got in _weight_rules(weights, config, scheme, num_local, has_map):
        if not ok:
            expect(False, name, expected, got)
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED[id(weights)] = (weakref.ref(weights), sig)


_CHECKED: dict[int, tuple[weakref.ref, tuple]] = {}


def _tensors(w: ExpertWeights) -> list:
    return [w.w13.data, w.w13.scale, w.w13.zero, w.w13.global_scale, w.w13.g_idx, w.w2.data, w.w2.scale, w.w2.zero,
            w.w2.global_scale, w.w2.g_idx, w.b13, w.b2, w.a1_scale, w.a2_scale, w.a1_global_scale,
            w.a2_global_scale]  # fmt: skip


def _weight_rules(weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme, num_local, has_map):
    """The one table of what ``ExpertWeights`` must be for ``config`` x ``scheme``, in the order
    problems are reported: (holds, argument, what was expected, what was found). A generator, so
    a rule can rely on the ones before it (a scale's dtype is asked only once it exists)."""
    e_cfg = config.num_experts
    e = weights.num_experts
    if num_local is not None:
        yield e == num_local, "weights", f"{num_local} local experts", e
    elif has_map:
        yield 1 <= e <= e_cfg, "weights", f"between 1 and num_experts = {e_cfg} local experts (with expert_map)", e
    else:
        yield e == e_cfg, "weights", f"num_experts = {e_cfg} experts (without expert_map every expert is local)", e
    rows, h, i = config.w13_rows, config.hidden_size, config.intermediate_size
    for name, q, want in (("weights.w13", weights.w13, (e, rows, h)), ("weights.w2", weights.w2, (e, h, i))):
        yield tuple(q.shape) == want, name, f"logical shape {want}", tuple(q.shape)
    b13, b2 = weights.b13, weights.b2
    if config.has_bias:
        yield b13 is not None and b2 is not None, "weights.b13/b2", "biases (has_bias)", None
        yield tuple(b13.shape) == (e, rows), "weights.b13", f"shape {(e, rows)}", tuple(b13.shape)
        yield tuple(b2.shape) == (e, h), "weights.b2", f"shape {(e, h)}", tuple(b2.shape)
    else:
        yield b13 is None and b2 is None, "weights.b13/b2", "None when has_bias=False", None
    for name, q, tq in (("weights.w13", weights.w13, scheme.w1), ("weights.w2", weights.w2, scheme.w2)):
        yield from _operand_rules(name, q, tq, config, scheme, weights.layout == "reference")
    for op, tq in (("a1", scheme.a1), ("a2", scheme.a2)):
        if tq is not None and not tq.dynamic:
            scale = getattr(weights, f"{op}_scale")
            yield scale is not None, f"weights.{op}_scale", f"a static scale for {scheme.name}", None
        if tq is not None and tq.has_global_scale:
            gs = getattr(weights, f"{op}_global_scale")
            yield gs is not None, f"weights.{op}_global_scale", f"a global scale for {scheme.name}", None


def _operand_rules(name: str, q, tq, config: MoEConfig, scheme: QuantScheme, reference_layout: bool):
    """The rules of one weight operand (W13 or W2) of ``scheme``."""
    if tq is None:
        yield q.scale is None, f"{name}.scale", f"None for the unquantized scheme {scheme.name}", "a scale"
        yield (
            q.data.dtype == config.dtype,
            f"{name}.data",
            f"dtype {config.dtype} (MoEConfig.dtype) for the unquantized scheme {scheme.name}",
            q.data.dtype,
        )
        return
    want = _DATA_DTYPE[tq.dtype]
    what = "packed two per uint8" if tq.dtype in _PACKED else "stored codes"
    yield q.scale is not None, f"{name}.scale", f"a scale for {scheme.name}", None
    yield q.data.dtype == want, f"{name}.data", f"dtype {want} ({tq.dtype.value} {what})", q.data.dtype
    e, n, k = q.shape
    if reference_layout:
        stored = (e, n, k // 2 if tq.dtype in _PACKED else k)
        yield tuple(q.data.shape) == stored, f"{name}.data", f"stored shape {stored}", tuple(q.data.shape)
    yield _scale_dtype_ok(q.scale.dtype, tq.dtype), f"{name}.scale", _SCALE_WANT.get(tq.dtype, "a floating dtype"), (
        q.scale.dtype
    )
    if not tq.symmetric:
        yield q.zero is not None, f"{name}.zero", f"zero points for {scheme.name}", None
        yield q.zero.dtype == torch.uint8, f"{name}.zero", "dtype torch.uint8", q.zero.dtype
    if tq.act_order:
        yield q.g_idx is not None, f"{name}.g_idx", f"an act-order group map for {scheme.name}", None
        yield q.g_idx.dtype == torch.int32, f"{name}.g_idx", "dtype torch.int32", q.g_idx.dtype
    if tq.has_global_scale:
        yield q.global_scale is not None, f"{name}.global_scale", f"a global scale for {scheme.name}", None
        yield q.global_scale.dtype == torch.float32, f"{name}.global_scale", "dtype torch.float32", (
            q.global_scale.dtype
        )


def _scale_dtype_ok(dtype: torch.dtype, fmt: QDtype) -> bool:
    if fmt is QDtype.MXFP4:
        return dtype in _E8M0
    if fmt is QDtype.NVFP4:
        return dtype == torch.float8_e4m3fn
    return dtype.is_floating_point


def _check_weights_device(weights: ExpertWeights, device: torch.device) -> None:
    for prefix, q in (("weights.w13.", weights.w13), ("weights.w2.", weights.w2)):
        for key in ("data", "scale", "zero", "global_scale", "g_idx"):
            t = getattr(q, key)
            if t is not None and t.device != device:
                expect(False, prefix + key, f"on x's device ({device})", t.device)
    for key in ("b13", "b2", "a1_scale", "a2_scale", "a1_global_scale", "a2_global_scale"):
        t = getattr(weights, key)
        if t is not None and t.device != device:
            expect(False, "weights." + key, f"on x's device ({device})", t.device)


def _check_expert_map(expert_map, device: torch.device, config: MoEConfig) -> None:
    e = config.num_experts
    if not isinstance(expert_map, torch.Tensor):
        expect(False, "expert_map", f"an int32 tensor [E] = [{e}]", type(expert_map))
    if expert_map.dim() != 1 or expert_map.shape[0] != e:
        expect(False, "expert_map", f"shape [E] = [{e}] (one entry per global expert)", tuple(expert_map.shape))
    if expert_map.dtype != torch.int32:
        expect(False, "expert_map", "dtype torch.int32", expert_map.dtype)
    if expert_map.device != device:
        expect(False, "expert_map", f"on x's device ({device})", expert_map.device)


def _check_values(x, ids, w, expert_map, config: MoEConfig, num_local: int) -> None:
    """The data checks, reduced on the device and fetched with one synchronisation."""
    e = config.num_experts + config.identity_experts
    names = []
    flags = []
    if ids.shape[0] > 0:
        names += ["ids_range", "ids_distinct", "x_finite", "w_finite"]
        s = ids.sort(dim=1).values
        flags += [
            (s[:, 0] >= 0).all() & (s[:, -1] < e).all(),
            (s[:, 1:] != s[:, :-1]).all(),
            torch.isfinite(x).all(),
            torch.isfinite(w).all(),
        ]
    if expert_map is not None:
        names.append("map_range")
        flags.append(((expert_map >= -1) & (expert_map < num_local)).all())
    if not flags:
        return
    ok = dict(zip(names, torch.stack(flags).tolist(), strict=True))
    if not ok.get("ids_range", True):
        bad = ((ids < 0) | (ids >= e)).nonzero()[0].tolist()
        expect(False, "topk_ids", f"expert ids in [0, E) = [0, {e})", f"{int(ids[bad[0], bad[1]])} at {tuple(bad)}")
    if not ok.get("ids_distinct", True):
        s = ids.sort(dim=1).values
        row = int((s[:, 1:] == s[:, :-1]).any(dim=1).nonzero()[0, 0])
        expect(False, "topk_ids", "distinct expert ids within each row", f"row {row}: {ids[row].tolist()}")
    if not ok.get("x_finite", True):
        row = int((~torch.isfinite(x)).any(dim=1).nonzero()[0, 0])
        expect(False, "x", f"finite values ({env.CHECK_VALUES} / check_values is on)", f"NaN/Inf in token {row}")
    if not ok.get("w_finite", True):
        row = int((~torch.isfinite(w)).any(dim=1).nonzero()[0, 0])
        expect(False, "topk_weights", "finite values", f"row {row}: {w[row].tolist()}")
    if not ok.get("map_range", True):
        expect(
            False,
            "expert_map",
            f"entries in [-1, E_local) = [-1, {num_local}) (-1: expert not on this rank)",
            expert_map.tolist(),
        )
