"""Summaries of an Nsight Compute report exported as CSV (``scripts/ncu_suite.sh``).

    python3 scripts/ncu_stalls.py raw.csv              # --page raw --csv: one row per kernel
    python3 scripts/ncu_stalls.py --source source.csv  # --page source --csv --print-source sass

Raw: per kernel, its time, the SM / DRAM / tensor-pipe throughputs, issue activity, occupancy and
the warp stall reasons (cycles a warp waited per issued instruction, largest first): where a
kernel's time goes when it is neither at the memory floor nor at the MMA rate. Source: the SASS
lines with the most stall samples per kernel, with their top reasons.
"""

from __future__ import annotations

import csv
import re
import sys

KEYS = {  # label: metric name (first found)
    "time us": ["gpu__time_duration.sum"],
    "SM %": ["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    "DRAM %": ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed"],
    "issue %": ["smsp__issue_active.avg.pct_of_peak_sustained_active",
                "sm__inst_issued.avg.pct_of_peak_sustained_active"],
    "tensor %": ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"],
    "occupancy %": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
    "regs": ["launch__registers_per_thread"],
    "grid": ["launch__grid_size"],
    "smem KiB": ["launch__shared_mem_per_block_dynamic"],
}  # fmt: skip
# the units ncu writes for durations (its first run here wrote "ms" where "msecond" was expected)
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+)_per_issue_active\.ratio$")


def _num(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def raw_summary(path: str) -> str:
    rows = list(csv.reader(open(path, newline="")))
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head, units, data = rows[start], rows[start + 1], rows[start + 2 :]
    col = {h: i for i, h in enumerate(head)}
    out = []
    for r in data:
        if len(r) != len(head):
            continue
        name = r[col["Kernel Name"]][:60]
        vals = []
        for label, names in KEYS.items():
            m = next((n for n in names if n in col), None)
            v = _num(r[col[m]]) if m else None
            if v is not None and label == "time us":
                unit = units[col[m]]
                v *= TO_US.get(unit.strip().lower(), float("nan"))  # an unknown unit shows as nan
            if v is not None and label == "smem KiB":
                v = v / 1024 if units[col[m]] == "byte" else v
            vals.append(f"{label} {v:.1f}" if v is not None else f"{label} -")
        stalls = []
        for h, i in col.items():
            m = STALL.match(h)
            v = _num(r[i]) if m else None
            if m and v is not None and not m.group(1).endswith("_not_issued") and v >= 0.05:
                stalls.append((v, m.group(1)))
        stalls.sort(reverse=True)
        total = sum(v for v, _ in stalls)
        out.append(f"### {name}\n{'; '.join(vals)}\n"
                   f"stalls (cycles per issued instruction, total {total:.1f}): "
                   + ", ".join(f"{k} {v:.2f}" for v, k in stalls[:10]) + "\n")  # fmt: skip
    return "\n".join(out)


def source_summary(path: str, top: int = 40) -> str:
    """The hottest SASS lines of each kernel's block of the source page (a block starts at its
    header row, whose first field is "#" or "Address" as ncu versions write it)."""
    out, block = [], []
    for row in list(csv.reader(open(path, newline=""))) + [["#"]]:
        if row and row[0].strip() in ("#", "Address"):
            if len(block) > 1:
                out.append(_source_block(block, top))
            block = [row]
        elif block:
            block.append(row)
    return "\n".join(out) if out else "no source rows found"


def _source_block(rows: list[list[str]], top: int) -> str:
    head = rows[0]
    src = next((i for i, h in enumerate(head) if h.lower() in ("source", "sass")), None)
    samp = next((i for i, h in enumerate(head) if "Sampling (All" in h or h.startswith("Warp Stall Sampling")), None)
    if src is None or samp is None:
        return "columns: " + ", ".join(head)
    reasons = [i for i, h in enumerate(head) if h.startswith("stall_")]  # not the sample totals
    data = [r for r in rows[1:] if len(r) == len(head) and _num(r[samp]) is not None]
    total = sum(_num(r[samp]) for r in data) or 1.0
    data.sort(key=lambda r: -_num(r[samp]))
    out = [f"{len(data)} SASS lines, {total:.0f} samples; top {top}:"]
    for r in data[:top]:
        rs = sorted(((_num(r[i]) or 0.0, head[i]) for i in reasons), reverse=True)[:2]
        out.append(f"{100 * _num(r[samp]) / total:5.1f}%  {r[src][:70]:70s} " + " ".join(f"{n}={v:.0f}" for v, n in rs))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--source":
        print(source_summary(sys.argv[2]))
    else:
        print(raw_summary(sys.argv[1]))
