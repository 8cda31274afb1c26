"""``cachexferd bench swap`` (placeholder until written)."""

from __future__ import annotations

import argparse


def add_swap_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=lambda args: 1)
