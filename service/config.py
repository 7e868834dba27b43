"""Service settings: environment variables with the SNCA_ prefix (pydantic-settings).

Model hyper-parameters (σ, transforms, class names) come from the model card, never from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from embedding.votes import VOTES
from service.store.datadir import STORE_FILE, default_data_dir
from service.store.url import is_postgres_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SNCA_", env_file=None, extra="ignore")
    _store_given: bool = PrivateAttr(default=False)

    # artifacts (run dir, index dir: build outputs) and the user's gallery (the data dir)
    model: Path = Field(Path("runs/demo"), description="training run dir (model card + weights)")
    index: Path | None = Field(None, description="snca-build-index's index dir (MODEL/index)")
    # the service's gallery store: a SQLite file (a copy of the index dir's store on the first
    # start) or a PostgreSQL URL (seeded from the index dir's store by the first replica)
    store: str | None = Field(
        None,
        description="the gallery store: a SQLite file (default DATA_DIR/gallery.sqlite) or "
        "postgresql://USER[:PASSWORD]@HOST:PORT/DB (replicas on several hosts)",
    )
    data_dir: Path | None = Field(
        None,
        description="the user's gallery: store, snapshots, previous stores; never written by "
        "training or index builds (default data/<model name>, relative to the working dir)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"

    # classification
    k: int = Field(30, ge=1, le=1000, description="neighbours that vote (kNN rule)")
    vote: str = Field("kde_shrunk", description=f"default voting rule: one of {', '.join(VOTES)}")
    candidates: int = Field(
        1024,
        ge=1,
        le=16384,
        description="galleries past exact_vote_max items vote from the index's top this many "
        "candidates plus exact per-label statistics (1,024 keeps >= 99.5% of the exact vote's "
        "labels on the default gallery)",
    )
    exact_vote_max: int = Field(
        60_000,
        ge=0,
        description="galleries up to this many items keep a dense copy of every embedding and "
        "vote exactly (faster there); beyond it the candidate vote, no dense copy",
    )
    unknown_tpr: float = Field(
        0.95,
        ge=0.0,
        lt=1.0,
        description="open-set: 'unknown' when the score is under the threshold that accepts this "
        "share of the gallery's own items (leave-one-out, per label; 0 turns it off)",
    )
    world_tpr: float = Field(
        0.99,
        ge=0.0,
        lt=1.0,
        description="the world check (is this the kind of image a label holds): a trained "
        "label's threshold accepts this share of held-out known images (0 turns the check off; "
        "registered labels are checked against their own images)",
    )
    unknown_k: int = Field(
        10,
        ge=1,
        le=1000,
        description="open-set score: similarity to the k-th nearest item of the chosen label "
        "(fewer for a label with fewer items)",
    )
    unknown_similarity: float = Field(
        0.5,
        ge=-1.0,
        le=1.0,
        description="open-set, besides the calibrated rule: 'unknown' when the best cosine is "
        "below this (-1: off)",
    )
    unknown_probability: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="open-set, besides the calibrated rule: 'unknown' when the winning "
        "probability is below this",
    )

    # batching
    max_batch: int = Field(
        64,
        ge=1,
        le=4096,
        description="micro-batcher: images per forward pass at most (see batch_min_gain)",
    )
    batch_min_gain: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="micro-batcher: from 8 images, a batch twice as large is formed only if it "
        "ran an image at least this much faster when timed at start (a photo model on a small "
        "CPU runs an image as fast at 8 as at 64, and a batch of 64 held ~700 MB more); 0: "
        "batches up to max_batch",
    )
    max_wait_ms: float = Field(
        0.0,
        ge=0.0,
        le=1000.0,
        description="micro-batcher: wait this long for more requests (0: none; batches still "
        "fill with the requests that arrive while the previous batch runs)",
    )
    engine: Literal["auto", "torch", "onnxruntime", "openvino"] = Field(
        "auto",
        description="what runs the model on a CPU: onnxruntime or openvino on the model exported "
        "to ONNX (cached in MODEL/engines), checked against torch at start; auto: every "
        "installed one timed there, the fastest serves; torch: the traced torch module. An "
        "engine that is not installed, cannot take the model or disagrees with torch leaves "
        "torch serving, with a warning saying why",
    )
    optimize: bool = Field(
        True,
        description="CPU: serve a traced, BatchNorm-folded oneDNN copy of the model (checked "
        "against the eager model at start; falls back to it)",
    )
    fused_batches: int = Field(
        8,
        ge=0,
        le=64,
        description="CPU: also compile a oneDNN-graph fused copy of the model for each batch "
        "size up to this, kept where it is at least 10% faster (timed at start; 0: none). "
        "Batches of one to a few images are what a moderately loaded server runs",
    )
    fused_memory_mb: float = Field(
        512.0,
        ge=0.0,
        description="CPU: resident memory the fused copies may take together (conv4: ~8 MB "
        "each, ResNet-18: ~100 MB each, so sizes 1-4); sizes beyond it get none",
    )
    warmup_seconds: float = Field(
        30.0,
        ge=0.0,
        description="start-up: run one batch of every size 1..max_batch (smallest first) until "
        "this many seconds are spent, so that the first batches of those sizes are neither slow "
        "nor a step in memory (conv4: all 64 in ~1 s; ResNet-50 at 224 px on a small CPU: a "
        "few sizes); later sizes build their kernels on first use",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="CPU threads for the model's forward pass (0: automatic, one less than the "
        "cores for a light model such as conv4, every core for a heavy one such as ResNet)",
    )

    # limits
    max_upload_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="per request body")
    max_image_pixels: int = Field(40_000_000, ge=64, description="width x height per image")
    max_request_pixels: int = Field(
        100_000_000,
        ge=64,
        description="width x height of all the images of one request together (checked from "
        "their headers before any is decoded; they are then decoded one at a time)",
    )
    max_images_per_request: int = Field(64, ge=1, le=1024)
    max_label_length: int = Field(100, ge=1, le=1000)
    max_metadata_bytes: int = Field(16 * 1024, ge=2)
    store_images: bool = Field(
        True, description="keep added images in the store (for re-embedding)"
    )
    max_stored_image_bytes: int = Field(2 * 1024 * 1024, ge=0)
    thumbnails: bool = Field(
        False,
        description="keep a small thumbnail of each added image (shown by the web page at /); "
        "when not set: on for a photo model (over 64 px), off otherwise",
    )
    thumbnail_side: int = Field(96, ge=16, le=256, description="thumbnail long edge, pixels")

    # the review queue (service/review/; issue 43)
    review_queue: bool = Field(
        False,
        description="keep the queries answered unknown, or with a margin below "
        "SNCA_REVIEW_MARGIN, for a person to name (GET /review, the page's Review tab)",
    )
    review_margin: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="an answer whose two best labels' probabilities differ by less goes to "
        "review too (0: only unknowns)",
    )
    review_max_items: int = Field(10_000, ge=1, description="queries the queue keeps at most")
    review_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="bytes the queue keeps at most (oldest go first)"
    )
    review_retention_s: float = Field(
        7 * 86400.0, gt=0, description="seconds a queued query is kept"
    )
    review_keep_images: bool = Field(
        False,
        description="keep the upload itself with a queued query (up to "
        "SNCA_MAX_STORED_IMAGE_BYTES; needed for a named query to be re-embedded by an upgrade)",
    )
    review_buffer_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="offers waiting for the queue's writer at most (beyond: dropped, counted)",
    )

    # durability
    snapshot_every: int = Field(
        1000, ge=0, description="snapshot the index after this many writes (0: only on demand)"
    )
    follow_poll_s: float | None = Field(
        None,
        gt=0,
        le=60,
        description="replicas: how often to look for other processes' writes (default: 0.01 s "
        "on SQLite, which has no notifications, 0.1 s (or this, if longer) after 2 s without a "
        "write while no request waits for a version; 1 s on PostgreSQL, a fallback for "
        "LISTEN/NOTIFY)",
    )
    min_version_wait_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="X-Min-Gallery-Version: how long a read waits for this replica to apply "
        "that write before it answers 503 with Retry-After",
    )
    max_parked: int = Field(
        256,
        ge=1,
        le=100_000,
        description="X-Min-Gallery-Version: requests that may wait for a version at once "
        "(429 beyond)",
    )
    max_parked_per_client: int = Field(
        16,
        ge=1,
        le=100_000,
        description="X-Min-Gallery-Version: requests one client address may have waiting at "
        "once (429 beyond; behind a proxy every client is the proxy's address)",
    )
    diagnostics_concurrency: int = Field(
        1,
        ge=1,
        le=64,
        description="GET /gallery/diagnostics computed at once per process (each ~0.3 s of "
        "CPU); repeated calls between two writes are answered from a cache",
    )
    diagnostics_queue: int = Field(
        4,
        ge=0,
        le=1000,
        description="GET /gallery/diagnostics calls that may wait for one of those; more are "
        "answered 429 too_busy at once",
    )
    model_process: bool = Field(
        True,
        description="each worker runs its model, vote and gallery replica in a process of its "
        "own beside the event loop's (docs/PERFORMANCE.md); off: one process, the model on a "
        "thread (less memory, lower throughput)",
    )
    model_timeout_s: float = Field(
        20.0,
        ge=0.5,
        le=3600,
        description="the longest the worker's model process may work without answering "
        "anything while jobs wait for it: past it the process counts as stopped or hung, its "
        "requests answer 503 model_unavailable, it is restarted (/readyz 503 from half of it); "
        "a busy process that answers batch after batch is never judged hung",
    )
    model_queue_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="the longest a request may expect to wait for the worker's model process "
        "(the jobs queued to it times its recent time per job): past it, 503 model_busy with "
        "Retry-After at once, before the request waits",
    )
    model_queue_max: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="jobs (images) queued to the worker's model process at most (their pixels "
        "wait in memory): past it, 503 model_busy",
    )
    idempotency_ttl_s: float = Field(
        86400.0,
        ge=60,
        le=365 * 86400,
        description="how long a write's Idempotency-Key is remembered (a retry within it is "
        "answered with the first outcome, on every replica and after restarts)",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="serving processes on one port sharing one gallery store (each a replica "
        "with its own model process; torch threads split between them)",
    )
    follow_alias: bool = Field(
        False,
        description="serve the model the gallery's alias names (the one `snca-gallery upgrade "
        "--switch` made live) instead of --model, when it names another; with no alias, the "
        "model a start last carried the gallery to (make run and make photos do)",
    )
    keep_previous: int = Field(
        3,
        ge=1,
        le=1000,
        description="stores kept in DATA_DIR/previous/ after a migration (the newest; one that "
        "is the only copy of an item is never deleted)",
    )
    migration_batch: int = Field(
        64,
        ge=1,
        le=4096,
        description="carrying the gallery to a new model: items re-embedded and committed per "
        "transaction (a restart resumes after the last one)",
    )

    # security
    api_key: SecretStr | None = Field(
        None, description="required on writes when set (X-API-Key); empty = no key"
    )
    api_key_file: Path | None = Field(
        None,
        description="read the API key from this file (e.g. a Docker/Compose secret, "
        "/run/secrets/snca_api_key) when api_key is not set",
    )
    api_keys: SecretStr | None = Field(
        None,
        description="scoped keys: SCOPE:KEY entries (SCOPE read or write) separated by commas",
    )
    api_keys_file: Path | None = Field(
        None,
        description="scoped keys from a file, one SCOPE:KEY a line; re-read when it changes "
        "(rotation without a restart)",
    )
    protect_reads: bool | None = Field(
        None,
        description="require a key (read or write) on read routes too; default: when a read "
        "key is configured",
    )
    allowed_hosts: str | None = Field(
        None,
        description="comma-separated Host header names the server answers to ('*': any); "
        "default: the loopback names, and bound beyond loopback also this host's own name and "
        "addresses; any other name (a DNS name clients use) must be listed (DNS rebinding)",
    )

    # slow or too many clients
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="a request's headers must arrive within this (408)"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="a request's body must arrive within this (408)"
    )
    max_connections: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="open connections; one more is answered 503 and closed",
    )

    # server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("store", mode="before")
    @classmethod
    def _store_text(cls, v):
        return str(v) if isinstance(v, Path) else v

    @field_validator("vote")
    @classmethod
    def _known_vote(cls, v: str) -> str:
        if v not in VOTES:
            raise ValueError(f"unknown vote {v!r}; choose one of {', '.join(VOTES)}")
        return v

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if self.api_key is not None and not self.api_key.get_secret_value():
            self.api_key = None  # SNCA_API_KEY="" (an unset compose variable): no key
        if self.api_key is None and self.api_key_file is not None:
            try:
                key = self.api_key_file.read_text().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read api_key_file {self.api_key_file}: {e}") from None
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file} is empty")
            self.api_key = SecretStr(key)
        if self.api_keys is not None and not self.api_keys.get_secret_value().strip():
            self.api_keys = None
        if self.index is None:
            self.index = self.model / "index"
        self._store_given = self.store is not None
        if self.data_dir is None:
            self.data_dir = default_data_dir(self.model)
        if self.store is None:
            self.store = str(self.data_dir / STORE_FILE)
        elif "://" in self.store and not is_postgres_url(self.store):
            raise ValueError(
                f"store {self.store.split('://')[0]}://...: give a SQLite file path or a "
                "postgresql://USER@HOST:PORT/DB URL"
            )
        return self

    @property
    def store_url(self) -> str | None:
        """The PostgreSQL URL when the store is one, else None (a SQLite file)."""
        return self.store if is_postgres_url(self.store) else None

    @property
    def store_path(self) -> Path:
        """The SQLite store's file (for a PostgreSQL store: where one would be, unused)."""
        return Path(self.store) if self.store_url is None else self.data_dir / STORE_FILE

    @property
    def home_store(self) -> str:
        """The gallery's store as the store layer opens it: the PostgreSQL URL, or the SQLite
        file's path (the home every start-up, carry and tool reads and writes)."""
        return self.store_url or str(self.store_path)

    def mark_store_given(self, given: bool) -> None:
        """Whether the store was named (a model process is handed the front's settings, where
        the store is always named: it is told whether the front's was)."""
        self._store_given = given

    @property
    def store_is_default(self) -> bool:
        """The store is DATA_DIR/gallery.sqlite because none was named."""
        return not self._store_given


def add_gallery_flags(p) -> None:
    """The flags that say which model and gallery a command opens, as the settings of the same
    names (snca-serve, and each snca-gallery command): --model, --index, --store, --data-dir."""
    p.add_argument("--model", type=Path, help="training run dir (default SNCA_MODEL or runs/demo)")
    p.add_argument("--index", type=Path, help="index dir (default MODEL/index)")
    p.add_argument(
        "--store",
        help="the gallery store: a SQLite file (default DATA_DIR/gallery.sqlite), or "
        "postgresql://USER[:PASSWORD]@HOST:PORT/DB (replicas on several hosts share one)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        help="the gallery's data dir: store, snapshots, previous stores (default "
        "data/<model name>)",
    )
