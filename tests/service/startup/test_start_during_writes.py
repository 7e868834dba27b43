"""A replica that starts while other processes write (issue 51): its read of the store (the log's
head, the items, the deletes) is one point in time, whatever commits meanwhile, and a snapshot
that disagrees with the store is found and not used. On SQLite and a real PostgreSQL, the app
in this process (the start-up code is what is tested; the writes are another store connection's,
as another process's would be).

The window a concurrent write needs is widened deterministically: the write is committed from
inside the start-up's read, at the moment the snapshot is loaded (`load_snapshot`, between the
read of the log's head and the read of the items that brought the bug: a rename committed there
left the renamed items out of the rows and in the index, and the follower then added their
vectors a second time)."""

from __future__ import annotations

import numpy as np
import pytest

from service.store.registry import open_as_found

from ..helpers import make_client, of_class, png


def _store_of(client):
    return client.app.state.snca.state.store.url


def _agrees(client, n_items: int, query: bytes) -> str:
    """The gallery holds each live item of the store once (the index's ids are the store's live
    ids, none twice; the rows as many; a search near `query` returns no id twice): its
    checksum."""
    import faiss

    st = client.app.state.snca.state
    g = st.gallery
    held = faiss.vector_to_array(g.vectors.index.id_map).tolist()
    held = [i for i in held if i not in g.vectors.tombstones]
    live = sorted(it.id for it in st.store.live_items())
    assert len(held) == len(set(held)), f"{len(held) - len(set(held))} vectors held twice"
    assert sorted(held) == live and g.size() == len(live) == n_items
    files = {"image": ("q.png", query, "image/png")}
    hits = client.post("/search", files=files, params={"k": 100}).json()["items"]
    ids = [h["id"] for h in hits]
    assert len(ids) == len(set(ids)), "an item found twice"
    return g.checksum()


@pytest.fixture(params=["sqlite", "postgresql"])
def where(request, tmp_path):
    if request.param == "sqlite":
        return {}
    return {"store": request.getfixturevalue("postgres").new_database()}


def test_a_replica_started_while_a_correction_commits_holds_each_item_once(
    base_run, tmp_path, fmnist_train, monkeypatch, where
):
    import service.startup.finishing as startup

    shots = of_class(fmnist_train, 0, 30)
    files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in shots]
    data = tmp_path / "serve"
    with make_client(base_run, data, **where) as c:
        ids = c.post("/gallery/add", data={"label": "top"}, files=files).json()["ids"]
        c.post("/admin/snapshot")  # (the moved items are in the snapshot's index)
        url = _store_of(c)
        n = c.app.state.snca.state.gallery.size()

    real = startup.load_snapshot
    committed = []

    def load_snapshot(*a, **kw):
        snap = real(*a, **kw)
        if not committed:  # another process's corrections, committed now
            s = open_as_found(url)
            try:
                committed.append(s.rename("top", "tops")[0])
                committed.append(s.relabel(ids[:5], "shirt")[0])
            finally:
                s.close()
        return snap

    monkeypatch.setattr(startup, "load_snapshot", load_snapshot)
    with make_client(base_run, data, **where) as c:
        assert committed and all(committed)
        state = c.app.state.snca.state
        state.catch_up()  # (the follower's work, now)
        assert state.gallery.version == max(committed)
        counts = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
        assert counts["tops"] == 25 and counts["shirt"] == 5 and "top" not in counts
        got = _agrees(c, n, png(fmnist_train, shots[0]))
    monkeypatch.setattr(startup, "load_snapshot", real)
    with make_client(base_run, data, **where) as c:  # a start with nothing committing
        assert _agrees(c, n, png(fmnist_train, shots[0])) == got


def test_a_snapshot_that_disagrees_with_the_store_is_found_and_not_used(
    base_run, tmp_path, fmnist_train, where
):
    """A snapshot whose index holds an item twice (what the bug above saved) and lacks another:
    the start compares the index with the store's live items, discards the snapshot and loads
    the built index; the next start finds no bad snapshot."""
    from service.gallery.snapshot import load_snapshot, write_snapshot

    shots = of_class(fmnist_train, 0, 12)
    files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in shots]
    data = tmp_path / "serve"
    with make_client(base_run, data, **where) as c:
        ids = c.post("/gallery/add", data={"label": "top"}, files=files).json()["ids"]
        st = c.app.state.snca.state
        seq, _ = st.snapshot()
        n, fp, index_id = st.gallery.size(), st.fingerprint, st.index_id
        token = st.store.log_token(seq)
    snap = load_snapshot(data, fp, index_id, seq, lambda s: token)
    v = snap.index.reconstruct(ids[0])
    snap.index.add_with_ids(v[None, :], np.array([ids[0]], dtype=np.int64))  # twice
    snap.index.remove_ids(np.array([ids[1]], dtype=np.int64))  # lacking
    import faiss

    write_snapshot(data, faiss.serialize_index(snap.index), seq, set(), fp, index_id, token)
    for _ in range(2):
        with make_client(base_run, data, **where) as c:
            _agrees(c, n, png(fmnist_train, shots[1]))
            assert c.app.state.snca.state.gallery.rows.has(ids[1])
