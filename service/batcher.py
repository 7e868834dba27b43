"""Dynamic micro-batching (the Triton / TorchServe pattern).

Requests put jobs on a queue; one collector task takes the first job, waits up to `max_wait`
for more (up to `max_batch`), and runs the whole batch in a worker thread with one call. While
a batch runs, new jobs queue up, so under load batches fill by themselves and an idle server
adds at most `max_wait` of latency. Model work never runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


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
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        # One model thread for the process: every forward pass (and the warm-up) runs on it, so
        # the math library keeps a single thread team instead of one per calling thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.in_flight = 0

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the model thread and wait (for start-up work such as the warm-up)."""
        return self._executor.submit(fn).result()

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def stop(self) -> None:
        """Finish the queued jobs, then stop the collector."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._executor.shutdown(wait=True)
        self._task = None

    async def submit(self, job: Any) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        try:
            await self._queue.put((job, fut, time.perf_counter()))
            return await fut
        finally:
            self.in_flight -= 1

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        q = self._queue
        while True:
            first = await q.get()
            batch = [first]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                try:
                    batch.append(q.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(q.get(), left))
                except asyncio.TimeoutError:
                    break
            waited = time.perf_counter() - batch[0][2]
            try:
                results = await loop.run_in_executor(
                    self._executor, self.run_batch, [b[0] for b in batch]
                )
                for (_, fut, _), r in zip(batch, results, strict=True):
                    if not fut.done():
                        if isinstance(r, BaseException):
                            fut.set_exception(r)
                        else:
                            fut.set_result(r)
            except BaseException as e:  # the batch failed as a whole: fail each job with it
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                for _ in batch:
                    q.task_done()
            if self.on_batch is not None:
                self.on_batch(len(batch), waited)
