"""The one JSON encoding of the service's responses: orjson (a classify answer in ~5 us
against json.dumps's ~45 us, a twentieth of the front's CPU per request, docs/PERFORMANCE.md),
falling back to json.dumps for what orjson refuses (integers beyond 64 bits, which stored
metadata may hold; keys that are not strings), so every body that encoded before still does."""

from __future__ import annotations

import json

import orjson
from starlette.responses import JSONResponse as _StarletteJSON


def dumps(content) -> bytes:
    """`content` as compact UTF-8 JSON (Starlette's JSONResponse's format: non-ASCII as is)."""
    try:
        return orjson.dumps(content)
    except TypeError:  # (orjson.JSONEncodeError)
        return json.dumps(
            content, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode("utf-8")


class JSONResponse(_StarletteJSON):
    """Starlette's JSONResponse, encoded by `dumps`."""

    def render(self, content) -> bytes:
        return dumps(content)
