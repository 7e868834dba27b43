"""The PostgreSQL gallery store: the system of record for replicas on several hosts.

    snca-serve --store postgresql://USER@HOST:PORT/DB      (or SNCA_STORE; psycopg 3)

Same tables as the SQLite store (embedding/gallery.py: meta, items, log) and the same interface
(service/store/base.py's Store). One database holds one gallery.

- Gap-free seq in commit order: a write locks the counter row (meta 'last_seq', SELECT ... FOR
  UPDATE) first, so writers run one after another and a later seq can never commit before an
  earlier one (a PostgreSQL SEQUENCE gives neither: numbers are taken outside the transaction
  and commit in any order).
- Followers: every write NOTIFYs `snca_gallery` with its seq (delivered at commit); a replica
  LISTENs on its own connection and also polls the head every second, so a lost notification
  (a dropped connection) costs at most a second.
- Seeding: against an empty database the first process copies the index dir's store in one
  transaction under a transaction-level advisory lock; processes that start at the same moment
  wait on the lock and then find the gallery there (exactly once).
- The server unreachable: every call raises StoreUnavailable (writes answer 503, reads of
  the in-memory gallery go on); the next call reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from embedding.errors import ArtifactError
from embedding.gallery import (
    ADDED_COLUMNS,
    ITEM_COLUMNS,
    LABEL_CHANGES_FROM_TOMBSTONES,
    READABLE_SCHEMAS,
    SQL_TYPES,
    STORE_ID,
    STORE_SCHEMA_VERSION,
    added_table_statements,
    new_token,
    schema_statements,
    utc_now,
)
from service.store import base, records, sql
from service.store.base import Store, StoreReader
from service.store.records import ChangeSet
from service.store.url import is_postgres_url

D = sql.POSTGRES

log = logging.getLogger("snca.store")

CHANNEL = "snca_gallery"
SEED_LOCK = 0x736E6361  # pg_advisory_xact_lock key ("snca")
CARRY_LOCK = 0x736E6363  # pg_advisory_lock key of carries and switches ("sncc")
TURNS_LOCK = 0x736E6374  # pg_advisory_xact_lock(key, what) of Store._take_turns ("snct")
CONNECT_TIMEOUT_S = 3


def _secret(name: str) -> bool:
    """A connection parameter whose value is a secret (password, sslpassword, ...)."""
    return "pass" in name.lower()


def redact(url: str) -> str:
    """The URL without any secret (for logs, errors and /readyz): the password of its user
    part and of every query parameter that carries one (`?password=`, `?sslpassword=`, which
    libpq accepts too) become ***; a URL that cannot be parsed is shown as its scheme only."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return url.split("://", 1)[0] + "://***"
    netloc = u.netloc
    if u.password is not None:
        netloc = f"{u.username}:***@" + (f"[{host}]" if ":" in host else host) + port
    query = "&".join(
        f"{k}={'***' if _secret(k) else v}" for k, v in parse_qsl(u.query, keep_blank_values=True)
    )
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def secrets(url: str) -> list[str]:
    """Every secret in a URL as it may be echoed back (raw and percent-decoded)."""
    out = []
    try:
        u = urlsplit(url)
        if u.password:
            out += [u.password, unquote(u.password)]
        out += [v for k, v in parse_qsl(u.query, keep_blank_values=True) if _secret(k) and v]
        out += [
            m.split("=", 1)[1]
            for m in u.query.split("&")
            if "=" in m and _secret(m.split("=", 1)[0]) and m.split("=", 1)[1]
        ]
    except ValueError:
        pass
    return sorted({x for x in out if x}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (a driver's error message, say) with the URL and every secret in it hidden."""
    text = text.replace(url, redact(url))
    for x in secrets(url):
        text = text.replace(x, "***")
    return text


def _driver():
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise ArtifactError(
            "a postgresql:// store needs psycopg 3: pip install 'psycopg[binary]'"
        ) from None
    return psycopg


class PostgresStore(Store):
    """The Store interface over PostgreSQL (see the module docstring)."""

    default_poll_s = 1.0  # LISTEN/NOTIFY wakes followers; this is only the fallback
    dialect = D
    read_only: str | None = None  # a database is never on a read-only filesystem

    @classmethod
    def claims(cls, target) -> bool:
        return is_postgres_url(target)

    def __init__(
        self,
        url: str,
        seed: Path | None,
        model_fingerprint: str,
        index_id: str,
        seed_meta: dict[str, str] | None = None,
        _conn=None,
    ):
        """SqliteStore.__init__, on the database (schema) `url` (`_conn`: a connection to it
        that the store takes, from as_found)."""
        self.psycopg = _driver()
        url = str(url)
        self._dsn = url
        self.url = redact(url)
        self._lock = threading.Lock()
        self._conn = _conn
        self._follow_lock = threading.Lock()
        self._listen = None
        self._closing = False
        try:
            try:
                self._seed_once(seed, seed_meta or {})
                self._upgrade()
                meta = self.meta()
            except records.StoreUnavailable as e:
                raise ArtifactError(f"cannot use the gallery store {self.url}: {e}") from None
            self._take(
                meta, model_fingerprint, index_id,
                other_model="build this model's gallery beside it first (snca-gallery upgrade "
                "--to THIS_RUN_DIR), or use a new database",
                new_place="a new database",
            )  # fmt: skip
            if meta.get("schema_version") != str(STORE_SCHEMA_VERSION):
                raise ArtifactError(
                    f"gallery store {self.url} has schema {meta.get('schema_version')}; this "
                    f"version reads {STORE_SCHEMA_VERSION}"
                )
        except BaseException:
            self._drop()  # (a store refused here is never closed by its caller)
            raise

    # ------------------------------------------------------------------ as found (tools)
    @classmethod
    def sibling(cls, home, gen: str) -> str:
        """Another model's gallery `gen` beside the home database's: the same database, schema
        snca_<gen> (named in the URL's `options`, which libpq passes to the server)."""
        u = urlsplit(str(home))
        query = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True) if k != "options"]
        query.append(("options", f"-csearch_path=snca_{gen}"))
        return urlunsplit((u.scheme, u.netloc, u.path, urlencode(query), u.fragment))

    @classmethod
    def exists(cls, target) -> bool:
        conn = cls._connect_to(str(target), autocommit=True)
        try:
            return cls._holds_gallery(conn)
        finally:
            conn.close()

    @classmethod
    @contextlib.contextmanager
    def carry_lock(cls, home, waiting=None, blocking: bool = True):
        """One carry or switch at a time among the galleries of the database `home` (a
        session advisory lock on a connection of its own, held until this returns; the server
        lets go of it when the connection dies with its process). `waiting(why)` is told
        when another session holds it."""
        conn = cls._connect_to(str(home), autocommit=True)
        try:
            conn.execute(
                "SELECT set_config('application_name', %s, false)",
                (f"snca-carry pid {os.getpid()}",),
            )
            told = False
            while not conn.execute("SELECT pg_try_advisory_lock(%s)", (CARRY_LOCK,)).fetchone()[0]:
                if not blocking:
                    yield False
                    return
                if not told and waiting is not None:
                    row = conn.execute(
                        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                        "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.objid = %s "
                        "AND l.granted",
                        (CARRY_LOCK,),
                    ).fetchone()
                    who = row[0] if row and row[0] else "another session"
                    waiting(f"waiting for another carry or switch of {redact(str(home))} ({who})")
                    told = True
                time.sleep(0.5)
            yield True
        finally:
            conn.close()  # (the session's lock goes with it)

    @classmethod
    def _connect_to(cls, url: str, autocommit: bool):
        psycopg = _driver()
        try:
            return psycopg.connect(
                url,
                autocommit=autocommit,
                connect_timeout=CONNECT_TIMEOUT_S,
                client_encoding="UTF8",
            )
        except psycopg.Error as e:
            raise ArtifactError(f"cannot reach {redact(url)}: {scrub(_one_line(e), url)}") from None

    @classmethod
    def _holds_gallery(cls, conn) -> bool:
        return (
            conn.execute(
                "SELECT 1 FROM information_schema.tables WHERE table_name = 'meta' "
                "AND table_schema = current_schema()"
            ).fetchone()
            is not None
        )

    @classmethod
    def as_found(cls, target) -> PostgresStore:
        """Store.as_found on one connection: the meta is read on the connection the store then
        keeps (a new connection is a new server process: the carry and the tools open a store
        for each step)."""
        conn = cls._connect_to(str(target), autocommit=True)
        try:
            meta = cls._meta_on(conn, target)
            conn.autocommit = False  # (as _connect makes the store's own)
        except BaseException:
            conn.close()
            raise
        fp, ix = meta.get("model_fingerprint", ""), meta.get("index_id", "")
        return cls(target, None, fp, ix, _conn=conn)

    @classmethod
    def meta_of(cls, target) -> dict[str, str]:
        conn = cls._connect_to(str(target), autocommit=True)
        try:
            return cls._meta_on(conn, target)
        finally:
            conn.close()

    @classmethod
    def _meta_on(cls, conn, target) -> dict[str, str]:
        """The meta table of the gallery `conn` reaches; ArtifactError when it holds none."""
        if not cls._holds_gallery(conn):
            raise ArtifactError(f"{redact(str(target))} holds no gallery")
        return dict(conn.execute(sql.META).fetchall())

    @classmethod
    def dump(cls, target, dest: Path) -> None:
        """A consistent copy of the gallery in the database at `target` into the new SQLite
        file `dest`: every table read in one REPEATABLE READ, READ ONLY transaction."""
        from service.store.backup import copy_rows, new_sqlite

        url = str(target)
        conn = cls._connect_to(url, autocommit=True)
        try:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if not cls._holds_gallery(conn):
                raise ArtifactError(f"{redact(url)} holds no gallery")
            with new_sqlite(dest) as out:

                def write(table, cols, rows):
                    marks = ", ".join("?" * len(cols))
                    out.executemany(
                        f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})",
                        [
                            tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                            for r in rows
                        ],
                    )

                copy_rows(conn, D, write)
        except _driver().Error as e:
            raise ArtifactError(f"cannot copy {redact(url)}: {scrub(_one_line(e), url)}") from None
        finally:
            conn.close()

    @classmethod
    def swap_dir(cls, home) -> None:
        """SqliteStore.swap_dir: a database is never swapped by a start-up migration."""
        return None

    @classmethod
    def leftovers(cls, target) -> list[str]:
        """Other models' galleries in the database `target` (schemas snca_<gen> holding one)."""
        conn = cls._connect_to(str(target), autocommit=True)
        try:
            rows = conn.execute(
                "SELECT table_schema FROM information_schema.tables WHERE table_name = 'meta' "
                "AND table_schema LIKE 'snca\\_%' ORDER BY 1"
            ).fetchall()
        finally:
            conn.close()
        return [r[0] for r in rows]

    @classmethod
    def discard(cls, target, found: list[str], stamp: str) -> list[str]:
        """Rename the schemas `found` to discarded_STAMP_<gen> (kept, never dropped); the new
        names."""
        conn = cls._connect_to(str(target), autocommit=False)
        out = []
        try:
            with conn.transaction():
                for schema in found:
                    new = f"discarded_{stamp}_{schema.removeprefix('snca_')}"[:63]
                    conn.execute(f'ALTER SCHEMA "{schema}" RENAME TO "{new}"')
                    out.append(new)
        finally:
            conn.close()
        return out

    @classmethod
    def load(cls, target, src: Path, check) -> None:
        """Restore the SQLite store file `src` into the database at `target`, which must hold
        no gallery: one transaction (under the seed lock) creates the tables, copies every row,
        runs check(conn, dialect) and only then commits."""
        from service.store.backup import copy_rows

        url = str(target)
        conn = cls._connect_to(url, autocommit=False)
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (SEED_LOCK,))
                if cls._holds_gallery(conn):
                    raise ArtifactError(
                        f"{redact(url)} already holds a gallery: restore into an empty database"
                    )
                for stmt in schema_statements("postgresql"):
                    conn.execute(stmt)
                s = sqlite3.connect(f"file:{src}?mode=ro&immutable=1", uri=True)
                try:

                    def write(table, cols, rows):
                        with conn.cursor().copy(
                            f"COPY {table} ({', '.join(cols)}) FROM STDIN"
                        ) as copy:
                            for row in rows:
                                copy.write_row(row)

                    copy_rows(s, sql.SQLITE, write)
                finally:
                    s.close()
                check(conn, D)
        except _driver().Error as e:
            raise ArtifactError(
                f"cannot restore into {redact(url)}: {scrub(_one_line(e), url)}"
            ) from None
        finally:
            conn.close()

    # ------------------------------------------------------------------ connections
    def _connect(self, autocommit: bool = False):
        try:
            # UTF-8 on the wire whatever the database's encoding: psycopg returns text as
            # bytes from a SQL_ASCII database (initdb under the C locale makes one)
            return self.psycopg.connect(
                self._dsn,
                autocommit=autocommit,
                connect_timeout=CONNECT_TIMEOUT_S,
                client_encoding="UTF8",
            )
        except self.psycopg.Error as e:
            raise records.StoreUnavailable(
                f"cannot reach the gallery store {self.url}: {self._say(e)}"
            ) from None

    def _run(self, fn):
        """fn(conn) in a transaction on the shared connection (reconnecting once it broke);
        records.StoreUnavailable on any database error."""
        with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            ran = False  # fn returned: an error now is the commit's (its outcome unknown)
            try:
                with self._conn.transaction():
                    out = fn(self._conn)
                    ran = True
                return out
            except self.psycopg.Error as e:
                # a lost connection is dropped (the next call reconnects); so is one whose
                # commit failed, of any kind: its outcome is unknown to the caller
                if ran or isinstance(e, self.psycopg.OperationalError):
                    self._drop()
                if ran:
                    raise records.CommitUnknown(
                        f"the gallery store {self.url} failed while committing: {self._say(e)}"
                    ) from None
                raise records.StoreUnavailable(
                    f"the gallery store {self.url} failed: {self._say(e)}"
                ) from None

    def _drop(self) -> None:
        try:
            if self._conn is not None:
                self._conn.close()
        finally:
            self._conn = None

    def _seed_once(self, seed: Path | None, extra: dict[str, str]) -> None:
        schema = schema_of(self._dsn)

        def fn(conn):
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SEED_LOCK,))
            if schema is not None:  # a sibling gallery (galleries.py): its schema first
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            exists = conn.execute(
                "SELECT 1 FROM information_schema.tables WHERE table_name = 'meta' "
                "AND table_schema = current_schema()"
            ).fetchone()
            if exists:
                return False
            if seed is None:
                raise ArtifactError(f"the gallery store {self.url} is empty and no seed was given")
            for stmt in schema_statements("postgresql"):
                conn.execute(stmt)
            n = _copy_seed(conn, seed, extra)
            log.info("seeded the gallery store", extra={"fields": {"store": self.url, "items": n}})
            return True

        self._run(fn)

    def _say(self, e: Exception) -> str:
        """A driver error in one line, without the URL's secrets (some echo the URL)."""
        return scrub(_one_line(e), self._dsn)

    def _upgrade(self) -> None:
        """Bring a database written by an older version to this schema (once, under the seed
        lock: replicas starting together upgrade it one at a time)."""

        def fn(conn):
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SEED_LOCK,))
            row = conn.execute(D.q(sql.META_KEY), ("schema_version",)).fetchone()
            if row is None or row[0] == str(STORE_SCHEMA_VERSION):
                return
            if row[0] not in READABLE_SCHEMAS:  # a newer version's: never "upgraded" down
                raise ArtifactError(
                    f"gallery store {self.url} has schema {row[0]}, which this version cannot "
                    f"read (it reads {', '.join(READABLE_SCHEMAS)}): a newer version wrote it"
                )
            # each column the database lacks (columns are only ever added)
            for table, column, type_ in ADDED_COLUMNS:
                conn.execute(
                    f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} "
                    + type_.format(**SQL_TYPES[D.name])
                )
            for stmt in added_table_statements(D.name):  # each table the database lacks
                conn.execute(stmt)
            conn.execute(LABEL_CHANGES_FROM_TOMBSTONES)
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
                (STORE_ID, new_token()),
            )
            conn.execute(D.q(sql.SET_META), (str(STORE_SCHEMA_VERSION), "schema_version"))

        self._run(fn)

    def select(self, query: str, params: tuple | list = ()) -> list[tuple]:
        return self._run(lambda c: c.execute(query, params).fetchall())

    def retire(self, why: str) -> None:  # pragma: no cover - no migration on PostgreSQL yet
        self.close()

    def reader(self) -> StoreReader:
        """SqliteStore.reader: one REPEATABLE READ, READ ONLY transaction on its own
        connection."""
        conn = self._connect(autocommit=True)
        try:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            conn.execute("SELECT 1 FROM meta LIMIT 1").fetchone()  # the snapshot starts here
        except self.psycopg.Error as e:
            conn.close()
            raise records.StoreUnavailable(
                f"the gallery store {self.url} failed: {self._say(e)}"
            ) from None
        return StoreReader(conn, D)

    # ------------------------------------------------------------------ reads
    # ------------------------------------------------------------------ the log (followers)
    def _listener(self):
        if self._listen is None or self._listen.closed or self._listen.broken:
            conn = self._connect(autocommit=True)
            conn.execute(f"LISTEN {CHANNEL}")
            self._listen = conn
        return self._listen

    def _follow(self, fn):
        with self._follow_lock:
            try:
                return fn(self._listener())
            except self.psycopg.Error as e:
                if self._listen is not None:
                    self._listen.close()
                    self._listen = None
                raise records.StoreUnavailable(
                    f"the gallery store {self.url} failed: {self._say(e)}"
                ) from None

    def head(self) -> int:
        return self._follow(lambda c: int(c.execute(sql.LAST_SEQ).fetchone()[0]))

    def wait_head(self, after: int, timeout: float) -> int:
        """The head once a NOTIFY says it moved past `after`, or after `timeout` seconds."""

        def fn(conn):
            h = int(conn.execute(sql.LAST_SEQ).fetchone()[0])
            if h > after:
                return h
            # in slices of at most a second, so that close() never waits a whole long poll
            end = time.monotonic() + timeout
            while not self._closing and (left := end - time.monotonic()) > 0:
                if list(conn.notifies(timeout=min(left, 1.0), stop_after=1)):
                    break  # (the seq it carries is re-read below: several may have come)
            return int(conn.execute(sql.LAST_SEQ).fetchone()[0])

        return self._follow(fn)

    def changes_after(self, after: int) -> ChangeSet:
        """Every write after `after`, in seq order, from one REPEATABLE READ snapshot. Read on
        the store's own connection, not the listening one: a follower thread waits on that one
        (wait_head) for up to a second at a time, and a reader that must catch up now (the
        model process before answering a write's sync) would wait behind it, or starve."""

        def fn(conn):  # (in the transaction _run began: its isolation set before any query)
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            meta = dict(
                conn.execute(
                    "SELECT key, value FROM meta WHERE key IN ('last_seq', 'log_floor', 'standby')"
                ).fetchall()
            )
            rows = conn.execute(D.q(sql.CHANGES), (after, after, after)).fetchall()
            ops = dict(conn.execute(D.q(sql.LOG_OPS_AFTER), (after,)).fetchall())
            return meta, rows, ops

        meta, rows, ops = self._run(fn)  # (records.vec reads psycopg's memoryviews as they are)
        return ChangeSet(
            int(meta["last_seq"]),
            int(meta.get("log_floor", 0)),
            records.changes_from_rows(rows, after, ops),
            standby=meta.get(records.STANDBY),
        )

    def log_gaps(self) -> tuple[int, int, list[int]]:
        def fn(c):
            meta = dict(c.execute(sql.META).fetchall())
            have = {r[0] for r in c.execute(sql.LOG_SEQS).fetchall()}
            return meta, have

        return base.gaps(*self._run(fn))

    def compact(self, upto: int) -> int:
        """As SqliteStore.compact: forget the history up to write `upto`."""

        def fn(c):
            n = c.execute(D.q(sql.COMPACT_ITEMS), (upto,)).rowcount
            c.execute(D.q(sql.COMPACT_LOG), (upto,))
            c.execute(
                "UPDATE meta SET value = GREATEST(value::bigint, %s)::text WHERE key = 'log_floor'",
                (upto,),
            )
            return n

        return self._run(fn)

    # ------------------------------------------------------------------ writes
    def unwritable(self) -> str | None:
        return None  # known only by trying: a failed write raises records.StoreUnavailable

    def transaction(self, fn, op: str = "migrate", count=lambda result: 0):
        """fn(conn, seq) with the next seq, its log row (a new token) and a NOTIFY, in one
        transaction; fn raising records.NothingChanged(result) rolls back: (0, result)."""

        def run(conn):
            # the counter row locked first: writers (and a switch) run one after another
            conn.execute("SELECT value FROM meta WHERE key = 'last_seq' FOR UPDATE").fetchone()
            base.guard_write(dict(conn.execute(sql.WRITE_GUARDS).fetchall()), op)
            seq = int(conn.execute(sql.LAST_SEQ).fetchone()[0]) + 1
            result = fn(conn, seq)
            conn.execute(D.q(sql.SET_META), (str(seq), "last_seq"))
            conn.execute(D.q(sql.INSERT_LOG), (seq, op, int(count(result)), utc_now(), new_token()))
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(seq)))
            return seq, result

        try:
            return self._run(run)
        except records.NothingChanged as e:  # (the transaction block rolled back)
            return 0, e.args[0] if e.args else None

    def plain(self, fn):
        """fn(conn) in one transaction with no seq and no log row (SqliteStore.plain)."""
        return self._run(fn)

    def _take_turns(self, conn, what: str) -> None:
        """Store._take_turns: a transaction-level advisory lock of `what` in this gallery's
        schema (READ COMMITTED transactions of two fronts otherwise each count the queue
        without the other's rows and both keep it past its bound)."""
        conn.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(current_schema() || %s))",
            (TURNS_LOCK, what),
        )

    def _next_ids(self, conn, n: int) -> list[int]:
        row = conn.execute("SELECT value FROM meta WHERE key = 'next_id' FOR UPDATE").fetchone()
        conn.execute(D.q(sql.SET_META), (str(int(row[0]) + n), "next_id"))
        return list(range(int(row[0]), int(row[0]) + n))

    def _mark_deleted(self, conn, seq, ids, label):
        if label is not None:
            where, arg = "label = %s", label
        else:
            where, arg = "id = ANY(%s)", [int(i) for i in ids or []]
        rows = conn.execute(
            f"UPDATE items SET deleted_seq = %s WHERE deleted_seq IS NULL AND {where} "
            "RETURNING id, label, embedding, source",
            (seq, arg),
        ).fetchall()
        return [(r[0], r[1], records.vec(r[2]), r[3]) for r in sorted(rows)]

    def close(self) -> None:
        self._closing = True
        with self._lock:
            self._drop()
        with self._follow_lock:
            if self._listen is not None:
                self._listen.close()
                self._listen = None


def _copy_seed(conn, seed: Path, extra: dict[str, str]) -> int:
    """Copy an index dir's SQLite store (meta and items) into the new tables; the row count."""
    src = sqlite3.connect(f"file:{seed}?mode=ro", uri=True)
    try:
        meta = dict(src.execute("SELECT key, value FROM meta"))
        n = 0
        have = {r[1] for r in src.execute("PRAGMA table_info(items)")}
        # (an index dir built before a column existed: its trained items have none)
        cols = ", ".join(c if c in have else f"NULL AS {c}" for c in ITEM_COLUMNS)
        with conn.cursor().copy(
            f"COPY items ({sql.COLUMNS}, add_seq, deleted_seq) FROM STDIN"
        ) as copy:
            for row in src.execute(f"SELECT {cols}, add_seq, deleted_seq FROM items ORDER BY id"):
                copy.write_row(row)
                n += 1
    finally:
        src.close()
    meta.update(
        schema_version=str(STORE_SCHEMA_VERSION),
        log_floor=meta.get("last_seq", "0"),
        seeded_at=utc_now(),
        **{STORE_ID: new_token()},  # (this gallery's own identity)
        **extra,
    )
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO meta (key, value) VALUES (%s, %s)", sorted(meta.items()))
    return n


def schema_of(url: str) -> str | None:
    """The schema a sibling gallery's URL names (`options=-csearch_path=snca_<gen>`), else
    None (the database's default schema: the home gallery)."""
    for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if k == "options":
            m = re.fullmatch(r"-c\s*search_path=(snca_[0-9a-z_]+)", v.strip())
            if m:
                return m.group(1)
    return None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
