"""The index dir contract: FAISS index + gallery store + manifest.json, and its reader.

    <index dir>/
        index.faiss      FAISS index, IndexIDMap2 around the factory's index, CPU-readable;
                         inner product on unit vectors (= cosine)
        gallery.sqlite   id -> label, source, metadata (embedding/gallery.py)
        manifest.json    format_version, dim, metric, count, labels, model fingerprint, σ,
                         factory, search_params, source, created_at, sha256 of both files

The index builder writes it (`IndexManifest`, `write_manifest`); the service opens it with
`open_index_dir`, which verifies the format version and the checksums and refuses a model whose
fingerprint differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ArtifactError
from .files import atomic_write_json, check_format_version, read_json

INDEX_FORMAT_VERSION = 1
INDEX_FILE = "index.faiss"
STORE_FILE = "gallery.sqlite"
MANIFEST_FILE = "manifest.json"
METRIC = "inner_product"
# FAISS run-time parameters the manifest may record (applied with faiss.ParameterSpace).
SEARCH_PARAMS = ("nprobe", "efSearch")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tune_faiss() -> None:
    """Process-wide FAISS settings for this workload. Exhaustive search computes inner products
    with BLAS only from `distance_compute_blas_threshold` queries per call; this FAISS build
    sets it to 128,000, so a batch of 64 took its per-query SIMD path: 121 ms against 19 ms
    with BLAS (55,000 x 128-d Flat, 2 cores; benchmarks/gallery_scale.py). 20 was FAISS's long
    default: below it (a lone query) nothing changes."""
    import faiss

    faiss.cvar.distance_compute_blas_threshold = 20


def apply_search_params(index, params: dict[str, Any]) -> None:
    """Set nprobe / efSearch on `index` (through IndexIDMap2 and other wrappers)."""
    import faiss

    ps = faiss.ParameterSpace()
    for name, value in params.items():
        if name not in SEARCH_PARAMS:
            raise ArtifactError(f"unknown search parameter {name!r} (known: {SEARCH_PARAMS})")
        try:
            ps.set_index_parameter(index, name, float(value))
        except RuntimeError:
            raise ArtifactError(
                f"search parameter {name}={value} does not apply to this index"
            ) from None


@dataclass
class IndexManifest:
    """manifest.json of an index dir: written by the index builder, read by the service."""

    dim: int
    count: int  # vectors in index.faiss
    model_fingerprint: str  # the model whose vectors these are (the service checks it)
    search_params: dict[str, Any]  # nprobe / efSearch the service must use
    files: dict[str, dict[str, Any]]  # name -> {sha256, bytes} of index.faiss and the store
    index_id: str = ""  # random id of this build; a gallery store remembers the one it grew from
    metric: str = METRIC
    normalized: bool = True
    next_id: int | None = None  # first id free for items the service adds
    labels: dict[str, int] = field(default_factory=dict)  # label -> items
    class_names: list[str] = field(default_factory=list)
    temperature: float | None = None  # σ of the model card
    space: str = "embedding"  # embedding.model.SPACES: the vectors indexed (and served)
    factory: str = "Flat"
    source: str = "memory"  # memory bank rows, or re-embedded ("recompute")
    thumbnails: bool = False  # the store holds a preview of every item
    dataset: str | None = None
    run_dir: str | None = None
    created_at: str = ""
    build: dict[str, Any] = field(default_factory=dict)  # device, timings, faiss version
    format_version: int = INDEX_FORMAT_VERSION

    REQUIRED = ("dim", "count", "model_fingerprint", "files", "search_params")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> IndexManifest:
        """Validate a parsed manifest.json; unknown keys (a newer builder's) are ignored."""
        if not isinstance(d, dict):
            raise ArtifactError(f"{where} is not a JSON object")
        check_format_version(
            where, "index", d.get("format_version"), INDEX_FORMAT_VERSION,
            "; rebuild it with snca-build-index",
        )  # fmt: skip
        missing = [k for k in cls.REQUIRED if k not in d]
        if missing:
            raise ArtifactError(f"{where} lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        m = cls(**{k: v for k, v in d.items() if k in known})
        bad = [
            name
            for name, ok in (
                ("dim", isinstance(m.dim, int) and m.dim > 0),
                ("count", isinstance(m.count, int) and m.count >= 0),
                ("model_fingerprint", isinstance(m.model_fingerprint, str)),
                ("search_params", isinstance(m.search_params, dict)),
                ("files", isinstance(m.files, dict)),
                ("labels", isinstance(m.labels, dict)),
            )
            if not ok
        ]
        if bad:
            raise ArtifactError(f"{where}: invalid {', '.join(bad)}")
        return m


@dataclass
class IndexDir:
    """An opened index dir: its manifest and FAISS index; `store` is the gallery store the
    builder wrote (the trained items), which the service copies to start its own."""

    path: Path
    manifest: IndexManifest
    index: Any  # faiss.Index (IndexIDMap2)

    @property
    def store(self) -> Path:
        return self.path / STORE_FILE

    @property
    def dim(self) -> int:
        return self.manifest.dim

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries (Q, d) float32 unit rows -> similarities (Q, k) float32 descending, ids (Q, k)
        int64 (-1 where the index holds fewer than k items)."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries must be (Q, {self.dim}), got {q.shape}")
        return self.index.search(q, k)


def read_manifest(path: str | Path) -> IndexManifest:
    path = Path(path)
    return IndexManifest.from_dict(read_json(path / MANIFEST_FILE), str(path / MANIFEST_FILE))


def write_manifest(path: str | Path, manifest: IndexManifest) -> None:
    atomic_write_json(Path(path) / MANIFEST_FILE, manifest.to_dict())


def verify_checksums(path: str | Path, manifest: IndexManifest) -> None:
    path = Path(path)
    for name, info in manifest.files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"index dir {path} is missing {name}")
        actual = sha256_file(f)
        if actual != info.get("sha256"):
            raise ArtifactError(
                f"{f} does not match its checksum in the manifest (modified or corrupt): "
                f"expected sha256 {str(info.get('sha256'))[:16]}..., found {actual[:16]}..."
            )


def open_index_dir(
    path: str | Path, expected_fingerprint: str | None = None, verify: bool = True
) -> IndexDir:
    """Open an index dir: check format version, checksums (when `verify`) and, when given,
    that it was built for the model with `expected_fingerprint`; load the FAISS index with the
    manifest's search parameters applied."""
    import faiss

    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"index dir {path} does not exist")
    manifest = read_manifest(path)
    if expected_fingerprint is not None and manifest.model_fingerprint != expected_fingerprint:
        raise ArtifactError(
            f"index {path} was built for model {manifest.model_fingerprint[:19]}..., not for "
            f"this model {expected_fingerprint[:19]}...: rebuild the index with this model"
        )
    if verify:
        verify_checksums(path, manifest)
    try:
        index = faiss.read_index(str(path / INDEX_FILE))
    except RuntimeError as e:
        raise ArtifactError(f"cannot read FAISS index {path / INDEX_FILE}: {e}") from None
    if index.d != manifest.dim or index.ntotal != manifest.count:
        raise ArtifactError(
            f"{path / INDEX_FILE} holds {index.ntotal} vectors of dim {index.d}; the manifest "
            f"says {manifest.count} of dim {manifest.dim}"
        )
    apply_search_params(index, manifest.search_params)
    return IndexDir(path=path, manifest=manifest, index=index)
