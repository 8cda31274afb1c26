"""The access rules on endpoints, groups and key files, checked before anything binds."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from cachexferd.config import ConfigError, load_config
from cachexferd.keys_cli import generate
from cachexferd.security import Peer, SegmentPolicy, exposure_warnings, load_client_keys, parse_endpoint


def config(tmp: Path, **settings: object) -> object:
    return load_config(overrides={"daemon.runtime_dir": str(tmp / "rt"), **settings}, environ={})


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    generate(directory, "daemon")
    generate(directory, "engine")
    (directory / "clients").mkdir()
    (directory / "engine.key").rename(directory / "clients" / "engine.key")
    return directory


@pytest.mark.parametrize(
    ("endpoint", "needle"),
    [
        ("ipc://@cachexferd", "abstract-namespace"),
        ("ipc:///tmp/elsewhere/cmd.sock", "directly in daemon.runtime_dir"),
        ("ipc://relative.sock", "directly in daemon.runtime_dir"),
        ("tcp://0.0.0.0:5555", "access.insecure_tcp"),
        ("tcp://*:5555", "reachable from other machines"),
        ("tcp://[2001:db8::1]:5555", "reachable from other machines"),
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("udp://x", "ipc://PATH"),
    ],
)
def test_refused_endpoints(tmp_path: Path, endpoint: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"daemon\.endpoint") as info:
        config(tmp_path, **{"daemon.endpoint": endpoint})
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5555", "tcp://127.3.4.5:5555", "tcp://localhost:5555", "tcp://[::1]:5555"]
)
def test_loopback_tcp_is_accepted(tmp_path: Path, endpoint: str) -> None:
    assert config(tmp_path, **{"daemon.endpoint": endpoint}).endpoint == endpoint  # type: ignore[attr-defined]


def test_explicit_opt_ins(tmp_path: Path, keys: Path) -> None:
    assert config(tmp_path, **{"daemon.endpoint": "ipc://@cx-test", "access.abstract_ipc": "true"})
    insecure = config(tmp_path, **{"daemon.endpoint": "tcp://0.0.0.0:5555", "access.insecure_tcp": "true"})
    assert any("anyone who can reach the port" in w for w in exposure_warnings(insecure))  # type: ignore[arg-type]
    curve = {"access.curve_secret_key": str(keys / "daemon.key_secret"), "access.curve_clients": str(keys / "clients")}
    secured = config(tmp_path, **{"daemon.endpoint": "tcp://0.0.0.0:5555", **curve})
    assert exposure_warnings(secured) == []  # type: ignore[arg-type]


def test_ipc_in_runtime_dir_is_accepted(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'rt' / 'other.sock'}"
    assert config(tmp_path, **{"daemon.endpoint": endpoint}).endpoint == endpoint  # type: ignore[attr-defined]


def test_metrics_off_loopback_warns(tmp_path: Path) -> None:
    assert exposure_warnings(config(tmp_path)) == []  # type: ignore[arg-type]
    warnings = exposure_warnings(config(tmp_path, **{"metrics.host": "0.0.0.0"}))  # type: ignore[arg-type]
    assert warnings == ["metrics.host '0.0.0.0' is not loopback: metrics are served to other machines"]


def test_key_file_problems(tmp_path: Path, keys: Path) -> None:
    clients = str(keys / "clients")
    cases = [
        ({"access.curve_secret_key": str(keys / "daemon.key_secret")}, "must be set together"),
        ({"access.curve_secret_key": str(keys / "daemon.key"), "access.curve_clients": clients}, "no secret key"),
        ({"access.curve_secret_key": str(tmp_path / "none"), "access.curve_clients": clients}, "cannot read"),
        ({"access.curve_secret_key": str(keys / "daemon.key_secret"), "access.curve_clients": "/nonexistent"},
         "not a directory"),
        ({"access.group": "no-such-group-here"}, "not a group on this machine"),
    ]  # fmt: skip
    for settings, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            config(tmp_path, **settings)
    os.chmod(keys / "daemon.key_secret", 0o644)
    readable = {"access.curve_secret_key": str(keys / "daemon.key_secret"), "access.curve_clients": clients}
    with pytest.raises(ConfigError, match="accessible to all users"):
        config(tmp_path, **readable)


def test_keys_command_writes_private_pairs(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "cachexferd", "keys", "generate", str(tmp_path / "k"), "gpu0"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    public_file, secret_file = tmp_path / "k" / "gpu0.key", tmp_path / "k" / "gpu0.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_file.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    public, secret = zmq.auth.load_certificate(secret_file)
    assert zmq.auth.load_certificate(public_file) == (public, None) and secret is not None
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr  # never overwritten without --force
    keys = load_client_keys(public_file, secret_file)
    assert keys.public == public and keys.server_public == public


def test_peer_credentials_and_segment_policy() -> None:
    assert Peer.from_address("localhost:1000:1001:4242") == Peer(1000, 1001, 4242)
    assert Peer.from_address("127.0.0.1") is None and Peer.from_address("") is None
    regular = os.stat_result((stat.S_IFREG | 0o600, 0, 0, 1, 1000, 1000, 4096, 0, 0, 0))
    assert SegmentPolicy(Peer(1000, 1000, 1)).refusal(regular) is None
    assert "not by the attaching process" in str(SegmentPolicy(Peer(1001, 1000, 1)).refusal(regular))
    assert SegmentPolicy(Peer(0, 0, 1)).refusal(regular) is None  # root could open it itself
    assert "neither this daemon's user" in str(SegmentPolicy(None, daemon_uid=0).refusal(regular))
    assert SegmentPolicy(None, daemon_uid=1000).refusal(regular) is None
    fifo = os.stat_result((stat.S_IFIFO | 0o600, 0, 0, 1, 1000, 1000, 0, 0, 0, 0))
    assert SegmentPolicy(Peer(1000, 1000, 1)).refusal(fifo) == "is not a regular file"


def test_endpoint_parsing() -> None:
    assert parse_endpoint("tcp://[::1]:80").loopback
    assert not parse_endpoint("tcp://10.1.2.3:80").loopback
    assert parse_endpoint("ipc://@x").abstract
