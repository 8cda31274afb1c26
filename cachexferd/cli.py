"""The ``cachexferd`` command: serve | status | demo | bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from .config import ConfigError, describe, load_config

_SERVE_FLAGS = {
    "rank": "daemon.rank",
    "backend": "daemon.backend",
    "endpoint": "daemon.endpoint",
    "runtime_dir": "daemon.runtime_dir",
    "capacity": "host_cache.capacity",
    "metrics_port": "metrics.port",
    "storage": "storage.backend",
    "storage_path": "storage.path",
}


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run one daemon (one per GPU)")
    p.add_argument("--config", default=os.environ.get("CACHEXFERD_CONFIG"), help="TOML file (env CACHEXFERD_CONFIG)")
    p.add_argument("--rank", help="daemon.rank: TP rank / GPU index")
    p.add_argument("--backend", help="daemon.backend: cpu, cuda or auto")
    p.add_argument("--endpoint", help="daemon.endpoint: ipc://PATH or tcp://127.0.0.1:PORT")
    p.add_argument("--runtime-dir", help="daemon.runtime_dir")
    p.add_argument("--capacity", help="host_cache.capacity, e.g. 64GiB")
    p.add_argument("--metrics-port", help="metrics.port (the daemon adds its rank; 0: any free port)")
    p.add_argument("--storage", help="storage.backend: none, file, mooncake, redis")
    p.add_argument("--storage-path", help="storage.path for the file backend")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="any setting; repeatable")
    p.add_argument("--check-config", action="store_true", help="print the effective config and exit")
    p.add_argument("--list-settings", action="store_true", help="list every setting with its default and exit")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, flag) for flag, key in _SERVE_FLAGS.items() if getattr(args, flag) is not None}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like table.key=value")
        out[key.strip()] = value.strip()
    return out


def _setup_logging(level: str, rank: int) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s cachexferd[{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    if args.list_settings:
        for key, default, doc in describe():
            print(f"{key:28} {default!r:24} {doc}")
        return 0
    try:
        config = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"cachexferd: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
        return 0
    _setup_logging(config.daemon.log_level, config.daemon.rank)
    from .daemon.server import Daemon, DaemonError

    log = logging.getLogger("cachexferd")
    log.info("effective config: %s", json.dumps(config.to_dict(), sort_keys=True))

    async def main() -> None:
        daemon = Daemon(config)
        daemon.install_signal_handlers()
        await daemon.run()

    import uvloop

    try:
        uvloop.run(main())
    except DaemonError as exc:
        log.error("%s", exc)
        return 1
    return 0


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", help="show a running daemon's state")
    p.add_argument("--endpoint", help="daemon command endpoint (default: from --rank / config)")
    p.add_argument("--rank", default=None, help="daemon.rank, to find the default endpoint")
    p.add_argument("--config", default=os.environ.get("CACHEXFERD_CONFIG"))
    p.add_argument("--json", action="store_true", help="print the raw status map")
    p.add_argument("--server-key", help="CURVE: the daemon's public key file (tcp with CURVE)")
    p.add_argument("--client-key", help="CURVE: this client's secret key file")
    p.add_argument("--timeout", type=float, default=5.0)


def cmd_status(args: argparse.Namespace) -> int:
    from .security import client_keys_or_none
    from .status import fetch_status, format_status

    endpoint = args.endpoint
    if endpoint is None:
        try:
            overrides = {"daemon.rank": args.rank} if args.rank is not None else {}
            endpoint = load_config(args.config, overrides).endpoint
        except ConfigError as exc:
            print(f"cachexferd: invalid configuration: {exc}", file=sys.stderr)
            return 2
    try:
        status = fetch_status(endpoint, args.timeout, client_keys_or_none(args.server_key, args.client_key))
    except Exception as exc:
        print(f"cachexferd: no status from {endpoint}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else format_status(status))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachexferd", description="Per-GPU KV-cache transfer daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_status(sub)
    from .bench.cli import add_bench
    from .demo import add_demo
    from .keys_cli import add_keys

    add_demo(sub)
    add_bench(sub)
    add_keys(sub)
    args = parser.parse_args(argv)
    handler = {"serve": cmd_serve, "status": cmd_status}.get(args.command) or args.func
    result: int = handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
