"""argparse value types shared by the command-line tools (clear messages, no tracebacks)."""

from __future__ import annotations

import argparse


def _int_from(s: str, least: int, what: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def non_negative_int(s: str) -> int:
    return _int_from(s, 0, "an integer >= 0")


def positive_int(s: str) -> int:
    return _int_from(s, 1, "a positive integer")
