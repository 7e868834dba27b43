"""The follower's polling of a store without notifications (SQLite): one query of the head a
poll, and a slower poll while nothing is written and no request waits for a version (an idle
worker spent ~4 % of a core on each of its processes polling every 10 ms)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from embedding.gallery import create_store
from service.state import IDLE_AFTER_S, IDLE_POLL_S, ServiceState
from service.store.sqlite import SqliteStore

FP, INDEX = "sha256:" + "ab" * 32, "build-1"


def test_a_poll_of_the_sqlite_head_is_one_query_after_its_wait(tmp_path):
    seed = tmp_path / "seed.sqlite"
    v = np.ones(4, "<f4") / 2
    create_store(
        seed,
        [(0, "a", "trained", {}, v.tobytes(), None)],
        {"model_fingerprint": FP, "index_id": INDEX, "dim": "4"},
    )
    store = SqliteStore(tmp_path / "data" / "gallery.sqlite", seed, FP, INDEX)
    try:
        calls = []
        real = store.head
        store.head = lambda: calls.append(time.monotonic()) or real()
        t0 = time.monotonic()
        assert store.wait_head(store.head(), 0.05) == real()
        assert len(calls) == 2 and calls[1] - t0 >= 0.05  # (the first: the caller's own)
    finally:
        store.close()


def test_the_follower_polls_slower_only_while_idle_and_nobody_waits():
    waiting = []
    s = SimpleNamespace(_poll_s=0.01, _changed_at=time.monotonic(), eager=lambda: bool(waiting))
    timeout = lambda: ServiceState._follow_timeout(s)  # noqa: E731
    assert timeout() == 0.01  # a write was just seen
    s._changed_at -= IDLE_AFTER_S + 0.1
    assert timeout() == IDLE_POLL_S  # quiet
    waiting.append("a request parked for a version")
    assert timeout() == 0.01
    waiting.clear()
    s._poll_s = 1.0  # PostgreSQL's long poll (LISTEN/NOTIFY) is never shortened
    assert timeout() == 1.0
