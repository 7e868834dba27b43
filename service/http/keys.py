"""API keys and what each may do: `write` (every route) or `read` (the routes that change
nothing). Sources, all at once:

- SNCA_API_KEY (or SNCA_API_KEY_FILE: one key, read at start): a write key, as before scopes;
- SNCA_API_KEYS: entries `SCOPE:KEY` separated by commas or whitespace;
- SNCA_API_KEYS_FILE: the same entries, one per line (`#` comments), re-read when the file
  changes (looked at most once a second), so keys rotate without a restart. Only a whole file
  is applied: one renamed into place (a new inode) at once, one rewritten in place once it has
  not changed for SETTLE_S (a file caught half-written, say with its `write:` line and not yet
  its `read:` line, would open the reads for a moment). A file that turns unreadable or invalid
  keeps the last good keys (logged without any key).

A presented key is compared with every configured key in constant time (hmac.compare_digest,
no early exit), and no key is ever logged or put in an error."""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from pathlib import Path
from typing import Literal

Scope = Literal["read", "write"]
SCOPES: tuple[Scope, ...] = ("read", "write")
RECHECK_S = 1.0  # how often the key file's identity (mtime, size, inode) is looked at
SETTLE_S = 1.0  # a key file rewritten in place is applied once unchanged this long

log = logging.getLogger("snca.keys")


def parse_entries(text: str, where: str, lines: bool = False) -> list[tuple[Scope, str]]:
    """`SCOPE:KEY` entries of `text` (lines of a file with `lines`, else comma or whitespace
    separated); ValueError naming the entry's position (never the key) when one is wrong."""
    if lines:
        raw = [s.strip() for s in text.splitlines()]
        raw = [s if not s.startswith("#") else "" for s in raw]  # (a whole-line comment)
    else:
        raw = text.replace(",", " ").split()
    out: list[tuple[Scope, str]] = []
    for n, entry in enumerate(raw, 1):
        if not entry:
            continue
        scope, sep, key = entry.partition(":")
        scope = scope.strip().lower()
        key = key.strip()
        if not sep or scope not in SCOPES:
            raise ValueError(
                f"{where}: entry {n} is not SCOPE:KEY with SCOPE one of {', '.join(SCOPES)}"
            )
        if len(key) < 8 or any(c.isspace() for c in key):
            raise ValueError(f"{where}: entry {n}: a key has at least 8 characters, no spaces")
        out.append((scope, key))  # type: ignore[arg-type]
    return out


class KeyRing:
    """The keys in force and their scopes (see the module docstring)."""

    def __init__(
        self,
        fixed: list[tuple[Scope, str]],
        file: Path | None = None,
        protect_reads: bool | None = None,
    ):
        self._fixed = list(fixed)
        self._file = Path(file) if file is not None else None
        self._protect_reads = protect_reads
        self._lock = threading.Lock()
        self._from_file: list[tuple[Scope, str]] = []
        self._seen: tuple | None = None  # the file's (mtime_ns, size, inode) last read
        self._checked = 0.0
        self.reloads = 0  # times the file was (re)read successfully
        if self._file is not None:
            self._from_file = self._read_file()  # at start, an unreadable file is an error
            self.reloads = 1

    @classmethod
    def from_settings(cls, settings) -> KeyRing:
        fixed: list[tuple[Scope, str]] = []
        if settings.api_key is not None:
            fixed.append(("write", settings.api_key.get_secret_value()))
        if settings.api_keys is not None:
            fixed += parse_entries(settings.api_keys.get_secret_value(), "SNCA_API_KEYS")
        return cls(fixed, settings.api_keys_file, settings.protect_reads)

    # ------------------------------------------------------------------ the file
    def _identity(self) -> tuple:
        st = os.stat(self._file)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read_file(self) -> list[tuple[Scope, str]]:
        self._seen = self._identity()
        try:
            text = self._file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read SNCA_API_KEYS_FILE {self._file}: {e}") from None
        entries = parse_entries(text, f"SNCA_API_KEYS_FILE {self._file}", lines=True)
        if not entries:
            raise ValueError(f"SNCA_API_KEYS_FILE {self._file} holds no key")
        return entries

    def refresh(self) -> None:
        """Re-read the key file if it changed since it was last read (at most once a
        RECHECK_S); a file that cannot be used keeps the keys in force."""
        if self._file is None:
            return
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        with self._lock:
            if now - self._checked < RECHECK_S:
                return
            self._checked = now
            try:
                ident = self._identity()
                if ident == self._seen:
                    return
                same_inode = self._seen is not None and ident[2] == self._seen[2]
                if same_inode and time.time() - ident[0] / 1e9 < SETTLE_S:
                    self._checked = now - RECHECK_S + min(RECHECK_S, SETTLE_S / 4)  # soon
                    return  # rewritten in place just now: maybe not whole yet
                entries = self._read_file()
            except (OSError, ValueError) as e:
                log.warning("key file not reloaded, the keys in force stay: %s", e)
                return
            self._from_file = entries
            self.reloads += 1
            log.info(
                "key file reloaded",
                extra={"fields": {"file": str(self._file), "keys": len(entries)}},
            )

    # ------------------------------------------------------------------ questions
    def _entries(self) -> list[tuple[Scope, str]]:
        self.refresh()
        return self._fixed + self._from_file

    @property
    def enabled(self) -> bool:
        """Some key is configured: requests must present one where a route's level needs it."""
        return bool(self._entries())

    @property
    def reads_protected(self) -> bool:
        """Read routes need a key: SNCA_PROTECT_READS, or by default whenever a read key is
        configured (a read key that protects nothing would be a mistake)."""
        entries = self._entries()
        if not entries:
            return False
        if self._protect_reads is not None:
            return self._protect_reads
        return any(scope == "read" for scope, _ in entries)

    def scope(self, key: str | None) -> Scope | None:
        """What `key` may do (None: nothing), compared with every key in constant time."""
        given = (key or "").encode()
        found: Scope | None = None
        for scope, k in self._entries():
            if hmac.compare_digest(given, k.encode()) and key:
                found = "write" if (found == "write" or scope == "write") else scope
        return found

    def needs_key(self, level: str) -> bool:
        """Whether a route of `level` (public, read, private, write) needs a key now."""
        if level == "public" or not self.enabled:
            return False
        return level in ("write", "private") or self.reads_protected
