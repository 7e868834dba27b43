"""RFC 9457 problem details: the one shape of every error the service sends.

    HTTP/1.1 413 Content Too Large
    Content-Type: application/problem+json

    {"type": "about:blank", "title": "Content Too Large", "status": 413,
     "detail": "request body exceeds the limit of 10485760 bytes",
     "code": "request_too_large", "request_id": "9f2c01ab-1c"}

`type` is "about:blank" (RFC 9457 §4.2.1: the status says what happened, `title` is its
phrase); `code` is the stable, machine-readable reason a client branches on (CODES lists them),
`detail` the human-readable one, `request_id` the id in the X-Request-ID header and the logs.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from service.http.encode import JSONResponse
from service.logs import request_id

PROBLEM_JSON = "application/problem+json"

# Every `code` the service sends, with what it means (docs/serving.md's error table lists them).
CODES = {
    "bad_request": "the request is malformed (the detail says how)",
    "multipart_invalid": "the multipart/form-data body is malformed",
    "image_empty": "an uploaded file is empty",
    "image_undecodable": "an image claims a format but cannot be decoded",
    "image_unsupported": "a file is not an image of an accepted format",
    "image_too_large": "one image has more pixels than SNCA_MAX_IMAGE_PIXELS",
    "request_too_large": "the body is over SNCA_MAX_UPLOAD_BYTES",
    "too_many_pixels": "the images of one request have more pixels than SNCA_MAX_REQUEST_PIXELS",
    "too_many_files": "more files or form parts than the route takes",
    "metadata_too_large": "metadata is over SNCA_MAX_METADATA_BYTES",
    "metadata_invalid": "metadata is not a JSON object (or list of them) the store keeps as sent",
    "label_invalid": "a label is empty, too long, not text or not valid UTF-8",
    "label_unknown": "a label named in the request is not in the gallery",
    "item_unknown": "no live gallery item has this id",
    "label_exists": "a rename onto a label that has items (merge into it instead)",
    "label_same": "a rename or merge of a label onto itself",
    "thumbnail_unknown": "the item has no thumbnail",
    "validation_error": "a field or parameter is invalid (the detail names it)",
    "unknown_parameter": "a query parameter the route does not take (a typo would do nothing)",
    "unauthorized": "the X-API-Key header is missing or wrong",
    "cross_origin_write": "a write from another web origin while no API key is set",
    "insufficient_scope": "the API key may only read; the route writes",
    "host_not_allowed": "the Host header is not one this server answers to",
    "not_found": "no such route",
    "method_not_allowed": "the route does not take this method",
    "request_timeout": "the request's headers or body arrived too slowly",
    "not_ready": "starting, migrating the gallery, or stopping",
    "model_unavailable": "the worker's model process stopped, or did not answer within "
    "SNCA_MODEL_TIMEOUT_S, and a new one is starting (nothing was changed: `committed` false); "
    "retry after Retry-After",
    "model_busy": "the worker's model process has more queued than it does within "
    "SNCA_MODEL_QUEUE_S (or SNCA_MODEL_QUEUE_MAX jobs): refused before waiting (nothing was "
    "changed); retry after Retry-After",
    "write_not_applied": "the write was committed (`committed` true, its `gallery_version`) but "
    "is not applied where the answer comes from yet (the model process did not answer in time, "
    "or the store could not be read right after the commit); retry with the same "
    "Idempotency-Key to get its outcome",
    "store_unavailable": "the gallery store cannot be reached or written (or was carried to a "
    "new model by another process); nothing was changed (`committed` false), unless the "
    "connection broke while the write committed (`committed` null: retry it with the same "
    "Idempotency-Key to learn its outcome)",
    "version_not_applied": "this replica has not applied the X-Min-Gallery-Version write within "
    "SNCA_MIN_VERSION_WAIT_S (retry, or ask another replica)",
    "version_unknown": "X-Min-Gallery-Version names a write the gallery store has not made yet",
    "too_many_waiting": "too many requests wait for an X-Min-Gallery-Version (per client or in "
    "all: SNCA_MAX_PARKED_PER_CLIENT, SNCA_MAX_PARKED); retry after Retry-After",
    "client_gone": "the client closed the connection while its request waited (logged only)",
    "learn_running": "a learn runs already on this data dir (GET /admin/learn follows it)",
    "too_busy": "too many requests of this kind run at once (the detail says which bound); "
    "retry after Retry-After",
    "header_invalid": "a request header the service reads has an invalid value",
    "idempotency_key_reused": "the Idempotency-Key was used before for another request (another "
    "route, label, image or metadata): nothing was changed",
    "snapshot_failed": "the index snapshot could not be written",
    "too_many_connections": "the server holds SNCA_MAX_CONNECTIONS connections",
    "internal_error": "a bug: logged with the request id",
}

# The code of an error raised without one (the framework's own errors), by status.
DEFAULT_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    415: "image_unsupported",
    422: "validation_error",
    500: "internal_error",
    503: "not_ready",
}


class Problem(Exception):
    """Raise anywhere in a request: answered as a problem details response."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        headers: dict | None = None,
        extra: dict | None = None,
    ):
        """`extra`: extension members of the problem (RFC 9457 §3.2), next to `code`."""
        assert code in CODES, code
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers
        self.extra = extra


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 499: nginx's "client closed request", never seen by the client
        return "Client Closed Request" if status == 499 else "Error"


def body(status: int, code: str, detail: str, extra: dict | None = None) -> dict:
    return {
        "type": "about:blank",
        "title": _phrase(status),
        "status": status,
        "detail": detail,
        "code": code,
        "request_id": request_id.get(),
        **(extra or {}),
    }


def response(
    status: int,
    code: str | None,
    detail: str,
    headers: dict | None = None,
    extra: dict | None = None,
) -> JSONResponse:
    code = code or DEFAULT_CODES.get(status, "bad_request")
    return JSONResponse(
        body(status, code, detail, extra),
        status_code=status,
        headers=headers,
        media_type=PROBLEM_JSON,
    )


def raw_response(status: int, code: str, detail: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for the protocol layer (no app)."""
    payload = json.dumps(body(status, code, detail)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"content-type: {PROBLEM_JSON}\r\ncontent-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + payload
