"""systemd's sd_notify protocol (READY=1, STOPPING=1, STATUS=...) without libsystemd."""

from __future__ import annotations

import os
import socket


def sd_notify(message: str) -> bool:
    """Sends ``message`` to $NOTIFY_SOCKET; returns False when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError:
            return False
    return True
