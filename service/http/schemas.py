"""Response bodies (OpenAPI documents them with these models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.http.fields import MAX_IDS, ItemIds, JsonId, Label


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
        ...,
        description="the answer: the chosen label; null when the image is unknown (the nearest "
        "label is then only `nearest_label`, a guess) or the gallery is empty",
    )
    confidence: float | None = Field(
        ...,
        description="how likely `label` is right: the vote's share between its two best labels "
        "(its reliability is measured in docs/RESULTS.md: close on a model's trained classes, "
        "too high on photos and small labels); null when `label` is",
    )
    nearest_label: str | None = Field(
        None,
        description="the label the vote chose, also when the image is unknown (then a guess, "
        "not an answer); null if the gallery is empty",
    )
    nearest_probability: float | None = Field(
        None,
        description="the vote's probability of `nearest_label` (among all labels: it falls as "
        "labels are added; `confidence` is the calibrated one)",
    )
    probabilities: list[Probability] = Field(..., description="top 5 labels")
    unknown: bool = Field(
        ...,
        description="nothing in the gallery is like this image: it is not of the chosen label's "
        "world (world_score over world_threshold), or its unknown_score is under the label's "
        "unknown_threshold (or, if set, best_similarity under SNCA_UNKNOWN_SIMILARITY or "
        "confidence under SNCA_UNKNOWN_PROBABILITY); false with unknown=off",
    )
    unknown_reason: Literal["outside_world", "no_label_accepts"] | None = Field(
        None,
        description="why the image is unknown: outside_world (not the kind of image the "
        "chosen label holds: the world check), no_label_accepts (of that kind, but no label's "
        "neighbourhood takes it: the label check); null when it is not unknown",
    )
    explanation: str = Field(
        ...,
        description="the answer in words: what the image was compared with, what decided, and "
        "what to do (an unknown's cause, an empty gallery); for people, beside the codes",
    )
    world_score: float | None = Field(
        None,
        description="the world check's distance: for a trained label, the Mahalanobis distance "
        "per dimension of the image's activation statistics from the training images' (about 1 "
        "for the training world, larger farther from it); for a label users registered, the "
        "same distance to its nearest image of the label; null when there is no world check",
    )
    world_threshold: float | None = Field(
        None,
        description="the distance over which the image is outside the world: for a trained "
        "label, the quantile that accepts SNCA_WORLD_TPR of held-out known images (null, and "
        "nothing refused, when the run had too few held-out images to place it: 99 at 0.99); "
        "for a registered label, a radius from its own images' spread",
    )
    world_basis: Literal["training", "label"] | None = Field(
        None,
        description="what the world check compared with: the training world, or the label's "
        "own images",
    )
    unknown_score: float | None = Field(
        None,
        description="open-set score (Sun et al. 2022, label-conditional): cosine similarity to "
        "the k-th most similar item of `label`, k = min(SNCA_UNKNOWN_K, the label's items - 1)",
    )
    unknown_threshold: float | None = Field(
        None,
        description="the score under which the image is unknown: the label's leave-one-out "
        "scores' quantile that accepts unknown_tpr of its own items (pooled over the trained "
        "labels for a label of fewer than 20 items, or its lowest own score if lower); null "
        "when there is nothing to calibrate from or unknown=off",
    )
    unknown_tpr: float | None = Field(
        None,
        description="the acceptance rate the threshold was set for (SNCA_UNKNOWN_TPR or the "
        "request's unknown_tpr); null when the calibrated rule is off",
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
                "confidence": 0.98,
                "nearest_label": "Sneaker",
                "nearest_probability": 0.97,
                "probabilities": [
                    {"label": "Sneaker", "probability": 0.97},
                    {"label": "Sandal", "probability": 0.02},
                ],
                "unknown": False,
                "explanation": "Most like the images of 'Sneaker': 98% likely right, from the "
                "vote of its nearest images against 'Sandal', the next label.",
                "unknown_score": 0.93,
                "unknown_threshold": 0.88,
                "unknown_tpr": 0.95,
                "best_similarity": 0.96,
                "neighbors": None,
                "vote": "kde_shrunk",
                "k": 30,
                "gallery_version": 3,
                "model_fingerprint": "sha256:85390a8f...",
            }
        }
    }


class BatchResult(BaseModel):
    results: list[ClassifyResult]


class OutlierInfo(BaseModel):
    id: int
    sits_with: str = Field(..., description="the label its leave-one-out vote chose")
    probability: float = Field(..., description="that vote's probability")


class LabelDiagnostics(BaseModel):
    """How a label's images agree with each other and sit among the other labels."""

    label: str
    count: int = Field(..., description="live items of the label")
    checked: int = Field(
        ..., description="images checked: the ones just added, or a sample of up to 200"
    )
    agreement: float | None = Field(
        None,
        description="share of the checked images that the vote, with the image itself taken "
        "out of the gallery, still gives this label (leave-one-out); null for a label of one "
        "image",
    )
    cohesion: float | None = Field(
        None, description="mean cosine between two of the label's items (null under 2 items)"
    )
    gallery_cohesion: float | None = Field(
        None,
        description="the median cohesion of the gallery's labels of >= 20 items: a label far "
        "below it is spread out (mixed images, or images the embedding does not group)",
    )
    nearest_label: str | None = Field(
        None, description="the other label whose mean embedding is nearest this label's"
    )
    nearest_similarity: float | None = Field(None, description="cosine between the two means")
    confused_with: dict[str, float] = Field(
        default_factory=dict,
        description="labels that the leave-one-out vote gave checked images to (and are not "
        "unknown there), with the share of images",
    )
    outliers: list[OutlierInfo] = Field(
        default_factory=list, description="checked images that sit with another label"
    )
    outside_world: float | None = Field(
        None,
        description="share of the images just added that are not the kind of image the model "
        "was trained on (the world check); such a label is recognised by its own images' world; "
        "null when not checked",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="plain-language warnings: the label overlaps another one (the vote will "
        "confuse them), suspected mislabelled images, one image already classified as a label",
    )


class AddResult(BaseModel):
    ids: list[int]
    label: str
    count: int = Field(..., description="live items of this label after the add")
    gallery_version: int
    diagnostics: LabelDiagnostics | None = Field(
        None, description="the new images checked against the gallery (null: not computed)"
    )


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
    """RFC 9457 problem details (application/problem+json), service/http/problems.py."""

    type: str = Field("about:blank", description="about:blank: the status says what happened")
    title: str = Field(..., description="the status's phrase")
    status: int
    detail: str = Field(..., description="what went wrong, for a person")
    code: str = Field(
        ..., description="why, for a program: a stable code (docs/serving.md, Errors)"
    )
    request_id: str = Field(..., description="the X-Request-ID of the request (logs have it)")
    committed: bool | None = Field(
        None,
        description="a write's 503 (model_unavailable, store_unavailable, write_not_applied): "
        "whether the write was committed: false (nothing changed), true (durable as "
        "gallery_version, not yet applied here), null (unknown: the store's connection broke "
        "during the commit); a retry with the same Idempotency-Key settles it",
    )
    gallery_version: int | None = Field(
        None, description="the committed write's gallery version (with committed: true)"
    )


# ------------------------------------------------------------------ corrections (routes/corrections.py)
class NewLabel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Label


class Relabel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: ItemIds
    label: Label


class Rename(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Label = Field(description="the label renamed")
    to: Label = Field(description="its new name (no live item may have it: merge instead)")


class Merge(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: Label = Field(description="the label merged away")
    into: Label = Field(description="the label its items join (it has items)")


class Moved(BaseModel):
    id: int
    previous_label: str


class RelabelResult(BaseModel):
    relabelled: list[Moved] = Field(description="the items moved (those already there: none)")
    label: str
    gallery_version: int


class RenameResult(BaseModel):
    label: str = Field(description="the label the items have now")
    previous_label: str
    count: int = Field(description="items moved")
    gallery_version: int


# ------------------------------------------------------------------ the review queue (routes/review.py)
QueuedId = JsonId  # a queued query's id (GET /review)


class Name(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[QueuedId] = Field(min_length=1, max_length=MAX_IDS, description="queued query ids")
    label: Label


class Dismiss(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[QueuedId] = Field(min_length=1, max_length=MAX_IDS, description="queued query ids")


class Named(BaseModel):
    ids: list[int] = Field(description="the new gallery items, in the order of the queued ids")
    queued_ids: list[int] = Field(description="the queued queries they were (those still queued)")
    label: str
    count: int = Field(description="the label's live items now")
    gallery_version: int
