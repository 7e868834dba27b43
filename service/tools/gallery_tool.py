"""snca-gallery: bulk registration into a service's gallery, export out of it, and its day-two
operations (service/tools/gallery_ops.py).

    snca-gallery import photos/ --model runs/demo          # photos/<label>/<images>
    snca-gallery import list.csv --model runs/demo         # rows: path,label (a header is fine)
    snca-gallery export out/ --model runs/demo             # out/items.jsonl + out/images/...
    snca-gallery upgrade --to runs/v2 [--switch]           # v2's gallery beside the live one
    snca-gallery rollback | galleries                      # switch back; which is live
    snca-gallery backup OUT | verify OUT | restore OUT     # consistent copies, checksummed
    snca-gallery compact --keep 1000 | prune --keep 3      # the log's floor; previous/
    snca-gallery relabel 17 18 --label Boots               # corrections: one write each
    snca-gallery rename Trouser Pants | merge Sneaker Shoes
    snca-gallery accept decisions.csv                      # rows id,label (service/tools/label_ops.py)
    snca-gallery review-export OUT | review-name F | review-dismiss F   # the review queue
    snca-gallery classify photos/ --out answers.csv        # the API's answers, no server needed
    snca-gallery learn                                     # retrain on the gallery, switch live

Same flags and SNCA_ settings as snca-serve (--model, --index, --data-dir, --store, --device,
--thumbnails), so it finds the very gallery the service serves. An import embeds the images
with the service's model and preprocessing, in batches with a progress bar, and writes each
batch through the service's durable write path (one store transaction per label and batch,
appended to the change log): a server running on the same store sees the items as they
commit. Reruns are resumable: an image already imported under the same label (same bytes,
recorded as metadata {"import": {"path", "sha256"}}) is skipped. Unreadable, oversized
(> SNCA_MAX_UPLOAD_BYTES) or non-regular files, bad CSV rows, CSV paths outside the CSV's
folder (absolute or with `..`, unless --allow-outside) and invalid labels are listed, skipped,
and make the exit status 1; nothing imported is lost.

An export is a point-in-time copy (one read transaction of the store: writes committed while
it runs are not in it): every live item to OUT/items.jsonl (id, label, source, metadata,
created_at, and for added items the stored image's path under OUT/images/<label>/) in id
order, OUT/labels.json (label -> folder; a label that is no safe folder name, or longer than
100 bytes, gets a number) and OUT/export.json (the gallery_version it shows, counts). Every
file and folder is created new inside OUT (no symbolic link is followed). A gallery that has
served is read from its store as found, no model loaded (tool_state.open_served_store); one
never served, or another model's, through the service's state as a start would open it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from embedding.cliutil import documented_parser, positive_int
from embedding.errors import SNCAError
from service.store.records import Keyed, StoreUnavailable
from service.tools.tool_state import (
    IMAGE_SUFFIXES,
    open_host,
    open_served_store,
    open_state,
    read_image_file,
    tool_settings,
)

EXT = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "image/gif": "gif"}


@dataclass
class Entry:
    path: Path
    key: str  # as recorded: the path relative to the source
    label: str


def _shared_flags(p: argparse.ArgumentParser) -> None:
    from service.config import add_gallery_flags

    add_gallery_flags(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def build_parser() -> argparse.ArgumentParser:
    p = documented_parser("snca-gallery", __doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser(
        "import",
        help="register a folder (SRC/<label>/<images>) or a CSV of path,label",
        argument_default=argparse.SUPPRESS,
    )
    imp.add_argument("source", type=Path, help="a folder of label folders, or a .csv file")
    _shared_flags(imp)
    imp.add_argument(
        "--thumbnails", action="store_true", help="keep a thumbnail of each image (the web page)"
    )
    imp.add_argument(
        "--allow-outside",
        action="store_true",
        help="import CSV rows whose path is absolute or climbs out of the CSV's folder (..)",
    )
    imp.add_argument(
        "--batch-size",
        type=positive_int,
        default=256,
        help="images per store transaction (default 256)",
    )
    exp = sub.add_parser(
        "export", help="write every item and stored image out", argument_default=argparse.SUPPRESS
    )
    exp.add_argument("out", type=Path, help="a new or empty folder")
    exp.add_argument(
        "--trained",
        action="store_true",
        help="also the trained items' images (from the dataset the model's run dir names): "
        "what a model learns from the whole gallery needs (snca-gallery learn)",
    )
    exp.add_argument(
        "--hold-out",
        type=float,
        metavar="F",
        help="a share F (0-0.5) of the items of every label of 4 or more (one at least), "
        "chosen by a hash of the id, under heldout/ instead of images/ (what a learned model "
        "is compared on)",
    )
    _shared_flags(exp)
    le = sub.add_parser(
        "learn",
        help="retrain the served model on what the gallery holds now (trained, added, corrected "
        "items), compare it with the served one on a held-out part, and switch to it live "
        "only when it is not worse; resumable (run again with the same --out)",
        argument_default=argparse.SUPPRESS,
    )
    le.add_argument("--out", type=Path, help="the learned run dir (default MODEL-learned-vVERSION)")
    le.add_argument("--epochs", type=positive_int, help="training epochs (default 3)")
    le.add_argument(
        "--hold-out",
        type=float,
        metavar="F",
        help="share of every label of 4+ items (one at least) kept out of training to compare on "
        "(default 0.1)",
    )
    le.add_argument(
        "--no-switch",
        dest="switch",
        action="store_false",
        help="train, index and compare, but leave the served model live",
    )
    le.add_argument(
        "--min-gain",
        type=float,
        help="switch only when the learned model's held-out score (the harmonic mean of "
        "top-1 on trained and on added items) beats the served one's by this much (default 0: "
        "not worse; negative: even a little worse)",
    )
    le.add_argument(
        "--balance",
        type=float,
        help="class-balanced training draws (snca-train --balance; default 1: every label "
        "drawn as often, whatever its size)",
    )
    le.add_argument("--seed", type=int, help="training seed")
    _shared_flags(le)
    up = sub.add_parser(
        "upgrade",
        help="build --to's gallery beside the live one (re-embedding every stored image, then "
        "following the log), resumable; --switch makes it the live gallery",
        argument_default=argparse.SUPPRESS,
    )
    up.add_argument("--to", type=Path, required=True, help="the new model's run dir")
    up.add_argument("--to-index", type=Path, help="its index dir (default TO/index)")
    up.add_argument(
        "--switch",
        action="store_true",
        help="then make it the live gallery (the old one goes on standby, for rollback)",
    )
    up.add_argument(
        "--batch-size", type=positive_int, default=64, help="images per write (default 64)"
    )
    _shared_flags(up)
    rb = sub.add_parser(
        "rollback",
        help="switch back to the previous gallery (carrying the writes made since into it)",
        argument_default=argparse.SUPPRESS,
    )
    _shared_flags(rb)
    gl = sub.add_parser(
        "galleries",
        help="list the store's galleries: live, standby, how far",
        argument_default=argparse.SUPPRESS,
    )
    _shared_flags(gl)
    bk = sub.add_parser(
        "backup",
        help="a consistent copy of a live gallery (images, log position, model) with its checksum",
        argument_default=argparse.SUPPRESS,
    )
    bk.add_argument("out", type=Path, help="a new or empty folder")
    ve = sub.add_parser(
        "verify",
        help="check a backup's file and gallery checksums",
        argument_default=argparse.SUPPRESS,
    )
    ve.add_argument("backup", type=Path, help="a folder `snca-gallery backup` wrote")
    _shared_flags(ve)  # (accepted for uniformity: a backup folder is all it reads)
    rs = sub.add_parser(
        "restore",
        help="verify a backup, then restore it into an empty data dir or database",
        argument_default=argparse.SUPPRESS,
    )
    rs.add_argument("backup", type=Path, help="a folder `snca-gallery backup` wrote")
    rs.add_argument(
        "--discard-galleries",
        action="store_true",
        help="move aside other models' galleries left in the place (kept, not deleted); "
        "without it a restore next to them is refused",
    )
    _shared_flags(rs)
    co = sub.add_parser(
        "compact",
        help="move the log's floor: forget deleted items' rows and old log rows",
        argument_default=argparse.SUPPRESS,
    )
    co.add_argument(
        "--upto", type=int, help="the write the log starts after (default: the head minus --keep)"
    )
    co.add_argument(
        "--keep", type=int, default=1000, help="the last N writes stay in the log (default 1000)"
    )
    pr = sub.add_parser(
        "prune",
        help="delete the oldest stores in DATA_DIR/previous/ (never the newest, never an only copy)",
        argument_default=argparse.SUPPRESS,
    )
    pr.add_argument(
        "--keep", type=positive_int, help="stores kept, newest first (SNCA_KEEP_PREVIOUS, 3)"
    )
    pr.add_argument("--dry-run", action="store_true", help="say what would be removed")
    _shared_flags(pr)
    for x in (bk, co):
        _shared_flags(x)
        x.add_argument(
            "--gallery", help="a gallery's gen (snca-gallery galleries; default: the live one)"
        )
    from service.tools import classify_folder, label_ops, review_ops

    label_ops.add_parsers(sub, _shared_flags)
    review_ops.add_parsers(sub, _shared_flags)
    classify_folder.add_parsers(sub, _shared_flags)
    for x in (imp, exp, up, rb, le):
        x.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="a progress line (also when the output is not a terminal)",
        )
    return p


# ---------------------------------------------------------------------------- sources
def read_entries(
    source: Path, allow_outside: bool = False, bad: list[str] | None = None
) -> list[Entry]:
    """ImageFolder (SRC/<label>/<image files>) or a CSV of path,label (paths relative to the
    CSV's folder; a first row "path,label" is a header; a UTF-8 BOM is fine). A CSV row that
    cannot be used is described in `bad` and skipped (with bad None: an error)."""
    if source.is_dir():
        out = []
        for d in sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for f in sorted(d.iterdir()):
                if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                    out.append(Entry(f, f.relative_to(source).as_posix(), d.name))
        if not out:
            raise SNCAError(
                f"{source} has no images in label folders ({source}/<label>/<image files>, "
                f"suffixes {', '.join(sorted(IMAGE_SUFFIXES))})"
            )
        return out
    if source.is_file() and source.suffix.lower() == ".csv":
        out = []

        def skip(n: int, why: str) -> None:
            if bad is None:
                raise SNCAError(f"{source}, line {n}: {why}")
            bad.append(f"{source.name}, line {n}: {why}")

        with open(source, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            n = 0
            while True:
                try:
                    row = next(rows)
                except StopIteration:
                    break
                except csv.Error as e:  # (a field over the csv module's limit, say)
                    skip(rows.line_num, str(e))
                    continue
                n += 1
                if not row or (
                    n == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]
                ):
                    continue
                if len(row) < 2 or not row[0].strip():
                    skip(rows.line_num, f"expected path,label; got {str(row)[:200]}")
                    continue
                path = Path(row[0].strip())
                if not allow_outside and (path.is_absolute() or ".." in path.parts):
                    skip(
                        rows.line_num,
                        f"{row[0][:200]!r} is outside the CSV's folder (--allow-outside "
                        "imports it)",
                    )
                    continue
                full = path if path.is_absolute() else source.parent / path
                out.append(Entry(full, path.as_posix(), row[1]))
        if not out and not bad:
            raise SNCAError(f"{source} lists no images (rows of path,label)")
        return out
    raise SNCAError(f"{source} is neither a folder of label folders nor a .csv file")


def import_images(args: dict, log=print) -> int:
    from embedding.progress import Progress
    from service.gallery.labels import LabelInvalid, check_label
    from service.model.embedder import ImageError, open_image
    from service.registration import register_batch
    from service.store import StoreUnavailable

    failed: list[str] = []
    entries = read_entries(args["source"], args.get("allow_outside", False), failed)
    host = open_state(args, snapshot_every=0)
    state = host.state
    s = state.settings
    added = skipped = 0
    try:
        todo = []
        for e in entries:
            try:
                todo.append(Entry(e.path, e.key, check_label(e.label, s.max_label_length)))
            except LabelInvalid as err:
                failed.append(f"{e.key}: label {e.label!r}: {err}")
        done = imported_keys(state.store)
        log(
            f"snca-gallery: {len(entries)} images in {args['source']}; the gallery has "
            f"{state.gallery.size()} items, {len(done)} of them imported before",
            flush=True,
        )
        batch = args.get("batch_size", 256)
        with Progress(len(todo), "importing", "img", enabled=args.get("progress", True)) as bar:
            for start in range(0, len(todo), batch):
                chunk = todo[start : start + batch]
                ready = []  # (label, Prepared, metadata)
                for e in chunk:
                    try:
                        data = read_image_file(e.path, s.max_upload_bytes)
                    except OSError as err:
                        failed.append(f"{e.key}: {err.strerror or err}")
                        continue
                    digest = hashlib.sha256(data).hexdigest()
                    if (e.label, digest) in done:
                        skipped += 1
                        continue
                    try:  # the service's decoding, limits and preprocessing
                        img = open_image(data, s.max_image_pixels, e.key)
                        p = state.runtime.uploads.prepare_image(img, data, e.key, s.thumbnails)
                    except ImageError as err:
                        failed.append(f"{e.key}: {err.message}")
                        continue
                    ready.append((e.label, p, {"import": {"path": e.key, "sha256": digest}}))
                    done.add((e.label, digest))  # the same bytes twice in one run: once
                try:
                    added += register_batch(state, ready, _import_key(s.idempotency_ttl_s))
                except StoreUnavailable as err:
                    raise SNCAError(
                        f"the gallery store refused the write ({err}); {added} images were "
                        "imported before it: run this again to import the rest"
                    ) from None
                bar.update(len(chunk))
        log(
            f"snca-gallery: imported {added}, skipped {skipped} already in, {len(failed)} "
            f"failed; the gallery has {state.gallery.size()} items at version "
            f"{state.gallery.version}",
            flush=True,
        )
        if added:  # what /gallery/add would say of each label imported into (overlaps...)
            for label in sorted({e.label for e in todo}):
                d = state.gallery.diagnose(label, s.vote, s.k, s.unknown_tpr)
                for w in d.warnings if d is not None else ():
                    log(f"snca-gallery: label {label!r}: {w}", flush=True)
    finally:
        host.stop()
    for f in failed[:50]:
        print(f"snca-gallery: skipped {f}", file=sys.stderr)
    if len(failed) > 50:
        print(f"snca-gallery: ... and {len(failed) - 50} more", file=sys.stderr)
    return 1 if failed else 0


def _import_key(ttl_s: float):
    """One Idempotency-Key per batch and label, from the images' digests: a rerun that forms
    the same batch is answered by the first write, never writes it twice."""

    def key_of(label: str, metadata: list) -> Keyed:
        ident = json.dumps([label, metadata], sort_keys=True)
        key = "import-" + hashlib.sha256(ident.encode()).hexdigest()[:40]
        return Keyed(key, key, ttl_s)

    return key_of


def imported_keys(store) -> set[tuple[str, str]]:
    """(label, sha256) of every live item an import added (its metadata says so)."""
    keys, after = set(), -1
    while True:
        page = store.added_items(after, 2000)
        if not page:
            return keys
        for it in page:
            md = json.loads(it.metadata) if it.metadata else None
            imp = md.get("import") if isinstance(md, dict) else None
            if isinstance(imp, dict) and isinstance(imp.get("sha256"), str):
                keys.add((it.label, imp["sha256"]))
        after = page[-1].id


def export_items(args: dict, log=print) -> int:
    from embedding.progress import Progress

    out: Path = args["out"]
    hold = args.get("hold_out")
    if hold is not None and not 0.0 <= hold <= 0.5:
        raise SNCAError(f"--hold-out {hold}: a share between 0 and 0.5")
    # The folder is opened once and everything is created inside it through that handle, new
    # (O_EXCL) and never through a symbolic link (O_NOFOLLOW): a link planted in OUT while
    # the gallery opens cannot send a file elsewhere.
    root = _open_export_dir(out)
    try:
        settings = tool_settings(args, snapshot_every=0)
        store, host = open_served_store(settings), None
        if store is None:  # (a gallery never served, another model's, a switch to settle)
            host = open_host(settings)
            store = host.state.store
        try:
            with store.reader() as view:  # one point in time
                n, n_images, version = _export(view, root, settings, args, Progress)
        finally:
            if host is not None:
                host.stop()
            else:
                store.close()
    finally:
        os.close(root)
    log(
        f"snca-gallery: exported {n} items ({n_images} images) at gallery_version {version} "
        f"to {out}",
        flush=True,
    )
    return 0


def _export(view, root: int, settings, args, Progress) -> tuple[int, int, int]:
    """Write the export (see the module docstring) from the store's point-in-time `view`: the
    added items' stored images, with --trained the trained items' images too (from the dataset
    the served model's run dir names: service/tools/trained_images.py), with --hold-out F a share
    F of the items of every label of at least HOLD_OUT_MIN items (one at least) under heldout/
    instead of images/ (what a model learning from images/ is compared on). (items, images,
    version)."""
    from service.tools.trained_images import (
        HOLD_OUT_MIN,
        TrainedImages,
        held_out_ids,
        trained_provenance,
    )

    version = view.last_seq()
    trained = None
    if args.get("trained"):
        prov = trained_provenance(Path(settings.model))
        if prov is not None:
            trained = TrainedImages(prov)
        elif view.label_counts() and _has_trained(view):
            raise SNCAError(
                f"--trained: {settings.model} records no dataset its trained items come "
                "from: their images cannot be exported"
            )
    hold = float(args.get("hold_out") or 0.0)
    held = held_out_ids(_id_labels(view), hold) if hold else set()
    folders = _Folders(root)
    images: dict[int, str] = {}
    missing = n_trained = n_held = 0

    def put(item_id: int, label: str, data: bytes, suffix: str) -> str:
        nonlocal n_held
        top = "images"
        if item_id in held:
            top, n_held = "heldout", n_held + 1
        sub, fd = folders.of(top, label)
        name = f"{item_id}.{suffix}"
        _write_new(fd, name, data)
        return f"{top}/{sub}/{name}"

    try:
        after = -1
        while True:  # the stored images of added items, by id
            page = view.added_items(after, 500)
            if not page:
                break
            for it in page:
                missing += it.image is None
                if it.image is not None:
                    ext = EXT.get(it.image_type or "", "bin")
                    images[it.id] = put(it.id, it.label, it.image, ext)
            after = page[-1].id
        n = 0
        total = sum(view.label_counts().values())
        with Progress(total, "exporting", "item", enabled=args.get("progress", True)) as bar:
            after = -1
            fd = os.open("items.jsonl", _NEW, 0o644, dir_fd=root)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                while True:
                    page = view.item_rows(after, 2000)
                    if not page:
                        break
                    lines = []
                    for r in page:
                        if trained is not None and r.source == "trained":
                            got = trained.image(r.metadata)
                            if got is not None:
                                images[r.id] = put(r.id, r.label, got[0], "t." + got[1])
                                n_trained += 1
                        row = {
                            "id": r.id,
                            "label": r.label,
                            "source": r.source,
                            "metadata": r.metadata,
                            "created_at": r.created_at,
                            "image": images.get(r.id),
                        }
                        if hold:
                            row["held_out"] = (images.get(r.id) or "").startswith("heldout/")
                        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
                        n += 1
                    f.write("".join(lines))
                    bar.update(len(page))
                    after = page[-1].id
    finally:
        folders.close()
    _write_new(
        root, "labels.json", json.dumps(folders.labels, ensure_ascii=False, indent=1).encode()
    )
    summary = {"gallery_version": version, "items": n, "images": len(images) - n_held}
    # where the gallery lives: a run trained on this export records it (RunDir.GALLERY)
    summary["data_dir"] = str(Path(settings.data_dir).resolve())
    summary["added_without_image"] = missing
    if trained is not None:  # (what an index of a model learned from it re-embeds them from)
        summary["trained"] = {"provenance": trained.provenance, "images": n_trained}
    if hold:
        summary["held_out"] = {"fraction": hold, "images": n_held, "min_label_items": HOLD_OUT_MIN}
    _write_new(root, "export.json", json.dumps(summary, indent=1).encode())
    if missing:  # a training run on OUT/images (snca-train --dataset imagefolder) lacks them
        print(
            f"snca-gallery: warning: {missing} added items have no stored image (added with "
            "SNCA_STORE_IMAGES off or over SNCA_MAX_STORED_IMAGE_BYTES): they are in "
            "items.jsonl but not in images/, so a model trained on images/ never sees them",
            file=sys.stderr,
        )
    return n, len(images), version


def _id_labels(view) -> list[tuple[int, str]]:
    """(id, label) of every live item of the export's point-in-time view."""
    out, after = [], -1
    while page := view.item_rows(after, 5000):
        out += [(r.id, r.label) for r in page]
        after = page[-1].id
    return out


def _has_trained(view) -> bool:
    return bool(
        view.conn.execute(
            "SELECT 1 FROM items WHERE source = 'trained' AND deleted_seq IS NULL LIMIT 1"
        ).fetchone()
    )


class _Folders:
    """The label folders of an export (images/<folder>/, heldout/<folder>/), made on first
    use inside the export's handle; `labels`: label -> folder (labels.json)."""

    def __init__(self, root: int):
        self.root = root
        self.labels: dict[str, str] = {}
        self._taken: set[str] = set()
        self._fds: dict[tuple[str, str], int] = {}
        self._tops: dict[str, int] = {}

    def of(self, top: str, label: str) -> tuple[str, int]:
        sub = self.labels.get(label)
        if sub is None:
            sub = self.labels[label] = _folder(label, self._taken)
        if top not in self._tops:
            self._tops[top] = _mkdir(self.root, top)
        if (top, sub) not in self._fds:
            self._fds[(top, sub)] = _mkdir(self._tops[top], sub)
        return sub, self._fds[(top, sub)]

    def close(self) -> None:
        for fd in (*self._fds.values(), *self._tops.values()):
            os.close(fd)


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def _open_export_dir(out: Path) -> int:
    """A handle on OUT, a new or empty folder (created here when absent), not a link."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(out)
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise SNCAError(f"{out} is not a folder this can write into ({e.strerror})") from None
    if os.listdir(fd):
        os.close(fd)
        raise SNCAError(f"{out} exists and is not an empty folder")
    return fd


def _mkdir(parent: int, name: str) -> int:
    """A new folder `name` in the folder `parent` (a handle), opened without following links."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as e:
        raise SNCAError(
            f"cannot create {name!r} in the export folder ({e.strerror}): something else "
            "wrote into it meanwhile"
        ) from None


def _write_new(parent: int, name: str, data: bytes) -> None:
    try:
        fd = os.open(name, _NEW, 0o644, dir_fd=parent)
    except OSError as e:
        raise SNCAError(
            f"cannot create {name!r} in the export folder ({e.strerror}): something else "
            "wrote into it meanwhile"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


MAX_FOLDER_BYTES = 100  # a label longer than this (UTF-8) gets a number: NAME_MAX is 255 bytes


def _folder(label: str, taken: set[str]) -> str:
    """The label itself as a folder name where that is safe (so the export imports back as
    an image folder), else a free number (labels.json maps them)."""
    bad = set('/\\\0:*?"<>|') & set(label)
    name = label
    n = len(taken)
    while (
        bad
        or name.startswith(".")
        or name.strip() != name
        or name in taken
        or len(name.encode("utf-8", "surrogatepass")) > MAX_FOLDER_BYTES
    ):
        name, bad, n = f"{n:05d}", set(), n + 1
    taken.add(name)
    return name


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        from service.logs import setup_logging

        setup_logging(args.get("log_level", "warning"))
        if args["cmd"] == "import":
            return import_images(args)
        if args["cmd"] == "export":
            return export_items(args)
        from service.tools import classify_folder, gallery_ops, label_ops, learn, review_ops

        commands = {
            **classify_folder.COMMANDS,
            **gallery_ops.COMMANDS,
            **label_ops.COMMANDS,
            **review_ops.COMMANDS,
            **learn.COMMANDS,
        }
        return commands[args["cmd"]]({k.replace("-", "_"): v for k, v in args.items()})
    except ImportError as e:
        print(f"snca-gallery: error: {e} (pip install 'snca[serve]')", file=sys.stderr)
        return 2
    except (SNCAError, OSError, ValueError, RuntimeError, StoreUnavailable) as e:
        print(f"snca-gallery: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("snca-gallery: interrupted; every batch written before is kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
