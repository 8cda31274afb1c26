"""``cachexferd status``: fetch a daemon's status map and render it for people."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from .client.link import Link, check_ok
from .protocol import Status
from .security import CurveClientKeys
from .units import human_bytes


class NoDaemon(RuntimeError):
    """Nothing to ask: the daemon's ipc socket file does not exist."""


def fetch_status(endpoint: str, timeout_s: float = 5.0, curve: CurveClientKeys | None = None) -> dict[str, Any]:
    """The daemon's STATUS map. An ipc socket file that does not exist fails at once
    (NoDaemon): ZeroMQ would keep retrying the connect until the timeout."""
    if _missing_ipc_file(endpoint):
        raise NoDaemon(f"{endpoint[len('ipc://') :]} does not exist")
    ctx: zmq.Context[Any] = zmq.Context()
    link = Link(ctx, endpoint, curve=curve)
    try:
        return check_ok(link.call(Status(req_id=1), timeout_s))
    finally:
        link.close()
        ctx.term()


def _missing_ipc_file(endpoint: str) -> bool:
    return endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@") and not Path(endpoint[6:]).exists()


def no_status_hint(endpoint: str) -> str:
    """What to look at when a daemon did not answer (appended to the error line)."""
    if _missing_ipc_file(endpoint):
        return " (no socket there: is the daemon running? systemctl status 'cachexferd@*', or check --rank/--endpoint)"
    return " (the socket exists but nothing answered: the daemon may be starting, stuck or gone)"


def format_status(s: dict[str, Any]) -> str:
    host, device, cmds = s["host_cache"], s["device"], s["commands"]
    ready = host["ready_bytes"] / host["capacity_bytes"] if host["capacity_bytes"] else 0.0
    rows = [
        ("daemon", f"rank {s['rank']}  pid {s['pid']}  {s['state']}  up {s['uptime_s']:.0f}s  v{s['version']}"),
        ("boot id", s["boot_id"]),
        ("endpoint", s["endpoint"]),
        ("metrics", s.get("metrics_url") or "disabled"),
        ("backend", ", ".join(f"{k}={v}" for k, v in s["backend"].items())),
        (
            "host cache",
            f"{human_bytes(host['capacity_bytes'])}, {host['num_blocks']} blocks of {human_bytes(host['block_bytes'])}"
            f", ready {ready:.0%}{' (pinned)' if host['pinned'] else ''}",
        ),
        ("device cache", _device_line(device)),
        ("commands", f"{cmds['queued']} queued, {cmds['running']} running"),
        ("clients", str(s["clients"])),
    ]
    if "storage" in s:
        rows.append(("storage", _storage_line(s["storage"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _device_line(device: dict[str, Any]) -> str:
    if device["state"] != "attached":
        return str(device["state"])
    layout = device.get("layout", {})
    return (
        f"attached (runner pid {device.get('runner_pid')}): {layout.get('num_layers')} layers x "
        f"{layout.get('kv_tensors')} tensors, {layout.get('num_blocks')} blocks, {layout.get('dtype')}, "
        f"{device.get('mappings', 0)} mappings"
    )


def _storage_line(storage: dict[str, Any]) -> str:
    """Backend and state first; byte counts (file backend usage) in human units; a map (the
    journal's view) as ``name(key=value, ...)``."""
    return ", ".join(_storage_part(k, v) for k, v in storage.items())


def _storage_part(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return f"{key}({_storage_line(value)})"
    return f"{key}={human_bytes(value) if key.endswith('_bytes') and isinstance(value, int) else value}"
