"""Helpers for the operations tests: `cachexferd` as a user runs it, in a scrubbed environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment minus CACHEXFERD_* (a developer's settings must not leak in), with the
    default storage directory moved under ``tmp`` (nothing is written to the real one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEXFERD_")}
    env["STATE_DIRECTORY"] = str(tmp / "state")  # what systemd sets; also for root
    env.update(extra)
    return env


def run_cli(args: list[str], tmp: Path, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachexferd", *args],
        capture_output=True, text=True, timeout=timeout_s, env=clean_env(tmp, **env), cwd=REPO,
    )  # fmt: skip
