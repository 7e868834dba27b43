"""Index snapshots: the in-memory FAISS index written atomically with the last store write it
contains, so start-up replays only the writes after it.

    <data dir>/snapshot/index.faiss + snapshot.json (seq, tombstones, fingerprint, index_id,
    sha256). A snapshot that is missing, corrupt or for another model/index is ignored: the
    service then starts from the built index and replays every write (documented fallback).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from embedding.artifacts import atomic_write_json, publish_dir
from embedding.gallery import utc_now
from embedding.index import sha256_file

log = logging.getLogger("snca.snapshot")
SNAPSHOT_DIR = "snapshot"


@dataclass
class Snapshot:
    index: object
    seq: int
    tombstones: set[int]


def write_snapshot(
    data_dir: Path,
    blob: np.ndarray,
    seq: int,
    tombstones: set[int],
    fingerprint: str,
    index_id: str,
) -> Path:
    """blob: faiss.serialize_index output. Written under a temp name, then swapped in."""
    out = Path(data_dir) / SNAPSHOT_DIR
    stage = out.with_name(f".{SNAPSHOT_DIR}.tmp-{os.getpid()}")
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    try:
        with open(stage / "index.faiss", "wb") as f:
            f.write(blob.tobytes())
        atomic_write_json(
            stage / "snapshot.json",
            {
                "seq": seq,
                "tombstones": sorted(tombstones),
                "model_fingerprint": fingerprint,
                "index_id": index_id,
                "created_at": utc_now(),
                "sha256": sha256_file(stage / "index.faiss"),
            },
        )
        publish_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def load_snapshot(data_dir: Path, fingerprint: str, index_id: str, max_seq: int) -> Snapshot | None:
    d = Path(data_dir) / SNAPSHOT_DIR
    if not (d / "snapshot.json").is_file():
        return None
    try:
        meta = json.loads((d / "snapshot.json").read_text())
        if meta.get("model_fingerprint") != fingerprint or meta.get("index_id") != index_id:
            log.warning("ignoring snapshot %s: made for another model or index", d)
            return None
        if int(meta["seq"]) > max_seq:
            log.warning(
                "ignoring snapshot %s: newer (seq %s) than the store (%s)", d, meta["seq"], max_seq
            )
            return None
        if sha256_file(d / "index.faiss") != meta.get("sha256"):
            log.warning("ignoring snapshot %s: index.faiss does not match its checksum", d)
            return None
        index = faiss.read_index(str(d / "index.faiss"))
        return Snapshot(index, int(meta["seq"]), set(int(t) for t in meta.get("tombstones", [])))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.warning("ignoring unreadable snapshot %s: %s", d, e)
        return None
