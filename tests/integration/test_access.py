"""Access control on a real daemon: modes of what it creates, refused directories, CURVE on
tcp, IPv6 loopback, and attaches of segments the asking process does not own."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.client.link import ClientError
from cachexferd.client.runner import RunnerClient, ShmKVCache
from cachexferd.daemon.server import DaemonError
from cachexferd.keys_cli import generate
from cachexferd.protocol import ErrorCode, KVLayout

from ..helpers import SMALL, InProcessDaemon, RawClient, config_for

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another user)")
NOBODY = 65534  # nobody / nogroup on Debian


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Segment:
    """What RunnerClient.attach needs: a layout and a handle naming a file in /dev/shm."""

    def __init__(self, name: str, layout: KVLayout = SMALL) -> None:
        self.layout, self.name = layout, name

    def device_handle(self) -> dict[str, Any]:
        offsets = [t * self.layout.tensor_bytes for t in range(self.layout.num_tensors)]
        return {"kind": "shm", "name": self.name, "offsets": offsets}


@pytest.fixture
def shm_file() -> Iterator[Path]:
    """A segment-sized regular file in /dev/shm, removed afterwards."""
    path = Path(f"/dev/shm/cx-test-{uuid.uuid4().hex[:12]}")
    path.write_bytes(b"\x5a" * (SMALL.num_tensors * SMALL.tensor_bytes))
    yield path
    path.unlink(missing_ok=True)


# Modes and directories -------------------------------------------------------------------


def test_private_modes_by_default(short_tmp: Path) -> None:
    daemon = InProcessDaemon(config_for(short_tmp / "rt")).start()
    try:
        assert mode(short_tmp / "rt") == 0o700
        assert mode(short_tmp / "rt" / "cmd.sock") == 0o600
    finally:
        daemon.stop()


@as_root
def test_group_modes(short_tmp: Path) -> None:
    (short_tmp / "rt").mkdir(mode=0o755)  # an existing directory gets the modes too
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **{"access.group": "nogroup"})).start()
    try:
        for path, want in ((short_tmp / "rt", 0o750), (short_tmp / "rt" / "cmd.sock", 0o660)):
            assert (mode(path), path.stat().st_gid) == (want, NOBODY), path
    finally:
        daemon.stop()


@pytest.mark.parametrize("how", ["world-writable", "other owner"])
def test_unsafe_runtime_dir_is_refused(short_tmp: Path, how: str) -> None:
    runtime = short_tmp / "rt"
    runtime.mkdir()
    if how == "world-writable":
        runtime.chmod(0o777)
        needle = "writable by all users"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root (chown)")
        os.chown(runtime, NOBODY, NOBODY)
        needle = f"belongs to uid {NOBODY}"
    with pytest.raises(DaemonError, match=needle):
        InProcessDaemon(config_for(runtime)).start()
    assert not (runtime / "cmd.sock").exists()


def test_runner_segment_modes(short_tmp: Path) -> None:
    with ShmKVCache(SMALL) as private:
        assert mode(Path(private.path)) == 0o600
    if os.geteuid() != 0:
        return
    with ShmKVCache(SMALL, group="nogroup") as shared:
        assert (mode(Path(shared.path)), Path(shared.path).stat().st_gid) == (0o660, NOBODY)


# Endpoints ---------------------------------------------------------------------------------


def test_ipv6_loopback(short_tmp: Path) -> None:
    """Commands to a daemon on tcp://[::1], and its events to a PULL on tcp://[::1]."""
    import zmq

    from cachexferd.protocol import Hello, Lookup, decode_outcome, encode_command

    try:
        endpoint, events = f"tcp://[::1]:{free_port('::1')}", f"tcp://[::1]:{free_port('::1')}"
    except OSError:
        pytest.skip("no IPv6 loopback here")
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **{"daemon.endpoint": endpoint})).start()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with RunnerClient(endpoint, timeout_s=10) as runner:  # the client library sets ZMQ_IPV6 itself
            assert runner.status()["endpoint"] == endpoint
        pull, dealer = ctx.socket(zmq.PULL), ctx.socket(zmq.DEALER)
        for sock in (pull, dealer):
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.LINGER, 0)
        pull.bind(events)
        dealer.connect(endpoint)
        dealer.send_multipart(encode_command(Hello(req_id=1, protocol=[1, 0], events=events)))
        assert dealer.poll(10_000) and decode_outcome(dealer.recv_multipart())[1].ok
        dealer.send_multipart(encode_command(Lookup(req_id=2, keys=["k"])))
        assert pull.poll(10_000), "no event over IPv6"
        assert decode_outcome(pull.recv_multipart())[1].req_id == 2
    finally:
        ctx.destroy(0)
        daemon.stop()


def test_abstract_event_endpoint_refused(inproc: InProcessDaemon, short_tmp: Path) -> None:
    from cachexferd.protocol import Hello

    raw = RawClient(inproc.endpoint)
    try:
        reply = raw.call(Hello(req_id=1, protocol=[1, 0], events="ipc://@cx-events"))
        assert reply.code == ErrorCode.BAD_FIELD and "abstract" in reply.detail
    finally:
        raw.close()


def test_warnings_at_start(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"tcp://0.0.0.0:{free_port()}"
    settings = {"daemon.endpoint": endpoint, "access.insecure_tcp": "true", "metrics.host": "0.0.0.0"}
    with caplog.at_level(logging.WARNING, logger="cachexferd"):
        daemon = InProcessDaemon(config_for(short_tmp / "rt", **settings)).start()
        daemon.stop()
    text = caplog.text
    assert f"plaintext tcp on {endpoint}" in text and "metrics.host '0.0.0.0' is not loopback" in text


# CURVE ---------------------------------------------------------------------------------------


@pytest.fixture
def curve(short_tmp: Path) -> Iterator[tuple[str, Path]]:
    """A daemon on tcp://0.0.0.0 with CURVE; keys: daemon, engine (allowed), intruder (not)."""
    keys = short_tmp / "keys"
    for name in ("daemon", "engine", "intruder", "late"):
        generate(keys, name)
    clients = keys / "clients"
    clients.mkdir()
    shutil.copy(keys / "engine.key", clients)
    port = free_port()
    settings = {
        "daemon.endpoint": f"tcp://0.0.0.0:{port}",
        "access.curve_secret_key": str(keys / "daemon.key_secret"),
        "access.curve_clients": str(clients),
    }
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **settings)).start()
    yield f"tcp://127.0.0.1:{port}", keys
    daemon.stop()


def test_curve_accepts_the_right_keys(curve: tuple[str, Path]) -> None:
    endpoint, keys = curve
    with RunnerClient(
        endpoint, timeout_s=10, server_key=keys / "daemon.key", client_key=keys / "engine.key_secret"
    ) as runner:
        assert runner.status()["endpoint"].startswith("tcp://0.0.0.0:")


def test_status_command_with_curve_keys(curve: tuple[str, Path]) -> None:
    import subprocess
    import sys

    endpoint, keys = curve
    base = [sys.executable, "-m", "cachexferd", "status", "--endpoint", endpoint, "--timeout", "10", "--json"]
    done = subprocess.run(
        [*base, "--server-key", str(keys / "daemon.key"), "--client-key", str(keys / "engine.key_secret")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused = subprocess.run([*base[:-3], "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "no status from" in refused.stderr


@pytest.mark.parametrize(
    ("server", "client", "needle"),
    [
        ("daemon.key", "intruder.key_secret", "refused our CURVE key"),
        ("intruder.key", "engine.key_secret", "no reply"),
        (None, None, "no reply"),
    ],
)
def test_curve_refuses_wrong_or_missing_keys(
    curve: tuple[str, Path], server: str | None, client: str | None, needle: str
) -> None:
    endpoint, keys = curve
    kwargs = {"server_key": keys / server, "client_key": keys / client} if server and client else {}
    with pytest.raises(ClientError) as info:
        RunnerClient(endpoint, timeout_s=2, **kwargs)  # type: ignore[arg-type]
    # No reply; or, when the refusal ended the connection before the hello went out, no send.
    assert info.value.code in (ErrorCode.CLIENT_TIMEOUT, ErrorCode.SEND_FAILED)
    assert needle in str(info.value) or (needle == "no reply" and info.value.code == ErrorCode.SEND_FAILED)


def test_failed_curve_bind_leaves_no_zap_thread(short_tmp: Path) -> None:
    import threading

    keys = short_tmp / "keys"
    generate(keys, "daemon")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        settings = {
            "daemon.endpoint": f"tcp://0.0.0.0:{busy.getsockname()[1]}",
            "access.curve_secret_key": str(keys / "daemon.key_secret"),
            "access.curve_clients": str(keys),
        }
        before = set(threading.enumerate())
        with pytest.raises(DaemonError, match="cannot bind"):
            InProcessDaemon(config_for(short_tmp / "rt", **settings)).start()
    zap = [t for t in set(threading.enumerate()) - before if type(t).__name__ == "AuthenticationThread"]
    assert not any(t.is_alive() for t in zap)


def test_curve_client_keys_are_reread(curve: tuple[str, Path]) -> None:
    endpoint, keys = curve
    kwargs = {"server_key": keys / "daemon.key", "client_key": keys / "late.key_secret"}
    with pytest.raises(ClientError):
        RunnerClient(endpoint, timeout_s=1.5, **kwargs)  # type: ignore[arg-type]
    shutil.copy(keys / "late.key", keys / "clients")
    with RunnerClient(endpoint, timeout_s=10, **kwargs) as runner:  # type: ignore[arg-type]
        assert runner.status()["state"] == "running"


# Attach: whose segments the daemon maps --------------------------------------------------------


@as_root
def test_symlink_to_a_root_only_file_is_refused(inproc: InProcessDaemon, short_tmp: Path) -> None:
    secret = short_tmp / "secret"
    secret.write_bytes(b"s" * (SMALL.num_tensors * SMALL.tensor_bytes))
    secret.chmod(0o600)
    os.chown(secret, NOBODY, NOBODY)
    before = (secret.read_bytes(), secret.stat().st_mode, secret.stat().st_uid)
    link = Path(f"/dev/shm/cx-test-link-{uuid.uuid4().hex[:12]}")
    link.symlink_to(secret)
    try:
        with RunnerClient(inproc.endpoint, timeout_s=10) as runner:
            with pytest.raises(ClientError, match="is a symbolic link") as info:
                runner.attach(Segment(link.name))  # type: ignore[arg-type]
            assert info.value.code == ErrorCode.ATTACH_FAILED
            assert runner.status()["device"]["state"] == "detached"
    finally:
        link.unlink()
    assert (secret.read_bytes(), secret.stat().st_mode, secret.stat().st_uid) == before


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_special_files_are_refused(inproc: InProcessDaemon, kind: str) -> None:
    path = Path(f"/dev/shm/cx-test-{kind}-{uuid.uuid4().hex[:12]}")
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    try:
        with RunnerClient(inproc.endpoint, timeout_s=10) as runner:
            with pytest.raises(ClientError, match="not a regular file"):
                runner.attach(Segment(path.name))  # type: ignore[arg-type]
    finally:
        path.rmdir() if kind == "directory" else path.unlink()


@as_root
def test_tcp_peer_may_attach_only_allowed_owners(short_tmp: Path, shm_file: Path) -> None:
    """Over tcp the kernel does not say who asks: the owner must be the daemon's user or
    belong to access.group."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    os.chown(shm_file, NOBODY, NOBODY)
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **{"daemon.endpoint": endpoint})).start()
    try:
        with RunnerClient(endpoint, timeout_s=10) as runner:
            with pytest.raises(ClientError, match=f"owned by uid {NOBODY}, neither this daemon's user"):
                runner.attach(Segment(shm_file.name))  # type: ignore[arg-type]
            os.chown(shm_file, 0, 0)
            assert runner.attach(Segment(shm_file.name))["state"] == "attached"  # type: ignore[arg-type]
            runner.detach()
    finally:
        daemon.stop()
    assert shm_file.read_bytes() == b"\x5a" * (SMALL.num_tensors * SMALL.tensor_bytes)


def _attach_as_nobody(endpoint: str, names: list[str]) -> list[str]:
    """In a forked child running as nobody: hello, then ATTACH (and DETACH) each segment;
    returns each attach's error name and detail."""
    import select
    import signal

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no threads, a fresh zmq context, then straight to _exit
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            text = "\n".join(_child_attach(endpoint, names))
        except BaseException as exc:
            text = f"child failed: {exc!r}"
        os.write(write_end, text.encode())
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise TimeoutError("the child attaching as nobody did not answer")
        out = os.read(read_end, 1 << 16).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return out.split("\n")


def _child_attach(endpoint: str, names: list[str]) -> list[str]:
    import zmq

    from cachexferd.protocol import Attach, Detach, Hello, decode_outcome, encode_command

    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def call(cmd: Any) -> Any:
        sock.send_multipart(encode_command(cmd))
        if not sock.poll(10_000):
            raise TimeoutError(f"no reply to {cmd.TYPE.name}")
        return decode_outcome(sock.recv_multipart())[1]

    results = [call(Hello(req_id=1, protocol=[1, 0], role="runner")).error]
    for i, name in enumerate(names):
        device = Segment(name).device_handle()
        reply = call(Attach(req_id=10 + i, layout=SMALL.to_wire(), device=device, pid=os.getpid()))
        results.append(f"{reply.error}: {reply.detail}")
        if reply.ok:
            call(Detach(req_id=100 + i))
    ctx.destroy(0)
    return results


@as_root
def test_ipc_peer_may_attach_only_its_own_segments(spawn_daemon: Any, short_tmp: Path, shm_file: Path) -> None:
    """A group member (nobody, via access.group) connects over ipc: the kernel reports its
    uid, and the daemon (root) maps its segment but refuses root's, which nobody cannot open."""
    short_tmp.chmod(0o711)  # the test's temp dir must not be what keeps nobody out
    daemon = spawn_daemon(settings={"access.group": "nogroup"})
    shm_file.chmod(0o600)
    own = Path(f"/dev/shm/cx-test-own-{uuid.uuid4().hex[:12]}")
    own.write_bytes(bytes(SMALL.num_tensors * SMALL.tensor_bytes))
    os.chown(own, NOBODY, NOBODY)
    try:
        results = _attach_as_nobody(daemon.endpoint, [shm_file.name, own.name])
        assert len(results) == 3, results
        hello, theirs, mine = results
    finally:
        own.unlink()
    assert hello == "OK"
    assert theirs.startswith("ATTACH_FAILED") and f"not by the attaching process (uid {NOBODY}" in theirs, theirs
    assert mine == "OK: ", mine
    assert shm_file.read_bytes() == b"\x5a" * (SMALL.num_tensors * SMALL.tensor_bytes)
    assert "Traceback" not in daemon.log_tail(200)
