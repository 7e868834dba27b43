"""What a request carries, checked before anything is stored: the multipart form and metadata
(JSON the store keeps exactly as sent); labels are checked by service/gallery/labels.py."""

from __future__ import annotations

import json
import math
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from python_multipart.multipart import parse_options_header

from service.http.multipart import Form, FormError, parse_form_of
from service.http.problems import Problem
from service.store.records import Keyed

# Metadata nested deeper than this is refused: responses serialise it, and a stored item that
# cannot be serialised would break every search that returns it.
MAX_METADATA_DEPTH = 16


async def read_form(request: Request, max_parts: int, fields: tuple[str, ...]) -> Form:
    """The request's multipart body (an empty Form for another content type: the route's
    missing-field error then names what it needs); 422 for a field not in `fields`."""
    ct = parse_options_header(request.headers.get("content-type", ""))
    if ct[0] != b"multipart/form-data":
        return Form()
    try:
        form = parse_form_of(await request.body(), ct, max_parts)
    except FormError as e:
        raise Problem(e.status, e.code, e.message) from None
    unknown = (form.files.keys() | form.fields.keys()) - set(fields)
    if unknown:
        raise Problem(
            422,
            "unknown_parameter",
            f"unknown form fields: {', '.join(sorted(unknown))[:200]} (this route takes "
            f"{', '.join(fields)})",
        )
    return form


def missing(field: str) -> RequestValidationError:
    """The 422 FastAPI gives for a missing form field."""
    return RequestValidationError(
        [{"type": "missing", "loc": ("body", field), "msg": "Field required", "input": None}]
    )


def text_field(form: Form, name: str, code: str) -> str | None:
    """The first value of text field `name` (None when absent); 422 `code` unless UTF-8."""
    values = form.fields.get(name)
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise Problem(
            422, code, f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def _finite(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise ValueError(f"the number {text[:24]} is out of range (it would be stored as null)")
    return f


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON number (it would be stored as null)")


def _depth(v) -> int:
    """Nesting depth of a JSON value (iterative: no recursion on hostile input)."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict | list):
            deepest = max(deepest, d)
            if d > MAX_METADATA_DEPTH:
                return d
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


def parse_metadata(raw: str | None, n: int, limit: int) -> list[dict | None]:
    """JSON object (shared by all images) or list of n objects (one per image), refused (422)
    unless the store would give it back unchanged: no NaN/Infinity, no number out of range,
    no integer of more digits than Python converts, at most MAX_METADATA_DEPTH levels."""
    if raw is None or raw == "":
        return [None] * n
    size = len(raw.encode())
    if size > limit:
        raise Problem(413, "metadata_too_large", f"metadata is {size} bytes; the limit is {limit}")
    try:
        md = json.loads(raw, parse_float=_finite, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise Problem(422, "metadata_invalid", f"metadata is not valid JSON: {e}") from None
    except RecursionError:
        raise Problem(422, "metadata_invalid", "metadata is nested too deeply") from None
    except ValueError as e:  # _finite, _constant, or an integer over Python's digit limit
        raise Problem(422, "metadata_invalid", f"metadata: {e}") from None
    if _depth(md) > MAX_METADATA_DEPTH:
        raise Problem(
            422,
            "metadata_invalid",
            f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep",
        )
    if isinstance(md, dict):
        return [md] * n
    if isinstance(md, list) and len(md) == n and all(isinstance(m, dict) for m in md):
        return md
    raise Problem(
        422,
        "metadata_invalid",
        f"metadata must be a JSON object, or a list of {n} objects (one per image)",
    )


IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_PATTERN = r"^[!-~]{1,255}$"  # 1-255 visible ASCII characters
_IDEMPOTENCY = re.compile(IDEMPOTENCY_PATTERN)
# the OpenAPI parameter of every route that writes the gallery
IDEMPOTENCY_PARAMETER = {
    "name": IDEMPOTENCY_HEADER,
    "in": "header",
    "required": False,
    "description": "a key of the client's choosing (a UUID) that makes a retry safe: a write "
    "made under it is remembered for SNCA_IDEMPOTENCY_TTL_S on every replica, and a retry with "
    "the same key and request is answered with the first outcome (header Idempotent-Replayed: "
    "true), writing nothing again; the same key with another request is 422 "
    "idempotency_key_reused",
    "schema": {"type": "string", "pattern": IDEMPOTENCY_PATTERN},
}


def idempotency_key(request: Request, ttl_s: float, *asked: bytes | str) -> Keyed | None:
    """The request's Idempotency-Key (None: it sent none) with the sha256 of what it asks
    (`asked`: the route and every part of its body that matters), so that the same key sent
    with another request is refused; 422 header_invalid for a malformed key."""
    import hashlib

    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not _IDEMPOTENCY.match(key):
        raise Problem(
            422,
            "header_invalid",
            f"{IDEMPOTENCY_HEADER} must be 1-255 visible ASCII characters (a UUID, say)",
        )
    h = hashlib.sha256()
    for part in asked:
        b = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(b).to_bytes(8, "little") + b)
    return Keyed(key, h.hexdigest(), ttl_s)


ERRORS = {  # (what every route or upload answers: service/http/openapi.py)
    400: {"description": "undecodable image or malformed multipart body"},
    404: {"description": "a label in the `labels` filter is unknown"},
    413: {"description": "body, image or the request's pixels too large"},
}


# One image sent as the whole body (`curl --data-binary @q.png -H 'Content-Type: image/png'`):
# no form to build or parse. The routes that take one image (field "image") document it as
# IMAGE_BODY beside their multipart form; the bytes go to the same decoder as a form's file, so
# bad input gets the same answers (400 undecodable, 413 pixels, 415 not an image).
IMAGE_BODY = {"image/*": {"schema": {"type": "string", "format": "binary", "minLength": 1}}}


def is_image_body(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower().startswith("image/")


async def read_uploads(request: Request, field: str, max_files: int) -> list[bytes]:
    """The files of multipart field `field` (at least one; 422 like FastAPI's when missing;
    413 `too_many_files` above `max_files`); for field "image", also the body itself when it is
    sent as `Content-Type: image/*` (empty: the decoder's 400, as for a 0-byte file)."""
    if field == "image" and is_image_body(request.headers.get("content-type", "")):
        return [await request.body()]
    got = (await read_form(request, max_files + 8, (field,))).files.get(field)
    if not got:
        raise missing(field)
    if len(got) > max_files:
        raise Problem(413, "too_many_files", f"{len(got)} images; the limit is {max_files}")
    return got


def check_labels(state, labels) -> None:
    """404 `label_unknown` naming the labels of a filter that the gallery does not have."""
    unknown = [lab for lab in labels if not state.gallery.has_label(lab)]
    if unknown:
        raise Problem(404, "label_unknown", f"unknown labels in the filter: {', '.join(unknown)}")
