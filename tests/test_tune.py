"""The tuner writes files the runtime reads back (interpreter: two candidates, tiny layer)."""

from __future__ import annotations

import json

import pytest

from fusedmoe.kernels import tuned_configs
from fusedmoe.kernels.launch_config import LaunchConfig, pick_launch_config
from fusedmoe.tune import candidates, tune


def test_candidates_keep_small_tiles_for_decode():
    dec = candidates("quick", 8, 64)  # 8 pairs over 64 experts
    assert dec and all(c.block_m == 16 for c in dec)
    assert any(c.block_m == 128 for c in candidates("quick", 64 * 512, 64))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """Both GEMMs of a tiny layer, tuned once (two candidates each, under the interpreter)."""
    out = tmp_path_factory.mktemp("tuned")
    paths = tune(
        "small",
        "bf16",
        [1, 8],
        out_dir=out,
        space="tiny",
        device="cpu",
        num_experts=4,
        hidden_size=64,
        intermediate_size=32,
    )
    return out, paths


def test_tuned_files_round_trip_into_pick_launch_config(tuned, monkeypatch):
    tmp_path, paths = tuned
    assert len(paths) == 2
    data = json.loads(paths[0].read_text())
    assert set(data["configs"]) == {"2", "16"}  # pairs = T * K with K = 2
    monkeypatch.setenv(tuned_configs.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: "cpu-interpreter")
    tuned_configs.clear_cache()
    got = pick_launch_config(2, data["E"], data["N"], data["K"], data["scheme"])
    assert got == LaunchConfig(**data["configs"]["2"])
    tuned_configs.clear_cache()


def test_second_gemm_is_tuned_under_the_first_gemms_block_m(tuned):
    _, paths = tuned
    first, second = (json.loads(p.read_text()) for p in paths)
    for pairs, cfg in first["configs"].items():
        assert second["configs"][pairs]["block_m"] == cfg["block_m"]
    assert candidates("quick", 4096, 8, block_m=32) and all(c.block_m == 32 for c in candidates("quick", 4096, 8, 32))
