"""An engine in a process of its own, spoken to one JSON line at a time (vLLM keeps one KV
connector per process, so two plug-in engines need two processes). Requests go in on the
child's stdin; each answer comes back as one JSON line on a pipe of its own, because vLLM
writes its log to stdout. Used by the benchmarks and the tests."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any


class LineChild:
    """``python -m module CONFIG`` with ``config["fd"]`` the answers' pipe; ``ask`` sends one
    request and waits for its answer."""

    def __init__(self, module: str, config: dict[str, Any], log: Path | None = None, cwd: Path | None = None) -> None:
        read, write = os.pipe()
        self.log = log
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", module, json.dumps({**config, "fd": write})],
                                         stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                         pass_fds=[write], cwd=cwd)  # fmt: skip
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
            os.close(write)
        self.replies = os.fdopen(read)

    def ask(self, request: Any, timeout_s: float) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        line = self.replies.readline() if ready else ""
        if not line:
            tail = self.log.read_text()[-3000:] if self.log is not None else ""
            raise RuntimeError(f"the engine process gave no answer (exit code {self.proc.poll()})\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.replies.close()


def answer_lines(fd: int, handle: Any) -> None:
    """The child's side: ``handle(request)`` for each line on stdin, its answer on ``fd``."""
    with os.fdopen(fd, "w") as out:
        for line in sys.stdin:
            out.write(json.dumps(handle(json.loads(line))) + "\n")
            out.flush()
