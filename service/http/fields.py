"""Field types that more than one route takes: a label, ids in a JSON body and in a path. One
home, so that every route checks a label or an id the same way."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path
from pydantic import BeforeValidator, Field

from service.gallery.labels import LABEL_PATTERN

# marks a JSON body's label field (Label below): service/http/openapi.py writes the settings'
# SNCA_MAX_LABEL_LENGTH in as its maxLength
LABEL_FIELD = "x-snca-label"

MAX_IDS = 1000  # items one relabel may name (one write; bounded time under the write lock)

# a label as the gallery takes it (openapi.py writes SNCA_MAX_LABEL_LENGTH in as maxLength)
Label = Annotated[
    str,
    Field(
        min_length=1,
        max_length=1000,
        pattern=LABEL_PATTERN,
        description="a label name",
        json_schema_extra={LABEL_FIELD: True},
    ),
]
# ids in a JSON body: below 2^53, a number every JSON reader holds exactly (ids count up from 0)
JSON_ID_MAX = 2**53 - 1


def _not_bool(v):
    """JSON Schema's integer: 3 and 3.0, never true (which lax int validation takes as 1)."""
    if isinstance(v, bool):
        raise ValueError("an id is a number, not true or false")
    return v


JsonId = Annotated[int, Field(ge=0, le=JSON_ID_MAX), BeforeValidator(_not_bool)]
ItemIds = Annotated[
    list[JsonId],
    Field(min_length=1, max_length=MAX_IDS, description=f"1 to {MAX_IDS} item ids"),
]
# an item id in a URL path
ItemId = Annotated[int, Path(ge=0, le=2**63 - 1, description="gallery item id")]
