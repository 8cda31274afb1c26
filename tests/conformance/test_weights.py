"""Weights versions on the wire (docs/protocol.md §7.4, §7.12, §10.3; docs/storage.md §1.9):
object names carry the version the command was read under, and an ATTACH can name the
version (1.2) so that a re-attach after a restart restores it before any copy runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from .conftest import CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import burst, object_file, object_name
from .spec import E, T

pytestmark = pytest.mark.conformance


def _store_dir(daemon: DaemonProc) -> Path:
    return daemon.runtime_dir.parent / f"{daemon.name}-store"


def test_object_names_carry_the_version_the_command_was_read_under(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client, store = connect(fresh_daemon), _store_dir(fresh_daemon)
    assert client.call(T.ATTACH, **shm(seed=3).attach_fields()).ok
    assert client.call(T.STORE, keys=["k"], host_ids=[1], device_ids=[1]).result["stored"] == 1
    assert object_file(store, "k", 0).is_file()  # version 0 has its w0/ part too
    # A STORE and a SET_WEIGHTS sent back to back: the STORE was read under version 0.
    store_id, weights_id = burst(
        client, [(T.STORE, {"keys": ["late"], "host_ids": [2], "device_ids": [2]}), (T.SET_WEIGHTS, {"version": 27})]
    )
    assert client.wait(weights_id).ok and client.wait(store_id).result["stored"] == 1
    assert object_file(store, "late", 0).is_file() and not object_file(store, "late", 27).exists()
    assert client.call(T.LOAD, keys=["late"], host_ids=[3]).result["loaded"] == 0
    assert client.call(T.STORE, keys=["k"], host_ids=[4], device_ids=[4]).result["stored"] == 1
    data = object_file(store, "k", 27).read_bytes()
    assert data[28:36] == hashlib.blake2b(object_name("k", 27).encode(), digest_size=8).digest()
    # A key that spells another version's name is still its own object.
    assert client.call(T.LOAD, keys=["w0/k"], host_ids=[5]).result["loaded"] == 0
    assert client.call(T.DETACH).ok


def test_attach_can_name_the_weights_version(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client, cache = connect(fresh_daemon), shm(seed=4)
    attached = client.call(T.ATTACH, **cache.attach_fields(), weights_version=4)
    assert attached.ok and attached.result["weights_version"] == 4, attached
    assert client.call(T.STATUS).result["host_cache"]["weights_version"] == 4
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[9]).ok  # host block 9: version 4
    assert client.call(T.DETACH).ok
    # Commands pipelined behind the ATTACH are judged under the version it names.
    attach = {**cache.attach_fields(), "weights_version": 7}
    attach_id, store_id = burst(client, [(T.ATTACH, attach), (T.STORE, {"keys": ["x"], "host_ids": [9]})])
    assert client.wait(attach_id).result["weights_version"] == 7
    assert client.wait(store_id).code == E.STALE_WEIGHTS
    assert client.call(T.DETACH).ok
    again = client.call(T.ATTACH, **cache.attach_fields())  # without the field: unchanged
    assert again.ok and again.result["weights_version"] == 7
    assert client.call(T.DETACH).ok
    for bad in (-1, 2**63, "7", 1.0):
        assert client.call(T.ATTACH, **cache.attach_fields(), weights_version=bad).code == E.BAD_FIELD, bad
    assert client.call(T.STATUS).result["device"]["state"] == "detached"
