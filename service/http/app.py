"""create_app(): the FastAPI application with its lifespan, middleware and error handlers."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from embedding.errors import SNCAError
from service.config import Settings
from service.gallery.labels import LabelInvalid
from service.http import openapi, problems
from service.http.admission import Admission
from service.http.keys import KeyRing
from service.http.lean import Lean
from service.http.problems import Problem
from service.http.routes import (
    classify,
    corrections,
    gallery,
    learning,
    ops,
    page,
    review,
    search,
    suggestions,
)
from service.logs import request_id, setup_logging
from service.model.embedder import ImageError
from service.model.wire import ModelUnavailable
from service.review.queue import ReviewQueue
from service.startup import ServiceHost
from service.store import StoreUnavailable
from service.store.records import WriteNotApplied

log = logging.getLogger("snca.http")

DESCRIPTION = """
Classify images by their neighbours in an embedding gallery (Scalable NCA), register new labels
from a few images at run time, and retrieve similar images.

Writes (`/gallery/add`, deletes, `/admin/*`) need an `X-API-Key` of scope `write` when keys
are configured (`SNCA_API_KEY`, `SNCA_API_KEYS`, `SNCA_API_KEYS_FILE`); a key of scope `read`
may use every read route and gets 403 `insufficient_scope` on writes (reads need a key when a
read key is configured, or with `SNCA_PROTECT_READS`). Without any key, writes are accepted only
from this server's own page, not from other web origins. Every error is RFC 9457 problem details
(`application/problem+json`) with a stable `code` (docs/serving.md, "Errors").
"""

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Sent with every response; the page also gets PAGE_HEADERS (routes/page.py).
ALWAYS = [(b"x-content-type-options", b"nosniff")]


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


def allowed_hosts(settings: Settings) -> frozenset[str] | None:
    """Host header names this server answers to (None: any, only with SNCA_ALLOWED_HOSTS=*).
    A web page whose DNS name is re-pointed at this server (DNS rebinding) sends its own name
    and is refused. Default: the loopback names, and when bound beyond loopback also this
    host's own names and addresses (what a client reaching it directly, a container's health
    check, or a balancer forwarding those sends); any other name must be listed."""
    if settings.allowed_hosts is not None and settings.allowed_hosts.strip():
        names = {h.strip().lower() for h in settings.allowed_hosts.split(",") if h.strip()}
        return None if "*" in names else frozenset(names)
    if settings.host in LOOPBACK:
        return frozenset(LOOPBACK)
    return frozenset(LOOPBACK | own_names(settings.host))


def own_names(bound: str) -> set[str]:
    """This host's name, fully qualified name and addresses (and the address bound, unless a
    wildcard)."""
    import socket

    names = set()
    if bound not in ("0.0.0.0", "::", ""):
        names.add(bound.lower())
    try:
        host = socket.gethostname()
        names |= {host.lower(), socket.getfqdn().lower()}
        for info in socket.getaddrinfo(host, None):
            names.add(str(info[4][0]).lower())
    except OSError:
        pass
    return {n for n in names if n}


def host_name(header: bytes) -> str:
    """The name in a Host header, port removed ("[::1]:8000" -> "::1")."""
    h = header.decode("latin-1").strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def route_label(scope) -> str:
    """The metrics label of a request: the route's path template; the path itself for the
    fixed routes FastAPI adds (/docs, /openapi.json), "/static" for any static file, and
    "unmatched" for anything else (a client cannot grow the label set)."""
    route = scope.get("route")
    if route is not None:
        return route.path
    if scope.get("endpoint") is None:
        return "unmatched"
    path = scope.get("path", "")
    for prefix in ("/static/", "/docs-assets/"):
        if path.startswith(prefix):
            return prefix.rstrip("/")
    return path


class RequestContext:
    """Pure ASGI middleware: request id, Host check, body size and time limits, timing and
    security headers, metrics, access log; a bug becomes a 500 problem, never a stack trace."""

    def __init__(self, app, host: ServiceHost, lean: Lean):
        self.app = app
        self.host = host
        self.hosts = allowed_hosts(host.settings)
        self.lean = lean  # the hot routes, called without the router (service/http/lean.py)
        # Request ids: a random per-process prefix and a counter (unique, and no syscall per
        # request as uuid4 makes).
        self._prefix = os.urandom(4).hex()
        self._counter = itertools.count(1)

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"

    async def _refuse(self, scope, receive, send, t0, status, code, detail, headers=None):
        await problems.response(status, code, detail, headers)(scope, receive, send)
        self._account(scope, status, t0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or self._next_id()
        token = request_id.set(rid)
        settings = self.host.settings
        limit = settings.max_upload_bytes
        t0 = time.perf_counter()
        status_box = {"code": 500}

        started = False

        async def send_wrapper(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
                status_box["code"] = msg["status"]
                ms = (time.perf_counter() - t0) * 1000
                msg["headers"] = [
                    *msg.get("headers", ()),
                    (b"x-request-id", rid.encode("latin-1")),
                    (b"x-process-time-ms", f"{ms:.2f}".encode()),
                    *ALWAYS,
                ]
            await send(msg)

        try:
            host = headers.get(b"host")
            if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
                return await self._refuse(
                    scope,
                    receive,
                    send_wrapper,
                    t0,
                    400,
                    "host_not_allowed",
                    f"this server does not answer to Host {host.decode('latin-1')[:100]!r} "
                    "(SNCA_ALLOWED_HOSTS)",
                )
            try:
                length = int(headers.get(b"content-length", b"0") or 0)
            except ValueError:
                length = 0
            if length > limit:
                return await self._refuse(
                    scope,
                    receive,
                    send_wrapper,
                    t0,
                    413,
                    "request_too_large",
                    f"request body is {length} bytes; the limit is {limit}",
                )
            seen = 0
            deadline = asyncio.get_running_loop().time() + settings.body_timeout_s

            async def limited_receive():
                nonlocal seen
                try:
                    async with asyncio.timeout_at(deadline):
                        msg = await receive()
                except TimeoutError:
                    raise BodyTimeout(
                        f"the request body did not arrive within {settings.body_timeout_s:g} s "
                        "(SNCA_BODY_TIMEOUT_S)"
                    ) from None
                if msg["type"] == "http.request":
                    seen += len(msg.get("body", b""))
                    if seen > limit:
                        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
                return msg

            try:
                route = self.lean.find(scope)
                if route is not None:
                    await self.lean(route, scope, limited_receive, send_wrapper)
                else:
                    await self.app(scope, limited_receive, send_wrapper)
            except Exception:
                # Never a stack trace to the client, never a dropped connection: a bug is
                # logged with the request id and answered as a 500 problem.
                log.exception("unhandled error")
                status_box["code"] = 500
                if not started:
                    await problems.response(
                        500, "internal_error", f"internal error (request id {rid})"
                    )(scope, receive, send_wrapper)
            self._account(scope, status_box["code"], t0)
        finally:
            request_id.reset(token)

    def _account(self, scope, code: int, t0: float) -> None:
        path = route_label(scope)
        dt = time.perf_counter() - t0
        m = self.host.metrics
        m.requests.labels(path, scope.get("method", ""), str(code)).inc()
        m.latency.labels(path).observe(dt)
        if log.isEnabledFor(logging.DEBUG) or code >= 400:
            # a 503 is the service saying "not now" (not ready, a version not applied, the
            # store down: each logged where it is found), not a failure of the request's own
            level = (
                logging.INFO if code < 500 else logging.WARNING if code == 503 else logging.ERROR
            )
            log.log(
                level,
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


class SNCA(FastAPI):
    """FastAPI with `RequestContext` outside its own layers: an HTTP request goes to the context
    first (which calls the hot routes itself, service/http/lean.py, and everything else through
    FastAPI's whole stack: telemetry, its body limit, the exception and exit-stack middleware,
    the router); FastAPI's error middleware, telemetry and body-limit layers cost ~5 % of the
    front's CPU on a small /classify (docs/PERFORMANCE.md) and the context already answers a bug
    with a 500 problem and bounds the body. Lifespan and other scopes go to FastAPI as before."""

    context: RequestContext | None = None  # set by create_app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.context is not None:
            scope["app"] = self  # (what Starlette sets: request.app, the exception handlers)
            await self.context(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def framework(self, scope, receive, send) -> None:
        """The request through FastAPI's own stack (the context's inner app)."""
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None, host: ServiceHost | None = None) -> FastAPI:
    """The app for `settings` (default: from SNCA_* variables), started by its lifespan. A
    `host` already opened (as snca-serve does, to report start-up errors before binding the
    port) is used as it is; if its gallery must first be carried to a new model, that runs in
    the background while /readyz reports its progress."""
    if host is None:
        settings = settings or Settings()
        host = ServiceHost(settings, model="process" if settings.model_process else "thread")
    settings = host.settings
    setup_logging(settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        opening = await run_in_threadpool(host.open)
        opening.runtime.start()  # results go to this event loop
        if host.state is None:
            if opening.migrating is None:
                await run_in_threadpool(host.finish)
            else:
                host.finish_in_background()
        try:
            yield
        finally:
            host.phase = "stopping"  # /readyz fails first: load balancers stop sending
            await opening.runtime.stop()  # in-flight batches finish
            if app.state.review is not None:  # (what it was handed, written)
                await run_in_threadpool(app.state.review.close)
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
    app = SNCA(
        title="snca",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # page.router serves /docs with local assets (no CDN)
        redoc_url=None,
        **kw,
    )
    app.state.snca = host
    app.state.admission = admission = Admission(settings, host.metrics)
    host.on_ready.append(admission.attach)
    app.state.review = None  # the review queue (service/review/), once the gallery is open
    app.state.keys = KeyRing.from_settings(settings)  # (cli checked it before binding the port)

    def open_review(state) -> None:
        if settings.review_queue and app.state.review is None:
            store_of = lambda: host.state.store  # noqa: E731 (a migration replaces it)
            app.state.review = ReviewQueue(store_of, settings, state.runtime.embedder.dim)
            if not app.state.keys.enabled:
                log.warning(
                    "the review queue keeps the queries it could not name (thumbnails%s) and, "
                    "with no API key set, anyone who can reach the service can see them "
                    "(GET /review): set SNCA_API_KEY (or SNCA_API_KEYS) to need a key",
                    " and uploads" if settings.review_keep_images else "",
                )

    host.on_ready.append(open_review)
    if host.state is not None:  # (opened and finished before the app: snca-serve)
        admission.attach(host.state)
        open_review(host.state)
    routers = (classify, gallery, corrections, suggestions, review, search, ops, learning, page)
    for r in (m.router for m in routers):
        app.include_router(r)
    app.mount("/static", StaticFiles(directory=page.STATIC_DIR), name="static")
    app.mount("/docs-assets", StaticFiles(directory=page.docs_assets()), name="docs-assets")

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        # FastAPI's error middleware (inside RequestContext) answers with this and re-raises;
        # the context logs it (the same answer as one it makes itself: `internal_error`)
        return problems.response(
            500, "internal_error", f"internal error (request id {request_id.get()})"
        )

    @app.exception_handler(Problem)
    async def _problem(request: Request, e: Problem):
        return problems.response(e.status, e.code, e.detail, e.headers, e.extra)

    @app.exception_handler(WriteNotApplied)
    async def _not_applied(request: Request, e: WriteNotApplied):
        extra = {"committed": True, "gallery_version": e.seq}
        return problems.response(503, "write_not_applied", str(e), {"Retry-After": "1"}, extra)

    @app.exception_handler(LabelInvalid)
    async def _label_invalid(request: Request, e: LabelInvalid):
        return problems.response(422, "label_invalid", str(e))

    @app.exception_handler(ImageError)
    async def _image_error(request: Request, e: ImageError):
        return problems.response(e.status, e.code, e.message)

    @app.exception_handler(ModelUnavailable)
    async def _model_down(request: Request, e: ModelUnavailable):
        detail = f"{e}; retry shortly (nothing was changed)"
        extra = {"committed": False}
        headers = {"Retry-After": str(e.retry_after)}  # (model_unavailable, model_busy)
        return problems.response(503, e.code, detail, headers, extra)

    @app.exception_handler(StoreUnavailable)
    async def _store_error(request: Request, e: StoreUnavailable):
        if e.committed is None:  # (the one case a write cannot say what happened)
            detail = (
                f"{e}; the write may have been committed: retry it with the same "
                "Idempotency-Key to learn its outcome (reads keep working)"
            )
        else:
            detail = f"{e}; nothing was changed, reads keep working"
        extra = {"committed": e.committed}
        return problems.response(503, "store_unavailable", detail, {"Retry-After": "5"}, extra)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return problems.response(413, "request_too_large", str(e), {"Connection": "close"})

    @app.exception_handler(BodyTimeout)
    async def _slow_body(request: Request, e: BodyTimeout):
        return problems.response(408, "request_timeout", str(e), {"Connection": "close"})

    @app.exception_handler(SNCAError)
    async def _snca_error(request: Request, e: SNCAError):
        return problems.response(400, "bad_request", str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path"))
            msgs.append(f"{loc or 'request'}: {err.get('msg')}")
        return problems.response(422, "validation_error", "; ".join(msgs) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        # the framework's own: 404 no route, 405 method, 400 unparsable body
        headers = e.headers
        if e.status_code == 405:  # Allow: every method of the path, not one route's
            methods = set()
            for r in request.app.router.routes:
                if getattr(r, "methods", None) and r.matches(request.scope)[0] != Match.NONE:
                    methods |= r.methods
            headers = {**(headers or {}), "Allow": ", ".join(sorted(methods))}
        return problems.response(e.status_code, None, str(e.detail), headers)

    app.context = RequestContext(app.framework, host=host, lean=Lean(m.router for m in routers))
    openapi.install(app, settings)
    return app
