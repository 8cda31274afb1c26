"""A connection to the daemons of one or more ranks that never holds an engine step.

The engine calls its integration at every step, so nothing here may wait on a daemon that is
down or behind. Each daemon is watched by a ``Probe`` (liveness.py) on a socket of its own.
The blocking calls (hello, and for a worker the attach) are made by a keeper thread, only
to daemons that have just answered, each bounded by ``connect_timeout_s``; the engine's
thread only ever finds the connection up or not. So an idle engine attaches as soon as a
daemon comes up, and a daemon that comes up late costs the engine nothing.

Threads: the engine's thread uses ``client`` inside ``with conn.lock``; the keeper thread
takes the same lock only for quick steps (reading probes, installing or dropping a
client), never for a blocking call. Losses (liveness.py says what counts) are handled by
whichever thread sees them first; the owner learns of one from ``tick()`` and fails what it
had in flight.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ...client import EngineClient, RunnerClient
from ...client.link import ClientError
from ...protocol import ErrorCode
from .liveness import Probe, Verdict, orphaned, why_unreachable
from .logs import log
from .shm_cache import PageCache

# Outcomes that say the daemon or our attachment (not the command) is the problem.
# Restart errors: the daemon we said hello to, or our attachment, is gone: the connection is
# dropped and opened again. Link errors: the socket connection dropped with the command in
# flight (the client fails those commands at once); whether the daemon is gone is for the
# liveness checks to say: a stopped or starved daemon's connection can drop (ZeroMQ's
# heartbeat) while the daemon keeps its attachment and its blocks. A command that merely took
# long (CLIENT_TIMEOUT) is neither: a slow daemon keeps its link.
RESTART_ERRORS = frozenset(
    {
        ErrorCode.DAEMON_RESTARTED, ErrorCode.STALE_BOOT, ErrorCode.NOT_ATTACHED, ErrorCode.DETACHED,
        ErrorCode.SHUTTING_DOWN, ErrorCode.NO_EVENT_CHANNEL,
    }
)  # fmt: skip
LINK_ERRORS = frozenset({ErrorCode.DAEMON_LOST, ErrorCode.SEND_FAILED})
GEOMETRY_POLL_S = 0.1  # STATUS polls while a new connection's runner attaches
UNREACHABLE_LOG_S = 60.0  # how often an unreachable daemon is named again
CONNECTION_ERRORS = RESTART_ERRORS | LINK_ERRORS
# Failures after which the daemon may still run the command: its link dropped with it in
# flight, or the client stopped waiting. (A send that failed never left; a restarted daemon
# lost its queue with its process.)
OUTCOME_UNKNOWN = frozenset({ErrorCode.DAEMON_LOST, ErrorCode.CLIENT_TIMEOUT})


class DaemonConnection:
    """EngineClient (and, for a worker, RunnerClient + attach) to ``endpoints``, kept up.

    ``lineage``: for a worker, the engine's processes it depends on (``liveness.engine_lineage``);
    when one of them is gone, the connection lets go of the daemon (see ``_orphaned``)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        name: str,
        transfer_timeout_s: float,
        connect_timeout_s: float,
        retry_interval_s: float,
        lost_after_s: float = 30.0,
        slow_after_s: float = 0.5,
        cache: PageCache | None = None,
        lineage: Sequence[tuple[int, int]] = (),
    ) -> None:
        if cache is not None and len(endpoints) != 1:
            raise ValueError("a worker attaches its cache to exactly one daemon")
        self.endpoints = list(endpoints)
        self.name = name
        self.transfer_timeout_s = transfer_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.lost_after_s = lost_after_s
        self.slow_after_s = slow_after_s
        self.cache = cache
        # Whether a daemon this connection attached to makes device writes inside the device
        # fence (protocol 1.5, ATTACH ``device_fence``; client/fence.py).
        self.device_fence = False
        self.device_fence_reads = False  # (1.6, ATTACH ``device_fence_reads``) copies out of them too
        self.lock = threading.RLock()
        self.client: EngineClient | None = None
        self.runner: RunnerClient | None = None
        self.hellos: list[dict[str, Any]] = []
        self.boot_ids: list[str] = []
        self.opened = 0  # successful (re)connections so far
        self.last_loss = ""  # why the connection was last lost (by whichever thread saw it)
        self.verdict = Verdict.LOST
        self.on_keeper_tick: list[Callable[[], None]] = []  # also run by the keeper (e.g. log flushes)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._probes = [Probe(self._ctx, e) for e in self.endpoints]
        self._next_ping = 0.0
        self._last_nudge = 0.0
        self._next_open = 0.0
        self._last_error = ""
        self._slow_logged = False
        self._closed = False
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._lineage = list(lineage)  # a worker watches the engine's processes
        self.opened_at = 0.0  # monotonic time of the last (re)connection
        self._unreachable_since: float | None = None
        self._next_unreachable_log = 0.0

    @property
    def up(self) -> bool:
        return self.client is not None

    @property
    def usable(self) -> bool:
        """Up, answering, and every link has said hello under its current boot (a command
        submitted otherwise would be held by the client until a new hello; we fail it instead)."""
        client = self.client
        return client is not None and self.verdict is Verdict.UP and all(client.core.boot_ids)

    def nudge(self) -> None:
        """Pings every daemon now (non-blocking), so that ``heard_since`` soon tells whether
        they are reading what was just sent."""
        with self.lock:
            now = time.monotonic()
            if now - self._last_nudge >= 0.02:
                self._last_nudge = now
                for probe in self._probes:
                    probe.ping()

    def heard_since(self, t: float) -> bool:
        """Whether every daemon has answered something since ``t`` (monotonic): it is reading
        its socket, if slowly; a daemon that has not may be hung."""
        return all(p.last_reply > t for p in self._probes)

    def daemon_pids(self) -> tuple[int, ...] | None:
        """The processes of the daemons this connection's commands go to now; None when one
        is not known here (a remote daemon, another pid namespace, no STATUS yet)."""
        pids = [p.pid for p in self._probes]
        return tuple(pid for pid in pids if pid is not None) if None not in pids else None

    def generations(self) -> list[int | None]:
        return [p.generation for p in self._probes]

    def weights_versions(self) -> list[int | None]:
        """Each daemon's weights version: host blocks written under another one are never loaded."""
        return [p.weights_version for p in self._probes]

    def statuses(self) -> list[dict[str, Any]]:
        """The last STATUS of each daemon (asked for once per boot, and by ``ask_status``)."""
        return [p.status for p in self._probes]

    def ask_status(self) -> None:
        for probe in self._probes:
            probe.ask_status()

    # Start and keep ------------------------------------------------------------------------

    def start(self) -> bool:
        """At start-up: one bounded attempt to open, then the keeper thread keeps trying."""
        deadline = time.monotonic() + self.connect_timeout_s
        with self.lock:
            pinged = all([probe.ping() for probe in self._probes])
            self._next_ping = time.monotonic() + self.retry_interval_s
        while pinged and time.monotonic() < deadline and not self._all_answered():
            time.sleep(0.01)
            with self.lock:
                for probe in self._probes:
                    probe.drain()
        if pinged and self._all_answered():
            self._try_open()
        self._keeper = threading.Thread(target=self._keep, name=f"cachexferd-{self.name}", daemon=True)
        self._keeper.start()
        return self.up

    def _keep(self) -> None:
        period = min(0.25, self.retry_interval_s / 2)
        while not self._stop.wait(period):
            try:
                if self._orphaned():
                    return
                self.tick()
                if self.client is None and self._all_answered() and time.monotonic() >= self._next_open:
                    self._next_open = time.monotonic() + self.retry_interval_s
                    self._try_open()
                if self.client is None:
                    self._report_unreachable(time.monotonic())
                for callback in self.on_keeper_tick:
                    callback()
            except Exception:  # never let the keeper die: the engine would lose the daemon for good
                log.exception("cachexferd: connection keeper error (continuing)")

    def unreachable(self) -> str:
        """One line on the daemons that do not answer: what is wrong at each endpoint, and
        the command that shows a daemon's state."""
        silent = [p.endpoint for p in self._probes if p.boot_id is None] or self.endpoints
        return "; ".join(f"{why_unreachable(e)} (`cachexferd status --endpoint {e}`)" for e in silent)

    def _report_unreachable(self, now: float) -> None:
        """Repeats the warning while the daemons stay unreachable (not once and then silence)."""
        if self._unreachable_since is None:
            self._unreachable_since = now
            self._next_unreachable_log = now + UNREACHABLE_LOG_S
            return  # the start (or the loss) has just said so
        if now < self._next_unreachable_log or self._last_error:
            return  # an open that failed has said why
        self._next_unreachable_log = now + UNREACHABLE_LOG_S
        log.warning("cachexferd: still no daemon after %.0fs: %s; the engine runs without it until it answers",
                    now - self._unreachable_since, self.unreachable())  # fmt: skip

    def _orphaned(self) -> bool:
        """A worker whose engine's main process died (an engine may leave its other processes
        running then) lets go of its attachment: it would keep the daemon from the engine's
        next start."""
        gone = orphaned(self._lineage) if self._lineage else None
        if gone is None:
            return False
        log.warning("cachexferd: the engine's process %d is gone (this worker is orphaned): detaching from %s",
                    gone, self.endpoints)  # fmt: skip
        self.close()
        return True

    # The engine's step ---------------------------------------------------------------------

    def tick(self) -> str | None:
        """Call at every step boundary (the keeper calls it too). Returns why the connection
        was just lost, else None."""
        with self.lock:
            if self._closed:
                return None
            now = time.monotonic()
            for probe in self._probes:
                probe.drain()
            if now >= self._next_ping:
                self._next_ping = now + self._ping_interval()
                for probe in self._probes:
                    probe.ping()
            if self.client is None:
                return None
            reason = self._judge(now)
            if reason:
                self.lose(reason)
            return reason

    def _ping_interval(self) -> float:
        """Once per retry interval; more often while connected to a daemon whose host cache
        geometry is not known yet (its runner is attaching): the engine offloads nothing
        until it knows it, so it should learn it within a step or two."""
        if self.client is not None and not all(p.geometry_known for p in self._probes):
            return min(self.retry_interval_s, GEOMETRY_POLL_S)
        return self.retry_interval_s

    def _judge(self, now: float) -> str | None:
        """Updates ``verdict``; returns a reason when the connection is lost."""
        verdict, why = Verdict.UP, ""
        for probe, boot in zip(self._probes, self.boot_ids):
            v, reason = probe.verdict(now, boot, self.slow_after_s, self.lost_after_s)
            if v is Verdict.LOST:
                return reason
            if v is Verdict.UNRESPONSIVE and verdict is Verdict.UP:
                verdict, why = v, reason
        client = self.client
        if verdict is Verdict.UP and client is not None and not all(client.core.boot_ids):
            # The client saw its connection drop (DAEMON_LOST) and says hello again when it
            # is back; until then nothing can be sent. A gone daemon is LOST by the probe.
            verdict, why = Verdict.UNRESPONSIVE, f"the connection to {self.endpoints} dropped"
        if verdict is not self.verdict:
            if verdict is Verdict.UNRESPONSIVE:
                log.warning("cachexferd: %s; no new transfers until it answers", why)
            elif self.verdict is Verdict.UNRESPONSIVE:
                log.info("cachexferd: daemon(s) %s answer again", self.endpoints)
        self.verdict = verdict
        return None

    def _all_answered(self) -> bool:
        return all(p.boot_id is not None for p in self._probes)

    # Opening (keeper thread, or start) -------------------------------------------------------

    def _try_open(self) -> None:
        try:
            client, runner = self._connect()
        except (ClientError, OSError, zmq.ZMQError) as exc:
            if str(exc) != self._last_error:
                log.warning("cachexferd: cannot use daemon(s) %s yet: %s", self.endpoints, exc)
            self._last_error = str(exc)
            return
        with self.lock:
            if self.client is not None or self._closed:  # lost the race (or shutting down)
                _close_quietly(client, runner)
                return
            self.client, self.runner = client, runner
            self.hellos = [link.info for link in client.links]
            self.boot_ids = [link.boot_id or "" for link in client.links]
            self.verdict = Verdict.UP
            self.opened += 1
            self.opened_at = time.monotonic()
            self._next_ping = 0.0  # ask for the status (and the host cache's geometry) at once
            self._unreachable_since = None
        self._last_error = ""
        log.info("cachexferd: connected to %s (boot %s)%s", self.endpoints, self.boot_ids,
                 ", KV cache attached" if self.cache is not None else "")  # fmt: skip

    def _connect(self) -> tuple[EngineClient, RunnerClient | None]:
        """Blocking (each call bounded by connect_timeout_s); touches no shared state."""
        client = EngineClient(self.endpoints, name=self.name, timeout_s=self.transfer_timeout_s)
        try:
            client.connect(timeout_s=self.connect_timeout_s)
            runner = self._attach(self.endpoints[0], self.cache) if self.cache is not None else None
        except BaseException:
            client.close()
            raise
        return client, runner

    def _attach(self, endpoint: str, cache: PageCache) -> RunnerClient:
        runner = RunnerClient(endpoint, name=f"{self.name}-runner", timeout_s=self.connect_timeout_s)
        try:
            try:
                attached = runner.attach(cache)
            except ClientError as exc:
                if exc.code != ErrorCode.ALREADY_ATTACHED:
                    raise
                owner = runner.status().get("device", {}).get("runner_pid")
                if owner == os.getpid():
                    # Our own earlier attach (a connection we dropped): replace it.
                    runner.detach()
                    attached = runner.attach(cache)
                else:
                    # Another runner's: the daemon replaces it only if that one is gone or
                    # orphaned and ran as our user (docs/protocol.md §7.15).
                    attached = runner.attach(cache, supersede=True)
        except BaseException:
            runner.close()
            raise
        if attached.get("device_fence") == "flock":  # 1.5; never unset: an older daemon may still copy
            self.device_fence = True
        # What this daemon does (an older one that replaced it is gone with its copies).
        self.device_fence_reads = self.device_fence and attached.get("device_fence_reads") is True
        return runner

    # Losing and closing -------------------------------------------------------------------------

    def lose(self, reason: str) -> None:
        """Drops the clients (their pending commands will never complete: the owner fails them)."""
        with self.lock:
            if self.client is None:
                return
            log.warning("cachexferd: lost %s: %s; the engine recomputes instead until it is back",
                        self.endpoints, reason)  # fmt: skip
            self.last_loss = reason
            client, runner, self.client, self.runner = self.client, self.runner, None, None
            self.boot_ids = []
            self.verdict = Verdict.LOST
            for probe in self._probes:
                probe.forget()
        _close_quietly(client, runner)

    def close(self) -> None:
        """Detaches (so the engine may free its cache) and closes every socket."""
        self._stop.set()
        with self.lock:
            if self._closed:
                return
            self._closed = True
            client, runner, self.client, self.runner = self.client, self.runner, None, None
            self.boot_ids = []
        if runner is not None:
            try:
                runner.detach()
            except (ClientError, zmq.ZMQError) as exc:
                log.warning("cachexferd: detach from %s failed: %s", self.endpoints[0], exc)
        _close_quietly(client, runner)
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=self.connect_timeout_s * 2 + 1)
        with self.lock:
            for probe in self._probes:
                probe.close()
        self._ctx.term()


def _close_quietly(client: EngineClient | None, runner: RunnerClient | None) -> None:
    for closable in (runner, client):
        if closable is not None:
            try:
                closable.close()
            except zmq.ZMQError as exc:
                log.debug("cachexferd: close: %s", exc)
