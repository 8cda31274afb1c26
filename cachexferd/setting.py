"""The metadata every setting carries (its doc, its kind, its checks), shared by the daemon's
configuration (cachexferd.config) and the tables the backend registries declare for their
backends. Imports nothing of the package."""

from __future__ import annotations

from typing import Any


def meta(doc: str, kind: str = "", **checks: Any) -> dict[str, Any]:
    """``doc``: one line for docs/operations.md; ``kind``: "size" for byte sizes (else the
    field's type decides); ``checks``: ``choices``, ``lo``, ``hi``."""
    return {"doc": doc, "kind": kind, **checks}
