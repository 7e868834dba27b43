"""POST /classify and /classify/batch."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool

from embedding.votes import VOTES
from service.gallery.labels import normalize_label
from service.gallery.query import VoteQuery
from service.http.deps import GuardedRoute, access, ready_state
from service.http.encode import JSONResponse
from service.http.inputs import ERRORS, IMAGE_BODY, check_labels, read_uploads
from service.http.schemas import BatchResult, ClassifyResult
from service.http.urls import thumbnail_url
from service.model.runtime import Answer
from service.state import ServiceState

router = APIRouter(tags=["classify"], route_class=GuardedRoute)


class ClassifyQuery(BaseModel):
    """Query parameters of /classify and /classify/batch."""

    model_config = ConfigDict(extra="ignore")

    k: int | None = Field(None, ge=1, le=1000, description="neighbours that vote (default SNCA_K)")
    vote: Literal[VOTES] | None = Field(  # every rule of embedding.votes.RULES
        None,
        description="voting rule (default SNCA_VOTE): knn (the paper's), prototype, "
        "kde (density-aware, equal label priors), kde_shrunk (kde with a prior of a few "
        "pseudo-items from the whole gallery, the default)",
    )
    neighbors: bool = Field(False, description="include the k nearest gallery items")
    labels: list[str] | None = Field(
        None, description="only consider these labels (repeat the parameter)"
    )
    unknown: Literal["on", "off"] = Field(
        "on", description="off: never flag unknown (the calibrated rule and the fixed floors)"
    )
    unknown_tpr: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="the calibrated rule's acceptance rate of the gallery's own kind for this "
        "request (default SNCA_UNKNOWN_TPR): higher flags fewer images unknown",
    )


# These routes are the hot path: the query is validated by one compiled pydantic model rather
# than FastAPI's per-parameter machinery and dependencies (~100 us of ~500 us per request for
# a 28x28 image, docs/PERFORMANCE.md). The same model documents the parameters in OpenAPI.
_QUERY = TypeAdapter(ClassifyQuery)
# A request with no query string (most) takes every default: validated once, not per request
# (the parse and the validation were ~4 % of the front's CPU for a 28x28 /classify)
_DEFAULTS = _QUERY.validate_python({}, strict=False)


def _docs(field: str, many: bool) -> dict:
    """OpenAPI for a route that reads its multipart body itself (service/http/multipart.py)."""
    binary = {"type": "string", "format": "binary", "minLength": 1}
    desc = (
        "1 to SNCA_MAX_IMAGES_PER_REQUEST images"
        if many
        else "PNG, JPEG, WebP, BMP, TIFF or GIF; grey or colour"
    )
    prop = {"type": "array", "items": binary, "minItems": 1} if many else binary
    return access(
        "read",
        **_QUERY_DOCS,
        requestBody={
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": [field],
                        "properties": {field: {**prop, "description": desc}},
                        "additionalProperties": False,
                    }
                },
                **({} if many else IMAGE_BODY),
            },
        },
    )


_QUERY_DOCS = {
    "parameters": [
        {
            "name": name,
            "in": "query",
            "required": False,
            "description": f.description,
            "schema": ClassifyQuery.model_json_schema()["properties"][name],
            **({"style": "form", "explode": True} if name == "labels" else {}),
        }
        for name, f in ClassifyQuery.model_fields.items()
    ],
    "security": [{}, {"APIKeyHeader": []}],  # the key only with SNCA_PROTECT_READS
}


def read_query(request: Request) -> tuple[ServiceState, VoteQuery, float | None]:
    """The ready state (503 otherwise) and the validated query (422 in FastAPI's own error
    format otherwise) with the defaults applied: (state, the vote's parameters (the labels
    filter as a sorted tuple or None; 404 for an unknown label), the open-set acceptance rate:
    None for unknown=off)."""
    state = ready_state(request)
    q = _query(request) if request.scope.get("query_string") else _DEFAULTS
    labels = q.labels
    if labels is not None:
        labels = tuple(sorted({normalize_label(lab) for lab in labels} - {""}))
        check_labels(state, labels)
    s = state.settings
    # None: no unknown at all; 0: the fixed floors only (SNCA_UNKNOWN_TPR=0)
    tpr = None if q.unknown == "off" else (q.unknown_tpr or s.unknown_tpr)
    return state, VoteQuery(q.vote or s.vote, q.k or s.k, labels, q.neighbors), tpr


def _query(request: Request) -> ClassifyQuery:
    """The request's query parameters validated (422 in FastAPI's own error format)."""
    qp = request.query_params
    raw = {k: v for k, v in qp.items() if k != "labels"}
    if "labels" in qp:
        raw["labels"] = qp.getlist("labels")
    try:
        return _QUERY.validate_python(raw, strict=False)
    except ValidationError as e:
        errs = [{**err, "loc": ("query", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errs) from None


async def add_thumbnail_urls(state: ServiceState, results: list[dict]) -> None:
    """Give each neighbour that has a thumbnail in the store its URL (one store query)."""
    ids = [n["id"] for r in results for n in r.get("neighbors", ())]
    if not ids:
        return
    have = await run_in_threadpool(state.store.with_thumbnails, ids)
    for r in results:
        for n in r.get("neighbors", ()):
            n["thumbnail_url"] = thumbnail_url(n["id"]) if n["id"] in have else None


def result(
    state: ServiceState,
    a: Answer,
    vote: str,
    k: int,
    neighbors: bool,
    tpr: float | None,
) -> dict:
    """A ClassifyResult as a plain dict (Answer.result): routes return it in a JSONResponse,
    skipping FastAPI's validate-and-serialise pass (a quarter of the per-request CPU for 28x28
    images). The route tests check every response against the ClassifyResult schema."""
    return a.result(state.fingerprint, state.settings, vote, k, neighbors, tpr)


async def answers(
    state: ServiceState, prepared: list, query: VoteQuery, tpr: float | None, review=None
) -> list[dict]:
    """Classify prepared uploads (by the model thread or the model process: runtime.answers)
    -> ClassifyResult dicts, in order, with the metrics counted and the neighbours' thumbnail
    URLs when asked; `tpr`: the open-set acceptance rate (None: unknown=off). `review`: the
    review queue (service/review/), handed the answers it keeps."""
    got = await state.runtime.answers(prepared, query, tpr)
    if review is not None and query.labels is None:  # (a filtered vote is no verdict on it)
        review.offer(got, prepared)
    vote_name, k, neighbors = query.vote, query.k, query.neighbors
    state.metrics.classified.labels(vote_name).inc(len(got))
    out = [result(state, a, vote_name, k, neighbors, tpr) for a in got]
    unknown = sum(r["unknown"] for r in out)
    if unknown:
        state.metrics.unknown.inc(unknown)
    if neighbors:
        await add_thumbnail_urls(state, out)
    return out


def _classify_route(path: str, model: type, field: str):
    """router.post for a classify route reading multipart `field` ("images": several); its
    docstring's first line is the summary."""

    def register(fn):
        return router.post(
            path,
            response_model=model,
            responses=ERRORS,
            response_model_exclude_none=True,
            summary=fn.__doc__.strip().splitlines()[0],
            openapi_extra=_docs(field, many=field == "images"),
        )(fn)

    return register


@_classify_route("/classify", ClassifyResult, "image")
async def classify(request: Request):
    """Classify one image by its neighbours in the gallery"""
    state, query, tpr = read_query(request)
    data = await read_uploads(request, "image", 1)
    prepared = await state.runtime.prepare_queries(data, ["image"])
    (r,) = await answers(state, prepared, query, tpr, request.app.state.review)
    return JSONResponse(r)


@_classify_route("/classify/batch", BatchResult, "images")
async def classify_batch(request: Request):
    """Classify several images; one result per image, in order"""
    state, query, tpr = read_query(request)
    limit = state.settings.max_images_per_request
    datas = await read_uploads(request, "images", limit)
    names = [f"images[{i}]" for i in range(len(datas))]
    prepared = await state.runtime.prepare_queries(datas, names)
    review = request.app.state.review
    return JSONResponse({"results": await answers(state, prepared, query, tpr, review)})
