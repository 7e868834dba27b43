"""Dynamic micro-batching (the Triton / TorchServe pattern).

Requests put jobs on a thread-safe queue; one model thread takes the first job, waits up to
`max_wait` for more (up to `max_batch`), runs the whole batch with one call, and hands the
results back to the event loop in one callback. While a batch runs, new jobs queue up, so under
load batches fill by themselves and an idle server adds at most `max_wait` of latency. Model
work never runs on the event loop.

The model thread pulls its next batch itself the moment the previous one is done. The event
loop only enqueues jobs and sets results: when a busy loop also had to start each batch (as an
asyncio collector task did before), the model waited for the loop between batches, and at half
of the saturating rate that wait was most of a request's latency (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class MicroBatcher:
    def __init__(
        self,
        run_batch: Callable[[list[Any]], list[Any]],
        max_batch: int,
        max_wait_ms: float,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.on_batch = on_batch  # (batch size, oldest queue wait in s) for metrics
        # (job, asyncio future, enqueue time) | (callable, concurrent Future, None) | _STOP
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future | None = None
        # One model thread for the process: every forward pass (and the warm-up) runs on it, so
        # the math library keeps a single thread team instead of one per calling thread.
        self._thread = self._spawn()

    def _spawn(self) -> threading.Thread:
        t = threading.Thread(target=self._work, args=(self._queue,), name="model", daemon=True)
        t.start()
        return t

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the model thread and wait (for start-up work such as the warm-up)."""
        if not self._thread.is_alive():
            raise RuntimeError("the model thread has stopped")
        f: Future = Future()
        self._queue.put((fn, f, None))
        return f.result()

    def start(self) -> None:
        """Bind to the running event loop, which receives the results."""
        self._loop = asyncio.get_running_loop()
        if not self._thread.is_alive():  # started again after a stop()
            self._queue = queue.SimpleQueue()
            self._thread = self._spawn()

    async def stop(self) -> None:
        """Finish the queued jobs, then stop the model thread."""
        if self._loop is None or not self._thread.is_alive():
            return
        self._stopped = self._loop.create_future()
        self._queue.put(_STOP)
        await self._stopped
        self._thread.join()
        self._loop = None

    def close(self) -> None:
        """Stop the model thread without an event loop (after `stop`, a no-op)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    async def submit(self, job: Any) -> Any:
        fut = self._loop.create_future()
        self._queue.put((job, fut, time.perf_counter()))
        return await fut

    # ------------------------------------------------------------------ the model thread
    def _work(self, q: queue.SimpleQueue) -> None:
        pending = None  # an item taken while filling a batch that cannot join it
        while True:
            first = pending if pending is not None else q.get()
            pending = None
            if first is _STOP:
                self._post(self._set_stopped)
                return
            if first[2] is None:  # a call(): run it alone
                fn, f, _ = first
                try:
                    f.set_result(fn())
                except BaseException as e:
                    f.set_exception(e)
                continue
            batch = [first]
            deadline = time.perf_counter() + self.max_wait
            while len(batch) < self.max_batch:
                left = deadline - time.perf_counter()
                try:
                    item = q.get(timeout=left) if left > 0 else q.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP or item[2] is None:
                    pending = item
                    break
                batch.append(item)
            waited = time.perf_counter() - batch[0][2]
            try:
                results = self.run_batch([b[0] for b in batch])
            except BaseException as e:  # the batch failed as a whole: fail each job with it
                err = e if isinstance(e, Exception) else RuntimeError(str(e))
                results = [err] * len(batch)
            if len(results) != len(batch):  # never leave a request waiting
                results = [RuntimeError("the batch returned a wrong number of results")] * len(
                    batch
                )
            self._post(self._deliver, batch, results)
            if self.on_batch is not None:
                with contextlib.suppress(Exception):  # metrics must not stop the model thread
                    self.on_batch(len(batch), waited)

    def _post(self, fn, *args) -> None:
        # no loop, or it closed: nobody is waiting
        with contextlib.suppress(AttributeError, RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _set_stopped(self) -> None:
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    @staticmethod
    def _deliver(batch: list, results: list) -> None:
        """On the event loop: one callback per batch sets every job's future."""
        for (_, fut, _), r in zip(batch, results, strict=True):
            if fut.done():  # the client went away
                continue
            if isinstance(r, BaseException):
                fut.set_exception(r)
            else:
                fut.set_result(r)


class InlineCalls:
    """The batcher's `call` for a process whose own thread runs the model (the model process,
    service/model_process.py): `call(fn)` runs `fn` at once on the caller's thread, so the
    torch threads set there are the ones the batches run with."""

    def call(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def close(self) -> None:
        pass
