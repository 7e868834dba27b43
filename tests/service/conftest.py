"""Fixtures the service tests share: the real Fashion-MNIST splits and a real PostgreSQL server
(helpers they share: tests/service/helpers.py)."""

import pytest

from embedding.datasets import load_raw


@pytest.fixture(scope="session")
def fmnist_test():
    return load_raw("fashion-mnist", "test")


@pytest.fixture(scope="session")
def fmnist_train():
    return load_raw("fashion-mnist", "train")


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (tests/service/pg.py), started once per test process."""
    from .pg import PostgresServer

    server = PostgresServer()
    yield server
    server.close()
