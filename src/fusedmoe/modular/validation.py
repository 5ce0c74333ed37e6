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
- **Value checks** (``check_values=True`` or ``FUSEDMOE_CHECK_VALUES`` set to a true
  boolean: 1/true/yes/on): top-k ids in [0, E) or -1 and distinct within a row,
  expert-map entries in [-1, E_local), no NaN/Inf in x or the top-k weights. They read
  the data, which costs one host synchronisation per call (all conditions are reduced on
  the device and fetched together), so they are off by default (and must stay off while
  a CUDA graph is captured). Off, ids outside [0, E) and map entries outside
  [0, E_local) are not errors: such pairs contribute nothing, in every backend
  (``metadata.TopK``), and no kernel reads outside its buffers for them.
- **Weight checks** (``check_weights``, once per weights object): the shape of every
  tensor of the ``ExpertWeights`` against the scheme's granularity (scales, zero points,
  global scales, act-order g_idx, stored data against the logical shape), and the few
  values that decide whether the output means anything: static activation scales and
  global scales finite and > 0 (a scale of 0 made the whole output 0), act-order g_idx
  entries in [0, groups). Those values need a host read, done once when the weights are
  first checked (``FusedMoE`` after loading, ``fused_moe`` on first sight of a weights
  object), never per call; under ``torch.compile`` tracing or CUDA-graph capture they
  are skipped (the weights of a captured call were checked by its eager warm-up).

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
from ..metadata import ID_DTYPES
from ..quant import QDtype, QTensor, QuantScheme
from ..quant.formats import PACKED, WEIGHT_DATA_DTYPE
from ..quant.scheme import shape_supported
from ..weights import ExpertWeights

__all__ = ["check_weights", "validate_call"]


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
    if ids.dtype not in ID_DTYPES:
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
    1..E with an expert map (``has_map``). Shapes, dtypes and presence, then the few values of
    the module docstring (one host read each, a handful of small tensors). A weights object
    that passed is remembered (by identity, with the identities of its tensors), so
    ``fused_moe`` called again with the same weights does not re-check them; one checked
    while values could not be read (tracing, capture) is checked again when they can.
    """
    sig = (config, scheme, num_local, has_map, weights.layout, tuple(map(id, _tensors(weights))))
    seen = _CHECKED.get(id(weights))
    if seen is not None and seen[0]() is weights and seen[1] == sig:
        return
    for ok, name, expected, got in _weight_rules(weights, config, scheme, num_local, has_map):
        if not ok:
            expect(False, name, expected, got)
    if not _can_read_values(weights.w13.data):
        return
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED[id(weights)] = (weakref.ref(weights), sig)


_CHECKED: dict[int, tuple[weakref.ref, tuple]] = {}


_Q_FIELDS = ("data", "scale", "zero", "global_scale", "g_idx")
_W_FIELDS = ("b13", "b2", "a1_scale", "a2_scale", "a1_global_scale", "a2_global_scale")


def _tensors(w: ExpertWeights) -> list:
    """Every tensor of ``w`` (None where absent; getattr: a malformed object is reported by the rules)."""
    return [getattr(getattr(w, q, None), f, None) for q in ("w13", "w2") for f in _Q_FIELDS] + [
        getattr(w, f, None) for f in _W_FIELDS
    ]


def _weight_rules(weights: ExpertWeights, config: MoEConfig, scheme: QuantScheme, num_local, has_map):
    """The one table of what ``ExpertWeights`` must be for ``config`` x ``scheme``, in the order
    problems are reported: (holds, argument, what was expected, what was found). A generator, so
    a rule can rely on the ones before it (a scale's dtype is asked only once it exists). The
    value rules (a host read each) come last, once every shape is known to be right."""
    for name in ("w13", "w2"):
        q = getattr(weights, name)
        ok = isinstance(q, QTensor) and isinstance(q.data, torch.Tensor) and len(tuple(q.shape)) == 3
        yield ok, f"weights.{name}", "a QTensor with a data tensor and a 3-D logical shape [E, N, K]", _what(q)
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
    reference = weights.layout == "reference"
    for name, q, tq in (("weights.w13", weights.w13, scheme.w1), ("weights.w2", weights.w2, scheme.w2)):
        yield from _operand_rules(name, q, tq, config, scheme, reference)
    acts = []  # (name, tensor) of the static activation scales this scheme reads
    for op, tq in (("a1", scheme.a1), ("a2", scheme.a2)):
        if tq is not None and not tq.dynamic:
            scale = getattr(weights, f"{op}_scale")
            yield scale is not None, f"weights.{op}_scale", f"a static scale for {scheme.name}", None
            acts.append((f"weights.{op}_scale", scale))
        if tq is not None and tq.has_global_scale:
            gs = getattr(weights, f"{op}_global_scale")
            yield gs is not None, f"weights.{op}_global_scale", f"a global scale for {scheme.name}", None
            acts.append((f"weights.{op}_global_scale", gs))
    for name, t in acts:
        yield t.numel() == 1, name, "one value (a per-tensor activation scale)", tuple(t.shape)
    if not _can_read_values(weights.w13.data):
        return
    # values, read once per weights object: a scale of 0 made the whole output 0 without a word
    for name, t in acts + [(f"weights.{n}.global_scale", getattr(weights, n).global_scale) for n in ("w13", "w2")]:
        if t is not None:
            lo, finite = torch.stack([t.float().min(), torch.isfinite(t.float()).all().float()]).tolist()
            got = t.flatten().tolist()
            yield lo > 0 and finite == 1.0, name, "finite values > 0 (a dequantization multiplier)", got
    for name, q in (("weights.w13", weights.w13), ("weights.w2", weights.w2)):
        if q.g_idx is not None and reference:
            groups = q.scale.shape[-1]
            lo, hi = torch.stack([q.g_idx.min(), q.g_idx.max()]).tolist()
            yield lo >= 0 and hi < groups, f"{name}.g_idx", f"group ids in [0, {groups})", (lo, hi)


def _what(q) -> object:
    return tuple(q.shape) if isinstance(q, QTensor) else type(q)


def _can_read_values(t: torch.Tensor) -> bool:
    """Whether a host read of weight values is allowed now: not while ``torch.compile`` traces
    (a graph break) and not while a CUDA graph is captured (a sync is illegal there)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _data_bytes(t: torch.Tensor) -> int:
    """Bytes a data tensor reaches from its first element (its strides decide which it reads)."""
    if t.numel() == 0:
        return 0
    last = sum((d - 1) * abs(st) for d, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _operand_rules(name: str, q, tq, config: MoEConfig, scheme: QuantScheme, reference_layout: bool):
    """The rules of one weight operand (W13 or W2) of ``scheme``: dtypes; in the reference layout the
    exact stored shape of the data and of every scale, zero point, global scale and g_idx (the
    kernels index them by these shapes, with the tensors' own strides); in a backend's layout at
    least the bytes the logical shape needs (a smaller buffer was read past)."""
    e, n, k = q.shape
    if tq is None:
        yield q.scale is None, f"{name}.scale", f"None for the unquantized scheme {scheme.name}", "a scale"
        yield (
            q.data.dtype == config.dtype,
            f"{name}.data",
            f"dtype {config.dtype} (MoEConfig.dtype) for the unquantized scheme {scheme.name}",
            q.data.dtype,
        )
        if reference_layout:
            yield tuple(q.data.shape) == (e, n, k), f"{name}.data", f"stored shape {(e, n, k)}", tuple(q.data.shape)
        else:
            need = e * n * k * q.data.element_size()
            yield _data_bytes(q.data) >= need, f"{name}.data", f"{need} bytes for {(e, n, k)}", _data_bytes(q.data)
        return
    want = WEIGHT_DATA_DTYPE[tq.dtype]
    what = "packed two per uint8" if tq.dtype in PACKED else "stored codes"
    yield q.scale is not None, f"{name}.scale", f"a scale for {scheme.name}", None
    gran = tq.granularity
    if reference_layout:  # a backend's layout stores its own way (the w4 layout: int32 words)
        yield q.data.dtype == want, f"{name}.data", f"dtype {want} ({tq.dtype.value} {what})", q.data.dtype
        stored = (e, n, k // 2 if tq.dtype in PACKED else k)
        yield tuple(q.data.shape) == stored, f"{name}.data", f"stored shape {stored}", tuple(q.data.shape)
        want_scale = (e, *gran.scale_shape(n, k))
        got_scale = tuple(q.scale.shape)
        yield got_scale == want_scale, f"{name}.scale", f"shape {want_scale} ({gran!r} of {(e, n, k)})", got_scale
    else:
        need, got = e * n * (k * tq.dtype.bits // 8), _data_bytes(q.data)
        yield got >= need, f"{name}.data", f"{need} bytes for {(e, n, k)} {tq.dtype.value}", got
    scale_ok = _scale_dtype_ok(q.scale.dtype, tq.dtype)
    yield scale_ok, f"{name}.scale", _SCALE_WANT.get(tq.dtype, "a floating dtype"), q.scale.dtype
    if not tq.symmetric:
        yield q.zero is not None, f"{name}.zero", f"zero points for {scheme.name}", None
        yield q.zero.dtype == torch.uint8, f"{name}.zero", "dtype torch.uint8", q.zero.dtype
        same = tuple(q.zero.shape) == tuple(q.scale.shape)
        yield same, f"{name}.zero", f"the scale's shape {tuple(q.scale.shape)}", tuple(q.zero.shape)
    if tq.act_order:
        yield q.g_idx is not None, f"{name}.g_idx", f"an act-order group map for {scheme.name}", None
        yield q.g_idx.dtype == torch.int32, f"{name}.g_idx", "dtype torch.int32", q.g_idx.dtype
        got_g = tuple(q.g_idx.shape)
        if reference_layout:  # a backend's layout may pad K
            yield got_g == (e, k), f"{name}.g_idx", f"shape {(e, k)} (a group per input column)", got_g
    if tq.has_global_scale:
        gs = q.global_scale
        yield gs is not None, f"{name}.global_scale", f"a global scale for {scheme.name}", None
        yield gs.dtype == torch.float32, f"{name}.global_scale", "dtype torch.float32", gs.dtype
        got_gs = tuple(gs.shape)
        yield got_gs == (e, 1, 1), f"{name}.global_scale", f"shape {(e, 1, 1)} (one per expert)", got_gs


def _scale_dtype_ok(dtype: torch.dtype, fmt: QDtype) -> bool:
    if fmt is QDtype.MXFP4:
        return dtype in _E8M0
    if fmt is QDtype.NVFP4:
        return dtype == torch.float8_e4m3fn
    return dtype.is_floating_point


def _check_weights_device(weights: ExpertWeights, device: torch.device) -> None:
    for prefix, q in (("weights.w13.", weights.w13), ("weights.w2.", weights.w2)):
        for key in _Q_FIELDS:
            t = getattr(q, key)
            if t is not None and t.device != device:
                expect(False, prefix + key, f"on x's device ({device})", t.device)
    for key in _W_FIELDS:
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
            ((ids == -1) | ((ids >= 0) & (ids < e))).all(),
            ((s[:, 1:] != s[:, :-1]) | (s[:, 1:] == -1)).all(),
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
        bad = ((ids < -1) | (ids >= e)).nonzero()[0].tolist()
        got = f"{int(ids[bad[0], bad[1]])} at {tuple(bad)}"
        expect(False, "topk_ids", f"expert ids in [0, E) = [0, {e}), or -1 for a dropped pair", got)
    if not ok.get("ids_distinct", True):
        s = ids.sort(dim=1).values
        row = int(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != -1)).any(dim=1).nonzero()[0, 0])
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
