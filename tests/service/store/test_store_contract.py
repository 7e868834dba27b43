"""The Store contract (service/store/base.py): the same cases against SQLite and a real
PostgreSQL (tests/service/pg.py), on a seed store made here (no model needed). A backend that
answers differently from the other fails here, whatever its SQL."""

from __future__ import annotations

import inspect
import json
import threading

import numpy as np
import pytest

from embedding.gallery import create_store, schema_statements
from service.store import BACKENDS, NothingChanged, Store, StoreReader, backend_of, sql
from service.store.postgres import PostgresStore
from service.store.sqlite import SqliteStore

DIM = 8
FP, INDEX = "sha256:" + "ab" * 32, "build-1"
TRAINED = {"a": 3, "b": 2}  # label -> trained items in the seed


@pytest.fixture
def seed(tmp_path):
    rng = np.random.default_rng(0)
    rows, i = [], 0
    for label, n in TRAINED.items():
        for _ in range(n):
            v = rng.normal(size=DIM).astype("<f4")
            rows.append(
                (i, label, "trained", {"dataset_index": i}, v.tobytes(), b"png" if i % 2 else None)
            )
            i += 1
    path = tmp_path / "seed.sqlite"
    create_store(path, rows, {"model_fingerprint": FP, "index_id": INDEX, "dim": str(DIM)})
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, seed, tmp_path) -> Store:
    if request.param == "sqlite":
        s = SqliteStore(tmp_path / "data" / "gallery.sqlite", seed, FP, INDEX)
    else:
        pg = request.getfixturevalue("postgres")
        s = PostgresStore(pg.new_database(), seed, FP, INDEX)
    yield s
    s.close()


def vecs(n: int, seed: int = 1) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_every_backend_implements_the_whole_interface_with_its_signatures():
    abstract = Store.__abstractmethods__
    assert {"claims", "transaction", "changes_after", "reader", "_next_ids"} <= abstract
    for cls in BACKENDS.values():
        assert issubclass(cls, Store) and not inspect.isabstract(cls), cls.__name__
        for name in abstract:
            want = inspect.signature(getattr(Store, name))
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(want.parameters), (cls.__name__, name)


def test_the_registry_picks_the_backend_by_target(tmp_path):
    assert backend_of("postgresql://u@h/db") == "postgresql"
    assert backend_of("postgres://u@h/db") == "postgresql"
    assert backend_of(tmp_path / "g.sqlite") == "sqlite"
    assert backend_of(str(tmp_path / "postgresql.sqlite")) == "sqlite"


def test_both_backends_create_the_same_tables():
    for dialect in ("sqlite", "postgresql"):
        names = [s.split()[2] for s in schema_statements(dialect) if s.startswith("CREATE TABLE")]
        want = ["meta", "items", "log", "tombstones", "label_changes", "review", "requests"]
        assert names == want, dialect


def _reopened_as_of(store, seed, version: int, drop: list[str]):
    """`store` made to look written by schema `version` (`drop` run, the version set back),
    closed and opened again: what opening an old store does to it."""

    def older(conn):
        for stmt in drop:
            conn.execute(stmt)
        conn.execute(store.dialect.q(sql.SET_META), (str(version), "schema_version"))

    store.plain(older)
    cls, target = type(store), store.url if isinstance(store, SqliteStore) else store._dsn
    store.close()
    return cls(target, seed, FP, INDEX)


def test_a_store_of_schema_5_gets_the_new_tables_and_keeps_its_writes(store, seed):
    """Schema 6 added the tables tombstones and requests: a store written before gets them
    (empty) when opened, on both backends, and its items stay."""
    seq, ids = store.add("x", vecs(1), [None], [None])
    again = _reopened_as_of(store, seed, 5, ["DROP TABLE tombstones", "DROP TABLE requests"])
    try:
        assert again.meta()["schema_version"] == "7"
        assert again.select("SELECT COUNT(*) FROM tombstones")[0][0] == 0
        assert [i.id for i in again.live_items() if i.source == "added"] == ids
        assert again.delete(label="x")[0] > seq  # and writes tombstones now
        assert again.select("SELECT kind, name FROM tombstones") == [("label", "x")]
    finally:
        again.close()


def test_a_store_of_schema_6_gets_its_label_deletes_as_label_changes(store, seed):
    """Schema 7 added label_changes (a label's deletes and renames, in order, for a carry): a
    store written before gets the table, filled from its label tombstones, on both backends."""
    store.add("x", vecs(1), [None], [None])
    dseq, _ = store.delete(label="x")
    again = _reopened_as_of(store, seed, 6, ["DROP TABLE label_changes"])
    try:
        assert again.meta()["schema_version"] == "7"
        got = again.select("SELECT seq, kind, name, new FROM label_changes")
        assert got == [(dseq, "label", "x", None)]
    finally:
        again.close()


def test_deletes_leave_tombstones_and_keyed_writes_replay(store):
    """A label's delete leaves a label tombstone, a trained item's delete by id a trained one
    (its [dataset, dataset_index]); a write under a used Idempotency-Key writes nothing and
    says what the first one did."""
    from service.store.records import Keyed, Replayed

    k = Keyed("key-1", "digest-1")
    seq, ids = store.add("x", vecs(2), [None, None], [None, None], keyed=k)
    with pytest.raises(Replayed) as e:
        store.add("x", vecs(2), [None, None], [None, None], keyed=k)
    assert (e.value.seq, e.value.outcome["ids"], e.value.same) == (seq, ids, True)
    with pytest.raises(Replayed) as e:
        store.add("y", vecs(1), [None], [None], keyed=Keyed("key-1", "other"))
    assert not e.value.same and store.last_seq() == seq  # nothing written
    assert store.request("key-1") == ("digest-1", seq, {"op": "add", "ids": ids, "label": "x"})
    assert store.delete([0])[0]  # a trained item, by id
    assert store.delete(label="b")[0]
    rows = sorted(store.select("SELECT kind, name FROM tombstones"))
    assert rows == [("label", "b"), ("trained", "[null, 0]")]


def test_seeded_store_holds_the_trained_items(store):
    meta = store.meta()
    assert meta["model_fingerprint"] == FP and meta["index_id"] == INDEX
    assert store.dim == DIM and store.last_seq() == 0
    items = store.live_items()
    assert [(i.id, i.label, i.source) for i in items] == [
        (0, "a", "trained"),
        (1, "a", "trained"),
        (2, "a", "trained"),
        (3, "b", "trained"),
        (4, "b", "trained"),
    ]
    assert all(i.world is None and i.embedding.shape == (DIM,) for i in items)
    assert store.with_thumbnails([0, 1, 2, 3]) == {1, 3}
    assert store.thumbnail(1) == b"png" and store.thumbnail(0) is None


def test_add_numbers_writes_and_ids_and_the_log_follows(store):
    worlds = np.arange(2 * 5, dtype=np.float32).reshape(2, 5)
    seq, ids = store.add(
        "new", vecs(2), [{"k": "é"}, None], [(b"img", "image/png"), None], [b"t", None], worlds
    )
    assert (seq, ids) == (1, [5, 6])
    seq2, ids2 = store.add("b", vecs(1, 2), [None], [None])
    assert (seq2, ids2) == (2, [7])
    assert store.last_seq() == 2 and store.head() == 2
    assert store.log_gaps() == (0, 2, [])
    assert isinstance(store.log_token(1), str) and store.log_token(1) != store.log_token(2)
    assert store.log_token(99) is None

    got = store.items([5, 6, 7, 100])
    assert got == {
        5: ("new", "added", {"k": "é"}, True),
        6: ("new", "added", None, False),
        7: ("b", "added", None, False),
    }
    added = store.live_items(after_seq=0)
    assert [i.id for i in added] == [5, 6, 7] and [i.add_seq for i in added] == [1, 1, 2]
    assert np.array_equal(added[0].world, worlds[0]) and added[2].world is None
    assert [i.id for i in store.live_items(after_seq=0, upto=1)] == [5, 6]

    stored = store.added_items(after_id=-1, limit=10)
    assert [s.id for s in stored] == [5, 6, 7]
    assert stored[0].image == b"img" and stored[0].image_type == "image/png"
    assert stored[0].thumbnail == b"t" and isinstance(stored[0].embedding, bytes)
    assert [s.id for s in store.added_items(after_id=5, limit=1)] == [6]

    cs = store.changes_after(0)
    assert (cs.last_seq, cs.floor) == (2, 0)
    assert [(c.seq, c.op, c.ids, c.label) for c in cs.changes] == [
        (1, "add", [5, 6], "new"),
        (2, "add", [7], "b"),
    ]
    assert np.allclose(cs.changes[0].embeddings, vecs(2), atol=1e-6)
    assert np.array_equal(cs.changes[0].worlds[1], worlds[1])
    assert [c.seq for c in store.changes_after(1).changes] == [2]


def test_deletes_by_id_and_by_label_resolve_in_the_store(store):
    store.add("new", vecs(2), [None, None], [None, None])  # seq 1, ids 5, 6
    seq, rows = store.delete(ids=[0, 5, 42])
    assert seq == 2 and sorted(r[0] for r in rows) == [0, 5]
    assert {r[0]: (r[1], r[3]) for r in rows} == {0: ("a", "trained"), 5: ("new", "added")}
    assert store.delete(ids=[0, 5]) == (0, [])  # nothing live: no write
    assert store.last_seq() == 2
    seq, rows = store.delete(label="a")
    assert seq == 3 and sorted(r[0] for r in rows) == [1, 2]
    assert store.delete(label="a") == (0, [])
    assert 0 not in store.items([0, 1, 3]) and set(store.items([0, 1, 3])) == {3}
    assert {d[0] for d in store.deleted_after(1)} == {0, 1, 2, 5}
    cs = store.changes_after(1)
    assert [(c.seq, c.op, sorted(c.ids)) for c in cs.changes] == [
        (2, "delete", [0, 5]),
        (3, "delete", [1, 2]),
    ]
    # an add and its delete both after the version: both in order
    assert [(c.seq, c.op) for c in store.changes_after(0).changes] == [
        (1, "add"),
        (2, "delete"),
        (3, "delete"),
    ]


def test_item_pages_filter_and_follow_the_cursor(store):
    store.add("b", vecs(1), [{"x": 1}], [None], [b"t"])  # id 5
    page = store.item_rows(after_id=-1, limit=3)
    assert [r.id for r in page] == [0, 1, 2]
    assert [r.id for r in store.item_rows(after_id=2, limit=10)] == [3, 4, 5]
    rows = store.item_rows(after_id=-1, limit=10, label="b")
    assert [(r.id, r.source, r.has_thumbnail) for r in rows] == [
        (3, "trained", True),
        (4, "trained", False),
        (5, "added", True),
    ]
    assert rows[2].metadata == {"x": 1} and rows[2].created_at
    assert [r.id for r in store.item_rows(after_id=-1, limit=10, item_id=4)] == [4]
    store.delete(ids=[4])
    assert store.item_rows(after_id=-1, limit=10, item_id=4) == []


def test_a_reader_sees_the_store_as_it_was_when_it_opened(store):
    store.add("x", vecs(2), [None, None], [(b"i1", "image/png"), (b"i2", "image/png")])
    with store.reader() as r:
        assert isinstance(r, StoreReader)
        store.add("y", vecs(1), [None], [None])
        store.delete(ids=[5])
        assert r.last_seq() == 1
        assert [s.id for s in r.added_items(-1, 10)] == [5, 6]
        assert [x.id for x in r.item_rows(-1, 100)] == [0, 1, 2, 3, 4, 5, 6]
    assert store.last_seq() == 3


def test_transaction_rolls_back_on_nothing_changed_and_on_errors(store):
    def nothing(conn, seq):
        raise NothingChanged(["why"])

    assert store.transaction(nothing, "delete") == (0, ["why"])
    assert store.last_seq() == 0 and store.log_gaps() == (0, 0, [])

    def boom(conn, seq):
        raise ValueError("boom")

    with pytest.raises(ValueError):
        store.transaction(boom, "add")
    assert store.last_seq() == 0
    seq, result = store.transaction(lambda conn, seq: seq * 10, "migrate")
    assert (seq, result) == (1, 10) and store.log_gaps() == (0, 1, [])


def test_compaction_forgets_deleted_history_and_moves_the_floor(store):
    store.add("x", vecs(2), [None, None], [None, None])  # 1: ids 5, 6
    store.delete(ids=[5])  # 2
    store.delete(ids=[0])  # 3 (a trained item: its row stays)
    store.add("y", vecs(1), [None], [None])  # 4
    assert store.compact(3) == 1  # the added item deleted by then
    floor, last, missing = store.log_gaps()
    assert (floor, last, missing) == (3, 4, [])
    assert store.log_token(3) is not None and store.log_token(2) is None
    cs = store.changes_after(3)
    assert cs.floor == 3 and [(c.seq, c.op) for c in cs.changes] == [(4, "add")]


def test_concurrent_writers_get_gap_free_seqs_in_commit_order(store):
    errors = []

    def writer(k):
        try:
            for _ in range(5):
                store.add(f"w{k}", vecs(1, k), [None], [None])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.last_seq() == 20 and store.log_gaps() == (0, 20, [])
    seqs = [c.seq for c in store.changes_after(0).changes]
    assert seqs == list(range(1, 21))
    ids = [i for c in store.changes_after(0).changes for i in c.ids]
    assert sorted(ids) == list(range(5, 25))  # every id once


def test_two_writers_of_the_review_queue_keep_its_bound_exactly(store, seed):
    """Issue 51: on PostgreSQL two fronts writing the review queue at once each counted it
    without the other's rows (READ COMMITTED) and together kept it past its byte bound, and the
    rows they said they dropped summed past what was queued. Now the bookkeeping takes turns
    (Store._take_turns): after every write the queue is within its bounds, and the drops
    reported are the rows that went."""
    from service.store.records import Queued

    other = type(store)(
        store.url if store.dialect.name == "postgresql" else store.path, seed, FP, INDEX
    )
    size = 4 * DIM + 500
    bound = 20 * size
    dropped, errors = [], []

    def writer(s, k):
        try:
            for r in range(15):
                rows = [
                    Queued(10_000 * k + 10 * r + i, None, vecs(1, seed=i)[0], None, None, "a",
                           0.01, "unknown_score", thumbnail=b"t" * 500)
                    for i in range(3)
                ]  # fmt: skip
                dropped.append(s.queue(rows, 10**6, bound, 3600))
                n, b = s.queue_totals()
                assert b <= bound, (n, b)
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [
        threading.Thread(target=writer, args=(s, k)) for k, s in enumerate((store, other) * 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other.close()
    assert not errors, errors
    n, b = store.queue_totals()
    assert b <= bound and n == 20
    assert sum(dropped) == 4 * 15 * 3 - n  # (each row dropped once, by one writer)


def test_a_server_opening_a_store_another_holds_waits_for_it(seed, tmp_path):
    # A second replica starting while the first upgrades a large store's schema (one write
    # transaction, longer than SQLite's 5 s busy wait): it waits its turn instead of exiting
    # with 'database is locked'. (The same retry covers the locks SQLite refuses without
    # waiting, two connections upgrading theirs at once, as a fresh-clone run saw.)
    import sqlite3

    path = tmp_path / "data" / "gallery.sqlite"
    SqliteStore(path, seed, FP, INDEX).close()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("DROP TABLE requests")
    released = threading.Timer(6.0, lambda: holder.execute("COMMIT"))
    released.start()
    try:
        s = SqliteStore(path, seed, FP, INDEX)
        assert s.meta()["schema_version"] == "7" and len(s.live_items()) == 5
        s.close()
    finally:
        released.join()
        holder.close()


def test_corrections_move_labels_in_place_and_the_log_brings_them(store):
    """Relabel, rename and merge (issue 43): one write each, items keep their ids, the rows
    move to the correction's seq so a follower's read of the log brings them; a rename onto a
    label with items and a merge into one without are refused with nothing written."""
    from service.store.records import Keyed, Refused, Replayed

    seq, ids = store.add("c", vecs(3), [None] * 3, [None] * 3)
    seq2, moved = store.relabel([ids[0], 1, 999], "d", Keyed("k1", "x"))
    assert seq2 == seq + 1 and [m.id for m in moved] == [1, ids[0]]
    assert {m.id: (m.old, m.source) for m in moved} == {1: ("a", "trained"), ids[0]: ("c", "added")}
    assert np.allclose(moved[1].embedding, vecs(3)[0], atol=1e-6)
    assert store.relabel([ids[0]], "d") == (0, [])  # already there: nothing written
    with pytest.raises(Replayed):
        store.relabel([ids[1]], "d", Keyed("k1", "x"))
    cs = store.changes_after(seq)
    [c] = cs.changes
    assert (c.seq, c.op, c.label, sorted(c.ids)) == (seq2, "relabel", "d", [1, ids[0]])
    assert sorted(c.sources) == ["added", "trained"]
    with pytest.raises(Refused) as e:
        store.rename("c", "d")
    assert e.value.code == "label_exists"
    with pytest.raises(Refused) as e:
        store.rename("c", "nobody", merge=True)
    assert e.value.code == "label_unknown"
    assert store.last_seq() == seq2  # (both refused: rolled back)
    seq3, moved = store.rename("c", "e")
    assert sorted(m.id for m in moved) == ids[1:] and store.rename("c", "f") == (0, [])
    seq4, moved = store.rename("e", "d", merge=True)
    rows = store.item_rows(-1, 100)
    assert {r.id: r.label for r in rows if r.label == "d"} == {1: "d", **{i: "d" for i in ids}}
    assert seq4 == seq3 + 1 and len(store.live_items()) == 5 + 3
    changes = store.select("SELECT seq, kind, name, new FROM label_changes ORDER BY seq")
    assert changes == [
        (seq2, "trained", "[null, 1]", "d"),  # (the trained image, by its dataset index)
        (seq3, "label", "c", "e"),
        (seq4, "label", "e", "d"),
    ]
    # a delete after a relabel: the follower gets the item's delete, once
    dseq, _ = store.delete([ids[0]])
    [dc] = store.changes_after(seq4).changes
    assert (dc.op, dc.ids) == ("delete", [ids[0]]) and dc.seq == dseq
    # issue 51: a keyed write that changes nothing is still a write of its own (a seq, a log
    # row of no items) recording its outcome, so a retry is answered alike and the key cannot
    # serve another request; unkeyed, nothing is written
    assert store.relabel([ids[1]], "d") == (0, [])
    nseq, moved = store.relabel([ids[1]], "d", Keyed("k2", "y"))
    assert nseq == dseq + 1 and moved == [] and store.changes_after(dseq).changes == []
    assert store.request("k2") == ("y", nseq, {"op": "relabel", "rows": [], "label": "d"})
    with pytest.raises(Replayed) as r:
        store.relabel([ids[1]], "e", Keyed("k2", "z"))
    assert not r.value.same and store.last_seq() == nseq
    assert store.delete([999], keyed=Keyed("k3", "y")) == (nseq + 1, [])
    assert store.request("k3")[2] == {"op": "delete", "rows": [], "label": None}
    # refusals: recorded with a key (and raised with that write's seq), rolled back without
    with pytest.raises(Refused) as e:
        store.relabel([999], "d")
    assert (e.value.code, e.value.seq, store.last_seq()) == ("item_unknown", 0, nseq + 1)
    # a label with no items renamed onto one with items: nothing to rename (not a conflict)
    assert store.rename("nobody", "d") == (0, [])
    seq5, _ = store.add("e", vecs(1), [None], [None])
    with pytest.raises(Refused) as e:
        store.rename("d", "e", keyed=Keyed("k5", "y"))
    assert (e.value.code, e.value.seq) == ("label_exists", seq5 + 1)
    assert store.request("k5")[2]["refused"][0] == "label_exists"
    assert store.items([1])[1][0] == "d"  # (nothing moved)


def test_the_review_queue_keeps_its_bounds_and_a_named_group_is_one_add(store):
    """The review queue (issue 43) on both backends: bounded in rows and bytes (the oldest go
    first), rows past the retention go, nothing of it is in the log; naming queued rows is one
    add (in the log, followed) that takes them out of the queue, once."""
    from service.store.records import Keyed, Queued, Replayed

    def row(i, age_s=0.0, thumb=b"t" * 100):
        import datetime as dt

        at = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=age_s)
        v = vecs(1, seed=i)[0]
        return Queued(1000 + i, at.isoformat(timespec="seconds"), v, None, None, "a", 0.01,
                      "unknown_score", thumbnail=thumb)  # fmt: skip

    head = store.last_seq()
    assert store.queue([row(i, age_s=100 - i) for i in range(5)], 10, 10**6, 3600) == 0
    assert store.queue_totals() == (5, 5 * (4 * DIM + 100))
    assert store.last_seq() == head  # (not a gallery write)
    # bounded: 6 rows at most, the oldest go first; then a byte bound
    assert store.queue([row(i, age_s=50 - i) for i in range(5, 9)], 6, 10**6, 3600) == 3
    assert sorted(q.id for q in store.queued(100)) == [1003, 1004, 1005, 1006, 1007, 1008]
    assert store.queue([], 100, 3 * (4 * DIM + 100), 3600) == 3
    assert sorted(q.id for q in store.queued(100)) == [1006, 1007, 1008]
    # retention: a row older than it goes at the next write
    assert store.queue([row(20, age_s=7200)], 100, 10**6, 3600) == 1
    assert store.queued_thumbnail(1006) == b"t" * 100 and store.queued_thumbnail(1) is None
    # naming: one add, out of the queue, its vectors as queued
    seq, ids, named = store.name_queued([1006, 1007, 999], "new", Keyed("n1", "d"))
    assert seq == head + 1 and len(ids) == 2 and [q.id for q in named] == [1006, 1007]
    [c] = store.changes_after(head).changes
    assert (c.op, c.label, c.ids) == ("add", "new", ids)
    assert np.allclose(c.embeddings[0], vecs(1, seed=6)[0], atol=1e-6)
    assert [q.id for q in store.queued(100)] == [1008]
    assert store.name_queued([1006], "new") == (0, [], [])  # named already: nothing written
    with pytest.raises(Replayed):
        store.name_queued([1008], "new", Keyed("n1", "d"))
    items = store.stored_items(ids)
    assert [json.loads(it.metadata)["review"]["answered"] for it in items] == [None, None]
    assert all(it.thumbnail == b"t" * 100 and it.image is None for it in items)
    assert store.dismiss([1008, 5]) == 1 and store.queue_totals() == (0, 0)


def test_the_followers_read_of_the_changes_walks_the_seq_indexes_not_every_item(seed, tmp_path):
    """changes_after runs after every write in every process: SQLite must find the rows by
    add_seq and deleted_seq, not walk all items (embeddings included) in id order, which an
    ORDER BY on the union itself made it do (~30 ms a write at 55,000 trained items)."""
    s = SqliteStore(tmp_path / "data" / "gallery.sqlite", seed, FP, INDEX)
    try:
        plan = s.conn.execute("EXPLAIN QUERY PLAN " + sql.SQLITE.q(sql.CHANGES), (1, 1, 1))
        steps = [row[-1] for row in plan]
    finally:
        s.close()
    assert any("USING INDEX items_add_seq" in x for x in steps), steps
    assert any("USING INDEX items_deleted_seq" in x for x in steps), steps
    assert not any(x.startswith("SCAN items") for x in steps), steps
