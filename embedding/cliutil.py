"""What the command-line tools share: argparse value types (clear messages, no tracebacks) and
a parser that shows the tool's docstring as written."""

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


def documented_parser(prog: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """A tool's parser whose --help shows its module docstring as written (examples and tables
    keep their lines); `kwargs` go to ArgumentParser."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )
