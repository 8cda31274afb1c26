"""Storage tier backends, declared in one table (``STORAGE_BACKENDS``) and imported lazily.

Each entry names the backend's module, its settings table (``[storage.<name>]`` in the
configuration: the settings of that backend alone), the pip extra that installs its client
library and the module that library provides. The configuration, the start-up checks and
the daemon read this table; nothing else lists the backends. This package imports nothing
heavy: ``cachexferd.storage.keys`` (the key computation engines import) and
``cachexferd.storage.objects`` import nothing outside the standard library, and a backend's
module (with its client library) is imported only when it is selected.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..setting import meta

if TYPE_CHECKING:
    from ..config import Config
    from ..host_cache import HostPool
    from .base import StorageBackend


@dataclass(frozen=True)
class FileSettings:
    path: str = field(
        default="", metadata=meta("directory of the objects, shared by the ranks; empty: see docs/operations.md")
    )
    capacity: int = field(
        default=64 << 30,
        metadata=meta("bytes kept before the least recently used objects go; 0: no limit", kind="size"),
    )
    fsync: bool = field(default=False, metadata=meta("fsync objects before rename"))


@dataclass(frozen=True)
class RedisSettings:
    url: str = field(default="", metadata=meta("server URL; empty: redis://127.0.0.1:6379/0"))


@dataclass(frozen=True)
class MooncakeSettings:
    master: str = field(default="", metadata=meta("master address host:port; empty: 127.0.0.1:50051"))
    local_hostname: str = field(default="127.0.0.1", metadata=meta("this node's address"))
    metadata_server: str = field(default="P2PHANDSHAKE", metadata=meta("metadata server"))
    protocol: str = field(default="tcp", metadata=meta("transport: tcp or rdma", choices=("tcp", "rdma")))
    device_name: str = field(default="", metadata=meta("RDMA device names, empty for tcp"))
    segment_size: int = field(default=0, metadata=meta("bytes this node contributes to the pool", kind="size"))


class StorageBackendSpec(NamedTuple):
    module: str  # imported when the backend is selected; its create(config, pool) makes the backend
    settings: type  # the dataclass of its [storage.<name>] table
    client: str = ""  # the client library's module, checked before start ("" none)
    extra: str = ""  # the pip extra that installs it: pip install 'cachexferd[<extra>]'


STORAGE_BACKENDS: dict[str, StorageBackendSpec] = {
    "file": StorageBackendSpec("cachexferd.storage.file", FileSettings),
    "mooncake": StorageBackendSpec("cachexferd.storage.mooncake", MooncakeSettings, "mooncake", "mooncake"),
    "redis": StorageBackendSpec("cachexferd.storage.redis", RedisSettings, "redis", "redis"),
}
BACKENDS = ("none", *STORAGE_BACKENDS)  # the values of storage.backend


def load_storage(config: Config, pool: HostPool) -> StorageBackend | None:
    """The configured backend, not yet started; None for ``storage.backend = "none"``.

    Raises ImportError when the backend's client library is missing (its pip extra) and
    ValueError for a bad address.
    """
    name = config.storage.backend
    if name == "none":
        return None
    if name not in STORAGE_BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {list(BACKENDS)}")
    module = importlib.import_module(STORAGE_BACKENDS[name].module)
    backend: StorageBackend = module.create(config, pool)
    return backend
