"""docs/vllm.md's walk for a small machine, run as written (bash, from the repository's
directory, in a directory and on ports of its own): every answer and metric line it
promises in its comments is what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from .server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- recipe: small machine -->"


def recipe() -> str:
    text = (ROOT / "docs" / "vllm.md").read_text()
    block = re.match(r"\s*```sh\n(.*?)^```", text.split(MARKER, 1)[1], re.S | re.M)
    assert block, f"docs/vllm.md has no sh block after {MARKER}"
    return block.group(1)


def promised(script: str) -> tuple[list[str], list[str]]:
    """What the comments say it prints: the answers (``ask  # cached_tokens: N``) and the
    metric lines (comment lines that are a metric sample)."""
    answers = re.findall(r"^ask\s+#\s*(cached_tokens: \d+)$", script, re.M)
    samples = re.findall(r"^#\s*(cachexferd_\w+\{.*\} [\d.]+)$", script, re.M)
    return answers, samples


def test_the_recipe_finds_what_it_promises() -> None:
    answers, samples = promised(recipe())
    assert answers[0] == "cached_tokens: 0" and int(answers[1].split()[1]) > 0, answers
    assert samples, "the recipe shows the metrics it expects"


def test_the_small_machine_recipe_runs_as_written() -> None:
    script = recipe()
    answers, samples = promised(script)
    with tempfile.TemporaryDirectory(prefix="cxr-") as cx:
        env = {**os.environ, "CX": cx, "PORT": str(free_port()), "METRICS": str(free_port())}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the tests' setting; a user has vLLM's default
        try:
            out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=800, start_new_session=True)  # fmt: skip
        finally:
            # Whatever the recipe left running (it stops both itself when it gets to its end).
            subprocess.run(["pkill", "-KILL", "-f", f"--runtime-dir {cx}/run"], check=False)
            subprocess.run(["pkill", "-KILL", "-f", f"--port {env['PORT']}"], check=False)
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in Path(cx).glob("*.log"))
        shown = f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-3000:]}\n{logs}"
        assert out.returncode == 0, shown
        printed = out.stdout.splitlines()
        assert [line for line in printed if line.startswith("cached_tokens:")] == answers, shown
        for sample in samples:
            name = sample.rsplit(" ", 1)[0]
            got = [line for line in printed if line.startswith(name + " ")]
            assert got and float(got[0].rsplit(" ", 1)[1]) >= 1, f"{name}: {got}\n{shown}"
        assert any("worker rank 0 done" in line for line in printed), shown
        # cachexferd status after vLLM stopped: the daemon serves on, free for the next vLLM,
        # with the prompt's blocks in storage (write-through, the plug-in's default).
        assert re.search(r"^device cache\s+detached$", out.stdout, re.M), shown
        stored = re.search(r"objects=(\d+)", out.stdout)
        assert stored and int(stored.group(1)) >= int(answers[1].split()[1]) // 128, shown
