"""The grouped GEMM for 4-bit weights (int4, MXFP4, NVFP4) with float activations: ``w4_gemm_launch``.

Same contract as ``grouped_gemm.grouped_gemm_launch`` (standard layout with ``routing``,
batched with ``counts``; bias, fused activation, router weight, static output quantization),
for weights converted once at load time to the w4 layout (``quant.w4_layout.to_w4``): K packed
in blocks so one byte tile splits into two dot operands without a shuffle, act-order columns
sorted by group. ``grouped_gemm_launch`` forwards such weights here, so the public
``grouped_gemm`` / ``grouped_gemm_batched`` take them as they are.

What the launch config selects (``LaunchConfig``; ``fit_w4_config`` adapts any config):

    block_m >= 16, w_major 1   C^T = W @ A^T on the tensor cores, W fed from registers ("swap")
    block_m >= 16, w_major 0   C = A @ W^T, as the reference kernel multiplies ("dot")
    block_m 1, w_major 1       fp32 FMA with [BN, BK] partial sums, reduced after the loop ("fma1")
    block_m 1..8 otherwise     fp32 FMA, one reduction per K step and row ("fma")
    split_k S > 1              S programs per output tile along K, fp32 partials P [S, rows, N]

Act-order weights (columns sorted by group at conversion, ``W4Tensor.perm``): the FMA path
gathers A's columns through the permutation in its loads; the tensor-core path first writes A
permuted per expert (one extra launch, a [slots, Kp] copy), because the gathered loads were
6.5x slower there (Qwen3 int4 GEMM1 at T = 4096: 4.10 ms against 0.63 ms without act-order;
with the permuted copy 1.02 ms, GEMM2 0.59 vs 0.43 ms).

Split-K needs somewhere for the partials: ``partials`` (workspace, fp32, at least
``partials_numel`` elements) or a new tensor. With ``reduce=True`` (default) a second launch
sums them in split order and finishes the epilogue (activation, router weight, quantized
store) into ``c``; with ``reduce=False`` (no activation) the partials are the result, already
multiplied by the router weight, and ``moe_sum`` sums them with the top-k sum (GEMM2 of the
standard layout: no launch of its own).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton.language as tl

from .. import env
from ..errors import expect
from ..quant import Operand, TensorQuant
from ..quant.w4_layout import W4_DTYPES, W4Tensor, convertible, is_w4
from ._common import cdiv, interpreting, next_power_of_2
from ._grouped_gemm_w4 import _w4_gemm_kernel, _w4_permute_a_kernel, _w4_reduce_kernel
from .gemm_format import (
    _TL_DTYPE,
    GemmCall,
    GemmFormat,
    _strides,
    _u8,
    epilogue_scale,
    out_quant,
    per_expert_scale,
)
from .launch import launch
from .launch_config import LaunchConfig, pick_launch_config

_REDUCE_BN = 128  # columns per program of the split-K reduce (fp32 loads of 512 B per row)


def supports(w_quant: TensorQuant | None, a_quant: TensorQuant | None, dtype: torch.dtype) -> str | None:
    """None if this kernel runs weights ``w_quant`` (once converted) with activations ``a_quant``
    in ``dtype``; else why not (the reference kernel then keeps them in the reference layout)."""
    if a_quant is not None:
        return f"w4 kernel takes float activations, not {a_quant.dtype.value}"
    if dtype not in _TL_DTYPE:
        return f"w4 kernel takes bf16/fp16/fp32 activations, not {dtype}"
    return convertible(w_quant)


def fit_w4_config(cfg: LaunchConfig, w: W4Tensor) -> LaunchConfig:
    """``cfg`` made valid for ``w``: BK a multiple of the layout's pack block (and no more K than
    the weight has; the FMA path steps one or two pack blocks at a time, ``_w4_gemm_kernel``), w_major
    only where it means something (BM >= 16 or BM = 1), scale_loads on tensor-core tiles only, and
    splits that each get K steps (the kernel assumes its K range is not empty)."""
    kp, pk = w.k_padded, w.pack_block
    if cfg.block_m < 16:  # the FMA path steps one or two pack blocks at a time
        bk = 2 * pk if cfg.block_k >= 2 * pk and kp >= 2 * pk else pk
    else:
        bk = min(max(cfg.block_k, pk), max(pk, next_power_of_2(kp)))
    w_major = cfg.w_major if (cfg.block_m >= 16 or cfg.block_m == 1) else 0
    steps = max(1, cdiv(kp, bk))
    split = max(1, min(cfg.split_k, steps))
    split = cdiv(steps, cdiv(steps, split))  # no split left without K: the kernel assumes one
    loads = cfg.scale_loads if cfg.block_m >= 16 else 0  # the FMA path loads its own step ahead
    if (bk, w_major, split, loads) == (cfg.block_k, cfg.w_major, cfg.split_k, cfg.scale_loads):
        return cfg
    return LaunchConfig(
        cfg.block_m, cfg.block_n, bk, cfg.group_m, cfg.num_warps, cfg.num_stages, split, w_major, scale_loads=loads
    )


def _mode(cfg: LaunchConfig) -> str:
    if cfg.block_m >= 16:
        return "swap" if cfg.w_major else "dot"
    return "fma1" if cfg.block_m == 1 and cfg.w_major else "fma"


def w4_scheme_key(w: W4Tensor) -> str:
    """The tuned-config folder of w4 GEMMs on ``w``'s format: 'int4_g128_w4', 'mxfp4_g32_w4',
    'nvfp4_g16_w4'. The group sets the pack block and the scale loads (int4 comes in groups of
    32-128), so it is part of the key; zero points and act-order share their plain format's tables."""
    return f"{w.w_fmt}_g{w.group_size}_w4"


def w4_launch_config(
    m_pairs: int, num_experts: int, n: int, k: int, w: W4Tensor, *, gated: bool = False, deterministic: bool = False
) -> LaunchConfig:
    """The config for a w4 GEMM of ``m_pairs`` routed rows over ``num_experts`` experts of W [N, K]
    (``gated``: GEMM1 with a fused gated activation; the caller still halves BN for it with
    ``gated_act_config``, as for the reference kernel).

    As for every GEMM (``pick_launch_config``): a scoped ``override_launch_config`` or
    ``FUSEDMOE_LAUNCH_CONFIG``, else this GPU's tuned entry (``w4_scheme_key``; ``fusedmoe tune``
    tunes GEMM1 as the layer launches it, with the fused activation and BN halved), else
    ``default_w4_config``. ``deterministic``: plan as if every expert had 64 rows, and never
    split K (split-K sums partials in a different order than the unsplit loop).
    """

    def default(m, e, n_, k_):
        return default_w4_config(m, e, n_, k_, gated, w.w_fmt)

    cfg = pick_launch_config(m_pairs, num_experts, n, k, w4_scheme_key(w), deterministic=deterministic, default=default)
    if deterministic and cfg.split_k > 1:
        cfg = replace(cfg, split_k=1)
    return fit_w4_config(cfg, w)


def default_w4_config(
    m_pairs: int, num_experts: int, n: int, k: int, gated: bool = False, w_fmt: str = "int4"
) -> LaunchConfig:
    """The w4 config measured best on an H100 (``scripts/kbench_w4.py``; Mixtral-8x7B, Qwen3-30B-A3B,
    gpt-oss-20b at T 1..4096, ``benchmarks/results/kbench_w4_h100_2026-11-25.md``). BN counts W's
    rows: a fused gated GEMM1 reads two per output column, and the layer halves BN for it
    (``gated_act_config``), so GEMM1's numbers below are twice its output columns.

    * <= 0.5 rows per expert (decode): BM 1, FMA with [BN, PK/2] partial sums ("fma1"), 32 W rows
      per program (16 were within 5% of 64 W rows on the tensor cores for Mixtral's GEMM1, and
      best for Qwen3's). Split-K while the output tiles give fewer than ~8 programs per SM and
      each split keeps >= 4 K steps of 256: Mixtral's GEMM2 (N 4096, K 14336, 256 tiles) took 92
      us unsplit and 66-70 us with 2-4 splits, gpt-oss's (N 2880, 4 experts) 39 vs 30 us with 2;
      Qwen3's (K 768) was best unsplit. A gated GEMM1 is not split (that needs a reduce launch,
      and the presets have >= 384 tiles there).
    * <= 16 rows, int4: BM 16 W-major ("swap"), 128 W rows under a gated GEMM1, else 64 (paired
      PTX unpack, ``scripts/kbench_w4.py`` 2026-11-25 third run: Qwen3 GEMM1 at T = 256 142 us
      vs 204 for C-major BM 32; Mixtral GEMM1 at T = 64 369 vs 513; Qwen3 GEMM2 at T = 16-256
      52-95 vs 56-104 with 128 W rows).
    * <= 8 rows, e2m1: BM 16 C-major ("dot"), 64 W rows (Mixtral T = 16 GEMM1 MXFP4 dot 449 us vs
      swap 547, portable unpack; with the PTX unpack dot 405 vs swap 489).
    * <= 16 rows, e2m1: C-major BM 32, GEMM1 128 and GEMM2 64 W rows (Mixtral MXFP4 T = 64 GEMM1:
      512 us against 1584 us with 64 W rows).
    * <= 160 rows: W-major BM 64 x 128 W rows (int4 GEMM2 at <= 64 rows: BM 32 x 64 W rows, Mixtral
      T = 256 385 us vs 555; e2m1 keeps BM 64 x 128: Qwen3 MXFP4 T = 1024 188 vs 227 us, Mixtral
      T = 256 578 vs 645).
    * prefill: GEMM1 W-major BM 128 x 128 W rows with 4 warps (5.28 ms at Mixtral int4 T = 4096;
      14.8 ms with 8 warps: each dot's M is its 64 W rows, one warpgroup); GEMM2 BM 256 x 128 W
      rows, 8 warps (2.44 ms vs 3.18 at BM 128). GEMM1 and GEMM2 then want different BM: the
      layer aligns twice for prefill.
    """
    rows = m_pairs / max(1, num_experts)
    if rows <= 0.5:
        tiles = min(m_pairs, num_experts) * cdiv(n, 32)
        split = 1
        while not gated and tiles * split < 1024 and k // (256 * split * 2) >= 4:
            split *= 2
        return LaunchConfig(1, 32, 256, 1, 4, 4, split_k=split, w_major=1)
    if rows <= 16 and w_fmt == "int4":
        return LaunchConfig(16, 128 if gated else 64, 128, 1, 4, 4, w_major=1)
    if rows <= 8:
        return LaunchConfig(16, 64, 128, 1, 4, 4)
    if rows <= 16:
        return LaunchConfig(32, 128 if gated else 64, 128, 1, 4, 4)
    if rows <= 160:
        if not gated and rows <= 64 and w_fmt == "int4":
            return LaunchConfig(32, 64, 128, 4, 4, 4, w_major=1)
        return LaunchConfig(64, 128, 128, 8, 4 if gated else 8, 3, w_major=1)
    if gated:
        return LaunchConfig(128, 128, 128, 8, 4, 3, w_major=1)
    return LaunchConfig(256, 128, 128, 8, 8, 3, w_major=1)


def partials_numel(cfg: LaunchConfig, rows: int, n_w: int) -> int:
    """fp32 elements of split-K partials for ``rows`` rows (T*K pairs, or E_l * M_max) of a W
    with ``n_w`` rows; 0 without split-K."""
    return 0 if cfg.split_k == 1 else cfg.split_k * rows * n_w


def w4_gemm_launch(
    a: Operand,
    w: Operand,
    c: torch.Tensor,
    fmt: GemmFormat,
    cfg: LaunchConfig,
    call: GemmCall,
    *,
    partials: torch.Tensor | None = None,
    reduce: bool = True,
) -> torch.Tensor | None:
    """Launch into ``c`` (module docstring). Returns the split-K partials viewed as [S, *C rows,
    N_w], or None without split-K (``fit_w4_config`` may lower ``cfg.split_k`` to K's steps, to 1
    included: then ``c`` holds the result). With ``reduce=False`` and partials returned, they
    are the result and ``c`` is left as it was."""
    routing, counts, a_div, bias, route_weights, act, act_scale = call.unpacked()
    a_scale, a_global_scale = a.scale, a.global_scale
    a, w = a.data, w.q
    expect(is_w4(w), "w", "a weight in the w4 layout (quant.w4_layout.to_w4)", type(w).__name__)
    expect(fmt.a_fmt == "float" and a_scale is None and a_global_scale is None, "a", "float activations", fmt)
    expect(reduce or act is None, "reduce", "True with a fused activation (it needs the summed tile)", reduce)
    # its activations are never quantized, so nothing asks it for a2's abs-max (experts.triton)
    expect(act is None or not act.track_amax, "act.track_amax", "False for the 4-bit kernel", True)
    expect(w.k_padded > 0, "w", "a weight with K > 0 (the kernel walks at least one K step)", tuple(w.shape))
    cfg = fit_w4_config(cfg, w)
    rows = _Rows.of(a, w, cfg, routing, counts, a_div)
    e_l, n_w, kd = w.shape
    n = n_w if act is None else act.out_cols(n_w)
    p = None
    if cfg.split_k > 1:
        numel = cfg.split_k * n_w * rows.total
        if partials is None:
            partials = torch.empty(numel, dtype=torch.float32, device=a.device)
        expect(partials.dtype == torch.float32 and partials.numel() >= numel, "partials", f">= {numel} fp32", partials)
        p = partials.reshape(-1)[:numel].view(cfg.split_k, *rows.c_shape, n_w)
    if rows.num_m_blocks == 0 or n == 0 or (p is None and c.numel() == 0):
        return p
    permuted = w.perm is not None and cfg.block_m >= 16  # act-order on the tensor cores: permute A first
    if permuted:
        a, kd = _permute_a(a, w, rows), w.k_padded
        rows = _Rows.of(a, w, cfg, routing, counts, 1)
    perm = None if permuted else w.perm
    target = p if p is not None else c
    oq = out_quant(act)
    c_scale = epilogue_scale(oq, act_scale)
    rw, rw_str = _route_weights(route_weights, rows.batched)
    rw_in_gemm = rw is not None and (p is None or act is None)
    t_str = ((target.stride(0),) if p is not None else (0,)) + _row_strides(target, rows.batched)
    wg = per_expert_scale(w.global_scale)
    dummy = target
    grid = (rows.num_m_blocks * cdiv(n if p is None else n_w, cfg.block_n), cfg.split_k)
    cat = dot_cat(cfg, w)
    launch(_w4_gemm_kernel, grid,
        a, w.bytes_u8(), _u8(w.scale), dummy if w.zero is None else w.zero, dummy if wg is None else wg,
        dummy if perm is None else perm, dummy if bias is None else bias,
        dummy if rw is None else rw, _u8(target), dummy if c_scale is None else c_scale,
        *rows.ptrs(dummy), n if p is None else n_w, kd, w.k_padded,
        cdiv(cdiv(w.k_padded, cfg.block_k), cfg.split_k) * cfg.block_k,
        *rows.scalars(), 1.702 if act is None else act.swiglu_alpha, 7.0 if act is None else act.swiglu_limit,
        *rows.a_strides, *w.bytes_u8().stride(), *_strides(w.scale, 3),
        *(perm.stride() if perm is not None else (0, 0)), *(bias.stride() if bias is not None else (0, 0)),
        *rw_str, *t_str,
        BATCHED=rows.batched, PAIR_BLOCKS=rows.pair_blocks, W_FMT=w.w_fmt, GROUP=w.group_size, PK=w.pack_block,
        RUNS=cfg.block_k // w.pack_block if cat else dot_runs(cfg, w), CAT=cat,
        ACT_ORDER=perm is not None, HAS_ZERO=w.zero is not None, HAS_W_GSCALE=wg is not None,
        HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=rw_in_gemm, DOT_DTYPE=_dot_dtype(a),
        ACT="none" if act is None or p is not None else act.activation.value,
        GATED=act is not None and p is None and act.activation.is_gated,
        INTERLEAVED=act is not None and act.gate_up_interleaved,
        OUT_QUANT="none" if p is not None else oq, EXACT_CAST=interpreting(),
        MODE=_mode(cfg), FAST=fast_unpack(cfg, w, a.dtype), SCALE_LOADS=cfg.scale_loads,
        SPLIT_SCALE=w.scale.dtype != a.dtype if w.w_fmt == "int4" else not w.e2m1_one_mul,
        SPLIT_K=cfg.split_k, EVEN_K=kd == w.k_padded and w.k_padded % cfg.block_k == 0,
        A_SLOT=permuted and not rows.batched, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, EVEN_N=even_columns(cfg, w, n if p is None else n_w),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if p is not None and reduce:
        _reduce(p, c, act, oq, c_scale, None if rw_in_gemm else rw, rw_str, rows, n)
    return p


def dot_cat(cfg: LaunchConfig, w: W4Tensor) -> bool:
    """Whether a W-major ("swap") tile makes one dot per K step, its 64-column pack blocks
    unpacked and concatenated in K order, instead of a K = 32 dot per half block: chained inside
    the step, those register-A wgmma are waited for one by one (sm_90 SASS: a wait to zero after
    each), while a step's single dot is split by Triton into K = 16 wgmma left in flight. Only
    at BM 32 (H200, MXFP4, the layer, same tables; PERF_LOG, eighth session): gpt-oss T = 64
    425 -> 323 us and T = 256 609 -> 497 (GEMM1's BM 32 x 128 tile, N 5760, K 2880), the other BM
    32 cells within 1%; at BM 64 one cell gained (gpt-oss GEMM2) and Qwen3's and DeepSeek-V3's
    GEMM2 lost ~3%; at BM 128-256 the whole unpack comes before the dot and its registers stay
    held while it runs (Mixtral T = 4096 7.98 -> 8.40 ms); BM 16 already pairs blocks (``dot_runs``)."""
    small_swap = _mode(cfg) == "swap" and w.half_block < 64 and cfg.block_m == 32
    return small_swap and cfg.block_k % w.pack_block == 0 and cfg.block_k // w.pack_block in (1, 2, 4)


def dot_runs(cfg: LaunchConfig, w: W4Tensor) -> int:
    """Pack blocks per tensor-core dot: 2 for BM 16 tiles where a half block is under 64 columns
    (MXFP4, NVFP4, int4 groups of 16-32: 64-column blocks) and the K step holds two, so each
    dot is K = 64 instead of K = 32 dots that wait for each other. H200, MXFP4, the layer with
    the same tables (PERF_LOG, seventh session): BM 16 cells 1.05-1.35x faster (Mixtral T = 16
    559 -> 506 us, gpt-oss T = 64 437 -> 326, DeepSeek-V3 T = 256 3.51 -> 2.84 ms); with BM 32-256
    mixed, 0.86-1.19x (Mixtral T = 64 0.89x, DeepSeek-V3 T = 1024 0.88x), so they keep one."""
    if cfg.block_m != 16 or w.half_block >= 64 or w.half_block < w.group_size:
        return 1
    return 2 if cfg.block_k % (2 * w.pack_block) == 0 else 1


def even_columns(cfg: LaunchConfig, w: W4Tensor, n: int) -> bool:
    """Whether the kernel drops W's column masks (EVEN_N): BLOCK_N divides the ``n`` columns it
    walks, on the tensor-core tiles of the e2m1 formats. H200, the layer, same tables, against
    the masked loads in one call (PERF_LOG, ninth session): MXFP4 and NVFP4 at T >= 16
    0.97-1.06x, geometric mean 1.007x, the prefill tiles gaining (Mixtral MXFP4 T = 4096 7.93 ->
    7.75 ms, in both calls that ran it) and gpt-oss MXFP4 T = 1024 losing (946 -> 973 us); int4
    g128 lost up to 10% with it (Mixtral T = 16, BM 16: 0.354 -> 0.390 ms) and the FMA path ~9%
    (NVFP4 T = 1: Qwen3 38 -> 42 us), so they keep the masks."""
    return cfg.block_m >= 16 and w.w_fmt != "int4" and n % cfg.block_n == 0


def fast_unpack(cfg: LaunchConfig, w: W4Tensor, dtype: torch.dtype) -> bool:
    """Whether the tensor-core path unpacks W with paired 16-bit PTX (``_w4_unpack``): on a GPU
    (the interpreter runs no PTX), for bf16 activations, and fp16 ones with int4 weights (e2m1
    values times e8m0 scales can leave fp16's range), unless ``FUSEDMOE_W4_PTX`` is off. The
    FMA path (BM < 16) takes fp32 weights: by PTX for e2m1 (exact in bf16, so unchanged), by the
    fp32 decode for int4 (a bf16 weight would add a rounding the fp32 path does not make)."""
    if interpreting() or not env.w4_ptx():
        return False
    if cfg.block_m < 16:  # "fma1": fp32 weights by PTX where they are exact in bf16; "fma": fp32 decode
        return w.w_fmt != "int4" and _mode(cfg) == "fma1"
    return ptx_16bit_unpack(w, dtype)


def ptx_16bit_unpack(w: W4Tensor, dtype: torch.dtype) -> bool:
    """Whether W tiles of ``dtype`` (a tensor-core operand, or ``w4_dequant``'s output) are
    unpacked by the paired 16-bit PTX: on a GPU, bf16, or fp16 with int4 weights, unless
    ``FUSEDMOE_W4_PTX`` is off."""
    if interpreting() or not env.w4_ptx():
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float16 and w.w_fmt == "int4")


def _dot_dtype(a: torch.Tensor):
    """The dot path's operand dtype: A's (fp32 under the interpreter, whose bf16/fp16 dot
    multiplies raw bits)."""
    return tl.float32 if interpreting() else _TL_DTYPE[a.dtype]


def _route_weights(rw: torch.Tensor | None, batched: bool):
    if rw is None:
        return None, (0, 0)
    if batched:
        return rw, _strides(rw, 2)
    rw = rw.reshape(-1)
    return rw, (0, rw.stride(0))


def _row_strides(t: torch.Tensor, batched: bool) -> tuple[int, int, int]:
    """(expert, row, column) strides of C or of one split of the partials."""
    return tuple(t.stride()[-3:]) if batched else (0, *t.stride()[-2:])


class _Rows:
    """How a launch maps programs to rows (what ``_w4_rows`` reads): the standard layout's aligned
    blocks of ``block_m`` slots, or the batched layout's per-expert slabs of ``m_max`` rows."""

    def __init__(self, batched, block_m, num_m_blocks, num_pairs, m_max, a_div, a_strides, c_shape, ptrs,
                 num_experts, pair_blocks=False):  # fmt: skip
        self.batched, self.block_m, self.num_m_blocks, self.num_pairs = batched, block_m, num_m_blocks, num_pairs
        self.m_max, self.a_div, self.a_strides, self.c_shape, self._ptrs = m_max, a_div, a_strides, c_shape, ptrs
        self.num_experts, self.pair_blocks = num_experts, pair_blocks
        self.blocks_per_expert = cdiv(m_max, block_m) if batched else 0
        self.total = c_shape[0] * (c_shape[1] if batched else 1)  # rows of C

    @classmethod
    def of(cls, a, w, cfg, routing, counts, a_div) -> _Rows:
        e_l = w.shape[0]
        if routing is None:
            m_max = a.shape[1]
            blocks = e_l * cdiv(m_max, cfg.block_m)  # BM = 1: one program per row
            ptrs = (None, None, counts)
            return cls(True, cfg.block_m, blocks, 0, m_max, a_div, a.stride(), (e_l, m_max), ptrs, e_l)
        expect(routing.block_m == cfg.block_m, "cfg.block_m", f"routing.block_m = {routing.block_m}", cfg.block_m)
        ptrs = (routing.sorted_ids, routing.block_expert, None)
        n, blocks = routing.num_pairs, routing.block_expert.numel()
        strides = (0, *a.stride())
        return cls(False, cfg.block_m, blocks, n, 0, a_div, strides, (n,), ptrs, e_l, routing.pair_blocks)

    @property
    def slots(self) -> int:
        """Slots of the standard layout's blocks (rows of an A permuted per slot)."""
        return self.num_m_blocks * self.block_m

    def ptrs(self, dummy) -> tuple:
        return tuple(dummy if t is None else t for t in self._ptrs)

    def scalars(self) -> tuple:
        return self.num_pairs, self.a_div, self.m_max, self.blocks_per_expert, self.num_experts, self.num_m_blocks


_PERMUTE_BK = 128  # columns per program of the act-order A permutation


def _permute_a(a, w: W4Tensor, rows: _Rows) -> torch.Tensor:
    """A with each row's columns in its expert's sorted K order (``_w4_permute_a_kernel``):
    [slots, Kp] for the standard layout (a row per aligned slot), [E, M_max, Kp] batched."""
    kp = w.k_padded
    if rows.batched:
        out = torch.empty(w.shape[0], rows.m_max, kp, dtype=a.dtype, device=a.device)
        o_str = out.stride()[:2]
    else:
        out = torch.empty(rows.slots, kp, dtype=a.dtype, device=a.device)
        o_str = (0, out.stride(0))
    grid = (rows.num_m_blocks, cdiv(kp, _PERMUTE_BK))
    launch(_w4_permute_a_kernel, grid,
        a, w.perm, out, *rows.ptrs(out), w.shape[2], kp, rows.num_pairs, rows.a_div, rows.m_max,
        rows.blocks_per_expert, rows.num_experts, *rows.a_strides, *w.perm.stride(), *o_str,
        BATCHED=rows.batched, PAIR_BLOCKS=rows.pair_blocks, BLOCK_M=rows.block_m, BLOCK_K=_PERMUTE_BK, num_warps=4,
    )  # fmt: skip
    return out


def _reduce(p, c, act, oq, c_scale, route_weights, rw_str, rows: _Rows, n) -> None:
    """C from the split-K partials: sum over splits in order, then the epilogue's tail; the
    GEMM's row blocks, so rows no program wrote (other experts', past the counts) stay as they are."""
    bn = min(_REDUCE_BN, next_power_of_2(max(n, 16)))
    grid = (rows.num_m_blocks, cdiv(n, bn))
    launch(_w4_reduce_kernel, grid,
        p, _u8(c), p if c_scale is None else c_scale, p if route_weights is None else route_weights,
        *rows.ptrs(p), n, rows.num_pairs, rows.m_max, rows.blocks_per_expert, rows.num_experts,
        1.702 if act is None else act.swiglu_alpha, 7.0 if act is None else act.swiglu_limit,
        p.stride(0), *_row_strides(p[0], rows.batched), *rw_str, *_row_strides(c, rows.batched),
        SPLIT_K=p.shape[0], BATCHED=rows.batched, PAIR_BLOCKS=rows.pair_blocks,
        MUL_ROUTED_WEIGHT=route_weights is not None,
        ACT="none" if act is None else act.activation.value,
        GATED=act is not None and act.activation.is_gated,
        INTERLEAVED=act is not None and act.gate_up_interleaved,
        OUT_QUANT=oq, EXACT_CAST=interpreting(), BLOCK_M=rows.block_m, BLOCK_N=bn,
        num_warps=4,
    )  # fmt: skip


__all__ = [
    "W4_DTYPES",
    "default_w4_config",
    "fit_w4_config",
    "partials_numel",
    "supports",
    "w4_gemm_launch",
    "w4_launch_config",
    "w4_scheme_key",
]
