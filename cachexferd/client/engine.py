"""Synchronous engine client: fan out to every TP rank, drain completions at step boundaries.

No thread is started. The scheduler calls ``poll()`` once per step (or when ``fileno()``
turns readable): it drains every event and reply available, sends heartbeats, expires
deadlines, and returns the commands that completed, each aggregated over all ranks.
Commands go out as they are submitted; inside ``with client.batch():`` (or with
``autoflush=False``) they are queued and sent as one BATCH envelope per rank at the end of
the block (or at the next ``flush()`` / ``poll()``); a block inside another leaves the
sending to the outer one::

    client = EngineClient(["ipc:///run/cachexferd/0/cmd.sock", "ipc:///run/cachexferd/1/cmd.sock"])
    client.connect()
    req = client.swap_out(device_ids=[3, 4, 9], host_ids=[100, 101, 102])
    ...
    for done in client.poll():
        if not done.ok:
            print(done.describe())
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import zmq

from ..protocol import Command, ErrorCode, MsgType, Outcome, Shutdown, Status
from ..security import KeyFile, group_id
from ..zmqio import FdWatch
from .commands import CommandMethods, Fields
from .core import EngineCore
from .events import EventSocket, check_curve_events, curve_per_endpoint
from .link import ClientError, Link, check_ok, read_outcomes
from .pending import Completion

_UNASKED_REPLY_S = 0.005  # longest a refusal of an asynchronous command may wait to be read


def default_events_endpoint(group: str | None = None) -> tuple[str, Path]:
    """An ipc endpoint in a private temp dir (removed on close). With ``group`` (the daemons'
    access.group) the directory is 0750 and group-owned, so a daemon running as another user
    of that group can reach the socket (made 0660 by secure_events_socket after the bind)."""
    directory = Path(tempfile.mkdtemp(prefix="cachexferd-engine-"))  # the daemon knows this prefix
    if group is not None:
        os.chown(directory, -1, group_id(group))
        os.chmod(directory, 0o750)
    return f"ipc://{directory / 'events.sock'}", directory


def secure_events_socket(endpoint: str, group: str | None) -> None:
    """After the bind: the daemons (members of ``group``) must be able to connect."""
    if group is not None and endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        path = endpoint[len("ipc://") :]
        os.chown(path, -1, group_id(group))
        os.chmod(path, 0o660)


class EngineClient(CommandMethods[int]):
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        events: str | None = None,
        name: str = "engine",
        timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        autoflush: bool = True,
        events_group: str | None = None,
        server_key: KeyFile | Sequence[KeyFile] | None = None,
        client_key: KeyFile | None = None,
    ) -> None:
        """``events_group``: the daemons run as another user of this group (docs/operations.md,
        "Access control"); ``server_key`` / ``client_key``: CURVE key files for daemons on tcp
        (the daemons' public key: one file for all, or one per endpoint; this client's secret
        key). With keys, ``events`` may be ``tcp://ADDRESS:PORT`` on an address the daemons
        reach (port 0: any free port): a CURVE event socket for daemons on other machines."""
        if not endpoints:
            raise ValueError("EngineClient needs at least one daemon endpoint")
        curve = curve_per_endpoint(endpoints, server_key, client_key)
        self._tmpdir: Path | None = None
        if events is None:
            events, self._tmpdir = default_events_endpoint(events_group)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.events = EventSocket(self.ctx, events, curve)
        self.pull = self.events.pull
        secure_events_socket(events, events_group)
        self.links = [Link(self.ctx, endpoint, i, keys) for i, (endpoint, keys) in enumerate(zip(endpoints, curve))]
        self.core = EngineCore(len(self.links), name, self.events.endpoint, timeout_s, heartbeat_s, self.events.key)
        self._ready: list[Completion] = []  # finished while we were waiting for something else
        self.autoflush = autoflush  # False: submit() queues until flush() / poll()
        self._poller = zmq.Poller()  # for waits (poll with a timeout)
        self._poller.register(self.pull, zmq.POLLIN)
        if self.events.zap is not None:  # daemons' handshakes with a CURVE event socket
            self._poller.register(self.events.zap.sock, zmq.POLLIN)
        for link in self.links:
            self._poller.register(link.sock, zmq.POLLIN)
            self._poller.register(link.monitor, zmq.POLLIN)
        # For the checks of poll(): one poll(2) says which sockets may have news (FdWatch).
        self._fds = FdWatch()
        self._pull_fd = self._fds.add(self.pull)
        self._link_fds = [(self._fds.add(link.sock), self._fds.add(link.monitor)) for link in self.links]
        self._look_everywhere = True  # until the next _drain: a wait took in news without us
        self._closed = False

    # Set-up ---------------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Says hello to every rank; returns their hello results."""
        outcomes = [
            check_ok_outcome(link.call(self.core.hello(), timeout_s, self._on_reply(link))) for link in self.links
        ]
        self.core.accept_hellos(outcomes)
        for link, outcome in zip(self.links, outcomes):
            link.remember_hello(outcome)
        self._look_everywhere = True
        if self.events.key is not None:
            check_curve_events([o.result for o in outcomes], [link.endpoint for link in self.links])
        return [o.result for o in outcomes]

    @property
    def ranks(self) -> list[int]:
        return list(self.core.rank_of)

    # Asynchronous commands (the methods are in CommandMethods) ------------------------

    def submit(self, op: MsgType, fields: Fields, timeout_s: float | None = None) -> int:
        """Sends ``op`` to every rank (or queues it, see ``batch``); returns its req_id.
        The outcome arrives via poll()."""
        req_id, bodies = self.core.build(op, fields, timeout_s)
        for link, body in zip(self.links, bodies):
            if not self.autoflush or self.core.boot_ids[link.index] is None:
                link.outbox.append((op, body))  # held while that daemon is being said hello to again
                continue
            try:
                link.send_body(op, body)
            except ClientError as exc:
                self._ready += self.core.send_failed(link.index, req_id, exc.detail)
        return req_id

    @contextlib.contextmanager
    def batch(self) -> Iterator[EngineClient]:
        """Commands submitted inside the block go out together, one BATCH per rank, at its end
        (the end of the outermost block, when blocks nest; with ``autoflush=False``, at the
        next ``flush()`` / ``poll()``)."""
        outermost, self.autoflush = self.autoflush, False
        try:
            yield self
        finally:
            self.autoflush = outermost
            if outermost:
                self.flush()

    def flush(self) -> None:
        """Sends every queued command; a rank that cannot be reached fails them at once.
        Commands for a daemon that restarted wait for its new hello (with its new boot id).
        A closed client sends nothing."""
        if self._closed:
            return
        for link in self.links:
            boot_id = self.core.boot_ids[link.index]
            if boot_id is None or not link.outbox:
                continue
            link.outbox = [
                (op, {**body, "boot_id": boot_id}) for op, body in link.outbox if body["req_id"] in self.core.pending
            ]
            for _, body in link.flush():
                self._ready += self.core.send_failed(link.index, body["req_id"], f"send to {link.endpoint} failed")

    # Completion intake ----------------------------------------------------------------

    def fileno(self) -> int:
        """The event socket's fd for selectors. Edge-triggered: call poll() until it returns [].
        Call poll() at least once a second also while waiting: it sends the heartbeats, expires
        deadlines and, with a CURVE event socket, answers the daemons' connection handshakes."""
        return int(self.pull.getsockopt(zmq.FD))

    def poll(self, timeout_ms: int = 0) -> list[Completion]:
        """Sends what is queued, drains everything available and returns finished commands;
        never blocks past timeout_ms."""
        self.flush()
        done = self._drain()
        if done or timeout_ms <= 0:
            return done
        deadline = self.core.pending.next_deadline()
        if deadline is not None:
            timeout_ms = min(timeout_ms, max(1, int((deadline - time.monotonic()) * 1000) + 1))
        self._poller.poll(timeout_ms)
        self._look_everywhere = True
        return self._drain()

    def wait(self, req_ids: Iterable[int], timeout_s: float = 60.0) -> dict[int, Completion]:
        """Blocks until every req_id completed (or ``timeout_s`` passes: ClientError)."""
        wanted = set(req_ids)
        got: dict[int, Completion] = {}
        self.flush()
        deadline = time.monotonic() + timeout_s
        while wanted - got.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - got.keys())
                raise ClientError(
                    ErrorCode.CLIENT_TIMEOUT, f"{len(missing)} commands still pending after {timeout_s}s: {missing[:8]}"
                )
            for completion in self.poll(timeout_ms=max(1, int(min(left, 0.05) * 1000))):
                if completion.req_id in wanted:
                    got[completion.req_id] = completion
                else:
                    self._ready.append(completion)
        return got

    def _drain(self) -> list[Completion]:
        done, self._ready = self._ready, []
        self.events.serve_handshakes()
        ready, everywhere = self._fds.ready(), self._look_everywhere
        self._look_everywhere = False
        if everywhere or self._pull_fd in ready:
            for outcome in read_outcomes(self.pull):
                done += self._file(outcome, None)
        now = time.monotonic()
        for link, (sock_fd, monitor_fd) in zip(self.links, self._link_fds):
            if everywhere or monitor_fd in ready:
                done += self._watch_connection(link)
            if everywhere or sock_fd in ready or self._reply_due(link, now):
                link.unchecked_since = None
                for reply in read_outcomes(link.sock):
                    done += self._file(reply, link.index)
        self.flush()  # what waited for a new hello goes out now
        for index, cmd in self.core.heartbeat():
            self._send_control(index, cmd)
        done += self.core.expire()
        return done

    def _reply_due(self, link: Link, now: float) -> bool:
        """Whether to look for replies on a DEALER whose fd shows nothing. Sends on it may
        have taken in libzmq's news of a reply, so after a send it is looked at: at once
        while a ping or hello awaits its reply, else within _UNASKED_REPLY_S (replies nobody
        awaits are refusals of asynchronous commands, such as a duplicate req_id). This
        spares a zmq.EVENTS call per rank on most steps."""
        since = link.unchecked_since
        return since is not None and (self.core.awaiting_control(now) or now - since >= _UNASKED_REPLY_S)

    def _watch_connection(self, link: Link) -> list[Completion]:
        """A dropped connection fails that rank's in-flight commands at once; when it comes
        back, the client says hello before anything else is sent there."""
        done: list[Completion] = []
        for event in link.connection_events():
            if event == zmq.EVENT_DISCONNECTED:
                done += self.core.link_lost(link.index)
            elif self.core.boot_ids[link.index] is None:
                self._send_control(link.index, self.core.hello())
        return done

    def _file(self, outcome: Outcome, index: int | None) -> list[Completion]:
        done, resend = self.core.on_outcome(outcome, index)
        for i, cmd in resend:
            self._send_control(i, cmd)
        return done

    def _send_control(self, index: int, cmd: Command) -> None:
        with contextlib.suppress(ClientError):  # the next heartbeat tries again
            self.links[index].send(cmd)

    def _on_reply(self, link: Link) -> Any:
        def on_other(outcome: Outcome) -> None:
            self._ready += self._file(outcome, link.index)

        return on_other

    # Synchronous calls to every rank ---------------------------------------------------

    def call_all(self, cmd_type: type[Command], timeout_s: float = 10.0, **fields: Any) -> list[dict[str, Any]]:
        results = []
        for link in self.links:
            cmd = cmd_type(req_id=self.core.next_req_id(), **fields)
            results.append(check_ok(link.call(cmd, timeout_s, self._on_reply(link))))
        self._look_everywhere = True
        return results

    def status(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return self.call_all(Status, timeout_s)

    def shutdown_daemons(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return self.call_all(Shutdown, timeout_s)

    def close(self) -> None:
        self._closed = True
        for link in self.links:
            link.close()
        self.events.close()
        self.ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_ok_outcome(outcome: Outcome) -> Outcome:
    check_ok(outcome)
    return outcome
