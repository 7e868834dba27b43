"""Move the labels added through /gallery/add from one gallery store to a running service,
typically one serving a new model (a store is tied to its model's embeddings, so the images are
embedded again by the new model).

    python -m service.tools.label_copy data/demo/gallery.sqlite http://127.0.0.1:8001   # to another model
    SNCA_API_KEY=... python -m service.tools.label_copy OLD.sqlite URL --labels my-shoe,my-bag --dry-run

Reads the old store read-only (it is never changed). Each live added item with its stored image
(SNCA_STORE_IMAGES, on by default) is posted to URL/gallery/add, CHUNK images per request, with
its metadata plus {"migrated_from": old id}. Labels the target already has are skipped unless
--append. Items without a stored image are counted and named, not migrated. Exit status 0 when
every eligible item was migrated, 1 if a request failed (what was sent before stays), 2 on bad
arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path

from embedding.cliutil import documented_parser
from embedding.errors import ArtifactError
from embedding.gallery import open_store


def _multipart(fields: list[tuple[str, str]], files: list[tuple[str, bytes, str]]):
    boundary = uuid.uuid4().hex
    out = bytearray()
    for name, value in fields:
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        out += value.encode() + b"\r\n"
    for i, (name, data, mime) in enumerate(files):
        out += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="image{i}"\r\nContent-Type: {mime}\r\n\r\n'
        ).encode()
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def _request(
    url: str,
    key: str | None,
    body: bytes | None = None,
    ctype: str | None = None,
    idempotency: str | None = None,
):
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    if ctype:
        req.add_header("Content-Type", ctype)
    if key:
        req.add_header("X-API-Key", key)
    if idempotency:
        req.add_header("Idempotency-Key", idempotency)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read()).get("detail", e.reason)
        except (ValueError, AttributeError):
            detail = e.reason
        raise RuntimeError(f"{e.code} from {url}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise RuntimeError(f"cannot reach {url}: {e}") from None


def read_added(store: Path, labels: set[str] | None):
    """{label: [(old id, metadata, image bytes, mime)]} and [(old id, label)] without image."""
    conn = open_store(store, readonly=True)
    try:
        rows = conn.execute(
            "SELECT id, label, metadata, image, image_type FROM items "
            "WHERE source = 'added' AND deleted_seq IS NULL ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    by_label, missing = defaultdict(list), []
    for item_id, label, md, image, mime in rows:
        if labels is not None and label not in labels:
            continue
        if image is None:
            missing.append((item_id, label))
            continue
        meta = json.loads(md) if md else {}
        by_label[label].append((item_id, {**meta, "migrated_from": item_id}, image, mime))
    return by_label, missing


def main(argv: list[str] | None = None) -> int:
    ap = documented_parser("python -m service.tools.label_copy", __doc__)
    ap.add_argument("store", type=Path, help="the old gallery store (SQLite), read only")
    ap.add_argument("url", help="the target service, e.g. http://127.0.0.1:8000")
    ap.add_argument("--labels", help="comma-separated labels to move (default: every added one)")
    ap.add_argument("--chunk", type=int, default=16, help="images per /gallery/add request (16)")
    ap.add_argument("--append", action="store_true", help="add to labels the target already has")
    ap.add_argument("--dry-run", action="store_true", help="only report what would be sent")
    ap.add_argument("--api-key", help="the target's API key (default: $SNCA_API_KEY)")
    a = ap.parse_args(argv)
    if not 1 <= a.chunk <= 1024:
        print("migrate: error: --chunk must be in 1..1024", file=sys.stderr)
        return 2
    key = a.api_key or os.environ.get("SNCA_API_KEY") or None
    url = a.url.rstrip("/")
    try:
        wanted = {x.strip() for x in a.labels.split(",")} if a.labels else None
        by_label, missing = read_added(a.store, wanted)
    except ArtifactError as e:
        print(f"migrate: error: {e}", file=sys.stderr)
        return 2
    for item_id, label in missing:
        print(f"skipped item {item_id} ({label!r}): no stored image", file=sys.stderr)
    try:
        present = {x["label"] for x in _request(f"{url}/gallery/labels", key)["labels"]}
    except RuntimeError as e:
        print(f"migrate: error: {e}", file=sys.stderr)
        return 1
    sent = 0
    for label, items in by_label.items():
        if label in present and not a.append:
            print(f"label {label!r}: the target has it already; skipped (--append adds anyway)")
            continue
        if a.dry_run:
            print(f"label {label!r}: would send {len(items)} images")
            continue
        for s in range(0, len(items), a.chunk):
            part = items[s : s + a.chunk]
            body, ctype = _multipart(
                [("label", label), ("metadata", json.dumps([md for _, md, _, _ in part]))],
                [("images", img, mime or "application/octet-stream") for _, _, img, mime in part],
            )
            # one Idempotency-Key per batch, from the items it carries: a rerun after a
            # failure (or with --append) is answered for the batches sent before, not doubled
            ident = f"{a.store.resolve()}:{label}:{[i for i, _, _, _ in part]}"
            batch_key = "label-copy-" + hashlib.sha256(ident.encode()).hexdigest()[:40]
            try:
                r = _request(f"{url}/gallery/add", key, body, ctype, batch_key)
            except RuntimeError as e:
                print(
                    f"migrate: error: label {label!r}, items {part[0][0]}..{part[-1][0]}: {e} "
                    f"({sent} images migrated before this)",
                    file=sys.stderr,
                )
                return 1
            sent += len(part)
        print(f"label {label!r}: {len(items)} images migrated (now {r['count']} on the target)")
    print(f"migrated {sent} images; {len(missing)} items had no stored image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
