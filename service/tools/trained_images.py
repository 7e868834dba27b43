"""The images of a gallery's trained items, for an export that a model learns from
(`snca-gallery export --trained`, `snca-gallery learn`): a trained item has no stored image, but
its metadata names it (its dataset and dataset index) and the served model's run dir says where
that dataset's images are (its dataset provenance; for a model that learned from a gallery
export, the provenance that export recorded for its trained items).

And the held-out part of a gallery (`--hold-out F`): the items a learned model is compared on,
never trained on; chosen by a hash of the item's id (the same items on every run): those whose
hash falls in the share F, and in a label of at least HOLD_OUT_MIN items that has none so, its
item of the smallest hash (a label of five photos keeps four to learn from and one to judge
by; a label of three keeps all three)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

from embedding.errors import ArtifactError, SNCAError

HOLD_OUT_MIN = 4  # a label with fewer items holds none out


def trained_provenance(run_dir: Path) -> dict | None:
    """The dataset provenance (embedding.rundir.DatasetProvenance's dict) of the served model's
    trained items: the run's own, or, for a run trained on a gallery export, the one that export
    recorded for the trained items it held (None: none recorded, or nothing trained)."""
    from embedding.rundir import RunDir

    try:
        prov = RunDir(run_dir).read_provenance()
    except ArtifactError:
        return None
    if prov.dataset != "gallery":
        return prov.to_dict()
    summary = Path(prov.root or "").parent / "export.json"  # (root: the export's images/)
    try:
        trained = json.loads(summary.read_text()).get("trained") or {}
    except (OSError, ValueError):
        return None
    return trained.get("provenance")


class TrainedImages:
    """Image bytes of trained items by (dataset, dataset index), read from the dataset that
    `provenance` names (loaded once, on first use)."""

    def __init__(self, provenance: dict):
        from embedding.rundir import DatasetProvenance

        self.provenance = provenance
        self._prov = DatasetProvenance.from_dict(provenance, "the trained items' provenance")
        self._raw = None

    def _source(self):
        if self._raw is None:
            try:
                self._raw = self._prov.load_train()
            except (ArtifactError, SNCAError, OSError) as e:
                raise SNCAError(
                    f"the trained items' images ({self._prov.dataset} from "
                    f"{self._prov.root or 'its usual place'}) cannot be read: {e}"
                ) from None
        return self._raw

    def image(self, metadata: dict | None) -> tuple[bytes, str] | None:
        """(bytes, file suffix) of the trained item `metadata` names; None when it names no
        image of this dataset."""
        m = metadata or {}
        if m.get("dataset") != self._prov.dataset or not isinstance(m.get("dataset_index"), int):
            return None
        raw = self._source()
        i = int(m["dataset_index"])
        if not 0 <= i < len(raw.source):
            return None
        paths = getattr(raw.source, "paths", None)
        if paths is not None:  # (a file: its own bytes, as training read them)
            p = Path(paths[i])
            return p.read_bytes(), (p.suffix.lstrip(".").lower() or "bin")
        return _png(raw.source.get(i)), "png"


def _png(t) -> bytes:
    """A (C, H, W) uint8 tensor as PNG bytes."""
    from PIL import Image

    a = t.numpy()
    img = Image.fromarray(a[0], "L") if a.shape[0] == 1 else Image.fromarray(a.transpose(1, 2, 0))
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def _rank(item_id: int, salt: str = "snca-learn") -> float:
    h = hashlib.sha256(f"{salt}:{int(item_id)}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def held_out(item_id: int, fraction: float) -> bool:
    """Whether item `item_id` falls in the held-out share `fraction` of ids, by hash."""
    return fraction > 0 and _rank(item_id) < fraction


def held_out_ids(rows, fraction: float) -> set[int]:
    """The held-out part of (id, label) `rows` (see the module docstring)."""
    if fraction <= 0:
        return set()
    by_label: dict[str, list[int]] = {}
    for item_id, label in rows:
        by_label.setdefault(label, []).append(int(item_id))
    out: set[int] = set()
    for ids in by_label.values():
        if len(ids) < HOLD_OUT_MIN:
            continue
        chosen = {i for i in ids if held_out(i, fraction)}
        out |= chosen or {min(ids, key=_rank)}
    return out
