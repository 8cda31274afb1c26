"""The documented group deployment survives a runner crash, with real users: the daemon runs
as one user with ``access.group``, runners as another user of that group create their caches
with ``ShmKVCache(group=)``. A runner killed with SIGKILL is detached; the daemon, which may
not unlink the runner's file in the sticky /dev/shm, empties it (frees the memory), logs no
stray task error, and the next runner's attach and detach work without the daemon touching
that runner's segment."""

from __future__ import annotations

import grp
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachexferd.status import fetch_status

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates users and runs processes as them")

GROUP, DAEMON_USER, RUNNER_USER = "cx-test-kv", "cx-test-daemon", "cx-test-runner"
ROOT = Path(__file__).resolve().parents[2]

RUNNER = textwrap.dedent(
    """
    import os, sys, time
    from cachexferd.client.runner import RunnerClient, ShmKVCache
    from cachexferd.protocol import KVLayout

    endpoint, group, mode = sys.argv[1:4]
    layout = KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=32, dtype="float16")
    cache = ShmKVCache(layout, group=group)
    runner = RunnerClient(endpoint, timeout_s=20)
    runner.attach(cache)
    print("attached", cache.path, flush=True)
    if mode == "crash":
        time.sleep(600)  # killed by the test
    reply = runner.detach()
    print("detached", reply["state"], "segment still there:", os.path.exists(cache.path), flush=True)
    cache.close()
    runner.close()
    """
)


def _ensure_account(name: str, *args: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *args, name],
                       check=True, capture_output=True)  # fmt: skip


@pytest.fixture(scope="module")
def accounts() -> tuple[int, int, int]:
    """(daemon uid, runner uid, group gid), created once if missing."""
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", GROUP], check=True, capture_output=True)
    _ensure_account(DAEMON_USER, "--gid", GROUP)
    _ensure_account(RUNNER_USER, "--groups", GROUP)
    _skip_unless_importable_by(DAEMON_USER)
    return pwd.getpwnam(DAEMON_USER).pw_uid, pwd.getpwnam(RUNNER_USER).pw_uid, grp.getgrnam(GROUP).gr_gid


def _skip_unless_importable_by(user: str) -> None:
    """The test's users run this checkout's code: a checkout (or venv) in a directory other
    users may not enter, e.g. one made by ``mktemp -d``, cannot be tested this way."""
    probe = subprocess.run(as_user(user, [sys.executable, "-c", "import cachexferd"]), capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd="/")  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"user {user} cannot import cachexferd from {ROOT} (not readable by other users?): {last}")


def as_user(user: str, argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups", *argv]


@pytest.fixture
def group_daemon(accounts: tuple[int, int, int], short_tmp: Path) -> Iterator[tuple[str, Path]]:
    """A cpu daemon running as DAEMON_USER with access.group = GROUP: (endpoint, its log)."""
    daemon_uid, _, gid = accounts
    short_tmp.chmod(0o755)
    runtime = short_tmp / "rt"
    runtime.mkdir()
    os.chown(runtime, daemon_uid, gid)
    log = short_tmp / "daemon.log"
    settings = {"daemon.runtime_dir": str(runtime), "daemon.backend": "cpu", "access.group": GROUP,
                "metrics.port": 0, "host_cache.capacity": "8MiB", "storage.backend": "none"}  # fmt: skip
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    argv = [sys.executable, "-m", "cachexferd", "serve", *sets]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(short_tmp)}
    with log.open("wb") as out:
        proc = subprocess.Popen(as_user(DAEMON_USER, argv), stdout=out, stderr=subprocess.STDOUT, env=env)
    endpoint = f"ipc://{runtime / 'cmd.sock'}"
    try:
        _wait(lambda: _status(endpoint) is not None, 60, lambda: f"daemon did not start: {log.read_text()[-2000:]}")
        yield endpoint, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _status(endpoint: str) -> dict[str, object] | None:
    try:
        return fetch_status(endpoint, timeout_s=1.0)
    except Exception:
        return None


def _wait(ready: object, timeout_s: float, message: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(message if isinstance(message, str) else message())


def _runner(endpoint: str, mode: str, home: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)}
    argv = as_user(RUNNER_USER, [sys.executable, "-c", RUNNER, endpoint, GROUP, mode])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _device_state(endpoint: str) -> str:
    status = _status(endpoint) or {}
    device = status.get("device", {})
    return str(device.get("state")) if isinstance(device, dict) else ""


def test_runner_killed_in_the_group_deployment(group_daemon: tuple[str, Path], short_tmp: Path) -> None:
    endpoint, log = group_daemon
    crashed = _runner(endpoint, "crash", short_tmp)
    try:
        assert crashed.stdout is not None
        line = crashed.stdout.readline()
        assert line.startswith("attached"), line + (crashed.stderr.read() if crashed.stderr else "")
        segment = Path(line.split()[1])
        assert segment.stat().st_uid == pwd.getpwnam(RUNNER_USER).pw_uid
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(10)
        _wait(lambda: _device_state(endpoint) == "detached", 20, "the dead runner was not detached")
        _wait(lambda: "segment" in log.read_text(), 10, "nothing logged about the dead runner's segment")
        # The daemon (another user) may not unlink it in the sticky /dev/shm; it emptied it.
        assert segment.exists() and segment.stat().st_size == 0, "the dead runner's memory was not freed"
        assert "emptied the dead runner's segment" in log.read_text()

        nxt = _runner(endpoint, "normal", short_tmp)
        out, err = nxt.communicate(timeout=60)
        assert nxt.returncode == 0, err[-3000:]
        assert "detached detached segment still there: True" in out, out
    finally:
        crashed.kill()
        crashed.wait(10)
        for path in Path("/dev/shm").glob(f"cachexferd-kv-{crashed.pid}-*"):
            path.unlink()
    text = log.read_text()
    for bad in ("Task exception was never retrieved", "Traceback", "INTERNAL"):
        assert bad not in text, f"daemon log has {bad!r}:\n{text[-3000:]}"
