"""Dependencies as Annotated aliases (full-stack-fastapi-template style), and the one access
check every route goes through (GuardedRoute), before its body is read."""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request
from fastapi.routing import APIRoute

from .startup import ServiceHost
from .state import ServiceState

Access = Literal["public", "read", "write"]
ACCESS_KEY = "x-snca-access"  # the OpenAPI extension that carries a route's access level
KEY_HEADER = "X-API-Key"
KEY_SCHEME = {
    "APIKeyHeader": {
        "type": "apiKey",
        "in": "header",
        "name": KEY_HEADER,
        "description": "required when SNCA_API_KEY is set (on reads only with SNCA_PROTECT_READS)",
    }
}


def access(level: Access, **openapi: object) -> dict:
    """openapi_extra of a route with this access level: `write` needs the API key when one is
    set, `read` only with SNCA_PROTECT_READS, `public` never."""
    return {ACCESS_KEY: level, **openapi}


def check_access(request: Request, level: Access) -> None:
    """401 unless the request may use a route of `level` (constant-time key compare)."""
    settings = request.app.state.snca.settings
    expected = settings.api_key
    if expected is None or level == "public" or (level == "read" and not settings.protect_reads):
        return
    key = request.headers.get(KEY_HEADER)
    if not hmac.compare_digest((key or "").encode(), expected.get_secret_value().encode()):
        raise HTTPException(
            401,
            f"missing or wrong API key (header {KEY_HEADER})"
            if key
            else f"this route needs the API key (header {KEY_HEADER})",
            headers={"WWW-Authenticate": KEY_HEADER},
        )


class GuardedRoute(APIRoute):
    """The route class of every router: the access check runs first, before FastAPI reads the
    body or solves the route's dependencies (a form is never parsed for a request without
    the key)."""

    def __init__(self, path: str, endpoint, **kwargs):
        extra = dict(kwargs.get("openapi_extra") or {})
        self.access: Access = extra.get(ACCESS_KEY, "public")
        if self.access != "public":
            extra.setdefault("security", [{"APIKeyHeader": []}])
        kwargs["openapi_extra"] = extra or None
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self):
        handler = super().get_route_handler()
        if self.access == "public":
            return handler
        level = self.access

        async def guarded(request: Request):
            check_access(request, level)
            return await handler(request)

        return guarded


def ready_state(request: Request) -> ServiceState:
    """The ServiceState, or 503 (with what start-up is doing) while there is none."""
    host: ServiceHost = request.app.state.snca
    if not host.ready:
        raise HTTPException(503, host.status(), headers={"Retry-After": "5"})
    return host.state


# Dependencies are `async def`: FastAPI runs plain `def` ones in a worker thread, a thread hop
# per dependency per request (a third of the event loop's time for 28x28 classify).
async def get_state(request: Request) -> ServiceState:
    return ready_state(request)


StateDep = Annotated[ServiceState, Depends(get_state)]


def parse_metadata(raw: str | None, n: int, limit: int) -> list[dict | None]:
    """JSON object (shared by all images) or list of n objects (one per image)."""
    if raw is None or raw == "":
        return [None] * n
    if len(raw.encode()) > limit:
        raise HTTPException(413, f"metadata is {len(raw.encode())} bytes; the limit is {limit}")
    try:
        md = json.loads(raw)
    except json.JSONDecodeError as e:
        raise HTTPException(422, f"metadata is not valid JSON: {e}") from None
    if isinstance(md, dict):
        return [md] * n
    if isinstance(md, list) and len(md) == n and all(isinstance(m, dict) for m in md):
        return md
    raise HTTPException(
        422,
        f"metadata must be a JSON object, or a list of {n} objects (one per image)",
    )


def check_label(label: str, max_len: int) -> str:
    lab = label.strip()
    if not lab:
        raise HTTPException(422, "label is empty")
    if len(lab) > max_len:
        raise HTTPException(422, f"label is {len(lab)} characters; the limit is {max_len}")
    if not lab.isprintable():
        raise HTTPException(422, "label must be printable text (no control characters)")
    return lab
