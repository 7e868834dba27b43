"""The model process of a snca-serve worker (started by service/model/remote.py, never by
hand): `python -m service.model_process` with its settings and two descriptors in the
environment.

It opens the model and the gallery exactly as a serving process does (ServiceHost: the
migration to a new model runs here, with the model), then serves jobs from the front on its
main thread: everything queued (up to SNCA_MAX_BATCH) is one batch, one forward pass, then the
votes (service/model/runtime.py `_run_batch`). Torch threads are set on this thread, which runs
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
from service.gallery.query import VoteQuery
from service.model.remote import CONTROL_FD_ENV, DATA_FD_ENV, SETTINGS_ENV
from service.model.runtime import Job, label_threshold
from service.model.wire import FrameReader, frame
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


def classification_row(c, threshold, version: int) -> list:
    """What remote._answer reads back."""
    w = c.world
    return [
        c.label,
        c.confidence,
        c.probabilities,
        c.best_similarity,
        c.unknown_score,
        c.label_id,
        c.neighbors,
        [w.score, w.threshold, w.ok, w.basis],
        threshold,
        version,
    ]


class Server:
    """The job loop on the main thread."""

    def __init__(self, state, sock: socket.socket):
        self.state = state
        self.rt = state.runtime
        self.sock = sock
        self.shape = self.rt.embedder.pixel_shape
        self.max_batch = state.settings.max_batch
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
            if not self.pending and not self._read(None):
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
        g, st = self.state.gallery, self.state
        need = max(h[2] for h, _, _ in batch)  # min_version (jobs) or seq (syncs)
        caught_up = True
        if need > g.version:
            try:
                st.catch_up()
            except (StoreUnavailable, SNCAError):
                caught_up = False
        out, rows, model = [], [], []
        for h, p, _ in batch:
            if h[2] > g.version and not caught_up:
                why = "the model process cannot read the gallery store to apply the latest writes"
                out.append([h[1], "x", [503, why]])
            elif h[0] == "s":
                out.append([h[1], "s", g.version])
            else:
                model.append((h, p))
        if model:
            jobs = [
                Job("classify", px, VoteQuery(h[3], h[4], tuple(h[5]) if h[5] else None, h[6]))
                if h[0] == "c"
                else Job("embed", px)
                for h, px in ((h, self._pixels(p)) for h, p in model)
            ]
            try:
                results = self.rt._run_batch(jobs)
            except Exception as e:  # the batch failed as a whole: each job says why
                results = [e] * len(jobs)
            version = g.version
            thresholds: dict = {}
            at = 0
            for (h, _), r in zip(model, results, strict=True):
                if isinstance(r, Exception):
                    out.append([h[1], "x", [500, f"{type(r).__name__}: {r}"]])
                elif h[0] == "e":
                    rows.append(r)
                    out.append([h[1], "e", [at, len(r)]])
                    at += len(r)
                else:
                    tpr = h[7]
                    t = None
                    if tpr:
                        if tpr not in thresholds:
                            cached = g.cached_thresholds(tpr)
                            thresholds[tpr] = cached if cached is not None else g.thresholds_at(tpr)
                        t = label_threshold(thresholds[tpr], r.label_id)
                    out.append([h[1], "c", classification_row(r, t, version)])
        waited = time.perf_counter() - batch[0][2]
        payload = b"".join(r.astype("<f4", copy=False).tobytes() for r in rows)
        return frame(["b", len(model), waited, out], payload)

    def _pixels(self, payload: bytes):
        import numpy as np

        return np.frombuffer(payload, np.uint8).reshape(self.shape)


def main() -> int:
    from service.logs import setup_logging
    from service.startup import ServiceHost

    control = Control(int(os.environ.pop(CONTROL_FD_ENV)))
    sock = socket.socket(fileno=int(os.environ.pop(DATA_FD_ENV)))
    sock.setblocking(True)
    given = json.loads(os.environ.pop(SETTINGS_ENV))
    default_store = given.pop("store_is_default", False)
    settings = Settings.model_validate(given)
    settings._store_given = not default_store
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
