"""Condenses a scripts/gpu-validate.sh output directory into the comparison a reader needs:
the swap bench at vLLM shapes per copy method, beside the reference scripts run in the same
session, against the targets (ratios to a raw contiguous pinned copy of the same run).

    python3 scripts/gpu_summary.py OUT_DIR        # prints; gpu-validate.sh appends it to summary.txt

Targets: with 4 swaps in flight, one direction >= 90% from 16 blocks on for every piece
size; a single block of 1 MiB or more >= 80%; both directions at once >= 85% of the raw
both-ways figure; a lone swap's fixed cost <= 20 us beyond the raw copy; and at or above the
reference kernel (anchor_kernel.py), gather (anchor_gather.py) and duplex (anchor_duplex.py)
in every row. Pinning: 64 GiB in <= 8 s with status p99 <= 20 ms meanwhile.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

KIB = 1 << 10


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def anchor_ratios(out: Path) -> dict[tuple[int, int, str], float]:
    """(piece, blocks, direction) -> the best reference ratio measured in this session."""
    best: dict[tuple[int, int, str], float] = {}

    def note(piece: int, blocks: int, direction: str, value: float | None, raw: float | None) -> None:
        if value and raw:
            key = (piece, blocks, direction)
            best[key] = max(best.get(key, 0.0), value / raw)

    for r in _jsonl(out / "anchors" / "anchor_kernel.jsonl"):
        note(r["piece"], r["blocks"], "d2h", r.get("kernel_d2h"), r.get("raw_d2h"))
        note(r["piece"], r["blocks"], "h2d", r.get("kernel_h2d"), r.get("raw_h2d"))
        note(r["piece"], r["blocks"], "both", r.get("kernel_both"), r.get("raw_both"))
    for r in _jsonl(out / "anchors" / "anchor_gather.jsonl"):
        note(r["piece"], r["blocks"], "d2h", r.get("gather_d2h"), r.get("raw_d2h"))
        note(r["piece"], r["blocks"], "h2d", r.get("scatter_h2d"), r.get("raw_h2d"))
    for r in _jsonl(out / "anchors" / "anchor_duplex.jsonl"):
        note(r["piece"], r["blocks"], "both", r.get("both"), r.get("raw_both"))
    return best


def target(piece: int, blocks: int, direction: str, in_flight: int = 4) -> float | None:
    """The ratio a row must reach: with swaps in flight, one way from 16 blocks 90%; both
    ways 85%; a single block of 1 MiB or more 80% (a lone swap)."""
    if direction == "both":
        return 0.85
    if blocks >= 16 and in_flight > 1:
        return 0.90
    if blocks == 1 and piece * 64 >= 1 << 20:  # a host block of 32 layers x 2 pieces
        return 0.80
    return None


FIXED_TARGET_US = 20.0  # a lone swap beyond the raw copy


def bench_table(out: Path) -> list[str]:
    path = out / "bench" / "swap.json"
    if not path.exists():
        return ["swap bench: no bench/swap.json"]
    data = json.loads(path.read_text())
    machine = data.get("machine", {})
    anchors = anchor_ratios(out)
    methods = list(dict.fromkeys(r["method"] for r in data["rows"]))
    by_key: dict[tuple[int, int, str], dict[str, float]] = {}
    for r in data["rows"]:
        if r.get("in_flight", 1) != 1:  # the targets and anchors are for one swap at a time
            continue
        by_key.setdefault((r["piece_bytes"], r["blocks"], r["direction"]), {})[r["method"]] = r["ratio"]
    fixed = {(r["piece_bytes"], r["blocks"], r["direction"]): r.get("fixed_p50_us") for r in data["rows"]
             if r["method"] == "auto" and r.get("in_flight", 1) == 1}  # fmt: skip
    lines = [
        f"swap bench ({machine.get('device')}, torch {machine.get('torch')}, cuda {machine.get('cuda')}, "
        f"triton {machine.get('triton')}, load {machine.get('load_average')}); ratios to raw, scattered ids, "
        "one swap at a time; fixed: auto's us beyond the raw copy (p50)",
        f"{'piece':>6} {'blocks':>6} {'dir':5} "
        + " ".join(f"{m:>8}" for m in methods)
        + "   anchor  target  auto  fixed",
    ]
    misses = 0
    for (piece, blocks, direction), ratios in sorted(by_key.items()):
        anchor, goal = anchors.get((piece, blocks, direction)), target(piece, blocks, direction, 1)
        auto, cost = ratios.get("auto"), fixed.get((piece, blocks, direction))
        verdict = "-"
        if auto is not None:
            ok = (goal is None or auto >= goal) and (anchor is None or auto >= anchor)
            ok = ok and (cost is None or direction == "both" or cost <= FIXED_TARGET_US)
            verdict = "met" if ok else "MISSED"
            misses += not ok
        cells = " ".join(f"{ratios[m]:>8.0%}" if m in ratios else f"{'':>8}" for m in methods)
        anchor_cell = f"{anchor:>7.0%}" if anchor is not None else f"{'':>7}"
        goal_cell = f"{goal:>6.0%}" if goal is not None else f"{'':>6}"
        cost_cell = f"{cost:>6.0f}" if cost is not None else ""
        lines.append(
            f"{piece // KIB:>4}Ki {blocks:>6} {direction:5} {cells}  {anchor_cell}  {goal_cell}  {verdict:6}{cost_cell}"
        )
    lines.append(f"auto against targets (fixed <= {FIXED_TARGET_US:.0f} us) and anchors: {misses} row(s) missed")
    return lines


def probes(out: Path) -> list[str]:
    lines = []
    copy = out / "copy_probe.json"
    if copy.exists():
        data = json.loads(copy.read_text())
        lines.append(
            f"copy probe: raw pinned GB/s {data.get('raw_pinned_gbps')} (before {data.get('raw_before')}, "
            f"after {data.get('raw_after')}); kernel {data.get('kernel')}; {len(data.get('rows', []))} rows"
        )
    pin = out / "pin_probe.json"
    if pin.exists():
        data = json.loads(pin.read_text())
        pinning = data.get("pinning", {})
        latency, goals = data.get("status_latency_ms", {}), data.get("targets", {})
        met = (
            data.get("pinned") and pinning.get("seconds", 1e9) <= goals.get("pin_s", 8)
            and (latency.get("p99") or 1e9) <= goals.get("status_p99_ms", 20)
        )  # fmt: skip
        lines.append(
            f"pin probe: {data.get('capacity')} pinned {data.get('pinned')} in {pinning.get('seconds')} s "
            f"({pinning.get('gib_per_s')} GiB/s, {pinning.get('workers')} workers); status latency {latency} "
            f"(targets {goals}: {'met' if met else 'MISSED'})"
        )
    return lines


def in_flight_table(out: Path) -> list[str]:
    path = out / "bench" / "swap-inflight.json"
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["rows"]
    lines = ["swaps in flight at once (ratios to raw; targets: one way >= 90% from 16 blocks, both >= 85%):"]
    misses = 0
    for r in rows:
        piece, flight = r["piece_bytes"] >> 10, r.get("in_flight", 1)
        goal = target(r["piece_bytes"], r["blocks"], r["direction"], flight)
        verdict = "" if goal is None or r["method"] != "auto" else ("met" if r["ratio"] >= goal else "MISSED")
        misses += verdict == "MISSED"
        lines.append(f"{piece:>4}Ki {r['blocks']:>5} {r['direction']:5} {r['method']:8} x{flight} {r['ratio']:>5.0%}"
                     f"  {verdict}")  # fmt: skip
    lines.append(f"auto with {rows[0].get('in_flight', 1) if rows else '?'} in flight: {misses} row(s) missed")
    return lines


def probe_lines(out: Path) -> list[str]:
    """The fast-path probe (scripts/gpu_fastpath_probe.py), condensed."""
    lines = []
    for r in _jsonl(out / "probe.jsonl"):
        step = r.get("step")
        if "error" in r:
            lines.append(f"probe {step}: ERROR {r['error']}")
        elif step == "A":
            calls = ", ".join(f"{k} {v['p50']}" for k, v in r["calls_us"].items())
            lines.append(f"probe A (driver calls, us p50): {calls}; driver {r.get('driver')}")
        elif step == "B":
            for mode, b in r.items():
                if isinstance(b, dict) and "fixed_us_p50" in b:
                    verdict = "met" if b["fixed_us_p50"] <= 20 else "MISSED"
                    lines.append(f"probe B ({mode}): lone 1-block swap {b['swap_us']['p50']} us, raw "
                                 f"{b['raw_us']['p50']} us, fixed {b['fixed_us_p50']} us (target <= 20: {verdict}); "
                                 f"stages {b['stages_us_p50']}")  # fmt: skip
        elif step in ("E", "F"):
            lines.append(f"probe {step}: {json.dumps({k: v for k, v in r.items() if k != 'step'})}")
    return lines


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-validate-out")
    print("\n".join(probe_lines(out) + bench_table(out) + in_flight_table(out) + probes(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
