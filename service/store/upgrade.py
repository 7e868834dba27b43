"""The alias ending of the carry engine (service/store/carry.py): another model's gallery built
beside the live one while it keeps serving, then made live by switching the alias, and back
(snca-gallery upgrade / rollback). Works on any Store backend.

- One carry or switch at a time per home store, across processes and hosts: the backend's
  `carry_lock` (SQLite: an flock beside the home store; PostgreSQL: a session advisory lock),
  held from before the live gallery is read until the alias is set.
- The target gallery (galleries.py: a sibling of the home store, seeded with the new index's
  trained items) is on standby from its creation: servers of the new model serve it read-only
  (writes 503, /readyz 503 `standby`) while the engine carries into it. Every gallery but the
  live one is on standby; a run that finds one that is not puts it there, saying so.
- The switch, fenced by the alias's epoch (how many switches made a gallery live):
    1. the seal: inside a write transaction of the live gallery S, which must not be on standby
       and must have become live at the alias's epoch E (else another switch moved on: refused),
       the last writes are carried, S goes on standby naming T and epoch E+1, and S records
       where a carry back starts: T's head at that moment (T is on standby: only this run
       writes it), so that every write T acknowledges once live is carried back by a rollback;
    2. the promotion: T's standby lifted and its LIVE_EPOCH set to E+1, with a log row its
       servers follow;
    3. the alias set to T at epoch E+1, only if it is still at E.
  A run killed between 1 and 3 leaves S sealed for T: the next run (whatever its target)
  finishes that switch first (`settle`), so a live gallery always exists and no write is ever
  taken by two galleries. A seal for a gallery that is gone is taken back.
- Rollback is the same switch the other way: the old gallery follows the new one's writes from
  the point its seal recorded (re-embedded by the old model), then takes writes again.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from embedding.errors import ArtifactError
from embedding.gallery import STORE_ID, utc_now
from service.store import migration
from service.store.base import Store
from service.store.carry import Carry, CarryState, Embed, Side, state_key
from service.store.galleries import (
    LIVE_EPOCH,
    alias,
    epoch_of,
    home_gen,
    register,
    registry,
    set_alias,
)
from service.store.records import CARRIED_TO, STANDBY


class Galleries:
    """The galleries of one home store (`home_target`, opened as `home` by backend `cls`)."""

    def __init__(self, cls, home_target: str, home: Store):
        self.cls, self.home_target, self.home = cls, str(home_target), home
        self._open: list[Store] = []

    def close(self) -> None:
        for s in reversed(self._open):
            with contextlib.suppress(Exception):
                s.close()
        self._open.clear()

    def reopen_home(self) -> None:
        """The home store again (a start-up swap put another file in its place)."""
        from service.store.registry import open_as_found

        with contextlib.suppress(Exception):
            self.home.close()
        self.home = open_as_found(self.home_target)

    def lock(self, say: Callable[[str], None]):
        return self.cls.carry_lock(self.home_target, say)

    def target_of(self, gen: str) -> str:
        """Where the gallery `gen` lives: the home store, or its sibling."""
        return (
            self.home_target
            if gen == home_gen(self.home)
            else self.cls.sibling(self.home_target, gen)
        )

    def exists(self, gen: str) -> bool:
        return self.cls.exists(self.target_of(gen))

    def open(self, gen: str) -> Store:
        """The gallery `gen` as it is (closed with the others by close())."""
        from service.store.registry import open_as_found

        if gen == home_gen(self.home):
            return self.home
        s = open_as_found(self.target_of(gen))
        self._open.append(s)
        return s

    def live(self) -> tuple[str, int]:
        """(the live gallery's gen, the alias's epoch)."""
        a = alias(self.home)
        return (a["gen"] if a else home_gen(self.home)), epoch_of(a)


@dataclass
class To:
    """A gallery to carry into: its gen, registry entry and how to open (seed) its store."""

    gen: str
    info: dict
    # its store, created from its index's seed if new, with these meta rows from the start
    open: Callable[[dict[str, str]], Store]


def _standby(live: str, fingerprint: str | None) -> str:
    return json.dumps({"gen": live, "model_fingerprint": fingerprint})


def _flag(store: Store, live: str, fingerprint: str | None) -> None:
    flag = _standby(live, fingerprint)
    store.plain(lambda c: store.set_meta(c, STANDBY, flag))


def promote(store: Store, epoch: int) -> None:
    """Make `store` the live gallery at `epoch`: its standby lifted (a log row its servers
    follow) and LIVE_EPOCH recorded; nothing when that was done already."""
    m = store.meta()
    if STANDBY not in m and int(m.get(LIVE_EPOCH, 0)) == epoch:
        return

    def fn(conn, seq):
        store.set_meta(conn, STANDBY, None)
        store.set_meta(conn, LIVE_EPOCH, str(epoch))

    store.transaction(fn, "promote")


def settle(g: Galleries, say: Callable[[str], None]) -> str:
    """Under the lock: finish a switch that a killed run began (the live gallery sealed for
    another: that one made live, the alias moved), or take back a seal whose target is gone;
    then put every other registered gallery that is not on standby there (a first run that
    died before flagging its target, or a store written by an older version). The live gen."""
    if CARRIED_TO in g.home.meta():  # a start-up migration sealed it, not yet swapped
        g.close()  # (the swap waits until no connection has the sealed store open: ours too)
        g.home.close()
        data = g.cls.swap_dir(g.home_target)
        if data is not None and migration.finish_swap(data, say):
            say(f"finished the swap of a start-up migration of {g.home_target}")
        g.reopen_home()
    live, epoch = g.live()
    s = g.open(live)
    flag = s.meta().get(STANDBY)
    if flag is not None:
        pending = json.loads(flag).get("gen")
        if pending and pending != live and g.exists(pending):
            promote(g.open(pending), epoch + 1)
            set_alias(g.home, pending, live, epoch + 1, epoch)
            say(f"finished the switch from {live} to {pending} that an earlier run began")
            live, epoch = pending, epoch + 1
        else:
            promote(s, epoch)  # sealed for a gallery that is gone: nothing wrote it
            say(f"{live} was sealed for a switch to a missing gallery: it takes writes again")
    for gen in registry(g.home):
        if gen != live and g.exists(gen):
            other = g.open(gen)
            if STANDBY not in other.meta():
                _flag(other, live, None)
                say(
                    f"warning: {gen} was not on standby although {live} is live; it is now "
                    "(writes it took on its own are not in the live gallery: snca-gallery "
                    "galleries lists both)"
                )
    return live


def prepare(g: Galleries, to: To, live: str, live_fingerprint: str | None) -> Store:
    """The target's store: created (seeded) if new, on standby from its creation (and, found
    without the flag, flagged before it is registered: servers find it by the registry)."""
    store = to.open({STANDBY: _standby(live, live_fingerprint)})
    if STANDBY not in store.meta():
        _flag(store, live, live_fingerprint)
    register(g.home, to.gen, to.info)
    return store


def carry_into(
    g: Galleries,
    live: str,
    target: Store,
    to: To,
    embed: Embed | None,
    batch: int = 64,
    say: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Carry, dict]:
    """Carry the live gallery into `target` (begin, backfill, catch up): (the carry, its state)."""
    source = g.open(live)
    carry = Carry(
        Side(source, live, registry(g.home).get(live, {})),
        Side(target, to.gen, to.info),
        embed,
        batch,
        say,
        progress,
    )
    carry.discard_hint = (
        f"remove the gallery {to.gen} ({g.target_of(to.gen)}) and run the command again"
        if to.gen != home_gen(g.home)
        else "it is the home store: restore it from a backup instead"
    )
    st = carry.begin()
    carry.backfill(st)
    carry.catch_up(st)
    return carry, st


def switch(g: Galleries, carry: Carry, st: CarryState, say: Callable[[str], None] = print) -> dict:
    """Make the carry's target the live gallery (see the module docstring); the alias."""
    src, tgt = carry.source, carry.target
    live, epoch = g.live()
    if live != src.gen:
        raise ArtifactError(f"the live gallery is {live}, not {src.gen}: nothing switched")
    carry.catch_up(st)
    t0 = time.perf_counter()

    def ending(conn, seq, read):
        rows = read(src.store.dialect.q("SELECT value FROM meta WHERE key = {p}"), (LIVE_EPOCH,))
        have = int(rows[0][0]) if rows else 0
        if have != epoch:
            raise ArtifactError(
                f"{src.gen} became live at epoch {have}, but the alias is at epoch {epoch}: "
                "another switch ran; nothing switched"
            )
        t_seq = tgt.store.last_seq()  # (on standby: only this run writes it)
        back = CarryState(
            source_seq=t_seq,
            source_store=tgt.store.meta().get(STORE_ID),
            token=tgt.store.log_token(t_seq) if t_seq > 0 else None,
            backfilled=True,
            started_at=utc_now(),
            target_seq=seq,  # (this seal's write: the gallery it describes)
        )
        src.store.set_meta(conn, state_key(tgt.gen), back.encode())
        sealed = {
            "gen": tgt.gen,
            "model_fingerprint": tgt.info.get("model_fingerprint"),
            "epoch": epoch + 1,
            "at": utc_now(),
        }
        src.store.set_meta(conn, STANDBY, json.dumps(sealed, sort_keys=True))

    carry.seal(st, ending, "switch")
    say(f"writes paused for {time.perf_counter() - t0:.2f} s while switching")
    promote(tgt.store, epoch + 1)
    return set_alias(g.home, tgt.gen, src.gen, epoch + 1, epoch)


@dataclass
class Outcome:
    """What a run did: the target's gen (None: nothing to do), the carry, its state, the alias
    after a switch."""

    gen: str | None
    live: str
    carry: Carry | None = None
    state: CarryState | None = None
    alias: dict | None = None


def run(
    g: Galleries,
    resolve: Callable[[Galleries, str], tuple[To, Embed | None] | None],
    switch_after: bool,
    batch: int = 64,
    say: Callable[[str], None] = print,
    progress: Callable[[int, int], None] | None = None,
    live_fingerprint: str | None = None,
) -> Outcome:
    """One upgrade (or rollback) under the home store's carry lock: settle what a killed run
    left, `resolve(g, live)` the target (its To and the Embed of its model; None: nothing to
    do), carry the live gallery into it, and with `switch_after` make it live."""
    with g.lock(say):
        live = settle(g, say)
        got = resolve(g, live)
        if got is None:
            return Outcome(None, live)
        to, embed = got
        if to.gen == live:
            say(f"the gallery {to.gen} is the live one already: nothing to do")
            return Outcome(None, live)
        fp = live_fingerprint or registry(g.home).get(live, {}).get("model_fingerprint")
        target = prepare(g, to, live, fp)
        g._open.append(target)
        carry, st = carry_into(g, live, target, to, embed, batch, say, progress)
        a = switch(g, carry, st, say) if switch_after else None
        return Outcome(to.gen, live, carry, st, a)


def open_galleries(cls, home_target: str) -> Galleries:
    from service.store.registry import open_as_found

    return Galleries(cls, home_target, open_as_found(home_target))
