"""snca-gallery's review-queue commands (issue 43), for people who script: export the queue
grouped as GET /review groups it, then name (or dismiss) what a person decided. They work on the
live gallery's store; no model is loaded (a queued query keeps its vector).

    snca-gallery review-export OUT/     # OUT/review.csv (one row per queued query, by group,
                                        # an empty `label` column to fill) + OUT/thumbnails/
    snca-gallery review-name OUT/review.csv      # rows with a label: named (one write per
                                                 # label, like POST /review/name)
    snca-gallery review-dismiss OUT/review.csv   # rows with no label: dropped from the queue
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from embedding.errors import SNCAError
from service.gallery.labels import LabelInvalid, check_label
from service.review import groups as grouping
from service.tools.gallery_ops import open_gallery, settings_of, write_by_label

COLUMNS = (
    "queued_id", "group", "group_size", "label", "nearest_label", "answer", "margin",
    "unknown_reason", "created_at", "thumbnail",
)  # fmt: skip


def add_parsers(sub, shared) -> None:
    import argparse

    d = argparse.SUPPRESS
    ex = sub.add_parser(
        "review-export",
        help="write the review queue, grouped, to OUT/review.csv and OUT/thumbnails/",
        argument_default=d,
    )
    ex.add_argument("out", type=Path, help="a new or empty folder")
    ex.add_argument(
        "--limit", type=int, default=grouping.MAX_QUERIES, help="newest queued queries exported"
    )
    nm = sub.add_parser(
        "review-name",
        help="name the queued queries of a review.csv whose label column is filled",
        argument_default=d,
    )
    nm.add_argument("file", type=Path, help="a review.csv (columns queued_id and label)")
    ds = sub.add_parser(
        "review-dismiss",
        help="drop the queued queries of a review.csv whose label column is empty",
        argument_default=d,
    )
    ds.add_argument("file", type=Path, help="a review.csv (columns queued_id and label)")
    for p in (ex, nm, ds):
        shared(p)


def _link(store) -> float:
    """groups.link_similarity from the store's live items (the label statistics a server
    keeps in memory, summed here)."""
    from service.gallery.rows import LabelStats

    items = store.live_items()
    stats = LabelStats(len(items[0].embedding) if items else 1)
    for it in items:
        stats.add(stats.id_of(it.label), it.embedding[None, :], 0)
    link = grouping.link_similarity(stats)
    return 0.5 if link is None else link


def review_export(args: dict, say=print) -> int:
    from embedding.thumbnails import thumbnail_mime

    out = Path(args["out"])
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SNCAError(f"{out} exists and is not an empty folder")
    store, gen = open_gallery(args)
    try:
        rows = store.queued(max(1, int(args.get("limit") or grouping.MAX_QUERIES)))
        link = _link(store)
        emb = np.stack([q.embedding for q in rows]) if rows else np.zeros((0, 1), np.float32)
        groups = grouping.group(emb, link)
        (out / "thumbnails").mkdir(parents=True, exist_ok=True)
        n = 0
        with open(out / "review.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for k, g in enumerate(groups):
                for i in g.members:
                    q = rows[i]
                    thumb = store.queued_thumbnail(q.id) if q.has_thumbnail else None
                    name = ""
                    if thumb is not None:
                        ext = "jpg" if thumbnail_mime(thumb) == "image/jpeg" else "png"
                        name = f"thumbnails/{q.id}.{ext}"
                        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                        with os.fdopen(fd, "wb") as t:
                            t.write(thumb)
                    w.writerow(
                        [q.id, k + 1, len(g.members), "", q.nearest or "", q.answer or "",
                         f"{q.margin:.4f}", q.reason or "", q.created_at, name]
                    )  # fmt: skip
                    n += 1
    finally:
        store.close()
    say(
        f"{gen}: {n} queued queries in {len(groups)} groups written to {out / 'review.csv'}; "
        "fill the label column, then snca-gallery review-name (and review-dismiss) it"
    )
    return 0


def _read(path: Path, settings) -> tuple[dict[str, list[int]], list[int]]:
    """({label: queued ids}, queued ids with no label) of a review.csv; every bad row named
    (SNCAError), nothing applied."""
    named: dict[str, list[int]] = {}
    blank, bad = [], []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            r = csv.DictReader(f)
            if not r.fieldnames or not {"queued_id", "label"} <= set(r.fieldnames):
                raise SNCAError(f"{path}: needs the columns queued_id and label (a header row)")
            for n, row in enumerate(r, 2):
                try:
                    qid = int(row["queued_id"])
                except (TypeError, ValueError):
                    bad.append(f"row {n}: {row['queued_id']!r} is not a queued id")
                    continue
                label = (row.get("label") or "").strip()
                if not label:
                    blank.append(qid)
                    continue
                try:
                    named.setdefault(check_label(label, settings.max_label_length), []).append(qid)
                except LabelInvalid as e:
                    bad.append(f"row {n}: {e}")
    except UnicodeDecodeError as e:
        raise SNCAError(f"{path} is not UTF-8 text: {e}") from None
    if bad:
        raise SNCAError(f"{path}: nothing applied; " + "; ".join(bad[:20]))
    return named, blank


def review_name(args: dict, say=print) -> int:
    named, _ = _read(Path(args["file"]), settings_of(args))
    if not named:
        raise SNCAError(f"{args['file']}: no row has a label")

    def name(store, gen: str, ids: list[int], label: str) -> int:
        seq, new, _ = store.name_queued(ids, label)
        if seq:
            say(f"{gen}: write {seq}: {len(new)} queued queries are now {label!r}")
        return len(new)

    total = write_by_label(args, named, name)
    asked = sum(len(v) for v in named.values())
    say(f"{total} of {asked} named ({asked - total} were not queued any more)")
    return 0


def review_dismiss(args: dict, say=print) -> int:
    _, blank = _read(Path(args["file"]), settings_of(args))
    store, gen = open_gallery(args)
    try:
        n = store.dismiss(sorted(set(blank))) if blank else 0
    finally:
        store.close()
    say(f"{gen}: {n} queued queries dismissed")
    return 0


COMMANDS = {
    "review-export": review_export,
    "review-name": review_name,
    "review-dismiss": review_dismiss,
}
