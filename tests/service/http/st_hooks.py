"""schemathesis hooks for tests/service/http/test_fuzz.py (SCHEMATHESIS_HOOKS=tests.service.http.st_hooks).

schemathesis 4.32 makes a string "violate" a `pattern` by appending "*" and does not check
that the result does violate it (schemathesis/specs/openapi/negative/value_channel.py,
violate_pattern): the label pattern allows "*", so a schema-valid request is reported as
"Schema-violating request accepted" (ST201). Such a failure is dropped only when the label
sent matches the published pattern; every other ST201 still fails the run.

A generated X-Min-Gallery-Version the store has not reached is refused at once with 422
`version_unknown` (documented); one the store has but this replica has not applied yet gets the
documented 503 `version_not_applied` (tests/service/test_replicas.py tests both): schemathesis
counts any 5xx as a failure, so exactly that answer is dropped (the fuzz server waits 0 s for
it; with one server it comes only in the moment between a write's commit and its answer).
schemathesis reports the 422 as "schema-valid request rejected" (ST202): the schema cannot say
"at most the store's last write", so exactly those answers (and the 429 of too many waiting)
are dropped too; every other failure of such a request still fails the run. The same for an
Idempotency-Key that an earlier generated request used with other content (422
`idempotency_key_reused`: it depends on what the server saw before). And a "violation" that
only adds a header the document does not name (any HTTP request may carry headers a server does
not read; schemathesis makes them with two documented header parameters on a route).

schemathesis 4.32 also makes a multipart body "violate" `additionalProperties` by adding a
property whose value is an empty list: a multipart form sends no part for it, so the request on
the wire is the valid one (seed 265324267: POST /search with {"image": ..., "": []} was
reported as ST201). Such a failure is dropped only when every property outside the schema is an
empty list and every required one is there. The same for an optional property made an empty
list to "violate" its `type` (seed 871886231: /gallery/add's metadata). Likewise a multipart label made a boolean or a
number "violates" `type`, but a form part is text: `false` arrives as the label "false" (seed
1568876363), dropped only when that text matches the published pattern. The same for a query
parameter of free text (an array of strings with no constraint on them): a value of another
type goes on the wire as text, which it takes (seed 1640257816: POST /search?label= was reported
as a `label` violating `anyOf`); dropped only for such a parameter."""

import json
import re

import schemathesis

from service.gallery.labels import LABEL_PATTERN

# Answers to a schema-valid X-Min-Gallery-Version that depend on the store's state, not on
# the request's shape (documented in the OpenAPI document and tested in test_replicas.py).
STATEFUL = {(422, "version_unknown"), (503, "version_not_applied"), (429, "too_many_waiting")}


def _version_not_applied(case, response) -> bool:
    if response is None or response.status_code not in {s for s, _ in STATEFUL}:
        return False
    sent = {k.lower(): v for k, v in (case.headers or {}).items()}
    try:
        code = response.json().get("code")
    except Exception:
        return False
    return "x-min-gallery-version" in sent and (response.status_code, code) in STATEFUL


def _key_used_before(case, response) -> bool:
    """A schema-valid Idempotency-Key that an earlier generated request already used, with
    other content: the documented 422 idempotency_key_reused depends on what the server saw
    before, not on the request's shape (tests/service/http/test_routes.py tests it)."""
    if response is None or response.status_code != 422:
        return False
    sent = {k.lower() for k in (case.headers or {})}
    try:
        code = response.json().get("code")
    except Exception:
        return False
    return "idempotency-key" in sent and code == "idempotency_key_reused"


def _extra_header_only(failure) -> bool:
    """A "violation" that only adds a header the document does not name: HTTP lets a client
    send any header, and the service ignores those it does not read (an OpenAPI document
    cannot say that header parameters allow others)."""
    msg = getattr(failure, "message", "") or ""
    return "in header - object with unexpected properties" in msg


def _form_schema(case) -> dict:
    body = case.operation.definition.raw.get("requestBody", {})
    return body.get("content", {}).get("multipart/form-data", {}).get("schema", {})


def _nothing_extra_sent(case, failure) -> bool:
    """An additionalProperties "violation" that sends nothing (empty lists are no parts)."""
    if "additionalProperties" not in failure.message or not isinstance(case.body, dict):
        return False
    try:
        schema = _form_schema(case)
    except Exception:
        return False
    props, required = set(schema.get("properties", {})), set(schema.get("required", []))
    extra = {k: v for k, v in case.body.items() if k not in props}
    return bool(extra) and all(v == [] for v in extra.values()) and required <= set(case.body)


def _optional_part_left_out(case, failure) -> bool:
    """A "violation" of an optional multipart field by an empty list: a form sends no part for
    it, so the field is absent on the wire, which the schema allows (seed 871886231: POST
    /gallery/add's metadata made [] was reported as a type violation, ST201)."""
    m = re.search(r"/properties/([^/ ]+)", getattr(failure, "message", "") or "")
    if not m or not isinstance(case.body, dict) or case.body.get(m.group(1)) != []:
        return False
    if "multipart" not in (getattr(case, "media_type", "") or ""):
        return False
    try:
        required = set(_form_schema(case).get("required", []))
    except Exception:
        return False
    sent = {k for k, v in case.body.items() if v != []}
    return m.group(1) not in required and required <= sent


CONSTRAINTS = {"pattern", "minLength", "maxLength", "enum", "format", "const"}


def _free_text(schema: dict) -> bool:
    """A query parameter's schema that any text satisfies: a string, or an array of strings,
    with no constraint (null allowed beside it)."""
    for v in schema.get("anyOf", [schema]):
        if v.get("type") == "null":
            continue
        items = v.get("items", {}) if v.get("type") == "array" else v
        if (
            items.get("type") != "string"
            or CONSTRAINTS & set(items)
            or {"minItems", "maxItems"} & set(v)
        ):
            return False
    return True


def _query_text_only(case, failure) -> bool:
    """A "violation" of a free-text query parameter: on the wire a query value is text."""
    m = re.search(r"parameter `([^`]+)` in query", getattr(failure, "message", "") or "")
    if not m:
        return False
    try:
        params = case.operation.definition.raw.get("parameters", [])
    except Exception:
        return False
    return any(
        p.get("in") == "query" and p.get("name") == m.group(1) and _free_text(p.get("schema", {}))
        for p in params
    )


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    if getattr(failure, "code", None) == "ST201" and _query_text_only(case, failure):
        return False
    if _version_not_applied(case, response) or _key_used_before(case, response):
        return False
    if getattr(failure, "code", None) == "ST201" and _nothing_extra_sent(case, failure):
        return False
    if getattr(failure, "code", None) == "ST201" and _optional_part_left_out(case, failure):
        return False
    if getattr(failure, "code", None) == "ST201" and _extra_header_only(failure):
        return False
    if getattr(failure, "code", None) != "ST201" or "/properties/label" not in failure.message:
        return True
    label = case.body.get("label") if isinstance(case.body, dict) else None
    if not isinstance(label, str) and "multipart" in (getattr(case, "media_type", "") or ""):
        # a multipart part is text: a "boolean" or "number" label goes on the wire as its
        # JSON text ("false": seed 1568876363), a label like any other
        label = json.dumps(label) if isinstance(label, bool | int | float) else label
    return not (isinstance(label, str) and re.search(LABEL_PATTERN, label))
