"""What the tuner tries: the candidate spaces, the candidates of one step, and their ranking."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, replace

from ...kernels.launch_config import LaunchConfig

SPACES = {
    # 96 configs before the BM and GROUP_M filters: 12-24 per decode step, 60-96 per prefill step
    "quick": dict(
        block_m=(16, 32, 64, 128),
        block_n=(64, 128, 256),
        block_k=(64, 128),
        group_m=(1, 8),
        num_warps=(4, 8),
        num_stages=(3,),
    ),
    "full": dict(
        block_m=(16, 32, 64, 128),
        block_n=(32, 64, 128, 256),
        block_k=(32, 64, 128),
        group_m=(1, 8, 16),
        num_warps=(4, 8),
        num_stages=(2, 3, 4, 5),
    ),
    # for tests under the interpreter: two candidates
    "tiny": dict(block_m=(16,), block_n=(32, 64), block_k=(32,), group_m=(1,), num_warps=(4,), num_stages=(2,)),
}
# Steps with at most DECODE_ROWS rows per expert also try the FMA path (BM < 16: no tensor cores,
# the W tile reduced in fp32 as stored), 4-24 more candidates each; BM beyond twice the rows per
# expert only multiplies the FMA work, so those are left out.
DECODE_SPACE = dict(
    block_m=(1, 2, 4, 8),
    block_n=(32, 64, 128),
    block_k=(128, 256),
    group_m=(1,),
    num_warps=(4,),
    num_stages=(3, 4),
)
DECODE_ROWS = 8
# Steps with at least PREFILL_ROWS rows per expert also try the persistent TMA-fed kernel (Hopper;
# ``grouped_gemm_persistent``): the tiles that won each prefill GEMM of the kernel bench on an H100
# (bf16 128 x 128/256 x 64, fp8 x 128; 1.02-1.63x over the one-program-per-tile kernel at T = 4096,
# ``benchmarks/results/kbench_prefill_h100_2026-11-25``), 16 candidates a step. Where the kernel
# does not serve a scheme (4-bit, mxfp8, nvfp4 activations) the launch runs the other kernel,
# which the tuner then times like any other candidate.
PERSISTENT_SPACE = dict(
    block_m=(64, 128),
    block_n=(128, 256),
    block_k=(64, 128),
    group_m=(8,),
    num_warps=(8,),
    num_stages=(3, 4),
    persistent=(True,),
)
PREFILL_ROWS = 64
# And two 4-warp programs per SM (``programs_per_sm``): Triton's pipeline puts a CTA-wide barrier
# around each K step's loads, so the two warpgroups of an 8-warp program promote their partial
# products (fp8 blocks: 128 FFMA a step) while the tensor cores idle; two independent programs
# overlap one's promotion with the other's MMAs. H200, fp8 blocks, 64 x 128 x 128 with 3 stages:
# 1.59-1.64x over one such program per SM, and 1.07-1.14x over the shipped 8-warp 64 x 256 tiles
# on DeepSeek-V3 at T = 4096 (PERF_LOG, eleventh session). Only tiles whose stages fit twice in an
# SM's shared memory (``PAIRED_SMEM``) and whose accumulators fit 128 threads' registers.
PAIRED_SPACE = dict(PERSISTENT_SPACE, num_warps=(4,), programs_per_sm=(2,))
PAIRED_SMEM = 110 << 10  # bytes of pipeline stages per program: two in an H100/H200 SM's 228 KiB
PAIRED_TILE = 64 * 256  # accumulator elements of a 4-warp program (128 fp32 registers a thread)
# The w4 kernel's space (``kernels.grouped_gemm_w4``; 4-bit weights, float activations): BK 128
# (every format's pack block divides it), tensor-core tiles in both orientations, W-major
# ("swap", W fed from registers, BM the MMA's N: BM 16-256) and C-major ("dot", BM <= 64: it
# measured 1.25x slower than swap at BM 128 on Mixtral int4 GEMM2, and BM 256 would hold a
# [256, BN] accumulator), at most 128 x 256 accumulator elements per program, 8 warps only from
# 128 x 128; and from ``W4_DECODE_ROWS`` rows per expert down the FMA path (BM 1, one or two pack
# blocks per step) with split-K, which decode needs (Mixtral GEMM2 at T = 1, 256 output tiles:
# 92 us unsplit, 66-70 us with 2-4 splits on an H100).
W4_SPACES = {
    "quick": dict(
        block_m=(16, 32, 64, 128, 256),
        block_n=(64, 128, 256),
        block_k=(128,),
        group_m=(1, 8),
        num_warps=(4, 8),
        num_stages=(3, 4),
        w_major=(0, 1),
    ),
    "full": dict(
        block_m=(16, 32, 64, 128, 256),
        block_n=(32, 64, 128, 256),
        block_k=(128, 256),
        group_m=(1, 8),
        num_warps=(4, 8),
        num_stages=(2, 3, 4, 5),
        w_major=(0, 1),
    ),
    "tiny": dict(
        block_m=(16,), block_n=(32,), block_k=(128,), group_m=(1,), num_warps=(4,), num_stages=(2,), w_major=(0, 1)
    ),
}
W4_DECODE_SPACE = dict(
    block_m=(1,),
    block_n=(16, 32, 64),
    block_k=(256,),
    group_m=(1,),
    num_warps=(4,),
    num_stages=(4,),  # the FMA loop issues its loads one step ahead itself
    w_major=(1,),
    split_k=(1, 2, 4, 8),
)
W4_TINY_DECODE = dict(W4_DECODE_SPACE, block_n=(32,), split_k=(1, 2))
W4_DECODE_ROWS = 1
ALL_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b")  # ``--preset all``
# ``--scheme all``: what the shipped tables cover (the w4 kernel's int4, MXFP4 and NVFP4 included)
SCHEMES = ("bf16", "fp8_tensor", "fp8_block", "int4_g128", "mxfp4", "nvfp4_w4a16")
MIN_CANDIDATES = 4  # kept per step (besides the heuristic) whatever the budget


def parse_presets(text: str) -> list[str]:
    """'all' -> the four shipped presets; else a comma list."""
    return list(ALL_PRESETS) if text == "all" else [p for p in text.split(",") if p]


def w4_candidates(space: str, m_pairs: int, num_experts: int) -> list[LaunchConfig]:
    """The w4 kernel's candidates (``W4_SPACES``): tensor-core tiles whose BM suits the rows per
    expert as in ``candidates``, and the FMA path's from ``W4_DECODE_ROWS`` rows down. GEMM2's BM
    is free (the layer aligns again when it differs from GEMM1's)."""
    rows = m_pairs / max(1, num_experts)
    grids = [W4_SPACES[space]]
    if rows <= W4_DECODE_ROWS:
        grids.append(W4_TINY_DECODE if space == "tiny" else W4_DECODE_SPACE)
    need = max(16, 4 * m_pairs // max(1, num_experts))
    out = []
    for grid in grids:
        for vals in itertools.product(*grid.values()):
            c = LaunchConfig(**dict(zip(grid, vals, strict=True)))
            tile = c.block_m * c.block_n
            ok = c.block_m == 1 or (
                (c.block_m <= need or c.block_m == 16)
                and (c.w_major or c.block_m <= 64)
                and tile <= 128 * 256
                and (c.num_warps == 4 or tile >= 128 * 128)
            )
            if ok and (c.group_m == 1 or rows > c.block_m):
                out.append(c)
    return out


def candidates(
    space: str, m_pairs: int, num_experts: int, block_m: int | None = None, operand_bytes: int = 2
) -> list[LaunchConfig]:
    """The space's configs whose BM suits the rows per expert (at most 4x the need, at least 16),
    and for decode steps (``DECODE_ROWS``) the FMA path's (BM < 16, at most twice the rows), for
    prefill steps (``PREFILL_ROWS``) the persistent kernel's, one and two programs per SM
    (``PAIRED_SPACE``; ``operand_bytes``, the wider of A's and W's elements, sizes their stages).

    ``block_m`` pins BM: the layer aligns the pairs once, with GEMM1's BM, and GEMM2 runs
    on that alignment, so GEMM2 is tuned under the BM GEMM1 chose (tuning it freely
    picked tiles the layer then ran with another BM: 2x slower fp8-block cells, H200).
    GROUP_M > 1 only where an expert has more than one BM tile on average: it orders the
    tiles so the M tiles of one expert share W[e] in L2; with one tile per expert every
    order reads the same bytes (this halves the decode steps' candidates).
    """
    rows = m_pairs / max(1, num_experts)
    grids = [dict(SPACES[space])]
    if space != "tiny" and rows <= DECODE_ROWS:
        grids.append(dict(DECODE_SPACE))
    if space != "tiny" and rows >= PREFILL_ROWS:
        grids += [dict(PERSISTENT_SPACE), dict(PAIRED_SPACE)]
    need = max(16, 4 * m_pairs // max(1, num_experts))
    out = []
    for grid in grids:
        if block_m is not None:
            if (block_m < 16) != (grid["block_m"][0] < 16):
                continue
            grid["block_m"] = (block_m,)
        for vals in itertools.product(*grid.values()):
            cfg = LaunchConfig(**dict(zip(grid, vals, strict=True)))
            if cfg.block_m < 16:
                ok = block_m is not None or cfg.block_m <= max(1, 2 * math.ceil(rows))
            else:
                ok = cfg.block_m <= need or cfg.block_m == 16
            if ok and (cfg.group_m == 1 or rows > cfg.block_m) and _fits_paired(cfg, operand_bytes):
                out.append(cfg)
    return out


def _fits_paired(cfg: LaunchConfig, operand_bytes: int) -> bool:
    """A two-per-SM config's stages fit twice in shared memory and its accumulator in registers."""
    if cfg.programs_per_sm == 1:
        return True
    stages = (cfg.block_m + cfg.block_n) * cfg.block_k * operand_bytes * cfg.num_stages
    return stages <= PAIRED_SMEM and cfg.block_m * cfg.block_n <= PAIRED_TILE


def by_distance(cfgs: list[LaunchConfig], ref: LaunchConfig) -> list[LaunchConfig]:
    """Unique ``cfgs``, nearest the heuristic ``ref`` first (log2 tile distance, then the other
    knobs; the space's order among equals): a budget cut keeps the heuristic's neighbourhood."""

    def dist(c: LaunchConfig) -> float:
        tiles = sum(abs(math.log2(getattr(c, f) / getattr(ref, f))) for f in ("block_m", "block_n", "block_k"))
        knobs = (c.group_m != ref.group_m) + (c.num_warps != ref.num_warps) + abs(c.num_stages - ref.num_stages)
        knobs += c.programs_per_sm != ref.programs_per_sm
        return tiles + knobs + (c.w_major != ref.w_major) + abs(math.log2(c.split_k / ref.split_k))

    return sorted(dict.fromkeys(cfgs), key=dist)


def family(c: LaunchConfig) -> tuple:
    """The kernel path a config takes: FMA (BM < 16), one program a tile, persistent (by warps and
    programs per SM), the w4 kernel's orientation and split."""
    return (c.block_m < 16, c.persistent, c.num_warps, c.programs_per_sm, c.w_major, c.split_k > 1)


def families_first(ranked: list[LaunchConfig], head: int) -> list[LaunchConfig]:
    """``ranked`` with its first ``head`` kept, then the best-ranked config of each kernel path not
    among them, then the rest in order: a budget that screens only a step's first few candidates
    still meets every path. By distance alone the two-per-SM tiles (two knobs from an 8-warp
    heuristic) ranked past the 4-5 candidates a T = 16,384 step could screen (H200, eleventh
    session)."""
    seen = {family(c) for c in ranked[:head]}
    leaders = []
    for c in ranked[head:]:
        if family(c) not in seen:
            seen.add(family(c))
            leaders.append(c)
    return ranked[:head] + leaders + [c for c in ranked[head:] if c not in leaders]


def knob_variants(best: LaunchConfig, w4: bool) -> list[LaunchConfig]:
    """The configs a step times beside its best finalist without screening them: the knobs whose
    effect depends on the tile more than any distance says, so that sweeping them would multiply
    the space. The w4 kernel's ``scale_loads`` (tensor-core tiles): the other two places. H200,
    MXFP4 (PERF_LOG twelfth session): a step ahead 1.18x faster on Mixtral's GEMM2 at T = 16
    (BM 16) and 1.9x slower on its GEMM1 at T = 4096 (BM 128), where the compiler then converts
    the dequantized W tile through shared memory; at the step's start 1.07x on GEMM1 at T = 16,
    0.91x on Mixtral's GEMM1 at T = 256."""
    if w4 and best.block_m >= 16:
        return [replace(best, scale_loads=v) for v in (0, 1, 2) if v != best.scale_loads]
    return []


def fmt_config(c: LaunchConfig) -> str:
    """'BM,BN,BK,GROUP_M,warps,stages' then the knobs that differ from their default as name=value
    (``"128,256,64,8,8,3,persistent=1"``): what ``LaunchConfig.parse`` and FUSEDMOE_LAUNCH_CONFIG read."""
    vals = asdict(c)
    names = list(vals)
    head = [str(vals[n]) for n in names[:6]]
    default = LaunchConfig()
    tail = [f"{n}={int(vals[n])}" for n in names[6:] if vals[n] != getattr(default, n)]
    return ",".join(head + tail)
