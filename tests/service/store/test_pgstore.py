"""The PostgreSQL store against a real server (tests/service/pg.py), without a service process:
a database owned by an ordinary role, in SQL_ASCII (what initdb makes under the C locale)."""

from __future__ import annotations

import sqlite3

import numpy as np
import psycopg

from service.store.postgres import PostgresStore, redact


def test_sql_ascii_database_owned_by_a_plain_role_seeds_writes_and_follows(postgres, base_run):
    with psycopg.connect(postgres.url(), autocommit=True) as c:
        c.execute("CREATE ROLE snca_plain LOGIN PASSWORD 'secret-pw'")
        c.execute(
            "CREATE DATABASE snca_ascii OWNER snca_plain ENCODING 'SQL_ASCII' "
            "LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        )
    url = f"postgresql://snca_plain:secret-pw@127.0.0.1:{postgres.port}/snca_ascii"
    seed = base_run / "index" / "gallery.sqlite"
    meta = dict(sqlite3.connect(seed).execute("SELECT key, value FROM meta"))
    store = PostgresStore(url, seed, meta["model_fingerprint"], meta["index_id"])
    try:
        assert store.url == redact(url) and "secret-pw" not in store.url
        assert store.meta()["model_fingerprint"] == meta["model_fingerprint"]  # text, not bytes
        emb = np.eye(2, store.dim, dtype=np.float32)
        seq, ids = store.add("café", emb, [{"k": "é"}, None], [None, None])
        seq2, gone = store.delete(ids[:1])
        assert [g[0] for g in gone] == ids[:1]
        cs = store.changes_after(0)
        assert [(c.seq, c.op) for c in cs.changes] == [(seq, "add"), (seq2, "delete")]
        assert cs.changes[0].label == "café" and cs.changes[1].ids == ids[:1]
        assert cs.changes[0].ids == ids and np.allclose(cs.changes[0].embeddings, emb)  # id order
        assert store.log_gaps() == (0, seq2, [])
        assert store.items(ids)[ids[1]][0] == "café"
    finally:
        store.close()


def test_a_catch_up_never_waits_behind_the_followers_long_poll(postgres, base_run):
    """A follower thread sits in wait_head (up to its timeout) on the listening connection;
    changes_after, which a model process calls before it answers a write's sync, must not wait
    for it. It did: every add through a model process on PostgreSQL took 1 to 7 s (the reader
    waited on the follower's lock, which the follower kept taking back first)."""
    import threading

    seed = base_run / "index" / "gallery.sqlite"
    meta = dict(sqlite3.connect(seed).execute("SELECT key, value FROM meta"))
    store = PostgresStore(
        postgres.new_database(), seed, meta["model_fingerprint"], meta["index_id"]
    )
    try:
        seq, ids = store.add("x", np.eye(1, store.dim, dtype=np.float32), [None], [None])
        waiting = threading.Event()
        done = threading.Event()

        def follower():
            waiting.set()
            store.wait_head(seq, 30.0)  # nothing else is written: waits the whole 30 s
            done.set()

        t = threading.Thread(target=follower, daemon=True)
        t.start()
        waiting.wait()
        threading.Event().wait(0.5)  # (the follower is inside its long poll now)
        cs = store.changes_after(0)
        assert [c.ids for c in cs.changes] == [ids]
        assert not done.is_set()  # answered while the follower still waits
    finally:
        store.close()  # (ends the long poll within a second)
        t.join(timeout=5)


def test_a_gallery_opened_as_found_is_one_connection(postgres, base_run):
    """The tools and the carry open a store as found (registry.open_as_found) for each step;
    each connection is a server process. The meta is read on the connection the store keeps:
    one backend for the open (it was two: 3,490 connections in the carry model's PostgreSQL
    test, 1,427 since), and none left open by an open that is refused. A gallery a newer
    version wrote is refused and left as it is (its schema version was overwritten with this
    version's, as if upgraded)."""
    from embedding.errors import ArtifactError
    from service.store.registry import open_as_found

    seed = base_run / "index" / "gallery.sqlite"
    meta = dict(sqlite3.connect(seed).execute("SELECT key, value FROM meta"))
    url = postgres.new_database()
    PostgresStore(url, seed, meta["model_fingerprint"], meta["index_id"]).close()
    db = url.rsplit("/", 1)[1]

    def backends() -> int:
        with psycopg.connect(postgres.url(), autocommit=True) as c:
            q = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
            return c.execute(q, (db,)).fetchone()[0]

    seen = []
    real = psycopg.connect

    def counted(*a, **k):
        seen.append(a[0] if a else k.get("conninfo"))
        return real(*a, **k)

    psycopg.connect = counted
    try:
        store = open_as_found(url)
    finally:
        psycopg.connect = real
    try:
        assert len(seen) == 1 and backends() == 1
        assert store.meta()["model_fingerprint"] == meta["model_fingerprint"]
        assert store.add("x", np.eye(1, store.dim, dtype=np.float32), [None], [None])[0] > 0
    finally:
        store.close()
    with psycopg.connect(url, autocommit=True) as c:  # a newer version's: refused
        c.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    try:
        open_as_found(url)
        raise AssertionError("a newer version's gallery was opened")
    except ArtifactError as e:
        assert "has schema 999, which this version cannot read" in str(e)
    assert backends() == 0  # (the refused store left no connection open)
    with psycopg.connect(url, autocommit=True) as c:  # (it was "upgraded" down to this one's)
        q = "SELECT value FROM meta WHERE key = 'schema_version'"
        assert c.execute(q).fetchone()[0] == "999"
