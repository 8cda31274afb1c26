"""What the HTTP probes answer: ``/healthz`` (liveness) and ``/readyz`` (readiness).

Both are answered on the metrics server's own thread, never on the event loop: a probe must
tell a stuck loop from a live one, so it cannot wait for the loop to answer. The loop
instead stamps a heartbeat every ``BEAT_S``; the probe thread reads the stamp and the
daemon's states (plain attribute reads) and decides:

- live: the loop has run within ``daemon.loop_stall_s`` (a loop that stopped running
  serves no command, whatever the process looks like from outside);
- ready: live, serving (not starting or draining), and, with ``daemon.expect_runner``, a
  device cache attached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

BEAT_S = 0.5  # how often the loop stamps the heartbeat
Answer = tuple[bool, dict[str, Any]]  # (passes, the JSON body)


class Health:
    def __init__(
        self, stall_s: float, expect_runner: bool, serving: Callable[[], str], device: Callable[[], str]
    ) -> None:
        """``serving``: the daemon's state (``running`` when it serves); ``device``: the device
        cache's (``attached`` when a runner's cache is imported)."""
        self.stall_s, self.expect_runner = stall_s, expect_runner
        self._serving, self._device = serving, device
        self._beat = time.monotonic()  # written by the loop, read by the probe thread (a float: atomic)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Starts the heartbeat on the running loop."""
        self._stamp()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _stamp(self) -> None:
        self._beat = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(BEAT_S, self._stamp)

    def live(self) -> Answer:
        lag = time.monotonic() - self._beat
        alive = lag < self.stall_s
        body: dict[str, Any] = {"live": alive, "loop_lag_s": round(lag, 3), "state": self._serving()}
        if not alive:
            body["reason"] = f"the event loop has not run for {lag:.1f} s (daemon.loop_stall_s = {self.stall_s:g})"
        return alive, body

    def ready(self) -> Answer:
        alive, body = self.live()
        state, device = body["state"], self._device()
        reasons = [] if alive else [body.pop("reason")]
        if state != "running":
            reasons.append(f"the daemon is {state}")
        if self.expect_runner and device != "attached":
            reasons.append(f"no runner attached (device cache {device}; daemon.expect_runner = true)")
        answer = {"ready": not reasons, "state": state, "device": device, "loop_lag_s": body["loop_lag_s"]}
        if reasons:
            answer["reasons"] = reasons
        return not reasons, answer
