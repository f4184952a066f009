"""Every test here runs with one torch thread (tests/conftest.py's ``one_thread``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
