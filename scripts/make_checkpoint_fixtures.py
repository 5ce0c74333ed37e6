"""Write tests/fixtures/checkpoints/: tiny MoE models quantized by the tools users run.

Each fixture is a folder as the tool saved it (config.json, model.safetensors,
the tool's own quantization files) plus ``fixture.json`` (tool, its version,
transformers' version, model, scheme, what was done) and, where the tool has a
dequantizer, ``tool_dequantized/experts.safetensors`` (a subfolder, so that a
loader reading the checkpoint's ``*.safetensors`` never sees it): the expert weights as the tool's
own code dequantizes them (the model the tool's environment builds from the
saved checkpoint, float32), under the names of the loaded module's fused
parameters (``model.layers.{L}.{block}.experts.gate_up_proj`` / ``down_proj``)
with the layout flags in fixture.json, or per expert Linear under its own name
(``...experts.{e}.gate_proj`` -> [N, K]) where the tool dequantizes Linears; stored
in the narrowest float type that holds the values exactly (``lossless``).

Run one tool per call, in a virtual environment that has it (their pins
conflict: llm-compressor 0.14 pins transformers 5.17);
``scripts/make_checkpoint_fixtures.sh`` makes the environments and runs all::

    python scripts/make_checkpoint_fixtures.py --tool llmcompressor --out tests/fixtures/checkpoints

Models (random weights, seed 0): hidden 64, 4 experts of intermediate 64,
top-2, one decoder layer (two for the mixed-scheme one), vocabulary 32; the
int4 presets with groups of 128 get hidden and intermediate 128.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys

import torch

H, I, E, VOCAB = 64, 64, 4, 32
_NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_config(model: str, hidden: int = H, inter: int = I, layers: int = 1):
    """A transformers config of the tiny ``model`` (mixtral, qwen3_moe, deepseek_v3, gpt_oss, olmoe)."""
    import transformers as tf

    c = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, vocab_size=VOCAB, **_NO_IDS)
    if model == "mixtral":
        return tf.MixtralConfig(**c, num_key_value_heads=1, intermediate_size=inter, num_local_experts=E)
    if model == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **c, num_key_value_heads=1, intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=E,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
        )  # fmt: skip
    if model == "olmoe":
        return tf.OlmoeConfig(**c, num_key_value_heads=1, intermediate_size=inter, num_experts=E, num_experts_per_tok=2)
    if model == "deepseek_v3":
        mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        return tf.DeepseekV3Config(
            **c, **mla, num_key_value_heads=2, intermediate_size=2 * inter, moe_intermediate_size=inter,
            n_routed_experts=E, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=0, norm_topk_prob=True, routed_scaling_factor=2.5,
        )  # fmt: skip
    if model == "gpt_oss":
        return tf.GptOssConfig(
            **c, num_key_value_heads=1, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=2,
            head_dim=32, sliding_window=8, layer_types=["full_attention"] * layers,
        )  # fmt: skip
    raise SystemExit(f"unknown model {model!r}")


def tiny_model(model: str, path: str, **sizes):
    """Build, randomise (std 0.5 biases, 1/sqrt(fan-in) matrices), save in bf16; return the path."""
    import transformers as tf

    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(tiny_config(model, **sizes))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                continue
            std = 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    m.to(torch.bfloat16).save_pretrained(path)
    return path


def tokenizer():
    """A word-level tokenizer of VOCAB tokens (llm-compressor wants a processor with a dataset)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def calibration(n: int = 16, seq: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, seq), generator=g) for _ in range(n)]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def lossless(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each float tensor in the narrowest of float16 / bfloat16 / float32 that holds its values exactly
    (a tool that dequantizes in float16 or bfloat16 gives values of that type: half the bytes)."""
    out = {}
    for k, t in tensors.items():
        t = t.float().contiguous()
        for dt in (torch.float16, torch.bfloat16):
            if torch.equal(t.to(dt).float(), t):
                t = t.to(dt)
                break
        out[k] = t
    return out


def _dequantized_path(path: str) -> str:
    os.makedirs(os.path.join(path, "tool_dequantized"), exist_ok=True)
    return os.path.join(path, "tool_dequantized", "experts.safetensors")


def save_dequantized(path: str) -> dict:
    """Load the saved checkpoint with this environment's transformers (the tool's own decompression)
    and save its experts in float32; returns the layout flags."""
    import transformers as tf
    from safetensors.torch import save_file

    m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out, flags = {}, {}
    for name, mod in m.named_modules():
        if name.endswith("experts") and hasattr(mod, "gate_up_proj"):
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}"] = getattr(mod, p).detach().float().contiguous()
            flags = {k: bool(getattr(mod, k, d)) for k, d in (("is_transposed", False), ("is_concatenated", True))}
    save_file(out, _dequantized_path(path))
    return flags


def write_info(path: str, info: dict) -> None:
    info = {**info, "transformers": version("transformers"), "torch": version("torch")}
    with open(os.path.join(path, "fixture.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
    print(f"wrote {path}: {info.get('tool')} {info.get('scheme')} on {info.get('model')}", flush=True)


def fresh(out: str, name: str) -> str:
    path = os.path.join(out, name)
    shutil.rmtree(path, ignore_errors=True)
    return path


def main() -> int:
    from _fixture_tools import TOOLS  # noqa: PLC0415  (the per-tool writers, beside this file)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tool", required=True, choices=sorted(TOOLS))
    p.add_argument("--out", default="tests/fixtures/checkpoints")
    p.add_argument("--only", default=None, help="comma list of fixture names")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    failed = TOOLS[args.tool](args.out, only)
    for name, why in failed:
        print(f"FAILED {name}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
