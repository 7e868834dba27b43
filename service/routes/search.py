"""POST /search: the nearest gallery items of an image."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Query, UploadFile
from starlette.concurrency import run_in_threadpool

from ..deps import GuardedRoute, StateDep, access
from ..schemas import SearchItem, SearchResult
from .classify import ERRORS, thumbnail_url

router = APIRouter(tags=["search"], route_class=GuardedRoute)


@router.post(
    "/search", responses=ERRORS, summary="Most similar gallery items", openapi_extra=access("read")
)
async def search(
    state: StateDep,
    image: Annotated[UploadFile, File(description="query image")],
    k: Annotated[int, Query(ge=1, le=1000, description="items to return")] = 10,
    label: Annotated[
        list[str] | None, Query(description="only items of these labels (repeatable)")
    ] = None,
) -> SearchResult:
    if label:
        missing = [lab for lab in label if not state.gallery.has_label(lab)]
        if missing:
            raise HTTPException(404, f"unknown labels in the filter: {', '.join(missing)}")
    (p,) = await state.runtime.prepare_async([await image.read()], ["image"])
    q = (await state.runtime.embed(p))[None, :]
    sims, ids, _names = await run_in_threadpool(state.gallery.search, q, k, label or None)
    hits = (
        [(int(i), float(s)) for i, s in zip(ids[0], sims[0], strict=True) if i >= 0]
        if len(ids)
        else []
    )
    info = await run_in_threadpool(state.store.items, [i for i, _ in hits])
    items = [
        SearchItem(
            id=i,
            label=info[i][0],
            similarity=s,
            source=info[i][1],
            metadata=info[i][2],
            thumbnail_url=thumbnail_url(i) if info[i][3] else None,
        )
        for i, s in hits
        if i in info  # an item deleted since the search is left out
    ]
    return SearchResult(items=items, gallery_version=state.gallery.version)
