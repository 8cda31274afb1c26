"""Prometheus metrics of one daemon, on a registry of its own (several daemons can share a
process in tests without clashing). Names follow the Prometheus conventions: base units,
``_total`` on counters, ``_bytes`` / ``_seconds`` suffixes. docs/operations.md lists them."""

from __future__ import annotations

import json
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, disable_created_metrics, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from . import __version__
from .protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR

# No `*_created` series: a start timestamp per counter and histogram child doubles the series
# count for nothing (process_start_time_seconds and the boot id say when a daemon started).
disable_created_metrics()

# An HTTP probe: (passes, JSON body), answered with 200 or 503. Called on the server's thread.
Probe = Callable[[], tuple[bool, dict[str, Any]]]
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class DaemonMetrics:
    def __init__(self, rank: int, backend: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        self.build = Info("cachexferd_build", "Build and protocol of this daemon", registry=r)
        self.build.info(
            {
                "version": __version__,
                "protocol": f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}",
                "backend": backend,
                "rank": str(rank),
            }
        )
        self.commands = CommandStats(r)
        self.batches = BatchStats(r)
        self.transfer_bytes = Counter(
            "cachexferd_transfer_bytes_total",
            "Bytes moved, by direction (d2h, h2d, store, load)",
            ["direction"],
            registry=r,
        )
        self.queued = Gauge("cachexferd_queue_depth", "Accepted commands waiting for earlier ones", registry=r)
        self.running = Gauge("cachexferd_inflight_commands", "Commands executing now", registry=r)
        self.host_capacity = Gauge("cachexferd_host_cache_capacity_bytes", "Host cache size", registry=r)
        self.host_ready = Gauge(
            "cachexferd_host_cache_ready_bytes", "Host cache bytes usable now (pinned, for cuda)", registry=r
        )
        self.host_blocks = Gauge(
            "cachexferd_host_cache_blocks", "Host cache blocks (0 until geometry is known)", registry=r
        )
        self.attached = Gauge("cachexferd_attached_device_caches", "Device caches attached (0 or 1)", registry=r)
        self.mappings = Gauge("cachexferd_imported_mappings", "Device memory mappings imported now", registry=r)
        self.clients = Gauge("cachexferd_clients", "Clients that said hello", registry=r)
        self.events_dropped = Counter(
            "cachexferd_events_dropped_total", "Outcomes that could not be delivered to a client", registry=r
        )
        self.auto_detaches = Counter(
            "cachexferd_auto_detaches_total", "Detaches because the attached runner exited", registry=r
        )
        self.storage_ops = Counter(
            "cachexferd_storage_operations_total",
            "Storage backend calls by operation and result",
            ["op", "result"],
            registry=r,
        )
        self.storage_errors = Counter(
            "cachexferd_storage_errors_total",
            "Storage problems by kind (corrupt, mismatch, unavailable, timeout)",
            ["kind"],
            registry=r,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def serve(self, host: str, port: int, probes: Mapping[str, Probe] | None = None) -> int:
        """Starts the HTTP endpoint: ``/metrics`` (and any other path), plus the ``probes`` by
        path; returns the bound port (useful with port 0)."""
        app = _with_probes(make_wsgi_app(self.registry), dict(probes or {}))
        server_class = type("Server", (_ThreadingServer,), {"address_family": _family(host, port)})
        self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        """Stops serving without waiting: socketserver's shutdown() blocks up to its 0.5 s
        poll interval, which would stall every daemon stop."""
        server, self._server = self._server, None
        if server is not None:

            def close() -> None:
                server.shutdown()
                server.server_close()

            threading.Thread(target=close, name="metrics-stop", daemon=True).start()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape or probe in progress never holds up the daemon's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # every scrape and probe would be a line on stderr


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (``::``, ``::1``), else IPv4."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


def _with_probes(metrics: Callable[..., Iterable[bytes]], probes: dict[str, Probe]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: the probes at their paths (JSON, 200 or 503, never cached), metrics elsewhere."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics(environ, start_response)
        passes, body = probe()
        data = (json.dumps(body, sort_keys=True) + "\n").encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        start_response("200 OK" if passes else "503 Service Unavailable", [*headers, ("Cache-Control", "no-store")])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    return app


class BatchStats:
    """How commands arrive: in BATCH envelopes, and how many of a BATCH's swaps were checked
    and copied together as a group. Plain integers the loop thread adds to (a Counter's
    lock per envelope is not needed: the scrape only reads them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.envelopes = 0
        self.commands = 0
        self.grouped_swaps = 0
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield from self.collect()

    def collect(self) -> Iterator[Metric]:
        for name, text, value in (
            ("cachexferd_batches", "BATCH envelopes received", self.envelopes),
            ("cachexferd_batched_commands", "Commands that arrived in BATCH envelopes", self.commands),
            ("cachexferd_grouped_swaps", "Swaps of a BATCH checked and copied together as a group", self.grouped_swaps),
        ):
            yield CounterMetricFamily(name, text, value=value)


class CommandStats:
    """``cachexferd_commands_total`` (by op and outcome) and ``cachexferd_command_duration_seconds``
    (by op), kept here and updated once per flush of outcomes with everything decided since
    the last one: prometheus_client's Counter and Histogram take a lock and search the buckets
    in Python on every call, which cost more than the rest of a batched command's outcome.

    The daemon's loop thread records; the metrics server's thread collects. One lock makes
    each scrape see whole flushes (a histogram's count always equals its +Inf bucket)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}  # (op, outcome) -> commands
        self._buckets: dict[str, list[int]] = {}  # op -> commands per bucket (not cumulative), +Inf last
        self._sums: dict[str, float] = {}  # op -> seconds
        registry.register(self)

    def record(self, op: str, outcome: str, latencies: list[float]) -> None:
        """Adds commands of one op and outcome, with their receipt-to-outcome seconds."""
        self.record_counted(op, outcome, [(seconds, 1) for seconds in latencies])

    def record_counted(self, op: str, outcome: str, latencies: list[tuple[float, int]]) -> None:
        """``record`` for (seconds, commands) pairs: the commands of one message arrived
        together and are often decided together, so they share one latency."""
        with self._lock:
            key = (op, outcome)
            self._counts[key] = self._counts.get(key, 0) + sum([n for _, n in latencies])
            if not latencies:
                return
            buckets = self._buckets.get(op)
            if buckets is None:
                buckets = self._buckets[op] = [0] * (len(_LATENCY_BUCKETS) + 1)
            for seconds, n in latencies:
                buckets[bisect_left(_LATENCY_BUCKETS, seconds)] += n  # le: a bound is its own bucket
            self._sums[op] = self._sums.get(op, 0.0) + sum([seconds * n for seconds, n in latencies])

    def count(self, op: str, outcome: str) -> int:
        with self._lock:
            return self._counts.get((op, outcome), 0)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self._counts)
            buckets = {op: list(b) for op, b in self._buckets.items()}
            sums = dict(self._sums)
        yield from self._families(counts, buckets, sums)

    @staticmethod
    def _families(
        counts: dict[tuple[str, str], int] | None = None,
        buckets: dict[str, list[int]] | None = None,
        sums: dict[str, float] | None = None,
    ) -> Iterator[Metric]:
        total = CounterMetricFamily("cachexferd_commands", "Commands by type and outcome", labels=["op", "outcome"])
        for (op, outcome), n in sorted((counts or {}).items()):
            total.add_metric([op, outcome], n)
        yield total
        latency = HistogramMetricFamily(
            "cachexferd_command_duration_seconds", "Time from receipt to outcome, by command type", labels=["op"]
        )
        bounds = [*(floatToGoString(b) for b in _LATENCY_BUCKETS), "+Inf"]
        for op, per_bucket in sorted((buckets or {}).items()):
            cumulative, running = [], 0
            for bound, n in zip(bounds, per_bucket):
                running += n
                cumulative.append((bound, running))
            latency.add_metric([op], cumulative, (sums or {})[op])
        yield latency
