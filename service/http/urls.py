"""The URLs answers link to (a gallery item's and a queued query's thumbnail): one home, so
that a route that links to another route's resource does not import that route."""

from __future__ import annotations


def thumbnail_url(item_id: int) -> str:
    """A gallery item's thumbnail (GET /gallery/items/{id}/thumbnail)."""
    return f"/gallery/items/{item_id}/thumbnail"


def queued_thumbnail_url(queued_id: int) -> str:
    """A queued query's thumbnail (GET /review/items/{id}/thumbnail)."""
    return f"/review/items/{queued_id}/thumbnail"
