"""What the engine side says about a daemon that does not answer: each case with a real
socket file in a temp directory (none, left behind, listening but silent), and tcp."""

from __future__ import annotations

import socket
from pathlib import Path

from cachexferd.integrations.engine.liveness import why_unreachable


def test_no_socket_names_the_path(tmp_path: Path) -> None:
    why = why_unreachable(f"ipc://{tmp_path}/cmd.sock")
    assert why == f"no socket at {tmp_path}/cmd.sock: no daemon serves there yet, or the endpoint names another path"


def test_a_socket_left_behind_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "cmd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))  # bound, never listening, closed: the file stays, nobody is there
    assert path.exists()
    assert "exists but nothing listens on it" in why_unreachable(f"ipc://{path}")


def test_a_listening_but_silent_daemon_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "cmd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen(1)
        assert "accepts connections but does not answer" in why_unreachable(f"ipc://{path}")


def test_tcp_names_the_address() -> None:
    assert why_unreachable("tcp://127.0.0.1:1") == "nothing answers at tcp://127.0.0.1:1"
