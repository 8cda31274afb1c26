"""``cachexferd bench swap`` with the vLLM shapes: option handling, and a tiny run on the cpu
backend (the CI smoke test of what a GPU host runs with ``--backend cuda``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachexferd.bench.swap import (
    SwapHarness,
    add_swap_args,
    apply_preset,
    block_sizes,
    cases,
    measure_case,
    methods_for,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_swap_args(parser)
    args = parser.parse_args(list(argv))
    apply_preset(args)
    return args


def test_vllm_preset_sizes_blocks_by_their_pieces() -> None:
    args = parse("--backend", "cuda", "--preset", "vllm")
    assert block_sizes(args) == [4 << 16, 16 << 16, 32 << 16]  # piece x 32 layers x 2
    assert (args.patterns, args.directions, args.counts) == ("scattered", "d2h,h2d,both", "1,16,128,1024")
    assert methods_for(args) == ["auto", "dma", "staging", "kernel"]
    assert (2 << 20, 1) in set(cases(args)), "a single block of 2 MiB (32 KiB pieces)"
    assert max(size * count for size, count in cases(args)) <= 512 << 20  # --max-bytes
    explicit = parse("--backend", "cuda", "--preset", "vllm", "--counts", "16", "--methods", "kernel")
    assert explicit.counts == "16" and methods_for(explicit) == ["kernel"]
    assert methods_for(parse("--preset", "vllm")) == ["-"]  # cpu has one method
    with pytest.raises(SystemExit):
        methods_for(parse("--backend", "cuda", "--methods", "magic"))


def test_defaults_are_unchanged_without_a_preset() -> None:
    args = parse()
    assert block_sizes(args)[0] == 16 << 10 and args.layers == 32 and args.patterns == "contiguous,scattered"


def test_vllm_shapes_run_on_the_cpu_backend(short_tmp: Path) -> None:
    out = short_tmp / "bench.json"
    argv = [sys.executable, "-m", "cachexferd", "bench", "swap", "--preset", "vllm", "--pieces", "4KiB,16KiB",
            "--counts", "1,8", "--layers", "2", "--min-time", "0.01", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["piece_bytes"], r["blocks"], r["direction"]) for r in rows} == {
        (p, c, d) for p in (4096, 16384) for c in (1, 8) for d in ("d2h", "h2d", "both")
    }
    assert all(r["pattern"] == "scattered" and r["method"] == "-" for r in rows)
    assert all(r["swap_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    assert "load_average" in data["machine"] and "torch" in data["machine"]
    assert "piece" in proc.stdout and "load" in proc.stdout


@pytest.mark.parametrize("direction", ["d2h", "both"])
def test_in_flight_submits_that_many_swaps_at_once_over_disjoint_blocks(direction: str) -> None:
    import asyncio
    import random

    args = parse("--sizes", "64KiB", "--counts", "8", "--layers", "2", "--in-flight", "3", "--min-time", "0.01")
    assert list(cases(args)) == [(64 << 10, 8)]
    assert list(cases(parse("--sizes", "64KiB", "--counts", "8", "--in-flight", "3", "--max-bytes", "1MiB"))) == []
    harness = SwapHarness(args, 64 << 10, 8)
    calls: list[tuple[str, list[int], list[int]]] = []
    in_flight = most = 0
    real_swap = harness.kit.device.swap

    async def counting_swap(d: object, ids: list[int], hosts: list[int], token: object) -> int:
        nonlocal in_flight, most
        calls.append((str(d), list(ids), list(hosts)))
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001)  # let the others be submitted before this one ends
        try:
            moved: int = await real_swap(d, ids, hosts, token)  # type: ignore[arg-type]
            return moved
        finally:
            in_flight -= 1

    harness.kit.device.swap = counting_swap  # type: ignore[method-assign]
    try:
        swap_gbps, raw_gbps, times = measure_case(harness, direction, "scattered", 8, random.Random(1))
    finally:
        harness.close()
    assert swap_gbps > 0 and raw_gbps > 0 and len(times.swap) >= 4 and len(times.raw) >= 4
    per_round = 3 if direction == "d2h" else 6  # both: each swap's pairs split, half out and half in
    assert len(calls) % per_round == 0 and most == per_round
    first = calls[:per_round]
    devices = [i for _, ids, _ in first for i in ids]
    hosts = [h for _, _, hs in first for h in hs]
    assert len(devices) == len(set(devices)) == 24 and len(hosts) == len(set(hosts)) == 24


def test_rows_carry_the_fixed_cost_beside_the_ratio(short_tmp: Path) -> None:
    """One uvloop loop, swaps timed one after another: each row has its fixed cost (µs over
    the raw copy's median, median and 90th percentile round), the 90th never below the median."""
    out = short_tmp / "bench.json"
    argv = [sys.executable, "-m", "cachexferd", "bench", "swap", "--sizes", "64KiB", "--counts", "1,4",
            "--layers", "2", "--patterns", "scattered", "--directions", "d2h", "--min-time", "0.05",
            "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["fixed_p90_us"] >= r["fixed_p50_us"] for r in rows), rows
    assert "fixed us p50/p90" in proc.stdout


def test_cuda_fake_reports_loop_cpu_per_unit_against_a_bare_loop(short_tmp: Path) -> None:
    out = short_tmp / "cost.json"
    argv = [sys.executable, "-m", "cachexferd", "bench", "swap", "--backend", "cuda-fake", "--pieces", "4KiB",
            "--counts", "16", "--layers", "2", "--min-time", "0.1", "--in-flight", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["direction"], r["blocks"], r["in_flight"]) for r in rows} == {("d2h", 16, 2), ("h2d", 16, 2)}
    for r in rows:
        assert r["cpu_us"] > 0 and r["bare_us"] > 0 and r["net_us"] == r["cpu_us"] - r["bare_us"]
        assert 0.5 <= r["polls"] <= 2, "an inline unit is settled by the next doorbell read"
    assert "net loop CPU per unit at 16 blocks" in proc.stdout
