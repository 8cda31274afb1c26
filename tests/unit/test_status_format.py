"""``cachexferd status``'s lines: the storage map, the journal's view inside it included."""

from __future__ import annotations

from cachexferd.status import format_status


def test_the_storage_line_shows_the_journal_view_and_human_sizes() -> None:
    status = {
        "rank": 0, "state": "running", "version": "x", "pid": 1, "uptime_s": 1.0, "boot_id": "b", "endpoint": "e",
        "backend": {"name": "cpu"}, "clients": 2,
        "host_cache": {"capacity_bytes": 1 << 30, "num_blocks": 4, "block_bytes": 1 << 20, "ready_bytes": 1 << 30,
                       "pinned": False},
        "device": {"state": "detached"}, "commands": {"queued": 0, "running": 0},
        "storage": {"backend": "file", "state": "ready", "used_bytes": 3 << 20,
                    "journal": {"objects": 12, "records": 40, "gaps": 0, "files": 1}},
    }  # fmt: skip
    line = next(x for x in format_status(status).splitlines() if x.startswith("storage"))
    assert "backend=file" in line and "used_bytes=3.0 MiB" in line
    assert "journal(objects=12, records=40, gaps=0, files=1)" in line
