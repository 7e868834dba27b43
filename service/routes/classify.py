"""POST /classify and /classify/batch."""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Query, UploadFile
from starlette.concurrency import run_in_threadpool

from ..deps import ReadKey, StateDep
from ..gallery import Classification
from ..schemas import BatchResult, ClassifyResult, ErrorBody
from ..state import ServiceState

router = APIRouter(tags=["classify"])

Vote = Enum("Vote", {v: v for v in ("knn", "prototype", "kde")}, type=str)

ERRORS = {
    400: {"model": ErrorBody, "description": "undecodable image"},
    401: {"model": ErrorBody, "description": "missing or wrong API key (SNCA_PROTECT_READS)"},
    413: {"model": ErrorBody, "description": "upload or image too large"},
    415: {"model": ErrorBody, "description": "not an image"},
    503: {"model": ErrorBody, "description": "not ready"},
}

KQuery = Annotated[
    int | None, Query(ge=1, le=1000, description="neighbours that vote (default SNCA_K)")
]
VoteQuery = Annotated[
    Vote | None,
    Query(
        description="voting rule (default SNCA_VOTE): knn (the paper's), prototype, kde (density-aware)"
    ),
]
NeighborsQuery = Annotated[bool, Query(description="include the k nearest gallery items")]
LabelsQuery = Annotated[
    list[str] | None, Query(description="only consider these labels (repeat the parameter)")
]


def result(
    state: ServiceState, c: Classification, vote: str, k: int, neighbors: bool
) -> ClassifyResult:
    s = state.settings
    unknown = (
        c.label is None
        or c.best_similarity < s.unknown_similarity
        or c.confidence < s.unknown_probability
    )
    return ClassifyResult(
        label=c.label,
        confidence=c.confidence,
        probabilities=[{"label": lab, "probability": min(1.0, p)} for lab, p in c.probabilities],
        unknown=unknown,
        best_similarity=c.best_similarity,
        neighbors=[{"id": i, "label": lab, "similarity": sim} for i, lab, sim in c.neighbors]
        if neighbors
        else None,
        vote=vote,
        k=k,
        gallery_version=state.gallery.version,
        model_fingerprint=state.fingerprint,
    )


def _params(state: ServiceState, k, vote, labels):
    k = k or state.settings.k
    vote = vote.value if vote is not None else state.settings.vote
    if labels is not None:
        labels = tuple(sorted({lab for lab in labels if lab}))
        known = set(state.gallery.label_id)
        missing = [lab for lab in labels if lab not in known]
        if missing:
            raise HTTPException(404, f"unknown labels in the filter: {', '.join(missing)}")
    return k, vote, labels


@router.post(
    "/classify",
    response_model=ClassifyResult,
    responses=ERRORS,
    response_model_exclude_none=True,
    summary="Classify one image by its neighbours in the gallery",
)
async def classify(
    state: StateDep,
    _: ReadKey,
    image: Annotated[
        UploadFile, File(description="PNG, JPEG, WebP, BMP, TIFF or GIF; grey or colour")
    ],
    k: KQuery = None,
    vote: VoteQuery = None,
    neighbors: NeighborsQuery = False,
    labels: LabelsQuery = None,
):
    k, vote_name, labels = _params(state, k, vote, labels)
    p = await run_in_threadpool(state.prepare, await image.read(), "image")
    c = await state.classify(p, vote_name, k, labels, neighbors)
    state.metrics.classified.labels(vote_name).inc()
    r = result(state, c, vote_name, k, neighbors)
    if r.unknown:
        state.metrics.unknown.inc()
    return r


@router.post(
    "/classify/batch",
    response_model=BatchResult,
    responses=ERRORS,
    response_model_exclude_none=True,
    summary="Classify several images; one result per image, in order",
)
async def classify_batch(
    state: StateDep,
    _: ReadKey,
    images: Annotated[
        list[UploadFile], File(description="1 to SNCA_MAX_IMAGES_PER_REQUEST images")
    ],
    k: KQuery = None,
    vote: VoteQuery = None,
    neighbors: NeighborsQuery = False,
    labels: LabelsQuery = None,
):
    if len(images) > state.settings.max_images_per_request:
        raise HTTPException(
            413,
            f"{len(images)} images; the limit is {state.settings.max_images_per_request} per request",
        )
    k, vote_name, labels = _params(state, k, vote, labels)
    datas = [await f.read() for f in images]
    prepared = await run_in_threadpool(
        lambda: [state.prepare(d, f"images[{i}]") for i, d in enumerate(datas)]
    )
    cs = await asyncio.gather(
        *[state.classify(p, vote_name, k, labels, neighbors) for p in prepared]
    )
    state.metrics.classified.labels(vote_name).inc(len(cs))
    out = [result(state, c, vote_name, k, neighbors) for c in cs]
    state.metrics.unknown.inc(sum(r.unknown for r in out))
    return BatchResult(results=out)
