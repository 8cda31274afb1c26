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


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r["blocks"] >= 128:
            series[f"{r['direction']} {r['pattern']} x{r['blocks']}"].append((r["block_bytes"], r["ratio"]))
    colors = dict(zip(sorted({n.split()[0] + n.split()[2] for n in series}), plt.get_cmap("tab10").colors))
    for name, points in sorted(series.items()):
        points.sort()
        direction, pattern, count = name.split()
        style = "-" if pattern == "contiguous" else "--"
        ax.plot([p[0] >> 10 for p in points], [p[1] * 100 for p in points], style, marker="o",
                color=colors[direction + count], label=name)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("host block size (KiB)")
    ax.set_ylabel("swap / raw contiguous copy (%)")
    ax.axhline(85, color="grey", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    print(table(data["rows"]))
    if args.plot:
        m = data["machine"]
        plot(data["rows"], args.plot, f"{m['backend']} on {m['device']}, {m['layers']} layers x 2 tensors per block")


if __name__ == "__main__":
    main()
