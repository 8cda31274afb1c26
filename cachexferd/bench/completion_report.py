"""Figures, table, target check and plot for ``cachexferd bench completion``.

A run's raw record (``StepLog``) holds the scheduler's step-boundary times and, for every
completion it saw, the origin time (submit, or the producer's put for the polled queue) and
the index of the boundary where it was seen. Latency in steps counts the boundaries after
the origin up to and including that one: a completion seen at the first boundary after its
submit is 1 step.
"""

from __future__ import annotations

import bisect
import importlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .completion_engines import ClientTime

# Printed beside the results; never asserted.
TARGETS = {"p50_steps": 1, "p99_steps": 2, "loss": 0.03, "client_us_per_cmd": 25.0, "backlog_steps": 2}
TARGETS_TEXT = (
    "targets: every completion delivered (none missing; at most 2 steps' worth outstanding when traffic "
    "stops), p50 <= 1 step, p99 <= 2 steps, scheduler loss <= 3%, client time <= 25 us per command"
)


@dataclass
class StepLog:
    """What one run's scheduler did and saw."""

    boundaries: list[float] = field(default_factory=list)  # time.monotonic() of each step boundary
    seen: list[tuple[float, int]] = field(default_factory=list)  # (origin time, boundary index)
    failed: int = 0  # completions with an error outcome
    work_s: float = 0.0  # wall time in the scheduler's own work
    work_cpu_s: float = 0.0  # its CPU time (thread_time): what the work cost, however fast the CPU ran
    traffic_work_cpu_s: float = 0.0  # work_cpu_s when the traffic stopped
    traffic_steps: int = 0  # steps until the traffic stopped
    traffic_s: float = 0.0
    delivered_in_run: int = 0  # seen by the time the traffic stopped
    thread_cpu_s: float = 0.0  # the scheduler thread
    process_cpu_s: float = 0.0  # the whole engine process
    peer_cpu_s: float = 0.0  # the processes at the other end: daemons, or manager + producer

    @property
    def steps_per_s(self) -> float:
        return self.traffic_steps / self.traffic_s if self.traffic_s else 0.0

    @property
    def work_share(self) -> float:
        """Share of the traffic window's wall time the scheduler spent running its own work."""
        return self.traffic_work_cpu_s / self.traffic_s if self.traffic_s else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted here); 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def latencies(log: StepLog) -> tuple[list[float], list[float]]:
    """(milliseconds, steps) from origin to the boundary where each completion was seen."""
    ms, steps = [], []
    for origin, step in log.seen:
        ms.append((log.boundaries[step] - origin) * 1000)
        steps.append(float(step - bisect.bisect_right(log.boundaries, origin) + 1))
    return ms, steps


def summarize(engine: str, tp: int, rate: float, log: StepLog, expected: int, client: ClientTime) -> dict[str, Any]:
    ms, steps = latencies(log)
    per_cmd = 1e6 / expected if expected else 0.0
    return {
        "engine": engine,
        "tp": tp,
        "rate": rate,
        "duration_s": round(log.traffic_s, 3),
        "steps": log.traffic_steps,
        "steps_per_s": round(log.steps_per_s, 1),
        "work_ms_per_step": round(1000 * log.work_s / max(1, len(log.boundaries)), 4),
        "work_share": round(log.work_share, 4),
        "expected": expected,
        "delivered": len(log.seen),
        "delivered_in_run": log.delivered_in_run,
        "backlog_at_end": expected - log.delivered_in_run,
        "missing": expected - len(log.seen),
        "failed": log.failed,
        "p50_ms": round(percentile(ms, 0.50), 4),
        "p99_ms": round(percentile(ms, 0.99), 4),
        "max_ms": round(max(ms, default=0.0), 4),
        "p50_steps": percentile(steps, 0.50),
        "p99_steps": percentile(steps, 0.99),
        "client_us_per_cmd": round(sum(client.wall.values()) * per_cmd, 2),
        "client_parts_us_per_cmd": {part: round(s * per_cmd, 2) for part, s in sorted(client.wall.items())},
        "other_threads_cpu_us_per_cmd": round((log.process_cpu_s - log.thread_cpu_s) * per_cmd, 2),
        "peer_cpu_us_per_cmd": round(log.peer_cpu_s * per_cmd, 1),
    }


def add_loss(rows: list[dict[str, Any]]) -> None:
    """Scheduler loss of each traffic run against the idle runs just before and after it.

    ``loss``: steps/s below idle. ``loss_time``: share of wall time the scheduler did not
    spend running its own work, above idle's; it does not move with the CPU's speed, which
    drifts by tens of percent over seconds on shared virtual machines.
    """
    for i, row in enumerate(rows):
        row["loss"] = row["loss_time"] = None
        idle = [r for r in (rows[i - 1] if i else None, rows[i + 1] if i + 1 < len(rows) else None)
                if r is not None and r["engine"] == "idle"]  # fmt: skip
        if row["engine"] == "idle" or not idle:
            continue
        steps_per_s = sum(r["steps_per_s"] for r in idle) / len(idle)
        share = sum(r["work_share"] for r in idle) / len(idle)
        row["idle_steps_per_s"] = round(steps_per_s, 1)
        row["loss"] = round(1 - row["steps_per_s"] / steps_per_s, 4) if steps_per_s else None
        row["loss_time"] = round(share - row["work_share"], 4)


def add_floor(rows: list[dict[str, Any]]) -> None:
    """Each traffic run against the floors of its configuration, measured in the same
    session: ``client_vs_bare`` (client time over the ``bare`` run's) and ``floor_p99_steps``
    (the ``floor`` run's p99: what any pair of ZeroMQ processes got here)."""
    bare = next((r for r in rows if r["engine"] == "bare"), None)
    floor = next((r for r in rows if r["engine"] == "floor"), None)
    for row in rows:
        row["client_vs_bare"] = row["floor_p99_steps"] = None
        if row["engine"] in ("idle", "floor"):
            continue
        if floor is not None:
            row["floor_p99_steps"] = floor["p99_steps"]
        if bare is not None and row["engine"] != "bare" and bare["client_us_per_cmd"]:
            row["client_vs_bare"] = round(row["client_us_per_cmd"] / bare["client_us_per_cmd"], 3)


HEADER = (
    f"{'engine':7} {'TP':>2} {'rate/s':>7} {'delivered':>13} {'backlog':>7} {'p50 ms':>7} {'p99 ms':>7} "
    f"{'p50 st':>6} {'p99 st':>6} {'steps/s':>7} {'loss':>6} {'loss-t':>6} "
    f"{'client us/cmd':>13} {'other us/cmd':>12} {'peer us/cmd':>11}"
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_row(r: dict[str, Any]) -> str:
    if r["engine"] == "idle":
        blank = f"{'-':>7} {'-':>13} {'-':>7} {'':>7} {'':>7} {'':>6} {'':>6}"
        return f"{'idle':7} {r['tp']:>2} {blank} {r['steps_per_s']:>7.0f}"
    return (
        f"{r['engine']:7} {r['tp']:>2} {r['rate']:>7.0f} {r['delivered']:>6}/{r['expected']:<6} "
        f"{r['backlog_at_end']:>7} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['p50_steps']:>6.0f} "
        f"{r['p99_steps']:>6.0f} {r['steps_per_s']:>7.0f} {_pct(r['loss']):>6} {_pct(r['loss_time']):>6} "
        f"{r['client_us_per_cmd']:>13.1f} {r['other_threads_cpu_us_per_cmd']:>12.1f} "
        f"{r['peer_cpu_us_per_cmd']:>11.0f}"
    )


def check_targets(r: dict[str, Any]) -> list[str]:
    """One 'name: ok|MISSED (value)' item per target for a traffic run. Loss is judged on
    the time share (loss-t), which the CPU's speed drift does not move."""
    per_step = r["rate"] / r["idle_steps_per_s"] if r.get("idle_steps_per_s") else 0.0
    loss_time = r["loss_time"] or 0.0
    checks = [
        ("delivered", r["missing"] == 0 and r["backlog_at_end"] <= max(1, TARGETS["backlog_steps"] * per_step),
         f"{r['missing']} missing, {r['backlog_at_end']} outstanding at end"),
        ("p50", r["p50_steps"] <= TARGETS["p50_steps"], f"{r['p50_steps']:.0f} steps"),
        ("p99", r["p99_steps"] <= TARGETS["p99_steps"], _p99_text(r)),
        ("loss", loss_time <= TARGETS["loss"], f"{loss_time:.1%} of time, {_pct(r['loss'])} of steps/s"),
        ("client", r["client_us_per_cmd"] <= TARGETS["client_us_per_cmd"], _client_text(r)),
    ]  # fmt: skip
    return [f"{name}: {'ok' if met else 'MISSED'} ({value})" for name, met, value in checks]


def _p99_text(r: dict[str, Any]) -> str:
    floor = r.get("floor_p99_steps")
    return f"{r['p99_steps']:.0f} steps" + (f"; the floor run's {floor:.0f}" if floor is not None else "")


def _client_text(r: dict[str, Any]) -> str:
    ratio = r.get("client_vs_bare")
    floor = f"; {ratio:.2f}x the bare ZeroMQ floor of this run" if ratio is not None else ""
    return f"{r['client_us_per_cmd']:.1f} us{floor}"


ENGINE_COLORS = {
    "floor": "black", "bare": "tab:gray", "client": "tab:green", "batched": "tab:olive", "async": "tab:blue",
    "queue": "tab:red",
}  # fmt: skip


def plot(rows: list[dict[str, Any]], path: str, title: str) -> bool:
    """Latency (p50 solid, p99 dashed) against offered rate, one panel per TP. A run where
    some completions never arrived is drawn with hollow markers: its percentiles cover only
    the completions that did."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return False
    matplotlib.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(1, len(tps), figsize=(5 * len(tps) + 1, 4.5), sharey=True, squeeze=False)
    for ax, tp in zip(axes[0], tps):
        _plot_panel(ax, [r for r in rows if r["tp"] == tp and r["engine"] != "idle" and r["delivered"]], tp)
    axes[0][0].set_ylabel("delivery latency to the scheduler (ms)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_panel(ax: Any, rows: list[dict[str, Any]], tp: int) -> None:
    for engine, color in ENGINE_COLORS.items():
        points = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["rate"])
        if not points:
            continue
        x = [r["rate"] for r in points]
        for key, style, marker in (("p50_ms", "-", "o"), ("p99_ms", "--", "^")):
            ax.plot(x, [r[key] for r in points], style, color=color, label=f"{engine} {key[:3]}")
            for r in points:
                hollow = r["missing"] > 0
                ax.plot(r["rate"], r[key], marker, color=color, markerfacecolor="white" if hollow else color)
    step_ms = [1000 / r["idle_steps_per_s"] for r in rows if r.get("idle_steps_per_s")]
    if step_ms:
        ax.axhline(sum(step_ms) / len(step_ms), color="grey", linestyle=":", linewidth=1, label="1 step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (commands/s)")
    ax.set_title(f"TP={tp}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
