"""Checkpoint formats on real artefacts: written, saved with safetensors, loaded, run.

Every checkpoint starts from a tiny random transformers model saved with
``save_pretrained`` (H=64, I=32, 8 experts, top-2, one layer; the MoE weights
re-drawn as in test_hf_models). Its expert Linears are then written in the
format under test:

- compressed-tensors: by the library itself (``apply_quantization_config``,
  ``calculate_qparams`` / ``generate_gparam``, ``ModelCompressor.compress_model``
  and ``update_config``), as llm-compressor does after calibration;
- fp8 (DeepSeek-V3 blocks / per-tensor), GPTQ, AWQ, gpt-oss MXFP4, ModelOpt
  FP8/NVFP4: by the writers here, which follow each format's documented layout
  (see fusedmoe/formats/*.py) using fusedmoe's quantizers and packers.

Each is checked three ways: (1) ``run_checkpoint``: the layer against
``moe_reference`` on its own weights; (2) the layer's dequantized experts
against an independent reader of the same files (the compressed-tensors
library's ``decompress``, transformers' ``_dequantize_fp8_weight`` and
``convert_moe_packed_tensors``, AutoAWQ's ``dequantize_gemm`` when installed,
or a decoder written here from the documented layout); (3) the layer's output
against the transformers block (the unpatched model) holding those
independently dequantized experts, within ``fusedmoe.testing.tolerance`` plus
the error of quantizing the activations, which the transformers block does
not do. Run with ``-s`` to see the measured errors.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re

import pytest
import torch

from fusedmoe import FusedMoEError, ParallelConfig, QuantScheme, UnsupportedError
from fusedmoe.checkpoints import detect, find_experts, load_checkpoint, load_layer, run_checkpoint
from fusedmoe.integrations.hf_blocks import extract
from fusedmoe.quant import Granularity, QDtype, TensorQuant, dequantize, quantize
from fusedmoe.quant.fp4 import nvfp4_global_scale
from fusedmoe.quant.int4 import pack_awq, pack_gptq
from fusedmoe.testing import rel_error, tolerance

tf = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_hf_models import _COMMON, _config  # noqa: E402  (the shared tiny-model recipes)

H, T = 64, 12
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


@functools.cache
def _model(name: str):
    """A tiny float32 model whose MoE block has non-trivial random weights ('name:i64': I = 64,
    'name:bf16': the model in bfloat16)."""
    torch.manual_seed(0)
    base, _, variant = name.partition(":")
    cfg = _config(base)
    if variant == "i64":
        for attr in ("moe_intermediate_size", "intermediate_size"):
            if getattr(cfg, attr, None) == 32:
                setattr(cfg, attr, 64)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            std = 0.5 if p.dim() == 1 else H**-0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for bname, b in model.model.layers[0].mlp.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.to(torch.bfloat16) if variant == "bf16" else model


def _save(model, path: str, tensors: dict | None = None, quant: dict | None = None) -> str:
    model.save_pretrained(path)
    if tensors is not None:
        safetensors_torch.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if quant is not None:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quant
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return path


def _float_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    _save(_model(name), path)
    return safetensors_torch.load_file(os.path.join(path, "model.safetensors"))


def _rewrite(sd: dict, linear) -> dict:
    """Replace every expert Linear ``x.weight`` by ``linear(prefix, weight)``'s tensors."""
    out = {}
    pairs = {}
    for k, v in sd.items():
        m = _EXPERT.search(k)
        if m is None:
            out[k] = v
            continue
        pairs.setdefault(k[: m.start()] + f".experts.{m.group(1)}", {})[m.group(2)] = (k[: -len(".weight")], v)
    for group in pairs.values():
        ups = [v for p, (_, v) in group.items() if p in ("gate_proj", "up_proj", "w1", "w3")]
        for proj, (prefix, w) in group.items():
            partner = torch.cat(ups) if proj in ("gate_proj", "up_proj", "w1", "w3") else w
            for suffix, t in linear(w.float(), partner.float()).items():
                out[f"{prefix}.{suffix}"] = t.contiguous()
    return out


# ---- writers of the formats fusedmoe reads (our writers; layout per the formats' docs) -------


def _fp8_linear(block):
    tq = TensorQuant(QDtype.FP8, Granularity.block(*block) if block else Granularity.tensor())

    def linear(w, pair):
        q = quantize(w[None], tq)
        out = {"weight": q.data[0], "weight_scale_inv": q.scale[0] if block else q.scale.reshape(())}
        if not block:
            out["input_scale"] = torch.tensor(4.0 / 448)  # static, calibrated on |x| <= 4
        return out

    return linear


def _int4_q(w, g, sym, act_order, pair=None):
    """int4 groups; act-order groups follow the columns sorted by the input's size, which gate and
    up share (GPTQ orders by the Hessian diagonal, a property of the common input)."""
    tq = TensorQuant(QDtype.INT4, Granularity.group(g), symmetric=sym, act_order=act_order)
    g_idx = None
    if act_order:
        perm = (w if pair is None else pair).norm(dim=0).argsort(descending=True)
        g_idx = torch.empty(w.shape[1], dtype=torch.int32)
        g_idx[perm] = (torch.arange(w.shape[1]) // g).to(torch.int32)
    return quantize(w[None], tq, g_idx=g_idx)


def _gptq_linear(g, sym, act_order):
    def linear(w, pair):
        return {k: v[0] for k, v in pack_gptq(_int4_q(w, g, sym, act_order, pair)).items()}

    return linear


def _awq_linear(g):
    return lambda w, pair: {k: v[0] for k, v in pack_awq(_int4_q(w, g, False, False)).items()}


def _modelopt_linear(algo):
    def linear(w, pair):
        if algo == "FP8":
            q = quantize(w[None], TensorQuant(QDtype.FP8, Granularity.tensor()))
            return {"weight": q.data[0], "weight_scale": q.scale.reshape(()), "input_scale": torch.tensor(4.0 / 448)}
        gs = nvfp4_global_scale(pair.abs().max())  # gate and up share amax, so their global scales agree
        q = quantize(w[None], TensorQuant(QDtype.NVFP4, Granularity.group(16)), global_scale=gs)
        return {
            "weight": q.data[0],
            "weight_scale": q.scale[0],
            "weight_scale_2": gs.reshape(()),
            "input_scale": nvfp4_global_scale(torch.tensor(4.0)).reshape(()),
        }

    return linear


def _gpt_oss_mxfp4(sd: dict) -> dict:
    tq = QuantScheme.mxfp4_w4a16().w1
    out = {}
    for k, v in sd.items():
        if _FUSED.search(k) is None:
            out[k] = v
            continue
        q = quantize(v.transpose(1, 2).float(), tq)  # [E, K, N] (module layout) -> [E, N, K]
        e, n, kk = q.shape
        out[k + "_blocks"] = q.data.reshape(e, n, kk // 32, 16).contiguous()
        out[k + "_scales"] = q.scale.contiguous()
    return out


def _ct_write(name: str, path: str, preset: str, sd: dict) -> tuple[str, dict]:
    """A compressed-tensors checkpoint made by the library's own compressors."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.format import infer_model_format
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    root = torch.nn.Module()
    names = [k[: -len(".weight")] for k in sd if _EXPERT.search(k)]
    for n in names:
        w = sd[n + ".weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        parent = root
        for part in n.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(n.split(".")[-1], lin)
    scheme = preset_name_to_scheme(preset, targets=[r"re:.*experts\..*"])
    if scheme.weights.group_size and scheme.weights.group_size > 32:
        scheme.weights.group_size = 32
    if scheme.weights.block_structure:
        scheme.weights.block_structure = [32, 32]
    if scheme.input_activations is not None and scheme.input_activations.group_size == 128:
        scheme.input_activations.group_size = 32
    qc = QuantizationConfig(config_groups={"group_0": scheme})
    apply_quantization_config(root, qc)
    mods = {n: root.get_submodule(n) for n in names}
    pair_gs = {}
    for n, lin in mods.items():
        a, w = lin.quantization_scheme.weights, lin.weight.data.float()
        if a.strategy == "tensor_group":  # llm-compressor fuses the global scales of gate and up
            key = re.sub(r"(gate|up)_proj$", "", n)
            pair_gs[key] = torch.minimum(
                pair_gs.get(key, torch.tensor([float("inf")])), generate_gparam(w.min(), w.max())
            )
    for n, lin in mods.items():
        a, w = lin.quantization_scheme.weights, lin.weight.data.float()
        gs = pair_gs.get(re.sub(r"(gate|up)_proj$", "", n)) if a.strategy == "tensor_group" else None
        if gs is not None:
            lin.weight_global_scale.data.copy_(gs)
        s = a.strategy
        if s == "tensor":
            mn, mx = w.min().reshape(1), w.max().reshape(1)
        elif s == "channel":
            mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif s == "block":
            bn, bk = a.block_structure
            v = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
            mn, mx = v.amin((1, 3)), v.amax((1, 3))
        else:
            v = w.unflatten(1, (-1, a.group_size))
            mn, mx = v.amin(-1), v.amax(-1)
        sc, zp = calculate_qparams(mn, mx, a, global_scale=gs)
        lin.weight_scale.data.copy_(sc.reshape(lin.weight_scale.shape))
        if hasattr(lin, "weight_zero_point"):
            lin.weight_zero_point.data.copy_(zp.reshape(lin.weight_zero_point.shape))
        if hasattr(lin, "input_global_scale"):
            lin.input_global_scale.data.copy_(generate_gparam(torch.tensor(-4.0), torch.tensor(4.0)))
        if hasattr(lin, "input_scale"):
            lin.input_scale.data.fill_(4.0 / 448)
    qc.format = infer_model_format(root)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(root)
    csd = root.state_dict()
    tensors = {k: v for k, v in sd.items() if not _EXPERT.search(k)}
    tensors.update({k: v.contiguous() for k, v in csd.items()})
    _save(_model(name), path, tensors)
    compressor.update_config(path)
    return path, {"scheme": scheme, "format": str(getattr(qc.format, "value", qc.format)), "state": csd}


# ---- the cases ------------------------------------------------------------------------------

CASES = {
    # case: (model, how it is written)
    "bf16_mixtral": ("mixtral", "float"),
    "bf16_gpt_oss": ("gpt_oss", "float"),
    "bf16_qwen2_in_bf16": ("qwen2_moe:bf16", "float"),
    "fp8_online_qwen3": ("qwen3_moe", "online"),
    "fp8_block_deepseek_v3": ("deepseek_v3", "fp8_block"),
    "fp8_tensor_static_mixtral": ("mixtral", "fp8_tensor"),
    "ct_w4a16_qwen3": ("qwen3_moe", "ct:W4A16"),
    "ct_w4a16_asym_olmoe": ("olmoe", "ct:W4A16_ASYM"),
    "ct_fp8_static_qwen2": ("qwen2_moe", "ct:FP8"),
    "ct_fp8_dynamic_qwen3": ("qwen3_moe", "ct:FP8_DYNAMIC"),
    "ct_fp8_block_deepseek_v3": ("deepseek_v3", "ct:FP8_BLOCK"),
    "ct_int8_w8a8_mixtral": ("mixtral", "ct:W8A8"),
    "ct_nvfp4_qwen3": ("qwen3_moe", "ct:NVFP4"),
    "ct_mxfp4_olmoe": ("olmoe", "ct:MXFP4A16"),
    "gptq_qwen2": ("qwen2_moe", "gptq"),
    "gptq_act_order_mixtral": ("mixtral", "gptq_act_order"),
    "gptq_asym_deepseek_v2": ("deepseek_v2", "gptq_asym"),
    "awq_qwen3": ("qwen3_moe", "awq"),
    "mxfp4_gpt_oss": ("gpt_oss", "mxfp4"),
    "modelopt_nvfp4_deepseek_v3": ("deepseek_v3", "modelopt:NVFP4"),
    "modelopt_fp8_olmoe": ("olmoe", "modelopt:FP8"),
}
# I = 64, so that a tensor-parallel half of I is a whole number of groups of 32
TP_CASES = {
    "gptq_asym_qwen3_i64": ("qwen3_moe:i64", "gptq_asym"),
    "fp8_block_deepseek_v3_i64": ("deepseek_v3:i64", "fp8_block"),
    "mxfp4_gpt_oss_i64": ("gpt_oss:i64", "mxfp4"),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            made[case] = _write(case, str(tmp_path_factory.mktemp(case)))
        return made[case]

    return get


def _write(case: str, path: str):
    name, how = {**CASES, **TP_CASES}[case]
    sd = _float_tensors(name, path)
    info = {}
    if how in ("float", "online"):
        return path, info
    if how.startswith("ct:"):
        return _ct_write(name, path, how[3:], sd)
    if how.startswith("fp8"):
        block = [32, 32] if how == "fp8_block" else None
        quant = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic" if block else "static",
            "weight_block_size": block,
        }
        return _save(_model(name), path, _rewrite(sd, _fp8_linear(block)), quant), info
    if how.startswith("gptq"):
        sym, act = how != "gptq_asym", how == "gptq_act_order"
        quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act, "sym": sym}
        return _save(_model(name), path, _rewrite(sd, _gptq_linear(32, sym, act)), quant), info
    if how == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
        return _save(_model(name), path, _rewrite(sd, _awq_linear(32)), quant), info
    if how == "mxfp4":
        quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
        return _save(_model(name), path, _gpt_oss_mxfp4(sd), quant), info
    algo = how.split(":")[1]
    quant = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "ignore": ["lm_head"]}
    return _save(_model(name), path, _rewrite(sd, _modelopt_linear(algo)), quant), info


# ---- independent readers of each format (never fusedmoe's code) ---------------------------------

_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _nibbles(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes [..., K], the low nibble first (ModelOpt / vLLM / transformers)."""
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).long()


def _words(w: torch.Tensor, order=range(8)) -> torch.Tensor:
    """int32 words -> their 8 nibbles along a new last dim, nibble i at bits 4i."""
    u = w.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(u >> (4 * i)) & 0xF for i in order], dim=-1)


def _read_linear(case: str, st: dict, prefix: str, info: dict) -> torch.Tensor:
    """The real weight [N, K] of one expert Linear, read without fusedmoe."""
    how = CASES[case][1]
    if how.startswith("ct:"):
        from compressed_tensors.compressors import BaseCompressor

        local = {k[len(prefix) + 1 :]: v for k, v in info["state"].items() if k.startswith(prefix + ".")}
        return (
            BaseCompressor.get_value_from_registry(info["format"]).decompress(local, info["scheme"])["weight"].float()
        )
    if how.startswith("fp8"):
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

        block = [32, 32] if how == "fp8_block" else None
        return _dequantize_fp8_weight(st[f"{prefix}.weight"], st[f"{prefix}.weight_scale_inv"], block, torch.float32)
    if how.startswith("modelopt"):
        w = st[f"{prefix}.weight"]
        if w.dtype == torch.float8_e4m3fn:
            return w.float() * st[f"{prefix}.weight_scale"]
        s = st[f"{prefix}.weight_scale"].float().repeat_interleave(16, dim=-1)
        return _LUT[_nibbles(w)] * s * st[f"{prefix}.weight_scale_2"]
    if how == "awq":
        return _awq_reference_dequant(st, prefix)
    qw, qz, sc, gi = (st[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx"))
    codes = _words(qw).transpose(1, 2).reshape(-1, qw.shape[1])  # [K, N]: row 8j + i = nibble i of word j
    zeros = (_words(qz).reshape(qz.shape[0], -1) + 1) & 0xF  # [G, N], v1 stores zero - 1
    g = gi.long()
    return ((codes - zeros[g]) * sc.float()[g]).t()


def _awq_reference_dequant(st: dict, prefix: str) -> torch.Tensor:
    qw, qz, sc = (st[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales"))
    spec = importlib.util.find_spec("awq")
    if spec is not None:  # AutoAWQ's own reader, loaded without its package __init__
        path = os.path.join(os.path.dirname(spec.origin), "utils", "packing_utils.py")
        mod_spec = importlib.util.spec_from_file_location("_awq_packing_utils", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod.dequantize_gemm(qw, qz, sc.half(), 4, qw.shape[0] // sc.shape[0]).float().t()
    order = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of each word sits in nibble order[c] (AWQ_REVERSE_ORDER)
    codes = _words(qw, order).reshape(qw.shape[0], -1)  # [K, N]
    zeros = _words(qz, order).reshape(qz.shape[0], -1)
    g = torch.arange(qw.shape[0]) // (qw.shape[0] // sc.shape[0])
    return ((codes - zeros[g]) * sc.float()[g]).t()


def _truth(case: str, path: str, info: dict, where) -> tuple[torch.Tensor, torch.Tensor]:
    """(W13 [E, 2I, H], W2 [E, H, I]) of the checkpoint, in fusedmoe's reference layout."""
    st = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    how, block_path = CASES[case][1], where.block
    if how == "mxfp4":
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        w = [
            convert_moe_packed_tensors(
                st[f"{block_path}.experts.{p}_blocks"], st[f"{block_path}.experts.{p}_scales"], dtype=torch.float32
            )
            for p in ("gate_up_proj", "down_proj")
        ]
        return w[0].transpose(1, 2), w[1].transpose(1, 2)
    if f"{block_path}.experts.gate_up_proj" in st:  # gpt-oss in the model dtype: [E, K, N]
        return tuple(st[f"{block_path}.experts.{p}"].transpose(1, 2).float() for p in ("gate_up_proj", "down_proj"))
    w13, w2 = [], []
    for e in sorted(where.linears):
        p = dict(where.linears[e])
        if how in ("float", "online"):
            w13.append(torch.cat([st[p["w1"] + ".weight"], st[p["w3"] + ".weight"]]).float())
            w2.append(st[p["w2"] + ".weight"].float())
        else:
            w13.append(torch.cat([_read_linear(case, st, p["w1"], info), _read_linear(case, st, p["w3"], info)]))
            w2.append(_read_linear(case, st, p["w2"], info))
    return torch.stack(w13), torch.stack(w2)


def _hf_block_with(name: str, w13: torch.Tensor, w2: torch.Tensor) -> torch.nn.Module:
    """A copy of the transformers MoE block with the given experts (reference layout)."""
    block = copy.deepcopy(_model(name).model.layers[0].mlp)
    ex = block.experts
    if getattr(ex, "is_transposed", False):
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    with torch.no_grad():
        ex.gate_up_proj.copy_(w13.to(ex.gate_up_proj.dtype))
        ex.down_proj.copy_(w2.to(ex.down_proj.dtype))
    return block


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_and_matches(case, checkpoints):
    path, info = checkpoints(case)
    name, how = CASES[case]
    online = "fp8" if how == "online" else None
    result = run_checkpoint(path, "reference", 16, online=online, truth="reference")
    assert result["passed"], result
    layer = load_layer(path, backend="cpu", keep_reference=True, online=online)
    keys = safetensors_torch.load_file(os.path.join(path, "model.safetensors")).keys()
    w13, w2 = _truth(case, path, info, find_experts(keys, 0, layer.config.num_experts))
    ours13, ours2 = layer.reference_weights.dequantized(layer.scheme)
    err_w2 = rel_error(ours2, w2)
    err_w13 = rel_error(ours13, w13)
    # per-tensor W1/W3 scales that differ are requantized to the larger one (fp8 static cases)
    # compressed-tensors decompresses FP4 in bf16 (``unpack_fp4_from_uint8``'s default dtype): 2^-8;
    # AutoAWQ's ``dequantize_gemm`` (when installed) computes in fp16: 2^-11
    w2_tol = {"ct:NVFP4": 4e-3, "awq": 1e-3, "online": 0.05}.get(how, 1e-6)
    w13_tol = 0.05 if layer.scheme.w1 is not None and layer.scheme.w1.granularity.kind == "tensor" else w2_tol
    assert err_w2 < w2_tol and err_w13 < w13_tol, (case, err_w13, err_w2)
    block = _hf_block_with(name, w13, w2)
    hf = extract(block)
    dt = layer.config.dtype
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dt)
    with torch.no_grad():
        want = block(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        got = layer(x, hf.router_logits(x, dt))
    err = rel_error(got, want)
    # tolerance() bounds a backend against the reference of the same scheme; the transformers
    # block quantizes no activations, so add the activation quantization itself (fp8/int8: about
    # half an e4m3 step, nvfp4: e2m1 steps) and the W1/W3 requantization measured above
    tol = tolerance(layer.compute_scheme, torch.bfloat16 if online else dt) + (0.05 if online else 0.0)
    a1 = layer.compute_scheme.a1
    tol += 0.0 if a1 is None else 0.05 if a1.dtype is QDtype.NVFP4 else 0.02
    tol += 0.02 if w13_tol == 0.05 else 0.0
    print(f"\n[format] {case:28s} {layer.scheme.name:20s} weights {err_w13:.1e}/{err_w2:.1e} vs transformers {err:.2e}")
    assert err < tol, (case, err, tol)


@pytest.mark.parametrize("preset", ["W4A16", "FP8_DYNAMIC", "MXFP4A16"])
def test_transformers_reads_the_compressed_tensors_checkpoint_as_we_do(preset, checkpoints):
    """Where transformers loads the library's checkpoint itself (CPU decompression), its model agrees."""
    case = {"W4A16": "ct_w4a16_qwen3", "FP8_DYNAMIC": "ct_fp8_dynamic_qwen3", "MXFP4A16": "ct_mxfp4_olmoe"}[preset]
    path, _ = checkpoints(case)
    model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    layer = load_layer(path, backend="reference", keep_reference=True)
    w13, w2 = layer.reference_weights.dequantized(layer.scheme)
    ex = model.model.layers[0].mlp.experts
    assert rel_error(w13, ex.gate_up_proj.data) < 1e-6 and rel_error(w2, ex.down_proj.data) < 1e-6


def test_gptq_packing_matches_autogptq():
    """Our GPTQ packer gives the bytes AutoGPTQ's ``QuantLinear.pack`` gives (when AutoGPTQ is installed)."""
    spec = importlib.util.find_spec("auto_gptq")
    if spec is None:
        pytest.skip("auto-gptq is not installed (its packer is the independent check)")
    path = os.path.join(os.path.dirname(spec.origin), "nn_modules", "qlinear", "qlinear_cuda_old.py")
    mod_spec = importlib.util.spec_from_file_location("_autogptq_qlinear", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    w = torch.randn(64, 128) * 0.1
    q = _int4_q(w, 32, False, False)
    ours = pack_gptq(q)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data.copy_(dequantize(q, TensorQuant(QDtype.INT4, Granularity.group(32), symmetric=False))[0])
    ql = mod.QuantLinear(4, 32, 128, 64, bias=False)
    ql.pack(lin, q.scale[0].clone(), q.zero[0].long(), torch.arange(128) // 32)
    assert torch.equal(ql.qweight, ours["qweight"][0]) and torch.equal(ql.qzeros, ours["qzeros"][0])


def test_detect():
    assert detect({}).scheme.name == "bf16"
    assert detect({}, online="fp8").scheme.name == "fp8_tensor"
    assert (
        detect({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}).scheme.name
        == "fp8_block"
    )
    assert (
        detect({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}).scheme.name
        == "int4_g128_actorder"
    )
    assert detect({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}).scheme.name == "int4_g64_zp"
    assert detect({"quant_method": "mxfp4"}).scheme.name == "mxfp4"
    assert (
        detect({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}}).scheme.name
        == "nvfp4"
    )
    assert detect({"quant_method": "modelopt", "quant_algo": "FP8"}).scheme.name == "fp8_tensor_static"


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method: expected one of"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits: expected 4"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version: expected 'gemm'"),
        ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "quant_algo: expected one of"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: expected"),
    ],
)
def test_detect_refuses_what_it_cannot_read(qc, match):
    with pytest.raises((FusedMoEError, UnsupportedError), match=match):
        detect({"quantization_config": qc})


def _broken(checkpoints, tmp_path, case, mutate) -> str:
    path, _ = checkpoints(case)
    sd = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    mutate(sd)
    dst = str(tmp_path)
    os.makedirs(dst)
    for f in os.listdir(path):
        if f.endswith(".json"):
            with open(os.path.join(path, f)) as src, open(os.path.join(dst, f), "w") as out:
                out.write(src.read())
    safetensors_torch.save_file(sd, os.path.join(dst, "model.safetensors"))
    return dst


def test_malformed_checkpoints_name_the_tensor(checkpoints, tmp_path):
    g = "model.layers.0.mlp.experts.3.gate_proj"
    p = _broken(checkpoints, tmp_path / "a", "gptq_qwen2", lambda sd: sd.pop(f"{g}.qzeros"))
    with pytest.raises(FusedMoEError, match=f"checkpoint tensor '{g}.qzeros': expected present"):
        load_layer(p)
    p = _broken(
        checkpoints,
        tmp_path / "b",
        "fp8_block_deepseek_v3",
        lambda sd: sd.update({f"{g}.weight_scale_inv": torch.ones(3, 2)}),
    )
    with pytest.raises(FusedMoEError, match=rf"'{g}.weight_scale_inv': expected shape \(1, 2\)"):
        load_layer(p)
    p = _broken(
        checkpoints,
        tmp_path / "c",
        "modelopt_nvfp4_deepseek_v3",
        lambda sd: sd.update({f"{g}.weight_scale": sd[f"{g}.weight_scale"].float()}),
    )
    with pytest.raises(FusedMoEError, match=f"'{g}.weight_scale': expected dtype torch.float8_e4m3fn"):
        load_layer(p)
    b = "model.layers.0.mlp.experts.gate_up_proj"
    p = _broken(
        checkpoints,
        tmp_path / "d",
        "mxfp4_gpt_oss",
        lambda sd: sd.update({f"{b}_scales": sd[f"{b}_scales"][:, :, :1].contiguous()}),
    )
    with pytest.raises(FusedMoEError, match=f"'{b}_scales': expected shape"):
        load_layer(p)


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tensor_and_expert_parallel_loading_from_a_checkpoint(case, checkpoints):
    path, _ = checkpoints(case)
    full = load_layer(path, backend="reference")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    logits = torch.randn(T, full.config.num_experts, generator=torch.Generator().manual_seed(6))
    want = full(x, logits).double()
    for par in (
        [ParallelConfig(tp_size=2, tp_rank=r) for r in range(2)],
        [ParallelConfig(ep_size=2, ep_rank=r, placement="round_robin") for r in range(2)],
    ):
        layers = [load_checkpoint(path, backend="reference", parallel=p)[0] for p in par]
        got = sum(L(x, logits).double() for L in layers)
        if full.shared_experts is not None:
            got -= full.shared_experts(x).double() * (len(layers) - 1)
        assert rel_error(got, want) < 1e-5, (case, par[0])


def test_online_fp8_needs_an_unquantized_checkpoint(checkpoints):
    path, _ = checkpoints("gptq_qwen2")
    with pytest.raises(UnsupportedError, match="already quantized"):
        load_layer(path, online="fp8")


def test_load_checkpoint_finds_every_moe_layer(tmp_path):
    cfg = tf.Qwen2MoeConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(tmp_path))
    layers = load_checkpoint(str(tmp_path), backend="cpu")
    assert len(layers) == 2 and all(L.choice.backend == "cpu" for L in layers)
