"""``cachexferd bench commands`` end to end at a tiny size: every part's commands get ok
outcomes from the real daemon and from the bare loop. Nothing here is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_tiny_run_measures_every_part(tmp_path: Path) -> None:
    out = tmp_path / "commands.json"
    argv = [sys.executable, "-m", "cachexferd", "bench", "commands", "--count", "300", "--rounds", "1",
            "--batch-count", "640", "--chains", "2,8", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    parts = {p["name"]: p for p in report["parts"]}
    names = ["(a) bare loop", "(b) daemon", "(c) chain of 2", "(c) chain of 8", "(d) daemon, batches of 64"]
    assert list(parts) == names
    for name, want in zip(parts, (300, 300, 2, 8, 640)):
        part = parts[name]
        assert part["commands"] == want and part["failed"] == 0, part
        assert part["rate"] > 0 and 0 < part["p50_ms"] <= part["p99_ms"], part
    assert parts["(b) daemon"]["server_cpu_us"] >= 0
    assert set(report["ratios"]) == {"b_over_a", "d_over_a", "longest_chain_over_shortest"}
    assert "(b) / (a) = " in proc.stdout and "(d) target >= 50,000" in proc.stdout
