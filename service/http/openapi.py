"""The OpenAPI document as the running server enforces it (schemathesis checks it with
`--checks all`, tests/service/http/test_fuzz.py): the security requirement of each route under
this server's key settings, every error as problem details, the statuses any route can
answer, and the form limits of these settings."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.config import Settings
from service.http.deps import ACCESS_KEY, KEY_SCHEME, MIN_VERSION_HEADER
from service.http.fields import LABEL_FIELD
from service.http.inputs import IDEMPOTENCY_HEADER
from service.http.keys import KeyRing
from service.http.problems import PROBLEM_JSON
from service.http.schemas import ErrorBody

PROBLEM = {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}

# What any route can answer, whatever it does (the middleware and GuardedRoute). The statuses
# shared by a kind of route are documented here, once; a route's `responses` name only its own
# (400 undecodable image, 404, 413 limits, 429 of its own).
EVERY_ROUTE = {
    "400": "malformed request, or a Host header this server does not answer to",
    "422": "invalid or unknown query parameter",
    "503": "not ready",
}
WITH_BODY = {  # a route that reads an upload (multipart)
    "408": "the body arrived too slowly",
    "415": "not an image",
}
WRITE_503 = "not ready, or the gallery store cannot be written (nothing was changed)"

# Read-your-writes across replicas (deps.wait_for_version), taken by every route that reads
# or writes the gallery (not by the public health, readiness and metrics routes).
MIN_VERSION = {
    "name": MIN_VERSION_HEADER,
    "in": "header",
    "required": False,
    "description": "answer only once this process has applied this write (a gallery_version "
    "another answer carried); waits at most SNCA_MIN_VERSION_WAIT_S, then 503; a version the "
    "store has not reached is 422 at once; too many waiting at once is 429",
    "schema": {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
}
WITH_MIN_VERSION = {
    "422": "invalid or unknown query parameter, or an X-Min-Gallery-Version no write has",
    "429": "too many requests wait for an X-Min-Gallery-Version (SNCA_MAX_PARKED_PER_CLIENT, "
    "SNCA_MAX_PARKED)",
    "503": f"not ready, or {MIN_VERSION_HEADER} not applied within SNCA_MIN_VERSION_WAIT_S",
}


def _label_fields(comps: dict, s: Settings) -> None:
    for schema in comps.values():
        for prop in schema.get("properties", {}).values():
            if prop.pop(LABEL_FIELD, False):
                prop["maxLength"] = s.max_label_length


def _limits(op: dict, s: Settings) -> None:
    """The settings' limits into a documented multipart form (service/http/inputs.py reads it)."""
    body = op.get("requestBody", {}).get("content", {}).get("multipart/form-data")
    if not body:
        return
    props = body["schema"]["properties"]
    if "label" in props:
        props["label"]["maxLength"] = s.max_label_length
    if props.get("images", {}).get("type") == "array":
        props["images"]["maxItems"] = s.max_images_per_request


def build(app: FastAPI, settings: Settings, keys: KeyRing | None = None) -> dict:
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps["ErrorBody"] = ErrorBody.model_json_schema()
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    keys = KeyRing.from_settings(settings) if keys is None else keys
    if keys.enabled:
        schema["components"]["securitySchemes"] = KEY_SCHEME
    for path_ops in schema.get("paths", {}).values():
        for op in path_ops.values():
            level = op.get(ACCESS_KEY, "public")
            op.pop("security", None)
            responses = op.setdefault("responses", {})
            if keys.needs_key(level):
                op["security"] = [{"APIKeyHeader": []}]
                responses.setdefault("401", {"description": "missing or wrong API key"})
                if level == "write":
                    responses.setdefault(
                        "403", {"description": "the key is a read key (insufficient_scope)"}
                    )
            elif level == "write" and not keys.enabled:
                responses.setdefault("403", {"description": "a write from another web origin"})
            if level == "write":
                responses.setdefault("503", {"description": WRITE_503})
            if "multipart/form-data" in op.get("requestBody", {}).get("content", {}):
                for code, desc in WITH_BODY.items():
                    responses.setdefault(code, {"description": desc})
            for code, desc in EVERY_ROUTE.items():
                responses.setdefault(code, {"description": desc})
            if level != "public":
                for code, desc in WITH_MIN_VERSION.items():
                    responses.setdefault(code, {"description": desc})
                op.setdefault("parameters", []).append(MIN_VERSION)
            for code, r in responses.items():
                own = r.get("content", {}).get("application/json")
                if code[0] in "45" and not (own is not None and not own.get("schema")):
                    r["content"] = PROBLEM  # (a route's own status body, /readyz's, stays)
            if "422" in responses:
                responses["422"]["description"] = "invalid or unknown field or query parameter"
                if any(p.get("name") == IDEMPOTENCY_HEADER for p in op.get("parameters", [])):
                    responses["422"]["description"] += (
                        ", or an Idempotency-Key used before for another request"
                    )
            _limits(op, settings)
    _label_fields(comps, settings)
    return schema


def install(app: FastAPI, settings: Settings) -> None:
    """app.openapi() answers `build` (made again only when the key file changed)."""

    made = [-1]  # the key ring's reloads the document was built for (a rotated key file
    # can add or drop read keys, and with them what the read routes require)

    def openapi() -> dict:
        keys = app.state.keys
        keys.refresh()  # (looks at the key file)
        if not app.openapi_schema or made[0] != keys.reloads:
            app.openapi_schema = build(app, settings, keys)
            made[0] = keys.reloads
        return app.openapi_schema

    app.openapi = openapi
