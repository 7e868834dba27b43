"""snca-gallery: bulk registration into a service's gallery, and export out of it.

    snca-gallery import photos/ --model runs/demo          # photos/<label>/<images>
    snca-gallery import list.csv --model runs/demo         # rows: path,label (a header is fine)
    snca-gallery export out/ --model runs/demo             # out/items.jsonl + out/images/...

Same flags and SNCA_ settings as snca-serve (--model, --index, --data-dir, --store, --device,
--thumbnails), so it finds the very gallery the service serves. An import embeds the images
with the service's model and preprocessing, in batches with a progress bar, and writes each
batch through the service's durable write path (one store transaction per label and batch,
appended to the change log): a server running on the same store sees the items as they
commit. Reruns are resumable: an image already imported under the same label (same bytes,
recorded as metadata {"import": {"path", "sha256"}}) is skipped. Unreadable images and
invalid labels are listed, skipped, and make the exit status 1; nothing imported is lost.

An export writes every live item to OUT/items.jsonl (id, label, source, metadata, created_at,
and for added items the stored image's path under OUT/images/<label>/) in id order, and
OUT/labels.json (label -> folder; a label that is no safe folder name gets a number).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from embedding.cliutil import positive_int
from embedding.errors import SNCAError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
EXT = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "image/gif": "gif"}


@dataclass
class Entry:
    path: Path
    key: str  # as recorded: the path relative to the source
    label: str


def _shared_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="training run dir (default SNCA_MODEL or runs/demo)")
    p.add_argument("--index", type=Path, help="index dir (default MODEL/index)")
    p.add_argument(
        "--store",
        help="the gallery store: a SQLite file (default DATA_DIR/gallery.sqlite) or "
        "postgresql://USER[:PASSWORD]@HOST:PORT/DB",
    )
    p.add_argument("--data-dir", type=Path, help="the gallery's data dir (default data/<model>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snca-gallery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        "--batch-size",
        type=positive_int,
        default=256,
        help="images per store transaction (default 256)",
    )
    exp = sub.add_parser(
        "export", help="write every item and stored image out", argument_default=argparse.SUPPRESS
    )
    exp.add_argument("out", type=Path, help="a new or empty folder")
    _shared_flags(exp)
    for x in (imp, exp):
        x.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="a progress line (also when the output is not a terminal)",
        )
    return p


# ---------------------------------------------------------------------------- sources
def read_entries(source: Path) -> list[Entry]:
    """ImageFolder (SRC/<label>/<image files>) or a CSV of path,label (paths relative to the
    CSV's folder; a first row "path,label" is a header)."""
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
        with open(source, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), start=1):
                if not row or (
                    n == 1 and [c.strip().lower() for c in row[:2]] == ["path", "label"]
                ):
                    continue
                if len(row) < 2 or not row[0].strip():
                    raise SNCAError(f"{source}, line {n}: expected path,label; got {row!r}")
                path = Path(row[0].strip())
                full = path if path.is_absolute() else source.parent / path
                out.append(Entry(full, path.as_posix(), row[1]))
        if not out:
            raise SNCAError(f"{source} lists no images (rows of path,label)")
        return out
    raise SNCAError(f"{source} is neither a folder of label folders nor a .csv file")


# ---------------------------------------------------------------------------- the service
def open_state(args: dict, **overrides):
    """The ServiceState a server on these settings would have (model, gallery, store)."""
    from pydantic import ValidationError

    from .config import Settings
    from .startup import ServiceHost

    given = {k.replace("-", "_"): v for k, v in args.items() if k in SETTINGS}
    try:
        settings = Settings(**given, **overrides)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SNCAError(msgs) from None
    host = ServiceHost(settings)
    opening = host.open()
    if opening.plan is not None:
        host.stop()
        raise SNCAError(
            f"the gallery in {opening.data.path} was made with another model or index: start "
            "snca-serve with this model once to carry it over, then run this again"
        )
    host.finish()
    return host


SETTINGS = ("model", "index", "store", "data_dir", "device", "log_level", "thumbnails")


def import_images(args: dict, log=print) -> int:
    from embedding.progress import Progress

    from .embedder import ImageError, open_image
    from .inputs import check_label
    from .problems import Problem

    entries = read_entries(args["source"])
    host = open_state(args, snapshot_every=0)
    state = host.state
    s = state.settings
    failed: list[str] = []
    added = skipped = 0
    try:
        todo = []
        for e in entries:
            try:
                todo.append(Entry(e.path, e.key, check_label(e.label, s.max_label_length)))
            except Problem as p:
                failed.append(f"{e.key}: label {e.label!r}: {p.detail}")
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
                ready = []  # (entry, Prepared, metadata)
                for e in chunk:
                    try:
                        data = e.path.read_bytes()
                    except OSError as err:
                        failed.append(f"{e.key}: {err.strerror or err}")
                        continue
                    digest = hashlib.sha256(data).hexdigest()
                    if (e.label, digest) in done:
                        skipped += 1
                        continue
                    try:  # the service's decoding, limits and preprocessing
                        img = open_image(data, s.max_image_pixels, e.key)
                        p = state.runtime._finish(img, data, e.key, s.thumbnails)
                    except ImageError as err:
                        failed.append(f"{e.key}: {err.message}")
                        continue
                    ready.append((e, p, {"import": {"path": e.key, "sha256": digest}}))
                    done.add((e.label, digest))  # the same bytes twice in one run: once
                added += _write(state, ready)
                bar.update(len(chunk))
        log(
            f"snca-gallery: imported {added}, skipped {skipped} already in, {len(failed)} "
            f"failed; the gallery has {state.gallery.size()} items at version "
            f"{state.gallery.version}",
            flush=True,
        )
    finally:
        host.stop()
    for f in failed[:50]:
        print(f"snca-gallery: skipped {f}", file=sys.stderr)
    if len(failed) > 50:
        print(f"snca-gallery: ... and {len(failed) - 50} more", file=sys.stderr)
    return 1 if failed else 0


def _write(state, ready: list) -> int:
    """Embed a batch and write it as /gallery/add does: one store transaction per label."""
    if not ready:
        return 0
    s = state.settings
    emb = state.runtime.embed_pixels([p.pixels for _, p, _ in ready])  # (n, d)
    by_label: dict[str, list[int]] = {}
    for i, (e, _, _) in enumerate(ready):
        by_label.setdefault(e.label, []).append(i)
    for label, rows in by_label.items():
        ps = [ready[i][1] for i in rows]
        stored = [
            (p.data, p.mime) if s.store_images and len(p.data) <= s.max_stored_image_bytes else None
            for p in ps
        ]
        state.add(label, emb[rows], [ready[i][2] for i in rows], stored, [p.thumbnail for p in ps])
    return len(ready)


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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SNCAError(f"{out} exists and is not an empty folder")
    host = open_state(args, snapshot_every=0)
    store = host.state.store
    try:
        total = host.state.gallery.size()
        (out / "images").mkdir(parents=True, exist_ok=True)
        label_dirs: dict[str, str] = {}
        taken: set[str] = set()
        images, after, n = {}, -1, 0
        while True:  # the stored images of added items, by id
            page = store.added_items(after, 500)
            if not page:
                break
            for it in page:
                if it.image is not None:
                    sub = label_dirs.setdefault(it.label, _folder(it.label, taken))
                    (out / "images" / sub).mkdir(exist_ok=True)
                    rel = f"images/{sub}/{it.id}.{EXT.get(it.image_type or '', 'bin')}"
                    (out / rel).write_bytes(it.image)
                    images[it.id] = rel
            after = page[-1].id
        with (
            open(out / "items.jsonl", "w", encoding="utf-8") as f,
            Progress(total, "exporting", "item", enabled=args.get("progress", True)) as bar,
        ):
            after = -1
            while True:
                page = store.item_rows(after, 2000)
                if not page:
                    break
                for r in page:
                    row = {
                        "id": r.id,
                        "label": r.label,
                        "source": r.source,
                        "metadata": r.metadata,
                        "created_at": r.created_at,
                        "image": images.get(r.id),
                    }
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    n += 1
                bar.update(len(page))
                after = page[-1].id
        (out / "labels.json").write_text(json.dumps(label_dirs, ensure_ascii=False, indent=1))
        log(f"snca-gallery: exported {n} items ({len(images)} images) to {out}", flush=True)
    finally:
        host.stop()
    return 0


def _folder(label: str, taken: set[str]) -> str:
    """The label itself as a folder name where that is safe (so the export imports back as
    an image folder), else a free number (labels.json maps them)."""
    bad = set('/\\\0:*?"<>|') & set(label)
    name = label
    n = len(taken)
    while bad or name.startswith(".") or name.strip() != name or name in taken:
        name, bad, n = f"{n:05d}", set(), n + 1
    taken.add(name)
    return name


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        from .logs import setup_logging

        setup_logging(args.get("log_level", "warning"))
        if args["cmd"] == "import":
            return import_images(args)
        return export_items(args)
    except ImportError as e:
        print(f"snca-gallery: error: {e} (pip install 'snca[serve]')", file=sys.stderr)
        return 2
    except (SNCAError, OSError, ValueError, RuntimeError) as e:
        print(f"snca-gallery: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("snca-gallery: interrupted; every batch written before is kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
