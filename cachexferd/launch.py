"""Start and stop daemons as subprocesses (used by ``cachexferd demo``, the benchmarks and
the tests). Each daemon gets its own runtime dir; ``start`` returns once it answers status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .status import fetch_status


class LaunchError(RuntimeError):
    pass


@dataclass
class DaemonProcess:
    runtime_dir: Path
    rank: int = 0
    settings: dict[str, Any] = field(default_factory=dict)  # table.key -> value
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return str(self.settings.get("daemon.endpoint") or f"ipc://{self.runtime_dir / 'cmd.sock'}")

    def argv(self) -> list[str]:
        base = {"daemon.rank": self.rank, "daemon.runtime_dir": str(self.runtime_dir), "daemon.backend": "cpu"}
        merged = {**base, **self.settings}
        args = [sys.executable, "-m", "cachexferd", "serve"]
        for key, value in merged.items():
            args += ["--set", f"{key}={value}"]
        return args

    def start(self, timeout_s: float = 30.0) -> dict[str, Any]:
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = self.log_path or self.runtime_dir / "daemon.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            self.argv(), stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        ipc = Path(self.endpoint[len("ipc://") :]) if self.endpoint.startswith("ipc://") else None
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(f"daemon rank {self.rank} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if ipc is None or ipc.exists():
                try:
                    status = fetch_status(self.endpoint, timeout_s=1.0)
                except Exception as exc:
                    last = exc
                else:
                    if self.proc is None or status.get("pid") == self.proc.pid:
                        return status
                    last = RuntimeError(f"endpoint answered by another daemon (pid {status.get('pid')})")
            time.sleep(0.05)
        self.kill()
        raise LaunchError(f"daemon rank {self.rank} not ready after {timeout_s}s ({last}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait for the drain; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = -9
        self._close_log()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
