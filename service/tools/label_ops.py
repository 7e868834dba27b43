"""snca-gallery's corrections (issue 43), for people who script: relabel items, rename or merge
a label, accept a file of (id, label) decisions. Each is one durable write of the live
gallery's store (the one the alias names), in the change log like the service's own: every
running server and model process follows it, an upgrade carries it. No model is loaded.

    snca-gallery relabel 17 18 --label Boots       # items 17, 18 -> Boots (one write)
    snca-gallery rename Trouser Pants               # a label renamed (Pants must have no item)
    snca-gallery merge Sneaker Shoes                # Sneaker's items into Shoes (which has some)
    snca-gallery accept decisions.csv               # rows id,label (a header is fine): one
                                                    # write per label, up to 1000 ids each
"""

from __future__ import annotations

import csv
from pathlib import Path

from embedding.errors import SNCAError
from service.gallery.labels import LabelInvalid, check_label, normalize_label
from service.tools.gallery_ops import MAX_IDS, open_gallery, settings_of, write_by_label

MAX_ROWS = 1_000_000  # rows of one accept file


def add_parsers(sub, shared) -> None:
    """The commands' parsers on `sub` (snca-gallery's subparsers); `shared(p)` adds the flags
    every command takes (--model, --store, --data-dir ...)."""
    import argparse

    d = argparse.SUPPRESS
    rl = sub.add_parser("relabel", help="move items to a label (one write)", argument_default=d)
    rl.add_argument("ids", type=int, nargs="+", help="item ids (snca-gallery export lists them)")
    rl.add_argument("--label", required=True, help="their new label")
    rn = sub.add_parser(
        "rename", help="rename a label (the new name must have no item)", argument_default=d
    )
    rn.add_argument("label", help="the label now")
    rn.add_argument("to", help="its new name")
    mg = sub.add_parser(
        "merge", help="move every item of a label into another that has items", argument_default=d
    )
    mg.add_argument("label", help="the label merged away")
    mg.add_argument("into", help="the label it is merged into")
    ac = sub.add_parser(
        "accept",
        help="apply a CSV of id,label decisions (a review's or suggestions' export, edited)",
        argument_default=d,
    )
    ac.add_argument("file", type=Path, help="CSV rows of id,label (a header row is fine)")
    for p in (rl, rn, mg, ac):
        shared(p)


def _checked(label: str, settings) -> str:
    try:
        return check_label(label, settings.max_label_length)
    except LabelInvalid as e:
        raise SNCAError(f"label {label!r}: {e}") from None


def relabel(args: dict, say=print) -> int:
    settings = settings_of(args)
    label = _checked(args["label"], settings)
    ids = sorted({int(i) for i in args["ids"]})
    if any(i < 0 for i in ids):
        raise SNCAError("item ids are 0 or more")
    store, gen = open_gallery(args)
    try:
        moved = _relabel(store, gen, ids, label, say)
    finally:
        store.close()
    if not moved:
        say(f"no live item among those ids was under another label than {label!r}")
    return 0


def _relabel(store, gen: str, ids: list[int], label: str, say) -> int:
    """`ids` to `label`, one write per MAX_IDS; the items moved."""
    from service.store.records import Refused

    moved = 0
    for s in range(0, len(ids), MAX_IDS):
        try:
            seq, rows = store.relabel(ids[s : s + MAX_IDS], label)
        except Refused:  # (none of this part is live)
            continue
        moved += len(rows)
        if seq:
            say(f"{gen}: write {seq}: {len(rows)} items to {label!r}")
    return moved


def _rename(args: dict, new_key: str, merge: bool, say) -> int:
    from service.store.records import Refused

    settings = settings_of(args)
    old, new = normalize_label(args["label"]), _checked(args[new_key], settings)
    if old == new:
        raise SNCAError(f"{old!r} is {new!r} already")
    store, gen = open_gallery(args)
    try:
        seq, moved = store.rename(old, new, merge)
    except Refused as e:
        raise SNCAError(str(e)) from None
    finally:
        store.close()
    if not seq:
        raise SNCAError(f"no live items with label {old!r}")
    say(f"{gen}: write {seq}: {len(moved)} items of {old!r} now {new!r}")
    return 0


def rename(args: dict, say=print) -> int:
    return _rename(args, "to", False, say)


def merge(args: dict, say=print) -> int:
    return _rename(args, "into", True, say)


def read_decisions(path: Path, settings) -> dict[str, list[int]]:
    """label -> ids from a CSV of id,label rows (a first row that is no id: a header); every
    bad row named (SNCAError), nothing applied."""
    out: dict[str, list[int]] = {}
    bad = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if n > MAX_ROWS:
                    raise SNCAError(f"{path}: more than {MAX_ROWS} rows")
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) < 2:
                    bad.append(f"row {n}: expected id,label")
                    continue
                try:
                    item = int(row[0])
                except ValueError:
                    if n == 1:
                        continue  # a header
                    bad.append(f"row {n}: {row[0]!r} is not an item id")
                    continue
                try:
                    label = check_label(row[1], settings.max_label_length)
                except LabelInvalid as e:
                    bad.append(f"row {n}: {e}")
                    continue
                out.setdefault(label, []).append(item)
    except UnicodeDecodeError as e:
        raise SNCAError(f"{path} is not UTF-8 text: {e}") from None
    if bad:
        raise SNCAError(f"{path}: nothing applied; " + "; ".join(bad[:20]))
    return out


def accept(args: dict, say=print) -> int:
    settings = settings_of(args)
    decisions = read_decisions(Path(args["file"]), settings)
    if not decisions:
        raise SNCAError(f"{args['file']} holds no id,label row")
    moved = write_by_label(
        args, decisions, lambda st, gen, ids, label: _relabel(st, gen, ids, label, say)
    )
    n = sum(len(v) for v in decisions.values())
    say(f"{moved} of {n} items moved ({n - moved} were there already, or are not live)")
    return 0


COMMANDS = {"relabel": relabel, "rename": rename, "merge": merge, "accept": accept}
