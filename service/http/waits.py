"""Requests parked until this replica reaches a gallery version (X-Min-Gallery-Version).

A parked request costs nothing while it waits: it awaits a future that the thread applying
the write resolves (Gallery.on_version -> `notify`), no polling. It ends when the version is
reached, when SNCA_MIN_VERSION_WAIT_S has passed (503), or when its client goes away (the
request's body is read meanwhile, within the usual limits, and replayed to the route; after it
the next message is the disconnect). At most SNCA_MAX_PARKED requests wait at once, and at
most SNCA_MAX_PARKED_PER_CLIENT from one client address (429 beyond either).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import Counter
from collections.abc import Callable

from service.http.problems import Problem


class ClientGone(Exception):
    """The client closed the connection while its request was parked."""


class VersionWaits:
    def __init__(self, max_total: int, max_per_client: int, gauge=None):
        self.max_total = max_total
        self.gauge = gauge  # a prometheus Gauge of the parked requests, or None
        self.max_per_client = max_per_client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heap: list[tuple[int, int, asyncio.Future]] = []  # (version wanted, n, future)
        self._n = itertools.count()
        self._clients: Counter[str] = Counter()
        self.parked = 0

    # ------------------------------------------------------------------ any thread
    def notify(self, version: int) -> None:
        """The gallery reached `version` (called by whichever thread applied the write)."""
        loop = self._loop
        if self.parked and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._release, version)

    # ------------------------------------------------------------------ the event loop
    def _release(self, version: int) -> None:
        h = self._heap
        while h and h[0][0] <= version:
            fut = heapq.heappop(h)[2]
            if not fut.done():
                fut.set_result(None)

    @contextlib.contextmanager
    def admitted(self, client: str):
        """One more parked request from `client`, or 429 `too_many_waiting`."""
        if self.parked >= self.max_total or self._clients[client] >= self.max_per_client:
            raise Problem(
                429,
                "too_many_waiting",
                f"too many requests are waiting for a gallery version (at most "
                f"{self.max_per_client} per client, {self.max_total} in all): retry later",
                headers={"Retry-After": "1"},
            )
        self.parked += 1
        self._clients[client] += 1
        if self.gauge is not None:
            self.gauge.inc()
        try:
            yield
        finally:
            if self.gauge is not None:
                self.gauge.dec()
            self.parked -= 1
            self._clients[client] -= 1
            if not self._clients[client]:
                del self._clients[client]

    async def wait(
        self, want: int, current: Callable[[], int], timeout: float, receive
    ) -> tuple[bool, list[dict]]:
        """Wait until current() >= want, at most `timeout` s, watching `receive` for the
        client going away (ClientGone). Returns (reached, the body messages read meanwhile:
        the caller replays them to the route)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        fut = loop.create_future()
        entry = (want, next(self._n), fut)
        heapq.heappush(self._heap, entry)
        if current() >= want:  # applied between the caller's check and the push
            fut.set_result(None)
        body: list[dict] = []
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    return
                body.append(msg)

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({fut, watcher}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._heap.remove(entry)
                    heapq.heapify(self._heap)
        if gone.is_set():
            raise ClientGone
        if watcher.done() and not watcher.cancelled() and watcher.exception() is not None:
            raise watcher.exception()  # the body broke a limit while parked (413, 408)
        return current() >= want, body
