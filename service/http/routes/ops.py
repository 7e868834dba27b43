"""GET /healthz, /readyz, /metrics; POST /admin/snapshot."""

from __future__ import annotations

import contextlib
import os
import socket

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from service.http.deps import GuardedRoute, StateDep, access, may_read, scope_of
from service.http.encode import JSONResponse
from service.http.problems import Problem
from service.http.schemas import SnapshotResult
from service.store import StoreUnavailable

router = APIRouter(tags=["operations"], route_class=GuardedRoute)


@router.get("/healthz", summary="The process is alive")
async def healthz():
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Model and index loaded, store writable",
    responses={
        503: {
            "description": "starting, migrating, stopping, or the store is not writable "
            "(the body says which)",
            "content": {"application/json": {}},
        }
    },
)
async def readyz(request: Request):
    host = request.app.state.snca
    if not host.ready:
        body = {"status": host.phase, "detail": host.status()}  # (a status, not a problem)
        if host.phase == "migrating":
            body["migrated"], body["total"] = host.progress
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    state = host.state
    model_down = state.runtime.problem()  # the model process restarting
    writable = state.store_writable()
    status = "ready" if writable and model_down is None else "degraded"
    if state.standby is not None:  # another model's gallery is live: take no traffic
        status = "standby"
    code = 200 if status == "ready" else 503
    if not may_read(request):  # SNCA_PROTECT_READS without the key: the status only
        body = {"status": status, "store_writable": writable, "access": scope_of(request)}
        return JSONResponse(body, status_code=code)
    body = {
        "status": status,
        "access": scope_of(request),  # what this request's key may do: write, read, none
        "model_fingerprint": state.fingerprint,
        "items": state.gallery.size(),
        "gallery_version": state.gallery.version,
        "gallery_checksum": state.gallery.cached_checksum()
        or await run_in_threadpool(state.gallery.checksum),
        "pid": os.getpid(),
        "model_pid": state.runtime.pid(),  # the model process (or this one: --no-model-process)
        **({"model_process": c} if (c := state.runtime.counters()) else {}),
        "hostname": socket.gethostname(),  # which replica answered (behind a load balancer)
        "store_writable": writable,
        "data_dir": str(state.data.path),
        # dense: every row kept and voted over; candidates: past SNCA_EXACT_VOTE_MAX
        "vote_path": "dense" if state.gallery.rows.dense else "candidates",
        # what runs the forward (SNCA_ENGINE) and why: auto's timings, or why torch serves
        **_engine(state.runtime.info),
        # the world check (is this the kind of image a label holds): off for an index dir
        # built before it, or with SNCA_WORLD_TPR=0
        "world_check": state.gallery.worlds.enabled,
    }
    if state.migration is not None:
        body["migration"] = state.migration.to_dict()
    with contextlib.suppress(StoreUnavailable):  # (what snca-gallery learn would teach it)
        unlearned, at = await run_in_threadpool(state.unlearned)
        body["unlearned"] = {"items": unlearned, "gallery_version": at}
    body["store"] = state.store.url
    if state.rebuilds:
        body["rebuilds"] = state.rebuilds
    review = request.app.state.review
    if review is not None:  # what this front's review queue writer did (service/review/)
        body["review"] = {
            "queued": review.queued,
            "dropped": review.dropped,
            "pruned": review.pruned,
            "error": review.error,
        }
    if not writable:
        body["store_error"] = state.store_problem() or "the store cannot be written"
    if model_down is not None:
        body["model_error"] = model_down
    return JSONResponse(
        body, status_code=code, headers={"Retry-After": "1"} if code != 200 else None
    )


def _engine(info) -> dict:
    if info is None:
        return {}
    return {"engine": info.engine, "engine_note": info.engine_note}


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
)
async def metrics(request: Request):
    body, ctype = request.app.state.snca.metrics.render()
    return Response(body, media_type=ctype)


@router.post(
    "/admin/snapshot",
    response_model=SnapshotResult,
    summary="Write an index snapshot now",
    responses={503: {"description": "the snapshot cannot be written"}},
    openapi_extra=access("write"),
)
async def snapshot(state: StateDep):
    try:
        seq, path = await run_in_threadpool(state.snapshot)
    except OSError as e:
        raise Problem(503, "snapshot_failed", f"the snapshot could not be written: {e}") from None
    return SnapshotResult(seq=seq, path=str(path))
