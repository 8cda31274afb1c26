"""Storage-test rig: a daemon (in-process or subprocess) with an attached runner cache and a
connected engine client, plus helpers to run storage commands and read storage metrics."""

from __future__ import annotations

import struct
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.client.pending import Completion
from cachexferd.daemon.storage_feed import StorageFeed
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout
from cachexferd.storage.keys import KeySpace

from .helpers import SMALL, InProcessDaemon, assert_moved, assert_untouched, config_for, fill_random, snapshot

WAIT_S = 30.0


def seen_within(feed: StorageFeed, oid: bytes, timeout_s: float) -> float:
    """Seconds until the storage feed holds ``oid`` (fails past ``timeout_s``)."""
    started = time.monotonic()
    while not feed.holds(oid):
        assert time.monotonic() - started < timeout_s, "the follower did not read the append"
        time.sleep(0.005)
    return time.monotonic() - started


class Node:
    """One daemon + one runner cache (random bytes from ``seed``) + one engine client."""

    def __init__(self, endpoint: str, layout: KVLayout, seed: int, stop: Callable[[], None]) -> None:
        self.endpoint, self._stop = endpoint, stop
        self.cache = ShmKVCache(layout)
        fill_random(self.cache, seed)
        self.before = snapshot(self.cache)
        self.runner = RunnerClient(endpoint)
        self.runner.attach(self.cache)
        self.engine = EngineClient([endpoint], timeout_s=WAIT_S)
        self.engine.connect()

    @classmethod
    def in_process(cls, runtime: Path, seed: int = 0, layout: KVLayout = SMALL, **settings: Any) -> Node:
        daemon = InProcessDaemon(config_for(runtime, **settings)).start()
        node = cls(daemon.endpoint, layout, seed, daemon.stop)
        node.inproc = daemon
        return node

    @classmethod
    def subprocess(cls, daemon: DaemonProcess, seed: int = 0, layout: KVLayout = SMALL) -> Node:
        return cls(daemon.endpoint, layout, seed, daemon.stop)

    inproc: InProcessDaemon | None = None

    # Commands ---------------------------------------------------------------------------

    def run(self, op: str, *args: Any, timeout_s: float = WAIT_S, **kwargs: Any) -> Completion:
        req = getattr(self.engine, op)(*args, **kwargs)
        return self.engine.wait([req], timeout_s)[req]

    def ok(self, op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        done = self.run(op, *args, **kwargs)
        assert done.ok, done.describe()
        return done.result()

    def error(self, op: str, *args: Any, **kwargs: Any) -> tuple[str, str]:
        """(error name, detail) of a command that must fail on rank 0."""
        done = self.run(op, *args, **kwargs)
        assert not done.ok, f"{op} unexpectedly succeeded: {done.result()}"
        return done.errors[0]

    # Introspection ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.engine.status()[0]

    def metric(self, name: str, **labels: str) -> float:
        """A sample from the daemon's /metrics endpoint (0.0 when absent)."""
        url = self.status()["metrics_url"]
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    def close(self) -> None:
        self.engine.close()
        try:
            self.runner.detach()
        finally:
            self.runner.close()
            self.cache.close()
            self._stop()


def store_and_load_back(node: Node, keys: list[str]) -> None:
    """Stores 4 device blocks under ``keys``, finds them, loads them into other device
    blocks: exact bytes there, every other block unchanged."""
    src, dst = [1, 2, 3, 4], [40, 41, 42, 43]
    assert node.ok("store", keys, host_ids=[0, 1, 2, 3], device_ids=src)["stored"] == 4
    assert node.ok("lookup", keys)["prefix"] == 4
    assert node.ok("load", keys, host_ids=[10, 11, 12, 13], device_ids=dst)["loaded"] == 4
    assert_moved(node.cache, dst, node.before, src)
    assert_untouched(node.cache, node.before, dst)


def key_space(model: str = "test-model", weights: str = "w1", tp_size: int = 1) -> KeySpace:
    return KeySpace.for_layout(model, SMALL, weights_version=weights, tp_size=tp_size)


def prompt(n_tokens: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_tokens))


def swap_sectors(payload: bytearray) -> bytearray:
    """Two 512-byte sectors of one 4 KiB page exchanged (a misdirected write)."""
    damaged = bytearray(payload)
    damaged[0:512], damaged[512:1024] = payload[512:1024], payload[0:512]
    assert damaged != payload
    return damaged


def cancel_flips(payload: bytearray) -> bytearray:
    """One bit set in one u64 word and the same bit cleared in another word of the same page:
    every page's word sum stays the same."""
    damaged = bytearray(payload)
    words = struct.unpack_from("<64Q", payload)
    bit = next(b for b in range(64) if any(w >> b & 1 for w in words) and any(not w >> b & 1 for w in words))
    one = next(i for i, w in enumerate(words) if w >> bit & 1)
    zero = next(i for i, w in enumerate(words) if not w >> bit & 1)
    struct.pack_into("<Q", damaged, one * 8, words[one] & ~(1 << bit))
    struct.pack_into("<Q", damaged, zero * 8, words[zero] | (1 << bit))
    assert damaged != payload
    return damaged
