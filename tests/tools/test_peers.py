"""The recorded peer times: parsing the notes, the committed JSON, our ratio to the best peer and
its geometric mean per scheme (all on the CPU: the bench attaches them to its GPU rows)."""

from __future__ import annotations

import json
import math

import pytest

from fusedmoe.quant import QuantScheme
from fusedmoe.tools import peers
from fusedmoe.tools.bench import Row
from fusedmoe.tools.peers import (
    PeerTimes,
    attach_peers,
    differs_from_peers,
    geomean,
    load_peers,
    parse_notes,
    ratio_summary,
)
from fusedmoe.tools.presets import PRESETS, preset_config, preset_router

NOTES = """# Peer MoE layer times on one H100 (measured 2026-11-25)

Facts for targets: the whole layer from router logits.
H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0; ceilings measured in the run: copy 3.00 TB/s,
bf16 matmul 787 TFLOP/s, fp8 matmul 1315 TFLOP/s.

Peers: vLLM's Triton fused_moe; Marlin MoE.

## qwen3-30b-a3b mxfp4

| T | floor | fusedmoe | vLLM Triton | best peer | who | ratio |
|---|---|---|---|---|---|---|
| 1 | 6.7 | 43.1 | n/a | 44.5 | Marlin MoE (vLLM) | 0.97 |
| 16 | 66.9 | 220.0 | n/a | 122.4 | Marlin MoE (vLLM) | 1.80 |

## mixtral-8x7b fp8_block

| T | floor | fusedmoe | vLLM Triton | best peer | who | ratio |
|---|---|---|---|---|---|---|
| 1 | 117.5 | 176.1 | 161.1 | 161.1 | vLLM Triton | 1.09 |

## Eager calls (no CUDA graph), wall time per call with a synchronize, median of 25

| preset | scheme | T | fusedmoe fused_moe() | fusedmoe MoEKernel (as the layer calls it) | vLLM fused_experts |
|---|---|---|---|---|---|
| mixtral-8x7b | fp8_block | 1 | 3866.4 | 750.6 | 428.3 |

## End to end: transformers generate

| model | batch | experts | prefill ms | decode ms/step |
|---|---|---|---|---|
| qwen3 x4 layers | 1 | eager | 135.6 | 18.77 |
"""


def test_notes_parse_into_cells_eager_cells_and_the_source():
    data = parse_notes(NOTES)
    assert data["cells"][0] == {
        "preset": "qwen3-30b-a3b", "scheme": "mxfp4", "tokens": 1, "floor_us": 6.7, "fusedmoe_us": 43.1,
        "vllm_triton_us": None, "best_us": 44.5, "best_who": "Marlin MoE (vLLM)", "ratio": 0.97,
    }  # fmt: skip
    assert [(c["preset"], c["scheme"], c["tokens"]) for c in data["cells"]] == [
        ("qwen3-30b-a3b", "mxfp4", 1),
        ("qwen3-30b-a3b", "mxfp4", 16),
        ("mixtral-8x7b", "fp8_block", 1),
    ]
    assert data["eager"] == [
        {
            "preset": "mixtral-8x7b",
            "scheme": "fp8_block",
            "tokens": 1,
            "fused_moe_us": 3866.4,
            "moe_kernel_us": 750.6,
            "vllm_fused_experts_us": 428.3,
        }  # fmt: skip
    ]
    assert data["skipped"] == ["End to end: transformers generate"]
    src = data["source"]
    assert (src["gpu"], src["torch"], src["triton"], src["date"]) == (
        "H100 80GB HBM3",
        "2.11.0+cu130",
        "3.6.0",
        "2026-11-25",
    )
    assert (src["copy_tb_s"], src["bf16_tflop_s"], src["fp8_tflop_s"]) == (3.0, 787.0, 1315.0)
    assert src["peers"].startswith("Peers: vLLM") and src["units"] == "us"


@pytest.mark.parametrize(
    "change, match",
    [
        (("| T | floor | fusedmoe |", "| T | floor | ours |"), "unknown columns"),
        (("## mixtral-8x7b fp8_block", "## mixtral-8x7b w4a8"), "no mapping"),
        (("| mixtral-8x7b | fp8_block | 1 |", "| grok | fp8_block | 1 |"), "unknown preset"),
    ],
    ids=["column", "scheme", "preset"],
)
def test_notes_of_another_shape_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        parse_notes(NOTES.replace(*change))


def test_every_scheme_of_the_notes_is_a_scheme_of_ours():
    for name in peers.SCHEME_NAMES:
        assert QuantScheme.by_name(peers.scheme_name(name)).name == name


def test_the_committed_json_holds_consistent_cells():
    data = json.loads(peers.REPO_JSON.read_text())
    assert len(data["cells"]) == 76 and len(data["eager"]) == 10
    assert data["source"]["gpu"].startswith("H100")
    for c in data["cells"] + data["eager"]:
        assert c["preset"] in PRESETS and QuantScheme.by_name(c["scheme"])
    for c in data["cells"]:
        assert abs(c["ratio"] - c["fusedmoe_us"] / c["best_us"]) <= 0.006  # the notes round to 2 places
        assert c["vllm_triton_us"] is None or c["best_us"] <= c["vllm_triton_us"]
    assert load_peers().path == str(peers.REPO_JSON)  # the default where the repository is there
    assert load_peers("none") is None


def test_geomean():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([2.0, None, 0.0, 8.0]) == pytest.approx(4.0)  # None and non-positive left out
    assert geomean([]) is None and geomean([None]) is None


def _row(provider="fusedmoe", ms=0.05, t=1, scheme="fp8_block", mode="graph", preset="mixtral-8x7b"):
    return Row(preset, scheme, t, provider, mode, ms, ms / 2, 50.0, "memory", 1.0, 1.0, 2, "cmd")


def test_ratios_attach_to_our_graph_rows_and_summarise_per_scheme(tmp_path):
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(parse_notes(NOTES)))
    pt = load_peers(path)
    assert isinstance(pt, PeerTimes) and pt.path == str(path)
    rows = [
        _row(ms=0.1611 * 2),  # twice the best peer
        _row(mode="eager", ms=0.2),  # eager rows get no graph ratio
        _row(provider="torch_grouped_mm", ms=0.1),
        _row(ms=0.0445 / 2, scheme="mxfp4", preset="qwen3-30b-a3b"),
        _row(ms=0.1224 * 2, t=16, scheme="mxfp4", preset="qwen3-30b-a3b"),
        _row(ms=1.0, t=64, scheme="mxfp4", preset="qwen3-30b-a3b"),  # no peer cell
    ]
    rows[0].eager_wall_us = 428.3 * 3
    attach_peers(rows, pt)
    assert rows[0].peer_us == 161.1 and rows[0].peer_who == "vLLM Triton" and rows[0].peer_ratio == pytest.approx(2)
    assert rows[0].peer_ratio_recorded == 1.09
    assert rows[0].peer_eager_us == 428.3 and rows[0].eager_ratio == pytest.approx(3)
    assert rows[1].peer_ratio is None and rows[2].peer_ratio is None and rows[5].peer_ratio is None
    s = {x["scheme"]: x for x in ratio_summary(rows)}
    assert s["mxfp4"]["cells"] == 2 and s["mxfp4"]["geomean"] == pytest.approx(1.0)  # 0.5 and 2
    assert s["mxfp4"]["recorded"] == pytest.approx(math.sqrt(0.97 * 1.80))
    assert s["mxfp4"]["eager_cells"] == 0 and s["mxfp4"]["eager_geomean"] is None
    assert s["fp8_block"]["eager_cells"] == 1 and s["fp8_block"]["eager_geomean"] == pytest.approx(3)
    attach_peers(rows, None)  # no peers: nothing changes
    assert rows[0].peer_ratio == pytest.approx(2)


def test_presets_whose_layer_differs_from_the_peers_say_how():
    why = {p: differs_from_peers(preset_config(p), *preset_router(p)) for p in PRESETS}
    assert why["mixtral-8x7b"] is None and why["qwen3-30b-a3b"] is None
    assert why["deepseek-v3"] == "sigmoid routing in groups with a correction bias"
    assert why["gpt-oss-20b"] == "swigluoai activation, expert biases"
