"""A plug-in engine in a process of its own, for tests that need two (vLLM keeps one KV
connector per process). Prompts (token ids) go in on its stdin, one JSON line each; the
cached prompt tokens of each come back on a pipe of its own (vLLM logs to stdout, which goes
to ``log``)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any


class EngineChild:
    def __init__(self, model: Path, log: Path, **llm_args: Any) -> None:
        read, write = os.pipe()
        config = {"model": str(model), "fd": write, "llm": llm_args}
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(config)], stdin=subprocess.PIPE,
                                         stdout=out, stderr=subprocess.STDOUT, text=True, pass_fds=[write],
                                         cwd=Path(__file__).parents[2])  # fmt: skip
        os.close(write)
        self.replies = os.fdopen(read)
        self.log = log

    def generate(self, tokens: list[int], timeout_s: float = 60.0) -> int:
        """Runs one prompt; its cached prompt tokens."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(tokens) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout_s)
        line = self.replies.readline() if ready else ""
        if not line:
            tail = self.log.read_text()[-3000:]
            raise AssertionError(f"the engine process gave no answer (exit code {self.proc.poll()}):\n{tail}")
        return int(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.replies.close()


def serve(config: dict[str, Any]) -> None:
    """The child's side."""
    from vllm import LLM

    from .engines import generate, shutdown
    from .rig import engine_args

    llm = LLM(**engine_args(Path(config["model"])), **config["llm"])
    with os.fdopen(config["fd"], "w") as out:
        for line in sys.stdin:
            out.write(json.dumps(generate(llm, json.loads(line))[2]) + "\n")
            out.flush()
    shutdown(llm)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
