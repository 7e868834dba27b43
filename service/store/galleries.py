"""Several models' galleries in one store location, and the alias that names the live one.

The home store is what SNCA_STORE / the data dir names (DATA_DIR/gallery.sqlite, or a
PostgreSQL database's default schema). `snca-gallery upgrade` builds another model's gallery
beside it, a sibling:

    SQLite       DATA_DIR/galleries/<gen>/gallery.sqlite   (its own snapshot/ beside it)
    PostgreSQL   schema snca_<gen> of the same database   (snapshots in DATA_DIR/galleries/<gen>/)

where <gen> names the model and index build (gen_of). The home store's meta holds the registry:
`gallery:<gen>` (model fingerprint, index build, run and index dirs) for every gallery, and
`alias:live` (the live gallery's gen, the previous one, when). A server started with a model
serves that model's gallery (home or sibling); only the live one takes writes, the others are on
standby (records.STANDBY) and are kept up to date by `snca-gallery upgrade`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from embedding.gallery import utc_now
from service.store import sql
from service.store.base import Store

ALIAS = "live"
GALLERIES_DIR = "galleries"


def gen_of(fingerprint: str, index_id: str) -> str:
    """A short name for a model and index build, safe in a file name and a SQL identifier."""
    fp = re.sub(r"[^0-9a-z]", "", fingerprint.split(":")[-1].lower())[:12]
    ix = re.sub(r"[^0-9a-z]", "", index_id.lower())[:8]
    return f"{fp}_{ix}"


def gallery_key(gen: str) -> str:
    return f"gallery:{gen}"


def alias_key(name: str = ALIAS) -> str:
    return f"alias:{name}"


def registry(home: Store) -> dict[str, dict]:
    """gen -> the registered gallery (model_fingerprint, index_id, model_dir, index_dir,
    created_at), from the home store's meta."""
    rows = home.select(
        home.dialect.q("SELECT key, value FROM meta WHERE key LIKE {p}"), ("gallery:%",)
    )
    return {k.split(":", 1)[1]: json.loads(v) for k, v in rows}


def alias(home: Store, name: str = ALIAS) -> dict | None:
    """The alias `name` ({gen, previous, epoch, switched_at}) or None (never switched: the home
    gallery is live, epoch 0)."""
    rows = home.select(home.dialect.q(sql.META_KEY), (alias_key(name),))
    return json.loads(rows[0][0]) if rows else None


def home_gen(home: Store) -> str:
    m = home.meta()
    return gen_of(m["model_fingerprint"], m["index_id"])


def live_gen(home: Store) -> str:
    """The gen of the gallery that takes writes: the alias's, else the home store's own."""
    a = alias(home)
    return a["gen"] if a is not None else home_gen(home)


def epoch_of(a: dict | None) -> int:
    """The alias's epoch: how many switches made a gallery live (0: never switched). A
    gallery's meta LIVE_EPOCH says at which epoch it became live; a switch's seal checks that
    its source's is the alias's (the fence: a switch that lost its place writes nothing)."""
    return int((a or {}).get("epoch", 0))


LIVE_EPOCH = "live_epoch"


def register(home: Store, gen: str, info: dict) -> None:
    """Record a gallery in the home store's registry (kept: its first created_at)."""
    have = registry(home).get(gen, {})
    info = {**info, "created_at": have.get("created_at", utc_now())}
    home.plain(lambda c: home.set_meta(c, gallery_key(gen), json.dumps(info, sort_keys=True)))


def register_served(home: Store, gen: str, info: dict) -> bool:
    """A server of the gallery `gen` records which run and index dirs serve it (`info`), when
    that gallery is the home store's own or registered, and the registry does not say yet;
    whether it did."""
    m = home.meta()
    mine = gen_of(m["model_fingerprint"], m["index_id"]) == gen
    if not (mine or gallery_key(gen) in m) or registry(home).get(gen, {}).get("model_dir"):
        return False
    register(home, gen, info)
    return True


class AliasMoved(Exception):
    """The alias is not where this switch found it: another switch ran (the fence)."""


def set_alias(
    home: Store, gen: str, previous: str | None, epoch: int, expect: int, name: str = ALIAS
) -> dict:
    """Point the alias at `gen` with `epoch`, only if it is still at epoch `expect` (or at `gen`
    with `epoch` already: a rerun); AliasMoved otherwise."""
    value = {"gen": gen, "previous": previous, "epoch": epoch, "switched_at": utc_now()}

    def fn(conn):
        row = conn.execute(home.dialect.q(sql.META_KEY), (alias_key(name),)).fetchone()
        have = json.loads(row[0]) if row else None
        if have is not None and have.get("gen") == gen and epoch_of(have) == epoch:
            return have
        if epoch_of(have) != expect:
            raise AliasMoved(
                f"the alias moved to {have.get('gen')} (epoch {epoch_of(have)}) while this switch "
                f"to {gen} ran (it expected epoch {expect})"
            )
        home.set_meta(conn, alias_key(name), json.dumps(value, sort_keys=True))
        return value

    return home.plain(fn)


def sibling_data_dir(data_dir: Path, gen: str) -> Path:
    """The folder of a sibling gallery's snapshots (and, on SQLite, its store file)."""
    return Path(data_dir) / GALLERIES_DIR / gen
