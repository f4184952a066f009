"""Every test here runs with one torch thread (tests/conftest.py's ``one_thread``): the
references these tests train in the pytest process (``train_reference``) are tiny, and
beside a launched bundle's ranks on the same cores torch's default of one thread per
core spins for its share: a 3-step reference of tiny_cpu took 31 s of CPU at 2 threads
against 1.5 s at one, on the 2-core machine CI runs on."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
