"""Idempotency-Key on every write route: a write made under a key records its outcome in the
store with it (the same transaction; store/base.py `_keyed`), whatever that outcome was: items
written, nothing to change (a no-op, or a 404: the write then takes a seq of its own and changes
no item), or refused (a 409, a 404: records.Refused). A retry with the key and the same request
is answered with that first outcome (header Idempotent-Replayed: true) once the write is applied
where the model votes, on any replica, after restarts, switches and rollbacks (a carry copies
the records); the key with another request is 422 idempotency_key_reused."""

from __future__ import annotations

import inspect

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from service.http.inputs import IDEMPOTENCY_HEADER, idempotency_key
from service.http.problems import Problem
from service.store.records import Keyed, Refused, Replayed

REPLAYED = "Idempotent-Replayed"  # set on an answer that replays a key's first outcome

# the status of a refusal (records.Refused.code)
REFUSED_STATUS = {"label_exists": 409, "label_unknown": 404, "item_unknown": 404}


def refused(code: str, detail: str, replayed: bool = False) -> Problem:
    """The problem a refused write answers (the same on its replays, marked as such)."""
    return Problem(
        REFUSED_STATUS.get(code, 409),
        code,
        detail,
        headers={REPLAYED: "true"} if replayed else None,
    )


async def replay(state, keyed: Keyed, digest: str, seq: int, outcome: dict, op: str) -> None:
    """A key used before: 422 unless for this very request, else wait until the model process
    applied that first write (as its answer did); a refusal is raised again."""
    if digest != keyed.digest or outcome.get("op") != op:
        raise Problem(
            422,
            "idempotency_key_reused",
            f"this {IDEMPOTENCY_HEADER} was used by another request (gallery version {seq}) "
            "with other content; nothing was changed (use a new key for a new request)",
        )
    await state.runtime.sync(seq)
    if outcome.get("refused"):
        code, detail = outcome["refused"]
        raise refused(code, detail, replayed=True)


async def keyed_write(request: Request, state, op: str, asked: tuple, write):
    """A write under the request's Idempotency-Key (if any): `write(keyed)` unless the key was
    used (in a worker thread; awaited when it is a coroutine function, as an add that embeds
    first); (its result, None), or (None, (seq, outcome)) for a key used before by this very
    request (its first write applied where the model votes: `replay`; 422 for another
    request's key). A refusal (records.Refused) is answered as a problem. `asked`: what the
    request asked (the key's digest)."""
    keyed = idempotency_key(request, state.settings.idempotency_ttl_s, op, *asked)
    found = None
    if keyed is not None:
        found = await run_in_threadpool(state.store.request, keyed.key)
    if found is None:
        try:
            if inspect.iscoroutinefunction(write):
                return await write(keyed), None
            return await run_in_threadpool(write, keyed), None
        except Replayed as e:
            found = (keyed.digest if e.same else "", e.seq, e.outcome)
        except Refused as e:
            raise refused(e.code, str(e)) from None
    await replay(state, keyed, *found, op)
    return None, found[1:]
