"""Dependencies as Annotated aliases (full-stack-fastapi-template style), and the one access
check every route goes through (GuardedRoute), before its body is read."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from service.http.keys import KeyRing
from service.http.problems import Problem
from service.http.waits import ClientGone
from service.startup import ServiceHost
from service.state import ServiceState

# public: never a key; read: a key when reads are protected; private: reads of what callers
# sent (the review queue's stored queries): a key of either scope whenever any key is
# configured, protected reads or not; write: a write key when keys are configured
Access = Literal["public", "read", "private", "write"]
ACCESS_KEY = "x-snca-access"  # the OpenAPI extension that carries a route's access level
KEY_HEADER = "X-API-Key"
KEY_SCHEME = {
    "APIKeyHeader": {
        "type": "apiKey",
        "in": "header",
        "name": KEY_HEADER,
        "description": "a key of scope `write` (SNCA_API_KEY, or `write:` in SNCA_API_KEYS) "
        "for every route; of scope `read` for the read routes only (a write route answers it "
        "403 insufficient_scope). Read routes need a key when SNCA_PROTECT_READS is set or a "
        "read key is configured; the review queue's (stored queries of other callers) "
        "whenever any key is configured.",
    }
}


def access(level: Access, **openapi: object) -> dict:
    """openapi_extra of a route with this access level: `write` needs a write key when keys
    are configured, `private` a read or write key when keys are configured, `read` a read or
    write key when reads are protected, `public` never."""
    return {ACCESS_KEY: level, **openapi}


def keys_of(request: Request) -> KeyRing:
    return request.app.state.keys


def same_origin(request: Request) -> bool:
    """Not a browser request from another web origin. Browsers send Sec-Fetch-Site (or at
    least Origin) with every form POST; clients that are not browsers send neither."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is None or origin.partition("://")[2] == request.headers.get("host", "")


def check_access(request: Request, level: Access) -> None:
    """401 unless the request may use a route of `level`; 403 for a read key on a write
    route (constant-time key compare, keys.py). With no key configured, writes are refused
    (403) from another web origin: any page the user visits could otherwise post a form to the
    service on their loopback (CSRF)."""
    keys = keys_of(request)
    if not keys.needs_key(level):
        if level == "write" and not keys.enabled and not same_origin(request):
            raise Problem(
                403,
                "cross_origin_write",
                "writes without an API key are accepted only from this server's own page "
                f"(origin {request.headers.get('origin', '?')}); set SNCA_API_KEY for other clients",
            )
        return
    key = request.headers.get(KEY_HEADER)
    scope = keys.scope(key)
    if scope is None:
        raise Problem(
            401,
            "unauthorized",
            f"missing or wrong API key (header {KEY_HEADER})"
            if key
            else f"this route needs the API key (header {KEY_HEADER})",
            headers={"WWW-Authenticate": KEY_HEADER},
        )
    if level == "write" and scope != "write":
        raise Problem(
            403,
            "insufficient_scope",
            "this API key may only read; this route changes the gallery and needs a key of "
            "scope write",
        )


def scope_of(request: Request) -> str:
    """What this request's key may do, as the page shows it: write, read or none (no key
    needed for a level counts as allowed)."""
    keys = keys_of(request)
    scope = keys.scope(request.headers.get(KEY_HEADER))
    if scope is not None:
        return scope
    if not keys.needs_key("write"):
        return "write"
    return "read" if not keys.needs_key("read") else "none"


def may_read(request: Request) -> bool:
    """Whether this request may see what read routes show (no key needed for reads, or a key
    of either scope given): /readyz, public for load balancers, shows its details only then."""
    keys = keys_of(request)
    return not keys.needs_key("read") or keys.scope(request.headers.get(KEY_HEADER)) is not None


def _query_names(dependant) -> set[str]:
    """The query parameters FastAPI reads for a route, its dependencies' included."""
    names, stack = set(), [dependant]
    while stack:
        d = stack.pop()
        names |= {p.alias for p in d.query_params}
        stack.extend(d.dependencies)
    return names


class GuardedRoute(APIRoute):
    """The route class of every router: the access check runs first, before FastAPI reads the
    body or solves the route's dependencies (a form is never parsed for a request without
    the key)."""

    def __init__(self, path: str, endpoint, **kwargs):
        extra = dict(kwargs.get("openapi_extra") or {})
        self.access: Access = extra.get(ACCESS_KEY, "public")
        kwargs["openapi_extra"] = extra or None
        super().__init__(path, endpoint, **kwargs)
        # the query parameters it takes: FastAPI's, and those a route documents itself
        names = _query_names(self.dependant)
        names |= {p["name"] for p in extra.get("parameters", ()) if p.get("in") == "query"}
        self.query_names = frozenset(names)

    def get_route_handler(self):
        handler, guard = super().get_route_handler(), self.guard

        async def guarded(request: Request):
            await guard(request)
            return await handler(request)

        return guarded

    async def guard(self, request: Request) -> None:
        """What every request of this route passes first: the key, no unknown query
        parameter, X-Min-Gallery-Version (service/http/lean.py calls it too)."""
        level = self.access
        check_access(request, level)
        names = self.query_names
        # (no query string, the usual /classify: nothing to parse)
        unknown = request.scope.get("query_string") and request.query_params.keys() - names
        if unknown:
            takes = ", ".join(sorted(names)) or "none"
            raise Problem(
                422,
                "unknown_parameter",
                f"unknown query parameters: {', '.join(sorted(unknown))} (this route takes "
                f"{takes})",
            )
        min_version = request.headers.get(MIN_VERSION_HEADER)
        if min_version is not None and level != "public":  # (health, metrics: never)
            await wait_for_version(request, min_version)


MIN_VERSION_HEADER = "X-Min-Gallery-Version"


async def wait_for_version(request: Request, value: str) -> None:
    """Read-your-writes across replicas: hold the request until this replica has applied write
    `value` (a `gallery_version` another replica answered), at most SNCA_MIN_VERSION_WAIT_S;
    then 503 + Retry-After. A version no write has reached yet is refused at once (422
    `version_unknown`); a parked request awaits a future (service/http/waits.py), ends when its
    client goes, and counts against SNCA_MAX_PARKED(_PER_CLIENT) (429)."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise Problem(
            422,
            "header_invalid",
            f"{MIN_VERSION_HEADER} must be a gallery_version: a non-negative integer, not "
            f"{value[:40]!r}",
        )
    host: ServiceHost = request.app.state.snca
    if not host.ready:
        return  # the route answers 503 not_ready itself
    state, want = host.state, int(value)
    if state.gallery.version >= want:
        return
    # Written and acknowledged somewhere means committed to the store: a version past the
    # store's last write was never answered by any replica
    head = await run_in_threadpool(state.store.last_seq)
    if want > head:
        raise Problem(
            422,
            "version_unknown",
            f"no write has gallery_version {want} yet: the gallery store's last write is "
            f"{head} ({MIN_VERSION_HEADER} takes a gallery_version an answer carried)",
        )
    s = state.settings
    client = (request.scope.get("client") or ("?",))[0]
    receive = request._receive
    waits = request.app.state.admission.waits
    with waits.admitted(client):
        try:
            reached, body = await waits.wait(
                want, lambda: state.gallery.version, s.min_version_wait_s, receive
            )
        except ClientGone:
            raise Problem(499, "client_gone", "the client closed the connection") from None
    if body:  # what the route reads next: the body read while parked, then the rest
        pending = list(body)

        async def replay():
            return pending.pop(0) if pending else await receive()

        request._receive = replay
    if not reached:
        raise Problem(
            503,
            "version_not_applied",
            f"this replica is at gallery_version {state.gallery.version}, not yet at "
            f"{want} ({MIN_VERSION_HEADER}) after {s.min_version_wait_s:g} s",
            headers={"Retry-After": "1"},
        )


def ready_state(request: Request) -> ServiceState:
    """The ServiceState, or 503 (with what start-up is doing) while there is none."""
    host: ServiceHost = request.app.state.snca
    if not host.ready:
        raise Problem(503, "not_ready", host.status(), headers={"Retry-After": "5"})
    return host.state


# Dependencies are `async def`: FastAPI runs plain `def` ones in a worker thread, a thread hop
# per dependency per request (a third of the event loop's time for 28x28 classify).
async def get_state(request: Request) -> ServiceState:
    return ready_state(request)


StateDep = Annotated[ServiceState, Depends(get_state)]
