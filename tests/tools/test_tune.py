"""The tuner under the interpreter (tiny space, tiny layers): several presets and schemes in one
CLI call, files the runtime reads back, GEMM2 under GEMM1's BM, the budget, atomic writes,
rejected outputs, two-stage timing, and the compile workers' specialisation matching the main
process's (in-process and in a spawned worker)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from fusedmoe import cli, env
from fusedmoe.kernels import launch, tuned_configs
from fusedmoe.kernels._common import interpreting
from fusedmoe.kernels.grouped_gemm_w4 import w4_launch_config
from fusedmoe.kernels.launch_config import LaunchConfig, pick_launch_config
from fusedmoe.quant import QuantScheme
from fusedmoe.quant.w4_layout import LAYOUT
from fusedmoe.testing import random_topk, rel_error
from fusedmoe.tools.presets import PRESETS, preset_config
from fusedmoe.tools.tune import Combo, candidates, operands, pool, probe, report, space, tune_many
from fusedmoe.tools.tune import run as runner

TINY = {
    "tiny-a": dict(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32),
    # prime E, K = 1 (GEMM1's a_div is the constant 1), H and I not powers of 2
    "tiny-b": dict(num_experts=3, top_k=1, hidden_size=48, intermediate_size=24),
}


@pytest.fixture(scope="module", autouse=True)
def tiny_presets():
    with pytest.MonkeyPatch.context() as mp:
        for name, shape in TINY.items():
            mp.setitem(PRESETS, name, shape)
        yield


def _json(path):
    return json.loads(path.read_text())


def test_candidates_keep_small_tiles_for_decode():
    dec = candidates("quick", 8, 64)  # 8 pairs over 64 experts
    assert dec and {c.block_m for c in dec} == {1, 2, 16}  # the FMA path: BM <= twice the rows (1)
    assert {c.block_m for c in candidates("quick", 4 * 64, 64)} == {1, 2, 4, 8, 16}  # 4 rows per expert
    assert min(c.block_m for c in candidates("quick", 16 * 64, 64)) == 16  # past DECODE_ROWS: tensor cores
    assert all(c.block_m == 16 for c in candidates("tiny", 8, 64))
    pinned = candidates("quick", 8, 64, block_m=1)  # GEMM2 under GEMM1's BM 1: the FMA grid only
    assert (
        pinned
        and {c.block_m for c in pinned} == {1}
        and len(pinned)
        == len(space.DECODE_SPACE["block_n"])
        * len(space.DECODE_SPACE["block_k"])
        * len(space.DECODE_SPACE["num_stages"])
    )
    assert {c.block_m for c in candidates("quick", 8, 64, block_m=16)} == {16}
    assert any(c.block_m == 128 for c in candidates("quick", 64 * 512, 64))
    assert candidates("quick", 4096, 8, block_m=32) and all(c.block_m == 32 for c in candidates("quick", 4096, 8, 32))


def test_group_m_only_where_an_expert_has_several_tiles():
    assert {c.group_m for c in candidates("quick", 8, 64)} == {1}  # 0.125 rows per expert
    many = candidates("quick", 64 * 512, 64)  # 512 rows per expert: several tiles at every BM
    # + the persistent kernel's 16, and 3 of its two-per-SM tiles whose 2-byte stages fit twice
    assert {c.group_m for c in many} == {1, 8} and len(many) == 96 + 16 + 3
    assert sum(c.persistent for c in many) == 19


@pytest.mark.parametrize("pairs", [64 * 512, 64 * 4], ids=["prefill", "decode"])
def test_every_kernel_path_is_in_the_head_of_a_step(pairs):
    """By distance from an 8-warp persistent heuristic, the two-per-SM and one-program tiles rank
    far down; ``families_first`` puts the nearest of each path right after the head, so a budget
    that screens a step's first few candidates still meets every path, and nothing is lost."""
    heur = LaunchConfig(128, 256, 128, 8, 8, 3, persistent=True) if pairs > 64 * 64 else LaunchConfig(16, 64, 128, 1)
    ranked = space.by_distance([heur] + candidates("quick", pairs, 64, operand_bytes=1), heur)
    paths = {space.family(c) for c in ranked}
    out = space.families_first(ranked, 1)
    assert sorted(map(repr, out)) == sorted(map(repr, ranked)) and out[0] == heur
    assert {space.family(c) for c in out[: len(paths)]} == paths
    if pairs > 64 * 64:
        assert len(paths) >= 4 and any(c.programs_per_sm == 2 for c in out[: len(paths)])
        assert not any(c.programs_per_sm == 2 for c in ranked[: len(paths)])  # by distance alone: none
    else:
        assert any(c.block_m < 16 for c in out[: len(paths)])  # the FMA path


def test_two_programs_per_sm_only_where_two_fit_an_sm():
    fp8 = [c for c in candidates("quick", 64 * 512, 64, operand_bytes=1) if c.programs_per_sm == 2]
    bf16 = [c for c in candidates("quick", 64 * 512, 64, operand_bytes=2) if c.programs_per_sm == 2]
    shape = {(c.block_m, c.block_n, c.block_k, c.num_stages) for c in fp8}
    assert (64, 128, 128, 4) in shape and (64, 256, 64, 4) in shape  # 96 KiB and 80 KiB of stages
    assert (64, 256, 128, 3) not in shape and (128, 128, 128, 4) not in shape  # 120 and 128 KiB: one fits
    assert all(c.block_m * c.block_n <= space.PAIRED_TILE and c.num_warps == 4 and c.persistent for c in fp8)
    assert {(c.block_m, c.block_n, c.block_k, c.num_stages) for c in bf16} == {(64, 128, 64, 3), (64, 128, 64, 4),
                                                                               (128, 128, 64, 3)}  # fmt: skip
    assert not [c for c in candidates("quick", 64 * 32, 64, operand_bytes=1) if c.programs_per_sm == 2]  # decode


def test_w4_candidates_cover_both_orientations_and_split_k_fma_for_decode():
    dec = space.w4_candidates("quick", 2, 8)  # Mixtral at T = 1: 0.25 rows per expert
    fma = [c for c in dec if c.block_m == 1]
    assert {c.split_k for c in fma} == {1, 2, 4, 8} and all(c.w_major for c in fma)
    assert {c.block_m for c in dec} == {1, 16} and {c.w_major for c in dec if c.block_m == 16} == {0, 1}
    pre = space.w4_candidates("quick", 4096 * 2, 8)  # T = 4096: 1024 rows per expert
    assert {c.block_m for c in pre} == {16, 32, 64, 128, 256} and all(c.split_k == 1 for c in pre)
    assert all(c.w_major for c in pre if c.block_m > 64)  # C-major only for small BM
    assert all(c.block_m * c.block_n <= 128 * 256 for c in pre)
    assert all(c.num_warps == 4 for c in pre if c.block_m * c.block_n < 128 * 128)
    assert {c.group_m for c in pre} == {1, 8} and {c.group_m for c in dec} == {1}


def test_combos_whose_scheme_cannot_store_the_shape_are_refused_with_the_reason():
    kept, refused = operands.storable([Combo("gpt-oss-20b", "int4_g128"), Combo("gpt-oss-20b", "mxfp4")])
    assert [c.scheme for c in kept] == ["mxfp4"]  # H = I = 2880: 90 groups of 32, 22.5 of 128
    assert len(refused) == 1 and "gpt-oss-20b int4_g128" in refused[0] and "group size 128" in refused[0]
    with pytest.raises(Exception, match="scheme"):
        operands.storable([Combo("gpt-oss-20b", "no_such_scheme")])


def test_steps_interleave_so_gemm2_compiles_during_the_next_gemm1():
    assert runner._steps([1, 8, 16]) == [("w13", 1), ("w13", 8), ("w2", 1), ("w13", 16), ("w2", 8), ("w2", 16)]
    assert space.parse_presets("all") == list(space.ALL_PRESETS)


# ---- one CLI call: two presets x two schemes ------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned")
    argv = ["tune", "--preset", "tiny-a,tiny-b", "--scheme", "bf16,fp8_block", "--tokens", "1"]
    rc = cli.main([*argv, "--space", "tiny", "--out", str(out), "--summary", str(out / "summary.md")])
    return rc, out


def test_cli_tunes_every_preset_and_scheme(cli_run):
    rc, out = cli_run
    assert rc == 0
    files = sorted(out.rglob("*.json"))
    assert len(files) == 8  # 2 presets x 2 schemes x 2 GEMMs
    for f in files:
        data = _json(f)
        k = 1 if data["E"] == 3 else 2
        assert set(data["configs"]) == {str(k)}  # pairs = T * K
        assert set(data["ms"]) == set(data["heuristic_ms"]) == set(data["configs"])
    summary = (out / "summary.md").read_text()
    for name in ("tiny-a bf16", "tiny-a fp8_block", "tiny-b bf16", "tiny-b fp8_block"):
        assert f"## {name}" in summary
    checked, mismatched = map(int, re.search(r"warm keys checked (\d+), mismatched (\d+)", summary).groups())
    assert checked > 0 and mismatched == 0
    assert not list(out.rglob("*.tmp"))


def test_tuned_files_round_trip_into_pick_launch_config(cli_run, monkeypatch):
    _, out = cli_run
    monkeypatch.setenv(env.CONFIG_DIR, str(out))
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: "cpu-interpreter")
    tuned_configs.clear_cache()
    for f in out.rglob("*.json"):
        data = _json(f)
        for pairs, cfg in data["configs"].items():
            assert pick_launch_config(int(pairs), data["E"], data["N"], data["K"], data["scheme"]) == LaunchConfig(
                **cfg
            )
    tuned_configs.clear_cache()


def test_second_gemm_is_tuned_under_the_first_gemms_block_m(cli_run):
    _, out = cli_run
    for shape in TINY.values():
        e, h, i = shape["num_experts"], shape["hidden_size"], shape["intermediate_size"]
        for scheme in ("bf16", "fp8_block"):
            first, second = (
                _json(out / "cpu_interpreter" / scheme / f"E={e},N={n},K={k}.json") for n, k in ((2 * i, h), (h, i))
            )
            assert {p: c["block_m"] for p, c in first["configs"].items()} == {
                p: c["block_m"] for p, c in second["configs"].items()
            }


def test_dry_run_counts_candidates_and_compiles(capsys):
    assert cli.main(["tune", "--preset", "tiny-a", "--scheme", "bf16", "--space", "tiny", "--dry-run"]) == 0
    assert "distinct compiles" in capsys.readouterr().out


# ---- timing, rejection, budget, writes ---------------------------------------------------


class FakeTime:
    """A clock that only the timer moves (1 s per timing), and a timer with a table of ms."""

    def __init__(self, ms=lambda cfg: 1.0):
        self.now, self.ms, self.calls = 0.0, ms, []

    def clock(self):
        return self.now

    def timer(self, cfg, fn, target_ms):
        self.now += 1.0
        self.calls.append((cfg, target_ms))
        return self.ms(cfg)


def test_two_stage_timing_picks_the_fastest_and_reports_the_speedup(tmp_path):
    ft = FakeTime(lambda cfg: 0.5 if cfg.block_n == 32 else 1.0)
    rep = tune_many(["tiny-a"], ["bf16"], [1], extra_tokens=[8], out_dir=tmp_path, space="tiny", device="cpu",
                    timer=ft.timer, clock=ft.clock, screen_ms=2.0, retime_ms=20.0, top=1)  # fmt: skip
    steps = rep.combos[0].steps.values()
    assert len(steps) == 4
    assert all(set(_json(f)["configs"]) == {"2", "16"} for f in rep.files)  # both phases, one file per GEMM
    for r in steps:
        assert r.cfg.block_n == 32 and r.speedup == pytest.approx(2.0) and r.screened == 2
    assert {t for _, t in ft.calls} == {2.0, 20.0}
    assert sum(t == 20.0 for _, t in ft.calls) == 4 * 2  # per step: the heuristic and top=1 finalist


def test_a_candidate_with_a_wrong_output_is_rejected(tmp_path, monkeypatch):
    launch = operands.launch

    def corrupt(op, cfg, routing):  # a config that computes something else (and would be fastest)
        out = launch(op, cfg, routing)
        return out.mul_(1.5) if cfg.block_n == 32 else out

    monkeypatch.setattr(runner, "launch", corrupt)  # the main process checks and times through it
    ft = FakeTime(lambda cfg: 0.5 if cfg.block_n == 32 else 1.0)
    rep = tune_many(["tiny-a"], ["bf16"], [1], out_dir=tmp_path, space="tiny", device="cpu", timer=ft.timer,
                    clock=ft.clock)  # fmt: skip
    for r in rep.combos[0].steps.values():
        assert [c.block_n for c, _ in r.rejected] == [32] and r.rejected[0][1] > runner.TOLERANCE
        assert r.cfg.block_n == 64
    assert all(c["block_n"] == 64 for f in rep.files for c in _json(f)["configs"].values())


def test_budget_stops_between_steps_and_writes_only_finished_token_counts(tmp_path):
    ft = FakeTime()  # every step costs ~5 fake seconds; 12 s left after the write reserve
    rep = tune_many(["tiny-a"], ["bf16"], [1, 8], extra_tokens=[16], out_dir=tmp_path, space="tiny", device="cpu",
                    timer=ft.timer, clock=ft.clock, budget_s=runner.WRITE_RESERVE_S + 12)  # fmt: skip
    assert rep.stopped == "budget"
    assert "tiny-a bf16 w2 T=16" in rep.skipped
    first, second = (_json(f) for f in rep.files)
    assert set(first["configs"]) == set(second["configs"]) and "2" in first["configs"]
    assert "32" not in first["configs"]  # T=16 never finished both GEMMs
    assert not list(tmp_path.rglob("*.tmp"))
    assert "Not tuned (budget)" in rep.markdown()


def test_budget_keeps_the_heuristics_neighbourhood_and_puts_extra_token_counts_last():
    t = {"now": 0.0}

    def plan(budget_s):
        r = runner._Run([Combo("tiny-a", "bf16")], [1, 64, 256], [512], space="quick", device="cpu", out_dir=None,
                        gpu="", budget_s=budget_s, pool=pool.WarmPool(0), timer=runner._no_timer,
                        clock=lambda: t["now"], knobs=(8.0, 60.0, 3))  # fmt: skip
        r.plan_all()
        ranked = {step: v for step, v in r.plan.items() if isinstance(v, list)}  # GEMM1 steps, GEMM2 not planned
        return r, ranked, set(r.pool._queued)

    def heads(ranked, n):
        return {k for v in ranked.values() for _, k in v[:n]}

    keep = space.MIN_CANDIDATES + 1
    run, ranked, queued = plan(None)  # no budget: everything
    assert run.fraction(0) == 1.0 and queued == heads(ranked, 10**6)
    run, ranked, queued = plan(runner.WRITE_RESERVE_S + 3.0)  # no time: the heuristic's neighbourhood
    assert run.fraction(0) == 0.0 and queued == heads(ranked, keep)
    assert max(len(v) for v in ranked.values()) > keep
    run, ranked, queued = plan(260.0)  # (cost-model priors, no workers) time for the first phase, not the extra
    assert run.fraction(0) == 1.0 and run.fraction(len(run.passes) - 1) < 1.0


def test_files_are_written_by_rename(tmp_path, monkeypatch):
    cfg = LaunchConfig(16, 64, 32, 1, 4, 2)
    cr = report.ComboResult(Combo("tiny-a", "bf16"), e=4, shapes={"w13": (64, 64, "bf16"), "w2": (64, 32, "bf16")})
    for g in ("w13", "w2"):
        cr.steps[(g, 1)] = report.StepResult(g, 1, 2, cfg, 0.1, cfg, 0.2, planned=2, kept=2)
    paths = report.write_combo(cr, tmp_path, "cpu-interpreter")
    before = [p.read_text() for p in paths]

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", fail)
    cr.steps[("w13", 1)].cfg = LaunchConfig(16, 32, 32, 1, 4, 2)
    with pytest.raises(OSError):
        report.write_combo(cr, tmp_path, "cpu-interpreter")
    assert [p.read_text() for p in paths] == before  # the old file, whole
    assert sorted(tmp_path.rglob("*")) == sorted({*paths, *(p.parent for p in paths), *(p.parents[1] for p in paths)})


def test_a_run_of_some_token_counts_keeps_the_others(tmp_path):
    def combo(cfgs: dict) -> report.ComboResult:
        cr = report.ComboResult(Combo("tiny-a", "bf16"), e=4, shapes={"w13": (64, 64, "bf16"), "w2": (64, 32, "bf16")})
        for t, cfg in cfgs.items():
            for g in ("w13", "w2"):
                cr.steps[(g, t)] = report.StepResult(g, t, 2 * t, cfg, 0.1, cfg, 0.2, planned=2, kept=2)
        return cr

    a, b, c = LaunchConfig(16, 64, 32, 1, 4, 2), LaunchConfig(32, 64, 32, 1, 4, 2), LaunchConfig(1, 32, 128, 1, 4, 3)
    report.write_combo(combo({1: a, 64: b}), tmp_path, "cpu-interpreter")
    paths = report.write_combo(combo({1: c}), tmp_path, "cpu-interpreter")  # re-tunes T = 1 only
    for p in paths:
        data = _json(p)
        assert list(data["configs"]) == ["2", "128"] and list(data["ms"]) == ["2", "128"]
        assert LaunchConfig(**data["configs"]["2"]) == c and LaunchConfig(**data["configs"]["128"]) == b
    other = report.write_combo(combo({1: a}), tmp_path, "another-gpu")  # another GPU's file: its own
    assert all(list(_json(p)["configs"]) == ["2"] for p in other)


# ---- the workers compile what the main process runs ---------------------------------------


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_block"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(num_experts=256, top_k=8, hidden_size=128, intermediate_size=64),  # DeepSeek-like E and K
        dict(num_experts=5, top_k=1, hidden_size=48, intermediate_size=24),
        dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, has_bias=True),
    ],
    ids=["E256K8", "E5K1", "E8K2bias"],
)
def test_worker_operands_give_the_main_process_specialisation(shape, scheme):
    combo = Combo("small", scheme, tuple(sorted(shape.items())))
    config, sch = preset_config("small", **shape), QuantScheme.by_name(scheme)
    weights = operands.layer_weights(config, sch, "cpu")
    specs = {}
    for t in (1, 2, 16, 64):
        ids, rw = random_topk(t, config.num_experts, config.top_k, torch.Generator().manual_seed(t))
        for gemm in ("w13", "w2"):
            main = operands.step_operands(config, sch, weights, gemm, t, "cpu", ids, rw)
            for cfg in (main.heuristic(), main.fit(LaunchConfig(64, 128, 64, 8, 8, 3))):
                with probe.probing("record") as got:
                    operands.launch(main, cfg, main.routing(cfg.block_m))
                worker = probe.job_spec(probe.Job(combo, gemm, t, cfg, "cpu"))
                assert worker == tuple(got), (gemm, t, cfg)
                specs[(gemm, t, cfg)] = worker
    # the check can fail: the pair count's divisibility by 16 is part of the key
    if config.top_k == 8:
        heur = {t: c for (g, t, c) in specs if g == "w13"}
        assert specs[("w13", 1, heur[1])][0][0] != specs[("w13", 2, heur[2])][0][0] or heur[1] != heur[2]


W4_SHAPES = {
    "E256K8": dict(num_experts=256, top_k=8, hidden_size=128, intermediate_size=64),
    "E3K1": dict(num_experts=3, top_k=1, hidden_size=256, intermediate_size=256),  # GEMM2: two K steps
    "E8K2bias": dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, has_bias=True),
}
W4_CONFIGS = [LaunchConfig(32, 64, 128, 1, 4, 3, w_major=1), LaunchConfig(1, 32, 256, 1, 4, 4, split_k=2, w_major=1)]


@pytest.mark.parametrize("scheme", ["int4_g32", "mxfp4"])
@pytest.mark.parametrize("shape", list(W4_SHAPES.values()), ids=list(W4_SHAPES))
def test_w4_steps_plan_as_the_layer_does(shape, scheme, monkeypatch):
    """4-bit steps: weights in the w4 layout, the layer's untuned config as the heuristic, GEMM1's
    output [pairs, I] (the fused activation), and the workers' specialisation equal to the main
    process's (recorded, not launched)."""
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: None)  # no table: the layer's heuristic
    combo = Combo("small", scheme, tuple(sorted(shape.items())))
    config, sch = preset_config("small", **shape), QuantScheme.by_name(scheme)
    weights = operands.layer_weights(config, sch, "cpu")
    assert weights.layout == LAYOUT
    for t in (1, 16):
        ids, rw = random_topk(t, config.num_experts, config.top_k, torch.Generator().manual_seed(t))
        for gemm in ("w13", "w2"):
            main = operands.step_operands(config, sch, weights, gemm, t, "cpu", ids, rw)
            assert main.w4 and main.key == f"{scheme.split('_')[0]}_g32_w4"
            assert main.routing(16).pair_blocks == (t == 1)  # the layer's T = 1: no moe_align
            layer_cfg = w4_launch_config(main.pairs, config.num_experts, main.n, main.kd, main.w.q, gated=gemm == "w13")
            assert main.heuristic() == layer_cfg
            assert main.out.shape == (main.pairs, config.intermediate_size if gemm == "w13" else main.n)
            for cfg in (main.heuristic(), *(main.fit(c) for c in W4_CONFIGS)):
                with probe.probing("record") as got:
                    operands.launch(main, cfg, main.routing(cfg.block_m))
                assert probe.job_spec(probe.Job(combo, gemm, t, cfg, "cpu")) == tuple(got), (gemm, t, cfg)


def test_cli_tunes_the_w4_kernel_and_the_layer_reads_its_tables(tmp_path, monkeypatch):
    argv = ["tune", "--preset", "tiny-a", "--scheme", "mxfp4", "--tokens", "1,8", "--space", "tiny"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    files = sorted(tmp_path.rglob("*.json"))
    assert [f.parent.name for f in files] == ["mxfp4_g32_w4"] * 2
    monkeypatch.setenv(env.CONFIG_DIR, str(tmp_path))
    monkeypatch.setattr(tuned_configs, "current_gpu", lambda: "cpu-interpreter")
    tuned_configs.clear_cache()
    try:
        config, sch = preset_config("tiny-a"), QuantScheme.by_name("mxfp4")
        weights = operands.layer_weights(config, sch, "cpu")
        for f in files:
            data = _json(f)
            gemm1 = data["N"] == config.w13_rows
            w = weights.w13 if gemm1 else weights.w2
            assert set(data["configs"]) == {"2", "16"}  # pairs = T * K
            for pairs, cfg in data["configs"].items():
                got = w4_launch_config(int(pairs), data["E"], data["N"], data["K"], w, gated=gemm1)
                assert got == LaunchConfig(**cfg)
    finally:
        tuned_configs.clear_cache()


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()), reason="no kernel launches")
def test_w4_split_k_partials_are_what_the_layer_sums():
    """GEMM2 under split-K returns fp32 partials [S, pairs, H] (the layer's ``moe_sum`` adds them):
    the tuner checks their sum against the unsplit launch."""
    config, sch = preset_config("small", **W4_SHAPES["E3K1"]), QuantScheme.by_name("int4_g32")
    weights = operands.layer_weights(config, sch, "cpu")
    ids, rw = random_topk(1, config.num_experts, config.top_k, torch.Generator().manual_seed(1))
    op = operands.step_operands(config, sch, weights, "w2", 1, "cpu", ids, rw)
    split, one = op.fit(W4_CONFIGS[1]), op.fit(replace(W4_CONFIGS[1], split_k=1))
    assert split.split_k == 2
    parts = operands.launch(op, split, op.routing(1))
    assert parts.shape == (2, op.pairs, op.n) and parts.dtype == torch.float32
    op.out.fill_(float("nan"))
    whole = operands.launch(op, one, op.routing(1))
    assert whole is op.out and not whole.isnan().any()
    assert rel_error(op.value(parts), whole.float()) < 1e-2
    assert not torch.equal(parts[0], parts[1])  # two halves of K, not one result twice


def test_a_cpu_without_the_interpreter_plans_without_launching(monkeypatch):
    """No kernel can launch there, and the op would compute its float reference at full size
    (minutes for a ``--dry-run`` of the shipped presets): the job stays unkeyed, nothing runs."""
    monkeypatch.setattr(probe, "interpreting", lambda: False)
    monkeypatch.setattr(probe, "worker_operands", lambda *a: pytest.fail("operands built"))
    job = probe.Job(Combo("tiny-a", "bf16"), "w13", 4096, LaunchConfig(), "cpu")
    assert probe.job_spec(job) == ("unkeyed", job)


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()), reason="no kernel launches to probe")
def test_probing_sees_the_launch_through_the_kernels_interception_point():
    op = operands.worker_operands(Combo("tiny-a", "bf16"), "w13", 4, "cpu")
    cfg = op.heuristic()
    routing = op.routing(cfg.block_m)
    op.out.fill_(float("nan"))
    with probe.probing("record") as recorded:
        operands.launch(op, cfg, routing)
    assert len(recorded) == 1 and recorded[0][0][0] == "_grouped_gemm_kernel"
    assert op.out.isnan().all()  # recorded, not launched
    with probe.probing("run") as ran:
        out = operands.launch(op, cfg, routing)
    assert ran == recorded and not out.isnan().any()  # every pair is local: every row written
    assert launch._INTERCEPTORS == []  # nothing left behind


@pytest.mark.slow
def test_spawned_workers_warm_what_the_main_process_runs(tmp_path):
    # a spawned process sees the package's presets only: a shipped one, overridden (overrides travel)
    rep = tune_many(["small"], ["bf16"], [1], out_dir=tmp_path, space="tiny", device="cpu", workers=1, **TINY["tiny-a"])
    assert rep.workers == 1 and rep.jobs >= 3
    assert rep.total("key_checked") >= 3 and rep.total("key_mismatch") == 0
    assert len(rep.files) == 2


@pytest.mark.parametrize(
    "shipped_wins, late", [(True, False), (False, False), (True, True)], ids=["shipped_fastest", "candidate_fastest",
                                                                              "shipped_fastest_not_screened"]
)  # fmt: skip
def test_the_shipped_entry_is_screened_retimed_and_beaten_only_by_a_faster_one(
    tmp_path, monkeypatch, shipped_wins, late
):
    """The table's entry for a step (here outside the tiny space: BK 64, 3 stages) is ranked second,
    right after the heuristic, so a budget cut cannot leave it out; it is re-timed beside the
    finalists, and the winner is the fastest of them (``x shipped`` in the summary). ``late``: its
    compile missed the screening deadline (never screened): it is still re-timed, and still wins."""
    from fusedmoe.kernels.tuned_configs import config_path

    shipped = LaunchConfig(16, 64, 64, 1, 4, 3)
    if late:
        screen = runner._Run.screen
        monkeypatch.setattr(runner._Run, "screen", lambda self, op, cfg, *a: None if cfg == shipped else
                            screen(self, op, cfg, *a))  # fmt: skip
    users = tmp_path / "user"
    entry = {"configs": {"2": {f: getattr(shipped, f) for f in LaunchConfig.__dataclass_fields__}}}
    for n, k in ((64, 64), (64, 32)):  # GEMM1 [2I, H], GEMM2 [H, I]
        path = config_path(users, "cpu-interpreter", "bf16", 4, n, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entry))
    monkeypatch.setenv(env.CONFIG_DIR, str(users))
    tuned_configs.clear_cache()
    fast = shipped if shipped_wins else LaunchConfig(16, 32, 32, 1, 4, 2)
    ft = FakeTime(lambda cfg: 0.25 if cfg == fast else 1.0)
    try:
        rep = tune_many(["tiny-a"], ["bf16"], [1], out_dir=tmp_path / "out", space="tiny", device="cpu",
                        timer=ft.timer, clock=ft.clock, top=1)  # fmt: skip
    finally:
        tuned_configs.clear_cache()
    # planning in the full-size space: the entry right after the heuristic, inside any budget's head
    tuned_configs.clear_cache()
    plan = runner._Run([Combo("tiny-a", "bf16")], [1], [], space="quick", device="cpu", out_dir=None,
                       gpu="cpu-interpreter", budget_s=None, pool=pool.WarmPool(0), timer=runner._no_timer,
                       clock=ft.clock, knobs=(8.0, 60.0, 3))  # fmt: skip
    plan.plan_all()
    ranked = [c for c, _ in plan.plan[(0, "w13", 1)]]
    assert len(ranked) > space.MIN_CANDIDATES + 1 and ranked[1] == shipped and shipped not in ranked[2:]
    tuned_configs.clear_cache()
    for r in rep.combos[0].steps.values():
        assert r.shipped == shipped and r.shipped_ms == (0.25 if shipped_wins else 1.0)
        assert r.cfg == fast
    assert "| x shipped |" in rep.markdown()
    assert ("4.00" if not shipped_wins else "1.00") in rep.markdown().split("| x shipped |")[1]


@pytest.mark.parametrize("fastest", [0, 1, 2], ids=["at_use", "ahead", "at_start"])
def test_w4_steps_time_their_best_with_each_scale_loads(tmp_path, fastest):
    """The w4 space does not sweep ``scale_loads`` (it would triple it): each tensor-core step
    times its best finalist with the knob's other two values, checked against the heuristic's
    output, and keeps the fastest; the FMA path (BM < 16) has no such variant."""
    assert space.knob_variants(LaunchConfig(1, 32, 128, 1, 4, 4, w_major=1), True) == []
    assert space.knob_variants(LaunchConfig(16, 32, 128, 1, 4, 2), False) == []
    ft = FakeTime(lambda cfg: 0.25 if cfg.scale_loads == fastest else 1.0)
    rep = tune_many(["tiny-a"], ["mxfp4"], [8], out_dir=tmp_path, space="tiny", device="cpu",
                    timer=ft.timer, clock=ft.clock, top=1)  # fmt: skip
    steps = list(rep.combos[0].steps.values())
    assert steps and all(r.cfg.block_m >= 16 for r in steps)
    assert all(r.cfg.scale_loads == fastest for r in steps)
    assert {cfg.scale_loads for cfg, _ in ft.calls} == {0, 1, 2}  # every value was timed
    for f in rep.files:
        assert {LaunchConfig(**c).scale_loads for c in _json(f)["configs"].values()} == {fastest}
