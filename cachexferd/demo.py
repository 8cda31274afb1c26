"""``cachexferd demo`` (placeholder until written)."""

from __future__ import annotations

from typing import Any


def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the whole system end to end on this machine")
    p.set_defaults(func=lambda args: 1)
