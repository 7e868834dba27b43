"""POST /gallery/add, GET /gallery/labels, DELETE /gallery/labels/{label}, DELETE /gallery/items/{id}."""

from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import APIRouter, File, Form, HTTPException, Path, Response, UploadFile
from starlette.concurrency import run_in_threadpool

from embedding.thumbnails import thumbnail_mime

from ..deps import GuardedRoute, StateDep, access, check_label, parse_metadata
from ..schemas import AddResult, DeleteResult, ErrorBody, LabelInfo, LabelsResult

router = APIRouter(prefix="/gallery", tags=["gallery"], route_class=GuardedRoute)

# Ids are SQLite integers (64-bit): a larger number is a 422, not an overflow deeper down.
ItemId = Annotated[int, Path(ge=0, le=2**63 - 1, description="gallery item id")]

WRITE_ERRORS = {
    400: {"model": ErrorBody, "description": "undecodable image"},
    401: {"model": ErrorBody, "description": "missing or wrong API key"},
    413: {"model": ErrorBody, "description": "too many or too large images / metadata"},
    415: {"model": ErrorBody, "description": "not an image"},
    503: {
        "model": ErrorBody,
        "description": "the gallery store cannot be written (nothing was changed)",
    },
}


@router.post(
    "/add",
    response_model=AddResult,
    responses=WRITE_ERRORS,
    summary="Register images under a label (new or existing); classifiable on return",
    openapi_extra=access("write"),
)
async def add(
    state: StateDep,
    label: Annotated[
        str, Form(description="label name: printable text, at most SNCA_MAX_LABEL_LENGTH")
    ],
    images: Annotated[
        list[UploadFile], File(description="1 to SNCA_MAX_IMAGES_PER_REQUEST images")
    ],
    metadata: Annotated[
        str | None,
        Form(
            description='JSON object for all images, or a list with one object per image, e.g. {"sku": "A-17"}'
        ),
    ] = None,
):
    s = state.settings
    label = check_label(label, s.max_label_length)
    if not images:
        raise HTTPException(422, "at least one image is needed")
    if len(images) > s.max_images_per_request:
        raise HTTPException(
            413, f"{len(images)} images; the limit is {s.max_images_per_request} per request"
        )
    md = parse_metadata(metadata, len(images), s.max_metadata_bytes)
    datas = [await f.read() for f in images]
    prepared = await state.runtime.prepare_async(
        datas, [f"images[{i}]" for i in range(len(datas))], thumbnails=s.thumbnails
    )
    emb = np.stack(await asyncio.gather(*[state.runtime.embed(p) for p in prepared]))
    stored = [
        (p.data, p.mime) if s.store_images and len(p.data) <= s.max_stored_image_bytes else None
        for p in prepared
    ]
    thumbs = [p.thumbnail for p in prepared]
    ids, seq = await run_in_threadpool(state.add, label, emb, md, stored, thumbs)
    return AddResult(ids=ids, label=label, count=state.gallery.count_of(label), gallery_version=seq)


@router.get(
    "/labels",
    response_model=LabelsResult,
    summary="Labels with their live item counts",
    openapi_extra=access("read"),
)
async def labels(state: StateDep):
    rows = state.gallery.label_table()
    out = []
    for name, count, added in rows:
        src = "added" if added == count else ("trained" if added == 0 else "trained+added")
        out.append(LabelInfo(label=name, count=count, source=src))
    return LabelsResult(
        labels=out, total=sum(r.count for r in out), gallery_version=state.gallery.version
    )


def _delete_route(path: str, summary: str):
    return router.delete(
        path,
        response_model=DeleteResult,
        responses=WRITE_ERRORS | {404: {"model": ErrorBody}},
        summary=summary,
        openapi_extra=access("write"),
    )


async def _delete(state, ids: list[int], label: str | None, what: str) -> DeleteResult:
    """Delete the live items among `ids` (404 naming `what` when there are none)."""
    rows = []
    if ids:
        rows, seq = await run_in_threadpool(state.delete, ids)
    if not rows:
        raise HTTPException(404, f"no {what} in the gallery")
    return DeleteResult(deleted=sorted(r[0] for r in rows), label=label, gallery_version=seq)


@_delete_route("/labels/{label:path}", "Delete every item of a label")
async def delete_label(state: StateDep, label: str):
    return await _delete(state, state.gallery.ids_of(label), label, f"label {label!r}")


@_delete_route("/items/{item_id}", "Delete one item")
async def delete_item(state: StateDep, item_id: ItemId):
    label = state.gallery.label_of_id(item_id)
    ids = [] if label is None else [item_id]
    return await _delete(state, ids, label, f"item {item_id}")


@router.get(
    "/items/{item_id}/thumbnail",
    responses={
        200: {"content": {"image/png": {}, "image/jpeg": {}}, "description": "the thumbnail"},
        404: {"model": ErrorBody, "description": "no such live item, or no thumbnail kept"},
    },
    response_class=Response,
    summary="A gallery item's thumbnail (cacheable: ids are never reused)",
    openapi_extra=access("read"),
)
async def thumbnail(state: StateDep, item_id: ItemId):
    data = await run_in_threadpool(state.store.thumbnail, item_id)
    if data is None:
        raise HTTPException(404, f"no thumbnail for item {item_id}")
    # An id is never reused and its thumbnail never changes: cache for a year.
    return Response(
        data,
        media_type=thumbnail_mime(data),
        headers={"Cache-Control": "public, max-age=31536000, immutable", "ETag": f'"t{item_id}"'},
    )
