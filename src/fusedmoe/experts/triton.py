"""``triton`` and ``triton_batched``: the fused grouped-GEMM Triton kernels.

Standard layout, per call (T tokens, K top-k, E_l local experts)::

    moe_align          sort the T*K pairs by local expert, pad runs to BM   (1 launch; none at T = 1)
    grouped_gemm #1    h = A[pair] @ W13[e]^T (+ b13)      [T*K, 2I]          (1 launch)
    act_and_quantize   a2 = Q_a2(act(h))                   [T*K, I]           (1 launch)
    grouped_gemm #2    y = a2 @ W2[e]^T (+ b2) * w[t,k]    [T*K, H]           (1 launch)
    moe_sum            out[t] = sum_k y[t, k]              [T, H]             (1 launch)

At T = 1 (no expert map) the pairs are not sorted: each GEMM block takes one pair, in pair
order (``kernels.align.pair_blocks``; the K experts of one token are distinct, so sorting
saves no weight read). That drops ``moe_align``'s launch: 6.1 us of a 59 us Qwen3-30B-A3B
bf16 call on an H100, 10.1 us for DeepSeek-V3's 256 experts. Also at up to 16 pairs that are
at most 1/8 of the experts (T = 2 for Qwen3-30B-A3B and DeepSeek-V3; ``pair_blocked``).

Fused activation (the default): GEMM1 applies the activation in its epilogue
(``grouped_gemm(act=ActEpilogue)``), so the [T*K, 2I] h never exists. Where a2's scale is
known before its values (a2 not quantized, or static per-tensor fp8/int8) the epilogue also
quantizes and writes a2 [T*K, I] directly: one launch fewer (two with an expert map or the
batched layout, whose h is zero-filled first). A per-tensor dynamic scale needs the whole
tensor first: GEMM1 writes act(h) [T*K, I] in the model dtype and raises its abs-max as it
stores it (``ActEpilogue.track_amax``: an atomic integer max per tile into a zeroed fp32 [1]),
and ``quantize_activations`` follows with one pass, the codes. Before, act(h) was read twice
after GEMM1 (abs-max, then codes), and before that h [T*K, 2I] twice by ``act_and_quantize``
(Mixtral fp8 at T = 4096 on an H100: 470 MB of h written and read twice became 235 MB, the
layer 3,163 -> 2,965 us); the activation is rounded to the model dtype once before Q_a2,
and the abs-max is of the rounded values. Per-row dynamic scales (per token, 1x128 groups,
MX/NV blocks) keep GEMM1 plain and ``act_and_quantize`` (one pass): GEMM1 with the
activation takes half the tile width, and that was slower at a few hundred tokens (fp8
blocks, T = 256: Qwen3 276 -> 321 us, gpt-oss 405 -> 472 us with the activation in GEMM1).
``FUSEDMOE_FUSE_ACT=0`` (read when the experts are built) or ``experts.fuse_act = False``
turns the fusion off, for comparison. The fused GEMM1 takes the plain GEMM1's launch
config with BN halved (``gated_act_config``), so a program reads the same W13 rows.

Decode, per-tensor dynamic a2. With pair blocks (T = 1) GEMM1's programs each write their tile's
abs-max to an int32 slot of their own (``ActEpilogue.amax_slots``) instead of raising one zeroed
fp32: no memset launch (H200, T = 1, fp8 per tensor: Qwen3-30B-A3B 35.8 -> 34.6 us, Mixtral
126.0 -> 125.3, DeepSeek-V3 117.2 -> 116.2). Where few K steps per SM make it pay (``_a2_on_load``)
GEMM2 also quantizes act(h) as it loads each tile (``grouped_gemm(quantize_a=...)``, the codes
the pass would write): no codes pass either, 5 launches in all (route, x's quantization, the two
GEMMs, the sum). ``FUSEDMOE_QUANT_ON_LOAD`` = N (or ``experts.quant_on_load``) does it in every
call of at most N pairs that can, per 1 x g group scales included; 0 never.

Workspace (``workspace``, declared from the shapes): h [T*K, 2I] (unfused), h_act [T*K, I] and
a2_amax [1] (fused with a per-tensor dynamic a2: act(h) before Q_a2, and its abs-max; the slots
a2_amax_slots for pair blocks) and y
[T*K, H] in the model dtype, a2 [T*K, I] quantized as scheme.a2 (plus its row scales);
``MoEKernel`` chunking bounds T. Given a workspace (``MoEKernel.allocate``), ``apply``
writes into it and allocates none of these. Batched layout: the same two GEMMs over
[E_l, M, .] with per-expert counts read by the kernel (no align, no sum: combine
weights and scatters); its workspace is h (unfused only) and a2 for E_l * M rows.

Rows that no local pair writes (pairs that contribute nothing: ids outside [0, E), experts
mapped outside [0, E_l), see ``metadata.TopK``; batched rows past the counts) are never
read as outputs: GEMM2 reads the rows of local pairs only and ``moe_sum`` skips the
others. A per-tensor dynamic a2 scale never sees them: with the fused activation its abs-max
is raised by GEMM1's stores alone; unfused (``act_and_quantize`` over h) they are
zero-filled before GEMM1 (small h and the batched layout) or left out by a row mask of the
local pairs (``_MASK_OVER_FILL_BYTES``), so it never sees uninitialised memory (zeros leave
an abs-max unchanged); with a reused workspace
such rows hold the previous call's values. Other a2 scales are per row: a stale row
only makes its own, unread, output.

4-bit weights with float activations (int4, MXFP4, NVFP4 as w4a16) are converted once at load
(``prepare_weights``) into the w4 layout and run by their own kernel (``kernels.grouped_gemm_w4``):
its configs come from ``w4_launch_config`` (measured per regime); at prefill GEMM1 and GEMM2 want
different BM, so the pairs are aligned twice; at decode GEMM2 may split K, its fp32 partials
[S, T*K, H] summed by ``moe_sum`` with the top-k sum (no launch of its own).

Prefill with 4-bit weights (``_dequant_w4``): from a measured number of rows per expert, per GPU and
4-bit format (``thresholds.w4_dequant_from``; ``FUSEDMOE_W4_DEQUANT`` or ``experts.w4_dequant`` sets
it), a call writes W13 out in the model dtype (``kernels.w4_dequant``, one pass) into the workspace's
"w_deq", runs GEMM1 as the bf16 layer does (its tables, the persistent TMA-fed kernel), then W2 into
the same buffer and GEMM2. The buffer is E_l x max(2I x H, H x I) values (Mixtral-8x7B: 1.9 GB in
bf16), declared only where the largest call may take this path; the 4-bit GEMM serves the rest.

Launch plans: the configs of both GEMMs (and GEMM2's split) for a pair count are worked out once
and kept (``_plan``), so a call with a known T picks no config and builds no dataclass.

Deterministic mode (``deterministic``; ``FUSEDMOE_DETERMINISTIC=1`` when built): the
launch config does not depend on the token count (``pick_launch_config``), so every
token meets the same tiles and K-loop order whatever batch it is in. Nothing else
here depends on T: no kernel reduces with atomic adds (the sum over top-k is
``moe_sum``, in k order; the only atomic is an order-free ``atomic_max`` for a
per-tensor dynamic scale) and no split-K (the w4 configs of this mode never split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from .. import env
from ..contract import TokenLayout, WeightedReduce, Workspace, quantized_layout, take
from ..kernels._common import cdiv, interpreting
from ..kernels.act_quant import act_and_quantize, quantize_activations
from ..kernels.align import moe_align, pair_blocks
from ..kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat, amax_slot_count, on_load_why, scheme_key
from ..kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched
from ..kernels.grouped_gemm_w4 import supports as w4_supports
from ..kernels.grouped_gemm_w4 import w4_gemm_launch, w4_launch_config
from ..kernels.launch_config import LaunchConfig, gated_act_config, pick_launch_config
from ..kernels.moe_sum import moe_sum
from ..kernels.w4_dequant import dequantize_w4
from ..metadata import ID_DTYPES, int32_ids, local_expert_ids
from ..platform import current_platform
from ..quant import Operand, QTensor
from ..quant.w4_layout import W4_FORMATS, convertible, from_w4_weights, is_w4, to_w4_weights
from .base import ALL_SCHEMES, Capabilities, Experts
from .thresholds import W4_DEQUANT_MAX_BYTES, w4_dequant_from

# Under the interpreter the kernels also run on the CPU (CI checks them there).
_PLATFORMS = frozenset({"cuda"} | ({"cpu"} if interpreting() else set()))


def _caps(layout: TokenLayout, note: str, seed: str) -> Capabilities:
    """Both Triton backends: every scheme, on CUDA from sm80 (and the CPU under the interpreter), in one layout."""
    return Capabilities(
        layouts=frozenset({layout}),
        schemes=ALL_SCHEMES,
        platforms=_PLATFORMS,
        min_capability=(8, 0),
        note=note,
        seed_names=(seed,),
    )


def _needs_native_fp8(scheme) -> bool:
    return scheme.a1 is not None and scheme.a1.dtype.value in ("fp8_e4m3", "mxfp8")


def _tensor_dynamic(tq) -> bool:
    return tq is not None and tq.dynamic and tq.granularity.kind == "tensor"


# h's size from which a row mask beats zero-filling it (~20 us of fill at ~2.5 TB/s on an H100)
_MASK_OVER_FILL_BYTES = 48 << 20


def _local_pairs(ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """bool [T*K]: the pairs whose expert runs here, the rows of h that GEMM1 writes."""
    return local_expert_ids(ids.reshape(-1), expert_map, num_local_experts) >= 0


def _unwritten_rows(h: torch.Tensor, tq, local_pairs) -> torch.Tensor | None:
    """Keep the rows of ``h`` that GEMM1 will not write out of a per-tensor dynamic scale: zero
    them now, or return the row mask (``local_pairs()``, standard layout) where the fill costs
    more than the mask's few [T*K] launches (~8 us): the fill of Mixtral's [T*K, 2I] h at
    T = 4096 took 141 us on an H100 (470 MB). None: nothing to mask."""
    if not _tensor_dynamic(tq):
        return None
    if local_pairs is not None and h.numel() * h.element_size() >= _MASK_OVER_FILL_BYTES:
        return local_pairs()
    h.zero_()
    return None


def _a2_out(ws, tq, rows: int, cols: int, device) -> QTensor | torch.Tensor | None:
    """``act_and_quantize``'s output buffers for ``rows`` rows, taken from the workspace
    (None without one: it allocates its own)."""
    if ws is None or "a2" not in ws:
        return None
    buf = ws["a2"]
    data = take(ws, "a2", (rows, *buf.shape[1:]), buf.dtype, device)
    if tq is None:
        return data
    scale = ws.get("a2_scale")
    if scale is not None and not _tensor_dynamic(tq):
        scale = take(ws, "a2_scale", (rows, *scale.shape[1:]), scale.dtype, device)
    return QTensor(data, (rows, cols), scale=scale)


@dataclass(frozen=True)
class _Plan:
    """How one call of a given pair count runs: GEMM1's config as launched (BN halved under a
    fused gated activation), GEMM2's, GEMM1's activation epilogue (None: unfused), and whether
    GEMM2 quantizes a2 as it loads it (``a2_on_load``, module docstring)."""

    lc1: LaunchConfig
    lc2: LaunchConfig
    act: ActEpilogue | None = None
    a2_on_load: bool = False
    dequant: bool = False  # 4-bit weights written out in the model dtype for the bf16 GEMMs (``_dequant_w4``)

    @property
    def same_blocks(self) -> bool:
        return self.lc1.block_m == self.lc2.block_m


def _amax_subtile(cfg: LaunchConfig) -> LaunchConfig:
    """GEMM1's config when its epilogue also raises the abs-max (``track_amax``): the persistent
    kernel's 128 x >= 128 tiles take their epilogue in two column pieces. The tables were tuned
    with the plain epilogue, and the abs-max's extra live registers spill there (sm_90 compiles,
    ``tests/kernels/sm90_compile.py``, fp8, 8 warps): gpt-oss-20b's interleaved 128 x 128 (x 2 W
    rows) tile 232 -> 496 bytes in one piece, 48 in two; the split 128 x 128 silu tile 0 -> 16;
    BM 64 tiles none either way. Measured on an H200 (layer, fp8 per-tensor, two pieces against
    one): gpt-oss T = 4096 / 16384 1.270 -> 1.123 / 4.233 -> 3.855 ms (128 x 256 tables), but
    T = 1024 (64 x 256) 0.455 -> 0.480, hence BM 128 only."""
    if cfg.persistent and cfg.epilogue_subtile == 1 and cfg.block_m >= 128 and cfg.block_n >= 128:
        return replace(cfg, epilogue_subtile=2)
    return cfg


_PLANS_KEPT = 64  # distinct pair counts planned per experts instance (prefill lengths vary)

# GEMM2 quantizing a2 on load adds work to each K step of each program; it saves a launch. Measured
# on an H200 at T = 1 (fp8 per tensor, layer under CUDA graphs, against the codes pass): Qwen3-30B-A3B
# (8 pairs x 32 column tiles x 6 K steps over 132 SMs: 12 steps an SM) 34.6 -> 33.8 us, gpt-oss-20b
# (31) 60.1 -> 59.6, DeepSeek-V3 (109) 116.2 -> 117.0, Mixtral (109) 125.3 -> 129.2. Per 1 x 128
# groups it lost everywhere (the row abs-max per K step: Mixtral 130.7 -> 187.5 us), so not by default.
_ON_LOAD_STEPS_PER_SM = 32
# Pair blocks beyond T = 1 (``pair_blocked``), measured on an H200 (layer, CUDA graphs, against
# aligned blocks): at T = 2, 16 pairs, Qwen3-30B-A3B's 128 experts bf16 64.8 -> 58.8 us, fp8 per
# tensor 52.7 -> 45.3; DeepSeek-V3's 256 bf16 345.9 -> 341.9, fp8 211.4 -> 201.7. At T = 4 (32 pairs)
# DeepSeek-V3 lost (bf16 598.9 -> 648.3, fp8 330.6 -> 358.0: an expert of 88 MB read twice costs more
# than the launch), hence both bounds.
_PAIR_BLOCK_PAIRS = 16
_EXPERTS_PER_PAIR = 8
_SMS_UNKNOWN = 132  # the interpreter, or a platform without its SM count


class _TritonBase(Experts):
    # Deterministic mode: launch configs chosen without looking at the token count
    # (see the module docstring). MoEKernel(deterministic=...) sets it too.
    deterministic: bool = False
    # GEMM1 applies the activation in its epilogue where the scheme allows (module docstring).
    fuse_act: bool = True

    def __init__(self, config, scheme) -> None:
        super().__init__(config, scheme)
        self.deterministic = env.deterministic()
        self.fuse_act = env.fuse_act()
        # the epilogue quantizes a2 where its scale is known up front; a per-tensor dynamic a2 is
        # quantized after it (module docstring); per-row dynamic scales: no epilogue
        self._epilogue = None
        if ActEpilogue.supports(scheme.a2):
            self._epilogue = ActEpilogue.of(config, scheme.a2)
        elif _tensor_dynamic(scheme.a2):  # act(h) in the model dtype, its abs-max raised by the epilogue
            self._epilogue = replace(ActEpilogue.of(config, None), track_amax=True)
        self._plans: dict[tuple, _Plan] = {}
        # 4-bit weights the w4 kernel runs (converted by prepare_weights); None: why not
        why = w4_supports(scheme.w1, scheme.a1, config.dtype) or w4_supports(scheme.w2, scheme.a2, config.dtype)
        self._w4 = why is None
        # GEMM2 quantizes a2 in its loads: None, where the measured rule says (``_a2_on_load``), or
        # in every call of at most this many pairs that can (0: never)
        self.quant_on_load: int | None = env.quant_on_load()
        # 4-bit weights written out in the model dtype for the bf16 GEMMs: None, where the measured
        # rule says (``_dequant_w4``), or from this many rows per expert (0: never)
        self.w4_dequant: int | None = env.w4_dequant()
        fmt2 = GemmFormat.of(scheme.w2, scheme.a2, config.hidden_size, config.intermediate_size)
        self._a2_loadable = self.layout is TokenLayout.STANDARD and on_load_why(scheme.a2) is None and fmt2.native

    def prepare_weights(self, weights):
        """4-bit weights into the w4 layout (once), where the w4 kernel runs them; else as given."""
        if not self._w4 or weights.layout != "reference":
            return weights
        sch = self.scheme
        if convertible(sch.w1, weights.w13) or convertible(sch.w2, weights.w2):
            return weights  # e.g. groups that are not a power of 2: the reference kernel runs them
        return to_w4_weights(weights, sch)

    def restore_weights(self, weights):
        return from_w4_weights(weights) if is_w4(weights.w13) else weights

    def _plan(self, rows: int, e_l: int, w13, w2, by_pair: bool = False) -> _Plan:
        """The launch configs of a call of ``rows`` pairs (or batched rows), worked out once
        (``by_pair``: its GEMM blocks are pairs, ``pair_blocks``)."""
        w4 = is_w4(w13)
        key = (rows, e_l, w4, self.deterministic, self.fuse_act, self.quant_on_load, by_pair, self.w4_dequant)
        plan = self._plans.get(key)
        if plan is None:
            cfg, sch = self.config, self.scheme
            h, i, n1 = cfg.hidden_size, cfg.intermediate_size, cfg.w13_rows
            on_load = False
            dequant = w4 and self._dequant_w4(rows, e_l, w13.w_fmt)
            if w4 and not dequant:
                ep, det = self.act_epilogue(), self.deterministic
                gated = ep is not None and ep.activation.is_gated
                lc1 = w4_launch_config(rows, e_l, n1, h, w13, gated=gated, deterministic=det)
                lc2 = w4_launch_config(rows, e_l, h, i, w2, deterministic=det)
            else:  # dequant: the bf16 GEMMs' tables (w4a16: a1 and a2 are None too)
                lc1 = self._launch_config(rows, e_l, n1, h, None if dequant else sch.w1, sch.a1)
                lc2 = self._launch_config(rows, e_l, h, i, None if dequant else sch.w2, sch.a2)
                if self.layout is TokenLayout.STANDARD:  # aligned once, with GEMM1's BM: GEMM2 is tuned under it
                    lc2 = replace(lc2, block_m=lc1.block_m)
                on_load = self._a2_on_load(rows, lc2, by_pair)
                ep = self._on_load_epilogue() if on_load else self.act_epilogue()
            if ep is not None and ep.track_amax and by_pair:  # no zeroed buffer: no memset launch
                ep = replace(ep, amax_slots=True)
            lc1 = gated_act_config(lc1) if ep is not None and ep.activation.is_gated else lc1
            lc1 = _amax_subtile(lc1) if ep is not None and ep.track_amax else lc1
            plan = _Plan(lc1, lc2, ep, on_load, dequant)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _dequant_w4(self, rows: int, e_l: int, w_fmt: str) -> bool:
        """Whether a call of ``rows`` pairs (or batched rows) over ``e_l`` local experts writes its
        4-bit weights out in the model dtype and runs the bf16 GEMMs (``kernels.w4_dequant``): from
        ``w4_dequant`` rows per expert, or by default from the measured threshold of the GPU and
        format (``thresholds.w4_dequant_from``); never in deterministic mode (the GEMMs would then
        depend on the batch size) or where the buffer would pass ``W4_DEQUANT_MAX_BYTES``. Rows per
        expert: the pairs over all E experts (standard layout: with an expert map the pairs of
        every rank's experts arrive, T*K/E of them each), or the batched slab's rows."""
        if self.deterministic or e_l == 0:
            return False
        start = w4_dequant_from(current_platform(), w_fmt, self.w4_dequant)
        experts = e_l if self.layout is TokenLayout.BATCHED else self.config.num_experts
        if not start or rows < start * experts:
            return False
        return self._dequant_numel(e_l) * self.config.dtype.itemsize <= W4_DEQUANT_MAX_BYTES

    def _dequant_numel(self, e_l: int) -> int:
        """Values of the buffer both GEMMs' weights are written out into, one after the other."""
        c = self.config
        return e_l * max(c.w13_rows * c.hidden_size, c.hidden_size * c.intermediate_size)

    def _weight(self, plan: _Plan, weights, which: str, workspace, dev) -> Operand:
        """GEMM1's ("w13") or GEMM2's ("w2") weight operand: as stored, or under ``plan.dequant``
        written out into the workspace's "w_deq" (GEMM2's overwrites GEMM1's, which the stream
        order keeps after GEMM1)."""
        w = getattr(weights, which)
        if not plan.dequant:
            return Operand(w, self.scheme.w1 if which == "w13" else self.scheme.w2)
        buf = take(workspace, "w_deq", tuple(w.shape), self.config.dtype, dev)
        # NVFP4's global scale stays out of the written values (exact in bf16) and goes to the
        # GEMM's fp32 accumulator, as in the 4-bit GEMM: one rounding fewer a weight
        data = dequantize_w4(w, self.config.dtype, out=buf, global_scale=False)
        return Operand.of(QTensor(data, tuple(w.shape), global_scale=w.global_scale))

    def _a2_on_load(self, rows: int, lc2: LaunchConfig, by_pair: bool) -> bool:
        """Whether GEMM2 quantizes a2 as it loads it in a call of ``rows`` pairs (module docstring).
        It can for a dynamic per-tensor or 1 x g group fp8/int8 a2 with its own weights, the
        activation fused, a group GEMM2's tuned BK (a tile holds one group), not in deterministic
        mode (the path would then depend on the batch size). It does where ``quant_on_load`` says
        (up to that many pairs) or, by default, where measured to pay: a per-tensor a2 at pair
        blocks, with at most ``_ON_LOAD_STEPS_PER_SM`` of GEMM2's K steps per SM."""
        if not (self._a2_loadable and self.fuse_act) or self.deterministic:
            return False
        tq = self.scheme.a2
        if tq.granularity.kind == "group" and lc2.block_k != tq.granularity.group_size:
            return False
        if self.quant_on_load is not None:
            return rows <= self.quant_on_load
        if not (by_pair and tq.granularity.kind == "tensor"):
            return False
        c = self.config
        steps = rows * cdiv(c.hidden_size, lc2.block_n) * cdiv(c.intermediate_size, lc2.block_k)
        return steps <= _ON_LOAD_STEPS_PER_SM * (current_platform().sm_count or _SMS_UNKNOWN)

    def _on_load_epilogue(self) -> ActEpilogue:
        """GEMM1's epilogue when GEMM2 quantizes a2 on load: act(h) in the model dtype, its
        abs-max tracked for a per-tensor scale."""
        return replace(ActEpilogue.of(self.config, None), track_amax=_tensor_dynamic(self.scheme.a2))

    def _amax_buffer(self, ep: ActEpilogue, routing, lc1: LaunchConfig, workspace, dev) -> torch.Tensor:
        """Where GEMM1's epilogue leaves a2's abs-max: one int32 slot per program (pair blocks,
        ``ActEpilogue.amax_slots``), else the fp32 [1] it raises, zeroed here."""
        if ep.amax_slots:
            slots = amax_slot_count(routing.block_expert.numel(), self.config.intermediate_size, lc1.block_n)
            return take(workspace, "a2_amax_slots", (slots,), torch.int32, dev)
        return take(workspace, "a2_amax", (1,), torch.float32, dev).zero_()

    def act_epilogue(self) -> ActEpilogue | None:
        """GEMM1's fused activation, or None: GEMM1 writes h and act_and_quantize follows."""
        return self._epilogue if self.fuse_act else None

    @classmethod
    def extra_checks(cls, config, scheme, platform):
        if platform.kind == "cuda" and _needs_native_fp8(scheme) and not platform.has_fp8:
            return f"fp8 activations need fp8 tensor cores (sm89+), platform is {platform.label}"
        return None

    def _launch_config(self, rows: int, e_l: int, n: int, k: int, w_quant, a_quant):
        return pick_launch_config(rows, e_l, n, k, scheme_key(w_quant, a_quant), deterministic=self.deterministic)

    def _gemm1_act(
        self, a, weights, w13: Operand, ep: ActEpilogue, rows: int, workspace, gemm, local_pairs=None, on_load=False,
        **kw,
    ) -> tuple[QTensor, torch.Tensor | None]:  # fmt: skip
        """(a2 [rows, I], its abs-max or None) from GEMM1 with the activation in its epilogue
        (``gemm`` is the standard or batched op). a2 is quantized there; or, for a per-tensor
        dynamic a2, by one pass of ``quantize_activations`` after it over the abs-max the
        epilogue raised (``track_amax``); or, ``on_load``, left as act(h) in the model dtype for
        a GEMM2 that quantizes it as it loads it (with that abs-max, per tensor).
        ``local_pairs`` (with an expert map): the rows the pass needs, the others being another
        rank's (up to (EP - 1) / EP of them); rows GEMM1 leaves unwritten are otherwise quantized
        into codes GEMM2 never reads."""
        cfg, sch = self.config, self.scheme
        i, dev = cfg.intermediate_size, a.data.device
        if ep.track_amax or on_load:  # act(h) in the model dtype; only the rows GEMM1 writes reach its abs-max
            data = take(workspace, "h_act", (rows, i), cfg.dtype, dev)
            scale = self._amax_buffer(ep, kw.get("routing"), kw["config"], workspace, dev) if ep.track_amax else None
        else:
            data = take(workspace, "a2", (rows, i), ep.out_dtype(cfg.dtype), dev)
            scale = weights.act_scales("a2", sch.a2).get("scale") if ep.quant is not None else None
        out = data if a.data.dim() == 2 else data.view(*a.data.shape[:2], i)  # batched: [E_l, M, I]
        gemm(Operand(a, sch.a1), w13, bias=weights.b13, out=out, act=ep, act_scale=scale, **kw)
        if on_load:
            return QTensor(data, (rows, i)), scale
        if ep.track_amax:
            a2_out = _a2_out(workspace, sch.a2, rows, i, dev)
            row_mask = None if local_pairs is None else local_pairs()
            a2_scales = weights.act_scales("a2", sch.a2)
            return quantize_activations(data, sch.a2, out=a2_out, row_mask=row_mask, amax=scale, **a2_scales), None
        return QTensor(data, (rows, i), scale=None if scale is None else scale.reshape(1, 1).float()), None

    def _workspace(self, rows: int, e_l: int | None = None) -> Workspace:
        c, ep = self.config, self.act_epilogue()
        i = c.intermediate_size
        shapes = {}
        if ep is None:
            shapes["h"] = ((rows, c.w13_rows), c.dtype)
        elif ep.track_amax:  # act(h), quantized after GEMM1 (per tensor), and its abs-max
            shapes["h_act"] = ((rows, i), c.dtype)
            shapes["a2_amax"] = ((1,), torch.float32)
        shapes.update(quantized_layout("a2", self.scheme.a2, rows, i, c.dtype))
        on_load = 0  # act(h) rows GEMM2 may quantize on load: the forced limit's, else pair blocks' (the rule's)
        if self._a2_loadable and self.fuse_act:
            limit = self.quant_on_load
            if limit is None:
                limit = self._pair_block_pairs(rows, e_l) if _tensor_dynamic(self.scheme.a2) else 0
            on_load = min(rows, limit)
        if on_load:  # act(h) for GEMM2 to quantize (and its abs-max)
            shapes.setdefault("h_act", ((on_load, i), c.dtype))
            if _tensor_dynamic(self.scheme.a2):
                shapes["a2_amax"] = ((1,), torch.float32)
        if self._w4 and e_l and self._dequant_w4(rows, e_l, W4_FORMATS[self.scheme.w1.dtype]):
            shapes["w_deq"] = ((self._dequant_numel(e_l),), c.dtype)  # both GEMMs' weights, one after the other
        if "a2_amax" in shapes and self.layout is TokenLayout.STANDARD:
            # pair blocks: one slot per GEMM1 program, >= 16 columns a tile
            shapes["a2_amax_slots"] = ((self._pair_block_pairs(rows, e_l) * cdiv(i, 16),), torch.int32)
        return Workspace(shapes)


class TritonExperts(_TritonBase):
    name = "triton"
    layout = TokenLayout.STANDARD
    batched_twin = "triton_batched"
    capabilities = _caps(TokenLayout.STANDARD, "fused grouped-GEMM Triton kernels, every scheme", "triton")
    # Calls that skip moe_align (no expert map): one GEMM block per pair, in pair order
    # (``kernels.align.pair_blocks``). None: ``pair_blocked``'s rule; a number: calls of at most
    # that many tokens (0 aligns always).
    pair_blocks_tokens: int | None = None

    @staticmethod
    def pair_blocked(t: int, k: int, e_l: int, limit: int | None = None) -> bool:
        """Whether a call of ``t`` tokens over ``e_l`` local experts takes pair blocks: up to
        ``limit`` tokens, or by default at T = 1 (the token's K experts are distinct, so sorting
        saves no weight read and costs a launch, module docstring) and at up to
        ``_PAIR_BLOCK_PAIRS`` pairs that are at most 1/8 of the experts (then ~P / 2E of them
        share an expert with another: a weight read twice, against ``moe_align``'s launch)."""
        if limit is not None:
            return t <= limit
        return t == 1 or t * k <= min(_PAIR_BLOCK_PAIRS, e_l // _EXPERTS_PER_PAIR)

    def _pair_block_pairs(self, rows: int, e_l: int | None) -> int:
        """The most pairs a call of at most ``rows`` pairs takes as pair blocks (workspace sizes)."""
        k, limit = self.config.top_k, self.pair_blocks_tokens
        if limit is not None:
            return min(rows, limit * k)
        most = min(_PAIR_BLOCK_PAIRS, (e_l or self.config.num_experts) // _EXPERTS_PER_PAIR)
        return min(rows, max(k, most // k * k))

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        pairs = num_tokens * self.config.top_k
        ws = self._workspace(pairs, num_local_experts)
        ws.shapes["y"] = ((pairs, self.config.hidden_size), self.config.dtype)
        return ws

    def apply(self, a, topk, weights, out, *, expert_map=None, workspace=None):
        cfg, sch = self.config, self.scheme
        t, k = topk.ids.shape
        if t == 0:
            return
        dev = a.data.device
        e_l = weights.num_experts
        pairs = t * k
        by_pair = expert_map is None and self.pair_blocked(t, k, e_l, self.pair_blocks_tokens)
        plan = self._plan(pairs, e_l, weights.w13, weights.w2, by_pair)
        # the kernels read int32 or int64 ids (transformers' routers give int64) without a
        # conversion launch, which would also keep the call from being replayed (``modular.replay``)
        n_ids = e_l if expert_map is None else expert_map.shape[0]
        ids = topk.ids if topk.ids.dtype in ID_DTYPES else int32_ids(topk.ids, n_ids)
        routing = pair_blocks(ids, plan.lc1.block_m) if by_pair else moe_align(ids, e_l, plan.lc1.block_m, expert_map)
        ep = plan.act
        local_pairs = partial(_local_pairs, ids, e_l, expert_map)
        a2_amax = None  # GEMM2 quantizing act(h) as it loads it (``a2_on_load``): its abs-max, per tensor
        if ep is not None:
            kw = dict(routing=routing, a_div=k, config=plan.lc1, on_load=plan.a2_on_load)
            mask = None if expert_map is None else local_pairs
            w13 = self._weight(plan, weights, "w13", workspace, dev)
            a2, a2_amax = self._gemm1_act(a, weights, w13, ep, pairs, workspace, grouped_gemm, mask, **kw)
        else:
            h = take(workspace, "h", (pairs, cfg.w13_rows), cfg.dtype, dev)
            row_mask = _unwritten_rows(h, sch.a2, local_pairs)
            w13 = self._weight(plan, weights, "w13", workspace, dev)
            grouped_gemm(Operand(a, sch.a1), w13, routing, bias=weights.b13, a_div=k, out=h, config=plan.lc1)
            a2_out = _a2_out(workspace, sch.a2, pairs, cfg.intermediate_size, dev)
            act_scales = weights.act_scales("a2", sch.a2)
            a2 = act_and_quantize(h, cfg, sch.a2, out=a2_out, row_mask=row_mask, **act_scales)
            a2 = a2 if isinstance(a2, QTensor) else QTensor(a2, tuple(a2.shape))
        if not plan.same_blocks:  # the w4 kernel's prefill: GEMM2 takes a larger BM than GEMM1
            bm = plan.lc2.block_m
            routing = pair_blocks(ids, bm) if by_pair else moe_align(ids, e_l, bm, expert_map)
        y = take(workspace, "y", (pairs, cfg.hidden_size), cfg.dtype, dev)
        load_q = sch.a2 if plan.a2_on_load else None  # a2 quantized by GEMM2 itself, else as stored
        a2, w2 = Operand(a2, None if load_q else sch.a2), self._weight(plan, weights, "w2", workspace, dev)
        route_w = None if cfg.apply_router_weight_on_input else topk.weights
        if plan.lc2.split_k > 1:
            # split-K partials [S, T*K, H] (router weight applied): moe_sum adds them up with the top-k sum
            fmt = GemmFormat.of(sch.w2, sch.a2, cfg.hidden_size, cfg.intermediate_size)
            call = GemmCall(routing, bias=weights.b2, route_weights=route_w)
            p = w4_gemm_launch(a2, w2, y, fmt, plan.lc2, call, reduce=False)
            y = y if p is None else p
        else:
            grouped_gemm(a2, w2, routing, bias=weights.b2, topk_weights=route_w, out=y, config=plan.lc2,
                         quantize_a=load_q, a_amax=a2_amax)  # fmt: skip
        moe_sum(y.view(*y.shape[:-2], t, k, -1), out, topk_ids=ids, expert_map=expert_map, num_local_experts=e_l)


class TritonBatchedExperts(_TritonBase):
    name = "triton_batched"
    layout = TokenLayout.BATCHED
    reduce = WeightedReduce.WEIGHT_AND_SUM
    capabilities = _caps(
        TokenLayout.BATCHED,
        "Triton grouped GEMMs on the batched layout (counts read on the device)",
        "triton (batched)",
    )

    def workspace(self, num_tokens: int, num_local_experts: int) -> Workspace:
        """Buffers for ``num_tokens`` rows per expert (M of the batched layout)."""
        return self._workspace(num_local_experts * num_tokens, num_local_experts)

    def apply_batched(self, a, counts, weights, out, *, workspace=None):
        cfg, sch = self.config, self.scheme
        e_l, m = a.shape[0], a.shape[1]
        dev = a.data.device
        rows = e_l * m
        plan = self._plan(rows, e_l, weights.w13, weights.w2)
        ep = self.act_epilogue()
        if ep is not None:
            kw = dict(counts=counts, config=plan.lc1)
            w13 = self._weight(plan, weights, "w13", workspace, dev)
            a2, _ = self._gemm1_act(a, weights, w13, ep, rows, workspace, grouped_gemm_batched, **kw)
        else:
            h = take(workspace, "h", (rows, cfg.w13_rows), cfg.dtype, dev).zero_()
            w13 = self._weight(plan, weights, "w13", workspace, dev)
            h3 = h.view(e_l, m, -1)
            grouped_gemm_batched(Operand(a, sch.a1), w13, counts, bias=weights.b13, out=h3, config=plan.lc1)
            a2_out = _a2_out(workspace, sch.a2, rows, cfg.intermediate_size, dev)
            a2 = act_and_quantize(h, cfg, sch.a2, out=a2_out, **weights.act_scales("a2", sch.a2))
        i = cfg.intermediate_size
        if isinstance(a2, QTensor):
            row_scale = a2.scale is not None and a2.scale.shape[0] == rows
            scale = a2.scale.view(e_l, m, -1) if row_scale else a2.scale
            a2 = QTensor(a2.data.view(e_l, m, -1), (e_l, m, i), scale=scale, global_scale=a2.global_scale)
        else:
            a2 = QTensor(a2.view(e_l, m, -1), (e_l, m, i))
        grouped_gemm_batched(
            Operand(a2, sch.a2),
            self._weight(plan, weights, "w2", workspace, dev),
            counts,
            bias=weights.b2,
            out=out,
            config=plan.lc2,
        )
