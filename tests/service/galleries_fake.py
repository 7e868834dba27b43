"""Galleries of several fake models on one home store, for the in-process checks of the carry
engine and its endings (no torch: a model is a seed store of trained items and an embedding
that hashes the image bytes). Shared by tests/service/store/test_carry_model.py and
tests/service/store/test_day_two_fences.py."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np

from embedding.gallery import create_store
from service.store.galleries import alias, gen_of
from service.store.postgres import PostgresStore
from service.store.sqlite import SqliteStore
from service.store.upgrade import Galleries, To, open_galleries, run

DIM = 4
TRAINED_LABELS = ("T0", "T1")


def fingerprint(m: int) -> str:
    return "sha256:" + hashlib.sha256(f"model{m}".encode()).hexdigest()


def index_id(m: int) -> str:
    return f"ix{m}build"


def gen(m: int) -> str:
    return gen_of(fingerprint(m), index_id(m))


def embedding(image: bytes) -> np.ndarray:
    v = np.frombuffer(hashlib.sha256(image).digest()[:16], dtype="<u4").astype(np.float32) + 1
    return v / np.linalg.norm(v)


def embed(items):
    """The carry's Embed of every fake model (the vectors do not matter here)."""
    return np.stack([embedding(it.image) for it in items]), None, [None] * len(items)


def image(n: int) -> bytes:
    return f"image-{n}".encode()


class Place:
    """A home store of one backend (a SQLite file in a temp dir, or a new PostgreSQL
    database) and the seeds of models 0..models-1: model m's index holds the trained items
    of dataset indices 0..5+2m (labels T0/T1 alternating), so a later model has trained images
    an earlier one lacks."""

    def __init__(self, kind: str, pg=None, models: int = 3):
        self.kind = kind
        self.dir = Path(tempfile.mkdtemp(prefix="snca-carry-"))
        self.seeds = []
        for m in range(models):
            rows = [
                (i, TRAINED_LABELS[i % 2], "trained", {"dataset": "fake", "dataset_index": i},
                 embedding(b"trained-%d" % i).astype("<f4").tobytes())
                for i in range(6 + 2 * m)
            ]  # fmt: skip
            path = self.dir / f"seed{m}.sqlite"
            meta = {"model_fingerprint": fingerprint(m), "index_id": index_id(m), "dim": str(DIM)}
            meta["next_id"] = "1000"  # (added ids above every fake index's trained ids)
            create_store(path, rows, meta)
            self.seeds.append(path)
        if kind == "sqlite":
            self.cls, self.home = SqliteStore, str(self.dir / "data" / "gallery.sqlite")
        else:
            self.cls, self.home = PostgresStore, pg.new_database()
        self.cls(self.home, self.seeds[0], fingerprint(0), index_id(0)).close()

    def galleries(self) -> Galleries:
        return open_galleries(self.cls, self.home)

    def to(self, g: Galleries, m: int) -> To:
        def open_(seed_meta) -> object:
            target = g.target_of(gen(m))
            return self.cls(target, self.seeds[m], fingerprint(m), index_id(m), seed_meta)

        info = {"model_fingerprint": fingerprint(m), "index_id": index_id(m), "model": m}
        return To(gen(m), info, open_)

    def upgrade(self, m: int, switch: bool = True, say=lambda s: None, delay: float = 0.0):
        """snca-gallery upgrade --to model m [--switch], in-process (the same upgrade.run);
        `delay`: seconds each embedding call takes (a model's time, so that runs overlap)."""

        def slow(items):
            import time

            time.sleep(delay)
            return embed(items)

        with closing(self.galleries()) as g:
            return run(g, lambda g, live: (self.to(g, m), slow if delay else embed), switch, 2, say)

    def model_of(self, gen_: str) -> int:
        return next(m for m in range(len(self.seeds)) if gen(m) == gen_)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def closing(g: Galleries):
    try:
        yield g
    finally:
        g.close()
        g.home.close()


def live_added(place: Place, gen_: str | None = None) -> dict[int, str]:
    with closing(place.galleries()) as g:
        a = alias(g.home)
        s = g.open(gen_ or (a["gen"] if a else gen(0)))
        rows = s.select(
            "SELECT id, label FROM items WHERE source = 'added' AND deleted_seq IS NULL"
        )
        return dict(rows)


def add(place: Place, gen_: str, label: str, n: int, start: int) -> list[int]:
    """n adds of one image each on the gallery `gen_` (as its server would); the ids."""
    with closing(place.galleries()) as g:
        s, ids = g.open(gen_), []
        for i in range(start, start + n):
            b = image(i)
            ids += s.add(label, [embedding(b)], [None], [(b, "image/png")])[1]
        return ids
