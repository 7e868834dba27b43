"""Labels as the gallery keeps them: one visible character at least, no control characters
or line breaks, bounded length, stored in Unicode NFC without surrounding whitespace. Every
entry point that takes a label checks it here (the HTTP routes answer LabelInvalid as a 422
`label_invalid` problem; `snca-gallery import` reports the file and skips it)."""

from __future__ import annotations

import re
import unicodedata

# A label: a visible character and no control characters (C0, DEL, C1) or line separators.
# OpenAPI publishes this as the form's `pattern` and the server checks the same expression
# (re.search, as JSON Schema validators do): the schema is exact.
_LABEL_CHAR = r"[^\x00-\x1f\x7f-\x9f\u2028\u2029]"
LABEL_PATTERN = rf"^{_LABEL_CHAR}*[^\s\x00-\x1f\x7f-\x9f\u2028\u2029]{_LABEL_CHAR}*$"
_LABEL = re.compile(LABEL_PATTERN)


class LabelInvalid(ValueError):
    """A label the gallery does not take; the message says why."""


def normalize_label(label: str) -> str:
    """The form every label is stored and looked up in: Unicode NFC ("é" typed as one code
    point or as e + combining accent is the same label), surrounding whitespace removed."""
    return unicodedata.normalize("NFC", label).strip()


def check_label(label: str, max_len: int) -> str:
    """A label as sent (limits as OpenAPI states them) -> as stored (normalize_label)."""
    if len(label) > max_len:
        raise LabelInvalid(f"label is {len(label)} characters; the limit is {max_len}")
    if not _LABEL.search(label):
        raise LabelInvalid(
            "label must have a visible character and no control characters or line breaks"
        )
    return normalize_label(label)
