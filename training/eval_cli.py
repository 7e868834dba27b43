"""`snca-eval`: one entry point for the two evaluations (training/evaluate.py: closed set;
training/fewshot.py: few-shot), each also runnable as `python -m` its module."""

from __future__ import annotations

import sys

from .evaluate import main as closed_main
from .fewshot import main as fewshot_main


def eval_cli(argv: list[str] | None = None) -> int:
    """`snca-eval closed ...` (this module) or `snca-eval fewshot ...` (training.fewshot)."""
    argv = sys.argv[1:] if argv is None else argv
    commands = ("closed", "fewshot")
    if not argv or argv[0] not in commands:
        print(
            "usage: snca-eval {closed,fewshot} ...\n"
            "  closed   kNN / +PCA / parametric top-1 of run dirs (python -m training.evaluate)\n"
            "  fewshot  generalized few-shot and N-way K-shot episodes (python -m training.fewshot)",
            file=sys.stderr,
        )
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "fewshot":
        return fewshot_main(argv[1:])
    return closed_main(argv[1:])
