"""Argument parsing for ``cachexferd bench``; each benchmark lives in its own module."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure copy and storage throughput against a raw baseline")
    kinds = p.add_subparsers(dest="bench", required=True)
    from .swap import add_swap_args

    add_swap_args(kinds.add_parser("swap", help="swap-out / swap-in GB/s vs a raw contiguous copy"))
    from .storage import add_storage_args

    add_storage_args(kinds.add_parser("storage", help="store / load GB/s per backend vs its raw client"))
    from .commands import add_commands_args

    add_commands_args(kinds.add_parser("commands", help="commands/s of a daemon vs a bare pyzmq loop"))


def run_bench(args: argparse.Namespace) -> int:
    result: int = args.bench_func(args)
    return result
