"""The per-tool writers of ``make_checkpoint_fixtures.py``: each runs the tool itself on a tiny model.

A writer returns the (fixture, reason) pairs it could not make; a fixture the
tool refused is not written (its reason is printed, and the table in
tests/fixtures/checkpoints/README.md says so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

import torch
from make_checkpoint_fixtures import (
    _dequantized_path,
    calibration,
    fresh,
    lossless,
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


# GPTQModel: its own GPTQ (Hessian, act-order off) on the CPU, saved with its own ``save``
GPTQMODEL = {
    "gptqmodel_w4g128_qwen3": ("qwen3_moe", 128, {"hidden": 128, "inter": 128}),  # one group per row
    "gptqmodel_w4g32_mixtral": ("mixtral", 32, {}),  # two groups per row of 64
}


_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _gptqmodel_outputs(path: str, base: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """GPTQModel's own dequantizer and forward, from the saved folder loaded back by ``GPTQModel.load``
    on the CPU with its plain torch kernel (``BACKEND.TORCH``) in float16 (the kernel takes float16 or
    bfloat16; float16 keeps the float16 scales exact):

    - each expert Linear's ``dequantize_weight()`` (``[K, N]``: its forward is ``x @ w``), saved per
      Linear as ``[N, K]`` under the Linear's name;
    - ``x`` (16 tokens, seed 0) and the output of its MoE block ``model.layers.0.mlp`` for ``x``.

    Also returns the dequantized experts' relative error against the unquantized weights of ``base``
    (a check that the dequantizer is read the right way round: int4 is about 0.1)."""
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file

    m = GPTQModel.load(path, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    deq = {}
    for name, mod in m.model.named_modules():
        if ".experts." in name and hasattr(mod, "dequantize_weight"):
            w = mod.dequantize_weight().detach().float()
            assert tuple(w.shape) == (mod.in_features, mod.out_features), (name, tuple(w.shape))
            deq[name] = w.t().contiguous()
    orig = load_file(os.path.join(base, "model.safetensors"))  # the unquantized model, per-expert Linears
    num = den = 0.0
    for name, w in deq.items():  # model.layers.{L}.mlp.experts.{e}.{proj}
        layer, e, proj = name.split("layers.")[1].split(".")[0], name.split(".")[-2], name.split(".")[-1]
        mixtral = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_W[proj]}.weight"  # Mixtral's saved names
        ref = orig.get(f"{name}.weight", orig.get(mixtral)).float()
        num, den = num + (w - ref).pow(2).sum().item(), den + ref.pow(2).sum().item()
    hidden = m.model.config.hidden_size
    x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(0))
    block = m.model.model.layers[0].mlp
    with torch.no_grad():
        y = block(x[None].half())
    y = (y[0] if isinstance(y, tuple) else y)[0]
    return deq, {"x": x.contiguous(), "out": y.float().contiguous()}, (num / den) ** 0.5


def gptqmodel(out: str, only) -> list:
    """GPTQModel quantizes on the CPU (no CUDA on this machine): ``GPTQModel.load`` of the tiny bf16
    model, ``quantize`` on the calibration token ids, ``save``. Attention is left unquantized
    (``dynamic`` negative match): its o_proj has 64 inputs, fewer than a group of 128.
    GPTQModel 7.7 sizes its CPU pool at (cores + 1) // 2 workers and then asks for a loader pool of
    2: on a 2-core machine that is "Virtual pool 'model_loader:cpu' requests 2 workers but parent
    'cpu' only has 1", so GPTQMODEL_CPU_WORKERS=2 is set here."""
    names = [n for n in GPTQMODEL if not only or n in only]
    if len(names) > 1:  # one process per fixture: GPTQModel patches transformers' MoE modules per model type,
        failed = []  # and a Mixtral after a Qwen3-MoE in one process fails in its lazy loader
        for name in names:
            cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "make_checkpoint_fixtures.py")]
            if subprocess.run([*cmd, "--tool", "gptqmodel", "--out", out, "--only", name]).returncode:
                failed.append((name, "its process failed (output above)"))
        return failed
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    out = os.path.abspath(out)
    os.chdir(tempfile.mkdtemp(prefix="gptqmodel-cwd-"))  # it writes logs/gptq_log_*.log under the working folder
    from gptqmodel import GPTQModel, QuantizeConfig
    from safetensors.torch import save_file

    failed = []
    for name in names:
        model, group, sizes = GPTQMODEL[name]
        path = fresh(out, name)
        info = {"tool": "gptqmodel", "version": version("gptqmodel"), "model": model, "scheme": f"W4 g{group} sym"}
        info.update(sizes=sizes, note=gptqmodel.__doc__, layout="per-Linear [N, K] under each prefix")
        with tempfile.TemporaryDirectory() as base:
            try:
                tiny_model(model, base, **sizes)
                tokenizer().save_pretrained(base)
                q = QuantizeConfig(bits=4, group_size=group, desc_act=False, sym=True, dynamic={r"-:.*self_attn.*": {}})
                m = GPTQModel.load(base, q, device="cpu")
                ids = [{"input_ids": t[0].tolist(), "attention_mask": [1] * t.shape[1]} for t in calibration()]
                m.quantize(ids, batch_size=1)
                m.save(path)
                del m
            except Exception as e:
                traceback.print_exc()
                failed.append((name, f"{type(e).__name__}: {e}"))
                continue
            try:
                deq, io, err = _gptqmodel_outputs(path, base)
                save_file(lossless(deq), _dequantized_path(path))
                save_file(io, os.path.join(path, "tool_dequantized", "block_io.safetensors"))
                info["tool_dequantized_vs_unquantized"] = round(err, 4)
            except Exception as e:
                traceback.print_exc()
                info["dequantizer_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        write_info(path, info)
    return failed


# llm-compressor fixtures whose environment's transformers gave no dequantized experts (it maps no
# gate_proj / up_proj names for Mixtral and gpt-oss and leaves those experts random, keeps NVFP4 packed on
# the CPU, fails on W4A16_ASYM and on the mixed config): compressed-tensors' own model-free dequantizer
CT_DEQUANTIZED = [
    "llmc_fp8_mixtral", "llmc_mxfp4a16_mixtral", "llmc_w4a16_gptq_mixtral", "llmc_w8a8_int8_mixtral",
    "llmc_fp8_dynamic_gpt_oss", "llmc_nvfp4_deepseek_v3", "llmc_nvfp4a16_qwen3", "llmc_w4a16_asym_olmoe",
    "llmc_mixed_qwen3",
]  # fmt: skip


def _ct_dequantize(path: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' ``CompressedTensorsDequantizer`` (its model-free checkpoint dequantizer,
    ``compressed_tensors.entrypoints.convert``) on the folder's expert tensors, in float32: the expert
    Linears' weights [N, K] under their module names. Only the experts' tensors are given to it: without
    the model it cannot tell a Linear's ``weight`` from an embedding's (target "Linear" matched
    ``model.embed_tokens.weight`` and asked for its weight_scale), and ``process`` is called rather
    than ``validate``, which counts NVFP4's ``input_global_scale`` as an orphan parameter."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items() if ".experts." in k}
    out = CompressedTensorsDequantizer(path, dtype=torch.float32).process(tensors)
    return {k[: -len(".weight")]: v.contiguous() for k, v in out.items() if ".experts." in k and k.endswith(".weight")}


def _add_dequantized(out: str, names, only, dequantize, note: str) -> list:
    """Write ``tool_dequantized/experts.safetensors`` = ``dequantize(folder)`` beside each fixture of
    ``names`` already in ``out`` (the checkpoints are not rewritten) and record ``note`` in its
    fixture.json; returns [(fixture, error)] for the ones that failed."""
    from safetensors.torch import save_file

    failed = []
    for name in names:
        if only and name not in only:
            continue
        path = os.path.join(out, name)
        try:
            deq = dequantize(path)
        except Exception as e:
            traceback.print_exc()
            failed.append((name, f"{type(e).__name__}: {e}"))
            continue
        save_file(lossless(deq), _dequantized_path(path))
        with open(os.path.join(path, "fixture.json")) as f:
            info = json.load(f)
        info.pop("dequantizer_failed", None)
        info["layout"] = "per-Linear [N, K] under each prefix"
        info["tool_dequantized"] = note
        with open(os.path.join(path, "fixture.json"), "w") as f:
            json.dump(info, f, indent=1, sort_keys=True)
        print(f"wrote {path}/tool_dequantized: {len(deq)} expert Linears", flush=True)
    return failed


def ct_dequantize(out: str, only) -> list:
    """``tool_dequantized/`` by compressed-tensors' own dequantizer for the llm-compressor fixtures
    (CT_DEQUANTIZED); run in llm-compressor's environment (the compressed-tensors that wrote them)."""
    note = (
        f"compressed-tensors {version('compressed-tensors')} CompressedTensorsDequantizer (model-free, float32); "
        f"transformers {version('transformers')} loading the folder gave no dequantized experts"
    )
    return _add_dequantized(out, CT_DEQUANTIZED, only, _ct_dequantize, note)


def _modelopt_dequantize(path: str) -> dict[str, torch.Tensor]:
    """ModelOpt's own dequantizers of its export format (``modelopt.torch.quantization.qtensor``):
    ``NVFP4QTensor.dequantize`` (packed e2m1, e4m3 ``weight_scale`` per 16, fp32 ``weight_scale_2``) and
    ``FP8QTensor.dequantize`` (e4m3, per-tensor ``weight_scale``), float32, per expert Linear [N, K]."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    from safetensors.torch import load_file

    st = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    for k, w in st.items():
        if ".experts." not in k or not k.endswith(".weight"):
            continue
        name = k[: -len(".weight")]
        if w.dtype == torch.uint8:  # NVFP4: two e2m1 codes per byte along K
            shape = torch.Size([w.shape[0], w.shape[1] * 2])
            q = NVFP4QTensor(shape, torch.float32, w)
            kw = dict(scale=st[f"{name}.weight_scale"], double_scale=st[f"{name}.weight_scale_2"], block_sizes={-1: 16})
            out[name] = q.dequantize(dtype=torch.float32, **kw)
        else:
            out[name] = FP8QTensor(w.shape, torch.float32, w).dequantize(
                dtype=torch.float32, scale=st[f"{name}.weight_scale"]
            )
    return {k: v.float().contiguous() for k, v in out.items()}


def modelopt_dequantize(out: str, only) -> list:
    """``tool_dequantized/`` by ModelOpt's own dequantizers for the ModelOpt fixtures; run in
    ModelOpt's environment."""
    note = f"nvidia-modelopt {version('nvidia-modelopt')} NVFP4QTensor / FP8QTensor.dequantize (float32)"
    return _add_dequantized(out, MODELOPT, only, _modelopt_dequantize, note)


TOOLS = {
    "llmcompressor": llmcompressor,
    "transformers": transformers_fp8,
    "modelopt": modelopt,
    "autoawq": autoawq,
    "gptqmodel": gptqmodel,
    "ct-dequantize": ct_dequantize,
    "modelopt-dequantize": modelopt_dequantize,
}
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
