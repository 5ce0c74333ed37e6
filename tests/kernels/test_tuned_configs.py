"""Launch configs as data: precedence (override > env pin > tuned JSON > heuristic) and nearest-key lookup."""

from __future__ import annotations

import json

import pytest

from fusedmoe import env
from fusedmoe.kernels import tuned_configs
from fusedmoe.kernels.launch_config import (
    LaunchConfig,
    default_launch_config,
    override_launch_config,
    pick_launch_config,
)

GPU = "NVIDIA H200"
A = LaunchConfig(16, 64, 128, 1, 4, 3)
B = LaunchConfig(64, 128, 64, 8, 8, 4)


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    path = tuned_configs.config_path(tmp_path, GPU, "bf16", 8, 256, 128)
    path.parent.mkdir(parents=True)
    cfgs = {"1": A.__dict__, "1024": B.__dict__}
    path.write_text(json.dumps({"gpu": GPU, "scheme": "bf16", "triton": "3.6.0", "configs": cfgs}))
    monkeypatch.setenv(env.CONFIG_DIR, str(tmp_path))
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: GPU)
    tuned_configs.clear_cache()
    yield tmp_path
    tuned_configs.clear_cache()


def test_gpu_key_is_a_folder_name():
    assert tuned_configs.gpu_key("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


@pytest.mark.parametrize("m,want", [(1, A), (16, A), (511, A), (513, B), (1024, B), (100000, B)])
def test_nearest_token_count_wins(tuned_dir, m, want):
    assert pick_launch_config(m, 8, 256, 128, "bf16") == want


def test_other_shapes_and_schemes_fall_back_to_the_heuristic(tuned_dir):
    assert pick_launch_config(16, 8, 256, 256, "bf16") == default_launch_config(16, 8, 256, 256, "bf16")
    assert pick_launch_config(16, 8, 256, 128, "fp8") == default_launch_config(16, 8, 256, 128, "fp8")


def test_override_and_env_pin_take_precedence(tuned_dir, monkeypatch):
    c = LaunchConfig(32, 32, 32, 1, 2, 2)
    with override_launch_config(c):
        assert pick_launch_config(1, 8, 256, 128, "bf16") == c
    monkeypatch.setenv("FUSEDMOE_LAUNCH_CONFIG", "32,64,32,4,4,2")
    assert pick_launch_config(1, 8, 256, 128, "bf16") == LaunchConfig(32, 64, 32, 4, 4, 2)


def test_no_gpu_means_no_tuned_lookup(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: None)
    assert tuned_configs.lookup(16, 8, 256, 128, "bf16") is None


@pytest.mark.parametrize("key", ["fp8", "int8", "fp8_block", "int8_block", "w8a16", "int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("k", [8, 16, 24])
def test_heuristic_keeps_the_dot_minimum_for_tiny_k(key, k):
    # Hopper's tl.dot rejects 8-bit operands with K < 32 (a CompilationError the GPU fuzzer hit
    # at H = I = 8, fp8 per-tensor); masked tiles make a longer BK safe
    assert default_launch_config(1, 1, 16, k, key).block_k >= 32
    assert default_launch_config(1, 1, 16, k, "bf16").block_k >= 16
