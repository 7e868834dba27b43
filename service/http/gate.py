"""A bound on how many requests of one costly kind run at once in a process (asyncio, on the
event loop): `slots` run, at most `queue` more wait for a slot, any beyond are refused with a
429 problem (`too_busy`, Retry-After) at once, before any work is done."""

from __future__ import annotations

import asyncio
import contextlib

from service.http.problems import Problem


class Gate:
    def __init__(self, what: str, slots: int, queue: int):
        self.what = what
        self.slots = slots
        self.queue = queue
        self.waiting = 0
        self.running = 0
        self._sem: asyncio.Semaphore | None = None  # made on the loop that uses it

    @contextlib.asynccontextmanager
    async def enter(self):
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        if self._sem.locked() and self.waiting >= self.queue:
            raise Problem(
                429,
                "too_busy",
                f"{self.what}: {self.slots} run at once and {self.queue} wait; retry later",
                headers={"Retry-After": "1"},
            )
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._sem.release()
