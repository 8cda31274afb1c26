"""``cachexferd bench completion`` end to end at a tiny size, and its figure arithmetic.

The benchmark is not timed here: these tests check that every run delivers every
completion and reports sane fields, never how fast anything was.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachexferd.bench.completion import configs
from cachexferd.bench.completion_report import StepLog, add_floor, add_loss, check_targets, latencies, percentile

TRAFFIC = ("floor", "bare", "client", "batched", "async", "queue")


@pytest.mark.slow
def test_tiny_run_reports_every_engine(tmp_path: Path) -> None:
    out, png = tmp_path / "completion.json", tmp_path / "completion.png"
    argv = [sys.executable, "-m", "cachexferd", "bench", "completion", "--tp", "1", "--rates", "40",
            "--duration", "0.5", "--drain", "10", "--json", str(out), "--plot", str(png)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [r["engine"] for r in runs] == ["idle", *(n for engine in TRAFFIC for n in (engine, "idle"))]
    for run in runs:
        assert run["tp"] == 1 and run["rate"] == 40
        assert run["steps"] > 0 and run["steps_per_s"] > 0
        if run["engine"] == "idle":
            assert run["expected"] == 0 and run["loss"] is None
            continue
        assert run["expected"] >= 10, run  # 40/s for 0.5 s
        assert run["delivered"] == run["expected"] and run["missing"] == 0, run
        assert run["failed"] == 0, f"{run['engine']}: {run['failed']} failed: {run.get('errors')}"
        assert 0 < run["p50_ms"] <= run["p99_ms"] <= run["max_ms"], run
        assert 1 <= run["p50_steps"] <= run["p99_steps"], run
        assert run["client_us_per_cmd"] > 0 and run["loss"] is not None, run
        assert (run["client_vs_bare"] is None) == (run["engine"] in ("floor", "bare")), run
        assert (run["floor_p99_steps"] is None) == (run["engine"] == "floor"), run
    assert data["machine"]["step_ms"] > 0 and data["machine"]["loadavg_start"]
    assert "targets:" in proc.stdout
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in proc.stdout
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_pairing_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cachexferd", "bench", "completion", "--tp", "1,2", "--rates", "10,20,30"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "must pair up" in proc.stderr


def test_configs_pair_up_or_broadcast() -> None:
    assert configs("2,1", "1000,5000") == [(2, 1000.0), (1, 5000.0)]
    assert configs("1", "10,20") == [(1, 10.0), (1, 20.0)]
    assert configs("1,2", "50") == [(1, 50.0), (2, 50.0)]
    with pytest.raises(ValueError):
        configs("1", "0")


def test_latency_in_steps_counts_boundaries_after_the_origin() -> None:
    log = StepLog(boundaries=[1.0, 2.0, 3.0, 4.0])
    # Submitted just after boundary 0, seen at 1: one step. Seen at 3: three steps.
    log.seen = [(1.5, 1), (1.5, 3), (0.5, 0)]
    ms, steps = latencies(log)
    assert steps == [1.0, 3.0, 1.0]
    assert ms == pytest.approx([500.0, 2500.0, 500.0])


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) == 0.0


def test_loss_uses_the_idle_runs_beside_each_run() -> None:
    rows = [
        {"engine": "idle", "steps_per_s": 1000.0, "work_share": 0.99},
        {"engine": "client", "steps_per_s": 900.0, "work_share": 0.89},
        {"engine": "idle", "steps_per_s": 800.0, "work_share": 0.99},
    ]
    add_loss(rows)
    assert rows[1]["loss"] == pytest.approx(0.0)  # 900 against the mean of 1000 and 800
    assert rows[1]["loss_time"] == pytest.approx(0.10)
    assert rows[0]["loss"] is None


def test_runs_are_read_against_the_floors_of_their_configuration() -> None:
    rows = [
        {"engine": "idle", "client_us_per_cmd": 0.0, "p99_steps": 0.0},
        {"engine": "floor", "client_us_per_cmd": 30.0, "p99_steps": 3.0},
        {"engine": "bare", "client_us_per_cmd": 40.0, "p99_steps": 4.0},
        {"engine": "client", "client_us_per_cmd": 60.0, "p99_steps": 5.0},
    ]
    add_floor(rows)
    assert rows[3]["client_vs_bare"] == 1.5 and rows[3]["floor_p99_steps"] == 3.0
    assert rows[2]["client_vs_bare"] is None and rows[2]["floor_p99_steps"] == 3.0
    assert rows[1]["floor_p99_steps"] is None and rows[0]["client_vs_bare"] is None
    row = {**rows[3], "rate": 100.0, "missing": 0, "backlog_at_end": 0, "p50_steps": 1.0, "loss": 0.0,
           "loss_time": 0.0}  # fmt: skip
    checks = check_targets(row)
    assert "client: MISSED (60.0 us; 1.50x the bare ZeroMQ floor of this run)" in checks
    assert "p99: MISSED (5 steps; the floor run's 3)" in checks
