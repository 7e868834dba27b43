"""The model process of a snca-serve worker (started by service/model/remote.py, never by
hand): `python -m service.model_process` with its settings and two descriptors in the
environment.

It opens the model and the gallery exactly as a serving process does (ServiceHost: the
migration to a new model runs here, with the model), then serves jobs from the front on its
main thread: everything queued (up to SNCA_MAX_BATCH) is one batch, one forward pass, then the
votes (service/model/runtime.py `run_batch`). Torch threads are set on this thread, which runs
every forward. The gallery is a replica that follows the store's log (its follower thread,
service/state.py) and applies it up to a job's `min_version` before voting.

It exits when the front closes the socket (EOF) or dies (its parent changes): never an orphan.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from dataclasses import asdict

from embedding.errors import SNCAError
from service.config import Settings
from service.model.embedder import ImageError
from service.model.runtime import label_threshold
from service.model.spawn import CONTROL_FD_ENV, DATA_FD_ENV, SETTINGS_FD_ENV
from service.model.wire import Batch, Failed, FrameReader, Synced, frame
from service.store import StoreUnavailable

PROGRESS_EVERY_S = 0.5


class Control:
    """JSON lines to the front (start-up messages)."""

    def __init__(self, fd: int):
        self.f = os.fdopen(fd, "wb", buffering=0)
        self.lock = threading.Lock()
        self.last = 0.0

    def send(self, msg: dict) -> None:
        with self.lock:
            self.f.write(json.dumps(msg, default=str).encode() + b"\n")

    def progress(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S or done >= total:
            self.last = now
            self.send({"t": "progress", "done": done, "total": total})


def watch_parent() -> None:
    """Exit when the front is gone (its parent changes), even mid start-up or mid batch."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="watch-front", daemon=True).start()


class BatchContext:
    """What a batch's results share: the embedding rows of its payload, each open-set rate's
    thresholds (looked up once per batch), the gallery version the votes read."""

    def __init__(self, gallery):
        self.gallery = gallery
        self.version = gallery.version
        self.rows: list = []
        self._floats = 0
        self._thresholds: dict = {}

    def add_row(self, row) -> int:
        """A row into the payload; its offset in floats."""
        at = self._floats
        self.rows.append(row)
        self._floats += len(row)
        return at

    def threshold(self, tpr: float | None, label_id: int) -> float | None:
        if not tpr:
            return None
        if tpr not in self._thresholds:
            cached = self.gallery.cached_thresholds(tpr)
            self._thresholds[tpr] = (
                cached if cached is not None else self.gallery.thresholds_at(tpr)
            )
        return label_threshold(self._thresholds[tpr], label_id)

    def payload(self) -> bytes:
        return b"".join(r.astype("<f4", copy=False).tobytes() for r in self.rows)


class Server:
    """The job loop on the main thread."""

    def __init__(self, state, sock: socket.socket):
        self.state = state
        self.rt = state.runtime
        self.sock = sock
        self.shape = self.rt.embedder.pixel_shape
        self.max_batch = self.rt.info.max_batch  # (SNCA_MAX_BATCH, or less: batch_cap)
        self.max_wait = state.settings.max_wait_ms / 1000.0
        self.reader = FrameReader()
        self.pending: list = []  # (header, payload, arrival time)

    def _read(self, timeout: float | None) -> bool:
        """Take what arrived (waiting up to `timeout`, None: until something does); False on
        EOF (the front is gone)."""
        if timeout is not None:
            r, _, _ = select.select([self.sock], [], [], timeout)
            if not r:
                return True
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        now = time.perf_counter()
        self.pending.extend((h, p, now) for h, p in self.reader.feed(data))
        return True

    def run(self) -> None:
        while True:
            # until a whole job is here: a frame larger than one read (a 224 px photo's pixels,
            # 150 KB) arrives in pieces, and a batch of none was a crash (ValueError in answer)
            while not self.pending:
                if not self._read(None):
                    return
            # everything queued joins the batch; with SNCA_MAX_WAIT_MS also what comes soon
            deadline = time.perf_counter() + self.max_wait
            while len(self.pending) < self.max_batch:
                left = max(0.0, deadline - time.perf_counter())
                before = len(self.pending)
                if not self._read(left):
                    return
                if len(self.pending) == before and left <= 0:
                    break
            batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
            self.sock.sendall(self.answer(batch))

    def answer(self, batch: list) -> bytes:
        """One frame with the batch's results."""
        t0 = time.perf_counter()
        decoding = 0.0
        g, st = self.state.gallery, self.state
        need = max(j.min_version for j, _, _ in batch)  # jobs: the front's version; syncs: seq
        caught_up = True
        if need > g.version:
            try:
                st.catch_up()
            except (StoreUnavailable, SNCAError):
                caught_up = False
        out, model = [], []
        for j, p, _ in batch:
            if j.min_version > g.version and not caught_up:
                why = "the model process cannot read the gallery store to apply the latest writes"
                out.append(Failed(j.id, 503, why))
                continue
            t = time.perf_counter()
            try:
                pixels = j.pixels(p, self.shape, self.rt.uploads)
            except ImageError as e:  # (an upload left encoded: its problem, as the front's)
                out.append(Failed(j.id, e.status, e.message, e.code))
                continue
            finally:
                decoding += time.perf_counter() - t
            job = j.model_job(pixels)
            if job is None:  # a sync (or a ping): the version it reached
                out.append(Synced(j.id, g.version))
            else:
                model.append((j, job))
        ctx = BatchContext(g)
        if model:
            try:
                results = self.rt.run_batch([job for _, job in model])
            except Exception as e:  # the batch failed as a whole: each job says why
                results = [e] * len(model)
            ctx.version = g.version
            for (j, _), r in zip(model, results, strict=True):
                if isinstance(r, Exception):  # (run_batch's way of failing one job)
                    out.append(Failed(j.id, 500, f"{type(r).__name__}: {r}"))
                else:
                    out.append(j.result(r, ctx))
        now = time.perf_counter()
        waited = now - batch[0][2]
        # (spent: the forward and the votes of run_batch, which ran only for model jobs)
        phases = {"decode": decoding, **(self.rt.spent if model else {})}
        phases["other"] = max(0.0, now - t0 - sum(phases.values()))
        return frame(Batch(len(model), waited, out, phases), ctx.payload())


def read_settings(fd: int) -> dict | None:
    """The front's settings, JSON, from the pipe it writes them to (None: it closed the pipe
    without any: it exited, or runs no model process; service/model/spawn.py)."""
    chunks = []
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 16):
            chunks.append(chunk)
    return json.loads(b"".join(chunks)) if chunks else None


def main() -> int:
    # everything heavy first: the front imports its own meanwhile, then sends the settings
    from service.logs import setup_logging
    from service.startup import ServiceHost

    given = read_settings(int(os.environ.pop(SETTINGS_FD_ENV)))
    if given is None:
        return 0
    control = Control(int(os.environ.pop(CONTROL_FD_ENV)))
    sock = socket.socket(fileno=int(os.environ.pop(DATA_FD_ENV)))
    sock.setblocking(True)
    default_store = given.pop("store_is_default", False)
    settings = Settings.model_validate(given)
    settings.mark_store_given(not default_store)
    settings.snapshot_every = 0  # the front writes the snapshots; this replica only reads
    watch_parent()
    setup_logging(settings.log_level)
    from embedding.sysalloc import keep_freed_memory

    keep_freed_memory()
    host = ServiceHost(settings, model="inline")
    host.on_progress = control.progress
    host.on_waiting = lambda why: control.send({"t": "waiting", "why": why})
    try:
        o = host.open()
    except (SNCAError, OSError, ValueError, RuntimeError) as e:
        control.send({"t": "failed", "error": str(e)})
        return 2
    emb = o.runtime.embedder
    control.send(
        {
            "t": "opened",
            "config": emb.config.to_dict(),
            "dim": emb.dim,
            "world_dim": emb.world_dim,
            "fingerprint": o.fingerprint,
            "temperature": o.temperature,
            "migrating": o.migrating,
            "adopted": None if o.adopted is None else str(o.adopted),
        }
    )
    try:
        state = host.finish()
    except Exception as e:
        control.send({"t": "failed", "error": str(e)})
        host.stop()
        return 1
    import gc

    gc.collect()
    gc.freeze()  # start-up's long-lived objects: out of every collection's way
    carried = None if state.migration is None else state.migration.to_dict()
    control.send(
        {
            "t": "ready",
            "info": asdict(state.runtime.info),
            "version": state.gallery.version,
            "migration": carried,  # what this start carried to the model (/readyz shows it)
        }
    )
    try:
        Server(state, sock).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front is gone
    finally:
        host.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
