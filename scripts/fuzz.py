#!/usr/bin/env python3
"""Random-frame fuzzer against a real daemon subprocess.

Sends ``--count`` inputs to the command socket of a cpu-backend daemon (file storage in a
temporary directory, a runner cache attached so copies really run): random bytes, random
frame counts, valid headers with random bodies, random msgpack maps with the protocol's keys,
valid commands of every type with mutated fields or flipped bytes, and BATCH envelopes of
those. Every input must get its outcome(s): one per message, or one per item of a BATCH
envelope the codec accepts (the protocol package is the oracle). At the end the daemon
must still answer and its log must hold no traceback.

    python scripts/fuzz.py                       # 100000 inputs
    python scripts/fuzz.py --count 5000 --seed 7

Prints inputs sent, outcomes expected and received, and whether the daemon is alive; exits
1 on any difference. Two kinds of input are not sent, because they would end the run
rather than test it: a SHUTDOWN the daemon would obey, and a HELLO naming another events
endpoint than the fuzzer's (events sent there would be lost, and with them outcomes).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from cachexferd.client import RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import (
    MAGIC,
    ErrorCode,
    Hello,
    KVLayout,
    Limits,
    MsgType,
    Ping,
    ProtocolError,
    Shutdown,
    batch_item,
    batch_items,
    command_from_body,
    decode_frames,
    decode_outcomes,
    encode_command,
)

LAYOUT = KVLayout(num_layers=2, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=32, dtype="float16")
CHUNK = 250  # inputs sent before waiting for their outcomes
WAIT_S = 60.0
KEYS = ["req_id", "boot_id", "protocol", "client", "role", "events", "pid", "batch_events", "layout", "device",
        "drain_timeout_s", "device_ids", "host_ids", "keys", "items", "kind", "name", "offsets"]  # fmt: skip


class Fuzzer:
    def __init__(self, endpoint: str, events: str, cache: ShmKVCache, rng: random.Random) -> None:
        self.rng, self.events, self.cache = rng, events, cache
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.dealer, self.pull = self.ctx.socket(zmq.DEALER), self.ctx.socket(zmq.PULL)
        for sock in (self.dealer, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.SNDHWM, 0)
        self.pull.bind(events)
        self.dealer.connect(endpoint)
        self.sent = self.expected = self.received = 0
        self.undecodable: list[str] = []  # outcomes a client could not read: each one a finding
        self.kinds: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[str] = collections.Counter()
        self.boot_id = ""
        self.templates = self._templates()

    # Inputs -------------------------------------------------------------------------------

    def _templates(self) -> list[tuple[MsgType, dict[str, Any]]]:
        handle = self.cache.device_handle()
        return [
            (MsgType.HELLO, {"protocol": [1, 1], "events": self.events, "client": "fuzz", "batch_events": True}),
            (MsgType.PING, {}), (MsgType.STATUS, {}), (MsgType.CLEAR_HOST, {}),
            (MsgType.ATTACH, {"layout": LAYOUT.to_wire(), "device": handle, "pid": os.getpid()}),
            (MsgType.DETACH, {"drain_timeout_s": 1.0}),
            (MsgType.SHUTDOWN, {"boot_id": "0" * 32}),
            (MsgType.SWAP_OUT, {"device_ids": [1, 2, 3], "host_ids": [4, 5, 6]}),
            (MsgType.SWAP_IN, {"device_ids": [7, 8], "host_ids": [4, 5]}),
            (MsgType.STORE, {"keys": ["a", "b"], "host_ids": [4, 5], "device_ids": [1, 2]}),
            (MsgType.LOAD, {"keys": ["a", "b"], "host_ids": [9, 10]}),
            (MsgType.LOOKUP, {"keys": ["a", "b", "c"]}), (MsgType.DELETE, {"keys": ["b"]}),
        ]  # fmt: skip

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        makers: list[Callable[[], Any]] = [
            lambda: None, lambda: True, lambda: r.randint(-5, 70), lambda: r.randint(-(2**63), 2**64 - 1),
            lambda: r.random() * 100, lambda: "", lambda: "".join(r.choices("ab k/.:@\x00é", k=r.randint(1, 12))),
            lambda: r.randbytes(r.randint(0, 8)), lambda: [r.randint(-1, 70) for _ in range(r.randint(0, 8))],
            lambda: ["a", "b", "c d", "x" * 300][: r.randint(0, 4)],
        ]  # fmt: skip
        if depth < 2:  # containers of containers, two levels at most
            makers.append(lambda: [self.value(depth + 1) for _ in range(r.randint(0, 5))])
            makers.append(lambda: {r.choice(KEYS): self.value(depth + 1) for _ in range(r.randint(0, 4))})
        return r.choice(makers)()

    def command(self) -> tuple[int, dict[str, Any]]:
        """A template command, usually with something wrong in it."""
        r = self.rng
        msg_type, fields = r.choice(self.templates)
        body = {"req_id": r.randint(1, 2000), **fields}
        if r.random() < 0.3:
            body["boot_id"] = r.choice([self.boot_id, "0" * 32, None])
        for _ in range(r.choice([0, 1, 1, 2])):
            key = r.choice([*body, *KEYS])
            if r.random() < 0.2:
                body.pop(key, None)
            else:
                body[key] = self.value()
        return (r.randrange(256) if r.random() < 0.03 else int(msg_type)), body

    def frames(self) -> tuple[str, list[bytes]]:
        """One input: (kind, frames)."""
        r = self.rng
        roll = r.random()
        if roll < 0.08:
            return "random bytes", [r.randbytes(r.randint(0, 40)) for _ in range(r.choice([1, 2, 2, 3]))]
        if roll < 0.16:
            return "header + random body", [self.header(r.randrange(256)), r.randbytes(r.randint(0, 60))]
        if roll < 0.26:
            body = {r.choice(KEYS): self.value() for _ in range(r.randint(0, 6))}
            return "random map", [self.header(r.randrange(256)), pack(body)]
        if roll < 0.36:
            msg_type, body = self.command()
            data = bytearray(pack(body))
            for _ in range(r.randint(1, 3)):
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            return "flipped bits", [self.header(msg_type), bytes(data)]
        if roll < 0.46:
            items: list[Any] = [list(self.command()) for _ in range(r.randint(1, 20))]
            if r.random() < 0.1:  # an item type that is no byte
                items.append([r.randint(-(2**63), 2**64 - 1), {"req_id": r.randint(1, 2000)}])
            if r.random() < 0.2:
                items.append(self.value())
            return "batch", [self.header(MsgType.BATCH), pack({"items": items})]
        if roll < 0.4603:
            return "oversized body", [self.header(MsgType.PING), r.randbytes(Limits.MAX_BODY_BYTES + 1)]
        msg_type, body = self.command()
        return "mutated command", [self.header(msg_type), pack(body)]

    def header(self, msg_type: int) -> bytes:
        major = 1 if self.rng.random() < 0.97 else self.rng.randrange(256)
        return MAGIC + bytes((major, msg_type))

    # The oracle ---------------------------------------------------------------------------

    def outcomes_of(self, frames: list[bytes]) -> int | None:
        """How many outcomes the daemon owes for ``frames``; None: an input not to send."""
        try:
            msg_type, body = decode_frames(frames)
            if msg_type != MsgType.BATCH:
                return 1 if self.harmless(lambda: command_from_body(msg_type, body)) else None
            items = batch_items(body)
        except ProtocolError:
            return 1
        if not all(self.harmless(functools.partial(batch_item, item)) for item in items):
            return None
        return len(items)

    def harmless(self, decode: Callable[[], Any]) -> bool:
        try:
            cmd = decode()
        except ProtocolError:
            return True
        if isinstance(cmd, Shutdown):
            return cmd.boot_id is not None and cmd.boot_id != self.boot_id
        if isinstance(cmd, Hello):
            return cmd.events in (None, self.events)
        return True

    # Running ------------------------------------------------------------------------------

    def hello(self) -> None:
        self.dealer.send_multipart(encode_command(Hello(req_id=1, protocol=[1, 1], events=self.events)))
        self.expected += 1
        self.sent += 1
        self.wait()

    def run(self, count: int) -> bool:
        while self.sent < count:
            for _ in range(min(CHUNK, count - self.sent)):
                kind, frames = self.frames()
                owed = self.outcomes_of(frames)
                if owed is None:
                    continue
                self.dealer.send_multipart(frames)
                self.sent, self.expected = self.sent + 1, self.expected + owed
                self.kinds[kind] += 1
            if not self.wait():
                return False
        return self.wait(quiet_s=0.5)

    def wait(self, quiet_s: float = 0.0) -> bool:
        """Reads outcomes until every one owed so far arrived (then ``quiet_s`` more)."""
        poller = zmq.Poller()
        poller.register(self.dealer, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        deadline = time.monotonic() + WAIT_S
        quiet_until = None
        while time.monotonic() < (quiet_until or deadline):
            for sock, _ in poller.poll(20):
                while sock.poll(0):
                    for outcome in self.decode(sock.recv_multipart()):
                        self.received += 1
                        self.boot_id = outcome.boot_id
                        self.codes[ErrorCode(outcome.code).name if outcome.code in ErrorCode._value2member_map_
                                   else str(outcome.code)] += 1  # fmt: skip
            if self.received > self.expected:
                return False
            if quiet_until is None and self.received == self.expected:
                if not quiet_s:
                    return True
                quiet_until = time.monotonic() + quiet_s
        return self.received == self.expected

    def decode(self, frames: list[bytes]) -> list[Any]:
        try:
            return decode_outcomes(frames)
        except ProtocolError as exc:
            self.received += 1
            self.undecodable.append(f"{exc.detail}: {frames!r:.300}")
            return []

    def alive(self) -> bool:
        self.dealer.send_multipart(encode_command(Ping(req_id=2**40)))
        self.expected += 1
        return self.wait()

    def close(self) -> None:
        self.ctx.destroy(0)


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="inputs to send (default 100000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock, printed)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    with tempfile.TemporaryDirectory(prefix="cx-fuzz-") as tmp:
        return fuzz(Path(tmp), args.count, seed)


def fuzz(tmp: Path, count: int, seed: int) -> int:
    settings = {"storage.file.path": str(tmp / "pool"), "metrics.port": 0, "host_cache.capacity": "16MiB",
                "daemon.drain_timeout_s": 2.0}  # fmt: skip
    daemon = DaemonProcess(tmp / "rt", settings=settings)
    daemon.start()
    started = time.monotonic()
    with ShmKVCache(LAYOUT) as cache, RunnerClient(daemon.endpoint, timeout_s=30) as runner:
        runner.attach(cache)
        fuzzer = Fuzzer(daemon.endpoint, f"ipc://{tmp / 'ev.sock'}", cache, random.Random(seed))
        try:
            fuzzer.hello()
            complete = fuzzer.run(count)
            alive = fuzzer.alive() and daemon.proc is not None and daemon.proc.poll() is None
        finally:
            fuzzer.close()
    exit_code = daemon.stop()
    tracebacks = daemon.log_path.read_text(errors="replace").count("Traceback")
    report(fuzzer, seed, time.monotonic() - started, complete, alive, exit_code, tracebacks)
    ok = complete and alive and exit_code == 0 and tracebacks == 0 and not fuzzer.undecodable
    if not ok:
        print(f"the daemon log ends (the same inputs again: --seed {seed}):\n{daemon.log_tail(40)}")
    return 0 if ok else 1


def report(fuzzer: Fuzzer, seed: int, elapsed: float, complete: bool, alive: bool, code: int, tracebacks: int) -> None:
    print(f"seed {seed}: {fuzzer.sent} inputs sent in {elapsed:.1f}s")
    print("  " + ", ".join(f"{kind} {n}" for kind, n in fuzzer.kinds.most_common()))
    print(f"outcomes expected {fuzzer.expected}, received {fuzzer.received}: {'ok' if complete else 'DIFFERENT'}")
    print("  " + ", ".join(f"{name} {n}" for name, n in fuzzer.codes.most_common()))
    print(f"daemon alive: {'yes' if alive else 'NO'}; exit status {code}; tracebacks in its log: {tracebacks}")
    for problem in fuzzer.undecodable[:5]:
        print(f"UNDECODABLE OUTCOME ({len(fuzzer.undecodable)} in all): {problem}")


if __name__ == "__main__":
    sys.exit(main())
