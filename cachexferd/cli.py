"""The ``cachexferd`` command: serve | status | demo | bench.

Exit statuses of ``serve`` (docs/operations.md): 0 stopped cleanly, 1 failed (a bug or a
crash: the log says what), 2 refused to start because of the configuration or this machine
(one line on stderr per problem names the setting and the fix; the systemd unit does not restart on 2),
130 a second SIGINT cut the drain short.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from . import __version__
from .config import Config, ConfigError, describe, load_config
from .preflight import EXIT_CONFIG, port_error

if TYPE_CHECKING:
    from .daemon.server import Daemon

EXIT_FAILURE = 1
_SERVE_FLAGS = {
    "rank": "daemon.rank",
    "backend": "daemon.backend",
    "endpoint": "daemon.endpoint",
    "runtime_dir": "daemon.runtime_dir",
    "capacity": "host_cache.capacity",
    "metrics_port": "metrics.port",
    "storage": "storage.backend",
    "storage_path": "storage.file.path",
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
    p.add_argument("--storage-path", help="storage.file.path: the file backend's directory")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="any setting; repeatable")
    p.add_argument(
        "--check-config", action="store_true", help="check the config against this machine, print it and exit"
    )
    p.add_argument("--list-settings", action="store_true", help="list every setting with its default and exit")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, flag) for flag, key in _SERVE_FLAGS.items() if getattr(args, flag) is not None}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like table.key=value")
        out[key.strip()] = value.strip()
    return out


# Logging -----------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line (daemon.log_format = "json"), for log shippers."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "rank": self.rank,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(config: Config) -> None:
    rank = config.daemon.rank
    handler = logging.StreamHandler(sys.stderr)
    if config.daemon.log_format == "json":
        handler.setFormatter(JsonFormatter(rank))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s cachexferd[{rank}] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, config.daemon.log_level.upper()), handlers=[handler])


def _refuse(message: str | list[str], config: Config | None = None, code: int = EXIT_CONFIG) -> int:
    """A start-up refusal: one line on stderr per problem (one JSON object per line in the
    JSON log format)."""
    for problem in [message] if isinstance(message, str) else message:
        if config is not None and config.daemon.log_format == "json":
            line = json.dumps({"level": "error", "rank": config.daemon.rank, "msg": problem, "exit": code})
        else:
            line = f"cachexferd: {problem}"
        print(line, file=sys.stderr, flush=True)
    return code


# serve -------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from . import preflight

    if args.list_settings:
        for key, default, doc in describe():
            print(f"{key:28} {default!r:24} {doc}")
        return 0
    try:
        config = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        return _refuse([f"invalid configuration: {problem}" for problem in exc.problems])
    try:
        warnings = preflight.check(config, running_ok=args.check_config)
    except ConfigError as exc:
        return _refuse(exc.problems, config)
    warnings = [*config.warnings, *warnings]
    effective = {**config.to_dict(), "resolved": config.resolved()}
    if args.check_config:
        print(json.dumps(effective, indent=2, sort_keys=True))
        for warning in warnings:
            print(f"cachexferd: warning: {warning}", file=sys.stderr)
        return 0
    _setup_logging(config)
    log = logging.getLogger("cachexferd")
    for warning in warnings:
        log.warning("%s", warning)
    log.info("effective config: %s", json.dumps(effective, sort_keys=True))
    return _run_daemon(config, log)


def _run_daemon(config: Config, log: logging.Logger) -> int:
    """Runs the daemon until it stops. A start that fails undoes itself (Daemon.start owns
    that clean-up); here it only becomes the exit status and the one line."""
    from .priority import raise_priority

    log.info("%s", raise_priority(config.daemon.nice))  # before the imports and threads below: they inherit it
    import uvloop

    from .daemon.server import Daemon

    made: list[Daemon] = []

    async def main() -> None:
        daemon = Daemon(config)
        made.append(daemon)
        daemon.install_signal_handlers()
        await daemon.run()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:  # SIGINT before the daemon's own handler was installed
        return 130
    except Exception as exc:
        if made and made[0].state != "starting":
            log.exception("daemon failed")
            return EXIT_FAILURE
        code, message = start_failure(config, exc)
        log.debug("start-up failure", exc_info=True)
        return _refuse(message, config, code)
    return 0


def start_failure(config: Config, exc: Exception) -> tuple[int, str]:
    """Exit status and one line for an exception the daemon raised while starting.

    preflight catches these cases up front; this covers what changed in between (another
    process took the port) and what only the daemon finds out (the mmap itself failing)."""
    from .daemon.server import DaemonError
    from .units import human_bytes

    if isinstance(exc, DaemonError):  # runtime dir, lock, endpoint, storage settings
        return EXIT_CONFIG, str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
        return EXIT_CONFIG, port_error(config, "metrics.port", config.metrics.host, config.metrics_port, exc)
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        capacity = human_bytes(config.host_cache.capacity)
        return EXIT_CONFIG, (
            f"host_cache.capacity (from {config.source('host_cache.capacity')}): cannot allocate {capacity} "
            "(out of memory); lower host_cache.capacity"
        )
    if isinstance(exc, RuntimeError) and str(exc).startswith("cuda backend:"):
        return EXIT_CONFIG, f"daemon.backend (from {config.source('daemon.backend')}): {exc}"
    detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return EXIT_FAILURE, f"failed to start: {detail} (daemon.log_level = debug logs the traceback)"


# status ------------------------------------------------------------------------------------


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
    from .status import fetch_status, format_status, no_status_hint

    endpoint = args.endpoint
    if endpoint is None:
        try:
            overrides = {"daemon.rank": args.rank} if args.rank is not None else {}
            endpoint = load_config(args.config, overrides).endpoint
        except ConfigError as exc:
            return _refuse(f"invalid configuration: {exc}")
    try:
        status = fetch_status(endpoint, args.timeout, client_keys_or_none(args.server_key, args.client_key))
    except Exception as exc:
        print(f"cachexferd: no status from {endpoint}: {exc}{no_status_hint(endpoint)}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else format_status(status))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command and its options (the docs' examples are checked against it)."""
    from .bench.cli import add_bench
    from .demo import add_demo
    from .keys_cli import add_keys
    from .protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR

    parser = argparse.ArgumentParser(prog="cachexferd", description="Per-GPU KV-cache transfer daemon")
    parser.add_argument(
        "--version", action="version", version=f"cachexferd {__version__} (protocol {PROTOCOL_MAJOR}.{PROTOCOL_MINOR})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_status(sub)
    add_demo(sub)
    add_bench(sub)
    add_keys(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"serve": cmd_serve, "status": cmd_status}.get(args.command) or args.func
    result: int = handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
