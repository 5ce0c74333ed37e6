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

import torch

from .. import env
from ..config import MoEConfig
from ..errors import UnsupportedError, expect
from ..quant import QDtype, QuantScheme
from ..quant.scheme import shape_supported
from ..weights import ExpertWeights

__all__ = ["validate_call"]


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
        if not weights_checked and not _weights_ok(weights, config, scheme, expert_map is not None):
            _explain_weights(weights, config, scheme, expert_map is not None)
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


def _weights_ok(weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme, has_map: bool) -> bool:
    """All of ``_explain_weights``'s conditions (and ``ExpertWeights.check``'s), without building a message.

    Only a fast path: when it says False, ``_explain_weights`` finds and names the problem.
    """
    e, rows, h, i = weights.num_experts, config.w13_rows, config.hidden_size, config.intermediate_size
    if not (1 <= e <= config.num_experts if has_map else e == config.num_experts):
        return False
    w13, w2 = weights.w13, weights.w2
    if w13.shape != (e, rows, h) or w2.shape != (e, h, i):
        return False
    b13, b2 = weights.b13, weights.b2
    if config.has_bias:
        if b13 is None or b2 is None or b13.shape != (e, rows) or b2.shape != (e, h):
            return False
    elif b13 is not None or b2 is not None:
        return False
    if scheme.w1 is None:
        return w13.scale is None and w13.data.dtype == config.dtype and w2.data.dtype == config.dtype
    for q, tq in ((w13, scheme.w1), (w2, scheme.w2)):
        fmt = tq.dtype
        if q.data.dtype != _DATA_DTYPE[fmt] or q.scale is None or not _scale_dtype_ok(q.scale.dtype, fmt):
            return False
        if weights.layout == "reference":
            n, kk = q.shape[1], q.shape[2]
            if q.data.shape != (e, n, kk // 2 if fmt in _PACKED else kk):
                return False
        if not tq.symmetric and (q.zero is None or q.zero.dtype != torch.uint8):
            return False
        if tq.act_order and (q.g_idx is None or q.g_idx.dtype != torch.int32):
            return False
        if tq.has_global_scale and (q.global_scale is None or q.global_scale.dtype != torch.float32):
            return False
    for tq, scale, global_scale in (
        (scheme.a1, weights.a1_scale, weights.a1_global_scale),
        (scheme.a2, weights.a2_scale, weights.a2_global_scale),
    ):
        if tq is not None and not tq.dynamic and scale is None:
            return False
        if tq is not None and tq.has_global_scale and global_scale is None:
            return False
    return True


def _explain_weights(weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme, has_map: bool) -> None:
    """Raise the error that names the weights' first problem (``ExpertWeights.check`` does most)."""
    e = config.num_experts
    if has_map:
        expect(
            1 <= weights.num_experts <= e,
            "weights",
            f"between 1 and num_experts = {e} local experts (with expert_map)",
            weights.num_experts,
        )
    else:
        expect(
            weights.num_experts == e,
            "weights",
            f"num_experts = {e} experts (without expert_map every expert is local)",
            weights.num_experts,
        )
    weights.check(config, scheme)
    for name, q, tq in (("weights.w13", weights.w13, scheme.w1), ("weights.w2", weights.w2, scheme.w2)):
        if tq is None:
            expect(
                q.data.dtype == config.dtype,
                f"{name}.data",
                f"dtype {config.dtype} (MoEConfig.dtype) for the unquantized scheme {scheme.name}",
                q.data.dtype,
            )
            continue
        want = _DATA_DTYPE[tq.dtype]
        what = "packed two per uint8" if tq.dtype in _PACKED else "stored codes"
        expect(q.data.dtype == want, f"{name}.data", f"dtype {want} ({tq.dtype.value} {what})", q.data.dtype)
        expect(q.scale is not None, f"{name}.scale", f"a scale for {scheme.name}")
        if weights.layout == "reference":
            n, kk = q.shape[1], q.shape[2]
            stored = (q.shape[0], n, kk // 2 if tq.dtype in _PACKED else kk)
            expect(tuple(q.data.shape) == stored, f"{name}.data", f"stored shape {stored}", tuple(q.data.shape))
        expect(
            _scale_dtype_ok(q.scale.dtype, tq.dtype),
            f"{name}.scale",
            _SCALE_WANT.get(tq.dtype, "a floating dtype"),
            q.scale.dtype,
        )
        if not tq.symmetric:
            expect(q.zero is not None, f"{name}.zero", f"zero points for {scheme.name}")
            expect(q.zero.dtype == torch.uint8, f"{name}.zero", "dtype torch.uint8", q.zero.dtype)
        if tq.act_order:
            expect(q.g_idx is not None, f"{name}.g_idx", f"an act-order group map for {scheme.name}")
            expect(q.g_idx.dtype == torch.int32, f"{name}.g_idx", "dtype torch.int32", q.g_idx.dtype)
        if tq.has_global_scale:
            expect(q.global_scale is not None, f"{name}.global_scale", f"a global scale for {scheme.name}")
            expect(
                q.global_scale.dtype == torch.float32,
                f"{name}.global_scale",
                "dtype torch.float32",
                q.global_scale.dtype,
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
    e = config.num_experts
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
