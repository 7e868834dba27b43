"""The front's handle on its model process: a worker of snca-serve is two processes.

The front (this side) runs the event loop: HTTP, limits, multipart, decoding uploads into
uint8 pixels, JSON, the store writes and a gallery replica for the routes that need no model
(labels, items, search results, diagnostics). The model process (service/model_process.py)
runs the model, its own gallery replica following the store's log, the batches, the vote and
the open-set score, on its main thread. In one process the model thread and the event loop
took turns on one GIL, and every torch call of a batch waited for the loop to give it back
(docs/PERFORMANCE.md); here neither waits for the other.

Jobs cross a Unix socket as frames (service/model/wire.py): pixels and rows as raw bytes,
never pickled. The event loop writes through an asyncio transport (never blocks) and reads
the answers in a protocol callback; a supervisor thread starts the model process, relays its
start-up messages (migration progress), and when it dies fails every job in flight at once
(ModelUnavailable: 503 + Retry-After) and starts a new one, which loads the gallery from the
store as any replica does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding.config import ModelConfig
from embedding.errors import ArtifactError
from service.config import Settings
from service.gallery.gallery import Classification
from service.gallery.query import VoteQuery
from service.gallery.world import WorldVerdict
from service.model import spawn
from service.model.embedder import Preprocessing
from service.model.runtime import Answer, ModelInfo, Runtime
from service.model.uploads import Prepared
from service.model.wire import (
    Batch,
    ClassifyAnswer,
    ClassifyJob,
    EmbedJob,
    FrameReader,
    ModelBusy,
    ModelUnavailable,
    SyncJob,
    frame,
)
from service.store.migration import Report
from service.store.records import WriteNotApplied

log = logging.getLogger("snca.service")

RESTART_BACKOFF_S = (0.2, 1.0, 5.0)  # after the 1st, 2nd, 3rd+ death in a row
WATCH_S = 0.5  # how often the watchdog looks at the jobs in flight
PING_S = 1.0  # an idle model process is asked for its version this often (a ping)


class RemoteRuntime(Runtime):
    """The Runtime with the model in a process of its own."""

    def __init__(
        self, settings: Settings, on_batch: Callable[[int, float, dict], None] | None = None
    ):
        """Start the model process and wait until it has opened the model and the index
        (ArtifactError with its reason if it cannot); the gallery loads meanwhile
        (`wait_ready`)."""
        super().__init__()
        torch.set_num_threads(1)  # the front runs no model: no torch thread team here
        self.settings = settings
        self.on_batch = on_batch
        self.gallery = None  # the front's replica (min_version of each job)
        self.info: ModelInfo | None = None
        self.opened: dict = {}
        self._messages: queue.SimpleQueue = queue.SimpleQueue()  # start-up messages
        self._futures: dict[int, asyncio.Future] = {}
        self._sent: dict[int, float] = {}  # job id -> when it was sent (the watchdog's bound)
        self.timeout = float(settings.model_timeout_s)
        self.stalls = 0  # model processes killed for not answering within the timeout
        # progress, not age, says whether the process is hung (_silence): when it last answered
        self._answered_at = time.monotonic()
        # the work queued to it is bounded (_admit): in jobs, and in the wait it means at the
        # recent seconds per job (an average over its batches while it had work)
        self.queue_s = float(settings.model_queue_s)
        self.queue_max = int(settings.model_queue_max)
        self._per_job = 0.0
        self.refused = 0  # requests answered 503 model_busy
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None  # a ready process's socket, not yet attached
        self._connected: socket.socket | None = None  # the attached one
        self._down: str | None = "the model process is starting"
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self.restarts = 0
        self._carried: Report | None = None  # what the model process's start carried
        self._supervisor = threading.Thread(
            target=self._supervise, name="model-process", daemon=True
        )
        self._supervisor.start()
        msg = self._next_message()
        if msg["t"] != "opened":
            raise ArtifactError(msg.get("error") or "the model process did not start")
        self.opened = msg
        cfg = ModelConfig.from_dict(msg["config"])
        self.embedder = Preprocessing(cfg, msg["dim"], msg["world_dim"])

    # ------------------------------------------------------------------ start-up
    def _next_message(self) -> dict:
        return self._messages.get()

    def wait_ready(self, progress=None, waiting=None) -> None:
        """Block until the model process has loaded its gallery (carrying it to this model
        first if it had to: `progress(done, total)`, `waiting(why)` as it goes)."""
        if self.info is not None:
            return
        while True:
            msg = self._next_message()
            t = msg["t"]
            if t == "progress" and progress is not None:
                progress(msg["done"], msg["total"])
            elif t == "waiting" and waiting is not None:
                waiting(msg["why"])
            elif t == "ready":
                return
            elif t in ("failed", "exit"):
                raise RuntimeError(msg.get("error") or "the model process stopped")

    def _spawn(self) -> tuple[subprocess.Popen, socket.socket, int]:
        """A model process (the one `snca-serve` spawned early, the first time), configured
        with these settings (without any API key: service/model/spawn.py strips them)."""
        dump = self.settings.model_dump(
            mode="json", exclude={"api_key", "api_key_file", "api_keys", "api_keys_file"}
        )
        dump["store_is_default"] = self.settings.store_is_default
        child = spawn.take()
        with contextlib.suppress(OSError):  # (it died first: the supervisor sees it exit)
            child.configure(json.dumps(dump))
        return child.proc, child.sock, child.ctl

    def _supervise(self) -> None:
        """The supervisor thread: start the model process, relay what it says, and when it
        dies fail the jobs in flight and start another (after a back-off)."""
        deaths = 0
        while not self._closed:
            proc, sock, ctl = self._spawn()
            self._proc = proc
            ready = False
            with os.fdopen(ctl, "rb", buffering=0) as f:
                for line in iter(f.readline, b""):
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if msg.get("t") == "ready":
                        ready = True
                        self.info = ModelInfo(**msg["info"])
                        if msg.get("migration") and self._carried is None:
                            self._carried = Report.from_summary(msg["migration"])
                        deaths = 0
                        self._up(sock)
                    if not self.restarts:  # (start-up waits on them; a restart, nobody)
                        self._messages.put(msg)
            code = proc.wait()
            why = _exit_reason(code)
            if not ready:  # (once ready the event loop owns it: _lost closes it there)
                sock.close()
            if self._closed:
                return
            if not ready and not self.restarts:  # the first start failed: start-up fails
                self._messages.put({"t": "exit", "error": f"the model process {why}"})
                return
            deaths += 1
            self.restarts += 1
            log.warning(
                "the model process %s; starting another", why, extra={"fields": {"pid": proc.pid}}
            )
            self._set_down(f"the model process {why}; a new one is starting")
            time.sleep(RESTART_BACKOFF_S[min(deaths, len(RESTART_BACKOFF_S)) - 1])

    def _up(self, sock: socket.socket) -> None:
        """On the supervisor thread: a model process is ready on `sock`."""
        loop = self._loop
        if loop is None:  # before the event loop started: `start` attaches it
            self._sock = sock
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            asyncio.run_coroutine_threadsafe(self._attach(sock), loop)

    async def _attach(self, sock: socket.socket) -> None:
        """On the event loop: serve from the ready process on `sock`."""
        transport, _ = await self._loop.create_unix_connection(
            lambda: _Results(self, sock), sock=sock
        )
        self._transport = transport
        self._connected = sock  # (the transport's wrapper refuses shutdown(); close uses this)
        self._answered_at = time.monotonic()
        self._down = None

    def _set_down(self, why: str) -> None:
        loop = self._loop
        if loop is None:
            self._down = why
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._lost, None, why)

    def _silence(self, now: float) -> float:
        """How long the model process has had work and answered none of it: since its last
        answer or since the oldest job in flight was sent, whichever is later (0: no job in
        flight). A process working through a long queue answers batch after batch: it is
        busy, not hung, however old the oldest job waiting is."""
        if not self._sent:
            return 0.0
        return now - max(self._answered_at, min(self._sent.values()))

    def _stalled(self, age: float) -> None:
        """On the event loop: jobs have waited `age` s > the timeout with no answer at all: the
        model process is stopped or hung. Every job in flight fails (503 model_unavailable),
        and the process is killed so the supervisor starts another."""
        why = (
            f"the model process has answered nothing for {age:.1f} s with jobs waiting (stopped "
            f"or hung, over SNCA_MODEL_TIMEOUT_S={self.timeout:g}); a new one is starting"
        )
        log.error(why, extra={"fields": {"pid": self.pid()}})
        self.stalls += 1
        proc = self._proc
        self._lost(None, why)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()  # (SIGKILL works on a stopped process too)

    async def _watchdog(self) -> None:
        """Bounds every wait on the model process: jobs waiting with no answer at all for
        longer than the timeout fail the process (_silence, _stalled); an idle process is
        pinged, so one that stopped answering is found even with no request waiting (/readyz
        turns 503)."""
        last_ping = 0.0
        while not self._closed:
            await asyncio.sleep(WATCH_S)
            if self._transport is None or self._down is not None:
                continue
            now = time.monotonic()
            silent = self._silence(now)
            if silent > self.timeout:
                self._stalled(silent)
                continue
            if not self._sent and now - last_ping >= PING_S:
                last_ping = now
                with contextlib.suppress(ModelUnavailable):
                    fut = self._send(SyncJob(next(self._ids), 0))
                    fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _lost(self, transport, why: str) -> None:
        """On the event loop: the process behind `transport` (None: the current one) is gone:
        every job in flight fails now, new ones until another is ready."""
        if transport is not None and transport is not self._transport:
            return  # an older process's connection, already handled
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._sock is not None:  # ready, never attached
            self._sock.close()
            self._sock = None
        self._down = why
        futures, self._futures = self._futures, {}
        self._sent.clear()
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(ModelUnavailable(why))

    # ------------------------------------------------------------------ the event loop side
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock, self._sock = self._sock, None
        if sock is not None:
            self._loop.create_task(self._attach(sock))
        self._watch = self._loop.create_task(self._watchdog())

    async def stop(self) -> None:
        """Let the jobs in flight finish (bounded), then stop the model process."""
        deadline = time.monotonic() + 10
        while self._futures and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            # EOF now: the model process exits (a transport closes its socket only on the
            # loop's next turn, which the wait below would hold up)
            with contextlib.suppress(OSError):
                self._connected.shutdown(socket.SHUT_RDWR)
            self._transport.close()
            self._transport = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def problem(self) -> str | None:
        """Why the model process cannot answer now (None: it can): down, restarting, or a job
        in flight for more than half the timeout (stopped or hung: /readyz says so before the
        watchdog gives up on it)."""
        if self._down is None:
            silent = self._silence(time.monotonic())
            if silent > self.timeout / 2:
                return f"the model process has answered nothing for {silent:.1f} s"
        return self._down

    def migration_report(self) -> Report | None:
        """What the model process carried to this model at its first start (None: nothing)."""
        return self._carried

    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def counters(self) -> dict[str, int]:
        """Model processes started again (`restarts`: died or killed), killed for answering
        nothing for the timeout (`killed_hung`), requests refused with model_busy (`busy`),
        jobs queued now (`queued`)."""
        return {
            "restarts": self.restarts,
            "killed_hung": self.stalls,
            "busy": self.refused,
            "queued": len(self._sent),
        }

    def serve(self, gallery, vote: str | None = None, k: int | None = None) -> None:
        """The front's replica: each job asks the model process for at least its version."""
        self.gallery = gallery

    def _admit(self, n: int) -> None:
        """Refuse `n` new jobs (ModelBusy: 503 model_busy, before anything waits) when the
        queue would pass SNCA_MODEL_QUEUE_MAX jobs, or when what is queued already takes the
        process longer than SNCA_MODEL_QUEUE_S at its recent seconds per job."""
        queued = len(self._sent)
        wait = (queued + n) * self._per_job
        if queued + n <= self.queue_max and wait <= self.queue_s:
            return
        self.refused += 1
        why = (
            f"the model process has {queued} jobs queued (about {queued * self._per_job:.1f} s "
            f"of work; bounds: SNCA_MODEL_QUEUE_S={self.queue_s:g}, "
            f"SNCA_MODEL_QUEUE_MAX={self.queue_max})"
        )
        raise ModelBusy(why, max(1, int(wait - self.queue_s + 0.999)))

    def _send(self, job, payload: bytes = b"") -> asyncio.Future:
        """Send a job record (service/model/wire.py); the future of its result's value."""
        if self._transport is None or self._down is not None:
            raise ModelUnavailable(self._down or "the model process is not connected")
        fut = self._loop.create_future()
        self._futures[job.id] = fut
        self._sent[job.id] = time.monotonic()
        self._transport.write(frame(job, payload))
        return fut

    def _version(self) -> int:
        return 0 if self.gallery is None else self.gallery.version

    async def prepare_queries(self, datas: list[bytes], names: list[str]) -> list[Prepared]:
        """Small uploads left encoded once their headers pass: the model process decodes them
        (a fifth of this process's CPU on a 28x28 /classify, docs/PERFORMANCE.md). Decoded here
        with the review queue on (it keeps the pixels the model saw)."""
        encoded = not self.settings.review_queue
        return await self.uploads.prepare_async(datas, names, encoded=encoded)

    async def answers(
        self, prepared: list[Prepared], query: VoteQuery, tpr: float | None
    ) -> list[Answer]:
        v = self._version()
        self._admit(len(prepared))
        futs = [
            self._send(ClassifyJob(next(self._ids), v, query, tpr, p.name), p.data)
            if p.encoded
            else self._send(ClassifyJob(next(self._ids), v, query, tpr), _raw(p.pixels))
            for p in prepared
        ]
        got = [await futs[0]] if len(futs) == 1 else await asyncio.gather(*futs)  # (/classify)
        return [_answer(r, tpr, self.settings) for r in got]

    async def embed(self, p: Prepared) -> np.ndarray:
        self._admit(1)
        return await self._send(EmbedJob(next(self._ids), self._version()), _raw(p.pixels))

    async def sync(self, seq: int) -> int:
        """Return once the model process has applied the write `seq` (the answer to the write
        waits for this). A process that is down (or that the watchdog gives up on) loads the
        store when it starts, so it will have the write: nothing to wait for. Past the timeout
        otherwise: WriteNotApplied (the write is committed; the answer says so)."""
        try:
            return await asyncio.wait_for(
                asyncio.shield(self._send(SyncJob(next(self._ids), seq))),
                self.timeout + 2 * WATCH_S,
            )
        except ModelUnavailable:
            return seq
        except TimeoutError:
            log.warning("the model process did not apply write %d within %ss", seq, self.timeout)
            why = f"the model process did not apply it within {self.timeout:g} s"
            raise WriteNotApplied(seq, why) from None

    def _results(self, batch: Batch, payload: bytes) -> None:
        """On the event loop: one batch's results (progress: the watchdog's clock restarts;
        the seconds per job it took feed the queue's bound)."""
        if self.on_batch is not None and batch.size:
            with contextlib.suppress(Exception):
                self.on_batch(batch.size, batch.waited, batch.phases)
        now = time.monotonic()
        sent = [t for r in batch.results if (t := self._sent.get(r.id)) is not None]
        if batch.size and sent:  # (its work began at the last answer, or when it was sent)
            took = (now - max(self._answered_at, min(sent))) / len(batch.results)
            self._per_job = took if not self._per_job else 0.8 * self._per_job + 0.2 * took
        self._answered_at = now
        for r in batch.results:
            self._sent.pop(r.id, None)
            fut = self._futures.pop(r.id, None)
            if fut is None or fut.done():  # the client went away
                continue
            try:
                fut.set_result(r.value(payload))
            except Exception as e:  # (a Failed job's error)
                fut.set_exception(e)


class _Results(asyncio.Protocol):
    def __init__(self, rt: RemoteRuntime, sock: socket.socket):
        self.rt = rt
        self.sock = sock
        self.reader = FrameReader()
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except ValueError as e:
            self.rt._lost(self.transport, f"the model process sent a corrupt frame: {e}")
            return
        for header, payload in frames:
            self.rt._results(header, payload)

    def connection_lost(self, exc) -> None:
        self.rt._lost(self.transport, "the model process stopped; a new one is starting")


def _raw(pixels: np.ndarray) -> memoryview:
    """The bytes of C-contiguous uint8 pixels, without a copy."""
    return memoryview(pixels).cast("B")


def _answer(r: ClassifyAnswer, tpr: float | None, settings: Settings) -> Answer:
    """A classification as the model process sent it (wire.ClassifyAnswer)."""
    w = r.world
    c = Classification(
        r.label,
        r.confidence,
        [tuple(p) for p in r.probabilities],
        r.best_similarity,
        [tuple(n) for n in r.neighbors],
        r.unknown_score,
        r.label_id,
        WorldVerdict(w["score"], w["threshold"], w["ok"], w["basis"]),
        r.row,
    )
    return Answer.judged(c, r.threshold, r.version, tpr, settings)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
