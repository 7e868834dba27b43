"""GET and POST /admin/learn (issue 52): `snca-gallery learn` as one background job of the
service (service/learn_job.py: one at a time per data dir, low priority), what it is doing, and
how many items the served model has not learned from."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from service import learn_job
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.problems import Problem
from service.store import StoreUnavailable

router = APIRouter(tags=["ops"], route_class=GuardedRoute)


async def _status(state) -> dict:
    out = await run_in_threadpool(learn_job.status, state.settings)
    with contextlib.suppress(StoreUnavailable):
        items, at = await run_in_threadpool(state.unlearned)
        out["unlearned"] = {"items": items, "gallery_version": at}
    return out


@router.get(
    "/admin/learn",
    summary="The learn job: running or not, its last output lines, items not learned from",
    openapi_extra=access("read"),
)
async def learn_status(state: StateDep):
    return await _status(state)


@router.post(
    "/admin/learn",
    status_code=202,
    responses={409: {"description": "a learn runs already on this data dir"}},
    summary="Start snca-gallery learn in the background: retrain on the gallery, switch when "
    "not worse (GET /admin/learn follows it)",
    openapi_extra=access("write"),
)
async def learn_start(state: StateDep):
    now = await run_in_threadpool(learn_job.busy, state.settings.data_dir)
    if now is not None:
        raise Problem(
            409,
            "learn_running",
            f"a learn runs already (process {now.get('pid', '?')}): GET /admin/learn follows it",
        )
    await run_in_threadpool(learn_job.start, state.settings)
    return JSONResponse(await _status(state), status_code=202)
