"""Every statement the store backends share, written once: `{p}` stands for the driver's
placeholder, which a Dialect fills in (`?` for sqlite3, `%s` for psycopg). What only one backend
can say (SQLite's PRAGMAs, PostgreSQL's FOR UPDATE, LISTEN/NOTIFY, COPY) stays in its module."""

from __future__ import annotations

from dataclasses import dataclass

from embedding.gallery import ITEM_COLUMNS

COLUMNS = ", ".join(ITEM_COLUMNS)


@dataclass(frozen=True)
class Dialect:
    name: str  # a key of embedding.gallery.SQL_TYPES
    param: str  # the driver's placeholder

    def q(self, template: str) -> str:
        """`template` with its {p} placeholders in this dialect."""
        return template.format(p=self.param)


SQLITE = Dialect("sqlite", "?")
POSTGRES = Dialect("postgresql", "%s")

# ---------------------------------------------------------------------------------- meta, log
META = "SELECT key, value FROM meta"
META_KEY = "SELECT value FROM meta WHERE key = {p}"
LAST_SEQ = "SELECT value FROM meta WHERE key = 'last_seq'"
SET_META = "UPDATE meta SET value = {p} WHERE key = {p}"
UPSERT_META = (
    "INSERT INTO meta (key, value) VALUES ({p}, {p}) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)
DELETE_META = "DELETE FROM meta WHERE key = {p}"
# the meta keys a write reads with the counter: the seal of a migration, the standby flag
WRITE_GUARDS = "SELECT key, value FROM meta WHERE key IN ('last_seq', 'carried_to', 'standby')"
LOG_TOKEN = "SELECT token FROM log WHERE seq = {p}"
LOG_SEQS = "SELECT seq FROM log"
# the op of each write after a version (records.kind_of: how a follower applies its rows)
LOG_OPS_AFTER = "SELECT seq, op FROM log WHERE seq > {p}"
INSERT_LOG = "INSERT INTO log (seq, op, items, at, token) VALUES ({p}, {p}, {p}, {p}, {p})"
# the writes after a version, as (id, label, source, embedding, add_seq, deleted_seq, world)
# (sorted outside the union: with ORDER BY on the compound itself SQLite walked every row of
# items in id order twice, embeddings included, instead of its two seq indexes: ~30 ms a
# follow at 55,000 trained items, paid by every process after every write; the plan is tested)
CHANGES = (
    "SELECT * FROM ("
    "SELECT id, label, source, embedding, add_seq, deleted_seq, world FROM items "
    "WHERE add_seq > {p} UNION ALL "
    "SELECT id, label, source, embedding, add_seq, deleted_seq, NULL FROM items "
    "WHERE deleted_seq > {p} AND add_seq <= {p}) AS changes ORDER BY id"
)
# compaction: added items deleted by `upto`, and the log rows before it
COMPACT_ITEMS = "DELETE FROM items WHERE source = 'added' AND deleted_seq <= {p}"
COMPACT_LOG = "DELETE FROM log WHERE seq < {p}"

# ---------------------------------------------------------------------------------- items
LIVE_ITEMS = (
    "SELECT id, label, source, embedding, add_seq, world FROM items "
    "WHERE deleted_seq IS NULL AND add_seq > {p} AND add_seq <= {p} ORDER BY id"
)
DELETED_AFTER = "SELECT id, label, embedding, add_seq FROM items WHERE deleted_seq > {p}"
ITEMS_OF_IDS = (
    "SELECT id, label, source, metadata, thumbnail IS NOT NULL FROM items "
    "WHERE deleted_seq IS NULL AND id IN ({ids})"
)
THUMBNAILS_OF_IDS = (
    "SELECT id FROM items WHERE deleted_seq IS NULL AND thumbnail IS NOT NULL AND id IN ({ids})"
)
ITEM_ROWS = (
    "SELECT id, label, source, metadata, created_at, thumbnail IS NOT NULL FROM items "
    "WHERE deleted_seq IS NULL AND id > {p}"
)
ADDED_ITEMS = (
    f"SELECT {COLUMNS} FROM items WHERE source = 'added' AND deleted_seq IS NULL "
    "AND id > {p} ORDER BY id LIMIT {p}"
)
STORED_OF_IDS = (
    f"SELECT {COLUMNS} FROM items WHERE source = 'added' AND deleted_seq IS NULL "
    "AND id IN ({ids})"
)
SOURCE_KEYS_OF_IDS = "SELECT id, source, metadata FROM items WHERE id IN ({ids})"
LIVE_TRAINED = "SELECT id, metadata FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
LIVE_ADDED_IDS = "SELECT id FROM items WHERE source = 'added' AND deleted_seq IS NULL"
EXISTING_OF_IDS = "SELECT id FROM items WHERE id IN ({ids})"
THUMBNAIL = "SELECT thumbnail FROM items WHERE id = {p} AND deleted_seq IS NULL"
INSERT_ITEM = f"INSERT INTO items ({COLUMNS}, add_seq) VALUES (" + ", ".join(["{p}"] * 11) + ")"
LIVE_OF_LABEL = "SELECT id FROM items WHERE label = {p} AND deleted_seq IS NULL"
LIVE_OF_IDS = (
    "SELECT id, label, embedding, source FROM items WHERE deleted_seq IS NULL AND id IN ({ids})"
)
MARK_DELETED = "UPDATE items SET deleted_seq = {p} WHERE id = {p}"
# corrections (Store.relabel, Store.rename): the live rows they touch, as the gallery needs them
# (id, label, embedding, source, world); a relabel moves the row's add_seq to the write that
# relabelled it, so the followers' CHANGES bring it (a replica that holds the item moves its label)
LIVE_ROWS_OF_IDS = (
    "SELECT id, label, embedding, source, world FROM items "
    "WHERE deleted_seq IS NULL AND id IN ({ids})"
)
LIVE_ROWS_OF_LABEL = (
    "SELECT id, label, embedding, source, world FROM items "
    "WHERE deleted_seq IS NULL AND label = {p} ORDER BY id"
)
SET_LABEL = "UPDATE items SET label = {p}, add_seq = {p} WHERE id = {p} AND deleted_seq IS NULL"
RENAME_LABEL = (
    "UPDATE items SET label = {p}, add_seq = {p} WHERE label = {p} AND deleted_seq IS NULL"
)
# a carry moving the target's copy of an item (only where the label differs: a resumed backfill
# over items the target holds rewrites nothing)
MOVE_LABEL = (
    "UPDATE items SET label = {p}, add_seq = {p} "
    "WHERE id = {p} AND deleted_seq IS NULL AND label <> {p}"
)
LABEL_COUNTS = "SELECT label, COUNT(*) FROM items WHERE deleted_seq IS NULL GROUP BY label"
HAS_LABEL = "SELECT 1 FROM items WHERE label = {p} AND deleted_seq IS NULL LIMIT 1"

# ---------------------------------------------------------------------------------- tombstones
# kind 'label' (name: the label) or 'trained' (name: the JSON [dataset, dataset_index])
UPSERT_TOMBSTONE = (
    "INSERT INTO tombstones (kind, name, seq) VALUES ({p}, {p}, {p}) "
    "ON CONFLICT (kind, name) DO UPDATE SET seq = excluded.seq"
)
TOMBSTONES = "SELECT kind, name, seq FROM tombstones"
# what happened to trained items, in order: a label's (a delete: new NULL; a rename, a merge),
# a trained image's (a relabel, by [dataset, dataset_index]); a carry applies them to the
# target's trained items whichever images its index holds (store/carry.py)
INSERT_LABEL_CHANGE = "INSERT INTO label_changes (seq, kind, name, new) VALUES ({p}, {p}, {p}, {p})"
LABEL_CHANGES_AFTER = (
    "SELECT seq, kind, name, new FROM label_changes WHERE seq > {p} ORDER BY seq, kind, name"
)
TOMBSTONES_AFTER = "SELECT kind, name, seq FROM tombstones WHERE seq > {p}"
# trained items whose label a correction changed (add_seq > 0: a trained row is written by
# the index build with 0, and only a relabel moves it)
RELABELLED_TRAINED = (
    "SELECT metadata, label FROM items "
    "WHERE source = 'trained' AND deleted_seq IS NULL AND add_seq > 0"
)
LIVE_TRAINED_OF_LABEL = (
    "SELECT id FROM items WHERE source = 'trained' AND deleted_seq IS NULL AND label = {p}"
)

# ---------------------------------------------------------------------------------- review queue
INSERT_REVIEW = (
    "INSERT INTO review (id, created_at, embedding, world, thumbnail, image, image_type, "
    "answer, nearest, margin, reason, bytes) VALUES (" + ", ".join(["{p}"] * 12) + ")"
)
REVIEW_ROWS = (
    "SELECT id, created_at, embedding, world, answer, nearest, margin, reason, "
    "thumbnail IS NOT NULL FROM review ORDER BY created_at DESC, id LIMIT {p}"
)
REVIEW_OF_IDS = (
    "SELECT id, created_at, embedding, world, answer, nearest, margin, reason, "
    "thumbnail IS NOT NULL, thumbnail, image, image_type FROM review WHERE id IN ({ids})"
)
REVIEW_THUMBNAIL = "SELECT thumbnail FROM review WHERE id = {p}"
REVIEW_TOTALS = "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM review"
REVIEW_EXPIRED = "DELETE FROM review WHERE created_at < {p}"
REVIEW_OLDEST = "SELECT id, bytes FROM review ORDER BY created_at, id LIMIT {p}"
REVIEW_DELETE = "DELETE FROM review WHERE id IN ({ids})"

# ---------------------------------------------------------------------------------- requests
REQUEST = "SELECT digest, seq, outcome FROM requests WHERE key = {p}"
INSERT_REQUEST = (
    "INSERT INTO requests (key, digest, seq, outcome, at) VALUES ({p}, {p}, {p}, {p}, {p})"
)
UPSERT_REQUEST = INSERT_REQUEST + " ON CONFLICT (key) DO NOTHING"
REQUESTS_SINCE = "SELECT key, digest, seq, outcome, at FROM requests WHERE at >= {p}"
PRUNE_REQUESTS = "DELETE FROM requests WHERE at < {p}"
LOG_TOKENS = "SELECT seq, token FROM log WHERE seq > {p} AND seq <= {p}"

CHUNK = 500  # ids per IN (...) list: SQLite caps the number of bound parameters


def ids_in(dialect: Dialect, template: str, ids: list[int]) -> str:
    """`template` with its {ids} list of len(ids) placeholders."""
    return dialect.q(template.replace("{ids}", ", ".join(["{p}"] * len(ids))))


def item_rows_query(dialect: Dialect, label: str | None, item_id: int | None) -> str:
    """A page of GET /gallery/items: ITEM_ROWS, narrowed to a label or an id, in id order."""
    sql = ITEM_ROWS
    if label is not None:
        sql += " AND label = {p}"
    if item_id is not None:
        sql += " AND id = {p}"
    return dialect.q(sql + " ORDER BY id LIMIT {p}")
