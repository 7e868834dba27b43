"""Corrections (issue 43): PATCH /gallery/items/{id} (one item's label), POST /gallery/relabel
(many items to one label), POST /gallery/rename and /gallery/merge (a label's every item; the
label in the body, not the path: `DELETE /gallery/labels/{label}` takes any label, "/" included,
so a path under it would be another label's delete). Each is one durable
write like an add: in the change log (every replica, the model process, an upgrade's carry
follow it), answered once the model process votes with it, the open-set calibration of every
touched label recomputed (service/gallery/gallery.py apply_relabel), an Idempotency-Key
replayed, a write key needed where keys are set."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from service.gallery.labels import check_label, normalize_label
from service.http.deps import GuardedRoute, StateDep, access
from service.http.encode import JSONResponse
from service.http.fields import MAX_IDS, ItemId
from service.http.idempotency import REPLAYED, keyed_write
from service.http.inputs import IDEMPOTENCY_PARAMETER, idempotency_key
from service.http.problems import Problem
from service.http.schemas import (
    Merge,
    Moved,
    NewLabel,
    Relabel,
    RelabelResult,
    Rename,
    RenameResult,
)

router = APIRouter(prefix="/gallery", tags=["gallery"], route_class=GuardedRoute)


def _label(state, raw: str) -> str:
    return check_label(raw, state.settings.max_label_length)


async def _relabel(request: Request, state, ids: list[int], label: str):
    """Move the live items among `ids` to `label`: (moved [(id, before)], version, replayed)."""
    asked = (label, str(sorted(set(ids))))
    done, found = await keyed_write(
        request, state, "relabel", asked, lambda keyed: state.relabel(ids, label, keyed)
    )
    if found is not None:
        seq, outcome = found
        return [(int(i), old) for i, old in outcome["rows"]], seq, True
    moved, seq = done  # (none live: refused, 404 item_unknown, in keyed_write)
    await state.runtime.sync(seq)  # acknowledged once the model votes with it (or its no-op)
    return [(m.id, m.old) for m in moved], seq, False


@router.patch(
    "/items/{item_id}",
    response_model=RelabelResult,
    responses={404: {"description": "no such live item"}},
    summary="Change one item's label (a correction: durable, in the change log)",
    openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
)
async def relabel_item(request: Request, state: StateDep, item_id: ItemId, body: NewLabel):
    label = _label(state, body.label)
    moved, seq, replayed = await _relabel(request, state, [item_id], label)
    return _answer(
        RelabelResult(relabelled=_moved(moved), label=label, gallery_version=seq), replayed
    )


@router.post(
    "/relabel",
    response_model=RelabelResult,
    responses={404: {"description": "none of the items is live"}},
    summary=f"Move up to {MAX_IDS} items to one label in one write (accepting suggestions)",
    openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
)
async def relabel(request: Request, state: StateDep, body: Relabel):
    label = _label(state, body.label)
    moved, seq, replayed = await _relabel(request, state, body.ids, label)
    return _answer(
        RelabelResult(relabelled=_moved(moved), label=label, gallery_version=seq), replayed
    )


def _moved(moved) -> list[Moved]:
    return [Moved(id=i, previous_label=old) for i, old in moved]


def _answer(out: BaseModel, replayed: bool):
    return JSONResponse(out.model_dump(), headers={REPLAYED: "true"} if replayed else None)


async def _rename(request: Request, state, old: str, new: str, merge: bool):
    op = "merge" if merge else "rename"
    idempotency_key(request, state.settings.idempotency_ttl_s, op)  # (a bad key: 422 first)
    if old == new:
        raise Problem(409, "label_same", f"{old!r} is already called {new!r}: nothing to {op}")
    done, found = await keyed_write(  # (refused: 409 label_exists, 404 label_unknown)
        request, state, op, (old, new), lambda keyed: state.rename(old, new, merge, keyed)
    )
    none = f"no live items with label {old!r}"
    if found is not None:
        seq, outcome = found
        if not outcome["count"]:  # (nothing to move then: answered 404 then)
            raise Problem(404, "label_unknown", none, headers={REPLAYED: "true"})
        out = RenameResult(
            label=new, previous_label=old, count=outcome["count"], gallery_version=seq
        )
        return _answer(out, True)
    moved, seq = done
    if not moved:  # (with a key, that outcome is recorded: a retry is answered 404 too)
        raise Problem(404, "label_unknown", none)
    await state.runtime.sync(seq)
    return RenameResult(label=new, previous_label=old, count=len(moved), gallery_version=seq)


@router.post(
    "/rename",
    response_model=RenameResult,
    responses={
        404: {"description": "the label has no live items"},
        409: {"description": "the new name has items already (merge instead), or is the label"},
    },
    summary="Rename a label (every item moves; another model's index follows on upgrade)",
    openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
)
async def rename(request: Request, state: StateDep, body: Rename):
    old, new = normalize_label(body.label), _label(state, body.to)
    return await _rename(request, state, old, new, merge=False)


@router.post(
    "/merge",
    response_model=RenameResult,
    responses={
        404: {"description": "either label has no live items"},
        409: {"description": "the two labels are one"},
    },
    summary="Merge a label into another that has items (every item moves to it)",
    openapi_extra=access("write", parameters=[IDEMPOTENCY_PARAMETER]),
)
async def merge(request: Request, state: StateDep, body: Merge):
    old, new = normalize_label(body.label), _label(state, body.into)
    return await _rename(request, state, old, new, merge=True)
