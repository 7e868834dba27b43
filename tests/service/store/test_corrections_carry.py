"""Corrections (issue 43: relabel, rename, merge) carried by the one carry engine, on SQLite
and a real PostgreSQL, in-process on fake models (tests/service/galleries_fake.py): an upgrade
brings every correction into the new model's gallery, trained images its index holds and the
old one lacked included; a rollback carries the corrections made meanwhile back into a gallery
that holds the items already; a follow during a carry applies them in order."""

from __future__ import annotations

import json

from service.store.carry import compose_label_changes

from ..galleries_fake import Place, add, closing, gen, live_added


def trained(place: Place, gen_: str) -> dict[int, str]:
    """dataset index -> label of the live trained items of a gallery."""
    with closing(place.galleries()) as g:
        rows = g.open(gen_).select(
            "SELECT metadata, label FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
        )
    return {json.loads(md)["dataset_index"]: label for md, label in rows}


def store(g, m: int):
    return g.open(gen(m))


def labels_of(rows):
    """compose_label_changes of label rows (seq, old, new) only: the label mapping."""
    return compose_label_changes([(q, "label", old, new) for q, old, new in rows])[0]


def test_label_changes_compose_in_order_and_a_write_applies_together():
    # a chain, a swap through a temporary name, a delete after a merge, a rename back
    assert labels_of([(1, "a", "b"), (2, "b", "c")]) == {"a": "c", "b": "c"}
    swap = [(1, "x", "tmp"), (2, "y", "x"), (3, "tmp", "y")]
    assert labels_of(swap) == {"x": "y", "y": "x", "tmp": "y"}
    assert labels_of([(1, "a", "b"), (2, "b", None)]) == {"a": None, "b": None}
    assert labels_of([(1, "a", "b"), (2, "b", "a")]) == {"b": "a"}
    # one write's rows at once (a target's bury records a composed mapping at one seq)
    assert labels_of([(5, "x", "y"), (5, "y", "x")]) == {"x": "y", "y": "x"}
    assert labels_of([(1, "a", None), (2, "b", "a")]) == {"a": None, "b": "a"}
    # a trained image relabelled, then its new label renamed, then deleted
    rows = [(1, "trained", "k", "late"), (2, "label", "late", "x")]
    assert compose_label_changes(rows) == ({"late": "x"}, {"k": "x"})
    rows += [(3, "label", "x", None), (4, "trained", "j", "x")]
    assert compose_label_changes(rows) == ({"late": None, "x": None}, {"k": None, "j": "x"})


def test_an_upgrade_and_a_rollback_carry_every_correction(place):
    ids = add(place, gen(0), "a", 4, 0)
    with closing(place.galleries()) as g:
        s = store(g, 0)
        assert s.relabel(ids[:2], "b")[0]
        assert s.relabel([1], "one")[0]  # a trained image, by id (T1)
        assert s.rename("T0", "zero")[0]  # a trained label: model 2's index has more of it
        # T1 and "b" swapped through a temporary name, then "a" merged into T1
        assert s.rename("T1", "tmp")[0] and s.rename("b", "T1")[0] and s.rename("tmp", "b")[0]
        assert s.rename("a", "T1", merge=True)[0]
    want_added = {i: "T1" for i in ids}
    assert live_added(place, gen(0)) == want_added
    place.upgrade(2, True)  # model 2's index: trained images 6..9 model 0's never had
    assert live_added(place, gen(2)) == want_added
    t = trained(place, gen(2))
    assert t == {i: ("zero" if i % 2 == 0 else "b") for i in range(10) if i != 1} | {1: "one"}
    # corrections on the new live gallery, carried back by a rollback into model 0's gallery,
    # which holds every one of these items already
    with closing(place.galleries()) as g:
        s = store(g, 2)
        assert s.relabel([ids[0], 7], "late")[0]
        assert s.rename("zero", "even")[0]
    place.upgrade(0, True)
    assert live_added(place, gen(0)) == {**want_added, ids[0]: "late"}
    t0 = trained(place, gen(0))
    assert t0 == {0: "even", 1: "one", 2: "even", 3: "b", 4: "even", 5: "b"}
    # and on into model 1 (trained 0..7): 7 was relabelled on model 2's gallery, 6 renamed
    place.upgrade(1, True)
    t1 = trained(place, gen(1))
    assert t1 == {**t0, 6: "even", 7: "late"}


def test_corrections_made_while_a_carry_follows_are_applied_in_order(place):
    ids = add(place, gen(0), "a", 3, 0)
    place.upgrade(1, False)  # built beside, not switched: the next run follows the log
    with closing(place.galleries()) as g:
        s = store(g, 0)
        assert s.relabel([ids[0]], "x")[0]
        assert s.rename("x", "y")[0]
        assert s.delete(label="T1")[0]
        assert s.rename("T0", "T1")[0]  # the name of a deleted label, reused
        assert s.relabel([ids[1]], "T1")[0]
    place.upgrade(1, True)
    assert live_added(place, gen(1)) == {ids[0]: "y", ids[1]: "T1", ids[2]: "a"}
    assert trained(place, gen(1)) == {i: "T1" for i in range(8) if i % 2 == 0}
