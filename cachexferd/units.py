"""Formatting shared by the commands and the start-up checks (no imports from the package:
the lowest layer, usable from anywhere)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: '512 B', '1.5 KiB', '64.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable
