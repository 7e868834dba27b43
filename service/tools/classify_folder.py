"""`snca-gallery classify SOURCE`: classify an image or a folder of images (recursively) with
the served model and gallery, the same answers as POST /classify (the same preprocessing,
vote, unknown verdict and explanation: service/model/runtime.py `Answer.result`), written as
CSV or JSON lines, with a progress line. It reads the gallery and writes nothing to it.

    snca-gallery classify my-photos/ --model runs/photos-lite0 --out answers.csv
    snca-gallery classify query.jpg --format jsonl          # to standard output

CSV columns: path (relative to SOURCE), label (empty when unknown), confidence, nearest_label,
nearest_probability, unknown, unknown_reason, explanation, error (why an image could not be
read; the other columns empty). JSON lines: {"path", "error"} or {"path", ...the API's
ClassifyResult}. Exit 0 when every image was classified, 1 when some could not be read.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from embedding.errors import SNCAError

COLUMNS = ("path", "label", "confidence", "nearest_label", "nearest_probability", "unknown",
           "unknown_reason", "explanation", "error")  # fmt: skip


def add_parsers(sub, shared) -> None:
    import argparse

    cl = sub.add_parser(
        "classify",
        help="classify an image or a folder of images (CSV or JSON lines, the API's answers)",
        argument_default=argparse.SUPPRESS,
    )
    cl.add_argument("source", type=Path, help="an image file, or a folder (read recursively)")
    cl.add_argument("--out", type=Path, help="the file to write (default: standard output)")
    cl.add_argument(
        "--format",
        choices=("csv", "jsonl"),
        help="csv or jsonl (default: from --out's suffix, .json/.jsonl -> jsonl; else csv)",
    )
    cl.add_argument("--vote", help="the vote (default SNCA_VOTE)")
    cl.add_argument("--k", type=int, help="neighbours that vote (default SNCA_K)")
    cl.add_argument(
        "--unknown",
        choices=("on", "off"),
        default="on",
        help="off: always name the nearest label (as /classify?unknown=off)",
    )
    cl.add_argument(
        "--batch-size", type=int, default=64, help="images per forward pass (default 64)"
    )
    cl.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a progress line on stderr (also when it is not a terminal)",
    )
    shared(cl)


def images_of(source: Path) -> list[tuple[Path, str]]:
    """(file, path shown) of every image under `source` (sorted), or of the one image."""
    from service.tools.tool_state import IMAGE_SUFFIXES

    if source.is_file():
        return [(source, source.name)]
    if not source.is_dir():
        raise SNCAError(f"{source}: no such file or folder")
    out = [
        (f, f.relative_to(source).as_posix())
        for f in sorted(source.rglob("*"))
        if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")
    ]
    if not out:
        raise SNCAError(f"{source} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return out


def classify(args: dict, log=print) -> int:
    from embedding.progress import Progress
    from embedding.votes import RULES
    from service.gallery.query import VoteQuery
    from service.model.embedder import ImageError, open_image
    from service.tools.tool_state import open_state, read_image_file

    files = images_of(args["source"])
    out_path = args.get("out")
    fmt = args.get("format") or (
        "jsonl"
        if out_path is not None and out_path.suffix.lower() in (".json", ".jsonl")
        else "csv"
    )
    if args.get("k") is not None and not 1 <= args["k"] <= 1000:
        raise SNCAError(f"--k {args['k']}: between 1 and 1000")
    if args.get("vote") is not None and args["vote"] not in RULES:
        raise SNCAError(f"--vote {args['vote']}: one of {', '.join(sorted(RULES))}")
    host = open_state(args, snapshot_every=0)
    state, failed, counts = host.state, 0, {"named": 0, "unknown": 0}
    s = state.settings
    query = VoteQuery(args.get("vote") or s.vote, args.get("k") or s.k)
    tpr = None if args.get("unknown") == "off" else s.unknown_tpr
    sink = open(out_path, "w", newline="", encoding="utf-8") if out_path else sys.stdout  # noqa: SIM115
    try:
        writer = csv.DictWriter(sink, COLUMNS, extrasaction="ignore") if fmt == "csv" else None
        if writer is not None:
            writer.writeheader()

        def emit(row: dict) -> None:
            if writer is None:
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                writer.writerow(row)

        step = max(1, args.get("batch_size", 64))
        with Progress(len(files), "classifying", "img", enabled=args.get("progress", True)) as bar:
            for start in range(0, len(files), step):
                ready = []
                for path, shown in files[start : start + step]:
                    try:  # the service's reading, limits and preprocessing
                        data = read_image_file(path, s.max_upload_bytes)
                        img = open_image(data, s.max_image_pixels, shown)
                        ready.append((shown, state.runtime.uploads.prepare_image(img, data, shown)))
                    except ImageError as e:
                        failed += 1
                        emit({"path": shown, "error": e.message})
                    except OSError as e:
                        failed += 1
                        emit({"path": shown, "error": e.strerror or str(e)})
                if ready:
                    got = state.runtime.answers_now([p for _, p in ready], query, tpr)
                    for (shown, _), a in zip(ready, got, strict=True):
                        r = a.result(state.fingerprint, s, query.vote, query.k, False, tpr)
                        counts["unknown" if r["unknown"] else "named"] += 1
                        emit({"path": shown, **r})
                bar.update(min(step, len(files) - start))
    finally:
        host.stop()
        if out_path:
            sink.close()
    print(
        f"snca-gallery: classified {counts['named'] + counts['unknown']} images ({counts['named']} "
        f"named, {counts['unknown']} unknown), {failed} could not be read"
        + (f"; written to {out_path}" if out_path else ""),
        file=sys.stderr,
        flush=True,
    )
    return 1 if failed else 0


COMMANDS = {"classify": classify}
