"""GET /gallery/suggestions?label=... (issue 43, propagation): the gallery items of other
labels and the queued queries the service's vote would most likely give to a label, ranked,
each with its score and the label's item it sits nearest (service/gallery/suggest.py); accept
them with POST /gallery/relabel (items) or POST /review/name (queued queries)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from embedding.votes import VOTES
from service.gallery.labels import normalize_label
from service.gallery.suggest import suggest
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.problems import Problem
from service.http.urls import queued_thumbnail_url, thumbnail_url
from service.review.groups import MAX_QUERIES

router = APIRouter(prefix="/gallery", tags=["gallery"], route_class=GuardedRoute)


def _suggest(state, label: str, limit: int, queued: bool, vote: str) -> dict | None:
    rows = state.store.queued(MAX_QUERIES) if queued else []
    q = [(r.id, r.embedding, r.answer) for r in rows]
    s = state.settings
    got = suggest(state.gallery, vote, label, s.k, limit, q)
    if got is None:
        return None
    thumbs = state.store.with_thumbnails([x.id for x in got if x.kind == "item"])
    queued_thumbs = {r.id for r in rows if r.has_thumbnail}
    out = []
    for x in got:
        d = asdict(x)
        d["score"], d["near_similarity"] = round(x.score, 5), round(x.near_similarity, 5)
        if x.kind == "item":
            d["thumbnail_url"] = thumbnail_url(x.id) if x.id in thumbs else None
        else:
            d["thumbnail_url"] = queued_thumbnail_url(x.id) if x.id in queued_thumbs else None
        out.append(d)
    return {
        "label": label,
        "suggestions": out,
        "vote": s.vote,
        "gallery_version": state.gallery.version,
    }


@router.get(
    "/suggestions",
    responses={404: {"description": "no live items with this label"}},
    summary="Gallery items and queued queries that likely belong to a label, ranked, with why",
    openapi_extra=access("private"),
)
async def suggestions(
    request: Request,
    state: StateDep,
    label: Annotated[str, Query(min_length=1, max_length=1000, description="the label")],
    limit: Annotated[int, Query(ge=1, le=1000, description="suggestions returned")] = 100,
    queued: Annotated[bool, Query(description="also rank the review queue's queries")] = True,
    vote: Annotated[
        Literal[VOTES], Query(description="the rule whose probability ranks them")
    ] = "knn",
):
    name = normalize_label(label)
    admission = request.app.state.admission
    async with admission.diagnostics_gate.enter():  # (CPU-bound: a bounded number at once)
        body = await run_in_threadpool(_suggest, state, name, limit, queued, vote)
    if body is None:
        raise Problem(404, "label_unknown", f"no live items with label {name!r}")
    return JSONResponse(body)
