"""The command as installed: version, extras, default ports, demo progress, bench plots."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import cachexferd
from cachexferd.config import DEFAULT_METRICS_PORT, load_config

from .helpers import REPO, clean_env, run_cli

# Ports that other software on GPU inference hosts listens on by default.
TAKEN = {
    "Prometheus exporters (node 9100, dcgm 9400, ...)": range(9100, 10000),
    "vLLM / Triton / SGLang": (8000, 8001, 8002, 30000),
    "torch.distributed / torchrun": (29400, 29500),
    "Mooncake (master 50051, metadata 8080)": (50051, 8080),
    "Redis, Ray GCS": (6379,),
    "Grafana": (3000,),
}
RANKS = 16  # metrics of ranks 0..15 must fit in the free range


def test_version() -> None:
    result = run_cli(["--version"], Path("/tmp"))
    assert result.returncode == 0 and result.stdout.strip().startswith(f"cachexferd {cachexferd.__version__} ")


def test_extras_and_entry_point() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["cachexferd"] == "cachexferd.cli:main"
    extras = project["optional-dependencies"]
    assert {"redis", "mooncake", "cuda", "plots", "test", "dev"} <= set(extras)
    assert any(d.startswith("hypothesis") for d in extras["test"])
    assert not any("torch" in d and "+" in d for d in project["dependencies"]), "the torch build is the installer's"


def test_default_metrics_ports_avoid_common_services() -> None:
    ports = range(DEFAULT_METRICS_PORT, DEFAULT_METRICS_PORT + RANKS)
    for owner, taken in TAKEN.items():
        assert not set(ports) & set(taken), f"metrics ports collide with {owner}"
    assert ports[-1] < 32768, "inside the kernel's ephemeral port range"
    assert load_config(overrides={"daemon.rank": 3}, environ={}).metrics_port == DEFAULT_METRICS_PORT + 3


def test_demo_reports_progress_at_once_and_no_stale_urls(short_tmp: Path) -> None:
    argv = [sys.executable, "-m", "cachexferd", "demo", "--storage", "none", "--rounds", "1", "--blocks", "32"]
    started = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(short_tmp),
                          cwd=REPO) as proc:  # fmt: skip
        assert proc.stdout is not None
        first = proc.stdout.readline()
        first_after = time.monotonic() - started
        try:
            rest, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, rest + err
    assert first.startswith("cachexferd demo:")
    # Aim: under a second (it is ~0.6 s here); the bound leaves room for a loaded machine.
    assert first_after < 3.0, f"first output after {first_after:.1f} s"
    lines = rest.splitlines()
    assert lines[-1] == "demo swap: OK"
    urls = [line for line in lines if "http://" in line]
    assert len(urls) == 2 and all("until the demo ends" in line for line in urls)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed (extra plots)")
@pytest.mark.parametrize("kind", ["swap", "storage"])
def test_bench_plot(short_tmp: Path, kind: str) -> None:
    png = short_tmp / f"{kind}.png"
    args = {
        "swap": ["--sizes", "64KiB", "--counts", "4", "--min-time", "0.01", "--patterns", "contiguous"],
        "storage": ["--backends", "file", "--blocks", "4", "--rounds", "1", "--block-bytes", "64KiB"],
    }[kind]
    result = run_cli(["bench", kind, *args, "--plot", str(png)], short_tmp, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in result.stdout


def test_bench_journal_reports_every_row(short_tmp: Path) -> None:
    out = short_tmp / "journal.json"
    args = ["--objects", "64", "--per-store", "1,16", "--pace-us", "0,1000", "--pace-s", "0.02", "--rounds", "1",
            "--live-ms", "5,20", "--live-records", "4"]  # fmt: skip
    result = run_cli(["bench", "journal", *args, "--path", str(short_tmp / "store"), "--json", str(out)], short_tmp,
                     timeout_s=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["per_store"], r["pace_us"]) for r in rows] == [(1, 0), (1, 1000), (16, 0), (16, 1000)]
    for row in rows:
        assert row["writer_us"] > 0 and row["writer_alone_us"] > 0 and row["follower_us"] > 0 and row["raw_us"] > 0
        assert row["stores_per_write"] >= 1.0
    assert rows[0]["stores_per_write"] > 1.0, "64 one-object STOREs back to back shared writes"
    assert f"{'1':>13}  {'0':>7}" in result.stdout
    live = json.loads(out.read_text())["live"]
    assert [(r["pace_ms"], r["records"]) for r in live] == [(5, 4), (20, 4)]
    assert all(r["follower_us"] > 0 and r["bare_us"] > 0 for r in live), live
    assert "another daemon following one-object STOREs as they come" in result.stdout


def test_bench_small_stores_reports_both_rows(short_tmp: Path) -> None:
    out = short_tmp / "small.json"
    args = ["--stores", "40", "--rounds", "1", "--window", "4", "--blocks", "2", "--block-bytes", "8KiB"]
    result = run_cli(["bench", "small-stores", *args, "--path", str(short_tmp / "store"), "--json", str(out)],
                     short_tmp, timeout_s=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["window"], r["blocks"], r["stores"], r["failed"]) for r in rows] == [(1, 2, 40, 0), (4, 2, 40, 0)]
    for row in rows:
        assert row["daemon_cpu_us"] > 0 and row["raw_put_cpu_us"] > 0 and row["over_floor"] > 0
        assert 0 < row["daemon_p50_ms"] <= row["daemon_p99_ms"]
    stored = list((short_tmp / "store" / "daemon").glob("??/??/*"))
    assert len(stored) == 2 * 40 * 2 * 2, "every STORE of both rounds of both rows wrote its objects"
    assert "daemon/floor" in result.stdout
