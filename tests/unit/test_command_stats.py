"""The daemon's command counter and latency histogram, updated once per flush, export what
prometheus_client's own Counter and Histogram would for the same commands."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cachexferd.metrics import _LATENCY_BUCKETS, DaemonMetrics

# Bounds themselves (a bound belongs to its own bucket), between them, beyond the last.
LATENCIES = [0.00005, 0.0001, 0.00011, 0.0025, 0.003, 1.0, 9.99, 10.0, 11.0, 0.0]


def series(text: str, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(prefixes))


def test_per_flush_stats_export_what_prometheus_client_would() -> None:
    metrics = DaemonMetrics(rank=0, backend="cpu")
    metrics.commands.record("swap_out", "ok", LATENCIES[:6])
    metrics.commands.record("swap_out", "ok", LATENCIES[6:])  # a second flush adds up
    metrics.commands.record("swap_out", "busy", [0.0002])
    metrics.commands.record("ping", "ok", [])  # nothing decided: a count of 0, no latency

    reference = CollectorRegistry()
    counter = Counter("cachexferd_commands_total", "Commands by type and outcome", ["op", "outcome"],
                      registry=reference)  # fmt: skip
    histogram = Histogram("cachexferd_command_duration_seconds", "Time from receipt to outcome, by command type",
                          ["op"], buckets=_LATENCY_BUCKETS, registry=reference)  # fmt: skip
    for seconds in LATENCIES:
        counter.labels("swap_out", "ok").inc()
        histogram.labels("swap_out").observe(seconds)
    counter.labels("swap_out", "busy").inc()
    histogram.labels("swap_out").observe(0.0002)
    counter.labels("ping", "ok").inc(0)

    names = ("cachexferd_commands_total", "cachexferd_command_duration_seconds_")
    ours = series(generate_latest(metrics.registry).decode(), names)
    theirs = series(generate_latest(reference).decode(), names)
    assert ours == theirs
    assert 'cachexferd_command_duration_seconds_bucket{le="0.0001",op="swap_out"} 3.0' in ours
    assert metrics.commands.count("swap_out", "ok") == len(LATENCIES)


def test_families_are_exported_before_any_command() -> None:
    text = generate_latest(DaemonMetrics(rank=0, backend="cpu").registry).decode()
    assert "# TYPE cachexferd_commands_total counter" in text
    assert "# TYPE cachexferd_command_duration_seconds histogram" in text


def test_counted_latencies_are_the_same_as_repeated_ones() -> None:
    """Commands that share an arrival (one message) are recorded as (seconds, count) pairs."""
    counted, repeated = DaemonMetrics(rank=0, backend="cpu"), DaemonMetrics(rank=0, backend="cpu")
    pairs = [(0.0001, 3), (0.0025, 64), (10.0, 1), (11.0, 2)]
    counted.commands.record_counted("swap_out", "ok", pairs)
    repeated.commands.record("swap_out", "ok", [seconds for seconds, n in pairs for _ in range(n)])
    names = ("cachexferd_commands_total", "cachexferd_command_duration_seconds_")
    ours = series(generate_latest(counted.registry).decode(), names)
    assert ours == series(generate_latest(repeated.registry).decode(), names)
    assert counted.commands.count("swap_out", "ok") == 70
    assert 'cachexferd_command_duration_seconds_bucket{le="0.0025",op="swap_out"} 67.0' in ours
