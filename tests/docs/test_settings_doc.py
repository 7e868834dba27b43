"""The settings table documents exactly the service's settings: every `Settings` field
(service/config.py, environment SNCA_<NAME>) has a row, and every variable a row names is one
(a setting renamed or removed leaves no row behind; a new one cannot go undocumented)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAD = "**Settings** (environment, prefix `SNCA_`"


def settings_table() -> tuple[Path, list[str]]:
    """(the document, the first cells of its settings table's rows)."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        if HEAD in text:
            rows = []
            for line in text[text.index(HEAD) :].splitlines()[1:]:
                if rows and not line.startswith("|"):
                    break
                if line.startswith("| `"):
                    rows.append(line.split("|")[1])
            return doc, rows
    pytest.fail(f"no document has the settings table ({HEAD!r})")


def test_the_settings_table_names_exactly_the_settings():
    from service.config import Settings

    doc, rows = settings_table()
    documented = {v for cell in rows for v in re.findall(r"`(SNCA_[A-Z0-9_]+)`", cell)}
    fields = {f"SNCA_{name.upper()}" for name in Settings.model_fields}
    assert len(rows) > 20
    assert not fields - documented, f"undocumented in {doc.name}: {sorted(fields - documented)}"
    assert not documented - fields, f"{doc.name} documents no setting {sorted(documented - fields)}"
