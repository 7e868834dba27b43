"""Registering images under a label: the one home of an add. Embed the prepared images, keep
the uploads by the stored-image policy, write them durably (one store transaction, applied to
this process's gallery: ServiceState.add), and acknowledge only once the model votes with them
(the model process applied the write). POST /gallery/add (and the page, which posts there) and
`snca-gallery import` both go through here."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import numpy as np
from anyio import to_thread

from service.config import Settings
from service.model.uploads import Prepared
from service.state import ServiceState
from service.store.records import Keyed, Replayed


@dataclass
class Added:
    ids: list[int]
    seq: int  # the write's gallery_version
    embeddings: np.ndarray  # (n, d) float32
    stats: np.ndarray | None  # (n, D) the images' world statistics, when the model has them


def stored_image(p: Prepared, s: Settings) -> tuple[bytes, str] | None:
    """The upload kept for a later model to re-embed (SNCA_STORE_IMAGES), unless larger than
    SNCA_MAX_STORED_IMAGE_BYTES (then only its embedding and thumbnail are kept)."""
    return (p.data, p.mime) if s.store_images and len(p.data) <= s.max_stored_image_bytes else None


def write(
    state: ServiceState,
    label: str,
    prepared: list[Prepared],
    emb: np.ndarray,
    stats: np.ndarray | None,
    metadata: list,
    keyed: Keyed | None,
) -> Added:
    """The durable write of embedded images, blocking (Replayed: `keyed` was used before)."""
    stored = [stored_image(p, state.settings) for p in prepared]
    thumbs = [p.thumbnail for p in prepared]
    ids, seq = state.add(label, emb, metadata, stored, thumbs, stats, keyed)
    return Added(ids, seq, emb, stats)


async def register(
    state: ServiceState,
    label: str,
    prepared: list[Prepared],
    metadata: list,
    keyed: Keyed | None,
) -> Added:
    """Embed (through the batcher, one job per image), write, and return once the model
    process applied the write: a classify after this answer votes with the new images."""
    rows = np.stack(await asyncio.gather(*[state.runtime.embed(p) for p in prepared]))
    emb, stats = state.runtime.embedder.split(rows)  # (n, d), (n, D) or None
    added = await to_thread.run_sync(write, state, label, prepared, emb, stats, metadata, keyed)
    await state.runtime.sync(added.seq)
    return added


def register_batch(state: ServiceState, batch: list[tuple[str, Prepared, dict]], key_of) -> int:
    """Blocking, with the model in this process (`snca-gallery import`): embed a batch of
    (label, Prepared, metadata) at once, then one write per label, keyed by
    `key_of(label, metadatas)` (a rerun that forms the same batch writes nothing twice). The
    images written (a write answered by its key's first outcome counts: it is in)."""
    if not batch:
        return 0
    emb, stats = state.runtime.embedder.split(
        state.runtime.embed_pixels([p.pixels for _, p, _ in batch])
    )  # (n, d), (n, D) or None
    by_label: dict[str, list[int]] = {}
    for i, (label, _, _) in enumerate(batch):
        by_label.setdefault(label, []).append(i)
    for label, rows in by_label.items():
        metadata = [batch[i][2] for i in rows]
        with contextlib.suppress(Replayed):
            write(
                state,
                label,
                [batch[i][1] for i in rows],
                emb[rows],
                None if stats is None else stats[rows],
                metadata,
                key_of(label, metadata),
            )
    return len(batch)
