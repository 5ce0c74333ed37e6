"""Class 5 (and the checkpoint side of 6 and 9): checkpoint folders that are wrong.

Before: config.json with fewer experts than the files hold built the smaller layer (12 of 15
formats); a tensor in two shards silently won in one; a truncated file raised an error naming
no file; loader errors named fusedmoe's parameters (``w13_weight``) instead of the checkpoint
key. Folders are written here by hand (a Mixtral layer of 4 experts, H 64, I 32, in float32 or
per-tensor fp8 with static activation scales; gpt-oss fused experts), in milliseconds.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from robust_helpers import raises_clearly, robust

from fusedmoe.checkpoints import load_layer, run_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

E, H, I = 4, 64, 32
BLOCK = "model.layers.0.block_sparse_moe"


def _config(**kw) -> dict:
    cfg = dict(model_type="mixtral", num_hidden_layers=1, hidden_size=H, num_local_experts=E, num_experts_per_tok=2,
               intermediate_size=I, hidden_act="silu", torch_dtype="float32")  # fmt: skip
    return {**cfg, **kw}


def _tensors(experts: int = E, fp8: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"{BLOCK}.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(experts):
        for name, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            w = torch.randn(*shape, generator=g) * shape[1] ** -0.5
            key = f"{BLOCK}.experts.{e}.{name}"
            if fp8:
                s = w.abs().max() / 448
                out[f"{key}.weight"] = (w / s).to(torch.float8_e4m3fn)
                out[f"{key}.weight_scale"] = s.reshape(())
                out[f"{key}.input_scale"] = torch.tensor(0.01)
            else:
                out[f"{key}.weight"] = w
    return out


def _write(path, config: dict, shards: dict[str, dict[str, torch.Tensor]]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name, tensors in shards.items():
        safetensors_torch.save_file(tensors, os.path.join(path, name))
    return str(path)


FP8 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}


@robust(5, "reference")
@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8_static"])
def test_a_sound_checkpoint_equals_the_reference(tmp_path, fp8):
    path = _write(tmp_path, _config(**(FP8 if fp8 else {})), {"model.safetensors": _tensors(fp8=fp8)})
    r = run_checkpoint(path, "cpu", 5)
    assert r["passed"], r


@robust(5, "error")
@pytest.mark.parametrize("config_experts,file_experts", [(3, 4), (2, 4), (1, 4)])
def test_config_with_fewer_experts_than_the_files_is_refused(tmp_path, config_experts, file_experts):
    tensors = _tensors(file_experts)
    tensors[f"{BLOCK}.gate.weight"] = tensors[f"{BLOCK}.gate.weight"][:config_experts]
    path = _write(tmp_path, _config(num_local_experts=config_experts, num_experts_per_tok=1),
                  {"model.safetensors": tensors})  # fmt: skip
    raises_clearly(lambda: load_layer(path, backend="cpu"), "config.json", f"{BLOCK}.experts.{config_experts}")


@robust(5, "error")
def test_config_with_more_experts_than_the_files_names_the_missing_tensor(tmp_path):
    path = _write(tmp_path, _config(num_local_experts=6), {"model.safetensors": _tensors()})
    raises_clearly(lambda: load_layer(path, backend="cpu"), f"{BLOCK}.experts.4.w1.weight")


@robust(5, "error")
@pytest.mark.parametrize("key", ["experts.2.w3.weight", "gate.weight"])
def test_a_tensor_in_two_shards_is_refused_naming_both_files(tmp_path, key):
    t = _tensors()
    dup = {f"{BLOCK}.{key}": t[f"{BLOCK}.{key}"].clone()}
    path = _write(tmp_path, _config(), {"model-00001-of-00002.safetensors": t, "model-00002-of-00002.safetensors": dup})
    msg = raises_clearly(lambda: load_layer(path, backend="cpu"), f"{BLOCK}.{key}")
    assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg


@robust(5, "error")
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header_only"])
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage):
    path = _write(tmp_path, _config(), {"a.safetensors": _tensors(), "b.safetensors": {"extra": torch.zeros(4)}})
    f = os.path.join(path, "b.safetensors")
    data = open(f, "rb").read()
    cut = {"truncated": data[: len(data) - 7], "garbage": b"\x00\xff" * 40, "empty": b"", "header_only": data[:8]}
    with open(f, "wb") as fh:
        fh.write(cut[damage])
    raises_clearly(lambda: load_layer(path, backend="cpu"), "b.safetensors")


@robust(5, "error")
@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_an_unreadable_config_json_is_refused_naming_it(tmp_path, text):
    path = _write(tmp_path, _config(), {"model.safetensors": _tensors()})
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text)
    raises_clearly(lambda: load_layer(path, backend="cpu"), "config.json")


@robust(9, "error")
@pytest.mark.parametrize("name,shape", [("w1", (I + 8, H)), ("w2", (H, I - 1)), ("w3", (I, H + 2))])
def test_a_tensor_of_the_wrong_shape_is_named_by_its_checkpoint_key(tmp_path, name, shape):
    t = _tensors()
    t[f"{BLOCK}.experts.1.{name}.weight"] = torch.randn(*shape)
    path = _write(tmp_path, _config(), {"model.safetensors": t})
    raises_clearly(lambda: load_layer(path, backend="cpu"), f"{BLOCK}.experts.1.{name}", "model.safetensors")


@robust(6, "error")
@pytest.mark.parametrize("value", [0.0, -0.5, float("inf")])
def test_a_static_input_scale_that_is_not_positive_is_refused(tmp_path, value):
    t = _tensors(fp8=True)
    t[f"{BLOCK}.experts.3.w2.input_scale"] = torch.tensor(value)
    path = _write(tmp_path, _config(**FP8), {"model.safetensors": t})
    raises_clearly(lambda: load_layer(path, backend="cpu"), f"{BLOCK}.experts.3.w2", "> 0")


@robust(5, "error")
def test_fused_experts_with_another_expert_count_are_refused(tmp_path):
    cfg = dict(model_type="gpt_oss", num_hidden_layers=1, hidden_size=H, num_local_experts=E, num_experts_per_tok=2,
               intermediate_size=I, torch_dtype="float32")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    blk = "model.layers.0.mlp"
    t = {
        f"{blk}.router.weight": torch.randn(E, H, generator=g),
        f"{blk}.router.bias": torch.zeros(E),
        f"{blk}.experts.gate_up_proj": torch.randn(E + 2, H, 2 * I, generator=g),
        f"{blk}.experts.gate_up_proj_bias": torch.zeros(E + 2, 2 * I),
        f"{blk}.experts.down_proj": torch.randn(E + 2, I, H, generator=g),
        f"{blk}.experts.down_proj_bias": torch.zeros(E + 2, H),
    }
    path = _write(tmp_path, cfg, {"model.safetensors": t})
    raises_clearly(lambda: load_layer(path, backend="cpu"), f"{blk}.experts.gate_up_proj", f"{E} experts")


@robust(5, "error")
def test_a_folder_without_checkpoint_files_is_refused(tmp_path):
    path = _write(tmp_path, _config(), {})
    raises_clearly(lambda: load_layer(path, backend="cpu"), "safetensors")
