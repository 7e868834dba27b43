"""Progress of long steps, on a terminal and off it.

On a terminal: a tqdm bar. Elsewhere (logs, CI, Docker, a pipe) a bar is useless and tqdm
disables itself, which left a 3-epoch run silent for minutes at a time; there a line is printed
every `every` seconds instead ("epoch 1/3: 120/430 (28%), loss 0.53, 41 s, ~1 min left"),
by default every $SNCA_PROGRESS_SECONDS (5).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO


def log_every() -> float:
    """Seconds between progress lines when the output is not a terminal."""
    try:
        return max(0.0, float(os.environ.get("SNCA_PROGRESS_SECONDS", "5")))
    except ValueError:
        return 5.0


class Progress:
    """Counts `total` units of work. `enabled=False`: silent. Use as a context manager or call
    `close()`; `update(n)` after each piece, `note(text)` for a short status (loss, lr)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        enabled: bool = True,
        every: float | None = None,
        stream: TextIO | None = None,
        isatty: bool | None = None,
        write: Callable[[str], None] | None = None,
        later_units: int = 0,
        later_seconds: float = 0.0,
    ):
        """`stream`: where the bar or lines go (stderr); `isatty`: override the terminal test;
        `write`: lines go to this callable instead (a logger), never a bar. `later_units`,
        `later_seconds`: the work that follows this bar (the next epochs): "~N left" is the
        whole job's, this bar's pace applied to `later_units` plus `later_seconds`."""
        self.later_units, self.later_seconds = later_units, later_seconds
        self.total, self.desc, self.unit = total, desc, unit
        self.every = log_every() if every is None else every
        self.done = 0
        self.status = ""
        self._stream = stream
        self._t0 = self._last = time.monotonic()
        self._bar = None
        self._lines = False
        self._write_line = write
        if enabled:
            tty = False if write is not None else self._out().isatty() if isatty is None else isatty
            if tty:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=stream
                )
            else:
                self._lines = True

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines:
            now = time.monotonic()
            if now - self._last >= self.every:
                self._last = now
                self._write(now)

    def note(self, status: str) -> None:
        self.status = status
        if self._bar is not None:
            self._bar.set_postfix_str(status, refresh=False)

    def _write(self, now: float) -> None:
        el = now - self._t0
        parts = [f"{self.done}/{self.total}" if self.total else f"{self.done}"]
        if self.total:
            parts[0] += f" {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        if self.status:
            parts.append(self.status)
        parts.append(f"{el:.0f} s")
        if self.total and 0 < self.done < self.total:
            left = el / self.done * (self.total - self.done + self.later_units)
            parts.append(f"~{_duration(left + self.later_seconds)} left")
        line = f"{self.desc}: " + ", ".join(parts)
        if self._write_line is not None:
            self._write_line(line)
        else:
            print(line, file=self._out(), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def track(
    items: Iterable, total: int | None, desc: str, unit: str = "it", enabled: bool = True
) -> Iterator:
    """Iterate `items`, reporting progress (one unit per item)."""
    with Progress(total, desc, unit, enabled) as p:
        for it in items:
            yield it
            p.update()


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"
