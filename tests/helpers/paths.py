"""Where the tests' files are: the repository, the tests, these helpers and the golden data."""

from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
REPO = TESTS.parent
DATA = TESTS / "data"
