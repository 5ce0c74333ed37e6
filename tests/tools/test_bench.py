"""The benchmark's arithmetic and outputs on the CPU (the timing itself needs a GPU: gpu_suite.sh).

- the PyTorch grouped-GEMM provider computes the layer (against the float64 reference);
- the roofline floor and its bound; the matmul rate per scheme;
- the bar verdicts, the w4a16 speedups, the markdown and the plot.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance
from fusedmoe.tools.bench import (
    COMPUTE_BAR,
    DECODE_BAR,
    MEMORY_BAR,
    Row,
    TorchGroupedMM,
    bar_verdicts,
    matmul_rate,
    plot,
    roofline,
    to_markdown,
    w4a16_speedups,
)
from fusedmoe.tools.presets import preset_config, preset_router

CONFIGS = {
    "silu": MoEConfig(num_experts=5, top_k=2, hidden_size=64, intermediate_size=32),
    "swigluoai_bias": MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=64,
        intermediate_size=32,
        activation="swigluoai",
        has_bias=True,
        gate_up_interleaved=True,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_torch_grouped_mm_provider_matches_reference(name):
    cfg = CONFIGS[name]
    scheme = QuantScheme.by_name("bf16")
    p = make_problem(cfg, scheme, 11, seed=3)
    impl = TorchGroupedMM(cfg, scheme, p.weights)
    out = impl(p.x, TopK(p.topk_ids, p.topk_weights))
    assert rel_error(out, p.reference()) <= tolerance(scheme, cfg.dtype)


def test_torch_provider_refuses_block_scales():
    scheme = QuantScheme.by_name("fp8_block")
    p = make_problem(MoEConfig(num_experts=2, top_k=1, hidden_size=256, intermediate_size=128), scheme, 3)
    with pytest.raises(NotImplementedError, match="fp8_block"):
        TorchGroupedMM(p.config, scheme, p.weights)


def test_roofline_bounds():
    cfg = preset_config("deepseek-v3")
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * 2
    bw, rate = 4e12, 7e14
    floor, bound, nbytes, flops = roofline(cfg, 1, 8, per_expert, rate, bw)
    assert bound == "memory"
    assert nbytes == 8 * per_expert + 2 * cfg.hidden_size * 2
    assert floor == pytest.approx(nbytes / bw * 1e3)
    floor, bound, _, flops = roofline(cfg, 16384, 256, per_expert, rate, bw)
    assert bound == "compute"
    assert flops == 2 * 16384 * 8 * cfg.hidden_size * 3 * cfg.intermediate_size
    assert floor == pytest.approx(flops / rate * 1e3)


def test_matmul_rate_per_scheme():
    ceil = {"bf16_flop_per_s": 1.0, "fp8_flop_per_s": 2.0}
    assert matmul_rate(QuantScheme.by_name("fp8_block"), ceil) == 2.0
    assert matmul_rate(QuantScheme.by_name("fp8_tensor"), ceil) == 2.0
    assert matmul_rate(QuantScheme.by_name("bf16"), ceil) == 1.0
    assert matmul_rate(QuantScheme.by_name("int4_g128"), ceil) == 1.0
    assert matmul_rate(QuantScheme.by_name("mxfp4"), ceil) == 1.0


def _row(provider, ms, t=64, scheme="bf16", pct=90.0, bound="memory", mode="graph", preset="p"):
    return Row(preset, scheme, t, provider, mode, ms, ms * pct / 100, pct, bound, 1.0, 1.0, 8, "cmd")


def test_bar_verdicts():
    rows = [
        _row("fusedmoe", 1.0, pct=90.0),
        _row("torch_grouped_mm", 2.0, pct=45.0),
        _row("fusedmoe", 1.0, t=4096, pct=70.0, bound="compute"),
        _row("torch_grouped_mm", 0.9, t=4096, pct=78.0, bound="compute"),
        _row("fusedmoe", 1.0, t=1, pct=80.0),
        _row("fusedmoe", 3.0, t=1, pct=20.0, mode="eager"),
    ]
    v = {r["tokens"]: r for r in bar_verdicts(rows)}
    assert v[64]["misses"] == [] and v[64]["need"] == MEMORY_BAR
    assert v[4096]["need"] == COMPUTE_BAR and len(v[4096]["misses"]) == 2
    assert v[1]["need"] == pytest.approx(DECODE_BAR) and v[1]["ms"] == 1.0  # the graph row, not eager
    assert v[1]["misses"] and "80%" in v[1]["misses"][0]


def test_w4a16_speedups_and_markdown(tmp_path):
    rows = [
        _row("fusedmoe", 0.9, t=1, scheme="bf16"),
        _row("fusedmoe", 0.25, t=1, scheme="int4_g128"),
        _row("fusedmoe", 0.45, t=1, scheme="mxfp4"),
    ]
    rows[0].kernels, rows[0].launches = [("_grouped_gemm_kernel", 2.0, 30.0)], 2.0
    s = {r["scheme"]: r["speedup"] for r in w4a16_speedups(rows)}
    assert s == {"int4_g128": pytest.approx(3.6), "mxfp4": pytest.approx(2.0)}
    meta = {"gpu": "G", "date": "d", "torch": "t", "triton": "tr", "copy_bytes_per_s": 1e12,
            "bf16_flop_per_s": 1e15, "fp8_flop_per_s": 2e15}  # fmt: skip
    md = to_markdown(rows, meta)
    assert "| p | int4_g128 | 1 | fusedmoe | graph | 0.2500 |" in md
    assert "3.60x" in md and "2.00x" in md
    assert "_grouped_gemm_kernel x2 30.0 us" in md
    assert "Not run" not in md
    md = to_markdown(rows, {**meta, "not_run": ["gpt-oss-20b int4_g128: hidden_size=2880 is not a multiple"]})
    assert "Not run (the scheme cannot store the preset's weights): gpt-oss-20b int4_g128" in md
    assert md.index("Not run") < md.index("| preset | scheme |")
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert plot(rows, meta, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b"])
def test_preset_router_routes(preset):
    router, biased = preset_router(preset)
    cfg = preset_config(preset)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) if biased else None
    tk = router.route(logits, bias)
    assert tk.ids.shape == (5, cfg.top_k)
    assert biased == (preset == "deepseek-v3")
    out = poison_(torch.empty(5))
    out.copy_(tk.weights.sum(1))
    expected = 2.5 if preset == "deepseek-v3" else 1.0  # renormalized, times the scaling factor
    assert torch.allclose(out, torch.full((5,), expected), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("sname", ["bf16", "fp8_token", "fp8_channel"])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_torch_grouped_mm_provider_on_gpu(preset, sname):
    """The PyTorch provider the bench compares with computes the layer. Its fp8 activations
    are row-wise, so it is checked on the row-wise schemes; in fp8_tensor cells it computes
    fp8_token (same bytes and FLOPs; 6.5e-2 from the per-tensor reference on Qwen3, H100)."""
    cfg = preset_config(preset)
    scheme = QuantScheme.by_name(sname)
    p = make_problem(cfg, scheme, 64, device="cuda")
    out = TorchGroupedMM(cfg, scheme, p.weights)(p.x, TopK(p.topk_ids, p.topk_weights))
    err = rel_error(out, p.reference())
    print(f"MAXERR bench torch provider {preset} {sname}: {err:.2e}")
    assert err <= tolerance(scheme, cfg.dtype)
