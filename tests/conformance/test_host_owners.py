"""Protocol 1.2 on the wire: the host-cache generation, owner tokens on host blocks,
``not_after`` on copies, ATTACH ``supersede`` (docs/protocol.md §7.13 to §7.15), and
segments attached by descriptor (§8.3)."""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import DaemonProc
from .shm import LAYOUT, geometry
from .spec import E, T

pytestmark = pytest.mark.conformance


def generation(client: object) -> int:
    reply = client.call(T.PING)  # type: ignore[attr-defined]
    assert reply.ok
    value = reply.result["host_generation"]
    assert isinstance(value, int)
    return value


def test_clear_host_moves_the_generation_every_client_sees(fresh_daemon: DaemonProc, connect: ClientFactory) -> None:
    one, other = connect(fresh_daemon), connect(fresh_daemon)
    before = other.hello().result["host_generation"]
    assert generation(other) == before
    cleared = one.call(T.CLEAR_HOST)
    assert cleared.ok and cleared.result["host_generation"] == before + 1
    assert generation(other) == before + 1
    assert other.hello().result["host_generation"] == before + 1
    assert other.call(T.STATUS).result["host_cache"]["generation"] == before + 1


def test_a_read_naming_its_owner_gets_only_what_that_owner_wrote(attached: Attached, connect: ClientFactory) -> None:
    client, cache = attached.client, attached.cache
    want = cache.block(3)
    assert client.call(T.SWAP_OUT, device_ids=[3], host_ids=[20], owner="engine-a").ok
    untouched = cache.block(5)
    assert client.call(T.SWAP_IN, device_ids=[4], host_ids=[20], owner="engine-a").ok
    assert cache.block(4) == want and cache.block(5) == untouched

    refused = client.call(T.SWAP_IN, device_ids=[5], host_ids=[20], owner="engine-b")
    assert refused.code == E.HOST_BLOCK_CHANGED and "engine-b" in refused.body["detail"]
    assert cache.block(5) == untouched, "a refused read must not copy"

    # Another client rewrites the block (naming no owner): engine-a's next read is refused.
    other = connect(attached.daemon)
    assert other.call(T.SWAP_OUT, device_ids=[6], host_ids=[20]).ok
    assert client.call(T.SWAP_IN, device_ids=[5], host_ids=[20], owner="engine-a").code == E.HOST_BLOCK_CHANGED
    assert cache.block(5) == untouched
    # A 1.1 client (no owner) is served as before.
    assert client.call(T.SWAP_IN, device_ids=[5], host_ids=[20]).ok and cache.block(5) == cache.block(6)


def test_clear_host_voids_every_owner(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[1, 2], host_ids=[30, 31], owner="engine-a").ok
    untouched = cache.block(8)
    assert client.call(T.CLEAR_HOST).ok
    refused = client.call(T.SWAP_IN, device_ids=[8], host_ids=[30], owner="engine-a")
    assert refused.code == E.HOST_BLOCK_CHANGED
    assert cache.block(8) == untouched


def test_storage_commands_stamp_and_check_owners(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[2], host_ids=[40], owner="engine-a").ok
    assert client.call(T.STORE, keys=["owned-40"], host_ids=[40], owner="engine-a").result["stored"] == 1
    assert client.call(T.STORE, keys=["owned-40b"], host_ids=[40], owner="engine-b").code == E.HOST_BLOCK_CHANGED
    loaded = client.call(T.LOAD, keys=["owned-40"], host_ids=[41], owner="engine-b")
    assert loaded.ok and loaded.result["loaded"] == 1
    assert client.call(T.SWAP_IN, device_ids=[9], host_ids=[41], owner="engine-b").ok
    assert cache.block(9) == cache.block(2)


def test_copies_read_after_not_after_are_refused(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    past, future = time.time() - 1.0, time.time() + 60.0
    assert client.call(T.SWAP_OUT, device_ids=[10], host_ids=[50], not_after=future).ok
    before = cache.snapshot()
    for msg_type, fields in (
        (T.SWAP_OUT, {"device_ids": [11], "host_ids": [50]}),
        (T.SWAP_IN, {"device_ids": [11], "host_ids": [50]}),
        (T.STORE, {"keys": ["late"], "host_ids": [50]}),
        (T.LOAD, {"keys": ["late"], "host_ids": [51], "device_ids": [12]}),
    ):
        refused = client.call(msg_type, not_after=past, **fields)
        assert refused.code == E.EXPIRED, (msg_type, refused)
    assert cache.snapshot() == before
    assert client.call(T.SWAP_IN, device_ids=[11], host_ids=[50], not_after=future).ok
    assert cache.block(11) == cache.block(10)
    assert client.call(T.SWAP_IN, device_ids=[1], host_ids=[50], not_after="soon").code == E.BAD_FIELD


def _orphan_to_be() -> tuple[subprocess.Popen[bytes], int]:
    """A parent process and the pid of a child it started; killing the parent orphans the child."""
    script = "import subprocess,sys,time;c=subprocess.Popen(['sleep','120']);print(c.pid,flush=True);time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def test_supersede_replaces_only_an_orphaned_runner(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    parent, child = _orphan_to_be()
    try:
        first, second = connect(fresh_daemon), connect(fresh_daemon)
        assert first.call(T.ATTACH, **shm(seed=2).attach_fields(pid=child)).ok
        newcomer = shm(seed=3)
        plain = second.call(T.ATTACH, **newcomer.attach_fields(pid=os.getpid()))
        assert plain.code == E.ALREADY_ATTACHED
        refused = second.call(T.ATTACH, supersede=True, **newcomer.attach_fields(pid=os.getpid()))
        assert refused.code == E.ALREADY_ATTACHED and "alive" in refused.body["detail"]
        assert second.call(T.STATUS).result["device"]["runner_pid"] == child

        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)  # the child lives on, orphaned
        taken = second.call(T.ATTACH, supersede=True, **newcomer.attach_fields(pid=os.getpid()))
        assert taken.ok, taken
        status = second.call(T.STATUS).result["device"]
        assert (status["state"], status["runner_pid"]) == ("attached", os.getpid())
        want = newcomer.block(4)
        assert second.call(T.SWAP_OUT, device_ids=[4], host_ids=[0]).ok
        assert second.call(T.SWAP_IN, device_ids=[5], host_ids=[0]).ok and newcomer.block(5) == want
        assert second.call(T.DETACH).ok
    finally:
        for pid in (parent.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)


def test_a_segment_without_a_name_is_attached_by_descriptor(fresh_daemon: DaemonProc, connect: ClientFactory) -> None:
    """§8.3 (1.2): an O_TMPFILE segment, named by the attaching process's descriptor only."""
    _, chunk, _, tensor_bytes = geometry(LAYOUT)
    tensors = LAYOUT["num_layers"] * LAYOUT["kv_tensors"]
    size = tensors * tensor_bytes
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        memory[:] = random.Random(9).randbytes(size)

        def block(b: int) -> bytes:
            return b"".join(memory[t * tensor_bytes + b * chunk :][:chunk] for t in range(tensors))

        client = connect(fresh_daemon)
        offsets = [t * tensor_bytes for t in range(tensors)]
        reply = client.call(
            T.ATTACH, layout=LAYOUT, device={"kind": "shm", "fd": fd, "offsets": offsets}, pid=os.getpid()
        )
        assert reply.ok, reply
        want, untouched = block(3), block(5)
        assert client.call(T.SWAP_OUT, device_ids=[3], host_ids=[1]).ok
        assert client.call(T.SWAP_IN, device_ids=[4], host_ids=[1]).ok
        assert block(4) == want and block(5) == untouched
        assert client.call(T.DETACH).ok
        bad = client.call(T.ATTACH, layout=LAYOUT, device={"kind": "shm", "fd": 9999, "offsets": offsets})
        assert bad.code == E.ATTACH_FAILED
        memory.close()
    finally:
        os.close(fd)
