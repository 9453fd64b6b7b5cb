"""tests/vllm: what vLLM's engines leave behind is removed. vLLM's single-process engine
rendezvouses through a file store it names ``vllm_dist_<uuid>`` in the temporary directory
and never removes."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterator

import pytest


def _file_stores() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))


@pytest.fixture(scope="session", autouse=True)
def no_vllm_file_store_left() -> Iterator[None]:
    """Removes the file stores vLLM made during this session (the ones there before are
    someone else's)."""
    before = _file_stores()
    yield
    for path in _file_stores() - before:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
