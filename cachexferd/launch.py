"""Start and stop subprocesses by PID: daemons (``cachexferd demo``, the benchmarks, the
tests) and the storage servers (cachexferd.storage_servers). Each runs in its own session
with its own log file; ``start`` returns once a readiness check passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .security import CurveClientKeys
from .status import fetch_status


class LaunchError(RuntimeError):
    pass


class ManagedProcess:
    """One subprocess: started with a readiness check, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, ready: Callable[[], bool], env: dict[str, str] | None = None
    ) -> None:
        self.name, self.argv, self.log_path, self.ready, self.env = name, argv, log_path, ready, env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.05)
        self.kill()
        raise LaunchError(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.alive:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM by PID, SIGKILL if it does not exit within timeout_s; returns the exit code."""
        code = 0
        if self.proc is not None:
            if self.alive:
                self.signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
                self.signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                code = -signal.SIGKILL
        self._close_log()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.alive:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class DaemonProcess:
    """``python -m cachexferd serve`` with its own runtime dir; ready when it answers status."""

    runtime_dir: Path
    rank: int = 0
    settings: dict[str, Any] = field(default_factory=dict)  # table.key -> value
    env: dict[str, str] = field(default_factory=dict)
    process: ManagedProcess | None = None
    curve: CurveClientKeys | None = None  # keys to ask a daemon on tcp with CURVE for its status
    prefix: list[str] = field(default_factory=list)  # runs the daemon through this (e.g. ip netns exec NAME)

    @property
    def endpoint(self) -> str:
        return str(self.settings.get("daemon.endpoint") or f"ipc://{self.runtime_dir / 'cmd.sock'}")

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc if self.process is not None else None

    @property
    def log_path(self) -> Path:
        return self.runtime_dir / "daemon.log"

    def argv(self) -> list[str]:
        base = {"daemon.rank": self.rank, "daemon.runtime_dir": str(self.runtime_dir), "daemon.backend": "cpu"}
        args = [*self.prefix, sys.executable, "-m", "cachexferd", "serve"]
        for key, value in {**base, **self.settings}.items():
            args += ["--set", f"{key}={value}"]
        return args

    def start(self, timeout_s: float = 30.0) -> dict[str, Any]:
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        status: dict[str, Any] = {}

        def ready() -> bool:
            # Our own daemon must answer: another one may own the same endpoint.
            if self.endpoint.startswith("ipc://") and not Path(self.endpoint[len("ipc://") :]).exists():
                return False
            try:
                status.update(fetch_status(self.endpoint, timeout_s=1.0, curve=self.curve))
            except Exception:
                return False
            return bool(self.proc is not None and status.get("pid") == self.proc.pid)

        self.process = ManagedProcess(f"daemon rank {self.rank}", self.argv(), self.log_path, ready, self.env)
        self.process.start(timeout_s)
        return status

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return fetch_status(self.endpoint, timeout_s, self.curve)

    def log_tail(self, lines: int = 30) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    def signal(self, sig: int) -> None:
        if self.process is not None:
            self.process.signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait for the drain; SIGKILL if it does not exit in time. Returns the exit code."""
        return self.process.stop(timeout_s) if self.process is not None else 0

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
