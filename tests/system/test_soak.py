"""scripts/soak.py, briefly: random swaps, storage, pauses, weight changes, re-attaches and
runner kills, with every outcome counted and every block checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "soak.py"


def test_short_soak_loses_and_corrupts_nothing() -> None:
    args = ["--duration", "12", "--commands", "60", "--kill-rate", "0.3", "--seed", "11"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "soak: OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "corrupted 0" in proc.stdout
