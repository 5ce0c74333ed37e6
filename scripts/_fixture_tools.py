"""The per-tool writers of ``make_checkpoint_fixtures.py``: each runs the tool itself on a tiny model.

A writer returns the (fixture, reason) pairs it could not make; a fixture the
tool refused is not written (its reason is printed, and the table in
tests/fixtures/checkpoints/README.md says so).
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback

import torch
from make_checkpoint_fixtures import (
    _dequantized_path,
    calibration,
    fresh,
    save_dequantized,
    tiny_model,
    tokenizer,
    version,
    write_info,
)

# llm-compressor presets on MoE experts: fixture -> (model, preset or "mixed", modifier, sizes)
LLMC = {
    "llmc_fp8_mixtral": ("mixtral", "FP8", "quant", {}),
    "llmc_fp8_dynamic_qwen3": ("qwen3_moe", "FP8_DYNAMIC", "quant", {}),
    "llmc_fp8_block_deepseek_v3": ("deepseek_v3", "FP8_BLOCK", "quant", {}),
    "llmc_w8a8_int8_mixtral": ("mixtral", "W8A8", "quant", {}),
    "llmc_w8a16_olmoe": ("olmoe", "W8A16", "quant", {"hidden": 128, "inter": 128}),
    "llmc_w4a16_qwen3": ("qwen3_moe", "W4A16", "quant", {"hidden": 128, "inter": 128}),
    "llmc_w4a16_gptq_mixtral": ("mixtral", "W4A16", "gptq", {"hidden": 128, "inter": 128}),
    "llmc_w4a16_awq_qwen3": ("qwen3_moe", "W4A16_ASYM", "awq", {"hidden": 128, "inter": 128}),
    "llmc_w4a16_asym_olmoe": ("olmoe", "W4A16_ASYM", "quant", {"hidden": 128, "inter": 128}),
    "llmc_w4afp8_qwen3": ("qwen3_moe", "W4AFP8", "quant", {"hidden": 128, "inter": 128}),
    "llmc_nvfp4_deepseek_v3": ("deepseek_v3", "NVFP4", "quant", {}),
    "llmc_nvfp4a16_qwen3": ("qwen3_moe", "NVFP4A16", "quant", {}),
    "llmc_mxfp4_olmoe": ("olmoe", "MXFP4", "quant", {}),
    "llmc_mxfp4a16_mixtral": ("mixtral", "MXFP4A16", "quant", {}),
    "llmc_mxfp8_qwen3": ("qwen3_moe", "MXFP8", "quant", {}),
    "llmc_fp8_dynamic_gpt_oss": ("gpt_oss", "FP8_DYNAMIC", "quant", {}),
    "llmc_mixed_qwen3": ("qwen3_moe", "mixed", "quant", {"layers": 2}),
}
# attention is left in bf16: its 64-wide projections cannot hold the int4 presets' groups of 128
_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*router$", "re:.*self_attn.*"]


def _llmc_recipe(preset: str, modifier: str):
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if preset == "mixed":  # layer 0's experts W4A16 (groups of 32), layer 1's FP8_DYNAMIC: two config groups
        from compressed_tensors.quantization import preset_name_to_scheme

        w4 = preset_name_to_scheme("W4A16", [r"re:.*layers\.0\..*experts.*"])
        w4.weights.group_size = 32
        fp8 = preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*layers\.1\..*experts.*"])
        return QuantizationModifier(config_groups={"group_0": w4, "group_1": fp8}, ignore=_IGNORE)
    cls = {"quant": QuantizationModifier, "gptq": GPTQModifier, "awq": AWQModifier}[modifier]
    return cls(targets="Linear", scheme=preset, ignore=_IGNORE)


def llmcompressor(out: str, only) -> list:
    import transformers as tf
    from datasets import Dataset
    from llmcompressor import oneshot

    ids = [t[0].tolist() for t in calibration()]
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    failed = []
    for name, (model, preset, modifier, sizes) in LLMC.items():
        if only and name not in only:
            continue
        path = fresh(out, name)
        try:
            with tempfile.TemporaryDirectory() as base:
                m = tf.AutoModelForCausalLM.from_pretrained(tiny_model(model, base, **sizes), dtype=torch.bfloat16)
                recipe = _llmc_recipe(preset, modifier)
                oneshot(model=m, dataset=ds, recipe=recipe, processor=tokenizer(), num_calibration_samples=len(ids))
                m.save_pretrained(path, save_compressed=True)
        except Exception as e:  # the tool's own refusal is a result: record it
            traceback.print_exc()
            failed.append((name, f"{type(e).__name__}: {e}"))
            continue
        info = {"tool": "llmcompressor", "version": version("llmcompressor"), "model": model, "scheme": preset}
        info.update(modifier=modifier, compressed_tensors=version("compressed-tensors"), sizes=sizes)
        try:
            info["layout"] = save_dequantized(path)
        except Exception as e:  # the environment's own dequantizer (transformers' compressed-tensors loader)
            info["dequantizer_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        write_info(path, info)
    return failed


# transformers' own FP8 (FineGrainedFP8Config): quantized at load, saved with save_pretrained
TF_FP8 = {"tf_fp8_block_mixtral": ("mixtral", [32, 32]), "tf_fp8_tensor_qwen3": ("qwen3_moe", None)}


def transformers_fp8(out: str, only) -> list:
    """transformers refuses to *quantize* without a GPU (``validate_environment``: "A GPU or XPU is needed
    for FP8 quantization"); the quantization itself is plain PyTorch, so that one check is skipped here."""
    import transformers as tf
    from transformers.quantizers import quantizer_finegrained_fp8 as qf

    qf.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    failed = []
    for name, (model, block) in TF_FP8.items():
        if only and name not in only:
            continue
        path = fresh(out, name)
        with tempfile.TemporaryDirectory() as base:
            q = tf.FineGrainedFP8Config(weight_block_size=block)
            m = tf.AutoModelForCausalLM.from_pretrained(tiny_model(model, base), quantization_config=q)
            m.save_pretrained(path)
        info = {"tool": "transformers", "version": version("transformers"), "model": model}
        info.update(scheme=f"FineGrainedFP8Config(weight_block_size={block})", note=transformers_fp8.__doc__)
        write_info(path, info)
    return failed


MODELOPT = {
    "modelopt_fp8_qwen3": ("qwen3_moe", "FP8_DEFAULT_CFG"),
    "modelopt_nvfp4_mixtral": ("mixtral", "NVFP4_DEFAULT_CFG"),
}


def modelopt(out: str, only) -> list:
    import modelopt.torch.quantization as mtq
    import transformers as tf
    from modelopt.torch.export import export_hf_checkpoint

    failed = []
    for name, (model, cfg) in MODELOPT.items():
        if only and name not in only:
            continue
        path = fresh(out, name)
        try:
            with tempfile.TemporaryDirectory() as base:
                m = tf.AutoModelForCausalLM.from_pretrained(tiny_model(model, base), dtype=torch.bfloat16)

                def loop(mod):
                    for x in calibration():
                        mod(x)

                mtq.quantize(m, getattr(mtq, cfg), loop)
                export_hf_checkpoint(m, export_dir=path)
        except Exception as e:
            traceback.print_exc()
            failed.append((name, f"{type(e).__name__}: {e}"))
            continue
        write_info(
            path, {"tool": "nvidia-modelopt", "version": version("nvidia-modelopt"), "model": model, "scheme": cfg}
        )
    return failed


def _awq_pack(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's own code: ``AwqQuantizer.pseudo_quantize_tensor`` (scales, zeros) and
    ``WQLinear_GEMM.from_linear`` (the GEMM packing), on the CPU."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer

    q = AwqQuantizer.__new__(AwqQuantizer)  # only the fields pseudo_quantize_tensor reads
    q.w_bit, q.group_size, q.zero_point = 4, group, True
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    dq, scales, zeros = q.pseudo_quantize_tensor(w.float())
    lin.weight.data.copy_(dq)
    ql = WQLinear_GEMM.from_linear(lin, 4, group, False, scales.t().contiguous(), zeros.t().contiguous())  # [G, N]
    return {k: getattr(ql, k).contiguous() for k in ("qweight", "qzeros", "scales")}


def autoawq(out: str, only) -> list:
    """AutoAWQ's quantizer (``AutoAWQForCausalLM.quantize``) runs its calibration on CUDA only and does
    not know transformers 5's fused experts; its scale/zero computation and GEMM packer run on the CPU
    and write the per-expert Linears here (names as AutoAWQ saves Qwen3-MoE: ``mlp.experts.{e}.*_proj``).
    No activation-aware scaling search: plain round-to-nearest with AWQ's zero points."""
    import transformers as tf
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file, save_file

    name, group = "autoawq_gemm_qwen3", 32
    if only and name not in only:
        return []
    path = fresh(out, name)
    tiny_model("qwen3_moe", path)
    m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = load_file(os.path.join(path, "model.safetensors"))
    deq = {}
    for L, layer in enumerate(m.model.layers):
        ex = layer.mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):
            gate, up = ex.gate_up_proj[e].detach().chunk(2, dim=0)  # [2I, H]: gate rows then up rows
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", ex.down_proj[e].detach())):
                prefix = f"model.layers.{L}.mlp.experts.{e}.{proj}"
                sd.pop(f"{prefix}.weight", None)
                packed = _awq_pack(w, group)
                sd.update({f"{prefix}.{k}": v for k, v in packed.items()})
                deq[prefix] = dequantize_gemm(packed["qweight"], packed["qzeros"], packed["scales"], 4, group).t()
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.float().contiguous() for k, v in deq.items()}, _dequantized_path(path))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    info = {"tool": "autoawq (packer)", "version": version("autoawq"), "model": "qwen3_moe", "scheme": "W4 g32 zp GEMM"}
    write_info(path, {**info, "note": autoawq.__doc__, "layout": "per-Linear [N, K] under each prefix"})
    return []


TOOLS = {"llmcompressor": llmcompressor, "transformers": transformers_fp8, "modelopt": modelopt, "autoawq": autoawq}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
