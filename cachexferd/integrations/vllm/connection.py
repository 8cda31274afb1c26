"""A connection to the daemons of one or more ranks that never blocks a step on a dead one.

vLLM calls the plug-in at every engine step, so nothing here may wait on a daemon that is
down. A separate DEALER probes each daemon with PING (non-blocking send, replies read at the
next tick); only once every daemon has answered does the connection make its blocking calls
(hello, and for a worker the attach), each bounded by ``connect_timeout_s``. While up, the
same probe keeps pinging: a daemon silent for three intervals counts as lost, and so does
one whose replies carry a new boot id (it restarted and lost its host cache). The owner
learns of a loss from ``tick()``'s return value and fails what it had in flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from ...client import EngineClient, RunnerClient
from ...client.link import ClientError, Link
from ...protocol import ErrorCode, Ping
from .shm_cache import PageCache

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

# Outcomes that say the daemon (not the command) is the problem: the connection is reopened.
CONNECTION_ERRORS = frozenset(
    {
        ErrorCode.CLIENT_TIMEOUT, ErrorCode.DAEMON_RESTARTED, ErrorCode.SEND_FAILED, ErrorCode.STALE_BOOT,
        ErrorCode.NOT_ATTACHED, ErrorCode.DETACHED, ErrorCode.SHUTTING_DOWN, ErrorCode.NO_EVENT_CHANNEL,
    }
)  # fmt: skip
_MISSED_PINGS = 3


class Probe:
    """PINGs one daemon from its own DEALER; remembers the last reply's time and boot id."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.endpoint = endpoint
        self.link = Link(ctx, endpoint)
        self.boot_id: str | None = None  # from the last reply; None until one arrives
        self.unanswered_since: float | None = None  # send time of the oldest unanswered ping
        self._next_id = 0

    def ping(self) -> bool:
        """Sends a PING; False when no daemon has bound the ipc path (nothing is queued then)."""
        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[len("ipc://") :]).exists():
            return False
        self._next_id += 1
        if self.unanswered_since is None:
            self.unanswered_since = time.monotonic()
        with contextlib.suppress(ClientError):  # a full queue: the next interval tries again
            self.link.send(Ping(req_id=self._next_id))
        return True

    def drain(self) -> None:
        while (outcome := self.link.recv_nowait()) is not None:
            if outcome.ok:
                self.boot_id = outcome.boot_id
                self.unanswered_since = None

    def silent_for(self, now: float) -> float:
        """How long a ping has gone unanswered (0 when none is outstanding). Measured from
        the ping, not the last reply, so a long gap between ticks is not mistaken for death."""
        return 0.0 if self.unanswered_since is None else now - self.unanswered_since

    def close(self) -> None:
        self.link.close()


class DaemonConnection:
    """EngineClient (and, for a worker, RunnerClient + attach) to ``endpoints``, kept up."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        name: str,
        transfer_timeout_s: float,
        connect_timeout_s: float,
        retry_interval_s: float,
        cache: PageCache | None = None,
    ) -> None:
        if cache is not None and len(endpoints) != 1:
            raise ValueError("a worker attaches its cache to exactly one daemon")
        self.endpoints = list(endpoints)
        self.name = name
        self.transfer_timeout_s = transfer_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.cache = cache
        self.client: EngineClient | None = None
        self.runner: RunnerClient | None = None
        self.hellos: list[dict[str, Any]] = []
        self.boot_ids: list[str] = []
        self.opened = 0  # successful (re)connections so far
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._probes = [Probe(self._ctx, e) for e in self.endpoints]
        self._next_ping = 0.0
        self._next_open = 0.0
        self._last_error = ""

    @property
    def up(self) -> bool:
        return self.client is not None

    def start(self) -> bool:
        """At start-up: waits (at most connect_timeout_s) for every daemon to answer, then opens."""
        deadline = time.monotonic() + self.connect_timeout_s
        if not all([probe.ping() for probe in self._probes]):
            return False  # some daemon is not even listening: tick() picks it up later
        self._next_ping = time.monotonic() + self.retry_interval_s
        while time.monotonic() < deadline and not self._all_answered():
            time.sleep(0.01)
            for probe in self._probes:
                probe.drain()
        if self._all_answered():
            self._open()
        return self.up

    def tick(self) -> str | None:
        """Call at every step boundary. Returns why the connection was just lost, else None."""
        now = time.monotonic()
        for probe in self._probes:
            probe.drain()
        if now >= self._next_ping:
            self._next_ping = now + self.retry_interval_s
            for probe in self._probes:
                probe.ping()
        if self.client is not None:
            reason = self._lost_reason(now)
            if reason:
                self.lose(reason)
            return reason
        if self._all_answered() and now >= self._next_open:
            # A daemon that answers pings but refuses us (attach refused, say) is retried
            # once per interval, not at every step.
            self._next_open = now + self.retry_interval_s
            self._open()
        return None

    def _all_answered(self) -> bool:
        return all(p.boot_id is not None for p in self._probes)

    def _lost_reason(self, now: float) -> str | None:
        for probe, boot in zip(self._probes, self.boot_ids):
            if probe.boot_id is not None and probe.boot_id != boot:
                return f"daemon at {probe.endpoint} restarted (boot {boot} -> {probe.boot_id})"
            if probe.silent_for(now) > _MISSED_PINGS * self.retry_interval_s:
                return f"daemon at {probe.endpoint} stopped answering"
        return None

    def _open(self) -> None:
        try:
            client = EngineClient(self.endpoints, name=self.name, timeout_s=self.transfer_timeout_s)
            try:
                self.hellos = client.connect(timeout_s=self.connect_timeout_s)
                if self.cache is not None:
                    self.runner = self._attach(self.endpoints[0], self.cache)
            except BaseException:
                client.close()
                raise
        except (ClientError, OSError, zmq.ZMQError) as exc:
            if str(exc) != self._last_error:
                log.warning("cachexferd: cannot use daemon(s) %s yet: %s", self.endpoints, exc)
            self._last_error = str(exc)
            return
        self.client = client
        self.boot_ids = [link.boot_id or "" for link in client.links]
        self.opened += 1
        self._last_error = ""
        log.info("cachexferd: connected to %s (boot %s)%s", self.endpoints, self.boot_ids,
                 ", KV cache attached" if self.cache is not None else "")  # fmt: skip

    def _attach(self, endpoint: str, cache: PageCache) -> RunnerClient:
        runner = RunnerClient(endpoint, name=f"{self.name}-runner", timeout_s=self.connect_timeout_s)
        try:
            try:
                runner.attach(cache)
            except ClientError as exc:
                if exc.code != ErrorCode.ALREADY_ATTACHED:
                    raise
                # Our own earlier attach (a reconnect to the same daemon): replace it. Never
                # detach a cache another process attached.
                owner = runner.status().get("device", {}).get("runner_pid")
                if owner != os.getpid():
                    raise ClientError(exc.code, f"daemon already serves another runner (pid {owner})") from None
                runner.detach()
                runner.attach(cache)
        except BaseException:
            runner.close()
            raise
        return runner

    def lose(self, reason: str) -> None:
        """Drops the clients (their pending commands will never complete: the owner fails them)."""
        log.warning("cachexferd: lost %s: %s; vLLM recomputes instead until it is back", self.endpoints, reason)
        self._close_clients(detach=False)
        for probe in self._probes:
            probe.boot_id = None

    def _close_clients(self, detach: bool) -> None:
        if self.runner is not None:
            if detach:
                try:
                    self.runner.detach()
                except (ClientError, zmq.ZMQError) as exc:
                    log.warning("cachexferd: detach from %s failed: %s", self.endpoints[0], exc)
            self.runner.close()
            self.runner = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self.boot_ids = []

    def close(self) -> None:
        """Detaches (so vLLM may free its cache) and closes every socket."""
        self._close_clients(detach=True)
        for probe in self._probes:
            probe.close()
        self._ctx.term()
