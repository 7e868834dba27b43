"""What kind of store a setting names: a PostgreSQL URL, else a SQLite file (a module of its
own, so that the settings can tell without loading the PostgreSQL backend)."""

from __future__ import annotations

from pathlib import Path


def is_postgres_url(s: str | Path | None) -> bool:
    return s is not None and str(s).startswith(("postgresql://", "postgres://"))
