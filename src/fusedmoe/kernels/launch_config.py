"""Launch configurations of the grouped GEMM as data: ``LaunchConfig``.

Where a config comes from, first match wins:

1. ``override_launch_config(cfg)`` (a context manager, for tests and the tuner);
2. ``FUSEDMOE_LAUNCH_CONFIG="BM,BN,BK,GROUP_M,WARPS,STAGES[,field=value...]"`` in the
   environment (e.g. ``"128,256,64,8,8,3,persistent=1"``, ``"1,32,256,1,4,4,split_k=4,w_major=1"``);
3. tuned JSON files for this GPU and GEMM shape (``tuned_configs``: ``FUSEDMOE_CONFIG_DIR``,
   then the package's ``configs/``), the entry nearest to the call's pair count;
4. ``default_launch_config``: a heuristic on the problem shape.

The launcher then *fits* the config to the operands (``fit_launch_config``): BK is
shrunk to divide a w8a8 block or group size so each K step sees one scale.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from .. import env
from ..errors import FusedMoEError, expect
from . import tuned_configs


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one grouped-GEMM launch.

    block_m: BM, rows (sorted pairs) per tile; also the padding unit of ``moe_align`` and
    the row block of the batched layout. A power of 2: >= 16 multiplies with ``tl.dot``
    (tensor cores); 1, 2, 4 or 8 selects the kernel's FMA path for decode (no tensor cores,
    fp32 broadcast multiply-reduce; see ``_grouped_gemm``), and BM = 1 means no padding.
    block_n / block_k: BN, BK, powers of 2 >= 16. group_m: M tiles walked together for L2
    reuse of W.

    Read by the 4-bit weight kernel only (``grouped_gemm_w4``; the other kernels ignore them):
    split_k: programs sharing one output tile along K, each writing an fp32 partial tile that
    ``moe_sum`` (or a reduce kernel) sums in a fixed order; 1 = no split. w_major: 1 puts the
    weight tile first: the dot computes C^T = W @ A^T (the dequantized W tile feeds the tensor
    cores from registers), and at BM = 1 the FMA path keeps a partial sum per K position, reduced
    once after the K loop. scale_loads (tensor-core tiles): where a K step's scale (and
    zero-point) codes are loaded: 0 beside each pack block's unpack, 1 one step before (carried
    through the loop), 2 all of them at the step's start; the tuner picks per tile (each is the
    fastest somewhere: PERF_LOG, twelfth session).

    The persistent TMA-fed kernel (``grouped_gemm_persistent``, prefill on Hopper) runs
    instead of the one-program-per-tile kernel when ``persistent`` is set and it serves the
    call; its knobs, ignored otherwise: ``warp_specialize`` (``tl.range(...,
    warp_specialize=True)`` on the K loop: a producer warpgroup feeding two consumer ones;
    Triton 3.6 does it for 4-warp configs with A through TMA, see ``grouped_gemm_persistent``),
    ``flatten`` (the tile loop and the K loop fused into one software pipeline; off under
    warp_specialize), ``epilogue_subtile`` (the epilogue in 1 or 2 column halves, for registers),
    ``programs_per_sm`` (the grid is this many programs per SM: at 2, two independent 4-warp
    programs share an SM where their registers and shared memory fit, so that one's scale
    promotion, barriers and epilogue overlap the other's MMAs; where two do not fit, the second
    wave waits and the tuner measures it slower).
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    w_major: int = 0
    persistent: bool = False
    warp_specialize: bool = False
    flatten: bool = True
    epilogue_subtile: int = 1
    programs_per_sm: int = 1
    scale_loads: int = 0

    def __post_init__(self) -> None:
        bm = self.block_m
        expect(
            bm >= 1 and bm & (bm - 1) == 0,
            "LaunchConfig.block_m",
            "a power of 2: >= 16 for tl.dot tiles, or 1, 2, 4, 8 for the FMA (decode) path",
            bm,
        )
        for f in ("block_n", "block_k"):
            v = getattr(self, f)
            expect(v >= 16 and v & (v - 1) == 0, f"LaunchConfig.{f}", "a power of 2 >= 16", v)
        for f in ("group_m", "num_warps", "num_stages", "split_k"):
            expect(getattr(self, f) >= 1, f"LaunchConfig.{f}", ">= 1", getattr(self, f))
        expect(self.w_major in (0, 1), "LaunchConfig.w_major", "0 or 1", self.w_major)
        expect(self.epilogue_subtile in (1, 2), "LaunchConfig.epilogue_subtile", "1 or 2", self.epilogue_subtile)
        expect(self.programs_per_sm in (1, 2), "LaunchConfig.programs_per_sm", "1 or 2", self.programs_per_sm)
        expect(self.scale_loads in (0, 1, 2), "LaunchConfig.scale_loads", "0, 1 or 2", self.scale_loads)

    @classmethod
    def parse(cls, text: str) -> LaunchConfig:
        """``"64,128,64,8,4,3"`` -> LaunchConfig(64, 128, 64, 8, 4, 3). More fields may follow, in
        field order or as ``name=value`` (booleans as 0/1): ``"128,256,64,8,8,3,persistent=1"``."""
        parts = [p.strip() for p in text.split(",")]
        flds = {f.name: f for f in fields(cls)}
        names = list(flds)
        what = (
            f"{_TILE_FIELDS} comma-separated integers ({','.join(names[:_TILE_FIELDS])}), then more in field "
            f"order or as name=value ({', '.join(names[_TILE_FIELDS:])})"
        )
        vals: dict = {}
        for i, p in enumerate(parts):
            name, _, v = p.rpartition("=") if "=" in p else (names[i] if i < len(names) else "", "", p)
            ok = name in flds and name not in vals and v.isdigit() and (i >= _TILE_FIELDS or "=" not in p)
            expect(ok and len(parts) >= _TILE_FIELDS, env.LAUNCH_CONFIG, what, text)
            vals[name] = bool(int(v)) if flds[name].type in (bool, "bool") else int(v)
        try:
            return cls(**vals)
        except FusedMoEError as err:  # a field out of range: name the variable it came from
            raise FusedMoEError(f"{env.LAUNCH_CONFIG}={text!r}: {err}") from None


_TILE_FIELDS = 6  # block_m .. num_stages: what every config string gives


_OVERRIDE: list[LaunchConfig] = []


@contextlib.contextmanager
def override_launch_config(cfg: LaunchConfig) -> Iterator[LaunchConfig]:
    """Use ``cfg`` for every grouped-GEMM launch inside the ``with`` block."""
    _OVERRIDE.append(cfg)
    try:
        yield cfg
    finally:
        _OVERRIDE.pop()


def scoped_override() -> bool:
    """An ``override_launch_config`` block is active."""
    return bool(_OVERRIDE)


def default_launch_config(m_pairs: int, num_experts: int, n: int, k: int, scheme_key: str) -> LaunchConfig:
    """A heuristic config for ``m_pairs`` routed rows over ``num_experts`` experts of W [N, K].

    ``scheme_key`` is ``grouped_gemm.scheme_key(...)``: 'bf16', 'fp8', 'int8', 'w8a16',
    'int4', 'mxfp4', 'nvfp4', with '_block' for block/group-scaled w8a8.
    BM follows the expected rows per expert (decode: ~1 row per expert, so a 16-row
    tile wastes the least); 8- and 4-bit weights take a longer K step because a byte
    per element halves the shared memory per step. Measured on an H100 (E 64, N 1536,
    K 2048, top-8, CUDA-graph replay): at 2 and 16 rows per expert, BM 16 and BM 64 are
    within 10% of each other for bf16/fp8/int8 (T=16: bf16 140 vs 138 us, fp8 block 80 vs
    88 us); MXFP4/NVFP4 at 16 rows preferred BM 64 (269 vs 360 us, measured before the
    current e2m1 decode). Tuned tables (``tuned_configs``) take precedence where they exist.

    4-bit weights at <= 0.5 rows per expert (T = 1 on every shipped preset) take the FMA
    path (BM < 16): on an H100 the tuner picked BM 1, BN 32, BK 256, 4 warps for every such
    GEMM it could try, 1.2-1.7x faster than the BM 16 dot config (int4 and MXFP4, four
    presets, ``benchmarks/results/tune_h100_decode_2026-11-22.md``); at ~1 row per expert
    (Qwen3 T = 16) the dot path won again. bf16 kept the dot path at every T.
    """
    rows_per_expert = m_pairs / max(1, num_experts)
    if scheme_key in ("int4", "mxfp4", "nvfp4") and rows_per_expert <= 0.5:
        return LaunchConfig(1, min(32, max(16, _pow2_at_least(n))), min(256, max(16, _pow2_at_least(k))), 1, 4, 4)
    if rows_per_expert <= 16:
        bm = 16
    elif rows_per_expert <= 48:
        bm = 32
    elif rows_per_expert <= 160:
        bm = 64
    else:
        bm = 128
    narrow = scheme_key != "bf16"
    bn = 64 if bm <= 32 else 128
    bk = 128 if narrow else 64
    if scheme_key in ("int4", "mxfp4", "nvfp4") and bm >= 64:
        bk = 64  # a guess, not measured: halves the dequantized bf16 tile in shared memory
    warps = 4 if bm * bn <= 64 * 128 else 8
    stages = 4 if bm <= 32 else 3
    group_m = 1 if bm == 16 else 8
    bn = min(bn, max(16, _pow2_at_least(n)))
    # tl.dot needs K >= 32 for 8-bit operands and >= 16 for 16-bit ones on Hopper; a tile
    # longer than K is masked, so tiny K (H = I = 8, found by the GPU fuzzer) keeps the minimum
    bk = min(bk, max(32 if narrow else 16, _pow2_at_least(k)))
    if bm == 128 and scheme_key in _PERSISTENT_KEYS and n >= 256 and k >= 128:
        # prefill: the persistent TMA-fed kernel, with the tile that won each GEMM of the H100 kernel
        # bench at T = 4096 (1.02-1.63x over this kernel; ``grouped_gemm_persistent`` declines what it
        # does not serve, e.g. on GPUs without TMA, and the one-program-per-tile kernel runs instead)
        block = scheme_key.endswith("_block")
        return LaunchConfig(128, 128 if block else 256, bk, 8, 8, 4 if block else 3, persistent=True)
    return LaunchConfig(bm, bn, bk, group_m, warps, stages)


_PERSISTENT_KEYS = ("bf16", "fp8", "fp8_block", "int8", "int8_block", "w8a16")


@functools.lru_cache(maxsize=1024)
def _config(**fields) -> LaunchConfig:
    """One ``LaunchConfig`` per distinct tuned entry (validated once, not per call)."""
    return LaunchConfig(**fields)


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


# Deterministic mode plans every launch as if each expert had this many rows (BM 64): a
# tile shape that depends on T would change a token's accumulation order with its batch.
DETERMINISTIC_ROWS_PER_EXPERT = 64


def pick_launch_config(
    m_pairs: int, num_experts: int, n: int, k: int, scheme_key: str, *, deterministic: bool = False, default=None
) -> LaunchConfig:
    """The scoped override, else the environment variable, else the tuned entry nearest
    ``m_pairs`` for (GPU, ``scheme_key``, E, N, K), else ``default(m_pairs, E, N, K)``
    (``default_launch_config`` for this kernel; the w4 kernel passes its own).

    ``deterministic``: ignore ``m_pairs`` (the token count), so the config is the same for
    every batch (see ``DETERMINISTIC_ROWS_PER_EXPERT``).
    """
    if deterministic:
        m_pairs = DETERMINISTIC_ROWS_PER_EXPERT * max(1, num_experts)
    if _OVERRIDE:
        return _OVERRIDE[-1]
    text = env.raw(env.LAUNCH_CONFIG)
    if text:
        return LaunchConfig.parse(text)
    tuned = tuned_configs.lookup(m_pairs, num_experts, n, k, scheme_key)  # nearest pair count
    if tuned is not None:
        return _config(**tuned)
    if default is not None:
        return default(m_pairs, num_experts, n, k)
    return default_launch_config(m_pairs, num_experts, n, k, scheme_key)


def fit_launch_config(cfg: LaunchConfig, k_group: int | None, strict: bool = True) -> LaunchConfig:
    """Shrink BK so it divides ``k_group`` (the K extent of one scale), if any.

    ``strict``: no BK >= 16 divides the group is an error (w8a8 kernels need one scale per
    K step); otherwise the kernel gathers a scale per element, and BK <= 64 with 2 stages
    keeps those [BN, BK] fp32 tiles within shared memory (128 x 128 x 3 stages needed
    240 KiB on an H100, over its 227).
    """
    if not k_group:
        return cfg
    bk = cfg.block_k
    while bk > 16 and k_group % bk:
        bk //= 2
    if k_group % bk:
        expect(not strict, "scale group along K", "a multiple of 16 for a w8a8 kernel", k_group)
        return replace(cfg, block_k=min(cfg.block_k, 64), num_stages=min(cfg.num_stages, 2))
    return replace(cfg, block_k=bk)


def gated_act_config(cfg: LaunchConfig) -> LaunchConfig:
    """GEMM1's config (picked or tuned for W13's 2I rows) for the fused gated activation.

    There BN counts activation columns and each takes a gate and an up row of W13, so BN
    halves (to no less than 16): a program reads the same BN rows of W13, in two dots of
    half the width, and the grid has as many programs as the plain GEMM1's.
    """
    return replace(cfg, block_n=max(16, cfg.block_n // 2))
