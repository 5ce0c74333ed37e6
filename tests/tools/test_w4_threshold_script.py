"""``scripts/w4_threshold.py``: the written-out thresholds read off bench runs of both paths."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))

from w4_threshold import ratios, threshold, w4_format  # noqa: E402


def test_formats_of_bench_schemes():
    assert w4_format("mxfp4") == "mxfp4" and w4_format("nvfp4_w4a16") == "nvfp4"
    assert w4_format("int4_g128") == "int4"
    assert w4_format("bf16") is None and w4_format("fp8_block") is None and w4_format("mxfp4_mxfp8") is None


def test_threshold_is_where_every_larger_count_gains():
    # mixtral-8x7b: T x 2 / 8 rows per expert; qwen3-30b-a3b: T x 8 / 128
    off = {("mixtral-8x7b", "mxfp4", 1024): 2.4, ("mixtral-8x7b", "mxfp4", 2048): 4.2,
           ("qwen3-30b-a3b", "mxfp4", 8192): 1.8, ("qwen3-30b-a3b", "mxfp4", 4096): 1.0,
           ("mixtral-8x7b", "bf16", 4096): 4.7}  # fmt: skip
    deq = {k: v / 1.2 for k, v in off.items()}
    deq[("mixtral-8x7b", "mxfp4", 1024)] = 2.6  # 256 rows per expert: slower
    got = ratios([(off, deq)])
    assert set(got) == {"mxfp4"}
    assert sorted(got["mxfp4"]) == [256, 512]  # qwen3 T = 4096 and 8192: 256 and 512
    assert threshold(got["mxfp4"]) == 512
    assert threshold({256: {"a": 1.1}, 512: {"a": 0.9}, 1024: {"a": 1.2}}) == 1024  # a loss above stops it
    assert threshold({256: {"a": 0.9}}) is None
