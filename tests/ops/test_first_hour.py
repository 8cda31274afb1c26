"""What a newcomer meets in the first hour: `serve --check-config` tells the truth about
storage paths and shows the values it will use, every configuration problem at once in one
style, `status` and `demo` that fail at once when there is nothing to ask, and a daemon that
cleans up after itself (its lock file; a storage directory only its group can enter)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cachexferd.launch import DaemonProcess
from cachexferd.storage.file import FileBackend

from .helpers import REPO, clean_env, run_cli
from .test_file_storage_limits import put

Spawn = Callable[..., DaemonProcess]


def check_config(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = ["serve", "--check-config", "--backend", "cpu", "--runtime-dir", str(tmp / "rt"), "--metrics-port", "0"]
    return run_cli([*base, *args], tmp, **env)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr.strip().splitlines()


# Storage paths that can never work ---------------------------------------------------------


def test_a_regular_file_as_storage_path_is_refused_as_such(short_tmp: Path) -> None:
    (short_tmp / "kv").write_text("a file, not a directory")
    [line] = error_lines(check_config(short_tmp, "--storage-path", str(short_tmp / "kv")))
    assert "storage.file.path (from flag storage.file.path)" in line and "is a regular file, not a directory" in line
    assert "not writable" not in line


def test_a_storage_path_below_a_regular_file_is_refused(short_tmp: Path) -> None:
    (short_tmp / "kv").write_text("a file")
    [line] = error_lines(check_config(short_tmp, "--storage-path", str(short_tmp / "kv" / "objects")))
    assert f"cannot be created: {short_tmp / 'kv'} is a regular file" in line


def test_a_storage_path_in_proc_is_refused_as_such(short_tmp: Path) -> None:
    [line] = error_lines(check_config(short_tmp, "--storage-path", "/proc/cachexferd-x"))
    assert "proc file system" in line and "capacity" not in line


def test_a_storage_path_not_created_yet_is_accepted_and_shown(short_tmp: Path) -> None:
    result = check_config(short_tmp, "--storage-path", str(short_tmp / "later" / "kv"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["resolved"]["storage_path"] == str(short_tmp / "later" / "kv")
    assert not (short_tmp / "later").exists()


# What will be used -----------------------------------------------------------------------------


def test_check_config_prints_the_resolved_values(short_tmp: Path) -> None:
    argv = ["serve", "--check-config", "--backend", "cpu", "--rank", "2"]
    result = run_cli(argv, short_tmp, XDG_RUNTIME_DIR=str(short_tmp / "xdg"))
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    resolved = shown["resolved"]
    runtime = str(short_tmp / "xdg" / "cachexferd" / "2") if os.geteuid() else "/run/cachexferd/2"
    assert resolved["runtime_dir"] == runtime
    assert resolved["endpoint"] == f"ipc://{runtime}/cmd.sock"
    assert resolved["storage_path"] == str(short_tmp / "state" / "storage")  # STATE_DIRECTORY (clean_env)
    assert resolved["metrics"] == "http://127.0.0.1:18702/metrics"  # port 18700 + rank 2
    assert shown["metrics"]["port"] == 18700 and shown["daemon"]["endpoint"] == ""  # the settings as given


# Every problem at once, in one style -------------------------------------------------------------


def test_every_problem_at_once_in_one_style(short_tmp: Path) -> None:
    config = short_tmp / "c.toml"
    config.write_text(
        '[daemon]\nrank = "zero"\nbakend = "cpu"\n[metrics]\nport = "18700"\nenabled = "yes"\n'
        '[host_cache]\ncapacity = "lots"\ncopy_threads = 2.5\n'
    )
    lines = error_lines(run_cli(["serve", "--check-config", "--config", str(config)], short_tmp))
    assert len(lines) == 6, lines
    assert all(line.startswith("cachexferd: invalid configuration: ") for line in lines), lines
    by_key = {line.split(": ")[2].split(" ")[0]: line for line in lines}
    assert "expected an integer, got 'zero'" in by_key["daemon.rank"]
    assert "int()" not in "".join(lines) and "invalid literal" not in "".join(lines)
    assert "did you mean 'backend'" in by_key["unknown"]
    assert (
        "expected an integer, got the string '18700' (a TOML file takes 18700, without quotes)"
        in by_key["metrics.port"]
    )
    assert "expected a bool (true or false), got the string 'yes'" in by_key["metrics.enabled"]
    assert "expected a size" in by_key["host_cache.capacity"]
    assert "expected an integer, got a number (2.5)" in by_key["host_cache.copy_threads"]


def test_text_is_parsed_from_the_environment_and_flags_only(short_tmp: Path) -> None:
    ok = check_config(short_tmp, "--set", "metrics.enabled=no", CACHEXFERD_DAEMON_RANK="3")
    assert ok.returncode == 0, ok.stderr
    shown = json.loads(ok.stdout)
    assert shown["daemon"]["rank"] == 3 and shown["metrics"]["enabled"] is False
    [line] = error_lines(check_config(short_tmp, CACHEXFERD_DAEMON_RANK="zero"))
    assert line.endswith("daemon.rank (from env CACHEXFERD_DAEMON_RANK): expected an integer, got 'zero'")


# Commands that have nothing to ask ------------------------------------------------------------------


def test_status_without_a_socket_file_answers_at_once(short_tmp: Path) -> None:
    started = time.monotonic()
    result = run_cli(["status", "--endpoint", f"ipc://{short_tmp}/cmd.sock", "--timeout", "60"], short_tmp)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "is the daemon running?" in result.stderr
    assert elapsed < 30, f"waited {elapsed:.0f} s for a socket file that does not exist"


def test_demo_with_redis_missing_fails_at_once_with_one_line(short_tmp: Path) -> None:
    result = run_cli(["demo", "--storage", "redis"], short_tmp, timeout_s=60, CXTEST_REDIS_SERVER="/nonexistent")
    lines = error_lines(result)
    assert len(lines) == 1 and "demo --storage redis" in lines[0], lines
    assert "redis-server" in lines[0] and "--storage-url" in lines[0]
    assert result.stdout == "", "the demo started something before finding out"


# Clean-up ---------------------------------------------------------------------------------------------


def test_a_clean_stop_removes_the_lock_and_the_socket(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    assert (daemon.runtime_dir / "daemon.lock").exists()
    assert daemon.stop() == 0
    left = sorted(p.name for p in daemon.runtime_dir.iterdir() if p.name != "daemon.log")
    assert left == [], f"a clean stop left {left}"


def test_a_restart_after_a_clean_stop_takes_the_lock_again(spawn_daemon: Spawn) -> None:
    first = spawn_daemon()
    first.stop()
    again = DaemonProcess(first.runtime_dir, settings=first.settings)
    try:
        assert again.start()["state"] == "running"
        assert (first.runtime_dir / "daemon.lock").read_text().strip() == str(again.process and again.process.pid)
    finally:
        assert again.stop() == 0


def test_the_storage_directory_is_created_for_the_group_only(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a root shell's usual umask: directories would come out 0755
    try:
        fb = FileBackend(tmp_path / "lib" / "storage")
        put(fb, "k")
        fb.close()
    finally:
        os.umask(old)
    for path in (tmp_path / "lib", tmp_path / "lib" / "storage"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o750, f"{path} is {stat.S_IMODE(path.stat().st_mode):o}"


def test_an_uncreatable_storage_directory_says_why_in_status(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    fb = FileBackend(tmp_path / "file" / "storage")
    fb.start()
    try:
        assert fb.describe()["state"] == "unavailable: cannot be created by this user"
    finally:
        fb.close()


def test_serve_logs_the_resolved_values(short_tmp: Path) -> None:
    argv = [sys.executable, "-m", "cachexferd", "serve", "--backend", "cpu", "--runtime-dir", str(short_tmp / "rt"),
            "--metrics-port", "0", "--capacity", "16MiB"]  # fmt: skip
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=clean_env(short_tmp), cwd=REPO) as proc:
        assert proc.stderr is not None
        watchdog = threading.Timer(120, proc.kill)  # the read below must not hang
        watchdog.start()
        try:
            line = next((line for line in proc.stderr if "effective config" in line), "")
        finally:
            watchdog.cancel()
            proc.terminate()
            proc.wait(30)
    effective = json.loads(line.split("effective config: ", 1)[1])
    assert effective["resolved"]["endpoint"] == f"ipc://{short_tmp / 'rt'}/cmd.sock"


def test_a_refused_second_daemon_leaves_the_first_ones_lock(short_tmp: Path, spawn_daemon: Spawn) -> None:
    """A second daemon on the same directory is refused and leaves the first one's lock alone."""
    first = spawn_daemon()
    result = run_cli(["serve", "--backend", "cpu", "--runtime-dir", str(first.runtime_dir)], short_tmp)
    assert result.returncode == 2 and "another cachexferd is running" in result.stderr
    assert (first.runtime_dir / "daemon.lock").read_text().strip() == str(first.process and first.process.pid)
