#!/usr/bin/env python3
"""Soak: a daemon under a bounded, random mix of everything, with every byte checked.

One daemon (cpu backend, file storage) and a runner process with known data. Each round
pipelines random swaps, stores and loads, and between or inside rounds injects: pause and
resume, weight-version changes, detach / re-attach, and the runner killed with SIGKILL (a
new runner with new data takes its place; the host tier must survive it). A model of what
every device block, host block and stored key must hold follows along; after each clean
round the runner's blocks are compared with it byte for byte.

Prints outcomes expected vs received, unexpected failures and corrupted blocks; exits 0
only when every command had exactly one outcome and nothing was corrupted.

    scripts/soak.py --duration 60
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cachexferd.client import EngineClient, RunnerClient
from cachexferd.demo_runner import known_data
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout

LAYOUT = KVLayout(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32, dtype="float16")
HOST_BLOCKS = 96
Content = tuple[int, int] | None  # (runner seed, original block), or unknown


@dataclass
class Tally:
    submitted: int = 0
    received: int = 0
    unexpected: list[str] = field(default_factory=list)
    corrupted: int = 0
    verified: int = 0
    events: dict[str, int] = field(default_factory=dict)

    def note(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1


class Runner:
    """A runner process (cachexferd.demo_runner) holding known data for ``seed``."""

    def __init__(self, endpoint: str, seed: int) -> None:
        self.seed = seed
        argv = [sys.executable, "-m", "cachexferd.demo_runner", endpoint, json.dumps(LAYOUT.to_wire()), str(seed)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().split()
        if not line or line[0] != "attached":
            raise RuntimeError("runner did not attach")
        self.name = line[1]

    def blocks(self) -> list[torch.Tensor]:
        size = LAYOUT.num_tensors * LAYOUT.tensor_bytes
        storage = torch.UntypedStorage.from_file(f"/dev/shm/{self.name}", shared=True, nbytes=size)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        n = LAYOUT.tensor_bytes
        return [flat[t * n : (t + 1) * n].view(LAYOUT.num_blocks, -1).clone() for t in range(LAYOUT.num_tensors)]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(20)


class Soak:
    def __init__(self, workdir: Path, rng: random.Random) -> None:
        settings = {"metrics.port": 0, "host_cache.capacity": "8MiB", "daemon.drain_timeout_s": 2.0,
                    "storage.backend": "file", "storage.file.path": str(workdir / "store")}  # fmt: skip
        self.daemon = DaemonProcess(workdir / "daemon", settings=settings)
        self.daemon.start()
        self.rng, self.tally = rng, Tally()
        self.engine = EngineClient([self.daemon.endpoint], timeout_s=60)
        self.engine.connect()
        self.tool = RunnerClient(self.daemon.endpoint, name="soak-control", timeout_s=30)
        self.seed = 1
        self.runner = Runner(self.daemon.endpoint, self.seed)
        self.device: list[Content] = [(self.seed, b) for b in range(LAYOUT.num_blocks)]
        self.host: list[Content] = [None] * HOST_BLOCKS
        self.keys: dict[str, Content] = {}

    # One round of random pipelined work -----------------------------------------------

    def round(self, commands: int, kill_at: int | None) -> None:
        req_ids: list[int] = []
        for i in range(commands):
            if i == kill_at:
                self._kill_runner()
            req_ids.append(self._random_command())
        self.tally.submitted += len(req_ids)
        done = self.engine.wait(req_ids, timeout_s=120)
        self.tally.received += sum(1 for r in req_ids if r in done and done[r].outcomes)
        clean = kill_at is None
        if not clean:  # commands after the kill may or may not have run: forget what they wrote
            self._forget_host()
        for r in req_ids:
            if not done[r].ok and clean:
                self.tally.unexpected.append(done[r].describe())
        if clean:
            self._verify()

    def _random_command(self) -> int:
        n = self.rng.randint(1, 4)
        dev = self.rng.sample(range(LAYOUT.num_blocks), n)
        host = self.rng.sample(range(HOST_BLOCKS), n)
        kind = self.rng.random()
        if kind < 0.4:
            for d, h in zip(dev, host):
                self.host[h] = self.device[d]
            return self.engine.swap_out(dev, host)
        if kind < 0.75:
            pairs = [(d, h) for d, h in zip(dev, host) if self.host[h] is not None]
            for d, h in pairs:
                self.device[d] = self.host[h]
            return self.engine.swap_in([d for d, _ in pairs], [h for _, h in pairs])
        if kind < 0.9:
            stored = [h for h in host if self.host[h] is not None]
            keys = [f"soak-{self.rng.randrange(1 << 30)}" for _ in stored]
            for k, h in zip(keys, stored):
                self.keys[k] = self.host[h]
            return self.engine.store(keys, stored)
        keys = self.rng.sample(sorted(self.keys), min(n, len(self.keys))) if self.keys else []
        for k, h in zip(keys, host):
            self.host[h] = self.keys[k]
        return self.engine.load(keys, host[: len(keys)])

    # Injected events --------------------------------------------------------------------

    def _kill_runner(self) -> None:
        self.runner.kill()
        self.tally.note("runner killed")

    def _forget_host(self) -> None:
        self.host = [None] * HOST_BLOCKS
        self.keys = {}

    def between_rounds(self, killed: bool) -> None:
        if killed:
            self._replace_runner()
            return
        event = self.rng.choice(["pause", "weights", "reattach", "nothing"])
        self.tally.note(event)
        if event == "pause":
            self.tool.pause()
            self.tool.resume()
        elif event == "weights":
            self.tool.set_weights(self.rng.randrange(1, 1 << 20))
            self._forget_host()  # old KV is never served again (STALE_WEIGHTS); storage names moved on
        elif event == "reattach":
            self.runner.stop()  # detaches, unlinks its segment
            self._replace_runner()

    def _replace_runner(self) -> None:
        self.seed += 1
        self.runner = Runner(self.daemon.endpoint, self.seed)
        self.device = [(self.seed, b) for b in range(LAYOUT.num_blocks)]

    def _verify(self) -> None:
        actual = self.runner.blocks()
        expected = {}
        for b, content in enumerate(self.device):
            if content is None:
                continue
            seed, orig = content
            for t in range(LAYOUT.num_tensors):
                key = (seed, t)
                if key not in expected:
                    expected[key] = known_data(LAYOUT, seed, t)
                if not torch.equal(actual[t][b], expected[key][orig]):
                    self.tally.corrupted += 1
                    break
            self.tally.verified += 1

    def close(self) -> None:
        self.runner.stop()
        self.tool.close()
        self.engine.close()
        self.daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run (bounded)")
    parser.add_argument("--rounds", type=int, default=1000, help="at most this many rounds")
    parser.add_argument("--commands", type=int, default=200, help="commands per round")
    parser.add_argument("--kill-rate", type=float, default=0.2, help="share of rounds in which the runner is killed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="cachexferd-soak-") as tmp:
        soak = Soak(Path(tmp), rng)
        deadline, rounds = time.monotonic() + args.duration, 0
        try:
            while rounds < args.rounds and time.monotonic() < deadline:
                kill_at = rng.randrange(args.commands) if rng.random() < args.kill_rate else None
                soak.round(args.commands, kill_at)
                soak.between_rounds(killed=kill_at is not None)
                rounds += 1
        finally:
            soak.close()
    return report(soak.tally, rounds)


def report(tally: Tally, rounds: int) -> int:
    print(f"soak: {rounds} rounds; events {json.dumps(tally.events, sort_keys=True)}")
    print(f"  outcomes   expected {tally.submitted}, received {tally.received}")
    first = f" (first: {tally.unexpected[0]})" if tally.unexpected else ""
    print(f"  failures   unexpected {len(tally.unexpected)}{first}")
    print(f"  blocks     verified {tally.verified}, corrupted {tally.corrupted}")
    ok = tally.submitted == tally.received and not tally.unexpected and tally.corrupted == 0
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
