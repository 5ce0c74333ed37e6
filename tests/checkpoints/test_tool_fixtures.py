"""Checkpoints as the quantization tools write them (tests/fixtures/checkpoints/, made by
scripts/make_checkpoint_fixtures.sh with llm-compressor, transformers, nvidia-modelopt, AutoAWQ's
packer and GPTQModel; each folder's fixture.json names the tool and its version).

Every fixture either loads and matches, or is refused by design with the reason checked here:

- weights: the layer's dequantized experts against two outside dequantizations, the tool's own
  (``tool_dequantized/experts.safetensors``: the tool's dequantizer, or transformers of the tool's
  environment; every fixture that loads has one but transformers' FP8 saves) and transformers'
  (the model it loads from the same folder, where it can load it);
- output: against the tool's own forward of its MoE block where it saved one
  (``tool_dequantized/block_io.safetensors``, GPTQModel), against the float64 reference on the
  loaded weights, and against transformers' own MoE block of the same checkpoint where transformers
  loads it (``run_checkpoint``'s truth).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from fusedmoe import FusedMoEError, QuantScheme, UnsupportedError
from fusedmoe.checkpoints import load_layer, run_checkpoint
from fusedmoe.checkpoints.checkpoint import open_checkpoint
from fusedmoe.checkpoints.run import router_logits, transformers_block, truth_tolerance
from fusedmoe.integrations.hf_blocks import extract
from fusedmoe.quant import QDtype
from fusedmoe.testing import rel_error

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("compressed_tensors")

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoints")
FIXTURES = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "fixture.json")))
# refused by design: fixture -> what the error must say
REFUSED = {
    "llmc_w4afp8_qwen3": r"int4 weights with fp8 activations \(W4AFP8\)",
    "llmc_mxfp4_olmoe": r"MXFP4 weights with MXFP4 activations",
    "llmc_mxfp8_qwen3": r"scheme MXFP8 .*only as an activation format",
}
# transformers' compressed-tensors loader and compressed-tensors' own dequantizer round to bfloat16
# (2^-9 relative); AutoAWQ's dequantize_gemm and GPTQModel's torch kernel compute in float16 (2^-11)
WEIGHT_TOL = 4e-3
# where transformers (5.24 here) loads the folder without the experts (it maps no gate_proj names for
# Mixtral / gpt-oss and leaves them random) or keeps NVFP4 packed on the CPU, its model is no truth
# (``transformers_block`` says so from its load report; see the fixtures' README)
NO_OUTSIDE_WEIGHTS = {"llmc_fp8_mixtral", "llmc_mxfp4a16_mixtral", "llmc_w4a16_gptq_mixtral", "llmc_w8a8_int8_mixtral"}
NO_OUTSIDE_WEIGHTS |= {"llmc_fp8_dynamic_gpt_oss", "llmc_nvfp4_deepseek_v3", "llmc_nvfp4a16_qwen3"}
# every fixture that loads has the tool's own dequantization beside it (a missing file is a failure, not
# a skipped comparison), except transformers' FP8 saves: transformers 5.24 loading them with
# FineGrainedFP8Config(dequantize=True) on the CPU keeps the experts' fp8 codes and drops their scales
NO_TOOL_DEQUANTIZED = {"tf_fp8_block_mixtral", "tf_fp8_tensor_qwen3"}


def _info(name: str) -> dict:
    with open(os.path.join(ROOT, name, "fixture.json")) as f:
        return json.load(f)


def _layers(path: str) -> list[int]:
    with open(os.path.join(path, "config.json")) as f:
        return list(range(json.load(f)["num_hidden_layers"]))


# the tools' names of an expert's projections, read here (not through the loader's layout module, so a
# role mix-up there shows against the tool's files)
_TOOL_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_TOOL_LINEAR = re.compile(r"(?:^|\.)layers\.(\d+)\..*\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")


def _tool_dequantized(path: str, info: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(W13 [E, 2I, H] (gate rows, then up rows), W2 [E, H, I]) as the tool dequantized them, or None.

    Two layouts: per Linear, ``{linear path}`` -> [N, K] (AutoAWQ, GPTQModel, ModelOpt's and
    compressed-tensors' own dequantizers), or the fused parameters of the module the tool's environment
    built (``{experts}.gate_up_proj`` / ``down_proj`` with fixture.json's layout flags)."""
    f = os.path.join(path, "tool_dequantized", "experts.safetensors")
    if not os.path.isfile(f):
        return None
    st = safetensors_torch.load_file(f)
    per: dict[int, dict[int, torch.Tensor]] = {}
    for k, v in st.items():
        m = _TOOL_LINEAR.search(k)
        if m and int(m[1]) == layer:
            per.setdefault(int(m[2]), {})[_TOOL_ROLE[m[3]]] = v
    if per:
        experts = [per[e] for e in sorted(per)]
        assert sorted(per) == list(range(len(per))) and all(len(p) == 3 for p in experts), (path, layer, sorted(per))
        return torch.stack([torch.cat([p[0], p[1]]) for p in experts]), torch.stack([p[2] for p in experts])
    pre = [k[: -len(".gate_up_proj")] for k in st if k.endswith("gate_up_proj") and f".layers.{layer}." in k]
    if not pre:
        return None
    w13, w2 = st[f"{pre[0]}.gate_up_proj"], st[f"{pre[0]}.down_proj"]
    if info["layout"].get("is_transposed"):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def _as_the_layer_holds(path: str, moe, layer: int, w13: torch.Tensor) -> torch.Tensor:
    """The tool's W13 ([gate; up] rows) as the layer holds it: gate/up rows interleaved where the model
    interleaves them (gpt-oss), and for per-tensor FP8 with W1 and W3 scales that differ, both halves
    requantized to e4m3 with the larger scale (one scale per expert, as vLLM does), here from the
    checkpoint's own ``weight_scale`` tensors."""
    i = w13.shape[1] // 2
    w1 = moe.scheme.w1
    if w1 is not None and w1.granularity.kind == "tensor" and w1.dtype is QDtype.FP8:
        from safetensors import safe_open

        best: dict[int, torch.Tensor] = {}  # expert -> the larger of its gate and up scales
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            for k in f.keys():
                m = _TOOL_LINEAR.search(k.removesuffix(".weight_scale"))
                if k.endswith(".weight_scale") and m and int(m[1]) == layer and _TOOL_ROLE[m[3]] < 2:
                    s = f.get_tensor(k).float().max()
                    best[int(m[2])] = torch.maximum(best.get(int(m[2]), s), s)
        w13 = torch.stack([(w13[e] / best[e]).to(torch.float8_e4m3fn).float() * best[e] for e in range(len(w13))])
    if moe.config.gate_up_interleaved:
        w13 = torch.stack([w13[:, :i], w13[:, i:]], dim=2).reshape(w13.shape)
    return w13


def _tool_output(path: str, moe, layer: int) -> tuple[float, float] | None:
    """(relative error, tolerance) of the layer against the tool's own forward of its MoE block
    (``tool_dequantized/block_io.safetensors``: x and the block's output, GPTQModel), or None."""
    f = os.path.join(path, "tool_dequantized", "block_io.safetensors")
    if not os.path.isfile(f):
        return None
    io = safetensors_torch.load_file(f)
    reader, fmt, arch = open_checkpoint(path)
    x = io["x"].to(moe.config.dtype)
    with torch.no_grad():
        out = moe(x, router_logits(reader, fmt, arch, layer, x))
    return rel_error(out, io["out"]), truth_tolerance(moe)


def _keys(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_and_matches(name):
    path, info = os.path.join(ROOT, name), _info(name)
    assert info["version"] and info["tool"]
    if name in REFUSED:
        with pytest.raises(UnsupportedError, match=REFUSED[name]):
            load_layer(path)
        return
    for layer in _layers(path):
        moe = load_layer(path, layer, keep_reference=True)
        w13, w2 = moe.reference_weights.dequantized(moe.scheme)
        tool = _tool_dequantized(path, info, layer)
        assert (tool is None) == (name in NO_TOOL_DEQUANTIZED), (name, layer, "tool_dequantized/experts.safetensors")
        if tool is not None:
            t13 = _as_the_layer_holds(path, moe, layer, tool[0])
            assert rel_error(w13, t13) < WEIGHT_TOL and rel_error(w2, tool[1]) < WEIGHT_TOL, (name, layer)
        out = _tool_output(path, moe, layer)
        if out is not None:
            assert out[0] <= out[1], (name, layer, "vs the tool's own forward", out)
        block, why = transformers_block(path, layer)
        if block is not None and name not in NO_OUTSIDE_WEIGHTS:
            hf = extract(block)
            tw13, tw2 = hf.weights.dequantized(QuantScheme.unquantized())
            assert rel_error(w13, tw13) < WEIGHT_TOL and rel_error(w2, tw2) < WEIGHT_TOL, (name, layer, why)
        truth = "reference" if name in NO_OUTSIDE_WEIGHTS else "auto"
        r = run_checkpoint(path, "auto", 16, layer=layer, truth=truth)
        print(f"\n[fixture] {name} layer {layer}: {r['scheme']}, {r['rel_error']:.1e} vs {r['truth'][:60]}")
        assert r["passed"], r


def test_every_tool_named_in_the_issue_has_a_fixture_or_a_reason():
    tools = {_info(n)["tool"].split(" ")[0] for n in FIXTURES}
    assert {"llmcompressor", "transformers", "nvidia-modelopt", "autoawq", "gptqmodel"} <= tools
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "could not run here" in readme  # llm-compressor's AWQModifier: its reason is in the table


# ---- the seven problems of the issue, each as it was met --------------------------------------


def _copy(name: str, dst: str, rename=None, drop=None) -> str:
    """A copy of fixture ``name`` with tensor names rewritten by ``rename`` / dropped by ``drop``."""
    src = os.path.join(ROOT, name)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tool_dequantized"))
    if rename or drop:
        st = safetensors_torch.load_file(os.path.join(dst, "model.safetensors"))
        st = {(rename(k) if rename else k): v for k, v in st.items() if not (drop and drop(k))}
        safetensors_torch.save_file(st, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_1_mixtral_with_gate_up_down_names_loads(tmp_path):
    """llm-compressor names Mixtral's experts gate_proj/up_proj/down_proj under block_sparse_moe;
    GPTQModel writes the same under ``mlp.`` (as its fixture shows): both load, and to the same weights."""
    gptqmodel = _keys(os.path.join(ROOT, "gptqmodel_w4g32_mixtral"))
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in gptqmodel
    assert not any("block_sparse_moe" in k for k in gptqmodel)
    a = load_layer(os.path.join(ROOT, "llmc_w4a16_gptq_mixtral"), keep_reference=True)
    p = _copy("llmc_w4a16_gptq_mixtral", str(tmp_path / "m"), rename=lambda k: k.replace("block_sparse_moe", "mlp"))
    b = load_layer(p, keep_reference=True)
    assert rel_error(b.reference_weights.dequantized(b.scheme)[0], a.reference_weights.dequantized(a.scheme)[0]) == 0


def test_1_unmappable_checkpoint_names_what_it_found_and_what_is_missing(tmp_path):
    p = _copy("llmc_fp8_dynamic_qwen3", str(tmp_path / "m"), drop=lambda k: ".down_proj." in k)
    with pytest.raises(FusedMoEError) as e:
        load_layer(p)
    msg = str(e.value)
    assert "no down (down_proj / w2)" in msg and "mlp.experts.{e}.gate_proj.weight_scale" in msg, msg
    p = _copy("llmc_fp8_dynamic_qwen3", str(tmp_path / "n"), drop=lambda k: ".experts.3." in k)
    with pytest.raises(FusedMoEError, match=r"experts \[3\] missing"):
        load_layer(p)


def test_2_gpt_oss_from_llmcompressor_loads_with_its_biases():
    moe = load_layer(os.path.join(ROOT, "llmc_fp8_dynamic_gpt_oss"), keep_reference=True)
    assert moe.config.gate_up_interleaved and moe.reference_weights.b13.abs().sum() > 0


def test_3_w8a16_loads_as_int8_weights():
    assert load_layer(os.path.join(ROOT, "llmc_w8a16_olmoe")).scheme.name == "int8_w8a16"


def test_4_w4afp8_is_refused_naming_the_scheme():
    with pytest.raises(UnsupportedError, match=REFUSED["llmc_w4afp8_qwen3"]):
        load_layer(os.path.join(ROOT, "llmc_w4afp8_qwen3"))


@pytest.mark.parametrize("name", ["tf_fp8_block_mixtral", "tf_fp8_tensor_qwen3"])
def test_5_transformers_fp8_moe_save_loads_its_fused_scales(name):
    moe = load_layer(os.path.join(ROOT, name), keep_reference=True)
    assert moe.scheme.family == "fp8"


def test_6_run_checkpoint_sees_a_loader_that_swaps_gate_and_up(monkeypatch):
    """Against the weights the loader produced a swap is invisible; against transformers' block it fails."""
    from fusedmoe.checkpoints import layout

    path = os.path.join(ROOT, "llmc_fp8_dynamic_qwen3")
    swapped = {**layout._ROLE, "gate_proj": "w3", "up_proj": "w1"}
    monkeypatch.setattr(layout, "_ROLE", swapped)
    assert run_checkpoint(path, "reference", 16, truth="reference")["passed"]
    r = run_checkpoint(path, "reference", 16)
    assert r["truth"].startswith("transformers") and not r["passed"], r


def test_6_cli_bad_checkpoint_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    from fusedmoe.cli import main

    p = _copy("llmc_fp8_dynamic_qwen3", str(tmp_path / "m"), drop=lambda k: ".up_proj." in k)
    assert main(["run", "--checkpoint", p, "--cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no up (up_proj / w3)" in err and "Traceback" not in err
    with pytest.raises(FusedMoEError):
        main(["run", "--checkpoint", p, "--cpu", "--debug"])
    assert main(["run", "--checkpoint", os.path.join(ROOT, "llmc_fp8_dynamic_qwen3"), "--cpu", "--tokens", "4"]) == 0
    assert "truth: transformers" in capsys.readouterr().out


def test_7_missing_optional_packages_name_the_extra(monkeypatch):
    import tomllib

    from fusedmoe.checkpoints import base

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(r.startswith("safetensors") for r in extras["checkpoints"])
    assert any(r.startswith("compressed-tensors") for r in extras["checkpoints"])
    assert any(r.startswith("transformers>=5") for r in extras["hf"])
    assert {"fusedmoe[checkpoints]", "fusedmoe[hf]"} <= set(extras["dev"])
    monkeypatch.setitem(base.INSTALLED, "safetensors", False)
    with pytest.raises(FusedMoEError, match=r"pip install 'fusedmoe\[checkpoints\]'"):
        load_layer(os.path.join(ROOT, "tf_fp8_tensor_qwen3"))
    monkeypatch.setitem(base.INSTALLED, "transformers", False)
    assert transformers_block(os.path.join(ROOT, "tf_fp8_tensor_qwen3"), 0)[1].endswith("'fusedmoe[hf]')")
