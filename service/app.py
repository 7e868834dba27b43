"""create_app(): the FastAPI application with its lifespan, middleware and error handlers."""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from embedding.errors import SNCAError

from .config import Settings
from .deps import KEY_SCHEME
from .embedder import ImageError
from .logs import request_id, setup_logging
from .routes import classify, gallery, ops, page, search
from .schemas import ErrorBody
from .startup import ServiceHost
from .store import StoreUnavailable

log = logging.getLogger("snca.http")

DESCRIPTION = """
Classify images by their neighbours in an embedding gallery (Scalable NCA), register new labels
from a few images at run time, and retrieve similar images.

Writes (`/gallery/*`, `/admin/*`) need the `X-API-Key` header when `SNCA_API_KEY` is set.
Errors are JSON `{"detail": ...}`: 400 undecodable image, 401 API key, 404 unknown label/item,
413 too large, 415 not an image, 422 invalid field, 503 not ready or store not writable.
"""


class BodyTooLarge(Exception):
    pass


class RequestContext:
    """Pure ASGI middleware: request id, body-size limit, timing header, metrics, access log."""

    def __init__(self, app, host: ServiceHost):
        self.app = app
        self.host = host
        # Request ids: a random per-process prefix and a counter (unique, and no syscall per
        # request as uuid4 makes).
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count(1)

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or self._next_id()
        token = request_id.set(rid)
        limit = self.host.settings.max_upload_bytes
        t0 = time.perf_counter()
        status_box = {"code": 500}
        try:
            length = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            length = 0
        if length > limit:
            resp = JSONResponse(
                {"detail": f"request body is {length} bytes; the limit is {limit}"}, status_code=413
            )
            await resp(scope, receive, send)
            self._account(scope, 413, t0)
            request_id.reset(token)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            return msg

        async def send_wrapper(msg):
            if msg["type"] == "http.response.start":
                status_box["code"] = msg["status"]
                ms = (time.perf_counter() - t0) * 1000
                msg.setdefault("headers", [])
                msg["headers"] = [
                    *list(msg["headers"]),
                    (b"x-request-id", rid.encode("latin-1")),
                    (b"x-process-time-ms", f"{ms:.2f}".encode()),
                ]
            await send(msg)

        started = {"yes": False}

        async def send_tracking(msg):
            if msg["type"] == "http.response.start":
                started["yes"] = True
            await send_wrapper(msg)

        try:
            await self.app(scope, limited_receive, send_tracking)
        except Exception:
            # Never a stack trace to the client, never a dropped connection: a bug is logged
            # with the request id and answered as a plain 500.
            log.exception("unhandled error")
            status_box["code"] = 500
            if not started["yes"]:
                resp = JSONResponse(
                    {"detail": f"internal error (request id {rid})"}, status_code=500
                )
                await resp(scope, receive, send_wrapper)
        finally:
            self._account(scope, status_box["code"], t0)
            request_id.reset(token)

    def _account(self, scope, code: int, t0: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        dt = time.perf_counter() - t0
        m = self.host.metrics
        m.requests.labels(path, scope.get("method", ""), str(code)).inc()
        m.latency.labels(path).observe(dt)
        if log.isEnabledFor(logging.DEBUG) or code >= 400:
            log.log(
                logging.INFO if code < 500 else logging.ERROR,
                "request",
                extra={
                    "fields": {
                        "method": scope.get("method"),
                        "path": scope.get("path"),
                        "status": code,
                        "ms": round(dt * 1000, 2),
                    }
                },
            )


def create_app(settings: Settings | None = None, host: ServiceHost | None = None) -> FastAPI:
    """The app for `settings` (default: from SNCA_* variables), started by its lifespan. A
    `host` already opened (as snca-serve does, to report start-up errors before binding the
    port) is used as it is; if its gallery must first be carried to a new model, that runs in
    the background while /readyz reports its progress."""
    if host is None:
        host = ServiceHost(settings or Settings())
    settings = host.settings
    setup_logging(settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        opening = await run_in_threadpool(host.open)
        opening.runtime.batcher.start()  # results go to this event loop
        if host.state is None:
            if opening.plan is None:
                await run_in_threadpool(host.finish)
            else:
                host.finish_in_background()
        try:
            yield
        finally:
            host.phase = "stopping"  # /readyz fails first: load balancers stop sending
            await opening.runtime.batcher.stop()  # in-flight batches finish
            host.stop()

    kw = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # FastAPI >= 0.16x traces every request through OpenTelemetry hooks (tens of us per
        # request even with no provider); /metrics already covers what we need.
        kw["telemetry"] = {
            "tracing": False,
            "metrics": False,
            "logs": False,
            "operation_spans": False,
        }
    app = FastAPI(title="snca", version="0.1.0", description=DESCRIPTION, lifespan=lifespan, **kw)
    app.state.snca = host
    for r in (classify.router, gallery.router, search.router, ops.router, page.router):
        app.include_router(r)
    app.mount("/static", StaticFiles(directory=page.STATIC_DIR), name="static")

    @app.exception_handler(ImageError)
    async def _image_error(request: Request, e: ImageError):
        return JSONResponse({"detail": e.message}, status_code=e.status)

    @app.exception_handler(StoreUnavailable)
    async def _store_error(request: Request, e: StoreUnavailable):
        return JSONResponse(
            {"detail": f"{e}; nothing was changed, reads keep working"}, status_code=503
        )

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return JSONResponse({"detail": str(e)}, status_code=413)

    @app.exception_handler(SNCAError)
    async def _snca_error(request: Request, e: SNCAError):
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path"))
            msgs.append(f"{loc or 'request'}: {err.get('msg')}")
        return JSONResponse({"detail": "; ".join(msgs) or "invalid request"}, status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return JSONResponse({"detail": e.detail}, status_code=e.status_code, headers=e.headers)

    app.add_middleware(RequestContext, host=host)
    _document_errors_as_sent(app)
    return app


def _document_errors_as_sent(app: FastAPI) -> None:
    """Every error, 422 included, is sent as {"detail": "..."} (the handlers above); FastAPI's
    generated schema documents 422 as its own list-of-errors model. Rewrite those entries so the
    published schema matches what clients receive (schemathesis checks it)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.setdefault("ErrorBody", ErrorBody.model_json_schema())
        schema["components"]["securitySchemes"] = KEY_SCHEME
        for path_ops in schema.get("paths", {}).values():
            for op in path_ops.values():
                r422 = op.get("responses", {}).get("422")
                if r422 is not None:
                    r422["description"] = "invalid field (the message names it)"
                    r422["content"] = {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                    }
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
