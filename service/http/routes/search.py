"""POST /search: the nearest gallery items of an image."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from service.gallery.labels import normalize_label
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.inputs import ERRORS, IMAGE_BODY, check_labels, read_uploads
from service.http.schemas import SearchResult
from service.http.urls import thumbnail_url

router = APIRouter(tags=["search"], route_class=GuardedRoute)

BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["image"],
                "additionalProperties": False,
                "properties": {
                    "image": {
                        "type": "string",
                        "format": "binary",
                        "minLength": 1,
                        "description": "query image",
                    }
                },
            }
        },
        **IMAGE_BODY,
    },
}


@router.post(
    "/search",
    response_model=SearchResult,
    responses=ERRORS,
    summary="Most similar gallery items",
    openapi_extra=access("read", requestBody=BODY),
)
async def search(
    request: Request,
    state: StateDep,
    k: Annotated[int, Query(ge=1, le=1000, description="items to return")] = 10,
    label: Annotated[
        list[str] | None, Query(description="only items of these labels (repeatable)")
    ] = None,
):
    labels = sorted({normalize_label(lab) for lab in label} - {""}) if label else None
    if labels:
        check_labels(state, labels)
    (data,) = await read_uploads(request, "image", 1)
    (p,) = await state.runtime.uploads.prepare_async([data], ["image"])
    q, _ = state.runtime.embedder.split((await state.runtime.embed(p))[None, :])
    sims, ids, _names = await run_in_threadpool(state.gallery.search, q, k, labels or None)
    hits = (
        [(int(i), float(s)) for i, s in zip(ids[0], sims[0], strict=True) if i >= 0]
        if len(ids)
        else []
    )
    info = await run_in_threadpool(state.store.items, [i for i, _ in hits])
    items = [
        {
            "id": i,
            "label": info[i][0],
            "similarity": s,
            "source": info[i][1],
            "metadata": info[i][2],
            "thumbnail_url": thumbnail_url(i) if info[i][3] else None,
        }
        for i, s in hits
        if i in info  # an item deleted since the search is left out
    ]
    # a plain JSONResponse: stored metadata is JSON however deep (pydantic's serialiser has a
    # depth limit that one stored item would turn into a 500 for every search returning it)
    return JSONResponse({"items": items, "gallery_version": state.gallery.version})
