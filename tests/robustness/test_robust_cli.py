"""Class 10: the command line, and the README's usage snippet.

Before: mistakes ended in full tracebacks; ``fusedmoe bench`` on a CPU machine raised
``AssertionError: Torch not compiled with CUDA enabled``; ``fusedmoe tune`` on a CPU exited 0
with every time 0.0000 ms and wrote JSON into the installed package; ``run --tokens -3``
crashed; ``run --preset deepseek-v3`` on a CPU tried to allocate 30 GB at once; the README's
``QuantScheme.unquantized()`` alternative failed with a dtype error.

Now every user mistake is one line on stderr and exit status 2 (``--debug``: the traceback).
Most cases call ``cli.main(argv)`` in this process; two run the real ``fusedmoe`` entry point
in a subprocess (a fresh interpreter, no Triton interpreter variable) to see what a user sees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from robust_helpers import robust

import fusedmoe
from fusedmoe import FusedMoEError, RouterConfig, cli
from fusedmoe import env as fenv
from fusedmoe.experts.reference import moe_reference
from fusedmoe.testing import rel_error, tolerance

README = Path(__file__).resolve().parents[2] / "README.md"
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def _one_line_error(capsys, argv, *names) -> str:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors exit
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert err.count("\n") == 0 and err.startswith("fusedmoe"), err
    assert "Traceback" not in err
    for n in names:
        assert n in err, f"{n!r} not in {err!r}"
    return err


MISTAKES = [
    ("tokens_negative", ["run", "--tokens", "-3"], "--tokens"),
    ("tokens_zero", ["run", "--tokens", "0"], "--tokens"),
    ("tokens_text", ["run", "--tokens", "abc"], "--tokens"),
    ("iters_zero", ["run", "--iters", "0"], "--iters"),
    ("layer_negative", ["run", "--checkpoint", ".", "--layer", "-1"], "--layer"),
    ("dtype", ["run", "--dtype", "int8"], "--dtype"),
    ("preset", ["run", "--preset", "mixtral"], "preset"),
    ("scheme", ["run", "--scheme", "fp9"], "scheme"),
    ("backend", ["run", "--backend", "tritonn", "--tokens", "2"], "backend"),
    ("backend_cannot", ["run", "--backend", "grouped_mm", "--scheme", "fp8_block", "--tokens", "2"], "grouped_mm"),
    ("checkpoint_missing", ["run", "--checkpoint", "/nonexistent/model"], "checkpoint"),
    ("unknown_command", ["serve"], "serve"),
    ("unknown_option", ["run", "--tokenz", "4"], "--tokenz"),
    ("explain_tokens", ["explain", "--tokens", "0"], "--tokens"),
    ("explain_preset", ["explain", "--preset", "nope"], "preset"),
    ("explain_layout", ["explain", "--layout", "diagonal"], "--layout"),
    ("features_platform", ["features", "--platform", "sm70"], "platform"),
    ("tune_tokens", ["tune", "--tokens", "1,-4"], "--tokens"),
    ("bench_tokens", ["bench", "--tokens", "1,x"], "--tokens"),
    ("bench_nproc", ["bench", "--ep", "--nproc", "0"], "--nproc"),
]


@robust(10, "error")
@pytest.mark.parametrize("label,argv,name", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_status_2(capsys, label, argv, name):
    _one_line_error(capsys, argv, name)


@robust(10, "error")
def test_a_corrupt_checkpoint_is_one_line_naming_the_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 30)
    _one_line_error(capsys, ["run", "--checkpoint", str(tmp_path)], "model.safetensors")


@robust(10, "error")
@pytest.mark.parametrize("argv", [["run", "--preset", "nope", "--debug"], ["--debug", "run", "--tokens", "2",
                                                                           "--scheme", "fp9"]])  # fmt: skip
def test_debug_shows_the_exception_instead(argv):
    with pytest.raises(FusedMoEError, match="expected"):
        cli.main(argv)


@needs_no_gpu
@robust(10, "error")
@pytest.mark.parametrize("argv", [["bench"], ["bench", "--ep"], ["tune"], ["tune", "--preset", "small"]])
def test_gpu_commands_without_a_gpu_say_so_in_one_line(capsys, monkeypatch, argv):
    import fusedmoe.kernels._common as common

    monkeypatch.setattr(common, "interpreting", lambda: False)  # as on a user's CPU machine
    _one_line_error(capsys, argv, "CUDA GPU")


@robust(10, "error")
@pytest.mark.parametrize("preset", ["deepseek-v3", "mixtral-8x7b"])
def test_a_preset_too_large_for_the_memory_is_refused_saying_how_much_it_needs(capsys, monkeypatch, preset):
    import fusedmoe.platform as platform

    monkeypatch.setattr(platform, "host_memory_available", lambda: 1 << 30)
    err = _one_line_error(capsys, ["run", "--preset", preset, "--cpu"], preset, "GiB")
    need = float(re.search(r"needs about ([\d.]+) GiB", err).group(1))
    assert need > 1.0


@robust(10, "reference")
@pytest.mark.parametrize("scheme", ["bf16", "fp8_block", "int4_g128"])
def test_run_small_on_the_cpu_passes(capsys, scheme):
    rc = cli.main(["run", "--preset", "small", "--scheme", scheme, "--tokens", "3", "--iters", "1", "--cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out, out


@robust(10, "reference")
def test_tune_writes_to_the_user_folder_never_into_the_package(capsys, monkeypatch, tmp_path):
    import fusedmoe.tools.tune as tune
    from fusedmoe.kernels import tuned_configs

    seen = {}

    class Report:
        files, combos = ["x.json"], []

        def markdown(self):
            return "# tuned"

    def fake_tune_many(presets, schemes, tokens, **kw):
        seen.update(kw, tokens=tokens)
        return Report()

    monkeypatch.setattr(tune, "tune_many", fake_tune_many)
    monkeypatch.setenv(fenv.CONFIG_DIR, str(tmp_path / "mine"))
    assert cli.main(["tune", "--preset", "small", "--tokens", "1,16"]) == 0
    assert seen["out_dir"] is None and seen["tokens"] == [1, 16]
    assert str(tmp_path / "mine") in capsys.readouterr().err
    assert fenv.config_dir() == tmp_path / "mine" and tuned_configs.search_dirs()[0] == tmp_path / "mine"
    monkeypatch.delenv(fenv.CONFIG_DIR)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = fenv.config_dir()
    package = Path(fusedmoe.__file__).resolve().parent
    assert package not in user.resolve().parents and user.name == "configs"


def _subprocess(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(fusedmoe.__file__).resolve().parents[1])
    return subprocess.run([sys.executable, "-m", "fusedmoe.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=100)  # fmt: skip


@robust(10, "error")
@pytest.mark.parametrize("argv", [["run", "--tokens", "-3"], ["bench"]] if not torch.cuda.is_available() else
                         [["run", "--tokens", "-3"]])  # fmt: skip
def test_what_a_user_sees_in_a_terminal(argv):
    p = _subprocess(argv)
    assert p.returncode == 2, p
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr, p.stderr


# ---- the README's usage snippet, every commented alternative ------------------------------------


def _snippet() -> tuple[str, list[str]]:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    line = next(x for x in block.splitlines() if x.startswith("scheme ="))
    first = re.search(r"QuantScheme\.(\w+\([^)]*\))", line).group(1)
    return block, [first, *re.findall(r"(\w+\([^)]*\))", line.split("# or", 1)[1])]


_, ALTERNATIVES = _snippet()


@robust(10, "reference")
@pytest.mark.parametrize("alt", ALTERNATIVES)
def test_readme_snippet_runs_for_every_alternative(alt):
    """The snippet as written, with H 1024 -> 256 and I 512 -> 128 so the CPU runs it fast
    (every alternative stores both sizes: groups of 128 and 32)."""
    block, alts = _snippet()
    code = block.replace(f"QuantScheme.{alts[0]}", f"QuantScheme.{alt}").replace("1024", "256").replace("512", "128")
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    out, cfg = ns["out"], ns["config"]
    assert out.shape == (16, 256) and out.dtype == cfg.dtype and torch.isfinite(out).all()
    topk = RouterConfig(8, 2).route(ns["logits"])
    ref = moe_reference(ns["x"], topk.ids, topk.weights, ns["weights"], cfg, ns["scheme"])
    assert rel_error(out, ref) <= tolerance(ns["scheme"], cfg.dtype)
