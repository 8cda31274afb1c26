"""Storage tier backends (file, mooncake, redis), selected by name and imported lazily.

``cachexferd.storage.keys`` (the key computation engines import) and
``cachexferd.storage.objects`` import nothing outside the standard library; the backends
import their client libraries only when selected.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from ..host_cache import HostPool
    from .base import StorageBackend

_MODULES = {
    "file": "cachexferd.storage.file",
    "mooncake": "cachexferd.storage.mooncake",
    "redis": "cachexferd.storage.redis",
}
BACKENDS = ("none", *_MODULES)


def load_storage(config: Config, pool: HostPool) -> StorageBackend | None:
    """The configured backend, not yet started; None for ``storage.backend = "none"``.

    Raises ImportError when the backend's client library is missing (pip extra
    ``cachexferd[redis]`` or ``cachexferd[mooncake]``) and ValueError for a bad address.
    """
    name = config.storage.backend
    if name == "none":
        return None
    if name not in _MODULES:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {list(BACKENDS)}")
    module = importlib.import_module(_MODULES[name])
    backend: StorageBackend = module.create(config, pool)
    return backend
