"""vLLM started before its daemon: once the daemon is up and both sides of the plug-in have
connected, the very next request is stored (and so comes back cached), not only those that
come seconds later; and while no daemon answers, the plug-in says why, and says it again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.integrations.engine import connection  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import BLOCK, engine_args, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


class Lines(logging.Handler):
    """The plug-in's log lines. Attached once the engine exists: vLLM reconfigures its
    loggers while an engine starts, which drops handlers added before."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def having(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def test_the_first_request_after_a_late_daemon_is_stored(
    tiny_model: Path, cx_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import LLM

    monkeypatch.setattr(connection, "UNREACHABLE_LOG_S", 1.0)
    endpoint = f"ipc://{cx_root}/late/cmd.sock"
    # A long retry interval: before it, the plug-in learned the host cache's size only at the
    # next ping after its worker attached, and requests in between were neither looked up nor stored.
    llm = LLM(**engine_args(tiny_model), kv_transfer_config=transfer_config(endpoint, retry_interval_s=5.0))
    daemon = None
    plugin_log = Lines()
    logging.getLogger("vllm.cachexferd").addHandler(plugin_log)
    try:
        # Repeated while no daemon answers: what is wrong at the endpoint, and how to look.
        wait_for(lambda: bool(plugin_log.having("still no daemon after")), 30, "the warning to be repeated")
        warning = plugin_log.having("still no daemon after")[0]
        assert f"no socket at {cx_root}/late/cmd.sock" in warning, warning
        assert f"cachexferd status --endpoint {endpoint}" in warning, warning
        daemon = start_daemon(cx_root, "late", cx_root / "storage")
        wait_for(lambda: len(plugin_log.having("connected to")) >= 2, 30, "the scheduler and the worker to connect")
        tokens = prompt(77)
        first = generate(llm, tokens)  # right away: the host tier opens during this request
        # Its stores may be placed in its last steps (the host tier opened meanwhile), and vLLM
        # hears of their completion at a later step: a short other request takes those steps.
        generate(llm, prompt(5, length=BLOCK + 1), max_tokens=2)
        reset_gpu_cache(llm)
        again = generate(llm, tokens)
        assert again[0] == first[0], "the loaded KV changed the greedy tokens"
        assert again[2] >= len(tokens) // BLOCK * BLOCK, f"came back with {again[2]} cached tokens"
    finally:
        logging.getLogger("vllm.cachexferd").removeHandler(plugin_log)
        shutdown(llm)
        if daemon is not None:
            daemon.stop()
