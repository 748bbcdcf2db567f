"""Make tests/helpers.py importable from every test module; fixtures shared by the process tests."""

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import segments_left_by_dead_owners, shm_segments  # noqa: E402


@pytest.fixture
def no_shm_leaks():
    """The test ends with its processes gone and no segment of its stores left in /dev/shm."""
    before = shm_segments()
    yield
    for child in mp.active_children():
        child.kill()
        child.join(10)
    assert segments_left_by_dead_owners(before) == set(), "shared-memory segments leaked"
