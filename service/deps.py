"""Dependencies as Annotated aliases (full-stack-fastapi-template style)."""

from __future__ import annotations

import hmac
import json
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import APIKeyHeader

from .state import ServiceState

_key_header = APIKeyHeader(
    name="X-API-Key", auto_error=False, description="required when SNCA_API_KEY is set"
)


# Dependencies are `async def`: FastAPI runs plain `def` ones in a worker thread, a thread hop
# per dependency per request (a third of the event loop's time for 28x28 classify).
def ready_state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.snca
    if not state.ready:
        raise HTTPException(503, "the service is not ready yet")
    return state


async def get_state(request: Request) -> ServiceState:
    return ready_state(request)


StateDep = Annotated[ServiceState, Depends(get_state)]


def check_key(state: ServiceState, key: str | None) -> None:
    expected = state.settings.api_key
    if expected is None:
        return
    given = (key or "").encode()
    if not hmac.compare_digest(given, expected.get_secret_value().encode()):
        raise HTTPException(
            401,
            "missing or wrong API key (header X-API-Key)"
            if key
            else "this route needs the API key (header X-API-Key)",
            headers={"WWW-Authenticate": "X-API-Key"},
        )


async def require_key(request: Request, key: Annotated[str | None, Depends(_key_header)]) -> None:
    """Mutating routes: the API key when one is configured (constant-time compare)."""
    check_key(request.app.state.snca, key)


async def require_read_key(
    request: Request, key: Annotated[str | None, Depends(_key_header)]
) -> None:
    """Read routes: the API key only with SNCA_PROTECT_READS."""
    state = request.app.state.snca
    if state.settings.protect_reads:
        check_key(state, key)


WriteKey = Annotated[None, Depends(require_key)]
ReadKey = Annotated[None, Depends(require_read_key)]


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
