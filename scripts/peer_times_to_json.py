"""Write the recorded peer times as the JSON ``fusedmoe bench --peers`` reads.

The source is the team's peer-times notes (markdown): the peers' whole-layer times on one GPU,
measured once, with the method and versions at the top, a '## <preset> <scheme>' table per cell
group (T, floor, fusedmoe then, vLLM Triton, best peer, who, ratio) and an eager-call table.
``benchmarks/peers/peer_times_h100.json`` was written from the H100 notes of 2026-11-25 by

    PYTHONPATH=src python scripts/peer_times_to_json.py NOTES.md benchmarks/peers/peer_times_h100.json

The parsing is ``fusedmoe.tools.peers.parse_notes`` (tested); this prints what it read and
what it skipped (tables that are not layer cells, such as end-to-end generate times).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fusedmoe.tools.peers import parse_notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("notes", help="the peer-times markdown")
    ap.add_argument("out", nargs="?", default=None, help="the JSON to write (default: stdout)")
    args = ap.parse_args(argv)
    data = parse_notes(Path(args.notes).read_text())
    text = json.dumps(data, indent=1) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    src = data["source"]
    print(
        f"{len(data['cells'])} cells, {len(data['eager'])} eager cells from {src.get('gpu')} ({src.get('date')}); "
        f"skipped: {data['skipped'] or 'nothing'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
