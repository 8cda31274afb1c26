"""`cachexferd serve` refusing to start: one line on stderr naming the setting and the fix,
exit status 2 (the systemd unit's RestartPreventExitStatus), nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cachexferd.launch import DaemonProcess
from cachexferd.preflight import physical_memory

from .helpers import REPO, clean_env, run_cli

Spawn = Callable[..., DaemonProcess]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def refused(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The refusal's single stderr line, after checking status 2 and what it names."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def serve(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(["serve", "--set", f"daemon.runtime_dir={tmp / 'rt'}", *args], tmp)


def nothing_left(tmp: Path) -> None:
    assert not (tmp / "rt").exists(), f"left behind: {sorted(p.name for p in (tmp / 'rt').rglob('*'))}"
    assert not (tmp / "state").exists(), "the storage directory was created"


def test_metrics_port_in_use(short_tmp: Path, busy_port: int) -> None:
    line = refused(serve(short_tmp, "--backend", "cpu", "--metrics-port", str(busy_port)), "metrics.port", "in use")
    assert "metrics.port = 0" in line or "0 for any free port" in line
    nothing_left(short_tmp)


def test_metrics_port_plus_rank_in_use(short_tmp: Path, busy_port: int) -> None:
    result = serve(short_tmp, "--backend", "cpu", "--metrics-port", str(busy_port - 3), "--rank", "3")
    refused(result, "metrics.port", f"{busy_port - 3} + rank 3", "(from flag metrics.port)")
    nothing_left(short_tmp)


def test_host_cache_larger_than_memory(short_tmp: Path) -> None:
    too_big = str(2 * physical_memory())
    refused(serve(short_tmp, "--backend", "cpu", "--capacity", too_big), "host_cache.capacity", "memory")
    nothing_left(short_tmp)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the cuda config is valid here")
def test_cuda_config_on_a_host_without_gpu(short_tmp: Path) -> None:
    """Every problem of the GPU host's config on this machine, one line each, the GPU first."""
    result = serve(short_tmp, "--config", "configs/cuda-host.toml")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and all(line.startswith("cachexferd: ") for line in lines), result.stderr
    for needle in ("daemon.backend", "configs/cuda-host.toml", "no CUDA GPU", '"cpu"'):
        assert needle in lines[0], lines[0]
    nothing_left(short_tmp)


def test_config_naming_a_directory(short_tmp: Path) -> None:
    refused(serve(short_tmp, "--config", str(short_tmp)), "is a directory", "--config")
    nothing_left(short_tmp)


def test_runtime_dir_that_cannot_be_created(short_tmp: Path) -> None:
    (short_tmp / "file").write_text("not a directory")
    result = run_cli(["serve", "--backend", "cpu", "--runtime-dir", str(short_tmp / "file" / "rt")], short_tmp)
    refused(result, "daemon.runtime_dir", "(from flag daemon.runtime_dir)", "not a directory")


def test_runtime_dir_of_a_running_daemon(short_tmp: Path, spawn_daemon: Spawn) -> None:
    first = spawn_daemon()
    result = run_cli(["serve", "--backend", "cpu", "--runtime-dir", str(first.runtime_dir)], short_tmp)
    refused(result, "another cachexferd is running", "daemon.runtime_dir", str(first.process and first.process.pid))
    assert first.status()["state"] == "running" and Path(first.endpoint[len("ipc://") :]).exists()


def test_redis_url_that_is_not_redis(short_tmp: Path) -> None:
    result = serve(short_tmp, "--backend", "cpu", "--storage", "redis", "--set", "storage.redis.url=http://x")
    refused(result, "storage.redis.url", "'http://x'", "redis://")
    nothing_left(short_tmp)


def test_mooncake_master_without_port(short_tmp: Path) -> None:
    result = serve(short_tmp, "--backend", "cpu", "--storage", "mooncake", "--set", "storage.mooncake.master=mc-master")
    refused(result, "storage.mooncake.master", "HOST:PORT")


def test_bad_value_from_the_environment(short_tmp: Path) -> None:
    result = run_cli(
        ["serve", "--runtime-dir", str(short_tmp / "rt")], short_tmp, CACHEXFERD_HOST_CACHE_CAPACITY="lots"
    )
    refused(result, "host_cache.capacity", "env CACHEXFERD_HOST_CACHE_CAPACITY")
    nothing_left(short_tmp)


def test_json_log_format_refuses_in_json(short_tmp: Path, busy_port: int) -> None:
    import json

    result = serve(short_tmp, "--backend", "cpu", "--metrics-port", str(busy_port), "--set", "daemon.log_format=json")
    entry = json.loads(refused(result, "metrics.port"))
    assert entry["level"] == "error" and entry["exit"] == 2


def test_check_config_finds_the_same_problems(short_tmp: Path, busy_port: int) -> None:
    result = serve(short_tmp, "--check-config", "--backend", "cpu", "--metrics-port", str(busy_port))
    refused(result, "metrics.port", "in use")
    too_big = str(2 * physical_memory())
    refused(serve(short_tmp, "--check-config", "--backend", "cpu", "--capacity", too_big), "host_cache.capacity")
    ok = serve(short_tmp, "--check-config", "--backend", "cpu", "--metrics-port", "0")
    assert ok.returncode == 0, ok.stderr
    assert '"capacity"' in ok.stdout
    nothing_left(short_tmp)


def test_check_config_next_to_the_running_daemon(short_tmp: Path, spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    result = run_cli(["serve", "--check-config", "--backend", "cpu", "--runtime-dir", str(daemon.runtime_dir)],
                        short_tmp)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "is running with this runtime directory" in result.stderr


# A failure that only the daemon itself meets (the port taken after the checks passed): the
# same one line and status, and the daemon's socket, lock and runtime directory are removed.
_SKIP_PREFLIGHT = textwrap.dedent(
    """
    import sys
    import cachexferd.preflight as preflight
    preflight.check = lambda config, **kw: []
    from cachexferd.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_failure_inside_the_daemon_cleans_up(short_tmp: Path, busy_port: int) -> None:
    runtime = short_tmp / "deep" / "rt"
    argv = [sys.executable, "-c", _SKIP_PREFLIGHT, "serve", "--backend", "cpu", "--runtime-dir", str(runtime),
            "--metrics-port", str(busy_port)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env(short_tmp), cwd=REPO)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "metrics.port" in last and "in use" in last, result.stderr
    assert not (short_tmp / "deep").exists(), f"left behind: {sorted(str(p) for p in short_tmp.rglob('*'))}"
