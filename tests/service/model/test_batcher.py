"""The micro-batcher: one model thread pulls batches itself (no event-loop hop between
batches), results come back per job, failures stay with their batch, stop drains the queue."""

import asyncio
import threading
import time

import pytest

from service.model.batcher import MicroBatcher


def _run(coro):
    return asyncio.run(coro)


def test_jobs_queued_behind_a_running_batch_form_the_next_batch():
    sizes, threads, started = [], set(), threading.Event()

    def run_batch(jobs):
        sizes.append(len(jobs))
        threads.add(threading.current_thread().name)
        if len(sizes) == 1:
            started.set()
            time.sleep(0.2)  # the first batch is slow: the rest queue up meanwhile
        return [j * 10 for j in jobs]

    async def main():
        b = MicroBatcher(run_batch, max_batch=4, max_wait_ms=0)
        b.start()
        first = asyncio.ensure_future(b.submit(0))
        while not started.is_set():
            await asyncio.sleep(0.001)
        rest = await asyncio.gather(*[b.submit(i) for i in range(1, 10)])
        out = [await first, *rest]
        await b.stop()
        return out

    assert _run(main()) == [i * 10 for i in range(10)]
    assert sizes == [1, 4, 4, 1]  # max_batch respected, batches filled from the queue
    assert threads == {"model"}


def test_call_runs_on_the_model_thread_and_returns_or_raises():
    b = MicroBatcher(lambda jobs: jobs, 8, 0)
    assert b.call(lambda: threading.current_thread().name) == "model"
    with pytest.raises(ZeroDivisionError):
        b.call(lambda: 1 / 0)
    b.close()
    with pytest.raises(RuntimeError, match="stopped"):
        b.call(lambda: 1)


def test_a_failing_batch_fails_only_its_own_jobs():
    def run_batch(jobs):
        if "boom" in jobs:
            raise ValueError("bad batch")
        if "short" in jobs:
            return []  # a wrong number of results must not leave anyone waiting
        return [ValueError(j) if j == "per-job" else j.upper() for j in jobs]

    async def main():
        b = MicroBatcher(run_batch, 1, 0)  # one job per batch
        b.start()
        res = await asyncio.gather(
            b.submit("ok"),
            b.submit("boom"),
            b.submit("per-job"),
            b.submit("short"),
            b.submit("fine"),
            return_exceptions=True,
        )
        await b.stop()
        return res

    ok, boom, per_job, short, fine = _run(main())
    assert ok == "OK" and fine == "FINE"
    assert isinstance(boom, ValueError) and str(boom) == "bad batch"
    assert isinstance(per_job, ValueError) and str(per_job) == "per-job"
    assert isinstance(short, RuntimeError) and "wrong number" in str(short)


def test_stop_finishes_queued_jobs_and_a_gone_client_does_not_break_the_batch():
    gate = threading.Event()

    def run_batch(jobs):
        gate.wait(5)
        return jobs

    async def main():
        b = MicroBatcher(run_batch, 64, 0)
        b.start()
        tasks = [asyncio.ensure_future(b.submit(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        tasks[2].cancel()  # its client disconnected while it waited
        stopping = asyncio.ensure_future(b.stop())
        await asyncio.sleep(0.05)
        assert not stopping.done()  # stop waits for the queued jobs
        gate.set()
        await stopping
        return [t.result() for i, t in enumerate(tasks) if i != 2], tasks[2].cancelled()

    done, cancelled = _run(main())
    assert done == [0, 1, 3, 4, 5] and cancelled


def test_max_wait_collects_jobs_that_arrive_within_it():
    sizes = []

    async def main():
        b = MicroBatcher(lambda jobs: sizes.append(len(jobs)) or jobs, 64, max_wait_ms=500)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.02)
        second = await b.submit(2)
        out = (await first, second)
        await b.stop()
        return out

    assert _run(main()) == (1, 2) and sizes == [2]
