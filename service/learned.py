"""What the served model has not learned from (issue 52): the live items whose label it never
trained on, which `snca-gallery learn` would teach it.

A model trained on a dataset (not on a gallery) learned its trained items' labels as they were:
every item users added, and every trained item a correction moved (its add_seq moved past 0),
is unlearned. A model that learned from a gallery export (`snca-gallery learn`) learned the
items of that export under their labels then (held-out ones excluded): an added item by id, a
trained one by its dataset key; any other live item, or one whose label changed since, is
unlearned. Counted from the store, once per gallery version (/readyz reports it)."""

from __future__ import annotations

import json
from pathlib import Path


class Unlearned:
    """count(store, version) -> (items the model at `run_dir` has not learned, the version
    counted at): counted again when the version moved, but not more often than 20 times the
    last count's own time (a scan of the live items: 55,000 take ~0.1 s, and /readyz may be
    asked often while writes come in), nor less often than every `every_s` seconds."""

    def __init__(self, run_dir: Path, every_s: float = 5.0):
        self.learned = _learned(Path(run_dir))
        self.every_s = every_s
        self._at: tuple[int, int, float, float] | None = None  # (version, count, when, took)

    def count(self, store, version: int) -> tuple[int, int]:
        import time

        now = time.monotonic()
        at = self._at
        if at is not None and (at[0] == version or now - at[2] < min(self.every_s, 20 * at[3])):
            return at[1], at[0]
        rows = store.select(
            "SELECT id, label, source, metadata, add_seq FROM items WHERE deleted_seq IS NULL"
        )
        n = sum(1 for r in rows if not self._knows(*r))
        self._at = (version, n, now, time.monotonic() - now)
        return n, version

    def _knows(self, item_id, label, source, metadata, add_seq) -> bool:
        if self.learned is None:  # (trained on a dataset: its trained items as they were)
            return source == "trained" and not add_seq
        ids, keys = self.learned
        if source == "added":
            return ids.get(int(item_id)) == label
        md = json.loads(metadata) if metadata else {}
        return keys.get((md.get("dataset"), md.get("dataset_index"))) == label


def _learned(run_dir: Path) -> tuple[dict, dict] | None:
    """({added id: label}, {(dataset, dataset index): label}) of the export a run learned from
    (None: a run trained on a dataset, or whose export is gone)."""
    try:
        prov = json.loads((run_dir / "dataset.json").read_text())
    except (OSError, ValueError):
        return None
    if prov.get("dataset") != "gallery" or not prov.get("root"):
        return None
    items = Path(prov["root"]).parent / "items.jsonl"
    ids, keys = {}, {}
    try:
        with open(items, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if not r.get("image") or r.get("held_out"):
                    continue
                if r["source"] == "added":
                    ids[int(r["id"])] = r["label"]
                else:
                    md = r.get("metadata") or {}
                    keys[(md.get("dataset"), md.get("dataset_index"))] = r["label"]
    except (OSError, ValueError):
        return None
    return ids, keys
