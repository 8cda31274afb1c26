"""Daemon configuration: one frozen dataclass per TOML table.

Precedence, lowest to highest: built-in defaults, the TOML file, ``CACHEXFERD_<TABLE>_<KEY>``
environment variables, command-line overrides (``--set table.key=value`` and the named
flags of ``cachexferd serve``). Every value is validated before anything binds; a bad
value is a ConfigError that names the key and where it came from.

Each storage backend has a table of its own, ``[storage.<backend>]``, declared with the
backend in its registry (cachexferd.storage); ``[storage]`` keeps what every backend uses.
The flat names of earlier releases (``storage.path``, ``storage.url``, ...) still read,
each with one warning naming the new key (``Config.warnings``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .backends import BACKEND_CHOICES
from .setting import meta as _meta
from .storage import BACKENDS as STORAGE_CHOICES
from .storage import STORAGE_BACKENDS, FileSettings, MooncakeSettings, RedisSettings

ENV_PREFIX = "CACHEXFERD_"
# Outside 9100-9999, which Prometheus exporters have taken (node_exporter 9100, NVIDIA
# dcgm-exporter 9400, ...), below the kernel's ephemeral ports, and clear of torch.distributed
# (29400, 29500): rank r listens on 18700 + r.
DEFAULT_METRICS_PORT = 18700
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """Invalid configuration: one or more problems, each naming the key, where its value came
    from, and why (``problems``; the message has one per line)."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as '64GiB', '512 MiB', '1.5GB'."""
    if type(value) is int:
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    raise ValueError(f"{value!r} is not a size (use bytes or a unit: KiB MiB GiB TiB KB MB GB TB)")


@dataclass(frozen=True)
class DaemonConfig:
    rank: int = field(default=0, metadata=_meta("TP rank / GPU index this daemon serves; events carry it", lo=0))
    backend: str = field(default="auto", metadata=_meta("copy backend: cpu, cuda, or auto", choices=BACKEND_CHOICES))
    runtime_dir: str = field(
        default="", metadata=_meta("directory for ipc sockets (0700, 0750 with access.group); see docs/operations.md")
    )
    endpoint: str = field(
        default="",
        metadata=_meta("command socket; empty: ipc://<runtime_dir>/cmd.sock; tcp off loopback needs [access] CURVE"),
    )
    drain_timeout_s: float = field(
        default=10.0, metadata=_meta("shutdown/detach drain limit before failing the rest", lo=0.0)
    )
    max_inflight: int = field(
        default=4096, metadata=_meta("accepted commands without an outcome yet, beyond it BUSY", lo=1)
    )
    watch_runner_pid: bool = field(default=True, metadata=_meta("detach automatically when the attached runner exits"))
    expect_runner: bool = field(
        default=False, metadata=_meta("readiness (/readyz) also needs an attached runner: set for a sidecar of one")
    )
    loop_stall_s: float = field(
        default=10.0, metadata=_meta("liveness (/healthz) fails once the event loop has not run for this long", lo=1.0)
    )
    nice: int = field(
        default=-10,
        metadata=_meta("CPU priority of the daemon's threads and autogroup (-20..19; lower runs first); raising "
                       "it needs root or CAP_SYS_NICE, else it is kept and logged", lo=-20, hi=19),
    )  # fmt: skip
    log_level: str = field(
        default="info", metadata=_meta("debug, info, warning, error", choices=("debug", "info", "warning", "error"))
    )
    log_format: str = field(
        default="text",
        metadata=_meta("text (one line per record) or json (one JSON object per line)", choices=("text", "json")),
    )


@dataclass(frozen=True)
class HostCacheConfig:
    capacity: int = field(default=1 << 30, metadata=_meta("host cache bytes (e.g. '64GiB')", kind="size", lo=1 << 20))
    block_bytes: int = field(
        default=0, metadata=_meta("bytes per host block; 0: fixed by the first attach", kind="size")
    )
    copy_threads: int = field(default=2, metadata=_meta("copy workers per direction (cpu backend)", lo=1, hi=64))


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = field(default=True, metadata=_meta("serve Prometheus metrics over HTTP"))
    host: str = field(default="127.0.0.1", metadata=_meta("bind address; keep loopback unless a scraper needs more"))
    port: int = field(
        default=DEFAULT_METRICS_PORT,
        metadata=_meta("base port; the daemon listens on port + rank; 0: any free port", lo=0, hi=65535),
    )


@dataclass(frozen=True)
class CudaConfig:
    device: str = field(
        default="", metadata=_meta("GPU index (after CUDA_VISIBLE_DEVICES) or UUID; empty: daemon.rank")
    )
    pin_chunk: int = field(
        default=1 << 30, metadata=_meta("bytes registered per pinning step", kind="size", lo=1 << 20)
    )
    numa_node: int = field(default=-1, metadata=_meta("NUMA node for the host cache; -1: the GPU's node", lo=-1))
    copy_method: str = field(
        default="auto",
        metadata=_meta(
            "auto, dma (2D memcpy per run), staging (device gather/scatter + DMA) or kernel (zero-copy); docs/cuda.md",
            choices=("auto", "dma", "staging", "kernel"),
        ),
    )
    dma_min_bytes: int = field(
        default=256 << 10,
        metadata=_meta("auto copies with DMA when its contiguous rows average at least this", kind="size"),
    )
    kernel_programs_d2h: int = field(
        default=8, metadata=_meta("copy kernel: persistent programs (SMs) for swap-out", lo=1, hi=1024)
    )
    kernel_programs_h2d: int = field(
        default=32, metadata=_meta("copy kernel: persistent programs (SMs) for swap-in", lo=1, hi=1024)
    )
    memcpy_api: str = field(
        default="auto",
        metadata=_meta(
            "2D memcpy binding: auto, cuda-python, ctypes (torch's libcudart), torch (none: stage all)",
            choices=("auto", "cuda-python", "ctypes", "torch"),
        ),
    )
    staging_below: int = field(
        default=64 << 10,
        metadata=_meta("without Triton: auto stages a swap when DMA averages fewer bytes per call", kind="size"),
    )
    batch_bytes: int = field(
        default=64 << 20,
        metadata=_meta("bytes enqueued per batch (cancel checkpoint, staging buffer size)", kind="size", lo=1 << 20),
    )


_TABLE = {"table": True}  # a sub-table field ([storage.file]): not a setting itself


@dataclass(frozen=True)
class StorageConfig:
    """What every storage backend uses; each backend's own settings are in its sub-table."""

    backend: str = field(default="file", metadata=_meta("none, file, mooncake, redis", choices=STORAGE_CHOICES))
    timeout_s: float = field(default=10.0, metadata=_meta("limit on every storage wait", lo=0.001))
    namespace: str = field(default="", metadata=_meta("prefix for every object name (isolates deployments)"))
    io_threads: int = field(
        default=4, metadata=_meta("storage I/O threads: backend calls that run at once", lo=1, hi=64)
    )
    checksum: str = field(
        default="crc32",
        metadata=_meta(
            "payload checksum of new objects: crc32, or sum64 (faster, misses reordered sectors); reads take both",
            choices=("crc32", "sum64"),
        ),
    )
    journal: bool = field(
        default=True,
        metadata=_meta("keep the storage journal (what every daemon on the store stored and lost; file, redis)"),
    )
    file: FileSettings = field(default_factory=FileSettings, metadata=_TABLE)
    mooncake: MooncakeSettings = field(default_factory=MooncakeSettings, metadata=_TABLE)
    redis: RedisSettings = field(default_factory=RedisSettings, metadata=_TABLE)


@dataclass(frozen=True)
class AccessConfig:
    """Who may command the daemon; docs/operations.md, "Access control"."""

    group: str = field(
        default="",
        metadata=_meta("group (name or gid) whose members may connect: dir 0750, socket 0660; empty: 0700/0600"),
    )
    curve_secret_key: str = field(
        default="", metadata=_meta("CURVE: this daemon's secret key file (cachexferd keys generate); tcp off loopback")
    )
    curve_clients: str = field(default="", metadata=_meta("CURVE: directory of the allowed clients' public key files"))
    insecure_tcp: bool = field(
        default=False, metadata=_meta("accept plaintext tcp off loopback (anyone reaching the port has control)")
    )
    abstract_ipc: bool = field(
        default=False, metadata=_meta("accept ipc://@name endpoints (no file permissions: any local user may connect)")
    )


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    host_cache: HostCacheConfig = field(default_factory=HostCacheConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    # Where each value that is not a default came from ('table.key' -> file, env or flag),
    # so later checks (cachexferd.preflight) can name it too. Not a setting.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # Lines to log at start: settings read under a name of an earlier release. Not a setting.
    warnings: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def source(self, key: str) -> str:
        """Where setting ``key`` ('table.key') came from: a file, 'env VAR', 'flag ...' or 'default'."""
        return self.sources.get(key, "default")

    @property
    def runtime_dir(self) -> Path:
        return Path(self.daemon.runtime_dir or default_runtime_dir(self.daemon.rank))

    @property
    def storage_path(self) -> Path:
        """The file backend's directory."""
        return Path(self.storage.file.path or default_storage_path())

    @property
    def endpoint(self) -> str:
        return self.daemon.endpoint or f"ipc://{self.runtime_dir / 'cmd.sock'}"

    @property
    def metrics_port(self) -> int:
        return 0 if self.metrics.port == 0 else self.metrics.port + self.daemon.rank

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every table, sub-tables nested (``{"storage": {"file": {...}, ...}}``)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in TABLES if "." not in name}

    def resolved(self) -> dict[str, Any]:
        """What the empty and relative defaults become for this daemon, on this machine, for
        this user: the values it will use (``--check-config`` prints them, the start logs them)."""
        out: dict[str, Any] = {"endpoint": self.endpoint, "runtime_dir": str(self.runtime_dir)}
        if self.storage.backend == "file":
            out["storage_path"] = str(self.storage_path)
        if not self.metrics.enabled:
            out["metrics"] = "disabled"
        elif self.metrics_port:
            out["metrics"] = f"http://{self.metrics.host}:{self.metrics_port}/metrics"
        else:
            out["metrics"] = f"http://{self.metrics.host}:<any free port>/metrics"
        return out


TABLES: dict[str, type] = {
    "daemon": DaemonConfig,
    "host_cache": HostCacheConfig,
    "metrics": MetricsConfig,
    "cuda": CudaConfig,
    "storage": StorageConfig,
    **{f"storage.{name}": spec.settings for name, spec in STORAGE_BACKENDS.items()},
    "access": AccessConfig,
}
# Settings of earlier releases under their new names: still read, with a warning.
RENAMED = {
    f"storage.{key}": f"storage.{backend}.{key}"
    for backend, keys in {
        "file": ("path", "capacity", "fsync"),
        "redis": ("url",),
        "mooncake": ("master", "local_hostname", "metadata_server", "protocol", "device_name", "segment_size"),
    }.items()
    for key in keys
}


def _settings_of(cls: type) -> list[dataclasses.Field[Any]]:
    """The settings of a table: its fields but its sub-tables."""
    return [fld for fld in fields(cls) if not fld.metadata.get("table")]


def default_runtime_dir(rank: int) -> str:
    """systemd's RuntimeDirectory when set, else /run for root, else a per-user tmp dir."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.environ["RUNTIME_DIRECTORY"].split(":")[0]
    if os.geteuid() == 0:
        return f"/run/cachexferd/{rank}"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/cachexferd-{os.getuid()}"
    return f"{base}/cachexferd/{rank}"


def default_storage_path() -> str:
    """Durable and shared by every rank on the host (object keys carry the TP rank):
    systemd's StateDirectory when set, else /var/lib for root, else the user's XDG state dir."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0] + "/storage"
    if os.geteuid() == 0:
        return "/var/lib/cachexferd/storage"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return f"{base}/cachexferd/storage"


_STORAGE_URL_SCHEMES = ("redis://", "rediss://", "unix://")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^\s:\[\]]+):[0-9]{1,5}$")


def validate_storage(config: Config) -> None:
    """Addresses of the selected storage backend: caught here, not at the first connect."""
    s = config.storage
    url, master = s.redis.url, s.mooncake.master
    if s.backend == "redis" and url and not url.startswith(_STORAGE_URL_SCHEMES):
        raise ConfigError(
            f"storage.redis.url (from {config.source('storage.redis.url')}): {url!r} is not a Redis URL; "
            "use redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) or unix:///PATH"
        )
    if s.backend == "mooncake" and master and not _HOST_PORT.match(master):
        raise ConfigError(
            f"storage.mooncake.master (from {config.source('storage.mooncake.master')}): {master!r} is not a "
            "mooncake_master address; use HOST:PORT, e.g. 127.0.0.1:50051"
        )


_INT = re.compile(r"^[+-]?[0-9]+$")
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _convert(table: str, fld: dataclasses.Field[Any], value: Any, source: str, from_file: bool) -> Any:
    """The typed value of one setting, or ConfigError. Text from the environment and flags
    is parsed; a TOML file must use the setting's own type (``port = 18700``, not
    ``"18700"``), except sizes, which may be written as strings with a unit."""
    key = f"{table}.{fld.name}"
    meta = fld.metadata
    kind = "size" if meta.get("kind") == "size" else str(fld.type)
    try:
        out = _CONVERTERS[kind](value, not from_file)
    except ValueError as exc:
        raise ConfigError(
            f"{key} (from {source}): expected {_EXPECTED[kind]}, got {_shown(value, kind, from_file)}"
        ) from exc
    _check_range(key, source, out, meta)
    return out


def _to_int(value: Any, text_ok: bool) -> int:
    if type(value) is int:
        return value
    if text_ok and isinstance(value, str) and _INT.match(value.strip()):
        return int(value)
    raise ValueError(value)


def _to_float(value: Any, text_ok: bool) -> float:
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if text_ok and isinstance(value, str) and math.isfinite(number := float(value)):  # ValueError if not a number
        return number
    raise ValueError(value)


def _to_bool(value: Any, text_ok: bool = True) -> bool:
    if type(value) is bool:
        return value
    if text_ok and isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    raise ValueError(value)


def _to_size(value: Any, text_ok: bool) -> int:
    return parse_size(value)  # an int, or a string with a unit (also in a file: "64GiB")


def _to_str(value: Any, text_ok: bool) -> str:
    if isinstance(value, str):
        return value
    raise ValueError(value)


_CONVERTERS: dict[str, Any] = {"int": _to_int, "float": _to_float, "bool": _to_bool, "size": _to_size, "str": _to_str}
_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "a bool (true or false)",
    "size": "a size (bytes, or a number and a unit: KiB MiB GiB TiB KB MB GB TB)",
    "str": "a string",
}


def _shown(value: Any, kind: str, from_file: bool) -> str:
    """How a rejected value is quoted back: with its TOML type when the file's type was wrong."""
    if isinstance(value, str):
        if from_file and _parses_as_text(value, kind):
            bare = str(_to_bool(value)).lower() if kind == "bool" else value.strip()
            return f"the string {value!r} (a TOML file takes {bare}, without quotes)"
        return repr(value)
    names = {bool: "a boolean", int: "an integer", float: "a number", list: "an array", dict: "a table"}
    return f"{names.get(type(value), type(value).__name__)} ({value!r})"


def _parses_as_text(value: str, kind: str) -> bool:
    try:
        _CONVERTERS[kind](value, True)
    except ValueError:
        return False
    return True


def _check_range(key: str, source: str, value: Any, meta: Mapping[str, Any]) -> None:
    """Choices and bounds (after the type is right)."""
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key} (from {source}): {value!r} is not one of {list(meta['choices'])}")
    if "lo" in meta and value < meta["lo"]:
        raise ConfigError(f"{key} (from {source}): {value} is below the minimum {meta['lo']}")
    if "hi" in meta and value > meta["hi"]:
        raise ConfigError(f"{key} (from {source}): {value} is above the maximum {meta['hi']}")


def _unknown(name: str, known: list[str], what: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown {what} {name!r} in {source}{hint}")


class _Layers:
    """Collects overrides per table, remembering where each value came from, and every
    problem found on the way: all of them are reported at once."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, tuple[Any, str, bool]]] = {name: {} for name in TABLES}
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def put(self, table: str, key: str, value: Any, source: str, from_file: bool = False) -> None:
        renamed = RENAMED.get(f"{table}.{key}")
        if renamed is not None:
            self.warnings.append(f"{table}.{key} (from {source}) is now {renamed}; it still works, but rename it")
            table, key = renamed.rsplit(".", 1)
        if table not in TABLES:
            self.problems.append(str(_unknown(table, list(TABLES), "table", source)))
            return
        known = [fld.name for fld in _settings_of(TABLES[table])]
        if key not in known:
            self.problems.append(str(_unknown(key, known, f"key in [{table}]", source)))
            return
        self.values[table][key] = (value, source, from_file)

    def build(self) -> Config:
        tables: dict[str, Any] = {}
        for name in sorted(TABLES, key=lambda n: -n.count(".")):  # sub-tables before their table
            cls = TABLES[name]
            by_name = {fld.name: fld for fld in _settings_of(cls)}
            kwargs = {k: v for k, v in tables.items() if k.rpartition(".")[0] == name}  # its sub-tables
            kwargs = {k.rpartition(".")[2]: v for k, v in kwargs.items()}
            for k, (v, src, from_file) in self.values[name].items():
                try:
                    kwargs[k] = _convert(name, by_name[k], v, src, from_file)
                except ConfigError as exc:
                    self.problems += exc.problems  # the default stands in, so later checks still run
            tables[name] = cls(**kwargs)
        sources = {f"{t}.{k}": src for t, values in self.values.items() for k, (_, src, _) in values.items()}
        top = {name: table for name, table in tables.items() if "." not in name}
        config = Config(**top, sources=sources, warnings=tuple(self.warnings))
        self._check_whole(config)
        if self.problems:
            raise ConfigError(*self.problems)
        return config

    def _check_whole(self, config: Config) -> None:
        """Rules across settings: access (endpoint, keys, group) and storage addresses."""
        from .security import AccessError, check_access

        try:
            check_access(config)
        except AccessError as exc:
            self.problems.append(str(exc))
        try:
            validate_storage(config)
        except ConfigError as exc:
            self.problems += exc.problems


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Builds the effective config. ``overrides`` maps 'table.key' to a value (CLI layer)."""
    layers = _Layers()
    if path is not None:
        _load_file(layers, Path(path))
    env = os.environ if environ is None else environ
    for var, value in sorted(env.items()):
        if var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            try:
                table, key = _split_env(var)
            except ConfigError as exc:
                layers.problems += exc.problems
                continue
            layers.put(table, key, value, f"env {var}")
    for dotted, value in (overrides or {}).items():
        table, _, key = dotted.rpartition(".")
        if not table:
            layers.problems.append(f"override {dotted!r} must look like table.key=value")
            continue
        layers.put(table, key, value, f"flag {dotted}")
    return layers.build()


def _load_file(layers: _Layers, path: Path) -> None:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path} is a directory; --config (or CACHEXFERD_CONFIG) must name a TOML file"
        ) from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user (uid {os.getuid()})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text (TOML is UTF-8)") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for table, values in data.items():
        if not isinstance(values, dict):
            layers.problems.append(f"{path}: top-level key {table!r} must be a [table]")
            continue
        for key, value in values.items():
            if isinstance(value, dict) and f"{table}.{key}" in TABLES:  # [storage.file]
                for sub_key, sub_value in value.items():
                    layers.put(f"{table}.{key}", sub_key, sub_value, str(path), from_file=True)
            else:
                layers.put(table, key, value, str(path), from_file=True)


def _split_env(var: str) -> tuple[str, str]:
    """CACHEXFERD_STORAGE_FILE_PATH -> ("storage.file", "path"): the longest table wins."""
    rest = var[len(ENV_PREFIX) :].lower()
    for table in sorted(TABLES, key=len, reverse=True):
        prefix = table.replace(".", "_") + "_"
        if rest.startswith(prefix):
            return table, rest[len(prefix) :]
    raise _unknown(rest.split("_")[0], list(TABLES), "table", f"env {var} (CACHEXFERD_<TABLE>_<KEY>)")


def describe() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every setting, for docs and `cachexferd serve --help-config`."""
    rows = []
    for table, cls in TABLES.items():
        for fld in _settings_of(cls):
            default = fld.default if fld.default is not dataclasses.MISSING else None
            rows.append((f"{table}.{fld.name}", default, fld.metadata["doc"]))
    return rows


def settings_markdown() -> str:
    """The settings table of docs/operations.md (kept in sync by a test)."""
    lines = ["| setting | default | meaning |", "|---|---|---|"]
    for key, default, doc in describe():
        shown = f"`{default!r}`" if not isinstance(default, bool) else f"`{str(default).lower()}`"
        lines.append(f"| `{key}` | {shown} | {doc.replace('|', '/')} |")
    return "\n".join(lines)
