"""``FusedMoE``: the ``torch.nn.Module`` of one MoE layer, from checkpoint tensors to forward.

Life of a layer (the same three steps as vLLM's ``FusedMoE``)::

    layer = FusedMoE(config, scheme, router, parallel)     # empty parameters, checkpoint-like names
    layer.weight_loader("w13_weight", t, expert_id, "w1")  # once per checkpoint tensor (formats/ calls it)
    layer.process_weights_after_loading()                  # oracle -> pad -> prepare_weights -> MoEKernel
    out = layer(hidden_states, router_logits)

Parameters are created in fusedmoe's canonical layout (``quant/tensor.py``):
the format modules (``fusedmoe.checkpoints``) turn each checkpoint's own tensors
(GPTQ ``qweight``, gpt-oss ``*_blocks``, compressed-tensors ``weight_packed``,
...) into these before calling ``weight_loader``. Names, per local expert
(E_l of them), N x K being the logical operand::

    w13_weight / w2_weight                [E_l, N, K] (fp8, int8, model dtype) or [E_l, N, K/2] uint8
    *_weight_scale                        [E_l, *Granularity.scale_shape(N, K)]; per-tensor ones
                                          are [E_l, S], S = 2 for a gated W13 (w1 and w3 may differ)
    *_weight_zero_point                   uint8, like the scale (int4 with zero points)
    *_weight_global_scale                 fp32 [E_l, S] (NVFP4, dequantization multiplier)
    *_g_idx                               int32 [E_l, K] (int4 act-order; identity if never loaded)
    w13_bias [E_l, 2I], w2_bias [E_l, H]
    *_input_scale, *_input_global_scale   fp32 [E_l]: static activation scales, max over experts

Tensor parallelism splits I: ``config.intermediate_size`` is this rank's
share and a loaded tensor holds the full I = I_shard * tp_size; rows
[tp_rank * I_shard, (tp_rank + 1) * I_shard) of W1/W3 and the same columns of
W2 are kept, in whole scale groups/blocks (a slice that would cut one is an
error). The down-projection bias is kept on tp_rank 0 only, so the sum over
ranks adds it once. Expert parallelism keeps the experts of
``ParallelConfig.local_experts`` (linear or round-robin) and skips the rest.
With tp_size > 1, or ep_size > 1 under the ``local`` dispatcher, ``forward``
returns this rank's partial sum, which the caller all-reduces.

Per-tensor scales of W1 and W3 (fp8, and the NVFP4 global scale) are unified
after loading: where they differ, both halves are requantized with the larger
one (what vLLM does), because a backend takes one scale per expert.

The oracle's ``Choice`` says which backend runs the layer, with which
activation precision (``effective_scheme``, kept as ``compute_scheme``) and
which H/I multiples it needs (``align``): the weights are padded once
(``oracle.padding.pad_weights``) and ``forward`` pads x and cuts the output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .config import MoEConfig, ParallelConfig
from .errors import FusedMoEError, expect
from .modular.kernel import MoEKernel
from .modular.validation import check_weights, validate_call
from .oracle import Choice
from .oracle.build import build_kernel
from .oracle.padding import pad_weights
from .platform import Platform
from .quant import QDtype, QTensor, QuantScheme, TensorQuant, dequantize, quantize
from .quant.formats import PACKED, WEIGHT_DATA_DTYPE
from .routing import RouterConfig
from .weights import ExpertWeights

__all__ = ["FusedMoE", "SHARDS"]

SHARDS = ("w1", "w3", "w2", "w13")

_SCALE_DTYPE = {QDtype.MXFP4: torch.uint8, QDtype.NVFP4: torch.float8_e4m3fn}


@dataclass(frozen=True)
class _Spec:
    """One loadable parameter: its full shape and how a per-expert slice maps to (N, K).

    kind: 'matrix' [N', K'] with ``rows``/``cols`` logical elements per stored one (``cols``
    0: one column for all of K, a per-channel scale), 'rowvec' [N'] (a bias), 'colvec' [K']
    (g_idx), 'shard' [S] (the per-tensor scale of each of W1/W3), 'expert' [] (an activation
    scale; the max of all loads is kept).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    rows: int = 1
    cols: int = 1
    required: bool = True


def _gran_units(tq: TensorQuant) -> tuple[int, int]:
    g = tq.granularity
    if g.kind == "group":
        return 1, g.group_size
    if g.kind == "block":
        return g.block_n, g.block_k
    return 1, 0  # channel: one column for all of K


def _weight_specs(prefix: str, e: int, n: int, k: int, tq: TensorQuant | None, dtype, shards: int) -> dict:
    if tq is None:
        return {f"{prefix}_weight": _Spec((e, n, k), dtype, "matrix")}
    pack = 2 if tq.dtype in PACKED else 1
    specs = {f"{prefix}_weight": _Spec((e, n, k // pack), WEIGHT_DATA_DTYPE[tq.dtype], "matrix", cols=pack)}
    sdt = _SCALE_DTYPE.get(tq.dtype, torch.float32)
    if tq.granularity.kind == "tensor":
        specs[f"{prefix}_weight_scale"] = _Spec((e, shards), sdt, "shard")
    else:
        ru, cu = _gran_units(tq)
        sn, sk = tq.granularity.scale_shape(n, k)
        specs[f"{prefix}_weight_scale"] = _Spec((e, sn, sk), sdt, "matrix", rows=ru, cols=cu)
        if not tq.symmetric:
            specs[f"{prefix}_weight_zero_point"] = _Spec((e, sn, sk), torch.uint8, "matrix", rows=ru, cols=cu)
    if tq.has_global_scale:
        specs[f"{prefix}_weight_global_scale"] = _Spec((e, shards), torch.float32, "shard")
    if tq.act_order:
        specs[f"{prefix}_g_idx"] = _Spec((e, k), torch.int32, "colvec", required=False)
    return specs


def _act_specs(prefix: str, e: int, tq: TensorQuant | None) -> dict:
    specs = {}
    if tq is not None and not tq.dynamic:
        specs[f"{prefix}_input_scale"] = _Spec((e,), torch.float32, "expert")
    if tq is not None and tq.has_global_scale:
        specs[f"{prefix}_input_global_scale"] = _Spec((e,), torch.float32, "expert")
    return specs


def _span(lo: int, hi: int, unit: int, full: int, what: str) -> slice:
    """Stored indices of the logical range [lo, hi) of a dim of ``full`` elements, ``unit`` per stored one."""
    expect(
        lo % unit == 0 and (hi % unit == 0 or hi == full),
        what,
        f"a range [{lo}, {hi}) of whole groups/blocks of {unit} (tensor-parallel shard or gate/up boundary)",
    )
    return slice(lo // unit, -(-hi // unit))


class FusedMoE(torch.nn.Module):
    """One MoE layer: creates, loads and converts its weights, then runs (see the module docstring).

    config:         shapes (``intermediate_size`` is this rank's shard) and dtype.
    scheme:         the quantization scheme (``formats.detect`` derives it from a checkpoint).
    router:         how router logits become a ``TopK`` (default softmax top-k, renormalized).
    parallel:       TP/EP sizes and ranks, dispatcher name, expert placement.
    backend:        an Experts backend name or "auto" (the oracle decides).
    correction_bias: [E] DeepSeek-V3 ``e_score_correction_bias`` (registered as a buffer).
    shared_experts: ``f(x [T, H]) -> [T, H]`` added to the routed output (MoEKernel's hook).
    online_quant:   create model-dtype weights and quantize them with ``scheme`` after
                    loading (an FP8-online bf16 checkpoint).
    """

    def __init__(
        self,
        config: MoEConfig,
        scheme: QuantScheme | None = None,
        router: RouterConfig | None = None,
        parallel: ParallelConfig | None = None,
        *,
        backend: str = "auto",
        correction_bias: torch.Tensor | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        online_quant: bool = False,
        platform: Platform | None = None,
        chunk_size: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.scheme = scheme or QuantScheme.unquantized()
        e = config.num_experts + config.identity_experts
        self.router = router or RouterConfig(e, config.top_k, renormalize=True)
        self.parallel = parallel or ParallelConfig()
        self.backend = backend
        self.shared_experts = shared_experts
        self.online_quant = online_quant
        self.platform = platform
        self.chunk_size = chunk_size
        expect(
            self.router.num_experts == e and self.router.top_k == config.top_k,
            "router",
            f"num_experts={e}, top_k={config.top_k} as in the MoEConfig (identity experts included)",
            (self.router.num_experts, self.router.top_k),
        )
        if online_quant:
            expect(self.scheme.w1 is not None, "online_quant", "a quantized scheme to quantize to", self.scheme.name)
        self.local_experts = self.parallel.local_experts(config.num_experts)
        em = self.parallel.expert_map(config.num_experts)
        self.register_buffer("expert_map", None if em is None else em.to(device), persistent=False)
        if correction_bias is not None:
            expect(
                tuple(correction_bias.shape) == (config.num_experts,),
                "correction_bias",
                f"shape ({config.num_experts},)",
                tuple(correction_bias.shape),
            )
            correction_bias = correction_bias.detach().float().to(device)
        self.register_buffer("e_score_correction_bias", correction_bias)
        self._specs = self._make_specs()
        for name, spec in self._specs.items():
            t = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            if spec.kind == "colvec":  # act-order g_idx: identity (contiguous groups) unless loaded
                tq = self.scheme.w1 if name.startswith("w13") else self.scheme.w2
                t.copy_(torch.arange(spec.shape[1], device=device) // tq.granularity.group_size)
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self._loaded: set[tuple[str, int, str]] = set()
        self.kernel: MoEKernel | None = None
        self.choice: Choice | None = None
        self.reference_weights: ExpertWeights | None = None
        self.compute_scheme = self.scheme
        self._pad = (0, 0)
        self._layout = "reference"
        self._templates: dict = {}
        self._params: dict[tuple[str, str], str] = {}
        self._weights_cache = None

    # ---- parameters ------------------------------------------------------------------
    def _make_specs(self) -> dict[str, _Spec]:
        c, s = self.config, self.scheme
        e, h, i, dt = len(self.local_experts), c.hidden_size, c.intermediate_size, c.dtype
        gated = c.activation.is_gated
        w1, w2 = (None, None) if self.online_quant else (s.w1, s.w2)
        specs = _weight_specs("w13", e, c.w13_rows, h, w1, dt, 2 if gated else 1)
        specs.update(_weight_specs("w2", e, h, i, w2, dt, 1))
        if c.has_bias:
            specs["w13_bias"] = _Spec((e, c.w13_rows), dt, "rowvec")
            specs["w2_bias"] = _Spec((e, h), dt, "rowvec")
        if not self.online_quant:
            specs.update(_act_specs("w13", e, s.a1))
            specs.update(_act_specs("w2", e, s.a2))
        return specs

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    def weight_loader(self, param_name: str, loaded: torch.Tensor, expert_id: int, shard_id: str) -> bool:
        """Copy one checkpoint tensor (canonical layout, full I) of global expert ``expert_id``.

        shard_id: 'w1' (gate rows of W13), 'w3' (up rows), 'w13' (both, fused as the
        config says: gate then up, or interleaved), 'w2' (down). Returns False when
        the expert is not local under expert parallelism (nothing is copied).
        """
        expect(self.kernel is None, "weight_loader", "calls before process_weights_after_loading()")
        expect(param_name in self._specs, "param_name", f"one of {sorted(self._specs)}", param_name)
        expect(shard_id in SHARDS, "shard_id", f"one of {SHARDS}", shard_id)
        expect(
            0 <= expert_id < self.config.num_experts,
            "expert_id",
            f"in [0, {self.config.num_experts})",
            expert_id,
        )
        is_w13 = param_name.startswith("w13_")
        expect(
            (shard_id != "w2") == is_w13,
            f"{param_name} shard_id",
            "'w2' for w2_* parameters and 'w1', 'w3' or 'w13' for w13_* ones",
            shard_id,
        )
        if shard_id == "w3":
            expect(self.config.activation.is_gated, f"{param_name} shard_id", "not 'w3' for a non-gated activation")
        if self.expert_map is not None:
            local = int(self.expert_map[expert_id])
            if local < 0:
                return False
        else:
            local = expert_id
        spec = self._specs[param_name]
        what = f"{param_name} (expert {expert_id}, shard {shard_id})"
        dst = getattr(self, param_name).data[local]
        src = loaded.detach().to(dst.device)
        src = self._check_dtype(src, spec, param_name, what)
        if spec.kind == "expert":
            # a static activation scale of 0 made the whole output 0: refused here, once per tensor
            ok = src.numel() > 0 and bool(torch.isfinite(src).all() and (src > 0).all())
            expect(ok, what, "finite static activation scales > 0 (dequantization multipliers)", src.flatten().tolist())
            v = src.float().max().reshape(())
            key = (param_name, local, "any")
            dst.copy_(torch.maximum(dst, v) if key in self._loaded else v)
            self._loaded.add(key)
            return True
        if spec.kind == "shard":
            self._load_shard(dst, src, shard_id, what)
        elif spec.kind == "colvec" and is_w13:
            expect(tuple(src.shape) == tuple(dst.shape), what, f"shape {tuple(dst.shape)}", tuple(src.shape))
            other = (param_name, local, "w3" if shard_id == "w1" else "w1")
            if other in self._loaded:  # one g_idx per expert row of W13: gate and up share the input
                expect(torch.equal(dst, src.to(dst.dtype)), what, f"the same g_idx as shard {other[2]}")
            dst.copy_(src)
        elif is_w13:
            self._load_w13(dst, src, spec, shard_id, what)
        else:
            self._load_w2(dst, src, spec, what)
        self._loaded.add((param_name, local, shard_id))
        return True

    def _check_dtype(self, src: torch.Tensor, spec: _Spec, name: str, what: str) -> torch.Tensor:
        """``src`` as the parameter's dtype takes it: float to float casts; stored codes must match."""
        if src.dtype == torch.float8_e8m0fnu:
            src = src.view(torch.uint8)
        if spec.dtype.is_floating_point and (spec.dtype.itemsize > 1 or not name.endswith("_weight")):
            ok = src.is_floating_point()
        elif spec.dtype == torch.int32:
            ok = not src.is_floating_point() and src.dtype != torch.bool
        else:
            ok = src.dtype == spec.dtype
        expect(ok, what, f"dtype {spec.dtype}", src.dtype)
        return src

    def _load_shard(self, dst: torch.Tensor, src: torch.Tensor, shard_id: str, what: str) -> None:
        s = dst.shape[0]
        if shard_id == "w13":
            expect(src.numel() in (1, s), what, f"1 or {s} per-tensor scales", tuple(src.shape))
            dst.copy_(src.reshape(-1).float().expand(s) if src.numel() == 1 else src.reshape(s))
        else:
            expect(src.numel() == 1, what, "one per-tensor scale", tuple(src.shape))
            dst[1 if shard_id == "w3" else 0] = src.reshape(()).float()

    def _load_w13(self, dst: torch.Tensor, src: torch.Tensor, spec: _Spec, shard_id: str, what: str) -> None:
        c = self.config
        i, tp, rank = c.intermediate_size, self.parallel.tp_size, self.parallel.tp_rank
        i_full, u, gated = i * tp, spec.rows, c.activation.is_gated
        if spec.kind == "matrix":
            expect(src.dim() == 2, what, "a 2-D tensor [N, K]", tuple(src.shape))
            expect(src.shape[1] == dst.shape[1], what, f"{dst.shape[1]} stored columns (K = H)", tuple(src.shape))
        else:
            expect(src.dim() == 1, what, "a 1-D tensor [N]", tuple(src.shape))
        if shard_id == "w13":
            rows_full = i_full * (2 if gated else 1)
            want = -(-rows_full // u)
            expect(src.shape[0] == want, what, f"{want} stored rows for N = {rows_full}", tuple(src.shape))
            if tp == 1:
                dst.copy_(src)
            elif c.gate_up_interleaved or not gated:
                m = 2 if gated else 1
                dst.copy_(src[_span(rank * i * m, (rank + 1) * i * m, u, rows_full, what)])
            else:
                expect(i_full % u == 0, what, f"the gate/up boundary I = {i_full} on a block boundary ({u} rows)")
                self._load_w13(dst, src[: i_full // u], spec, "w1", what)
                self._load_w13(dst, src[i_full // u :], spec, "w3", what)
            return
        want = -(-i_full // u)
        expect(src.shape[0] == want, what, f"{want} stored rows for N = I = {i_full}", tuple(src.shape))
        part = src[_span(rank * i, (rank + 1) * i, u, i_full, what)]
        if c.gate_up_interleaved:
            expect(u == 1, what, "per-row data and scales for separate gate and up of an interleaved W13")
            dst[(1 if shard_id == "w3" else 0) :: 2].copy_(part)
            return
        off = i if shard_id == "w3" else 0
        dst[_span(off, off + i, u, c.w13_rows, what)].copy_(part)

    def _load_w2(self, dst: torch.Tensor, src: torch.Tensor, spec: _Spec, what: str) -> None:
        h = self.config.hidden_size
        i, tp, rank = self.config.intermediate_size, self.parallel.tp_size, self.parallel.tp_rank
        if spec.kind == "rowvec":
            expect(tuple(src.shape) == (h,), what, f"shape ({h},)", tuple(src.shape))
            dst.copy_(src if rank == 0 else torch.zeros_like(src))
            return
        if spec.kind == "colvec":
            expect(tp == 1, what, "tensor_parallel size 1: act-order g_idx of W2 cannot be split over I")
            expect(tuple(src.shape) == tuple(dst.shape), what, f"shape {tuple(dst.shape)}", tuple(src.shape))
            dst.copy_(src)
            return
        rows = dst.shape[0]
        expect(src.dim() == 2 and src.shape[0] == rows, what, f"a 2-D tensor [{rows}, K] (N = H)", tuple(src.shape))
        if spec.cols == 0:  # per-channel scale: one column for all of K
            expect(src.shape[1] == 1, what, "one column (a per-channel scale)", tuple(src.shape))
            dst.copy_(src)
            return
        u, i_full = spec.cols, i * tp
        want = -(-i_full // u)
        expect(src.shape[1] == want, what, f"{want} stored columns for K = I = {i_full}", tuple(src.shape))
        dst.copy_(src[:, _span(rank * i, (rank + 1) * i, u, i_full, what)])

    # ---- after loading ---------------------------------------------------------------
    def _check_loaded(self) -> None:
        gated = self.config.activation.is_gated
        for name, spec in self._specs.items():
            if not spec.required:
                continue
            for local, e in enumerate(self.local_experts):
                if spec.kind == "expert":
                    ok = (name, local, "any") in self._loaded
                elif name.startswith("w2_"):
                    ok = (name, local, "w2") in self._loaded
                else:
                    ok = (name, local, "w13") in self._loaded or all(
                        (name, local, s) in self._loaded for s in (("w1", "w3") if gated else ("w1",))
                    )
                if not ok:
                    raise FusedMoEError(f"{name}: expected loaded for expert {e}, but no checkpoint tensor was given")

    def _qtensor(self, prefix: str, tq: TensorQuant, n: int, k: int) -> QTensor:
        p = {
            name.removeprefix(prefix + "_"): prm.data
            for name, prm in self.named_parameters()
            if name.startswith(prefix + "_")
        }
        e = self.num_local_experts
        scale = p["weight_scale"]
        gs = p.get("weight_global_scale")
        shard_scale = scale if tq.granularity.kind == "tensor" else gs
        data = p["weight"]
        if shard_scale is not None and shard_scale.shape[1] == 2:
            data, scale, gs = self._unify_shards(data, scale, gs, tq, n, k)
        elif tq.granularity.kind == "tensor":
            scale = scale.reshape(e, 1, 1)
        if gs is not None:
            gs = gs[:, :1].reshape(e, 1, 1)
        g_idx = p.get("g_idx")
        return QTensor(data, (e, n, k), scale=scale, zero=p.get("weight_zero_point"), global_scale=gs, g_idx=g_idx)

    def _unify_shards(self, data, scale, gs, tq: TensorQuant, n: int, k: int):
        """One per-tensor scale (or NVFP4 global scale) per expert: requantize W1/W3 to the larger."""
        e, i = data.shape[0], n // 2
        per_tensor = tq.granularity.kind == "tensor"
        two = scale if per_tensor else gs
        if bool((two[:, 0] == two[:, 1]).all()):
            return data, (two[:, :1].reshape(e, 1, 1) if per_tensor else scale), gs
        best = two.amax(dim=1)
        halves = []
        for h in range(2):
            rows = slice(h * i, (h + 1) * i)
            q = QTensor(
                data[:, rows],
                (e, i, k),
                scale=two[:, h].reshape(e, 1, 1) if per_tensor else scale[:, rows],
                global_scale=None if per_tensor else two[:, h].reshape(e, 1, 1),
            )
            x = dequantize(q, tq, torch.float32)
            if per_tensor:
                halves.append(quantize(x, tq, scale=best.reshape(e, 1, 1)))
            else:
                halves.append(quantize(x, tq, global_scale=best.reshape(e, 1, 1)))
        data = torch.cat([halves[0].data, halves[1].data], dim=1)
        if per_tensor:
            return data, best.reshape(e, 1, 1), gs
        return data, torch.cat([halves[0].scale, halves[1].scale], dim=1), best.reshape(e, 1).expand(e, 2)

    def _canonical_weights(self) -> ExpertWeights:
        c, s = self.config, self.scheme
        p = dict(self.named_parameters())
        b13 = p["w13_bias"].data if c.has_bias else None
        b2 = p["w2_bias"].data if c.has_bias else None
        if self.online_quant or s.w1 is None:
            w13, w2 = p["w13_weight"].data, p["w2_weight"].data
            if s.w1 is None:
                return ExpertWeights.from_float(w13, w2, s, b13=b13, b2=b2)
            expect(
                s.a1 is None or s.a1.dynamic,
                "online_quant",
                "a scheme with dynamic activation scales (no checkpoint calibrates them)",
                s.name,
            )
            return ExpertWeights.from_float(w13.float(), w2.float(), s, b13=b13, b2=b2)
        w = ExpertWeights(
            w13=self._qtensor("w13", s.w1, c.w13_rows, c.hidden_size),
            w2=self._qtensor("w2", s.w2, c.hidden_size, c.intermediate_size),
            b13=b13,
            b2=b2,
        )
        for name, key in (("a1", "w13"), ("a2", "w2")):
            if f"{key}_input_scale" in p:
                setattr(w, f"{name}_scale", p[f"{key}_input_scale"].data.max().reshape(1, 1))
            if f"{key}_input_global_scale" in p:
                setattr(w, f"{name}_global_scale", p[f"{key}_input_global_scale"].data.max().reshape(1, 1))
        return w

    def process_weights_after_loading(self, *, keep_reference: bool = False) -> Choice:
        """Check every tensor was loaded, choose the backend, pad, convert once, build the kernel.

        keep_reference: keep the reference-layout weights (unpadded) as
        ``self.reference_weights`` for comparisons with ``moe_reference``.
        """
        expect(self.kernel is None, "process_weights_after_loading", "to be called once")
        self._check_loaded()
        weights = self._canonical_weights()
        check_weights(weights, self.config, self.scheme, num_local=self.num_local_experts)
        if keep_reference:
            self.reference_weights = weights
        kernel = build_kernel(
            self.config,
            self.scheme,
            backend=self.backend,
            dispatcher=self.parallel.dispatcher,
            parallel=self.parallel,
            platform=self.platform,
            expert_map=self.expert_map is not None,
            chunk_size=self.chunk_size,
        )
        choice = kernel.choice
        # the backend may run the weights with other activations (MXFP4 x MXFP8) and need H, I rounded up
        self.compute_scheme = kernel.scheme
        weights = pad_weights(weights, self.config, self.scheme, choice.align)
        self._pad = (
            kernel.config.hidden_size - self.config.hidden_size,
            kernel.config.intermediate_size - self.config.intermediate_size,
        )
        self._store(kernel.experts.prepare_weights(weights))
        if self.shared_experts is not None:
            kernel.shared_experts = self._shared_hook()
        self.kernel = kernel
        self.choice = choice
        return choice

    # parameter names of a weight operand's tensors (``QTensor.tensors()`` keys), as checkpoints name them
    _PARAM_SUFFIX = {"data": "weight", "scale": "weight_scale", "zero": "weight_zero_point",
                     "global_scale": "weight_global_scale"}  # fmt: skip
    _EXTRA_PARAMS = {"b13": "w13_bias", "b2": "w2_bias", "a1_scale": "w13_input_scale",
                     "a2_scale": "w2_input_scale", "a1_global_scale": "w13_input_global_scale",
                     "a2_global_scale": "w2_input_global_scale"}  # fmt: skip

    def _store(self, w: ExpertWeights) -> None:
        """Replace the loading parameters by the converted tensors (so ``.to()`` moves them). Each
        operand keeps a template: its class and non-tensor fields (a backend's layout may add
        both), filled with the current parameters by ``expert_weights``."""
        for name in list(self._specs):
            delattr(self, name)
        self._templates, self._params = {}, {}
        for prefix, q in (("w13", w.w13), ("w2", w.w2)):
            tensors = q.tensors()
            # no tensor kept in the template: it would keep the pre-``.to()`` copy alive
            blank = {k: (torch.empty(0) if k == "data" else None) for k in tensors}
            self._templates[prefix] = dataclasses.replace(q, **blank)
            for key, t in tensors.items():
                self._params[(prefix, key)] = f"{prefix}_{self._PARAM_SUFFIX.get(key, key)}"
                self.register_parameter(self._params[(prefix, key)], torch.nn.Parameter(t, requires_grad=False))
        for key, name in self._EXTRA_PARAMS.items():
            t = getattr(w, key)
            if t is not None:
                self._params[("", key)] = name
                self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self._layout = w.layout
        self._weights_cache = None

    @property
    def expert_weights(self) -> ExpertWeights:
        """The converted weights as the backend takes them: built from the parameters once, and again
        only when a parameter object is replaced (moving the module keeps the objects: ``.to()``
        changes their data in place), so a forward pays 16 attribute reads, not a rebuild."""
        expect(self.kernel is not None, "FusedMoE", "process_weights_after_loading() called first")
        params = tuple(getattr(self, name) for name in self._params.values())
        cached = self._weights_cache
        if cached is not None and all(a is b for a, b in zip(cached[0], params, strict=True)):
            return cached[1]
        by_key = dict(zip(self._params, params, strict=True))
        ops = {
            prefix: dataclasses.replace(t, **{k: v for (pf, k), v in by_key.items() if pf == prefix})
            for prefix, t in self._templates.items()
        }
        extra = {key: by_key.get(("", key)) for key in self._EXTRA_PARAMS}
        weights = ExpertWeights(w13=ops["w13"], w2=ops["w2"], layout=self._layout, **extra)
        self._weights_cache = (params, weights)
        return weights

    def _shared_hook(self) -> Callable[[torch.Tensor], torch.Tensor]:
        h, pad = self.config.hidden_size, self._pad[0]
        fn = self.shared_experts

        def hook(x: torch.Tensor) -> torch.Tensor:
            y = fn(x[:, :h]).to(x.dtype)
            return F.pad(y, (0, pad)) if pad else y

        return hook

    # ---- forward ---------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] or [B, S, H], router_logits [T, E] (or [B, S, E]) -> hidden_states' shape."""
        expect(self.kernel is not None, "FusedMoE", "process_weights_after_loading() called before forward")
        c = self.config
        shape = hidden_states.shape
        expect(shape[-1] == c.hidden_size, "hidden_states", f"last dimension H = {c.hidden_size}", tuple(shape))
        x = hidden_states.reshape(-1, c.hidden_size)
        logits = router_logits.reshape(-1, router_logits.shape[-1])
        expect(
            logits.shape[0] == x.shape[0],
            "router_logits",
            f"one row per token ({x.shape[0]})",
            tuple(router_logits.shape),
        )
        expect(x.dtype == c.dtype, "hidden_states", f"dtype {c.dtype} (MoEConfig.dtype)", x.dtype)
        # expert_weights is built from the parameters on each access: take it once per forward
        weights = self.expert_weights
        x = x.contiguous()
        if self._pad[0]:
            out = self._routed(x, logits, weights)[:, : c.hidden_size]
        else:  # the routing launch and the experts' in one launch plan (``MoEKernel.route_and_run``)
            bias = self.e_score_correction_bias
            plain = partial(self._routed, x, logits, weights)
            out = self.kernel.route_and_run(x, logits, self.router, bias, weights, plain, expert_map=self.expert_map)
        return out.reshape(shape)

    def _routed(self, x: torch.Tensor, logits: torch.Tensor, weights) -> torch.Tensor:
        """x [T, H] routed from ``logits`` and run: the kernel's launch plan, or checked and run
        (padded to the kernel's H where it needs it)."""
        c = self.config
        topk = self.router.route(logits, self.e_score_correction_bias)
        out = None if self._pad[0] else self.kernel.replay(x, topk, weights, expert_map=self.expert_map)
        if out is None:  # no launch plan for inputs of this kind yet (``modular.replay``): check them
            validate_call(x, topk.ids, topk.weights, weights, c, self.scheme, self.expert_map, weights_checked=True)
            if self._pad[0]:
                x = F.pad(x, (0, self._pad[0]))
            out = self.kernel(x, topk, weights, expert_map=self.expert_map)
        return out

    def extra_repr(self) -> str:
        backend = self.choice.backend if self.choice else "not chosen yet"
        return f"config={self.config!r}, scheme={self.scheme.name}, backend={backend}"
