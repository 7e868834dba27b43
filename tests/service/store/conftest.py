"""Fixtures of the store tests."""

import pytest

from ..galleries_fake import Place


@pytest.fixture(params=["sqlite", "postgresql"])
def place(request):
    """Galleries of fake models on one home store (tests/service/galleries_fake.py), on SQLite
    and a real PostgreSQL."""
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    p = Place(request.param, pg)
    yield p
    p.close()
