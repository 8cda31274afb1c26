"""Daemons as subprocesses (`python -m cachexferd serve`), started ahead of the tests that
need them so that several import their dependencies at the same time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 90.0  # the daemon imports torch; a loaded 2-core machine takes a while


class DaemonProc:
    def __init__(self, name: str, root: Path, args: list[str]) -> None:
        self.name = name
        self.shared = False  # a session daemon that many tests use
        self.runtime_dir = root / name
        self.socket_path = self.runtime_dir / "cmd.sock"  # the default endpoint (§1)
        self.endpoint = f"ipc://{self.socket_path}"
        self.log_path = root / f"{name}.log"
        command = [
            sys.executable, "-m", "cachexferd", "serve",
            "--runtime-dir", str(self.runtime_dir),
            "--rank", "0",
            "--metrics-port", "0",
            "--capacity", "16MiB",
            "--backend", "cpu",
            "--set", "daemon.log_level=warning",
            *args,
        ]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        env = {k: v for k, v in env.items() if not k.startswith("CACHEXFERD_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> DaemonProc:
        deadline = time.monotonic() + timeout_s
        while not self.socket_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon {self.name}: no {self.socket_path} after {timeout_s}s:\n{self.log()}")
            time.sleep(0.02)
        return self

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
