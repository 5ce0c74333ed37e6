"""``scripts/ab_ratios.py``: old / new per bench cell and the geometric mean (what lab_ab.sh prints)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("ab_ratios", Path(__file__).parents[2] / "scripts" / "ab_ratios.py")
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)


def _bench(tmp_path, name, cells):
    rows = [dict(preset=p, scheme="bf16", tokens=t, mode="graph", provider="fusedmoe", ms=ms) for p, t, ms in cells]
    rows.append(dict(preset="a", scheme="bf16", tokens=1, mode="eager", provider="fusedmoe", ms=99.0))  # not graph
    rows.append(dict(preset="a", scheme="bf16", tokens=1, mode="graph", provider="vllm", ms=0.1))  # a peer
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    return str(path)


def test_ratios_per_cell_and_geometric_mean(tmp_path, capsys):
    old = _bench(tmp_path, "old.json", [("a", 1, 2.0), ("a", 16, 8.0), ("b", 1, 1.0)])
    new = _bench(tmp_path, "new.json", [("a", 1, 1.0), ("a", 16, 16.0), ("c", 1, 1.0)])
    assert ab.main([old, new]) == 0
    out = capsys.readouterr().out
    assert "a bf16 T=1: 2.0000 -> 1.0000 ms, x 2.000" in out
    assert "a bf16 T=16: 8.0000 -> 16.0000 ms, x 0.500" in out
    assert "b bf16 1: only in old" in out and "c bf16 1: only in new" in out
    assert "geometric mean x 1.000 over 2 cells" in out


def test_usage_without_two_files(capsys):
    assert ab.main(["only.json"]) == 2
    assert "ab_ratios.py OLD.json NEW.json" in capsys.readouterr().err


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        ab.main([str(tmp_path / "missing.json"), str(tmp_path / "missing.json")])
