"""The benchmark's arithmetic and outputs on the CPU (the timing itself needs a GPU: gpu_suite.sh).

- the PyTorch grouped-GEMM provider computes the layer (against the float64 reference);
- the roofline floor and its bound; the matmul rate per scheme;
- the bar verdicts, the w4a16 speedups, the markdown and the plot;
- the eager figures' arithmetic (a fake clock), a failed measurement recorded on its row, and
  the eager and peer columns of the markdown.
"""

from __future__ import annotations

import pytest
import torch

from fusedmoe.config import MoEConfig
from fusedmoe.metadata import TopK
from fusedmoe.quant import QuantScheme
from fusedmoe.testing import make_problem, poison_, rel_error, tolerance
from fusedmoe.tools import bench
from fusedmoe.tools.bench import (
    COMPUTE_BAR,
    DECODE_BAR,
    MEMORY_BAR,
    Row,
    TorchGroupedMM,
    bar_verdicts,
    eager_host_us,
    eager_wall_us,
    matmul_rate,
    plot,
    roofline,
    to_markdown,
    w4a16_speedups,
)
from fusedmoe.tools.peers import attach_peers, load_peers, ratio_summary
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


class FakeGPU:
    """A clock that each call moves by its host time, and a synchronize that waits out the queued
    GPU work (``gpu_us`` per call): host time and wall time come out exactly."""

    def __init__(self, host_us, gpu_us):
        self.now, self.host, self.gpu, self.queued, self.calls, self.syncs = 0.0, host_us, gpu_us, 0.0, [], 0

    def clock(self):
        return self.now

    def fn(self, i):
        def call():
            self.calls.append(i)
            self.now += self.host * 1e-6
            self.queued = max(self.queued, self.now) + self.gpu * 1e-6

        return call

    def sync(self):
        self.syncs += 1
        self.now = max(self.now, self.queued)


def test_eager_host_time_counts_enqueueing_only_and_rotates_input_sets():
    g = FakeGPU(host_us=30.0, gpu_us=500.0)
    us = eager_host_us([g.fn(0), g.fn(1)], calls=10, warmup=2, sync=g.sync, clock=g.clock)
    assert us == pytest.approx(30.0)  # the GPU's 500 us per call is drained after the span
    assert g.calls == [0, 1] * 2 + [0, 1] * 5 and g.syncs == 2  # warm-up, then after the span
    assert g.now >= 14 * 500e-6  # the queue drained


def test_eager_wall_time_is_the_median_of_synchronised_calls():
    g = FakeGPU(host_us=30.0, gpu_us=500.0)
    us = eager_wall_us([g.fn(0), g.fn(1), g.fn(2)], calls=5, warmup=1, sync=g.sync, clock=g.clock)
    assert us == pytest.approx(530.0)  # host then GPU, one call at a time
    assert g.calls == [0, 1, 2] + [0, 1, 2, 0, 1] and g.syncs == 1 + 5
    g = FakeGPU(host_us=800.0, gpu_us=100.0)  # host-bound: the host time is the wall time
    assert eager_wall_us([g.fn(0)], calls=3, warmup=0, sync=g.sync, clock=g.clock) == pytest.approx(900.0)


def test_a_failed_measurement_is_recorded_on_its_row_and_the_run_goes_on():
    row = _row("fusedmoe", 1.0)

    def boom():
        raise RuntimeError("out of memory")

    assert bench._measured(row, "eager wall time", boom) is None
    assert bench._measured(row, "eager host time", lambda: 12.5) == 12.5
    assert row.errors == ["eager wall time: RuntimeError: out of memory"]


def test_a_cell_records_what_fails_and_goes_on(monkeypatch):
    """A provider whose timing fails is listed, the next one runs; a failed eager figure is
    recorded on the fusedmoe row beside the ones that worked (fake timers: no GPU needed)."""

    def median_ms(fns, graph=True):
        fns[0]()
        return 0.5, "graph" if graph else "eager"

    def good(x, logits, bias):
        return x

    def bad(x, logits, bias):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(bench, "eager_host_us", lambda fns: 12.0)
    monkeypatch.setattr(bench, "eager_wall_us", lambda fns: (fns[0](), 34.0)[1])
    b = bench._Bench(
        {}, ("fusedmoe", "loop"), True, False, 2, timer=type("T", (), {"median_ms": staticmethod(median_ms)})
    )
    x, logits = torch.zeros(16, 8), torch.zeros(16, 4)
    cell = bench._Cell("p", "bf16", 16, None, [(x, logits, None)] * 2, 2.0, 0.25, "memory", 1e6, 1e9)
    rows = b.provider(cell, "fusedmoe", good, True, (bad, None))
    assert [(r.provider, r.mode, r.ms, r.pct_of_floor) for r in rows] == [
        ("fusedmoe", "graph", 0.5, 50.0),
        ("fusedmoe", "eager", 0.5, 50.0),  # T <= 64: also timed eagerly
    ]
    assert (rows[0].eager_host_us, rows[0].eager_wall_us, rows[0].fused_moe_us) == (12.0, 34.0, None)
    assert rows[0].errors == ["fused_moe() wall time: RuntimeError: no kernel for this shape"]
    assert rows[1].eager_wall_us is None and rows[0].command.endswith("--tokens 16 --providers fusedmoe")
    rows = b.provider(cell, "fusedmoe", good, True, (None, "fused_moe(): UnsupportedError: padded H"))
    assert rows[0].errors == ["fused_moe(): UnsupportedError: padded H"]
    assert b.provider(cell, "loop", bad, False, (None, None)) == []
    assert b.failed == ["p bf16 T=16 loop: RuntimeError('no kernel for this shape')"]


def _meta(**kw):
    ceilings = {"copy_bytes_per_s": 1e12, "bf16_flop_per_s": 1e15, "fp8_flop_per_s": 2e15}
    return {"gpu": "NVIDIA H100 80GB HBM3", "date": "d", "torch": "t", "triton": "tr", **ceilings,
            "eager_calls": {"host": 100, "wall": 25}, **kw}  # fmt: skip


def test_markdown_shows_eager_figures_peers_and_their_geometric_means():
    peers = load_peers()
    rows = [
        _row("fusedmoe", 0.0540 * 1.5, t=1, preset="qwen3-30b-a3b"),  # best peer 54.0 us
        _row("fusedmoe", 0.2, t=1, preset="qwen3-30b-a3b", mode="eager"),
        _row("fusedmoe", 0.2866 / 1.5, t=16, preset="qwen3-30b-a3b"),  # best peer 286.6 us
        _row("torch_grouped_mm", 0.5, t=16, preset="qwen3-30b-a3b"),
    ]
    rows[0].eager_host_us, rows[0].eager_wall_us, rows[0].fused_moe_us = 61.25, 263.5 * 2, 700.0
    rows[2].errors = ["fused_moe() wall time: RuntimeError: boom"]
    attach_peers(rows, peers)
    assert [r["scheme"] for r in ratio_summary(rows)] == ["bf16"]
    meta = _meta(peers={"path": peers.path, **peers.source}, failed=["deepseek-v3 bf16: OutOfMemoryError"])
    md = to_markdown(rows, meta)
    head = "| preset | scheme | T | graph | peer best | who | ratio | eager host | eager wall | fused_moe() "
    assert head in md
    assert (
        "| qwen3-30b-a3b | bf16 | 1 | 81.0 | 54.0 | vLLM Triton (H200 tuned cfg) | 1.50 | 61.2 | 527.0 | 700.0 "
        "| 263.5 | 2.00 |  |" in md
    )
    assert "| qwen3-30b-a3b | bf16 | 16 | 191.1 | 286.6 | vLLM Triton | 0.67 |  |  |  |  |  | fused_moe() wall " in md
    assert "| bf16 | 2 | 1.000 | 1.049 | 1 | 2.000 |" in md  # sqrt(1.5 * 0.667); recorded sqrt(1.10 * 1.00)
    assert "Failed (the run went on): deepseek-v3 bf16: OutOfMemoryError" in md
    assert "100 calls without synchronisation" in md and "median of 25" in md
    assert "`peer_times_h100.json`" in md and "ratios compare GPUs" not in md
    md = to_markdown(rows, {**meta, "gpu": "NVIDIA H200", "peer_layer_differs": {"deepseek-v3": "sigmoid routing"}})
    assert "the peers were timed on H100 80GB HBM3: ratios compare GPUs" in md
    assert "- deepseek-v3: the bench's layer has sigmoid routing" in md
    assert "per call: CUDA graph" not in to_markdown(rows[3:], _meta())  # no fusedmoe figures: no section


def test_peers_meta_names_the_presets_the_peers_ran_differently():
    m = bench.peers_meta(load_peers(), ["mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"])
    assert m["peers"]["gpu"] == "H100 80GB HBM3" and m["peers"]["path"].endswith("peer_times_h100.json")
    assert set(m["peer_layer_differs"]) == {"deepseek-v3", "gpt-oss-20b"}
    assert bench.peers_meta(None, ["deepseek-v3"]) == {}


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
