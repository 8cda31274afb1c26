"""The daemon's CPU priority (docs/operations.md, "CPU priority"): a real daemon raises the
nice value of every one of its threads and of its session's autogroup where it may, keeps
it with one log line where it may not, and leaves it alone with ``daemon.nice = 0``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachexferd.launch import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]


def thread_nices(pid: int) -> set[int]:
    """The nice value of each thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    values = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        values.add(int(fields[16]))  # field 19 counted from 1; the text after ')' starts at field 3
    return values


def autogroup_nice(pid: int) -> int | None:
    path = Path(f"/proc/{pid}/autogroup")
    return int(path.read_text().split("nice")[1]) if path.exists() else None


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a nice value needs root or CAP_SYS_NICE")
def test_the_daemon_runs_every_thread_at_its_nice_value(spawn_daemon: Any) -> None:
    daemon = spawn_daemon()
    assert daemon.process.pid is not None
    assert thread_nices(daemon.process.pid) == {-10}, "every thread, also those started after the setting"
    if autogroup_nice(daemon.process.pid) is not None:
        assert autogroup_nice(daemon.process.pid) == -10, "its session's group (the daemon has a session of its own)"
    assert "CPU priority: nice -10" in daemon.log_tail(200)


def test_nice_zero_leaves_the_priority_alone(spawn_daemon: Any) -> None:
    daemon = spawn_daemon(settings={"daemon.nice": 0})
    assert thread_nices(daemon.process.pid) == {0}
    assert "CPU priority: nice 0" in daemon.log_tail(200)


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="drops CAP_SYS_NICE with util-linux's setpriv")
def test_without_the_right_it_keeps_its_priority_and_says_why(short_tmp: Path) -> None:
    """A real daemon whose process may not raise its priority (CAP_SYS_NICE dropped): it
    starts, serves, keeps nice 0 and says why in its log."""
    daemon = DaemonProcess(short_tmp / "nocap", settings={"metrics.port": 0, "host_cache.capacity": "16MiB"},
                           prefix=[str(SETPRIV), "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"])  # fmt: skip
    daemon.start()
    try:
        assert daemon.process is not None and daemon.process.pid is not None
        assert thread_nices(daemon.process.pid) == {0}
        assert "CPU priority kept at nice 0: nice -10 needs root or CAP_SYS_NICE" in daemon.log_tail(200)
    finally:
        daemon.stop(timeout_s=20)


def test_a_lower_priority_needs_no_right() -> None:
    code = "from cachexferd.priority import raise_priority; import os; print(raise_priority(5)); " \
           "print(os.getpriority(os.PRIO_PROCESS, 0))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         start_new_session=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    line, nice = out.stdout.splitlines()
    assert line.startswith("CPU priority: nice 5"), line
    assert nice == "5"
