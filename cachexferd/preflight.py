"""What ``cachexferd serve`` checks before it binds anything, and ``--check-config`` too.

load_config() checks each value on its own; these checks hold the configuration against
this machine: the runtime directory, physical memory, the GPU, the storage client library,
the ports. A failed check raises ConfigError with one line that names the setting, where it
came from, and what to do; ``serve`` prints it and exits with status 2 (EXIT_CONFIG), which
the systemd unit's RestartPreventExitStatus= keeps from restarting in a loop.

Checks that pass but look risky return warnings (strings) for the caller to log.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .config import Config, ConfigError
from .storage import STORAGE_BACKENDS
from .units import human_bytes

EXIT_CONFIG = 2
T = TypeVar("T")
_IPC_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL
_DAEMON_OVERHEAD = 512 << 20  # interpreter, torch and the daemon beside the host cache


def check(config: Config, *, running_ok: bool = False) -> list[str]:
    """Runs every check; raises one ConfigError naming every failure, returns warnings.

    ``running_ok`` (``--check-config``): a daemon already running with this configuration
    is expected, not an error; its lock and ports are then not checked."""
    problems: list[str] = []

    def run(check: Callable[[], T], empty: T) -> T:
        try:
            return check()
        except ConfigError as exc:  # every check runs: all problems are reported at once
            problems.extend(exc.problems)
            return empty

    running = run(lambda: check_runtime_dir(config, running_ok), "")
    run(lambda: check_backend(config), None)
    none: list[str] = []
    warnings = run(lambda: check_memory(config), none) + run(lambda: check_storage(config), none)
    if running:
        warnings.append(f"a cachexferd (pid {running}) is running with this runtime directory: ports not checked")
    else:
        run(lambda: check_ports(config), None)
    if problems:
        raise ConfigError(*problems)
    return warnings


def _setting(config: Config, key: str) -> str:
    return f"{key} (from {config.source(key)})"


# Runtime directory -------------------------------------------------------------------------


def check_runtime_dir(config: Config, running_ok: bool = False) -> str:
    """Returns the pid of a daemon running with this directory when ``running_ok``, else ''."""
    runtime = config.runtime_dir
    key = "daemon.runtime_dir"
    if config.endpoint.startswith("ipc://") and len(config.endpoint) - len("ipc://") > _IPC_PATH_MAX:
        raise ConfigError(
            f"{_setting(config, key)}: the socket path {config.endpoint[6:]} is longer than the "
            f"{_IPC_PATH_MAX} bytes a unix socket allows; choose a shorter directory"
        )
    if runtime.exists() and not runtime.is_dir():
        raise ConfigError(
            f"{_setting(config, key)}: {runtime} exists and is not a directory; remove it or choose another"
        )
    existing = _nearest_existing(runtime)
    if not existing.is_dir():
        raise ConfigError(f"{_setting(config, key)}: {runtime} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "cannot be created" if existing != runtime else "is not writable"
        raise ConfigError(
            f"{_setting(config, key)}: {runtime} {what} by this user (uid {os.getuid()}: {existing} is not "
            "writable); choose a directory it owns, or run under systemd (RuntimeDirectory=)"
        )
    running = _lock_holder(runtime / "daemon.lock")
    if running and not running_ok:
        raise ConfigError(
            f"another cachexferd is running with daemon.runtime_dir {runtime} (pid {running}); stop it, "
            "or give this daemon another daemon.rank or daemon.runtime_dir"
        )
    return running


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _lock_holder(lock: Path) -> str:
    """The pid in the lock file if another process holds the lock, else '' (never creates it)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return ""  # absent (or unreadable: the daemon's own open will say so)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return ""
    except BlockingIOError:
        return lock.read_text().strip() or "?"
    finally:
        os.close(fd)


# Backend and memory ------------------------------------------------------------------------


def check_backend(config: Config) -> None:
    """The cuda backend needs a GPU that torch can see, and the one it selects must exist."""
    if config.daemon.backend != "cuda":
        return
    import torch

    key = "daemon.backend"
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (", a CPU-only build" if torch.version.cuda is None else "")
        raise ConfigError(
            f"{_setting(config, key)}: 'cuda' but torch sees no CUDA GPU ({build}); set "
            'daemon.backend = "cpu" (or "auto"), or install a CUDA build of torch (docs/operations.md, "Install")'
        )
    device = config.cuda.device or str(config.daemon.rank)
    count = torch.cuda.device_count()
    if device.isdigit() and int(device) >= count:
        which = "cuda.device" if config.cuda.device else "daemon.rank"
        raise ConfigError(
            f"{_setting(config, which)}: selects GPU {device} but this host shows {count} "
            "(CUDA_VISIBLE_DEVICES applies); set cuda.device to one of them"
        )


def physical_memory() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    return min(total, limit) if limit else total


def _cgroup_memory_limit() -> int | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: the lowest memory.max on the way up
            return _lowest_limit(Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max")
        if "memory" in controllers.split(","):
            return _lowest_limit(Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes")
    return None


def _lowest_limit(directory: Path, name: str) -> int | None:
    limits = []
    for d in (directory, *directory.parents):
        try:
            value = (d / name).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:  # "max" or a huge number: no limit
            limits.append(int(value))
    return min(limits) if limits else None


def check_memory(config: Config) -> list[str]:
    """The host cache must fit in RAM: past it, mmap fails with ENOMEM (or the OOM killer
    comes later). Several daemons on one host each need their own capacity."""
    capacity, ram = config.host_cache.capacity, physical_memory()
    key = "host_cache.capacity"
    if capacity + _DAEMON_OVERHEAD > ram:
        raise ConfigError(
            f"{_setting(config, key)}: {human_bytes(capacity)} does not fit in this machine's "
            f"{human_bytes(ram)} of memory (the daemon needs about {human_bytes(_DAEMON_OVERHEAD)} more); "
            f"set host_cache.capacity below {human_bytes(max(ram - _DAEMON_OVERHEAD, 0))}, divided by the "
            "daemons on this host"
        )
    available = _mem_available()
    if config.daemon.backend == "cuda" and available is not None and capacity > available:
        return [
            f"{key} {human_bytes(capacity)} is more than the {human_bytes(available)} available now: "
            "pinning will stop early and the rest is served unpinned (slower)"
        ]
    return []


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Storage -----------------------------------------------------------------------------------


def check_storage(config: Config) -> list[str]:
    backend = config.storage.backend
    spec = STORAGE_BACKENDS.get(backend)
    if spec is not None and spec.client and importlib.util.find_spec(spec.client) is None:
        raise ConfigError(
            f"{_setting(config, 'storage.backend')}: {backend!r} needs the {spec.client} client, which is not "
            f"installed; pip install 'cachexferd[{spec.extra}]', or choose another storage.backend"
        )
    if backend == "mooncake" and config.storage.mooncake.protocol == "rdma" and not _has_rdma_device():
        raise ConfigError(
            f"{_setting(config, 'storage.mooncake.protocol')}: 'rdma' but this host has no RDMA device "
            '(/sys/class/infiniband is empty); set storage.mooncake.protocol = "tcp"'
        )
    if backend == "file":
        return _file_storage_warnings(config)
    return []


def _has_rdma_device() -> bool:
    try:
        return any(Path("/sys/class/infiniband").iterdir())
    except OSError:
        return False


def _file_storage_warnings(config: Config) -> list[str]:
    """A path that can never hold objects is refused (a file where the directory should be,
    a virtual file system such as /proc). The directory may legitimately appear later (a
    shared file system not mounted yet, permissions an operator fixes), so the rest are
    warnings: storage commands answer STORAGE_UNAVAILABLE meanwhile, and status says why."""
    path = config.storage_path
    key = _setting(config, "storage.file.path")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        kind = _file_kind(existing)
        where = f"is {kind}" if existing == path else f"cannot be created: {existing} is {kind}"
        raise ConfigError(f"{key}: {path} {where}, not a directory; name a directory (or one to create)")
    fs_type = file_system_type(existing)
    if fs_type in _VIRTUAL_FS:
        raise ConfigError(
            f"{key}: {path} is on a {fs_type} file system, which cannot hold files; choose a directory on a disk "
            "or a shared file system"
        )
    disk = os.statvfs(existing)
    if disk.f_flag & os.ST_RDONLY:
        return [f"storage.file.path {path} is on a read-only file system ({existing}): storage commands fail until it "
                "is writable (a shared file system not mounted yet?)"]  # fmt: skip
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "cannot be created" if existing != path else "is not writable"
        return [f"storage.file.path {path} {what} by this user (uid {os.getuid()}: {existing} is not writable): "
                "storage commands fail until it is"]  # fmt: skip
    size = disk.f_blocks * disk.f_frsize
    if config.storage.file.capacity > size:
        return [
            f"storage.file.capacity {human_bytes(config.storage.file.capacity)} is more than the file system holding "
            f"{path} ({human_bytes(size)}): a full disk stops stores before eviction does"
        ]
    return []


# File systems that exist only in memory of the kernel: nothing can be stored there.
_VIRTUAL_FS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs", "pstore", "bpf",
    "configfs", "fusectl", "mqueue", "binfmt_misc", "efivarfs", "selinuxfs", "nsfs", "rpc_pipefs",
})  # fmt: skip


def _file_kind(path: Path) -> str:
    mode = path.stat().st_mode
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a device or another special file"


def file_system_type(path: Path) -> str:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo), '' if unknown."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    real, best, fs_type = os.path.realpath(path), "", ""
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount = parts[4].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # the last, deepest mount wins
            best, fs_type = mount, rest.split()[0]
    return fs_type


# Ports -------------------------------------------------------------------------------------


def check_ports(config: Config) -> None:
    if config.metrics.enabled and config.metrics_port:
        _check_port_free(config, "metrics.port", config.metrics.host, config.metrics_port)
    if config.endpoint.startswith("tcp://"):
        host, _, port = config.endpoint[len("tcp://") :].rpartition(":")
        _check_port_free(config, "daemon.endpoint", host.strip("[]"), int(port))


def _check_port_free(config: Config, key: str, host: str, port: int) -> None:
    """Binds and closes the port as the server would (SO_REUSEADDR, like http.server)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        host_key = "metrics.host" if key == "metrics.port" else key
        raise ConfigError(f"{_setting(config, host_key)}: {host!r} does not resolve ({exc.strerror})") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(port_error(config, key, host, port, exc)) from None


def port_error(config: Config, key: str, host: str, port: int, exc: OSError) -> str:
    """The one line for a port this daemon cannot bind (also used after a failed start)."""
    where = f"{host}:{port}"
    if key == "metrics.port" and config.metrics.port:
        where += f" (metrics.port {config.metrics.port} + rank {config.daemon.rank})"
    if exc.errno == errno.EADDRINUSE:
        problem = f"{where} is already in use by another process"
    elif exc.errno == errno.EACCES:
        problem = f"{where} needs privileges this user does not have"
    else:
        problem = f"cannot bind {where}: {exc.strerror or exc}"
    fix = (
        "set metrics.port to a free base port (each rank adds its number), 0 for any free port, "
        "or metrics.enabled = false"
        if key == "metrics.port"
        else "choose a free port in daemon.endpoint"
    )
    return f"{_setting(config, key)}: {problem}; {fix}"
