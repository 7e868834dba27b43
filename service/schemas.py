"""Response bodies (OpenAPI documents them with these models)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Probability(BaseModel):
    label: str
    probability: float = Field(..., ge=0, le=1)


class Neighbor(BaseModel):
    id: int
    label: str
    similarity: float
    thumbnail_url: str | None = Field(
        None, description="GET this for the item's thumbnail; null when none is kept"
    )


class ClassifyResult(BaseModel):
    label: str | None = Field(
        ..., description="best guess (also when unknown); null if the gallery is empty"
    )
    confidence: float = Field(..., description="probability of `label`")
    probabilities: list[Probability] = Field(..., description="top 5 labels")
    unknown: bool = Field(
        ..., description="open-set rejection: best similarity or confidence under threshold"
    )
    best_similarity: float = Field(..., description="cosine of the most similar gallery item")
    neighbors: list[Neighbor] | None = Field(None, description="the k nearest items, when asked")
    vote: str
    k: int
    gallery_version: int
    model_fingerprint: str

    model_config = {
        "json_schema_extra": {
            "example": {
                "label": "Sneaker",
                "confidence": 0.97,
                "probabilities": [
                    {"label": "Sneaker", "probability": 0.97},
                    {"label": "Sandal", "probability": 0.02},
                ],
                "unknown": False,
                "best_similarity": 0.96,
                "neighbors": None,
                "vote": "kde",
                "k": 30,
                "gallery_version": 3,
                "model_fingerprint": "sha256:85390a8f...",
            }
        }
    }


class BatchResult(BaseModel):
    results: list[ClassifyResult]


class AddResult(BaseModel):
    ids: list[int]
    label: str
    count: int = Field(..., description="live items of this label after the add")
    gallery_version: int


class SearchItem(BaseModel):
    id: int
    label: str
    similarity: float
    source: str
    metadata: dict | None = None
    thumbnail_url: str | None = Field(
        None, description="GET this for the item's thumbnail; null when none is kept"
    )


class SearchResult(BaseModel):
    items: list[SearchItem]
    gallery_version: int


class LabelInfo(BaseModel):
    label: str
    count: int
    source: str = Field(..., description="trained, added, or trained+added")


class LabelsResult(BaseModel):
    labels: list[LabelInfo]
    total: int = Field(..., description="live items of every label (all pages)")
    label_count: int = Field(..., description="labels with live items (all pages)")
    gallery_version: int
    next_page_token: str | None = Field(
        None, description="page_token for the next page; null on the last"
    )


class ItemInfo(BaseModel):
    id: int
    label: str
    source: str = Field(..., description="trained (from the index build) or added")
    metadata: dict | None = None
    created_at: str = Field(..., description="when it was added (ISO 8601, UTC)")
    thumbnail_url: str | None = Field(
        None, description="GET this for the item's thumbnail; null when none is kept"
    )


class ItemsPage(BaseModel):
    items: list[ItemInfo]
    next_page_token: str | None = Field(
        None, description="page_token for the next page; null on the last"
    )
    gallery_version: int


class DeleteResult(BaseModel):
    deleted: list[int]
    label: str | None = None
    gallery_version: int


class SnapshotResult(BaseModel):
    seq: int
    path: str


class ErrorBody(BaseModel):
    """RFC 9457 problem details (application/problem+json), service/problems.py."""

    type: str = Field("about:blank", description="about:blank: the status says what happened")
    title: str = Field(..., description="the status's phrase")
    status: int
    detail: str = Field(..., description="what went wrong, for a person")
    code: str = Field(..., description="why, for a program: a stable code (README's table)")
    request_id: str = Field(..., description="the X-Request-ID of the request (logs have it)")
