"""Copy backends, selected by name and imported lazily.

The cpu path never imports the cachexferd.backends.cuda package (nor anything CUDA-only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Config
    from .base import Backend

_MODULES = {"cpu": "cachexferd.backends.cpu", "cuda": "cachexferd.backends.cuda.backend"}


def resolve_name(name: str) -> str:
    """'auto' becomes 'cuda' when torch sees a GPU, else 'cpu'."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(name: str, config: Config) -> Backend:
    resolved = resolve_name(name)
    if resolved not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(_MODULES)} or 'auto'")
    module = importlib.import_module(_MODULES[resolved])
    backend: Backend = module.create(config)
    return backend
