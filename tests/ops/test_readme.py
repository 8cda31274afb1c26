"""The README's first run, pasted into a shell as written: two daemons, the runners and the
engine in one Python process, every byte checked, the daemons stopped.

One substitution, the only one: the README puts the daemons' runtime directories under
``/tmp/cxd``; here they go to a private temporary directory. Everything else (commands,
layout, ids, checks) is the README's text. The Python fragments of the README (parts of a
long-running engine and runner) must at least be valid Python.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from .helpers import REPO, clean_env

README = REPO / "README.md"
RUNTIME = "/tmp/cxd"
DONE = "swapped blocks 3-5 out and into 9-11 on both ranks: every byte checked"


def first_run() -> str:
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), re.DOTALL) if "EngineClient(" in b]
    assert len(blocks) == 1, "expected one shell sequence with the runners and the engine"
    assert blocks[0].count(RUNTIME) >= 4  # the two daemons and the two sockets
    return blocks[0]


def run_shell(script: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` with bash, ``cachexferd`` and ``python3`` from this venv, in a session
    of its own that is killed (daemons included) if it overruns."""
    env = clean_env(tmp, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    with subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=tmp, start_new_session=True) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"the README sequence did not finish:\n{out}\n{err}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # nothing of it may outlive the test
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_first_run_swaps_and_checks_every_byte(short_tmp: Path) -> None:
    result = run_shell(first_run().replace(RUNTIME, str(short_tmp / "cxd")), short_tmp)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == DONE, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    for rank in (0, 1):  # both daemons stopped cleanly: no socket, no lock left
        runtime = short_tmp / "cxd" / str(rank)
        assert runtime.is_dir() and sorted(p.name for p in runtime.iterdir()) == []
        assert f"rank {rank} serving on ipc://{runtime}/cmd.sock" in result.stderr


def test_first_run_notices_misplaced_blocks(short_tmp: Path) -> None:
    """The sequence's own check can fail: swapped into other blocks, it says so."""
    script = first_run().replace(RUNTIME, str(short_tmp / "cxd"))
    wrong = script.replace("device_ids=[9, 10, 11]", "device_ids=[9, 10, 12]")
    assert wrong != script
    result = run_shell(wrong, short_tmp)
    assert "AssertionError: the swapped-in blocks differ" in result.stderr, result.stderr[-4000:]
    assert DONE not in result.stdout


def test_fragments_are_python() -> None:
    fragments = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(fragments) >= 2
    for code in fragments:
        ast.parse(code)
