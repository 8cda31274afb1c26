"""A plug-in engine in a process of its own, for tests that need two (vLLM keeps one KV
connector per process): each prompt's answer is its cached prompt tokens; vLLM's log goes
to ``log``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from cachexferd.integrations.vllm.child import LineChild, answer_lines


class EngineChild(LineChild):
    def __init__(self, model: Path, log: Path, **llm_args: Any) -> None:
        super().__init__(__name__, {"model": str(model), "llm": llm_args}, log=log, cwd=Path(__file__).parents[2])

    def generate(self, tokens: list[int], timeout_s: float = 60.0) -> int:
        """Runs one prompt; its cached prompt tokens."""
        try:
            return int(self.ask(tokens, timeout_s))
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None


def serve(config: dict[str, Any]) -> None:
    """The child's side."""
    from vllm import LLM

    from .engines import generate, shutdown
    from .rig import engine_args

    llm = LLM(**engine_args(Path(config["model"])), **config["llm"])
    answer_lines(config["fd"], lambda tokens: generate(llm, tokens)[2])
    shutdown(llm)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
