"""The review queue (issue 43; SNCA_REVIEW_QUEUE): GET /review lists what the service could not
name, grouped by similarity (service/review/groups.py); POST /review/name makes a group's
queries items of a label (one durable write, an add); POST /review/dismiss drops them; a queued
query's thumbnail. Naming and dismissing need a write key where keys are set."""

from __future__ import annotations

from collections import Counter
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from embedding.thumbnails import thumbnail_mime
from service.gallery.labels import check_label
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.idempotency import REPLAYED, keyed_write
from service.http.inputs import IDEMPOTENCY_PARAMETER
from service.http.problems import Problem
from service.http.schemas import Dismiss, Name, Named
from service.http.urls import queued_thumbnail_url
from service.review import groups as grouping

router = APIRouter(prefix="/review", tags=["review"], route_class=GuardedRoute)


def _entry(q) -> dict:
    return {
        "id": q.id,
        "created_at": q.created_at,
        "answer": q.answer,
        "nearest_label": q.nearest,
        "margin": round(q.margin, 4),
        "unknown_reason": q.reason,
        "thumbnail_url": queued_thumbnail_url(q.id) if q.has_thumbnail else None,
    }


def _groups(state, limit: int, sample: int) -> dict:
    """The newest `limit` queued queries grouped (in a worker thread: O(limit²))."""
    rows = state.store.queued(limit)
    n, size = state.store.queue_totals()
    with state.gallery.lock.read():
        link = grouping.link_similarity(state.gallery.stats)
    link = 0.5 if link is None else link  # (no label of two items yet: cosine 0.5)
    import numpy as np

    emb = np.stack([q.embedding for q in rows]) if rows else np.zeros((0, 1), np.float32)
    out = []
    for g in grouping.group(emb, link, sample=sample):
        members = [rows[i] for i in g.members]
        votes = Counter(q.nearest for q in members if q.nearest is not None)
        out.append(
            {
                "ids": [q.id for q in members],
                "size": len(members),
                "cohesion": round(g.cohesion, 4),
                "nearest_label": votes.most_common(1)[0][0] if votes else None,
                "sample": [_entry(rows[i]) for i in g.sample],
            }
        )
    return {
        "enabled": state.settings.review_queue,
        "queued": n,
        "bytes": size,
        "grouped": len(rows),
        "link_similarity": round(float(link), 4),
        "groups": out,
        "gallery_version": state.gallery.version,
    }


@router.get(
    "",
    summary="What the service could not name, grouped by similarity (one decision per group)",
    openapi_extra=access("private"),
)
async def review(
    request: Request,
    state: StateDep,
    limit: Annotated[
        int, Query(ge=1, le=grouping.MAX_QUERIES, description="newest queued queries grouped")
    ] = 500,
    sample: Annotated[int, Query(ge=1, le=50, description="queries shown per group")] = 6,
):
    admission = request.app.state.admission
    async with admission.diagnostics_gate.enter():  # (CPU-bound: a bounded number at once)
        body = await run_in_threadpool(_groups, state, limit, sample)
    return JSONResponse(body)


@router.get(
    "/items/{queued_id}/thumbnail",
    responses={
        200: {"content": {"image/png": {}, "image/jpeg": {}}, "description": "the thumbnail"},
        404: {"description": "not queued (named, dismissed, or past the queue's bounds)"},
    },
    response_class=Response,
    summary="A queued query's thumbnail",
    openapi_extra=access("private"),
)
async def queued_thumbnail(
    state: StateDep,
    queued_id: Annotated[int, Path(ge=0, le=2**63 - 1, description="queued query id")],
):
    data = await run_in_threadpool(state.store.queued_thumbnail, queued_id)
    if data is None:
        raise Problem(404, "item_unknown", f"no queued query {queued_id} with a thumbnail")
    headers = {"Cache-Control": "private, no-cache", "Vary": "X-API-Key"}
    return Response(data, media_type=thumbnail_mime(data), headers=headers)


@router.post(
    "/name",
    status_code=201,
    response_model=Named,
    responses={404: {"description": "none of the ids is queued"}},
    summary="Name queued queries: they become items of the label (one write) and leave the queue",
    openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
)
async def name(request: Request, state: StateDep, body: Name):
    label = check_label(body.label, state.settings.max_label_length)
    ids = sorted(set(body.ids))
    done, found = await keyed_write(
        request, state, "name", (label, str(ids)), lambda k: state.name_queued(ids, label, k)
    )
    none = "none of these ids is queued (named or dismissed?)"
    if found is not None:
        seq, outcome = found
        if not outcome["ids"]:  # (none was queued then: answered 404 then)
            raise Problem(404, "item_unknown", none, headers={REPLAYED: "true"})
        out = Named(
            ids=outcome["ids"], queued_ids=outcome.get("queued", []), label=label,
            count=state.gallery.count_of(label), gallery_version=seq,
        )  # fmt: skip
        return JSONResponse(out.model_dump(), status_code=201, headers={REPLAYED: "true"})
    new, queued, seq = done
    if not new:  # (with a key, that outcome is recorded: a retry is answered 404 too)
        raise Problem(404, "item_unknown", none)
    await state.runtime.sync(seq)  # acknowledged once the model votes with them
    out = Named(
        ids=new, queued_ids=[q.id for q in queued], label=label,
        count=state.gallery.count_of(label), gallery_version=seq,
    )  # fmt: skip
    return JSONResponse(out.model_dump(), status_code=201)


@router.post(
    "/dismiss",
    summary="Drop queued queries (nobody will name them)",
    openapi_extra=access("write"),
)
async def dismiss(state: StateDep, body: Dismiss):
    n = await run_in_threadpool(state.store.dismiss, sorted(set(body.ids)))
    return {"dismissed": n}
