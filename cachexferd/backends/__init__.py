"""Copy backends, declared in one table (``COPY_BACKENDS``) and imported lazily by name.

The configuration reads the table for the values of ``daemon.backend``; the daemon imports
the selected backend's module only. The cpu path never imports the cachexferd.backends.cuda
package (nor anything CUDA-only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..config import Config
    from .base import Backend


class CopyBackendSpec(NamedTuple):
    module: str  # imported when the backend is selected; its create(config) makes the backend
    table: str = ""  # the configuration table of its own settings ("" none)


COPY_BACKENDS: dict[str, CopyBackendSpec] = {
    "cpu": CopyBackendSpec("cachexferd.backends.cpu"),
    "cuda": CopyBackendSpec("cachexferd.backends.cuda.backend", table="cuda"),
}
BACKEND_CHOICES = ("auto", *COPY_BACKENDS)  # the values of daemon.backend


def resolve_name(name: str) -> str:
    """'auto' becomes 'cuda' when torch sees a GPU, else 'cpu'."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(name: str, config: Config) -> Backend:
    resolved = resolve_name(name)
    if resolved not in COPY_BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(COPY_BACKENDS)} or 'auto'")
    module = importlib.import_module(COPY_BACKENDS[resolved].module)
    backend: Backend = module.create(config)
    return backend
