"""Argument types shared by the project's command-line tools."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """'4' -> 4; a clear argparse error for zero, negatives and non-integers."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def positive_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; a clear argparse error for anything else."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated non-negative integers such as 1,4,16; got {text!r}")
    return values
