"""Argument parsing for ``cachexferd bench``; each benchmark lives in its own module.

``--plot FILE.png`` on ``swap`` and ``storage`` draws the rows the benchmark writes with
``--json`` (into a temp file when ``--json`` is not given); it needs matplotlib
(``pip install 'cachexferd[plots]'``). ``scripts/bench_report.py`` draws the same swap
figure from a saved JSON file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from typing import Any

PLOTS_HINT = "pip install 'cachexferd[plots]'"


def add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure copy and storage throughput against a raw baseline")
    kinds = p.add_subparsers(dest="bench", required=True)
    from .swap import add_swap_args

    swap = kinds.add_parser("swap", help="swap-out / swap-in GB/s vs a raw contiguous copy")
    add_swap_args(swap)
    _add_plot(swap, plot_swap)
    from .storage import add_storage_args

    storage = kinds.add_parser("storage", help="store / load GB/s per backend vs its raw client")
    add_storage_args(storage)
    _add_plot(storage, plot_storage)
    from .commands import add_commands_args

    add_commands_args(kinds.add_parser("commands", help="commands/s of a daemon vs a bare pyzmq loop"))
    from .completion import add_completion_args

    add_completion_args(kinds.add_parser("completion", help="completion delivery to a busy scheduler"))
    from .eviction import add_eviction_args

    add_eviction_args(kinds.add_parser("eviction", help="prefix index: eviction rate, match latency, memory"))
    from .journal import add_journal_args

    add_journal_args(kinds.add_parser("journal", help="storage journal: CPU per stored object vs a raw append log"))
    from .small_stores import add_small_stores_args

    add_small_stores_args(kinds.add_parser("small-stores", help="daemon CPU and latency per small STORE vs a floor"))


def run_bench(args: argparse.Namespace) -> int:
    result: int = args.bench_func(args)
    return result


# --plot ------------------------------------------------------------------------------------

Plotter = Callable[[dict[str, Any], str], None]


def _add_plot(p: argparse.ArgumentParser, plotter: Plotter) -> None:
    p.add_argument(
        "--plot", metavar="FILE.png", help=f"draw the results into this PNG (needs matplotlib: {PLOTS_HINT})"
    )
    run = p.get_default("func")
    p.set_defaults(func=lambda args: _run_with_plot(args, run, plotter))


def _run_with_plot(args: argparse.Namespace, run: Callable[[argparse.Namespace], int], plotter: Plotter) -> int:
    if not args.plot:
        return run(args)
    if importlib.util.find_spec("matplotlib") is None:  # say so before minutes of measuring
        print(f"cachexferd bench: --plot needs matplotlib: {PLOTS_HINT}", file=sys.stderr)
        return 2
    scratch = None
    if not args.json:
        fd, scratch = tempfile.mkstemp(prefix="cx-bench-", suffix=".json")
        os.close(fd)
        args.json = scratch
    try:
        code = run(args)
        with open(args.json) as f:
            data = json.load(f)
        if data.get("rows"):
            plotter(data, args.plot)
            print(f"plot written to {args.plot}")
        return code
    finally:
        if scratch is not None:
            os.unlink(scratch)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_swap(data: dict[str, Any], path: str) -> None:
    """Swap / raw copy ratio against block size, one line per direction, pattern and count
    (counts of 128 blocks and more when there are any: smaller swaps measure latency)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = [r for r in data["rows"] if r["blocks"] >= 128] or data["rows"]
    series: dict[tuple[str, str, int], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        series[(r["direction"], r["pattern"], r["blocks"])].append((r["block_bytes"], r["ratio"]))
    colors = dict(zip(sorted({(d, c) for d, _, c in series}), plt.get_cmap("tab10").colors))
    for (direction, pattern, count), points in sorted(series.items()):
        points.sort()
        style = "-" if pattern == "contiguous" else "--"  # a direction and count share a colour
        ax.plot([p[0] >> 10 for p in points], [p[1] * 100 for p in points], style, marker="o",
                color=colors[(direction, count)], label=f"{direction} {pattern} x{count}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")  # 64, not 2^6
    ax.set_xlabel("host block size (KiB)")
    ax.set_ylabel("swap / raw contiguous copy (%)")
    ax.axhline(85, color="grey", linestyle="--", linewidth=1)
    m = data.get("machine", {})
    layers = f", {m['layers']} layers x 2 tensors per block" if "layers" in m else ""
    ax.set_title(f"{m.get('backend', '')} on {m.get('device', 'this machine')}{layers}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_storage(data: dict[str, Any], path: str) -> None:
    """Daemon vs raw client GB/s per backend and operation, side by side."""
    plt = _pyplot()
    rows = data["rows"]
    labels = [f"{r['backend']}\n{r['op']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 4.5))
    ax.bar([x - 0.2 for x in xs], [r["daemon_gbps"] for r in rows], width=0.4, label="through the daemon")
    ax.bar([x + 0.2 for x in xs], [r["raw_gbps"] for r in rows], width=0.4, label="raw client")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['ratio']:.0%}", (x, max(r["daemon_gbps"], r["raw_gbps"])), ha="center", va="bottom")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GB/s (best round)")
    m = data.get("machine", {})
    ax.set_title(f"storage, {rows[0]['objects']} objects per command, on {m.get('cpu', 'this machine')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
