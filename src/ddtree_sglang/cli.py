"""What the project's command-line tools share: argument types that refuse bad values with a
clear message, and a parser / runner that turn every input error into one line and exit 2."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable


class CliError(Exception):
    """Bad input found after parsing (a missing file, a limit); the message is the whole report."""


class Parser(argparse.ArgumentParser):
    """argparse, with an error reported as one line (`prog: error: ...`) instead of usage + error."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def run(main: Callable[[], int | None], prog: str) -> int:
    """Call a tool's main; a CliError becomes one line on stderr and exit code 2."""
    try:
        return int(main() or 0)
    except CliError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def positive_int(text: str) -> int:
    """'4' -> 4; a clear argparse error for zero, negatives and non-integers."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0; got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0; got {text!r}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number; got {text!r}")
    return value


def _int_list(text: str, low: int, what: str, example: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated {what} such as {example}; got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; a clear argparse error for anything else (0 included)."""
    return _int_list(text, 1, "integers >= 1", "1,4,16")


def index_list(text: str) -> list[int]:
    """'0,1,2,3' -> [0, 1, 2, 3]: indices (GPUs, layers), from 0."""
    return _int_list(text, 0, "indices >= 0", "0,1,2,3")


def require_cuda(device: str) -> None:
    """Refuse a CUDA device on a machine without one, before any model is loaded."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu")
