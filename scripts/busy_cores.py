#!/usr/bin/env python3
"""Does the host tier hold when every core runs a vLLM worker? vLLM's OpenAI server at TP=2,
one worker bound per core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), one daemon per rank, the
plug-in's defaults; the daemons' ``daemon.nice`` takes each value given, in turn.

Each round sends two fresh prompts, resets vLLM's prefix cache and sends them again; a
prompt that comes back with cached tokens was loaded from the daemons. Beside it, every
10 ms, the growth of each daemon thread's run delay (time runnable but not running, from
/proc/<pid>/task/<tid>/schedstat): the largest growth is how long a daemon waited for a core.

    .venv-vllm/bin/python scripts/busy_cores.py --nice 0 -10 0 -10 --rounds 10

Needs vLLM (scripts/setup-vllm.sh) and, for a negative nice, root or CAP_SYS_NICE.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm.rig import make_tiny_model, prompt, start_daemon, transfer_config
from tests.vllm.server import VllmServer


class RunDelays:
    """The largest growth of any thread's run delay between two samples, per process."""

    def __init__(self, pids: list[int], interval_s: float = 0.01) -> None:
        self.pids, self.interval_s, self.worst_ms = pids, interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[Path, int] = {}
        while not self._stop.wait(self.interval_s):
            for pid in self.pids:
                for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
                    try:
                        delay_ns = int(path.read_text().split()[1])
                    except (OSError, IndexError):
                        continue
                    if path in last:
                        self.worst_ms = max(self.worst_ms, (delay_ns - last[path]) / 1e6)
                    last[path] = delay_ns

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.worst_ms


def one_run(root: Path, model: Path, nice: int, rounds: int) -> dict[str, object]:
    settings = {"daemon.nice": nice}
    daemons = [start_daemon(root, f"n{nice}-{rank}", root / f"storage{nice}", rank=rank, **settings) for rank in (0, 1)]
    transfer = transfer_config(f"ipc://{root}/n{nice}-{{rank}}/cmd.sock")
    server = VllmServer(model, root / f"vllm-{nice}.log", transfer, tp=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    cached = []
    try:
        server.start()
        delays = RunDelays([d.process.pid for d in daemons if d.process and d.process.pid])
        for r in range(rounds):
            prompts = [prompt(9000 + 2 * r), prompt(9001 + 2 * r)]
            for p in prompts:
                server.complete(p)
            server.reset()
            cached += [server.complete(p)[2] > 0 for p in prompts]
        worst_ms = delays.stop()
        log = server.log_text()
    finally:
        server.stop()
        for d in daemons:
            d.stop()
    return {
        "nice": nice, "prompts_cached": sum(cached), "prompts": len(cached),
        "rounds_with_a_hit": sum(any(cached[i : i + 2]) for i in range(0, len(cached), 2)), "rounds": rounds,
        "loads_given_up": len(re.findall(r"not done after", log)), "worst_wait_for_a_core_ms": round(worst_ms),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nice", type=int, nargs="+", default=[0, -10], help="daemon.nice of each run, in turn")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cxb-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model")
        for nice in args.nice:
            print(one_run(root, model, nice, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
