"""Times pinning a large host cache on the cuda backend and how fast status answers meanwhile.

    python3 scripts/pin_probe.py --capacity 64GiB --out $OUT/pin_probe.json

Starts a daemon subprocess (backend cuda), measures the time to its first status reply
(from the spawn, and the daemon's own uptime then, which excludes Python and torch
start-up), then asks for status every 20 ms until the pool is pinned, recording each
reply's latency and the pinning progress, against the targets (the whole pool pinned in
``PIN_TARGET_S`` seconds, status p99 within ``STATUS_P99_MS``). Needs a GPU and host memory
above --capacity.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cachexferd.launch import DaemonProcess
from cachexferd.status import fetch_status

PIN_TARGET_S = 8.0  # 64 GiB
STATUS_P99_MS = 20.0


def probe(capacity: str, chunk: str, limit_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cx-pin-") as tmp:
        settings = {"daemon.backend": "cuda", "host_cache.capacity": capacity, "cuda.pin_chunk": chunk}
        settings["metrics.port"] = 0
        daemon = DaemonProcess(Path(tmp) / "rt", settings=settings)
        spawned = time.monotonic()
        first = daemon.start(timeout_s=60)
        first_s = time.monotonic() - spawned
        latencies, progress = [], []
        status = first
        deadline = time.monotonic() + limit_s
        try:
            while not status["host_cache"]["pinned"] and time.monotonic() < deadline:
                time.sleep(0.02)
                asked = time.monotonic()
                status = fetch_status(daemon.endpoint, timeout_s=5)
                latencies.append(time.monotonic() - asked)
                progress.append((round(asked - spawned, 2), status["host_cache"]["ready_bytes"]))
        finally:
            daemon.stop(timeout_s=60)
    pinning = status["backend"].get("pinning", [{}])[0]
    return {
        "capacity": capacity,
        "pin_chunk": chunk,
        "device": status["backend"].get("device_name"),
        "first_status_after_spawn_s": round(first_s, 3),
        "first_status_daemon_uptime_s": first["uptime_s"],
        "ready_bytes_at_first_status": first["host_cache"]["ready_bytes"],
        "status_latency_ms": {
            "n": len(latencies),
            "p50": round(statistics.median(latencies) * 1e3, 2) if latencies else None,
            "p99": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))] * 1e3, 2) if latencies else None,
            "max": round(max(latencies) * 1e3, 2) if latencies else None,
        },
        "targets": {"pin_s": PIN_TARGET_S, "status_p99_ms": STATUS_P99_MS},
        "pinned": status["host_cache"]["pinned"],
        "pinning": pinning,
        "progress": progress[:: max(1, len(progress) // 50)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="64GiB")
    parser.add_argument("--chunk", default="1GiB")
    parser.add_argument("--limit-s", type=float, default=300.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = probe(args.capacity, args.chunk, args.limit_s)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    slowest = result["status_latency_ms"]["max"]
    ok = result["pinned"] and (slowest is None or slowest < 1000)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
