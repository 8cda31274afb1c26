#!/usr/bin/env python3
"""Turns `cachexferd bench swap --json FILE` output into a Markdown table (stdout) and,
when matplotlib is installed and --plot is given, a PNG of ratio vs block size.

    scripts/bench_report.py swap.json [--plot swap.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def size_label(n: int) -> str:
    return f"{n >> 10} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


def table(rows: list[dict]) -> str:
    cells: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for r in rows:
        cells[(r["block_bytes"], r["blocks"])][f"{r['direction']} {r['pattern'][:4]}"] = (
            f"{r['ratio']:.0%} ({r['swap_gbps']:.1f}/{r['raw_gbps']:.1f})"
        )
    cols = [f"{d} {p}" for d in ("d2h", "h2d", "both") for p in ("cont", "scat")]
    out = ["| block | blocks | " + " | ".join(cols) + " |", "|---|---:|" + "---|" * len(cols)]
    for (size, count), row in sorted(cells.items()):
        out.append(f"| {size_label(size)} | {count} | " + " | ".join(row.get(c, "") for c in cols) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    print(table(data["rows"]))
    if args.plot:
        from cachexferd.bench.cli import plot_swap  # the figure `cachexferd bench swap --plot` draws

        plot_swap(data, args.plot)


if __name__ == "__main__":
    main()
