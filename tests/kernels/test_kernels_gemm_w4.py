"""The 4-bit weight path: the w4 layout (conversion and its exact inverse) and the w4 grouped GEMM.

Conversion (no kernels): ``from_w4(to_w4(q)) == q`` bit for bit for every 4-bit format, pack
block, padded K and act-order map, and the layout's invariants (what byte j of a block holds,
groups contiguous after act-order sorting, misuse as the reference layout fails loudly).

Kernel (Triton interpreter, tiny shapes; real shapes marked ``gpu``): weights converted with
``to_w4``, run through the public ``grouped_gemm`` / ``grouped_gemm_batched`` (which forward
w4 weights to ``w4_gemm_launch``), against ``grouped_gemm_ref`` computed in float64 from the
*original* reference-layout weights, outputs poisoned with NaN first (rows of local pairs all
written, the others untouched). Under the interpreter both sides are exact fp32 sums of exactly
dequantized operands (~3e-7 with an fp32 output).

Which cases: the interpreter costs ~5 ms per program and K step, so every scheme meets every
way of multiplying (FMA with deferred reduction, FMA per row, C-major and W-major dots), and
the other dimensions (layout, fused activation, split-K, the labelled edge case) rotate along
that list, so each of them is met by several schemes and modes; the edge cases then run once
more each on the decode and the tensor-core path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import zlib

import pytest
import torch
from test_kernels_gemm import DEVICE, needs_cuda, needs_triton

from fusedmoe import env
from fusedmoe.config import Activation
from fusedmoe.kernels import tuned_configs
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.align import moe_align_ref
from fusedmoe.kernels.gemm_format import ActEpilogue, GemmCall, GemmFormat
from fusedmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_batched, grouped_gemm_batched_ref, grouped_gemm_ref
from fusedmoe.kernels.grouped_gemm_w4 import (
    default_w4_config,
    fit_w4_config,
    supports,
    w4_gemm_launch,
    w4_launch_config,
    w4_scheme_key,
)
from fusedmoe.kernels.launch_config import LaunchConfig, gated_act_config, override_launch_config
from fusedmoe.kernels.moe_sum import moe_sum, moe_sum_ref
from fusedmoe.quant import Operand, QuantScheme, dequantize, quantize
from fusedmoe.quant.w4_layout import LAYOUT, W4Tensor, convertible, from_w4, from_w4_weights, to_w4, to_w4_weights
from fusedmoe.testing import poison_, random_topk, rel_error, tolerance
from fusedmoe.weights import ExpertWeights, random_g_idx

SCHEMES = {
    "int4_g32": QuantScheme.int4_w4a16(32),
    "int4_g64": QuantScheme.int4_w4a16(64),
    "int4_g128": QuantScheme.int4_w4a16(128),
    "int4_g64_zp": QuantScheme.int4_w4a16(64, zero_points=True),
    "int4_g16_zp": QuantScheme.int4_w4a16(16, zero_points=True),  # halves of two groups (PK 64)
    "int4_g32_actorder": QuantScheme.int4_w4a16(32, act_order=True),
    "mxfp4": QuantScheme.mxfp4_w4a16(),
    "nvfp4": QuantScheme.nvfp4_w4a16(),
}


def _quantized(scheme: QuantScheme, e: int, n: int, k: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    tq = scheme.w1
    w = torch.randn(e, n, k, generator=gen) * k**-0.5
    g_idx = random_g_idx(e, k, tq.granularity.group_size) if tq.act_order else None
    return quantize(w, tq, g_idx=g_idx).to(device)


def _equal(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    """Bit equality, dtypes included (1-byte float formats compared as bytes)."""
    if x is None or y is None:
        return x is None and y is None
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.element_size() == 1:
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    return torch.equal(x, y)


# ---- the layout: round trip and invariants (no kernels) ------------------------------------


@pytest.mark.parametrize("pack_block", [None, 32, 64, 128, 256])
@pytest.mark.parametrize("k", [80, 128, 192, 384])
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_round_trip_is_exact(scheme, k, pack_block):
    """K = 80 and 192 are not multiples of every PK: padded, then stripped on the way back."""
    tq = SCHEMES[scheme].w1
    if k % tq.granularity.group_size or convertible(tq, pack_block=pack_block):
        pytest.skip("not storable / not a valid pack block for this group")
    q = _quantized(SCHEMES[scheme], 3, 10, k)
    w4 = to_w4(q, tq, pack_block)
    back = from_w4(w4)
    for f in ("data", "scale", "zero", "global_scale", "g_idx"):
        assert _equal(getattr(back, f), getattr(q, f)), f
    assert back.shape == q.shape and type(back).__name__ == "QTensor"


def test_pack_block_puts_k_and_k_plus_half_in_one_byte():
    tq = SCHEMES["int4_g64"].w1
    codes = torch.arange(256).remainder(16).to(torch.uint8).reshape(1, 1, 256)
    from fusedmoe.quant.fp4 import pack_nibbles

    q = dataclasses.replace(quantize(torch.randn(1, 1, 256), tq), data=pack_nibbles(codes))
    w4 = to_w4(q, tq, pack_block=128)
    b = w4.bytes_u8()[0, 0].long()
    for blk in range(2):
        for j in range(64):
            byte = b[blk * 64 + j]
            assert byte & 0xF == codes[0, 0, blk * 128 + j] and byte >> 4 == codes[0, 0, blk * 128 + 64 + j]


def test_layout_invariants():
    tq = SCHEMES["int4_g32_actorder"].w1
    q = _quantized(SCHEMES["int4_g32_actorder"], 2, 8, 96)
    w4 = to_w4(q, tq)  # PK 64: K 96 -> 128
    assert isinstance(w4, W4Tensor) and w4.layout == LAYOUT and w4.w_fmt == "int4" and w4.group_size == 32
    assert w4.data.dtype == torch.int32 and tuple(w4.data.shape) == (2, 8, 128 // 8) and w4.k_padded == 128
    assert tuple(w4.scale.shape) == (2, 8, 4) and bool((w4.scale[..., 3] == 0).all())  # padded group: scale 0
    # act-order: the stored columns are sorted by group, so group i is positions [32 i, 32 i + 32)
    for e in range(2):
        perm = w4.perm[e, :96].long()
        assert torch.equal(torch.sort(perm).values, torch.arange(96))
        assert torch.equal(q.g_idx[e].long()[perm], torch.arange(96) // 32)
    assert torch.equal(w4.g_idx[0], torch.arange(128, dtype=torch.int32) // 32)
    # read as the reference layout, the int32 words fail on shapes instead of giving wrong values
    with pytest.raises(RuntimeError):
        dequantize(w4, tq)
    one = w4.select(1)
    assert one.layout == LAYOUT and one.perm.shape == (1, 128) and torch.equal(one.data[0], w4.data[1])
    assert set(w4.tensors()) == {"data", "scale", "g_idx", "perm"}


def test_convertible_says_why_not():
    assert convertible(QuantScheme.int4_w4a16(128).w1) is None
    assert "w4 layout is for" in convertible(QuantScheme.fp8_per_tensor().w1)
    from fusedmoe.quant import Granularity, QDtype, TensorQuant

    assert "group scales" in convertible(TensorQuant(QDtype.INT4, Granularity.channel()))
    assert "power-of-2" in convertible(QuantScheme.int4_w4a16(96).w1)
    assert "pack_block" in convertible(QuantScheme.mxfp4_w4a16().w1, pack_block=48)
    tq = SCHEMES["int4_g32_actorder"].w1
    q = _quantized(SCHEMES["int4_g32_actorder"], 1, 4, 64)
    q.g_idx = torch.zeros(1, 64, dtype=torch.int32)  # every column in group 0: sizes 64 and 0
    assert "unequal" in convertible(tq, q)
    assert supports(tq, None, torch.bfloat16) is None
    assert "float activations" in supports(tq, QuantScheme.fp8_per_tensor().a1, torch.bfloat16)
    assert "bf16/fp16/fp32" in supports(tq, None, torch.int8)


def test_expert_weights_round_trip():
    scheme = QuantScheme.int4_w4a16(32, zero_points=True)
    w13, w2 = torch.randn(3, 64, 96), torch.randn(3, 96, 32)
    ew = ExpertWeights.from_float(w13, w2, scheme)
    conv = to_w4_weights(ew, scheme)
    assert conv.layout == LAYOUT and conv.w13.layout == LAYOUT
    with pytest.raises(ValueError):
        conv.dequantized(scheme)  # the reference-layout check of ExpertWeights
    back = from_w4_weights(conv)
    assert back.layout == "reference"
    for f in ("data", "scale", "zero"):
        assert _equal(getattr(back.w13, f), getattr(ew.w13, f)) and _equal(getattr(back.w2, f), getattr(ew.w2, f))


# ---- launch configs ----------------------------------------------------------------------------


def test_launch_config_new_fields():
    cfg = LaunchConfig(1, 32, 256, 1, 4, 4, split_k=4, w_major=1)
    assert eval(repr(cfg)) == cfg
    assert LaunchConfig.parse("1,32,256,1,4,4") == LaunchConfig(1, 32, 256, 1, 4, 4)
    assert LaunchConfig.parse("1,32,256,1,4,4,4") == LaunchConfig(1, 32, 256, 1, 4, 4, 4)
    assert LaunchConfig.parse("1,32,256,1,4,4,4,1") == cfg
    for bad in ("1,32,256", "1,32,256,1,4,4,4,1,1,1,1,1,9", "1,32,256,1,4,4,nope=1"):
        with pytest.raises(ValueError):
            LaunchConfig.parse(bad)
    with pytest.raises(ValueError):
        LaunchConfig(split_k=0)
    with pytest.raises(ValueError):
        LaunchConfig(w_major=2)
    loads = LaunchConfig.parse("16,64,128,1,4,3,scale_loads=2")
    assert loads.scale_loads == 2 and loads == LaunchConfig(16, 64, 128, 1, 4, 3, scale_loads=2)
    with pytest.raises(ValueError):
        LaunchConfig(scale_loads=3)


def test_fit_w4_config_keeps_scale_loads_on_tensor_core_tiles_only():
    """The FMA path loads its own operands a step ahead: the knob is dropped there, so its tuned
    entries and compiled variants stay one per config."""
    w4 = to_w4(_quantized(SCHEMES["mxfp4"], 2, 16, 2880), SCHEMES["mxfp4"].w1)
    for v in (1, 2):
        assert fit_w4_config(LaunchConfig(16, 64, 128, 1, 4, 3, w_major=1, scale_loads=v), w4).scale_loads == v
        assert fit_w4_config(LaunchConfig(1, 32, 128, 1, 4, 4, w_major=1, scale_loads=v), w4).scale_loads == 0


def test_fit_and_default_w4_config():
    w4 = to_w4(_quantized(SCHEMES["mxfp4"], 2, 16, 2880), SCHEMES["mxfp4"].w1)  # gpt-oss K: PK 64
    assert w4.pack_block == 64 and w4.k_padded == 2880
    fma = fit_w4_config(LaunchConfig(1, 32, 256, 1, 4, 4, split_k=64, w_major=1), w4)
    assert fma.block_k == 128 and fma.split_k == 23  # the FMA path steps two pack blocks; <= K steps
    one = fit_w4_config(LaunchConfig(1, 32, 64, 1, 4, 4, w_major=1), w4)
    assert one.block_k == 64  # or one, when asked
    dot = fit_w4_config(LaunchConfig(16, 64, 32, 1, 4, 4, w_major=1), w4)
    assert dot.block_k == 64 and dot.w_major == 1
    assert fit_w4_config(LaunchConfig(4, 32, 256, 1, 4, 4, w_major=1), w4).w_major == 0  # BM 2..8: per row
    for m, e, n, k, gated in ((2, 8, 4096, 14336, False), (16, 128, 1536, 2048, True), (32768, 128, 2048, 768, False)):
        cfg = w4_launch_config(m, e, n, k, w4, gated=gated)
        assert cfg.block_k % w4.pack_block == 0 and cfg.split_k >= 1
    assert default_w4_config(2, 8, 4096, 14336).split_k == 4  # Mixtral GEMM2 at T = 1
    assert default_w4_config(8, 128, 2048, 768).split_k == 1  # Qwen3: K 768 is 3 steps
    assert default_w4_config(4, 8, 28672, 4096, gated=True).split_k == 1


def test_w4_launch_config_reads_this_gpus_tuned_table(tmp_path, monkeypatch):
    """A tuned entry (``fusedmoe tune`` writes them under ``w4_scheme_key``) wins over the
    heuristic on its GPU only; a pinned config wins over both; deterministic mode never splits."""
    w4 = to_w4(_quantized(SCHEMES["mxfp4"], 2, 16, 2880), SCHEMES["mxfp4"].w1)
    assert w4_scheme_key(w4) == "mxfp4_g32_w4"
    tuned = LaunchConfig(16, 128, 128, 1, 8, 3, split_k=1, w_major=0)
    split = LaunchConfig(1, 64, 256, 1, 4, 4, split_k=8, w_major=1)
    path = tuned_configs.config_path(tmp_path, "GPU A", "mxfp4_g32_w4", 8, 16, 2880)
    path.parent.mkdir(parents=True)
    table = {str(m): dataclasses.asdict(c) for m, c in ((2, split), (4096, tuned))}
    path.write_text(json.dumps({"configs": table}))
    monkeypatch.setenv(env.CONFIG_DIR, str(tmp_path))
    tuned_configs.clear_cache()
    try:
        for gpu, want in (("GPU A", tuned), ("GPU B", default_w4_config(4000, 8, 16, 2880))):
            monkeypatch.setattr(tuned_configs, "current_gpu", lambda g=gpu: g)
            assert w4_launch_config(4000, 8, 16, 2880, w4) == fit_w4_config(want, w4)
        monkeypatch.setattr(tuned_configs, "current_gpu", lambda: "GPU A")
        assert w4_launch_config(2, 8, 16, 2880, w4).split_k == 8  # nearest pair count: 2
        assert w4_launch_config(2, 8, 16, 2880, w4, deterministic=True).split_k == 1
        pinned = LaunchConfig(32, 64, 128, 1, 4, 3, w_major=1)
        with override_launch_config(pinned):
            assert w4_launch_config(4000, 8, 16, 2880, w4) == fit_w4_config(pinned, w4)
        monkeypatch.setenv(env.LAUNCH_CONFIG, "64,128,128,1,4,3,1,1")
        assert w4_launch_config(4000, 8, 16, 2880, w4) == fit_w4_config(LaunchConfig(64, 128, 128, 1, 4, 3, 1, 1), w4)
    finally:
        tuned_configs.clear_cache()


def test_dot_runs_pairs_64_column_blocks_on_the_tensor_cores():
    """Two pack blocks per dot in BM 16 tiles where a block is 64 columns (halves of 32 or of two
    16-groups) and the K step holds two; one elsewhere (128-column blocks, larger tiles, the FMA
    path, a 64-column K step)."""
    from fusedmoe.kernels.grouped_gemm_w4 import dot_runs

    def w4(name):
        return to_w4(_quantized(SCHEMES[name], 1, 16, 256), SCHEMES[name].w1)

    mx, nv, g16, g128 = w4("mxfp4"), w4("nvfp4"), w4("int4_g16_zp"), w4("int4_g128")
    dot, swap = LaunchConfig(16, 64, 128, 1, 4, 3), LaunchConfig(16, 128, 128, 1, 4, 3, w_major=1)
    assert [dot_runs(c, w) for c in (dot, swap) for w in (mx, nv, g16)] == [2] * 6
    assert dot_runs(swap, g128) == 1 and dot_runs(LaunchConfig(16, 64, 64, 1, 4, 3), mx) == 1
    assert dot_runs(LaunchConfig(64, 128, 128, 1, 4, 3, w_major=1), mx) == 1
    assert dot_runs(LaunchConfig(1, 64, 128, 1, 4, 4, w_major=1), mx) == 1


def test_dot_cat_one_dot_per_k_step_at_bm_32():
    """W-major tiles of 64-column blocks at BM 32 make one dot per K step; BM 16 (two-block dots),
    BM 64+, C-major tiles, 128-column blocks and a step of 8 blocks do not."""
    from fusedmoe.kernels.grouped_gemm_w4 import dot_cat

    def w4(name):
        return to_w4(_quantized(SCHEMES[name], 1, 16, 256), SCHEMES[name].w1)

    mx, nv, g128 = w4("mxfp4"), w4("nvfp4"), w4("int4_g128")
    swap = [LaunchConfig(bm, 128, 128, 1, 4, 3, w_major=1) for bm in (16, 32, 64, 128)]
    assert [dot_cat(c, w) for w in (mx, nv) for c in swap] == [False, True, False, False] * 2
    assert not dot_cat(swap[1], g128) and not dot_cat(LaunchConfig(32, 128, 128, 1, 4, 3), mx)
    assert not dot_cat(LaunchConfig(32, 128, 512, 1, 4, 3, w_major=1), mx)  # 8 blocks a step


def test_even_columns_drops_w_masks_only_on_e2m1_tensor_tiles():
    """W's column masks go (EVEN_N) where BLOCK_N divides the columns, on the tensor-core tiles of
    MXFP4 and NVFP4; int4 and the FMA path keep them (measured slower without: ``even_columns``)."""
    from fusedmoe.kernels.grouped_gemm_w4 import even_columns

    def w4(name):
        return to_w4(_quantized(SCHEMES[name], 1, 16, 256), SCHEMES[name].w1)

    mx, nv, g128 = w4("mxfp4"), w4("nvfp4"), w4("int4_g128")
    tiles = [LaunchConfig(bm, 64, 128, 1, 4, 3, w_major=wm) for bm, wm in ((16, 0), (32, 1), (128, 1))]
    assert all(even_columns(c, w, 2880) for c in tiles for w in (mx, nv))  # 2880 = 45 x 64
    assert not any(even_columns(c, w, 2880 + 32) for c in tiles for w in (mx, nv))
    assert not any(even_columns(c, g128, 4096) for c in tiles)
    assert not even_columns(LaunchConfig(1, 64, 128, 1, 4, 4, w_major=1), mx, 4096)


@pytest.mark.parametrize(
    ("scheme", "top_code", "one_mul"),
    [("mxfp4", 128, True), ("mxfp4", 129, False), ("mxfp4", 254, False), ("nvfp4", 0x40, True), ("nvfp4", 0x41, False)],
    ids=["mxfp4_scale_2", "mxfp4_scale_4", "mxfp4_scale_2^127", "nvfp4_scale_2", "nvfp4_scale_2.25"],
)
def test_e2m1_one_mul_only_where_every_scale_fits(scheme, top_code, one_mul):
    """The unpack folds 2^126 into the scale (one multiply) only where every scale of the tensor is
    at most 2, so 2^126 times it is a bf16 value; a scale above makes the whole tensor take two.
    ``select`` keeps the flag; ``as_w4`` (tensors without the converted object) says False."""
    from fusedmoe.quant.w4_layout import as_w4

    tq = SCHEMES[scheme].w1
    q = _quantized(SCHEMES[scheme], 2, 8, 64)
    codes = q.scale.view(torch.uint8)
    codes.copy_(torch.where(codes > top_code, torch.full_like(codes, top_code), codes))
    codes[1, 3, 0] = top_code
    w4 = to_w4(q, tq)
    assert w4.e2m1_one_mul is one_mul and w4.select(1).e2m1_one_mul is one_mul
    assert not to_w4(_quantized(SCHEMES["int4_g128"], 1, 8, 128), SCHEMES["int4_g128"].w1).e2m1_one_mul
    assert not as_w4(w4, tq, None).e2m1_one_mul


def test_fast_unpack_where_exact_and_on_the_gpu(monkeypatch):
    """The PTX unpack runs on a GPU only (the interpreter runs no PTX), on the tensor-core path for
    bf16 (and fp16 with int4), on the FMA path for e2m1 only (exact there), and not at all with
    FUSEDMOE_W4_PTX off; a value the knob cannot mean is an error naming it."""
    from fusedmoe import env
    from fusedmoe.errors import FusedMoEError
    from fusedmoe.kernels import grouped_gemm_w4 as gw4

    int4 = to_w4(_quantized(SCHEMES["int4_g128"], 1, 16, 256), SCHEMES["int4_g128"].w1)
    mx = to_w4(_quantized(SCHEMES["mxfp4"], 1, 16, 256), SCHEMES["mxfp4"].w1)
    dot, fma = LaunchConfig(16, 64, 128, 1, 4, 4, w_major=1), LaunchConfig(1, 32, 256, 1, 4, 4, w_major=1)
    assert gw4.fast_unpack(dot, int4, torch.bfloat16) == (not interpreting())  # none under the interpreter (CI)
    monkeypatch.setattr(gw4, "interpreting", lambda: False)
    assert gw4.fast_unpack(dot, int4, torch.bfloat16) and gw4.fast_unpack(dot, int4, torch.float16)
    assert gw4.fast_unpack(dot, mx, torch.bfloat16) and not gw4.fast_unpack(dot, mx, torch.float16)
    assert gw4.fast_unpack(fma, mx, torch.float16) and not gw4.fast_unpack(fma, int4, torch.bfloat16)
    fma_rows = LaunchConfig(4, 32, 256, 1, 4, 4, w_major=1)  # "fma" (BM 2-8): the fp32 decode
    assert not gw4.fast_unpack(fma_rows, mx, torch.bfloat16)
    assert not gw4.fast_unpack(dot, int4, torch.float32)
    monkeypatch.setenv(env.W4_PTX, "0")
    assert not gw4.fast_unpack(dot, int4, torch.bfloat16) and not gw4.fast_unpack(fma, mx, torch.bfloat16)
    monkeypatch.setenv(env.W4_PTX, "sometimes")
    with pytest.raises(FusedMoEError, match="FUSEDMOE_W4_PTX"):
        gw4.fast_unpack(dot, int4, torch.bfloat16)


SPLITS = {"5_steps_4_splits": (640, 128, 4), "7_steps_6_splits": (896, 128, 6), "2_steps_8_splits": (128, 64, 8),
          "56_steps_45_splits": (14336, 256, 45)}  # fmt: skip


@pytest.mark.parametrize("k, bk, split", list(SPLITS.values()), ids=list(SPLITS))
def test_fit_w4_config_leaves_no_split_without_k(k, bk, split):
    """The tensor-core loop is compiled assuming a non-empty K range (``tl.assume``): every split
    the fitted config makes starts below K."""
    w4 = to_w4(_quantized(SCHEMES["int4_g64"], 1, 16, k), SCHEMES["int4_g64"].w1, 64)
    cfg = fit_w4_config(LaunchConfig(16, 64, bk, 1, 4, 4, split_k=split, w_major=1), w4)
    steps = -(-w4.k_padded // cfg.block_k)
    per = -(-steps // cfg.split_k)
    assert 1 <= cfg.split_k <= split and (cfg.split_k - 1) * per < steps


# ---- the kernel against the float64 reference --------------------------------------------------

MODES = {  # (BM, w_major): how the operands meet
    "fma1": (1, 1),  # FMA, [BN, PK/2] partial sums reduced after the loop
    "fma": (2, 0),  # FMA, one reduction per K step and A row
    "dot": (16, 0),  # tensor cores, C = A @ W^T
    "swap": (16, 1),  # tensor cores, C^T = W @ A^T
}
CAT_MODE = (32, 1)  # "swap" at BM 32: one dot per K step for 64-column blocks (``dot_cat``)
# (label, T, E, top-k, routing, N out, K): the labelled edge cases (STYLE point 7)
EDGES = [
    ("empty_expert", 9, 5, 2, "skip_last", 40, 128),
    ("one_expert", 10, 4, 1, "one_expert", 32, 128),
    ("TK_not_multiple", 11, 6, 3, "random", 24, 128),
    ("prime_E_odd_N", 13, 7, 2, "random", 37, 128),
    ("K_padded", 6, 4, 2, "random", 32, 192),  # PK 128 (or 64) does not divide K: padded
    ("T1", 1, 4, 2, "random", 32, 128),
    ("T0", 0, 4, 2, "random", 32, 128),
]
ACTS = [None, Activation.SILU, Activation.SWIGLUOAI]


@dataclasses.dataclass
class Case:
    scheme: str
    mode: str
    layout: str = "standard"
    act: Activation | None = None
    split: int = 1
    edge: tuple = EDGES[2]
    bias: bool = True
    loads: int = 0  # LaunchConfig.scale_loads

    @property
    def id(self) -> str:
        act = "plain" if self.act is None else self.act.value
        tail = ("", "-ahead", "-at_start")[self.loads]
        return f"{self.scheme}-{self.mode}-{self.layout}-{act}-s{self.split}-{self.edge[0]}{tail}"


def _cases() -> list[Case]:
    out = []
    for i, scheme in enumerate(SCHEMES):
        for j, mode in enumerate(MODES):
            r = i * len(MODES) + j
            out.append(
                Case(
                    scheme,
                    mode,
                    ("standard", "batched")[r % 2],
                    ACTS[r % 3],
                    (1, 2, 3)[(r // 2) % 3],
                    EDGES[r % 5],
                    bias=r % 4 != 3,
                )  # fmt: skip
            )
    for k, edge in enumerate(EDGES):
        out.append(Case(("int4_g64_zp", "nvfp4", "mxfp4")[k % 3], ("fma1", "swap")[k % 2], edge=edge, split=1 + k % 2))
    # two pack blocks per dot where K ends inside the second (K 192, BK 128: its bytes, scales
    # and A columns masked), halves of one and of two groups
    for i, scheme in enumerate(("mxfp4", "nvfp4", "int4_g16_zp", "int4_g32_actorder")):
        out.append(Case(scheme, ("dot", "swap")[i % 2], act=ACTS[i % 3], edge=EDGES[4], split=1))
    # one dot per K step (BM 32 W-major): the step's blocks concatenated in K order, K ending
    # inside the second block (K 192), halves of one and of two groups, both layouts, split-K
    for i, scheme in enumerate(("mxfp4", "nvfp4", "int4_g16_zp", "int4_g32_actorder")):
        out.append(Case(scheme, "cat", ("standard", "batched")[i % 2], ACTS[(i + 1) % 3], (1, 3)[i // 2], EDGES[4]))
    # scale (and zero-point) codes loaded a K step ahead or at the step's start (``scale_loads``):
    # every tensor-core mode, a half of one group, of two (NVFP4), two runs a dot (BK 128),
    # act-order, zero points, K ending inside a step (K 192: the last step's groups past K
    # masked), split-K, both layouts
    for loads in (1, 2):
        for i, scheme in enumerate(("mxfp4", "nvfp4", "int4_g16_zp", "int4_g32_actorder", "int4_g128", "mxfp4")):
            mode, split, edge = ("dot", "swap", "cat")[(i + loads) % 3], (1, 2, 3)[i % 3], EDGES[(4, 2)[i // 4]]
            layout = ("standard", "batched")[(i + loads) % 2]
            out.append(Case(scheme, mode, layout, ACTS[i % 3], split, edge, loads=loads))
    return out


CASES = _cases()


def _epilogue(act: Activation | None) -> ActEpilogue | None:
    if act is None:
        return None
    return ActEpilogue(act, gate_up_interleaved=act is Activation.SWIGLUOAI, swiglu_limit=1.0)


def run_case(c: Case, out_dtype=torch.float32, device: str = DEVICE, config: LaunchConfig | None = None) -> None:
    """One problem of ``c`` through the public op (w4 weights) vs the float64 reference (original weights)."""
    scheme = SCHEMES[c.scheme]
    label, t, e, k, routing_kind, n, kd = c.edge
    if kd % scheme.w1.granularity.group_size:
        kd = 256
    ep = _epilogue(c.act)
    n_w = 2 * n if ep is not None and ep.activation.is_gated else n
    seed = zlib.crc32(c.id.encode())
    gen = torch.Generator().manual_seed(seed)
    bm, w_major = CAT_MODE if c.mode == "cat" else MODES[c.mode]
    if config is None:
        # BN 64 (a gated activation's 32 output columns read 64 W rows): one or two column tiles
        # the FMA path steps one pack block (BK 64) or two (BK 256, odd splits); the tensor
        # cores BK 64 or, odd splits, 128: two 64-column blocks per dot (``dot_runs``)
        bk = (256 if bm < 16 else 128) if c.split % 2 else 64
        config = LaunchConfig(bm, 32 if n_w > n else 64, bk, 2, 4, 2, c.split, w_major, scale_loads=c.loads)
    counts = torch.tensor([(t * k) % 7, 0, 5, 1, 9][: max(2, min(e, 5))], dtype=torch.int32)
    if c.layout == "batched":  # experts of a partial block, none, a few, one, two blocks
        e = counts.numel()
    q = _quantized(scheme, e, n_w, kd, seed=seed, device=device)
    w4 = to_w4(q, scheme.w1)
    bias = (torch.randn(e, n_w, generator=gen) * 0.1).to(torch.bfloat16).to(device) if c.bias else None
    kw = dict(bias=bias, act=ep)
    wq, w4 = Operand(q, scheme.w1), Operand(w4, scheme.w1)
    if c.layout == "standard":
        ids, tw = random_topk(t, e, k, gen, routing_kind)
        r = moe_align_ref(ids.to(device), e, config.block_m)
        x = torch.randn(t, kd, generator=gen).to(torch.bfloat16).to(device)
        extra = dict(a_div=k, topk_weights=tw.to(device))
        out = poison_(torch.empty(t * k, n, dtype=out_dtype, device=device))
        x = Operand.of(x)
        grouped_gemm(x, w4, r, out=out, config=config, **kw, **extra)
        ref = grouped_gemm_ref(x, wq, r, **kw, **extra)
    else:
        m_max = int(counts.max()) + 1
        counts = counts.to(device)
        x = torch.randn(e, m_max, kd, generator=gen).to(torch.bfloat16).to(device)
        rw = torch.rand(e, m_max, generator=gen).to(device)
        out = poison_(torch.empty(e, m_max, n, dtype=out_dtype, device=device))
        x = Operand.of(x)
        grouped_gemm_batched(x, w4, counts, out=out, row_weights=rw, config=config, **kw)
        ref = grouped_gemm_batched_ref(x, wq, counts, row_weights=rw, **kw)
    tol = 1e-5 if interpreting() and out_dtype == torch.float32 else tolerance(scheme, torch.bfloat16)
    written = ~ref.isnan()
    assert torch.equal(~out.isnan(), written), "unwritten or wrongly written elements"
    if written.any():
        err = rel_error(out[written], ref[written])
        assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_w4_gemm(case):
    run_case(case)


@needs_triton
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
def test_w4_gemm_one_dot_of_four_blocks(scheme):
    """BK 256 at BM 32 W-major: four 64-column blocks in one dot (``dot_cat``), K 192 ending inside
    the step's third block (blocks three and four masked)."""
    config = LaunchConfig(32, 64, 256, 2, 4, 2, 1, 1)
    run_case(Case(scheme, "cat", act=Activation.SILU, edge=EDGES[4]), config=gated_act_config(config))


@needs_triton
def test_w4_gemm_bf16_output():
    """C in the model dtype: one rounding at the store, on the reduce path too (split 2)."""
    run_case(Case("int4_g128", "swap", act=Activation.SILU, split=2, edge=EDGES[0]), out_dtype=torch.bfloat16)


def test_w4_refuses_to_track_an_abs_max():
    """The 4-bit kernel has no abs-max epilogue (its activations are float): asked for one, it says
    so rather than leaving the buffer at 0 (a scale of 1 downstream)."""
    from fusedmoe.errors import FusedMoEError

    scheme = SCHEMES["int4_g128"]
    q = _quantized(scheme, 2, 64, 128, device=DEVICE)
    w4 = Operand(to_w4(q, scheme.w1), scheme.w1)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    act = ActEpilogue(Activation.SILU, track_amax=True)
    call = GemmCall(moe_align_ref(ids, 2, 16), a_div=2, act=act, act_scale=torch.zeros(1, device=DEVICE))
    a = Operand.of(torch.zeros(1, 128, dtype=torch.bfloat16, device=DEVICE))
    out = torch.empty(2, 32, dtype=torch.bfloat16, device=DEVICE)
    cfg = LaunchConfig(16, 32, 64, 1, 4, 2)
    with pytest.raises(FusedMoEError, match="act.track_amax"):
        w4_gemm_launch(a, w4, out, GemmFormat.of(scheme.w1, None, 64, 128), cfg, call)


@needs_triton
@pytest.mark.parametrize("split", [1, 3])
def test_split_k_partials_summed_by_moe_sum(split):
    """GEMM2 of the standard layout: with reduce=False the split-K partials (router weight
    applied, bias added once) go straight to moe_sum, which sums k and s in order; an expert map
    makes moe_sum skip the pairs of other ranks (whose partial rows are never written)."""
    scheme = SCHEMES["mxfp4"]
    gen = torch.Generator().manual_seed(3)
    t, e_glob, k, h, i = 7, 6, 2, 48, 128
    emap = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32, device=DEVICE)
    ids, tw = random_topk(t, e_glob, k, gen)
    ids, tw = ids.to(DEVICE), tw.to(DEVICE)
    q = _quantized(scheme, 4, h, i, device=DEVICE)
    w4 = to_w4(q, scheme.w1)
    cfg = LaunchConfig(1, 32, 64, 1, 4, 2, split, 1)
    r = moe_align_ref(ids, 4, 1, expert_map=emap)
    a = Operand.of(torch.randn(t * k, i, generator=gen).to(torch.bfloat16).to(DEVICE))
    bias = (torch.randn(4, h, generator=gen) * 0.1).to(DEVICE)
    fmt = GemmFormat.of(scheme.w1, None, h, i)
    y = torch.empty(t * k, h, device=DEVICE)  # written without split-K only
    partials = poison_(torch.empty(split * t * k * h, device=DEVICE))
    w4 = Operand(w4, scheme.w1)
    p = w4_gemm_launch(a, w4, y, fmt, cfg, GemmCall(r, bias=bias, route_weights=tw), partials=partials, reduce=False)
    c = y.view(t, k, h) if p is None else p.view(p.shape[0], t, k, h)  # splits: at most K steps
    out = moe_sum(c, torch.empty(t, h, device=DEVICE), topk_ids=ids, expert_map=emap, num_local_experts=4)
    ref = grouped_gemm_ref(a, Operand(q, scheme.w1), r, bias=bias, topk_weights=tw)
    local = (emap[ids.long()] >= 0).unsqueeze(-1)
    want = torch.where(local, ref.view(t, k, h).nan_to_num(0.0), torch.zeros((), dtype=ref.dtype)).sum(1)
    assert rel_error(out, want) <= 1e-5
    assert torch.allclose(moe_sum_ref(c, topk_ids=ids, expert_map=emap, num_local_experts=4), out, rtol=1e-5, atol=1e-6)


@needs_triton
def test_kbench_script_selftest(tmp_path):
    """``scripts/kbench_w4.py --selftest`` end to end (tiny, interpreter, no timing): every variant
    of the decode, small, mid and prefill regimes runs and matches the float64 reference."""
    if torch.cuda.is_available():
        pytest.skip("the selftest runs under the interpreter; the GPU runs the script itself")
    root = pathlib.Path(__file__).resolve().parents[2]
    args = ["--selftest", "--schemes", "mxfp4,int4_g128_zp", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    run_ = subprocess.run([sys.executable, str(root / "scripts" / "kbench_w4.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run_.returncode == 0, (run_.stdout + run_.stderr)[-3000:]
    assert ", 0 over tolerance, 0 failures" in run_.stdout, run_.stdout[-3000:]
    assert (tmp_path / "kbench_w4.json").exists()


def test_kbench_variants_parse():
    """``scripts/kbench_w4.py --variants``: explicit configs, the cell's default with fields
    replaced, and environment variables set around the launch."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("kbench_w4", root / "scripts" / "kbench_w4.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kbench_w4"] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["kbench_w4"]
    got = mod.parse_variants("a=128,64,128,8,4,3,2,1; b=default:block_k=64+X=1+Y=z;c=default")
    assert [n for n, _, _ in got] == ["a", "b", "c"]
    assert got[0][1] == LaunchConfig(128, 64, 128, 8, 4, 3, split_k=2, w_major=1) and got[0][2] == {}
    assert got[1][1:] == ({"block_k": 64}, {"X": "1", "Y": "z"}) and got[2][1:] == ({}, {})
    for bad in ("a=1,2,3", "b=default:bogus=1", "c"):
        with pytest.raises(SystemExit, match="--variants: expected"):
            mod.parse_variants(bad)
    seen = {}
    run = mod._with_env(lambda: seen.update(x=os.environ.get("KBENCH_TEST_VAR")), {"KBENCH_TEST_VAR": "on"})
    run()
    assert seen == {"x": "on"} and "KBENCH_TEST_VAR" not in os.environ


# ---- real shapes (GPU) --------------------------------------------------------------------------

REAL = [  # (E, H, I, T, top-k): Mixtral-like decode and a prefill batch, Qwen3-like mid batch
    (8, 4096, 1536, 1, 2),
    (8, 4096, 1536, 300, 2),
    (128, 2048, 768, 64, 8),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("shape", REAL, ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL])
@pytest.mark.parametrize("scheme", ["int4_g128", "int4_g64_zp", "int4_g32_actorder", "mxfp4", "nvfp4"])
def test_w4_gemm_real_shapes(scheme, shape, gemm):
    """The configs the layer would pick (``w4_launch_config``), bf16 output, fused silu on GEMM1."""
    e, h, i, t, k = shape
    n, kd, act = (i, h, Activation.SILU) if gemm == "gemm1" else (h, i, None)
    rows = t * k
    w_rows = 2 * n if act is not None else n
    probe = to_w4(_quantized(SCHEMES[scheme], 1, 16, kd), SCHEMES[scheme].w1)
    cfg = w4_launch_config(rows, e, w_rows, kd, probe, gated=act is not None)
    if act is not None:
        cfg = gated_act_config(cfg)
    case = Case(scheme, "fma1", act=act, edge=(f"real_{gemm}", t, e, k, "random", n, kd))
    run_case(case, out_dtype=torch.bfloat16, config=cfg)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("shape", REAL[1:], ids=[f"E{s[0]}_H{s[1]}_I{s[2]}_T{s[3]}" for s in REAL[1:]])
@pytest.mark.parametrize("scheme", ["int4_g64_zp", "int4_g32_actorder", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("loads", [1, 2], ids=["ahead", "at_start"])
def test_w4_gemm_real_shapes_scale_loads(scheme, shape, gemm, loads):
    """The layer's tensor-core configs with the scale codes loaded a K step ahead or at the step's
    start (``LaunchConfig.scale_loads``), as a tuned entry may ask."""
    e, h, i, t, k = shape
    n, kd, act = (i, h, Activation.SILU) if gemm == "gemm1" else (h, i, None)
    w_rows = 2 * n if act is not None else n
    probe = to_w4(_quantized(SCHEMES[scheme], 1, 16, kd), SCHEMES[scheme].w1)
    cfg = w4_launch_config(t * k, e, w_rows, kd, probe, gated=act is not None)
    cfg = dataclasses.replace(gated_act_config(cfg) if act is not None else cfg, scale_loads=loads)
    assert cfg.block_m >= 16
    case = Case(scheme, "swap", act=act, edge=(f"real_{gemm}_loads{loads}", t, e, k, "random", n, kd))
    run_case(case, out_dtype=torch.bfloat16, config=cfg)
