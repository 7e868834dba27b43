"""The gallery: POST /gallery/add; GET /gallery/labels, /gallery/items, /gallery/items/{id},
its thumbnail; DELETE a label or an item."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from embedding.thumbnails import thumbnail_mime
from service.gallery.labels import LABEL_PATTERN, check_label, normalize_label
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.fields import ItemId
from service.http.idempotency import REPLAYED, keyed_write
from service.http.inputs import (
    IDEMPOTENCY_PARAMETER,
    missing,
    parse_metadata,
    read_form,
    text_field,
)
from service.http.problems import Problem
from service.http.schemas import (
    AddResult,
    DeleteResult,
    ItemInfo,
    ItemsPage,
    LabelDiagnostics,
    LabelInfo,
    LabelsResult,
)
from service.http.urls import thumbnail_url
from service.registration import register
from service.store import ItemRow
from service.store.records import Keyed

router = APIRouter(prefix="/gallery", tags=["gallery"], route_class=GuardedRoute)

# Ids are SQLite integers (64-bit): a larger number is a 422, not an overflow deeper down.
Limit = Annotated[int, Query(ge=1, le=1000, description="items per page")]
ItemCursor = Annotated[
    str | None,
    Query(
        pattern=r"^[0-9]{1,18}$",
        description="next_page_token of the previous page (the last id it gave); absent: the "
        "first page",
    ),
]
LabelCursor = Annotated[
    str | None,
    Query(
        max_length=1000,
        description="next_page_token of the previous page (the last label it gave); absent: "
        "the first page",
    ),
]

UPLOAD_ERRORS = {  # (what every route, write or upload answers: service/http/openapi.py)
    400: {"description": "undecodable image or malformed multipart body"},
    413: {"description": "too many or too large images / metadata"},
}


FIELDS = ("label", "images", "metadata")


def _add_body() -> dict:
    """OpenAPI of /gallery/add's form (read by service/http/inputs.py, not by FastAPI); the
    settings' limits are filled in when the schema is made (service/http/openapi.py)."""
    binary = {"type": "string", "format": "binary", "minLength": 1}
    props = {
        "label": {
            "type": "string",
            "minLength": 1,
            "pattern": LABEL_PATTERN,
            "description": "label name: a visible character, no control characters, at most "
            "SNCA_MAX_LABEL_LENGTH characters (stored in Unicode NFC, without surrounding "
            "whitespace)",
        },
        "images": {
            "type": "array",
            "items": binary,
            "minItems": 1,
            "description": "1 to SNCA_MAX_IMAGES_PER_REQUEST images",
        },
        "metadata": {
            "type": "object",
            "description": 'a JSON object kept with every image, e.g. {"sku": "A-17"} (also '
            "accepted: a list with one object per image); at most SNCA_MAX_METADATA_BYTES, "
            "16 levels deep, no NaN/Infinity",
        },
    }
    schema = {
        "type": "object",
        "required": ["label", "images"],
        "properties": props,
        "additionalProperties": False,
    }
    form = {"schema": schema, "encoding": {"metadata": {"contentType": "application/json"}}}
    return {"required": True, "content": {"multipart/form-data": form}}


@router.post(
    "/add",
    status_code=201,
    response_model=AddResult,
    responses={**UPLOAD_ERRORS, 201: {"description": "added; Location: the first new item"}},
    summary="Register images under a label (new or existing); classifiable on return",
    openapi_extra=access("write", requestBody=_add_body(), parameters=[IDEMPOTENCY_PARAMETER]),
)
async def add(request: Request, state: StateDep):
    s = state.settings
    form = await read_form(request, s.max_images_per_request + 8, FIELDS)
    raw_label = text_field(form, "label", "label_invalid")
    if raw_label is None:
        raise missing("label")
    label = check_label(raw_label, s.max_label_length)
    datas = form.files.get("images")
    if not datas:
        raise missing("images")
    if len(datas) > s.max_images_per_request:
        raise Problem(
            413,
            "too_many_files",
            f"{len(datas)} images; the limit is {s.max_images_per_request} per request",
        )
    md_text = text_field(form, "metadata", "metadata_invalid")
    md = parse_metadata(md_text, len(datas), s.max_metadata_bytes)

    async def write(keyed: Keyed | None):
        prepared = await state.runtime.uploads.prepare_async(
            datas, [f"images[{i}]" for i in range(len(datas))], thumbnails=s.thumbnails
        )
        return await register(state, label, prepared, md, keyed)

    # a retry of a write made is answered as the first attempt was, nothing embedded
    added, found = await keyed_write(request, state, "add", (label, md_text or "", *datas), write)
    if found is not None:
        seq, outcome = found
        ids, label = outcome["ids"], outcome["label"]
        out = AddResult(
            ids=ids, label=label, count=state.gallery.count_of(label), gallery_version=seq
        )
        headers = {"Location": f"/gallery/items/{ids[0]}", REPLAYED: "true"}
        return JSONResponse(out.model_dump(), status_code=201, headers=headers)
    ids, seq, emb, stats = added.ids, added.seq, added.embeddings, added.stats
    diag = await run_in_threadpool(
        state.gallery.diagnose, label, s.vote, s.k, s.unknown_tpr, ids, emb, stats
    )
    out = AddResult(
        ids=ids,
        label=label,
        count=state.gallery.count_of(label),
        gallery_version=seq,
        diagnostics=None if diag is None else LabelDiagnostics.model_validate(asdict(diag)),
    )
    return JSONResponse(
        out.model_dump(), status_code=201, headers={"Location": f"/gallery/items/{ids[0]}"}
    )


@router.get(
    "/labels",
    response_model=LabelsResult,
    summary="Labels with their live item counts, by name (paginated)",
    openapi_extra=access("read"),
)
async def labels(
    state: StateDep,
    limit: Annotated[int, Query(ge=1, le=10000, description="labels per page")] = 1000,
    page_token: LabelCursor = None,
):
    rows = await run_in_threadpool(state.gallery.label_table)  # by name (a lock: not on the loop)
    total, n_labels = sum(r[1] for r in rows), len(rows)
    if page_token is not None:  # the labels after it: stable while labels come and go
        rows = [r for r in rows if r[0] > page_token]
    page = rows[:limit]
    out = []
    for name, count, added in page:
        src = "added" if added == count else ("trained" if added == 0 else "trained+added")
        out.append(LabelInfo(label=name, count=count, source=src))
    nxt = page[-1][0] if len(rows) > limit else None
    return LabelsResult(
        labels=out,
        total=total,
        label_count=n_labels,
        gallery_version=state.gallery.version,
        next_page_token=nxt,
    )


@router.get(
    "/diagnostics",
    response_model=LabelDiagnostics,
    responses={
        404: {"description": "no such label"},
        429: {
            "description": "SNCA_DIAGNOSTICS_CONCURRENCY calls run and as many wait: retry later",
        },
    },
    summary="How a label's images agree and where it sits among the other labels",
    openapi_extra=access("read"),
)
async def label_diagnostics(
    request: Request,
    state: StateDep,
    label: Annotated[str, Query(min_length=1, max_length=1000, description="label name")],
):
    s = state.settings
    name = normalize_label(label)
    key = (name, state.gallery.version)  # the same answer until the gallery changes
    admission = request.app.state.admission
    out = admission.diagnostics_cache.get(key)
    if out is None:
        async with admission.diagnostics_gate.enter():  # (429 too_busy beyond its bound)
            out = admission.diagnostics_cache.get(key)
            if out is None:
                diag = await run_in_threadpool(
                    state.gallery.diagnose, name, s.vote, s.k, s.unknown_tpr
                )
                out = None if diag is None else LabelDiagnostics.model_validate(asdict(diag))
                admission.diagnostics_cache.put(key, out)
    if out is None:
        raise Problem(404, "label_unknown", f"no live items with label {name!r}")
    return out


def _info(r: ItemRow) -> ItemInfo:
    return ItemInfo(
        id=r.id,
        label=r.label,
        source=r.source,
        metadata=r.metadata,
        created_at=r.created_at,
        thumbnail_url=thumbnail_url(r.id) if r.has_thumbnail else None,
    )


@router.get(
    "/items",
    response_model=ItemsPage,
    summary="Live items in id order (of one label), a page at a time",
    openapi_extra=access("read"),
)
async def items(
    state: StateDep,
    label: Annotated[str | None, Query(max_length=1000, description="only this label")] = None,
    limit: Limit = 100,
    page_token: ItemCursor = None,
):
    after_id = int(page_token) if page_token is not None else -1
    lab = normalize_label(label) if label is not None else None
    rows = await run_in_threadpool(state.store.item_rows, after_id, limit + 1, lab)
    nxt = str(rows[limit - 1].id) if len(rows) > limit else None
    return JSONResponse(
        {
            "items": [_info(r).model_dump() for r in rows[:limit]],
            "next_page_token": nxt,
            "gallery_version": state.gallery.version,
        }
    )


@router.get(
    "/items/{item_id}",
    response_model=ItemInfo,
    responses={404: {"description": "no such live item"}},
    summary="One gallery item: label, source, metadata, when added, thumbnail URL",
    openapi_extra=access("read"),
)
async def item(state: StateDep, item_id: ItemId):
    rows = await run_in_threadpool(state.store.item_rows, -1, 1, None, item_id)
    if not rows:
        raise Problem(404, "item_unknown", f"no item {item_id} in the gallery (never, or deleted)")
    # JSONResponse, not the model's serialiser: metadata is plain JSON however it nests
    return JSONResponse(_info(rows[0]).model_dump())


def _delete_route(path: str, summary: str):
    return router.delete(
        path,
        response_model=DeleteResult,
        responses={404: {"description": "nothing to delete"}},
        summary=summary,
        openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
    )


async def _delete(
    request: Request, state, ids: list[int] | None, label: str | None, code: str, what: str
):
    """Delete the live items among `ids`, or of `label`, as the store has them (a replica
    that has not applied an add yet still deletes it); 404 `code` naming `what` when none.
    With an Idempotency-Key, a retry of a delete that was made is answered as it was."""
    asked = ("label", label) if label is not None else ("ids", str(ids))
    done, found = await keyed_write(
        request, state, "delete", asked, lambda keyed: state.delete(ids, label, keyed)
    )
    if found is not None:
        seq, outcome = found
        if not outcome["rows"]:  # (nothing was live then: answered 404 then)
            raise Problem(404, code, f"no {what} in the gallery", headers={REPLAYED: "true"})
        out = DeleteResult(
            deleted=sorted(r[0] for r in outcome["rows"]),
            label=outcome["label"] or outcome["rows"][0][1],
            gallery_version=seq,
        )
        return JSONResponse(out.model_dump(), headers={REPLAYED: "true"})
    rows, seq = done
    if not rows:  # (with a key, that outcome is recorded: a retry is answered 404 too)
        raise Problem(404, code, f"no {what} in the gallery")
    await state.runtime.sync(seq)  # acknowledged once the model votes without them
    return DeleteResult(
        deleted=sorted(r[0] for r in rows), label=label or rows[0][1], gallery_version=seq
    )


@_delete_route("/labels/{label:path}", "Delete every item of a label")
async def delete_label(request: Request, state: StateDep, label: str):
    label = normalize_label(label)
    return await _delete(request, state, None, label, "label_unknown", f"label {label!r}")


@_delete_route("/items/{item_id}", "Delete one item")
async def delete_item(request: Request, state: StateDep, item_id: ItemId):
    return await _delete(request, state, [item_id], None, "item_unknown", f"item {item_id}")


@router.get(
    "/items/{item_id}/thumbnail",
    responses={
        200: {"content": {"image/png": {}, "image/jpeg": {}}, "description": "the thumbnail"},
        304: {"description": "not modified (If-None-Match): the item is still live"},
        404: {"description": "no such live item, or no thumbnail kept"},
    },
    response_class=Response,
    summary="A gallery item's thumbnail (private cache, revalidated: a deleted item's is gone)",
    openapi_extra=access("read"),
)
async def thumbnail(request: Request, state: StateDep, item_id: ItemId):
    data = await run_in_threadpool(state.store.thumbnail, item_id)
    if data is None:
        raise Problem(404, "thumbnail_unknown", f"no thumbnail for item {item_id}")
    etag = f'"t{item_id}"'
    # A thumbnail never changes while its item lives, but the item can be deleted and reads
    # can need the key: only the client's own cache keeps it, and asks again each time
    # (a 304 while the item is live). Never a shared cache, never for a year.
    headers = {"Cache-Control": "private, no-cache", "ETag": etag, "Vary": "X-API-Key"}
    if etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=thumbnail_mime(data), headers=headers)
