"""The service's one multipart/form-data reader (every route with an upload uses it).

Starlette's form parser (python-multipart's byte-level state machine, a spooled temporary file
per upload) costs ~130 us of the ~370 us the app spends on a 28x28 /classify request
(docs/PERFORMANCE.md). These routes only need the uploaded files' bytes, and the body is already
in memory and capped by SNCA_MAX_UPLOAD_BYTES, so splitting it on the boundary (RFC 7578: the
boundary never occurs inside a part) is enough. Header parameters are parsed by python-multipart's
own `parse_options_header`. Everything malformed is a 400 naming the problem; too many parts
a 413 (one reader, so every route answers the same: Starlette's parser said 400 for both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from python_multipart.multipart import parse_options_header

# The Content-Disposition every client library sends (`form-data; name="image";
# filename="q.png"`), read without the general parser (a fifth of the form's reading for a small
# upload): values without quotes, backslashes or semicolons inside, name before filename. Any
# other header (escapes, `filename*`, another order, IE's full paths) goes to
# parse_options_header, which gives the same (name, filename) for these.
_PLAIN_DISPOSITION = re.compile(
    rb'[^;"]*;[ \t]*name="([^"\\;]*)"[ \t]*(?:;[ \t]*filename="([^"\\;]*)"[ \t]*)?\Z'
)


class FormError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = "too_many_files" if status == 413 else "multipart_invalid"


@dataclass
class Form:
    files: dict[str, list[bytes]] = field(default_factory=dict)  # parts with a filename
    fields: dict[str, list[bytes]] = field(default_factory=dict)  # text parts, raw bytes


def is_multipart(content_type: str) -> bool:
    return parse_options_header(content_type)[0] == b"multipart/form-data"


def file_parts(body: bytes, content_type: str, max_parts: int) -> dict[str, list[bytes]]:
    """{field name: [file contents, in order]} of the parts that carry a filename."""
    return parse_form(body, content_type, max_parts).files


def parse_form(body: bytes, content_type: str, max_parts: int) -> Form:
    """Files ({name: [contents, in order]}) and text fields of a multipart body. Raises
    FormError(400) for a malformed body and FormError(413) above `max_parts` parts."""
    return parse_form_of(body, parse_options_header(content_type), max_parts)


def parse_form_of(body: bytes, content_type: tuple[bytes, dict], max_parts: int) -> Form:
    """`parse_form` with the Content-Type already parsed (parse_options_header's pair)."""
    ctype, params = content_type
    if ctype != b"multipart/form-data":
        raise FormError(400, f"expected multipart/form-data, got {ctype.decode('latin-1')!r}")
    boundary = params.get(b"boundary")
    if not boundary or len(boundary) > 200:
        raise FormError(400, "malformed multipart body: missing or invalid boundary")
    delim = b"--" + boundary
    if body.strip() == delim + b"--":  # no parts at all (an empty list of files)
        return Form()
    start = body.find(delim)
    if start < 0:
        raise FormError(400, "malformed multipart body: the boundary does not occur")
    end = body.find(b"\r\n" + delim + b"--", start)
    if end < 0:
        raise FormError(400, "malformed multipart body: no closing boundary")
    segment = body[start + len(delim) : end]
    if not segment:
        return Form()
    parts = segment.split(b"\r\n" + delim)
    if len(parts) > max_parts:
        raise FormError(413, f"{len(parts)} form parts; the limit is {max_parts}")
    out = Form()
    for i, part in enumerate(parts):
        part = part.lstrip(b" \t")  # transport padding after a boundary is allowed
        head, sep, content = part[2:].partition(b"\r\n\r\n")
        if not part.startswith(b"\r\n") or not sep:
            raise FormError(400, f"malformed multipart body: part {i} has no header block")
        name = filename = None
        for line in head.split(b"\r\n"):
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-disposition":
                name, filename = disposition(value)
        if name is None:
            raise FormError(400, f"malformed multipart body: part {i} has no field name")
        where = out.files if filename is not None else out.fields
        where.setdefault(name.decode("utf-8", "replace"), []).append(content)
    return out


def disposition(value: bytes) -> tuple[bytes | None, bytes | None]:
    """(name, filename) of a part's Content-Disposition value (None: absent)."""
    plain = _PLAIN_DISPOSITION.match(value.strip(b" \t"))
    if plain is not None:
        return plain.group(1), plain.group(2)
    _, p = parse_options_header(value)
    return p.get(b"name"), p.get(b"filename")
