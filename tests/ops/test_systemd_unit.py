"""The systemd template unit: what it promises, `systemd-analyze verify` clean, and an
exposure score of at most 3 from `systemd-analyze security` (where systemd-analyze exists)."""

from __future__ import annotations

import grp
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cachexferd.launch import DaemonProcess
from cachexferd.preflight import EXIT_CONFIG

from .helpers import REPO

UNIT = REPO / "systemd" / "cachexferd@.service"
INSTALLED_BINARY = "/opt/cachexferd/venv/bin/cachexferd"
MAX_EXPOSURE = 3.0


def settings() -> dict[str, list[str]]:
    """key -> values (systemd allows a key more than once)."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_promises() -> None:
    s = settings()
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"]
    assert s["RestartPreventExitStatus"] == [str(EXIT_CONFIG)]  # configuration errors are not retried
    assert s["ExecStart"][0].startswith(INSTALLED_BINARY + " serve ") and "--rank %i" in s["ExecStart"][0]
    assert s["RuntimeDirectory"] == ["cachexferd/%i"] and s["StateDirectory"] == ["cachexferd"]
    assert s["ProtectSystem"] == ["strict"] and s["NoNewPrivileges"] == ["yes"] and s["CapabilityBoundingSet"] == [""]
    # /dev/shm is how runners share their caches, /dev/nvidia* how CUDA works: both stay open.
    for forbidden in ("PrivateDevices", "DevicePolicy", "PrivateIPC", "RemoveIPC", "MemoryDenyWriteExecute"):
        assert forbidden not in s, f"{forbidden}= would break shared memory, CUDA or torch"


def test_install_path_is_the_documented_one() -> None:
    docs = (REPO / "docs" / "operations.md").read_text()
    assert INSTALLED_BINARY in docs and "python3 -m venv /opt/cachexferd/venv" in docs


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    help_text = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--offline" not in help_text:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    return tool


def _local_copy(tmp: Path) -> Path:
    """The unit with ExecStart on this machine's cachexferd (verify checks that it exists),
    instantiated as cachexferd@0.service."""
    binary = shutil.which("cachexferd", path=str(Path(sys.executable).parent)) or shutil.which("cachexferd")
    if binary is None:
        pytest.skip("no cachexferd executable to point ExecStart at (pip install -e . first)")
    (tmp / UNIT.name).write_text(UNIT.read_text().replace(INSTALLED_BINARY, binary))
    instance = tmp / "cachexferd@0.service"
    instance.symlink_to(UNIT.name)
    return instance


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    tool = _analyze()
    unit = _local_copy(tmp_path)
    result = subprocess.run([tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120)
    ours = [line for line in (result.stdout + result.stderr).splitlines() if "cachexferd" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    tool = _analyze()
    unit = _local_copy(tmp_path)
    result = subprocess.run(
        [tool, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout + result.stderr)
    assert match, result.stdout + result.stderr
    score = float(match.group(1))
    print(f"systemd-analyze security: {score}")
    assert score <= MAX_EXPOSURE, result.stdout


def test_group_reaches_the_socket_under_the_units_umask(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    umask = int(settings()["UMask"][0], 8)
    assert any(e.startswith("CACHEXFERD_ACCESS_GROUP=") for v in settings()["Environment"] for e in v.split())
    group = grp.getgrgid(os.getgid()).gr_name  # the unit names its service group; here, ours
    old = os.umask(umask)  # the daemon subprocess inherits it, as under systemd
    try:
        daemon = spawn_daemon(settings={"access.group": group})
    finally:
        os.umask(old)
    mode = os.stat(daemon.endpoint[len("ipc://") :]).st_mode
    assert stat.S_ISSOCK(mode) and mode & 0o060 == 0o060, oct(mode)  # connect() needs write permission
    assert mode & 0o007 == 0, oct(mode)
