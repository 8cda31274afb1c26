"""scripts/fuzz.py against a real daemon subprocess, with a few thousand inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_random_frames_get_every_outcome_and_the_daemon_survives(seed: int) -> None:
    run = [sys.executable, str(REPO / "scripts" / "fuzz.py"), "--count", "3000", "--seed", str(seed)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=600, cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "3000 inputs sent" in out and ": ok" in out
    assert "daemon alive: yes; exit status 0; tracebacks in its log: 0" in out
