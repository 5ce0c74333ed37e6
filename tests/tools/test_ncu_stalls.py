"""``scripts/ncu_stalls.py``: the summaries of Nsight Compute's CSV pages that ``ncu_suite.sh`` brings back."""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_stalls.py"


def _module():
    spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _csv(rows) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def test_raw_page_per_kernel_time_in_us_and_stalls_largest_first(tmp_path):
    stalls = [STALL.format(s) for s in ("long_scoreboard", "barrier", "long_scoreboard_not_issued")]
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread", *stalls]
    units = ["", "", "ms", "register/thread", "ratio", "ratio", "ratio"]
    rows = [head, units, ["0", "_w4_gemm_kernel", "0.311", "118", "3.29", "0.91", "9.0"],
            ["1", "_moe_sum_kernel", "0.05", "26", "0.2", "1.5", "0"]]  # fmt: skip
    path = tmp_path / "raw.csv"
    path.write_text("==PROF== Connected\n" + _csv(rows))
    out = _module().raw_summary(str(path))
    w4, moe = out.split("### ")[1:]
    assert w4.startswith("_w4_gemm_kernel") and "time us 311.0" in w4 and "regs 118.0" in w4
    assert "long_scoreboard 3.29, barrier 0.91" in w4 and "not_issued" not in w4  # largest first
    assert "time us 50.0" in moe and moe.index("barrier") < moe.index("long_scoreboard")


def test_raw_page_unknown_time_unit_is_not_passed_off_as_microseconds(tmp_path):
    rows = [["ID", "Kernel Name", "gpu__time_duration.sum"], ["", "", "fortnight"], ["0", "k", "2"]]
    path = tmp_path / "raw.csv"
    path.write_text(_csv(rows))
    assert "time us nan" in _module().raw_summary(str(path))


def test_source_page_hottest_lines_first_with_their_top_reasons(tmp_path):
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_barrier",
            "Warp Stall Sampling (Not-issued Samples)"]  # fmt: skip
    rows = [
        head,
        ["0x10", "LDG.E.U8 R1, [R2]", "10", "1", "9", "8"],
        ["0x20", "SHF.L.U32 R3, R1, 0x17", "70", "65", "5", "69"],
        ["0x30", "HGMMA.64x128x16", "20", "0", "0", "1"],
    ]
    path = tmp_path / "source.csv"
    second = [["#", *head[1:]], rows[1]]  # a second kernel's block, its header as other ncu versions write it
    path.write_text(_csv(rows) + _csv(second))
    blocks = _module().source_summary(str(path), top=2).split("\n\n")
    assert len(blocks) == 2 and blocks[1].startswith("1 SASS lines, 10 samples")
    out = blocks[0].splitlines()
    assert out[0].startswith("3 SASS lines, 100 samples")
    assert "70.0%" in out[1] and "SHF.L.U32" in out[1] and "stall_long_sb=65" in out[1]
    assert "Not-issued" not in out[1]  # a sample total, not a reason
    assert "HGMMA" in out[2] and len(out) == 3
