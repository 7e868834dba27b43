"""Run dir -> index dir (the contract in embedding/index.py).

Vectors come from the final memory bank (the paper's protocol) or from re-embedding the run's
training images with the final model and the eval transform. They are checked (dimension,
finite values, unit norm), put in a FAISS index wrapped in IndexIDMap2 (id = memory-bank row),
the labels go in a fresh SQLite gallery store, and a manifest records how to search it. The
dir is assembled under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedding import collapse
from embedding.errors import ArtifactError, SNCAError
from embedding.files import publish_dir
from embedding.gallery import create_store, utc_now
from embedding.index import (
    INDEX_FILE,
    STORE_FILE,
    IndexManifest,
    apply_search_params,
    read_manifest,
    sha256_file,
    tune_faiss,
    write_manifest,
)
from embedding.model import SPACES, in_space, space_dim
from embedding.progress import Progress, track
from embedding.rundir import RunDir
from embedding.world import WORLD_FILE

EMBEDDING_SOURCES = ("memory", "recompute")
DEVICES = ("auto", "cpu", "cuda")
NORM_TOLERANCE = 1e-3
DEFAULT_EF_SEARCH = 128
# FAISS's own default is 40; on clustered embedding-like data that graph reached recall@10 0.96
# at efSearch 128 where efConstruction 128 reached 1.00, for 2.2x the build time (200k vectors).
DEFAULT_EF_CONSTRUCTION = 128
ADD_BATCH = 65536
# --factory auto (benchmarks/gallery_scale.py measured these on Fashion-MNIST embeddings, 2 cores):
AUTO_EXACT_MAX = 200_000  # up to here Flat: exact, and the service votes densely or fast enough
AUTO_PQ_MIN = 5_000_000  # from here IVF-PQ (d/4 bytes a vector): IVF-Flat needs 4·d bytes
AUTO_RECALL = 0.95  # nprobe: the smallest reaching this recall@10 on held-out queries
AUTO_QUERIES = 1000


@dataclass
class BuildConfig:
    run_dir: Path
    out: Path
    source: str = "memory"
    factory: str = "Flat"
    nprobe: int | None = None  # IVF: lists visited per query (default: sqrt(nlist), >= 8)
    ef_search: int | None = None  # HNSW: search breadth (default 128)
    ef_construction: int | None = None  # HNSW: build breadth (default 128)
    device: str = "auto"
    overwrite: bool = False
    batch_size: int = 512  # recompute: images per forward pass
    num_workers: int = 0  # recompute: data-loader workers
    train_sample: int | None = None  # vectors to train IVF/PQ on (default: all, up to 500k)
    recall_target: float = AUTO_RECALL  # --factory auto: recall@10 that sets nprobe
    auto_exact_max: int = AUTO_EXACT_MAX  # --factory auto: largest gallery indexed Flat
    data_dir: str | None = None  # recompute: where the dataset is, if not where training found it
    seed: int = 0
    progress: bool = True
    thumbnails: bool = False  # a preview of every dataset item in the store (the web page)
    space: str = "embedding"  # embedding.model.SPACES: the vectors indexed (and served)
    reuse: bool = False  # keep `out` when it is already this build (same model and options)
    # index the run's training images as trained items; False: none (a run trained on an
    # exported gallery, whose items `snca-gallery upgrade --to` carries: else each would be
    # in the gallery twice)
    trained_items: bool = True


@dataclass
class Vectors:
    embeddings: np.ndarray  # (N, d) float32 unit rows
    label_ids: np.ndarray  # (N,) int64
    dataset_indices: np.ndarray  # (N,) int64


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------- inputs
def check_run_dir(cfg: BuildConfig) -> None:
    try:
        RunDir(cfg.run_dir).require(RunDir.MEMORY)
    except ArtifactError as e:
        raise SNCAError(str(e)) from None


def _train_raw(cfg: BuildConfig, log):
    """The run's training split as training read it (re-embedding and thumbnails read it),
    found through the run dir's dataset provenance record; for a run that learned from a whole
    gallery (gallery_trained), the dataset its trained items' images come from."""
    try:
        g = gallery_trained(cfg.run_dir)
        if g is not None:
            return g.provenance.load_train(None, log)
        return RunDir(cfg.run_dir).read_provenance().load_train(cfg.data_dir, log)
    except ArtifactError as e:
        raise SNCAError(str(e)) from None


@dataclass
class GalleryTrained:
    """A run trained on a gallery export that holds the gallery's trained items
    (`snca-gallery export --trained`, what `snca-gallery learn` trains on): its index holds
    those trained items, held-out ones included, by their own dataset and dataset index (so a
    carry finds them as it finds any trained item), re-embedded from that dataset; the items
    users added come through the carry from the store."""

    provenance: object  # embedding.rundir.DatasetProvenance of the trained items' dataset
    labels: list[str]  # each trained item's label in the gallery (at the export)
    dataset_indices: np.ndarray  # (N,) int64


def gallery_trained(run_dir: Path) -> GalleryTrained | None:
    """GalleryTrained of a run trained on such an export (None: any other run)."""
    from embedding.rundir import DatasetProvenance

    try:
        prov = RunDir(run_dir).read_provenance()
    except ArtifactError:
        return None
    if prov.dataset != "gallery" or not prov.root:
        return None
    export = Path(prov.root).parent
    try:
        summary = json.loads((export / "export.json").read_text())
    except (OSError, ValueError):
        return None
    trained = summary.get("trained")
    if not trained:
        return None
    source = DatasetProvenance.from_dict(trained.get("provenance"), f"{export}/export.json")
    labels, indices = [], []
    with open(export / "items.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            md = row.get("metadata") or {}
            if row.get("source") == "trained" and row.get("image") and "dataset_index" in md:
                labels.append(row["label"])
                indices.append(int(md["dataset_index"]))
    if not labels:  # (a gallery of added items only: nothing trained to index)
        return None
    return GalleryTrained(source, labels, np.asarray(indices, dtype=np.int64))


def _check_indices(raw, dataset_indices: np.ndarray) -> None:
    if len(dataset_indices) and int(dataset_indices.max()) >= len(raw.source):
        raise SNCAError(
            f"the memory bank refers to image {int(dataset_indices.max())} but {raw.name} has "
            f"{len(raw.source)} training images: is --data-dir the dataset this run trained on?"
        )


def recompute_embeddings(cfg: BuildConfig, model, dataset_indices: np.ndarray, log) -> np.ndarray:
    """Embed the run's training images (by dataset index) with the eval transform."""
    from embedding.device import resolve_device
    from embedding.inference import embed_images
    from embedding.transforms import eval_transform

    raw = _train_raw(cfg, log)
    _check_indices(raw, dataset_indices)
    device = resolve_device("cpu" if cfg.device == "cpu" else "auto")
    log(f"re-embedding {len(dataset_indices)} training images of {raw.name} on {device}")
    with Progress(len(dataset_indices), "embedding", "img", enabled=cfg.progress) as bar:
        emb = embed_images(
            model.to(device),
            raw.source,
            dataset_indices,
            eval_transform(model.config),
            device,
            cfg.batch_size,
            cfg.num_workers,
            progress=bar,
        )
    return emb.cpu().numpy().astype(np.float32)


def world_statistics(cfg: BuildConfig, model, vec: Vectors, log) -> tuple:
    """The world check's Gaussian (embedding/world.py) for the index dir: the run dir's own
    (written by snca-train since issue 28: calibrated on validation images), else fitted here
    on the run's training images (80% fit, 20% calibration: images the model was trained on, so
    the thresholds accept somewhat fewer held-out images than asked; docs/RESULTS.md). None
    when the training images cannot be read (the service then serves without the world check).
    Returns (the fit or None, where it came from: the manifest's build.world): "run dir",
    "fitted at build", "gallery" (none: nothing indexed from training; the service fits the
    check on the gallery's own images), "unavailable"."""
    from embedding import world
    from embedding.device import resolve_device

    run = RunDir(cfg.run_dir)
    if run.world.is_file():
        return world.load(run.world, model.fingerprint), "run dir"
    if len(vec.dataset_indices) == 0:
        log("world statistics: none (nothing trained here): the service fits them on the gallery")
        return None, "gallery"
    try:
        raw = _train_raw(cfg, log)
        _check_indices(raw, vec.dataset_indices)
    except SNCAError as e:
        log(f"world statistics: not computed ({e}); the service will serve without them")
        return None, "unavailable"
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(vec.dataset_indices))
    cut = int(0.8 * len(order))
    fit_rows, cal_rows = order[:cut][:20000], order[cut:][:5000]
    dim = world.stats_dim(model)
    diag = (
        ""
        if world.estimable(len(fit_rows), dim)
        else f" (diagonal: fewer than its {dim} statistics)"
    )
    log(
        f"world statistics (the run dir has none: trained before them): fitting on "
        f"{len(fit_rows)} training images{diag}, calibrating on {len(cal_rows)}"
    )
    device = resolve_device("cpu" if cfg.device == "cpu" else "auto")
    total = len(fit_rows) + len(cal_rows)
    with Progress(total, "world statistics", "img", enabled=cfg.progress) as bar:
        fit = world.fit_from_images(
            model.to(device),
            raw.source,
            vec.dataset_indices[fit_rows],
            vec.dataset_indices[cal_rows],
            vec.label_ids[cal_rows],
            device,
            cfg.batch_size,
            progress=bar,
            seed=cfg.seed,
        )
    return fit, "fitted at build"


def make_thumbnails(cfg: BuildConfig, dataset_indices: np.ndarray, log) -> list:
    """A thumbnail (bytes or None) per item, from the training images on disk."""
    from embedding.thumbnails import tensor_thumbnail

    raw = _train_raw(cfg, log)
    _check_indices(raw, dataset_indices)
    log(f"thumbnails of {len(dataset_indices)} {raw.name} training images")
    items = track(dataset_indices, len(dataset_indices), "thumbnails", "img", cfg.progress)
    return [tensor_thumbnail(raw.source.get(int(i))) for i in items]


def load_vectors(cfg: BuildConfig, log=_say) -> tuple[Vectors, object]:
    """(vectors, model) of the run dir, validated."""
    run = RunDir(cfg.run_dir)
    try:
        model = run.load_model()
        bank = run.load_memory(expected_fingerprint=model.fingerprint)
    except ArtifactError as e:
        raise SNCAError(str(e)) from None
    labels = bank.labels.numpy().astype(np.int64)
    indices = bank.indices.numpy().astype(np.int64)
    g = gallery_trained(cfg.run_dir) if cfg.trained_items else None
    if g is not None:  # the gallery's trained items, not the memory bank's export images
        names = {n: i for i, n in enumerate(model.config.class_names)}
        unknown = sorted({lab for lab in g.labels if lab not in names})
        if unknown:
            raise SNCAError(f"trained items of labels the model does not name: {unknown[:5]}")
        labels = np.asarray([names[lab] for lab in g.labels], dtype=np.int64)
        indices = g.dataset_indices
        log(f"the gallery's {len(labels)} trained items ({g.provenance.dataset}), re-embedded")
        if cfg.source == "memory":
            raise SNCAError("a run that learned from a gallery indexes with --source recompute")
    # an index of no vectors: a run of `snca-train --epochs 0` (nothing trained), or one whose
    # training images the carried gallery already holds (--no-trained-items)
    if not cfg.trained_items:
        why = f"the {len(labels)} training images are not indexed (--no-trained-items, the default for a run trained on a gallery: the gallery carried to this model holds them)"
    elif len(labels) == 0 and not model.config.class_names:
        why = "an empty gallery (nothing trained): labels come from /gallery/add, snca-gallery import or the page"
    else:
        why = None
    if why is not None:
        log(why)
        dim = space_dim(model, cfg.space)
        return Vectors(np.zeros((0, dim), np.float32), labels[:0], indices[:0]), model
    if cfg.source == "memory":
        emb = bank.embeddings.numpy()
    else:
        emb = recompute_embeddings(cfg, in_space(model, cfg.space), indices, log)
    vec = validate_vectors(
        emb, labels, indices, space_dim(model, cfg.space), model.config.num_classes, log
    )
    return vec, model


def validate_vectors(
    emb: np.ndarray, labels: np.ndarray, indices: np.ndarray, dim: int, num_classes: int, log=_say
) -> Vectors:
    if emb.ndim != 2:
        raise SNCAError(f"vectors must be a 2-d array, got shape {emb.shape}")
    if emb.shape[1] != dim:
        raise SNCAError(f"vector dim {emb.shape[1]} does not match the model's embedding dim {dim}")
    n = emb.shape[0]
    if n == 0:
        raise SNCAError(
            "there are no vectors to index (a model that names no label, from snca-train --epochs 0, starts empty)"
        )
    if labels.shape != (n,):
        raise SNCAError(f"{labels.shape[0]} labels for {n} vectors: the counts must match")
    if indices.shape != (n,):
        raise SNCAError(
            f"{indices.shape[0]} dataset indices for {n} vectors: the counts must match"
        )
    if num_classes and (labels.min() < 0 or labels.max() >= num_classes):
        raise SNCAError(
            f"label ids must be in 0..{num_classes - 1}, found {labels.min()}..{labels.max()}"
        )
    finite = np.isfinite(emb).all(axis=1)
    if not finite.all():
        bad = np.nonzero(~finite)[0]
        raise SNCAError(
            f"row {bad[0]} (dataset index {indices[bad[0]]}) has NaN or Inf values "
            f"({len(bad)} such rows in all)"
        )
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    norms = np.linalg.norm(emb, axis=1)
    if (norms == 0).any():
        raise SNCAError(f"row {np.nonzero(norms == 0)[0][0]} is all zeros and has no direction")
    off = np.abs(norms - 1.0) > NORM_TOLERANCE
    if off.any():
        log(
            f"warning: {int(off.sum())} of {n} rows were not unit-norm (e.g. row "
            f"{np.nonzero(off)[0][0]}: norm {norms[off][0]:.4f}); renormalised"
        )
        emb /= norms[:, None]
    return Vectors(emb, labels, indices)


# ---------------------------------------------------------------------------- FAISS
def resolve_device(device: str) -> str:
    """Where FAISS trains and adds: 'cuda' needs the faiss GPU build and a GPU."""
    import faiss

    if device not in DEVICES:
        raise SNCAError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if device == "cuda" and ngpu == 0:
        raise SNCAError(
            "--device cuda: this faiss build has no GPU support or sees no GPU "
            "(install the gpu extra: pip install 'snca[gpu]', or use --device cpu)"
        )
    return "cuda" if device in ("cuda", "auto") and ngpu > 0 else "cpu"


def parse_factory(factory: str, dim: int):
    """faiss.index_factory with inner product; a clear error when FAISS rejects the string."""
    import faiss

    f = factory.strip()
    if not f:
        raise SNCAError("--factory is empty")
    if "IDMap" in f:
        raise SNCAError(
            f"--factory {factory!r}: leave IDMap out, the builder adds IndexIDMap2 itself"
        )
    try:
        return faiss.index_factory(dim, f, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1].split(": ")[-1]
        raise SNCAError(f"FAISS rejects the factory string {factory!r}: {reason}") from None


def default_search_params(base, nprobe: int | None, ef_search: int | None) -> dict:
    import faiss

    params: dict = {}
    ivf = faiss.try_extract_index_ivf(base)
    if ivf is not None:
        # default sqrt(nlist) (64 for IVF4096): recall@10 1.000 on embedding-like data and
        # 0.947 on structureless data at 1M vectors (docs/PERFORMANCE.md); tune with --nprobe
        params["nprobe"] = int(nprobe) if nprobe else min(ivf.nlist, max(8, round(ivf.nlist**0.5)))
    elif nprobe:
        raise SNCAError("--nprobe applies to IVF indexes only")
    if _find_hnsw(base) is not None:
        params["efSearch"] = int(ef_search) if ef_search else DEFAULT_EF_SEARCH
    elif ef_search:
        raise SNCAError("--ef-search applies to HNSW indexes only")
    return params


def _find_hnsw(index):
    import faiss

    idx = faiss.downcast_index(index)
    while idx is not None:
        if hasattr(idx, "hnsw"):
            return idx
        sub = getattr(idx, "index", None) or getattr(idx, "base_index", None)
        idx = faiss.downcast_index(sub) if sub is not None else None
    return None


def auto_factory(n: int, d: int, exact_max: int = AUTO_EXACT_MAX) -> str:
    """The index for a gallery of n vectors of dim d: Flat (exact) up to `exact_max`, then
    IVF with ~4·sqrt(n) lists (a power of two; ~39+ training vectors a list), raw vectors
    up to AUTO_PQ_MIN and PQ codes of d/4 bytes beyond (4·d bytes a vector no longer fits)."""
    if n <= exact_max:
        return "Flat"
    nlist = 1 << max(4, round(np.log2(4 * np.sqrt(n))))
    nlist = min(nlist, max(16, n // 39))
    if n < AUTO_PQ_MIN:
        return f"IVF{nlist},Flat"
    m = next(m for m in (d // 4, d // 8, 16, 8, 4, 2, 1) if m >= 1 and d % m == 0)
    return f"IVF{nlist},PQ{m}"


def tune_recall(index, emb: np.ndarray, ids: np.ndarray, target: float, seed: int, log=_say):
    """The smallest nprobe (IVF) or efSearch (HNSW) whose recall@10 reaches `target` on
    AUTO_QUERIES held-out queries: vectors of the gallery, each query's own item left out of
    both the exact answer and the index's. Returns (search params, measurement record)."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    hnsw = _find_hnsw(index)
    if ivf is None and hnsw is None:
        return {}, {}
    rng = np.random.default_rng(seed + 1)
    pick = rng.choice(len(emb), min(AUTO_QUERIES, len(emb)), replace=False)
    q = emb[pick]
    exact = faiss.IndexFlatIP(emb.shape[1])
    exact.add(emb)
    _, truth = exact.search(q, 11)  # positions; drop each query's own item
    truth_ids = [set(ids[row[row != p][:10]].tolist()) for row, p in zip(truth, pick, strict=True)]
    own = ids[pick]
    name = "nprobe" if ivf is not None else "efSearch"
    values = [v for v in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)]
    if ivf is not None:
        values = [v for v in values if v < ivf.nlist] + [ivf.nlist]
    else:
        values = [v for v in values if v >= 16]
    tried: dict[int, float] = {}
    for v in values:
        apply_search_params(index, {name: v})
        _, got = index.search(q, 11)
        hits = [
            len(t & set(row[row != o][:10].tolist())) / max(1, len(t))
            for t, row, o in zip(truth_ids, got, own, strict=True)
        ]
        tried[v] = float(np.mean(hits))
        if tried[v] >= target:
            break
        rs = list(tried.values())
        if len(rs) >= 3 and rs[-1] - rs[-3] < 0.005:  # a plateau: the codes cap the recall
            break
    best = next((v for v, r in tried.items() if r >= target), None)
    if best is None:
        # Unreachable (PQ codes cap it; measured: IVF4096,PQ32 on 1M Fashion-MNIST embeddings
        # reached 0.43 at nprobe 4096, a full scan). Searching further buys nothing: take the
        # smallest setting within 0.01 of the best recall seen.
        top = max(tried.values())
        best = next(v for v, r in tried.items() if r >= top - 0.01)
        log(
            f"warning: recall@10 reaches {top:.3f}, below the target {target}: the index's "
            f"codes limit it (a larger PQ, or IVF-Flat); {name} {best} is within 0.01 of it"
        )
    log(f"{name} {best}: recall@10 {tried[best]:.3f} on {len(pick)} held-out queries")
    record = {
        "recall_target": target,
        "recall_at_10": tried[best],
        "queries": len(pick),
        "tried": {str(k): round(r, 4) for k, r in tried.items()},
    }
    return {name: best}, record


def make_index(vec: Vectors, cfg: BuildConfig, ids: np.ndarray, log=_say):
    """Build, train and fill the index; return (CPU IndexIDMap2, search params, info)."""
    import faiss

    tune_faiss()
    emb = vec.embeddings
    n, d = emb.shape
    auto = cfg.factory.strip().lower() == "auto"
    if auto:
        cfg.factory = auto_factory(n, d, cfg.auto_exact_max)
        log(f"--factory auto: {cfg.factory} for {n} vectors of dim {d}")
    base = parse_factory(cfg.factory, d)
    params = default_search_params(base, cfg.nprobe, cfg.ef_search)
    build_params = {}
    hnsw = _find_hnsw(base)
    if hnsw is not None:
        hnsw.hnsw.efConstruction = cfg.ef_construction or DEFAULT_EF_CONSTRUCTION
        build_params["efConstruction"] = hnsw.hnsw.efConstruction
    elif cfg.ef_construction:
        raise SNCAError("--ef-construction applies to HNSW indexes only")
    ivf = faiss.try_extract_index_ivf(base)
    sample = None
    if not base.is_trained:
        cap = cfg.train_sample or 500_000
        take = min(n, cap)
        if ivf is not None and ivf.nlist > take:
            raise SNCAError(
                f"{cfg.factory!r} has {ivf.nlist} IVF lists but only {take} training vectors: "
                f"use at most IVF{max(1, take // 39)} here (FAISS wants ~39+ vectors per list)"
            )
        rng = np.random.default_rng(cfg.seed)
        sample = emb if take == n else emb[np.sort(rng.choice(n, take, replace=False))]
    index = faiss.IndexIDMap2(base)
    device = resolve_device(cfg.device)
    work = index
    if device == "cuda":
        try:
            co = faiss.GpuMultipleClonerOptions()
            co.shard = faiss.get_num_gpus() > 1
            work = faiss.index_cpu_to_all_gpus(index, co)
        except (RuntimeError, AttributeError) as e:
            log(
                f"{cfg.factory} cannot run on the GPU ({str(e).strip().splitlines()[-1]}); using CPU"
            )
            device, work = "cpu", index
    t0 = time.perf_counter()
    if sample is not None:
        log(f"training {cfg.factory} on {len(sample)} vectors ({device})...")
        try:
            work.train(sample)
        except RuntimeError as e:
            raise SNCAError(
                f"training {cfg.factory!r} failed: {str(e).strip().splitlines()[-1]}"
            ) from None
    train_s = time.perf_counter() - t0
    with Progress(n, "adding", "vec", enabled=cfg.progress and n > 0) as bar:
        for s in range(0, n, ADD_BATCH):
            work.add_with_ids(emb[s : s + ADD_BATCH], ids[s : s + ADD_BATCH])
            bar.update(min(ADD_BATCH, n - s))
    if device == "cuda":
        index = faiss.index_gpu_to_cpu(work)  # always write a CPU-readable index
    tuned = {}
    if auto and n and not (cfg.nprobe or cfg.ef_search):
        found, tuned = tune_recall(index, emb, ids, cfg.recall_target, cfg.seed, log)
        params.update(found)
    apply_search_params(index, params)
    info = {
        "device": device,
        "params": build_params,
        "train_vectors": 0 if sample is None else len(sample),
        "train_seconds": train_s,
        "add_seconds": time.perf_counter() - t0 - train_s,
    }
    if auto:
        info["factory_requested"] = "auto"
        info["auto"] = tuned
    return index, params, info


# ---------------------------------------------------------------------------- the build
def _remove_stale_stages(out: Path) -> None:
    """Remove temp dirs that killed builds of `out` left (their process is gone)."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # still running: leave it alone
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def current_build(cfg: BuildConfig) -> IndexManifest | None:
    """The manifest of `cfg.out` when it already holds what this build would make: an index of
    the run's model (same fingerprint) with the same factory, source, space, thumbnails and,
    where given, search parameters. None otherwise (including when it cannot be read)."""
    try:
        m = read_manifest(cfg.out)
        _, fingerprint = RunDir(cfg.run_dir).load_model_card()
    except (ArtifactError, OSError):
        return None
    wanted = {"nprobe": cfg.nprobe, "efSearch": cfg.ef_search}
    same = (
        m.model_fingerprint == fingerprint
        and (m.build.get("factory_requested", m.factory), m.source, m.space, m.thumbnails)
        == (cfg.factory, cfg.source, cfg.space, cfg.thumbnails)
        and all(m.search_params.get(k) == v for k, v in wanted.items() if v is not None)
        and all((Path(cfg.out) / name).is_file() for name in m.files)
        and m.build.get("world") is not None  # (built before the world check: built again)
        and m.build.get("trained_items", True) == cfg.trained_items
    )
    return m if same else None


def build(cfg: BuildConfig, log=_say) -> IndexManifest:
    """Build the index dir `cfg.out` from run dir `cfg.run_dir`; return its manifest. With
    `cfg.reuse`, an `out` that is already this build is kept as it is."""
    import faiss

    t_start = time.perf_counter()
    if cfg.source not in EMBEDDING_SOURCES:
        raise SNCAError(
            f"unknown source {cfg.source!r} (choose from {', '.join(EMBEDDING_SOURCES)})"
        )
    if cfg.space not in SPACES:
        raise SNCAError(f"unknown space {cfg.space!r} (choose from {', '.join(SPACES)})")
    if cfg.space != "embedding" and cfg.source == "memory":
        raise SNCAError(
            f"the memory bank holds NCA embeddings, not {cfg.space} vectors: "
            f"--space {cfg.space} needs --source recompute"
        )
    if not 0.0 < cfg.recall_target <= 1.0:
        raise SNCAError(f"--recall-target {cfg.recall_target} must be in (0, 1]")
    out = Path(cfg.out)
    if cfg.reuse and (m := current_build(cfg)) is not None:
        log(f"index: {out} is already built from this model with these options; kept")
        return m
    if out.exists() and not (cfg.overwrite or cfg.reuse):
        raise SNCAError(
            f"--out {out} already exists; pass --overwrite to replace it "
            "(the old index stays until the new one is complete)"
        )
    if out.exists() and not out.is_dir():
        raise SNCAError(f"--out {out} exists and is not a directory")
    resolve_device(cfg.device)  # fail early on --device cuda without a GPU build
    check_run_dir(cfg)
    vec, model = load_vectors(cfg, log)
    spread = collapse.pair_similarity(vec.embeddings)
    if (said := collapse.warning(spread, "the index's vectors")) is not None:
        log("warning: " + said)
    t_world = time.perf_counter()
    world_fit, world_basis = world_statistics(cfg, model, vec, log)
    t_world = time.perf_counter() - t_world
    n = len(vec.embeddings)
    ids = np.arange(n, dtype=np.int64)  # id = memory-bank row; the service allocates above
    index, params, info = make_index(vec, cfg, ids, log)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_stages(out)
    stage = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    stage.mkdir()
    try:
        faiss.write_index(index, str(stage / INDEX_FILE))
        if world_fit is not None:
            from embedding import world

            world.save(world_fit, stage, model.fingerprint)
        names = model.config.class_names
        g = gallery_trained(cfg.run_dir) if cfg.trained_items else None
        try:
            dataset = (
                g.provenance.dataset
                if g is not None
                else RunDir(cfg.run_dir).read_provenance().dataset
            )
        except ArtifactError:  # a memory-bank index needs no images; the name is informative
            dataset = None
        emb_le = vec.embeddings.astype("<f4", copy=False)
        thumbs = (
            make_thumbnails(cfg, vec.dataset_indices, log) if cfg.thumbnails and n else [None] * n
        )
        rows = (
            (
                int(i),
                names[int(y)],
                "trained",
                {"dataset": dataset, "dataset_index": int(di)},
                emb_le[int(i)].tobytes(),
                th,
            )
            for i, y, di, th in zip(ids, vec.label_ids, vec.dataset_indices, thumbs, strict=True)
        )
        index_id = uuid.uuid4().hex
        store_meta = {
            "model_fingerprint": model.fingerprint,
            "index_id": index_id,
            "dim": str(int(index.d)),
            "space": cfg.space,
        }
        create_store(stage / STORE_FILE, rows, store_meta)
        counts = np.bincount(vec.label_ids, minlength=len(names))
        manifest = IndexManifest(
            index_id=index_id,
            dim=int(index.d),
            count=int(index.ntotal),
            next_id=n,
            labels={names[c]: int(counts[c]) for c in range(len(names)) if counts[c]},
            class_names=names,
            model_fingerprint=model.fingerprint,
            temperature=model.config.temperature,
            space=cfg.space,
            factory=cfg.factory,
            search_params=params,
            source=cfg.source,
            thumbnails=cfg.thumbnails,
            dataset=dataset,
            run_dir=str(cfg.run_dir),
            created_at=utc_now(),
            build={
                **info,
                "seconds": time.perf_counter() - t_start,
                "world": world_basis,
                "world_seconds": round(t_world, 2),
                "pair_similarity": None if spread is None else round(spread, 4),
                "trained_items": cfg.trained_items,
                "faiss": faiss.__version__,
            },
            files={
                name: {"sha256": sha256_file(stage / name), "bytes": (stage / name).stat().st_size}
                for name in (INDEX_FILE, STORE_FILE, WORLD_FILE)
                if (stage / name).is_file()
            },
        )
        write_manifest(stage, manifest)
        publish_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest
