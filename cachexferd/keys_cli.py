"""``cachexferd keys``: CURVE key pairs for tcp command sockets.

``cachexferd keys generate DIR NAME`` writes ``DIR/NAME.key`` (the public key, to hand out)
and ``DIR/NAME.key_secret`` (the pair, mode 0600, never to leave its host), in ZeroMQ's
certificate format, which ``zmq.auth`` and the daemon read. A daemon needs its own pair
(``access.curve_secret_key``) and a directory with each allowed client's ``.key`` file
(``access.curve_clients``); a client needs the daemon's ``.key`` and its own ``.key_secret``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def add_keys(sub: Any) -> None:
    p = sub.add_parser("keys", help="CURVE key pairs for tcp command sockets")
    actions = p.add_subparsers(dest="keys_action", required=True)
    gen = actions.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (0600) into DIR")
    gen.add_argument("dir", help="directory for the key files (created 0700 if missing)")
    gen.add_argument("name", help="base name, e.g. daemon-gpu0 or engine")
    gen.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    try:
        public, secret = generate(Path(args.dir), args.name, args.force)
    except (OSError, ValueError) as exc:
        print(f"cachexferd keys: {exc}", file=sys.stderr)
        return 1
    print(f"{public}  public key: give it to the peers that must accept this key")
    print(f"{secret}  key pair (mode 0600): keep it on this host")
    return 0


def generate(directory: Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """Writes a new key pair; returns (public file, secret file)."""
    import zmq

    if not _NAME.match(name):
        raise ValueError(f"key name {name!r} must be 1-100 chars of [A-Za-z0-9._-]")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    _write(secret_file, _certificate(public, secret), 0o600, force)
    _write(public_file, _certificate(public, None), 0o644, force)
    return public_file, secret_file


def _certificate(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [
        f"#   ZeroMQ CURVE {kind} Certificate, written by cachexferd keys on {datetime.date.today().isoformat()}",
        "#   Keep .key_secret files private (mode 0600) on the host they were made for."
        if secret is not None
        else "#   Hand this file to the peers that must recognise this key.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    """Creates ``path`` with ``mode`` from the start (a secret is never readable by others)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    if force:
        path.unlink(missing_ok=True)
    fd = os.open(path, flags, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, mode)  # the umask may have narrowed it; never widens a secret beyond 0600
